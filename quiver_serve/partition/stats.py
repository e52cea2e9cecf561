"""What a partitioning costs (docs/decisions/0042-partitioning.md): edge cut, node and edge
balance, replicated rows and bytes, seconds per phase; printed and saved as ``stats.json``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from quiver_serve.graph.csc import GraphData
from quiver_serve.partition.book import PartitionBook


@dataclass
class PartitionStats:
    method: str
    num_parts: int
    num_nodes: int
    num_edges: int
    num_features: int
    edge_cut: int  # in-edges u->v whose u and v have different owners
    edge_cut_fraction: float
    node_balance: float  # most nodes in a partition / mean
    edge_balance: float  # most in-edges in a partition / mean
    nodes_per_part: list[int]
    edges_per_part: list[int]
    replicated_rows: int  # hot rows over all partitions
    replicated_bytes: int  # their float32 feature bytes
    hot_rows_per_part: list[int]
    hot_read_share: list[float]  # per partition: expected share of remote row reads hot rows serve
    phase_s: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        """The summary the command line prints."""
        share = float(np.mean(self.hot_read_share)) if self.hot_read_share else 0.0
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in self.phase_s.items())
        return "\n".join([
            f"{self.method} into {self.num_parts} partitions: {self.num_nodes:,} nodes, "
            f"{self.num_edges:,} edges",
            f"edge cut: {self.edge_cut:,} edges ({self.edge_cut_fraction:.2%})",
            f"balance (max/mean): nodes {self.node_balance:.3f}, edges {self.edge_balance:.3f}",
            f"replicated hot rows: {self.replicated_rows:,} ({self.replicated_bytes / 1e6:.1f} MB), "
            f"expected share of remote row reads served by them {share:.1%}",
            f"time: {phases}",
        ])


def edge_cut(indptr: np.ndarray, indices: np.ndarray, owner: np.ndarray,
             edges_per_chunk: int = 1 << 24) -> int:
    """In-edges whose source and target have different owners (in chunks of about
    ``edges_per_chunk`` edges, so the temporaries stay bounded)."""
    num_nodes = indptr.shape[0] - 1
    step = max(1, edges_per_chunk * num_nodes // max(int(indptr[-1]), 1))
    cut = 0
    for lo in range(0, num_nodes, step):
        hi = min(num_nodes, lo + step)
        dst_owner = np.repeat(owner[lo:hi], np.diff(indptr[lo:hi + 1]))
        cut += int((owner[indices[indptr[lo]:indptr[hi]]] != dst_owner).sum())
    return cut


def balance(counts: np.ndarray) -> float:
    mean = float(np.mean(counts)) if counts.size else 0.0
    return float(np.max(counts)) / mean if mean > 0 else 1.0


def partition_stats(graph: GraphData, book: PartitionBook, hot_share: list[float],
                    hot_rows: list[int], phase_s: dict[str, float]) -> PartitionStats:
    indptr, indices = graph.indptr.numpy(), graph.indices.numpy()
    degree = np.diff(indptr)
    nodes = np.bincount(book.owner, minlength=book.num_parts)
    edges = np.bincount(book.owner, weights=degree, minlength=book.num_parts).astype(np.int64)
    cut = edge_cut(indptr, indices, book.owner)
    row_bytes = graph.num_features * 4
    return PartitionStats(
        method=book.method, num_parts=book.num_parts, num_nodes=graph.num_nodes,
        num_edges=graph.num_edges, num_features=graph.num_features, edge_cut=cut,
        edge_cut_fraction=cut / max(graph.num_edges, 1), node_balance=balance(nodes),
        edge_balance=balance(edges), nodes_per_part=nodes.tolist(), edges_per_part=edges.tolist(),
        replicated_rows=int(sum(hot_rows)), replicated_bytes=int(sum(hot_rows)) * row_bytes,
        hot_rows_per_part=list(hot_rows), hot_read_share=list(hot_share), phase_s=phase_s)
