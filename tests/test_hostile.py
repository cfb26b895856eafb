"""A hostile but fair user: copies, runs at once, full disks, killed parents, custom code, bad requests."""
from __future__ import annotations

import os
import shutil

from workbench.core.config import RunConfig
from workbench.core.record import RunRecord

from .test_verdicts import _consume, _produce


def test_a_copy_with_new_file_times_is_not_stale(tmp_path):
    record = RunRecord.create(tmp_path / "run", RunConfig())
    _produce(record, "first")
    _consume(record)
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "run", copy, copy_function=shutil.copy)  # `cp -r`: same bytes, new times
    onnx = copy / "onnx" / "original.onnx"
    os.utime(onnx, ns=(onnx.stat().st_atime_ns, onnx.stat().st_mtime_ns + 10**9))
    copied = RunRecord.load(copy)
    copied.mark("parity", "skipped", "not requested")  # any change to the record re-checks every input
    assert copied.status("optimize") == "ok"
    assert RunRecord.load(copy).data["artifacts"]["onnx.original"]["mtime_ns"] == onnx.stat().st_mtime_ns

    onnx.write_text("second")  # same size, other bytes
    copied = RunRecord.load(copy)
    copied.mark("parity", "skipped", "not requested")
    assert copied.status("optimize") == "stale"
    assert "onnx.original (the file export wrote changed)" in copied.data["steps"]["optimize"]["reason"]
