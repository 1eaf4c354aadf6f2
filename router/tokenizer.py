"""The router's view of the model: its tokenizer and the limits from its config.

The router tokenizes each prompt once; every node works on these ids. Colocated nodes
tokenize the same way (`encode` with the tokenizer's special tokens), so a prompt gives the
same ids whichever way it is served. The router never runs a model, so it loads the fast
tokenizer class directly when the checkpoint has a `tokenizer.json` (the same ids as
`AutoTokenizer`, without importing torch: a router starts in about a second) and reads the
limits from `config.json`. A conversation becomes ids in one place, `chat_ids` (router/chat.py),
for the gRPC and the OpenAI API alike.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from pathlib import Path

from pdserve.context import context_limit
from pdserve.models.catalogue import served_name
from pdserve.runtime.errors import NodeError
from pdserve.router import chat, reasoning
from pdserve.router.harmony import speaks_harmony
from pdserve.router.tool_dialects import dialect_named, dialect_of
from pdserve.router.tools import Tools, template_inputs
from pdserve.router.validation import max_prompt_chars


@dataclass
class ModelCard:
    model: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    aliases: tuple[str, ...] = ()  # more names a request may give the model (--served-model-name)
    loras: tuple[str, ...] = ()  # LoRA adapters a request may name as its model (--lora-modules)

    @property
    def names(self) -> list[str]:
        """Every name a request may give: the model's, then its adapters'."""
        return [self.model, *self.aliases, *self.loras]

    def lora_of(self, model: str) -> str:
        """The LoRA adapter a request naming `model` runs with: "" for the model itself (or
        no name given); NOT_FOUND naming what is served for any other name."""
        if not model or model in (self.model, *self.aliases):
            return ""
        if model in self.loras:
            return model
        raise NodeError(f"model {model!r} is not served here; this server serves "
                        f"{', '.join(map(repr, self.names))}", grpc.StatusCode.NOT_FOUND)


def lora_names(entries) -> tuple[str, ...]:
    """The adapter names of `--lora-modules NAME=DIR` entries (the nodes load the directories)."""
    return tuple(str(entry).partition("=")[0].strip() for entry in entries)


def _load_tokenizer(model_dir: Path):
    if (model_dir / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


class PromptTokenizer:
    """`served_model_name`: the model's names to clients, the first its own (`card.model`)
    and any more accepted as well (`card.aliases`); None: the catalogue name, else the
    directory as given (`served_name`). `chat_template`: the one to render
    conversations with, instead of the checkpoint's (`--chat-template`); `tool_call_parser`:
    the dialect of the model's tool calls, or "auto" for the template's."""

    def __init__(self, model_dir: str, served_model_name: str | Sequence[str] | None = None,
                 chat_template: str | None = None, tool_call_parser: str = "auto",
                 lora_modules: Sequence[str] = ()) -> None:
        path = Path(model_dir)
        self.tokenizer = _load_tokenizer(path)
        if chat_template is not None:  # before anything below reads the template
            self.tokenizer.chat_template = chat_template
        config = json.loads((path / "config.json").read_text())
        # A multimodal checkpoint (Gemma 3's 4B and up) keeps its language model's in text_config.
        config = {**config.get("text_config", {}), **config}
        eos = config.get("eos_token_id", self.tokenizer.eos_token_id)
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or ())
        self.card = ModelCard(
            model=names[0] if names else served_name(model_dir),
            vocab_size=int(config["vocab_size"]),
            max_model_len=int(context_limit(config.get)[0]),  # the nodes' own (pdserve/context.py)
            eos_token_ids=list(eos) if isinstance(eos, (list, tuple)) else
            ([eos] if eos is not None else []),
            aliases=tuple(names[1:]),
            loras=lora_names(lora_modules),
        )
        # What ends a chat answer; a conversation's request also stops there (validation.py).
        self.end_of_turn_ids = chat.end_of_turn_ids(self.tokenizer, path, config)
        self.thinks = reasoning.thinks(self.tokenizer.chat_template)  # router/reasoning.py
        self.harmony = speaks_harmony(self.tokenizer.chat_template)  # router/harmony.py (GPT-OSS)
        self.tool_dialect = dialect_of(self.tokenizer.chat_template) if tool_call_parser == "auto" \
            else dialect_named(tool_call_parser, self.tokenizer.chat_template)  # router/tool_dialects.py

    def opens_thinking(self, prompt_ids: list[int]) -> bool:
        """Whether a chat prompt ends inside an open think block (its last ids are enough)."""
        return self.thinks and reasoning.opened(self.tokenizer.decode(prompt_ids[-16:]))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def token_text(self, token_id: int) -> str:
        """One token's text, its id decoded alone (special tokens shown): how logprobs
        name a token."""
        return self.tokenizer.decode([token_id])

    def chat_ids(self, messages, tools: Tools | None = None, options: dict | None = None) -> list[int]:
        """Prompt ids of a conversation ([{"role", "content"}], checked here) as the model's
        chat template renders it, with the tools it may call (router/tools.py), the
        assistant's turn opened (or as `options`, chat.template_options, say). Raises
        ValueError naming the bad message or value, or the model when it has no chat template."""
        checked = chat.check_messages(messages, max_prompt_chars(self.card))
        checked, offered = template_inputs(checked, tools, self.tokenizer.chat_template)
        return chat.render(self.tokenizer, checked, self.card.model, offered, options)
