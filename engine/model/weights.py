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
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from pdserve.process_gc import trim_heap

TRIM_EVERY = 256 << 20  # bytes that Weights.pop hands out between two trims of the heap

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


# a decoder layer's served name (EXAONE 3's released ones are GPT-2's)
_LAYER = re.compile(r"^(?:model\.layers|transformer\.h)\.(\d+)\.")


def read_groups(model_dir: str | Path) -> Iterator[dict[str, torch.Tensor]]:
    """The checkpoint's tensors as stored, by served name, a group at a time: those outside the
    decoder layers first, then each layer's. They are views of the files' memory maps, read
    from disk as they are touched: a tensor-parallel rank that converts and cuts one group
    before the next, and copies only what it keeps (`Weights`), holds its own part of the
    model, not every rank's."""
    files = safetensors_files(model_dir)
    groups: dict[int, list] = {}
    # A progress bar on an interactive stderr only (tqdm's disable=None): logs stay clean.
    with ExitStack() as files_open, tqdm(desc="Loading weights", unit="tensor", disable=None, leave=False) as bar:
        for path in files:
            f = files_open.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            for name in f.keys():
                if (served := _served_name(name)) is not None:
                    layer = _LAYER.match(served)
                    groups.setdefault(int(layer[1]) if layer else -1, []).append((f, name, served))
        bar.total = sum(map(len, groups.values()))
        for layer in sorted(groups):
            group = {}
            for f, name, served in groups[layer]:
                group[served] = f.get_tensor(name)
                bar.update()
            yield group


def mapped_storages(group: dict[str, torch.Tensor]) -> set[int]:
    """Where `read_groups`' tensors lie: what `Weights.add` tells the files' views by."""
    return {t.untyped_storage().data_ptr() for t in group.values()}


def _kept(name: str, t: torch.Tensor, dtype: torch.dtype, device: str, copy: bool) -> torch.Tensor:
    """`t` as the engine keeps it: a contiguous tensor on `device`, floating in `dtype`.
    Quantized codes (GPT-OSS's MXFP4 uint8) keep their type; a router's correction bias
    (GLM-4.5's) stays float32, as transformers keeps it."""
    if t.is_floating_point():
        dtype = torch.float32 if name.endswith("e_score_correction_bias") else dtype
    else:
        dtype = t.dtype
    return t.to(device=device, dtype=dtype, memory_format=torch.contiguous_format, copy=copy)


class Weights(dict):
    """A model's weights by name as LlamaModel takes them (`pop`), each made what the engine
    keeps (`_kept`) as it is taken: one still mapped from the checkpoint's files is copied
    then, so a model that packs or fuses its weights holds one of them twice at most, never
    the whole model; and none stays a view of a file, which a checkpoint rewritten in place
    would change under the node or, truncated, make fault. A part cut from a tensor made at
    load (a dequantized or transposed expert) is copied as it is added, freeing the whole."""

    def __init__(self, dtype: torch.dtype, device: str = "cpu"):
        super().__init__()
        self.dtype, self.device, self._mapped, self._copied = dtype, device, set(), 0

    def add(self, group: dict[str, torch.Tensor], mapped: set[int]) -> None:
        """`group`'s tensors; `mapped`: `mapped_storages` of the group as read."""
        for name, t in group.items():
            if t.untyped_storage().data_ptr() in mapped:
                self._mapped.add(name)
            elif t.untyped_storage().nbytes() > t.nbytes:
                t = _kept(name, t, self.dtype, self.device, copy=True)
            self[name] = t

    def pop(self, name: str, *default):
        if name not in self:
            return super().pop(name, *default)
        t = _kept(name, super().pop(name), self.dtype, self.device, copy=name in self._mapped)
        # Each copy is freed once packed or fused, in blocks glibc keeps in its heap and
        # reuses only in part: handed back as they pile up, they leave the peak near what
        # the model holds.
        self._copied += t.nbytes
        if self._copied > TRIM_EVERY:
            trim_heap()
            self._copied = 0
        return t


def load_state_dict(model_dir: str | Path, dtype: torch.dtype, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, by its served Hugging Face name, as `Weights` keeps it."""
    state = Weights(dtype, device)
    for group in read_groups(model_dir):
        state.add(group, mapped_storages(group))
    return {name: state.pop(name) for name in list(state)}
