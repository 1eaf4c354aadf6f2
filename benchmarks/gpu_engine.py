"""The engine stage of `pdserve bench gpu` (benchmarks/gpu.py says what it measures):
decode steps beside the memory-bandwidth limit, and throughput against transformers'
`generate` measured in the same run."""

from __future__ import annotations

import contextlib
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from pdserve.benchmarks import host_step, stage_progress
from pdserve.benchmarks.gpu_models import FIRST_ID, ONE_B, TINY, checkpoint

DATASHEET_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def copy_bandwidth(device: str) -> float | None:
    """Device-to-device copy rate (bytes read + written per second) of a 2 GiB buffer."""
    import torch

    if not device.startswith("cuda"):
        return None
    x = torch.empty(1 << 30, dtype=torch.int16, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    end.synchronize()
    rate = 10 * 2 * x.numel() * 2 / (start.elapsed_time(end) / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return rate


def weight_bytes(engine) -> int:
    """Bytes a decode step reads of the weights: every linear layer, the norms, the LM head."""
    m = engine.model
    size = engine.kv_cache.element_size()  # the model's dtype
    total = (m.lm_head.in_features * m.lm_head.out_features + m.norm.numel()) * size
    for layer in m.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            total += lin.in_features * lin.out_features * size
        total += (layer.input_norm.numel() + layer.post_norm.numel()) * size
    return total


def decode_steps(engine, batch: int, prompt_len: int, steps: int, rng: random.Random, device: str,
                 timer: "GraphTimer | None" = None, around=None) -> dict:
    """Median wall time of `steps` decode steps of `batch` sequences, all decoding (and,
    with `timer`, the median GPU time of their graph replays); `around`, a context manager
    the measured steps run in (a profiler)."""
    from pdserve.engine import SamplingParams

    vocab = engine.vocab_size
    # No sequence may finish before the batch has decoded together: while decodes run, the
    # step budget cuts the others' prefill into chunks (engine/step_budget.py), so the
    # first ones decode for as many steps as the rest take to prefill. Aborted at the end.
    params = SamplingParams(max_tokens=engine.max_model_len - prompt_len, temperature=0.0, ignore_eos=True)
    ids = [f"step{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(FIRST_ID, vocab) for _ in range(prompt_len)], params)
    while any(not s.output_token_ids for r in engine.requests.values() for s in r.seqs):
        engine.step()
    times, scheduled = [], []
    contexts = [s.num_tokens for r in engine.requests.values() for s in r.seqs]
    if timer:
        timer.take_median_ms()  # not the replays of the steps that filled the batch
    with around or contextlib.nullcontext():
        for _ in range(steps):
            _sync(device)
            start = time.perf_counter()
            engine.step()
            _sync(device)
            times.append(time.perf_counter() - start)
            scheduled.append(engine.last_step_scheduled)
    for rid in ids:
        engine.abort(rid)
    m = engine.model
    kv_per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * engine.kv_cache.element_size()
    context = sum(contexts) / len(contexts) + steps / 2  # mean context of the measured steps
    step_bytes = weight_bytes(engine) + batch * context * kv_per_token
    return {"batch": batch, "prompt_len": prompt_len, "steps": steps,
            "all_steps_full": all(n == batch for n in scheduled),
            "median_ms": round(1e3 * statistics.median(times), 3),
            "p90_ms": round(1e3 * sorted(times)[int(0.9 * (len(times) - 1))], 3),
            "graph_replay_ms": timer.take_median_ms() if timer else None,
            "bytes_read_per_step": int(step_bytes)}


class GraphTimer:
    """GPU time of each decode step's input copy and graph replay, by CUDA events: the start
    is recorded when `DecodeGraphs.run` has filled its host buffer and copies it, the end
    when the replay is queued (the host's share of a step is its wall time less this)."""

    def __init__(self, engine):
        import torch

        self.graphs = engine.runner.graphs
        self.pairs: list = []
        run, copy = self.graphs.run, self.graphs._copy
        started: list = []

        def timed_copy(b):
            started.append(torch.cuda.Event(enable_timing=True))
            started[-1].record()
            copy(b)

        def timed_run(seqs):
            out = run(seqs)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pairs.append((started.pop(), end))
            return out

        self.graphs._copy, self.graphs.run = timed_copy, timed_run

    def take_median_ms(self) -> float | None:
        times = [s.elapsed_time(e) for s, e in self.pairs]
        self.pairs = []
        return round(statistics.median(times), 3) if times else None


def step_report(engine, batches, prompt_len: int, steps: int, device: str) -> dict:
    """Decode steps at each batch size, each beside the memory-bandwidth limit of its bytes
    (at the datasheet's rate for this device, and at the copy rate measured here)."""
    import torch

    rate = copy_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor()
    datasheet = next((v for k, v in DATASHEET_BYTES_PER_S.items() if k in name), None)
    rng = random.Random(0)
    decode_steps(engine, batches[0], prompt_len, 2, rng, device)  # warm-up
    timer = GraphTimer(engine) if engine.runner.graphs is not None else None
    rows = []
    for b in batches:
        print(f"[bench] decode steps at batch {b}", file=sys.stderr, flush=True)
        r = decode_steps(engine, b, prompt_len, steps, rng, device, timer)
        for label, bw in (("limit_ms_datasheet", datasheet), ("limit_ms_measured_copy", rate)):
            r[label] = round(1e3 * r["bytes_read_per_step"] / bw, 3) if bw else None
        rows.append(r)
        stage_progress.report({"decode_steps": rows})
    return {"device_name": name, "copy_bytes_per_s": rate, "datasheet_bytes_per_s": datasheet,
            "decode_steps": rows}


def _time_us(fn, repeats: int, device: str) -> float:
    """Mean time of `fn()` in microseconds. On a GPU, of `repeats` calls captured in one CUDA
    graph and replayed: launched one by one from Python, a call of a few microseconds on
    the GPU would time the host's launch instead."""
    import torch

    fn()  # compiles
    if not device.startswith("cuda"):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return 1e6 * (time.perf_counter() - start) / repeats
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(repeats):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (5 * repeats)


def attention_report(engine, device: str, datasheet: float | None, quick: bool) -> list[dict]:
    """Decode attention alone over one layer's K/V, in the model's geometry: each context cut
    into splits as the engine does (`decode_splits`) against one program per sequence and
    KV head, beside the time to read the batch's K and V once at the datasheet's rate, and
    the same call with other (query rows, tile, warps) than `launch_config`'s. On a CPU,
    through Triton's interpreter, with three splits standing for a GPU's choice."""
    import torch

    from pdserve.engine.attention import triton_ops

    on_gpu = device.startswith("cuda")
    m, ps, dtype = engine.model, engine.page_size, engine.kv_cache.dtype
    rows = []
    shapes = ((1, 200), (4, 64)) if quick else ((1, 4096), (1, 32768), (8, 4096), (64, 768), (256, 768))
    for batch, context in shapes:
        pages = batch * -(-context // ps)
        k_cache = torch.randn(pages, ps, m.num_kv_heads, m.head_dim, dtype=dtype, device=device)
        v_cache = torch.randn_like(k_cache)
        tables = torch.arange(pages, device=device).view(batch, -1)
        starts = torch.arange(batch + 1, device=device)
        lens = torch.full((batch,), context, device=device)
        q = torch.randn(batch, m.num_heads, m.head_dim, dtype=dtype, device=device)
        splits = triton_ops.decode_splits(batch, m.num_kv_heads, torch.device(device)) if on_gpu else 3
        times = {n: _time_us(lambda n=n: triton_ops.paged_attention(
            q, k_cache, v_cache, tables, starts, lens, ps, m.head_dim ** -0.5, max_query_len=1, num_splits=n),
            2 if quick else 50, device) for n in sorted({1, splits})}
        kv_bytes = 2 * batch * context * m.num_kv_heads * m.head_dim * k_cache.element_size()
        # Other (rows, tile, warps) for the same call: which tile the GPU likes, measured.
        default = triton_ops.launch_config(m.head_dim, dtype == torch.float32, True)
        tiles = {"x".join(map(str, t)): round(_time_us(lambda t=t: triton_ops.paged_attention(
            q, k_cache, v_cache, tables, starts, lens, ps, m.head_dim ** -0.5, max_query_len=1, num_splits=splits,
            launch=t), 2 if quick else 50, device), 1) for t in (default, (16, 32, 4), (16, 64, 8))}
        rows.append({"batch": batch, "context": context, "splits": splits,
                     "us_unsplit": round(times[1], 1), "us_as_run": round(times[splits], 1),
                     "speedup": round(times[1] / times[splits], 2),
                     "limit_us_datasheet": round(1e6 * kv_bytes / datasheet, 1) if datasheet else None,
                     "us_by_tile": tiles})
        del k_cache, v_cache
    if on_gpu:
        torch.cuda.empty_cache()
    return rows


def kernel_profile(engine, batch: int, prompt_len: int, device: str, steps: int = 8) -> dict:
    """GPU time per decode step by kernel (torch.profiler, CUPTI: the kernels inside a
    graph replay too), the largest first: where a step's time goes (on a CPU, its ops'
    own time). Never fails the stage: a profiler that cannot run gives its error instead."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.startswith("cuda")
    try:
        prof = profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU])
        decode_steps(engine, batch, prompt_len, steps, random.Random(2), device, around=prof)
        kind = torch.autograd.DeviceType.CUDA if on_gpu else torch.autograd.DeviceType.CPU
        per_step = sorted(((e.key, (e.self_device_time_total if on_gpu else e.self_cpu_time_total) / steps,
                            e.count / steps) for e in prof.key_averages() if e.device_type == kind),
                          key=lambda k: -k[1])
        total = sum(t for _, t, _ in per_step)
        return {"batch": batch, "steps": steps, "us_per_step": round(total, 1),
                "top": [{"kernel": name[:120], "us_per_step": round(t, 1), "calls_per_step": n,
                         "share": round(t / total, 3) if total else None} for name, t, n in per_step[:15]]}
    except Exception as err:  # noqa: BLE001 - a profile is extra; its failure is reported, not raised
        return {"batch": batch, "error": repr(err)[:300]}


def stage_engine(device: str, workdir: Path, quick: bool, hf_new_tokens: int) -> dict:
    if device == "cpu":  # the stage's own process: Triton, imported after this, interprets
        os.environ["TRITON_INTERPRET"] = "1"
    from pdserve.engine import LLM, SamplingParams

    model_dir = checkpoint(workdir / ("tiny" if quick else "llama-1b"), TINY if quick else ONE_B)
    dtype = "float32" if quick and device == "cpu" else "bfloat16"
    batches, prompt_len, steps = ((1, 4, 8), 16, 4) if quick else ((1, 64, 256), 128, 64)
    n_prompts, in_len, out_len = (8, 32, 8) if quick else (64, 512, 256)
    start = time.perf_counter()
    # A pool of 16 GiB holds every batch here many times over and leaves the GPU room for
    # transformers' baseline beside the engine, so that the extra figures below can come
    # last: a failure there loses nothing measured before.
    pool = 16 << 30 if device.startswith("cuda") else None
    llm = LLM(model_dir, dtype=dtype, device=device, max_num_seqs=max(batches), enable_prefix_cache=False,
              kv_cache_memory_bytes=pool)
    engine = llm.engine
    out = {"dtype": dtype, "model": model_dir, "geometry": TINY if quick else ONE_B,
           "engine_start_s": round(time.perf_counter() - start, 2),
           **step_report(engine, batches, prompt_len, steps, device)}
    stage_progress.report(out)
    rng = random.Random(1)
    prompts = [[rng.randrange(FIRST_ID, engine.vocab_size) for _ in range(in_len)] for _ in range(n_prompts)]
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    print(f"[gpu-check] engine: throughput, {n_prompts} x {in_len} -> {out_len}", file=sys.stderr, flush=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    _sync(device)
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    _sync(device)
    elapsed = time.perf_counter() - start
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    out["throughput"] = {"prompts": n_prompts, "prompt_len": in_len, "new_tokens": out_len, "seconds": round(elapsed, 3),
                         "generated_tokens": generated, "tokens_per_s": round(generated / elapsed, 1)}
    stage_progress.report(out)
    out["transformers"] = transformers_baseline(model_dir, dtype, device, prompts, hf_new_tokens if not quick else 4)
    out["throughput"]["over_transformers"] = round(
        out["throughput"]["tokens_per_s"] / out["transformers"]["tokens_per_s"], 2)
    stage_progress.report(out)
    print("[gpu-check] engine: decode attention, split and not; a kernel profile", file=sys.stderr, flush=True)
    out["attention"] = attention_report(engine, device, out["datasheet_bytes_per_s"], quick)
    stage_progress.report(out)
    out["profile"] = [kernel_profile(engine, b, prompt_len, device) for b in (batches[0], batches[1])]
    stage_progress.report(out)
    # The host's part of those steps on this machine's CPU (`pdserve bench host`).
    out["host"] = host_step.run(model_dir, list(batches), 4 if quick else 100, 16)
    return out


def transformers_baseline(model_dir: str, dtype: str, device: str, prompts, new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:2], **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        _sync(device)
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        _sync(device)
    elapsed = time.perf_counter() - start
    return {"prompts": len(prompts), "new_tokens": new_tokens, "seconds": round(elapsed, 3),
            "tokens_per_s": round(len(prompts) * new_tokens / elapsed, 1)}
