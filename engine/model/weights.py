"""Loading a Hugging Face checkpoint directory: config, tokenizer and safetensors weights
(one file or several with an index), without transformers' model classes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm


def load_config(model_dir: str | Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir))


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return files


def load_state_dict(model_dir: str | Path, dtype: torch.dtype, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, cast to `dtype`, by its Hugging Face name."""
    state = {}
    # A progress bar on an interactive stderr only (tqdm's disable=None): logs stay clean.
    files = safetensors_files(model_dir)
    with tqdm(desc="Loading weights", unit="tensor", disable=None, leave=False) as bar:
        for i, path in enumerate(files):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names = list(f.keys())
                bar.set_postfix_str(f"file {i + 1}/{len(files)}")
                bar.total = (bar.total or 0) + len(names)
                for name in names:
                    state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
                    bar.update()
    return state
