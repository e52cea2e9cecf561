#!/usr/bin/env python
"""The baseline: a GNN embedding server built the way PyG users serve today.

FastAPI in one uvicorn process; each request is handled on its own (FastAPI's thread pool, no
batching across requests): PyG-style CPU neighbour sampling of the request's seeds, CPU feature
gather ``x[n_id]``, the model (the same PyG class and weights quiver-serve serves, PyG's own
layers) on the GPU when there is one, ``tolist()`` + JSON or ``.npy`` answer. Same ``POST /v1/embed``
contract as quiver-serve, so the same load generator drives both.

Sampler: PyG's own ``torch_geometric.sampler.NeighborSampler`` when PyG can sample (pyg-lib or
torch-sparse installed: ``torch_geometric.typing.WITH_PYG_LIB`` / ``WITH_TORCH_SPARSE``); else,
clearly labelled, quiver-serve's pure-torch reference sampler (``sampling/reference.py``), which has
the same semantics (in-neighbours, uniform without replacement). ``GET /v1/baseline`` and the start
log say which one runs.

    python -m bench.frontdoor.baseline_server --config quiver_serve/defaults/default.yaml --port 8100 [--sampler auto|pyg|reference]
"""


# No `from __future__ import annotations`: FastAPI reads the route annotations at run time.
import argparse
import io
import logging
import time
from typing import Any

import numpy as np
import torch

from loadtest.results import add_set_option, load_config

log = logging.getLogger("baseline")


class PygSampler:
    """PyG's ``NeighborSampler`` over the graph's CSC (given sorted by target: no conversion)."""

    def __init__(self, indptr: torch.Tensor, indices: torch.Tensor, fanouts: list[int]) -> None:
        from torch_geometric.data import Data
        from torch_geometric.sampler import NeighborSampler

        num_nodes = indptr.numel() - 1
        dst = torch.repeat_interleave(torch.arange(num_nodes), indptr.diff())
        data = Data(edge_index=torch.stack([indices, dst]), num_nodes=num_nodes)
        self.sampler = NeighborSampler(data, num_neighbors=fanouts, is_sorted=True)
        import torch_geometric.typing as pyg_typing

        self.name = "pyg NeighborSampler (" + ("pyg-lib" if pyg_typing.WITH_PYG_LIB else
                                                "torch-sparse") + ")"

    def sample(self, seeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(n_id with the seeds first, local edge_index [2, E] source -> target)."""
        from torch_geometric.sampler import NodeSamplerInput

        out = self.sampler.sample_from_nodes(NodeSamplerInput(input_id=None, node=seeds))
        return out.node, torch.stack([out.row, out.col])


class ReferenceSampler:
    """Fallback when PyG cannot sample here: quiver-serve's pure-torch reference, same semantics."""

    name = "reference (pure torch; PyG's sampler needs pyg-lib or torch-sparse)"

    def __init__(self, indptr: torch.Tensor, indices: torch.Tensor, fanouts: list[int]) -> None:
        from quiver_serve.sampling.reference import ReferenceSampler as Ref

        self.ref, self.fanouts = Ref(indptr, indices), fanouts
        self.gen = torch.Generator().manual_seed(0)

    def sample(self, seeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.gen))
        out = self.ref.sample(seeds, self.fanouts, seed)
        return out.n_id, out.edge_index


def pick_sampler(kind: str, indptr: torch.Tensor, indices: torch.Tensor, fanouts: list[int]) -> Any:
    import torch_geometric.typing as pyg_typing

    can_pyg = bool(pyg_typing.WITH_PYG_LIB or pyg_typing.WITH_TORCH_SPARSE)
    if kind == "pyg" and not can_pyg:
        raise SystemExit("--sampler pyg: PyG's NeighborSampler needs pyg-lib or torch-sparse")
    if kind == "pyg" or (kind == "auto" and can_pyg):
        return PygSampler(indptr, indices, fanouts)
    return ReferenceSampler(indptr, indices, fanouts)


