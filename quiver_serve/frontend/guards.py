"""ASGI guards in front of the app: bearer-token auth and a request-body size limit.

Plain ASGI (not Starlette's BaseHTTPMiddleware) so they add no task hop per request.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from quiver_serve import envs

OPEN_PATHS = frozenset({"/v2/health/live"})
TOKEN_ENV = "QUIVER_SERVE_TOKEN"


def resolve_token(configured: str | None) -> str | None:
    """The environment variable wins over the config file (keeps secrets out of YAML)."""
    return envs.QUIVER_SERVE_TOKEN or configured


async def _reject(send: Any, status: int, code: str, message: str, path: str,
                  headers: list[tuple[bytes, bytes]] | None = None) -> None:
    from quiver_serve.frontend.kserve import error_payload

    body = json.dumps(error_payload(path, code, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class Guards:
    """Wraps an ASGI app: 401 without the bearer token (if one is set), 413 for oversized bodies."""

    def __init__(self, app: Any, token: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given, length = b"", None
        for key, value in scope["headers"]:  # one pass; the last of a repeated header counts
            if key == b"authorization":
                given = value
            elif key == b"content-length":
                length = value
        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            if not hmac.compare_digest(given, self.expected):
                await _reject(send, 401, "unauthorized", "missing or wrong bearer token",
                              scope["path"], [(b"www-authenticate", b"Bearer")])
                return
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _reject(send, 413, "body_too_large",
                          f"request body of {int(length)} bytes exceeds {self.max_body_bytes}",
                          scope["path"])
            return
        if length is None and scope.get("method") in ("POST", "PUT", "PATCH"):
            await self._call_buffered(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _call_buffered(self, scope: Any, receive: Any, send: Any) -> None:
        """A chunked body carries no length up front: read it (bounded), then replay it."""
        parts: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # client went away
                return
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                await _reject(send, 413, "body_too_large",
                              f"request body exceeds {self.max_body_bytes} bytes", scope["path"])
                return
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(parts), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
