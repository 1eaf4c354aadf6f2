"""A fake OpenAI-compatible completions server on bare asyncio (no HTTP library), for
testing the benchmark's OpenAI backend: `POST /v1/completions` streams one SSE chunk per
token `gap_s` apart, then a usage chunk and `[DONE]`; `GET /v1/models` names one model.
A prompt of `[0]` gets HTTP 400. Every request body is kept in `bodies`."""

from __future__ import annotations

import asyncio
import json


class FakeOpenAI:
    def __init__(self, gap_s: float = 0.01, model: str = "fake-model") -> None:
        self.gap_s = gap_s
        self.model = model
        self.bodies: list[dict] = []
        self.server: asyncio.AbstractServer | None = None
        self.url = ""

    async def __aenter__(self) -> "FakeOpenAI":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path, _ = (await reader.readline()).decode().split(" ", 2)
            headers = {}
            while (line := (await reader.readline()).decode().strip()):
                key, value = line.split(":", 1)
                headers[key.lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            if method == "GET" and path == "/v1/models":
                self._reply(writer, 200, "application/json",
                            json.dumps({"data": [{"id": self.model}]}).encode())
            elif method == "POST" and path == "/v1/completions":
                await self._complete(writer, json.loads(body))
            else:
                self._reply(writer, 404, "text/plain", b"not found")
            await writer.drain()
        finally:
            writer.close()

    @staticmethod
    def _reply(writer, status: int, content_type: str, body: bytes) -> None:
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)

    async def _complete(self, writer, body: dict) -> None:
        self.bodies.append(body)
        if body["prompt"] == [0]:
            self._reply(writer, 400, "application/json", b'{"error": {"message": "bad prompt"}}')
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Connection: close\r\n\r\n")
        n = body["max_tokens"]
        for i in range(n):
            await asyncio.sleep(self.gap_s)
            event = {"choices": [{"index": 0, "text": f" t{i}",
                                  "finish_reason": "length" if i == n - 1 else None}]}
            writer.write(f"data: {json.dumps(event)}\n\n".encode())
            await writer.drain()
        prompt_tokens = len(body["prompt"]) if isinstance(body["prompt"], list) else 1
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                 "total_tokens": prompt_tokens + n}
        writer.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        writer.write(b"data: [DONE]\n\n")
