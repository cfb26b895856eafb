"""Optimum's own ONNX files of a model; run by the peer environment's Python (benchmarks/peers.py and
benchmarks/graphs.py call it), not the workbench's:

    <peer venv>/bin/python benchmarks/peer_optimum.py [--task TASK] MODEL_DIR OUT_DIR avx512_vnni|avx2 [VARIANT ...]

TASK is optimum-cli's (default feature-extraction; text-classification for a cross-encoder).

Each VARIANT is a folder of OUT_DIR holding the graph, the tokenizer and the config (default: fp32 int8):
  plain             `optimum-cli export onnx` without --optimize (model.onnx)
  fp32 / O3         the same with `--optimize O2` / `--optimize O3` (O3: O2 with the GELU approximation)
  int8 / int8_per_tensor
                    the O2 graph after Optimum's dynamic int8 preset for the host, per channel / per tensor
                    (model_quantized.onnx)
OUT_DIR/status.json says, per variant, its file ({"path": ...}) or why it was not built ({"problem": ...}): one
variant Optimum fails on (its O2 optimizer crashes on some families) leaves no folder and does not stop the others.
Optimum's quantizer cannot type the O2 graph's fused weights by itself ("Unable to find data type for
weight_name"), so ONNX Runtime's quantizer is handed `DefaultTensorType=FLOAT`, as the workbench's own int8 is.
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

EXPORTS = {"plain": [], "fp32": ["--optimize", "O2"], "O3": ["--optimize", "O3"]}
QUANTIZED = {"int8": True, "int8_per_tensor": False}  # per channel or not
FILES = {**dict.fromkeys(EXPORTS, "model.onnx"), **dict.fromkeys(QUANTIZED, "model_quantized.onnx")}


def export(model_dir: str, dest: Path, options: list[str], task: str) -> None:
    done = subprocess.run([str(Path(sys.executable).parent / "optimum-cli"), "export", "onnx", "--model", model_dir,
                           "--task", task, *options, str(dest)], capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        raise RuntimeError(f"optimum-cli export onnx {' '.join(options)} failed (exit {done.returncode}): "
                           f"{lines[-1] if lines else 'no message'}")


def quantize(fp32: Path, dest: Path, preset: str, per_channel: bool) -> None:
    import onnx
    import optimum.onnxruntime.quantization as quantization
    from optimum.onnxruntime import ORTQuantizer
    from optimum.onnxruntime.configuration import AutoQuantizationConfig

    class FloatDefaultQuantizer(quantization.ONNXQuantizer):
        def __init__(self, *args, extra_options=None, **kwargs):
            extra = {**(extra_options or {}), "DefaultTensorType": onnx.TensorProto.FLOAT}
            super().__init__(*args, extra_options=extra, **kwargs)

    quantization.ONNXQuantizer = FloatDefaultQuantizer
    config = getattr(AutoQuantizationConfig, preset)(is_static=False, per_channel=per_channel)
    ORTQuantizer.from_pretrained(fp32, file_name="model.onnx").quantize(config, dest)
    for path in fp32.iterdir():  # the tokenizer and config beside the quantized file
        if path.is_file() and path.suffix != ".onnx" and not (dest / path.name).exists():
            shutil.copy(path, dest / path.name)


def main(model_dir: str, out_dir: str, preset: str, *variants: str, task: str = "feature-extraction") -> None:
    out = Path(out_dir)
    wanted = variants or ("fp32", "int8")
    unknown = set(wanted) - set(EXPORTS) - set(QUANTIZED)
    if unknown:
        sys.exit(f"unknown variants {sorted(unknown)}: choose from {sorted({*EXPORTS, *QUANTIZED})}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "status.json").unlink(missing_ok=True)
    needed = {*(v for v in wanted if v in EXPORTS), *(["fp32"] if set(wanted) & set(QUANTIZED) else [])}
    status = {}
    for name in sorted(needed):
        status[name] = built(out / name, lambda: export(model_dir, out / name, EXPORTS[name], task))
    for name in (v for v in wanted if v in QUANTIZED):
        source = status["fp32"].get("problem")
        status[name] = {"problem": f"needs Optimum's O2 graph, not built: {source}"} if source else built(
            out / name, lambda: quantize(out / "fp32", out / name, preset, QUANTIZED[name]))
    (out / "status.json").write_text(json.dumps({name: status[name] for name in wanted}, indent=2))


def built(folder: Path, build) -> dict[str, str]:
    """The variant in `folder`, built unless its file is there: its path, or the problem that stopped it (the
    folder removed)."""
    path = folder / FILES[folder.name]
    if not path.is_file():
        try:
            build()
        except Exception as exc:  # noqa: BLE001 - whatever Optimum raises is this variant's row
            shutil.rmtree(folder, ignore_errors=True)
            lines = str(exc).strip().splitlines() or [""]
            return {"problem": f"{type(exc).__name__}: {lines[-1]}"}
    return {"path": str(path)}


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if arguments[:1] == ["--task"]:
        main(*arguments[2:], task=arguments[1])
    else:
        main(*arguments)
