"""Selective disaggregation: whether a request uses a prefill node at all, and how much of
the prompt's tail the decode node prefills itself.

The rule, decided per request once the decode node D is picked (`plan`):
1. No usable prefill node, or the client asked for `kv_window_end = 0`: D prefills the
   whole prompt (`local`, reason "no_prefill" / "requested").
2. The window end: `--kv-window-end -k` (D prefills the last k tokens), or in `auto` mode
   `k = 1 + floor((L - 1) * max_tail * Qp / (Qp + Qd + 1))`, where Qp and Qd are the mean
   queues of the usable prefill and decode nodes (`Endpoint.queue`) and `max_tail` is
   `--auto-max-tail` (default 0.5). Idle prefill nodes give k = 1 (D computes only the
   last token, the usual split); the longer prefill queues are relative to decode queues,
   the more of the tail D computes itself, up to `max_tail` of the prompt.
3. D is believed to hold `hit` tokens of the prompt (its prefix index). If what it lacks
   up to the window end, `end - hit`, is at most `--min-remote-prefill-tokens`, shipping it
   costs more round trips than computing it: D prefills it (`local`, "short_window").
4. Every usable prefill node is saturated: D prefills it (`local`, "prefill_saturated")
   instead of waiting in a prefill queue. Saturated: at least `--prefill-saturated-queue`
   requests, or work queued while its RemoteSends take at least `saturated_s`
   (`--prefill-saturated-wait-fraction` of the lease; `Endpoint.send_wait_s`): a send
   that outlives D's lease is prefill work thrown away, and D prefills the prompt then
   anyway. Once its queue drains, the node gets work again.
A local request reserves nothing up front; D submits it as an ordinary request that
reuses D's own prefix cache (PrepareReceive `local_prefill`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pdserve.kvtransfer.window import KVWindowError, resolve_kv_window_end

AUTO = "auto"


@dataclass(frozen=True)
class Plan:
    kv_window_end: int        # what PrepareReceive gets, as given (-k stays -k; 0 when local)
    end: int                  # the same, absolute (-1: out of range, D refuses it)
    local: bool = False       # D prefills the whole prompt; no RemoteSend
    reason: str = ""          # why local (RouteInfo.skip_reason)


def auto_tail(prompt_len: int, prefill_queue: float, decode_queue: float,
              max_tail: float = 0.5) -> int:
    """Tokens at the prompt's end that D prefills itself under the current load (>= 1)."""
    share = prefill_queue / (prefill_queue + decode_queue + 1.0)
    return 1 + int((prompt_len - 1) * max_tail * share)


def _mean_queue(endpoints: Sequence) -> float:
    return sum(e.queue for e in endpoints) / len(endpoints) if endpoints else 0.0


def plan(prompt_token_ids: Sequence[int], kv_window_end: int | str, decode, prefill_pool: Sequence,
         decode_pool: Sequence, min_remote_prefill_tokens: int = 0,
         prefill_saturated_queue: int = 0, max_tail: float = 0.5,
         saturated_s: float = 0.0) -> Plan:
    """The plan for one request on decode node `decode` (see the module docstring)."""
    n = len(prompt_token_ids)
    if not prefill_pool:
        return Plan(0, 0, True, "no_prefill")
    if kv_window_end == 0:
        return Plan(0, 0, True, "requested")
    if kv_window_end == AUTO:
        kv_window_end = -auto_tail(n, _mean_queue(prefill_pool), _mean_queue(decode_pool),
                                   max_tail)
    try:
        end = resolve_kv_window_end(kv_window_end, n)
    except KVWindowError:  # out of range: D answers INVALID_ARGUMENT naming it
        return Plan(kv_window_end, -1)
    if end == 0:  # a one-token prompt: nothing to send
        return Plan(0, 0, True, "short_window")
    hit = min(decode.prefixes.match(prompt_token_ids), end - 1)
    if end - hit <= min_remote_prefill_tokens:
        return Plan(0, 0, True, "short_window")
    if all(_saturated(e, prefill_saturated_queue, saturated_s) for e in prefill_pool):
        return Plan(0, 0, True, "prefill_saturated")
    return Plan(kv_window_end, end)


def _saturated(endpoint, queue_bound: int, latency_bound_s: float) -> bool:
    if queue_bound > 0 and endpoint.queue >= queue_bound:
        return True
    return latency_bound_s > 0 and endpoint.queue > 0 and \
        endpoint.send_wait_s >= latency_bound_s
