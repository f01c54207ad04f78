"""The predict app's ASGI middleware: the gates that answer a request before any route sees it,
and the guard that turns a client's disconnect into the cancellation of its handler.

Both are plain ASGI callables, so the handler keeps the server's own ``receive`` semantics (a
Starlette ``@app.middleware("http")`` would hide the disconnect from it).

A request's life through :class:`DisconnectGuard`: the handler runs as a task of its own and
reads its body through the guard, message by message, only as it asks for it (so the size limit
the handler enforces while reading keeps a large body from costing memory). Once the last body
message has gone through, the guard waits on the server's ``receive`` for ``http.disconnect``. A
disconnect before the response is complete cancels the handler task: whatever it awaits — a whole
answer being collected, the next token of a stream, a write to the socket — raises
``CancelledError``, the generator chain under it closes, and the request is aborted on the
workers. From then on the handler's own ``receive`` answers ``http.disconnect``, as the server's
would, so a response's own disconnect listener still hears it. A disconnect is not an error: it is
not logged above debug level, and nothing is sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)
Refusal = Callable[[Request], Response | None]


class RequestGate:
    """Answers an HTTP request itself when ``refuse`` returns a response for it (judged on the
    headers alone; the body is not read), else passes it on untouched."""

    def __init__(self, app: ASGIApp, refuse: Refusal) -> None:
        self.app, self.refuse = app, refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self.refuse(Request(scope))
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


class DisconnectGuard:
    """Cancels an HTTP request's handler when its client goes away before the answer is
    complete (see the module's docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = Exchange(receive, send)
        handler = asyncio.ensure_future(self.app(scope, exchange.receive, exchange.send))
        exchange.handler = handler
        try:
            await handler
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not exchange.handler_cancelled or (current and current.cancelling()):
                raise  # cancelled from outside (the server is stopping): not ours to swallow
            log.debug("%s %s: the client went away", scope["method"], scope["path"])
        finally:
            exchange.stop_watching()


class Exchange:
    """One request's traffic between the server and its handler, as the guard sees it."""

    def __init__(self, receive: Receive, send: Send) -> None:
        self.server_receive, self.server_send = receive, send
        self.client_gone = asyncio.Event()
        self.body_complete = False
        self.response_complete = False
        self.handler_cancelled = False  # by the guard, because the client went away
        self.handler: asyncio.Future[None] | None = None
        self.watcher: asyncio.Task[None] | None = None

    async def receive(self) -> Message:
        """The handler's ``receive``: the body as the server delivers it, then (once the client
        is gone) ``http.disconnect``."""
        if self.body_complete:
            await self.client_gone.wait()
            return {"type": "http.disconnect"}
        message = await self.server_receive()
        if message["type"] == "http.disconnect":
            self.client_left()
            await asyncio.sleep(0)  # in the handler's own task, the cancellation lands here
        elif not message.get("more_body", False):
            self.body_complete = True
            self.watcher = asyncio.ensure_future(self.watch())
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.response_complete = True
        await self.server_send(message)

    async def watch(self) -> None:
        """Wait for the server's ``http.disconnect`` (it also comes once the response is done)."""
        try:
            while (await self.server_receive())["type"] != "http.disconnect":
                pass
        except Exception:  # a server whose receive fails after the body: stop watching
            log.debug("stopped watching for a disconnect", exc_info=True)
            return
        self.client_left()

    def client_left(self) -> None:
        self.client_gone.set()
        handler = self.handler
        if not self.response_complete and handler is not None and not handler.done():
            self.handler_cancelled = True
            handler.cancel()

    def stop_watching(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
