"""Schemathesis against the live OpenAPI schema: no 5xx for any generated input.

503 (overloaded / draining) and 504 (the client's own ``timeout_ms`` passed) are contract answers
with the documented error body, not faults; every other 5xx fails the test.
"""

from __future__ import annotations

from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from tests.conftest import ServerProcess  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


SEEN: dict[int, int] = {}


def check(case: Any) -> None:
    if "{name}" in case.path:  # the model served; other path parameters stay generated
        case.path_parameters = {**(case.path_parameters or {}), "name": "cora-graphsage"}
    response = case.call(timeout=30)
    status = response.status_code
    SEEN[status] = SEEN.get(status, 0) + 1
    where = f"{case.method} {case.path} {case.body!r:.200}"
    if status in (503, 504):
        _error_body_ok(case.path, response.json(), where)
        return
    assert status < 500, f"{where}: {status} {response.text[:300]}"
    if status >= 400:
        _error_body_ok(case.path, response.json(), where)


def _error_body_ok(path: str, body: Any, where: str) -> None:
    """/v2 routes answer KServe's ``{"error": "<message>"}``, the rest ``{code, message}``."""
    if path == "/v2" or path.startswith("/v2/"):
        assert isinstance(body["error"], str) and body["error"], where
    else:
        assert set(body["error"]) == {"code", "message"}, where


def test_no_server_errors(server: ServerProcess) -> None:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    assert len(operations) >= 6
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        def run(case: Any) -> None:
            check(case)

        run()
    # not vacuous: valid inputs were served and invalid ones refused
    assert SEEN.get(200, 0) > 10 and SEEN.get(422, 0) > 10, SEEN
