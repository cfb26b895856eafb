"""TensorRT on a machine without a GPU: everything up to the build runs; the build is skipped with the reason."""
from __future__ import annotations

from pathlib import Path

import pytest

from workbench.core.config import RunConfig
from workbench.core.errors import GpuRequiredError, StepSkipped
from workbench.core.machine import gpu_name
from workbench.core.record import RunRecord
from workbench.graphs import onnxfiles
from workbench.graphs.engines import (
    EngineSpec,
    cache_key,
    layer_matches,
    original_nodes_for,
    ort_tensorrt_options,
    require_tensorrt,
    trtexec_command,
)
from workbench.graphs.tables import ShapeProfile
from workbench.models.tiny import make_fp16_overflow
from workbench.runners.onnxruntime import tensorrt_providers
from workbench.steps import export, optimize, parity, tensorrt

PROFILES = [ShapeProfile(batch=[1, 4, 8], sequence=[1, 32, 32]),
            ShapeProfile(batch=[1, 4, 8], sequence=[33, 64, 64])]
NAMES = ("input_ids", "attention_mask", "token_type_ids")
needs_no_gpu = pytest.mark.skipif(gpu_name() is not None, reason="checks the behaviour on machines without a GPU")


@pytest.fixture(scope="module")
def overflow_run(tiny_models, tmp_path_factory):
    """A tiny BERT whose fp16 needs repair, through export, optimize, parity and tensorrt."""
    root = tmp_path_factory.mktemp("trt")
    model = make_fp16_overflow(root / "model", tiny_models["bert"])
    config = RunConfig.model_validate({"model": str(model), "batch": {"min": 1, "opt": 4, "max": 8},
                                       "sequence": {"min": 1, "opt": 32, "max": 64}, "precisions": ["fp32", "fp16"],
                                       # where the fp16 overflow happens (test_parity)
                                       "optimize": {"graph_form": "fused"}})
    record = RunRecord.create(root / "run", config)
    for step in (export, optimize, parity, tensorrt):
        step.run(config, record)
    return record


@needs_no_gpu
def test_without_a_gpu_the_build_is_skipped_not_passed(overflow_run):
    step = overflow_run.data["steps"]["tensorrt"]
    assert step["status"] == "skipped"
    assert "needs an NVIDIA GPU" in step["reason"] and "build_engines.sh" in step["reason"]
    assert not any(a["kind"] == "engine" for a in overflow_run.data["artifacts"].values())
    with pytest.raises(StepSkipped, match="needs an NVIDIA GPU"):
        require_tensorrt()


def test_profiles_and_padding_are_recorded(overflow_run):
    metrics = overflow_run.data["metrics"]["tensorrt"]
    profiles = [ShapeProfile.model_validate(p) for p in metrics["profiles"]]
    assert len(profiles) == 2
    assert profiles[0].sequence[0] == 1 and profiles[-1].sequence[2] == 64
    waste = metrics["padding_waste"]
    assert waste["2"]["dynamic"] < waste["1"]["dynamic"]
    assert metrics["lengths"]["count"] == 320 and sum(metrics["lengths"]["histogram"]["counts"]) == 320


def test_build_script_pins_the_layers_the_fp16_repair_found(overflow_run):
    metrics = overflow_run.data["metrics"]["tensorrt"]
    repaired = overflow_run.data["metrics"]["parity"]["repair"]["fp16"]["chosen"]["blocked"]
    assert set(metrics["fp16_pins"]) == set(repaired)
    pinned = metrics["engines"]["trt_fp16"]["spec"]["pinned"]
    original = {n.name for n in onnxfiles.load(overflow_run.artifact("onnx.tensorrt"), False).graph.node}
    assert pinned and set(pinned) <= original
    script = overflow_run.artifact("tensorrt.build_script").read_text()
    assert script.count("trtexec") >= 2 and "--profile=1" in script and "--noTF32" in script
    assert "--layerPrecisions=" + ",".join(f"{n}:fp32" for n in pinned) in script
    assert "--fp16" not in script.split("== trt_fp16")[0], "the fp32 engine is built without --fp16"
    options = metrics["engines"]["trt_fp16"]["ort_provider_options"]
    assert options["trt_profile_max_shapes"] == ("input_ids:8x32,attention_mask:8x32,token_type_ids:8x32,"
                                                 "input_ids:8x64,attention_mask:8x64,token_type_ids:8x64")


