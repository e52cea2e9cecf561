"""Internal errors: a fixed message with an error id for the client, the exception in the log."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from quiver_serve.config import ModelConfig
from quiver_serve.errors import internal_error
from quiver_serve.models.served import model_metadata

log = logging.getLogger("quiver_serve.tests.errors")


def test_internal_error_hides_the_exception_and_logs_it_under_an_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    try:
        raise KeyError("secret-token at /srv/data/graph.npz")
    except KeyError as exc:
        with caplog.at_level(logging.ERROR, logger=log.name):
            err = internal_error(exc, "GET /v1/thing", log)
    info = err.info
    assert (info.status, info.code) == (500, "internal")
    match = re.fullmatch(r"internal error \(id ([0-9a-f]{12})\); see the server log", info.message)
    assert match is not None and str(err) == info.message
    assert "secret" not in info.message and "KeyError" not in info.message
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    assert match.group(1) in record.getMessage() and "GET /v1/thing" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[0] is KeyError
    assert "secret-token" in caplog.text  # the traceback went to the log


def test_error_ids_differ() -> None:
    first = internal_error(RuntimeError("x"), "a", log).info.message
    assert first != internal_error(RuntimeError("x"), "a", log).info.message


def test_metadata_names_weights_outside_the_repository_by_file_name(tmp_path: Path) -> None:
    weights = tmp_path / "private" / "run-7" / "weights.pt"
    meta = model_metadata(ModelConfig(weights=str(weights)), 1433)
    assert meta["state_dict"] == "weights.pt"


def test_metadata_names_weights_inside_the_package_from_the_folder_holding_it() -> None:
    from quiver_serve.config import DEFAULTS_DIR

    weights = DEFAULTS_DIR / ".." / "defaults" / "cora_graphsage.pt"  # an absolute path
    meta = model_metadata(ModelConfig(weights=str(weights)), 1433)
    assert meta["state_dict"] == "quiver_serve/defaults/cora_graphsage.pt"
    assert model_metadata(ModelConfig(weights=None), 1433)["state_dict"] is None


def test_http_500_body_has_the_id_and_no_exception_text(caplog: pytest.LogCaptureFixture) -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from quiver_serve.frontend.app import _install_error_handlers

    app = FastAPI()
    _install_error_handlers(app)

    @app.get("/broken")
    async def broken() -> None:
        raise ValueError("secret detail from /srv/data")

    with caplog.at_level(logging.ERROR, logger="quiver_serve.frontend.app"):
        response = TestClient(app, raise_server_exceptions=False).get("/broken")
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "internal" and "secret" not in response.text
    error_id = re.fullmatch(r"internal error \(id ([0-9a-f]{12})\); see the server log",
                            error["message"])
    assert error_id is not None
    assert any(error_id.group(1) in r.getMessage() and "GET /broken" in r.getMessage()
               for r in caplog.records)
