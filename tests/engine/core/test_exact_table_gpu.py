"""The exact table on a GPU: built and refreshed on the device (device CSC and device overlay, or
a host CSC read over the bus), every row equal to PyG's full-graph output after every update, and
exact requests answered from it equal to the on-the-fly path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quiver_serve.graph.stream import StreamMix, hold_out
from tests.engine.core.test_engine_core import mb, run
from tests.engine.core.test_exact_table import (
    MODELS,
    Harness,
    awkward_graph,
    check_each_version,
    table_cfg,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("gpu_mode", ["device", "uva"])
@pytest.mark.parametrize(("cls", "kwargs"), MODELS)
def test_gpu_table_rows_equal_pyg_after_every_update(tmp_path: Path, cls: str, kwargs: dict,
                                                     gpu_mode: str) -> None:
    base, stream = hold_out(awkward_graph(3), 0.3, seed=4,
                            mix=StreamMix(edges_per_call=30, nodes_every=3, features_every=2))
    cfg = table_cfg(tmp_path, cls, kwargs, device="cuda")
    cfg.sampling.gpu_mode = gpu_mode  # type: ignore[assignment]
    h = Harness(tmp_path, cfg, base)
    try:
        assert h.table.where == "gpu" and h.table.layers[-1].is_cuda
        ids, want = check_each_version(h, cfg, base.edge_index(), base.x.clone(),
                                       list(stream)[:10])
        got = run(h.core, mb(999, [ids.tolist()], exact=True))[999].rows
        np.testing.assert_allclose(got, want.numpy(), atol=1e-5, rtol=1e-5)
        assert h.table.counters.from_table >= 1
    finally:
        h.close()
