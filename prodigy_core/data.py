"""Federated datasets held on the device: CIFAR-10, FEMNIST (LEAF) and scikit-learn's embedded digits (the
ProDiGy paper's data sets, and a small offline stand-in).

Entry points: `load_federation` (a dataset split among N clients: a `Federation`, which draws all clients'
batches of a local step at once, with no DataLoader in the training loop), `resolve_data_source` (which copy
of a dataset a run uses: part of its key), `decode_cifar10_jpeg` (`prodigy-fl data cifar10 --from`).
"""

from __future__ import annotations

import functools
import hashlib
import io
import itertools
import json
import math
import numbers
import os
import re
import tarfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from prodigy_core import paths
from prodigy_core.names import DATASETS, DISTRIBUTIONS, SOURCE_DIGEST_CHARS, check_variant
from prodigy_core.safe_io import atomic_write
from prodigy_core.seeding import resolve_device
from prodigy_core.streams import ClientStreams

# Read-only data beside the repository clone (../shared/data): CIFAR-10's JPEG copy, LEAF FEMNIST folders.
SHARED_DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"
CIFAR10_JPEG_ARCHIVE = SHARED_DATA_DIR / "cifar10-jpeg" / "cifar10-jpeg.tar.gz"


def jpeg_copy_hint() -> str:
    """What a message names as the JPEG copy to decode: the archive beside the clone where there is one, else
    the placeholder of the documented `prodigy-fl data cifar10 --from PATH` (never a path the user lacks)."""
    return str(CIFAR10_JPEG_ARCHIVE) if CIFAR10_JPEG_ARCHIVE.exists() else "PATH/cifar10-jpeg.tar.gz"


CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)  # the paper's normalisation (docs/semantics.md)
CIFAR10_STD = (0.2023, 0.1994, 0.2010)
FEMNIST_MEAN, FEMNIST_STD = (0.5,), (0.5,)
FEMNIST_CLASSES = 62
# Pixel mean and population std of all 1,797 bundled digits scaled to [0, 1] (x / 16), computed once and fixed
# so that normalisation does not depend on the seeded train/test split (tests/test_data.py recomputes them).
DIGITS_MEAN, DIGITS_STD = (0.3053,), (0.3760,)
DIGITS_TEST_FRACTION = 0.2
CIFAR_PAD = 4  # random crop 32 with padding 4

# RunConfig.data_source values (config.DATA_SOURCES lists them per dataset) and how outputs name them.
CIFAR10_BINARY, CIFAR10_JPEG, DIGITS_SOURCE, FEMNIST_SOURCE_PREFIX = (
    "cifar10-binary", "cifar10-jpeg", "digits", "femnist-leaf-"
)  # fmt: skip
SOURCE_LABELS = {
    CIFAR10_BINARY: "CIFAR-10 (torchvision binary batches)",
    CIFAR10_JPEG: "CIFAR-10 (JPEG copy)",
    DIGITS_SOURCE: "scikit-learn digits",
}
CIFAR10_JPEG_PART = "cifar10-jpeg-first-"  # + "<train>-<test>-<digest>": a copy decoded in part (per_class)
# SHA-256 of the arrays (`decoded_digest`) that shared/data/cifar10-jpeg's archive decodes to with Pillow
# 13.0.0 (libjpeg-turbo 3.2.0): the decode named `cifar10-jpeg`. Other pixels (another archive with the same
# counts, a Pillow whose decoder rounds otherwise) are named `cifar10-jpeg-<digest>` (its first
# SOURCE_DIGEST_CHARS hex digits): never its keys.
CIFAR10_JPEG_DIGEST = "eec90e10bd2f5438e70e4e8599dc5b7672ffbabf978fde50cd6de1e7ed6d6bf0"
CIFAR10_BATCH_FILES = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR10_PER_CLASS = {"train": 5000, "test": 1000}
CIFAR10_JPEG_FILE = Path("cifar10-jpeg") / "cifar10-jpeg-uint8.pt"  # under the data root
# The JPEG copy's test set is stored class by class; it is read in one fixed order that interleaves the
# classes, as torchvision's test batch does: torch.randperm(10000) under this seed, the same for every run.
# (The ``authors`` variant evaluates in training mode, where each test batch's own BatchNorm statistics
# make the order matter: a one-class batch would have its class's mean offsets removed.)
CIFAR10_JPEG_TEST_ORDER_SEED = 0
PAPER_MIN_WRITER_SAMPLES = 350  # the paper's LEAF -k (femnist_min_writer_samples in params/table2, table3)
# How to make a LEAF FEMNIST folder with enough writers (LEAF's data/femnist; --tf 0.9 is LEAF's default and
# the "_train_9" of the authors' file names; -k 350 keeps writers with >= 350 samples before the split).
LEAF_COMMAND = (
    "git clone https://github.com/TalwalkarLab/leaf && cd leaf/data/femnist && "
    "./preprocess.sh -s niid --sf 1.0 -k 350 -t sample --tf 0.9"
)


class DataError(ValueError):
    """Dataset files missing or malformed; the message says where we looked and how to fix it."""


def data_root() -> Path:
    """Where datasets are stored (torchvision's CIFAR-10 folder and the decoded JPEG copy live under it): env
    PRODIGY_DATA_DIR, else <project folder>/data (`paths.data_dir`, read now, so tests and notebooks can
    change directory or environment)."""
    return paths.data_dir()


def source_label(source: str | None) -> str | None:
    """How tables, figure titles and reports name a data source ("CIFAR-10 (JPEG copy)", ...)."""
    if source is None or source in SOURCE_LABELS:
        return SOURCE_LABELS.get(source) if source else None
    if source.startswith(FEMNIST_SOURCE_PREFIX):
        return f"FEMNIST (LEAF writers {source.removeprefix(FEMNIST_SOURCE_PREFIX)})"
    if source.startswith(CIFAR10_JPEG_PART):
        train, test, digest = source.removeprefix(CIFAR10_JPEG_PART).split("-")
        return f"CIFAR-10 (JPEG copy, its first {train} train / {test} test images per class, {digest})"
    if source.startswith(CIFAR10_JPEG + "-"):
        return f"CIFAR-10 (JPEG copy, decoded to other pixels: {source.removeprefix(CIFAR10_JPEG + '-')})"
    return source


