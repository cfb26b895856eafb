"""The runner protocol: one `infer(batch)`, exactly `output_names` back, closed after a `with` block."""
from __future__ import annotations

from contextlib import ExitStack

import numpy as np
import pytest

from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.machine import gpu_name
from workbench.core.record import RunRecord
from workbench.graphs.errors import OnnxModelError
from workbench.models.batches import Batch, shaped_batch, token_lengths
from workbench.models.loading import load_model
from workbench.precision.lab import ParityLab
from workbench.runners import Runner, RunnerClosedError
from workbench.runners.onnxruntime import CPU, OrtRunner
from workbench.runners.torch import TorchRunner
from workbench.serving.runner import ServedRunner
from workbench.serving.settings import lab_settings
from workbench.steps import export
from workbench.steps.bench import grid_rows

TEXTS = list(load_corpus()[:24])
OUTPUTS = {"bert": ("token_embeddings", "sentence_embedding"), "bert-seqcls": ("logits",)}
TASKS = {"bert": "feature-extraction", "bert-seqcls": "sequence-classification"}


@pytest.fixture(scope="module", params=sorted(OUTPUTS))
def exported(request, tiny_models, tmp_path_factory):
    config = RunConfig(model=str(tiny_models[request.param]), task=TASKS[request.param])
    record = RunRecord.create(tmp_path_factory.mktemp(f"runners-{request.param}"), config)
    export.run(config, record)
    loaded = load_model(config)
    lengths = token_lengths(loaded.tokenizer, TEXTS)
    batch = shaped_batch(loaded.tokenizer, loaded.input_names, TEXTS, lengths, rows=3, length=20)
    return request.param, config, record, loaded, batch


def make_runner(kind: str, config: RunConfig, record: RunRecord, loaded) -> Runner:
    if kind == "onnxruntime":
        return OrtRunner("original", record.artifact("onnx.original"), [CPU])
    return TorchRunner(loaded, config.output_specs)


@pytest.mark.parametrize("kind", ["onnxruntime", "torch"])
def test_runner_returns_exactly_its_outputs_and_is_closed_after_with(exported, kind):
    model, config, record, loaded, batch = exported
    with make_runner(kind, config, record, loaded) as runner:
        assert isinstance(runner, Runner)
        assert runner.output_names == OUTPUTS[model] and runner.input_names == loaded.input_names
        got = runner.infer(batch)
        assert tuple(got) == runner.output_names
        assert all(isinstance(v, np.ndarray) and v.shape[0] == 3 and np.isfinite(v).all() for v in got.values())
    with pytest.raises(RunnerClosedError, match="closed"):
        runner.infer(batch)
    runner.close()  # a second close is harmless


def test_onnxruntime_and_torch_agree_through_the_protocol(exported):
    """The graph is exported with eager attention (the pattern ONNX Runtime fuses); the reference runs sdpa, whose
    memory grows with the sequence, not its square."""
    model, config, record, loaded, batch = exported
    with (OrtRunner("original", record.artifact("onnx.original"), [CPU]) as ort,
          TorchRunner(loaded, config.output_specs) as reference):
        got, want = ort.infer(batch), reference.infer(batch)
    assert config.attn_implementation == "eager" and reference.attention == "sdpa"
    assert "sdpa attention" in reference.identity
    for name in OUTPUTS[model]:
        assert got[name].shape == want[name].shape and np.abs(got[name] - want[name]).max() < 1e-4, name


def test_an_error_inside_the_block_still_releases_the_session(exported):
    _, _, record, _, batch = exported
    runner = OrtRunner("original", record.artifact("onnx.original"), [CPU])
    with pytest.raises(ValueError, match="boom"), runner:
        raise ValueError("boom")
    assert runner.session is None
    with pytest.raises(RunnerClosedError, match="original: the ONNX Runtime session of .* is closed"):
        runner.infer(batch)


def test_the_parity_lab_closes_its_reference_and_compares_what_a_runner_returns(exported):
    model, config, record, loaded, _ = exported
    lab = ParityLab.corpus_only(lab_settings(config), loaded, tuple(TEXTS))
    with pytest.raises(RunnerClosedError):
        lab.reference.infer(lab.batches[0])
    with OrtRunner("original", record.artifact("onnx.original"), [CPU]) as runner:
        result = lab.compare(runner, "fp32")
    assert result.passed and tuple(result.outputs) == OUTPUTS[model]


