"""`pdserve bench gpu` (`make gpu-check`): the whole GPU check in one run, sized for one
H200 and a few minutes, model creation included. It writes one JSON file.

Stages, each in its own child process (and process group) with a time limit, within one
deadline for the whole check, so one failing or hanging stage still leaves the others'
figures; they run engine, cluster, parity, kernels: a run cut short loses the least:
- engine: a random "1B-class" Llama in bfloat16 (16 layers, hidden 2048, 32/8 heads,
  intermediate 8192, vocab 49152). Decode steps at batch 1, 64 and 256 (prompts of 128
  tokens; each step timed whole with `Engine.step()`: scheduling, inputs, the forward,
  sampling and detokenizing), each beside the memory-bandwidth limit of that step (the
  bf16 weights plus the batch's KV read once, at the datasheet's 4.8 TB/s and at the
  device-to-device copy rate measured here); the graph replay alone, timed with CUDA
  events; then 64 prompts of 512 tokens, 256 new tokens each, against transformers'
  `generate` on the same prompts in the same run (the baseline, `--hf-new-tokens` new
  tokens each, 256 unless told).
- parity: SmolLM2's geometry (30 layers, hidden 576, 9/3 heads) with random weights in
  float32; six prompts of 7 to 1030 tokens, 32 greedy tokens each, against transformers'
  greedy `generate` on the same device, with the Triton backend (and its CUDA graphs)
  and the torch backend.
- kernels: the tests that need CUDA (Triton kernels compiled for the GPU, graphs against
  eager steps), by pytest.
- cluster: router + prefill + decode processes with their KV pools in GPU memory,
  moving KV over NIXL (benchmarks/gpu_cluster.py): exactness, time to first token,
  faults.
`--device cpu --quick` runs the same code on tiny models on a CPU (the tests do).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from pdserve import launch, process_gc
from pdserve.benchmarks import gpu_engine, stage_progress
from pdserve.benchmarks.gpu_models import FIRST_ID, ONE_B, SMOLLM2_GEOMETRY, TINY, checkpoint, transformers_greedy

# `make gpu-check` runs from the repository: its tests/ and benchmarks/results/ are found there.
ROOT = Path.cwd()


def stage_parity(device: str, workdir: Path, quick: bool) -> dict:
    from pdserve.engine import LLM, SamplingParams

    model_dir = checkpoint(workdir / ("tiny" if quick else "smollm2-geometry"), TINY if quick else SMOLLM2_GEOMETRY)
    rng = random.Random(1)
    lengths = (7, 33, 100) if quick else (7, 64, 200, 511, 777, 1030)
    new = 6 if quick else 32
    vocab = (TINY if quick else SMOLLM2_GEOMETRY)["vocab_size"]
    prompts = [[rng.randrange(FIRST_ID, vocab) for _ in range(n)] for n in lengths]
    want = transformers_greedy(model_dir, device, prompts, new)
    out = {"model": model_dir, "prompt_lens": list(lengths), "new_tokens": new, "backends": {}}
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for backend in ("triton", "torch"):
        if quick and backend == "triton" and device == "cpu":
            continue  # the interpreter is too slow for 30 layers; tests/engine covers it
        llm = LLM(model_dir, dtype="float32", device=device, attention_backend=backend, enable_prefix_cache=False)
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        engine = llm.engine
        out["backends"][backend] = {
            "identical": sum(g == w for g, w in zip(got, want)), "of": len(prompts),
            "graphs": engine.runner.graphs is not None,
            "pool_full_after": engine.num_free_pages() == engine.num_total_pages(),
            "first_mismatch": next(({"prompt_len": len(p), "got": g, "want": w}
                                    for p, g, w in zip(prompts, got, want) if g != w), None)}
        del llm, engine
    out["ok"] = all(b["identical"] == b["of"] and b["pool_full_after"] for b in out["backends"].values())
    return out


# One random checkpoint of each mechanism the GPU step path runs beyond Llama's: capped
# scores and windows (gemma2), rope tables by layer kind (gemma3), NoPE layers (smollm3,
# exaone4), experts (qwen2_moe), norms over all heads (olmo2), scaled queries (ministral3),
# reordered partial rope (glm4), an ungated MLP (apertus), fused projections and LongRoPE past
# its original 32 positions, a prompt long from the start and one growing past them (phi3),
# attention sinks and clamped experts (gpt_oss), grouped sigmoid routing (glm4_moe), q and k
# normed after rope (hunyuan_v1_dense).
GPU_FAMILIES = ("gemma2", "gemma3", "smollm3", "exaone4", "qwen2_moe", "olmo2", "ministral3", "glm4", "apertus", "phi3",
                "gpt_oss", "glm4_moe", "hunyuan_v1_dense", "cohere2", "llama4")


def stage_families(device: str, workdir: Path, quick: bool) -> dict:
    """{"families": {family: identical of prompts}}: greedy tokens of the Triton backend
    (torch's on a CPU) against transformers' on `device`, prompts past the checkpoints'
    8-token windows; each family's reported as it ends (stage_progress)."""
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.checkpoint import write_checkpoint

    backend = "torch" if device == "cpu" else "triton"  # the interpreter: tests/engine covers it
    prompts = [[FIRST_ID + (i * 37 + j * 11) % 400 for j in range(n)] for i, n in enumerate((5, 28, 40))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = {}
    for family in GPU_FAMILIES[:2] if quick else GPU_FAMILIES:
        model_dir = workdir / f"family-{family}"
        if not (model_dir / "config.json").exists():
            write_checkpoint(model_dir, family=family, seed=4)
        want = transformers_greedy(str(model_dir), device, prompts, 8)
        llm = LLM(str(model_dir), dtype="float32", device=device, attention_backend=backend, num_pages=64)
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        out[family] = {"identical": sum(g == w for g, w in zip(got, want)), "of": len(prompts), "backend": backend,
                       "graphs": llm.engine.runner.graphs is not None}
        del llm
        stage_progress.report({"families": out})
    return {"families": out, "ok": all(f["identical"] == f["of"] for f in out.values())}


def stage_kernels(device: str, workdir: Path, quick: bool) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    files = ["tests/engine/test_gpu_kernels.py", "tests/engine/test_triton_fused.py"]
    files = [f for f in files if (ROOT / f).exists()]
    # -P and append mode: the installed pdserve on PYTHONPATH (build/gpu), not the source
    # tree's pdserve/ folder, which lacks the subpackages that only the build maps into it.
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=append",
           "-k", "cuda or gpu", *files]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)  # the stage's limit ends it
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"command": " ".join(cmd[1:]), "returncode": proc.returncode, "summary": tail[-1] if tail else "",
            "tail": tail, "ok": proc.returncode == 0}


