"""Errors the pipeline raises to its callers, each carrying the HTTP status it maps to."""

from __future__ import annotations

import logging
import uuid

from quiver_serve.messages import ErrorInfo


class ServeError(Exception):
    """A request that cannot be (or was not) served; ``info`` says why and which status."""

    def __init__(self, code: str, message: str, status: int) -> None:
        super().__init__(message)
        self.info = ErrorInfo(code=code, message=message, status=status)

    @classmethod
    def from_info(cls, info: ErrorInfo) -> ServeError:
        return cls(info.code, info.message, info.status)


def invalid(message: str) -> ServeError:
    return ServeError("invalid_node_ids", message, 400)


def too_large(n: int, limit: int) -> ServeError:
    return ServeError("too_many_nodes", f"{n} node ids in one request; the limit is {limit}", 413)


def unavailable(code: str, message: str) -> ServeError:
    return ServeError(code, message, 503)


def deadline() -> ServeError:
    return ServeError("deadline_exceeded", "the request's deadline passed before it was served", 504)


def overloaded(message: str, status: int = 503) -> ServeError:
    return ServeError("overloaded", message, status)


def internal_error(exc: BaseException, where: str, logger: logging.Logger) -> ServeError:
    """A 500 that names an error id and nothing of ``exc``; the traceback goes to the log.

    Exception text can carry file paths, library versions or request data, which a client must
    not see. The client quotes the id; operators find the traceback logged under it.
    """
    error_id = uuid.uuid4().hex[:12]
    logger.error("%s failed (error id %s)", where, error_id,
                 exc_info=(type(exc), exc, exc.__traceback__))
    return ServeError("internal", f"internal error (id {error_id}); see the server log", 500)
