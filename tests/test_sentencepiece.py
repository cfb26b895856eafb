"""A sentencepiece-only tokenizer folder (`spiece.model`, no tokenizer.json, as T5, ALBERT and XLNet checkpoints ship)
loads in the project's environment and tokenizes as sentencepiece does, loaded and as served."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from workbench.core.data import load_corpus
from workbench.models.errors import TokenizerNotFoundError
from workbench.models.loading import ModelSource, load_tokenizer
from workbench.serving.backend.text_input import TextEncoder
from workbench.serving.repository import encoder_json


@pytest.fixture(scope="module")
def spiece_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A T5 checkpoint's tokenizer files: `spiece.model` trained here on the corpus (T5's ids: pad 0, eos 1, unk 2),
    tokenizer_config.json and config.json, no tokenizer.json."""
    import sentencepiece

    root = tmp_path_factory.mktemp("spiece")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(load_corpus()), encoding="utf-8")
    folder = root / "t5"
    folder.mkdir()
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "spiece"), vocab_size=300, model_type="unigram",
        hard_vocab_limit=False, character_coverage=0.999, pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
    (folder / "spiece.vocab").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "T5Tokenizer"}), encoding="utf-8")
    (folder / "config.json").write_text(json.dumps({"model_type": "t5"}), encoding="utf-8")
    return folder


def test_a_sentencepiece_only_folder_gives_sentencepiece_ids_loaded_and_served(spiece_only: Path, tmp_path: Path):
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=str(spiece_only / "spiece.model"))
    texts = load_corpus()
    expected = [processor.encode(text) + [processor.eos_id()] for text in texts]  # T5's slow tokenizer: pieces, </s>
    assert processor.unk_id() in {i for ids in expected for i in ids}  # the corpus's rare characters are unknown

    tokenizer = load_tokenizer(ModelSource("local", str(spiece_only)))
    assert [tokenizer(text)["input_ids"] for text in texts] == expected
    served = tmp_path / "served"  # as the repository lays it out: the run's tokenizer, encoder.json where it is whole
    tokenizer.save_pretrained(served / "tokenizer")  # as export writes the run's tokenizer: tokenizer.json
    encoder = encoder_json(served / "tokenizer", max_length=4096)
    if encoder is not None:
        (served / "encoder.json").write_bytes(encoder)
    parts, _ = TextEncoder(served, 4096, ["input_ids", "attention_mask"]).encode(list(texts), [""] * len(texts))
    assert [part["input_ids"][0].tolist() for part in parts] == expected


def test_an_unreadable_sentencepiece_model_names_the_pinned_package(spiece_only: Path,
                                                                    monkeypatch: pytest.MonkeyPatch):
    """Without sentencepiece's protobuf code (sentencepiece missing, or its gencode newer than the installed protobuf)
    transformers reads spiece.model as a TikToken file; the refusal says why and which sentencepiece reads it."""
    import sentencepiece

    monkeypatch.delattr(sentencepiece, "sentencepiece_model_pb2", raising=False)
    monkeypatch.setitem(sys.modules, "sentencepiece.sentencepiece_model_pb2", None)  # its import then fails
    with pytest.raises(TokenizerNotFoundError) as refused:
        load_tokenizer(ModelSource("local", str(spiece_only)))
    assert refused.value.problem.startswith(f"{spiece_only / 'spiece.model'} is a sentencepiece model")
    assert refused.value.fix.startswith("install sentencepiece==0.2.2 (pip install -e '.[generation]')")
