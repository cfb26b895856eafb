"""Output parity metrics: masked errors, cosine, label agreement, tolerances and the worst case."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from workbench.core.config import Tolerance
from workbench.core.results import OutputResult, Verdict, WorstValue
from workbench.precision.errors import InputMismatchError, ParityError
from workbench.precision.ranking import ranking_agreement, same_top
from workbench.precision.retrieval import TOP_K, retrieval_agreement
from workbench.precision.sparse import Terms, sparse_agreement, terms
from workbench.tasks.registry import OutputSpec

QUANTILES = (0.5, 0.9, 0.99, 0.999)

HALF: dict[str, Tolerance] = {  # fp16 and bf16
    "hidden": Tolerance(atol=5e-2, rtol=1e-2, min_cosine=0.999),
    "embedding": Tolerance(atol=2e-2, rtol=1e-2, min_cosine=0.999),
    "logits": Tolerance(atol=5e-2, rtol=1e-2, min_agreement=0.98),
    "token_logits": Tolerance(atol=5e-2, rtol=1e-2, min_agreement=0.98),
    "scores": Tolerance(atol=2e-2, rtol=1e-2, min_agreement=0.98, min_kendall_tau=0.95),
    "sparse": Tolerance(min_cosine=0.999, min_top_k_overlap=0.9, max_dot_error=0.02),
}
# Task-aware defaults: precision class -> output kind -> tolerance. None means "not checked at this precision".
DEFAULT_TOLERANCES: dict[str, dict[str, Tolerance]] = {
    "fp32": {
        "hidden": Tolerance(atol=1e-4, rtol=1e-3, min_cosine=0.9999),
        "embedding": Tolerance(atol=1e-4, rtol=1e-3, min_cosine=0.9999),
        "logits": Tolerance(atol=1e-4, rtol=1e-3, min_agreement=0.99),
        "token_logits": Tolerance(atol=1e-4, rtol=1e-3, min_agreement=0.99),
        "scores": Tolerance(atol=1e-4, rtol=1e-3, min_agreement=0.99),
        "sparse": Tolerance(atol=1e-4, rtol=1e-3, min_cosine=0.9999, min_top_k_overlap=0.95, max_dot_error=1e-3),
    },
    "fp16": HALF,
    # bf16 (OpenVINO's float ops on a CPU with bf16) keeps 8 significant bits to fp16's 11 but accumulates in f32, and
    # is held to fp16's gate: on all-MiniLM-L6-v2 its hidden states were within 0.021 of f32 (values up to 6.1).
    "bf16": HALF,
    "int8": {
        "hidden": Tolerance(min_cosine=0.9),
        "embedding": Tolerance(min_cosine=0.99),
        "logits": Tolerance(min_agreement=0.95),
        "token_logits": Tolerance(min_agreement=0.95),
        "scores": Tolerance(min_agreement=0.95, min_kendall_tau=0.8, min_agreement_at_1=0.9),
        # A SPLADE's weak terms sit near relu's 0, where int8 turns some on or off: gated on the heavy terms and on
        # the scores a search engine computes from them.
        "sparse": Tolerance(min_cosine=0.99, min_top_k_overlap=0.75, max_dot_error=0.05),
    },
}


def tolerance_for(spec: OutputSpec, precision: str, overrides: dict[str, Tolerance]) -> Tolerance:
    """The default for (precision, output kind), with the run configuration's per-output fields on top."""
    base = DEFAULT_TOLERANCES[precision][spec.kind]
    override = overrides.get(spec.name)
    if override is None:
        return base
    return base.model_copy(update=override.model_dump(exclude_none=True))


