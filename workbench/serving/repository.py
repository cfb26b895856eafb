"""Model repositories, every config.pbtxt built as a ModelConfig protobuf and parsed back before anything is written.
Two layouts: `ensemble` (tokenizer -> model (-> postprocess) models behind an ensemble; any backend) and `fused`
(one Python model tokenizing, running ONNX Runtime and labelling in one `execute`; the python-ort flavor)."""
from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from workbench.core.atomic import atomic_dir, sha256_file, write_text
from workbench.core.data import lowercase_inputs
from workbench.graphs import onnxfiles
from workbench.runners.registry import runner_kind
from workbench.serving.errors import RepositoryError
from workbench.serving.flavor import Flavor
from workbench.tasks.registry import SPARSE_INDICES, SPARSE_VALUES, OutputSpec

if TYPE_CHECKING:
    from google.protobuf.internal.containers import RepeatedCompositeFieldContainer as Repeated

    Tensors = Repeated[mc.ModelInput] | Repeated[mc.ModelOutput]  # a config's inputs or outputs

MODELS_SOURCE = Path(__file__).parent / "backend"
MARKER = ".workbench.json"
LAYOUTS = ("ensemble", "fused")
INT64, FP32, STRING, BOOL = mc.TYPE_INT64, mc.TYPE_FP32, mc.TYPE_STRING, mc.TYPE_BOOL


@dataclass
class ServingPlan:
    """Everything the repository needs to know, resolved from the run configuration and record."""

    name: str
    flavor: Flavor
    input_names: tuple[str, ...]
    outputs: tuple[OutputSpec, ...]
    output_dims: dict[str, list[int]]  # per output, its dims after the batch axis as the graph declares them
    model_file: Path
    tokenizer_dir: Path
    max_length: int
    max_batch_size: int
    preferred_batch_sizes: list[int]
    max_queue_delay_us: int
    dynamic_batching: bool = True
    instances: int = 1
    instances_reason: str = ""
    gpu: bool = False
    gpu_accelerator: str = "none"
    fp16: bool = False
    pad_to: list[int] = field(default_factory=list)
    profiles: int = 1
    pad_token_id: int = 0
    threads: int = 0
    id2label: dict[str, str] = field(default_factory=dict)
    activation: str = "softmax"  # a classifier's head, as its pipeline applies it (tasks.registry.head_activation)
    layout: str = "ensemble"
    prompts: dict[str, str] = field(default_factory=dict)  # sentence-transformers prompts, by name
    default_prompt_name: str | None = None
    lowercase: bool = False  # the model's sentence-transformers files lowercase its input (do_lower_case)
    max_documents: int = 256  # rerankers: documents one request may score
    max_texts: int = 256  # texts (reranker queries) one request may send
    max_text_chars: int = 100_000  # characters one text may have
    max_tokens: int = 0  # padded tokens one batch the model runs may hold (batch.max_tokens; 0: unbounded)
    max_request_tokens: int = 0  # tokens one request may hold (triton.max_request_tokens; 0: unbounded)

    def record(self) -> dict[str, Any]:
        """The plan as run.json holds it (its files are the run's artifacts, named apart)."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("model_file", "tokenizer_dir")}
        return {**data, "flavor": self.flavor.value, "outputs": [asdict(o) for o in self.outputs]}

    @classmethod
    def from_record(cls, data: dict[str, Any], model_file: Path, tokenizer_dir: Path) -> ServingPlan:
        """The plan `record()` wrote, with the run's files."""
        outputs = tuple(OutputSpec(o["name"], tuple(o["axes"]), o["kind"]) for o in data["outputs"])
        return cls(**{**data, "flavor": Flavor(data["flavor"]), "outputs": outputs, "input_names": tuple(
            data["input_names"]), "model_file": model_file, "tokenizer_dir": tokenizer_dir})

    @property
    def runtime(self) -> str:
        """What runs the model file in the Python model: "openvino" for the OpenVINO variant, else "onnxruntime"
        (a TensorRT plan's engine: "tensorrt")."""
        if self.flavor is Flavor.TENSORRT_PLAN:
            return "tensorrt"
        return runner_kind(self.model_file).runtime

    @property
    def classifies(self) -> bool:
        return any(o.kind in ("logits", "token_logits") for o in self.outputs) and not self.reranks

    @property
    def sparse(self) -> bool:
        """A sparse encoder: each text's active terms served beside its dense row (`sparse_terms.py`)."""
        return any(o.kind == "sparse" for o in self.outputs)

    @property
    def reranks(self) -> bool:
        """A cross-encoder: a query and its documents in, their scores out (`rerank_config`)."""
        return any(o.kind == "scores" for o in self.outputs)

    @property
    def tokenizer_name(self) -> str:
        return f"{self.name}_tokenizer"

    @property
    def model_name(self) -> str:
        return f"{self.name}_model"

    @property
    def postprocess_name(self) -> str:
        return f"{self.name}_postprocess"

    @property
    def working_models(self) -> tuple[str, ...]:
        """The models that do the work (whose statistics tell where the time goes): the ensemble's steps, or the
        fused model itself."""
        if self.layout == "fused":
            return (self.name,)
        return (self.tokenizer_name, self.model_name) + ((self.postprocess_name,) if self.classifies else ())


