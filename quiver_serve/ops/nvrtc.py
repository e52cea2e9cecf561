"""The one NVRTC compile path of the project's CUDA sources (CuPy ``RawModule``)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def compile_module(cupy: Any, code: str, arch: int) -> tuple[Any, tuple[str, ...]]:
    """``code`` compiled for ``sm_<arch>`` (the device's own architecture), and the options used.

    CuPy adds its own ``-arch`` for the current device; some NVRTC versions refuse a second one,
    so when ours is rejected this falls back to CuPy's choice (the same architecture)."""
    error: Exception | None = None
    for options in (("--std=c++17", f"-arch=sm_{arch}"), ("--std=c++17",)):
        try:
            module = cupy.RawModule(code=code, options=options)
            module.compile()
            return module, options
        except Exception as exc:  # CompileException, or NVRTCError for the option itself
            log.debug("NVRTC options %s rejected: %s", options, exc)
            error = exc
    assert error is not None
    raise error
