"""A router keeping `--responses-store-dir` (router/store_file.py), killed outright
(SIGKILL: no shutdown, no file written), loses nothing it stored: the next router on the
directory returns the stored response as answered and continues it, keeps a deleted one
deleted, a conversation with its added item and new metadata, and a background response
the kill cut off reads "failed", saying why; the journal is folded into the file again."""

from __future__ import annotations

import json
import signal

import openai
import pytest

from pdserve.procs import free_port
from tests.cluster.nodes import WORKER_FLAGS, Cluster

GREEDY = dict(temperature=0.0, max_output_tokens=4, extra_body={"ignore_eos": True})


def text_of(item) -> str:
    return item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)


def test_a_router_killed_outright_loses_nothing_it_stored(tiny_model, tmp_path):
    kept_dir = tmp_path / "kept"
    nodes = Cluster(tmp_path, tiny_model)
    common = ["--model", tiny_model, "--host", "127.0.0.1"]
    http = free_port()
    try:
        for role in ("prefill", "decode"):
            nodes.start(role, [role, *common, *WORKER_FLAGS], wait=False)
        nodes.wait("prefill", "decode")
        nodes.start("router", ["router", *common, "--http-port", str(http), "--responses-store-dir", str(kept_dir),
                               "--prefill", nodes.address("prefill"), "--decode", nodes.address("decode")])
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="none", max_retries=0)
        model = api.models.list().data[0].id
        answered = api.responses.create(model=model, input="name a fox", **GREEDY)
        gone = api.responses.create(model=model, input="name a hen", **GREEDY)
        api.responses.delete(gone.id)
        talk = api.conversations.create(items=[{"type": "message", "role": "user", "content": "hi"}])
        api.conversations.items.create(talk.id, items=[{"type": "message", "role": "user", "content": "again"}])
        api.conversations.update(talk.id, metadata={"topic": "foxes"})
        nodes.nodes["decode"].send_signal(signal.SIGSTOP)  # the background response cannot end
        try:
            held = api.responses.create(model=model, input="name an owl", background=True, **GREEDY)
            nodes.nodes["router"].send_signal(signal.SIGKILL)
            nodes.nodes["router"].proc.wait()
        finally:
            nodes.nodes["decode"].send_signal(signal.SIGCONT)
        assert not (kept_dir / "stored.json").exists() or not json.loads((kept_dir / "stored.json").read_text())[
            "responses"]  # all it stored is in the journal alone
        nodes.restart("router")

        again = api.responses.retrieve(answered.id)
        assert again.model_dump() == answered.model_dump()
        with pytest.raises(openai.NotFoundError):
            api.responses.retrieve(gone.id)
        assert api.conversations.retrieve(talk.id).metadata == {"topic": "foxes"}
        items = api.conversations.items.list(talk.id, order="asc")
        assert [text_of(i) for i in items.data] == ["hi", "again"]
        cut = api.responses.retrieve(held.id)
        assert cut.status == "failed" and "the server stopped while this response ran" in cut.error.message
        follow = api.responses.create(model=model, input="and a bird?", previous_response_id=answered.id, **GREEDY)
        given = api.responses.input_items.list(follow.id, order="asc")
        assert [text_of(i) for i in given.data][:2] == ["name a fox", answered.output_text]
        stored = json.loads((kept_dir / "stored.json").read_text())  # folded at the restart
        assert {r["id"] for _, r, _ in stored["responses"]} == {answered.id, held.id}
    finally:
        nodes.stop()
