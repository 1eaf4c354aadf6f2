"""`python -m pdserve.benchmarks.gpu_cluster`: prefill and decode as real processes with their KV
pools on one device (`--device cuda` on a GPU: the pools are CUDA tensors registered with
NIXL as VRAM, and UCX moves the KV between the two processes), checked end to end.

One router, one prefill node (`--kv-send layerwise`) and one decode node per model, started
once (all at once, so their start-ups overlap) and reused by every stage; each stage has its
own time limit and records `ok`, `error` and its figures, so one that fails or hangs still
leaves the others' results. Every process is stopped at the end, whatever happened (and dies
with this one, `pdserve.procs`). Node logs go to `log_dir`, the results so far to
`log_dir/gpu_cluster.json` after each stage.

- exact: a random float32 Llama of SmolLM2's head layout (4 layers, hidden 576, 9/3 heads,
  vocab 2048). Six prompts of 7 to 1000 random token ids at once through the router, 24
  greedy tokens each (ignore_eos), against transformers' greedy `generate` of the same
  checkpoint on the same device (`matches`); `local_matches`: the same prompts prefilled
  by the decode node itself (`kv_window_end=0`, no KV moved), which tells a transfer
  fault (only the disaggregated answer differs) from kernel numerics (both differ).
  `remote`: every route names the prefill node and was not skipped. `kv_bytes_sent`: the
  growth of the prefill node's `kv_bytes_sent_total` (GetLoad) over the stage, against
  `kv_bytes_expected`: sum over the requests of (window end - window begin) x the layout's
  bytes per token (K and V of every layer). `pools`: both nodes' free pages == total,
  nothing running, parked or quarantined, once the stage is over. `pool_devices`: where
  each node's KV layout says its pool lives.
- ttft: a random bfloat16 "1B-class" Llama (16 layers, hidden 2048, 32/8 heads, vocab
  49152; `quick`: a small model) and prompts of fresh random ids (4096 tokens; `quick`:
  512), `max_tokens=1`, one at a time, after one warm-up of each kind:
  `ttft_s`: median client time to first token through router + prefill + decode, from
  sending the request to receiving the token (benchmarks/ttft.py's `_one`: a new client
  per request, connection included, as for the baseline);
  `prefill_alone_s`: the same for the same length with `kv_window_end=0`: the decode node
  prefills the whole prompt itself, same router, model and device, no KV moved;
  `transfer_added_fraction` = (ttft_s - prefill_alone_s) / prefill_alone_s: what moving
  the KV through a second process adds (reservation, RemoteSend, layer-wise WRITEs, the
  notification, StartGeneration), as a share of a transfer-free TTFT;
  `usage_prefill_s`: median `usage.prefill_time_s` of the disaggregated requests (the
  prefill node's RemoteSend from its start to its prefill's end, plus the decode node's
  step of the last position), against
  `usage_prefill_alone_s`, the decode node's engine time for the whole prompt (what the
  layer-wise sends cost the prefill itself shows between the two), and `exposed_s`:
  median of each request's TTFT minus its own `usage.prefill_time_s` (benchmarks/ttft.py's
  "exposed"); `transfer_tail_s`: median `usage.kv_transfer_time_s` (WRITEs still running
  after the prefill ended); `kv_writes` and `kv_descriptors`: medians per window, from
  the prefill node's request log lines.
  All of it per set-up, in `by_setup`: one cluster whose pools are page-major, one whose
  pools are layer-major (`--kv-layout`: a layer-wise WRITE of a page-major pool has a
  descriptor per page, of a layer-major one two per run of pages), and one layer-major
  whose WRITEs wait for 16 MiB of layers (`--layer-write-mb`: fewer WRITEs, a longer
  last one); `breakdown`: where the time went, with its `legs` (the router logs JSON
  too, so each request's lines join by id across the three nodes); `best_setup` and its
  `transfer_added_fraction` sum them up.
- faults, on the exact stage's cluster, whose prefill node stops requests named
  `gcf-sigstop-...` after the first layer-wise WRITE of their window (`--test-gates`: the
  process freezes mid-window, KV in flight): (1) `cancel`: the client cancels such a
  request while the prefill node is frozen, the node is resumed, and both pools must be
  full again; (2) `kill`: the frozen prefill node is SIGKILLed; the router falls back to
  the decode node prefilling the prompt itself, the client must get transformers' greedy
  tokens, and the decode node's pool must be full again.

Sizes (`quick`, the default on the CPU) keep a run on 2 cores within a few minutes; the
full one (the default on a GPU) is sized to finish within ~120 s there, start-up included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from pdserve import process_gc
from pdserve.benchmarks.gpu_cluster_stages import GATED, exact, faults, random_ids, ttft
from pdserve.benchmarks.gpu_models import ONE_B, checkpoint, transformers_greedy
from pdserve.benchmarks.local_cluster import Cluster, stop

EXACT = dict(vocab_size=2048, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048)
SMALL = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
             initializer_range=0.02)
PAGE = 16
# Each ttft cluster's (worker flags, prefill flags).
TTFT_SETUPS = {"page-major": (["--kv-layout", "page-major"], []),
               "layer-major": (["--kv-layout", "layer-major"], []),
               "layer-major-16mib": (["--kv-layout", "layer-major"], ["--layer-write-mb", "16"])}


@dataclass(frozen=True)
class Sizes:
    ttft_geometry: dict
    ttft_tokens: int
    ttft_repeats: int
    budget_s: float  # the whole run, start-up included (benchmarks/gpu.py passes what its stage has left)
    limits_s: dict[str, float]  # of each stage; the first to run waits for its cluster's start
    exact_lengths: tuple[int, ...] = (7, 100, 257, 513, 800, 1000)
    new_tokens: int = 24
    fault_tokens: int = 1024
    threads: int = 1  # torch threads of each node


QUICK = Sizes(SMALL, ttft_tokens=512, ttft_repeats=3, budget_s=600,
              limits_s={"exact": 240, "ttft": 240, "faults": 180})
FULL = Sizes(ONE_B, ttft_tokens=4096, ttft_repeats=10, budget_s=160,
             limits_s={"exact": 90, "ttft": 60, "faults": 45}, threads=4)


# ---- the run ------------------------------------------------------------------------------
def _stage(report: dict, name: str, limit_s: float, fn, log_dir: Path) -> None:
    """Run one stage within `limit_s`; whatever happens, record it (and the run so far)."""
    start = time.perf_counter()
    try:
        if limit_s <= 1:
            raise TimeoutError("no time left in the run's budget")
        result = fn(limit_s)
    except BaseException as err:  # noqa: BLE001 - the next stage must still run
        if isinstance(err, KeyboardInterrupt):
            raise
        result = {"ok": False, "error": repr(err), "traceback": traceback.format_exc()[-3000:]}
    result.setdefault("ok", False)
    result["wall_s"] = round(time.perf_counter() - start, 2)
    report["stages"][name] = result
    (log_dir / "gpu_cluster.json").write_text(json.dumps(report, indent=1, default=str))


def run(device: str, workdir: Path, log_dir: Path, quick: bool | None = None,
        ttft_model: str | None = None, budget_s: float | None = None) -> dict:
    """Every stage on `device` (see the module docstring); `quick`: small sizes (default on
    the CPU); `ttft_model`: the ttft stage's checkpoint (default: written into `workdir`);
    `budget_s`: the whole run's (default the sizes')."""
    quick = not device.startswith("cuda") if quick is None else quick
    sizes = QUICK if quick else FULL
    workdir, log_dir = Path(workdir), Path(log_dir)
    workdir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    end = time.monotonic() + (sizes.budget_s if budget_s is None else budget_s)
    report: dict = {"device": device, "quick": quick, "logs": str(log_dir), "env": environment(),
                    "stages": {}, "ok": False}
    clusters: list[Cluster] = []

    def left(stage: str) -> float:
        return min(sizes.limits_s[stage], end - time.monotonic() - 10)  # 10 s: stopping

    try:
        worker = ["--device", device, "--page-size", str(PAGE), "--max-num-seqs", "16",
                  "--num-threads", str(sizes.threads)]
        exact_dir = checkpoint(workdir / "cluster-exact", EXACT)
        a = Cluster("exact", exact_dir, [*worker, "--dtype", "float32", "--num-pages", "512"], log_dir,
                    prefill_flags=["--kv-send", "layerwise", "--test-gates", GATED],
                    decode_flags=["--no-prefix-cache"])
        clusters.append(a.start())
        ttft_clusters: dict[str, Cluster | Exception] = {}
        for setup, (worker_flags, prefill_flags) in TTFT_SETUPS.items():  # started together
            try:  # a ttft cluster's failures are the ttft stage's
                ttft_dir = ttft_model or checkpoint(workdir / ("cluster-small" if quick else "cluster-1b"),
                                                    sizes.ttft_geometry)
                pages = 4 * (sizes.ttft_tokens // PAGE + 2)
                b = Cluster(f"ttft-{setup}", ttft_dir, [*worker, "--dtype", "bfloat16", "--num-pages", str(pages),
                                                        *worker_flags, "--log-format", "json"], log_dir,
                            prefill_flags=["--kv-send", "layerwise", "--transfer-timeout-s", "120", *prefill_flags],
                            router_flags=["--log-format", "json"])
                clusters.append(b.start())
                ttft_clusters[setup] = b
            except Exception as err:
                ttft_clusters[setup] = err
        rng = random.Random(0)  # the reference runs here while the nodes start
        prompts = [random_ids(n, EXACT["vocab_size"], rng) for n in sizes.exact_lengths]
        fault_prompt = random_ids(sizes.fault_tokens, EXACT["vocab_size"], rng)
        try:
            reference = transformers_greedy(exact_dir, device, [*prompts, fault_prompt], sizes.new_tokens)
        except Exception as err:  # the stages that need it say so
            reference = err

        def on(cluster: Cluster | Exception, coro_of, checked: bool = True):
            """The stage that runs `coro_of()` on `cluster` (`checked`: against the reference)."""
            def stage(limit_s: float) -> dict:
                for failed in (cluster, reference if checked else None):
                    if isinstance(failed, Exception):
                        raise RuntimeError(f"set-up failed: {failed!r}")
                deadline = time.monotonic() + limit_s
                try:
                    cluster.wait(deadline)
                    result = asyncio.run(asyncio.wait_for(coro_of(), max(1.0, deadline - time.monotonic())))
                except Exception as err:
                    result = {"ok": False, "error": repr(err), "traceback": traceback.format_exc()[-3000:]}
                if not result.get("ok"):
                    result["log_tails"] = cluster.log_tails()
                return result
            return stage

        _stage(report, "exact", left("exact"), on(a, lambda: exact(a, prompts, reference[:-1], sizes.new_tokens)),
               log_dir)
        def ttft_of(b: Cluster | Exception):
            return on(b, lambda: ttft(b, *_ttft_shape(b.model, sizes), _vocab(b.model)), checked=False)

        def every_setup(limit_s: float) -> dict:
            end = time.monotonic() + limit_s
            by_setup = {}
            for i, (setup, b) in enumerate(ttft_clusters.items()):
                by_setup[setup] = ttft_of(b)((end - time.monotonic()) / (len(ttft_clusters) - i))
            added = {o: r["transfer_added_fraction"] for o, r in by_setup.items() if "transfer_added_fraction" in r}
            best = min(added, key=added.get) if added else None
            return {"ok": all(r.get("ok") for r in by_setup.values()), "best_setup": best,
                    "transfer_added_fraction": added.get(best), "by_setup": by_setup}

        _stage(report, "ttft", left("ttft"), every_setup, log_dir)
        _stage(report, "faults", left("faults"),
               on(a, lambda: faults(a, fault_prompt, reference[-1], EXACT["vocab_size"])), log_dir)
    except BaseException as err:  # noqa: BLE001 - set-up failed: say so, stop everything
        report["error"] = repr(err)
        report["traceback"] = traceback.format_exc()[-3000:]
        if isinstance(err, KeyboardInterrupt):
            raise
    finally:
        stop(clusters)
    stages = report["stages"]
    report["ok"] = "error" not in report and all(stages.get(s, {}).get("ok") for s in ("exact", "ttft", "faults"))
    (log_dir / "gpu_cluster.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def environment() -> dict:
    """What the nodes run with: versions, and the variables that steer UCX and CUDA memory."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {"packages": {n: of(n) for n in ("torch", "nixl", "nixl-cu12", "nixl-cu13", "triton", "transformers")},
            "variables": {k: v for k, v in os.environ.items()
                          if k.startswith(("UCX_", "NIXL_", "CUDA_", "PYTORCH_CUDA_"))}}


