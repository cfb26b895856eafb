from __future__ import annotations

import pytest

from workbench.core.config import RENAMED_SETTINGS, RunConfig
from workbench.core.errors import ConfigError, ShapeError
from workbench.models import footprint
from workbench.serving.flavor import Flavor
from workbench.serving.plan import instances_for


def test_defaults_describe_the_embedded_model():
    config = RunConfig()
    assert config.model == "sentence-transformers/all-MiniLM-L6-v2"
    assert config.exporter == "legacy" and config.attn_implementation == "eager"
    assert config.steps[:2] == ["export", "optimize"]
    assert config.model_slug == "all-MiniLM-L6-v2"
    # the task is read from the embedded package's own files, as from a local folder
    assert config.task_choice.reason.startswith("auto: a sentence-transformers SentenceTransformer (modules.json")


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: /models/x\nopset: 14\nbatch: {min: 1, opt: 4, max: 16}\n")
    config = RunConfig.load(path, ["opset=15", "batch.max=64", "precisions=[fp32, int8]",
                                   "optimize.int8.per_channel=false"])
    assert config.model == "/models/x"
    assert config.opset == 15
    assert (config.batch.min, config.batch.opt, config.batch.max) == (1, 4, 64)
    assert config.precisions == ["fp32", "int8"]
    assert config.optimize.int8.per_channel is False


def test_round_trip_through_papermill_parameters():
    config = RunConfig.load(None, ["tolerances.sentence_embedding.min_cosine=0.995",
                                "sequence.opt=32", "sequence.max=64"])
    again = RunConfig.from_dict(config.to_params())
    assert again == config
    assert again.tolerances["sentence_embedding"].min_cosine == 0.995


def test_each_model_instance_gets_its_share_of_the_cores():
    assert instances_for(2, None, Flavor.PYTHON_ORT, False, cores=8).threads == 4
    assert instances_for(16, None, Flavor.PYTHON_ORT, False, cores=8).threads == 1
    assert instances_for(2, 3, Flavor.PYTHON_ORT, False, cores=8).threads == 3


def test_auto_instances_overlap_tokenizing_with_inference_on_a_cpu_only():
    cpu = instances_for("auto", None, Flavor.PYTHON_ORT, False, cores=2)
    assert (cpu.count, cpu.threads) == (2, 1) and "tokenizes" in cpu.reason
    assert (instances_for("auto", None, Flavor.PYTHON_ORT, False, cores=1).count,
            instances_for("auto", None, Flavor.ONNXRUNTIME, True, cores=8).count) == (1, 1)
    base = instances_for("auto", None, Flavor.PYTHON_ORT, False, cores=2, model_bytes=436_000_000)
    assert (base.count, base.threads) == (1, 2) and "a second would add 3 sessions" in base.reason
    assert instances_for("auto", None, Flavor.PYTHON_ORT, False, cores=2, model_bytes=90_000_000).count == 2


def test_budgets_follow_the_model_where_auto():
    config = RunConfig()
    assert config.parity.repair.budget(2.0) == (180.0, "auto: at least 180 s (under 8 times the variant's 2.0 s "
                                                       "check on the lab)")
    assert config.parity.repair.budget(31.5) == (252.0, "auto: 8 times the variant's 31.5 s check on the lab")
    assert RunConfig.load(None, ["parity.repair.budget_s=90"]).parity.repair.budget(21.5)[0] == 90
    per_token = 16 * (12 * 384 + 3072 + 768)  # all-mpnet-base-v2 at 384 tokens: 135 KiB a token
    assert footprint.token_budget(config.batch, per_token, 384)[0] == 2**28 // per_token == 1985, "5 texts of 384"
    assert footprint.token_budget(config.batch, 16 * (16 * 8192 + 4096 + 1024), 8192)[0] == 8192, "one text at max"
    assert footprint.token_budget(config.batch, 16 * 1000, 128)[0] == 32 * 128, "never past batch.max texts"
    assert footprint.token_budget(RunConfig.load(None, ["batch.max_tokens=512"]).batch, per_token, 384) == (
        512, "configured (batch.max_tokens)")


def test_the_token_budget_shrinks_where_the_memory_limit_leaves_little_past_the_model(monkeypatch):
    from workbench.core import memory

    batch, per_token = RunConfig().batch, 16 * (12 * 384 + 3072 + 768)
    assert footprint.token_budget(batch, per_token, 384, room=8 * 2**30) == footprint.token_budget(batch, per_token,
                                                                                                  384)
    tokens, source = footprint.token_budget(batch, per_token, 384, room=2**29)
    assert tokens == 2**27 // per_token == 992 and "1/4 of the 0.5 GiB the memory limit leaves" in source
    assert footprint.token_budget(batch, per_token, 384, room=-2**30)[0] == 384, "one text at the max, whatever is left"
    monkeypatch.setattr(memory, "memory_limit", lambda: (6 * 2**30, "a cgroup"))
    assert footprint.activation_room(2**30) == 6 * 2**30 - footprint.step_need(2**30) == 1.375 * 2**30


