"""Tiny checkpoints whose chat template ends a turn with a token that is not their eos (as a
ChatML template over a base model whose eos is `<|endoftext|>` does), for the tests of the
end-of-turn stop: the router's (tests/router/test_chat_messages.py) and a served one
(tests/cluster/test_chat.py)."""

from __future__ import annotations

from pathlib import Path

END_OF_TURN = "<|im_end|>"
# The tiny template's turns, closed by END_OF_TURN instead of the eos `<|eos|>`.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}" + END_OF_TURN +
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Mistral's shape: a user turn ends with `<|assistant|>` (its `[/INST]`), an answer with eos.
INST_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] }}<|eos|>"
    "{% else %}<|user|>{{ message['content'] }}<|assistant|>{% endif %}"
    "{% endfor %}"
)


def write_chatml_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> int:
    """Tokenizer files in `out_dir` (over any there): the tiny tokenizer trained one id short
    of `vocab_size`, plus END_OF_TURN in the last id, under CHATML_TEMPLATE; END_OF_TURN's id."""
    from transformers import PreTrainedTokenizerFast

    from pdserve.engine.checkpoint import write_tokenizer

    write_tokenizer(out_dir, vocab_size=vocab_size - 1)
    tok = PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    tok.add_special_tokens({"additional_special_tokens": [END_OF_TURN]})
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(str(out_dir))
    end_of_turn = tok.convert_tokens_to_ids(END_OF_TURN)
    assert end_of_turn < vocab_size and end_of_turn != tok.eos_token_id, end_of_turn
    return end_of_turn


def write_tokenizer_only(out_dir: str | Path, chat_template: str | None) -> Path:
    """What the router reads of a checkpoint (config.json, tokenizer), no weights: the tiny
    tokenizer with `chat_template` (None: none), eos `<|eos|>` = 2 as in config.json."""
    import json

    from transformers import PreTrainedTokenizerFast

    from pdserve.engine.checkpoint import write_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out)
    tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    tok.chat_template = chat_template
    for stale in ("chat_template.jinja", "tokenizer_config.json"):
        (out / stale).unlink(missing_ok=True)
    tok.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(
        {"vocab_size": 512, "max_position_embeddings": 512, "eos_token_id": 2}))
    return out


def answer_with_end_of_turn_first(model_dir: str | Path, prompt_ids: list[int], end_of_turn: int) -> None:
    """Edit the checkpoint's lm_head so that its greedy first token after `prompt_ids` is
    `end_of_turn`: that row becomes twice the row of the token it chose (t), so its logit is
    twice t's, which is the largest and (checked) positive."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0, -1]
    chosen = int(logits.argmax())
    assert logits[chosen] > 0.5 and chosen != end_of_turn, (chosen, float(logits[chosen]))
    path = Path(model_dir) / "model.safetensors"
    weights = load_file(str(path))
    weights["lm_head.weight"][end_of_turn] = 2 * weights["lm_head.weight"][chosen]
    save_file(weights, str(path), metadata={"format": "pt"})
