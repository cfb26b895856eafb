"""The parity step's settings (`-p parity.<setting>`): the variants the lab checks, the precision repair and its
bounds, where reference outputs are kept between runs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field, field_validator

from workbench.core.config import BatchRange, Settings, StepSettings, Tolerance, from_here
from workbench.tasks.registry import OutputSpec

REPAIR_LAB_PASSES = 8  # parity.repair.budget_s auto: this many of the failing variant's lab checks,
REPAIR_MIN_SECONDS = 180.0  # and at least this (a small model's builds and sessions cost more than its lab pass)
ALL_VARIANTS_UP_TO = 300_000_000  # parameters: parity.variants auto checks every variant of a model up to this size


class RepairSettings(Settings):
    """Precision repair of a failing fp16/int8 variant, and its bounds."""

    enabled: bool = True
    budget_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | Literal["auto"] = Field(default="auto", description=(
        "seconds the repair of one precision may take: it ends with the best passing candidate found by then, or "
        "says it found none (the best candidate's numbers and how to give it more time); auto: "
        f"{REPAIR_LAB_PASSES} times the failing variant's own check on the parity lab, at least "
        f"{REPAIR_MIN_SECONDS:g} s"))
    max_builds: int = Field(default=80, ge=2, description="candidate files one repair may build")

    def budget(self, lab_seconds: float | None) -> tuple[float, str]:
        """The repair's seconds and where the number comes from: the setting, or (auto) REPAIR_LAB_PASSES times
        `lab_seconds` (the failing variant's own check on the lab; a model's size and the host's load both show in
        it), at least REPAIR_MIN_SECONDS."""
        if self.budget_s != "auto":
            return self.budget_s, "configured (parity.repair.budget_s)"
        passes = REPAIR_LAB_PASSES * (lab_seconds or 0.0)
        if passes <= REPAIR_MIN_SECONDS:
            return REPAIR_MIN_SECONDS, (f"auto: at least {REPAIR_MIN_SECONDS:g} s (under {REPAIR_LAB_PASSES} times "
                                        f"the variant's {lab_seconds or 0:.1f} s check on the lab)")
        return round(passes, 1), f"auto: {REPAIR_LAB_PASSES} times the variant's {lab_seconds:.1f} s check on the lab"



class ParitySettings(StepSettings):
    """The parity step: its precision repair, and where the lab keeps reference outputs between runs."""

    repair: RepairSettings = Field(default_factory=RepairSettings, description=(
        "precision repair; -p parity.repair=false turns it off"))
    variants: Literal["auto", "all", "served"] = Field(default="auto", description=(
        "the variants the lab checks: all; or served: fp32, then the others in the order the deployment serves "
        "them until one passes (those served after it could not be served), a failing fp16/int8 repaired only "
        "where none faster than fp32 passes; "
        f"auto: all up to {ALL_VARIANTS_UP_TO // 10**6}M parameters, served past them (one check of a larger "
        "model takes many minutes on a few cores)"))
    reference_cache_dir: str | None = Field(default=None, description=(
        "where the parity lab's reference outputs are kept between runs, by model files and texts; default: "
        "$XDG_CACHE_HOME (~/.cache)/transformer-workbench/reference"))
    _cache_here = field_validator("reference_cache_dir")(staticmethod(from_here))

    def scope(self, parameters: int | None) -> tuple[Literal["all", "served"], str]:
        """The variants the lab checks (`variants`, auto resolved by the model's `parameters`) and why."""
        if self.variants != "auto":
            return self.variants, "configured (parity.variants)"
        if parameters is None or parameters <= ALL_VARIANTS_UP_TO:
            return "all", f"auto: the model has at most {ALL_VARIANTS_UP_TO // 10**6}M parameters"
        return "served", (f"auto: the model has {parameters / 1e6:.0f}M parameters (past "
                          f"{ALL_VARIANTS_UP_TO // 10**6}M each check takes many minutes on a few cores); "
                          "-p parity.variants=all checks every variant")


@dataclass(frozen=True)
class LabSettings:
    """What the parity lab reads from a run's configuration (`TritonSettings.lab`): the outputs it compares, those that
    gate a verdict (the outputs the deployment serves) and their tolerances, the batch range and seed of its corner
    batches, the device its reference runs on, where reference outputs are kept between runs, whether the model's
    own code may run, and the corpus."""

    specs: tuple[OutputSpec, ...]
    gated: tuple[str, ...]
    tolerances: dict[str, Tolerance]
    batch: BatchRange
    seed: int
    device: str
    cache_dir: str | None
    trust_remote_code: bool
    corpus: str | None
    corpus_max_texts: int