def test_misspelled_key_names_the_closest_setting():
    with pytest.raises(ConfigError, match="unknown setting 'opest'.*did you mean 'opset'"):
        RunConfig.load(None, ["opest=17"])
    with pytest.raises(ConfigError, match="unknown setting 'batch.maxx' \\(did you mean 'batch.max'\\?\\)"):
        RunConfig.load(None, ["batch.maxx=4"])
    with pytest.raises(ConfigError, match="unknown setting 'triton.flavour' \\(did you mean 'triton.flavor'\\?\\)"):
        RunConfig.load(None, ["triton.flavour=auto"])
    with pytest.raises(ConfigError, match="unknown setting 'sequence_max' \\(did you mean 'sequence.max'\\?\\)"):
        RunConfig.load(None, ["sequence_max=128"])  # a notebook's name for it
    with pytest.raises(ConfigError, match="'parityy': did you mean 'parity'"):
        RunConfig.load(None, ["steps=[parityy]"])
    with pytest.raises(ConfigError, match="unknown setting 'bench.enabled'") as removed:
        RunConfig.load(None, ["bench.enabled=false"])
    assert "--steps report re-renders" in removed.value.fix


def test_a_bad_value_s_fix_lists_the_values_the_setting_takes():
    """A fresh-clone trial: `-p precisions=fp64` said only "set precisions to a valid value"."""
    with pytest.raises(ConfigError) as bad:
        RunConfig.load(None, ["precisions=fp64"])
    assert bad.value.fix == "set precisions to a valid value: a list of fp32, fp16, bf16, int8, or auto"
    with pytest.raises(ConfigError) as bad:
        RunConfig.load(None, ["target.cpu=foo"])
    assert bad.value.fix == "set target.cpu to a valid value: host, avx2, avx512, avx512_vnni, avx_vnni, amx"


def test_a_sequence_max_below_one_is_the_one_problem_named_where_opt_follows_it():
    """A fresh-user trial: `-p sequence.max=-3` blamed sequence.opt, never set, and offered sequence.max=1."""
    with pytest.raises(ShapeError) as bad:
        RunConfig.load(None, ["sequence.max=-3"]).sequence.resolve(256)
    assert bad.value.problem == "sequence.max=-3 is below 1" and bad.value.fix.endswith("e.g. -p sequence.max=128")
    with pytest.raises(ConfigError) as bad:
        RunConfig.load(None, ["steps=[export, ship]"])
    assert "`workbench steps` lists them; e.g. --steps export,optimize" in bad.value.fix


@pytest.mark.parametrize("override, message", [
    ("task=summarization", "unknown task 'summarization'"),
    ("steps=[export, ship]", "unknown steps \\['ship'\\]"),
    ("batch.opt=64", "min <= opt <= max"),
    ("exporter=jit", "exporter"),
    ("precisions=[fp8]",
     "configuration: precisions.0: Input should be 'fp32', 'fp16', 'bf16' or 'int8' \\(got 'fp8'\\)\n"),
    # the setting's path, not the union's inner types, nor the other alternative's "Input should be 'auto'"
    ("threads=0", "threads"),
    ("parity.repair.budget_s=.inf", "parity.repair.budget_s"),
    ("batch.max_tokens=0", "batch.max_tokens: must be at least 1 \\(or auto\\) \\(got 0\\)"),
    ("triton.instances=0", "triton.instances: must be at least 1 \\(or auto\\) \\(got 0\\)"),
    ("bench.batches=[8, 0]", "bench.batches.1: Input should be greater than or equal to 1 \\(got 0\\)"),
    ("generation.concurrency=[]", "generation.concurrency: List should have at least 1 item"),
    ("triton.http_port=99999", "triton.http_port: Input should be less than or equal to 65535"),
    ("parity.repair=maybe", "parity.repair is a section of settings \\(enabled, budget_s, max_builds\\), not one "
                            "value \\(got 'maybe'\\)(.|\\n)*-p parity.repair=true or false turns it on or off"),
    ("triton.flavor=onnxrt", "did you mean 'onnxruntime'(.|\\n)*valid value: onnxruntime, tensorrt_plan, python-ort, "
                             "or auto"),
])
def test_invalid_values_are_typed_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig.load(None, [override])