def model_name_for(text: str) -> str:
    """A Triton-safe model name: lower case letters, digits and underscores."""
    return re.sub(r"[^a-z0-9_]+", "_", text.lower()).strip("_") or "model"


def add_tensor(message: Tensors, name: str, data_type: int, dims: list[int], ragged: bool = False) -> None:
    tensor = message.add(name=name, data_type=data_type, dims=dims)
    if ragged:
        tensor.allow_ragged_batch = True


def _output_dims(spec: OutputSpec, plan: ServingPlan) -> list[int]:
    return plan.output_dims[spec.name]


def graph_output_dims(io_outputs: dict[str, list[int | str]]) -> dict[str, list[int]]:
    """Per graph output, its dims after the batch axis: -1 where the graph leaves one open (sequence)."""
    return {name: [d if isinstance(d, int) and d > 0 else -1 for d in dims[1:]] for name, dims in io_outputs.items()}


def _prompt_parameters(config: mc.ModelConfig, plan: ServingPlan) -> None:
    """The model's prompts, which a request picks by its `prompt_name` parameter (the default one otherwise)."""
    if plan.prompts:
        config.parameters["prompts"].string_value = json.dumps(plan.prompts)
    if plan.default_prompt_name:
        config.parameters["default_prompt_name"].string_value = plan.default_prompt_name


def _limits(config: mc.ModelConfig, plan: ServingPlan) -> None:
    """What one request may send (text_input.Limits): more is refused with a 400 naming the setting."""
    config.parameters["max_texts"].string_value = str(plan.max_texts)
    config.parameters["max_text_chars"].string_value = str(plan.max_text_chars)


def _batching(config: mc.ModelConfig, plan: ServingPlan) -> None:
    config.max_batch_size = plan.max_batch_size
    if plan.dynamic_batching:
        config.dynamic_batching.preferred_batch_size.extend(plan.preferred_batch_sizes)
        config.dynamic_batching.max_queue_delay_microseconds = plan.max_queue_delay_us
    config.version_policy.latest.num_versions = 1


def _instances(config: mc.ModelConfig, plan: ServingPlan, kind: int) -> None:
    config.instance_group.add(count=plan.instances, kind=kind)


def tokenizer_config(plan: ServingPlan) -> mc.ModelConfig:
    config = mc.ModelConfig(name=plan.tokenizer_name, backend="python")
    _batching(config, plan)
    add_tensor(config.input, "TEXT", STRING, [1])
    for name in plan.input_names:
        add_tensor(config.output, name, INT64, [-1])
    add_tensor(config.output, "truncated", BOOL, [1])
    config.parameters["max_length"].string_value = str(plan.max_length)
    config.parameters["pad_to"].string_value = ",".join(map(str, plan.pad_to))
    config.parameters["pad_token_id"].string_value = str(plan.pad_token_id)
    _prompt_parameters(config, plan)
    _limits(config, plan)
    _instances(config, plan, mc.ModelInstanceGroup.KIND_CPU)
    return config