def check_inputs(reference: tuple[str, ...], variant: tuple[str, ...], name: str) -> None:
    if set(reference) != set(variant):
        raise InputMismatchError(
            f"{name} takes inputs {sorted(variant)} but the reference takes {sorted(reference)}",
            "export the variant from the same model and task, or rename its graph inputs to match",
        )


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity along the last axis (0 where a vector is zero)."""
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return np.sum(a * b, axis=-1) / np.maximum(norms, 1e-12)


@dataclass
class OutputParity:
    """Accumulates one output's comparison over batches; padded positions never count. `groups`: the ids of pairs
    that share a query, whose scores are ranked (`ranking_agreement`); `gated`: the output decides the verdict."""

    spec: OutputSpec
    tolerance: Tolerance
    groups: list[list[int]] = field(default_factory=list)
    gated: bool = True
    errors: list[np.ndarray] = field(default_factory=list)
    cosines: list[np.ndarray] = field(default_factory=list)
    agreements: list[np.ndarray] = field(default_factory=list)
    max_rel: float = 0.0
    tolerance_violations: int = 0
    non_finite: int = 0
    worst: WorstValue | None = None
    per_text: dict[int, dict[str, float]] = field(default_factory=dict)
    vectors: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # embeddings: text -> got, want
    terms: dict[int, tuple[Terms, Terms]] = field(default_factory=dict)  # sparse embeddings: text -> got, want
    width: int = 0  # a sparse embedding's vocabulary
    max_prob_shift: float = 0.0
    scores: dict[int, tuple[float, float]] = field(default_factory=dict)  # one-score outputs: text -> got, want

    def add(self, batch: str, text_ids: list[int], got: np.ndarray, want: np.ndarray, mask: np.ndarray) -> None:
        if got.shape != want.shape:
            raise ParityError(f"{self.spec.name}: shape {got.shape} differs from the reference {want.shape}",
                              "check that both models were exported for the same task and pooling",
                              "", self.spec.name, {"batch": batch})
        got64, want64 = got.astype(np.float64), want.astype(np.float64)
        valid = self._valid(mask, got.shape)
        finite = np.isfinite(got64)
        self.non_finite += int(np.count_nonzero(~finite & valid))
        diff = np.where(finite, np.abs(got64 - want64), np.inf)
        masked = np.where(valid, diff, 0.0)
        self.errors.append(diff[valid])
        rel = masked / np.maximum(np.abs(want64), 1e-6)
        self.max_rel = max(self.max_rel, float(rel.max(initial=0.0)))
        if self.tolerance.atol is not None:
            limit = self.tolerance.atol + (self.tolerance.rtol or 0.0) * np.abs(want64)
            self.tolerance_violations += int(np.count_nonzero(valid & (diff > limit)))
        self._track_worst(batch, text_ids, masked, got, want)
        row_err = masked.reshape(masked.shape[0], -1).max(axis=1)
        row_cos = np.full(len(text_ids), np.nan)
        if self.spec.kind in ("hidden", "embedding", "sparse"):
            cos = cosine(np.nan_to_num(got64), want64)
            self.cosines.append(cos[mask.astype(bool)] if self.spec.per_token else cos)
            row_cos = np.where(mask.astype(bool), cos, np.inf).min(axis=1) if self.spec.per_token else cos
            if self.spec.kind == "embedding":  # a text's last batch wins: the sweep, or the regrouped, hold it whole
                self.vectors.update({int(t): (g, w) for t, g, w in zip(text_ids, got64, want64)})
            if self.spec.kind == "sparse":  # the active terms alone: a vocabulary-wide row is mostly zeros
                self.width = got.shape[-1]
                self.terms.update({int(t): (terms(np.nan_to_num(g)), terms(w))
                                   for t, g, w in zip(text_ids, got64, want64)})
        else:
            agree = same_top(got64, want64)
            self.agreements.append(agree[mask.astype(bool)] if self.spec.per_token else agree)
            shift = np.abs(_softmax(np.nan_to_num(got64)) - _softmax(want64)).max(axis=-1)
            self.max_prob_shift = max(self.max_prob_shift, float(np.where(valid[..., 0], shift, 0.0).max()))
            if self.spec.kind == "scores" and self.groups and got.shape[-1] == 1:
                self.scores.update({int(t): (float(g), float(w)) for t, g, w in zip(text_ids, got64[:, 0],
                                                                                      want64[:, 0])})
        for text_id, err, cos in zip(text_ids, row_err, row_cos):
            seen = self.per_text.setdefault(int(text_id), {"max_abs": 0.0})
            seen["max_abs"] = max(seen["max_abs"], float(err))
            if not np.isnan(cos):
                seen["min_cosine"] = min(seen.get("min_cosine", 1.0), float(cos))

    @property
    def per_text_metric(self) -> str:
        return "1 - cosine" if self.spec.kind in ("hidden", "embedding", "sparse") else "max abs error"

    def per_text_error(self, text_id: int) -> float:
        stats = self.per_text[text_id]
        return 1.0 - stats["min_cosine"] if "min_cosine" in stats else stats["max_abs"]

    def hardest(self, count: int) -> list[int]:
        """Text ids with the worst per-text result (lowest cosine, else largest error), worst first."""
        return sorted(self.per_text, key=lambda i: -self.per_text_error(i))[:count]

    def _valid(self, mask: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        if not self.spec.per_token:
            return np.ones(shape, dtype=bool)
        return np.broadcast_to(mask.astype(bool).reshape(mask.shape + (1,) * (len(shape) - 2)), shape)

    def _track_worst(self, batch: str, text_ids: list[int], masked: np.ndarray, got: np.ndarray,
                     want: np.ndarray) -> None:
        flat = int(np.argmax(masked))
        value = float(masked.flat[flat])
        if self.worst is not None and value <= self.worst.abs_error:
            return
        index = np.unravel_index(flat, masked.shape)
        self.worst = WorstValue(batch=batch, row=int(index[0]), text_id=int(text_ids[index[0]]),
                                position=[int(i) for i in index[1:]], got=float(got[index]),
                                want=float(want[index]), abs_error=value)

    def summary(self) -> OutputResult:
        """The output's result over every batch added: errors, cosine or agreement, order metrics, its verdict."""
        errors = np.concatenate(self.errors) if self.errors else np.zeros(1)
        finite = errors[np.isfinite(errors)]
        mean_abs = float(finite.mean()) if finite.size else float("inf")
        result = OutputResult(
            kind=self.spec.kind, max_abs=float(errors.max()) if errors.size else 0.0, mean_abs=mean_abs,
            max_rel=self.max_rel,
            quantiles={f"p{q * 100:g}": float(np.quantile(finite, q)) if finite.size else float("inf")
                       for q in QUANTILES},
            non_finite=self.non_finite, compared_values=int(errors.size), worst=self.worst or WorstValue(),
            tolerance=self.tolerance.model_dump(exclude_none=True), loss=mean_abs, gated=self.gated)
        if self.cosines:
            cos = np.concatenate(self.cosines)
            result.min_cosine, result.mean_cosine = float(cos.min()), float(cos.mean())
            result.loss = 1.0 - float(cos.mean())
        if self.agreements:
            result.agreement = float(np.concatenate(self.agreements).mean())
            result.max_prob_shift = self.max_prob_shift
        if self.vectors:
            ids = sorted(self.vectors)
            retrieval = retrieval_agreement(np.stack([self.vectors[i][0] for i in ids]),
                                            np.stack([self.vectors[i][1] for i in ids]))
            if retrieval:
                result.retrieval = retrieval
        if self.terms:
            result.sparse = sparse_agreement({t: g for t, (g, _) in self.terms.items()},
                                             {t: w for t, (_, w) in self.terms.items()}, self.width)
        if self.scores:
            ranking = ranking_agreement({i: g for i, (g, _) in self.scores.items()},
                                        {i: w for i, (_, w) in self.scores.items()}, self.groups)
            if ranking:
                result.ranking = ranking
        result.failures = self._failures(result)
        result.passed = not result.failures
        result.violation = self._violation(result)
        return result

    def _failures(self, r: OutputResult) -> list[str]:
        tol, failures = self.tolerance, []
        if r.non_finite:
            failures.append(f"{r.non_finite} NaN/Inf values")
        if tol.atol is not None and self.tolerance_violations:
            failures.append(f"{self.tolerance_violations} values beyond atol {tol.atol:g} + rtol {tol.rtol or 0:g}"
                            f"*|ref| (max abs {r.max_abs:.3g})")
        if tol.min_cosine is not None and r.min_cosine is not None and not r.min_cosine >= tol.min_cosine:
            failures.append(f"min cosine {r.min_cosine:.6f} < {tol.min_cosine}")
        if tol.min_agreement is not None and r.agreement is not None and not r.agreement >= tol.min_agreement:
            failures.append(f"label agreement {r.agreement:.4f} < {tol.min_agreement}")
        for key, limit in _order_gates(tol):
            value = r.order.get(key)
            if value is not None and not value >= limit:
                failures.append(f"{key.replace('_', ' ')} {value:.4f} < {limit}")
        dots = (r.sparse or {}).get("dot_rel_error")
        if tol.max_dot_error is not None and dots is not None and not dots <= tol.max_dot_error:
            failures.append(f"dot product error {dots:.4g} > {tol.max_dot_error} of the largest reference score")
        return failures

    def _violation(self, r: OutputResult) -> float:
        """0 when passing, else how far past the tolerance (relative), summed over criteria; inf for NaN/Inf."""
        tol = self.tolerance
        if r.non_finite:
            return float("inf")
        total = 0.0
        if tol.atol is not None and self.tolerance_violations and r.max_abs is not None:
            total += max(0.0, r.max_abs - tol.atol) / max(tol.atol, 1e-12)
        if tol.min_cosine is not None and r.min_cosine is not None:
            total += max(0.0, tol.min_cosine - r.min_cosine) / max(1.0 - tol.min_cosine, 1e-12)
        if tol.min_agreement is not None and r.agreement is not None:
            total += max(0.0, tol.min_agreement - r.agreement) / max(1.0 - tol.min_agreement, 1e-12)
        for key, limit in _order_gates(tol):
            value = r.order.get(key)
            if value is not None:
                total += max(0.0, limit - value) / max(1.0 - limit, 1e-12)
        dots = (r.sparse or {}).get("dot_rel_error")
        if tol.max_dot_error is not None and dots is not None:
            total += max(0.0, dots - tol.max_dot_error) / max(tol.max_dot_error, 1e-12)
        return total