def resolve_data_source(
    dataset: str, data_dir: str | Path | None, n_clients: int, min_writer_samples: int = 0
) -> str | None:
    """The data source a run of `dataset` would use on this machine now; None when there is none.

    cifar10: torchvision's binary batches when present, else the decoded JPEG copy (both under `data_dir`,
    default `data_root()`). femnist: `femnist-leaf-<hash>` of the first n_clients eligible writers of
    `data_dir` (default: `default_femnist_dir(n_clients, min_writer_samples)`), None with too few.

    The source (`RunConfig.data_source`) is part of every result key and named in every table. CIFAR-10's
    sources: torchvision's binary batches (`cifar10-binary`, `prodigy-fl data cifar10` with internet) and
    the decoded JPEG copy (`cifar10-jpeg`, `prodigy-fl data cifar10 --from cifar10-jpeg.tar.gz`: lossy
    re-encoded images, labelled "CIFAR-10 (JPEG copy)"; another decode is named by its pixels' digest:
    `decoded_source`). FEMNIST's, `femnist-leaf-<hash>`, hashes the writers a run uses (ids, train/test
    counts and the bytes of the files holding them: `femnist_source`), so that runs on different writers, or
    on other samples of the same writers, never share a key.
    Eligible writers have at least `min_writer_samples` samples over train + test (LEAF's `-k`, counted
    before LEAF's train/test split).
    """
    if dataset == "digits":
        return DIGITS_SOURCE
    if dataset == "cifar10":
        return cifar10_source(Path(data_dir) if data_dir else data_root())
    leaf = Path(data_dir) if data_dir else default_femnist_dir(n_clients, min_writer_samples)
    try:
        counts = leaf_writer_counts(leaf) if leaf is not None else {}
    except DataError:
        return None
    writers = eligible_writers(counts, min_writer_samples)
    return femnist_source(leaf, counts, writers[:n_clients]) if len(writers) >= n_clients else None


def cifar10_source(root: Path) -> str | None:
    """`cifar10-binary` when torchvision's batches are in root/cifar-10-batches-py (checked for presence),
    else the decoded JPEG copy's source when it is in root/cifar10-jpeg (`decoded_source`), else None."""
    if all((root / "cifar-10-batches-py" / name).is_file() for name in CIFAR10_BATCH_FILES):
        return CIFAR10_BINARY
    return jpeg_copy_source(root)


def jpeg_copy_source(root: Path) -> str | None:
    """The source of the JPEG copy decoded in root/cifar10-jpeg (`decoded_source`), else None."""
    path = root / CIFAR10_JPEG_FILE
    return decoded_source(str(path), _file_stamp(path)) if path.is_file() else None


def _file_stamp(path: Path) -> tuple[int, int, int, int]:
    """(mtime, ctime, inode, size) of `path`: the caches' key of a file's version. The ctime moves with any
    change to the file, even one whose mtime is then set back (`cp -p`, `tar x`, `touch -d`)."""
    st = path.stat()
    return st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_size


@functools.lru_cache(maxsize=16)
def decoded_source(path: str, stamp: tuple[int, ...]) -> str:
    """The source of a decoded JPEG copy (`decode_cifar10_jpeg`), from its arrays (`_decoded_copy_source`).
    Cached per file version, so the memory-mapped pixels are hashed once per version; a file that cannot be
    read counts as the reference copy, and loading it gives the error."""
    del stamp  # part of the cache key only
    try:
        arrays = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return _decoded_copy_source(arrays)
    except Exception:  # noqa: BLE001 - whatever a damaged file raises: `_check_decoded` names it on loading
        return CIFAR10_JPEG


def _decoded_copy_source(arrays: dict[str, Tensor]) -> str:
    """`cifar10-jpeg` for the reference decode (CIFAR-10's 5,000 train and 1,000 test images of every class,
    `decoded_digest` == CIFAR10_JPEG_DIGEST); `cifar10-jpeg-<digest>` for other pixels with those counts;
    `cifar10-jpeg-first-<train>-<test>-<digest>` for fewer (decoded with per_class). A source names the
    pixels and labels, so that two copies share a key only when they are the same data."""
    counts = [torch.bincount(arrays[f"{split}_labels"]).tolist() for split in CIFAR10_PER_CLASS]
    name, digest = _jpeg_source(counts), decoded_digest(arrays)
    if (name, digest) == (CIFAR10_JPEG, CIFAR10_JPEG_DIGEST):
        return CIFAR10_JPEG
    return f"{name}-{digest[:SOURCE_DIGEST_CHARS]}"


def decoded_digest(arrays: dict[str, Tensor]) -> str:
    """SHA-256 of a decoded copy's train images, train labels, test images and test labels (stored order)."""
    sha = hashlib.sha256()
    for split in CIFAR10_PER_CLASS:
        for kind in ("images", "labels"):
            sha.update(memoryview(arrays[f"{split}_{kind}"].contiguous().numpy()).cast("B"))
    return sha.hexdigest()


def _jpeg_source(counts: list[list[int]]) -> str:
    """The decoded copy's name from its images per class, train then test (`_decoded_copy_source`)."""
    per_class = [c[0] if c and len(set(c)) == 1 else 0 for c in counts]
    if per_class == list(CIFAR10_PER_CLASS.values()) or 0 in per_class:  # unequal classes: loading says so
        return CIFAR10_JPEG
    return CIFAR10_JPEG_PART + "-".join(map(str, per_class))


# ---------------------------------------------------------------------------------------------------------
# FEMNIST folders and writers


def femnist_dirs() -> list[Path]:
    """The LEAF folders to look in, in order of preference: env PRODIGY_FEMNIST_DIR (one folder, or several
    separated by the path separator), then `shared/data/femnist-leaf-24` (24 writers) and
    `shared/data/femnist-leaf` (10 writers) beside the repository clone; only those with a train/ folder."""
    named = [Path(p) for p in os.environ.get("PRODIGY_FEMNIST_DIR", "").split(os.pathsep) if p]
    shared = [SHARED_DATA_DIR / "femnist-leaf-24", SHARED_DATA_DIR / "femnist-leaf"]
    return [p for p in named + shared if (p / "train").is_dir()]