def test_steps_run_in_pipeline_order():
    assert RunConfig.load(None, ["steps=[optimize, export]"]).steps == ["export", "optimize"]


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not key=value"):
        RunConfig.load(None, ["opset"])
    with pytest.raises(ConfigError, match="does not exist"):
        RunConfig.load(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="not a mapping"):
        RunConfig.load(tmp_path / "list.yaml")


def test_a_tolerance_for_an_output_the_task_lacks_is_refused_with_the_closest_name():
    with pytest.raises(ConfigError, match="unknown outputs \\['sentence_embeding'\\] \\('sentence_embeding': did you "
                                          "mean 'sentence_embedding'\\?\\)"):
        RunConfig.load(overrides=["tolerances.sentence_embeding.min_cosine=0.999"])
    with pytest.raises(ConfigError, match="did you mean 'tolerances.sentence_embedding.min_recall_at_10'"):
        RunConfig.load(overrides=["tolerances.sentence_embedding.min_recal_at_10=0.9"])
    assert RunConfig.load(overrides=["tolerances.sentence_embedding.min_recall_at_10=0.9"]).tolerances[
        "sentence_embedding"].min_recall_at_10 == 0.9


def test_paths_given_from_the_working_directory_stay_right_in_the_notebooks(tmp_path, monkeypatch):
    """The step notebooks run in notebooks/: a relative model folder, corpus or output folder is made absolute from
    where the command ran; an HF id (nothing by that name here) stays as written."""
    (tmp_path / "models" / "mine").mkdir(parents=True)
    (tmp_path / "texts.txt").write_text("one\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    config = RunConfig.load(overrides=["model=models/mine", "corpus=texts.txt", "triton.repository_dir=repo",
                                       "generation.translation_model=Helsinki-NLP/opus-mt-en-de"])
    params = config.to_params()
    assert params["model"] == str(tmp_path / "models" / "mine") and params["corpus"] == str(tmp_path / "texts.txt")
    assert params["triton"]["repository_dir"] == str(tmp_path / "repo")
    assert params["generation"]["translation_model"] == "Helsinki-NLP/opus-mt-en-de"
    assert RunConfig().model == "sentence-transformers/all-MiniLM-L6-v2"


