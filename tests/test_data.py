"""Federated datasets: real loaders (torchvision CIFAR-10 on tiny files, LEAF FEMNIST, digits), partitions,
batch sampling, augmentation and label flipping, each checked against an independent expectation."""

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TF

from prodigy_core.data import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    DIGITS_MEAN,
    DIGITS_STD,
    DataError,
    dirichlet_split,
    iid_split,
    load_federation,
)

# ------------------------------------------------------------------------------------------------- fixtures


CIFAR_PER_BATCH, CIFAR_TEST = 20, 12


@pytest.fixture
def cifar_root(tmp_path, monkeypatch):
    """A tiny CIFAR-10 in torchvision's on-disk format (pickled dicts with (n, 3072) uint8 channel-major rows
    and `labels`), so that torchvision's real reader runs. torchvision checks the md5 of the official files,
    which tiny files cannot match: the md5 check (and only it) is replaced by an existence check."""
    import torchvision.datasets.cifar as cifar

    monkeypatch.setattr(cifar, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    batches = {}
    for name, n in [*((f"data_batch_{i}", CIFAR_PER_BATCH) for i in range(1, 6)), ("test_batch", CIFAR_TEST)]:
        batch = {
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            "labels": (np.arange(n) % 10).tolist(),
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
        batches[name] = batch
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)
    return tmp_path, batches


def write_leaf(root: Path, train: dict, test: dict) -> Path:
    """A LEAF directory with one empty file per split (as real LEAF output has) and one with the writers."""
    for split, writers in (("train", train), ("test", test)):
        (root / split).mkdir(parents=True)
        empty = {"users": [], "num_samples": [], "user_data": {}}
        (root / split / "part_0.json").write_text(json.dumps(empty))
        content = {
            "users": list(writers),
            "num_samples": [len(y) for y in writers.values()],
            "user_data": {
                w: {"x": [[float(v) / 783 for v in range(784)]] * len(y), "y": y} for w, y in writers.items()
            },
        }
        (root / split / "part_1.json").write_text(json.dumps(content))
    return root


# ------------------------------------------------------------------------------------------------- CIFAR-10


def test_cifar10_through_torchvision_reader(cifar_root):
    root, batches = cifar_root
    fed = load_federation("cifar10", 2, "iid", seed=0, data_dir=root)
    expected = np.concatenate([batches[f"data_batch_{i}"]["data"] for i in range(1, 6)]).reshape(
        -1, 3, 32, 32
    )
    assert fed.train_images.dtype == torch.uint8
    assert torch.equal(fed.train_images, torch.from_numpy(expected))
    assert fed.train_labels.tolist() == sum((batches[f"data_batch_{i}"]["labels"] for i in range(1, 6)), [])
    assert fed.test_images.shape == (CIFAR_TEST, 3, 32, 32) and fed.num_classes == 10
    assert fed.image_shape == (3, 32, 32) and fed.n_clients == 2
    images, labels = next(fed.test_batches(100))
    mean, std = torch.tensor(CIFAR10_MEAN).view(3, 1, 1), torch.tensor(CIFAR10_STD).view(3, 1, 1)
    torch.testing.assert_close(images, (fed.test_images.float() / 255 - mean) / std)
    assert torch.equal(labels, fed.test_labels)


def test_cifar10_augmentation_is_a_random_crop_with_padding_and_a_flip(cifar_root):
    root, _ = cifar_root
    fed = load_federation("cifar10", 2, "dirichlet", 0.5, seed=1, data_dir=root)
    gen = fed.generator(0)
    idx, mask = fed.sample_batch(16, gen)
    out = fed.train_batch(idx, gen)
    assert out.shape == (2, 16, 3, 32, 32) and out.dtype == torch.float32
    mean, std = torch.tensor(CIFAR10_MEAN).view(3, 1, 1), torch.tensor(CIFAR10_STD).view(3, 1, 1)
    raw = (out * std + mean) * 255
    seen = set()
    for image, i in zip(raw.flatten(0, 1), idx.flatten().tolist(), strict=True):
        padded = TF.pad(fed.train_images[i], [4])  # torchvision's own ops as the reference
        matches = [
            (dy, dx, flip)
            for dy in range(9)
            for dx in range(9)
            for flip in (False, True)
            if torch.allclose(
                image,
                (TF.horizontal_flip if flip else lambda t: t)(TF.crop(padded, dy, dx, 32, 32)).float(),
                atol=1e-3,
            )
        ]
        assert matches, f"augmented image of sample {i} is no crop/flip of it"
        seen.update(matches)
    assert len({m[2] for m in seen}) == 2 and len({m[:2] for m in seen}) > 5  # both flips, many offsets


def test_cifar10_missing_files_say_where_and_how(tmp_path):
    with pytest.raises(DataError) as info:
        load_federation("cifar10", 2, "iid", data_dir=tmp_path / "nowhere", download=False)
    message = str(info.value)
    assert "nowhere" in message and "download=True" in message and "prodigy-fl data cifar10" in message


# ------------------------------------------------------------------------------------------------- FEMNIST


def test_femnist_real_leaf_subset(femnist_dir):
    fed = load_federation("femnist", 10, "natural", data_dir=femnist_dir)
    assert fed.train_images.shape == (3348, 1, 28, 28) and fed.test_images.shape == (378, 1, 28, 28)
    assert fed.train_images.dtype == torch.float32 and fed.num_classes == 62
    assert fed.train_images.min() >= 0 and fed.train_images.max() <= 1
    assert fed.train_labels.min() >= 0 and fed.train_labels.max() < 62
    sizes = [len(ix) for ix in fed.client_indices]
    assert sum(sizes) == 3348 and min(sizes) >= 315 and max(sizes) <= 361
    assert torch.equal(torch.cat(fed.client_indices), torch.arange(3348))
    images, _ = next(fed.test_batches(1000))
    assert images.shape == (378, 1, 28, 28) and images.min() >= -1 and images.max() <= 1
    torch.testing.assert_close(images, (fed.test_images - 0.5) / 0.5)


def test_femnist_min_samples_and_too_few_writers(femnist_dir):
    leaf = femnist_dir
    assert load_federation("femnist", 3, "natural", data_dir=leaf, min_samples=340).n_clients == 3
    with pytest.raises(DataError, match=r"found \d writers with >= 340 training samples, need n_clients=10"):
        load_federation("femnist", 10, "natural", data_dir=leaf, min_samples=340)


def test_femnist_synthetic_leaf_takes_first_writers_in_sorted_order(tmp_path):
    leaf = write_leaf(
        tmp_path, {"w_b": [1, 2, 3], "w_a": [4, 5], "w_c": [6]}, {"w_b": [7], "w_a": [8], "w_c": [9]}
    )
    fed = load_federation("femnist", 2, "natural", data_dir=leaf)
    assert fed.train_labels.tolist() == [4, 5, 1, 2, 3]  # w_a, then w_b
    assert [ix.tolist() for ix in fed.client_indices] == [[0, 1], [2, 3, 4]]
    assert fed.test_labels.tolist() == [8, 7]
    # row-major 28x28: pixel (r, c) is x[28 r + c]
    torch.testing.assert_close(fed.train_images[0, 0, 1, 2], torch.tensor(30 / 783))


def test_femnist_malformed_leaf_directories(tmp_path):
    (tmp_path / "only_train" / "train").mkdir(parents=True)
    with pytest.raises(DataError, match="only_train.*no test/"):
        load_federation("femnist", 1, "natural", data_dir=tmp_path / "only_train")
    leaf = write_leaf(tmp_path / "differ", {"w_a": [1], "w_b": [2]}, {"w_a": [3], "w_z": [4]})
    with pytest.raises(DataError, match="differ.*train and test writers differ"):
        load_federation("femnist", 1, "natural", data_dir=leaf)
    leaf = write_leaf(tmp_path / "small", {"w_a": [1]}, {"w_a": [2]})
    with pytest.raises(DataError, match="small: found 1 writers .* need n_clients=2"):
        load_federation("femnist", 2, "natural", data_dir=leaf)


# ------------------------------------------------------------------------------------------------- digits


def test_digits_split_and_normalisation_constants():
    from sklearn.datasets import load_digits

    pixels = torch.from_numpy(load_digits().data).double() / 16
    assert (
        abs(pixels.mean().item() - DIGITS_MEAN[0]) < 1e-4 and abs(pixels.std().item() - DIGITS_STD[0]) < 1e-4
    )
    a, b, c = (load_federation("digits", 5, "iid", seed=s) for s in (0, 0, 1))
    assert len(a.train_labels) + len(a.test_labels) == 1797 and len(a.test_labels) == 359
    assert a.train_images.shape[1:] == (1, 8, 8) and a.train_images.max() <= 1
    assert torch.equal(a.test_images, b.test_images) and not torch.equal(a.test_images, c.test_images)
    gen = a.generator(0)
    idx, _ = a.sample_batch(8, gen)
    torch.testing.assert_close(
        a.train_batch(idx, gen), (a.train_images[idx] - DIGITS_MEAN[0]) / DIGITS_STD[0]
    )


def test_flip_labels_only_touches_the_given_clients():
    fed = load_federation("digits", 4, "dirichlet", 0.5, seed=0)
    before, test_before = fed.train_labels.clone(), fed.test_labels.clone()
    fed.flip_labels([1, 3])
    for k, ix in enumerate(fed.client_indices):
        expected = 9 - before[ix] if k in (1, 3) else before[ix]
        assert torch.equal(fed.train_labels[ix], expected)
    assert torch.equal(fed.test_labels, test_before) and fed.flipped_clients == [1, 3]


# ------------------------------------------------------------------------------------------------- partitions


def class_labels(per_class: int = 300, classes: int = 10) -> torch.Tensor:
    return torch.arange(classes).repeat_interleave(per_class)


def test_dirichlet_split_is_a_partition_with_min_size_and_deterministic():
    labels = class_labels()
    for alpha in (0.05, 0.1, 1.0):
        parts = dirichlet_split(labels, 20, alpha, torch.Generator().manual_seed(3))
        assert torch.equal(torch.cat(parts).sort().values, torch.arange(len(labels)))
        assert min(len(p) for p in parts) >= 10
        # a client stops receiving once it holds >= n/N, so it overshoots by at most one class
        assert max(len(p) for p in parts) < len(labels) / 20 + 300
        again = dirichlet_split(labels, 20, alpha, torch.Generator().manual_seed(3))
        assert all(torch.equal(p, q) for p, q in zip(parts, again, strict=True))
    other = dirichlet_split(labels, 20, 0.1, torch.Generator().manual_seed(4))
    assert not all(torch.equal(p, q) for p, q in zip(parts, other, strict=True))


def test_dirichlet_split_skew_follows_alpha():
    labels = class_labels()

    def mean_top_class_share(alpha: float) -> float:
        parts = dirichlet_split(labels, 10, alpha, torch.Generator().manual_seed(0))
        return sum(torch.bincount(labels[p], minlength=10).max().item() / len(p) for p in parts) / len(parts)

    assert mean_top_class_share(0.1) > 0.5  # mostly one or two classes per client
    assert mean_top_class_share(1000.0) < 0.15  # uniform would be 0.1


def test_dirichlet_split_bad_input():
    with pytest.raises(ValueError, match="must be > 0"):
        dirichlet_split(class_labels(), 10, 0.0, torch.Generator())
    with pytest.raises(ValueError, match="at least 10"):
        dirichlet_split(class_labels(5), 10, 0.1, torch.Generator())


def test_iid_split_is_a_balanced_partition():
    parts = iid_split(103, 10, torch.Generator().manual_seed(0))
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(103))
    assert {len(p) for p in parts} == {10, 11}


