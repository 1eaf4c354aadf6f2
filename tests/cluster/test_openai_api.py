"""The OpenAI-compatible HTTP API of a running router, through the official `openai` client:
streamed chat completions and completions match the non-streamed answer and the gRPC one,
and failures come back in OpenAI's error shape with the HTTP status of their gRPC status.
A colocated node (`pdserve serve --http-port`) serves the same API from one process."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from pdserve.client import AsyncClient
from pdserve.procs import NodeProcess, free_port
from tests.cluster.nodes import WORKER_FLAGS, run, sample, scrape, wait_until

GREEDY = dict(temperature=0.0, max_tokens=6, extra_body={"ignore_eos": True})
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a fox"}]
BRACKETS = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def model(api):
    return api.models.list().data[0].id


def test_models_lists_the_served_model(api, cluster):
    models = api.models.list().data
    assert [m.id for m in models] == [cluster.model]
    assert api.models.retrieve(cluster.model) == models[0]  # a directory: its slashes in the path
    with pytest.raises(openai.NotFoundError) as err:
        api.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found" and "no-such-model" in err.value.body["message"]


def test_openai_client_streams_a_chat_completion(api, model):
    stream = api.chat.completions.create(model=model, messages=MESSAGES, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert roles == ["assistant"]
    assert finish == ["length"]
    assert usage.completion_tokens == 6 and usage.prompt_tokens > 0
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"

    whole = api.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
    assert whole.choices[0].message.content == text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == usage.prompt_tokens


def test_chat_prompt_is_rendered_by_the_tokenizer_chat_template(api, model, cluster):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = tok.encode(tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)

    async def grpc_answer():
        async with AsyncClient(cluster.grpc) as client:
            return await client.generate(ids, temperature=0.0, max_tokens=6, ignore_eos=True)

    whole = api.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
    assert whole.usage.prompt_tokens == len(ids)
    assert whole.choices[0].message.content == run(grpc_answer()).text


def test_chat_continues_the_final_message_when_asked(api, model, cluster):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    started = [*MESSAGES, {"role": "assistant", "content": "the quick"}]
    ids = tok.encode(tok.apply_chat_template(started, tokenize=False, continue_final_message=True),
                     add_special_tokens=False)
    assert tok.decode(ids).endswith("the quick")  # the assistant's turn left open

    async def grpc_answer():
        async with AsyncClient(cluster.grpc) as client:
            return await client.generate(ids, temperature=0.0, max_tokens=6, ignore_eos=True)

    whole = api.chat.completions.create(model=model, messages=started, **{
        **GREEDY, "extra_body": {**GREEDY["extra_body"], "continue_final_message": True,
                                 "add_generation_prompt": False}})
    assert whole.usage.prompt_tokens == len(ids)
    assert whole.choices[0].message.content == run(grpc_answer()).text


def test_openai_client_streams_a_completion(api, model, cluster):
    prompt = "the quick brown fox"
    chunks = list(api.completions.create(model=model, prompt=prompt, stream=True, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "text_completion" for c in chunks)

    async def grpc_answer():
        async with AsyncClient(cluster.grpc) as client:
            return await client.generate(prompt, temperature=0.0, max_tokens=6, ignore_eos=True)

    assert text == run(grpc_answer()).text
    whole = api.completions.create(model=model, prompt=prompt, logprobs=2, **GREEDY)
    assert whole.choices[0].text == text
    lp = whole.choices[0].logprobs
    assert len(lp.token_logprobs) == 6
    # each token's text starts where the ones before it end
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)]
    assert whole.usage.completion_tokens == 6


def test_a_batch_of_prompts_answers_each_as_if_sent_alone(api, model, cluster):
    prompts = ["the quick brown fox", [1, 2, 3, 4]]
    alone = [api.completions.create(model=model, prompt=p, **GREEDY).choices[0].text for p in prompts]
    batch = api.completions.create(model=model, prompt=prompts, n=2,
                                   extra_headers={"X-Request-Id": "batch-of-2"}, **GREEDY)
    assert [(c.index, c.text) for c in batch.choices] == [
        (0, alone[0]), (1, alone[0]), (2, alone[1]), (3, alone[1])]
    assert batch.usage.completion_tokens == 4 * 6
    logged = {r["request_id"]: r for r in (json.loads(line) for line in cluster.log_lines("router")
                                           if "batch-of-2" in line)}
    assert sorted(logged) == ["batch-of-2-0", "batch-of-2-1"]  # each prompt a request
    assert {r["outcome"] for r in logged.values()} == {"length"}


@pytest.mark.parametrize("stream", [False, True])
def test_invalid_sampling_value_is_a_400_naming_the_field(api, model, stream):
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=model, prompt="hello", top_p=1.5, stream=stream)
    assert err.value.status_code == 400
    body = err.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == "top_p"
    assert body["code"] == "invalid_argument" and "1.5" in body["message"]


def test_unknown_model_is_a_404(api):
    with pytest.raises(openai.NotFoundError) as err:
        api.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"


def _post(url: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b'{"model": "M", "prompt": ""}', "prompt"),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "temperature": "hot"}', "temperature"),
    ("/v1/chat/completions", b'{"model": "M", "messages": []}', "messages"),
    ("/v1/completions", b'{"model": "M", "prompt": [1, 99999]}', "prompt"),
    ("/tokenize", b'{"model": "M"}', "prompt"),
    ("/tokenize", b'{"model": "M", "prompt": "hi", "add_special_tokens": 1}', "add_special_tokens"),
    ("/tokenize", b'{"model": "M", "messages": [{"role": "user"}]}', "messages"),
    ("/tokenize", b'{"model": "M", "prompt": "hi", "stream": true}', "stream"),
    ("/detokenize", b'{"model": "M", "tokens": [1, 99999]}', "tokens"),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "truncate_prompt_tokens": 0}', "truncate_prompt_tokens"),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "truncate_prompt_tokens": 2, "echo": true}',
     "truncate_prompt_tokens"),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "include_stop_str_in_output": 1}',
     "include_stop_str_in_output"),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "skip_special_tokens": "no"}', "skip_special_tokens"),
])
def test_bad_requests_are_400s_in_openai_error_shape(cluster, model, path, body, param):
    status, reply = _post(cluster.http + path, body.replace(b'"M"', json.dumps(model).encode()))
    assert status == 400
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["param"] == param


def test_tokenize_and_detokenize_answer_with_the_model_s_own_ids_and_text(cluster, model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    status, text = _post(cluster.http + "/tokenize", json.dumps(
        {"model": model, "prompt": "the quick fox", "return_token_strs": True}).encode())
    want = tok.encode("the quick fox")
    assert status == 200 and text == {"count": len(want), "max_model_len": 512, "tokens": want,
                                      "token_strs": tok.convert_ids_to_tokens(want)}
    _, bare = _post(cluster.http + "/tokenize", json.dumps(
        {"model": model, "prompt": "the quick fox", "add_special_tokens": False}).encode())
    assert bare["tokens"] == tok.encode("the quick fox", add_special_tokens=False) and bare["token_strs"] is None
    _, chat = _post(cluster.http + "/tokenize", json.dumps({"model": model, "messages": MESSAGES}).encode())
    whole = openai.OpenAI(base_url=cluster.http + "/v1", api_key="unused").chat.completions.create(
        model=model, messages=MESSAGES, **GREEDY)
    assert chat["count"] == whole.usage.prompt_tokens == len(chat["tokens"])  # the chat request's prompt
    status, back = _post(cluster.http + "/detokenize", json.dumps({"model": model, "tokens": want}).encode())
    assert status == 200 and back == {"prompt": tok.decode(want)}


def test_skip_special_tokens_false_writes_them_through_router_and_decode_node(api, model):
    from transformers import AutoTokenizer

    user = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("<|user|>")
    forced = dict(model=model, prompt="hi", max_tokens=2, temperature=0.0, logit_bias={str(user): 100})
    assert api.completions.create(**forced).choices[0].text == ""
    kept = api.completions.create(**forced, extra_body={"skip_special_tokens": False})
    assert kept.choices[0].text == "<|user|><|user|>" and kept.usage.completion_tokens == 2


def test_truncate_prompt_tokens_serves_the_prompt_s_last_tokens(api, model, cluster):
    ids = [(i * 37) % 400 + 30 for i in range(40)]

    async def grpc_answer():
        async with AsyncClient(cluster.grpc) as client:
            return await client.generate(ids[-10:], temperature=0.0, max_tokens=6, ignore_eos=True)

    cut = api.completions.create(model=model, prompt=ids, **{
        **GREEDY, "extra_body": {**GREEDY["extra_body"], "truncate_prompt_tokens": 10}})
    assert cut.usage.prompt_tokens == 10 and cut.choices[0].text == run(grpc_answer()).text
    whole = api.completions.create(model=model, prompt=ids, **{
        **GREEDY, "extra_body": {**GREEDY["extra_body"], "truncate_prompt_tokens": -1}})
    assert whole.usage.prompt_tokens == 40  # -1: up to the model's context, which it fits


def test_a_client_that_leaves_mid_stream_aborts_the_request_on_every_node(cluster, model):
    import http.client

    c = cluster
    before = c.scrape("router")
    conn = http.client.HTTPConnection("127.0.0.1", c.metrics_ports["router"], timeout=30)
    body = {"model": model, "prompt": "keep going", "max_tokens": 400, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json", "X-Request-Id": "leaves-early"})
    reply = conn.getresponse()
    assert reply.status == 200 and reply.getheader("X-Request-Id") == "leaves-early"
    assert reply.read(6) == b"data: "  # the first event has begun: hang up
    conn.sock.shutdown(2)
    conn.close()

    def aborted_everywhere():
        router, decode = c.scrape("router"), c.scrape("decode")
        cancelled = sample(router, "pdserve_requests_total", role="router", outcome="cancelled") - \
            sample(before, "pdserve_requests_total", role="router", outcome="cancelled")
        done = cancelled == 1 and sample(decode, "pdserve_kv_pages_used", role="decode") == 0
        return (router, decode, cancelled) if done else None

    router, decode, cancelled = wait_until(aborted_everywhere, "the request to end as cancelled "
                                           "with every decode page free", 15)
    assert cancelled == 1
    assert sample(decode, "pdserve_kv_pages_used", role="decode") == 0
    assert sample(router, "pdserve_queue_depth", role="router", queue="in_flight") == 0
    logged = [json.loads(line) for line in c.log_lines("router") if "leaves-early" in line]
    assert [r["outcome"] for r in logged] == ["cancelled"]
    assert logged[0]["completion_tokens"] < 400


@pytest.fixture(scope="module")
def serve_http(tiny_model, tmp_path_factory):
    """One `pdserve serve` node with its OpenAI API on, serving the tiny model as `foo`,
    conversations rendered by BRACKETS given on one line: (the node, the API's base URL)."""
    port = free_port()
    node = NodeProcess(["serve", "--model", tiny_model, "--host", "127.0.0.1", "--port", "0",
                        "--http-port", str(port), "--served-model-name", "foo", *WORKER_FLAGS,
                        "--chat-template", BRACKETS.replace("\n", "\\n")],
                       log=tmp_path_factory.mktemp("serve-http") / "serve.log")
    try:
        node.wait_ready()
        yield node, f"http://127.0.0.1:{port}"
    finally:
        node.stop()


def test_serve_answers_the_openai_api_itself_under_its_served_name(serve_http, tiny_model):
    node, http = serve_http
    prompt = "the quick brown fox"
    with openai.OpenAI(base_url=http + "/v1", api_key="unused", max_retries=0, timeout=60) as api:
        listed = [m.id for m in api.models.list().data]
        whole = api.completions.create(model="foo", prompt=prompt, **GREEDY)
        chunks = list(api.completions.create(model="foo", prompt=prompt, stream=True, **GREEDY))
        with pytest.raises(openai.NotFoundError):  # the directory is no longer its name
            api.completions.create(model=tiny_model, prompt=prompt, max_tokens=2)

    async def grpc_side():
        async with AsyncClient(node.address) as client:
            answer = await client.generate(prompt, temperature=0.0, max_tokens=6, ignore_eos=True)
            return answer, await client.models()

    answer, models = run(grpc_side())
    assert listed == ["foo"] and [m.id for m in models] == ["foo"]
    assert whole.model == "foo" and whole.usage.completion_tokens == 6
    assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks) == answer.text
    from transformers import AutoTokenizer

    status, rendered = _post(http + "/tokenize", json.dumps({"model": "foo", "messages": MESSAGES}).encode())
    assert status == 200 and rendered["tokens"] == AutoTokenizer.from_pretrained(tiny_model).encode(
        "[system] be brief\n[user] name a fox\n[assistant] ", add_special_tokens=False)
    # /metrics beside the API samples the node's own gauges (its pool: WORKER_FLAGS' pages)
    assert sample(scrape(http + "/metrics"), "pdserve_kv_pages_total", role="both") == 256
