"""gRPC status codes by name (the values of the gRPC spec's ``doc/statuscodes.md``) and the
daemon's HTTP-style statuses mapped to them.

The endpoint writes ``grpc-status`` itself (``streams.H2Stream.finish``), so it needs the
numbers, not grpcio: nothing in ``quiver_serve`` imports ``grpc`` at run time.
"""

from __future__ import annotations

from enum import IntEnum


class GrpcStatus(IntEnum):
    """A call's ``grpc-status``."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


#: the daemon's error status (``errors.ServeError``'s, HTTP's) -> the call's gRPC status
CODES: dict[int, GrpcStatus] = {
    400: GrpcStatus.INVALID_ARGUMENT, 401: GrpcStatus.UNAUTHENTICATED,
    403: GrpcStatus.PERMISSION_DENIED, 404: GrpcStatus.NOT_FOUND,
    409: GrpcStatus.ALREADY_EXISTS, 413: GrpcStatus.INVALID_ARGUMENT,
    422: GrpcStatus.INVALID_ARGUMENT, 429: GrpcStatus.RESOURCE_EXHAUSTED,
    499: GrpcStatus.CANCELLED, 501: GrpcStatus.UNIMPLEMENTED,
    503: GrpcStatus.UNAVAILABLE, 504: GrpcStatus.DEADLINE_EXCEEDED}


def status_for(http_status: int) -> GrpcStatus:
    """The gRPC status of a daemon error status (INTERNAL for one without its own)."""
    return CODES.get(http_status, GrpcStatus.INTERNAL)