def default_femnist_dir(n_clients: int | None = None, min_writer_samples: int = 0) -> Path | None:
    """The LEAF folder to use when none is given: the first of `femnist_dirs()` with at least n_clients
    eligible writers (the first one when n_clients is None); when none has enough, the one with the most, so
    that the error names the best count there is. None when there is no folder."""
    candidates = femnist_dirs()
    if n_clients is None or not candidates:
        return candidates[0] if candidates else None

    def eligible(leaf: Path) -> int:
        try:
            return len(eligible_writers(leaf_writer_counts(leaf), min_writer_samples))
        except DataError:
            return -1

    counts = [eligible(leaf) for leaf in candidates]
    enough = [leaf for leaf, k in zip(candidates, counts, strict=True) if k >= n_clients]
    return enough[0] if enough else candidates[counts.index(max(counts))]


def leaf_writer_counts(leaf_dir: Path) -> dict[str, tuple[int, int]]:
    """{writer: (train samples, test samples)} of a LEAF folder, writers sorted; DataError when the folder
    is malformed. Read from the files' `users`/`num_samples` (the loader checks them against the samples);
    cached per file version, so resolving the writers of a grid's runs reads each file once."""
    leaf_dir = Path(leaf_dir)
    if not leaf_dir.is_dir():
        raise DataError(
            f"LEAF directory {leaf_dir} does not exist: give the folder that holds train/ and test/"
        )
    missing = [s for s in ("train", "test") if not (leaf_dir / s).is_dir()]
    if missing:
        raise DataError(
            f"LEAF directory {leaf_dir} has no {'/ or '.join(missing)}/ folder (need train/ and test/)"
        )
    splits = []
    for split in ("train", "test"):
        counts: dict[str, int] = {}
        where: dict[str, str] = {}  # the file each writer came from
        for version in _leaf_file_versions(leaf_dir / split):
            file_counts = _leaf_file_counts(*version)
            twice = sorted(file_counts.keys() & where.keys())
            if twice:
                raise DataError(_twice(twice[0], where[twice[0]], version[0]))
            where.update(dict.fromkeys(file_counts, version[0]))
            counts.update(file_counts)
        splits.append(counts)
    train, test = splits
    if set(train) != set(test):
        raise DataError(
            f"LEAF directory {leaf_dir}: train and test writers differ ({len(train)} train writers, "
            f"{len(test)} test writers, {len(set(train) ^ set(test))} in only one of them)"
        )
    return {w: (train[w], test[w]) for w in sorted(train)}


def _leaf_file_versions(directory: Path) -> list[tuple[str, tuple[int, ...]]]:
    """(path, `_file_stamp`) of every LEAF JSON file in `directory`, sorted: the caches' key of its files."""
    versions = []
    for path in sorted(directory.glob("*.json")):
        _check_regular(path)
        versions.append((str(path), _file_stamp(path)))
    return versions


@functools.lru_cache(maxsize=256)
def _leaf_file_counts(path: str, stamp: tuple[int, ...]) -> dict[str, int]:
    """{writer: num_samples} of one LEAF JSON file. LEAF writes `users` and `num_samples` before
    `user_data`: that head is parsed alone (0.1 s instead of 4 s for 8,000 samples); else the whole file."""
    del stamp  # part of the cache key only
    text = _read_leaf_text(Path(path))
    head = text[: max(text.find('"user_data"'), 0)].rstrip().rstrip(",")
    try:
        content = json.loads(head + "}")
    except ValueError:
        content = {}
    if "users" not in content or "num_samples" not in content:
        try:
            content = json.loads(text)
        except ValueError as e:
            raise DataError(f"{path}: not a valid LEAF JSON file ({e})") from None
    if not isinstance(content, dict):
        raise DataError(f"{path}: a LEAF file is a JSON object with users, num_samples and user_data, "
                        f"this is {type(content).__name__}")  # fmt: skip
    users, counts = content.get("users", []), content.get("num_samples", [])
    if not isinstance(users, list) or not isinstance(counts, list) or len(users) != len(counts):
        raise DataError(f"{path}: users and num_samples must be lists of the same length")
    for user, count in zip(users, counts, strict=True):
        if not isinstance(user, str) or isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise DataError(f"{path}: num_samples of {user} is {count!r}, not a count of samples")
    if len(set(users)) < len(users):
        raise DataError(_twice(next(u for u in users if users.count(u) > 1), path, path))
    return dict(zip(users, counts, strict=True))


def _twice(writer: str, first: str | Path, second: str | Path) -> str:
    """The error for a writer listed twice in a LEAF split: one copy's samples would be lost."""
    where = f"twice in {first}" if str(first) == str(second) else f"in both {first} and {second}"
    return (f"LEAF writer {writer} is listed {where} (two LEAF outputs in one folder?): one copy's samples "
            "would be dropped; keep one copy of each writer")  # fmt: skip


def eligible_writers(counts: dict[str, tuple[int, int]], min_writer_samples: int = 0) -> list[str]:
    """Writers, sorted, with at least one training sample and at least min_writer_samples samples over train
    + test (LEAF's -k: the paper's 350)."""
    return [w for w, (tr, te) in sorted(counts.items()) if tr >= 1 and tr + te >= min_writer_samples]


def femnist_source(leaf_dir: Path, counts: dict[str, tuple[int, int]], writers: Sequence[str]) -> str:
    """`femnist-leaf-<digest>`: a hash of the writers (in client order), their train/test counts and the
    SHA-256 of every LEAF file of `leaf_dir` that holds one of them (train files, then test files, each
    sorted by digest: the files' names and the folder's path do not count). The same writers split again by
    LEAF with another seed (the same counts, other samples) get another source; so does a file that holds
    them and changes anywhere, which costs a rerun, never a wrong reuse."""
    used = set(writers)
    digests = [
        sorted(_leaf_file_digest(*version) for version in _leaf_file_versions(Path(leaf_dir) / split)
               if used & _leaf_file_counts(*version).keys())
        for split in ("train", "test")
    ]  # fmt: skip
    blob = json.dumps([[[w, *counts[w]] for w in writers], digests], separators=(",", ":"))
    return FEMNIST_SOURCE_PREFIX + hashlib.sha256(blob.encode()).hexdigest()[:SOURCE_DIGEST_CHARS]


