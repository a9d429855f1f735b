"""Federated datasets: real loaders (torchvision CIFAR-10 on tiny files, LEAF FEMNIST, digits), partitions,
batch sampling, augmentation and label flipping, each checked against an independent expectation."""

import hashlib
import io
import json
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF

from prodigy_core import data
from prodigy_core.config import RunConfig
from prodigy_core.data import (
    CIFAR10_CLASSES,
    CIFAR10_MEAN,
    CIFAR10_STD,
    DIGITS_MEAN,
    DIGITS_STD,
    DataError,
    _read_digits,
    decode_cifar10_jpeg,
    default_femnist_dir,
    dirichlet_split,
    dirichlet_split_numpy,
    eligible_writers,
    iid_split,
    iid_split_numpy,
    leaf_writer_counts,
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
    gen = fed.generators(0)
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
    assert "--from" in message  # the offline alternative: the JPEG copy


# ------------------------------------------------------------------------------------ CIFAR-10, JPEG copy


CLASSES = CIFAR10_CLASSES


def pillow_decode(content: bytes) -> torch.Tensor:
    """The reference: Pillow's own decode of one file, as (3, 32, 32) uint8."""
    from PIL import Image

    array = np.asarray(Image.open(io.BytesIO(content)).convert("RGB"))
    return torch.from_numpy(array.copy()).permute(2, 0, 1)


def full_digest(path: Path) -> str:
    """SHA-256 over a decoded file's train images, train labels, test images and test labels, written out
    here from the stored arrays' bytes (what a decoded copy's data source names)."""
    arrays = torch.load(path, weights_only=True)
    splits = [arrays[f"{split}_{kind}"] for split in ("train", "test") for kind in ("images", "labels")]
    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in splits)).hexdigest()


def digest12(path: Path) -> str:
    return full_digest(path)[:12]