def model_config(plan: ServingPlan) -> mc.ModelConfig:
    """The network itself, in the chosen flavor."""
    ragged = plan.flavor is Flavor.PYTHON_ORT
    config = mc.ModelConfig(name=plan.model_name)
    if plan.flavor is Flavor.ONNXRUNTIME:
        config.platform, config.default_model_filename = "onnxruntime_onnx", "model.onnx"
    elif plan.flavor is Flavor.TENSORRT_PLAN:
        config.platform, config.default_model_filename = Flavor.TENSORRT_PLAN.value, "model.plan"
    else:
        config.backend = "python"
        _onnxruntime_parameters(config, plan)
    _batching(config, plan)
    for name in plan.input_names:
        add_tensor(config.input, name, INT64, [-1], ragged=ragged)
    for spec in plan.outputs:
        add_tensor(config.output, spec.name, FP32, _output_dims(spec, plan))
    kind = mc.ModelInstanceGroup.KIND_GPU if plan.gpu else mc.ModelInstanceGroup.KIND_CPU
    if plan.flavor is Flavor.TENSORRT_PLAN and plan.profiles > 1:
        for profile in range(plan.profiles):  # one instance group per profile: each serves one length bucket
            config.instance_group.add(count=plan.instances, kind=kind, profile=[str(profile)])
    else:
        _instances(config, plan, kind)
    if plan.flavor is Flavor.ONNXRUNTIME and plan.gpu and plan.gpu_accelerator == "tensorrt":
        accelerator = config.optimization.execution_accelerators.gpu_execution_accelerator.add(name="tensorrt")
        accelerator.parameters["precision_mode"] = "FP16" if plan.fp16 else "FP32"
        accelerator.parameters["max_workspace_size_bytes"] = str(1 << 30)
    if not (plan.flavor is Flavor.TENSORRT_PLAN and plan.profiles > 1):
        warmup = config.model_warmup.add(name="zeros", batch_size=1)
        for name in plan.input_names:
            warmup.inputs[name].data_type = INT64
            warmup.inputs[name].dims.append(min(16, plan.max_length))
            warmup.inputs[name].zero_data = True
    return config


def _onnxruntime_parameters(config: mc.ModelConfig, plan: ServingPlan) -> None:
    """What a Python model running ONNX Runtime (or, for the OpenVINO variant, OpenVINO) needs: providers and the
    graph optimizers its file leaves out (OpenVINO: the inference precision it names), threads per instance (and all
    the instances' threads, for an instance whose neighbours are idle), the pad token, the token budget."""
    if plan.runtime == "openvino":
        config.parameters["runtime"].string_value = "openvino"
        config.parameters["openvino_precision"].string_value = onnxfiles.openvino_precision(plan.model_file)
    else:
        config.parameters["providers"].string_value = (
            "CUDAExecutionProvider,CPUExecutionProvider" if plan.gpu else "CPUExecutionProvider")
        disabled = onnxfiles.disabled_optimizers(plan.model_file)
        if disabled:  # the graph's layer-norm form, kept as measured (variants.GRAPH_FORMS)
            config.parameters["disabled_optimizers"].string_value = ",".join(disabled)
    config.parameters["intra_op_threads"].string_value = str(plan.threads)
    config.parameters["pad_token_id"].string_value = str(plan.pad_token_id)
    if plan.max_tokens:  # a request past it runs in pieces within it, its answers joined
        config.parameters["max_tokens"].string_value = str(plan.max_tokens)
    if plan.max_request_tokens:  # past it a request is refused (text_input.RequestBudget)
        config.parameters["max_request_tokens"].string_value = str(plan.max_request_tokens)
    if plan.instances > 1 and not plan.gpu:  # an instance alone at work takes the cores of the idle ones too
        config.parameters["instances"].string_value = str(plan.instances)
        config.parameters["wide_threads"].string_value = str(plan.threads * plan.instances)


