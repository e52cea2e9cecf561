"""Who may call what: one :func:`authorize` for every plane and protocol, and the ASGI guards.

Every request belongs to a plane (:func:`plane_of`): liveness is open; admin routes
(docs/architecture.md, "Admin plane": graph updates, compaction, feature re-placement, the model
repository) need ``server.admin_token`` as ``Authorization: Bearer`` when one is set (the
data-plane ``server.auth_token`` never opens them: 403), and with none set they answer loopback
clients only (403 to any other); everything else, ``GET /v1/graph`` included (it only reads), is
the data plane: ``server.auth_token`` when one is set. :func:`authorize` decides for the HTTP
protocol's hot routes (``hot_protocol.py``), the ASGI guards below (every other route) and gRPC
(``frontend/grpc/``), comparing tokens in constant time.

:class:`Guards` is plain ASGI (not Starlette's BaseHTTPMiddleware) so it adds no task hop per
request: the token check, then a request-body size limit (a chunked body counted as it streams).
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
import json
from typing import Any, NamedTuple

from quiver_serve import envs

TOKEN_ENV = "QUIVER_SERVE_TOKEN"
ADMIN_TOKEN_ENV = "QUIVER_SERVE_ADMIN_TOKEN"
#: every path under these is an admin route (``/v1/graph`` itself is not: it only reads)
ADMIN_PREFIXES = ("/admin/", "/v1/graph/", "/v2/repository")
OPEN_PATHS = frozenset({"/v2/health/live"})
_BEARER = (b"www-authenticate", b"Bearer")


class Plane(enum.Enum):
    OPEN = "open"  # liveness: no token
    DATA = "data"  # server.auth_token, when set
    ADMIN = "admin"  # server.admin_token, else loopback clients only


class Tokens(NamedTuple):
    """The ``Authorization`` header values that open each plane (``Bearer <token>``), None
    where no token is set."""

    data: bytes | None
    admin: bytes | None

    @classmethod
    def of(cls, token: str | None, admin_token: str | None) -> Tokens:
        return cls(f"Bearer {token}".encode() if token else None,
                   f"Bearer {admin_token}".encode() if admin_token else None)

    @classmethod
    def from_config(cls, server: Any) -> Tokens:
        """``server.auth_token`` and ``server.admin_token``, the environment winning."""
        return cls.of(resolve_token(server.auth_token), resolve_admin_token(server.admin_token))


class Refusal(NamedTuple):
    """Why a call is not let through: status (401 or 403), error code and message."""

    status: int
    code: str
    message: str

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """``WWW-Authenticate: Bearer`` on a 401, as RFC 6750 asks."""
        return [_BEARER] if self.status == 401 else []


def resolve_token(configured: str | None) -> str | None:
    """The environment variable wins over the config file (keeps secrets out of YAML)."""
    return envs.QUIVER_SERVE_TOKEN or configured


def resolve_admin_token(configured: str | None) -> str | None:
    """``QUIVER_SERVE_ADMIN_TOKEN`` wins over ``server.admin_token``, as for the data plane."""
    return envs.QUIVER_SERVE_ADMIN_TOKEN or configured


def plane_of(path: str) -> Plane:
    """The plane of an HTTP path."""
    if path.startswith(ADMIN_PREFIXES):
        return Plane.ADMIN
    return Plane.OPEN if path in OPEN_PATHS else Plane.DATA


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


def _matches(given: bytes, expected: bytes) -> bool:
    return hmac.compare_digest(given, expected)


def authorize(plane: Plane, authorization: bytes, client: Any, tokens: Tokens) -> Refusal | None:
    """None to let a call through, else its refusal. ``authorization``: the call's
    ``Authorization`` value (b"" when absent); ``client``: the peer (host, port), None when
    unknown (then never loopback)."""
    if plane is Plane.OPEN:
        return None
    if plane is Plane.DATA:
        if tokens.data is None or _matches(authorization, tokens.data):
            return None
        return Refusal(401, "unauthorized", "missing or wrong bearer token")
    if tokens.admin is not None:
        if _matches(authorization, tokens.admin):
            return None
        if tokens.data is not None and _matches(authorization, tokens.data):
            return Refusal(403, "forbidden", "the data-plane token does not open admin routes; "
                           "send the admin token (server.admin_token)")
        return Refusal(401, "unauthorized", "missing or wrong admin bearer token")
    if is_loopback(client):
        return None
    return Refusal(403, "forbidden", "admin routes answer loopback clients only while no admin "
                   f"token is set (server.admin_token or {ADMIN_TOKEN_ENV})")


def reject_parts(status: int, code: str, message: str, path: str,
                 headers: list[tuple[bytes, bytes]] | None = None
                 ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Status, headers and body of a guard's refusal (in the route's protocol's error body)."""
    from quiver_serve.frontend.kserve import error_payload

    body = json.dumps(error_payload(path, code, message)).encode()
    return status, [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()), *(headers or [])], body


def body_too_large(path: str, max_body_bytes: int,
                   declared_bytes: int | None = None) -> tuple[int, list[tuple[bytes, bytes]],
                                                               bytes]:
    """The 413 of a body over ``server.max_body_bytes`` (declared up front, or counted)."""
    if declared_bytes is None:
        message = f"request body exceeds {max_body_bytes} bytes"
    else:
        message = f"request body of {declared_bytes} bytes exceeds {max_body_bytes}"
    return reject_parts(413, "body_too_large", message, path)


async def _reject(send: Any, parts: tuple[int, list[tuple[bytes, bytes]], bytes]) -> None:
    status, raw, body = parts
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class Guards:
    """Wraps an ASGI app: :func:`authorize` on every request, then 413 for oversized bodies."""

    def __init__(self, app: Any, tokens: Tokens, max_body_bytes: int) -> None:
        self.app, self.tokens, self.max_body_bytes = app, tokens, max_body_bytes

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
        path = scope["path"]
        refused = authorize(plane_of(path), given, scope.get("client"), self.tokens)
        if refused is not None:
            await _reject(send, reject_parts(*refused, path, refused.headers))
            return
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _reject(send, body_too_large(path, self.max_body_bytes, int(length)))
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
                await _reject(send, body_too_large(scope["path"], self.max_body_bytes))
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
