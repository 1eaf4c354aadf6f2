"""The `pdserve` command line: servers, the `up` launcher, a client and benchmarks.

    pdserve router   --decode HOST:PORT [--prefill HOST:PORT ...]   client-facing router
    pdserve prefill  [--port P]                                     prefill worker
    pdserve decode   [--port P]                                     decode worker
    pdserve serve    [--port P]                                     colocated worker (role both)
    pdserve up       [--port P]            router + one prefill + one decode on localhost
    pdserve generate --server HOST:PORT --prompt TEXT               stream an answer
    pdserve bench engine|transfer|serve|router ...                  benchmarks
    pdserve health   [--server HOST:PORT]                           exit 0 if the node is SERVING

Every server takes `--model DIR`; without it, the built-in demo model is written once into
the cache (`engine.checkpoint.ensure_demo_model`) and used.

Every flag `--foo-bar` also reads the environment variable `PDSERVE_FOO_BAR` as its
default (`pdserve.envflags`); a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import sys

from pdserve.envflags import apply_env_defaults


def _model(args) -> str:
    if args.model:
        return args.model
    from engine.checkpoint import ensure_demo_model

    return str(ensure_demo_model())


def _add_server_flags(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face checkpoint directory (default: the built-in demo model)")
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=port,
                   help="gRPC port; 0 picks a free one (default: %(default)s)")
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests may take to finish while no "
                        "new work is accepted (default: %(default)s)")
    _add_log_flags(p)
    _add_tls_flags(p)


def _add_tls_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS (pdserve/tls.py; all optional, default plaintext)")
    g.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="this node's certificate: served on its endpoint and presented to the "
                        "nodes it calls (mutual TLS)")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    g.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="CA that signed the certificates of the nodes this process calls; "
                        "setting it turns on TLS for outgoing channels")
    g.add_argument("--tls-require-client-cert", action="store_true",
                   help="accept only callers with a certificate signed by --tls-ca (workers: "
                        "only the router and peer workers may call)")


def _configure_tls(args) -> None:
    if getattr(args, "tls_cert", None) or getattr(args, "tls_ca", None):
        from pdserve import tls

        tls.configure(tls.TLSConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca,
                                    require_client_cert=args.tls_require_client_cert))


def _add_log_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="log lines on stderr: text, or one JSON object a line (default: %(default)s)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="least severe log level shown (default: %(default)s)")


def _setup_logging(args) -> None:
    from pdserve.logs import setup_logging

    setup_logging(args.log_format, args.log_level)


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: %(default)s)")
    g.add_argument("--num-pages", type=int, default=None,
                   help="KV pages in the pool (default: as many as --kv-cache-mb holds)")
    g.add_argument("--kv-cache-mb", type=int, default=256,
                   help="memory for the KV pool when --num-pages is not given (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget of one engine step (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=64,
                   help="sequences running at once (default: %(default)s)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and KV dtype (default: %(default)s)")
    g.add_argument("--attention-backend", default="torch", choices=["torch", "triton"],
                   help="attention kernels: torch (CPU) or triton (GPU) (default: %(default)s)")
    g.add_argument("--no-prefix-cache", action="store_true", help="disable the prefix cache")
    g.add_argument("--num-threads", type=int, default=None,
                   help="torch threads for the engine (default: torch's choice)")
    g.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")


def _engine_config(args):
    from engine import EngineConfig

    return EngineConfig(
        model_dir=_model(args), page_size=args.page_size, num_pages=args.num_pages,
        kv_cache_memory_bytes=args.kv_cache_mb * 1024 * 1024,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        dtype=args.dtype, attention_backend=args.attention_backend,
        enable_prefix_cache=not args.no_prefix_cache, num_threads=args.num_threads,
        device=args.device)


def _add_prefill_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill role")
    g.add_argument("--transfer-timeout-s", type=float, default=30.0,
                   help="deadline of one KV write to a decode node (default: %(default)s)")
    g.add_argument("--max-in-flight", type=int, default=64,
                   help="RemoteSends worked on at once; more get RESOURCE_EXHAUSTED "
                        "(default: %(default)s)")
    # Test-only (hidden): make the phases of a RemoteSend long enough for fault tests to hit.
    g.add_argument("--debug-delay-prefill-ms", type=int, default=0, help=argparse.SUPPRESS)
    g.add_argument("--debug-delay-kv-write-ms", type=int, default=0, help=argparse.SUPPRESS)
    g.add_argument("--debug-delay-prefix", default="", help=argparse.SUPPRESS)


def _add_decode_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("decode role")
    g.add_argument("--lease-ms", type=int, default=30_000,
                   help="how long a reservation waits for StartGeneration when the router "
                        "asks for no lease (default: %(default)s)")
    g.add_argument("--notification-timeout-s", type=float, default=10.0,
                   help="how long StartGeneration waits for the prefill node's KV-ready "
                        "notification (default: %(default)s)")
    g.add_argument("--max-lease-ms", type=int, default=600_000,
                   help="longest lease a PrepareReceive may ask for (default: %(default)s)")
    g.add_argument("--quarantine-grace-ms", type=int, default=5_000,
                   help="a reservation freed before its KV arrived keeps its pages until the "
                        "prefill node's notification, or this long past its lease "
                        "(default: %(default)s)")
    g.add_argument("--max-parked", type=int, default=256,
                   help="reservations waiting for StartGeneration at once; more get "
                        "RESOURCE_EXHAUSTED (default: %(default)s)")


def _prefill_config(args):
    from prefill.config import PrefillConfig

    return PrefillConfig(engine=_engine_config(args), host=args.host, port=args.port,
                         transfer_timeout_s=args.transfer_timeout_s,
                         max_in_flight=args.max_in_flight, drain_timeout_s=args.drain_timeout_s,
                         debug_delay_prefill_ms=args.debug_delay_prefill_ms,
                         debug_delay_kv_write_ms=args.debug_delay_kv_write_ms,
                         debug_delay_prefix=args.debug_delay_prefix)


def _decode_config(args):
    from decode.config import DecodeConfig

    return DecodeConfig(engine=_engine_config(args), host=args.host, port=args.port,
                        lease_ms=args.lease_ms, notification_timeout_s=args.notification_timeout_s,
                        max_lease_ms=args.max_lease_ms,
                        quarantine_grace_ms=args.quarantine_grace_ms, max_parked=args.max_parked,
                        drain_timeout_s=args.drain_timeout_s)


def cmd_router(args) -> int:
    from pdserve.server import run
    from router.app import run_router
    from router.config import RouterConfig

    _setup_logging(args)
    config = RouterConfig(
        model=_model(args), prefill=_endpoints(args.prefill), decode=_endpoints(args.decode),
        host=args.host, port=args.port, http_port=args.http_port, kv_window_end=args.kv_window_end,
        prefill_policy=args.prefill_policy, decode_policy=args.decode_policy,
        lease_ms=args.lease_ms, remote_send_timeout_s=args.remote_send_timeout_s,
        generation_timeout_s=args.generation_timeout_s,
        max_prefill_attempts=args.max_prefill_attempts, full_retry_s=args.full_retry_s,
        max_concurrent_requests=args.max_concurrent_requests,
        max_queued_requests=args.max_queued_requests, health_interval_s=args.health_interval_s,
        drain_timeout_s=args.drain_timeout_s, prefix_load_tokens=args.prefix_load_tokens,
        min_remote_prefill_tokens=args.min_remote_prefill_tokens,
        prefill_saturated_queue=args.prefill_saturated_queue, auto_max_tail=args.auto_max_tail,
        overlap_prefill=not args.no_overlap_prefill, load_interval_s=args.load_interval_s,
        etcd=args.etcd, etcd_prefix=args.etcd_prefix)
    run(run_router(config))
    return 0


class _RouterParser(argparse.ArgumentParser):
    """`--decode` is required unless `--etcd` finds the decode nodes (either may come from
    its environment variable)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, rest = super().parse_known_args(args, namespace)
        if not namespace.decode and not namespace.etcd:
            self.error("the following arguments are required: --decode (or --etcd)")
        return namespace, rest