def test_a_configuration_is_made_without_importing_the_steps_first():
    """The registry registers the steps on first use: a script that imports the configuration alone works."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "from workbench.core.config import RunConfig; "
                           "print(','.join(RunConfig().steps))"], capture_output=True, text=True, check=True)
    assert done.stdout.startswith("export,optimize,parity")


def test_each_step_section_of_the_configuration_is_declared_by_its_step():
    """A step's own settings live under its name (`optimize.fp16.op_block_list`, `tensorrt.profiles`), and its
    SPEC names that section; no section is named after a step that does not declare it."""
    from workbench.core import registry

    config = RunConfig()
    declared = {spec.name: spec.settings for spec in registry.facts() if spec.settings}
    assert {name: type(getattr(config, name)) for name in config.sections()} == declared
    assert set(declared) == {"optimize", "parity", "tensorrt", "triton", "bench", "deploy", "generation"}
    assert not set(RunConfig.model_fields) & set(registry.step_names()), "the run-wide settings name no step"
    rooms = ("workbench.graphs", "workbench.measure", "workbench.precision", "workbench.serving")
    assert all(spec.settings.__module__.startswith((*rooms, f"workbench.steps.{spec.name}"))
               for spec in registry.facts() if spec.settings), "each lives with the step's code, none in core"


def test_settings_that_moved_into_their_steps_section_still_work_with_a_deprecation_line():
    moved = {"openvino": "always", "trt_profiles": 3, "repair": False, "fp16_op_block_list": ["Pow"],
             "int8_nodes_to_exclude": ["MatMul_1"], "reference_cache_dir": "/tmp/cache", "graph_form": "separate"}
    with pytest.warns(FutureWarning, match="setting 'openvino' is now 'optimize.openvino'"):
        config = RunConfig.model_validate(moved)
    assert config.optimize.openvino == "always" and config.optimize.graph_form == "separate"
    assert config.tensorrt.profiles == 3 and config.parity.repair.enabled is False
    assert config.optimize.fp16.op_block_list == ["Pow"] and config.optimize.int8.nodes_to_exclude == ["MatMul_1"]
    assert config.parity.reference_cache_dir == "/tmp/cache"
    with pytest.warns(FutureWarning, match="'repair_max_builds' is now 'parity.repair.max_builds'"):
        assert RunConfig.model_validate({"repair_max_builds": 7}).parity.repair.max_builds == 7
    with pytest.warns(FutureWarning):
        both = RunConfig.model_validate({"openvino": "never", "optimize": {"openvino": "always"}})
    assert both.optimize.openvino == "always", "a value set at both keys is the new key's"
    assert RunConfig.load(None, ["parity.repair=false"]).parity.repair.enabled is False


def test_the_deploy_steps_settings_left_the_triton_section_and_an_older_run_reads_no_change(tmp_path):
    """The image and autoscaler settings are deploy's own (`deploy.*`): a change to them leaves the verified triton
    step ok. The old keys (`triton.target_rps`) still load, nested in YAML or a run's configuration, and a triton step
    recorded with them reads no change."""
    from workbench.core.record import as_now, settings_changes, step_settings

    with pytest.warns(FutureWarning, match="'triton.target_rps' is now 'deploy.target_rps'"):
        assert RunConfig.load(None, ["triton.target_rps=400"]).deploy.target_rps == 400
    (tmp_path / "old.yaml").write_text("triton:\n  image_registry: registry.example.com/ml\n  instances: 2\n")
    with pytest.warns(FutureWarning):
        config = RunConfig.load(tmp_path / "old.yaml")
    assert config.deploy.image_registry == "registry.example.com/ml" and config.triton.instances == 2
    assert "target_rps" not in config.triton.model_dump()
    older = RunConfig().to_params()  # as a run recorded it before deploy had a section: those keys under triton
    moved = {old.split(".")[1]: new.split(".")[1] for old, new in RENAMED_SETTINGS.items() if new.startswith("deploy.")}
    older["triton"].update({old: older["deploy"].pop(new) for old, new in moved.items()})
    now = RunConfig().to_params()
    for step in ("triton", "deploy"):
        assert settings_changes(as_now(step_settings(older, step), step), step_settings(now, step)) == {}
    changed = RunConfig.load(None, ["deploy.target_rps=400"]).to_params()
    assert settings_changes(step_settings(now, "triton"), step_settings(changed, "triton")) == {}
    assert settings_changes(step_settings(now, "deploy"), step_settings(changed, "deploy")) == {
        "deploy.target_rps": (100.0, 400.0)}


def test_moved_settings_work_from_the_command_line_and_a_yaml_file(tmp_path):
    """`-p` and YAML start from the defaults, where every new key already has a value: an old key still wins."""
    with pytest.warns(FutureWarning, match="'openvino' is now 'optimize.openvino'"):
        config = RunConfig.load(None, ["openvino=never", "trt_profiles=3", "repair.budget_s=9",
                                       "fp16_op_block_list=[Add]"])
    assert config.optimize.openvino == "never" and config.tensorrt.profiles == 3
    assert config.parity.repair.budget_s == 9 and config.optimize.fp16.op_block_list == ["Add"]
    with pytest.warns(FutureWarning, match="'repair' is now 'parity.repair'"):
        assert RunConfig.load(None, ["repair=false"]).parity.repair.enabled is False
    for switch_first in (["parity.repair=false", "parity.repair.max_builds=5"],
                         ["parity.repair.max_builds=5", "parity.repair=false"]):
        repair = RunConfig.load(None, switch_first).parity.repair
        assert repair.enabled is False and repair.max_builds == 5, "the switch keeps the section's other keys"
    assert RunConfig.model_validate({"parity": {"repair": False}}).parity.repair.enabled is False
    path = tmp_path / "run.yaml"
    path.write_text("graph_form: fused\nrepair_max_builds: 5\nrepair: {budget_s: 30}\n")
    with pytest.warns(FutureWarning, match="'graph_form' is now 'optimize.graph_form'"):
        written = RunConfig.load(path)
    assert written.optimize.graph_form == "fused" and written.parity.repair.max_builds == 5
    assert written.parity.repair.budget_s == 30
    assert "openvino" not in RunConfig().to_params() and RunConfig().to_params()["optimize"]["openvino"] == "auto"


def test_a_run_written_with_moved_keys_resumes_without_warnings(tmp_path):
    """A record an older workbench wrote holds the old keys: the user never typed them, so resuming it takes them
    at their new place silently, while the same keys typed by a user still warn."""
    import json
    import warnings

    from workbench.core.record import RunRecord

    old = {"threads": 1, "openvino": "always", "repair": False, "trt_profiles": 3}
    (tmp_path / "run.json").write_text(json.dumps({"config": old, "steps": {}, "artifacts": {}, "metrics": {}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        resumed = RunRecord.load(tmp_path).config
        based = RunConfig.load(base=old, overrides=["threads=1"])
    for loaded in (resumed, based):
        assert loaded.optimize.openvino == "always" and loaded.parity.repair.enabled is False
        assert loaded.tensorrt.profiles == 3
    with pytest.warns(FutureWarning, match="'openvino' is now 'optimize.openvino'"):
        RunConfig.load(base=old, overrides=["openvino=never"])
