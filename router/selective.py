"""Selective disaggregation: whether a request uses a prefill node at all, and how much of
the prompt's tail the decode node prefills itself.

The rule, decided per request once the decode node D is picked (`plan`):
1. No usable prefill node, or the client asked for `kv_window_end = 0`: D prefills the
   whole prompt (`local`, reason "no_prefill" / "requested"). So does a request that asks
   for its prompt's logprobs ("prompt_logprobs"): each prompt position's logits are only
   where it is computed, at the node that generates (engine/prompt_logprobs.py).
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
   Under `--disagg-policy steady` (the default) D takes it only while no stream runs
   there for its prefill to slow, and while it would finish no later than a prefill node:
   D's predicted time for its prompt backlog plus this prompt (`local_prefill_s`) at most
   the prefill nodes' `send_wait_s`. Otherwise the request waits at the router (`wait`,
   at most `--max-queue-wait-s`) and is planned again as reports arrive. `throughput`
   sends it to D regardless, as before: more requests per second, and token gaps up to
   D's inter-token latency target (its prefill goes in chunks, engine/step_budget.py).
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
    wait: bool = False        # steady: every side is saturated; plan again later


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
         saturated_s: float = 0.0, cache_salt: str = "", steady: bool = False,
         scores_prompt: bool = False) -> Plan:
    """The plan for one request on decode node `decode` (see the module docstring);
    `cache_salt`: the request's, under which D's prefix index is consulted."""
    n = len(prompt_token_ids)
    if not prefill_pool:
        return Plan(0, 0, True, "no_prefill")
    if kv_window_end == 0:
        return Plan(0, 0, True, "requested")
    if scores_prompt:
        return Plan(0, 0, True, "prompt_logprobs")
    if kv_window_end == AUTO:
        kv_window_end = -auto_tail(n, _mean_queue(prefill_pool), _mean_queue(decode_pool),
                                   max_tail)
    try:
        end = resolve_kv_window_end(kv_window_end, n)
    except KVWindowError:  # out of range: D answers INVALID_ARGUMENT naming it
        return Plan(kv_window_end, -1)
    if end == 0:  # a one-token prompt: nothing to send
        return Plan(0, 0, True, "short_window")
    hit = min(decode.prefixes.match(prompt_token_ids, cache_salt), end - 1)
    if end - hit <= min_remote_prefill_tokens:
        return Plan(0, 0, True, "short_window")
    if all(_saturated(e, prefill_saturated_queue, saturated_s) for e in prefill_pool):
        if steady and not _absorbs(decode, n, prefill_pool):
            return Plan(kv_window_end, end, wait=True)
        return Plan(0, 0, True, "prefill_saturated")
    return Plan(kv_window_end, end)


def _saturated(endpoint, queue_bound: int, latency_bound_s: float) -> bool:
    if queue_bound > 0 and endpoint.queue >= queue_bound:
        return True
    return latency_bound_s > 0 and endpoint.queue > 0 and \
        endpoint.send_wait_s >= latency_bound_s


def _absorbs(decode, prompt_len: int, prefill_pool: Sequence) -> bool:
    """D has no stream its chunks would slow, and would finish prefilling this prompt no
    later than a prefill node would answer (unmeasured D: yes, so it learns what a prompt
    costs)."""
    if decode.steps is not None and decode.steps.num_decoding > 0:
        return False
    local_s = local_prefill_s(decode.steps, prompt_len)
    return local_s is None or local_s <= min(e.send_wait_s for e in prefill_pool)


def local_prefill_s(steps, prompt_len: int) -> float | None:
    """How long a decode node would take to prefill its prompt backlog and then `prompt_len`
    tokens, in chunks that keep its streams' target gaps; None: unmeasured. `steps`: its
    last LoadReport (the step fields), or None."""
    if steps is None or steps.prompt_token_ms <= 0:
        return None
    seconds = (steps.prompt_backlog_tokens + prompt_len) * steps.prompt_token_ms / 1e3
    if steps.num_decoding and steps.itl_target_ms > steps.decode_step_ms:  # chunks share steps
        seconds *= steps.itl_target_ms / (steps.itl_target_ms - steps.decode_step_ms)
    return seconds
