"""Seeding and determinism: one call makes a run repeatable."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def seed_everything(seed: int) -> torch.Generator:
    """Seed python's `random`, numpy and torch (CPU and every CUDA device); return a torch Generator
    seeded with the same value for code that wants an explicit stream."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return torch.Generator().manual_seed(seed)


def set_deterministic(enabled: bool = True) -> None:
    """Make torch pick deterministic kernels (bit-identical reruns on the same machine and torch version).

    On a CPU, torch's kernels are already deterministic for a fixed thread count, so this mostly matters on
    CUDA, where it also disables cuDNN autotuning and requires CUBLAS_WORKSPACE_CONFIG. Deterministic kernels
    can be slower; leave it off for paper-scale sweeps, on for tests and debugging. Kernels with no
    deterministic version only warn instead of raising.
    """
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=True)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = not enabled


def precision_flags() -> dict[str, bool]:
    """The settings that change a CUDA run's rounding or its kernels' choice, as recorded in every CUDA run's
    `environment`: TF32 for matmuls and convolutions, cuDNN's autotuner, deterministic algorithms."""
    return {"tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "tf32_cudnn": torch.backends.cudnn.allow_tf32, "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "deterministic": torch.are_deterministic_algorithms_enabled()}  # fmt: skip


def resolve_device(device: str = "auto") -> torch.device:
    """`auto` picks CUDA when available, else CPU; other names go to torch.device, with a clear error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(
            f"device={device!r} is not a torch device ({e}); use 'auto', 'cpu' or 'cuda'"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} requested but CUDA is not available here; use device='auto' or 'cpu'"
        )
    return dev