def _window_end(value: str):
    """`--kv-window-end`: an int (-k) or `auto`."""
    return value if value == "auto" else int(value)


def _add_membership_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("discovery (pdserve/membership.py)")
    g.add_argument("--etcd", default="", metavar="HOST:PORT",
                   help="register this node in etcd while it serves (default: no registration)")
    g.add_argument("--etcd-prefix", default="/pdserve/workers",
                   help="key prefix of the registrations (default: %(default)s)")
    g.add_argument("--etcd-ttl-s", type=int, default=5,
                   help="lease of the registration: a node that dies disappears within this "
                        "(default: %(default)s)")
    g.add_argument("--advertise-address", default="", metavar="HOST:PORT",
                   help="address registered for other nodes to reach (default: --host and the "
                        "bound port; the host's address when --host is 0.0.0.0)")


def _endpoints(values: list[str]) -> list[str]:
    return [e for v in values for e in v.split(",") if e]


def cmd_worker(args) -> int:
    from pdserve.server import run
    from pdserve.worker import MembershipConfig, run_worker

    prefill = _prefill_config(args) if args.command in ("prefill", "serve") else None
    decode = _decode_config(args) if args.command in ("decode", "serve") else None
    role = {"prefill": "prefill", "decode": "decode", "serve": "both"}[args.command]
    membership = MembershipConfig(args.etcd, args.etcd_prefix, args.etcd_ttl_s,
                                  args.advertise_address)
    _setup_logging(args)
    run(run_worker(role, prefill, decode, metrics_port=args.metrics_port, membership=membership))
    return 0


