"""Hostile inputs and faults, round 2 (issue 29): one regression test per row, each against an independent
expectation (the file system's state after the fault, an invariant, a rerun)."""

import contextlib
import errno
import json
import os
import signal
import warnings
from pathlib import Path

import pytest

from prodigy_core import cli, experiments, results, training
from prodigy_core.config import ConfigError, RunConfig
from prodigy_core.experiments import experiment_from_spec, run_grid

# A digits run of a second or less.
TINY = dict(dataset="digits", n_clients=6, n_byzantine=0, defense="average", attack="none", rounds=2,
            local_steps=1, batch_size=32, eval_every=2, checkpoint_every=1, device="cpu")  # fmt: skip
TINY_SET = [f"--set={k}={v}" for k, v in TINY.items()]


def tiny(**changes) -> RunConfig:
    return RunConfig(**{**TINY, **changes})


def one_error_line(err: str, *parts: str) -> None:
    """One `prodigy-fl: error: ...` line (after a progress bar, if one ran), no traceback."""
    lines = [
        line.partition("prodigy-fl: error: ")[2] for line in err.splitlines() if "prodigy-fl: error: " in line
    ]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(p in lines[0] for p in parts), err


# ------------------------------------------------------- 3: the record is written before the checkpoint goes


@pytest.fixture
def full_disk_for_records(monkeypatch):
    """Writing a finished run's record fails as on a full disk (failure records, checkpoints: not)."""
    real = results.write_json_atomic

    def write(path, obj):
        if path.name.endswith(".json") and not path.name.endswith(".failed.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, obj)

    monkeypatch.setattr(results, "write_json_atomic", write)
    return monkeypatch


def _resumed_from(monkeypatch) -> list[int]:
    """The round each later run starts from (0: from scratch, r: resumed from a checkpoint of round r)."""
    starts: list[int] = []
    real = training.start_run

    def spy(*args, **kwargs):
        st = real(*args, **kwargs)
        starts.append(st.start)
        return st

    monkeypatch.setattr(training, "start_run", spy)
    return starts


def test_run_keeps_its_checkpoint_when_the_record_cannot_be_written(tmp_path, full_disk_for_records, capsys):
    where = ["--results-dir", str(tmp_path)]
    ckpt = results.checkpoint_dir(tmp_path / "runs") / f"{tiny().key()}.pt"
    assert cli.main(["run", *TINY_SET, *where]) == 2
    one_error_line(capsys.readouterr().err, "No space left on device")
    assert ckpt.exists()  # the work is not lost
    full_disk_for_records.undo()
    starts = _resumed_from(full_disk_for_records)
    assert cli.main(["run", *TINY_SET, *where]) == 0
    assert starts == [1] and not ckpt.exists()  # resumed at round 1 of 2, then the checkpoint went
    assert results.stored_record(tmp_path / "runs", tiny().key()) is not None


@pytest.mark.parametrize("batch_runs", [1, 2])
def test_grid_keeps_checkpoints_when_the_records_cannot_be_written(
    tmp_path, full_disk_for_records, batch_runs
):
    spec = {"experiment": "seeds", "base": {**TINY, "engine": "batched"}, "seeds": [0, 1]}
    experiment = experiment_from_spec(spec)
    folder = tmp_path / "seeds"
    run_grid(experiment, results_dir=tmp_path, progress=False, batch_runs=batch_runs)
    ckpts = [results.checkpoint_dir(folder) / f"{c.key()}.pt" for c in experiment.configs]
    assert all(p.exists() for p in ckpts)
    assert all(results.failure_path(folder, c.key()).exists() for c in experiment.configs)
    full_disk_for_records.undo()
    starts = _resumed_from(full_disk_for_records)
    df = run_grid(experiment, results_dir=tmp_path, progress=False, batch_runs=batch_runs)
    assert starts == [1, 1] and len(df) == 2 and not any(p.exists() for p in ckpts)


# -------------------------------------------- 2, 10: FEMNIST writers validated on load, file and writer named

ROW = [0.5] * 784


def _leaf(root: Path, train_edit=None, test_edit=None) -> Path:
    """A valid LEAF folder of three writers (4 train and 2 test samples each), then edited: an edit gets
    the content of train/part_1.json (or test/...) as a dict and may change it or return a replacement."""
    for split, n, edit in (("train", 4, train_edit), ("test", 2, test_edit)):
        (root / split).mkdir(parents=True)
        (root / split / "part_0.json").write_text(
            json.dumps({"users": [], "num_samples": [], "user_data": {}})
        )
        writers = ["w_a", "w_b", "w_c"]
        data = {w: {"x": [ROW] * n, "y": [i % 62 for i in range(n)]} for w in writers}
        content = {"users": writers, "num_samples": [n] * 3, "user_data": data}
        replaced = edit(content) if edit is not None else None
        content = content if replaced is None else replaced
        (root / split / "part_1.json").write_text(json.dumps(content))
    return root


def _extra_x_row(c):
    c["user_data"]["w_b"]["x"].append(ROW)


def _short_row(c):
    c["user_data"]["w_b"]["x"][1] = ROW[:100]


def _label(value):
    def edit(c):
        c["user_data"]["w_b"]["y"][0] = value

    return edit


def _missing_user(c):
    del c["user_data"]["w_b"]


def _text_count(c):
    c["num_samples"][1] = "4"


def _nan_pixel(c):
    c["user_data"]["w_b"]["x"][2] = [float("nan")] * 784


BAD_LEAF = {
    "extra x row": (_extra_x_row, None, "train/part_1.json: writer w_b has 5 x rows but 4 labels"),
    "short row": (_short_row, None, "train/part_1.json: writer w_b: x row 1 has 100 values, not 784"),
    "label 500": (_label(500), None, "train/part_1.json: writer w_b: label 500 is not a class in 0..61"),
    "label 62": (_label(62), None, "writer w_b: label 62 is not a class in 0..61"),
    "label -1": (_label(-1), None, "writer w_b: label -1 is not a class in 0..61"),
    "label 1.5": (_label(1.5), None, "writer w_b: label 1.5 is not a class in 0..61"),
    "label text": (_label("3"), None, "writer w_b: label '3' is not a class in 0..61"),
    "nan pixel": (_nan_pixel, None, "train/part_1.json: writer w_b: x row 2 is not 784 finite numbers"),
    "missing user": (
        _missing_user,
        None,
        "train/part_1.json: writer w_b is listed in users but not in user_data",
    ),
    "text count": (_text_count, None, "train/part_1.json: num_samples of w_b is '4', not a count"),
    "test file a list": (None, lambda c: [], "test/part_1.json: a LEAF file is a JSON object"),
    "test label": (None, _label(99), "test/part_1.json: writer w_b: label 99 is not a class in 0..61"),
}


@pytest.mark.parametrize("case", list(BAD_LEAF))
def test_a_malformed_leaf_writer_is_one_error_naming_the_file_and_the_writer(tmp_path, capsys, case):
    from prodigy_core.data import DataError, load_federation

    train_edit, test_edit, message = BAD_LEAF[case]
    leaf = _leaf(tmp_path / "leaf", train_edit, test_edit)
    with pytest.raises(DataError) as caught:
        load_federation("femnist", 3, "natural", data_dir=leaf)
    assert str(leaf) in str(caught.value) and message in str(caught.value), str(caught.value)
    assert cli.main(["data", "femnist", str(leaf)]) == 2  # `data femnist` no longer calls it valid
    one_error_line(capsys.readouterr().err, message)


def test_a_valid_leaf_folder_still_loads(tmp_path, capsys):
    from prodigy_core.data import load_federation

    fed = load_federation("femnist", 3, "natural", data_dir=_leaf(tmp_path / "leaf"))
    assert fed.train_images.shape == (12, 1, 28, 28) and fed.test_labels.tolist() == [0, 1] * 3
    assert cli.main(["data", "femnist", str(tmp_path / "leaf")]) == 0


def test_the_committed_femnist_records_have_the_source_their_folder_makes_today(femnist24_dir):
    """figures/gpu's current FEMNIST records were made from femnist-leaf-24: their data source must be the one
    a new run on that folder resolves to, else the next GPU window reruns them (`--resume` finds no key) and a
    report mixes two sources (scripts/rekey_femnist_records.py migrates old ones)."""
    import tarfile

    from prodigy_core.data import resolve_data_source

    tarball = Path(__file__).resolve().parents[1] / "figures" / "gpu" / "results.tar.gz"
    with tarfile.open(tarball) as tar:
        records = [json.load(tar.extractfile(m)) for m in tar if m.isfile() and m.name.startswith("results/")]
    from prodigy_core.results import record_config_key

    current = [r for r in records if record_config_key(r) == r["key"]]  # not an older variant revision's
    femnist = [r["config"] for r in current if r["config"]["dataset"] == "femnist"]
    assert len(femnist) >= 20
    for config in femnist:
        n, k = config["n_clients"], config["femnist_min_writer_samples"]
        assert config["data_source"] == resolve_data_source("femnist", femnist24_dir, n, k), config


# ------------------------------------------------------ 4: reproduce --scale mini (papermill's string keys)


def test_reproduce_mini_table1_loads_its_grid_through_papermill(tmp_path, capsys):
    """The real notebook's parameters cell and its load_experiment line, run by `reproduce --scale mini`
    through papermill (whose injected cell writes mini.rounds' keys 2000/1000 as strings); no training."""
    import nbformat

    from prodigy_core import reproduce

    notebook, params_file = reproduce.NOTEBOOKS["table1_cifar10"]
    nb = nbformat.read(reproduce.NOTEBOOKS_DIR / notebook, as_version=4)
    tagged = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    load = nb.cells[tagged + 1]
    assert "load_experiment(" in load.source
    load.source = load.source.split("df = run_grid")[0] + 'assert "80 of 2000 / 40 of 1000" in exp.title\n'
    nb.cells = nb.cells[: tagged + 2]
    nbformat.write(nb, tmp_path / notebook)
    notebooks = {"table1_cifar10": (notebook, params_file)}
    rc = reproduce.reproduce("mini", only=["table1_cifar10"], notebooks=notebooks, notebooks_dir=tmp_path,
                             build_dir=tmp_path / "build")  # fmt: skip
    assert rc == 0, capsys.readouterr().err


@pytest.mark.parametrize("keys", [{"2000": 80, "1000": 40}, {2000: 80, 1000: 40}])
def test_mini_rounds_keys_written_as_text_are_rounds(keys):
    spec = {"experiment": "x", "base": {**TINY, "rounds": 1000}, "grid": {"rounds": [2000, 1000]},
            "mini": {"rounds": keys}}  # fmt: skip
    mini = experiment_from_spec(spec, scale="mini")
    assert sorted(c.rounds for c in mini.configs) == [40, 80]


# ------------------------------------------- 6: a FIFO, folder or dangling link at a record or lock path


SEEDS = {"experiment": "seeds", "base": TINY, "seeds": [0, 1]}


@contextlib.contextmanager
def deadline(seconds: float):
    """TimeoutError instead of a hang (a blocking open of a FIFO is interrupted by the alarm)."""

    def expire(signum, frame):
        raise TimeoutError(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _not_a_file(path: Path, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:
        path.symlink_to(path.with_name("nothing-there"))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
@pytest.mark.parametrize("suffix", ["json", "lock"])
@pytest.mark.parametrize("kind", ["fifo", "folder", "dangling link"])
def test_only_regular_files_are_read_as_records_or_locks(tmp_path, fake_training, suffix, kind):
    experiment = experiment_from_spec(SEEDS)
    folder = tmp_path / "seeds"
    folder.mkdir()
    key = experiment.configs[0].key()
    path = folder / f"{key}.{suffix}"
    _not_a_file(path, kind)
    with deadline(20), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert results.load(experiment, tmp_path).empty  # report: no hang, nothing counted
        df = run_grid(experiment, results_dir=tmp_path, progress=False)
        assert list(df["seed"]) == [0, 1] and sorted(fake_training) == [0, 1]  # done, not left "claimed"
        assert list(results.load(experiment, tmp_path)["seed"]) == [0, 1]
    if suffix == "json":
        assert any(f"{path}: not a valid result record" in str(w.message) for w in caught), caught
        assert "not a regular file" in str(caught[0].message)
    assert not path.exists() or path.is_file() and not path.is_symlink()
    assert len(list(folder.glob(f"{key}.{suffix}.*"))) == 1  # moved aside, not deleted


# -------------------------------------------------------------- 15: record_distances_at, one key per run


def test_record_distances_at_is_sorted_and_deduplicated_before_the_key():
    three = {**TINY, "rounds": 3}
    keys = {RunConfig(**three, record_distances_at=at).key() for at in ([1, 2], [2, 1], [1, 1, 2], (2, 1, 1))}
    assert len(keys) == 1
    assert RunConfig(**three, record_distances_at=[2, 1, 2]).record_distances_at == (1, 2)
    assert RunConfig.from_dict({**three, "record_distances_at": [2, 1]}).to_dict()["record_distances_at"] == [
        1,
        2,
    ]


@pytest.mark.parametrize("scale", ["smoke", "mini", "paper"])
def test_a_sorted_unique_record_distances_at_keeps_its_key(monkeypatch, scale):
    """The keys with the normalisation equal the keys without it (the tuple as given, as before)."""
    from prodigy_core import config as config_module

    at = [(), (1,), (1, 2), (1, 2, 3), (3,)]
    figure1 = experiments.load_experiment("figure1_pairwise_distances", scale=scale).configs
    normalised = [RunConfig(**{**TINY, "rounds": 3}, record_distances_at=a).key() for a in at]
    normalised += [c.key() for c in figure1]
    monkeypatch.setattr(config_module, "_distance_rounds", tuple)
    as_given = [RunConfig(**{**TINY, "rounds": 3}, record_distances_at=a).key() for a in at]
    as_given += [c.replace().key() for c in figure1]
    assert normalised == as_given and len(set(normalised)) == len(normalised)


# ------------------------------------------------------------------ 14: --only normalised like --set


def test_only_values_are_normalised_as_set_values(tmp_path, capsys):
    params = tmp_path / "grid.yaml"
    grid = {"defense": ["prodigy", "nnm+krum"], "attack": ["none", "alie"]}
    params.write_text(json.dumps({"experiment": "g", "base": {**TINY, "n_clients": 10, "n_byzantine": 3},
                                  "grid": grid}))  # fmt: skip
    where = ["--results-dir", str(tmp_path), "--dry-run"]
    assert cli.main(["grid", str(params), "--only", "defense=prodigy", "--only", "attack=alie", *where]) == 0
    lower = capsys.readouterr().out
    only = ["--only", "defense= ProDiGy", "--only", "attack=ALIE,Alie", "--only", "local_momentum=0"]
    assert cli.main(["grid", str(params), *only, *where]) == 0
    assert capsys.readouterr().out == lower and "1 run (" in lower


# ------------------------------------------------------------------- 16: one judgement of "stored"


def test_dry_run_report_and_grid_agree_on_an_invalid_record(tmp_path, fake_training, capsys):
    params = tmp_path / "seeds.yaml"
    params.write_text(json.dumps(SEEDS))
    where = ["--results-dir", str(tmp_path / "res")]
    assert cli.main(["grid", str(params), *where]) == 0
    experiment = experiments.load_experiment(params)
    path = results.record_path(tmp_path / "res" / "seeds", experiment.configs[0].key())
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "config": {**record["config"], "bogus_field": 1}}))
    capsys.readouterr()
    assert cli.main(["grid", str(params), "--dry-run", *where]) == 0
    out = capsys.readouterr().out
    assert "2 runs (1 stored, 1 to run)" in out, out
    assert path.exists()  # a dry run writes (and moves) nothing
    with pytest.warns(RuntimeWarning, match="unknown field 'bogus_field'"):
        assert list(results.load(experiment, tmp_path / "res")["seed"]) == [1]  # report: left out
    fake_training.clear()
    assert cli.main(["grid", str(params), *where]) == 0
    assert (
        fake_training == [0] and "unknown field 'bogus_field'" in capsys.readouterr().err
    )  # grid: named, redone


