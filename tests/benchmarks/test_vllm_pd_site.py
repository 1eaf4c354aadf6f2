"""The `sitecustomize` of vLLM's 1P1D servers (`vllm_pd_site`), run as vLLM would run it:
in a fresh interpreter with its directory on PYTHONPATH (`peer_pd.site_dir`), against a
stand-in for nixl's bindings module, so neither vLLM nor NIXL is needed."""

import os
import subprocess
import sys
import textwrap

import pytest

from pdserve.benchmarks.serve import vllm_pd_site
from pdserve.benchmarks.serve.peer_pd import server_env, site_dir

FAKE_BINDINGS = """
class nixlAgentConfig:
    useProgThread = True
    pthrDelay = 0

class nixlAgent:
    def __init__(self, name, config):
        self.config = config
"""


def run_with_site(tmp_path, code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    site = site_dir(tmp_path / "logs")
    pkg = tmp_path / "fake" / "nixl_cu99"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_bindings.py").write_text(FAKE_BINDINGS)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_PEER_")}
    env = {**clean, **env, "PYTHONPATH": f"{site}:{tmp_path / 'fake'}"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=60, check=True)


def test_a_zero_progress_thread_delay_becomes_the_configured_one(tmp_path):
    out = run_with_site(tmp_path, """
        import nixl_cu99._bindings as b
        on, off = b.nixlAgentConfig(), b.nixlAgentConfig()
        off.useProgThread = False
        b.nixlAgent("x", on), b.nixlAgent("y", off)
        print(on.pthrDelay, off.pthrDelay)
    """, {vllm_pd_site.DELAY_ENV: "2000"})
    assert out.stdout.split() == ["2000", "0"]  # no progress thread: nothing to delay
    assert "NIXL agent x: progress thread poll delay 0 -> 2000 us" in out.stderr


def test_without_its_variables_the_site_changes_nothing(tmp_path):
    out = run_with_site(tmp_path, """
        import os
        import nixl_cu99._bindings as b
        cfg = b.nixlAgentConfig()
        b.nixlAgent("x", cfg)
        print(cfg.pthrDelay, os.sched_setaffinity.__module__)
    """, {})
    assert out.stdout.split() == ["0", "posix"] and out.stderr == ""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move between")
def test_a_thread_asked_off_its_configured_core_keeps_it(tmp_path):
    first, second = sorted(os.sched_getaffinity(0))[:2]
    out = run_with_site(tmp_path, f"""
        import os
        os.sched_setaffinity(0, [{second}])   # what vLLM's NIXL worker does
        print(sorted(os.sched_getaffinity(0)))
    """, server_env(tmp_path, {first}, 5600))
    assert out.stdout.strip() == f"[{first}]"
    assert f"kept cores [{first}] of pid/tid self (asked [{second}])" in out.stderr


def test_keep_cores_narrows_a_request_to_the_configured_cores():
    assert vllm_pd_site.keep_cores({0, 1}, [1, 3]) == {1}
    assert vllm_pd_site.keep_cores({0}, [1]) == {0}
    assert vllm_pd_site.keep_cores({2, 3}, {2, 3}) == {2, 3}


def test_the_servers_get_their_core_side_channel_and_the_site_first_on_pythonpath(tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = server_env(tmp_path / "site", {1}, 5601)
    assert env["PYTHONPATH"] == f"{tmp_path / 'site'}:/elsewhere"
    assert (env[vllm_pd_site.CORES_ENV], env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ("1", "5601")
    assert int(env[vllm_pd_site.DELAY_ENV]) > 0
    assert server_env(tmp_path / "site", {5, 4}, 5602)[vllm_pd_site.CORES_ENV] == "4,5"  # a side of several