def test_fused_nodes_map_back_to_the_nodes_they_replaced(overflow_run):
    optimized = onnxfiles.load(overflow_run.artifact("onnx.fp32"), False)
    original = onnxfiles.load(overflow_run.artifact("onnx.tensorrt"), False)
    mapping = original_nodes_for(["SkipLayerNorm_AddBias_1", "/model/encoder/layer.0/output/dense/MatMul",
                                  "no-such-node"], optimized, original)
    assert mapping["/model/encoder/layer.0/output/dense/MatMul"] == ["/model/encoder/layer.0/output/dense/MatMul"]
    region = mapping["SkipLayerNorm_AddBias_1"]
    assert region[-1].endswith("LayerNorm/LayerNormalization") and 2 <= len(region) <= 4
    assert all("layer.0/output" in name for name in region)
    assert mapping["no-such-node"] == []


def test_trtexec_command_for_one_profile():
    spec = EngineSpec("trt_fp32", "fp32", PROFILES[:1], workspace_mb=1024)
    command = trtexec_command(Path("m.onnx"), Path("e.plan"), spec, NAMES[:2], Path("t.cache"), Path("r"))
    assert command[:3] == ["trtexec", "--onnx=m.onnx", "--saveEngine=e.plan"]
    assert "--minShapes=input_ids:1x1,attention_mask:1x1" in command
    assert "--maxShapes=input_ids:8x32,attention_mask:8x32" in command
    assert not any(part.startswith("--profile") for part in command)
    assert "--memPoolSize=workspace:1024M" in command and "--timingCacheFile=t.cache" in command


def test_cache_key_changes_with_every_input():
    spec = EngineSpec("trt_fp16", "fp16", PROFILES, ["a"])
    base = cache_key("sha", "10.9", "H100", spec)
    assert base == cache_key("sha", "10.9", "H100", EngineSpec("other-name", "fp16", PROFILES, ["a"]))
    variants = [cache_key("sha2", "10.9", "H100", spec), cache_key("sha", "10.10", "H100", spec),
                cache_key("sha", "10.9", "A100", spec),
                cache_key("sha", "10.9", "H100", EngineSpec("x", "fp32", PROFILES, ["a"])),
                cache_key("sha", "10.9", "H100", EngineSpec("x", "fp16", PROFILES[:1], ["a"])),
                cache_key("sha", "10.9", "H100", EngineSpec("x", "fp16", PROFILES, ["b"])),
                cache_key("sha", "10.9", "H100", EngineSpec("x", "fp16", PROFILES, ["a"], workspace_mb=1))]
    assert len({base, *variants}) == 1 + len(variants)


def test_layer_name_matching():
    assert layer_matches("/enc/MatMul", "/enc/MatMul")
    assert layer_matches("/enc/MatMul_1", "/enc/MatMul")
    assert not layer_matches("/enc/MatMul2", "/enc/MatMul")


def test_ort_tensorrt_options_have_one_entry_per_profile_and_input():
    options = ort_tensorrt_options(EngineSpec("trt_fp32", "fp32", PROFILES), NAMES[:1], Path("/cache"))
    assert options["trt_profile_min_shapes"] == "input_ids:1x1,input_ids:1x33"
    assert options["trt_profile_opt_shapes"] == "input_ids:4x32,input_ids:4x64"
    assert options["trt_fp16_enable"] is False and options["trt_engine_cache_path"] == "/cache"



@pytest.mark.skipif(gpu_name() is not None, reason="checks the no-GPU message")
def test_ort_tensorrt_provider_without_a_gpu_names_the_fix():
    with pytest.raises(GpuRequiredError, match="needs an NVIDIA GPU") as caught:
        tensorrt_providers(ort_tensorrt_options(EngineSpec("trt_fp32", "fp32", PROFILES), NAMES, Path("/cache")))
    assert "[gpu] extra" in caught.value.fix
