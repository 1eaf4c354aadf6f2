"""What a checkpoint directory must hold before pdserve hands it to transformers: a
config.json, safetensors weights (the engine reads no other format) and a tokenizer; and
weights that can be read, none cut short by an interrupted download.

Checked where a command takes `--model DIR` (pdserve/models_cli.py), so a wrong directory
is one line naming what is missing or damaged, not transformers' tracebacks about whatever
it tried next (an empty directory sent it looking for sentencepiece), nor safetensors'
about a header that names no file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def missing_files(model_dir: str | os.PathLike, weights: bool = True) -> list[str]:
    """What `model_dir` lacks to be served, in words, or []; `weights`: the weights too (a
    router needs only the config and the tokenizer)."""
    d = Path(model_dir)
    missing = []
    if not (d / "config.json").is_file():
        missing.append("config.json")
    if weights and not any(d.glob("*.safetensors")):
        if any(d.glob("*.bin")):
            missing.append("safetensors weights (*.safetensors; pdserve cannot read its *.bin "
                           "weights: save them with safetensors)")
        else:
            missing.append("weights (*.safetensors)")
    if not ((d / "tokenizer.json").is_file() or (d / "tokenizer.model").is_file()
            or ((d / "vocab.json").is_file() and (d / "merges.txt").is_file())):
        missing.append("tokenizer (tokenizer.json, tokenizer.model, or vocab.json with "
                       "merges.txt)")
    return missing


def damaged_weights(model_dir: str | os.PathLike) -> list[str]:
    """The weight files of `model_dir` that cannot be read, each with why, in words, or []:
    a file that its index lists and the directory lacks, or one whose header safetensors
    refuses (cut short, or not safetensors at all). Reads each file's header alone."""
    from safetensors import SafetensorError, safe_open

    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if not index.is_file():
        files, damaged = sorted(d.glob("*.safetensors")), []
    else:
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            return [f"{index.name} cannot be read ({type(err).__name__}: {err})"]
        files = [d / name for name in names if (d / name).is_file()]
        damaged = [f"{name} (listed in {index.name}) is missing" for name in names if not (d / name).is_file()]
    for path in files:
        try:
            with safe_open(str(path), framework="numpy"):
                pass
        except (SafetensorError, OSError) as err:
            damaged.append(f"{path.name} cannot be read ({err})")
    return damaged