class FakeClient:
    """Answers like the served ensemble: the reference's outputs, per-token ones padded to a wider bucket, plus an
    output the lab has no reference for."""

    protocol = "http"

    def __init__(self, loaded, config: RunConfig) -> None:
        self.loaded, self.config = loaded, config

    def infer_texts(self, model: str, texts: list[str], parameters: dict[str, str] | None = None
                    ) -> dict[str, np.ndarray]:
        from workbench.models.text import encode

        feed = encode(self.loaded.tokenizer, texts, self.loaded.input_names, max_length=self.loaded.sequence.max)
        with TorchRunner(self.loaded, self.config.output_specs) as reference:
            got = reference.infer(Batch(model, list(range(len(texts))), feed))
        padded = {k: np.pad(v, ((0, 0), (0, 7), (0, 0))) if v.ndim == 3 else v for k, v in got.items()}
        return padded | {"truncated": np.zeros((len(texts), 1), dtype=bool)}


def test_a_served_runner_is_compared_through_the_same_infer(exported):
    model, config, _, loaded, _ = exported
    lab = ParityLab.corpus_only(lab_settings(config), loaded, tuple(TEXTS))
    outputs = [*OUTPUTS[model], "truncated"]
    with ServedRunner(FakeClient(loaded, config), "served", tuple(TEXTS), loaded.input_names, outputs) as runner:
        got = runner.infer(lab.batches[0])
        result = lab.compare(runner, "fp32")
    assert tuple(got) == runner.output_names == tuple(outputs)
    assert all(v.shape[:2] == lab.batches[0].shape for v in got.values() if v.ndim == 3)
    assert result.passed and tuple(result.outputs) == OUTPUTS[model]


def test_benchmark_runners_are_all_closed_even_when_one_fails_to_load(exported, monkeypatch):
    _, config, record, _, batch = exported
    broken = record.run_dir / "onnx" / "broken.onnx"
    broken.write_bytes(b"not an onnx file")
    record.add_artifact("onnx.broken", broken, kind="onnx", variant="broken", precision="fp32")
    opened: list[Runner] = []
    for cls in (OrtRunner, TorchRunner):
        monkeypatch.setattr(cls, "__enter__", lambda self: opened.append(self) or self)
    try:
        with pytest.raises(OnnxModelError), ExitStack() as stack:
            grid_rows(config, record).open(stack)
    finally:
        del record.data["artifacts"]["onnx.broken"]
        broken.unlink()
    assert [r.name for r in opened] == ["pytorch", "original"]
    for runner in opened:
        with pytest.raises(RunnerClosedError):
            runner.infer(batch)


@pytest.mark.skipif(gpu_name() is not None, reason="checks the CPU fallback of a session asked for CUDA")
def test_a_session_asked_for_cuda_that_falls_back_to_the_cpu_is_a_typed_error(tmp_path):
    """ONNX Runtime creates the session on the CPU and only warns; the workbench refuses that run."""
    from onnx import TensorProto, helper

    from workbench.core.errors import GpuRequiredError
    from workbench.runners.errors import CudaFallbackError
    from workbench.runners.onnxruntime import CPU, CUDA, cuda_problem, cuda_usable, providers_for, session

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    path = tmp_path / "relu.onnx"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    path.write_bytes(model.SerializeToString())
    with pytest.raises(CudaFallbackError, match="asked for CUDAExecutionProvider and fell back to "
                                                "CPUExecutionProvider") as caught:
        session(path, [CUDA, CPU])
    assert cuda_problem() in str(caught.value) and "has no CUDA provider" in cuda_problem()
    assert not cuda_usable() and providers_for("auto") == [CPU]
    with pytest.raises(GpuRequiredError, match="device 'cuda' needs ONNX Runtime on CUDA: this ONNX Runtime build"):
        providers_for("cuda")
    assert session(path, [CPU]).get_providers() == [CPU]
    from workbench.preflight import preflight

    with pytest.raises(GpuRequiredError, match="has no CUDA provider"):  # refused before anything is written
        preflight(RunConfig(device="cuda", steps=["export"]))


