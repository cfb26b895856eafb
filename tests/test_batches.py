from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from workbench.core.config import RunConfig, ShapeRange
from workbench.core.data import load_corpus
from workbench.core.errors import ShapeError
from workbench.models.batches import Cell, corner_batches, corpus_batches, token_lengths
from workbench.models.loading import load_model
from workbench.precision.lab import ParityLab
from workbench.serving.settings import lab_settings

NAMES = ("input_ids", "attention_mask", "token_type_ids")


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return AutoTokenizer.from_pretrained(tiny_models["bert"])


def test_corners_have_exact_shapes_and_real_text(tokenizer):
    texts = list(load_corpus())
    batches = corner_batches(tokenizer, NAMES, texts, ShapeRange(min=1, opt=4, max=8),
                             ShapeRange(min=1, opt=32, max=64))
    shortest = int(token_lengths(tokenizer, texts).min())
    shapes = {b.name: b.shape for b in batches}
    for rows in (1, 4, 8):
        for length in (shortest, 32, 64):
            assert shapes[f"b{rows}_s{length}"] == (rows, length)
    assert {"mixed_b4", "mixed_b8"} <= set(shapes)
    for batch in batches:
        ids, mask = batch.feed["input_ids"], batch.mask
        assert len(set(ids[:, 1].tolist())) > 1 or batch.shape[0] == 1, "rows hold different texts"
        assert (np.diff(mask, axis=1) <= 0).all(), "right padding only"
        assert (mask[:, 0] == 1).all()
    long_corner = next(b for b in batches if b.name == "b8_s64")
    assert long_corner.mask.all(), "long corners are filled with texts at least that long"


def test_sequence_beyond_the_model_limit_is_a_shape_error(tiny_models):
    config = RunConfig.model_validate({"model": str(tiny_models["bert"]), "sequence": {"max": 200}})
    with pytest.raises(ShapeError, match=r"sequence.max=200 exceeds the model's limit of 128 tokens \(its "
                                         r"tokenizer's model_max_length 128\)"):
        load_model(config)


def test_corpus_batches_cover_every_text_once(tokenizer):
    texts = list(load_corpus())
    batches = corpus_batches(tokenizer, NAMES, texts, 16, 128)
    assert sorted(i for b in batches for i in b.text_ids) == list(range(len(texts)))
    assert len(texts) >= 300
    assert max(b.shape[1] for b in batches) == 128
    widths = [b.shape[1] for b in batches]
    assert widths == sorted(widths), "batched by length, as a server groups texts: little padding"
    padded = sum(b.mask.size for b in batches) / sum(b.mask.sum() for b in batches)
    assert padded < 1.1


@pytest.mark.parametrize("limit", [64, 96])
def test_whole_corpus_sweep_respects_sequence_max(tiny_models, limit):
    """The parity lab's sweep cuts long texts at the configured sequence.max, not at the model's 128."""
    config = RunConfig.model_validate({"model": str(tiny_models["bert"]),
                                       "batch": {"min": 1, "opt": 4, "max": 8},
                                       "sequence": {"min": 1, "opt": 32, "max": limit}})
    loaded = load_model(config)
    texts = load_corpus()
    lab = ParityLab.build(lab_settings(config), loaded, texts)
    assert loaded.max_sequence == 128 and (token_lengths(loaded.tokenizer, list(texts)) > limit).sum() > 10
    assert sorted(i for b in lab.sweep for i in b.text_ids) == list(range(len(texts)))
    assert max(b.shape[1] for b in lab.batches) == limit


def test_a_cell_names_itself_in_run_json_and_in_text():
    cell = Cell(8, 128)
    assert (cell.key, cell.label) == ("b8_s128", "b8 s128")
    assert Cell.parse("b8_s128") == cell and Cell.parse("mixed_b8") is None and Cell.parse("b8_s128x") is None
