"""quiver-serve: a GNN serving daemon (batching, hybrid CPU/GPU sampling, PyG inference).

Queue API (names follow torch-quiver's serving example)::

    batcher = RequestBatcher(cfg, stream_queue)
    sampler = HybridSampler(cfg, graph, batcher.batched_request_queue_list()); sampler.start()
    server = InferenceServer(cfg, graph, sampler.sampled_request_queue_list()); server.start()
    results = server.result_queue_list()

or the facade: ``Pipeline(cfg).start()`` with ``embed()``, ``request_queue()``, ``result_queue()``.
"""

from quiver_serve.config import ServeConfig
from quiver_serve.engine.batcher import RequestBatcher
from quiver_serve.engine.hybrid_sampler import HybridSampler
from quiver_serve.engine.inference import InferenceServer
from quiver_serve.engine.pipeline import Pipeline
from quiver_serve.errors import ServeError
from quiver_serve.graph import GraphData, load_graph
from quiver_serve.messages import EmbedRequest, EmbedResult, ErrorInfo

__all__ = [
    "EmbedRequest",
    "EmbedResult",
    "ErrorInfo",
    "GraphData",
    "HybridSampler",
    "InferenceServer",
    "Pipeline",
    "RequestBatcher",
    "ServeConfig",
    "ServeError",
    "load_graph",
]

__version__ = "0.1.0"
