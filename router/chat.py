"""Conversations: the messages a request may carry, how the model's chat template renders
them into a prompt, and which tokens end the assistant's turn.

Both APIs (a gRPC `Generate` with `messages`, OpenAI's `/v1/chat/completions`) come here
through `PromptTokenizer.chat_ids`, so a conversation gives the same ids and the same errors
either way. Errors are `ValueError`s naming the message and the value that broke the rule.

End of turn: a chat model ends its answer with the token that closes a turn in its template
(`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`), which need not be the config's eos (a ChatML
template over a checkpoint whose eos is `<|endoftext|>`). `end_of_turn_ids` collects every
candidate: the eos of config.json, of generation_config.json and of the tokenizer, and the
special token that follows an assistant message in the rendered template; in the harmony
format (GPT-OSS's) that is `<|end|>`, which closes one message of an answer of several, so
there the turn ends at `<|return|>` and `<|call|>` instead (router/harmony.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.router.harmony import TURN_ENDS, speaks_harmony

# Content no template changes, found again in the rendered text to see what follows it.
PROBE = "pdserve-end-of-turn-probe"


def check_messages(messages, max_chars: int) -> list[dict]:
    """`messages` as [{"role": str, "content": str}]: every role a non-empty string, every
    content a string or a list of OpenAI text parts (joined), at most `max_chars` of content
    in all (a bound on the work the template and the tokenizer do). An assistant message
    may instead carry `tool_calls` (its content then may be null), and its reasoning
    (`reasoning_content`, or `reasoning`), and a tool message its `tool_call_id`;
    router/tools.py renders those."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{role, content}} objects, "
                         f"got {messages!r:.80}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object with a role and a content, "
                             f"got {message!r:.80}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string, got {role!r:.80}")
        calls = message.get("tool_calls")
        content = message.get("content")
        checked = {"role": role, "content": "" if content is None and calls else _text(i, content)}
        if calls:
            checked["tool_calls"] = _tool_calls(i, calls)
        if isinstance(message.get("tool_call_id"), str):
            checked["tool_call_id"] = message["tool_call_id"]
        reasoning = next((message[k] for k in ("reasoning_content", "reasoning") if message.get(k) is not None), None)
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise ValueError(f"messages[{i}].reasoning_content must be a string (an earlier answer's "
                                 f"reasoning), got {reasoning!r:.80}")
            # Qwen3's template reads an answer's reasoning as reasoning_content, GPT-OSS's as
            # thinking (which it writes back where a call followed it, as harmony asks).
            checked["reasoning_content"] = checked["thinking"] = reasoning
        out.append(checked)
    chars = sum(len(m["content"]) + len(m.get("thinking", "")) +
                sum(len(c["function"]["arguments"]) for c in m.get("tool_calls", ())) for m in out)
    if chars > max_chars:
        raise ValueError(f"messages of {chars} characters are longer than the model's context "
                         f"can hold (at most {max_chars} characters)")
    return out


def _text(i: int, content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    raise ValueError(f"messages[{i}].content must be a string or a list of text parts, "
                     f"got {content!r:.80}")


def _tool_calls(i: int, calls) -> list[dict]:
    """An assistant message's earlier calls, as OpenAI writes them: each a function's name
    and its arguments (a JSON text)."""
    if isinstance(calls, list) and all(
            isinstance(c, dict) and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments", ""), str) for c in calls):
        return [{"id": c.get("id") if isinstance(c.get("id"), str) else f"call_{n}", "type": "function",
                 "function": {"name": c["function"]["name"], "arguments": c["function"].get("arguments", "")}}
                for n, c in enumerate(calls)]
    raise ValueError(f"messages[{i}].tool_calls must be a list of {{\"function\": {{\"name\": str, "
                     f"\"arguments\": str}}}}, got {calls!r:.80}")


# What the template's own arguments are, which chat_template_kwargs may not set.
TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                "add_generation_prompt", "continue_final_message", "tokenize",
                                "padding", "truncation", "max_length", "return_tensors",
                                "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_options(body: dict, template: str | None = None) -> dict:
    """vLLM's chat extras as `apply_chat_template` arguments: `add_generation_prompt`
    (default true: open the assistant's turn), `continue_final_message` (default false: go
    on with the last, assistant's, message instead, its turn left open),
    `chat_template_kwargs` (more variables for the template, such as Qwen3's
    `enable_thinking`), `documents` (for a retrieval template: Command R's, Granite's) and
    OpenAI's `reasoning_effort`, as the chat `template` takes them (`effort_variables`).
    ValueError naming the field."""
    options = {"add_generation_prompt": True, "continue_final_message": False}
    for name in options:
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be a boolean, got {value!r:.80}")
        options[name] = options[name] if value is None else value
    if options["add_generation_prompt"] and options["continue_final_message"]:
        if body.get("add_generation_prompt") is not None:
            raise ValueError("continue_final_message continues the last message, so it cannot also open "
                             "a new turn: send add_generation_prompt: false with it")
        options["add_generation_prompt"] = False
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict) or not all(isinstance(k, str) and k.isidentifier() for k in extra):
        raise ValueError(f"chat_template_kwargs must be an object of template variables, got {extra!r:.80}")
    taken = sorted(TEMPLATE_ARGUMENTS & set(extra))
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {taken[0]!r}: it is the request's own "
                         "field or the template's argument")
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(isinstance(d, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in d.items()) for d in documents):
            raise ValueError(f'documents must be a list of objects of strings (such as {{"title", "text"}}), '
                             f"got {documents!r:.80}")
        if not template or "documents" not in template:
            raise ValueError("documents are not taken by this model's chat template (it has no documents "
                             "variable): put them in a message instead")
        options["documents"] = documents
    effort = effort_variables(body.get("reasoning_effort"), template)
    clash = next((name for name, value in effort.items() if extra.get(name, value) != value), None)
    if clash:
        raise ValueError(f"reasoning_effort {body['reasoning_effort']!r} and chat_template_kwargs.{clash} "
                         f"{extra[clash]!r} disagree: send one of them")
    return {**options, **effort, **extra}


