"""Another engine measured on the same workloads as pdserve's (`pdserve bench engine --peer
vllm`): it runs in a child process with its own interpreter, the one `make bench-peers`
installs into `.venv-peers/vllm`, because vLLM pins its own torch and transformers.

The parent hands the child a JSON job (`build_job`) and reads back a JSON result
(`parse_result`); `peer_vllm.py` is the child. Only one engine runs at a time: the
benchmark starts pdserve's engine after the child has exited, so neither competes for
the cores or the memory of the other.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PEER_PYTHON_ENV = "PDSERVE_VLLM_PYTHON"
DEFAULT_PEER_PYTHON = ".venv-peers/vllm/bin/python"  # relative to the repository root
PEER_SCRIPT = Path(__file__).resolve().parent / "peer_vllm.py"
GiB = 1 << 30
STDERR_FD = 2  # the descriptor, not sys.stderr, which a test or a pipe may replace


class PeerMissing(Exception):
    """The peer's interpreter is not there: `make bench-peers` has not been run."""


class PeerFailed(Exception):
    """The child exited with an error, or its result does not answer the job."""


@dataclass
class PeerWorkload:
    name: str
    seconds: float
    token_ids: list[list[int]]


@dataclass
class PeerResult:
    peer: str
    version: str
    startup_s: float  # `vllm.LLM(...)`: loading, compiling, sizing the KV cache
    workloads: list[PeerWorkload]


def peer_python(flag: str | None) -> Path:
    """The interpreter `--peer-python` names, else $PDSERVE_VLLM_PYTHON, else the one
    `make bench-peers` installs; PeerMissing if it is not a file."""
    chosen = flag or os.environ.get(PEER_PYTHON_ENV) or str(REPO_ROOT / DEFAULT_PEER_PYTHON)
    path = Path(chosen).absolute()  # the child starts in a temporary directory
    if not path.is_file():
        raise PeerMissing(f"the vLLM interpreter {path} does not exist; run `make bench-peers` "
                          f"to install vLLM into {DEFAULT_PEER_PYTHON}, or name one with "
                          f"--peer-python or ${PEER_PYTHON_ENV}")
    return path


def build_job(model_dir: str, dtype: str, workloads, warmup) -> dict:
    """The child's job: every prompt as token ids and its own output length. `workloads`
    and `warmup` are `benchmarks.engine.Workload`s."""
    def entry(w):
        return {"name": w.name, "prompts": w.prompts, "output_lens": w.output_lens}

    longest = max(len(p) + n for w in [warmup, *workloads] for p, n in zip(w.prompts, w.output_lens))
    return {"model": str(model_dir), "dtype": dtype, "max_model_len": longest, "seed": 0,
            "warmup": entry(warmup), "workloads": [entry(w) for w in workloads]}


def parse_result(result: dict, job: dict) -> PeerResult:
    """The child's result, checked against its job: the same workloads in the same order,
    and every prompt's own number of tokens (greedy with ignore_eos cannot stop early)."""
    workloads = [PeerWorkload(w["name"], float(w["seconds"]), w["token_ids"]) for w in result["workloads"]]
    asked = [w["name"] for w in job["workloads"]]
    if [w.name for w in workloads] != asked:
        raise PeerFailed(f"the peer answered workloads {[w.name for w in workloads]}, asked {asked}")
    for got, want in zip(workloads, job["workloads"]):
        lens = [len(t) for t in got.token_ids]
        if lens != want["output_lens"]:
            raise PeerFailed(f"{got.name}: the peer generated {lens} tokens per prompt, "
                             f"asked {want['output_lens']}")
    return PeerResult(result["peer"], result["version"], float(result["startup_s"]), workloads)


def peer_env(kv_cache_bytes: int, python: Path) -> dict[str, str]:
    """What the child needs beyond our environment: the cores this process may use (the
    ones pdserve's engine runs on), a KV cache that holds the largest workload at once,
    no network, and Intel's OpenMP preloaded as vLLM's CPU guide asks (its venv has
    `lib/libiomp5.so`; without it vLLM ran the quick workloads 1.7-3.5x slower here).

    `kv_cache_bytes` is pdserve's figure (`engine.kv_cache_bytes`); vLLM's CPU cache holds
    about half the tokens of its raw K/V bytes (11,648 tokens of SmolLM2 fp32 in 1 GiB, not
    23,301), hence twice that, in whole GiB."""
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(sorted(os.sched_getaffinity(0))),
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(2 * kv_cache_bytes / GiB))),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"  # not resolved: bin/python is a link
    if iomp.is_file():
        env["LD_PRELOAD"] = ":".join(filter(None, [str(iomp), os.environ.get("LD_PRELOAD")]))
    return env


def cpu_list(cpus: list[int]) -> str:
    """`[0, 1, 2, 5]` as "0-2,5", the form VLLM_CPU_OMP_THREADS_BIND takes."""
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def run_peer(python: Path, job: dict, env: dict[str, str]) -> PeerResult:
    """Runs the job in `python` and waits for it. The child's log (vLLM writes its own to
    stdout) goes to our stderr, so stdout stays the benchmark's JSON."""
    with tempfile.TemporaryDirectory(prefix="pdserve-peer-") as tmp:
        job_path, result_path = Path(tmp, "job.json"), Path(tmp, "result.json")
        job_path.write_text(json.dumps(job))
        code = subprocess.call([str(python), str(PEER_SCRIPT), str(job_path), str(result_path)],
                               env={**os.environ, **env}, stdout=STDERR_FD, cwd=tmp)
        if code != 0 or not result_path.exists():
            raise PeerFailed(f"{python} {PEER_SCRIPT.name} exited with status {code}; "
                             f"its log is above")
        return parse_result(json.loads(result_path.read_text()), job)