def cmd_up(args) -> int:
    from pdserve.up import UpConfig, up

    return up(UpConfig(model=_model(args), port=args.port, host=args.host,
                       prefill_port=args.prefill_port, decode_port=args.decode_port,
                       num_threads=args.num_threads, extra=args.worker_args,
                       http_port=args.http_port, prefill_metrics_port=args.prefill_metrics_port,
                       decode_metrics_port=args.decode_metrics_port, log_format=args.log_format))


def cmd_generate(args) -> int:
    import asyncio
    import json

    from pdserve.client import Client

    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)

    async def go() -> int:
        async with Client(args.server) as client:
            if args.json:
                out = await client.complete(args.prompt, timeout=args.timeout, **sampling)
                print(json.dumps(out.to_dict()))
                return 0
            async for msg in client.stream(args.prompt, timeout=args.timeout, **sampling):
                if msg.index == 0 and msg.text:
                    print(msg.text, end="", flush=True)
            print()
            return 0

    import grpc

    try:
        return asyncio.run(go())
    except grpc.aio.AioRpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1


def cmd_health(args) -> int:
    import os

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server = args.server or f"127.0.0.1:{os.environ.get('PDSERVE_PORT', '50051')}"
    try:
        with grpc.insecure_channel(server) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as err:
        print(f"{server}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{server}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_bench(args) -> int:
    if args.target == "engine":
        from engine.bench import main as bench_main
    elif args.target == "serve":
        from pdserve.bench.serve import main as bench_main
    elif args.target == "router":
        from router.bench import main as bench_main
    else:
        from kvtransfer.bench import main as bench_main
    return bench_main(args.bench_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("router", help="client-facing router over prefill and decode workers")
    p.__class__ = _RouterParser
    _add_server_flags(p, 50051)
    p.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT",
                   help="prefill worker endpoint (repeat or comma-separate for several)")
    p.add_argument("--http-port", type=int, default=None,
                   help="serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions, "
                        "/v1/models) and Prometheus /metrics over HTTP on this port; 0 picks a "
                        "free one (default: no HTTP server)")
    p.add_argument("--decode", action="append", default=[], metavar="HOST:PORT",
                   help="decode worker endpoint (repeat or comma-separate for several); "
                        "required unless --etcd finds them")
    p.add_argument("--etcd", default="", metavar="HOST:PORT",
                   help="watch the workers registered in this etcd server, live, in addition "
                        "to --prefill/--decode (default: none)")
    p.add_argument("--etcd-prefix", default="/pdserve/workers",
                   help="key prefix the workers register under (default: %(default)s)")
    p.add_argument("--kv-window-end", type=_window_end, default=-1,
                   help="end of the KV window the prefill node computes, Python-style: -1 = all "
                        "but the last prompt token, -k = the decode node prefills the last k; "
                        "auto = pick k from the load: the longer prefill queues are relative "
                        "to decode queues, the more of the tail the decode node prefills "
                        "(router/selective.py) (default: %(default)s)")
    policies = ["round_robin", "least_loaded", "prefix_aware"]
    p.add_argument("--prefill-policy", default="round_robin", choices=policies,
                   help="how to pick a prefill node: in turn, fewest queued requests, or "
                        "longest cached prefix weighed against load (router/policies.py) "
                        "(default: %(default)s)")
    p.add_argument("--decode-policy", default="round_robin", choices=policies,
                   help="how to pick a decode node (choices as --prefill-policy) "
                        "(default: %(default)s)")
    p.add_argument("--prefix-load-tokens", type=int, default=128,
                   help="prefix_aware: one queued request on a node weighs as much as this "
                        "many prompt tokens it would have to prefill (default: %(default)s)")
    p.add_argument("--min-remote-prefill-tokens", type=int, default=0,
                   help="selective disaggregation: when the decode node lacks at most this "
                        "many tokens of the KV window (after its cached prefix), it prefills "
                        "the prompt itself instead of a RemoteSend (default: %(default)s)")
    p.add_argument("--prefill-saturated-queue", type=int, default=64,
                   help="when every prefill node has at least this many requests queued, the "
                        "decode node prefills the prompt itself; 0 = never (default: %(default)s)")
    p.add_argument("--auto-max-tail", type=float, default=0.5,
                   help="--kv-window-end auto: largest fraction of the prompt the decode node "
                        "prefills itself (default: %(default)s)")
    p.add_argument("--no-overlap-prefill", action="store_true",
                   help="send RemoteSend only after PrepareReceive answered (default: send "
                        "them together so the prefill node computes while the decode node "
                        "reserves)")
    p.add_argument("--load-interval-s", type=float, default=0.1,
                   help="how often every node's load is polled while requests flow "
                        "(once a second when idle) (default: %(default)s)")
    p.add_argument("--lease-ms", type=int, default=30_000,
                   help="lease of a decode node's reservation (default: %(default)s)")
    p.add_argument("--remote-send-timeout-s", type=float, default=60.0,
                   help="deadline of a RemoteSend call (never past the lease) "
                        "(default: %(default)s)")
    p.add_argument("--generation-timeout-s", type=float, default=600.0,
                   help="deadline of a whole StartGeneration stream (default: %(default)s)")
    p.add_argument("--max-prefill-attempts", type=int, default=2,
                   help="prefill nodes tried for one request before the decode node prefills "
                        "it itself (default: %(default)s)")
    p.add_argument("--full-retry-s", type=float, default=5.0,
                   help="while every decode node is full, retry this long before "
                        "RESOURCE_EXHAUSTED (default: %(default)s)")
    p.add_argument("--max-concurrent-requests", type=int, default=256,
                   help="requests dispatched at once (default: %(default)s)")
    p.add_argument("--max-queued-requests", type=int, default=4096,
                   help="requests waiting for a turn; more get RESOURCE_EXHAUSTED "
                        "(default: %(default)s)")
    p.add_argument("--health-interval-s", type=float, default=1.0,
                   help="how often a node that failed is health-checked until it passes "
                        "(default: %(default)s)")
    p.set_defaults(func=cmd_router)

    for name, text in (("prefill", "prefill worker: RemoteSend"),
                       ("decode", "decode worker: PrepareReceive and StartGeneration"),
                       ("serve", "colocated worker (role both): serves Generation itself")):
        p = sub.add_parser(name, help=text)
        _add_server_flags(p, {"prefill": 50061, "decode": 50062, "serve": 50051}[name])
        _add_engine_flags(p)
        p.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus /metrics over HTTP on this port; 0 picks a free one "
                            "(default: none)")
        if name in ("prefill", "serve"):
            _add_prefill_flags(p)
        if name in ("decode", "serve"):
            _add_decode_flags(p)
        _add_membership_flags(p)
        p.set_defaults(func=cmd_worker)

    p = sub.add_parser("up", help="router + one prefill + one decode on localhost; Ctrl-C stops all")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument("--host", default="127.0.0.1", help="router bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=50051, help="router port (default: %(default)s)")
    p.add_argument("--prefill-port", type=int, default=0, help="prefill port; 0 = any free one")
    p.add_argument("--decode-port", type=int, default=0, help="decode port; 0 = any free one")
    p.add_argument("--num-threads", type=int, default=1,
                   help="torch threads per worker (default: %(default)s)")
    p.add_argument("--http-port", type=int, default=0,
                   help="router's OpenAI API and /metrics port; 0 = any free one, printed "
                        "(default: %(default)s)")
    p.add_argument("--prefill-metrics-port", type=int, default=None,
                   help="prefill worker's /metrics port (default: none)")
    p.add_argument("--decode-metrics-port", type=int, default=None,
                   help="decode worker's /metrics port (default: none)")
    _add_log_flags(p)
    p.add_argument("worker_args", nargs=argparse.REMAINDER,
                   help="after `--`: extra flags for both workers (e.g. -- --page-size 8)")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("generate", help="send one prompt to a router or colocated node")
    p.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT (default: %(default)s)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens to generate (server default 16)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (server default 1.0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (default off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible output")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token_ids, finish_reason, usage) at the end")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    _add_tls_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="benchmarks: `bench engine --help`, `bench transfer --help`, "
                                          "`bench serve --help`, `bench router --help`")
    p.add_argument("target", choices=["engine", "transfer", "serve", "router"],
                   help="what to benchmark")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="flags for that benchmark")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("health", help="exit 0 if a node's gRPC health service says SERVING "
                                      "(container health checks)")
    p.add_argument("--server", default=None, metavar="HOST:PORT",
                   help="node to ask (default: 127.0.0.1 and $PDSERVE_PORT, else 50051)")
    p.add_argument("--service", default="",
                   help="service name to check; empty = the whole node (default: empty)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds (default: %(default)s)")
    p.set_defaults(func=cmd_health)
    return apply_env_defaults(parser)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_tls(args)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
