"""Responses sent with `background: true` (router/responses_http.py): answered at once,
"queued"; GET reads them as they go and once they end, with the answer the same request
gets in the foreground; cancel stops one (its decode node hears the Abort) and answers
the same again; a response sent without background cannot be cancelled."""

from __future__ import annotations

import asyncio

import pytest


def chat_tokenizer(tmp_path):
    from pdserve.engine.checkpoint import CHAT_TEMPLATE
    from pdserve.router.tokenizer import PromptTokenizer
    from tests.chat_checkpoint import write_tokenizer_only

    return PromptTokenizer(str(write_tokenizer_only(tmp_path, CHAT_TEMPLATE)), "fake")


def test_a_background_response_is_read_back_as_it_goes_and_cancel_stops_one(tmp_path):
    import aiohttp
    import openai

    from tests.router.fake_worker import FakeWorker, openai_router, run

    tokenizer = chat_tokenizer(tmp_path)
    worker = FakeWorker("d", texts=["Paris", "."])

    async def go():
        worker.stream_gate = asyncio.Event()  # the decode node holds every stream until set
        async with openai_router([worker], tokenizer) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            held = await client.responses.create(model="fake", input="capital of France?", background=True)
            queued = await client.responses.retrieve(held.id)
            cancelled = await client.responses.cancel(held.id)
            again = await client.responses.cancel(held.id)  # as the first answered
            worker.stream_gate.set()
            events = [e async for e in await client.responses.create(  # to its last event: it ended
                model="fake", input="capital of France?", background=True, stream=True)]
            served = events[0].response
            done = await client.responses.retrieve(served.id)
            foreground = await client.responses.create(model="fake", input="capital of France?")
            with pytest.raises(openai.BadRequestError) as not_background:
                await client.responses.cancel(foreground.id)
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{url}/v1/responses/resp_nope/cancel") as reply:
                    unknown = reply.status
            return held, queued, cancelled, again, served, done, foreground, not_background.value, unknown

    held, queued, cancelled, again, served, done, foreground, not_background, unknown = run(go())
    assert (held.status, queued.status, held.background) == ("queued", "queued", True)
    assert (cancelled.status, again.status, cancelled.output) == ("cancelled", "cancelled", [])
    assert held.id.removeprefix("resp_") in worker.aborted  # its stream closed: the nodes let it go
    assert served.status == "queued" and done.output_text == "Paris."  # the fake's two tokens: "length"
    assert (done.status, done.incomplete_details) == (foreground.status, foreground.incomplete_details)
    assert done.output_text == foreground.output_text and done.usage.output_tokens == foreground.usage.output_tokens
    assert not_background.body["param"] == "response_id" and "background: true" in not_background.body["message"]
    assert unknown == 404


def test_a_background_response_whose_nodes_fail_is_read_back_failed_with_the_error(tmp_path):
    import openai

    from pdserve.procs import free_port
    from tests.router.fake_worker import openai_router, run

    async def go():
        # a decode node that is not there
        async with openai_router([f"127.0.0.1:{free_port()}"], chat_tokenizer(tmp_path)) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            events = [e async for e in await client.responses.create(  # to its last event: it ended
                model="fake", input="hello", background=True, stream=True)]
            return events, await client.responses.retrieve(events[0].response.id)

    events, got = run(go())
    assert events[0].response.status == "queued" and events[-1].type == "response.failed"
    assert got.status == "failed" and got.output == []
    assert got.error.code and got.error.message  # the node error, as a foreground request would get it


def test_a_streamed_background_response_goes_on_without_its_client_and_resumes_where_it_left(tmp_path):
    import openai

    from tests.router.fake_worker import FakeWorker, openai_router, run

    worker = FakeWorker("d", texts=["It", " is", " sunny", " in", " Paris", "."])

    async def go():
        worker.stream_gate = asyncio.Event()
        async with openai_router([worker], chat_tokenizer(tmp_path)) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            first = []
            async with await client.responses.create(model="fake", input="weather?", background=True,
                                                     stream=True) as events:
                first.append(await anext(aiter(events)))  # created, queued; then the client leaves
            worker.stream_gate.set()
            response_id = first[0].response.id  # followed again, live, to its end
            again = [e async for e in await client.responses.retrieve(response_id, stream=True, starting_after=0)]
            done = await client.responses.retrieve(response_id)
            whole = [e async for e in await client.responses.retrieve(response_id, stream=True)]
            return first, done, again, whole

    first, done, again, whole = run(go())
    assert [e.type for e in first] == ["response.created"] and first[0].response.status == "queued"
    assert done.status == "incomplete" and done.output_text == "It is sunny in Paris."  # served on, unwatched
    assert [e.sequence_number for e in again] == list(range(1, len(whole)))  # from event 1, none twice
    assert [e.sequence_number for e in whole] == list(range(len(whole)))
    assert [e.type for e in whole][:2] == ["response.created", "response.in_progress"]
    assert whole[-1].type == "response.incomplete" and whole[-1].response.output_text == done.output_text
    assert "".join(e.delta for e in again if e.type == "response.output_text.delta") == done.output_text


def test_only_a_streamed_background_response_streams_again(tmp_path):
    import openai

    from tests.router.fake_worker import FakeWorker, openai_router, run

    async def go():
        async with openai_router([FakeWorker("d", texts=["Hi"])], chat_tokenizer(tmp_path)) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            quiet = await client.responses.create(model="fake", input="hello", background=True)
            with pytest.raises(openai.BadRequestError) as err:
                await client.responses.retrieve(quiet.id, stream=True)
            return err.value

    err = run(go())
    assert err.body["param"] == "stream" and "created with stream: true" in err.body["message"]
