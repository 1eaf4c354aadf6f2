"""`pdserve up` on real weights answers a real question through the official `openai`
client: router + prefill + decode, the chat template applied by the router."""

from __future__ import annotations

import openai

from pdserve.procs import NodeProcess, free_port


def test_up_answers_the_capital_of_france_through_the_openai_client(real_model, tmp_path):
    http_port = free_port()
    node = NodeProcess(["up", "--model", real_model, "--port", "0", "--http-port",
                        str(http_port)], log=tmp_path / "up.log")
    try:
        node.wait_ready()
        with openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x",
                           max_retries=0, timeout=120) as api:
            model = api.models.list().data[0].id
            reply = api.chat.completions.create(
                model=model, temperature=0, max_tokens=32,
                messages=[{"role": "user", "content": "What is the capital of France?"}])
        answer = reply.choices[0].message.content
        assert model == "smollm2-135m-instruct"
        assert "Paris" in answer, answer
        assert reply.choices[0].finish_reason == "stop"  # it ended at <|im_end|>, not at 32
    finally:
        node.stop()
