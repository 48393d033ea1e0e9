"""The OpenAI-compatible HTTP API: ``/v1/completions``, ``/v1/chat/completions`` (streamed as
server-sent events or not), ``/v1/models``, ``/health`` and ``/metrics``, on the same front
(``coordinator.front``) as the gRPC API -- one request path, two encodings. A request becomes one
``GenerateRequest`` per choice (``coordinator.openai_schema``); their chunks become OpenAI's
objects. docs/http-api.md is the user's page.

Every body is read with a bound, parsed here (so a bad body is an OpenAI-style error object
naming the field, never a framework page), and validated by the pydantic schema, then by the
request path as on gRPC; errors keep their gRPC meaning as HTTP statuses (400 / 404 / 429 / 503).
A client that disconnects cancels its generations, which frees their sessions as a cancelled
gRPC call does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from coordinator import openai_schema as schema
from coordinator.front import (
    BUFFERED_CHUNKS,
    STALL_TIMEOUT_S,
    TRACE_HEADERS,
    CoordinatorFront,
    Stalled,
    put_or_stall,
)
from specdec.errors import InvalidArgumentError, ReaderStalledError, SpecdecError
from specdec.runtime.grpc_server import failure_status
from specdec.v1 import coordinator_pb2

log = logging.getLogger("specdec.coordinator.http")
MAX_BODY_BYTES = 4 << 20  # a request body (prompts are bounded further by the schema)
# A whole (non-streamed) answer is rendered in a worker thread; past this many tokens and logprob
# entries in all (n x max_tokens x (1 + top logprobs)) it is refused: such an answer is streamed.
MAX_WHOLE_ANSWER_ENTRIES = 1 << 20

HTTP_STATUS = {  # gRPC status -> HTTP status, with OpenAI's error type
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "ALREADY_EXISTS": (409, "conflict_error"),
    "ABORTED": (409, "conflict_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
}


class HttpError(Exception):
    def __init__(self, status: int, kind: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.param = status, kind, message, param


def error_of(exc: BaseException) -> HttpError:
    """Any failure as the HTTP error a client gets (one mapping, from the gRPC one)."""
    if isinstance(exc, HttpError):
        return exc
    code, message = failure_status(exc, "the HTTP API")
    status, kind = HTTP_STATUS.get(code.name, (500, "internal_error"))
    param = http_param(exc.field) if isinstance(exc, InvalidArgumentError) else None
    return HttpError(status, kind, message, param)


def http_param(field: str) -> str:
    """A gRPC API field as the HTTP API spells it (sampling.max_new_tokens -> max_tokens)."""
    if field == "sampling.max_new_tokens":
        return "max_tokens"
    return field.removeprefix("sampling.")


def error_body(error: HttpError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.status}}


def error_response(exc: BaseException) -> JSONResponse:
    error = error_of(exc)
    return JSONResponse(error_body(error), status_code=error.status)


async def read_json(request: Request, limit: int = MAX_BODY_BYTES) -> Any:
    """The body as JSON, read with a bound: 415 for another content type, 413 past ``limit``,
    400 for bytes that are not JSON."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise HttpError(415, "invalid_request_error", f"Content-Type must be application/json, got {content_type!r}")
    body = bytearray()
    too_big = False
    async for part in request.stream():  # read to the end (a client still sending cannot read an answer)
        if not too_big:
            body += part
            too_big = len(body) > limit
            if too_big:
                body = bytearray()  # kept no further: memory stays bounded
    if too_big:
        raise HttpError(413, "invalid_request_error", f"the request body exceeds {limit} bytes")
    try:
        return json.loads(body)
    except ValueError as exc:
        raise HttpError(400, "invalid_request_error", f"the body is not valid JSON: {exc}") from None
    except RecursionError:  # arrays or objects nested deeper than the parser goes
        raise HttpError(400, "invalid_request_error", "the body's JSON is nested too deeply") from None


async def until_disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is read by then: only the disconnect is left)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@dataclass
class Choice:
    """One generation of a request (one GenerateRequest), as it accumulates. ``keep``: keep its
    text and logprobs for a whole (non-streamed) answer; a streamed one counts them only, so a
    long stream holds no more than its chunks in flight."""

    index: int
    keep: bool = True
    chars: int = 0  # characters of its text so far
    tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    stats: coordinator_pb2.SpeculationStats | None = None
    seed: int = 0
    pieces: list[str] = field(default_factory=list)  # its text, as it came (joined once: linear)
    logprobs: list[coordinator_pb2.TokenLogprobs] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, chunk: coordinator_pb2.GenerateChunk) -> None:
        if self.keep:
            self.logprobs.extend(chunk.logprobs)
            self.pieces.append(chunk.text)
        self.chars += len(chunk.text)
        self.tokens += len(chunk.token_ids)
        self.prompt_tokens = chunk.prompt_tokens or self.prompt_tokens
        if chunk.finish_reason:
            self.finish_reason = schema.finish_reason(chunk.finish_reason)
            self.stats, self.seed = chunk.stats, chunk.seed