def test_cifar10_jpeg_folder_decodes_with_labels_in_class_order(tmp_path, jpeg_folder):
    source = jpeg_folder(tmp_path / "jpeg", per_class=2)
    path = decode_cifar10_jpeg(source, tmp_path / "data", per_class=2, progress=False)
    assert path == tmp_path / "data" / "cifar10-jpeg" / "cifar10-jpeg-uint8.pt"
    assert not [p for p in path.parent.iterdir() if p != path]  # atomic write: no temporary file left
    fed = load_federation("cifar10", 2, "iid", data_dir=tmp_path / "data")
    assert fed.source == f"cifar10-jpeg-first-2-2-{digest12(path)}" and fed.train_images.dtype == torch.uint8
    assert fed.train_labels.tolist() == [c for c in range(10) for _ in range(2)]
    # the test set is read in the stated fixed order: torch.randperm(n) under seed 0, classes interleaved
    test_order = torch.randperm(20, generator=torch.Generator().manual_seed(0)).tolist()
    assert fed.test_labels.tolist() == [test_order[j] // 2 for j in range(20)]
    for split, images in (("train", fed.train_images), ("test", fed.test_images)):
        for row, (cls, i) in enumerate((c, i) for c in CLASSES for i in range(2)):
            expected = pillow_decode((source / split / cls / f"{i:04d}.jpg").read_bytes())
            at = test_order.index(row) if split == "test" else row
            assert torch.equal(images[at], expected), (split, cls, i)


def _single_class_batches(fed, batch_size: int) -> list[int]:
    return [i for i, (_, y) in enumerate(fed.test_batches(batch_size)) if y.unique().numel() == 1]


def test_no_evaluation_batch_of_either_variant_is_one_class(tmp_path, jpeg_folder):
    from prodigy_core.evaluation import eval_settings
    from prodigy_core.names import VARIANTS

    source = jpeg_folder(tmp_path / "jpeg", per_class=20)  # stored class by class, 20 per class
    decode_cifar10_jpeg(source, tmp_path / "data", per_class=20, progress=False)
    feds = [load_federation("cifar10", 2, "iid", data_dir=tmp_path / "data"), load_federation("digits", 10)]
    for fed in feds:
        for variant in VARIANTS:
            batch_size = eval_settings(RunConfig(variant=variant))[1]  # 1000, and the authors' 64
            assert _single_class_batches(fed, batch_size) == [], (fed.name, variant)


def test_authors_numbers_move_when_the_test_set_is_class_sorted():
    """The reason for the interleaved order: in training mode each batch's BatchNorm statistics remove a
    one-class batch's own mean, so the same network scores differently on the class-sorted test set."""
    import dataclasses

    from prodigy_core.evaluation import eval_settings, evaluate
    from prodigy_core.models import make_model

    torch.manual_seed(0)
    fed = load_federation("digits", 1, "iid")
    model = make_model("digits")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = fed.normalise(fed.train_images), fed.train_labels
    for step in range(60):  # a few epochs of plain training: a network that has learnt the task
        idx = torch.arange(step * 64, step * 64 + 64) % len(y)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    order = fed.test_labels.argsort(stable=True)
    sorted_fed = dataclasses.replace(
        fed, test_images=fed.test_images[order], test_labels=fed.test_labels[order]
    )
    assert max(y.unique().numel() for _, y in sorted_fed.test_batches(64)) <= 3  # ~36 test images a class
    train_mode, batch_size = eval_settings(RunConfig(variant="authors"))
    torch.manual_seed(1)
    interleaved = evaluate(model, fed, batch_size, train_mode)
    torch.manual_seed(1)
    class_sorted = evaluate(model, sorted_fed, batch_size, train_mode)
    # measured: 96.4% / loss 0.150 interleaved, 95.3% / 0.180 class-sorted
    assert interleaved[0] > 80 and class_sorted[0] < interleaved[0], (interleaved, class_sorted)
    assert class_sorted[1] > 1.1 * interleaved[1], (interleaved, class_sorted)


def test_cifar10_jpeg_wrong_counts_classes_or_sizes_are_clear_errors(tmp_path, jpeg_folder):
    source = jpeg_folder(tmp_path / "small", per_class=1)
    with pytest.raises(DataError, match=r"train/airplane has 1 JPEG files, expected 5,000"):
        decode_cifar10_jpeg(source, tmp_path / "data", progress=False)
    nine = jpeg_folder(tmp_path / "nine", per_class=1, classes=CLASSES[:9])
    with pytest.raises(DataError, match="expected the 10 CIFAR-10 class folders"):
        decode_cifar10_jpeg(nine, tmp_path / "data", per_class=1, progress=False)
    big = jpeg_folder(tmp_path / "big", per_class=1, size=40)
    with pytest.raises(DataError, match=r"train/airplane/0000.jpg is \(40, 40\), not 32x32"):
        decode_cifar10_jpeg(big, tmp_path / "data", per_class=1, progress=False)
    with pytest.raises(DataError, match="does not exist"):
        decode_cifar10_jpeg(tmp_path / "nowhere.tar.gz", tmp_path / "data", progress=False)
    assert not (tmp_path / "data" / "cifar10-jpeg" / "cifar10-jpeg-uint8.pt").exists()


def test_cifar10_binary_batches_come_before_the_jpeg_copy(cifar_root, jpeg_folder):
    root, batches = cifar_root
    path = decode_cifar10_jpeg(jpeg_folder(root / "jpeg", per_class=1), root, per_class=1, progress=False)
    fed = load_federation("cifar10", 2, "iid", data_dir=root)
    assert fed.source == "cifar10-binary" and len(fed.train_labels) == 5 * CIFAR_PER_BATCH
    part = f"cifar10-jpeg-first-1-1-{digest12(path)}"
    fed = load_federation("cifar10", 2, "iid", data_dir=root, source=part)
    assert fed.source == part and len(fed.train_labels) == 10
    from prodigy_core.config import RunConfig

    binary = RunConfig(dataset="cifar10", data_dir=str(root))
    jpeg = binary.replace(data_source=part)
    assert binary.resolved().data_source == "cifar10-binary"
    assert binary.key() == binary.replace(data_source="cifar10-binary").key() != jpeg.key()


def test_a_jpeg_copy_decoded_in_part_never_shares_the_whole_copys_key(tmp_path, jpeg_folder):
    """decode_cifar10_jpeg(per_class=k) (tests, or a quick look) where the whole copy is read: its runs are
    keyed `cifar10-jpeg-first-k-k-<digest>`, and a run keyed on the whole copy refuses it in one line instead
    of training on 20 images under the whole copy's key."""
    from prodigy_core.config import ConfigError, RunConfig

    root = tmp_path / "data"
    path = decode_cifar10_jpeg(jpeg_folder(tmp_path / "jpeg", per_class=2), root, per_class=2, progress=False)
    config = RunConfig(
        dataset="cifar10", n_clients=2, n_byzantine=0, defense="none", distribution="iid", data_dir=str(root)
    )
    digest = digest12(path)
    assert config.resolved().data_source == f"cifar10-jpeg-first-2-2-{digest}"
    assert config.key() != config.replace(data_source="cifar10-jpeg").key()
    assert (
        data.source_label(f"cifar10-jpeg-first-2-2-{digest}")
        == f"CIFAR-10 (JPEG copy, its first 2 train / 2 test images per class, {digest})"
    )
    part = rf"CIFAR-10 \(JPEG copy, its first 2 train / 2 test images per class, {digest}\)"
    with pytest.raises(DataError, match=rf"holds {part}, not the run's data_source=cifar10-jpeg;"):
        load_federation("cifar10", 2, "iid", data_dir=root, source="cifar10-jpeg")
    # the whole copy's counts (faked by repeating the part's labels) make the whole copy's source
    whole = [[5000] * 10, [1000] * 10]
    assert data._jpeg_source(whole) == "cifar10-jpeg" and data._jpeg_source([[2] * 10, [2] * 10]).endswith(
        "2-2"
    )
    assert data._jpeg_source([[2] * 9 + [3], [2] * 10]) == "cifar10-jpeg"  # unequal: loading says so
    for valid in (f"cifar10-jpeg-first-2-2-{digest}", "cifar10-jpeg", f"cifar10-jpeg-{digest}"):
        RunConfig(dataset="cifar10", data_source=valid).validate()
    short = f"cifar10-jpeg-{digest[:6]}"
    for invalid in (f"cifar10-jpeg-first-0-2-{digest}", "cifar10-jpeg-first-2-2", short):
        with pytest.raises(ConfigError, match="cifar10-jpeg-first-<train>-<test>-<digest>"):
            RunConfig(dataset="cifar10", data_source=invalid).validate()


def test_other_jpeg_pixels_never_share_the_reference_key(tmp_path, jpeg_folder, monkeypatch, capsys):
    """Two whole copies with the same counts share the name `cifar10-jpeg` only when their decoded pixels
    and labels are the reference's (CIFAR10_JPEG_DIGEST): one changed JPEG file (another archive, or a
    Pillow that rounds otherwise) names the copy by its own digest, and a run keyed on the reference refuses
    it. "Whole" is 2 images per class here, and the reference is copy A's digest, computed by hand."""
    from PIL import Image

    from prodigy_core.config import RunConfig

    monkeypatch.setattr(data, "CIFAR10_PER_CLASS", {"train": 2, "test": 2})
    source_a = jpeg_folder(tmp_path / "a", per_class=2)
    source_b = jpeg_folder(tmp_path / "b", per_class=2)
    other = np.full((32, 32, 3), 128, dtype=np.uint8)
    Image.fromarray(other).save(source_b / "test" / "frog" / "0001.jpg", quality=75)  # one image differs
    root_a, root_b = tmp_path / "data_a", tmp_path / "data_b"
    path_a = decode_cifar10_jpeg(source_a, root_a, progress=False)
    path_b = decode_cifar10_jpeg(source_b, root_b, progress=False)
    assert digest12(path_a) != digest12(path_b)
    monkeypatch.setattr(data, "CIFAR10_JPEG_DIGEST", full_digest(path_a))
    assert data.jpeg_copy_source(root_a) == "cifar10-jpeg"
    assert data.jpeg_copy_source(root_b) == f"cifar10-jpeg-{digest12(path_b)}"
    assert data.source_label(f"cifar10-jpeg-{digest12(path_b)}") == (
        f"CIFAR-10 (JPEG copy, decoded to other pixels: {digest12(path_b)})"
    )
    a = RunConfig(dataset="cifar10", n_clients=2, n_byzantine=0, defense="none", distribution="iid",
                  data_dir=str(root_a))  # fmt: skip
    b = a.replace(data_dir=str(root_b))
    assert a.resolved().data_source == "cifar10-jpeg" and a.key() != b.key()
    assert load_federation("cifar10", 2, "iid", data_dir=root_b).source == f"cifar10-jpeg-{digest12(path_b)}"
    other_label = rf"CIFAR-10 \(JPEG copy, decoded to other pixels: {digest12(path_b)}\)"
    with pytest.raises(DataError, match=rf"holds {other_label}, not the run's data_source=cifar10-jpeg;"):
        load_federation("cifar10", 2, "iid", data_dir=root_b, source="cifar10-jpeg")
    # `prodigy-fl data cifar10 --from` says so when it decodes other pixels, and only then
    from prodigy_core.cli import main

    for source, note in ((source_a, None), (source_b, f"keyed data_source=cifar10-jpeg-{digest12(path_b)}")):
        assert main(["data", "cifar10", str(tmp_path / f"cli_{source.name}"), "--from", str(source)]) == 0
        out = capsys.readouterr().out
        assert ("note: not the reference decode's pixels" in out) == (note is not None)
        assert (note or "") in out


@pytest.mark.slow  # reads the whole 60,000-file archive
def test_cifar10_jpeg_archive_subset_matches_pillow(cifar10_jpeg_archive, tmp_path):
    path = decode_cifar10_jpeg(cifar10_jpeg_archive, tmp_path, per_class=3, progress=False)
    arrays = torch.load(path, weights_only=True)
    assert arrays["train_images"].shape == arrays["test_images"].shape == (30, 3, 32, 32)
    wanted = {f"{split}/{cls}/{i:04d}.jpg" for split in ("train", "test") for cls in ("bird", "truck")
              for i in range(3)}  # fmt: skip
    with tarfile.open(cifar10_jpeg_archive) as tar:
        members = {"/".join(m.name.split("/")[-3:]): m for m in tar if m.isfile()}
        found = {name: tar.extractfile(members[name]).read() for name in wanted if name in members}
    assert len(found) == len(wanted)
    for name, content in found.items():
        split, cls, file = name.split("/")
        row = CLASSES.index(cls) * 3 + int(file[:4])
        assert torch.equal(arrays[f"{split}_images"][row], pillow_decode(content)), name
        assert arrays[f"{split}_labels"][row] == CLASSES.index(cls)


@pytest.mark.slow
def test_cifar10_jpeg_archive_decodes_whole_through_the_cli(cifar10_jpeg_archive, tmp_path, capsys):
    from prodigy_core.cli import main

    assert main(["data", "cifar10", str(tmp_path), "--from", str(cifar10_jpeg_archive)]) == 0
    out = capsys.readouterr().out
    assert "50,000 train and 10,000 test images" in out and "note:" not in out
    # this Pillow decodes the shared archive to the reference pixels, the ones `cifar10-jpeg` names
    assert full_digest(tmp_path / "cifar10-jpeg" / "cifar10-jpeg-uint8.pt") == data.CIFAR10_JPEG_DIGEST
    fed = load_federation("cifar10", 10, "dirichlet", data_dir=tmp_path)
    assert fed.source == "cifar10-jpeg"
    assert fed.train_images.shape == (50000, 3, 32, 32) and fed.test_images.shape == (10000, 3, 32, 32)
    assert fed.train_labels.bincount().tolist() == [5000] * 10
    assert fed.test_labels.bincount().tolist() == [1000] * 10
    assert _single_class_batches(fed, 64) == _single_class_batches(fed, 1000) == []  # read interleaved
    # the archive README's pixel statistics of the decoded training images
    x = fed.train_images.float().div(255)
    torch.testing.assert_close(x.mean((0, 2, 3)), torch.tensor([0.4913, 0.4821, 0.4465]), atol=1e-4, rtol=0)
    torch.testing.assert_close(x.std((0, 2, 3)), torch.tensor([0.2452, 0.2428, 0.2606]), atol=1e-4, rtol=0)


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


def read_leaf_counts(leaf: Path) -> dict[str, list[int]]:
    """The reference: {writer: [train, test]} counted from the samples of every JSON file."""
    counts: dict[str, list[int]] = {}
    for i, split in enumerate(("train", "test")):
        for path in sorted((leaf / split).glob("*.json")):
            for w, d in json.loads(path.read_text())["user_data"].items():
                counts.setdefault(w, [0, 0])[i] += len(d["y"])
    return counts


@pytest.mark.slow  # parses the 10-writer folder twice
def test_femnist_eligibility_counts_train_plus_test(femnist_dir):
    totals = {w: tr + te for w, (tr, te) in read_leaf_counts(femnist_dir).items()}
    k = sorted(totals.values())[5]  # about half of the 10 writers have fewer
    eligible = sorted(w for w, n in totals.items() if n >= k)
    assert 3 <= len(eligible) < 10
    assert eligible_writers(leaf_writer_counts(femnist_dir), k) == eligible
    fed = load_federation("femnist", 3, "natural", data_dir=femnist_dir, min_writer_samples=k)
    counts = read_leaf_counts(femnist_dir)
    assert [len(ix) for ix in fed.client_indices] == [counts[w][0] for w in eligible[:3]]
    with pytest.raises(DataError) as info:
        load_federation("femnist", 10, "natural", data_dir=femnist_dir, min_writer_samples=k)
    message = str(info.value)
    assert f"{len(eligible)} of its 10 writers have >= {k} samples (train + test), need n_clients=10" in (
        message
    )
    assert "preprocess.sh -s niid --sf 1.0 -k 350 -t sample" in message


def test_femnist_synthetic_eligibility_is_before_the_split(tmp_path):
    # w_a: 3 + 1 = 4 samples, w_b: 2 + 2 = 4, w_c: 3 + 0 = 3, w_d: 0 train (never a client)
    leaf = write_leaf(
        tmp_path, {"w_a": [1, 2, 3], "w_b": [4, 5], "w_c": [6, 7, 8], "w_d": []},
        {"w_a": [9], "w_b": [1, 2], "w_c": [], "w_d": [3, 4, 5, 6]},
    )  # fmt: skip
    counts = leaf_writer_counts(leaf)
    assert counts == {"w_a": (3, 1), "w_b": (2, 2), "w_c": (3, 0), "w_d": (0, 4)}
    assert eligible_writers(counts, 4) == ["w_a", "w_b"]
    assert eligible_writers(counts, 0) == ["w_a", "w_b", "w_c"]
    fed = load_federation("femnist", 2, "natural", data_dir=leaf, min_writer_samples=4)
    assert fed.train_labels.tolist() == [1, 2, 3, 4, 5] and fed.test_labels.tolist() == [9, 1, 2]


@pytest.mark.slow
def test_femnist_24_writer_folder_exact_counts(femnist24_dir):
    counts = read_leaf_counts(femnist24_dir)
    assert len(counts) == 24
    assert sum(tr for tr, _ in counts.values()) == 8165 and sum(te for _, te in counts.values()) == 920
    assert min(tr for tr, _ in counts.values()) == 315 and max(tr for tr, _ in counts.values()) == 369
    assert all(tr + te >= 350 for tr, te in counts.values())  # LEAF's -k 350
    assert {w: list(c) for w, c in leaf_writer_counts(femnist24_dir).items()} == counts
    fed = load_federation("femnist", 20, "natural", data_dir=femnist24_dir, min_writer_samples=350)
    first = sorted(counts)[:20]  # the authors' loader: the first N writers in sorted order
    assert [len(ix) for ix in fed.client_indices] == [counts[w][0] for w in first]
    assert len(fed.test_labels) == sum(counts[w][1] for w in first)
    # the writers, their counts and the SHA-256 of the folder's one train and one test file
    files = [
        hashlib.sha256(next((femnist24_dir / s).glob("*.json")).read_bytes()).hexdigest()
        for s in ("train", "test")
    ]
    blob = json.dumps([[[w, *counts[w]] for w in first], [[files[0]], [files[1]]]], separators=(",", ":"))
    assert fed.source == "femnist-leaf-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def test_femnist_folder_preference_and_writer_keys(tmp_path, monkeypatch):
    two = write_leaf(tmp_path / "two", {"w_a": [1], "w_b": [2]}, {"w_a": [3], "w_b": [4]})
    four = write_leaf(tmp_path / "four", {f"w_{c}": [1] for c in "cdef"}, {f"w_{c}": [2] for c in "cdef"})
    monkeypatch.setattr("prodigy_core.data.SHARED_DATA_DIR", tmp_path / "no-shared")
    monkeypatch.setenv("PRODIGY_FEMNIST_DIR", os.pathsep.join([str(two), str(four)]))
    assert default_femnist_dir() == two and default_femnist_dir(2) == two
    assert default_femnist_dir(3) == four and default_femnist_dir(9) == four  # the most writers
    assert load_federation("femnist", 3, "natural").n_clients == 3  # found in `four`

    from prodigy_core.config import RunConfig

    on_two = RunConfig(dataset="femnist", distribution="natural", n_clients=2, n_byzantine=0, defense="none")
    on_four = on_two.replace(data_dir=str(four))
    assert on_two.resolved().data_source != on_four.resolved().data_source  # other writers, other key
    assert on_two.key() != on_four.key()
    assert on_two.key() == on_two.replace(data_dir=str(two)).key()  # the folder itself is not in the key
    with pytest.raises(DataError, match="not the run's data_source"):
        load_federation("femnist", 2, "natural", data_dir=four, source=on_two.resolved().data_source)


def test_femnist_source_names_the_samples_not_only_the_writers(tmp_path):
    """The same writers with the same counts but other samples (LEAF's split under another seed) get another
    source; a file that holds none of the run's writers, the files' names and the folder do not count."""
    from prodigy_core.data import resolve_data_source

    def source(leaf: Path, n: int = 2) -> str:
        resolved = resolve_data_source("femnist", leaf, n)
        assert resolved == load_federation("femnist", n, "natural", data_dir=leaf).source  # one formula
        return resolved

    base = source(write_leaf(tmp_path / "a", {"w_a": [1, 2], "w_b": [3]}, {"w_a": [4], "w_b": [5]}))
    resplit = write_leaf(tmp_path / "b", {"w_a": [1, 4], "w_b": [3]}, {"w_a": [2], "w_b": [5]})
    assert leaf_writer_counts(resplit) == leaf_writer_counts(tmp_path / "a")  # the old hash's whole input
    assert source(resplit) != base
    moved = write_leaf(tmp_path / "c", {"w_a": [1, 2], "w_b": [3]}, {"w_a": [4], "w_b": [5]})
    for split in ("train", "test"):
        (moved / split / "part_1.json").rename(moved / split / "renamed.json")
        (moved / split / "unused.json").write_text(
            json.dumps(
                {"users": ["w_z"], "num_samples": [1], "user_data": {"w_z": {"x": [[0.0] * 784], "y": [9]}}}
            )
        )
    # w_z (sorted last) is not among the first 2 writers: its files do not count
    assert source(moved) == base
    assert source(moved, 3) != source(tmp_path / "a", 2)


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


def test_femnist_json_is_parsed_once_per_version_and_a_label_flip_never_reaches_the_next_run(
    tmp_path, monkeypatch
):
    leaf = write_leaf(tmp_path, {"w_a": [1, 2], "w_b": [3]}, {"w_a": [4], "w_b": [5]})
    parsed = []
    read_split = data._read_leaf_split
    monkeypatch.setattr(data, "_read_leaf_split", lambda d: parsed.append(d.name) or read_split(d))
    first = load_federation("femnist", 2, "natural", data_dir=leaf)
    first.flip_labels([0])  # an LF run: y' = 61 - y on client 0
    assert first.train_labels.tolist() == [60, 59, 3]
    second = load_federation("femnist", 2, "natural", data_dir=leaf)
    assert parsed == ["train", "test"]  # the second run of the setting parsed nothing
    assert second.train_labels.tolist() == [1, 2, 3] and second.test_labels.tolist() == [4, 5]
    # An edited file (another size) is a new version: parsed again, its new labels read.
    content = json.loads((leaf / "train" / "part_1.json").read_text())
    content["user_data"]["w_b"]["y"] = [13]
    (leaf / "train" / "part_1.json").write_text(json.dumps(content) + " ")
    third = load_federation("femnist", 2, "natural", data_dir=leaf)
    assert parsed == ["train", "test"] * 2 and third.train_labels.tolist() == [1, 2, 13]


def test_femnist_malformed_leaf_directories(tmp_path):
    (tmp_path / "only_train" / "train").mkdir(parents=True)
    with pytest.raises(DataError, match="only_train.*no test/"):
        load_federation("femnist", 1, "natural", data_dir=tmp_path / "only_train")
    leaf = write_leaf(tmp_path / "differ", {"w_a": [1], "w_b": [2]}, {"w_a": [3], "w_z": [4]})
    with pytest.raises(DataError, match="differ.*train and test writers differ"):
        load_federation("femnist", 1, "natural", data_dir=leaf)
    leaf = write_leaf(tmp_path / "small", {"w_a": [1]}, {"w_a": [2]})
    with pytest.raises(DataError, match=r"small: 1 of its 1 writers have >= 1 samples .* need n_clients=2"):
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
    gen = a.generators(0)
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
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        dirichlet_split(class_labels(), 10, 0.0, torch.Generator())
    with pytest.raises(ValueError, match="dirichlet_alpha=inf must be a finite number > 0"):
        dirichlet_split(class_labels(), 10, float("inf"), torch.Generator())
    with pytest.raises(ValueError, match="at least 10"):
        dirichlet_split(class_labels(5), 10, 0.1, torch.Generator())


def test_iid_split_is_a_balanced_partition():
    parts = iid_split(103, 10, torch.Generator().manual_seed(0))
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(103))
    assert {len(p) for p in parts} == {10, 11}


