"""The Ray Serve ingress answers errors as the daemon does (body, code, wording, Retry-After).

No Ray cluster: the ingress's FastAPI app runs under Starlette's test client, with the replica
context Ray Serve would give it (``serve.get_replica_context().servable_object``) pointing at an
ingress whose engine replica is a stand-in.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from fastapi.testclient import TestClient  # noqa: E402
from pydantic import ValidationError  # noqa: E402
from ray import serve  # noqa: E402

from quiver_serve.config import ServeConfig  # noqa: E402
from quiver_serve.frontend.bodies import validation_message  # noqa: E402
from quiver_serve.frontend.schemas import EmbedBody  # noqa: E402
from quiver_serve.scaleout import ray_serve  # noqa: E402


class Replica:
    """The engine deployment's handle: ``embed.remote(...)`` answers ``reply`` (awaitable)."""

    def __init__(self, reply: Any) -> None:
        async def remote(*_: Any) -> Any:
            return reply

        self.embed = types.SimpleNamespace(remote=remote)


def ingress_client(monkeypatch: pytest.MonkeyPatch, reply: Any, retry_after_s: int) -> TestClient:
    cfg = ServeConfig()
    cfg.server.retry_after_s = retry_after_s
    # the class as written (Ray Serve's wrapper subclass needs a replica), without its __init__
    written = next(k for k in ray_serve.Ingress.__mro__[1:] if k.__module__ == ray_serve.__name__)
    ingress = object.__new__(written)
    ingress.engine, ingress.cfg, ingress.num_nodes = Replica(reply), cfg, 2708
    monkeypatch.setattr(serve, "get_replica_context",
                        lambda: types.SimpleNamespace(servable_object=ingress))
    return TestClient(ray_serve.APP)


def daemon_message(body: Any) -> str:
    """The daemon's 422 wording of ``body`` (``bodies.validation_message`` over the schema's
    errors, as its FastAPI routes and the ingress both word a RequestValidationError)."""
    try:
        EmbedBody.model_validate(body)
    except ValidationError as exc:
        return validation_message(exc.errors())
    raise AssertionError(f"{body!r} is valid")


@pytest.mark.parametrize("body", [{"node_ids": "x"}, {"node_ids": [1, "a"]}, {"exact": True}])
def test_a_malformed_body_is_422_invalid_request_worded_as_the_daemon(
        monkeypatch: pytest.MonkeyPatch, body: Any) -> None:
    r = ingress_client(monkeypatch, None, 1).post("/v1/embed", json=body)
    assert r.status_code == 422 and "retry-after" not in r.headers
    assert r.json() == {"error": {"code": "invalid_request", "message": daemon_message(body)}}


def test_a_body_that_is_not_json_is_422_invalid_request(monkeypatch: pytest.MonkeyPatch) -> None:
    r = ingress_client(monkeypatch, None, 1).post(
        "/v1/embed", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "invalid_request"
    assert r.json()["error"]["message"].startswith("malformed JSON body")


@pytest.mark.parametrize("status,code", [(503, "overloaded"), (503, "replica_lost"),
                                         (504, "deadline_exceeded")])
def test_a_replica_refusal_keeps_its_status_and_503_carries_the_configured_retry_after(
        monkeypatch: pytest.MonkeyPatch, status: int, code: str) -> None:
    reply = {"status": status, "code": code, "message": "no"}
    r = ingress_client(monkeypatch, reply, 7).post("/v1/embed", json={"node_ids": [1, 2]})
    assert r.status_code == status
    assert r.json() == {"error": {"code": code, "message": "no"}}
    assert r.headers.get("retry-after") == ("7" if status == 503 else None)
