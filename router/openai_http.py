"""The router's HTTP front: OpenAI-compatible API and Prometheus `/metrics`, on aiohttp in
the same event loop as the gRPC server.

Routes: POST /v1/completions, POST /v1/chat/completions (both stream as server-sent events
with `"stream": true`, ending with `data: [DONE]`), POST /v1/responses (served as a chat
request, router/responses_api.py; its events are named; GET and DELETE
/v1/responses/<id>, GET /v1/responses/<id>/input_items and POST /v1/responses/<id>/cancel
read, remove and stop the stored ones, router/responses_http.py), /v1/conversations and
their items (router/conversations.py), Anthropic's POST /v1/messages and
/v1/messages/count_tokens (router/anthropic_api.py), GET /v1/models (and /v1/models/<id>),
GET /metrics, GET /health; and vLLM's POST /tokenize and /detokenize
(router/tokenize_api.py) and GET /version.
With API keys (`--api-key`, the same as the gRPC API's), every route but /health, /metrics
and /version needs `Authorization: Bearer <key>` or `x-api-key: <key>`, compared in
constant time; without it the answer is 401 with `WWW-Authenticate: Bearer`, never the key
(router/http_keys.py). The key names the caller's tenant (runtime/tenants.py): its request
ids and turns are its own.

Invariants:
- A request goes through the same `Dispatcher.generate` as a gRPC `Generate`, so it is
  routed, aborted and counted the same way; its id is `X-Request-Id` or a fresh one, and
  comes back in the `X-Request-Id` header. A completions batch (a list of prompts) is one
  such request per prompt, `<id>-<i>`, merged into one answer (router/prompt_batch.py).
- The HTTP status is decided before the first byte of the body: the first message of the
  stream is awaited before the response starts, so a request the nodes reject (bad
  sampling values, no room, no node) gets its 4xx/5xx even when streaming. An error after
  that point arrives as one `data: {"error": ...}` event before `[DONE]`.
- A client that disconnects cancels the handler, which closes the dispatch stream and so
  aborts the request on every node holding it.
"""

from __future__ import annotations

import contextlib
import uuid

import grpc
from aiohttp import web

from pdserve.proto import pdserve_pb2
from pdserve.router import (anthropic_api, fill_in_middle, http_keys, models_api, prompt_batch,
                            response_history, responses_api, responses_http, sse, store_file,
                            tokenize_api, validation)
from pdserve.router.choice_logprobs import ChoiceLogprobs
from pdserve.router.conversations import Conversations
from pdserve.router.echo import echo_of
from pdserve.router.openai_protocol import (
    OpenAIError, chat_prompt, completion_prompts, flag_of, invalid, now, placement_of,
    sampling_from_body, tools_of)
from pdserve.router.openai_shape import Shape, encoded, stream_options_of
from pdserve.router.peers import Peers, or_peer
from pdserve.router.response_store import ResponseStore
from pdserve.router.responses_http import StoredResponses
from pdserve.runtime import auth, http_limits, metrics, tenants
from pdserve.runtime.errors import NodeError, retry_after_of
from pdserve.runtime.identity import pdserve_version
from pdserve.runtime.observe import StreamObserver

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
TENANT = web.RequestKey("tenant", str)  # the caller's, from its API key


def _as_openai_error(err: BaseException, chat: bool) -> OpenAIError:
    if isinstance(err, OpenAIError):
        return err
    if isinstance(err, NodeError):  # a dispatch failure, no node left, ...
        error = OpenAIError.from_status(err.code, err.message, chat)
        error.retry_after_s = retry_after_of(err)
        return error
    raise err


