"""The authentication flags of the command line (pdserve/credentials.py): which commands
take which keys, how a server sets them up at start (with its caller role), the warning of
an open cluster, and bad values stopping the command."""

from __future__ import annotations

import logging

import pytest

from pdserve import cli, credentials
from pdserve.runtime import auth, cluster_key, tls
from pdserve.runtime.cluster_key import ClusterKey
from pdserve.runtime.tenants import KeyRing

KEY = "k" * 32


@pytest.fixture(autouse=True)
def process_settings(monkeypatch):
    for name in ("PDSERVE_API_KEY", "PDSERVE_CLUSTER_KEY", "PDSERVE_CLUSTER_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(auth, "_settings", auth.Settings())
    monkeypatch.setattr(cluster_key, "_key", ClusterKey(None))
    monkeypatch.setattr(tls, "_config", tls.TLSConfig())


def parse(*argv: str):
    return cli.build_parser().parse_args(list(argv))


def test_servers_take_the_cluster_key_and_only_generation_servers_the_api_key():
    for command in ("router --decode x:1", "prefill", "decode", "serve"):
        assert parse(*command.split(), "--cluster-key-file", "f").key_file == "f"
    for command in ("router --decode x:1", "serve", "generate --prompt p", "chat", "up"):
        assert parse(*command.split(), "--api-key", "sk").api_key == "sk"
    for command in ("prefill", "decode"):  # they serve no client: nothing to check a key on
        with pytest.raises(SystemExit):
            parse(command, "--api-key", "sk")


def test_a_server_starts_with_its_role_and_keys(tmp_path):
    (tmp_path / "cluster.key").write_text(KEY + "\n")
    (tmp_path / "api.key").write_text("sk-router\n")
    args = parse("router", "--decode", "x:1", "--cluster-key-file", str(tmp_path / "cluster.key"),
                 "--api-key-file", str(tmp_path / "api.key"))
    credentials.configure_server_keys(args, "router")
    assert auth.current() == auth.Settings("router", KeyRing({"default": "sk-router"}))
    assert cluster_key.current().token("router") == ClusterKey(KEY.encode()).token("router")
    assert len(auth.outgoing_interceptors()) == 4  # its channels present the router token


def test_a_server_without_a_cluster_key_says_it_is_open(caplog):
    with caplog.at_level(logging.WARNING):
        credentials.configure_server_keys(parse("decode"), "worker")
    assert [r.getMessage() for r in caplog.records] == [
        "open cluster: Worker calls are not authenticated; set --cluster-key-file"]
    assert auth.outgoing_interceptors() == []


def test_a_bad_key_stops_the_server_naming_the_problem(tmp_path):
    (tmp_path / "short.key").write_text("short\n")
    short = parse("prefill", "--cluster-key-file", str(tmp_path / "short.key"))
    with pytest.raises(SystemExit, match="at least 16 bytes"):
        credentials.configure_server_keys(short, "worker")
    missing = parse("serve", "--api-key-file", str(tmp_path / "none"))
    with pytest.raises(SystemExit, match="pdserve serve: --api-key-file .* no such file"):
        credentials.configure_server_keys(missing, "worker")


def test_the_api_key_variable_is_the_flags_default(monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", "sk-env")
    assert credentials.client_api_key(parse("generate", "--prompt", "p")) == "sk-env"


def test_certificate_names_without_mutual_tls_stop_the_server():
    with pytest.raises(SystemExit, match="--tls-require-client-cert"):
        credentials.configure_tls(parse("decode", "--tls-router-names", "r",
                                        "--tls-worker-names", "w"))