def _order_gates(tol: Tolerance) -> list[tuple[str, float]]:
    """The retrieval (embeddings) and ranking (rerankers) metrics this tolerance gates on, with their limits."""
    gates = {"agreement_at_1": tol.min_agreement_at_1, f"recall_at_{TOP_K}": tol.min_recall_at_10,
             "spearman": tol.min_spearman, "kendall_tau": tol.min_kendall_tau, "top_k_overlap": tol.min_top_k_overlap}
    return [(key, limit) for key, limit in gates.items() if limit is not None]


def verdict(outputs: dict[str, OutputResult]) -> Verdict:
    """Variant-level pass/fail and violation from the results of the outputs that gate; the others' failures are
    kept apart (`ungated`)."""
    gated = {name: o for name, o in outputs.items() if o.gated}
    return Verdict(passed=all(o.passed for o in gated.values()), violation=sum(o.violation for o in gated.values()),
                   failures=[f"{name}: {f}" for name, o in gated.items() for f in o.failures],
                   ungated=[f"{name}: {f}" for name, o in outputs.items() if not o.gated for f in o.failures],
                   outputs=outputs)


def raise_if_failed(variant: str, result: Verdict) -> None:
    """ParityError naming the worst failing output that gates, its input and both values."""
    failing = {name: o for name, o in result.outputs.items() if o.gated and not o.passed}
    if not failing:
        return
    name, out = max(failing.items(), key=lambda item: item[1].violation)
    w = out.worst
    raise ParityError(
        f"{variant} fails parity on {name}: {'; '.join(out.failures)}; worst value at text {w.text_id} "
        f"(batch {w.batch}, row {w.row}, position {w.position}): got {w.got}, reference {w.want}",
        "keep more nodes in higher precision (see the precision repair), or loosen `tolerances` in the config",
        variant, name, w.recorded(),
    )