class OpenAIFrontend:
    """`dispatcher`: what serves each request, with the router Dispatcher's `generate` and
    `active` (a colocated node passes its own Generation service, worker/colocated.py).
    `role` labels its metrics; `refresh`, when given, is awaited before /metrics answers (a
    worker samples its gauges then)."""

    def __init__(self, dispatcher, tokenizer, model_id: str, registry=None,
                 api_keys: tenants.KeyRing | None = None, role: str = "router",
                 refresh=None, peers=None) -> None:
        self.api_keys = api_keys  # None: no key needed, every caller is the tenant `default`
        self.dispatcher = dispatcher
        self.role, self.refresh = role, refresh
        self.tokenizer = tokenizer  # router.tokenizer.PromptTokenizer
        self.model_id = model_id  # what answers name it; requests may give any of model_names
        card = tokenizer.card if tokenizer is not None else None
        self.loras = card.loras if card is not None else ()  # LoRA adapters, named as models
        self.model_names = [model_id, *(card.aliases if card is not None else ()), *self.loras]
        self.registry = registry
        self.created = now()
        kept_mb = http_limits.current().responses_store_mb  # /v1/responses' and /v1/conversations' own
        self.stored = StoredResponses(ResponseStore(kept_mb), lambda request: request[TENANT], peers)
        self.conversations = Conversations(kept_mb, lambda request: request[TENANT], peers)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors_and_counts])
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/responses", or_peer(self.stored.peers, self.responses, ("conversation",))),
            web.post("/v1/messages", self.messages),
            web.post("/v1/messages/count_tokens", self.count_tokens),
            *self.stored.routes(), *self.conversations.routes(),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model:.+}", self.model),  # a directory's name has slashes
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/metrics", self.metrics),
            web.get("/health", self.health),
            web.get("/version", self.version),
        ])
        store_file.keep(app, http_limits.current().responses_store_dir, self.stored, self.conversations)
        return app

    @web.middleware
    async def _errors_and_counts(self, request: web.Request, handler):
        try:
            request[TENANT] = http_keys.tenant_of(request, self.api_keys)
            response = await handler(request)
        except OpenAIError as err:
            response = web.json_response(http_keys.error_body(request, err), status=err.status)
            if err.status == 401:
                response.headers["WWW-Authenticate"] = "Bearer"
            elif err.status == 429:  # full or waited too long: come back, do not hammer
                response.headers["Retry-After"] = str(retry_after_of(err))
        except web.HTTPException as err:  # unknown path, wrong method
            error = OpenAIError(err.status, f"{request.method} {request.path}: {err.reason}")
            response = web.json_response(http_keys.error_body(request, error), status=err.status)
        route = request.match_info.route.resource
        path = route.canonical if route is not None else "other"
        metrics.HTTP_REQUESTS.labels(path=path, status=str(response.status)).inc()
        return response

    # ---- simple routes ------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(models_api.listing(request, self.model_names, self.created,
                                                    self.tokenizer.card.max_model_len, self.loras))

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        models_api.check(name, self.model_names)
        parent = self.model_id if name in self.loras else None
        return web.json_response(models_api.card(request, name, self.created, self.tokenizer.card.max_model_len, parent))

    async def tokenize(self, request: web.Request) -> web.Response:
        return web.json_response(tokenize_api.tokenize(await self._body(request), self.tokenizer))

    async def detokenize(self, request: web.Request) -> web.Response:
        return web.json_response(tokenize_api.detokenize(await self._body(request), self.tokenizer))

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": pdserve_version()})

    async def metrics(self, request: web.Request) -> web.Response:
        if self.refresh is not None:
            await self.refresh()
        metrics.QUEUE_DEPTH.labels(role=self.role, queue="in_flight").set(len(self.dispatcher.active))
        if self.registry is not None:
            for pool in ("prefill", "decode"):
                for e in getattr(self.registry, pool):
                    metrics.ENDPOINT_IN_FLIGHT.labels(pool=pool, endpoint=e.address).set(e.in_flight)
                    metrics.ENDPOINT_QUEUE.labels(pool=pool, endpoint=e.address).set(e.queue)
                    metrics.ENDPOINT_ROUTABLE.labels(pool=pool, endpoint=e.address).set(int(e.routable))
        body, content_type = metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    # ---- generation -----------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._generate(request, "responses")
        except OpenAIError as err:
            raise responses_api.renamed(err) from None

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "messages")

    async def count_tokens(self, request: web.Request) -> web.Response:
        body = anthropic_api.chat_body(await self._body(request), counting=True)
        ids = chat_prompt(body, self.tokenizer, tools_of(body, self.tokenizer.tool_dialect))
        return web.json_response({"input_tokens": len(ids)})

    async def _generate(self, request: web.Request, api: str) -> web.StreamResponse:
        """A request to `api`: "completions", "chat", or "responses" or "messages" (a
        Responses or an Anthropic Messages API body, served as the chat request it maps to
        and answered in its shape)."""
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        observer = StreamObserver(self.role, request_id, api=api)
        chat, responses, anthropic = api != "completions", api == "responses", api == "messages"
        try:
            body = original = await self._body(request)
            if responses:  # served as the chat request it means, after its stored conversation
                await self.stored.fetch_previous(request, original)
                original, ended = response_history.prepared(original, request[TENANT], self.stored.store,
                                                            self.conversations)
                body = responses_api.chat_body(original)
            elif anthropic:
                body = anthropic_api.chat_body(original)
            tools = tools_of(body, self.tokenizer.tool_dialect) if chat else None
            card = self.tokenizer.card
            if responses and original.get("truncation") == "auto":  # the oldest turns left out to fit
                given = [response_history.fitted(body, lambda b: chat_prompt(b, self.tokenizer, tools),
                                              card.max_model_len, validation.max_prompt_chars(card))]
            else:
                given = [chat_prompt(body, self.tokenizer, tools)] if chat else completion_prompts(
                    body, self.tokenizer.encode, validation.max_prompt_chars(card))
            prompts = prompt_batch.truncated(body, given, self.tokenizer.card.max_model_len)
            if not chat:  # a suffix, after truncation: truncate_prompt_tokens counts the prompt sent
                prompts = fill_in_middle.with_suffix(body, prompts, self.tokenizer, self.model_id)
            default_max = max(1, self.tokenizer.card.max_model_len - len(prompts[0])) if chat \
                else COMPLETIONS_DEFAULT_MAX_TOKENS
            sampling = sampling_from_body(body, chat=chat, default_max_tokens=default_max, tools=tools)
            placement, stream_usage = placement_of(body), stream_options_of(body)
            placement["lora"] = lora = original["model"] if original["model"] in self.loras else ""
            want_ids, as_ids = flag_of(body, "return_token_ids"), flag_of(body, "return_tokens_as_token_ids")
            for name in ("user", "safety_identifier", "prompt_cache_key"):  # on the request's log line
                if body.get(name):
                    observer.fields[name] = body[name]
            if chat:  # stops at the template's end of turn, as a gRPC conversation does
                sampling = validation.chat_sampling(sampling, self.tokenizer)
                if self.tokenizer.harmony and not sampling.HasField("skip_special_tokens"):
                    sampling.skip_special_tokens = False  # the channels' markers, for router/harmony.py
            ids_of = {request_id: prompts[0]} if len(prompts) == 1 else \
                {f"{request_id}-{i}": ids for i, ids in enumerate(prompts)}
            for i, (one_id, ids) in enumerate(ids_of.items()):
                try:  # the very checks a gRPC Generate gets, so both APIs fail alike
                    validation.check_generate(pdserve_pb2.GenerateRequest(request_id=one_id), ids,
                                              self.tokenizer.card, sampling,
                                              "messages" if chat else "prompt",
                                              i if len(prompts) > 1 else None)
                except ValueError as err:
                    raise OpenAIError.from_status(grpc.StatusCode.INVALID_ARGUMENT, str(err), chat) from None
        except OpenAIError as err:
            observer.finish("not_found" if err.status == 404 else err.code or "invalid_argument",
                            error=err.message)
            raise
        model = lora or self.model_id  # what the answer names: the adapter, as vLLM's does
        shape = Shape(chat, f"{'chatcmpl' if chat else 'cmpl'}-{request_id}", model,
                      ChoiceLogprobs(self._token_text, chat, as_ids),
                      None if chat else echo_of(body, prompts, self.tokenizer, sampling.HasField("logprobs")),
                      tools, self.tokenizer.opens_thinking(prompts[0]) if chat and self.tokenizer.thinks else None,
                      chat and self.tokenizer.harmony)
        shape.scored = {} if body.get("prompt_logprobs") is not None else None
        if want_ids:
            shape.return_token_ids(prompts, sampling.n or 1)
        headers, tenant = {"X-Request-Id": request_id}, request[TENANT]
        keep = responses and original.get("store") is not False and self.stored.store.max_chars > 0
        answer = responses_api.ResponseStream(request_id, model, original, keep) if responses else \
            anthropic_api.MessageStream(request_id, model, original, len(prompts[0])) if anthropic else None

        def as_error(err):  # a node's failure, in the API's own names
            error = _as_openai_error(err, chat=True)
            return responses_api.renamed(error) if responses else error

        messages = self._dispatch(request, ids_of, sampling, placement, observer)
        if responses and original.get("background"):
            return await self.stored.start(request, tenant, answer, shape, messages,
                                           response_history.input_items(original), as_error, headers,
                                           body.get("stream"), ended)
        keep = ended if responses else None
        async with contextlib.aclosing(messages):
            if body.get("stream"):
                events = sse.EventStream(request, headers, sse.PING if anthropic else sse.COMMENT)
                async with contextlib.aclosing(sse.ticking(messages, http_limits.current().sse_keepalive_s,
                                                           events.keep_alive)) as ticked:
                    if answer is not None:
                        return await responses_http.respond(events, ticked, shape, answer, as_error, keep)
                    shape.stream_usage(*stream_usage, sum(map(len, prompts)))
                    return await self._stream(events, ticked, shape)
            if answer is not None:
                return await responses_http.answer_whole(headers, messages, shape, answer, as_error, keep)
            try:
                async for message in messages:
                    shape.add(message)
            except NodeError as err:
                raise _as_openai_error(err, chat) from None
            return web.json_response(shape.whole(), headers=headers)

    def _dispatch(self, request, ids_of: dict[str, list[int]], sampling, placement: dict,
                  observer: StreamObserver):
        """The response stream of each prompt, by its request id; a batch's merged in one
        (router/prompt_batch.py), each prompt logged and counted as a request of its own.
        `placement`: its cache salt and priority (`placement_of`)."""
        def one(one_id: str, ids: list[int], watcher: StreamObserver):
            return watcher.watch(self.dispatcher.generate(
                one_id, ids, sampling, None, tenant=request[TENANT], **placement))

        if len(ids_of) == 1:
            [(one_id, ids)] = ids_of.items()
            return one(one_id, ids, observer)
        return prompt_batch.merged(
            [one(one_id, ids, StreamObserver(self.role, one_id, **observer.fields))
             for one_id, ids in ids_of.items()], sampling.n or 1, observer.request_id)

    async def _stream(self, events: sse.EventStream, messages, shape):
        """`messages` as chat.completion.chunk (or text_completion) events, then [DONE]; a
        failure before anything was sent is its HTTP status, after that an error event."""
        async def send(obj: dict) -> None:
            await events.write(f"data: {encoded(obj, shape.obfuscate)}\n\n".encode())

        try:
            async for msg in messages:
                for event in shape.chunks(msg):
                    await send(event)
        except NodeError as err:
            if not events.started:
                raise _as_openai_error(err, shape.chat) from None
            await send(_as_openai_error(err, shape.chat).body())
        await events.write(b"data: [DONE]\n\n")
        return await events.end()

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except ValueError as err:
            raise invalid(f"request body is not valid JSON: {err}") from None
        if not isinstance(body, dict):
            raise invalid("request body must be a JSON object")
        model = body.get("model")
        if model is None:
            raise invalid("model is required", "model")
        models_api.check(model, self.model_names)
        return body

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id)


async def start_router_http(config, dispatcher, tokenizer, registry):
    """The router's HTTP server on `config.http_port`, or None when it has none."""
    if config.http_port is None:
        return None
    from pdserve.runtime.http import start_http

    metrics.NODE.info({"role": "router", "model": tokenizer.card.model})
    frontend = OpenAIFrontend(dispatcher, tokenizer, tokenizer.card.model, registry,
                              api_keys=auth.current().api_keys,
                              peers=Peers(config.peer_router) if config.peer_router else None)
    return await start_http(frontend.app(), config.server.host, config.http_port,
                            "router OpenAI API and /metrics")
