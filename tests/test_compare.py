from __future__ import annotations

import numpy as np
import pytest

from workbench.core.config import Tolerance
from workbench.precision.compare import OutputParity, check_inputs, raise_if_failed, tolerance_for, verdict
from workbench.precision.errors import InputMismatchError, ParityError
from workbench.precision.ranking import same_top
from workbench.tasks.registry import OutputSpec

HIDDEN = OutputSpec("token_embeddings", ("batch", "sequence", "hidden"), "hidden")
EMBEDDING = OutputSpec("sentence_embedding", ("batch", "hidden"), "embedding")
LOGITS = OutputSpec("logits", ("batch", "labels"), "logits")
TOKENS = OutputSpec("logits", ("batch", "sequence", "labels"), "token_logits")
RNG = np.random.default_rng(0)
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0]])


def test_padded_positions_never_count():
    want = RNG.normal(size=(2, 4, 8)).astype(np.float32)
    got = want.copy()
    got[MASK == 0] = 1e6  # garbage where the mask is 0
    got[0, 1, 3] += 0.01
    parity = OutputParity(HIDDEN, Tolerance(atol=0.02, min_cosine=0.99))
    parity.add("b", [10, 11], got, want, MASK)
    summary = parity.summary()
    assert summary.passed, summary.failures
    assert summary.max_abs == pytest.approx(0.01, rel=1e-3)
    assert summary.compared_values == 5 * 8
    assert summary.worst.recorded() == {
        "batch": "b", "row": 0, "text_id": 10, "position": [1, 3], "got": pytest.approx(float(got[0, 1, 3])),
        "want": pytest.approx(float(want[0, 1, 3])), "abs_error": pytest.approx(0.01, rel=1e-3)}


def test_nan_fails_with_a_count_and_infinite_violation():
    want = RNG.normal(size=(2, 8)).astype(np.float32)
    got = want.copy()
    got[1, 2] = np.nan
    parity = OutputParity(EMBEDDING, Tolerance(atol=0.1, min_cosine=0.9))
    parity.add("b", [0, 1], got, want, MASK)
    summary = parity.summary()
    assert not summary.passed
    assert summary.non_finite == 1 and "1 NaN/Inf values" in summary.failures
    assert summary.violation == float("inf")


def test_cosine_threshold_and_violation():
    want = RNG.normal(size=(4, 16))
    got = want + RNG.normal(scale=0.3, size=want.shape)
    parity = OutputParity(EMBEDDING, Tolerance(min_cosine=0.999))
    parity.add("b", [0, 1, 2, 3], got, want, np.ones((4, 5)))
    summary = parity.summary()
    cos = np.sum(got * want, 1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert summary.min_cosine == pytest.approx(cos.min())
    assert summary.failures == [f"min cosine {cos.min():.6f} < 0.999"]
    assert summary.violation == pytest.approx((0.999 - cos.min()) / 0.001)
    assert parity.hardest(1) == [int(np.argmin(cos))]


def test_label_agreement_for_sequence_and_token_logits():
    want = np.array([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    got = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    parity = OutputParity(LOGITS, Tolerance(min_agreement=0.9))
    parity.add("b", [0, 1], got, want, np.ones((2, 3)))
    assert parity.summary().agreement == 0.5
    tokens = OutputParity(TOKENS, Tolerance(min_agreement=1.0))
    want_t = RNG.normal(size=(2, 4, 3))
    got_t = want_t.copy()
    got_t[1, 3] = -want_t[1, 3]  # a padded position: ignored
    tokens.add("b", [0, 1], got_t, want_t, MASK)
    assert tokens.summary().agreement == 1.0 and tokens.summary().passed


def test_tolerance_defaults_and_overrides():
    assert tolerance_for(EMBEDDING, "int8", {}).min_cosine == 0.99
    assert tolerance_for(EMBEDDING, "int8", {}).atol is None
    merged = tolerance_for(EMBEDDING, "fp16", {"sentence_embedding": Tolerance(min_cosine=0.9)})
    assert (merged.min_cosine, merged.atol) == (0.9, 2e-2)


def test_parity_error_names_the_worst_output_and_values():
    want = np.zeros((2, 8))
    got = want.copy()
    got[1, 5] = 3.0
    parity = OutputParity(EMBEDDING, Tolerance(atol=0.1))
    parity.add("corpus_000", [7, 8], got, want, MASK)
    with pytest.raises(ParityError, match="fp32 fails parity on sentence_embedding.*text 8.*got 3.0, reference 0.0") \
            as info:
        raise_if_failed("fp32", verdict({"sentence_embedding": parity.summary()}))
    assert info.value.worst["position"] == [5] and info.value.output == "sentence_embedding"


def test_mismatched_input_names():
    with pytest.raises(InputMismatchError, match="takes inputs \\['attention_mask', 'input_ids'\\]"):
        check_inputs(("input_ids", "attention_mask", "token_type_ids"), ("input_ids", "attention_mask"), "roberta")


def test_retrieval_agreement_is_one_for_identical_embeddings_and_less_for_a_permutation():
    from workbench.precision.retrieval import retrieval_agreement

    corpus = RNG.normal(size=(40, 16))
    assert retrieval_agreement(corpus, corpus) == {"texts": 40, "agreement_at_1": 1.0, "recall_at_10": 1.0,
                                                   "spearman": pytest.approx(1.0)}
    shuffled = corpus[RNG.permutation(40)]  # every text now answers with another text's vector
    mixed = retrieval_agreement(shuffled, corpus)
    assert mixed["agreement_at_1"] < 0.5 and mixed["recall_at_10"] < 0.6 and mixed["spearman"] < 0.5
    assert retrieval_agreement(corpus[:10], corpus[:10]) is None  # no more texts than neighbours asked for


def test_a_retrieval_gate_fails_a_variant_whose_neighbours_change():
    want = RNG.normal(size=(30, 8))
    got = want + RNG.normal(scale=0.3, size=want.shape)  # cosine stays high, neighbours move
    gated = OutputParity(EMBEDDING, Tolerance(min_cosine=0.5, min_recall_at_10=0.99))
    gated.add("corpus", list(range(30)), got, want, np.ones((30, 4)))
    summary = gated.summary()
    recall = summary.retrieval["recall_at_10"]
    assert recall < 0.99 and summary.failures == [f"recall at 10 {recall:.4f} < 0.99"]
    assert summary.violation == pytest.approx((0.99 - recall) / 0.01)


def test_classifier_parity_reports_the_largest_probability_shift():
    want = np.array([[2.0, 0.0], [0.0, 0.0]])
    got = np.array([[2.0, 0.0], [1.0, 0.0]])  # second row: 0.5/0.5 -> 0.731/0.269
    parity = OutputParity(LOGITS, Tolerance(min_agreement=0.0))
    parity.add("b", [0, 1], got, want, MASK)
    assert parity.summary().max_prob_shift == pytest.approx(1 / (1 + np.exp(-1)) - 0.5)


def test_a_label_the_reference_scores_level_with_its_top_agrees_and_a_real_swap_does_not():
    want = np.array([[2.0, 2.0 - 1e-6, 0.0], [1.0, 0.5, 0.0]])
    assert same_top(np.array([[1.9, 2.1, 0.0], [1.0, 0.5, 0.0]]), want).tolist() == [True, True]
    assert same_top(np.array([[2.0, 0.0, 2.1], [0.5, 1.0, 0.0]]), want).tolist() == [False, False]
