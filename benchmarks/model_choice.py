"""Which model a benchmark measures: `--model NAME|DIR`, the real model by default.

A benchmark's `--model` takes what every server's takes (`pdserve.models`: a checkpoint
directory or a catalogue name; by default smollm2-135m-instruct, converted once into the
cache) and also the random-weight checkpoints of the benchmarks, written once into the
cache on first use:
- `bench-random-100m`: a Llama of about 100M parameters (hidden 1024, 8 layers, 16 query /
  4 KV heads, intermediate 2816, vocabulary 8192), the model of the first engine figures;
- `bench-random-moe`: a Mixtral of 8 experts, 2 a token (hidden 512, 8 layers, 8 query / 2
  KV heads, expert intermediate 1024, vocabulary 8192: about 110M parameters, 30M of them
  run a token), for the mixture-of-experts path;
- `bench-random-tiny`: 2 layers of hidden 128 and a vocabulary of 1024, for tests and
  smoke runs, never for a figure.
Their tokenizer is the small one `engine.checkpoint` trains, with far fewer entries than
their vocabulary, so the benchmarks send token ids, not text.

Every result records the model as `{"name", "dir", "dtype"}`: the catalogue name (a
converted directory's card says it; a random model's name is its own), the directory the
engines loaded, and the dtype they ran in.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from pdserve.models.catalogue import CATALOGUE, DEFAULT_MODEL, UnknownModel, cache_root, served_name

RANDOM_MODELS = {
    "bench-random-100m": dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816,
                              num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                              max_position_embeddings=2048, initializer_range=0.02),
    "bench-random-moe": dict(family="mixtral", vocab_size=8192, hidden_size=512, intermediate_size=1024,
                             num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                             num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=2048,
                             initializer_range=0.02),
    "bench-random-tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=344,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=512, initializer_range=0.02),
}
RANDOM_VERSION = "v1"  # bump when a geometry above changes, so old caches are not reused
KNOWN = (*CATALOGUE, *RANDOM_MODELS)
MODEL_HELP = (f"checkpoint directory or model name: {', '.join(KNOWN)} "
              f"(default: %(default)s, the real model; bench-random-* have random weights)")


@dataclass(frozen=True)
class MeasuredModel:
    name: str  # catalogue or random-model name; a plain directory's name is the directory
    dir: str

    def record(self, dtype: str) -> dict:
        return {"name": self.name, "dir": self.dir, "dtype": dtype}

    def described(self, dtype: str, config) -> dict:
        """`record`, with the checkpoint's size and shape (`config`: its transformers config)."""
        return {**self.record(dtype), "parameters": count_parameters(self.dir), "vocab_size": config.vocab_size,
                "hidden_size": config.hidden_size, "num_layers": config.num_hidden_layers}


def count_parameters(model_dir: str) -> int:
    """Parameters stored in the checkpoint (a tied output layer is stored, and counted, once)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


def add_model_flag(p, help: str = MODEL_HELP) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME|DIR", help=help)


def add_transformers_comparison_flags(p, quick: str) -> None:
    """The flags of a benchmark that runs pdserve's `LLM` beside transformers in one process:
    the model, both engines' dtype, transformers' batch, `--quick` (`quick`: what it runs)
    and `--json`."""
    add_model_flag(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="both engines' dtype (default float32)")
    p.add_argument("--hf-batch-size", type=int, default=8, help="transformers' batch (default 8)")
    p.add_argument("--quick", action="store_true", help=f"{quick}: a smoke test, not a figure")
    p.add_argument("--json", action="store_true", help="print the report as JSON (else a summary)")


def resolve(model: str) -> MeasuredModel:
    """The directory `model` names, converted or written first if need be; UnknownModel
    naming every known name otherwise."""
    if model in RANDOM_MODELS:
        return MeasuredModel(model, str(ensure_random(model)))
    from pdserve.models_cli import resolve_model

    try:
        path = resolve_model(model)
    except UnknownModel:
        raise UnknownModel(f"--model {model!r} is neither a checkpoint directory nor a known "
                           f"model; known models: {', '.join(KNOWN)}") from None
    return MeasuredModel(served_name(path), path)


def resolve_or_exit(model: str, prog: str) -> MeasuredModel:
    """`resolve` for a command line: the reason and exit status 2 on failure."""
    from pdserve.models.convert import ModelUnavailable

    try:
        return resolve(model)
    except (UnknownModel, ModelUnavailable) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def ensure_random(name: str) -> Path:
    """Random-weight model `name`, written once into the cache (into a temporary directory
    renamed into place, so a concurrent first run never sees half of it)."""
    from pdserve.engine.checkpoint import write_checkpoint

    target = cache_root() / f"{name}-{RANDOM_VERSION}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"
    geometry = dict(RANDOM_MODELS[name])
    write_checkpoint(tmp, family=geometry.pop("family", "llama"), seed=0, **geometry)
    try:
        os.rename(tmp, target)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def node_dtype(node_args: list[str]) -> str:
    """The dtype workers started with `node_args` run in: their `--dtype`, else
    `$PDSERVE_DTYPE` (`pdserve.envflags`), else the engine's default."""
    from pdserve.engine.config import EngineConfig

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--dtype", default=os.environ.get("PDSERVE_DTYPE")
                        or EngineConfig.__dataclass_fields__["dtype"].default)
    return parser.parse_known_args(node_args)[0].dtype


def node_device(node_args: list[str]) -> str:
    """The device workers started with `node_args` run on: their `--device`, else
    `$PDSERVE_DEVICE`, else the engine's default (the CPU)."""
    from pdserve.engine.config import EngineConfig

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--device", default=os.environ.get("PDSERVE_DEVICE")
                        or EngineConfig.__dataclass_fields__["device"].default)
    return parser.parse_known_args(node_args)[0].device
