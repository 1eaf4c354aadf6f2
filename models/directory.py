"""What a checkpoint directory must hold before pdserve hands it to transformers: a
config.json, safetensors weights (the engine reads no other format) and a tokenizer.

Checked where a command takes `--model DIR` (pdserve/models_cli.py), so a wrong directory
is one line naming what is missing, not transformers' tracebacks about whatever it tried
next (an empty directory sent it looking for sentencepiece).
"""

from __future__ import annotations

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