def _label_dims(plan: ServingPlan) -> list[int]:
    """A classifier's `label` and `score` dims after the batch axis (serving/backend/labels.py): one per token, one
    per text after a softmax, else one per label."""
    if next(o for o in plan.outputs if o.name == "logits").per_token:
        return [-1]
    return [1] if plan.activation == "softmax" else [len(plan.id2label)]


def _label_parameters(config: mc.ModelConfig, plan: ServingPlan) -> None:
    """What the Python model that labels reads: the label names and the head it applies (labels.py)."""
    config.parameters["id2label"].string_value = json.dumps(plan.id2label)
    config.parameters["activation"].string_value = plan.activation


def _text_outputs(config: mc.ModelConfig, plan: ServingPlan, terms: bool = True) -> None:
    """What text-in models answer: the task outputs, label and score for classifiers, a sparse encoder's active
    terms (where `terms`: the fused model computes them, an ensemble's network model does not), and `truncated`."""
    for spec in plan.outputs:
        add_tensor(config.output, spec.name, FP32, _output_dims(spec, plan))
    if plan.classifies:
        for name, data_type in (("label", STRING), ("score", FP32)):
            add_tensor(config.output, name, data_type, _label_dims(plan))
    if plan.sparse and terms:
        add_tensor(config.output, SPARSE_INDICES, INT64, [-1])
        add_tensor(config.output, SPARSE_VALUES, FP32, [-1])
    add_tensor(config.output, "truncated", BOOL, [1])


def fused_config(plan: ServingPlan) -> mc.ModelConfig:
    """Text in, task outputs out, in one Python model."""
    config = mc.ModelConfig(name=plan.name, backend="python")
    _batching(config, plan)
    add_tensor(config.input, "TEXT", STRING, [1])
    _text_outputs(config, plan)
    _onnxruntime_parameters(config, plan)
    config.parameters["max_length"].string_value = str(plan.max_length)
    config.parameters["model_outputs"].string_value = json.dumps([o.name for o in plan.outputs])
    _prompt_parameters(config, plan)
    _limits(config, plan)
    if plan.classifies:
        _label_parameters(config, plan)
    if plan.sparse:
        config.parameters["sparse"].string_value = "true"
    _instances(config, plan, mc.ModelInstanceGroup.KIND_GPU if plan.gpu else mc.ModelInstanceGroup.KIND_CPU)
    return config


def rerank_config(plan: ServingPlan) -> mc.ModelConfig:
    """A query (or one per document) and its documents in, one request at a time (its documents are the batch): the
    scores in the documents' order and, for a request asking TOP_K, the best documents' indices and scores."""
    config = mc.ModelConfig(name=plan.name, backend="python", max_batch_size=0)
    add_tensor(config.input, "QUERY", STRING, [-1])
    add_tensor(config.input, "DOCUMENTS", STRING, [-1])
    add_tensor(config.input, "TOP_K", INT64, [1])
    config.input[-1].optional = True
    for spec in plan.outputs:
        add_tensor(config.output, spec.name, FP32, [-1, *_output_dims(spec, plan)])
    for name, data_type in (("top_indices", INT64), ("top_scores", FP32), ("truncated", BOOL)):
        add_tensor(config.output, name, data_type, [-1])
    _onnxruntime_parameters(config, plan)
    config.parameters["max_length"].string_value = str(plan.max_length)
    config.parameters["max_documents"].string_value = str(plan.max_documents)
    _limits(config, plan)
    config.parameters["model_outputs"].string_value = json.dumps([o.name for o in plan.outputs])
    _instances(config, plan, mc.ModelInstanceGroup.KIND_CPU)
    return config


