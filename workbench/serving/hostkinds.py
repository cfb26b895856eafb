"""Host kinds: what decides which variant is fastest on a node (its int8 and bf16 instructions, its GPU), named
after the CPU flags the run record holds, with the Ray resource a node advertises for its kind and the
node-feature-discovery labels that place a Kubernetes pod on a node of that kind."""
from __future__ import annotations

import difflib
from dataclasses import dataclass

from workbench.core.errors import ConfigError
from workbench.core.results import CpuFeatures

NFD = "feature.node.kubernetes.io/cpu-cpuid."  # node-feature-discovery's CPUID labels, value "true"
GPU_LABEL = "nvidia.com/gpu.present"  # NVIDIA's GPU feature discovery, value "true"
KIND_RESOURCE = "host-kind:"  # a node advertises {"host-kind:<kind>": 1}: one cell measures there at a time
FEATURE_RESOURCE = "cpu:"  # and {"cpu:<flag>": 1} for each int8/bf16 flag it has, {"GPU": n} for its GPUs
ADVERTISED_FLAGS = ("amx_int8", "amx_bf16", "avx512_vnni", "avx512_bf16", "avx_vnni", "avx512_fp16")


@dataclass(frozen=True)
class HostKind:
    """One kind of node: the flags it has (all of them), its NFD label, and what it is in a sentence."""

    name: str
    flags: tuple[str, ...]
    label: str
    about: str

    @property
    def resource(self) -> str:
        return KIND_RESOURCE + self.name

    def node_selector(self) -> dict[str, str]:
        return {self.label: "true"}

    def affinity(self) -> dict[str, object]:
        """The labels of the kinds above this one must be absent: an AMX node is not an AVX2 node's replica."""
        above = KINDS[:KINDS.index(self)]
        absent = [{"key": kind.label, "operator": "DoesNotExist"} for kind in above if kind.label != self.label]
        if not absent:
            return {}
        return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": absent}]}}}


# Most capable first: a node is the first kind whose flags it has all of.
KINDS = (
    HostKind("gpu", (), GPU_LABEL, "an NVIDIA GPU (the variants run on CUDA)"),
    HostKind("amx", ("amx_int8", "amx_bf16"), NFD + "AMXINT8", "Intel with AMX (Sapphire Rapids and later)"),
    HostKind("avx512_bf16", ("avx512_vnni", "avx512_bf16"), NFD + "AVX512BF16",
             "AVX-512 VNNI and BF16 without AMX (AMD Zen 4 and later, Intel Cooper Lake)"),
    HostKind("avx512_vnni", ("avx512_vnni",), NFD + "AVX512VNNI", "AVX-512 VNNI (Intel Cascade Lake, Ice Lake)"),
    HostKind("avx_vnni", ("avx_vnni",), NFD + "AVXVNNI", "AVX-VNNI without AVX-512 (Intel Alder Lake clients)"),
    HostKind("avx2", ("avx2",), NFD + "AVX2", "AVX2 without an int8 dot product (AMD Zen 2/3, Intel Haswell)"),
)
BY_NAME = {kind.name: kind for kind in KINDS}


def host_kind(name: str) -> HostKind:
    """The kind named `name`; ConfigError naming the known ones otherwise."""
    try:
        return BY_NAME[name]
    except KeyError:
        close = difflib.get_close_matches(name, BY_NAME, n=1)
        raise ConfigError(f"{name!r} is not a host kind" + (f" (did you mean {close[0]!r}?)" if close else ""),
                          f"use one of {', '.join(BY_NAME)} (docs/compare.md, 'A fleet')") from None


def kind_of(features: CpuFeatures, gpu: str | None) -> HostKind:
    """The kind of a node with these CPU flags and this GPU (None: none)."""
    if gpu:
        return BY_NAME["gpu"]
    flags = set(features.flags)
    for kind in KINDS[1:]:
        if set(kind.flags) <= flags:
            return kind
    raise ConfigError(f"this CPU has none of the flags a host kind needs (flags: {' '.join(features.flags)})",
                      "pass the node's kind yourself: workbench node start --kind KIND")


def node_resources(kind: HostKind, features: CpuFeatures) -> dict[str, float]:
    """The custom resources a node of `kind` advertises to Ray: its kind (one cell at a time) and its flags."""
    return {kind.resource: 1.0, **{FEATURE_RESOURCE + flag: 1.0 for flag in features.flags
                                   if flag in ADVERTISED_FLAGS}}


def kinds_offered(resources: dict[str, float]) -> list[str]:
    """The host kinds among a node's (or a cluster's) resources."""
    return [name[len(KIND_RESOURCE):] for name in resources if name.startswith(KIND_RESOURCE)]