# ------------------------------------------------------------------------- partitions, the authors' variant


def authors_recipe(labels: np.ndarray, n_clients: int, alpha: float, seed: int) -> list[list[int]]:
    """The NIID-Bench split as the authors' code draws it, written here from the recipe on numpy's global
    RNG (main.py: np.random.seed(seed), then datasets.py find_distribution_map): per class 0..9, shuffle the
    class's indices, draw Dirichlet proportions, zero those of clients already at >= n/N, renormalise, cut
    at (cumsum * n_c).astype(int)[:-1]; redraw until every client has >= 10; shuffle each client's list."""
    saved = np.random.get_state()
    np.random.seed(seed)
    try:
        n, smallest = len(labels), 0
        while smallest < 10:
            clients = [[] for _ in range(n_clients)]
            for k in range(10):
                members = np.where(labels == k)[0]
                np.random.shuffle(members)
                share = np.random.dirichlet(np.repeat(alpha, n_clients))
                share = np.array(
                    [q if len(c) < n / n_clients else 0.0 for q, c in zip(share, clients, strict=True)]
                )
                ends = (np.cumsum(share / share.sum()) * len(members)).astype(int)
                starts = np.concatenate([[0], ends[:-1]])
                ends[-1] = len(members)
                clients = [c + members[a:b].tolist() for c, a, b in zip(clients, starts, ends, strict=True)]
            smallest = min(len(c) for c in clients)
        for c in clients:
            np.random.shuffle(c)  # a list, as theirs: the same draws as shuffling an array
        return clients
    finally:
        np.random.set_state(saved)


