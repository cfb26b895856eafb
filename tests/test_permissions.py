"""Everything written atomically gets the modes ordinary files and folders get: the umask decides, not mkstemp."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from workbench.core.atomic import atomic_dir, atomic_path, write_json, write_text
from workbench.graphs import onnxfiles
from workbench.serving.repository import MARKER, write_models


@pytest.fixture(params=[(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)], ids=["umask022", "umask077"])
def modes(request) -> tuple[int, int]:
    """Sets the umask for the test (restored after it); yields the file and folder modes it should give."""
    mask, file_mode, dir_mode = request.param
    old = os.umask(mask)
    yield file_mode, dir_mode
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_atomic_files_follow_the_umask(modes, tmp_path):
    file_mode, dir_mode = modes
    text = write_text(tmp_path / "new" / "notes.txt", "x")
    data = write_json(tmp_path / "run.json", {"a": 1})
    script = write_text(tmp_path / "reproduce.sh", "#!/usr/bin/env bash\necho hi\n")
    with atomic_path(tmp_path / "blob.bin") as tmp:
        with open(tmp, "wb") as handle:
            handle.write(b"\0")
    assert [mode(p) for p in (text, data, tmp_path / "blob.bin")] == [file_mode] * 3
    assert mode(script) == dir_mode, "a script gets the executable bits the umask allows"
    assert mode(tmp_path / "new") == dir_mode


def test_rewriting_a_private_file_gives_it_the_usual_mode(modes, tmp_path):
    """A run.json left 0600 by an older version becomes what the umask says when it is written again."""
    file_mode, _ = modes
    old = tmp_path / "run.json"
    old.write_text("{}")
    old.chmod(0o600)
    assert mode(write_json(old, {"b": 2})) == file_mode


def test_atomic_dir_and_its_subfolders_follow_the_umask(modes, tmp_path):
    file_mode, dir_mode = modes
    dest = tmp_path / "model"
    for _ in range(2):  # new, then replacing the existing folder
        with atomic_dir(dest) as tmp:
            (tmp / "sub" / "deeper").mkdir(parents=True)
            (tmp / "sub" / "deeper" / "weights.bin").write_bytes(b"\0")
            write_text(tmp / "config.json", "{}")
        assert [mode(p) for p in (dest, dest / "sub", dest / "sub" / "deeper")] == [dir_mode] * 3
        assert [mode(p) for p in (dest / "sub" / "deeper" / "weights.bin", dest / "config.json")] == [file_mode] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_saved_onnx_follows_the_umask(modes, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    file_mode, dir_mode = modes
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    saved = onnxfiles.save(helper.make_model(graph), tmp_path / "onnx" / "fp32.onnx")
    onnx.checker.check_model(str(saved))
    assert (mode(saved), mode(saved.parent)) == (file_mode, dir_mode)


def test_a_repository_has_the_umask_modes_even_from_private_sources(modes, tmp_path):
    """Sources left 0600/0700 (by an older version, or by the user) do not make a repository the server's user
    cannot read: every file and folder in it gets the umask's mode."""
    file_mode, dir_mode = modes
    tokenizer = tmp_path / "tokenizer"
    (tokenizer / "sub").mkdir(parents=True)
    for path in (tokenizer / "vocab.txt", tokenizer / "sub" / "merges.txt", tmp_path / "model.py"):
        path.write_text("x")
        path.chmod(0o600)
    for folder in (tokenizer, tokenizer / "sub"):
        folder.chmod(0o700)
    models = {"m": (mc.ModelConfig(name="m", backend="python"),
                    {"model.py": tmp_path / "model.py", "tokenizer": tokenizer})}
    root = write_models(models, tmp_path / "repository")
    entries = [root, *root.rglob("*")]
    assert {str(p.relative_to(tmp_path)): mode(p) for p in entries} == {
        str(p.relative_to(tmp_path)): dir_mode if p.is_dir() else file_mode for p in entries}
    assert {p.name for p in entries} >= {MARKER, "config.pbtxt", "model.py", "vocab.txt", "merges.txt", "sub"}
