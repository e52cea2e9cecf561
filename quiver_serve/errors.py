"""Errors the pipeline raises to its callers, each carrying the HTTP status it maps to.

Each refusal is worded here once (clients and tests match the text); every layer that checks a
request (front-ends, Pipeline, the seed API, the engine core's vectorised intake) words it here.
"""

from __future__ import annotations

import logging
import uuid

import numpy as np

from quiver_serve.messages import ErrorInfo

#: the largest sampling seed (samplers hash it as a signed 64-bit value)
MAX_SEED = 2**63 - 1
#: (code, message, status) of a request whose deadline passed: a tuple, so the engine core's
#: per-micro-batch ``wire.RequestError`` and a :class:`ServeError` share one wording
DEADLINE = ("deadline_exceeded", "the request's deadline passed before it was served", 504)


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
    return ServeError(*DEADLINE)


def out_of_range_message(bad_id: int, num_nodes: int) -> str:
    return f"node id {bad_id} is out of range: valid ids are 0..{num_nodes - 1}"


def out_of_range(bad_id: int, num_nodes: int) -> ServeError:
    return invalid(out_of_range_message(bad_id, num_nodes))


def check_id_range(ids: np.ndarray, num_nodes: int) -> None:
    """Raise a 400 naming the first extreme id outside ``0..num_nodes-1`` (``ids`` not empty)."""
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_nodes:
        raise out_of_range(lo if lo < 0 else hi, num_nodes)


def check_node_ids(ids: np.ndarray, num_nodes: int, max_request_nodes: int) -> None:
    """Every check of one request's ids, in the order the daemon has always answered them:
    shape (400), count (413), dtype (400), empty (400), range (400)."""
    if ids.ndim != 1:
        raise invalid(f"node_ids must be a 1-D list, got shape {tuple(ids.shape)}")
    if ids.size > max_request_nodes:
        raise too_large(int(ids.size), max_request_nodes)
    if ids.dtype.kind not in "iu":
        raise invalid(f"node_ids must be integers, got dtype {ids.dtype}")
    if ids.size == 0:
        raise invalid("node_ids is empty")
    check_id_range(ids, num_nodes)


def seed_ok(seed: int | None) -> bool:
    """No seed, or one the samplers take."""
    return seed is None or 0 <= seed <= MAX_SEED


def check_seed(seed: int | None) -> None:
    if not seed_ok(seed):
        raise ServeError("invalid_seed", f"seed must be in [0, {MAX_SEED}], got {seed}", 400)


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