def stage_cluster(device: str, workdir: Path, quick: bool, deadline: float) -> dict:
    from pdserve.benchmarks import gpu_cluster

    big = None if quick else checkpoint(workdir / "llama-1b", ONE_B)  # written by the engine stage
    budget = deadline - time.time() - 15  # 15 s: the nodes' stop, and the result's way back
    if budget < 30:
        raise TimeoutError(f"{budget:.0f} s left: too little to start the clusters")
    return gpu_cluster.run(device, workdir, workdir / "logs", quick=quick, ttft_model=big, budget_s=budget)


STAGES = {"engine": gpu_engine.stage_engine, "parity": stage_parity, "kernels": stage_kernels, "cluster": stage_cluster,
          "families": stage_families}
LIMITS_S = {"engine": 150, "parity": 90, "kernels": 150, "cluster": 180, "families": 90}
# The figures that matter most run first: a run cut short by its deadline loses the rest.
ORDER = "engine,cluster,parity,kernels,families"


def _child(fn, params: tuple, conn) -> None:
    os.setsid()  # its own process group: a stage killed at its limit takes its children along
    launch.set_parent_death_signal(signal.SIGKILL)  # out of our group, it must die with us
    stage_progress.attach(conn)
    try:
        conn.send({"ok": True, **fn(*params)})
    except BaseException as err:  # the parent records it and goes on with the next stage
        conn.send({"ok": False, "error": repr(err), "traceback": traceback.format_exc()[-4000:]})


def _answer(parent, proc, limit_s: float) -> dict:
    """The stage's result; failing, with the figures it reported (`stage_progress`) before."""
    end = time.monotonic() + limit_s
    partial: dict = {}
    while True:
        if not parent.poll(max(0.0, end - time.monotonic())):
            return {**partial, "ok": False, "error": f"timed out after {limit_s:.0f} s"}
        try:
            message = parent.recv()
        except EOFError:
            proc.join(5)
            return {**partial, "ok": False, "error": f"the stage's process died (exit code {proc.exitcode})"}
        if "partial" not in message:
            proc.join(5)  # it answered: let it end by itself
            return message if message.get("ok") else {**partial, **message}
        partial = message["partial"]


def run_stage(fn, params: tuple, limit_s: float) -> dict:
    """`fn(*params)` in a child process for at most `limit_s`; a crash is reported as soon as
    the child dies, with its exit code. Whatever happens, nothing of the stage is left."""
    ctx = mp.get_context("spawn")  # CUDA does not survive fork
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, params, child))
    start = time.perf_counter()
    proc.start()
    child.close()  # else the parent's copy keeps the pipe open and a dead child is never seen
    try:
        result = _answer(parent, proc, limit_s)
    finally:  # a timeout, or our own end (Ctrl-C, SIGTERM): the stage and what it started
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if proc.is_alive():  # killed before its setsid: not a group of its own yet
            proc.kill()
        proc.join(5)
    result.setdefault("ok", False)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    return result


