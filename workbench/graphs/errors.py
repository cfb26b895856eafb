"""Typed errors of ONNX graphs: an export that cannot be made, an unreadable file."""
from __future__ import annotations

from workbench.core.errors import WorkbenchError


class OnnxModelError(WorkbenchError):
    """An ONNX file is missing, corrupt or not what a step expects."""


class ExportError(OnnxModelError):
    """torch.onnx cannot export the model with these settings (an operator unsupported at the opset, ...)."""


class OpsetError(WorkbenchError):
    """The ONNX opset is outside what the exporter supports."""
