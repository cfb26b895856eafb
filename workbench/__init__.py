"""Transformer optimization workbench: PyTorch -> ONNX -> ONNX Runtime / TensorRT -> Triton, verified."""

__version__ = "0.1.0"
