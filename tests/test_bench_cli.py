"""Bench plumbing of issue 10: ``--set section.key=value`` config overrides (``bench/cli.py``,
``ServeConfig.with_overrides``) and the routing mixes of ``loadtest/workloads.py``."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from bench.cli import add_set_option, load_config
from loadtest.workloads import draw_requests, hot_set
from quiver_serve.config import ConfigError, ServeConfig


def test_set_overrides_are_applied_and_validated() -> None:
    ap = argparse.ArgumentParser()
    add_set_option(ap)
    args = ap.parse_args(["--set", "sampling.route=gpu", "--set", "batching.max_batch_nodes=512"])
    cfg = load_config("configs/default.yaml", args.sets)
    assert (cfg.sampling.route, cfg.batching.max_batch_nodes) == ("gpu", 512)
    base = ServeConfig.default()
    over = base.with_overrides(["sampling.route=gpu"])
    assert over.sampling.route == "gpu" and base.sampling.route == "auto"  # a copy, not in place


@pytest.mark.parametrize(("item", "names"), [
    ("sampling.nope=1", "sampling.nope"),  # no such field
    ("route=gpu", "route=gpu"),  # no section
    ("sampling.route", "sampling.route"),  # no value
    ("sampling.route=fast", "sampling.route"),  # not an allowed value
    ("batching.max_batch_nodes=-3", "batching.max_batch_nodes"),  # out of range
    ("sampling.fanouts=[1, 2", "sampling.fanouts"),  # not YAML
])
def test_a_bad_set_names_what_was_wrong(item: str, names: str) -> None:
    with pytest.raises(ConfigError, match=names.replace("[", r"\[")):
        ServeConfig.default().with_overrides([item])


def test_routing_mixes_draw_the_low_and_high_degree_halves_of_the_hot_set() -> None:
    rng = np.random.default_rng(0)
    degree = rng.integers(0, 1000, 20_000)
    hot = hot_set(degree)
    half = hot.size // 2
    low, high = set(hot[:half].tolist()), set(hot[half:].tolist())
    assert max(degree[list(low)]) <= min(degree[list(high)])
    light = draw_requests("light", 10, 48, degree.size, hot, rng)
    heavy = draw_requests("heavy", 10, 48, degree.size, hot, rng)
    mixed = draw_requests("mixed", 11, 48, degree.size, hot, rng)
    assert light.shape == heavy.shape == (10, 48) and mixed.shape == (11, 48)
    assert set(light.ravel().tolist()) <= low and set(heavy.ravel().tolist()) <= high
    # a caller walks consecutive rows: light and heavy alternate
    assert all(set(row.tolist()) <= (low if i % 2 == 0 else high) for i, row in enumerate(mixed))
