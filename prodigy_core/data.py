"""Federated datasets held on the device: CIFAR-10, FEMNIST (LEAF) and scikit-learn's embedded digits.

A `Federation` keeps the whole training set as one tensor on the device plus one index tensor per client, and
produces the batches of all N clients of one local step at once: an (N, B) index tensor drawn without
replacement within each client, then one gather + batched augmentation + normalisation. No DataLoader and no
per-sample PIL transform in the training loop (design-notes section 2; benchmarks/data.py measures the gain).

Splits (cifar10, digits): `iid` (a seeded random partition into near-equal parts) and `dirichlet` (the
NIID-Bench recipe, `dirichlet_split`). FEMNIST is `natural`: one writer per client. Splits are drawn on the
CPU from a generator seeded with the data seed, so a seed gives the same federation on every device.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from prodigy_core.config import DATASETS, DISTRIBUTIONS
from prodigy_core.seeding import resolve_device

# Default root for downloaded datasets (torchvision's CIFAR-10 folder lives under it); env PRODIGY_DATA_DIR.
DATA_DIR = Path(os.environ.get("PRODIGY_DATA_DIR", Path(__file__).resolve().parents[1] / "data"))

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)  # the paper's normalisation (design-notes section 1)
CIFAR10_STD = (0.2023, 0.1994, 0.2010)
FEMNIST_MEAN, FEMNIST_STD = (0.5,), (0.5,)
FEMNIST_CLASSES = 62
# Pixel mean and population std of all 1,797 bundled digits scaled to [0, 1] (x / 16), computed once and fixed
# so that normalisation does not depend on the seeded train/test split (tests/test_data.py recomputes them).
DIGITS_MEAN, DIGITS_STD = (0.3053,), (0.3760,)
DIGITS_TEST_FRACTION = 0.2
CIFAR_PAD = 4  # random crop 32 with padding 4


class DataError(ValueError):
    """Dataset files missing or malformed; the message says where we looked and how to fix it."""


def default_femnist_dir() -> Path | None:
    """The LEAF FEMNIST directory to use when none is given: env PRODIGY_FEMNIST_DIR, else the shared subset
    `shared/data/femnist-leaf` beside the repository clone; None when neither exists."""
    candidates = []
    if os.environ.get("PRODIGY_FEMNIST_DIR"):
        candidates.append(Path(os.environ["PRODIGY_FEMNIST_DIR"]))
    candidates.append(Path(__file__).resolve().parents[2] / "shared" / "data" / "femnist-leaf")
    return next((p for p in candidates if (p / "train").is_dir()), None)


# ---------------------------------------------------------------------------------------------------------
# Partitions


def iid_split(n: int, n_clients: int, rng: torch.Generator) -> list[Tensor]:
    """A uniformly random partition of range(n) into n_clients parts whose sizes differ by at most one."""
    if not 1 <= n_clients <= n:
        raise ValueError(f"n_clients={n_clients} must be between 1 and the number of samples ({n})")
    perm = torch.randperm(n, generator=rng)
    return [part.sort().values for part in torch.tensor_split(perm, n_clients)]


def dirichlet_split(
    labels: Tensor,
    n_clients: int,
    alpha: float,
    rng: torch.Generator,
    min_size: int = 10,
    max_tries: int = 1000,
) -> list[Tensor]:
    """Label-skewed partition, the NIID-Bench recipe (Li et al., "Federated Learning on Non-IID Data Silos",
    ICDE 2022), used by the paper with alpha = 0.1.

    For each class c: shuffle its samples, draw p ~ Dir_N(alpha), set p_k = 0 for every client k that already
    holds >= n/N samples, renormalise, and cut the class at floor(cumsum(p) * n_c). Redraw the whole split
    until every client has at least `min_size` samples. `rng` is a CPU generator (the split is device-free).
    Dirichlet draws are normalised Gamma(alpha) draws in float64 (torch.distributions takes no generator).
    """
    if not alpha > 0:
        raise ValueError(f"dirichlet_alpha={alpha} must be > 0 (0.1 is the paper's; larger is closer to iid)")
    labels = labels.cpu()
    n = labels.numel()
    if n_clients < 1 or n < n_clients * min_size:
        raise ValueError(
            f"cannot give each of n_clients={n_clients} clients at least {min_size} of {n} samples; "
            f"use fewer clients"
        )
    classes = labels.unique()
    for _ in range(max_tries):
        parts: list[list[Tensor]] = [[] for _ in range(n_clients)]
        sizes = torch.zeros(n_clients, dtype=torch.long)
        for c in classes:
            idx_c = (labels == c).nonzero().flatten()
            idx_c = idx_c[torch.randperm(idx_c.numel(), generator=rng)]
            p = torch._standard_gamma(
                torch.full((n_clients,), float(alpha), dtype=torch.float64), generator=rng
            )
            p = p * (sizes < n / n_clients)
            if p.sum() == 0:  # every open client drew a zero (float underflow): share evenly among them
                p = (sizes < n / n_clients).double()
            cuts = (torch.cumsum(p / p.sum(), 0) * idx_c.numel()).long()[:-1]
            for k, chunk in enumerate(torch.tensor_split(idx_c, cuts)):
                parts[k].append(chunk)
                sizes[k] += chunk.numel()
        if sizes.min() >= min_size:
            return [torch.cat(p).sort().values for p in parts]
    raise ValueError(
        f"dirichlet_split found no split with every client >= {min_size} samples in {max_tries} draws "
        f"(n={n}, n_clients={n_clients}, alpha={alpha}); use a larger alpha or fewer clients"
    )


# ---------------------------------------------------------------------------------------------------------
# The federation


@dataclass
class Federation:
    """A federated dataset on one device.

    `train_images` is uint8 (M, C, H, W) for cifar10 (augmented and normalised per batch) and float in [0, 1]
    for femnist and digits; `test_images` is stored the same raw way, `test_batches` normalises it.
    `client_indices[k]` are client k's rows of `train_images`/`train_labels` (disjoint, int64, on the device).
    """

    name: str
    train_images: Tensor
    train_labels: Tensor
    client_indices: list[Tensor]
    test_images: Tensor
    test_labels: Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: bool = False
    flipped_clients: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._padded: Tensor | None = None  # the zero-padded store for augmentation, made on first use
        sizes = torch.tensor([len(ix) for ix in self.client_indices])
        if len(sizes) == 0 or sizes.min() == 0:
            raise ValueError(f"every client needs at least one sample; client sizes: {sizes.tolist()}")
        self.client_sizes = sizes.to(self.device)
        # (N, largest client) table of client indices, each row padded with its own first index
        table = torch.stack(
            [torch.cat([ix, ix[:1].expand(int(sizes.max()) - len(ix))]) for ix in self.client_indices]
        )
        self._index_table = table.to(self.device)
        # normalise as one fused x * scale + shift, (x / range - mean) / std with range 255 for uint8, else 1
        mean = torch.tensor(self.mean, device=self.device).view(-1, 1, 1)
        std = torch.tensor(self.std, device=self.device).view(-1, 1, 1)
        pixel_range = 255.0 if self.train_images.dtype == torch.uint8 else 1.0
        self._scale, self._shift = 1.0 / (pixel_range * std), -mean / std

    @property
    def device(self) -> torch.device:
        return self.train_images.device

    @property
    def n_clients(self) -> int:
        return len(self.client_indices)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.train_images.shape[1:])

    def generator(self, seed: int) -> torch.Generator:
        """A generator on this federation's device, for `sample_batch` and `train_batch`."""
        return torch.Generator(device=self.device).manual_seed(seed)

    def sample_batch(self, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """One local step's batches of all clients: (idx (N, B) int64, mask (N, B) bool).

        B = min(batch_size, largest client); client k's first b_k = min(batch_size, |client k|) entries are
        distinct samples of its own, uniformly drawn (the b_k smallest of |client k| uniform random keys);
        the rest repeat a valid index of the same client and have mask False.
        """
        n_max = self._index_table.shape[1]
        width = min(batch_size, n_max)
        keys = torch.rand(self.n_clients, n_max, generator=generator, device=self.device)
        keys.masked_fill_(torch.arange(n_max, device=self.device) >= self.client_sizes[:, None], 2.0)
        pos = keys.topk(width, dim=1, largest=False, sorted=True).indices
        mask = torch.arange(width, device=self.device) < self.client_sizes.clamp(max=batch_size)[:, None]
        pos = torch.where(mask, pos, pos[:, :1])
        return self._index_table.gather(1, pos), mask

    def normalise(self, images: Tensor) -> Tensor:
        """Raw images stored like `train_images` (uint8, or float in [0, 1]) -> float32 (x - mean) / std."""
        if images.dtype != self.train_images.dtype:
            raise ValueError(f"normalise expects raw {self.train_images.dtype} images, got {images.dtype}")
        # a fresh copy, then in place: twice as fast as a broadcast addcmul on a CPU, never touching `images`
        return images.to(torch.float32, copy=True).mul_(self._scale).add_(self._shift)

    eval_images = normalise

    def train_batch(self, idx: Tensor, generator: torch.Generator) -> Tensor:
        """Gather the training images at `idx` (any shape), augment them (cifar10) and normalise: idx.shape +
        (C, H, W) float32."""
        if self.augment:
            if self._padded is None:  # padded once, on first use (1.6x the store for CIFAR-10)
                self._padded = pad_images(self.train_images, CIFAR_PAD)
            images = random_crop_flip(self.train_images, CIFAR_PAD, generator, idx, self._padded)
        else:
            images = self.train_images[idx.flatten()]
        return self.normalise(images).view(*idx.shape, *self.image_shape)

    def test_batches(self, batch_size: int = 1000) -> Iterator[tuple[Tensor, Tensor]]:
        """The test set in order, as (normalised images, labels) chunks."""
        for start in range(0, len(self.test_labels), batch_size):
            stop = start + batch_size
            yield self.normalise(self.test_images[start:stop]), self.test_labels[start:stop]

    def flip_labels(self, client_ids: Sequence[int]) -> None:
        """Label flipping (the LF attack): y' = C - 1 - y on the training labels of `client_ids` only.

        Flipping a client twice restores its labels; test labels are never touched."""
        client_ids = sorted(set(client_ids))
        if any(not 0 <= k < self.n_clients for k in client_ids):
            raise ValueError(f"client ids {list(client_ids)} must be in [0, {self.n_clients})")
        if not client_ids:
            return
        rows = torch.cat([self.client_indices[k] for k in client_ids])
        self.train_labels = self.train_labels.clone()  # never write into a tensor the caller may share
        self.train_labels[rows] = self.num_classes - 1 - self.train_labels[rows]
        self.flipped_clients = sorted(set(self.flipped_clients) ^ set(client_ids))


def random_crop_flip(
    images: Tensor,
    pad: int,
    generator: torch.Generator,
    idx: Tensor | None = None,
    padded: Tensor | None = None,
) -> Tensor:
    """torchvision's RandomCrop(H, padding=pad) + RandomHorizontalFlip, batched: images[idx] (all images when
    idx is None), each cropped at its own random offset of its zero-padded self and mirrored with prob. 1/2.

    The zero-padded store (`padded`, `pad_images(images, pad)`; made here when not given) is viewed, without a
    copy, as every image's (2 pad + 1)^2 crop windows; one indexed copy then takes each image's window, and
    the flipped ones are selected from its mirror image.
    """
    m, c, h, w = images.shape
    dev = images.device
    padded = pad_images(images, pad) if padded is None else padded
    hp, wp, k = h + 2 * pad, w + 2 * pad, 2 * pad + 1
    windows = padded.as_strided((m, k, k, c, h, w), (c * hp * wp, wp, 1, hp * wp, wp, 1))
    idx = torch.arange(m, device=dev) if idx is None else idx.flatten()
    n = idx.numel()
    dy = torch.randint(0, k, (n,), generator=generator, device=dev)
    dx = torch.randint(0, k, (n,), generator=generator, device=dev)
    flip = torch.rand(n, generator=generator, device=dev) < 0.5
    out = windows[idx, dy, dx]
    return torch.where(flip[:, None, None, None], out.flip(3), out)  # no boolean indexing: no GPU sync


def pad_images(images: Tensor, pad: int) -> Tensor:
    """The zero-padded (M, C, H + 2 pad, W + 2 pad) contiguous copy of `images` read by random_crop_flip."""
    return torch.nn.functional.pad(images, (pad, pad, pad, pad)).contiguous()


# ---------------------------------------------------------------------------------------------------------
# Loaders


def load_federation(
    name: str,
    n_clients: int,
    distribution: str = "dirichlet",
    dirichlet_alpha: float = 0.1,
    seed: int = 0,
    device: str | torch.device = "cpu",
    data_dir: str | Path | None = None,
    download: bool = False,
    min_samples: int = 0,
) -> Federation:
    """Load dataset `name` and split it among `n_clients` clients (see the module docstring).

    seed is the data seed (split, digits' train/test split). data_dir: the LEAF directory for femnist
    (default `default_femnist_dir()`), torchvision's root for cifar10 (default DATA_DIR), ignored by digits.
    min_samples (femnist): writers with fewer training samples are not eligible as clients.
    """
    if name not in DATASETS:
        raise ValueError(f"dataset={name!r} is unknown; valid: {', '.join(DATASETS)}")
    if distribution not in DISTRIBUTIONS[name]:
        raise ValueError(
            f"distribution={distribution!r} is not valid for {name}; valid: {DISTRIBUTIONS[name]}"
        )
    if distribution == "dirichlet" and not dirichlet_alpha > 0:
        raise ValueError(f"dirichlet_alpha={dirichlet_alpha} must be > 0 (0.1 is the paper's)")
    if n_clients < 1:
        raise ValueError(f"n_clients={n_clients} must be >= 1")
    dev = resolve_device(device) if isinstance(device, str) else device
    rng = torch.Generator().manual_seed(seed)

    if name == "femnist":
        leaf_dir = Path(data_dir) if data_dir else default_femnist_dir()
        train_x, train_y, parts, test_x, test_y = _read_femnist(leaf_dir, n_clients, min_samples)
        num_classes, mean, std, augment = FEMNIST_CLASSES, FEMNIST_MEAN, FEMNIST_STD, False
    else:
        if name == "cifar10":
            train_x, train_y, test_x, test_y = _read_cifar10(
                Path(data_dir) if data_dir else DATA_DIR, download
            )
            num_classes, mean, std, augment = 10, CIFAR10_MEAN, CIFAR10_STD, True
        else:
            train_x, train_y, test_x, test_y = _read_digits(rng)
            num_classes, mean, std, augment = 10, DIGITS_MEAN, DIGITS_STD, False
        if distribution == "iid":
            parts = iid_split(len(train_y), n_clients, rng)
        else:
            parts = dirichlet_split(train_y, n_clients, dirichlet_alpha, rng)
    return Federation(
        name,
        train_x.to(dev),
        train_y.to(dev),
        [ix.to(dev) for ix in parts],
        test_x.to(dev),
        test_y.to(dev),
        num_classes,
        mean,
        std,
        augment,
    )


def _read_digits(rng: torch.Generator) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's bundled 8x8 digits (1,797 images, 10 classes, offline) as float32 (1, 8, 8) in [0, 1],
    with a seeded random 80/20 train/test split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.from_numpy(digits.data).float().div(16.0).view(-1, 1, 8, 8)
    labels = torch.from_numpy(digits.target).long()
    perm = torch.randperm(len(labels), generator=rng)
    n_test = round(DIGITS_TEST_FRACTION * len(labels))
    test, train = perm[:n_test].sort().values, perm[n_test:].sort().values
    return images[train], labels[train], images[test], labels[test]


def _read_cifar10(root: Path, download: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """CIFAR-10 through torchvision's reader: uint8 (M, 3, 32, 32) images and int64 labels."""
    from torchvision.datasets import CIFAR10

    try:
        train = CIFAR10(str(root), train=True, download=download)
        test = CIFAR10(str(root), train=False, download=download)
    except RuntimeError as e:
        if "not found or corrupted" not in str(e):
            raise
        raise DataError(
            f"CIFAR-10 not found (or corrupted) in {root / CIFAR10.base_folder}; download it with "
            f"`prodigy-fl data cifar10`, or pass download=True (data_dir={str(root)!r})"
        ) from None

    def as_tensors(ds: CIFAR10) -> tuple[Tensor, Tensor]:
        return torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(ds.targets)

    return *as_tensors(train), *as_tensors(test)


def _read_leaf_split(directory: Path) -> dict[str, tuple[list, list]]:
    """{writer: (x, y)} from every LEAF JSON file in `directory` (files with no users are normal)."""
    writers: dict[str, tuple[list, list]] = {}
    for path in sorted(directory.glob("*.json")):
        with open(path) as f:
            content = json.load(f)
        for user in content["users"]:
            data = content["user_data"][user]
            writers[user] = (data["x"], data["y"])
    return writers


def _read_femnist(
    leaf_dir: Path | None, n_clients: int, min_samples: int
) -> tuple[Tensor, Tensor, list[Tensor], Tensor, Tensor]:
    """FEMNIST from a LEAF directory: clients = the first n_clients writers, in sorted order, with at least
    max(min_samples, 1) training samples; the test set = those writers' test samples."""
    if leaf_dir is None:
        raise DataError(
            "no FEMNIST data: pass data_dir=<LEAF directory with train/ and test/> or set "
            "PRODIGY_FEMNIST_DIR (LEAF's data/femnist/preprocess.sh produces one)"
        )
    missing = [s for s in ("train", "test") if not (leaf_dir / s).is_dir()]
    if missing:
        raise DataError(
            f"LEAF directory {leaf_dir} has no {' or '.join(missing)}/ folder (need train/ and test/)"
        )
    train, test = _read_leaf_split(leaf_dir / "train"), _read_leaf_split(leaf_dir / "test")
    if set(train) != set(test):
        raise DataError(
            f"LEAF directory {leaf_dir}: train and test writers differ ({len(train)} train writers, "
            f"{len(test)} test writers, {len(set(train) ^ set(test))} in only one of them)"
        )
    eligible = [w for w in sorted(train) if len(train[w][1]) >= max(min_samples, 1)]
    if len(eligible) < n_clients:
        raise DataError(
            f"LEAF directory {leaf_dir}: found {len(eligible)} writers with >= {max(min_samples, 1)} "
            f"training samples, need n_clients={n_clients}"
        )
    writers = eligible[:n_clients]

    def stack(split: dict[str, tuple[list, list]]) -> tuple[Tensor, Tensor, list[int]]:
        x = torch.tensor([row for w in writers for row in split[w][0]], dtype=torch.float32)
        y = torch.tensor([label for w in writers for label in split[w][1]], dtype=torch.long)
        return x.view(-1, 1, 28, 28), y, [len(split[w][1]) for w in writers]

    train_x, train_y, sizes = stack(train)
    test_x, test_y, _ = stack(test)
    parts = list(torch.arange(len(train_y)).split(sizes))
    return train_x, train_y, parts, test_x, test_y


__all__ = [
    "Federation",
    "DataError",
    "load_federation",
    "dirichlet_split",
    "iid_split",
    "random_crop_flip",
    "default_femnist_dir",
    "DATA_DIR",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
]
