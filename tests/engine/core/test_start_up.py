"""An engine core's start-up: its CPU work on every core, serving on ``inference.torch_threads``
again after it, and the private capacity copy of a mapped feature matrix."""

from __future__ import annotations

import os

import pytest
import torch

from quiver_serve.config import ServeConfig
from quiver_serve.engine.core.build import capacity_copy, start_up_threads


def test_start_up_threads_then_serving_threads_again() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cores = len(os.sched_getaffinity(0))
        with start_up_threads(ServeConfig()) as n:
            assert n == torch.get_num_threads() == cores
        assert torch.get_num_threads() == 1
        cfg = ServeConfig.model_validate({"inference": {"startup_threads": 3}})
        with pytest.raises(RuntimeError), start_up_threads(cfg) as n:
            assert n == 3
            raise RuntimeError("a failed start")
        assert torch.get_num_threads() == 1  # restored on the way out of a failure too
    finally:
        torch.set_num_threads(before)


def test_start_up_threads_never_below_serving() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        cfg = ServeConfig.model_validate({"inference": {"startup_threads": 2}})
        with start_up_threads(cfg) as n:
            assert n == 4
    finally:
        torch.set_num_threads(before)


def test_capacity_copy_is_private_with_zero_rows() -> None:
    x = torch.arange(12, dtype=torch.float32).view(4, 3)
    out = capacity_copy(x, 6)
    assert out.shape == (6, 3)
    assert torch.equal(out[:4], x) and not out[4:].any()
    out[0, 0] = -1.0
    assert x[0, 0] == 0.0  # the copy, not the mapped rows, takes writes
    same = capacity_copy(x, 4)
    assert torch.equal(same, x) and same.data_ptr() != x.data_ptr()