# OpenAI's levels, "none" (no reasoning) to "xhigh".
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def effort_variables(effort, template: str | None) -> dict:
    """The template variables that ask for `effort`: the template's own `reasoning_effort`
    (gpt-oss's, as vLLM passes it), or else the on/off switch `enable_thinking` of Qwen3
    and SmolLM3, which have no levels (none: off, any other: on). A model whose template
    takes neither cannot be asked, and a request that asks is refused, not ignored."""
    if effort is None:
        return {}
    if effort not in EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {effort!r:.80}")
    if template and "reasoning_effort" in template:
        return {"reasoning_effort": effort}
    if template and "enable_thinking" in template:
        return {"enable_thinking": effort != "none"}
    raise ValueError(f"reasoning_effort {effort!r}: this model's chat template takes no reasoning effort "
                     "(neither a reasoning_effort nor an enable_thinking variable): leave it out")


def render(tokenizer, messages: list[dict], model: str, tools: list[dict] | None = None,
           options: dict | None = None) -> list[int]:
    """Prompt ids of checked `messages`, with the assistant's turn opened unless `options`
    (`template_options`) say otherwise; `tools` go to the template's `tools` variable
    (router/tools.py decides when). The template adds any special tokens (a bos) itself,
    so encoding adds none."""
    if tokenizer.chat_template is None:
        raise ValueError(f"model {model} has no chat template: send a prompt instead, or start the "
                         "server with --chat-template")
    options = options or {"add_generation_prompt": True}
    if options.get("continue_final_message") and messages[-1]["role"] != "assistant":
        raise ValueError(f"continue_final_message needs the last message to be the assistant's, got role "
                         f"{messages[-1]['role']!r}")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **options)
    except Exception as err:  # the template itself rejects the conversation
        raise ValueError(f"messages: the chat template of {model} rejects them: {err}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def end_of_turn_ids(tokenizer, model_dir: Path, config: dict) -> list[int]:
    """Every token id that ends the assistant's turn, without repeats, eos ids first."""
    generation = model_dir / "generation_config.json"
    generation_eos = json.loads(generation.read_text()).get("eos_token_id") \
        if generation.exists() else None
    if speaks_harmony(tokenizer.chat_template):
        vocab = tokenizer.get_vocab()
        closers = [vocab[t] for t in TURN_ENDS if t in vocab]
    else:
        closers = _ids(_turn_closer(tokenizer))
    ids = [*_ids(config.get("eos_token_id")), *_ids(generation_eos), *_ids(tokenizer.eos_token_id), *closers]
    return list(dict.fromkeys(ids))


def _turn_closer(tokenizer) -> int | None:
    """The first special token after an assistant message in the rendered template. An
    assistant message, not a user's: `[INST] ... [/INST]` closes a user turn with a token
    the model never writes. Only a template that refuses that conversation is asked about
    a user message alone."""
    if tokenizer.chat_template is None:
        return None
    special = set(tokenizer.all_special_ids) | {
        i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    for conversation in ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": PROBE}],
                         [{"role": "user", "content": PROBE}]):
        try:
            text = tokenizer.apply_chat_template(conversation, tokenize=False)
        except Exception:
            continue
        at = text.rfind(PROBE)
        if at < 0:
            return None
        after = tokenizer.encode(text[at + len(PROBE):], add_special_tokens=False)
        return next((t for t in after if t in special), None)
    return None


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
