"""The ASGI application of `vaswani serve` (Starlette): LibreTranslate's `POST /translate`, `GET /languages` and
`GET /health`, errors as `{"error": ...}`, and one log line a request.

Any mistake in a request is a 4xx with a one-line error; a full queue a 503 with Retry-After; a bug a 500 whose
traceback is logged (uvicorn logs what the application raises), and the server goes on serving.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..model.errors_vaswani import UsageError
from .batcher import Decoded, QueueFull
from .languages import LanguagePair
from .libretranslate import BadRequest, translate_request
from .settings import ServingSettings

logger = logging.getLogger("hf_vaswani.serving.requests")
RECORD = "hf_vaswani.request_record"  # the scope key of a request's RequestRecord
RETRY_AFTER_SECONDS = 1
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away before the response; only logged


class TranslationService(Protocol):
    """What decodes the requests' sentences: the Batcher (or, in scripts/serve_benchmark.py, CTranslate2)."""

    queued_sentences: int

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def translate(self, sentences: list[str], nbest: int = 1) -> Decoded: ...


@dataclass
class RequestRecord:
    """What a request's log line reports besides its status."""

    sentences: int = 0
    queue_seconds: float = 0.0
    decode_seconds: float = 0.0


class RequestLog:
    """ASGI middleware: one line a request, when it ends: client, method and path, status, sentences, the queue wait
    and decoding time of its sentences, its time in all. An exception (a bug) is logged as a 500 and passed on."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = scope[RECORD] = RequestRecord()
        status = 500
        started = time.perf_counter()

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            client = "{}:{}".format(*scope["client"]) if scope.get("client") else "-"
            logger.info(
                '%s "%s %s" %d sentences=%d queue_wait=%.1fms decode=%.1fms total=%.1fms',
                client,
                scope["method"],
                scope["path"],
                status,
                record.sentences,
                record.queue_seconds * 1000,
                record.decode_seconds * 1000,
                (time.perf_counter() - started) * 1000,
            )


def error(message: str, status: int, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def body_within(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) once it is over `limit` bytes, by its Content-Length or as it arrives."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"the body of {declared} bytes is over the limit of {limit}", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"the body is over the limit of {limit} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


async def until_disconnected(receive: Receive) -> None:
    """Returns when the client has gone (the body has been read: the next message is the disconnection)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(work: Awaitable[Decoded], receive: Receive) -> Decoded | None:
    """`work`'s result, or None when the client goes first: `work` is then cancelled, as it is when the request's
    own task is."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnected(receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # nothing if done
    return task.result() if task.done() and not task.cancelled() else None


def create_app(service: TranslationService, pair: LanguagePair, settings: ServingSettings) -> ASGIApp:
    """The application serving `pair` with `service`, started and stopped with the application's lifespan: at
    shutdown, after the server's last request, the service decodes what is left and ends."""

    async def translate(request: Request) -> JSONResponse:
        try:
            body = await body_within(request, settings.max_body_bytes)
            query = request.scope.get("query_string", b"")
            parsed = translate_request(body, request.headers.get("content-type", ""), query, pair, settings)
        except BadRequest as refused:
            return error(str(refused), refused.status)
        except ClientDisconnect:
            return error("the client disconnected", CLIENT_CLOSED_REQUEST)
        record: RequestRecord = request.scope[RECORD]
        sentences = parsed.sentences()
        record.sentences = len(sentences)
        try:
            decoded = await unless_disconnected(service.translate(sentences, parsed.nbest), request.receive)
        except QueueFull:
            message = f"the server is busy ({service.queued_sentences} sentences queued): retry later"
            return error(message, 503, {"Retry-After": str(RETRY_AFTER_SECONDS)})
        except UsageError as refused:  # a sentence the model refuses
            return error(str(refused), 400)
        if decoded is None:
            return error("the client disconnected", CLIENT_CLOSED_REQUEST)
        record.queue_seconds, record.decode_seconds = decoded.queue_seconds, decoded.decode_seconds
        return JSONResponse(parsed.response(decoded.texts, pair))

    async def languages(request: Request) -> JSONResponse:
        return JSONResponse(pair.libretranslate_languages())

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "queued_sentences": service.queued_sentences})

    async def http_error(request: Request, refused: HTTPException) -> JSONResponse:
        return error(refused.detail, refused.status_code, refused.headers)

    async def internal_error(request: Request, bug: Exception) -> JSONResponse:
        # Starlette raises the exception again after this response: uvicorn logs it with its traceback.
        return error(f"internal error ({type(bug).__name__}): a bug in hf_vaswani, logged by the server", 500)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        service.start()
        try:
            yield
        finally:
            await service.stop()

    app = Starlette(
        routes=[
            Route("/translate", translate, methods=["POST"]),
            Route("/languages", languages, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        middleware=[
            # LibreTranslate's: browser pages of other origins may call the API
            Middleware(
                CORSMiddleware,
                allow_origins=["*"],
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type"],
            )
        ],
        exception_handlers={HTTPException: http_error, Exception: internal_error},
        lifespan=lifespan,
    )
    return RequestLog(app)
