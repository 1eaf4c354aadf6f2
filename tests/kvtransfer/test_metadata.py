"""Compressed append metadata: round trips, fewest segments, and clear errors."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.kvtransfer.metadata import (
    AppendMetadataError,
    decode_append_metadata,
    decode_models,
    encode_append_metadata,
    encode_models,
    validate_append_metadata,
)

slot_lists = st.lists(st.integers(0, 500), unique=True, max_size=80)


def test_runs_of_consecutive_slots_become_segments():
    assert encode_append_metadata([4, 5, 6, 10, 11, 2]) == [3, 4, 3, 10, 2, 2, 1]
    assert encode_append_metadata([]) == [0]
    assert decode_append_metadata([2, 8, 2, 0, 1]) == [8, 9, 0]


@given(slot_lists)
def test_encode_then_decode_round_trips_with_fewest_segments(slots):
    meta = encode_append_metadata(slots)
    assert decode_append_metadata(meta) == slots
    breaks = sum(1 for a, b in zip(slots, slots[1:]) if b != a + 1)
    assert meta[0] == (breaks + 1 if slots else 0)
    assert validate_append_metadata(meta, len(slots), 501) == slots


@given(st.lists(slot_lists, max_size=3))
def test_multi_model_arrays_round_trip(per_model):
    flat = encode_models(per_model)
    assert decode_models(flat, len(per_model)) == per_model


@pytest.mark.parametrize("meta,tokens,slots,msg", [
    ([], 0, 10, "empty"),
    ([2, 0, 1], 1, 10, "must have 5 values"),
    ([-1], 0, 10, "num_segments"),
    ([1, -3, 2], 2, 10, "start must be >= 0"),
    ([1, 0, -2], -2, 10, "length must be >= 0"),
    ([1, 0, 3], 4, 10, "add up to 3"),
    ([1, 8, 3], 3, 10, "runs past the pool of 10"),
    ([2, 0, 3, 2, 2], 5, 10, "same slot"),
    ([1, 0, "3"], 3, 10, "must be an int"),
])
def test_malformed_metadata_is_rejected_with_a_clear_error(meta, tokens, slots, msg):
    with pytest.raises(AppendMetadataError, match=msg):
        validate_append_metadata(meta, tokens, slots)


def test_multi_model_decoding_rejects_short_or_trailing_input():
    with pytest.raises(AppendMetadataError, match="expected 2"):
        decode_models([1, 0, 2], 2)
    with pytest.raises(AppendMetadataError, match="trailing"):
        decode_models([1, 0, 2, 7], 1)
    with pytest.raises(AppendMetadataError, match="only 2 left"):
        decode_models([2, 0, 2], 1)
