"""Optimum's own ONNX files for the infinity-emb peer; run by the peer environment's Python (benchmarks/peers.py
calls it), not the workbench's:

    <peer venv>/bin/python benchmarks/peer_optimum.py MODEL_DIR OUT_DIR avx512_vnni|avx2

OUT_DIR/fp32 gets `optimum-cli export onnx --optimize O2` (model.onnx, the tokenizer, the config); OUT_DIR/int8 the
same graph after Optimum's dynamic int8 preset for the host, per channel (model_quantized.onnx). Optimum's quantizer
cannot type the O2 graph's fused weights by itself ("Unable to find data type for weight_name"), so ONNX Runtime's
quantizer is handed `DefaultTensorType=FLOAT`, as the workbench's own int8 is.
"""
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import optimum.onnxruntime.quantization as quantization
from optimum.onnxruntime import ORTQuantizer
from optimum.onnxruntime.configuration import AutoQuantizationConfig


class FloatDefaultQuantizer(quantization.ONNXQuantizer):
    def __init__(self, *args, extra_options=None, **kwargs):
        extra = {**(extra_options or {}), "DefaultTensorType": onnx.TensorProto.FLOAT}
        super().__init__(*args, extra_options=extra, **kwargs)


def main(model_dir: str, out_dir: str, preset: str) -> None:
    fp32, int8 = Path(out_dir) / "fp32", Path(out_dir) / "int8"
    subprocess.run([str(Path(sys.executable).parent / "optimum-cli"), "export", "onnx", "--model", model_dir,
                    "--task", "feature-extraction", "--optimize", "O2", str(fp32)], check=True)
    quantization.ONNXQuantizer = FloatDefaultQuantizer
    config = getattr(AutoQuantizationConfig, preset)(is_static=False, per_channel=True)
    ORTQuantizer.from_pretrained(fp32, file_name="model.onnx").quantize(config, int8)
    for path in fp32.iterdir():  # the tokenizer and config beside the quantized file
        if path.suffix != ".onnx" and not (int8 / path.name).exists():
            shutil.copy(path, int8 / path.name)


if __name__ == "__main__":
    main(*sys.argv[1:])
