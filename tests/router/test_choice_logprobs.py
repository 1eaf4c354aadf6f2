"""Logprobs in OpenAI's shapes (router/choice_logprobs.py), labelled by text or, as vLLM's
return_tokens_as_token_ids asks, by id: two ids of the same text stay apart only by id."""

from __future__ import annotations

from pdserve.proto import pdserve_pb2
from pdserve.router.choice_logprobs import ChoiceLogprobs

TEXTS = {1: "é", 2: "é", 3: "ab"}  # 1 and 2: one text, two ids (as a byte-level vocabulary may hold)


def entry(token_id: int, logprob: float, *top: tuple[int, float]):
    return pdserve_pb2.TokenLogprob(token_id=token_id, logprob=logprob, top=[
        pdserve_pb2.TopLogprob(token_id=t, logprob=p) for t, p in top])


ENTRIES = [entry(3, -0.25, (3, -0.25), (1, -2.0), (2, -3.0)), entry(1, -0.5, (1, -0.5))]


def test_completions_alternatives_are_keyed_by_text_or_by_id():
    by_text = ChoiceLogprobs(TEXTS.get, chat=False).render(ENTRIES)
    assert by_text["top_logprobs"][0] == {"ab": -0.25, "é": -2.0}  # 2 shares 1's text: the likelier stays
    by_id = ChoiceLogprobs(TEXTS.get, chat=False, as_ids=True).render(ENTRIES)
    assert by_id["tokens"] == ["token_id:3", "token_id:1"]
    assert by_id["top_logprobs"][0] == {"token_id:3": -0.25, "token_id:1": -2.0, "token_id:2": -3.0}
    assert by_id["text_offset"] == by_text["text_offset"] == [0, 2]  # where each text starts


def test_chat_entries_carry_the_label_and_the_texts_bytes():
    [first, second] = ChoiceLogprobs(TEXTS.get, chat=True, as_ids=True).render(ENTRIES)["content"]
    assert (first["token"], first["bytes"]) == ("token_id:3", [97, 98])
    assert [t["token"] for t in first["top_logprobs"]] == ["token_id:3", "token_id:1", "token_id:2"]
    assert (second["token"], second["bytes"]) == ("token_id:1", list("é".encode()))
