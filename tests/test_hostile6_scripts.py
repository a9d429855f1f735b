"""Hostile inputs, round 6: the scripts' arguments and inputs. A bad input is refused in one line that names
it, before any training (quickstart_convergence.py, cross_device_reference.py), a run that has not converged
says so, an experiment folder, a truncated or corrupted tarball and a record without a config are handled
(rekey_femnist_records.py), and a record's environment may lack fields (mini_provenance.py). Training is
replaced by a stand-in that records its calls; the expectations are hand-made (curves, records, tarballs)."""

import gzip
import io
import json
import os
import tarfile
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_data import old_source, rekey_record, write_leaf

from prodigy_core.config import RunConfig
from prodigy_core.results import check_record


def one_error_line(err: str, start: str) -> str:
    err = err.strip()
    assert err.startswith(start) and "\n" not in err and "Traceback" not in err, err
    return err


# ------------------------------------------------ scripts/quickstart_convergence.py: --rounds, --out, the end


@pytest.fixture(scope="module")
def convergence(scripts):
    return scripts("scripts/quickstart_convergence.py")


@pytest.fixture
def trained(convergence, monkeypatch):
    """The training replaced: `curve` is what the next run returns; `calls` the rounds of every run."""
    state = SimpleNamespace(curve=[], calls=[])

    def run(config, progress=True):
        state.calls.append(config.rounds)
        return SimpleNamespace(accuracy_curve=state.curve)

    monkeypatch.setattr(convergence, "run", run)
    return state


def test_quickstart_convergence_rounds_0_is_a_usage_line(convergence, trained, capsys):
    with pytest.raises(SystemExit) as e:
        convergence.main(["--rounds", "0"])
    assert e.value.code == 2 and trained.calls == []
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--rounds" in err and "'0'" in err and ">= 1" in err, err


@pytest.mark.parametrize("where, why", [("folder", "a folder"), ("under a file", "cannot write there")])
def test_quickstart_convergence_refuses_its_out_before_training(convergence, trained, tmp_path, capsys, where,
                                                                why):  # fmt: skip
    (tmp_path / "file").write_text("")
    out = tmp_path if where == "folder" else tmp_path / "file" / "curve.csv"
    with pytest.raises(SystemExit) as e:
        convergence.main(["--rounds", "10", "--out", str(out)])
    assert e.value.code == 2 and trained.calls == []  # refused before any training
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--out {out}" in err and why in err, err


def test_quickstart_convergence_writes_into_a_new_folder_and_names_its_rounds(convergence, trained, tmp_path,
                                                                              capsys):  # fmt: skip
    # converged at round 15 (80, 80.5, 80.2 within 1 point of 80.4); the paper's lr drop is after round
    # floor(2R/3) + 1: 14 for R = 20, 21 for R = 30, so the quickstart's rounds are 30
    trained.curve = [(5, 10.0), (10, 50.0), (15, 80.0), (20, 80.5), (25, 80.2), (30, 80.4)]
    out = tmp_path / "new" / "sub" / "curve.csv"
    assert convergence.main(["--rounds", "30", "--out", str(out)]) == 0
    assert trained.calls == [30]
    rows = out.read_text().splitlines()
    assert rows[0] == "round,test_accuracy_percent,lr" and [r.split(",")[:2] for r in rows[1:]] == [
        [str(r), f"{a:.2f}"] for r, a in trained.curve
    ]
    assert "converged at round 15; quickstart rounds: 30" in capsys.readouterr().out


@pytest.mark.parametrize(
    "curve",
    [[(5, 10.0), (10, 50.0), (15, 90.0)], [(5, 50.0), (10, 50.2)]],
    ids=["still rising", "fewer than 3 evaluations"],
)
def test_quickstart_convergence_not_converged_says_so_and_keeps_the_curve(convergence, trained, tmp_path,
                                                                          capsys, curve):  # fmt: skip
    trained.curve = curve
    out = tmp_path / "curve.csv"
    assert convergence.main(["--rounds", "15", "--out", str(out)]) == 1
    err = one_error_line(capsys.readouterr().err, "quickstart_convergence: not converged within 15 rounds")
    assert "rerun with more --rounds" in err and str(out) in err
    assert len(out.read_text().splitlines()) == 1 + len(curve)  # the curve is written all the same


# ------------------------------------------------- scripts/cross_device_reference.py: --out and --data-dir


@pytest.fixture(scope="module")
def cross_device(scripts):
    return scripts("scripts/cross_device_reference.py")