# ------------------------------------------------------------------------------------------------- batches


def test_sample_batch_draws_distinct_own_indices():
    fed = load_federation("digits", 10, "dirichlet", 0.1, seed=2)
    sizes = [len(ix) for ix in fed.client_indices]
    assert min(sizes) < 64 < max(sizes)  # exercises both short and full batches
    gen = fed.generator(0)
    covered = [set() for _ in sizes]
    for _ in range(40):
        idx, mask = fed.sample_batch(64, gen)
        assert idx.shape == mask.shape == (10, 64)
        for k, ix in enumerate(fed.client_indices):
            own = set(ix.tolist())
            valid = idx[k][mask[k]].tolist()
            assert len(valid) == min(64, sizes[k]) == len(set(valid))
            assert set(idx[k].tolist()) <= own
            assert mask[k].tolist() == [True] * len(valid) + [False] * (64 - len(valid))
            covered[k].update(valid)
    assert all(len(c) == n for c, n in zip(covered, sizes, strict=True))  # every sample gets drawn
    again = fed.sample_batch(64, fed.generator(0))[0]
    assert torch.equal(again, fed.sample_batch(64, fed.generator(0))[0])


def test_load_federation_rejects_bad_names():
    with pytest.raises(ValueError, match="valid: digits, femnist, cifar10"):
        load_federation("mnist", 10)
    with pytest.raises(ValueError, match="'iid', 'dirichlet'"):
        load_federation("digits", 10, "natural")
    with pytest.raises(ValueError, match="natural"):
        load_federation("femnist", 10, "iid")
    with pytest.raises(ValueError, match="must be > 0"):
        load_federation("digits", 10, "dirichlet", dirichlet_alpha=-1)