async def _primed(stream: AsyncIterator[coordinator_pb2.GenerateChunk]):
    """The stream's first chunk (validation errors surface here, before any response is sent)."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _first_chunks(streams: list) -> list:
    """Every stream's first chunk; when one fails (a refusal: 429, 400) the others are stopped
    before the error is raised -- a choice still starting must not run on, unread, after its
    request was answered with an error."""
    primers = [asyncio.ensure_future(_primed(s)) for s in streams]
    try:
        return await asyncio.gather(*primers)
    except BaseException:
        for task in primers:
            task.cancel()
        await asyncio.gather(*primers, return_exceptions=True)
        raise


async def merged(
    streams: list[AsyncIterator[coordinator_pb2.GenerateChunk]],
    firsts: list[coordinator_pb2.GenerateChunk | None],
    gone: asyncio.Future,
    stall_timeout: float = STALL_TIMEOUT_S,
) -> AsyncIterator[tuple[int, coordinator_pb2.GenerateChunk]]:
    """(choice index, chunk) from every stream as they come; stops (closing every stream) when
    ``gone`` completes -- the client disconnected -- or on the first error, which it raises.

    At most BUFFERED_CHUNKS chunks per stream wait for the reader: a client that stops reading
    stalls its own generations (their producers wait; nobody else's do), and one that reads
    nothing for ``stall_timeout`` seconds has them stopped -- their sessions freed -- and, if it
    ever reads again, gets an error once the chunks already buffered are out."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=BUFFERED_CHUNKS * max(1, len(streams)))
    done = object()
    stalled = asyncio.Event()

    async def put(item) -> None:
        await put_or_stall(queue, item, stall_timeout)

    async def pump(index: int) -> None:
        try:
            if firsts[index] is not None:
                await put((index, firsts[index]))
            async for chunk in streams[index]:
                await put((index, chunk))
            await put((index, done))
        except Stalled:
            log.warning("a client read nothing for %.0f s: its generation is stopped", stall_timeout)
            stalled.set()
            with contextlib.suppress(Exception):
                await streams[index].aclose()  # type: ignore[attr-defined]  # cancels it, frees its sessions
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            with contextlib.suppress(Stalled):
                await put((index, exc))

    pumps = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    # The client may go while nobody iterates this (a streaming response stalled on a dead
    # socket): the disconnect itself cancels the generations.
    gone.add_done_callback(lambda _: [task.cancel() for task in pumps])
    waiting_stall = asyncio.ensure_future(stalled.wait())
    left = len(streams)
    try:
        while left:
            if stalled.is_set() and queue.empty():
                raise HttpError(408, "timeout_error", str(ReaderStalledError(stall_timeout)))
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, gone, waiting_stall}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                if gone.done():
                    return  # the client is gone
                continue  # stalled: the buffered chunks first, then the error
            index, item = getter.result()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        waiting_stall.cancel()
        for task in pumps:
            task.cancel()
        for stream in streams:
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]  # cancels the generation, frees its sessions


def _check_whole_answer(requests: list[coordinator_pb2.GenerateRequest]) -> None:
    """Refuse a non-streamed request whose answer could pass MAX_WHOLE_ANSWER_ENTRIES (its
    choices' max_tokens with their logprobs): held and rendered at once, it is a stream's job."""
    entries = sum(r.sampling.max_new_tokens * (1 + max(0, r.sampling.logprobs)) for r in requests)
    if entries > MAX_WHOLE_ANSWER_ENTRIES:
        raise InvalidArgumentError(
            "stream",
            f"a whole answer of {len(requests)} choices x max_tokens x logprobs ({entries} entries) passes the "
            f"limit of {MAX_WHOLE_ANSWER_ENTRIES}: send stream: true, or ask for fewer",
        )


def health_response(front: CoordinatorFront) -> Response:
    """GET /health: 200 while the front can serve (Redis and a target answer), else 503 and why."""
    if front.serving:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable", "reason": front.not_serving_because}, status_code=503)


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


