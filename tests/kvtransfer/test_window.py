"""KV window resolution: Python-style negatives, and 0 <= begin < end < length."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.kvtransfer.window import KVWindowError, resolve_kv_window, resolve_kv_window_end


def test_negative_values_count_from_the_end():
    assert resolve_kv_window(0, -1, 10) == (0, 9)
    assert resolve_kv_window(-5, -2, 10) == (5, 8)
    assert resolve_kv_window_end(-1, 10) == 9
    assert resolve_kv_window_end(3, 10) == 3


@pytest.mark.parametrize("begin,end,length", [(0, 10, 10), (5, 5, 10), (6, 5, 10), (-11, 5, 10),
                                              (0, -11, 10), (0, 0, 1), (0, 1, 0)])
def test_window_outside_the_prompt_is_rejected_naming_the_values(begin, end, length):
    with pytest.raises(KVWindowError) as err:
        resolve_kv_window(begin, end, length)
    assert str(length) in str(err.value)
    assert isinstance(err.value, ValueError)


def test_window_end_must_leave_the_last_token():
    with pytest.raises(KVWindowError, match="kv_window_end=10"):
        resolve_kv_window_end(10, 10)
    with pytest.raises(KVWindowError):
        resolve_kv_window_end(-11, 10)


def test_non_int_values_are_rejected():
    with pytest.raises(KVWindowError):
        resolve_kv_window(0, True, 5)
    with pytest.raises(KVWindowError):
        resolve_kv_window(0.0, 2, 5)


@given(st.integers(-50, 50), st.integers(-50, 50), st.integers(1, 40))
def test_resolved_windows_always_satisfy_the_invariant(begin, end, length):
    try:
        b, e = resolve_kv_window(begin, end, length)
    except KVWindowError:
        b0 = begin + length if begin < 0 else begin
        e0 = end + length if end < 0 else end
        assert not (0 <= b0 < e0 < length)
    else:
        assert 0 <= b < e < length
        assert list(range(length))[begin:end] == list(range(b, e))
