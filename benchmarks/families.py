"""Random-weight sentence-transformers models of the encoder families users bring, for `benchmarks/graphs.py --model`:

    .venv/bin/python benchmarks/families.py [--out DIR] [--size base|tiny] [--families bert,roberta,...]

Each folder (DIR/<family>-<size>, default DIR outputs/families) holds a transformers encoder with random weights
(workbench.models.tiny.build_encoder, a tokenizer trained on the shipped corpus) wrapped as sentence-transformers
wraps it: Transformer (128 tokens) -> mean Pooling -> Normalize. `base`: 12 layers (DistilBERT 6), hidden 768,
12 heads, feed-forward 3072, BERT-base's shape; `tiny`: 2 layers, hidden 64. MiniLM needs no build: graphs.py
without --model runs the embedded all-MiniLM-L6-v2. Prints one folder per line; a folder already built is kept.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from workbench.core.errors import ConfigError
from workbench.interrupt import script_exit
from workbench.models.tiny import MAX_POSITIONS, build_encoder, tiny_families

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = tuple(tiny_families())  # every family models.families can build a tiny (or base-size) one of
# Base size at transformers' initializer std for every family: at the 0.2 the tiny DeBERTa-v2 gets (tiny.py), its
# 12 layers are chaotic (1e-6 of noise on the weights moved PyTorch's own outputs by 0.35, min cosine 0.994), and no
# graph can match a reference that unstable.
SIZES = {"base": {"layers": 12, "hidden": 768, "heads": 12, "intermediate": 3072, "initializer_range": 0.02},
         "tiny": {"layers": 2, "hidden": 64, "heads": 4, "intermediate": 256}}
LAYERS = {"distilbert": 6}  # DistilBERT-base halves BERT-base's depth


def build(family: str, size: str, dest: Path) -> Path:
    """`family` at `size` saved as a sentence-transformers model in `dest` (kept when it is already there)."""
    if (dest / "modules.json").is_file():
        return dest
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    shape = dict(SIZES[size])
    if size == "base":
        shape["layers"] = LAYERS.get(family, shape["layers"])
    with tempfile.TemporaryDirectory() as tmp:
        encoder = build_encoder(Path(tmp) / "encoder", family, **shape)
        transformer = Transformer(str(encoder), max_seq_length=MAX_POSITIONS)
        modules = [transformer, Pooling(transformer.get_embedding_dimension(), "mean"), Normalize()]
        SentenceTransformer(modules=modules, device="cpu").save(str(dest))
    return dest


def chosen(value: str) -> list[str]:
    families = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in families if name not in FAMILIES]
    if unknown or not families:
        raise ConfigError(f"--families {value!r} names {', '.join(unknown) or 'no family'}",
                          f"choose among {', '.join(FAMILIES)} (MiniLM is the embedded model: no build)")
    return families


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "families", help="where the folders go")
    parser.add_argument("--size", choices=sorted(SIZES), default="base")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated, from: " + ", ".join(FAMILIES))
    args = parser.parse_args()

    def run() -> None:
        for family in chosen(args.families):
            print(build(family, args.size, args.out / f"{family}-{args.size}"), flush=True)
    return script_exit(run, "folders already printed are complete")


if __name__ == "__main__":
    sys.exit(main())