class OpenAIApp:
    """The routes, over one front. ``model_name``: what ``/v1/models`` lists and requests may name.
    A streaming client may read nothing for the front's ``stall_timeout`` before its generation
    stops."""

    def __init__(self, front: CoordinatorFront, model_name: str, metrics_text: Callable[[], bytes]):
        self.front = front
        self.model_name = model_name
        self.metrics_text = metrics_text
        self.app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url=None)
        self.app.add_api_route("/health", self.health, methods=["GET"])
        self.app.add_api_route("/v1/models", self.models, methods=["GET"])
        self.app.add_api_route("/metrics", self.metrics, methods=["GET"])
        self.app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        self.app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])

    async def dispatch(self, request: Request) -> Response:
        """The routes without the framework's router: how a Ray Serve deployment (whose HTTP
        proxy hands ``__call__`` each request) serves this same API."""
        routes: dict[tuple[str, str], Callable[..., Any]] = {
            ("GET", "/health"): self.health,
            ("GET", "/metrics"): self.metrics,
        }
        with_request = {
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("GET", "/v1/models"): self.models,
        }
        path = "/" + request.url.path.strip("/")
        if (request.method, path) in with_request:
            return await with_request[(request.method, path)](request)
        if (request.method, path) in routes:
            return await routes[(request.method, path)]()
        return error_response(HttpError(404, "not_found_error", f"no route {request.method} {path}"))

    async def health(self) -> Response:
        return health_response(self.front)

    async def models(self, request: Request) -> Response:
        try:
            self.front.authenticate(request.headers.get("authorization"))
        except SpecdecError as exc:
            return error_response(exc)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "specdec"}
        return JSONResponse({"object": "list", "data": [model]})

    async def metrics(self) -> Response:
        return Response(self.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, schema.CompletionRequest, schema.completion_requests, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, schema.ChatCompletionRequest, schema.chat_requests, chat=True)

    async def _serve(self, request: Request, model: type, to_grpc, chat: bool) -> Response:
        caller = {k: v for k, v in request.headers.items() if k in TRACE_HEADERS}
        streams: list = []
        try:
            # the key first, from the headers: a caller without one gets its 401 before a byte
            # of its body is read, let alone parsed into requests
            key = self.front.authenticate(request.headers.get("authorization"))
            body = await read_json(request)
            if not isinstance(body, dict):
                raise HttpError(400, "invalid_request_error", "the body must be a JSON object")
            parsed = schema.parse(model, body)
            if parsed.model and parsed.model != self.model_name:
                raise HttpError(404, "not_found_error", f"model {parsed.model!r} does not exist", "model")
            if not chat and parsed.echo and not isinstance(parsed.prompt, str):
                raise InvalidArgumentError("echo", "only with a text prompt")
            prefix = "chatcmpl" if chat else "cmpl"
            request_id = f"{prefix}-{uuid.uuid4().hex}"
            grpc_requests = to_grpc(parsed, request_id)
            # not durable: an OpenAI client cannot resume, so nothing of it goes to the session log
            streams = [self.front.stream(r, caller, durable=False, key=key) for r in grpc_requests]
            firsts = await _first_chunks(streams)  # every choice validated and started
            if not parsed.stream:
                _check_whole_answer(grpc_requests)
        except Exception as exc:
            for s in streams:
                with contextlib.suppress(Exception):
                    await s.aclose()
            if not isinstance(exc, (HttpError, SpecdecError)):
                log.exception("HTTP request failed")
            return error_response(exc)
        response = _Response(request_id, self.model_name, chat, parsed, len(streams))
        gone = asyncio.ensure_future(until_disconnected(request))
        chunks = merged(streams, list(firsts), gone, self.front.stall_timeout)
        if parsed.stream:
            return StreamingResponse(
                self._events(response, chunks, gone),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            async for index, chunk in chunks:
                response.choices[index].add(chunk)
            if gone.done():
                return Response(status_code=499)  # nobody to answer; the generations are cancelled
            # built and encoded in a worker thread: a large answer must not stall every other stream
            body = await asyncio.to_thread(lambda: json.dumps(response.whole(), separators=(",", ":")).encode())
            return Response(body, media_type="application/json")
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        finally:
            gone.cancel()

    async def _events(self, response: _Response, chunks, gone: asyncio.Future) -> AsyncIterator[bytes]:
        try:
            for event in response.opening():
                yield sse(event)
            async for index, chunk in chunks:
                for event in response.events(index, chunk):
                    yield sse(event)
            usage = response.usage_event()
            if usage is not None:
                yield sse(usage)
        except Exception as exc:  # noqa: BLE001 - the headers are gone: the error is an event
            yield sse(error_body(error_of(exc)))
        finally:
            gone.cancel()
            with contextlib.suppress(Exception):
                await chunks.aclose()
        yield b"data: [DONE]\n\n"


class _Response:
    """The OpenAI objects of one request, built from its choices' chunks."""

    def __init__(self, request_id: str, model: str, chat: bool, parsed, n_streams: int):
        self.id, self.model, self.chat, self.parsed = request_id, model, chat, parsed
        self.created = int(time.time())
        self.choices = [Choice(i, keep=not parsed.stream) for i in range(n_streams)]
        self.echo = "" if chat or not parsed.echo else parsed.prompt
        self.wants_logprobs = bool(parsed.logprobs) if chat else parsed.logprobs is not None

    def _logprobs(self, entries, offset: int) -> dict[str, Any] | None:
        """The ``logprobs`` object of a choice (or of a chunk's tokens), None when not asked for;
        ``offset``: characters of the choice's text before these tokens."""
        if not self.wants_logprobs:
            return None
        return schema.chat_logprobs(entries) if self.chat else schema.completion_logprobs(entries, offset)

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _usage(self) -> dict[str, Any]:
        # n choices of one prompt share it: OpenAI counts the prompt once per prompt, not per choice
        prompts: dict[int, int] = {}
        cached: dict[int, int] = {}  # per prompt, from its first finished choice
        for c in self.choices:
            prompts.setdefault(c.index // self.parsed.n, c.prompt_tokens)
            if c.stats is not None:
                cached.setdefault(c.index // self.parsed.n, c.stats.cached_prompt_tokens)
        known = sum(cached.values()) if len(cached) == len(prompts) else None  # every prompt finished
        return schema.usage(sum(prompts.values()), sum(c.tokens for c in self.choices), known)

    def _stats(self) -> dict[str, Any]:
        return {"choices": [schema.speculation_stats(c.stats) if c.stats else None for c in self.choices]}

    def whole(self) -> dict[str, Any]:
        out = self._envelope("chat.completion" if self.chat else "text_completion")
        choices = []
        for c in self.choices:
            if self.chat:
                message = {"role": "assistant", "content": c.text}
                logprobs = self._logprobs(c.logprobs, 0)
                choices.append(
                    {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": c.finish_reason}
                )
            else:
                text = self.echo + c.text
                logprobs = self._logprobs(c.logprobs, len(self.echo))
                choices.append({"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason})
        out["choices"] = choices
        out["usage"] = self._usage()
        out["specdec"] = self._stats()
        return out

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = [choice]
        return out

    def opening(self) -> list[dict[str, Any]]:
        """The events before any token: the assistant's role (chat), the echoed prompt (completions)."""
        if self.chat:
            return [
                self._chunk(
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
                for c in self.choices
            ]
        if self.echo:
            return [
                self._chunk({"index": c.index, "text": self.echo, "logprobs": None, "finish_reason": None})
                for c in self.choices
            ]
        return []

    def events(self, index: int, chunk: coordinator_pb2.GenerateChunk) -> list[dict[str, Any]]:
        choice = self.choices[index]
        offset = len(self.echo) + choice.chars
        choice.add(chunk)
        out = []
        if chunk.text or (self.wants_logprobs and chunk.logprobs):  # text may lag its tokens (a held stop)
            logprobs = self._logprobs(chunk.logprobs, offset)
            if self.chat:
                piece = {"index": index, "delta": {"content": chunk.text}, "logprobs": logprobs, "finish_reason": None}
            else:
                piece = {"index": index, "text": chunk.text, "logprobs": logprobs, "finish_reason": None}
            out.append(self._chunk(piece))
        if chunk.finish_reason:
            last: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": choice.finish_reason}
            if self.chat:
                last["delta"] = {}
            else:
                last["text"] = ""

            event = self._chunk(last)
            event["specdec"] = schema.speculation_stats(chunk.stats)
            out.append(event)
        options = self.parsed.stream_options
        if options is not None and options.continuous_usage_stats:
            for event in out:
                event["usage"] = self._usage()  # so far
        return out

    def usage_event(self) -> dict[str, Any] | None:
        options = self.parsed.stream_options
        if options is None or not options.include_usage:
            return None
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = []
        out["usage"] = self._usage()
        return out
