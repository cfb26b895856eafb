"""OpenVINO's own files of a model; run by the OpenVINO environment's Python (benchmarks/graphs.py calls it), not
the workbench's:

    <openvino venv>/bin/python benchmarks/peer_openvino.py MODEL_DIR OUT_DIR CALIBRATION_NPZ

  fp32   the IR sentence-transformers exports (`SentenceTransformer(MODEL_DIR, backend="openvino")`, then
         `save_pretrained`: OUT_DIR/fp32/openvino/openvino_model.xml)
  int8   that IR after NNCF's post-training int8 (`ModelType.TRANSFORMER`), calibrated on every text of
         CALIBRATION_NPZ (arrays `text/<i>/<input>`, one unpadded text each): OUT_DIR/int8/openvino_model.xml
Writes OUT_DIR/status.json: per variant its IR and output name, or the problem that stopped it (an exporter that
refuses a family is a finding, not a crash); built once, kept for later runs.
"""
import json
import sys
import traceback
from pathlib import Path

import numpy as np

FILES = {"fp32": "fp32/openvino/openvino_model.xml", "int8": "int8/openvino_model.xml"}


def export_fp32(model_dir: str, out: Path) -> None:
    from sentence_transformers import SentenceTransformer

    SentenceTransformer(model_dir, backend="openvino", device="cpu").save_pretrained(str(out / "fp32"))


def quantize_int8(out: Path, calibration: str) -> None:
    import nncf
    import openvino

    model = openvino.Core().read_model(str(out / FILES["fp32"]))
    names = {port.get_any_name() for port in model.inputs}
    arrays = np.load(calibration)
    count = len({key.split("/")[1] for key in arrays.files})
    items = [{name: arrays[f"text/{i}/{name}"] for name in names} for i in range(count)]
    quantized = nncf.quantize(model, nncf.Dataset(items), model_type=nncf.ModelType.TRANSFORMER, subset_size=count)
    (out / "int8").mkdir(parents=True, exist_ok=True)
    openvino.save_model(quantized, str(out / FILES["int8"]), compress_to_fp16=False)


def built(out: Path, variant: str) -> dict[str, str]:
    import openvino

    path = out / FILES[variant]
    names = openvino.Core().read_model(str(path)).outputs[0].get_names()
    return {"path": str(path), "output": "last_hidden_state" if "last_hidden_state" in names else sorted(names)[0]}


def main(model_dir: str, out_dir: str, calibration: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    status_file = out / "status.json"
    status = json.loads(status_file.read_text()) if status_file.is_file() else {}
    steps = {"fp32": lambda: export_fp32(model_dir, out), "int8": lambda: quantize_int8(out, calibration)}
    for variant, step in steps.items():
        if Path(status.get(variant, {}).get("path", out / "none")).is_file():
            continue
        if variant != "fp32" and "path" not in status["fp32"]:
            status[variant] = {"problem": "no fp32 IR to quantize"}
            continue
        try:
            step()
            status[variant] = built(out, variant)
        except Exception as exc:  # any exporter's refusal of a family: recorded for the table, the rest goes on
            traceback.print_exc()
            status[variant] = {"problem": f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1]}"}
        status_file.write_text(json.dumps(status, indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:])
