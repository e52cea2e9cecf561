"""``python server.py``: a start-up that cannot succeed ends at once with one named line."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
@pytest.mark.parametrize("http_workers", ["1", "2"])
def test_a_port_in_use_ends_start_up_with_one_line(http_workers: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "server.py", "--port", str(port), "--http-workers",
                              http_workers], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=60)
    assert out.returncode == 1
    assert time.monotonic() - t0 < 30  # before the graph and the engine, not after
    last = out.stderr.strip().splitlines()[-1]
    assert last == f"quiver-serve: cannot listen on 127.0.0.1:{port} (server.port): " \
                   "Address already in use"
