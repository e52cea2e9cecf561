"""Configuration: one pydantic model per section, composed into :class:`ServeConfig`.

Every field has a one-line description (it is also the config reference in docs/config.md).
Paths (``paths.py``; docs/config.md, "Paths"; docs/decisions/0038-package-data.md): a relative
path in a YAML file is taken from that file's folder, one in a ``QUIVER_SERVE__`` variable, a
``--set`` or a config built in Python from the working directory; each is made absolute as the
config is loaded, so a config dumped to another folder means the same files. The built-in
defaults name the embedded default, shipped inside the package (``paths.DEFAULTS_DIR``), so an
installed package serves it from any working directory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from quiver_serve import envs
from quiver_serve.paths import DEFAULT_CONFIG_PATH as DEFAULT_CONFIG_PATH
from quiver_serve.paths import DEFAULTS_DIR as DEFAULTS_DIR
from quiver_serve.paths import PACKAGE_DIR as PACKAGE_DIR
from quiver_serve.paths import PATH_FIELDS, anchor_paths, shown_path
from quiver_serve.paths import resolve_path as resolve_path


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class GraphConfig(_Section):
    """Which graph and node features to serve."""

    format: Literal["planetoid", "npz", "pyg", "synthetic"] = Field(
        "planetoid", description="dataset format: Planetoid raw folder, .npz, saved PyG Data, or synthetic (typed graphs: pyg also reads a saved HeteroData, npz the typed layout; docs/architecture.md, \"Typed graphs\")"
    )
    path: str | None = Field(
        default_factory=lambda: str(DEFAULTS_DIR / "planetoid" / "cora" / "raw"),
        description="file or folder of the dataset (not used by synthetic)"
    )
    name: str = Field("cora", description="dataset name (Planetoid: cora/citeseer/pubmed; else a label)")
    synthetic_preset: Literal["reddit", "products", "papers100m", "custom", "mag"] = Field(
        "reddit", description="published statistics the synthetic generator matches (mag: the typed ogbn-mag, four node types and four relations)"
    )
    words_as_nodes: bool = Field(
        False, description="typed graphs: serve a bag-of-words graph (Planetoid) as papers and words: paper-cites-paper, and paper-has_word-word for every nonzero feature; words have no features"
    )
    add_reverse_edges: bool = Field(
        False, description="typed graphs: add a (dst, rev_<rel>, src) relation for every relation between two types and make relations within one type undirected, as PyG's ToUndirected does"
    )
    synthetic_scale: float = Field(
        1.0, gt=0, le=1.0, description="fraction of the preset's nodes and edges to generate"
    )
    synthetic_num_nodes: int | None = Field(None, gt=0, description="custom preset: node count")
    synthetic_num_edges: int | None = Field(None, gt=0, description="custom preset: directed edge count")
    synthetic_num_features: int | None = Field(None, gt=0, description="custom preset: feature width")
    synthetic_seed: int = Field(0, description="seed of the synthetic generator (same seed, same graph)")
    update_log_dir: str | None = Field(
        None, description="folder of the graph's update log and compacted bases (null: a folder keyed by the graph under $QUIVER_SERVE_GRAPH_STATE, default the cache dir's graphs/)")
    fsync: Literal["always", "group", "none"] = Field(
        "always", description="when an update is synced before it is acknowledged: every call; group commit of concurrent calls; never (kill -9 safe, not power-loss safe)")
    group_commit_ms: float = Field(2.0, gt=0, description="fsync group: longest wait for other calls to share a sync")
    max_update_edges: int = Field(
        100_000, ge=1, description="most edges (add + remove) or rows in one update call (else 413)")
    max_new_nodes: int | None = Field(
        None, ge=0, description="nodes that can be appended while serving (ids and feature rows preallocated; null: max(1024, 10% of the base))")
    overlay_capacity_edges: int | None = Field(
        None, ge=1024, description="overlay entries (8 bytes each, per process that samples) before updates wait for compaction (null: max(2^20, edges / 4))")
    compact_at_fill: float = Field(
        0.5, gt=0, le=1.0, description="compact in the background once the overlay is this full")
    snapshot: bool = Field(
        True, description="write the loaded or generated graph as the base of version 0 in the update-log folder on a first start, so later starts map it instead of loading or generating it again (with its content hashes; a changed dataset file is refused)")
    apply_budget_ms: float = Field(
        2.0, gt=0, description="engine-loop time per step for applying updates while requests wait (the writer plans each update; an engine core applies the planned writes of as many records as fit, at least one per step; idle, it applies every record read; while requests wait, reading, applying and the PSGS entries take separate steps); see quiver_serve_graph_apply_seconds")
    compact_interval_s: float = Field(
        600.0, ge=0, description="also compact this long after the last compaction when anything changed (0: only by fill or on request)")
    compact_threads: int = Field(
        1, ge=1, description="intra-op threads of a compaction's fold, sort and write in the daemon's main process: background work, which should not take every core (torch's default) from the front-ends and callers on the same machine; the main process's other torch work keeps its threads")


#: how ``to_hetero`` combines the relations into one node type (PyG's choices)
TO_HETERO_AGGRS = ("sum", "mean", "max", "min", "mul")


class ModelConfig(_Section):
    """The PyG model served, rebuilt from its class name and kwargs and loaded weights-only."""

    name: str = Field("cora-graphsage", description="model name in URLs and responses")
    pyg_class: str = Field(
        "GraphSAGE", description="a class of torch_geometric.nn.models (GraphSAGE, GCN, GAT, GIN, ...; the fast layers serve GraphSAGE, GCN and GAT) or an import path package.module:Class of a torch.nn.Module whose forward takes (x, edge_index)"
    )
    kwargs: dict[str, Any] = Field(
        default_factory=lambda: {"hidden_channels": 128, "num_layers": 2, "out_channels": 64},
        description="constructor kwargs; in_channels defaults to the graph's feature width",
    )
    weights: str | None = Field(
        default_factory=lambda: str(DEFAULTS_DIR / "cora_graphsage.pt"), description="state_dict file (loaded with weights_only=True); null = random init"
    )
    random_init_seed: int = Field(0, description="seed for random weights when weights is null")
    to_hetero: dict[str, Any] | None = Field(
        None, description="typed graphs: {aggr: sum|mean|max} converts the class with PyG's to_hetero(model, metadata, aggr) (lazy in_channels, set by one forward before the weights load); null: the class is served as it is"
    )
    featureless_value: float = Field(
        1.0, description="typed graphs: node types without features get one feature column of this value (a model's own embedding table reads n_id_dict instead)"
    )

    @field_validator("to_hetero")
    @classmethod
    def _check_to_hetero(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        unknown = sorted(set(value) - {"aggr"})
        if unknown:
            raise ValueError(f"to_hetero takes only 'aggr', got {unknown}")
        aggr = value.setdefault("aggr", "sum")
        if aggr not in TO_HETERO_AGGRS:
            raise ValueError(f"to_hetero.aggr must be one of {list(TO_HETERO_AGGRS)}, got {aggr!r}")
        return value

    @property
    def num_layers(self) -> int:
        return int(self.kwargs.get("num_layers", 2))


class ModelsConfig(_Section):
    """The model repository (docs/architecture.md, "Models and versions"): several models and
    versions, loaded and unloaded while serving. Without a repository the ``model:`` section is the
    one model served (version 1)."""

    repository: str | None = Field(
        None, description="model repository folder: one sub-folder per model (config.yaml, and one sub-folder per version holding model.pt, a weights-only state_dict); null: serve the model: section")
    default: str | None = Field(
        None, description="the model that answers requests naming none; null: model.name when the repository has it, else the repository's first model")
    load_at_start: list[str] | None = Field(
        None, description="models loaded at start-up (each per its version_policy); null: every model in the repository")
    load_timeout_s: float = Field(
        300.0, gt=0, description="longest a load may take in every engine core (build, CUDA graphs, warm-up) before it is abandoned and the old versions keep serving")
    unload_drain_s: float = Field(
        30.0, ge=0, description="longest an unloaded version's queued and in-flight requests are waited for before it is released (what is left is answered 503)")
    table_build_step_ms: float = Field(
        2.0, gt=0, le=1000, description="most milliseconds of a new version's exact-table build per engine step (the version serves at once, its exact requests on the fly until the table is built beside serving; docs/decisions/0040-model-load-duty.md)")


class SamplingConfig(_Section):
    """Neighbour sampling (docs/architecture.md, "Sampling")."""

    fanouts: list[int] = Field(
        default_factory=lambda: [25, 10], description="neighbours per hop, nearest first; -1 = all"
    )
    implementation: Literal["auto", "reference", "cpp"] = Field(
        "auto", description="CPU sampler: compiled C++ when available (auto), or the pure-torch reference"
    )
    num_cpu_workers: int = Field(
        1, ge=0, description="CPU sampler processes; 0 = sample inside the inference worker"
    )
    cpu_threads_per_worker: int = Field(1, ge=1, description="intra-op threads of each CPU sampler")
    gpu_mode: Literal["auto", "device", "uva"] = Field(
        "auto", description="GPU sampling: CSC in GPU memory (device), pinned host memory read by the GPU (uva), or device when it fits in half the free GPU memory (auto)"
    )
    route: Literal["auto", "cpu", "gpu", "local", "quiver"] = Field(
        "auto", description="routing: auto (the path the cost model predicts finishes first; cpu on a box without a GPU sampler), cpu (CPU pool or engine, by the cost model), gpu, local (C++ sampler in the engine), quiver (torch-quiver's rule: one-draw size sum vs quiver_threshold)"
    )
    quiver_threshold: int = Field(
        800, ge=0, description="route quiver: batches whose summed one-draw sampled size reaches this go to the GPU, the rest to the CPU"
    )
    psgs_rounds: int = Field(
        4, ge=1, le=64, description="samples of every node alone behind its PSGS table entry (cached on disk per graph and fanouts)"
    )
    calibration: Literal["auto", "startup", "off"] = Field(
        "auto", description="cost model: auto (reuse the saved calibration when graph, fanouts and hardware match, else time the paths at start-up), startup (always time), off (priors, refined online)"
    )
    calibration_s: float = Field(
        20.0, gt=0, description="longest time the start-up calibration of the sampling paths may take"
    )
    pool_overlap: Literal["hidden", "serial", "off"] = Field(
        "hidden", description="route auto: while the GPU is busy, idle CPU samplers sample part of the waiting work; hidden: only when GPU sampling is slower than the model (it runs beside it), serial: whenever it saves GPU time (GPU sampling takes GPU time from the model, e.g. uva), off (engine/core/overlap.py)"
    )
    gpu_graph_cache_bytes: int = Field(
        0, ge=0, description="uva GPU sampling: GPU memory for the hottest nodes' neighbour lists (by access probability) and indptr; 0: all adjacency read over the bus")
    graph_cache_layout: Literal["packed", "elias_fano"] = Field(
        "elias_fano", description="how the adjacency cache stores neighbour lists: elias_fano (about log2(nodes / degree) + 2.5 bits per entry, each read a short select: all of Reddit's lists in 17% of its int64 CSC bytes; needs lists sorted by id, else packed) or packed (the fewest bits per id, e.g. 18)")

    @field_validator("pool_overlap", mode="before")
    @classmethod
    def _yaml_off(cls, v: object) -> object:
        """YAML reads a bare ``off`` as false (and ``on`` as true)."""
        return {False: "off", True: "hidden"}.get(v, v) if isinstance(v, bool) else v

    @model_validator(mode="after")
    def _check_fanouts(self) -> SamplingConfig:
        if not self.fanouts:
            raise ValueError("fanouts must name at least one hop")
        bad = [k for k in self.fanouts if k == 0 or k < -1]
        if bad:
            raise ValueError(f"fanouts must be positive or -1 (all), got {bad}")
        return self


class BatchingConfig(_Section):
    """The request batcher."""

    max_batch_nodes: int = Field(4096, ge=1, description="most seed nodes in one batch (the cost "
                                 "model caps each batch further by its oldest deadline)")
    max_delay_ms: float = Field(2.0, ge=0, description="longest wait after a batch's first request")
    queue_capacity: int = Field(4096, ge=1, description="bound of every internal queue (requests or batches)")
    adaptive: bool = Field(
        True, description="send a batch at once when nothing is queued downstream (else wait max_delay_ms)"
    )
    expected_fill: bool | Literal["auto"] = Field(
        "auto", description="an engine core holds a batch that would carry far fewer ids than are usually in the system until the callers expected back have sent theirs (engine/core/fill.py: merges closed-loop callers that come back together); auto: on for engine cores on a CPU (a batch's time grows with its size), off on a GPU (a batch's host time is fixed, and callers behind front-ends come back at spread times)")


class InferenceConfig(_Section):
    """Inference workers."""

    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="cuda when available (auto)")
    num_workers: int = Field(0, ge=0, description="inference processes; 0 = one per GPU, or one on CPU")
    torch_threads: int = Field(1, ge=1, description="intra-op threads per inference worker")
    startup_threads: int = Field(0, ge=0, description="intra-op threads of an engine core's start-up (feature copies and placement, PSGS, FAP); 0 = every core the process may run on; serving then uses torch_threads")
    switch_interval_ms: float = Field(5.0, gt=0, le=100, description="the interpreter's switch interval (sys.setswitchinterval) in engine cores and the daemon's main process: how long a thread back from a wait (a socket, a CUDA stream, an fsync) may wait for the interpreter lock while another thread runs Python (the refresh, the update planner, the compactor); 5 is CPython's default, and 0.5 measured 15-20% less capacity on the H200 (docs/decisions/0058-switch-interval.md)")
    gpu_cache_bytes: int = Field(
        4 << 30, ge=0,
        description="GPU memory for node features per GPU (rows and location map): the hottest rows by features.placement go there, the rest are read from pinned host memory",
    )
    engine_spin_ms: float = Field(
        2.0, ge=0, le=100,
        description="an engine core polls its sockets without sleeping for this long after it last answered (saves the wake-up of a sleeping process on the next request, ~0.05 ms; costs a core while requests keep coming); 0: sleep at once",
    )
    cuda_graph_max_seeds: int = Field(
        64, ge=0,
        description="sampled batches up to this many seeds replay a CUDA graph of gather + model (0: always eager)",
    )
    fast_model: bool = Field(
        True, description="serve GraphSAGE/GCN/GAT with the fast layers (CSR aggregation, transform-then-aggregate, per-layer trimming; on a typed graph, SAGEConv without propagate and the relations into a type in one product); false: PyG's own layers",
    )
    typed_cpu_max_seeds: int = Field(
        -1, ge=-1,
        description="typed graphs on a GPU: sampled batches of up to this many seeds are sampled and computed wholly on the CPU (a copy of the model there), where a small batch costs less host time than the GPU path's launches; -1: the largest warm-up batch size the CPU measured faster at start; 0: never",
    )
    precision: Literal["fp32", "tf32", "bf16", "fp16"] = Field(
        "fp32", description="sampled-mode compute precision (weights and activations; tf32: TF32 matmuls); exact mode always runs fp32",
    )


class FeaturesConfig(_Section):
    """Feature store (docs/architecture.md, "Feature store"): which rows go to GPU memory
    (``inference.gpu_cache_bytes`` per GPU)."""

    placement: Literal["fap", "degree"] = Field(
        "fap", description="rank rows by feature access probability (fap) or by in-degree (degree, torch-quiver's serving order)")
    policy: Literal["replicate", "partition"] = Field(
        "replicate", description="replicate: every GPU caches the same hottest rows; partition: GPUs with peer access split a larger hot set (one process driving them; engine cores per GPU fall back to replicate)")
    storage_dtype: Literal["fp32", "fp16", "bf16"] = Field(
        "fp32", description="precision features are stored and moved in (fp16/bf16 halve the bytes; exact mode computes in fp32 from the stored values)")
    fap_batch_size: int = Field(
        1024, ge=1, description="seeds per batch assumed by the uniform seed distribution of FAP")
    request_log_size: int = Field(
        1_000_000, ge=0, description="requested ids remembered per engine core (ring buffer): the seed distribution of a re-placement")
    numa_shards: bool = Field(
        True, description="host rows in one shard per NUMA node when the system has several (else the shared matrix in place)")


class ExactConfig(_Section):
    """The exact table (docs/architecture.md, "The exact table"): every node's exact embedding
    materialised and kept fresh."""

    materialize: Literal["auto", "on", "off"] = Field(
        "auto", description="materialise the exact table at start-up and answer exact requests from it: on; off; auto = on when the table fits gpu_bytes (GPU) or host_bytes")
    gpu_bytes: int = Field(
        8 << 30, ge=0, description="most bytes of table (every layer's output, fp32) in GPU memory per engine core; a larger table lives in pinned host memory")
    host_bytes: int = Field(
        8 << 30, ge=0, description="most bytes of table in host memory per engine core when it is not in GPU memory (auto: off above it)")
    chunk_edges: int = Field(
        1 << 23, ge=1024, description="in-edges per materialisation or refresh chunk (bounds the chunk's memory and its time on the device)")
    snapshot: bool = Field(
        True, description="save the start-up table beside the graph's update log and map it at the next start with the same model weights and base graph (rows the log changed since are refreshed), instead of computing it")
    refresh_chunk_edges: int = Field(
        1 << 20, ge=1024, description="in-edges per refresh chunk: a serving batch waits behind at most one chunk on the device (chunk_edges bounds the start-up build's)")
    refresh_duty: float = Field(
        0.5, gt=0, le=1.0, description="most share of time a refresh round computes: after each chunk it leaves the device and the interpreter to serving for the chunk's time x (1 - duty) / duty (1: no pause)")
    quiet_wait_ms: float = Field(
        50.0, ge=0, le=60000, description="background table work (a refresh chunk; a step of a new model version's table build) runs when the engine loop is quiet (nothing waiting, sampling or in flight); after waiting this long for a quiet loop it runs anyway, so the table progresses under a load that never leaves the loop quiet (docs/decisions/0068-quiet-gate.md)")
    refresh_interval_ms: float = Field(
        5.0, ge=0, description="a refresh round starts at most this often, so changes arriving together are refreshed together")
    stale_rows: Literal["auto", "on_the_fly", "wait"] = Field(
        "auto", description="an exact request naming a row an update changed and the refresh has not recomputed yet: on_the_fly = computed at once on the full neighbourhood (exact, but every neighbour of every hop: seconds on dense graphs); wait = answered from the table when the refresh round ends (the engine core applies updates only between rounds, so rounds end clean); auto = wait while more than full_recompute_fraction of the rows are stale, else on_the_fly")
    full_recompute_fraction: float = Field(
        0.25, gt=0, le=1.0, description="a layer whose dirty rows exceed this fraction of the nodes is recomputed whole")

    @field_validator("materialize", mode="before")
    @classmethod
    def _yaml_on_off(cls, v: object) -> object:
        """YAML reads a bare ``on`` as true and ``off`` as false."""
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


class GrpcLimitsConfig(_Section):
    """Per-connection abuse limits of the gRPC port's HTTP/2 (decision 0036): past one, the
    connection gets GOAWAY ENHANCE_YOUR_CALM and is closed. Counts run per window_s."""

    window_s: float = Field(10.0, gt=0, le=3600, description="the window the per-window counts below run over (each connection's own)")
    max_concurrent_streams: int = Field(1024, ge=1, le=1 << 20, description="streams one connection may have open at once (advertised in SETTINGS; a stream past it is refused REFUSED_STREAM)")
    max_resets: int = Field(100, ge=1, description="streams the client resets (RST_STREAM) per window, past which the connection ends when they are also over reset_ratio of the streams it opened in the window (rapid reset, CVE-2023-44487)")
    reset_ratio: float = Field(0.5, ge=0, le=1, description="share of the window's opened streams the client may reset once past max_resets")
    max_settings: int = Field(100, ge=1, description="SETTINGS frames (not ACKs) per window")
    max_pings: int = Field(500, ge=1, description="PING frames (not ACKs) per window")
    max_window_updates: int = Field(1000, ge=1, description="WINDOW_UPDATE frames per window beyond two per DATA frame this side sent in it")
    max_priority_frames: int = Field(1000, ge=1, description="PRIORITY frames per window")
    max_empty_frames: int = Field(100, ge=1, description="frames that carry nothing, per window: DATA without payload or END_STREAM, CONTINUATION without payload or END_HEADERS, frames of unknown types")
    max_continuations: int = Field(16, ge=1, description="CONTINUATION frames in one header block (its bytes are bounded apart: 64 KiB)")
    max_queued_acks: int = Field(1000, ge=1, description="PING and SETTINGS ACKs and stream refusals queued while the client does not read (the transport is full)")


class ServerConfig(_Section):
    """HTTP front-end and admission limits."""

    @model_validator(mode="before")
    @classmethod
    def _retired_keys(cls, data: Any) -> Any:
        """``fast_routes`` is accepted and ignored, with a warning: the hot routes have one
        answering path, in the HTTP protocol (docs/decisions/0037-one-answering-path.md)."""
        if isinstance(data, Mapping) and "fast_routes" in data:
            logging.getLogger(__name__).warning(
                "server.fast_routes is deprecated and ignored: the hot routes are always "
                "answered in the HTTP protocol (docs/decisions/0037-one-answering-path.md); "
                "remove it from the config")
            data = {k: v for k, v in data.items() if k != "fast_routes"}
        return data

    host: str = Field("127.0.0.1", description="bind address (loopback unless configured)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port")
    http_workers: int = Field(
        0, ge=0, le=64,
        description="HTTP front-end processes sharing server.port (SO_REUSEPORT), each a client of every engine core; 0 = max(1, min(8, CPUs // 2)); 1 = one front-end inside the main process; a mostly-JSON deployment on 16+ vCPUs gains from 12 (decision 0032)")
    grpc_port: int | None = Field(
        None, ge=0, le=65535,
        description="KServe v2 gRPC port on the same host (Triton's default is 8001); null: no gRPC endpoint")
    grpc_limits: GrpcLimitsConfig = Field(
        default_factory=GrpcLimitsConfig, description="per-connection abuse limits of the gRPC port (decision 0036)")
    max_request_nodes: int = Field(4096, ge=1, description="most node ids in one request (else 413)")
    max_pending_requests: int = Field(2048, ge=1, description="admitted requests not yet answered (else 503)")
    request_timeout_s: float = Field(10.0, gt=0, description="deadline of a request (else 504)")
    start_timeout_s: float = Field(300.0, gt=0, description="longest wait for workers to become ready")
    start_failure_limit: int = Field(
        5, ge=1, description="a child process (engine core, CPU sampler, HTTP front-end) that dies this many times in a row before it becomes ready stops the daemon (exit 1, one line naming it and its error); restarts in between wait 1, 2, 4, ... s (at most 30 s)")
    drain_timeout_s: float = Field(10.0, ge=0, description="time in-flight work gets on shutdown")
    retry_after_s: int = Field(1, ge=0, description="Retry-After header value on 503/429")
    overload_status: Literal[503, 429] = Field(
        503, description="status when queues are full (503, or 429 for clients that back off on it)"
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest request body accepted (else 413)")
    standby_processes: int = Field(
        1, ge=0, le=8, description="warm spare processes (torch and PyG imported) each supervisor keeps; a restarted engine core, sampler or HTTP front-end takes one instead of a fresh interpreter's imports (2-6 s); 0: spawn fresh")
    spawn_early: bool = Field(
        True, description="spawn the engine cores' interpreters as the daemon starts, so their imports of torch and PyG (5-15 s on a loaded or cold host) run beside its own start-up (reading the config, mapping the graph, replaying the log); each then takes its work as a standby does")
    gc_freeze: bool = Field(
        True, description="freeze each daemon process's start-up heap (gc.freeze) so a full garbage collection under load takes microseconds, not ~100 ms; pauses are in quiver_serve_gc_pause_seconds")
    auth_token: str | None = Field(
        None, description="bearer token required on every endpoint but liveness; env QUIVER_SERVE_TOKEN overrides"
    )
    admin_token: str | None = Field(
        None, description="bearer token of the admin routes (graph updates, compaction, feature re-placement, the model repository); null: those answer loopback clients only; env QUIVER_SERVE_ADMIN_TOKEN overrides")


def resolve_http_workers(configured: int, cpus: int | None = None) -> int:
    """``server.http_workers``, with 0 resolved from the CPUs this process may use: half of
    them, 1 to 8 (a front-end parses, validates and encodes, about half a core at full load; the
    engine cores and the CPU sampler pool need the rest; 8 front-ends served 27% more than 4 on
    16 vCPUs, docs/decisions/0029-front-door-hot-path.md)."""
    if configured > 0:
        return configured
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cpus // 2))


class PartitionConfig(_Section):
    """Partitioning a graph offline (docs/architecture.md, "Partitioning";
    ``python -m quiver_serve.partition --parts P --out DIR``)."""

    method: Literal["auto", "metis", "ldg", "range", "hash"] = Field(
        "auto", description="who owns each node: METIS k-way (balanced on nodes and in-edges, the smallest edge cut), ldg (streaming greedy over the in-edge lists, no copy of the graph), contiguous id ranges balanced on nodes and in-edges, hash of the id, or auto (metis up to metis_max_edges, fallback above)")
    metis_max_edges: int = Field(
        200_000_000, ge=1, description="method auto: the most in-edges partitioned by METIS (pymetis and METIS took about 260 bytes per in-edge above the graph: 200 M edges need about 52 GB; docs/decisions/0042-partitioning.md)")
    fallback: Literal["ldg", "range", "hash"] = Field(
        "ldg", description="method auto: the method above metis_max_edges")
    hot_budget_mb: float = Field(
        256.0, ge=0, description="per partition: MB of other partitions' float32 feature rows replicated there, the likeliest read by its requests (FAP under sampling.fanouts)")
    seed: int = Field(0, description="seed of METIS and of hash")


class PartitionedConfig(_Section):
    """A graph partitioned across partition servers on a Ray cluster (docs/architecture.md,
    "Partitioned serving"; ``python -m quiver_serve.scaleout.ray_serve --partitions P``)."""

    remote_timeout_s: float = Field(
        2.0, gt=0, le=60, description="longest wait for one call between partition servers (a sampling hop or a feature batch); past it the partition counts as unavailable and the request is answered 503 with Retry-After")
    rows_ride_max_seeds: int = Field(
        16, ge=0, le=1 << 20, description="a batch of at most this many seeds has its feature rows ride with the sampling calls' answers: a peer drawing a hop for it also sends the rows of the ids it drew from and, at the last hop, of the neighbours it drew that it owns (less the rows replicated here), and the rows the last hop's own draws name are asked for at once, so no rows call waits for the sampling (decision 0070; one network round less per request, more work per call: measured worth it for small batches only); 0: never")
    transport_delay_ms: float = Field(
        0.0, ge=0, le=1000, description="delay added before every call between partition servers (tests and benches: a slower network)")
    transport: Literal["wire", "ray"] = Field(
        "wire", description="how partition servers call each other: wire (ZeroMQ, raw array frames, decision 0001) or ray (actor calls through the object store); decision 0045")
    down_s: float = Field(
        1.0, ge=0, le=60, description="after a call to a partition failed, requests needing it are answered 503 at once for this long (then the next request tries it again)")
    max_ongoing_requests: int = Field(
        256, ge=1, le=65536, description="requests one partition server works on at once; past it 503 overloaded")
    device_bytes: int = Field(
        32 << 30, ge=0, description="GPU memory a partition server on a GPU fills with its partition's data, in this order while it fits: the in-edge lists (local hops drawn there), the replicated hot rows, its own feature rows (gathered there); the rest stays in host memory (decision 0054)")


class ServeConfig(_Section):
    """Everything the daemon needs; sections map to YAML top-level keys."""

    graph: GraphConfig = Field(default_factory=GraphConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    models: ModelsConfig = Field(default_factory=ModelsConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    features: FeaturesConfig = Field(default_factory=FeaturesConfig)
    exact: ExactConfig = Field(default_factory=ExactConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    partition: PartitionConfig = Field(default_factory=PartitionConfig)
    partitioned: PartitionedConfig = Field(default_factory=PartitionedConfig)

    @model_validator(mode="after")
    def _check_layers(self) -> ServeConfig:
        if self.models.repository is None and len(self.sampling.fanouts) != self.model.num_layers:
            raise ValueError(
                f"sampling.fanouts has {len(self.sampling.fanouts)} hops but model.kwargs.num_layers "
                f"is {self.model.num_layers}: they must match (one hop per layer)"
            )
        if self.sampling.route == "cpu" and self.sampling.num_cpu_workers == 0:
            raise ValueError("sampling.route=cpu needs sampling.num_cpu_workers >= 1 (use local "
                             "to sample inside the engine core)")
        if self.sampling.route == "gpu" and self.inference.device == "cpu":
            raise ValueError("sampling.route=gpu needs inference.device auto or cuda")
        return self

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> ServeConfig:
        """Load and validate a YAML file; errors name the file and the field."""
        path = Path(path)
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read config: {exc}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        anchor_paths(raw, path.absolute().parent)  # a mounted file's folder, links not followed
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            lines = [
                f"  {'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
                for err in exc.errors()
            ]
            raise ConfigError(f"{path}: invalid config\n" + "\n".join(lines)) from None

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None,
             environ: Mapping[str, str] | None = None) -> ServeConfig:
        """The config a deployment asks for: the YAML named by ``path``, else by
        ``QUIVER_SERVE_CONFIG``, else the embedded default; then every
        ``QUIVER_SERVE__<SECTION>__<KEY>=<YAML value>`` variable applied on top (containers and
        Kubernetes set single fields this way). Unknown sections or keys and invalid values raise
        :class:`ConfigError` naming the variable."""
        path = path or envs.read(CONFIG_ENV, environ) or DEFAULT_CONFIG_PATH
        cfg = cls.from_yaml(path)
        overrides = envs.config_overrides(environ)
        if not overrides:
            return cfg
        raw = cfg.model_dump()
        for name, text in sorted(overrides.items()):
            parts = name[len(OVERRIDE_PREFIX):].lower().split("__")
            if len(parts) != 2 or parts[0] not in raw or parts[1] not in raw[parts[0]]:
                raise ConfigError(f"{name}: no config field {'.'.join(parts)} (use "
                                  f"{OVERRIDE_PREFIX}<SECTION>__<KEY>, e.g. "
                                  f"{OVERRIDE_PREFIX}SERVER__PORT=8080)")
            try:
                raw[parts[0]][parts[1]] = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise ConfigError(f"{name}: not a YAML value: {exc}") from None
        anchor_paths(raw, Path.cwd())
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            lines = [f"  {'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()]
            raise ConfigError("invalid config after environment overrides "
                              f"({', '.join(sorted(overrides))})\n" + "\n".join(lines)) from None

    def with_overrides(self, sets: list[str]) -> ServeConfig:
        """A copy with ``section.key=<YAML value>`` settings applied (benches' ``--set``),
        validated as a whole; a bad name or value raises :class:`ConfigError` naming it."""
        raw = self.model_dump()
        for item in sets:
            name, sep, text = item.partition("=")
            parts = name.strip().split(".")
            if not sep or len(parts) != 2 or parts[0] not in raw or parts[1] not in raw[parts[0]]:
                raise ConfigError(f"--set {item!r}: expected section.key=value with an existing "
                                  "field, e.g. sampling.route=gpu")
            try:
                raw[parts[0]][parts[1]] = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise ConfigError(f"--set {item!r}: not a YAML value: {exc}") from None
        anchor_paths(raw, Path.cwd())
        try:
            return type(self).model_validate(raw)
        except ValidationError as exc:
            lines = [f"  {'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()]
            raise ConfigError(f"invalid config after --set {' '.join(sets)}\n"
                              + "\n".join(lines)) from None

    @classmethod
    def default(cls) -> ServeConfig:
        """The embedded default: Cora and the GraphSAGE trained on it, package data in
        ``paths.DEFAULTS_DIR`` (found through the package, wherever it is installed)."""
        return cls.from_yaml(DEFAULT_CONFIG_PATH)


#: environment (``envs.py``): the YAML file to load, and the prefix of single-field overrides
CONFIG_ENV = "QUIVER_SERVE_CONFIG"
OVERRIDE_PREFIX = envs.OVERRIDE_PREFIX


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and field."""


def reference_markdown() -> str:
    """The config reference (docs/config.md): one table row per field, from the models themselves."""
    lines = ["| key | default | description |", "|---|---|---|"]
    for section_name, section_field in ServeConfig.model_fields.items():
        section = section_field.annotation
        assert isinstance(section, type) and issubclass(section, BaseModel)
        instance = section()
        for name, field in section.model_fields.items():
            default = getattr(instance, name)
            if (section_name, name) in PATH_FIELDS and default is not None:
                default = shown_path(default)
            shown = "(its fields below)" if isinstance(default, BaseModel) else f"`{default!r}`"
            lines.append(f"| `{section_name}.{name}` | {shown} | {field.description} |")
            if isinstance(default, BaseModel):  # a sub-section: one row per field too
                for sub, sub_field in type(default).model_fields.items():
                    lines.append(f"| `{section_name}.{name}.{sub}` | `{getattr(default, sub)!r}` "
                                 f"| {sub_field.description} |")
    return "\n".join(lines)