# --------------------------------------------------------------------- 5: written files honour the umask


@pytest.fixture(params=[0o002, 0o022, 0o077])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_records_checkpoints_locks_and_decoded_data_honour_the_umask(tmp_path, umask, jpeg_folder):
    from prodigy_core.data import decode_cifar10_jpeg

    want = 0o666 & ~umask
    assert _mode(results.save_record(tmp_path, "k", {"final_accuracy": 1.0}, "x")) == want
    assert _mode(results.save_failure(tmp_path, "k", {}, ValueError("x"), "x")) == want
    claims = results.Claims(tmp_path)
    assert claims.claim("other") and _mode(claims.lock_path("other")) == want
    claims.release_all()
    cfg = tiny(rounds=3)
    with training.killed_after(1):
        training.run(cfg, progress=False, checkpoint_dir=tmp_path / "ckpt")
    assert _mode(tmp_path / "ckpt" / f"{cfg.key()}.pt") == want
    decoded = decode_cifar10_jpeg(
        jpeg_folder(tmp_path / "jpeg", 2), tmp_path / "data", per_class=2, progress=False
    )
    assert _mode(decoded) == want


# ------------------------------------------------------- 11: the decoded CIFAR-10 file checked on load


def _decoded(tmp_path, jpeg_folder) -> Path:
    from prodigy_core.data import decode_cifar10_jpeg

    return decode_cifar10_jpeg(
        jpeg_folder(tmp_path / "jpeg", 2), tmp_path / "data", per_class=2, progress=False
    )


