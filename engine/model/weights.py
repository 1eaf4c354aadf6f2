"""Loading a Hugging Face checkpoint directory: config, tokenizer and safetensors weights
(one file or several with an index), without transformers' model classes.

Of a multimodal checkpoint whose language model is a family served here (Gemma 3's 4B and
up, `Gemma3ForConditionalGeneration`; Mistral Small 3.1 and 3.2, `Mistral3ForConditionalGeneration`;
Llama 4, `Llama4ForConditionalGeneration`; Aya Vision and Command A Vision, whose language
models are Cohere's; Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE), the language model
alone is loaded: its text config
and its weights, renamed as the text model's own; the vision tower is never read."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm


# multimodal model types whose language model is served
TEXT_PARTS = ("gemma3", "mistral3", "llama4", "aya_vision", "cohere2_vision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
              "qwen3_vl_moe")
_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")  # its weights', as saved
_VISION_PARTS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                 "vision_model.", "model.vision_model.",  # (Llama 4's)
                 "visual.", "model.visual.")  # (Qwen-VL's)


def load_config(model_dir: str | Path):
    """The transformers config of the model served (a multimodal one's text config)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    if config.model_type not in TEXT_PARTS:
        return config
    text = config.get_text_config()
    # transformers ties the LM head to the embeddings by the whole model's flag, not its text config's
    text.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
    return text


def _served_name(name: str) -> str | None:
    """`name` as the text model's own, None for a vision weight."""
    if name.startswith(_VISION_PARTS):
        return None
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return name.replace("language_model.lm_head.", "lm_head.", 1)


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
    """Every tensor of the checkpoint, by its Hugging Face name: floating ones cast to `dtype`."""
    state = {}
    # A progress bar on an interactive stderr only (tqdm's disable=None): logs stay clean.
    files = safetensors_files(model_dir)
    with tqdm(desc="Loading weights", unit="tensor", disable=None, leave=False) as bar:
        for i, path in enumerate(files):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names = [(name, _served_name(name)) for name in f.keys()]
                names = [(name, served) for name, served in names if served is not None]
                bar.set_postfix_str(f"file {i + 1}/{len(files)}")
                bar.total = (bar.total or 0) + len(names)
                for name, served in names:
                    # Quantized codes (GPT-OSS's MXFP4 uint8) keep their type; a router's
                    # correction bias (GLM-4.5's) stays float32, as transformers keeps it.
                    t = f.get_tensor(name)
                    cast = torch.float32 if name.endswith("e_score_correction_bias") else dtype
                    state[served] = t.to(device=device, dtype=cast if t.is_floating_point() else t.dtype)
                    bar.update()
    return state