def cifar_like_labels() -> np.ndarray:
    """50,000 labels, 5,000 per class, interleaved (a fixed shuffle), like CIFAR-10's training set."""
    return np.random.RandomState(2024).permutation(np.repeat(np.arange(10), 5000))


@pytest.mark.parametrize("n_clients", [10, 20])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_authors_dirichlet_split_is_numpys_draw_after_np_random_seed(n_clients, seed):
    labels = cifar_like_labels()
    expected = authors_recipe(labels, n_clients, 0.1, seed)
    before = np.random.get_state()[1].copy()
    parts = dirichlet_split_numpy(torch.from_numpy(labels), n_clients, 0.1, seed)
    assert np.array_equal(np.random.get_state()[1], before)  # numpy's global state is left alone
    assert [len(p) for p in parts] == [len(c) for c in expected]
    assert [p.tolist() for p in parts] == expected  # the same indices, in the same (shuffled) order
    assert all(p.dtype == torch.int64 for p in parts)
    assert sorted(torch.cat(parts).tolist()) == list(range(len(labels)))
    # the paper variant's torch draw is another split
    torch_parts = dirichlet_split(
        torch.from_numpy(labels), n_clients, 0.1, torch.Generator().manual_seed(seed)
    )
    assert [len(p) for p in torch_parts] != [len(p) for p in parts]