def postprocess_config(plan: ServingPlan) -> mc.ModelConfig:
    config = mc.ModelConfig(name=plan.postprocess_name, backend="python")
    _batching(config, plan)
    logits = next(o for o in plan.outputs if o.name == "logits")
    add_tensor(config.input, "logits", FP32, _output_dims(logits, plan), ragged=True)
    add_tensor(config.output, "label", STRING, _label_dims(plan))
    add_tensor(config.output, "score", FP32, _label_dims(plan))
    _label_parameters(config, plan)
    _instances(config, plan, mc.ModelInstanceGroup.KIND_CPU)
    return config


def ensemble_config(plan: ServingPlan) -> mc.ModelConfig:
    """Text in, task outputs out: tokenizer -> model (-> postprocess)."""
    config = mc.ModelConfig(name=plan.name, platform="ensemble", max_batch_size=plan.max_batch_size)
    add_tensor(config.input, "TEXT", STRING, [1])
    steps = config.ensemble_scheduling.step
    tokenize = steps.add(model_name=plan.tokenizer_name, model_version=-1)
    tokenize.input_map["TEXT"] = "TEXT"
    for name in (*plan.input_names, "truncated"):
        tokenize.output_map[name] = name
    run = steps.add(model_name=plan.model_name, model_version=-1)
    for name in plan.input_names:
        run.input_map[name] = name
    for spec in plan.outputs:
        run.output_map[spec.name] = spec.name
    if plan.classifies:
        post = steps.add(model_name=plan.postprocess_name, model_version=-1)
        post.input_map["logits"] = "logits"
        for name in ("label", "score"):
            post.output_map[name] = name
    _text_outputs(config, plan, terms=False)
    return config


def to_pbtxt(config: mc.ModelConfig) -> str:
    return text_format.MessageToString(config)


def parse_pbtxt(text: str, where: str = "config.pbtxt") -> mc.ModelConfig:
    """Parse with Triton's own ModelConfig message; a misspelled field or enum is an error with line:col."""
    try:
        return text_format.Parse(text, mc.ModelConfig())
    except text_format.ParseError as exc:
        raise RepositoryError(f"{where} is not a valid Triton model config: {exc}",
                              "fix the field or enum named in the message (see model_config.proto)") from None


def configs(plan: ServingPlan) -> dict[str, mc.ModelConfig]:
    if plan.layout not in LAYOUTS:
        raise RepositoryError(f"unknown repository layout {plan.layout!r}", f"use one of {', '.join(LAYOUTS)}")
    if plan.reranks:
        if plan.layout != "fused" or plan.flavor is not Flavor.PYTHON_ORT:
            raise RepositoryError(f"a reranker is served by one Python model (query and documents in, scores out); "
                                  f"this plan asks for the {plan.layout} layout in flavor {plan.flavor.value}",
                                  "use -p triton.layout=fused and -p triton.flavor=python-ort (auto on a CPU)")
        return {plan.name: rerank_config(plan)}
    if plan.layout == "fused":
        if plan.flavor is not Flavor.PYTHON_ORT:
            raise RepositoryError(f"the fused layout runs in Triton's Python backend; flavor {plan.flavor.value} runs "
                                  "in a C++ backend behind the ensemble",
                                  "use -p triton.layout=ensemble (or auto), or -p triton.flavor=python-ort")
        return {plan.name: fused_config(plan)}
    result = {plan.tokenizer_name: tokenizer_config(plan), plan.model_name: model_config(plan),
              plan.name: ensemble_config(plan)}
    if plan.classifies:
        result[plan.postprocess_name] = postprocess_config(plan)
    return result


