"""What a gRPC client gets, against a real router + prefill + decode: the README's client
examples run exactly as printed, the blocking and asyncio clients agree, errors carry the
status and the server's message, logprobs name each token by its text, and `pdserve
generate` prints every choice, logprobs (each token's id and text), takes penalties,
logit bias and structures, and reads prompts from standard input or chat turns."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from pdserve.client import AsyncClient, Client, PdserveError
from tests.cluster.nodes import run

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## From Python: the client library"


def readme_examples() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(SECTION):]
    section = section[:section.index("\n## ", len(SECTION))]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def run_python(code: str, address: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PDSERVE_ADDRESS": address})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_readme_client_examples_run_as_printed(cluster):
    sync_example, async_example = readme_examples()
    out = run_python(sync_example, cluster.address("router")).splitlines()
    assert re.fullmatch(r".* length \d+\.\d+", out[0])
    assert [line.split()[:2] for line in out[1:4]] == [["0", "length"], ["1", "length"],
                                                      ["2", "length"]]
    # id, repr(text), logprob, [texts of the two alternatives]
    scored = [re.fullmatch(r"\d+ ('.*'|\".*\") (-?\d+\.\d+) (\[.*\])", line) for line in out[4:8]]
    assert all(scored), out[4:8]
    assert all(isinstance(ast.literal_eval(m[1]), str) and float(m[2]) <= 0
               and len(ast.literal_eval(m[3])) == 2 for m in scored)
    assert re.fullmatch(r"\d+ tokens, \d+\.\d ms per token", out[-1])

    out = run_python(async_example, cluster.address("router")).splitlines()
    # The tiny model can finish its 300 tokens before a starved client's abort lands: then
    # the abort finds nothing and the stream ends at the limit, as the server must say.
    assert out[:2] in (["aborted: True", "ended with ['abort']"],
                       ["aborted: False", "ended with ['length']"]), out
    assert out[2].startswith("INVALID_ARGUMENT ") and "top_p" in out[2]


def test_blocking_and_async_clients_agree_and_stream_every_choice(cluster):
    params = dict(n=3, seed=4, temperature=1.0, max_tokens=6, ignore_eos=True, logprobs=1)
    with Client(cluster.address("router"), timeout=60) as client:
        whole = client.generate("a shared prompt", **params)
        deltas = list(client.stream("a shared prompt", **params))
        assert client.health() == "SERVING"
        (model,) = client.models()

    async def go():
        async with AsyncClient(cluster.address("router")) as client:
            return await client.generate("a shared prompt", **params)

    assert [c.token_ids for c in run(go()).choices] == [c.token_ids for c in whole.choices]
    assert model.id == cluster.model and model.role == "router" and model.vocab_size == 512
    *pieces, last = deltas
    assert last.usage is not None and last.usage.completion_tokens == 18
    for choice in whole.choices:
        mine = [d for d in pieces if d.index == choice.index]
        assert sum((d.token_ids for d in mine), []) == choice.token_ids
        assert [d.finish_reason for d in mine if d.finish_reason] == ["length"]
        assert len(choice.logprobs) == 6 and all(len(e.top) == 1 for e in choice.logprobs)


def test_errors_carry_the_status_and_the_servers_message(cluster):
    with Client(cluster.address("router")) as client:
        with pytest.raises(PdserveError) as err:
            client.generate("x", max_tokens=4, top_p=1.5)
        with pytest.raises(TypeError, match="unknown sampling fields: \\['top_q'\\]"):
            client.generate("x", top_q=0.5)
        assert client.abort("never-sent") is False
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_p" in err.value.message and str(err.value).startswith("INVALID_ARGUMENT: ")


def test_a_client_of_no_server_retries_then_says_unavailable():
    with Client("127.0.0.1:1", timeout=5, retries=1) as client:
        with pytest.raises(PdserveError) as err:
            client.generate("x", max_tokens=1)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def pdserve_generate(cluster, *args: str, stdin: str | None = None) -> str:
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--server",
                          cluster.address("router"), *args], cwd=ROOT, capture_output=True,
                         text=True, input=stdin, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_pdserve_generate_prints_every_choice_logprobs_and_reads_stdin(cluster):
    sampling = ["--n", "3", "--seed", "2", "--temperature", "1", "--max-tokens", "5",
                "--ignore-eos"]
    # A priority orders waiting only: through real nodes, the same answer.
    as_json = json.loads(pdserve_generate(cluster, "--prompt-file", "-", "--json", "--priority", "-2", *sampling,
                                          stdin="a prompt from stdin"))
    with Client(cluster.address("router")) as client:
        expected = client.generate("a prompt from stdin", n=3, seed=2, temperature=1.0,
                                   max_tokens=5, ignore_eos=True)
    assert [c["token_ids"] for c in as_json["choices"]] == [c.token_ids for c in expected.choices]
    assert as_json["usage"]["time_to_first_token_s"] > 0

    shown = pdserve_generate(cluster, "--prompt-file", "-", *sampling, stdin="a prompt from stdin")
    assert [line for line in shown.splitlines() if line.startswith("--- choice")] == [
        "--- choice 0 (length)", "--- choice 1 (length)", "--- choice 2 (length)"]
    scored = pdserve_generate(cluster, "--prompt", "the sky", "--logprobs", "2",
                              "--max-tokens", "3", "--temperature", "0", "--ignore-eos")
    assert len([line for line in scored.splitlines() if " logprob " in line]) == 3
    penalized = json.loads(pdserve_generate(cluster, "--prompt", "the sky", "--max-tokens", "6",
                                            "--temperature", "0", "--repetition-penalty", "1.5",
                                            "--frequency-penalty", "0.5", "--logit-bias", "40:-100",
                                            "--logit-bias", "41:5", "--min-tokens", "3", "--bad-word", "the",
                                            "--bad-word", "sky", "--json"))
    with Client(cluster.address("router")) as client:
        want = client.generate("the sky", max_tokens=6, temperature=0, repetition_penalty=1.5,
                               frequency_penalty=0.5, logit_bias={40: -100, 41: 5}, min_tokens=3,
                               bad_words=["the", "sky"])
    refused = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--server", cluster.address("router"),
                              "--prompt", "the sky", "--max-tokens", "2", "--min-tokens", "3"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "min_tokens must be an integer in [0, max_tokens = 2], got 3" in refused.stderr
    assert penalized["choices"][0]["token_ids"] == want.token_ids and 40 not in want.token_ids
    shaped = pdserve_generate(cluster, "--prompt", "the sky", "--max-tokens", "6", "--temperature", "0",
                              "--choice", "yes", "--choice", "no way")
    assert shaped.strip() in ("yes", "no way")

    chat = json.loads(pdserve_generate(cluster, "--message", "system:be brief", "--message",
                                       "user:hello", "--max-tokens", "4", "--temperature", "0",
                                       "--json"))
    with Client(cluster.address("router")) as client:
        want = client.generate(messages=[{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "hello"}],
                               max_tokens=4, temperature=0)
    assert chat["choices"][0]["token_ids"] == want.token_ids


def test_logprobs_name_each_token_by_its_text_from_router_colocated_node_and_cli(cluster,
                                                                                 colocated):
    from transformers import AutoTokenizer

    decode = AutoTokenizer.from_pretrained(cluster.model).decode
    asked = dict(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3)
    for address in (cluster.address("router"), colocated.address):
        with Client(address) as client:
            entries = client.generate("the sky", **asked).logprobs
        assert len(entries) == 5 and all(len(e.top) == 3 for e in entries)
        for e in entries:
            assert e.token == decode([e.token_id]), address
            assert [t.token for t in e.top] == [decode([t.token_id]) for t in e.top], address

    shown = pdserve_generate(cluster, "--prompt", "the sky", "--logprobs", "3", "--max-tokens",
                             "5", "--temperature", "0", "--ignore-eos")
    lines = [line for line in shown.splitlines() if line.startswith("  token ")]
    assert len(lines) == 5
    for line, e in zip(lines, entries):  # the same greedy tokens: each id, then its text
        assert line.startswith(f"  token {e.token_id:>6} {decode([e.token_id])!r}"), line
        for t in e.top:
            assert f"{t.token_id} {decode([t.token_id])!r} " in line, line
