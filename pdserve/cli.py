"""The `pdserve` command line: servers, the `up` launcher, a client and benchmarks.

    pdserve router   --decode HOST:PORT [--prefill HOST:PORT ...]   client-facing router
    pdserve prefill  [--port P]                                     prefill worker
    pdserve decode   [--port P]                                     decode worker
    pdserve serve    [--port P] [--http-port H]                     colocated worker (role both)
    pdserve up       [--port P] [--dtype T] [-- FLAGS]  router + one prefill + one decode on localhost
    pdserve generate --server HOST:PORT --prompt TEXT [--n N]       stream an answer (pdserve.generate_cli)
    pdserve chat     --server HOST:PORT [--system TEXT]             chat in the terminal
    pdserve bench engine|step|transfer|ttft|serve|router|score|constrained|priority|cache-key|load ...  benchmarks
    pdserve health   [--server HOST:PORT]                           exit 0 if the node is SERVING
    pdserve models   list|fetch|path [NAME]                         the known models

Every server takes `--model NAME|DIR`: a checkpoint directory or a known model name
(`pdserve models list`); the default, smollm2-135m-instruct, is fetched and converted once
into the cache on first use (`pdserve.models`). A server's flags are the
fields of its configuration dataclasses (`runtime.options`): each flag's default and help
are written once, on its field.

Every flag `--foo-bar` also reads the environment variable `PDSERVE_FOO_BAR` as its
default (`pdserve.envflags`); a flag on the command line wins.

Keys (runtime/auth.py, pdserve/credentials.py): every server takes `--cluster-key-file`
(Worker calls between nodes), the router and `serve` also `--api-key-file` (what clients
must send), which `generate` and `chat` take to send it. A server sets its keys up at
start, with its caller role (router or worker).
"""

from __future__ import annotations

import argparse
import sys

from pdserve import process_gc
from pdserve.envflags import apply_env_defaults

BENCHMARKS = {name: "pdserve.benchmarks." + {"host": "host_step", "cache-key": "cache_key"}.get(name, name)
              for name in ("engine", "transfer", "serve", "router", "step", "chaos", "trust", "ttft", "gpu",
                           "host", "score", "constrained", "priority", "cache-key", "lora", "window", "load",
                           "start")}
WORKER_COMMANDS = {"prefill": "prefill", "decode": "decode", "serve": "both"}


def _model(args) -> str:
    from pdserve.models_cli import model_or_exit

    return model_or_exit(args.model, weights=args.command != "router")  # the router: no weights


# Every flag that names a port a server command listens on. `up`'s workers listen on
# loopback, the rest on --host.
PORT_FLAGS = ("port", "http_port", "metrics_port", "prefill_port", "decode_port",
              "prefill_metrics_port", "decode_metrics_port")


def _ports_or_exit(args) -> None:
    """Before anything loads: exit 1 with one line if a port this command listens on is
    taken (runtime/ports.py)."""
    from pdserve.runtime.ports import first_clash

    def host(name: str) -> str:
        return "127.0.0.1" if args.command == "up" and name.startswith(("prefill", "decode")) \
            else args.host

    clash = first_clash([(host(name), getattr(args, name), "--" + name.replace("_", "-"))
                         for name in PORT_FLAGS if getattr(args, name, None)])
    if clash:
        print(f"pdserve {args.command}: {clash}", file=sys.stderr)
        raise SystemExit(1)


def _add_node_flags(p: argparse.ArgumentParser, port: int | None = None,
                    api_key: bool = False) -> None:
    """What every server takes: its model, where it listens (`port`: this command's default,
    else ServerConfig's), logs, TLS and the cluster key; with `api_key` (it serves
    Generation), the API key its clients must send."""
    from pdserve.models_cli import add_model_flag
    from pdserve.runtime.auth import APIKeyConfig
    from pdserve.runtime.cluster_key import ClusterKeyConfig
    from pdserve.runtime.http_limits import HTTPConfig
    from pdserve.runtime.logs import LogConfig
    from pdserve.runtime.options import add_options
    from pdserve.runtime.server import ServerConfig
    from pdserve.runtime.tls import TLSConfig

    add_model_flag(p)
    add_options(p, ServerConfig, defaults={} if port is None else {"port": port})
    add_options(p, LogConfig)
    add_options(p.add_argument_group("TLS (runtime/tls.py; all optional, default plaintext)"),
                TLSConfig)
    add_options(p.add_argument_group("HTTP port (runtime/http.py: OpenAI API, /metrics)"),
                HTTPConfig)
    g = p.add_argument_group("authentication (runtime/auth.py; default open)")
    add_options(g, ClusterKeyConfig)
    if api_key:
        add_options(g, APIKeyConfig)


def _start_node(args, role: str):
    """Set up what every server process needs before it serves: TLS, logging, and its keys
    (`role`: the caller role its channels present, router or worker)."""
    from pdserve.credentials import configure_http, configure_server_keys, configure_tls
    from pdserve.runtime.logs import setup_logging

    configure_tls(args)
    configure_http(args)
    setup_logging(args.log_format, args.log_level)
    configure_server_keys(args, role)