@pytest.fixture
def summarised(cross_device, monkeypatch):
    """The training and the CIFAR-10 decoding replaced by stand-ins that record their calls."""
    calls = []

    def summarise(fields, device="cpu", **overrides):
        calls.append(overrides["engine"])
        return {"key": "0" * 16, "engine": overrides["engine"], **{m: [] for m in cross_device.MEASURES}}

    monkeypatch.setattr(cross_device, "summarise", summarise)
    monkeypatch.setattr("prodigy_core.data.decode_cifar10_jpeg", lambda *a, **k: calls.append("decode"))
    return calls


@pytest.mark.parametrize("dataset", ["femnist", "cifar10"])
def test_cross_device_refuses_an_out_folder_before_training(cross_device, summarised, tmp_path, capsys,
                                                            dataset):  # fmt: skip
    with pytest.raises(SystemExit) as e:
        cross_device.main([dataset, "--out", str(tmp_path)])
    assert e.value.code == 2 and summarised == []  # neither decoded nor trained
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--out {tmp_path}: a folder" in err and f"{dataset}.json" in err, err


def test_cross_device_writes_into_a_new_folder(cross_device, summarised, tmp_path):
    out = tmp_path / "new" / "femnist.json"
    assert cross_device.main(["femnist", "--out", str(out)]) == 0
    assert summarised == ["sequential", "batched"]
    written = json.loads(out.read_text())
    assert written["engine"] == "sequential" and written["twin"]["engine"] == "batched"


def test_cross_device_a_missing_data_dir_is_one_line(cross_device, tmp_path):
    # the real loader: the LEAF folder is read before any round is trained
    out, nowhere = tmp_path / "femnist.json", tmp_path / "nowhere"
    with pytest.raises(SystemExit) as e:
        cross_device.main(["femnist", "--data-dir", str(nowhere), "--out", str(out)])
    one_error_line(str(e.value.code), f"cross_device_reference: femnist: LEAF directory {nowhere}")
    assert not out.exists()


def test_cross_device_a_missing_cifar10_copy_is_one_line(cross_device, tmp_path, monkeypatch):
    monkeypatch.setattr("prodigy_core.data.CIFAR10_JPEG_ARCHIVE", tmp_path / "missing.tar.gz")
    out = tmp_path / "cifar10.json"
    with pytest.raises(SystemExit) as e:
        cross_device.main(["cifar10", "--data-dir", str(tmp_path / "data"), "--out", str(out)])
    err = one_error_line(str(e.value.code), "cross_device_reference: cifar10: ")
    assert f"{tmp_path / 'missing.tar.gz'} does not exist" in err and not out.exists()


# ------------------------------------- scripts/rekey_femnist_records.py: a folder, a tarball, a null config


@pytest.fixture(scope="module")
def rekey(scripts):
    return scripts("scripts/rekey_femnist_records.py")


@pytest.fixture
def one_old_record(tmp_path):
    """A LEAF folder of two writers and a results folder holding one record of them under the old source."""
    leaf = write_leaf(tmp_path / "leaf", {"w_a": [1, 2], "w_b": [3]}, {"w_a": [5], "w_b": [5]})
    config = RunConfig(dataset="femnist", distribution="natural", n_clients=2, n_byzantine=0, rounds=1,
                       defense="none", data_source=old_source(leaf, ["w_a", "w_b"]))  # fmt: skip
    folder = tmp_path / "results" / "t"
    folder.mkdir(parents=True)
    (folder / f"{config.key()}.json").write_text(json.dumps(rekey_record(config, 10.0)))
    return leaf, folder.parent, config.key()


def test_rekey_refuses_an_experiment_folder_and_names_its_parent(rekey, one_old_record, capsys):
    leaf, results, key = one_old_record
    assert rekey.main([str(results / "t"), "--leaf", str(leaf)]) == 2
    err = one_error_line(capsys.readouterr().err, f"rekey_femnist_records: {results / 't'} holds records")
    assert "pass its parent, the results folder" in err
    assert [p.name for p in (results / "t").iterdir()] == [f"{key}.json"]  # nothing changed
    assert rekey.main([str(results), "--leaf", str(leaf)]) == 0  # the parent: the record is rekeyed
    assert "1 record(s) rekeyed" in capsys.readouterr().out
    (rekeyed,) = (results / "t").iterdir()
    assert rekeyed.name != f"{key}.json" and "data_source_rekeyed_from" in json.loads(rekeyed.read_text())