def test_authors_split_reaches_clients_under_64_samples_at_n30_as_issue_25_says():
    """With the authors' split a client at N=30 has fewer than 64 samples (a batch) in each of seeds 0-2."""
    labels = torch.from_numpy(cifar_like_labels())
    assert all(min(len(p) for p in dirichlet_split_numpy(labels, 30, 0.1, s)) < 64 for s in (0, 1, 2))


def test_authors_iid_split_is_numpys_permutation():
    saved = np.random.get_state()
    np.random.seed(5)
    expected = [part.tolist() for part in np.array_split(np.random.permutation(103), 10)]
    np.random.set_state(saved)
    assert [p.tolist() for p in iid_split_numpy(103, 10, 5)] == expected


def test_load_federation_splits_by_variant(cifar_root):
    root, _ = cifar_root
    # paper (the default): the torch split, unchanged; rng as load_federation uses it (digits' split first)
    rng = torch.Generator().manual_seed(3)
    train_y = _read_digits(rng)[1]
    expected = dirichlet_split(train_y, 6, 0.5, rng)
    for fed in (
        load_federation("digits", 6, "dirichlet", 0.5, seed=3),
        load_federation("digits", 6, "dirichlet", 0.5, seed=3, variant="paper"),
    ):
        assert [p.tolist() for p in fed.client_indices] == [p.tolist() for p in expected]
    # authors: numpy's draw on the training labels as read (digits, and CIFAR-10 through torchvision)
    fed = load_federation("digits", 6, "dirichlet", 0.5, seed=3, variant="authors")
    assert [p.tolist() for p in fed.client_indices] == authors_recipe(fed.train_labels.numpy(), 6, 0.5, 3)
    cifar = load_federation("cifar10", 2, "dirichlet", 0.5, seed=1, data_dir=root, variant="authors")
    assert [p.tolist() for p in cifar.client_indices] == authors_recipe(cifar.train_labels.numpy(), 2, 0.5, 1)
    iid = load_federation("digits", 4, "iid", seed=2, variant="authors")
    assert [p.tolist() for p in iid.client_indices] == [
        p.tolist() for p in iid_split_numpy(len(train_y), 4, 2)
    ]
    with pytest.raises(ValueError, match="variant='author' is unknown; valid: paper, authors"):
        load_federation("digits", 4, "iid", variant="author")


