"""The server process: the application on uvicorn, on a socket of its own, until SIGTERM or Ctrl-C.

uvicorn's graceful shutdown stops accepting connections, waits for the requests in flight, then ends the application's
lifespan (the batcher decodes what is left, then stops). After it, uvicorn raises the signal again with the handlers
that were there before it started: here ones that do nothing, so that the process ends normally, with exit status 0.
"""

import logging
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.types import ASGIApp

from ..model.errors_vaswani import UsageError

logger = logging.getLogger("hf_vaswani.serving")
# uvicorn's own logging and the server's (hf_vaswani.serving) on standard error, the request lines
# (hf_vaswani.serving.requests) on standard output, where uvicorn's access log would go.
LOG_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"default": {"()": "uvicorn.logging.DefaultFormatter", "fmt": "%(levelprefix)s %(message)s"}},
    "handlers": {
        "default": {"formatter": "default", "class": "logging.StreamHandler", "stream": "ext://sys.stderr"},
        "requests": {"formatter": "default", "class": "logging.StreamHandler", "stream": "ext://sys.stdout"},
    },
    "loggers": {
        "uvicorn": {"handlers": ["default"], "level": "INFO", "propagate": False},
        "uvicorn.error": {"level": "INFO"},
        "hf_vaswani.serving": {"handlers": ["default"], "level": "INFO", "propagate": False},
        "hf_vaswani.serving.requests": {"handlers": ["requests"], "level": "INFO", "propagate": False},
    },
}


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to `host` and `port` (0: a free port), refused in one line (UsageError) where it cannot be."""
    if not 0 <= port < 65536:
        raise UsageError(f"--port must be from 0 to 65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as error:
        raise UsageError(f"cannot listen on {host} port {port}: {error.strerror or error}") from None


def uvicorn_server(app: ASGIApp, listening: socket.socket) -> uvicorn.Server:
    """A uvicorn server of `app` for `listening` (run it with `.run(sockets=[listening])`): no access log (the
    application logs each request), waiting for requests in flight however long they take at shutdown."""
    host, port = listening.getsockname()[:2]
    config = uvicorn.Config(app, host=host, port=port, lifespan="on", access_log=False, log_config=LOG_CONFIG)
    return uvicorn.Server(config)


@contextmanager
def signals_ending_quietly() -> Iterator[None]:
    """SIGINT and SIGTERM handled by doing nothing, for the block: what uvicorn calls after its shutdown."""
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {number: signal.signal(number, lambda *_: None) for number in handled}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def serve(app: ASGIApp, listening: socket.socket) -> None:
    """Serve `app` on the `listening` socket until SIGTERM or Ctrl-C, which end it gracefully and return."""
    server = uvicorn_server(app, listening)  # configures the logging
    host, port = listening.getsockname()[:2]
    logger.info("serving on http://%s:%d (Ctrl-C or SIGTERM to stop)", f"[{host}]" if ":" in host else host, port)
    with signals_ending_quietly():
        server.run(sockets=[listening])
