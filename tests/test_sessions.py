"""Session settings: what they set on ONNX Runtime, and the choice among measured candidates (given tables, no
timing)."""
import onnxruntime
import pytest

from workbench.sessions import MIN_GAIN, SessionSettings, candidates, choose


def test_settings_are_what_the_session_options_say():
    options = onnxruntime.SessionOptions()
    SessionSettings(1, spinning=True, optimization="basic", execution="parallel").apply(options)
    assert options.intra_op_num_threads == 1 and options.inter_op_num_threads == 1
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert options.graph_optimization_level == onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert options.execution_mode == onnxruntime.ExecutionMode.ORT_PARALLEL
    default = onnxruntime.SessionOptions()
    SessionSettings().apply(default)
    assert default.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert default.graph_optimization_level == onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert default.execution_mode == onnxruntime.ExecutionMode.ORT_SEQUENTIAL


def test_candidates_start_with_the_default_and_cover_the_grid_once():
    grid = candidates(2)
    assert grid[0] == SessionSettings(2)
    assert len(grid) == len(set(grid)) == 2 * 2 * 3 * 2
    assert {s.threads for s in grid} == {1, 2}
    assert len(candidates(1)) == 2 * 3 * 2


def test_a_setting_replaces_the_default_only_when_clearly_faster_and_never_spins():
    default, spinning, single = SessionSettings(2), SessionSettings(2, spinning=True), SessionSettings(1)
    chosen, reason = choose({default: 4.0, spinning: 2.0, single: 3.2}, default)
    assert chosen == single and reason == "1.25x faster than the default (1 threads, spinning off, all " \
                                          "optimizations, sequential)"
    close = 4.0 / (MIN_GAIN - 0.01)
    chosen, reason = choose({default: 4.0, spinning: 1.0, single: close}, default)
    assert chosen == default and "no setting beat the default by 1.05x (best 1.04x)" == reason
    chosen, _ = choose({default: 3.0, single: 3.0}, default)
    assert chosen == default  # a tie keeps the default


@pytest.mark.parametrize("level", ["all", "extended", "basic"])
def test_every_optimization_level_loads_a_real_graph(level, tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    path = tmp_path / "relu.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                       ir_version=9).SerializeToString())
    import numpy as np

    from workbench.runners.onnxruntime import session

    created = session(path, ["CPUExecutionProvider"], settings=SessionSettings(1, optimization=level))
    assert created.run(None, {"x": np.array([-1.0, 2.0], dtype=np.float32)})[0].tolist() == [0.0, 2.0]