def test_a_runs_federation_follows_its_variant():
    from prodigy_core import training
    from prodigy_core.config import RunConfig

    def split(variant):
        cfg = RunConfig(
            dataset="digits",
            n_clients=6,
            n_byzantine=2,
            distribution="dirichlet",
            dirichlet_alpha=0.1,
            seed=1,
            variant=variant,
        )
        fed = training.run_federation(cfg.resolved(), torch.device("cpu"))
        return fed, [p.tolist() for p in fed.client_indices]

    fed, authors = split("authors")
    assert authors == authors_recipe(fed.train_labels.numpy(), 6, 0.1, 1)  # data_seed = seed
    fed, paper = split("paper")
    rng = torch.Generator().manual_seed(1)
    _read_digits(rng)
    assert paper == [p.tolist() for p in dirichlet_split(fed.train_labels, 6, 0.1, rng)]


# ------------------------------------------------------------------------------------------------- batches


def test_sample_batch_draws_distinct_own_indices():
    fed = load_federation("digits", 10, "dirichlet", 0.1, seed=2)
    sizes = [len(ix) for ix in fed.client_indices]
    assert min(sizes) < 64 < max(sizes)  # exercises both short and full batches
    gen = fed.generators(0)
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
    again = fed.sample_batch(64, fed.generators(0))[0]
    assert torch.equal(again, fed.sample_batch(64, fed.generators(0))[0])


