"""quiver-serve: a GNN serving daemon (batching, hybrid CPU/GPU sampling, PyG inference).

Queue API (names follow torch-quiver's serving example)::

    batcher = RequestBatcher(cfg, stream_queue)
    sampler = HybridSampler(cfg, graph, batcher.batched_request_queue_list()); sampler.start()
    server = InferenceServer(cfg, graph, sampler.sampled_request_queue_list()); server.start()
    results = server.result_queue_list()

(a thin layer over the one engine: ``engine/client/seed_api.py``), or the facade:
``Pipeline(cfg).start()`` with ``embed()``, ``request_queue()``, ``result_queue()``.

Exports load lazily, so ``quiver_serve.sampling`` and ``quiver_serve.graph.csc`` import without the
server stack (pydantic, fastapi), e.g. on a GPU box that only runs the samplers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ServeConfig": "quiver_serve.config",
    "RequestBatcher": "quiver_serve.engine.client.seed_api",
    "HybridSampler": "quiver_serve.engine.client.seed_api",
    "InferenceServer": "quiver_serve.engine.client.seed_api",
    "Pipeline": "quiver_serve.engine.client.pipeline",
    "ServeError": "quiver_serve.errors",
    "GraphData": "quiver_serve.graph.csc",
    "load_graph": "quiver_serve.graph.datasets",
    "EmbedRequest": "quiver_serve.messages",
    "EmbedResult": "quiver_serve.messages",
    "ErrorInfo": "quiver_serve.messages",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'quiver_serve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
