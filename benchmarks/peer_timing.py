"""Every graph of benchmarks/graphs.py timed in one process, interleaved: run by the OpenVINO environment's Python
(it holds OpenVINO and the same onnxruntime as the workbench's), with the workbench on PYTHONPATH:

    PYTHONPATH=<repository> <openvino venv>/bin/python benchmarks/peer_timing.py WORK_DIR

WORK_DIR/plan.json holds the model folder, the rows (GraphRow records), the threads and rounds; WORK_DIR/feeds.npz
the cells' feeds (`cell/<cell>/<input>`) and the corpus batches (`batch/<k>/<input>`). Writes WORK_DIR/timed.json
(the rows with their medians, what OpenVINO computed in, and any problem) and WORK_DIR/embeddings.npz (by row index:
each row's sentence embedding of every corpus text, computed after the timing; a per-token output pooled by the
model's own sentence-transformers modules, which this environment holds too).

The graphs of one precision class (fp32, bf16, int8) are open together and interleaved; each class's are closed
before the next opens. The ratios that matter compare graphs of one class, and a dozen base-size graphs resident at
once skewed them: RoBERTa-base's two OpenVINO fp32 graphs timed 1.08 apart at b1 s16 among all 13 of its graphs,
0.99 apart among 4 (issue #39). Each class also times one of its graphs twice, two copies opened apart (an A/A
control): how far apart they time is this run's noise, written to timed.json's "controls" by class.
"""
import json
import sys
from pathlib import Path

import numpy as np
from peerlib.graphs import GraphRow, control_spread, embeddings, open_control, open_graphs, outputs, time_graphs


def grouped(arrays: np.lib.npyio.NpzFile, kind: str) -> dict[str, dict[str, np.ndarray]]:
    found: dict[str, dict[str, np.ndarray]] = {}
    for key in arrays.files:
        group, name, tensor = key.split("/")
        if group == kind:
            found.setdefault(name, {})[tensor] = arrays[key]
    return found


def main(work_dir: str) -> None:
    work = Path(work_dir)
    plan = json.loads((work / "plan.json").read_text())
    rows = [GraphRow.from_record(data) for data in plan["rows"]]
    arrays = np.load(work / "feeds.npz")
    cells, batches = grouped(arrays, "cell"), grouped(arrays, "batch")
    from sentence_transformers import SentenceTransformer

    library = SentenceTransformer(plan["model"], device="cpu")
    ordered = [batches[str(k)] for k in range(len(batches))]
    found, controls = {}, {}
    for precision in dict.fromkeys(row.precision for row in rows):
        group = [row for row in rows if row.precision == precision]
        opened = open_graphs(group, plan["threads"])
        control = open_control(group, opened, plan["threads"])
        print(f"timing {len(opened)} {precision} graphs ({control or 'no graph'} twice, the A/A control), "
              f"{plan['rounds']} interleaved rounds per cell", flush=True)
        medians = time_graphs(group, opened, {cell: cells[cell] for cell in plan["cells"]}, plan["rounds"])
        if control:
            controls[precision] = {"graph": control, "spread": control_spread(medians, control)}
        for row in group:
            if row.name in opened:
                row.computed_in = opened[row.name].inference_precision
                found[str(rows.index(row))] = embeddings(row, outputs(opened[row.name], ordered), ordered, library)
        del opened
    np.savez(work / "embeddings.npz", **found)
    (work / "timed.json").write_text(json.dumps({"rows": [row.record() for row in rows], "controls": controls},
                                                indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
