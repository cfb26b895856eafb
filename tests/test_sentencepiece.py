"""A sentencepiece-only tokenizer folder (`spiece.model`, no tokenizer.json, as T5, ALBERT and XLNet checkpoints ship)
loads in the project's environment and tokenizes as sentencepiece does, loaded and as served."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from workbench.core.data import load_corpus
from workbench.core.errors import TokenizerNotFoundError
from workbench.models.loading import ModelSource, load_tokenizer
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
    from tokenizers import Tokenizer

    processor = sentencepiece.SentencePieceProcessor(model_file=str(spiece_only / "spiece.model"))
    texts = load_corpus()
    expected = [processor.encode(text) + [processor.eos_id()] for text in texts]  # T5's slow tokenizer: pieces, </s>
    assert processor.unk_id() in {i for ids in expected for i in ids}  # the corpus's rare characters are unknown

    tokenizer = load_tokenizer(ModelSource("local", str(spiece_only)))
    assert [tokenizer(text)["input_ids"] for text in texts] == expected
    tokenizer.save_pretrained(tmp_path)  # as export writes the run's tokenizer: tokenizer.json, what Triton serves
    served = Tokenizer.from_str(encoder_json(tmp_path, max_length=4096).decode("utf-8"))
    assert [encoding.ids for encoding in served.encode_batch(list(texts))] == expected


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
