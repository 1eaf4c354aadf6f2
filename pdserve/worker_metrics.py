"""Metrics and request logs at a worker's gRPC edge, without touching the roles.

`ObservedWorkerServicer` is the Worker service with every request-carrying RPC watched:
- PrepareReceive (decode): prefix-cache lookup (prompt tokens) and hit (matched tokens);
  its duration is kept for the request's log line. A failure ends the request on this node:
  counted and logged at once.
- RemoteSend (prefill): one KV transfer (bytes, descriptors, duration, bandwidth, prefill
  time), the prefill node's own prefix hit, and the request's log line.
- StartGeneration (decode): TTFT / TPOT / end-to-end and the outcome (`StreamObserver`),
  logged with the PrepareReceive timing.
`ObservedColocatedServicer` watches Generate on a `both` node the same way.
`worker_refresh` samples the gauges (pages, queues, leases) when /metrics is scraped, so
an idle node does no periodic work.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict

from pdserve import metrics
from pdserve.colocated import ColocatedGenerationServicer
from pdserve.logs import log_request
from pdserve.observe import StreamObserver, outcome_of
from pdserve.worker import WorkerServicer
from proto import pdserve_pb2

# PrepareReceive facts wait here for the request's StartGeneration; bounded, because a
# reservation may never be started (lease expiry, abort).
_MAX_PREPARED = 10_000


class ObservedWorkerServicer(WorkerServicer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._prepared: OrderedDict[str, dict] = OrderedDict()

    async def PrepareReceive(self, request, context):
        started = time.perf_counter()
        try:
            reply = await super().PrepareReceive(request, context)
        except BaseException as err:
            outcome = outcome_of(err, context)
            metrics.REQUESTS.labels(role="decode", outcome=outcome).inc()
            log_request("decode", request.request_id, outcome, phase="PrepareReceive",
                        error=context.details() or str(err))
            raise
        metrics.record_prefix_lookup("decode", len(request.prompt_token_ids),
                                     reply.prefix_matched_length)
        self._prepared[request.request_id] = {
            "prepare_receive_s": time.perf_counter() - started,
            "prefix_matched": reply.prefix_matched_length,
            "kv_window_end": reply.kv_window_end}
        while len(self._prepared) > _MAX_PREPARED:
            self._prepared.popitem(last=False)
        return reply

    async def RemoteSend(self, request, context):
        started = time.perf_counter()
        try:
            reply = await super().RemoteSend(request, context)
        except BaseException as err:
            outcome = outcome_of(err, context)
            metrics.KV_TRANSFERS.labels(outcome=outcome).inc()
            metrics.REQUESTS.labels(role="prefill", outcome=outcome).inc()
            log_request("prefill", request.request_id, outcome, error=context.details() or str(err),
                        remote_send_s=time.perf_counter() - started)
            raise
        metrics.record_transfer(reply.num_bytes, reply.num_descriptors, reply.num_tokens_sent,
                                reply.prefill_s, reply.transfer_s)
        metrics.record_prefix_lookup("prefill", request.kv_window_end, reply.prefill_cached_tokens)
        metrics.REQUESTS.labels(role="prefill", outcome="ok").inc()
        log_request("prefill", request.request_id, "ok",
                    kv_window=f"{request.kv_window_begin}:{request.kv_window_end}",
                    prefill_cached_tokens=reply.prefill_cached_tokens, prefill_s=reply.prefill_s,
                    transfer_s=reply.transfer_s, remote_send_s=time.perf_counter() - started,
                    kv_bytes=reply.num_bytes, kv_descriptors=reply.num_descriptors)
        return reply

    async def StartGeneration(self, request, context):
        prepared = self._prepared.pop(request.request_id, {})
        observer = StreamObserver("decode", request.request_id, **prepared,
                                  kv_expected=request.expect_kv_notification)
        async for msg in observer.watch(super().StartGeneration(request, context), context):
            yield msg

    async def Abort(self, request, context):
        self._prepared.pop(request.request_id, None)
        return await super().Abort(request, context)


class ObservedColocatedServicer(ColocatedGenerationServicer):
    async def Generate(self, request, context):
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        observer = StreamObserver("both", request.request_id)
        async for msg in observer.watch(super().Generate(request, context), context):
            yield msg
        if observer.usage is not None:
            u = observer.usage
            metrics.record_prefix_lookup("both", u.prompt_tokens, u.cached_prompt_tokens)


async def worker_refresh(servicer: WorkerServicer) -> None:
    """Sample this node's gauges: KV pages, queue depths, expired leases."""
    report = await servicer.GetLoad(pdserve_pb2.LoadRequest(), None)
    waiting, running = await servicer.engine.run(
        lambda e: (len(e.scheduler.waiting), len(e.scheduler.running)))
    role = servicer.role
    metrics.set_pages(role, report.free_pages, report.total_pages)
    depth = metrics.QUEUE_DEPTH
    depth.labels(role=role, queue="waiting").set(waiting)
    depth.labels(role=role, queue="running").set(running)
    if servicer.decode is not None:
        depth.labels(role=role, queue="parked").set(report.num_parked)
        metrics.LEASES_EXPIRED.set(report.leases_expired_total)
    if servicer.prefill is not None:
        depth.labels(role=role, queue="remote_send").set(len(servicer.prefill.role.in_flight))
