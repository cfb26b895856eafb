"""CTranslate2's encoder behind the runner interface: a BERT-family encoder converted by CTranslate2's transformers
converter into a folder (`convert_encoder`), run in float32 or int8 on the CPU or CUDA, its last hidden state pooled
as the model's sentence-transformers pipeline pools it. It runs what CTranslate2 converts (BERT, DistilBERT,
RoBERTa, XLM-RoBERTa encoders; not MPNet or DeBERTa) for feature extraction with mean or CLS pooling and no Dense
layer; anything else is refused with UnsupportedModelError."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from workbench.core.atomic import atomic_dir, temporary_dir
from workbench.core.errors import DependencyMissingError
from workbench.models.batches import Batch
from workbench.models.errors import UnsupportedModelError
from workbench.runners import FOLDER_METADATA, Device, Runner, RunnerClosedError, folder_metadata

if TYPE_CHECKING:
    from ctranslate2 import Encoder

RUNTIME = "ctranslate2"
COMPUTE_TYPES = {"fp32": "float32", "int8": "int8_float32"}
POOLINGS = ("mean", "cls")
OUTPUTS = ("token_embeddings", "sentence_embedding")
INSTALL = "pip install -e '.[generation]' (`make env` installs it with its default EXTRAS)"


def convert_encoder(model_dir: Path, dest: Path, pooling: str, normalize: bool, dense_layers: int = 0) -> Path:
    """The encoder in `model_dir` converted by CTranslate2 into the folder `dest` (written whole or not at all),
    with the pooling and normalization of its sentence-transformers pipeline written beside."""
    if pooling not in POOLINGS or dense_layers:
        raise UnsupportedModelError(f"the CTranslate2 runner pools by {' or '.join(POOLINGS)} with no Dense layer; "
                                    f"this model pools by {pooling!r} with {dense_layers} Dense layer(s)",
                                    "run this model with ONNX Runtime or OpenVINO")
    try:
        from ctranslate2.converters import TransformersConverter
    except ImportError as exc:
        raise DependencyMissingError(f"the CTranslate2 runner needs ctranslate2 ({exc})", INSTALL) from exc
    source = temporary_dir(dest)
    try:
        for item in model_dir.iterdir():
            (source / item.name).symlink_to(item.resolve())
        # The converter reads config.position_embedding_type, which transformers 5 no longer sets by default.
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        (source / "config.json").unlink()
        (source / "config.json").write_text(json.dumps({"position_embedding_type": "absolute", **config}))
        with atomic_dir(dest) as folder:
            try:
                TransformersConverter(str(source)).convert(str(folder), force=True)
            except (AssertionError, ValueError, KeyError, NotImplementedError) as exc:
                raise UnsupportedModelError(f"CTranslate2 cannot convert {model_dir}: {type(exc).__name__}: {exc}",
                                            "run this model with ONNX Runtime or OpenVINO") from exc
            metadata = {"runtime": RUNTIME, "pooling": pooling, "normalize": normalize}
            (folder / FOLDER_METADATA).write_text(json.dumps(metadata), encoding="utf-8")
    finally:
        shutil.rmtree(source, ignore_errors=True)  # the links only, never what they point at
    return dest


class Ct2EncoderRunner(Runner):
    """Runs a converted encoder folder with CTranslate2 (one `Encoder`, `threads` intra-op threads, 0: its default)
    in `precision` (fp32, or int8 weights with float32 compute); `close()` drops the encoder."""

    def __init__(self, name: str, path: Path, threads: int | None = None, precision: str = "fp32",
                 device: Device = "cpu") -> None:
        import ctranslate2

        self.name, self.path, self.precision, self.device = name, path, precision, device
        metadata = folder_metadata(path)
        self.pooling, self.normalize = str(metadata["pooling"]), bool(metadata["normalize"])
        self.encoder: Encoder | None = ctranslate2.Encoder(str(path), device=device,
                                                           compute_type=COMPUTE_TYPES[precision],
                                                           intra_threads=threads or 0)
        self.input_names, self.output_names = ("input_ids", "attention_mask"), OUTPUTS
        self.providers = [f"CTranslate2 {ctranslate2.__version__} {device} ({COMPUTE_TYPES[precision]})"]
        self.engine = f"CTranslate2 {name}"

    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        if self.encoder is None:
            raise RunnerClosedError(f"{self.name}: the CTranslate2 encoder of {self.path} is closed")
        ids, mask = batch.feed["input_ids"], batch.mask
        lengths = mask.sum(axis=1)
        output = self.encoder.forward_batch([row[:n].tolist() for row, n in zip(ids, lengths)])
        found = np.array(output.last_hidden_state, dtype=np.float32)
        hidden = np.zeros((ids.shape[0], ids.shape[1], found.shape[2]), np.float32)
        hidden[:, :found.shape[1]] = found
        weights = mask[..., None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9) \
            if self.pooling == "mean" else hidden[:, 0]
        if self.normalize:
            pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return {"token_embeddings": hidden, "sentence_embedding": pooled}

    def close(self) -> None:
        self.encoder = None