def encoder_json(tokenizer_dir: Path, max_length: int, lowercase: bool = False) -> bytes | None:
    """The transformers tokenizer's own `tokenizers` backend as the served models run it (padding off, truncation
    to `max_length` on the tokenizer's side, lowercasing first where the model's sentence-transformers files say
    so), serialized; None for a tokenizer without one, or one its JSON does not give back whole (the model then
    loads the transformers tokenizer itself, as the library does). tokenizers 0.23 reads some of a Unigram
    model's scores back one ulp off (47 of a tiny T5's 600), and where two segmentations tie that flips one
    ("000": "00 0" in the library, "0 00" served); a lowercasing one is kept, as only its backend lowercases."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    wrapper = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if lowercase:
        lowercase_inputs(wrapper)
    backend = getattr(wrapper, "backend_tokenizer", None)
    if backend is None:
        return None
    saved = backend.to_str()
    encoder = Tokenizer.from_str(saved)
    if encoder.to_str() != saved and not lowercase:
        return None
    encoder.no_padding()
    encoder.enable_truncation(max_length, direction=wrapper.truncation_side)
    return encoder.to_str().encode("utf-8")


def model_files(plan: ServingPlan) -> dict[str, tuple[mc.ModelConfig, dict[str, Path | bytes]]]:
    """Every model of the plan: its config and the files of its version folder (name there -> source file or
    folder, or the bytes to write)."""
    network = {"model.plan" if plan.flavor is Flavor.TENSORRT_PLAN else "model.onnx": plan.model_file}
    data = Path(f"{plan.model_file}.data")
    if data.is_file():
        network[data.name] = data
    if plan.layout == "fused":
        config = configs(plan)[plan.name]
        fused: dict[str, Path | bytes] = {**network, "tokenizer": plan.tokenizer_dir, **{
            name: MODELS_SOURCE / source for name, source in (
                ("model.py", "rerank_model.py" if plan.reranks else "fused_model.py"),
                ("text_input.py", "text_input.py"),
                ("ort_batches.py", "ort_batches.py"), ("labels.py", "labels.py"), ("stages.py", "stages.py"),
                ("sparse_terms.py", "sparse_terms.py"))}}
        encoder = encoder_json(plan.tokenizer_dir, plan.max_length, plan.lowercase)
        if encoder is not None:
            fused["encoder.json"] = encoder
        return {plan.name: (config, fused)}
    tokenizer: dict[str, Path | bytes] = {"model.py": MODELS_SOURCE / "tokenizer.py",
                                          "text_input.py": MODELS_SOURCE / "text_input.py",
                                          "tokenizer": plan.tokenizer_dir}
    encoder = encoder_json(plan.tokenizer_dir, plan.max_length, plan.lowercase)
    if encoder is not None:
        tokenizer["encoder.json"] = encoder
    files: dict[str, dict[str, Path | bytes]] = {
        plan.tokenizer_name: tokenizer,
        plan.model_name: network,
        plan.name: {},
    }
    if plan.flavor is Flavor.PYTHON_ORT:
        files[plan.model_name]["model.py"] = MODELS_SOURCE / "onnxruntime_model.py"
        files[plan.model_name]["ort_batches.py"] = MODELS_SOURCE / "ort_batches.py"
    if plan.classifies:
        files[plan.postprocess_name] = {"model.py": MODELS_SOURCE / "postprocess.py",
                                        "labels.py": MODELS_SOURCE / "labels.py"}
    return {name: (config, files[name]) for name, config in configs(plan).items()}


def _copy_tree(source: Path, target: Path) -> None:
    """Copy a folder with the modes new files and folders get (the umask), not the source's (copytree copies
    folder modes: a 0700 source would make a folder the server's user may not read)."""
    target.mkdir()
    for path in sorted(source.rglob("*")):  # a folder sorts before its contents
        if path.is_dir():
            (target / path.relative_to(source)).mkdir()
        else:
            shutil.copyfile(path, target / path.relative_to(source))


def _fill(models: Mapping[str, tuple[mc.ModelConfig, Mapping[str, Path | bytes]]], root: Path) -> None:
    for name, (config, files) in models.items():
        folder = root / name
        (folder / "1").mkdir(parents=True)
        text = to_pbtxt(config)
        if parse_pbtxt(text, f"{name}/config.pbtxt") != config:
            raise RepositoryError(f"{name}/config.pbtxt does not read back as written", "report this as a bug")
        (folder / "config.pbtxt").write_text(text, encoding="utf-8")
        for target, source in files.items():
            if isinstance(source, bytes):
                (folder / "1" / target).write_bytes(source)
            elif Path(source).is_dir():
                _copy_tree(Path(source), folder / "1" / target)
            else:
                shutil.copyfile(source, folder / "1" / target)


