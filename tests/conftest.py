"""Shared fixtures."""

import contextlib
import importlib
import os
import shutil
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from prodigy_core.data import CIFAR10_CLASSES, CIFAR10_JPEG_ARCHIVE, SHARED_DATA_DIR


def missing(reason: str) -> NoReturn:
    """Skip for `reason`; under CI=true, which installs and provides everything the tests need, fail."""
    if os.environ.get("CI") == "true":
        pytest.fail(reason + ", but CI=true requires it")
    pytest.skip(reason)


def shared_data(path: Path | None, what: str) -> Path:
    """`path` when it exists; otherwise skip with a reason, except under CI=true, where it must be there."""
    if path is not None and path.exists():
        return path
    missing(f"{what} not found")


@pytest.fixture(scope="session")
def optional_import() -> Callable[[str, str], ModuleType]:
    """``optional_import(module, extra)``: an optional dependency, imported; `missing` when it is not
    installed (CI installs every extra whose tests it runs)."""

    def load(module: str, extra: str) -> ModuleType:
        try:
            return importlib.import_module(module)
        except ImportError as e:
            missing(f"needs {module}, from the {extra} extra (pip install -e '.[{extra}]'): {e}")

    return load


@pytest.fixture(scope="module")
def flower_extra(optional_import) -> ModuleType:
    """flwr, for the Flower tests (`missing` without the flower extra); module-scoped, so that a module
    fixture that imports `prodigy_core.flower` can ask for it first."""
    return optional_import("flwr", "flower")


@pytest.fixture(scope="session")
def git_installed() -> str:
    """The git executable, for the tests of what the package does to a clone (`missing` without it)."""
    return shutil.which("git") or missing("git is not installed")


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
def paper_reference_csv() -> Path:
    """The paper's 515 numbers as the project keeps them (shared/reference/paper_results.csv)."""
    path = SHARED_DATA_DIR.parent / "reference" / "paper_results.csv"
    return shared_data(path, f"the paper's numbers ({path})")


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


class _Accelerator(TorchDispatchMode):
    """An accelerator emulated on the CPU, to count the waits for it that a call would make: the input and
    everything computed from it (or written into by it) live "on the device" until ``Tensor.cpu`` (patched
    by `on_accelerator` to copy) brings a copy to the host. A wait is that copy, or a value read to the host
    (``item``, ``bool``, ``tolist``, ``nonzero``, a boolean-mask index) from a tensor on the device."""

    READS = {"_local_scalar_dense", "is_nonzero", "nonzero", "item"}

    def __init__(self):
        super().__init__()
        self.on_device: set[int] = set()
        self.waits = 0
        self.kernels = 0  # ops on the device other than views
        self.host_ops = 0  # ops on the host (views included: each costs a dispatch there)

    def place(self, t: torch.Tensor) -> None:
        if id(t) not in self.on_device:
            self.on_device.add(id(t))
            weakref.finalize(t, self.on_device.discard, id(t))

    def holds(self, t: object) -> bool:
        """t, or the tensor it is a view of, is on the device."""
        return isinstance(t, torch.Tensor) and (id(t) in self.on_device or id(t._base) in self.on_device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        device = any(self.holds(t) for t in inputs)
        indices = args[1] if name in ("index", "index_put", "index_put_", "_index_put_impl_") else []
        masks = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)  # nonzero inside
        self.waits += device and (name in self.READS or masks)
        view = not func._schema.is_mutable and any(r.alias_info is not None for r in func._schema.returns)
        self.kernels += device and not view
        self.host_ops += not device
        out = func(*args, **kwargs)
        if device:
            for t in torch.utils._pytree.tree_leaves(out) + list(self._written(func, args, kwargs)):
                if isinstance(t, torch.Tensor):
                    self.place(t if t._base is None else t._base)  # K[:N, :N].add_(...) writes into K
        return out

    @staticmethod
    def _written(func, args, kwargs):
        """The tensors an op writes into: in place (add_) or through out= (torch.sub(..., out=Y))."""
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                yield kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]


@pytest.fixture
def on_accelerator(monkeypatch) -> Callable[..., contextlib.AbstractContextManager[_Accelerator]]:
    """``with on_accelerator(*tensors) as accelerator``: those tensors, and everything computed from them,
    live on an accelerator emulated on the CPU (`_Accelerator`), which counts the waits for it."""
    accelerator = _Accelerator()

    def to_host(t: torch.Tensor) -> torch.Tensor:
        accelerator.waits += accelerator.holds(t)
        copy = t.clone()
        accelerator.on_device.discard(id(copy))
        return copy

    def read(t: torch.Tensor) -> list:
        accelerator.waits += accelerator.holds(t)
        return torch._C.TensorBase.tolist(t)

    @contextlib.contextmanager
    def on(*tensors: torch.Tensor) -> Iterator[_Accelerator]:
        monkeypatch.setattr(torch.Tensor, "cpu", to_host)
        monkeypatch.setattr(torch.Tensor, "tolist", read)
        with accelerator:
            for t in tensors:
                accelerator.place(t)
            yield accelerator

    return on


def load_script(path: str):
    """A script of the repository (``scripts/x.py``, ``benchmarks/x.py``) as a module named after its file,
    registered in sys.modules (dataclasses look their module up there)."""
    import importlib.util
    import sys

    file = Path(__file__).parents[1] / path
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[file.stem] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def scripts():
    """`load_script` for the tests: ``scripts("scripts/alie_z_sensitivity.py")``."""
    return load_script


@pytest.fixture(scope="session")
def gpu_run():
    """benchmarks/gpu_run.py as a module (the GPU window driver; test_gpu_run.py, test_autotune.py)."""
    return load_script("benchmarks/gpu_run.py")


@pytest.fixture(autouse=True)
def _restore_environment():
    """Every test leaves os.environ as it found it: the GPU driver (benchmarks/gpu_run.py, called by
    test_gpu_run.py and test_autotune.py in pytest's process) sets PRODIGY_* variables for its own process."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
