"""The compiled CPU sampler (``quiver_serve/csrc/cpu_sampler.cpp``), JIT-built on first use.

The extension is built once into a stable cache directory (``$QUIVER_SERVE_CACHE/ext/...``, else
``~/.cache/quiver_serve/ext/...``) and later processes load the cached library. When there is no
compiler, the build fails, or ``QUIVER_SERVE_DISABLE_CPP=1`` is set, :func:`cpp_sampler_available`
is False and ``make_cpu_sampler`` serves the pure-torch reference instead, with the same output.

``WITH_CPP_SAMPLER`` (None until a build was attempted, then True/False) and
:func:`cpu_sampler_status` say which implementation is in use and why; read them as
``cpu.WITH_CPP_SAMPLER`` after :func:`cpp_sampler_available`, since the flag changes after import.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import multiprocessing
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from quiver_serve import envs
from quiver_serve.sampling.base import BaseSampler, SamplerOutput, validate_seed

log = logging.getLogger(__name__)

#: names of the variables this module reads (``envs.py``), for messages and tests
DISABLE_ENV = "QUIVER_SERVE_DISABLE_CPP"
CACHE_ENV = "QUIVER_SERVE_CACHE"
SOURCE_PATH = Path(__file__).resolve().parents[1] / "csrc" / "cpu_sampler.cpp"
EXTENSION_NAME = "quiver_serve_cpu_sampler"
# -fopenmp makes at::parallel_for use torch's OpenMP pool (torch's own libgomp is already loaded,
# so the extension binds to it and follows torch.set_num_threads); no -march, so the cached
# binary also runs on other x86-64 hosts that share the cache.
CXX_FLAGS = ["-O3", "-fopenmp", "-std=c++17"]
LD_FLAGS = ["-fopenmp"]
EXPECTED_BUILD_S = 30
# Longest wait for another process's build before giving up (then the reference serves).
BUILD_LOCK_TIMEOUT_S = 300.0

WITH_CPP_SAMPLER: bool | None = None
_build_reason = "not built yet"
_extension: ModuleType | None = None
_build_guard = threading.Lock()


def cpp_sampler_available() -> bool:
    """Whether the C++ sampler can serve; builds (or loads the cached build) on the first call."""
    if envs.QUIVER_SERVE_DISABLE_CPP:
        return False
    return _load_extension() is not None


def cpu_extension() -> ModuleType:
    """The built C++ extension (built or loaded on the first call), or RuntimeError saying why
    there is none."""
    extension = None if envs.QUIVER_SERVE_DISABLE_CPP else _load_extension()
    if extension is None:
        raise RuntimeError(f"C++ sampler unavailable: {cpu_sampler_status()}")
    return extension


def cpu_sampler_status() -> str:
    """Which CPU sampler ``make_cpu_sampler('auto')`` serves, and why (for logs and /v2/models)."""
    if envs.QUIVER_SERVE_DISABLE_CPP:
        return f"reference ({DISABLE_ENV} is set)"
    if WITH_CPP_SAMPLER is None:
        return "unknown (C++ build not attempted yet; call cpp_sampler_available())"
    if WITH_CPP_SAMPLER:
        return f"cpp ({_build_reason}; {torch.get_num_threads()} intra-op threads)"
    return f"reference (C++ sampler unavailable: {_build_reason})"


def extension_build_dir() -> Path:
    """Build directory keyed by torch version, Python version, torch's install path and the
    source file's path.

    The paths are in the key because torch writes them into build.ninja: two environments (or two
    clones of the repository) sharing a directory would each see changed build commands and
    rebuild the other's library every time, each waiting on the other's build lock.
    """
    root = envs.QUIVER_SERVE_CACHE
    # torch's own spelling of its folder (abspath, links kept): a venv reached through a
    # symbolic link writes other paths into build.ninja than the same venv reached directly
    torch_path = os.path.dirname(os.path.abspath(torch.__file__))
    where = f"{torch_path}|{SOURCE_PATH}"
    torch_dir = hashlib.sha1(where.encode()).hexdigest()[:8]
    tag = f"torch{torch.__version__.replace('+', '_')}-py{sys.version_info[0]}{sys.version_info[1]}-{torch_dir}"
    return root / "ext" / tag


def _load_extension() -> ModuleType | None:
    global WITH_CPP_SAMPLER, _build_reason, _extension
    with _build_guard:
        if WITH_CPP_SAMPLER is None:
            try:
                _extension, _build_reason = _build()
                WITH_CPP_SAMPLER = True
                log.info("C++ sampler %s", _build_reason)
            except Exception as exc:  # any build failure means "serve the reference"
                _build_reason = _describe_failure(exc)
                WITH_CPP_SAMPLER = False
                log.warning("C++ sampler unavailable, using the reference sampler: %s", _build_reason)
        return _extension


def _build() -> tuple[ModuleType, str]:
    compiler = envs.CXX
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} not on PATH)")
    if not SOURCE_PATH.exists():
        raise RuntimeError(f"source {SOURCE_PATH} is missing")
    _put_ninja_on_path()
    from torch.utils.cpp_extension import load

    build_dir = extension_build_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    built = build_dir / f"{EXTENSION_NAME}.so"
    t0 = time.perf_counter()
    with _process_build_lock(build_dir):
        # Checked under the lock: a process that waited for another's build finds it done.
        fresh = not built.exists() or built.stat().st_mtime < SOURCE_PATH.stat().st_mtime
        if fresh:
            _announce(f"compiling C++ sampler (first use, ~{EXPECTED_BUILD_S} s) in {build_dir}...")
        module = load(name=EXTENSION_NAME, sources=[str(SOURCE_PATH)], extra_cflags=CXX_FLAGS,
                      extra_ldflags=LD_FLAGS, build_directory=str(build_dir), verbose=False)
    elapsed_s = time.perf_counter() - t0
    return module, f"{'built' if fresh else 'loaded'} in {elapsed_s:.1f} s from {build_dir}"


def _put_ninja_on_path() -> None:
    """torch's JIT build runs ``ninja`` from PATH; the ``ninja`` wheel (a dependency) installs it
    into the environment's bin folder, which is not on PATH when the venv is not activated."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja  # type: ignore[import-untyped]
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@contextlib.contextmanager
def _process_build_lock(build_dir: Path) -> Iterator[None]:
    """An flock around torch's ``load``.

    torch guards concurrent builds with an O_EXCL lock file, which a build killed midway leaves
    behind, and later loads then wait on it forever. The kernel drops an flock when its holder
    dies, so while we hold it any torch lock file left in the directory is stale and removable.
    """
    fd = os.open(build_dir / "quiver_serve.flock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        t0 = time.monotonic()
        announced = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited_s = time.monotonic() - t0
                if waited_s > BUILD_LOCK_TIMEOUT_S:
                    raise TimeoutError(f"another process held the build lock in {build_dir} "
                                       f"for {BUILD_LOCK_TIMEOUT_S:.0f} s") from None
                parent = multiprocessing.parent_process()
                if parent is not None and not parent.is_alive():  # never outlive the daemon
                    raise RuntimeError("the parent process is gone; not waiting for the build") from None
                if waited_s > 1.0 and not announced:  # loading a cached build takes well under 1 s
                    _announce(f"waiting for another process's C++ sampler build in {build_dir}...")
                    announced = True
                time.sleep(0.1)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing stale torch build lock %s (its builder died)", stale)
            stale.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # also releases the flock


def _announce(message: str) -> None:
    # Printed, not only logged: a first request that stalls for a build should say why, even
    # in a process that configured no logging.
    print(f"quiver_serve: {message}", file=sys.stderr, flush=True)


def _describe_failure(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # torch's message ends with the whole compiler log; its first "error:" line is the cause.
    errors = [line for line in lines if "error:" in line]
    detail = errors[0] if errors else (lines[-1] if lines else "")
    return f"{type(exc).__name__}: {detail}"[:500]


def _check_graph_tensor(name: str, t: Tensor) -> None:
    if t.device.type != "cpu" or t.dtype != torch.int64 or t.dim() != 1:
        raise TypeError(f"{name} must be a 1-D int64 CPU tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if not t.is_contiguous():
        # A copy would give every worker a private graph; make the caller fix it once instead.
        raise ValueError(f"{name} must be contiguous (it is read in place from shared memory)")


class CppSampler(BaseSampler):
    """Sampling (docs/architecture.md, "Sampling") in C++, parallel over the frontier with torch's
    intra-op threads.

    Same output as :class:`~quiver_serve.sampling.reference.ReferenceSampler`, bit for bit, for any
    ``torch.set_num_threads``. The graph tensors are read in place (never copied), so workers
    that map one shared-memory CSC add no copy of it; so are an overlay's (``set_overlay``: CPU
    tensors, e.g. ``torch.from_numpy`` of the owner's arrays).
    """

    name = "cpp"

    def __init__(self, indptr: Tensor, indices: Tensor) -> None:
        _check_graph_tensor("indptr", indptr)
        _check_graph_tensor("indices", indices)
        if indptr.numel() < 1 or int(indptr[-1]) != indices.numel():
            raise ValueError(f"indptr[-1] must equal indices.numel()={indices.numel()}")
        extension = _load_extension()
        if extension is None:
            raise RuntimeError(f"C++ sampler unavailable: {_build_reason}")
        super().__init__(indptr, indices)
        self._sample_neighbors = extension.sample_neighbors

    def __reduce__(self) -> tuple[type[CppSampler], tuple[Tensor, Tensor]]:
        # The bound extension function does not pickle; a spawned worker rebuilds the sampler,
        # loading the cached extension, around the same (shared-memory) tensors. The overlay is
        # not carried: its owner sets it on the rebuilt sampler.
        return CppSampler, (self.indptr, self.indices)

    def sample(self, seeds: Tensor, fanouts: list[int], seed: int) -> SamplerOutput:
        view = self.overlay
        overlay = () if view is None else (view.start, view.length, view.tail, view.n_base,
                                           view.num_nodes)
        n_id, edge_index, seed_index, num_nodes, num_edges = self._sample_neighbors(
            self.indptr, self.indices, seeds.to(torch.int64), [int(k) for k in fanouts],
            validate_seed(int(seed)), *overlay,
        )
        return SamplerOutput(n_id, edge_index, seed_index, list(num_nodes), list(num_edges))