def _fingerprint(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MARKER and "__pycache__" not in p.parts}


def written_files(root: Path) -> dict[str, str] | None:
    """The files (relative path: sha256) the workbench wrote into `root`, as its marker holds them (None: no
    readable marker, not the workbench's)."""
    try:
        files = json.loads((root / MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return files if isinstance(files, dict) else None


def changed_files(root: Path) -> list[str]:
    """The files in `root` changed, added or removed since the workbench wrote it (all of them without a marker)."""
    written, now = written_files(root) or {}, _fingerprint(root) if root.is_dir() else {}
    return sorted(name for name in written.keys() | now.keys() if written.get(name) != now.get(name))


def ours_and_untouched(root: Path) -> bool:
    """True when `root` was generated by the workbench and nothing in it changed since."""
    return written_files(root) is not None and not changed_files(root)


def check_replaceable(root: Path, overwrite: bool = False) -> None:
    """Refuse to replace a folder the workbench did not write (or that was edited since) unless `overwrite`."""
    if root.exists() and not overwrite and not ours_and_untouched(root):
        raise RepositoryError(f"{root} already exists and was not generated by this workbench (or was edited)",
                              "move it away, choose another -p triton.name=..., or pass -p triton.overwrite=true")


def verify_model_file(plan: ServingPlan) -> None:
    """Refuse a truncated or corrupt network before it is published (the server would fail minutes later, with the
    cause deep in its log): ONNX files through onnx.checker and an ONNX Runtime session. A TensorRT engine needs
    its GPU to be deserialized, so here it is only checked to exist and not be empty."""
    if plan.flavor is not Flavor.TENSORRT_PLAN:
        onnxfiles.verify(plan.model_file)
    elif not plan.model_file.is_file() or plan.model_file.stat().st_size == 0:
        raise RepositoryError(f"TensorRT engine {plan.model_file} is missing or empty",
                              "re-run the tensorrt step on a GPU host; an empty engine is a failed build")


def write_repository(plan: ServingPlan, root: Path, overwrite: bool = False, run: Path | None = None) -> Path:
    """Verify the plan's model file, then write its repository into `root` (see write_models), its marker naming
    the `run` it comes from."""
    verify_model_file(plan)
    about = {"name": plan.name, "flavor": plan.flavor.value, **({"run": str(run)} if run else {})}
    return write_models(model_files(plan), root, overwrite, about)


def published_by(root: Path) -> str | None:
    """The run folder whose deployment `root` holds, as its marker names it (None: none, or not named)."""
    try:
        return json.loads((root / MARKER).read_text()).get("run")
    except (OSError, ValueError):
        return None


def write_models(models: Mapping[str, tuple[mc.ModelConfig, Mapping[str, Path | bytes]]], root: Path,
                 overwrite: bool = False, about: dict[str, Any] | None = None) -> Path:
    """Write a repository into `root` atomically; an existing folder is replaced only if we wrote it and nobody
    changed it since, or `overwrite` says so."""
    root = Path(root)
    check_replaceable(root, overwrite)
    with atomic_dir(root) as tmp:
        _fill(models, tmp)
        write_text(tmp / MARKER, json.dumps({"generated_by": "transformer-workbench", **(about or {}),
                                             "files": _fingerprint(tmp)}, indent=2))
    return root


def read_repository(root: Path) -> dict[str, mc.ModelConfig]:
    """Parse every config.pbtxt under `root` and check that the ensemble's steps name models that exist."""
    parsed = {p.parent.name: parse_pbtxt(p.read_text(encoding="utf-8"), str(p))
              for p in sorted(Path(root).glob("*/config.pbtxt"))}
    for name, config in parsed.items():
        for step in config.ensemble_scheduling.step:
            if step.model_name not in parsed:
                raise RepositoryError(f"ensemble {name} uses {step.model_name}, which is not in {root}",
                                      "regenerate the repository with the triton step")
    return parsed
