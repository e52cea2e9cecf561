#!/usr/bin/env python
"""What a request costs at the front door: single-request latency and front-end CPU per request.

Against a running daemon (``--url``), one keep-alive client sends requests one at a time and
reports p50/p99 per route and body format, and (``--pids``, or the front-end pids that
``/v1/workers`` lists) the CPU time the HTTP front-end processes spent per request, read from
``/proc``. Also times the JSON answer of 48x64 float32 rows three ways (``tolist()`` +
``json.dumps``, orjson with ``OPT_SERIALIZE_NUMPY``, a ``.npy`` body).

    python server.py --port 8711 &
    python -m bench.frontdoor.front_door --url http://127.0.0.1:8711 --label before

JSON: --out, else $OUT or bench/results/, front_door_<machine>_<date>[_<label>].json. Before and
after in one run, two checkouts' daemons in turn: ``python -m bench.gpu front_door OTHER``.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from collections.abc import Callable

import httpx
import numpy as np
import orjson

from loadtest.cpu import CLK_TCK, read_stat
from loadtest.results import add_result_options, result_path, run_meta, write_result


def encode_costs_us(rows: int = 48, dim: int = 64, n: int = 2000) -> dict[str, float]:
    """Microseconds to turn one answer of ``rows x dim`` float32 into a body."""
    emb = np.random.default_rng(0).random((rows, dim), dtype=np.float32)

    def npy() -> bytes:
        buf = io.BytesIO()
        np.save(buf, emb)
        return buf.getvalue()

    ways: dict[str, Callable[[], bytes]] = {
        "tolist_json_dumps": lambda: json.dumps({"embeddings": emb.tolist()}).encode(),
        "orjson_numpy": lambda: orjson.dumps({"embeddings": emb}, option=orjson.OPT_SERIALIZE_NUMPY),
        "np_save": npy,
    }
    try:
        from quiver_serve.frontend.bodies import npy_bytes

        ways["npy_bytes"] = lambda: npy_bytes(emb)
    except ImportError:  # before the hot-route change
        pass
    out = {}
    for name, fn in ways.items():
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = (time.perf_counter() - t0) / n * 1e6
    return out


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (``loadtest/cpu.py``)."""
    stats = [read_stat(pid) for pid in pids]
    return sum(st[1] for st in stats if st is not None) / CLK_TCK


def frontend_pids(client: httpx.Client) -> list[int]:
    workers = client.get("/v1/workers").json()
    pids = [w["pid"] for w in workers["workers"] if w["role"] == "frontend"]
    if not pids and "frontend" in workers:  # one in-process front-end
        pids = [workers["frontend"]["pid"]]
    return pids


def latency(client: httpx.Client, send: Callable[[], httpx.Response], n: int,
            pids: list[int]) -> dict[str, float]:
    for _ in range(min(50, n)):
        send()
    times = np.empty(n)
    c0 = cpu_s(pids) if pids else 0.0
    for i in range(n):
        t0 = time.perf_counter()
        r = send()
        times[i] = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
    cpu = (cpu_s(pids) - c0) / n if pids else float("nan")
    ms = times * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "frontend_cpu_ms_per_request": cpu * 1e3}


def routes(client: httpx.Client, model: str, ids: list[int]) -> dict[str, Callable[[], httpx.Response]]:
    n = len(ids)
    raw = np.asarray(ids, dtype="<i8").tobytes()
    head = orjson.dumps({"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [n],
                                     "parameters": {"binary_data_size": len(raw)}}],
                         "parameters": {"binary_data_output": True}})
    infer = f"/v2/models/{model}/infer"
    return {
        f"embed_json_{n}": lambda: client.post("/v1/embed", json={"node_ids": ids}),
        f"embed_npy_{n}": lambda: client.post("/v1/embed", json={"node_ids": ids},
                                               headers={"accept": "application/x-npy"}),
        f"kserve_json_{n}": lambda: client.post(infer, json={"inputs": [
            {"name": "node_ids", "datatype": "INT64", "shape": [n], "data": ids}]}),
        f"kserve_binary_{n}": lambda: client.post(
            infer, content=head + raw, headers={"inference-header-content-length": str(len(head)),
                                                "content-type": "application/octet-stream"}),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=1000, help="requests per route")
    p.add_argument("--pids", type=int, nargs="*", help="front-end pids (default: from /v1/workers)")
    p.add_argument("--label", default="run", help="the run's name (in the JSON and, unless "
                   "'run', the file name)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 48], help="ids per request")
    p.add_argument("--routes", nargs="+", default=None,
                   help="only these rows (embed_json, embed_npy, kserve_json, kserve_binary)")
    p.add_argument("--out", help="JSON file (default $OUT or bench/results/, "
                   "front_door_<machine>_<date>[_<label>].json)")
    add_result_options(p)
    args = p.parse_args()
    out: dict[str, object] = {"label": args.label, "url": args.url, "encode_48x64_us": encode_costs_us()}
    with httpx.Client(base_url=args.url, timeout=30) as client:
        model = _model_name(client)
        pids = args.pids if args.pids is not None else frontend_pids(client)
        out["frontend_pids"] = pids
        rows: dict[str, dict[str, float]] = {}
        for n_ids in args.sizes:
            ids = list(range(100, 100 + n_ids))
            for name, send in routes(client, model, ids).items():
                if args.routes is None or name.rsplit("_", 1)[0] in args.routes:
                    rows[name] = latency(client, send, args.requests, pids)
        rows["health_live"] = latency(client, lambda: client.get("/v2/health/live"), args.requests, pids)
        out["latency"] = rows
    path = result_path("front_door", args, None if args.label == "run" else args.label)
    write_result(path, {"meta": run_meta(args), **out})
    print("encode 48x64 float32 (us): " + ", ".join(f"{k} {v:.0f}" for k, v in out["encode_48x64_us"].items()))
    print(f"{'route':24s} {'p50 ms':>8s} {'p99 ms':>8s} {'front-end CPU ms/req':>21s}")
    for name, r in rows.items():
        print(f"{name:24s} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {r['frontend_cpu_ms_per_request']:21.3f}")


def _model_name(client: httpx.Client) -> str:
    """The served model's name, from the OpenAPI-free route that names it (/v1/embed answers)."""
    return str(client.post("/v1/embed", json={"node_ids": [0]}).json()["model"])


if __name__ == "__main__":
    main()
