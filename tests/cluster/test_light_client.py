"""The light install (`pip install pdserve`: gRPC and protobuf, no torch, NIXL or Triton)
talks to a real router + prefill + decode: the library and `pdserve generate` both answer."""

from __future__ import annotations

import json

from tests.wheel import build_wheel, light_site, run_isolated


def test_the_light_client_generates_against_a_real_cluster(cluster, tmp_path):
    site = light_site(build_wheel(tmp_path / "wheel"), tmp_path / "site")
    address = cluster.address("router")
    code = ("import sys\n"
            "from pdserve.client import Client\n"
            "from pdserve import cli\n"
            f"with Client({address!r}, timeout=60) as client:\n"
            "    out = client.generate([5, 6, 7], max_tokens=4, temperature=0, ignore_eos=True)\n"
            "    print(len(out.choices[0].token_ids), bool(out.usage.route.prefill_endpoint))\n"
            f"cli.main(['generate', '--server', {address!r}, '--prompt', 'hello', '--max-tokens', '3',"
            " '--ignore-eos', '--json'])\n"
            "print(sorted(m for m in ('torch', 'nixl', 'triton') if m in sys.modules))")
    out = run_isolated(site, code, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "4 True", lines
    assert json.loads(lines[1])["usage"]["completion_tokens"] == 3, lines
    assert lines[-1] == "[]"