def _vocab(model_dir: str) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def _ttft_shape(model_dir: str, sizes: Sizes) -> tuple[int, int]:
    """(prompt tokens, repeats): the sizes' prompt, cut to what the model's context holds."""
    context = json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]
    return min(sizes.ttft_tokens, context - 1), sizes.ttft_repeats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.benchmarks.gpu_cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cpu, cuda or cuda:N (default cuda)")
    p.add_argument("--size", choices=("quick", "full"), default=None,
                   help="quick: small models and prompts (default on the CPU); full: the GPU sizes")
    p.add_argument("--workdir", default="/tmp/pdserve-gpu-cluster", help="checkpoints (default %(default)s)")
    p.add_argument("--log-dir", default=None, help="node logs (default: WORKDIR/logs)")
    p.add_argument("--ttft-model", default=None, help="checkpoint of the ttft stage (default: written)")
    p.add_argument("--out", default=None, help="write the results here as JSON (default: stdout only)")
    a = p.parse_args(argv)
    workdir = Path(a.workdir)
    report = run(a.device, workdir, Path(a.log_dir) if a.log_dir else workdir / "logs",
                 quick=None if a.size is None else a.size == "quick", ttft_model=a.ttft_model)
    text = json.dumps(report, indent=1, default=str)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    process_gc.own_process()
    sys.exit(main())