def cmd_router(args) -> int:
    _ports_or_exit(args)
    from pdserve.router.app import run_router
    from pdserve.router.config import RouterConfig
    from pdserve.runtime.options import from_args
    from pdserve.runtime.server import ServerConfig, run

    template = _chat_template(args)  # before the model, which may take a while to fetch
    config = from_args(RouterConfig, args, model=_model(args),
                       served_model_name=args.served_model_name, chat_template=template,
                       tool_call_parser=args.tool_call_parser,
                       server=from_args(ServerConfig, args))
    _start_node(args, "router")
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


def cmd_worker(args) -> int:
    _ports_or_exit(args)
    from pdserve.decode.config import DecodeConfig
    from pdserve.engine import EngineConfig
    from pdserve.worker.app import run_worker
    from pdserve.worker.config import WorkerConfig
    from pdserve.prefill.config import PrefillConfig
    from pdserve.runtime.membership import MembershipConfig
    from pdserve.runtime.options import from_args
    from pdserve.runtime.server import ServerConfig, run

    template = _chat_template(args)  # before the model, which may take a while to fetch
    engine = from_args(EngineConfig, args, model_dir=_model(args),
                       kv_cache_memory_bytes=args.kv_cache_mb and args.kv_cache_mb * 1024 * 1024)
    _engine_or_exit(args, engine)
    config = WorkerConfig(
        role=WORKER_COMMANDS[args.command], engine=engine, server=from_args(ServerConfig, args),
        prefill=from_args(PrefillConfig, args), decode=from_args(DecodeConfig, args),
        membership=from_args(MembershipConfig, args), metrics_port=args.metrics_port,
        http_port=getattr(args, "http_port", None), served_model_name=args.served_model_name,
        chat_template=template, tool_call_parser=getattr(args, "tool_call_parser", "auto"),
        test_gates=args.test_gates)
    _start_node(args, "worker")
    run(run_worker(config))
    return 0


def _chat_template(args) -> str | None:
    """`--chat-template`'s template (models_cli.chat_template_of), or exit 1 naming it."""
    from pdserve.models_cli import chat_template_of

    try:
        return chat_template_of(getattr(args, "chat_template", None))
    except ValueError as err:
        raise SystemExit(f"pdserve {args.command}: {err}") from None


def _engine_or_exit(args, engine) -> None:
    """Before the model loads: exit 1 with one line, naming the flag, if an engine flag's
    value is bad or its --device is not on this machine (engine/device.py)."""
    from pdserve.engine.device import usable_device
    from pdserve.models_cli import check_servable
    from pdserve.runtime.options import flag_fields, flag_name

    if args.kv_cache_mb is not None and args.kv_cache_mb <= 0:  # the engine sees bytes, not this flag
        raise SystemExit(f"pdserve {args.command}: --kv-cache-mb must be > 0, got {args.kv_cache_mb}")
    try:
        engine.validate()
        usable_device(engine.device)
        check_servable(engine.model_dir)
    except ValueError as err:
        message = str(err)
        for f in flag_fields(type(engine)):  # the field the message starts with, as its flag
            if message.startswith(f.name + " "):
                message = flag_name(f) + message[len(f.name):]
                break
        raise SystemExit(f"pdserve {args.command}: {message}") from None


def cmd_up(args) -> int:
    _ports_or_exit(args)
    from pdserve.models_cli import check_servable
    from pdserve.runtime.http_limits import HTTPConfig
    from pdserve.up import UpConfig, up
    from pdserve.runtime.auth import APIKeyConfig
    from pdserve.runtime.options import from_args

    _chat_template(args)  # a bad one stops `up` before any node starts
    model = _model(args)
    try:
        HTTPConfig(allowed_origins=args.allowed_origins, responses_store_mb=args.responses_store_mb,
                   sse_keepalive_s=args.sse_keepalive_s).validate()
    except ValueError as err:
        raise SystemExit(f"pdserve up: {err}") from None
    config = from_args(UpConfig, args, model=model, extra=args.worker_args,
                       served_model_name=args.served_model_name, chat_template=args.chat_template,
                       tool_call_parser=args.tool_call_parser,
                       api=from_args(APIKeyConfig, args))
    try:  # the model's check (seconds of imports) runs while the nodes start
        return up(config, check=lambda: check_servable(model, args.lora_modules))
    except ValueError as err:
        raise SystemExit(f"pdserve up: {err}") from None


def cmd_bench(args) -> int:
    # The benchmarks are the layer above this CLI: each runs as its own program.
    import subprocess

    return subprocess.call([sys.executable, "-m", BENCHMARKS[args.target], *args.bench_args])