def _edit_arrays(path: Path, **changes) -> None:
    import torch

    arrays = torch.load(path, weights_only=True)
    arrays.update(changes)
    torch.save(arrays, path)


@pytest.mark.parametrize(
    "damage, why",
    [
        ("garbage", "not a readable decoded file"),
        ("truncated", "not a readable decoded file"),
        ("label 99", "train_labels: label 99 is not a class in 0..9"),
        ("one label short", "train_images has 20 images but train_labels 19 labels"),
        ("float images", "train_images must be uint8 (N, 3, 32, 32), got torch.float32 (20, 3, 32, 32)"),
        ("no test set", "test_images is missing"),
    ],
)
def test_a_damaged_decoded_cifar10_file_is_one_error_saying_how_to_rebuild_it(
    tmp_path, jpeg_folder, damage, why
):
    import torch

    from prodigy_core.data import DataError, load_federation

    path = _decoded(tmp_path, jpeg_folder)
    arrays = torch.load(path, weights_only=True)
    if damage == "garbage":
        path.write_bytes(b"not a torch file")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    elif damage == "label 99":
        _edit_arrays(path, train_labels=torch.where(arrays["train_labels"] == 3, 99, arrays["train_labels"]))
    elif damage == "one label short":
        _edit_arrays(path, train_labels=arrays["train_labels"][:-1])
    elif damage == "float images":
        _edit_arrays(path, train_images=arrays["train_images"].float())
    else:
        del arrays["test_images"]
        torch.save(arrays, path)
    with pytest.raises(DataError) as caught:
        load_federation("cifar10", 2, "iid", data_dir=tmp_path / "data")
    message = str(caught.value)
    assert str(path) in message and why in message and "prodigy-fl data cifar10" in message, message
    assert "\n" not in message


