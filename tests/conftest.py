"""Shared fixtures."""

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from prodigy_core.data import CIFAR10_CLASSES, CIFAR10_JPEG_ARCHIVE, SHARED_DATA_DIR


def shared_data(path: Path | None, what: str) -> Path:
    """`path` when it exists; otherwise skip with a reason, except under CI=true, where it must be there."""
    if path is not None and path.exists():
        return path
    reason = f"{what} not found"
    if os.environ.get("CI") == "true":
        pytest.fail(reason + " but CI=true requires it")
    pytest.skip(reason)


@pytest.fixture
def femnist_dir() -> Path:
    """The real 10-writer FEMNIST LEAF subset (shared/data/femnist-leaf, or env PRODIGY_FEMNIST_DIR)."""
    named = os.environ.get("PRODIGY_FEMNIST_DIR")
    path = Path(named) if named else SHARED_DATA_DIR / "femnist-leaf"
    return shared_data(path, f"FEMNIST LEAF subset ({path}; or env PRODIGY_FEMNIST_DIR)")


@pytest.fixture
def femnist24_dir() -> Path:
    """The real 24-writer FEMNIST LEAF folder (shared/data/femnist-leaf-24, or env PRODIGY_FEMNIST24_DIR)."""
    named = os.environ.get("PRODIGY_FEMNIST24_DIR")
    path = Path(named) if named else SHARED_DATA_DIR / "femnist-leaf-24"
    return shared_data(path, f"24-writer FEMNIST LEAF folder ({path})")


@pytest.fixture
def cifar10_jpeg_archive() -> Path:
    """The JPEG copy of CIFAR-10 (shared/data/cifar10-jpeg/cifar10-jpeg.tar.gz; env PRODIGY_CIFAR10_JPEG)."""
    named = os.environ.get("PRODIGY_CIFAR10_JPEG")
    path = Path(named) if named else CIFAR10_JPEG_ARCHIVE
    return shared_data(path, f"CIFAR-10 JPEG copy ({path})")


def write_jpeg_folder(root: Path, per_class: int, size: int = 32, classes=CIFAR10_CLASSES) -> Path:
    """The JPEG copy's unpacked layout (train/<class>/NNNN.jpg, test/<class>/NNNN.jpg) of noise images."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for cls in classes:
            (root / split / cls).mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / cls / f"{i:04d}.jpg", quality=75)
    return root


@pytest.fixture
def jpeg_folder() -> Callable[..., Path]:
    """`write_jpeg_folder(root, per_class, size=32, classes=CIFAR-10's)`: a tiny JPEG copy of CIFAR-10."""
    return write_jpeg_folder


@pytest.fixture
def fake_training(monkeypatch) -> list[int]:
    """Training replaced by a valid record whose accuracy is 10 x the seed; returns the seeds it "trained"."""
    from prodigy_core import experiments

    seeds: list[int] = []

    def fake_execute(task, threads=None):
        seeds.append(task.config["seed"])
        return {"config": task.config, "final_accuracy": 10.0 * task.config["seed"], "final_loss": 1.0}

    monkeypatch.setattr(experiments, "execute", fake_execute)
    return seeds


@pytest.fixture(scope="session")
def gpu_run():
    """benchmarks/gpu_run.py as a module (the GPU window driver; test_gpu_run.py, test_autotune.py)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(
        "gpu_run", Path(__file__).parents[1] / "benchmarks" / "gpu_run.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_run"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module