def test_load_federation_rejects_bad_names():
    with pytest.raises(ValueError, match="valid: digits, femnist, cifar10"):
        load_federation("mnist", 10)
    with pytest.raises(ValueError, match="'natural' is not valid for digits; valid: iid, dirichlet$"):
        load_federation("digits", 10, "natural")
    with pytest.raises(ValueError, match="distribution='iid' is not valid for femnist; valid: natural$"):
        load_federation("femnist", 10, "iid")
    with pytest.raises(ValueError, match="dirichlet_alpha=-1 must be a finite number > 0"):
        load_federation("digits", 10, "dirichlet", dirichlet_alpha=-1)


@pytest.mark.parametrize(
    "args, message",
    [({"dirichlet_alpha": float("inf")}, r"dirichlet_alpha=inf must be a finite number > 0 \(.*"
                                         r"distribution='iid' the limit\)"),
     ({"dirichlet_alpha": "0.1"}, r"dirichlet_alpha='0.1' must be a finite number > 0"),
     ({"n_clients": 10.0}, r"n_clients=10.0 must be a whole number >= 1"),
     ({"n_clients": 0}, r"n_clients=0 must be a whole number >= 1"),
     ({"seed": 1.5}, r"seed=1.5 must be a whole number$")],
)  # fmt: skip
@pytest.mark.parametrize("variant", ["paper", "authors"])
def test_load_federation_names_a_split_argument_of_the_wrong_type(args, message, variant):
    """They met torch errors (`IntArrayRef contains an int that cannot be represented as a SymInt` for an
    infinite alpha, `tensor_split() received an invalid combination of arguments`, `manual_seed expected a
    long`) or `'>' not supported between 'str' and 'int'`."""
    call = {"n_clients": 10, "distribution": "dirichlet", **args}
    with pytest.raises(ValueError, match=message):
        load_federation("digits", variant=variant, **call)
    fed = load_federation("digits", 10, "dirichlet", 0.5, seed=np.int64(3), variant=variant)  # numpy int ok
    assert len(fed.client_indices) == 10


def test_the_papers_table2_test_set_is_793_samples_none_of_20_of_our_writers_make(femnist24_dir):
    """docs/semantics.md, row "FEMNIST writers": every 3-seed mean of Table II is a count of correct test
    samples out of 3 x 793 (and 793 is the only size up to 1,585 for which all 84 are), its collapse value
    3.78 is 30 of 793 (the class-0 share a NaN network scores), while no 20 of the 24 published writers hold
    793 test samples or 30 of class 0."""
    import itertools

    from prodigy_core.results import paper_results

    paper = paper_results()
    means = paper[paper["table"] == "femnist_n20"]["accuracy_mean"].tolist()

    def counts(size: int) -> bool:  # each mean is round(100 k / (3 size), 2) for a whole k
        return all(any(round(100 * k / (3 * size), 2) == m for k in range(round(m * 3 * size / 100) - 1,
                                                                          round(m * 3 * size / 100) + 2))
                   for m in means)  # fmt: skip

    assert len(means) == 84 and [t for t in range(100, 1586) if counts(t)] == [793]
    assert round(100 * 30 / 793, 2) == 3.78 and 3.78 in means
    test = read_leaf_labels(femnist24_dir / "test")
    sizes = {w: len(y) for w, y in test.items()}
    zeros = {w: sum(label == 0 for label in y) for w, y in test.items()}
    assert len(sizes) == 24
    assert all(sum(sizes[w] for w in c) < 793 for c in itertools.combinations(sizes, 20))
    assert sum(zeros.values()) < 30  # all 24 writers together hold fewer zeros than the paper's test set
    first = sorted(sizes)[:20]  # ours: the loader's first 20
    assert (sum(sizes[w] for w in first), sum(zeros[w] for w in first)) == (772, 19)


def read_leaf_labels(folder: Path) -> dict[str, list[int]]:
    """{writer: labels} of every JSON file in a LEAF split folder."""
    labels: dict[str, list[int]] = {}
    for path in sorted(folder.glob("*.json")):
        for w, d in json.loads(path.read_text())["user_data"].items():
            labels.setdefault(w, []).extend(d["y"])
    return labels


# ---------------------------------------- scripts/rekey_femnist_records.py: records keyed on the old FEMNIST
# source (writers and counts only) get the source their folder makes today and the key a new run makes.


@pytest.fixture(scope="module")
def rekey(scripts):
    return scripts("scripts/rekey_femnist_records.py")


