from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.core.config import ShapeRange
from workbench.graphs.profiles import bucket_edges, design_profiles, padding_waste, profile_for
from workbench.graphs.tables import ShapeProfile

BATCH = ShapeRange(min=1, opt=8, max=32)
SEQUENCE = ShapeRange(min=1, opt=128, max=256)
lengths = st.lists(st.integers(min_value=2, max_value=400), min_size=1, max_size=300).map(np.array)


@settings(max_examples=150, deadline=None)
@given(lengths, st.integers(min_value=1, max_value=6))
def test_every_length_fits_and_ranges_are_ordered(values, buckets):
    profiles = design_profiles(values, buckets, BATCH, SEQUENCE)
    assert 1 <= len(profiles) <= buckets
    for profile in profiles:
        assert profile.batch == [1, 8, 32]
        low, opt, high = profile.sequence
        assert low <= opt <= high
    assert profiles[0].sequence[0] == SEQUENCE.min and profiles[-1].sequence[2] == SEQUENCE.max
    for before, after in zip(profiles, profiles[1:]):
        assert after.sequence[0] == before.sequence[2] + 1, "contiguous, no gaps"
    for length in np.clip(values, SEQUENCE.min, SEQUENCE.max):
        assert profile_for(profiles, 1, int(length)) is not None


@settings(max_examples=100, deadline=None)
@given(lengths, st.integers(min_value=2, max_value=5))
def test_more_buckets_never_pad_more(values, buckets):
    def padded(edges):
        return sum(min(e for e in edges if e >= v) - v for v in values)

    assert padded(bucket_edges(values, buckets)) <= padded(bucket_edges(values, 1))
    assert padded(bucket_edges(values, buckets)) <= padded(bucket_edges(values, buckets - 1))


def test_bucket_edges_are_optimal_on_a_small_case():
    # Two clusters: 5x length 10, 5x length 100. Two buckets pad nothing.
    values = np.array([10] * 5 + [100] * 5)
    assert bucket_edges(values, 2) == [10, 100]
    assert bucket_edges(values, 1) == [100]


def test_padding_waste_numbers():
    values = np.array([10, 10, 100, 100])
    one = [ShapeProfile(batch=[1, 2, 2], sequence=[1, 100, 100])]
    two = [ShapeProfile(batch=[1, 2, 2], sequence=[1, 16, 16]),
           ShapeProfile(batch=[1, 2, 2], sequence=[17, 100, 100])]
    # One profile, batches of 2 in arrival order: [10, 10] and [100, 100]: no padding at all.
    assert padding_waste(values, one, 2)["dynamic"] == 0.0
    assert padding_waste(values, one, 2)["to_profile_max"] == 1 - 220 / 400
    assert padding_waste(values, two, 2)["to_profile_max"] == 1 - 220 / 232
    mixed = np.array([10, 100, 10, 100])
    assert padding_waste(mixed, one, 2)["dynamic"] == 1 - 220 / 400
    assert padding_waste(mixed, two, 2)["dynamic"] == 0.0


def test_texts_beyond_the_range_are_clipped_to_it():
    profiles = design_profiles(np.array([5, 600]), 2, BATCH, ShapeRange(min=1, opt=128, max=512))
    assert profiles[-1].sequence[2] == 512


def test_a_profiles_batches_stay_within_the_token_budget():
    """Long buckets get fewer texts: a batch at a profile's max (and at its opt) holds at most max_tokens padded
    tokens, one text at least; short buckets keep the run's batch range."""
    long = ShapeRange(min=1, opt=512, max=8192)
    profiles = design_profiles(np.array([20] * 50 + [3000] * 5 + [8000]), 3, BATCH, long, max_tokens=16384)
    assert [p.batch for p in profiles] == [[1, 8, 32], [1, 5, 5], [1, 2, 2]]
    for profile in profiles:
        assert profile.batch[2] * profile.sequence[2] <= 16384 or profile.batch[2] == 1
        assert profile.batch[1] * profile.sequence[1] <= 16384
    [alone] = design_profiles(np.array([8000]), 1, BATCH, long, max_tokens=4096)
    assert alone.batch == [1, 1, 1], "a text longer than the budget still runs, alone"