@functools.lru_cache(maxsize=256)
def _leaf_file_digest(path: str, stamp: tuple[int, ...]) -> str:
    """SHA-256 of one LEAF file's bytes, cached per file version (read only for files that hold a run's
    writers: a second or so per GB)."""
    del stamp  # part of the cache key only (`_leaf_file_versions` checked it is a regular file)
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def too_few_writers(leaf_dir: Path, counts: dict[str, tuple[int, int]], n_clients: int, k: int) -> DataError:
    """The error for a LEAF folder with fewer than n_clients eligible writers: the count and the fix."""
    eligible = len(eligible_writers(counts, k))
    return DataError(
        f"LEAF directory {leaf_dir}: {eligible} of its {len(counts)} writers have >= {max(k, 1)} samples "
        f"(train + test), need n_clients={n_clients}; make a LEAF folder with more writers ({LEAF_COMMAND}) "
        f"and pass it as data_dir or in env PRODIGY_FEMNIST_DIR"
    )


# ---------------------------------------------------------------------------------------------------------
# Partitions


def check_split_args(n_clients: Any, alpha: Any = None, seed: Any = None) -> None:
    """A split's arguments, or a ValueError naming the bad one: n_clients a whole number >= 1, seed (when
    given) a whole number, alpha (when given: a Dirichlet split's) a finite number > 0."""

    def whole(value: Any) -> bool:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)

    if not (whole(n_clients) and n_clients >= 1):
        raise ValueError(f"n_clients={n_clients!r} must be a whole number >= 1")
    if seed is not None and not whole(seed):
        raise ValueError(f"seed={seed!r} must be a whole number")
    real = isinstance(alpha, numbers.Real) and not isinstance(alpha, bool)
    if alpha is not None and not (real and math.isfinite(alpha) and alpha > 0):
        raise ValueError(
            f"dirichlet_alpha={alpha!r} must be a finite number > 0 (0.1 is the paper's; larger is closer to "
            "iid, distribution='iid' the limit)"
        )


def iid_split(n: int, n_clients: int, rng: torch.Generator) -> list[Tensor]:
    """A uniformly random partition of range(n) into n_clients parts whose sizes differ by at most one."""
    check_split_args(n_clients)
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
    check_split_args(n_clients, alpha)
    labels = labels.cpu()
    n = labels.numel()
    if n < n_clients * min_size:
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


def dirichlet_split_numpy(
    labels: Tensor, n_clients: int, alpha: float, seed: int, min_size: int = 10, max_tries: int = 1000
) -> list[Tensor]:
    """The authors' Dirichlet split (``variant="authors"``): numpy's draw exactly as their code makes it.

    Their main.py calls ``np.random.seed(seed)`` and then datasets.py's ``find_distribution_map``; this uses
    ``np.random.RandomState(seed)``, whose stream is the global one's after ``np.random.seed(seed)``, so it
    takes the same draws without touching numpy's global state. Per try, for each class c = 0, 1, ...:
    shuffle the class's indices (ascending, as ``np.where`` gives them), draw p ~ Dir_N(alpha), zero p_k for
    every client already holding >= n/N samples, renormalise, cut at ``(cumsum(p) * n_c).astype(int)[:-1]``
    and append the pieces; redraw everything until every client has >= min_size samples. Then each client's
    list is shuffled once, clients 0..N-1 in turn, and that order is kept (their dataset's order). Same
    recipe as `dirichlet_split` (the ``paper`` variant, on torch's generator): other draws, other splits.
    Which images the indices name depends on the training set's order: torchvision's binary batches are the
    authors' order; the JPEG copy is stored class by class, so its per-client class counts are theirs but
    not its images.
    """
    import numpy as np  # the authors' random stream is numpy's (the rest of the package is torch)

    check_split_args(n_clients, alpha, seed)
    y = labels.cpu().numpy()
    n = len(y)
    if n < n_clients * min_size:
        raise ValueError(
            f"cannot give each of n_clients={n_clients} clients at least {min_size} of {n} samples; "
            f"use fewer clients"
        )
    rs = np.random.RandomState(seed)
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(n_clients)]
        for c in range(int(y.max()) + 1):  # their `for k in range(K)`, K = 10 on CIFAR-10
            idx_c = np.flatnonzero(y == c)
            rs.shuffle(idx_c)
            p = rs.dirichlet(np.full(n_clients, alpha))
            p = p * np.array([len(part) < n / n_clients for part in parts])
            cuts = (np.cumsum(p / p.sum()) * len(idx_c)).astype(int)[:-1]
            for part, chunk in zip(parts, np.split(idx_c, cuts), strict=True):
                part.extend(chunk.tolist())
        if min(len(part) for part in parts) >= min_size:
            break
    else:
        raise ValueError(
            f"dirichlet_split_numpy found no split with every client >= {min_size} samples in {max_tries} "
            f"draws (n={n}, n_clients={n_clients}, alpha={alpha}); use a larger alpha or fewer clients"
        )
    out = []
    for part in parts:
        order = np.array(part, dtype=np.int64)
        rs.shuffle(order)
        out.append(torch.from_numpy(order))
    return out


def iid_split_numpy(n: int, n_clients: int, seed: int) -> list[Tensor]:
    """The authors' iid split (``variant="authors"``): ``np.array_split(np.random.permutation(n), N)`` after
    ``np.random.seed(seed)`` (their datasets.py), each part in the permutation's order."""
    import numpy as np

    check_split_args(n_clients, seed=seed)
    if not 1 <= n_clients <= n:
        raise ValueError(f"n_clients={n_clients} must be between 1 and the number of samples ({n})")
    perm = np.random.RandomState(seed).permutation(n)
    return [torch.from_numpy(part.astype(np.int64)) for part in np.array_split(perm, n_clients)]


# ---------------------------------------------------------------------------------------------------------
# The federation