def old_source(leaf, writers) -> str:
    """The source as the code before 2026-11-28 made it, written out again here."""
    counts = leaf_writer_counts(leaf)
    blob = json.dumps([[w, *counts[w]] for w in writers], separators=(",", ":"))
    return "femnist-leaf-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def rekey_record(config: RunConfig, accuracy: float) -> dict:
    return {"key": config.key(), "experiment": "t", "status": "done", "config": config.to_dict(),
            "final_accuracy": accuracy, "accuracy_curve": [[1, accuracy]]}  # fmt: skip


@pytest.fixture
def old_records(tmp_path, monkeypatch):
    """A LEAF folder of three writers and a results folder: two old records of its first two writers (one
    per defense), one of its three writers, one of another folder's writers, and one of its first two
    writers keyed at an older revision of the authors variant (no longer current)."""
    leaf = write_leaf(
        tmp_path / "leaf", {"w_a": [1, 2], "w_b": [3], "w_c": [4]}, {w: [5] for w in ("w_a", "w_b", "w_c")}
    )
    base = RunConfig(
        dataset="femnist", distribution="natural", n_clients=2, n_byzantine=0, rounds=1, defense="none"
    )
    olds = [
        base.replace(data_source=old_source(leaf, ["w_a", "w_b"])),
        base.replace(data_source=old_source(leaf, ["w_a", "w_b"]), defense="nnm+median"),
        base.replace(data_source=old_source(leaf, ["w_a", "w_b", "w_c"]), n_clients=3),
        base.replace(data_source="femnist-leaf-0123456789ab"),  # made from some other folder
    ]
    results = tmp_path / "results"
    (results / "t").mkdir(parents=True)
    for i, c in enumerate(olds):
        (results / "t" / f"{c.key()}.json").write_text(json.dumps(rekey_record(c, 10.0 + i)))
    stale = olds[0].replace(variant="authors")
    with monkeypatch.context() as m:
        m.setattr("prodigy_core.config.AUTHORS_REVISION", -1)
        stale_key = stale.key()
        (results / "t" / f"{stale_key}.json").write_text(json.dumps(rekey_record(stale, 14.0)))
    return leaf, results, olds, stale_key


def rekeyed_keys(leaf, olds, stale_key) -> dict[float, str]:
    """{accuracy: the key a new run of that record's config makes on `leaf`}; the last two unchanged."""
    today = [c.replace(data_source=None, data_dir=str(leaf)) for c in olds[:3]]
    assert all(t.resolved().data_source != c.data_source for t, c in zip(today, olds, strict=False))
    new = [t.key() for t in today]
    return {10.0: new[0], 11.0: new[1], 12.0: new[2], 13.0: olds[3].key(), 14.0: stale_key}


def test_rekey_a_results_folder_to_the_keys_new_runs_make(rekey, old_records, capsys):
    leaf, results, olds, stale_key = old_records
    before = sorted(p.name for p in (results / "t").glob("*.json"))
    assert rekey.main([str(results), "--leaf", str(leaf), "--dry-run"]) == 0
    assert sorted(p.name for p in (results / "t").glob("*.json")) == before  # a dry run changes nothing
    assert rekey.main([str(results), "--leaf", str(leaf)]) == 0
    out = capsys.readouterr().out
    assert "3 record(s) rekeyed" in out, out
    assert f"left as it is: t/{olds[3].key()}.json" in out and f"left as it is: t/{stale_key}.json" in out
    from prodigy_core.data import resolve_data_source
    from prodigy_core.results import check_record

    records = [json.loads(p.read_text()) for p in (results / "t").glob("*.json")]
    assert {r["final_accuracy"]: r["key"] for r in records} == rekeyed_keys(leaf, olds, stale_key)
    for r in records:
        if r["final_accuracy"] < 13:  # rekeyed: valid records of current keys (the key, the name, the config)
            assert check_record(r, results / "t" / f"{r['key']}.json") is None
            assert r["data_source_rekeyed_from"] == olds[int(r["final_accuracy"]) - 10].data_source
            n = r["config"]["n_clients"]
            assert r["config"]["data_source"] == resolve_data_source("femnist", leaf, n)
        else:
            assert "data_source_rekeyed_from" not in r
    assert rekey.main([str(results), "--leaf", str(leaf)]) == 0  # a second pass finds nothing to do
    assert "0 record(s) rekeyed" in capsys.readouterr().out


def test_rekey_a_tarball_in_place_with_its_other_members(rekey, old_records, tmp_path):
    leaf, results, olds, stale_key = old_records
    tarball = tmp_path / "results.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(results / "t", arcname="results/t")
        (tmp_path / "log.txt").write_text("the window's log\n")
        tar.add(tmp_path / "log.txt", arcname="log.txt")
    assert rekey.main([str(tarball), "--leaf", str(leaf)]) == 0
    with tarfile.open(tarball) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
    assert members.pop("log.txt") == b"the window's log\n"
    rekeyed = {json.loads(v)["final_accuracy"]: k for k, v in members.items()}
    assert rekeyed == {a: f"results/t/{key}.json" for a, key in rekeyed_keys(leaf, olds, stale_key).items()}


def test_rekey_without_a_leaf_folder_is_one_line(rekey, tmp_path, capsys):
    assert rekey.main([str(tmp_path), "--leaf", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nowhere" in err
