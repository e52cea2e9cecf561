"""ASGI guards in front of the app: bearer-token auth, the admin guard, a request-body size limit.

Plain ASGI (not Starlette's BaseHTTPMiddleware) so they add no task hop per request.

Admin routes (docs/architecture.md, "Admin plane": graph updates, compaction, feature re-placement,
the model repository) need ``server.admin_token`` as ``Authorization: Bearer`` when one is set (the
data-plane ``server.auth_token`` never opens them: 403); with none set they answer loopback clients
only (403 to any other). ``GET /v1/graph`` only reads: it is data-plane, like ``/v1/embed``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from typing import Any

from quiver_serve import envs

OPEN_PATHS = frozenset({"/v2/health/live"})
TOKEN_ENV = "QUIVER_SERVE_TOKEN"
ADMIN_TOKEN_ENV = "QUIVER_SERVE_ADMIN_TOKEN"
#: every path under these is an admin route (``/v1/graph`` itself is not: it only reads)
ADMIN_PREFIXES = ("/admin/", "/v1/graph/", "/v2/repository")


def resolve_token(configured: str | None) -> str | None:
    """The environment variable wins over the config file (keeps secrets out of YAML)."""
    return envs.QUIVER_SERVE_TOKEN or configured


def resolve_admin_token(configured: str | None) -> str | None:
    """``QUIVER_SERVE_ADMIN_TOKEN`` wins over ``server.admin_token``, as for the data plane."""
    return envs.QUIVER_SERVE_ADMIN_TOKEN or configured


def is_admin_path(path: str) -> bool:
    return path.startswith(ADMIN_PREFIXES)


def is_loopback(client: Any) -> bool:
    """The ASGI ``client`` (host, port) is this machine (127.0.0.0/8, ::1, IPv4-mapped)."""
    if not client or not client[0]:
        return False  # a Unix socket or an unknown peer: not trusted without a token
    try:
        ip = ipaddress.ip_address(client[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def admin_refusal(client: Any, authorization: bytes, admin_expected: bytes | None,
                  data_expected: bytes | None) -> tuple[int, str, str] | None:
    """(status, code, message) refusing an admin request, or None to let it through.
    ``*_expected`` are the full ``Bearer <token>`` header values, None when not set."""
    if admin_expected is not None:
        if hmac.compare_digest(authorization, admin_expected):
            return None
        if data_expected is not None and hmac.compare_digest(authorization, data_expected):
            return 403, "forbidden", "the data-plane token does not open admin routes; send " \
                "the admin token (server.admin_token)"
        return 401, "unauthorized", "missing or wrong admin bearer token"
    if is_loopback(client):
        return None
    return 403, "forbidden", "admin routes answer loopback clients only while no admin token " \
        f"is set (server.admin_token or {ADMIN_TOKEN_ENV})"


def reject_parts(status: int, code: str, message: str, path: str,
                 headers: list[tuple[bytes, bytes]] | None = None
                 ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Status, headers and body of a guard's refusal (in the route's protocol's error body)."""
    from quiver_serve.frontend.kserve import error_payload

    body = json.dumps(error_payload(path, code, message)).encode()
    return status, [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()), *(headers or [])], body


async def _reject(send: Any, status: int, code: str, message: str, path: str,
                  headers: list[tuple[bytes, bytes]] | None = None) -> None:
    status, raw, body = reject_parts(status, code, message, path, headers)
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class Guards:
    """Wraps an ASGI app: 401 without the bearer token (if one is set), the admin guard on admin
    routes (instead of the data-plane token), 413 for oversized bodies."""

    def __init__(self, app: Any, token: str | None, max_body_bytes: int,
                 admin_token: str | None = None) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None
        self.admin_expected = f"Bearer {admin_token}".encode() if admin_token else None
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
        if is_admin_path(scope["path"]):
            refused = admin_refusal(scope.get("client"), given, self.admin_expected, self.expected)
            if refused is not None:
                status, code, message = refused
                await _reject(send, status, code, message, scope["path"],
                              [(b"www-authenticate", b"Bearer")] if status == 401 else None)
                return
        elif self.expected is not None and scope["path"] not in OPEN_PATHS:
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
