"""Compressed append metadata: the decode node's reserved slots as runs.

The slots reserved for a KV window, in token order, are written as
``[num_segments, start_1, len_1, ..., start_k, len_k]``: each segment is a run of
consecutive slots. Invariants of a valid array for a window of ``n`` tokens in a pool of
``num_slots`` slots: its length is ``1 + 2 * num_segments``; starts and lengths are
non-negative ints; lengths add up to ``n``; every slot lies in ``[0, num_slots)``; no slot
appears twice. ``encode_append_metadata`` emits the fewest segments (maximal runs, no empty
segment). Several models (a draft model gets its own pool) concatenate their arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class AppendMetadataError(ValueError):
    """Malformed append metadata; the message names the offending value."""


def encode_append_metadata(slots: Sequence[int]) -> list[int]:
    """Compress ``slots`` (token order) into ``[nseg, start_1, len_1, ...]``."""
    arr = np.asarray(slots, dtype=np.int64).reshape(-1)
    if arr.size == 0:
        return [0]
    if (arr < 0).any():
        raise AppendMetadataError(f"slots must be non-negative, got {int(arr.min())}")
    starts_idx = np.flatnonzero(np.diff(arr) != 1) + 1
    starts_idx = np.concatenate(([0], starts_idx))
    lengths = np.diff(np.concatenate((starts_idx, [arr.size])))
    out = np.empty(1 + 2 * starts_idx.size, dtype=np.int64)
    out[0] = starts_idx.size
    out[1::2] = arr[starts_idx]
    out[2::2] = lengths
    return out.tolist()


def _segments(meta: Sequence[int]) -> np.ndarray:
    """Check the shape of ``meta`` and return its segments as an ``[nseg, 2]`` array."""
    if isinstance(meta, (str, bytes)):
        raise AppendMetadataError(f"append metadata must be a list of ints, got {meta!r}")
    items = list(meta)
    for i, v in enumerate(items):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise AppendMetadataError(f"append metadata[{i}] must be an int, got {v!r}")
    if not items:
        raise AppendMetadataError("append metadata is empty: expected [num_segments, ...]")
    nseg = int(items[0])
    if nseg < 0:
        raise AppendMetadataError(f"num_segments must be >= 0, got {nseg}")
    if len(items) != 1 + 2 * nseg:
        raise AppendMetadataError(
            f"append metadata with num_segments={nseg} must have {1 + 2 * nseg} "
            f"values, got {len(items)}"
        )
    seg = np.asarray(items[1:], dtype=np.int64).reshape(nseg, 2)
    bad = np.flatnonzero(seg[:, 0] < 0)
    if bad.size:
        raise AppendMetadataError(f"segment {int(bad[0])} start must be >= 0, got {int(seg[bad[0], 0])}")
    bad = np.flatnonzero(seg[:, 1] < 0)
    if bad.size:
        raise AppendMetadataError(f"segment {int(bad[0])} length must be >= 0, got {int(seg[bad[0], 1])}")
    return seg


def _expand(seg: np.ndarray) -> np.ndarray:
    lengths = seg[:, 1]
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    # slot = start of its segment + index within the segment, built without a Python loop
    seg_of = np.repeat(np.arange(seg.shape[0]), lengths)
    first = np.cumsum(lengths) - lengths
    return seg[seg_of, 0] + (np.arange(total) - first[seg_of])


def decode_append_metadata(meta: Sequence[int]) -> list[int]:
    """Expand ``[nseg, start_1, len_1, ...]`` back into the slot list (token order)."""
    return _expand(_segments(meta)).tolist()


def validate_append_metadata(meta: Sequence[int], expected_tokens: int, num_slots: int) -> list[int]:
    """Raise ``AppendMetadataError`` unless ``meta`` is valid for the window; return its slots."""
    seg = _segments(meta)
    total = int(seg[:, 1].sum())
    if total != expected_tokens:
        raise AppendMetadataError(
            f"segment lengths add up to {total}, but the window has {expected_tokens} tokens"
        )
    ends = seg[:, 0] + seg[:, 1]
    bad = np.flatnonzero((seg[:, 1] > 0) & (ends > num_slots))
    if bad.size:
        i = int(bad[0])
        raise AppendMetadataError(
            f"segment {i} (start={int(seg[i, 0])}, length={int(seg[i, 1])}) runs past "
            f"the pool of {num_slots} slots"
        )
    slots = _expand(seg)
    if slots.size and np.unique(slots).size != slots.size:
        raise AppendMetadataError("append metadata names the same slot more than once")
    return slots.tolist()


def encode_models(slot_lists: Sequence[Sequence[int]]) -> list[int]:
    """Concatenate one metadata array per model (in model order)."""
    flat: list[int] = []
    for slots in slot_lists:
        flat.extend(encode_append_metadata(slots))
    return flat


def decode_models(flat: Sequence[int], num_models: int) -> list[list[int]]:
    """Split a concatenation of ``num_models`` arrays and expand each into its slots."""
    items = list(flat)
    out: list[list[int]] = []
    pos = 0
    for m in range(num_models):
        if pos >= len(items):
            raise AppendMetadataError(
                f"append metadata holds {m} model(s), expected {num_models}"
            )
        nseg = items[pos]
        if isinstance(nseg, bool) or not isinstance(nseg, (int, np.integer)) or nseg < 0:
            raise AppendMetadataError(f"model {m}: num_segments must be an int >= 0, got {nseg!r}")
        end = pos + 1 + 2 * int(nseg)
        if end > len(items):
            raise AppendMetadataError(
                f"model {m}: num_segments={nseg} needs {2 * int(nseg)} values, "
                f"only {len(items) - pos - 1} left"
            )
        out.append(decode_append_metadata(items[pos:end]))
        pos = end
    if pos != len(items):
        raise AppendMetadataError(
            f"append metadata has {len(items) - pos} trailing value(s) after {num_models} model(s)"
        )
    return out