def build_parser() -> argparse.ArgumentParser:
    from pdserve.chat import add_chat_parser
    from pdserve.generate_cli import add_generate_parser
    from pdserve.health_cli import add_health_parser
    from pdserve.runtime.identity import pdserve_version

    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"pdserve {pdserve_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_server_commands(sub)
    add_generate_parser(sub)
    add_chat_parser(sub)
    add_health_parser(sub)
    return apply_env_defaults(parser)


def _add_server_commands(sub) -> None:
    """router, prefill, decode, serve, up, bench and models. Their flags come from
    configuration dataclasses that import nothing heavy, so the plain install (the client)
    parses them too and names the missing extra only when one runs (`main`)."""
    from pdserve.decode.config import DecodeConfig
    from pdserve.models_cli import add_chat_flags, add_model_flag, add_models_parser
    from pdserve.up import UpConfig, UpParser
    from pdserve.worker.config import DEFAULT_PORTS
    from pdserve.prefill.config import PrefillConfig
    from pdserve.router.config import RouterConfig
    from pdserve.runtime.auth import APIKeyConfig
    from pdserve.runtime.membership import MembershipConfig
    from pdserve.runtime.options import add_options
    from pdserve.runtime.tls import TLSConfig

    p = sub.add_parser("router", help="client-facing router over prefill and decode workers")
    p.__class__ = _RouterParser
    _add_node_flags(p, api_key=True)
    add_chat_flags(p)
    add_options(p, RouterConfig)
    p.set_defaults(func=cmd_router)

    worker_flags: set[str] = set()
    for name, text in (("prefill", "prefill worker: RemoteSend"),
                       ("decode", "decode worker: PrepareReceive and StartGeneration"),
                       ("serve", "colocated worker (role both): serves Generation itself")):
        role = WORKER_COMMANDS[name]
        p = sub.add_parser(name, help=text)
        _add_node_flags(p, DEFAULT_PORTS[role], api_key=role == "both")
        _add_engine_flags(p)
        p.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus /metrics over HTTP on this port; 0 picks a free one "
                            "(default: none)")
        if role == "both":
            add_chat_flags(p)
            p.add_argument("--http-port", type=int, default=None,
                           help="serve the OpenAI-compatible API (as `pdserve router` does) and "
                                "/metrics over HTTP on this port; 0 picks a free one (default: "
                                "no HTTP server)")
        if role in ("prefill", "both"):
            add_options(p.add_argument_group("prefill role"), PrefillConfig)
        if role in ("decode", "both"):
            add_options(p.add_argument_group("decode role"), DecodeConfig)
        add_options(p.add_argument_group("discovery (runtime/membership.py)"), MembershipConfig)
        # Test-only (hidden): requests whose id starts with this stop at test gates.
        p.add_argument("--test-gates", default="", help=argparse.SUPPRESS)
        p.set_defaults(func=cmd_worker)
        worker_flags |= set(p._option_string_actions)  # for up's hint (up.UpParser)

    p = sub.add_parser("up", help="router + one prefill + one decode on localhost; Ctrl-C stops all")
    p.__class__ = UpParser
    p.worker_flags = frozenset(worker_flags)
    add_model_flag(p)
    add_chat_flags(p)
    add_options(p, UpConfig)
    add_options(p.add_argument_group("authentication (the cluster key is made up for the "
                                     "run)"), APIKeyConfig)
    p.add_argument("worker_args", nargs=argparse.REMAINDER,
                   help="after `--`: any other worker flag, for both workers (e.g. -- "
                        "--no-prefix-cache)")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("bench", help="benchmarks, each with its own flags: `pdserve bench NAME --help`")
    p.add_argument("target", choices=sorted(BENCHMARKS), help="what to benchmark")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="flags for that benchmark")
    p.set_defaults(func=cmd_bench)

    add_models_parser(sub)


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    from pdserve.engine.config import EngineConfig
    from pdserve.runtime.options import add_options

    g = p.add_argument_group("engine")
    add_options(g, EngineConfig)
    g.add_argument("--kv-cache-mb", type=int,
                   help="memory for the KV pool when --num-pages is not given (default: "
                        "--kv-cache-memory-fraction of the memory free)")


def main(argv: list[str] | None = None, program: bool = False) -> int:
    """`program`: this process is the `pdserve` program (`run`), not a caller's."""
    args = build_parser().parse_args(argv)
    if program:
        process_gc.own_process(server=args.func in (cmd_router, cmd_worker))
    try:
        return args.func(args) or 0
    except ModuleNotFoundError as err:
        # A server command whose flags import nothing heavy (the workers': worker/config.py)
        # parses in the plain install too, and meets the missing package only when it runs.
        if (err.name or "pdserve").split(".")[0] == "pdserve":
            raise
        sys.exit(f"pdserve {args.command} needs the server packages ({err.name} is not "
                 "installed): pip install 'pdserve[server]'")


def run() -> int:  # the `pdserve` program
    return main(program=True)


if __name__ == "__main__":
    sys.exit(run())