def test_an_intact_decoded_cifar10_file_loads(tmp_path, jpeg_folder):
    from prodigy_core.data import load_federation

    _decoded(tmp_path, jpeg_folder)
    fed = load_federation("cifar10", 2, "iid", data_dir=tmp_path / "data")
    assert fed.train_images.shape == (20, 3, 32, 32) and sorted(fed.test_labels.tolist()) == sorted(
        list(range(10)) * 2
    )


# ------------------------------------------------------------ 13: init never writes into the package


@pytest.mark.parametrize("where", [".", "data", "nested/deeper"])
def test_init_inside_the_package_is_refused(tmp_path, monkeypatch, capsys, where):
    from prodigy_core import paths

    before = sorted(p.relative_to(paths.PACKAGE_DIR) for p in paths.PACKAGE_DIR.rglob("*"))
    target = paths.PACKAGE_DIR / where
    if where == ".":
        monkeypatch.chdir(paths.PACKAGE_DIR)
        args = ["init"]
    else:
        args = ["init", str(target)]
    try:
        assert cli.main(args) == 2
        one_error_line(capsys.readouterr().err, "is inside the installed package", "must be outside")
    finally:  # a regression must not leave its copies in the package
        after = sorted(p.relative_to(paths.PACKAGE_DIR) for p in paths.PACKAGE_DIR.rglob("*"))
        for new in sorted(set(after) - set(before), reverse=True):
            path = paths.PACKAGE_DIR / new
            path.rmdir() if path.is_dir() else path.unlink()
    assert after == before
    assert cli.main(["init", str(tmp_path / "project")]) == 0 and (tmp_path / "project" / "params").is_dir()


