"""Which device the inference workers use, and how many there are."""

from __future__ import annotations

import torch

from quiver_serve.config import ServeConfig


def cuda_usable() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:  # noqa: BLE001 - a broken driver means CPU
        return False


def inference_on_gpu(cfg: ServeConfig) -> bool:
    if cfg.inference.device == "cuda":
        if not cuda_usable():
            raise RuntimeError("inference.device=cuda but no CUDA device is available")
        return True
    return cfg.inference.device == "auto" and cuda_usable()


def num_inference_workers(cfg: ServeConfig) -> int:
    """Configured count, or one per GPU, or one on a CPU-only machine."""
    if cfg.inference.num_workers:
        return cfg.inference.num_workers
    return torch.cuda.device_count() if inference_on_gpu(cfg) else 1


def worker_device(cfg: ServeConfig, index: int) -> torch.device:
    if inference_on_gpu(cfg):
        return torch.device("cuda", index % torch.cuda.device_count())
    return torch.device("cpu")
