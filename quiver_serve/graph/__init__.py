"""Graph data: the CSC type and the dataset loaders."""

from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.datasets import load_graph

__all__ = ["GraphData", "load_graph"]