# --------------------------------------- 19, 7, 8: params files: duplicate keys, alias bombs, title's type


def _params(tmp_path, text: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return path


def test_a_duplicate_key_in_a_params_file_is_one_error(tmp_path, capsys):
    base = "{" + ", ".join(f"{k}: {v}" for k, v in TINY.items() if k != "rounds") + "}"
    path = _params(
        tmp_path, f"experiment: dup\nbase: {base}\nseeds: [0]\nmini:\n  rounds: 2\n  rounds: 500\n"
    )
    assert cli.main(["grid", str(path), "--dry-run", "--results-dir", str(tmp_path)]) == 2
    one_error_line(capsys.readouterr().err, str(path), "duplicate key 'rounds'", "line 6")
    top = _params(tmp_path, "experiment: a\nexperiment: b\n")
    with pytest.raises(ConfigError, match="duplicate key 'experiment'"):
        experiments.load_experiment(top)


def test_a_yaml_alias_bomb_is_rejected_before_it_expands(tmp_path, capsys):
    levels = ["&l0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):  # 10^9 strings once expanded
        levels.append(f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]")
    path = _params(tmp_path, f"experiment: bomb\ntitle: [{', '.join(levels)}]\n")
    with deadline(20):
        assert cli.main(["grid", str(path), "--dry-run", "--results-dir", str(tmp_path)]) == 2
    one_error_line(capsys.readouterr().err, str(path), "aliases expand to more than")


@pytest.mark.parametrize("title", ["[a, b]", "{x: 1}", "3", "x" * 501])
def test_a_title_is_a_bounded_string(tmp_path, capsys, title):
    path = _params(tmp_path, f"experiment: t\ntitle: {title}\nbase: {json.dumps(TINY)}\n")
    assert cli.main(["grid", str(path), "--dry-run", "--results-dir", str(tmp_path)]) == 2
    one_error_line(capsys.readouterr().err, "title=", "must be a string of at most 500 characters")


# ------------------------------------------------- 12: an archive member too big for a CIFAR-10 JPEG


def test_an_oversized_archive_member_is_refused_before_it_is_read(tmp_path, jpeg_folder, monkeypatch):
    import tarfile

    from prodigy_core import data

    source = jpeg_folder(tmp_path / "jpeg", 1)
    big = source / "train" / "cat" / "0001.jpg"
    big.write_bytes(b"\0" * (data.MAX_JPEG_BYTES + 1))
    archive = tmp_path / "copy.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source, arcname="cifar10")
    read = []
    real = tarfile.TarFile.extractfile
    monkeypatch.setattr(tarfile.TarFile, "extractfile", lambda self, m: read.append(m.name) or real(self, m))
    with pytest.raises(data.DataError, match=r"train/cat/0001\.jpg is \d[\d,]* bytes, .*not a CIFAR-10 JPEG"):
        data.decode_cifar10_jpeg(archive, tmp_path / "data", per_class=1, progress=False)
    assert not any(name.endswith("cat/0001.jpg") for name in read)  # refused unread
    with pytest.raises(data.DataError, match=r"0001\.jpg is \d[\d,]* bytes"):  # the unpacked folder too
        data.decode_cifar10_jpeg(source, tmp_path / "data", per_class=1, progress=False)


# ----------------------------------------- 17: the explorer's names normalised, its bounds and names enforced


@pytest.mark.parametrize("attack, defense", [("ALIE", "ProDiGy"), (" alie ", "PRODIGY ")])
def test_the_explorer_normalises_names_as_the_cli_does(attack, defense, optional_import):
    optional_import("ipywidgets", "dev")
    from prodigy_core import explorer

    c = explorer.explorer(n_clients=6, n_byzantine=2, rounds=1, attack=attack, defense=defense).controls
    assert (c["attack"].value, c["defense"].value) == ("alie", "prodigy")


@pytest.mark.parametrize(
    "setting, words",
    [
        (dict(n_clients=100), ["clients N=100", "4..50"]),
        (dict(rounds=0), ["rounds T=0", "1..100"]),
        (dict(dirichlet_alpha=1e3), ["Dirichlet α=1000", "0.01..100"]),
        (dict(n_clients=10, n_byzantine=5), ["Byzantine f=5", "clients N=10"]),
        (dict(bogus=1), ["unknown setting 'bogus'", "n_clients (clients N)"]),
        (dict(attack="nonesuch"), ["attack='nonesuch'"]),
    ],
)
def test_the_explorer_rejects_out_of_range_values_and_unknown_names_in_its_words(
    setting, words, optional_import
):
    optional_import("ipywidgets", "dev")
    from prodigy_core import explorer

    with pytest.raises(ConfigError) as e:
        explorer.explorer(**setting)
    message = str(e.value)
    assert "\n" not in message and all(w in message for w in words), message
    assert "n_clients=" not in message and "rounds=" not in message.replace("rounds T=", ""), message


# ------------------------------------------------ 18: messages that name the file or field and the real cause


def test_a_non_image_jpeg_is_named_by_its_file(tmp_path, jpeg_folder):
    from prodigy_core import data

    source = jpeg_folder(tmp_path / "jpeg", 1)
    for path in (source / "train" / "cat").iterdir():
        path.write_bytes(b"not an image")
    with pytest.raises(data.DataError) as e:
        data.decode_cifar10_jpeg(source, tmp_path / "data", per_class=1, progress=False)
    assert "train/cat/0000.jpg" in str(e.value) and "not a JPEG image" in str(e.value)
    assert "BytesIO" not in str(e.value)


def test_a_garbage_tar_is_one_line(tmp_path, capsys):
    archive = tmp_path / "copy.tar.gz"
    archive.write_bytes(bytes(range(256)) * 12)
    assert cli.main(["data", "cifar10", str(tmp_path / "data"), "--from", str(archive)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    one_error_line(err, str(archive), "not a readable .tar.gz", "not a tar archive")


@pytest.mark.parametrize("kind", ["file", "read-only"])
def test_an_unusable_data_folder_is_named_with_its_cause(tmp_path, capsys, monkeypatch, kind):
    root = tmp_path / "data"
    if kind == "file":
        root.write_text("x")
    else:
        root.mkdir()
        root.chmod(0o555)
        access = os.access  # root ignores chmod (CI runs as root): simulate the refusal for it too
        monkeypatch.setattr(os, "access", lambda p, mode: access(p, mode) and Path(p) != root)
    monkeypatch.setenv("PRODIGY_DATA_DIR", str(root))
    assert cli.main(["data", "cifar10"]) == 2
    err = capsys.readouterr().err
    cause = "is a file, not a folder" if kind == "file" else "is not writable"
    one_error_line(err, str(root), cause, "PRODIGY_DATA_DIR")
    assert "cannot download" not in err and "offline" not in err


def test_an_empty_leaf_folder_is_named_as_empty(tmp_path, capsys):
    leaf = tmp_path / "leaf"
    (leaf / "train").mkdir(parents=True)
    (leaf / "test").mkdir()
    assert cli.main(["data", "femnist", str(leaf)]) == 2
    err = capsys.readouterr().err
    one_error_line(err, str(leaf), "no writers")
    assert "n_clients" not in err


@pytest.mark.parametrize("field", ["seed", "data_seed"])
@pytest.mark.parametrize("value", [2**64, -(2**63) - 1])
def test_a_seed_out_of_range_is_a_range_error_naming_the_field(tmp_path, capsys, field, value):
    with pytest.raises(ConfigError, match=rf"{field}={value} .*outside .*-2\*\*63\.\.2\*\*64 - 1"):
        tiny(**{field: value})
    assert cli.main(["run", *TINY_SET, f"--set={field}={value}", "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    one_error_line(err, f"{field}={value}")
    assert "Overflow" not in err
    assert tiny(seed=2**64 - 1).seed == 2**64 - 1 and tiny(seed=-(2**63)).seed == -(2**63)  # torch's range


def test_a_malformed_accuracy_curve_names_the_record(tmp_path, fake_training):
    experiment = experiment_from_spec(SEEDS)
    run_grid(experiment, results_dir=tmp_path, progress=False)
    path = results.record_path(tmp_path / "seeds", experiment.configs[0].key())
    record = json.loads(path.read_text())
    for curve in ([["x", 1.0]], "garbage", [[1]], [[1, None]]):
        path.write_text(json.dumps({**record, "accuracy_curve": curve}))
        with pytest.warns(RuntimeWarning, match=rf"{path}: not a valid result record.*accuracy_curve"):
            assert list(results.load(experiment, tmp_path)["seed"]) == [1]
    path.write_text(json.dumps({**record, "accuracy_curve": [[1, 10.0], [2, 12.5]]}))
    assert list(results.load(experiment, tmp_path)["seed"]) == [0, 1]


def test_a_lock_of_a_dead_peer_is_not_reported_as_claimed(tmp_path, fake_training, monkeypatch, capsys):
    import socket
    import subprocess

    peer = subprocess.Popen(["true"])
    peer.wait()
    experiment = experiment_from_spec(SEEDS)
    folder = tmp_path / "seeds"
    folder.mkdir()
    lock = folder / f"{experiment.configs[0].key()}.lock"
    lock.write_text(json.dumps({"pid": peer.pid, "host": socket.gethostname(), "started": 0}))
    # the peer was alive when the grid looked, killed before the grid's summary
    monkeypatch.setattr(results.Claims, "_take_over_if_stale", lambda self, path: False)
    run_grid(experiment, results_dir=tmp_path, progress=True)
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert f"its claimant (pid {peer.pid}) is dead" in out and "taken over" in out, out
    assert "claimed by another process" not in out, out


@pytest.mark.parametrize("variant, first", [("paper", 61), ("authors", 60)])
def test_the_lr_decay_at_hint_states_the_rule_the_code_applies(variant, first):
    from prodigy_core.config import decay_round

    assert decay_round(90, variant) == first
    with pytest.raises(ConfigError) as e:
        tiny(rounds=90, eval_every=10, lr_decay_at=-1, variant=variant)
    rule = "2 * rounds // 3 + 1" if variant == "paper" else "2 * rounds // 3"
    assert f"null for the default {rule} (round {first} here" in str(e.value), e.value


# ------------------------------------------------------------- 19: a large grid announces its size first


def test_a_large_grid_announces_its_size_and_expansion_time(monkeypatch, capsys):
    monkeypatch.setattr(experiments, "LARGE_GRID", 20)
    lrs = [round(0.01 * (i + 1), 2) for i in range(12)]
    experiment = experiment_from_spec(
        {"experiment": "big", "base": TINY, "grid": {"lr": lrs}, "seeds": [0, 1]}
    )
    assert len(experiment.configs) == 24
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "24 runs" in lines[0] and "s to expand" in lines[0], err
    experiment_from_spec({"experiment": "small", "base": TINY, "grid": {"lr": lrs[:5]}, "seeds": [0, 1]})
    assert capsys.readouterr().err == ""  # 10 runs: nothing to announce


# ---------------------------------------------- 8-9: every params-file field validated for type at load


@pytest.mark.parametrize(
    "report, words",
    [
        ("{columns: [attack, lr]}", "report.columns=['attack', 'lr'] must be one run field name"),
        ("{rows: 3}", "report.rows=3 must be one run field name"),
        ("{blocks: {a: 1}}", "report.blocks={'a': 1} must be a run field name or a list of them"),
        ("{figures: heatmap}", "report.figures='heatmap' must be a list of figure names"),
        ("{figures: [heatmap, 3]}", "report.figures=['heatmap', 3] must be a list of figure names"),
        ("{figures: [heatmap, bogus]}", "report.figures: unknown 'bogus'"),
    ],
)
def test_report_fields_are_checked_for_type_at_load(tmp_path, capsys, report, words):
    path = _params(tmp_path, f"experiment: r\nbase: {json.dumps(TINY)}\nreport: {report}\n")
    assert cli.main(["grid", str(path), "--dry-run", "--results-dir", str(tmp_path)]) == 2
    one_error_line(capsys.readouterr().err, str(path), words)


def test_a_valid_report_layout_still_loads(tmp_path):
    path = _params(
        tmp_path,
        f"experiment: r\nbase: {json.dumps(TINY)}\n"
        "report: {rows: defense, columns: attack, blocks: lr, figures: [heatmap, curves]}\n",
    )
    assert experiments.load_experiment(path).report["figures"] == ["heatmap", "curves"]
