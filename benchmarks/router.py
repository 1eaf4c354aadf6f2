"""`pdserve bench router`: what the router itself costs.

Two measurements, each against separate processes on loopback:

- **Overhead** (`overhead_ms_p50`, `overhead_ms_p99`): one real colocated node (role
  `both`, a tiny generated checkpoint unless `--model`) and a router whose only decode node
  it is (no prefill node, so the router sends PrepareReceive with `local_prefill` and then
  StartGeneration: the node does exactly the work of a direct request). Each round sends
  the same one-token greedy request straight to the node (`Generation.Generate`) and
  through the router, in alternating order; the overhead is the router's time to first
  token minus the direct one, per round, so drift in the node's speed cancels out.
- **Rate** (`requests_per_s`): a router in front of fake Worker nodes that answer every
  call at once (`FastWorker`, one process serving as both prefill and decode), driven by
  `--concurrency` closed-loop clients for `--duration-s`: requests the router completes per
  second with the full disaggregated flow (RemoteSend sent early, DeliverWindow,
  PrepareReceive, StartGeneration with one token).

Prints one JSON object with `--json`, a short table otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from pdserve import process_gc
from pdserve.kvtransfer.window import resolve_kv_window_end
from pdserve.procs import NodeProcess, stop_all
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc


class FastWorker(pdserve_pb2_grpc.WorkerServicer):
    """A Worker that answers everything at once: one token per request, no model, no KV."""

    def __init__(self) -> None:
        self.windows: dict[str, asyncio.Future] = {}

    async def PrepareReceive(self, request, context):
        end = 0 if request.local_prefill else resolve_kv_window_end(
            request.kv_window_end, len(request.prompt_token_ids))
        return pdserve_pb2.PrepareReceiveResponse(
            request_id=request.request_id, kv_window_end=end, kv_append_metadata=[1, 0, end],
            lease_id="l", lease_ms=30_000, decode_agent_name="fast",
            lease_expires_unix_ms=int(time.time() * 1000) + 30_000)

    def _window(self, request_id: str) -> asyncio.Future:
        return self.windows.setdefault(request_id, asyncio.get_running_loop().create_future())

    async def RemoteSend(self, request, context):
        if request.window_follows:
            try:
                await asyncio.wait_for(self._window(request.request_id), 10)
            finally:
                self.windows.pop(request.request_id, None)
        return pdserve_pb2.RemoteSendResponse(request_id=request.request_id)

    async def DeliverWindow(self, request, context):
        future = self._window(request.request_id)
        if not future.done():
            future.set_result(None)
        return pdserve_pb2.DeliverWindowResponse(found=True)

    async def StartGeneration(self, request, context):
        yield pdserve_pb2.GenerateResponse(request_id=request.request_id, token_ids=[7],
                                           text="x", finish_reason="length")
        yield pdserve_pb2.GenerateResponse(request_id=request.request_id, usage=pdserve_pb2.Usage(
            prompt_tokens=8, completion_tokens=1, total_tokens=9))

    async def Abort(self, request, context):
        return pdserve_pb2.AbortResponse(found=False)

    async def GetLoad(self, request, context):
        return pdserve_pb2.LoadReport(role="both", free_pages=1024, total_pages=1024)


async def serve_fast_worker(port: int) -> None:
    server = grpc.aio.server()
    pdserve_pb2_grpc.add_WorkerServicer_to_server(FastWorker(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"pdserve fastworker listening on 127.0.0.1:{bound}", flush=True)
    await server.wait_for_termination()


# ---- processes --------------------------------------------------------------------------
def _tiny_model(root: str) -> str:
    from pdserve.engine.checkpoint import write_checkpoint

    write_checkpoint(root, family="llama", seed=0, vocab_size=512, hidden_size=64,
                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=512)
    return root


# ---- measurements -----------------------------------------------------------------------
async def _ttft(stub, prompt: list[int]) -> float:
    request = pdserve_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=pdserve_pb2.SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    first = None
    async for msg in stub.Generate(request, timeout=60):
        if first is None and msg.token_ids:
            first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


async def measure_overhead(node: str, router: str, rounds: int, prompt_len: int) -> dict:
    prompt = [(i * 7) % 500 + 3 for i in range(prompt_len)]
    async with grpc.aio.insecure_channel(node) as nch, grpc.aio.insecure_channel(router) as rch:
        direct, routed = pdserve_pb2_grpc.GenerationStub(nch), pdserve_pb2_grpc.GenerationStub(rch)
        for _ in range(5):  # warm both paths (channels, caches, the node's prefix cache)
            await _ttft(direct, prompt)
            await _ttft(routed, prompt)
        diffs, d_times, r_times = [], [], []
        for i in range(rounds):
            if i % 2:
                r = await _ttft(routed, prompt)
                d = await _ttft(direct, prompt)
            else:
                d = await _ttft(direct, prompt)
                r = await _ttft(routed, prompt)
            d_times.append(d)
            r_times.append(r)
            diffs.append(r - d)
    diffs.sort()
    return {"overhead_ms_p50": round(statistics.median(diffs) * 1000, 3),
            "overhead_ms_p99": round(diffs[min(len(diffs) - 1, int(len(diffs) * 0.99))] * 1000, 3),
            "direct_ttft_ms_p50": round(statistics.median(d_times) * 1000, 3),
            "router_ttft_ms_p50": round(statistics.median(r_times) * 1000, 3),
            "rounds": rounds}


async def measure_rate(router: str, concurrency: int, duration_s: float) -> dict:
    prompt = list(range(3, 35))
    done = 0
    errors = 0
    stop_at = time.perf_counter() + duration_s

    async def client(stub) -> None:
        nonlocal done, errors
        request = pdserve_pb2.GenerateRequest(prompt_token_ids=prompt,
                                              sampling=pdserve_pb2.SamplingParams(max_tokens=1))
        while time.perf_counter() < stop_at:
            try:
                async for _ in stub.Generate(request, timeout=30):
                    pass
                done += 1
            except grpc.aio.AioRpcError:
                errors += 1

    channels = [grpc.aio.insecure_channel(router) for _ in range(4)]
    try:
        stubs = [pdserve_pb2_grpc.GenerationStub(ch) for ch in channels]
        await _warm(stubs[0], prompt)
        start = time.perf_counter()
        stop_at = start + duration_s
        await asyncio.gather(*(client(stubs[i % len(stubs)]) for i in range(concurrency)))
        elapsed = time.perf_counter() - start
    finally:
        for ch in channels:
            await ch.close()
    return {"requests_per_s": round(done / elapsed, 1), "rate_requests": done,
            "rate_errors": errors, "concurrency": concurrency}


async def _warm(stub, prompt) -> None:
    request = pdserve_pb2.GenerateRequest(prompt_token_ids=prompt,
                                          sampling=pdserve_pb2.SamplingParams(max_tokens=1))
    for _ in range(20):
        async for _ in stub.Generate(request, timeout=30):
            pass


def run(args) -> dict:
    procs: list[NodeProcess] = []
    result: dict = {}

    def start(name: str, argv: list[str], module: str = "pdserve.cli") -> str:
        node = NodeProcess(argv, log=Path(tmp) / f"{name}.log", threads=1, module=module)
        procs.append(node)
        return node.wait_ready(120)

    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = args.model or _tiny_model(tmp)
            if not args.skip_overhead:
                node = start("node", ["serve", "--model", model, "--host", "127.0.0.1",
                                      "--port", "0", "--num-threads", "1", "--num-pages", "256",
                                      "--page-size", "8"])
                router = start("router", ["router", "--model", model, "--host", "127.0.0.1",
                                          "--port", "0", "--decode", node])
                result.update(asyncio.run(measure_overhead(node, router, args.rounds,
                                                           args.prompt_len)))
            if not args.skip_rate:
                fast = start("fast-worker", ["--fake-worker"], module="pdserve.benchmarks.router")
                router = start("router-rate", ["router", "--model", model, "--host", "127.0.0.1",
                                               "--port", "0", "--prefill", fast, "--decode", fast,
                                               "--log-level", "WARNING"])
                result.update(asyncio.run(measure_rate(router, args.concurrency, args.duration_s)))
            stop_all(procs)
    finally:
        stop_all(procs)
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench router", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--model", default=None,
                   help="checkpoint for the real node (default: a tiny generated one)")
    p.add_argument("--rounds", type=int, default=200,
                   help="direct/routed request pairs for the overhead (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=32,
                   help="prompt tokens of the overhead requests (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=32,
                   help="closed-loop clients for the rate (default: %(default)s)")
    p.add_argument("--duration-s", type=float, default=5.0,
                   help="how long the rate is measured (default: %(default)s)")
    p.add_argument("--skip-overhead", action="store_true", help="measure the rate only")
    p.add_argument("--skip-rate", action="store_true", help="measure the overhead only")
    p.add_argument("--fake-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.fake_worker:
        import uvloop

        uvloop.run(serve_fast_worker(args.port))
        return 0
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>22}  {value}")
    return 0


if __name__ == "__main__":
    process_gc.own_process()
    sys.exit(main())
