"""OpenAI's Conversations API (router/conversations.py), with the `openai` client: a
response that names a conversation gets its items before its input (the prompt is the one
the whole conversation renders), and adds its input and output after; items are added,
read, listed in pages and deleted; metadata is read and replaced; a deleted or unknown
conversation is a 404; bad items and metadata are 400s naming the field."""

from __future__ import annotations

import openai
import pytest

from tests.router.fake_worker import FakeWorker, openai_router, run
from tests.router.test_background_responses import chat_tokenizer


def test_responses_continue_a_conversation_and_add_to_it(tmp_path):
    tokenizer = chat_tokenizer(tmp_path)
    worker = FakeWorker("d", texts=["Paris", "."])

    async def go():
        async with openai_router([worker], tokenizer) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            conversation = await client.conversations.create(
                items=[{"type": "message", "role": "user", "content": "Answer in one word."}],
                metadata={"topic": "capitals"})
            first = await client.responses.create(model="fake", input="capital of France?",
                                                  conversation=conversation.id)
            second = await client.responses.create(model="fake", input="and of Spain?",
                                                   conversation={"id": conversation.id}, store=False)
            items = [i async for i in client.conversations.items.list(conversation.id, order="asc")]
            newest = (await client.conversations.items.list(conversation.id, limit=2)).data  # the first page
            return conversation, first, second, items, newest

    conversation, first, second, items, newest = run(go())
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "capitals"}
    assert first.conversation.id == conversation.id and second.conversation.id == conversation.id
    assert [(i.type, i.role) for i in items] == [("message", r) for r in ("user", "user", "assistant", "user",
                                                                         "assistant")]
    assert items[2].id == first.output[0].id and len({i.id for i in items}) == 5
    assert [i.id for i in newest] == [items[4].id, items[3].id]
    prompts = [list(msg.prepare.prompt_token_ids) for rpc, msg in worker.calls if rpc == "StartGeneration"]
    assert prompts[1] == tokenizer.chat_ids([
        {"role": "user", "content": "Answer in one word."}, {"role": "user", "content": "capital of France?"},
        {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "and of Spain?"}])


def test_items_and_metadata_are_added_read_and_deleted_and_bad_ones_refused(tmp_path):
    async def go():
        async with openai_router([FakeWorker("d")], chat_tokenizer(tmp_path)) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            conversation = await client.conversations.create()
            added = await client.conversations.items.create(conversation.id, items=[
                {"type": "message", "role": "user", "content": "hi"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello"}]}])
            one = await client.conversations.items.retrieve(added.data[0].id, conversation_id=conversation.id)
            await client.conversations.items.delete(added.data[0].id, conversation_id=conversation.id)
            left = [i.id async for i in client.conversations.items.list(conversation.id)]
            updated = await client.conversations.update(conversation.id, metadata={"k": "v"})
            errors = {}
            for name, call in [
                    ("items", client.conversations.create(items=[{"type": "input_image", "image_url": "x"}])),
                    ("metadata", client.conversations.create(metadata={"k": 1})),
                    ("conversation", client.responses.create(model="fake", input="hi", conversation="conv_nope")),
                    ("item_id", client.conversations.items.retrieve("msg_nope", conversation_id=conversation.id))]:
                with pytest.raises(openai.APIStatusError) as err:
                    await call
                errors[name] = (err.value.status_code, err.value.body["param"])
            deleted = await client.conversations.delete(conversation.id)
            with pytest.raises(openai.NotFoundError):
                await client.conversations.retrieve(conversation.id)
            return added, one, left, updated, errors, deleted

    added, one, left, updated, errors, deleted = run(go())
    assert [i.type for i in added.data] == ["message", "message"] and one.id == added.data[0].id
    assert left == [added.data[1].id] and updated.metadata == {"k": "v"}
    assert errors == {"items": (400, "items"), "metadata": (400, "metadata"), "conversation": (404, "conversation"),
                      "item_id": (404, "item_id")}
    assert deleted.deleted is True
