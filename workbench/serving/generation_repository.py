"""Repositories for generation: tokenize -> generate (transformers or CTranslate2) -> detokenize, as ensembles.

Models (name = the plan's name):  <name>_tokenize, <name>_hf, <name>_ct2, <name>_detokenize (Python backend) and
the ensembles <name>_hf_text and <name>_ct2_text: TEXT (+ TARGET_LANG, MAX_NEW_TOKENS) in; OUTPUT_TEXT, OUTPUT_IDS
and OUTPUT_LENGTHS out. Every config is a ModelConfig protobuf, parsed back before it is written.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tritonclient.grpc import model_config_pb2 as mc

from workbench.serving.repository import INT64, MODELS_SOURCE, STRING, add_tensor

if TYPE_CHECKING:
    from workbench.serving.repository import Tensors

INT32 = mc.TYPE_INT32
ENGINES = ("hf", "ct2")


@dataclass
class GenerationPlan:
    name: str
    kind: str  # "seq2seq" or "decoder"
    hf_dir: Path
    ct2_dir: Path
    max_input_tokens: int
    max_new_tokens: int
    max_new_tokens_limit: int
    max_batch_size: int
    compute_type: str = "float32"
    threads: int = 0
    max_queue_delay_us: int = 0


def _python(name: str, plan: GenerationPlan) -> mc.ModelConfig:
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=plan.max_batch_size)
    config.dynamic_batching.max_queue_delay_microseconds = plan.max_queue_delay_us
    config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    return config


def _optional(message: Tensors, name: str, data_type: int) -> None:
    message.add(name=name, data_type=data_type, dims=[1], optional=True)


def tokenize_config(plan: GenerationPlan) -> mc.ModelConfig:
    config = _python(f"{plan.name}_tokenize", plan)
    add_tensor(config.input, "TEXT", STRING, [1])
    _optional(config.input, "TARGET_LANG", STRING)
    add_tensor(config.output, "INPUT_IDS", INT64, [-1])
    add_tensor(config.output, "INPUT_LENGTHS", INT64, [1])
    config.parameters["max_input_tokens"].string_value = str(plan.max_input_tokens)
    return config


def generator_config(plan: GenerationPlan, engine: str) -> mc.ModelConfig:
    config = _python(f"{plan.name}_{engine}", plan)
    add_tensor(config.input, "INPUT_IDS", INT64, [-1], ragged=True)
    add_tensor(config.input, "INPUT_LENGTHS", INT64, [1])
    _optional(config.input, "MAX_NEW_TOKENS", INT32)
    _optional(config.input, "TARGET_LANG", STRING)
    add_tensor(config.output, "OUTPUT_IDS", INT64, [-1])
    add_tensor(config.output, "OUTPUT_LENGTHS", INT64, [1])
    for key, value in {"kind": plan.kind, "engine": engine, "max_new_tokens": plan.max_new_tokens,
                       "max_new_tokens_limit": plan.max_new_tokens_limit, "compute_type": plan.compute_type,
                       "threads": plan.threads}.items():
        config.parameters[key].string_value = str(value)
    return config


def detokenize_config(plan: GenerationPlan) -> mc.ModelConfig:
    config = _python(f"{plan.name}_detokenize", plan)
    add_tensor(config.input, "OUTPUT_IDS", INT64, [-1], ragged=True)
    add_tensor(config.input, "OUTPUT_LENGTHS", INT64, [1])
    add_tensor(config.output, "OUTPUT_TEXT", STRING, [1])
    return config


def text_ensemble(plan: GenerationPlan, engine: str) -> mc.ModelConfig:
    config = mc.ModelConfig(name=f"{plan.name}_{engine}_text", platform="ensemble",
                            max_batch_size=plan.max_batch_size)
    add_tensor(config.input, "TEXT", STRING, [1])
    _optional(config.input, "TARGET_LANG", STRING)
    _optional(config.input, "MAX_NEW_TOKENS", INT32)
    for name, data_type in (("OUTPUT_TEXT", STRING), ("OUTPUT_IDS", INT64), ("OUTPUT_LENGTHS", INT64)):
        add_tensor(config.output, name, data_type, [-1] if name == "OUTPUT_IDS" else [1])
    steps = config.ensemble_scheduling.step
    tokenize = steps.add(model_name=f"{plan.name}_tokenize", model_version=-1)
    tokenize.input_map.update({"TEXT": "TEXT", "TARGET_LANG": "TARGET_LANG"})
    tokenize.output_map.update({"INPUT_IDS": "INPUT_IDS", "INPUT_LENGTHS": "INPUT_LENGTHS"})
    generate = steps.add(model_name=f"{plan.name}_{engine}", model_version=-1)
    generate.input_map.update({n: n for n in ("INPUT_IDS", "INPUT_LENGTHS", "MAX_NEW_TOKENS", "TARGET_LANG")})
    generate.output_map.update({"OUTPUT_IDS": "OUTPUT_IDS", "OUTPUT_LENGTHS": "OUTPUT_LENGTHS"})
    detokenize = steps.add(model_name=f"{plan.name}_detokenize", model_version=-1)
    detokenize.input_map.update({"OUTPUT_IDS": "OUTPUT_IDS", "OUTPUT_LENGTHS": "OUTPUT_LENGTHS"})
    detokenize.output_map["OUTPUT_TEXT"] = "OUTPUT_TEXT"
    return config


def generation_models(plan: GenerationPlan) -> dict[str, tuple[mc.ModelConfig, dict[str, Path]]]:
    """Configs and version-folder files of every model (the input for repository.write_models)."""
    core = {"generation_core.py": MODELS_SOURCE / "generation_core.py"}
    tokenizer = {"tokenizer": plan.ct2_dir / "tokenizer"}
    models = {
        f"{plan.name}_tokenize": (tokenize_config(plan), {
            "model.py": MODELS_SOURCE / "gen_tokenize.py", "text_input.py": MODELS_SOURCE / "text_input.py",
            **core, **tokenizer}),
        f"{plan.name}_detokenize": (detokenize_config(plan), {
            "model.py": MODELS_SOURCE / "gen_detokenize.py", **core, **tokenizer}),
    }
    for engine in ENGINES:
        weights = {"hf": plan.hf_dir} if engine == "hf" else {"ct2": plan.ct2_dir}
        models[f"{plan.name}_{engine}"] = (generator_config(plan, engine), {
            "model.py": MODELS_SOURCE / "generator.py", "gen_tokenize.py": MODELS_SOURCE / "gen_tokenize.py",
            "text_input.py": MODELS_SOURCE / "text_input.py", **core, **tokenizer, **weights})
        models[f"{plan.name}_{engine}_text"] = (text_ensemble(plan, engine), {})
    return models