def stage_params(name: str, args, limit_s: float) -> tuple:
    extra = {"engine": (args.hf_new_tokens,), "cluster": (time.time() + limit_s,)}.get(name, ())
    return (args.device, Path(args.workdir), args.quick, *extra)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu with --quick (default cuda)")
    p.add_argument("--quick", action="store_true", help="tiny models and sizes: a smoke test of this script")
    p.add_argument("--stages", default=ORDER, help=f"comma-separated subset, in order (default {ORDER})")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_check.json"), help="JSON file")
    p.add_argument("--workdir", default="/tmp/pdserve-gpu-check", help="checkpoints and logs")
    p.add_argument("--hf-new-tokens", type=int, default=256,
                   help="new tokens per prompt of the transformers baseline (default 256, as pdserve's)")
    p.add_argument("--stage-limit-s", type=float, default=None, help="time limit of each stage")
    p.add_argument("--deadline-s", type=float, default=520,
                   help="time limit of the whole check; a stage gets at most what is left (default 520 s,"
                        " inside a 10-minute command with the installs)")
    p.add_argument("--logs-archive", default=None,
                   help="also write the nodes' logs as one .tar.gz here (a device machine returns few files)")
    return p


# What the check and the nodes it starts import beyond the standard library: named at the
# start when missing, so a run without them says why its stages fail.
NEEDED = ("torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "grpc", "grpc_health",
          "grpc_reflection", "google.protobuf", "nixl", "uvloop", "aiohttp", "prometheus_client", "pytest")


def missing_packages() -> list[str]:
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM (an outer `timeout`) ends the check as Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    end = time.monotonic() + args.deadline_s
    report = {"command": "pdserve bench gpu " + " ".join(argv if argv is not None else sys.argv[1:]),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "missing_packages": missing_packages(), "stages": {}}
    if report["missing_packages"]:
        print(f"[gpu-check] not importable here: {', '.join(report['missing_packages'])}", file=sys.stderr, flush=True)
    for name in args.stages.split(","):
        print(f"[gpu-check] {name} ...", file=sys.stderr, flush=True)
        limit = min(args.stage_limit_s or LIMITS_S[name], end - time.monotonic())
        report["stages"][name] = run_stage(STAGES[name], stage_params(name, args, limit), limit) if limit > 5 else {
            "ok": False, "error": f"not run: {args.deadline_s:.0f} s deadline reached", "wall_s": 0}
        print(f"[gpu-check] {name}: ok={report['stages'][name]['ok']} in {report['stages'][name]['wall_s']} s",
              file=sys.stderr, flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    report["ok"] = all(s["ok"] for s in report["stages"].values())
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.logs_archive and (Path(args.workdir) / "logs").is_dir():
        shutil.make_archive(args.logs_archive.removesuffix(".tar.gz"), "gztar", Path(args.workdir) / "logs")
    print(json.dumps(summary(report), indent=1))
    return 0 if report["ok"] else 1


def summary(report: dict) -> dict:
    """The figures worth a glance; the file has the rest."""
    out = {name: s.get("ok") for name, s in report["stages"].items()}
    eng = report["stages"].get("engine", {})
    for r in eng.get("decode_steps", []):
        out[f"step_b{r['batch']}_ms"] = (r["median_ms"], r.get("graph_replay_ms"), r.get("limit_ms_datasheet"))
    if "throughput" in eng:
        out["tok_s"] = (eng["throughput"]["tokens_per_s"], eng.get("transformers", {}).get("tokens_per_s"))
    for r in eng.get("attention") or []:
        out[f"attn_b{r['batch']}_ctx{r['context']}_us"] = (r["us_as_run"], r["us_unsplit"], r["limit_us_datasheet"])
    for p in eng.get("profile") or []:
        out[f"profile_b{p['batch']}"] = p.get("error") or [(k["kernel"][:40], k["us_per_step"]) for k in p["top"][:4]]
    ttft = report["stages"].get("cluster", {}).get("stages", {}).get("ttft", {})
    for setup, r in ttft.get("by_setup", {}).items():
        out[f"ttft_{setup}"] = (r.get("ttft_s"), r.get("prefill_alone_s"), r.get("transfer_added_fraction"),
                                r.get("kv_writes"), r.get("kv_descriptors"))
        out[f"ttft_{setup}_parts"] = r.get("breakdown")
    for name, s in report["stages"].items():
        if not s.get("ok"):
            out[f"{name}_error"] = (s.get("error") or s.get("summary") or "")[:300]
    return out


if __name__ == "__main__":
    process_gc.own_process()
    sys.exit(main())