@dataclass
class Federation:
    """A federated dataset on one device.

    It keeps the whole training set as one tensor on the device plus one index tensor per client, and produces
    the batches of all N clients of one local step at once: an (N, B) index tensor drawn without replacement
    within each client, then one gather + batched augmentation + normalisation. No DataLoader and no
    per-sample PIL transform in the training loop (benchmarks/data.py measures the gain).

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
    source: str | None = None  # the data source (RunConfig.data_source) the samples came from

    def __post_init__(self) -> None:
        self._padded: Tensor | None = None  # the zero-padded store for augmentation, made on first use
        sizes = torch.tensor([len(ix) for ix in self.client_indices])
        if len(sizes) == 0 or sizes.min() == 0:
            raise ValueError(f"every client needs at least one sample; client sizes: {sizes.tolist()}")
        self.client_sizes, self._cpu_sizes = sizes.to(self.device), sizes
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

    def generators(self, seed: int) -> list[torch.Generator]:
        """One CPU generator per client, for `sample_batch` and `train_batch` (a run's: `streams`)."""
        return ClientStreams(seed, self.n_clients).gens

    def sample_batch(self, batch_size: int, generators: Sequence[torch.Generator]) -> tuple[Tensor, Tensor]:
        """One local step's batches of all clients: (idx (N, B) int64, mask (N, B) bool).

        B = min(batch_size, largest client); client k's first b_k = min(batch_size, |client k|) entries are
        distinct samples of its own, uniformly drawn (the first b_k of a random permutation of its samples
        from its own CPU generator `generators[k]`, so the same on every device); the rest repeat a valid
        index of the same client and have mask False.
        """
        pos, mask = self.sample_positions(batch_size, generators)
        return self._index_table.gather(1, pos.to(self.device)), mask.to(self.device)

    def sample_positions(
        self, batch_size: int, generators: Sequence[torch.Generator]
    ) -> tuple[Tensor, Tensor]:
        """`sample_batch`'s draw on the host: (positions (N, B) into each client's row of the index table,
        mask (N, B)), both CPU tensors (`step_variants` gathers several runs' at once)."""
        width = min(batch_size, self._index_table.shape[1])
        pos = torch.zeros(self.n_clients, width, dtype=torch.int64)
        for k, (n, gen) in enumerate(zip(self._cpu_sizes.tolist(), generators, strict=True)):
            pos[k, : min(width, n)] = torch.randperm(n, generator=gen)[:width]
        return pos, torch.arange(width) < self._cpu_sizes.clamp(max=batch_size)[:, None]

    def normalise(self, images: Tensor) -> Tensor:
        """Raw images stored like `train_images` (uint8, or float in [0, 1]) -> float32 (x - mean) / std."""
        if images.dtype != self.train_images.dtype:
            raise ValueError(f"normalise expects raw {self.train_images.dtype} images, got {images.dtype}")
        # a fresh copy, then in place: twice as fast as a broadcast addcmul on a CPU, never touching `images`
        return images.to(torch.float32, copy=True).mul_(self._scale).add_(self._shift)

    eval_images = normalise

    def train_batch(self, idx: Tensor, generators: Sequence[torch.Generator]) -> Tensor:
        """Gather the training images at `idx` (N, B), augment them (cifar10: row k's crops and flips from
        `generators[k]`) and normalise: (N, B, C, H, W) float32."""
        if self.augment:
            if self._padded is None:  # padded once, on first use (1.6x the store for CIFAR-10)
                self._padded = pad_images(self.train_images, CIFAR_PAD)
            draws = crop_flip_draws(generators, idx.shape[-1], CIFAR_PAD)
            images = random_crop_flip(self.train_images, CIFAR_PAD, draws, idx, self._padded)
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


def crop_flip_draws(
    generators: Sequence[torch.Generator], width: int, pad: int
) -> tuple[Tensor, Tensor, Tensor]:
    """`random_crop_flip`'s random numbers for `width` images of each generator's row, drawn on the CPU:
    (dy, dx, flip), each of len(generators) * width entries, row after row; each row draws its dy, then its
    dx (uniform in 0..2 pad), then its flips (probability 1/2)."""
    k, rows = 2 * pad + 1, []
    for gen in generators:
        rows.append(torch.stack([torch.randint(0, k, (width,), generator=gen),
                                 torch.randint(0, k, (width,), generator=gen),
                                 (torch.rand(width, generator=gen) < 0.5).long()]))  # fmt: skip
    dy, dx, flip = torch.cat(rows, dim=1)
    return dy, dx, flip.bool()


def random_crop_flip(
    images: Tensor,
    pad: int,
    draws: tuple[Tensor, Tensor, Tensor],
    idx: Tensor | None = None,
    padded: Tensor | None = None,
) -> Tensor:
    """torchvision's RandomCrop(H, padding=pad) + RandomHorizontalFlip, batched: images[idx] (all images when
    idx is None), each cropped at its offset (dy, dx) of its zero-padded self and mirrored where flip is
    True, `draws` = (dy, dx, flip) one entry per image (`crop_flip_draws`, on any device).

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
    dy, dx, flip = (t.to(dev) for t in draws)
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
    min_writer_samples: int = 0,
    source: str | None = None,
    variant: str = "paper",
) -> Federation:
    """Load dataset `name` and split it among `n_clients` clients.

    Splits (cifar10, digits): `iid` (a seeded random partition into near-equal parts) and `dirichlet` (the
    NIID-Bench recipe, `dirichlet_split`). FEMNIST is `natural`: one writer per client, the first N eligible
    writers in sorted order, as in the authors' loader. Splits are drawn on the CPU from a generator seeded
    with the data seed, so a seed gives the same federation on every device.

    seed is the data seed (split, digits' train/test split). data_dir: the LEAF directory for femnist
    (default `default_femnist_dir(n_clients, min_writer_samples)`), the data root for cifar10 (default
    `data_root()`), ignored by digits. min_writer_samples (femnist): writers with fewer samples over train +
    test are not eligible as clients. source: the data source to use (`RunConfig.data_source`; None: the
    first one found, see `resolve_data_source`); a femnist source names the writers, and a folder whose
    first eligible writers differ is an error. The returned federation's `source` says which one was used.
    variant: ``paper`` splits on torch's generator (`iid_split`, `dirichlet_split`); ``authors`` on numpy's,
    seeded with `seed` as the authors' main.py seeds it (`iid_split_numpy`, `dirichlet_split_numpy`).
    """
    check_variant("load_federation", variant)
    if name not in DATASETS:
        raise ValueError(f"dataset={name!r} is unknown; valid: {', '.join(DATASETS)}")
    if distribution not in DISTRIBUTIONS[name]:
        raise ValueError(
            f"distribution={distribution!r} is not valid for {name}; valid: {', '.join(DISTRIBUTIONS[name])}"
        )
    check_split_args(n_clients, dirichlet_alpha if distribution == "dirichlet" else None, seed)
    n_clients, seed = int(n_clients), int(seed)  # a numpy integer too (torch's manual_seed takes no other)
    dev = resolve_device(device) if isinstance(device, str) else device
    rng = torch.Generator().manual_seed(seed)

    if name == "femnist":
        leaf_dir = Path(data_dir) if data_dir else default_femnist_dir(n_clients, min_writer_samples)
        train_x, train_y, parts, test_x, test_y, used = _read_femnist(leaf_dir, n_clients, min_writer_samples)
        if source is not None and source != used:
            raise DataError(
                f"LEAF directory {leaf_dir}: its first {n_clients} eligible writers are {used}, not the "
                f"run's data_source={source}; use the folder the run was keyed on, or data_source=null"
            )
        source = used
        num_classes, mean, std, augment = FEMNIST_CLASSES, FEMNIST_MEAN, FEMNIST_STD, False
    else:
        if name == "cifar10":
            root = Path(data_dir) if data_dir else data_root()
            source = source or cifar10_source(root) or (CIFAR10_BINARY if download else None)
            if source is not None and source.startswith(CIFAR10_JPEG):
                train_x, train_y, test_x, test_y, decoded = _read_cifar10_jpeg(root)
                if decoded != source:
                    raise DataError(
                        f"{root / CIFAR10_JPEG_FILE} holds {source_label(decoded)}, not the run's "
                        f"data_source={source}; decode that copy into another data folder, or run with "
                        "data_source=null"
                    )
            elif source == CIFAR10_BINARY:
                train_x, train_y, test_x, test_y = _read_cifar10(root, download)
            else:
                batches = root / "cifar-10-batches-py"
                missing = [f for f in CIFAR10_BATCH_FILES if not (batches / f).is_file()]
                if batches.is_dir() and len(missing) < len(CIFAR10_BATCH_FILES):
                    raise DataError(
                        f"{batches} is incomplete: {', '.join(missing)} missing; download it again with "
                        "`prodigy-fl data cifar10` (or download=True)"
                    )
                raise DataError(
                    f"CIFAR-10 not found in {root} (neither torchvision's cifar-10-batches-py nor a decoded "
                    f"{CIFAR10_JPEG_FILE}); download it with `prodigy-fl data cifar10` (or download=True), "
                    f"or offline decode the JPEG copy: `prodigy-fl data cifar10 --from {jpeg_copy_hint()}` "
                    f"(data_dir={str(root)!r})"
                )
            num_classes, mean, std, augment = 10, CIFAR10_MEAN, CIFAR10_STD, True
        else:
            train_x, train_y, test_x, test_y = _read_digits(rng)
            num_classes, mean, std, augment, source = 10, DIGITS_MEAN, DIGITS_STD, False, DIGITS_SOURCE
        if variant == "authors":
            parts = (
                iid_split_numpy(len(train_y), n_clients, seed)
                if distribution == "iid"
                else dirichlet_split_numpy(train_y, n_clients, dirichlet_alpha, seed)
            )
        elif distribution == "iid":
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
        source=source,
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


def _read_cifar10_jpeg(root: Path) -> tuple[Tensor, Tensor, Tensor, Tensor, str]:
    """The decoded JPEG copy (`decode_cifar10_jpeg`): uint8 (M, 3, 32, 32) images and int64 labels, the test
    set in the fixed interleaved order of `CIFAR10_JPEG_TEST_ORDER_SEED`, and the source these arrays are
    (`_decoded_copy_source`: read from them, not from the file again)."""
    path = root / CIFAR10_JPEG_FILE
    if not path.is_file():
        raise DataError(
            f"the decoded JPEG copy of CIFAR-10 is not in {path}; make it with "
            f"`prodigy-fl data cifar10 {root} --from {jpeg_copy_hint()}`"
        )
    arrays = _check_decoded(path, root)
    test_labels = arrays["test_labels"]
    order = torch.randperm(
        len(test_labels), generator=torch.Generator().manual_seed(CIFAR10_JPEG_TEST_ORDER_SEED)
    )
    train = arrays["train_images"], arrays["train_labels"]
    return *train, arrays["test_images"][order], test_labels[order], _decoded_copy_source(arrays)


def _check_decoded(path: Path, root: Path) -> dict[str, Tensor]:
    """The decoded JPEG copy's arrays, checked: readable, uint8 (N, 3, 32, 32) images with as many int64
    labels in 0..9, the same count for every class; else one DataError line naming the file and the fix."""
    rebuild = f"rebuild it: `prodigy-fl data cifar10 {root} --from {CIFAR10_JPEG_ARCHIVE}`"
    try:
        arrays = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # garbage, truncated, another format: whatever torch raises
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise DataError(f"{path}: not a readable decoded file of CIFAR-10 ({why}); {rebuild}") from None
    if not isinstance(arrays, dict):
        raise DataError(f"{path}: not a decoded file of CIFAR-10 (a {type(arrays).__name__}); {rebuild}")
    for split in ("train", "test"):
        images, labels = arrays.get(f"{split}_images"), arrays.get(f"{split}_labels")
        for name, value in ((f"{split}_images", images), (f"{split}_labels", labels)):
            if not isinstance(value, Tensor):
                raise DataError(f"{path}: {name} is missing; {rebuild}")
        if images.dtype != torch.uint8 or images.dim() != 4 or tuple(images.shape[1:]) != (3, 32, 32):
            raise DataError(
                f"{path}: {split}_images must be uint8 (N, 3, 32, 32), got {images.dtype} "
                f"{tuple(images.shape)}; {rebuild}"
            )
        if labels.dtype != torch.long or labels.dim() != 1 or len(labels) != len(images):
            raise DataError(
                f"{path}: {split}_images has {len(images)} images but {split}_labels {len(labels)} labels "
                f"({labels.dtype}, one int64 label per image); {rebuild}"
            )
        outside = labels[(labels < 0) | (labels >= len(CIFAR10_CLASSES))]
        if len(outside):
            raise DataError(
                f"{path}: {split}_labels: label {int(outside[0])} is not a class in 0..9; {rebuild}"
            )
        per_class = torch.bincount(labels, minlength=len(CIFAR10_CLASSES)).tolist()
        if len(set(per_class)) != 1:
            raise DataError(f"{path}: {split} images per class {per_class}, not equal; {rebuild}")
    return arrays


def decode_cifar10_jpeg(
    source: str | Path,
    root: str | Path | None = None,
    per_class: int | None = None,
    progress: bool = True,
) -> Path:
    """Decode the JPEG copy of CIFAR-10 (`cifar10-jpeg.tar.gz`, a folder holding it, or its unpacked
    `train/<class>/*.jpg`, `test/<class>/*.jpg`) once with Pillow into `root/cifar10-jpeg/` (default
    `data_root()`), as uint8 (M, 3, 32, 32) images and int64 labels, written atomically; returns the file.

    Labels are the class folders in alphabetical order (CIFAR-10's ids 0..9); images sorted by file name
    within a class. The counts must be CIFAR-10's: 5,000 train and 1,000 test images per class (50,000 /
    10,000). per_class (tests): decode only the first per_class files of every class and split; such a copy's
    data source is `cifar10-jpeg-first-<per_class>-<per_class>-<digest>`, never the whole copy's
    (`decoded_source`).
    """
    from PIL import Image
    from tqdm.auto import tqdm

    files = _cifar10_jpeg_files(Path(source))
    found = sorted({c for (_, c) in files})
    if found != sorted(CIFAR10_CLASSES):
        raise DataError(
            f"{source}: expected the 10 CIFAR-10 class folders ({', '.join(CIFAR10_CLASSES)}) in train/ and "
            f"test/, found {', '.join(found) or 'none'}"
        )
    for split, cls in itertools.product(CIFAR10_PER_CLASS, CIFAR10_CLASSES):
        have, want = len(files.get((split, cls), {})), CIFAR10_PER_CLASS[split]
        if have != want and not (per_class and have >= per_class):
            raise DataError(
                f"{source}: {split}/{cls} has {have:,} JPEG files, expected {want:,} (a partial or altered "
                f"copy of CIFAR-10: 5,000 train and 1,000 test images per class); get a complete copy"
            )
    arrays: dict[str, Tensor] = {}
    total = sum(min(len(v), per_class or len(v)) for v in files.values())
    with tqdm(total=total, unit="img", desc="decoding CIFAR-10 JPEG", disable=not progress) as bar:
        for split in ("train", "test"):
            images, labels = [], []
            for label, cls in enumerate(CIFAR10_CLASSES):
                for name, read in sorted(files[split, cls].items())[:per_class]:
                    try:
                        with Image.open(io.BytesIO(read())) as im:
                            if im.size != (32, 32):
                                raise DataError(f"{source}: {split}/{cls}/{name} is {im.size}, not 32x32")
                            pixels = im.convert("RGB").tobytes()
                    except (
                        OSError,
                        SyntaxError,
                        ValueError,
                    ) as e:  # PIL's UnidentifiedImageError: an OSError
                        if isinstance(e, DataError):
                            raise
                        raise DataError(
                            f"{source}: {split}/{cls}/{name} is not a JPEG image PIL can read "
                            f"({type(e).__name__}); get an unaltered copy of the JPEG archive"
                        ) from None
                    images.append(torch.frombuffer(bytearray(pixels), dtype=torch.uint8).view(32, 32, 3))
                    labels.append(label)
                    bar.update(1)
            arrays[f"{split}_images"] = torch.stack(images).permute(0, 3, 1, 2).contiguous()
            arrays[f"{split}_labels"] = torch.tensor(labels, dtype=torch.long)
    path = (Path(root) if root else data_root()) / CIFAR10_JPEG_FILE
    with atomic_write(path, "wb") as fh:
        torch.save({**arrays, "classes": list(CIFAR10_CLASSES), "source": str(source)}, fh)
    return path


MAX_JPEG_BYTES = 1 << 20  # a 32x32 JPEG is a few KB; a member over 1 MB is refused unread


def _check_jpeg_size(source: Path, name: str, size: int) -> None:
    if size > MAX_JPEG_BYTES:
        raise DataError(
            f"{source}: {name} is {size:,} bytes, over {MAX_JPEG_BYTES:,}: not a CIFAR-10 JPEG (32x32, a few "
            "KB); get an unaltered copy of the JPEG archive"
        )


def _cifar10_jpeg_files(source: Path) -> dict[tuple[str, str], dict[str, Callable[[], bytes]]]:
    """{(split, class): {file name: a reader of its bytes}} from the archive or the unpacked folder."""
    pattern = re.compile(r"(?:^|/)(train|test)/([^/]+)/([^/]+\.jpe?g)$", re.IGNORECASE)
    files: dict[tuple[str, str], dict[str, Callable[[], bytes]]] = {}
    if source.is_dir() and not (source / "train").is_dir():
        archives = sorted(source.glob("*.tar.gz"))
        if len(archives) != 1:
            raise DataError(
                f"{source}: expected train/ and test/ class folders of JPEG files, or one .tar.gz of them"
            )
        source = archives[0]
    if source.is_dir():
        for path in sorted(source.glob("*/*/*")):
            match = pattern.search(path.relative_to(source).as_posix())
            if match:
                _check_regular(path)
                _check_jpeg_size(source, path.relative_to(source).as_posix(), path.stat().st_size)
                files.setdefault(match.group(1, 2), {})[match.group(3)] = path.read_bytes
    elif source.is_file():
        try:
            with tarfile.open(source, "r:*") as tar:
                for member in tar:
                    match = pattern.search(member.name)
                    if member.isfile() and match:
                        _check_jpeg_size(source, member.name, member.size)  # before reading it
                        content = tar.extractfile(member).read()  # type: ignore[union-attr]
                        files.setdefault(match.group(1, 2), {})[match.group(3)] = lambda c=content: c
        except (tarfile.TarError, EOFError, OSError) as e:
            # tarfile's ReadError lists every compression it tried, one line each: one line here
            why = "not a tar archive, compressed or not" if isinstance(e, tarfile.ReadError) else e
            raise DataError(f"{source}: not a readable .tar.gz of the JPEG copy ({why})") from None
    else:
        raise DataError(f"{source} does not exist (pass the JPEG copy's .tar.gz or its unpacked folder)")
    if not files:
        raise DataError(f"{source}: no train/<class>/*.jpg or test/<class>/*.jpg files in it")
    return files


def _read_leaf_split(directory: Path) -> dict[str, tuple[list, list, Path]]:
    """{writer: (x, y, its file)} from every LEAF JSON file in `directory` (files with no users are normal);
    DataError naming the file (and the writer) when it does not have LEAF's structure."""
    writers: dict[str, tuple[list, list, Path]] = {}
    for path in sorted(directory.glob("*.json")):
        try:
            content = json.loads(_read_leaf_text(path))
        except ValueError as e:
            raise DataError(f"{path}: not a valid LEAF JSON file ({e})") from None
        users = content.get("users") if isinstance(content, dict) else None
        user_data = content.get("user_data") if isinstance(content, dict) else None
        if not isinstance(users, list) or not isinstance(user_data, dict):
            raise DataError(f"{path}: a LEAF file is a JSON object with a users list and a user_data object")
        for user in users:
            data = user_data.get(user) if isinstance(user, str) else None
            if data is None:
                raise DataError(f"{path}: writer {user} is listed in users but not in user_data")
            if (
                not isinstance(data, dict)
                or not isinstance(data.get("x"), list)
                or not isinstance(data.get("y"), list)
            ):
                raise DataError(f"{path}: writer {user}: user_data needs lists x (images) and y (labels)")
            if user in writers:
                raise DataError(_twice(user, writers[user][2], path))
            writers[user] = (data["x"], data["y"], path)
    return writers


def _check_regular(path: Path) -> None:
    """A DataError naming ``path`` unless it is a regular file (a FIFO or a device would block a read)."""
    if not path.is_file():
        raise DataError(f"{path}: not a regular file (a FIFO, a device or a folder); move it out of the data")


def _read_leaf_text(path: Path) -> str:
    """A LEAF JSON file's text; a DataError naming the file when it is not a regular file or not UTF-8."""
    _check_regular(path)
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not a UTF-8 LEAF JSON file ({e})") from None


def _writer_tensors(x: list, y: list, path: Path, writer: str) -> tuple[Tensor, Tensor]:
    """One writer's images (n, 784) float32 and labels (n,) int64, checked: as many x rows as labels, 784
    values in [0, 1] a row, integer labels among the FEMNIST_CLASSES classes; DataError naming the file and
    the writer (a shifted row would otherwise pair later images with the wrong labels, silently)."""
    where = f"{path}: writer {writer}"
    if len(x) != len(y):
        raise DataError(f"{where} has {len(x)} x rows but {len(y)} labels (y); one image per label")
    for i, row in enumerate(x):
        if not isinstance(row, list) or len(row) != 784:
            width = len(row) if isinstance(row, list) else type(row).__name__
            raise DataError(f"{where}: x row {i} has {width} values, not 784 (a 28x28 image)")
    for label in y:
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < FEMNIST_CLASSES:
            raise DataError(f"{where}: label {label!r} is not a class in 0..{FEMNIST_CLASSES - 1}")
    try:
        images = torch.tensor(x, dtype=torch.float32).view(-1, 784)
    except (TypeError, ValueError, RuntimeError):
        images = None
    bad = (
        torch.arange(len(x))
        if images is None
        else torch.nonzero(~((images >= 0) & (images <= 1)).all(dim=1)).flatten()  # NaN fails both
    )
    if len(bad):
        raise DataError(f"{where}: x row {int(bad[0])} is not 784 finite numbers in [0, 1] (LEAF's scale)")
    return images, torch.tensor(y, dtype=torch.long)


def _read_femnist(
    leaf_dir: Path | None, n_clients: int, min_writer_samples: int
) -> tuple[Tensor, Tensor, list[Tensor], Tensor, Tensor, str]:
    """FEMNIST from a LEAF directory: clients = the first n_clients eligible writers (`eligible_writers`) in
    sorted order; the test set = those writers' test samples; and the data source naming them."""
    if leaf_dir is None:
        raise DataError(
            "no FEMNIST data: pass data_dir=<LEAF directory with train/ and test/> or set "
            f"PRODIGY_FEMNIST_DIR (LEAF makes one: {LEAF_COMMAND})"
        )
    counts = leaf_writer_counts(leaf_dir)
    eligible = eligible_writers(counts, min_writer_samples)
    if len(eligible) < n_clients:
        raise too_few_writers(leaf_dir, counts, n_clients, min_writer_samples)
    versions = tuple(v for split in ("train", "test") for v in _leaf_file_versions(leaf_dir / split))
    return _read_femnist_writers(leaf_dir, tuple(eligible[:n_clients]), versions)


@functools.lru_cache(maxsize=1)
def _read_femnist_writers(
    leaf_dir: Path, writers: tuple[str, ...], versions: tuple[tuple[str, tuple[int, ...]], ...]
) -> tuple[Tensor, Tensor, list[Tensor], Tensor, Tensor, str]:
    """`_read_femnist`'s tensors of these writers, kept for the folder's file versions (`versions`, the
    cache key only): the runs of a grid on one FEMNIST setting parse its JSON once per process, not once a
    run (seconds for 24 writers, minutes for LEAF's whole FEMNIST). The tensors are shared, never written:
    `Federation.flip_labels` copies the labels first."""
    del versions
    counts = leaf_writer_counts(leaf_dir)
    train, test = _read_leaf_split(leaf_dir / "train"), _read_leaf_split(leaf_dir / "test")
    for w in writers:
        if (len(train[w][1]), len(test[w][1])) != counts[w]:
            raise DataError(
                f"LEAF directory {leaf_dir}: writer {w} has {len(train[w][1])} train / "
                f"{len(test[w][1])} test samples but num_samples says {counts[w][0]} / {counts[w][1]}"
            )

    def stack(split: dict[str, tuple[list, list, Path]]) -> tuple[Tensor, Tensor, list[int]]:
        xs, ys = zip(*(_writer_tensors(*split[w], w) for w in writers), strict=True)
        return torch.cat(xs).view(-1, 1, 28, 28), torch.cat(ys), [len(y) for y in ys]

    train_x, train_y, sizes = stack(train)
    test_x, test_y, _ = stack(test)
    parts = list(torch.arange(len(train_y)).split(sizes))
    return train_x, train_y, parts, test_x, test_y, femnist_source(leaf_dir, counts, writers)


__all__ = [
    "Federation",
    "DataError",
    "load_federation",
    "dirichlet_split",
    "iid_split",
    "random_crop_flip",
    "crop_flip_draws",
    "default_femnist_dir",
    "femnist_dirs",
    "leaf_writer_counts",
    "eligible_writers",
    "resolve_data_source",
    "source_label",
    "decode_cifar10_jpeg",
    "jpeg_copy_source",
    "data_root",
    "LEAF_COMMAND",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
]