def test_a_variant_opens_through_the_registered_runner_of_its_file(tmp_path, monkeypatch):
    """The registry decides: the file's runtime metadata picks the runner; a runtime no runner registers, or a
    precision the runner does not run, is refused with a typed error naming what is registered."""
    from dataclasses import replace

    from onnx import TensorProto, helper

    from workbench.core.record import Variant
    from workbench.graphs import onnxfiles
    from workbench.models.errors import UnsupportedModelError
    from workbench.runners.registry import RUNNERS, open_variant, runner_kind

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = onnxfiles.save(model, tmp_path / "m.onnx")
    assert runner_kind(path) is RUNNERS["onnxruntime"] and RUNNERS["onnxruntime"].tuned
    with open_variant(Variant("m", "fp32", "onnx", path), "cpu", 1) as runner:
        assert runner.infer(Batch("one", [0], {"x": np.ones(1, np.float32)}))["y"].tolist() == [1.0]
    cpu_only = replace(RUNNERS["onnxruntime"], devices=("cpu",))
    monkeypatch.setitem(RUNNERS, "onnxruntime", cpu_only)  # a runner asked for a device it lacks runs on its own
    with open_variant(Variant("m", "fp32", "onnx", path), "cuda", 1) as runner:
        assert runner.device == "cpu" and runner.providers == ["CPUExecutionProvider"]
    with pytest.raises(UnsupportedModelError, match="onnxruntime does not run here .it runs fp32, fp16, int8"):
        open_variant(Variant("m", "bf16", "onnx", path), "cpu", 1)
    onnxfiles.set_metadata(path, {onnxfiles.RUNTIME_KEY: "tensorrt_llm"})
    with pytest.raises(UnsupportedModelError, match="'tensorrt_llm', which no registered runner runs .registered: "
                                                    "onnxruntime, openvino"):
        runner_kind(path)
    onnxfiles.set_metadata(path, {onnxfiles.RUNTIME_KEY: "ctranslate2"})
    with pytest.raises(UnsupportedModelError, match="asks for ctranslate2, which opens a variant folder"):
        runner_kind(path)


def test_a_ctranslate2_encoder_folder_is_a_registered_runner_that_answers_as_pytorch(tiny_bert, tmp_path):
    """Adding a runner (docs/contributing.md), done once for real: CTranslate2's encoder on a converted tiny BERT,
    opened through the registry like any variant, answers as PyTorch does on the real positions (mean pooling);
    its int8 stays close; a pooling it cannot run is refused before anything is written."""
    from workbench.core.record import Variant
    from workbench.models.errors import UnsupportedModelError
    from workbench.runners.ctranslate2 import convert_encoder
    from workbench.runners.registry import open_variant, runner_kind

    config = RunConfig(model=str(tiny_bert))
    loaded = load_model(config)
    batch = shaped_batch(loaded.tokenizer, loaded.input_names, TEXTS, token_lengths(loaded.tokenizer, TEXTS), rows=3,
                         length=20)
    assert loaded.pipeline is not None
    folder = convert_encoder(tiny_bert, tmp_path / "ct2", loaded.pooling, loaded.pipeline.normalized)
    assert runner_kind(folder).runtime == "ctranslate2"
    with TorchRunner(loaded, config.output_specs) as reference:
        want = reference.infer(batch)
    real = batch.mask.astype(bool)
    for precision in ("fp32", "int8"):
        with open_variant(Variant("ct2", precision, "folder", folder), "cpu", 1) as runner:
            got = runner.infer(batch)
            assert runner.output_names == tuple(got) == ("token_embeddings", "sentence_embedding")
            assert runner.providers[0].startswith("CTranslate2 ")
        cosine = [float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
                  for a, b in zip(got["sentence_embedding"], want["sentence_embedding"])]
        if precision == "fp32":
            np.testing.assert_allclose(got["token_embeddings"][real], want["token_embeddings"][real], atol=1e-5)
            np.testing.assert_allclose(got["sentence_embedding"], want["sentence_embedding"], atol=1e-5)
        assert min(cosine) > (0.99999 if precision == "fp32" else 0.999), precision
    with pytest.raises(UnsupportedModelError, match="pools by mean or cls"):
        convert_encoder(tiny_bert, tmp_path / "max", "max", False)
    assert not (tmp_path / "max").exists()
