"""Seeding and determinism: one call makes a run repeatable."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator

import numpy as np
import torch

from prodigy_core.names import PRECISIONS


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


def precision_flags(device: torch.device | None = None) -> dict[str, bool | str]:
    """The settings in force that change a run's rounding or its kernels' choice, as recorded in every
    record's `environment`: bfloat16 autocast (``autocast``: "bfloat16" or "off"), whether oneDNN (mkldnn)
    kernels are on and their float32 matmul precision (both settable by the caller: oneDNN off changes the
    convolutions' kernels, `torch.set_float32_matmul_precision("medium")` runs a CPU's matmuls in bfloat16)
    and, on CUDA (or with no device given), TF32 for matmuls and convolutions, cuDNN's autotuner,
    deterministic algorithms."""
    device_type = "cuda" if device is None else device.type
    autocast = torch.is_autocast_enabled(device_type)
    flags: dict[str, bool | str] = {"autocast": str(torch.get_autocast_dtype(device_type)).removeprefix(
        "torch.") if autocast else "off", "mkldnn": torch.backends.mkldnn.enabled,
        "mkldnn_matmul": _mkldnn_matmul_precision()}  # fmt: skip
    if device_type == "cuda":
        flags.update({"tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
                      "tf32_cudnn": torch.backends.cudnn.allow_tf32,
                      "cudnn_benchmark": torch.backends.cudnn.benchmark,
                      "deterministic": torch.are_deterministic_algorithms_enabled()})  # fmt: skip
    return flags


def _mkldnn_matmul_precision() -> str:
    """oneDNN's float32 matmul precision ("ieee", "bf16" or "tf32"), read from its own backend: torch's global
    reading raises once the CUDA flags were set the legacy way (`precision_mode`) after the new way."""
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    if matmul is None or not hasattr(matmul, "fp32_precision"):  # a torch before the per-backend settings
        return {"highest": "ieee", "high": "tf32", "medium": "bf16"}[torch.get_float32_matmul_precision()]
    return "ieee" if matmul.fp32_precision == "none" else str(matmul.fp32_precision)  # none: not set


@contextlib.contextmanager
def precision_mode(precision: str, device: torch.device) -> Iterator[None]:
    """A run's `precision` (config.PRECISIONS) in force inside the block; every flag restored after it.

    - ``fp32``: full float32. On CUDA: TF32 off, deterministic kernels, cuDNN's autotuner off (bitwise
      reruns on one machine). On a CPU nothing changes (its kernels are float32 and deterministic).
    - ``tf32`` (CUDA only): TF32 for convolutions and matmuls (10 mantissa bits in their inputs), kernels
      chosen for speed: deterministic algorithms off, cuDNN's autotuner on.
    - ``bf16``: the block under bfloat16 autocast (CUDA, or CPU autocast on a CPU): convolutions and matmuls
      in bfloat16, the parameters, their gradients, the optimizer state and BatchNorm (`FloatBatchNorm`) in
      float32; on CUDA TF32 off and kernels chosen for speed as for tf32.

    The aggregation rules do not run inside it (and force their own float32/float64 Gram passes anyway).
    Raises ValueError for tf32 on a device other than CUDA (`training.start_run` raises it as ConfigError)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is unknown; valid: {', '.join(PRECISIONS)}")
    if precision == "tf32" and device.type != "cuda":
        raise ValueError(
            f"precision=tf32 exists only on CUDA and this run is on {device.type}: use precision=fp32 or bf16"
        )
    with contextlib.ExitStack() as stack:
        if device.type == "cuda":
            saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                     torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
                     torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled())  # fmt: skip
            stack.callback(_restore_cuda_flags, saved)
            tf32 = precision == "tf32"
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
            set_deterministic(precision == "fp32")
        if precision == "bf16":  # no cast cache: the sequential engine updates its weights in place
            stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False))
        yield


def _restore_cuda_flags(saved: tuple[bool, ...]) -> None:
    matmul, cudnn, benchmark, cudnn_deterministic, deterministic, warn_only = saved
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = benchmark, cudnn_deterministic
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


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
