"""On an NVIDIA host: the CUDA provider is the one that really ran, and the workbench knows it."""
from __future__ import annotations

from onnx import TensorProto, helper

from workbench.runners.onnxruntime import CUDA, cuda_problem, providers_for, session


def test_cuda_is_the_provider_that_ran(tmp_path):
    assert cuda_problem() is None, cuda_problem()
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "g",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [64, 64]) for n in "ab"],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [64, 64])])
    path = tmp_path / "matmul.onnx"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    path.write_bytes(model.SerializeToString())
    created = session(path, providers_for("cuda"))
    assert created.get_providers()[0] == CUDA
