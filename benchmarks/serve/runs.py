"""What every serving-benchmark run shares: the backend, the workload of each run, one
row of results per run, and where the results go (JSON, file, tables)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pdserve.benchmarks.serve import workload as wl


def make_backend(args):
    from pdserve.benchmarks.serve.backends import GrpcBackend, OpenAIBackend

    if args.backend == "openai":
        if not args.url:
            raise SystemExit("pdserve bench serve: --backend openai needs --url")
        return OpenAIBackend(args.url, args.served_model, args.timeout_s)
    return GrpcBackend(args.server, args.timeout_s)


def _served_dir(model: str) -> str | None:
    """The local directory of a served model: the directory itself, or a catalogue name's
    converted directory in this machine's cache (None if it has none)."""
    from pdserve.models.catalogue import cached

    if not model:
        return None
    if Path(model).is_dir():
        return model
    found = cached(model)
    return str(found) if found else None


def load_tokenizer(args, limits):
    """The tokenizer of `--tokenizer`, else of the model the server names: a directory, a
    catalogue model converted in this machine's cache, or a Hugging Face model id. Only a
    `--tokenizer` is fetched from the hub; the server's model is looked for on this machine
    (the hub's cache included), so an offline run is not held up by the hub's retries. None
    when none loads."""
    source = args.tokenizer or limits.model
    if not source:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(_served_dir(source) or source,
                                             local_files_only=not args.tokenizer)
    except (OSError, ValueError):  # no such directory or model id, or no tokenizer in it
        return None


def make_workload(args, limits):
    """`workload_for(key)`: the requests of the warm-up ("warmup") or of run `key`."""
    def size(key):
        return args.warmup if key == "warmup" else args.num_prompts

    if args.dataset:
        pairs, tokenizer = wl.read_sharegpt(args.dataset), load_tokenizer(args, limits)
        if tokenizer is None:
            print(f"pdserve bench serve: no tokenizer for {args.tokenizer or limits.model!r} "
                  "(give --tokenizer); estimating 4 characters per token", file=sys.stderr)

        def count(text: str) -> int:
            return len(tokenizer.encode(text)) if tokenizer else max(1, len(text) // 4)

        return lambda key: wl.sample_sharegpt(pairs, size(key), count, f"{args.seed}-{key}",
                                              limits.max_model_len or 0, args.sharegpt_output_len)
    vocab = args.vocab_size or limits.vocab_size  # the server's, over gRPC
    if not vocab:  # an OpenAI server does not say: its model's tokenizer does
        tokenizer = load_tokenizer(args, limits)
        if tokenizer is None:
            raise SystemExit(f"pdserve bench serve: synthetic prompts need the vocabulary, and "
                             f"no tokenizer of {args.tokenizer or limits.model!r} loads; give "
                             "--tokenizer DIR|MODEL_ID or --vocab-size N")
        vocab = len(tokenizer)
    longest = args.input_len[1] + args.output_len[1]
    if limits.max_model_len and longest > limits.max_model_len:
        raise SystemExit(f"pdserve bench serve: --input-len {args.input_len[1]} + --output-len "
                         f"{args.output_len[1]} exceeds the model's {limits.max_model_len} tokens")
    return lambda key: wl.synthetic(size(key), args.input_len, args.output_len, vocab,
                                    f"{args.seed}-{key}")


def workload_info(args) -> dict:
    if args.dataset:
        return {"dataset": args.dataset, "num_prompts": args.num_prompts, "seed": args.seed,
                "output_len": args.sharegpt_output_len}
    return {"dataset": "synthetic", "num_prompts": args.num_prompts, "seed": args.seed,
            "input_len": list(args.input_len), "output_len": list(args.output_len)}


def fixed_objectives(args):
    """The `--slo-*` objectives; the older `--ttft-slo-ms`/`--tpot-slo-ms` fill them in."""
    from pdserve.benchmarks.serve.metrics import Objectives

    ttft_s, tpot_ms = args.slo_ttft_s, args.slo_tpot_ms
    if getattr(args, "ttft_slo_ms", None) is not None:
        if ttft_s is not None:
            raise SystemExit("pdserve bench serve: give --slo-ttft-s or --ttft-slo-ms, not both")
        ttft_s = args.ttft_slo_ms / 1000
    if getattr(args, "tpot_slo_ms", None) is not None:
        if tpot_ms is not None:
            raise SystemExit("pdserve bench serve: give --slo-tpot-ms or --tpot-slo-ms, not both")
        tpot_ms = args.tpot_slo_ms
    try:
        return Objectives(ttft_s, tpot_ms, args.slo_itl_p99_ms)
    except ValueError as err:
        raise SystemExit(f"pdserve bench serve: {err}") from None


def run_row(run, args, objectives=None) -> dict:
    """One run's summary; with objectives given, its `goodput`, `good_requests` and
    `goodput_fraction` against them."""
    from pdserve.benchmarks.serve.metrics import summarize

    row = {**run.settings(), **summarize(run.results)}
    if objectives is not None and objectives.given():
        row.update(objectives.goodput(run.results, row["duration_s"]))
    if args.per_request:
        row["requests"] = [r.to_dict() for r in run.results]
    return row


def emit(result: dict, args, tables) -> None:
    text = json.dumps(result, indent=2)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text + "\n")
    if args.json:
        print(text)
    else:
        from pdserve.benchmarks.serve.report import show

        show(*tables)