def padded_tar(records: Path) -> bytes:
    """An uncompressed tar of a results folder and a log of 64 KB of random hex (no two runs' bytes alike, so
    its compressed stream is longer than what tarfile's first read inflates)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(records, arcname="results")
        log = os.urandom(32 * 1024).hex().encode()
        info = tarfile.TarInfo("log.txt")
        info.size = len(log)
        tar.addfile(info, io.BytesIO(log))
    return buf.getvalue()


def truncated(raw: bytes) -> bytes:
    whole = gzip.compress(raw, mtime=0)
    return whole[: len(whole) * 3 // 4]  # EOFError: the stream ends before its end marker


def corrupted(raw: bytes) -> bytes:
    """A gzip header, the first 20 KB deflated and flushed to a byte boundary, then a block of the reserved
    type 3 (0xff: final, type 11): zlib.error "invalid block type" once tarfile reads past 20 KB."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    body = deflate.compress(raw[: 20 * 1024]) + deflate.flush(zlib.Z_FULL_FLUSH) + b"\xff" * 16
    return gzip.compress(b"", mtime=0)[:10] + body


@pytest.mark.parametrize("damage, error", [(truncated, "EOFError"), (corrupted, "error")])
def test_rekey_a_damaged_tarball_is_one_line_and_left_as_it_is(rekey, one_old_record, tmp_path, capsys,
                                                               damage, error):  # fmt: skip
    leaf, results, _ = one_old_record
    tarball = tmp_path / "results.tar.gz"
    tarball.write_bytes(damage(padded_tar(results)))
    before = tarball.read_bytes()
    with pytest.raises(Exception) as what, tarfile.open(tarball, "r:gz") as tar:  # the damage said
        [tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()]
    assert type(what.value).__name__ == error
    assert rekey.main([str(tarball), "--leaf", str(leaf)]) == 2
    err = one_error_line(capsys.readouterr().err, f"rekey_femnist_records: {tarball}: ")
    assert f"({error}: " in err and "truncated or corrupted" in err and "nothing changed" in err
    assert tarball.read_bytes() == before


def test_rekey_skips_a_record_whose_config_is_null(rekey, one_old_record, capsys):
    leaf, results, _ = one_old_record
    null = results / "t" / ("f" * 16 + ".json")
    null.write_text(json.dumps({"key": "f" * 16, "status": "done", "config": None}))
    assert rekey.main([str(results), "--leaf", str(leaf), "--dry-run"]) == 0
    assert "1 record(s) would be rekeyed" in capsys.readouterr().out
    assert rekey.main([str(results), "--leaf", str(leaf)]) == 0
    assert "1 record(s) rekeyed" in capsys.readouterr().out
    assert json.loads(null.read_text())["config"] is None and len(list((results / "t").iterdir())) == 2


# ------------------------------------------------------ scripts/mini_provenance.py: partial environments


def test_mini_provenance_lists_records_whose_environment_is_partial_or_null(scripts, tmp_path):
    module = scripts("scripts/mini_provenance.py")
    folder = tmp_path / "tiny-mini"
    folder.mkdir()
    environments = {
        "none": {"device": "cpu", "engine": "batched", "torch": "9.9"},  # no threads
        "prodigy": None,
    }
    for defense, environment in environments.items():
        config = RunConfig(dataset="digits", n_clients=5, n_byzantine=2, rounds=2, defense=defense).to_dict()
        config.pop("data_source", None)  # an older record: no data source either
        key = RunConfig.from_dict(config).key()
        record = {"key": key, "experiment": "tiny-mini", "status": "done", "config": config,
                  "final_accuracy": 50.0, "accuracy_curve": [[2, 50.0]], "environment": environment,
                  "round_times": [1.0, "n/a", None]}  # fmt: skip
        (folder / f"{key}.json").write_text(json.dumps(record))
        assert check_record(record, folder / f"{key}.json") is None  # one the table lists
    rows = {cells[1]: cells for cells in ([c.strip() for c in row.strip("|").split("|")]
                                          for row in module.rows(tmp_path))}  # fmt: skip
    assert set(rows) == {"none", "prodigy"}
    assert rows["none"][9:11] == ["cpu, batched, - thread(s)", "9.9"]
    assert rows["prodigy"][9:11] == ["-, -, - thread(s)", "-"]
    assert rows["none"][6] == rows["prodigy"][6] == "-" and rows["none"][8] == "0"  # 1 s: 0 minutes
