"""Session settings: what they set on ONNX Runtime, and the choice among measured candidates (given tables, no
timing)."""
import onnxruntime
import pytest

from workbench.measure.sessions import MIN_GAIN, candidates, choose
from workbench.runners.onnxruntime import SessionSettings


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


def test_candidates_start_with_the_default_cover_the_grid_once_and_never_spin():
    grid = candidates(2)
    assert grid[0] == SessionSettings(2)
    assert len(grid) == len(set(grid)) == 2 * 3 * 2
    assert {s.threads for s in grid} == {1, 2} and not any(s.spinning for s in grid)
    assert len(candidates(1)) == 3 * 2


def test_the_challenger_replaces_the_default_only_when_clearly_faster_head_to_head():
    default, single = SessionSettings(2), SessionSettings(1, optimization="basic")
    chosen, reason = choose(default, single, {default: 4.0, single: 3.2}, {default: 80.0, single: 79.0})
    assert chosen == single
    assert reason == "1.25x faster than the default head to head at the smallest cell, 1.01x at the largest " \
                     "(1 thread, spinning off, basic optimizations, sequential)"
    chosen, reason = choose(default, single, {default: 4.0, single: 4.0 / (MIN_GAIN - 0.01)},
                            {default: 80.0, single: 80.0})
    assert chosen == default and reason.endswith("was 1.04x the default head to head (needs 1.05x)")
    # faster on short calls, but one session serves every shape: half the threads lose the large cell
    chosen, reason = choose(default, single, {default: 4.0, single: 3.0}, {default: 80.0, single: 150.0})
    assert chosen == default and reason.endswith("1.33x the default at the smallest cell but 0.53x at the largest")
    assert choose(default, None, {default: 4.0}, {default: 80.0}) == (
        default, "the default was the fastest in the screen")


@pytest.mark.parametrize("level", ["all", "extended", "basic", "disabled"])
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
