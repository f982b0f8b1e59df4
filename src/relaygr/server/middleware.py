"""ASGI middleware of the server: a request-body byte limit and per-endpoint status counting.

``BodyLimit`` reads the body before the app sees it and answers 413 as soon as it grows past the
limit (or when ``Content-Length`` already says so), so an oversize body is never parsed and never
reaches a handler. ``StatusCounter`` counts every response by endpoint and status code: the
endpoint is the route's path as declared, a template for a route with parameters
(``/v2/models/{name}/infer`` whatever the name), and paths the API does not define are counted
under ``other``, so neither a scan nor a client's names can grow the label set.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.routing import compile_path

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_json(send: Send, status: int, body: dict[str, str]) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


class BodyLimit:
    """Refuse request bodies over ``max_body_bytes`` with 413 (see the module docstring)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self, size: int) -> dict[str, str]:
        return {"error": "PayloadTooLarge",
                "detail": f"request body is {size} bytes or more; the limit is "
                          f"{self.max_body_bytes}"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() \
                    and int(value) > self.max_body_bytes:
                await send_json(send, 413, self._too_large(int(value)))
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":     # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await send_json(send, 413, self._too_large(size))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class StatusCounter:
    """Calls ``count(endpoint, status)`` once per HTTP response; ``endpoints`` are the routes'
    paths (templates such as ``/v2/models/{name}`` match any one path segment there)."""

    def __init__(self, app: ASGIApp, count: Callable[[str, int], None],
                 endpoints: frozenset[str]) -> None:
        self.app = app
        self.count = count
        self.endpoints = frozenset(e for e in endpoints if "{" not in e)
        self.templates = [(compile_path(e)[0], e) for e in sorted(endpoints) if "{" in e]

    def endpoint_of(self, path: str) -> str:
        """The label of ``path``: itself, the template it matches, or ``other``."""
        if path in self.endpoints:
            return path
        return next((t for regex, t in self.templates if regex.match(path)), "other")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = self.endpoint_of(scope.get("path", ""))

        started = False

        async def counted(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.count(endpoint, int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except BaseException:
            if not started:          # the server's error handler answers 500 further out
                self.count(endpoint, 500)
            raise
