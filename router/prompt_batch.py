"""A completions request with several prompts (OpenAI's batch `prompt`): each prompt is its
own request, and their response streams merge into one, shaped as a single request's.

Invariants:
- Prompt `i`'s choice `j` comes back as choice `i * n + j`, OpenAI's order.
- Nothing is passed on until every prompt's first message has come, so a prompt the nodes
  refuse (no room, no node) fails the whole call with its status before the body starts;
  the prompts already running are then aborted.
- Each prompt's stream runs whole in its own task, so a cancellation (the client left, or a
  failure elsewhere in the batch) reaches the dispatcher as a caller going away: it aborts
  the prompt on every node holding it.
- The usage of the prompts arrives once, at the end: token counts summed, timings those of
  the slowest prompt.

`truncated` cuts each prompt of a request to its last tokens first, as vLLM's
`truncate_prompt_tokens` asks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pdserve.proto import pdserve_pb2
from pdserve.router.openai_protocol import invalid

# Usage fields that add up over the batch; every other number is a time, of which the
# batch reports its slowest prompt's.
COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_prompt_tokens")
TIMES = ("time_to_first_token_s", "queue_time_s", "time_per_output_token_s",
         "time_per_output_token_p90_s", "prefill_time_s", "kv_transfer_time_s")


async def merged(streams: list[AsyncIterator], n: int, request_id: str
                 ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """Every prompt's messages as they come, renumbered, then one usage for the batch."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(i, s, queue)) for i, s in enumerate(streams)]
    usages: list[pdserve_pb2.Usage] = []
    held: list[pdserve_pb2.GenerateResponse] | None = []  # None once every prompt began
    started, live = set(), len(streams)
    try:
        while live:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            started.add(i)
            if item is None:
                live -= 1
            elif item.HasField("usage"):
                usages.append(item.usage)
            else:
                out = pdserve_pb2.GenerateResponse()
                out.CopyFrom(item)
                out.index = i * n + item.index
                if held is None:
                    yield out
                else:
                    held.append(out)
            if held is not None and len(started) == len(streams):
                for out in held:
                    yield out
                held = None
        yield pdserve_pb2.GenerateResponse(request_id=request_id, usage=batch_usage(usages))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(i: int, stream: AsyncIterator, queue: asyncio.Queue) -> None:
    """Prompt `i`'s messages into `queue`, then None, or the error that ended it."""
    try:
        async for msg in stream:
            queue.put_nowait((i, msg))
    except Exception as err:  # a NodeError, or a bug: the batch fails with it
        queue.put_nowait((i, err))
        return
    queue.put_nowait((i, None))


def batch_usage(usages: list[pdserve_pb2.Usage]) -> pdserve_pb2.Usage:
    total = pdserve_pb2.Usage()
    for u in usages:
        for name in COUNTS:
            setattr(total, name, getattr(total, name) + getattr(u, name))
        for name in TIMES:
            setattr(total, name, max(getattr(total, name), getattr(u, name)))
    return total


def truncated(body: dict, prompts: list[list[int]], max_model_len: int) -> list[list[int]]:
    """vLLM's `truncate_prompt_tokens` k: each prompt keeps its last k tokens (-1: the
    model's context); the shortened prompt is the one checked, served and counted."""
    k = body.get("truncate_prompt_tokens")
    if k is None:
        return prompts
    if not isinstance(k, int) or isinstance(k, bool) or not (k >= 1 or k == -1):
        raise invalid(f"truncate_prompt_tokens must be -1 (the model's context) or an integer >= 1, "
                      f"got {k!r:.80}", "truncate_prompt_tokens")
    if body.get("echo"):  # the echoed text is the prompt as sent, which this would contradict
        raise invalid("truncate_prompt_tokens cannot be combined with echo: send the prompt you want "
                      "echoed", "truncate_prompt_tokens")
    keep = max_model_len if k == -1 else k
    return [ids[-keep:] for ids in prompts]
