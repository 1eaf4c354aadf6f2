"""What `pip install` gives: one top-level package, `pdserve`, that a user's own `models.py`
or `runtime.py` cannot shadow; and a plain install that is the client alone (gRPC and
protobuf), with the servers' packages behind the `server` extra."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from tests.wheel import build_wheel, light_site, plain_requirements, run_isolated

# The folders the build maps into `pdserve.`: once top-level modules of their own.
FOLDERS = ["proto", "models", "engine", "kvtransfer", "runtime", "prefill", "decode", "router",
           "worker", "benchmarks"]
SERVER_ONLY = ["torch", "nixl", "triton", "transformers", "numpy", "uvloop"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_installs_one_top_level_package(wheel):
    with zipfile.ZipFile(wheel) as z:
        top = {name.split("/")[0] for name in z.namelist()}
    assert {t for t in top if not t.endswith(".dist-info")} == {"pdserve"}
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    for folder in ("proto", "engine", "router", "prefill", "decode", "kvtransfer"):
        assert f"pdserve/{folder}/__init__.py" in names, folder
    assert "pdserve/proto/pdserve.proto" in names and "pdserve/engine/attention_tiles.h" in names


def test_a_users_own_modules_named_like_ours_break_nothing(tmp_path):
    for name in FOLDERS:
        (tmp_path / f"{name}.py").write_text("raise ImportError('the user module was imported')\n")
    (tmp_path / "pdserve.py").unlink(missing_ok=True)
    code = ("from pdserve.client import Client\n"
            "import pdserve.engine.engine, pdserve.router.app, pdserve.kvtransfer.agent\n"
            "import pdserve.models.catalogue, pdserve.runtime.server\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_plain_install_asks_for_grpc_and_protobuf_only(wheel):
    names = {r.name for r in plain_requirements(wheel)}
    assert names == {"grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf"}


def test_the_client_runs_without_the_servers_packages(wheel, tmp_path):
    site = light_site(wheel, tmp_path / "site")
    code = ("import importlib.util, sys\n"
            f"missing = [m for m in {SERVER_ONLY!r} if importlib.util.find_spec(m) is None]\n"
            "from pdserve.client import AsyncClient, Client, PdserveError\n"
            "from pdserve import cli\n"
            "parser = cli.build_parser()\n"
            "parser.parse_args(['generate', '--server', 'h:1', '--prompt', 'hi'])\n"
            "parser.parse_args(['chat', '--server', 'h:1'])\n"
            "print(len(missing), sorted(m.split('.')[0] for m in sys.modules if m.split('.')[0] in "
            f"{SERVER_ONLY!r}))")
    out = run_isolated(site, code, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(len(SERVER_ONLY)), "[]"], out.stdout


def test_a_server_command_in_the_light_install_says_what_to_install(wheel, tmp_path):
    site = light_site(wheel, tmp_path / "site")
    out = run_isolated(site, "from pdserve import cli; cli.main(['decode', '--model', 'x'])",
                       cwd=tmp_path)
    assert out.returncode != 0
    assert "pip install 'pdserve[server]'" in out.stderr and "Traceback" not in out.stderr, out.stderr