class Baseline:
    """Graph, features and model; ``embed(ids)`` does one request the plain PyG way."""

    def __init__(self, cfg: Any, sampler_kind: str, device: str) -> None:
        from quiver_serve.graph.datasets import load_graph
        from quiver_serve.models.served import build_model

        t0 = time.perf_counter()
        g = load_graph(cfg.graph)
        self.num_nodes, self.x = g.num_nodes, g.x
        self.fanouts = list(cfg.sampling.fanouts)
        self.sampler = pick_sampler(sampler_kind, g.indptr, g.indices, self.fanouts)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.model = build_model(cfg.model, g.num_features).to(self.device).eval()
        self.model_name = cfg.model.name
        log.info("baseline ready in %.1f s: %s; sampler %s; model %s on %s", time.perf_counter() - t0,
                 g.describe(), self.sampler.name, cfg.model.pyg_class, self.device)

    @torch.no_grad()
    def embed(self, ids: list[int]) -> np.ndarray:
        seeds = torch.tensor(ids, dtype=torch.int64)
        uniq, inverse = torch.unique(seeds, return_inverse=True)  # PyG wants distinct seeds
        n_id, edge_index = self.sampler.sample(uniq)
        x = self.x[n_id].to(self.device)  # CPU gather, then one copy to the GPU
        out = self.model(x, edge_index.to(self.device))[: uniq.numel()]
        return out[inverse].float().cpu().numpy()

    def info(self) -> dict[str, Any]:
        return {"sampler": self.sampler.name, "device": str(self.device), "model": self.model_name,
                "fanouts": self.fanouts, "num_nodes": self.num_nodes}


def make_app(base: Baseline, max_request_nodes: int) -> Any:
    """FastAPI app: POST /v1/embed (JSON or .npy), health routes, GET /v1/baseline."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from pydantic import BaseModel, Field

    class EmbedBody(BaseModel):
        node_ids: list[int] = Field(min_length=1)
        exact: bool = False
        seed: int | None = None

    app = FastAPI(title="PyG-style baseline")

    def error(status: int, code: str, message: str) -> JSONResponse:
        return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error(422, "invalid_request", str(exc.errors()[:3]))

    @app.get("/v2/health/live")
    def live() -> dict:
        return {"live": True}

    @app.get("/v2/health/ready")
    def ready() -> dict:
        return {"ready": True}

    @app.get("/v1/baseline")
    def info() -> dict:
        return base.info()

    @app.post("/v1/embed")
    def embed(body: EmbedBody, request: Request) -> Response:  # sync: FastAPI's thread pool
        if body.exact:
            return error(400, "unsupported", "the baseline serves sampled mode only")
        if len(body.node_ids) > max_request_nodes:
            return error(413, "too_many_nodes", f"at most {max_request_nodes} node ids per request")
        bad = next((i for i in body.node_ids if not 0 <= i < base.num_nodes), None)
        if bad is not None:
            return error(400, "node_out_of_range",
                         f"node id {bad} is out of range 0..{base.num_nodes - 1}")
        emb = base.embed(body.node_ids)
        if "application/x-npy" in request.headers.get("accept", ""):
            buf = io.BytesIO()
            np.save(buf, emb, allow_pickle=False)
            return Response(buf.getvalue(), media_type="application/x-npy")
        return JSONResponse({"model": base.model_name, "dim": int(emb.shape[1]),
                             "embeddings": emb.tolist()})

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--config", default="quiver_serve/defaults/default.yaml", help="the quiver-serve config "
                    "whose graph, fanouts and model (class, kwargs, weights) the baseline serves")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--sampler", default="auto", choices=["auto", "pyg", "reference"],
                    help="auto: PyG's NeighborSampler when pyg-lib or torch-sparse is installed")
    ap.add_argument("--device", default="auto", help="model device: auto (cuda if any), cuda, cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    add_set_option(ap)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import uvicorn


    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.sets)
    base = Baseline(cfg, args.sampler, args.device)
    uvicorn.run(make_app(base, cfg.server.max_request_nodes), host=args.host, port=args.port,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
