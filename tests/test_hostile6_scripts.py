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
def test_quickstart_convergence_not_converged_says_so_and_keeps_both_curves(convergence, trained, tmp_path,
                                                                          capsys, curve):  # fmt: skip
    trained.curve = curve
    out, partial = tmp_path / "curve.csv", tmp_path / "curve.unconverged.csv"
    out.write_text("the last converged curve\n")
    assert convergence.main(["--rounds", "15", "--out", str(out)]) == 1
    err = one_error_line(capsys.readouterr().err, "quickstart_convergence: not converged within 15 rounds")
    assert "rerun with more --rounds" in err and f"in {partial}; {out} left as it is" in err
    assert len(partial.read_text().splitlines()) == 1 + len(curve)  # the curve is written beside it
    assert out.read_text() == "the last converged curve\n"  # a helper found it overwritten


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


def test_mini_provenance_never_drops_runs_whose_records_it_lacks(scripts, tmp_path, capsys):
    """A helper found that the script rewrote figures/mini/PROVENANCE.md from whatever mini records the
    results folder held: its 11 runs, whose records are gone, would have been replaced by the one new run."""
    module = scripts("scripts/mini_provenance.py")
    committed = Path(__file__).resolve().parents[1] / "figures" / "mini" / "PROVENANCE.md"
    out = tmp_path / "PROVENANCE.md"
    out.write_text(committed.read_text(encoding="utf-8"), encoding="utf-8")
    folder = tmp_path / "results" / "tiny-mini"
    folder.mkdir(parents=True)
    config = RunConfig(dataset="digits", n_clients=5, n_byzantine=2, rounds=2).to_dict()
    key = RunConfig.from_dict(config).key()
    (folder / f"{key}.json").write_text(json.dumps(
        {"key": key, "experiment": "tiny-mini", "status": "done", "config": config, "final_accuracy": 50.0,
         "accuracy_curve": [[2, 50.0]], "environment": None, "round_times": [1.0]}))  # fmt: skip
    argv = ["--results-dir", str(tmp_path / "results"), "--out", str(out)]
    assert module.main(argv) == 2
    assert out.read_text(encoding="utf-8") == committed.read_text(encoding="utf-8")  # left as it is
    err = one_error_line(capsys.readouterr().err, f"mini_provenance: {out} lists 11 run(s) whose records")
    assert "--force writes anyway" in err
    assert module.main([*argv, "--force"]) == 0
    assert module.listed_runs(out.read_text(encoding="utf-8")) == {
        ("tiny-mini", "prodigy", "none", "0.0", "paper", "2", "-")  # RunConfig's defaults
    }


@pytest.mark.parametrize(
    ("argv", "words"),
    [(["--engines", "bogus"], "argument --engines: invalid choice: 'bogus'"),
     (["--precisions", "fp16"], "argument --precisions: invalid choice: 'fp16'"),
     (["--steps", "0"], "argument --steps: '0': a whole number >= 1"),
     (["--steps", "-1"], "argument --steps: '-1': a whole number >= 1"),
     (["--sizes", "0"], "argument --sizes: '0': a whole number >= 1"),
     (["--out", "{file}"], "--out {file}: a file; give the folder to write into, e.g. --out /tmp/")],
)  # fmt: skip
def test_throughput_refuses_nonsense_in_one_line_before_timing(tmp_path, capsys, argv, words):
    """A helper found `--engines bogus` timed batched under that name, `--steps -1` printed negative rates,
    `--steps 0` and `--sizes 0` read as an engine refusing, and a file as --out failed after the timings."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import throughput

    (tmp_path / "a-file").write_text("")
    argv = [a.format(file=tmp_path / "a-file") for a in argv]
    with pytest.raises(SystemExit) as exit_:
        throughput.main(["--smoke", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr()
    assert words.format(file=tmp_path / "a-file") in err.err and "device:" not in err.out  # nothing timed


@pytest.mark.parametrize(
    "script", ["scripts/alie_z_sensitivity.py", "scripts/no_attack_f0.py", "scripts/precision_check.py"]
)
def test_a_results_dir_that_is_a_file_is_one_usage_line_before_training(scripts, tmp_path, capsys, script):
    """A helper found a NotADirectoryError traceback whose advice was to pass the --results-dir just given."""
    module, where = scripts(script), tmp_path / "a-file"
    where.write_text("")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--results-dir", str(where), "--out", str(tmp_path / "out.md")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"error: --results-dir {where}: a file; give the folder to write into, e.g. results" in err
    assert "Traceback" not in err and where.read_text() == ""


@pytest.mark.parametrize(
    ("script", "argv", "words"),
    [("aggregators", ["--sizes", "10x-5"], "argument --sizes: '10x-5': comma-separated NxD, N >= 2 and D"),
     ("aggregators", ["--sizes", "abc"], "argument --sizes: 'abc': comma-separated NxD"),
     ("attacks", ["--n", "10", "--f", "10"], "--f 10 with --n 10: the Byzantine clients must be under half"),
     ("attacks", ["--repeats", "0"], "argument --repeats: '0': a whole number >= 1"),
     ("attacks", ["--defenses", "bogus"], "--defenses bogus: unknown defense 'bogus'; valid: "),
     ("data", ["--samples", "2000", "--steps", "5"], "each client 200 images, fewer than --steps x --batch"),
     ("data", ["--rounds", "0"], "argument --rounds: '0': a whole number >= 1"),
     ("grid", ["--runs", "0"], "argument --runs: '0': a whole number >= 1"),
     ("training", ["--only", "bogus"], "argument --only: invalid choice: 'bogus'"),
     ("quickstart", ["--rounds", "1", "--floor-only"], "--rounds 1: at least 2")],
)  # fmt: skip
def test_the_benchmarks_refuse_nonsense_in_one_usage_line(monkeypatch, capsys, script, argv, words):
    """A helper found tracebacks from inside torch, statistics or a DataLoader for these arguments, and
    `--only bogus` printing an empty table with exit 0."""
    import importlib
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    module = importlib.import_module(f"benchmarks.{script}")
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err


@pytest.mark.parametrize("where, why", [("full", "not an empty folder"), ("a file", "not an empty folder"),
                                        ("under a file", "cannot write there")])  # fmt: skip
def test_check_committed_quickstart_refuses_its_keep_folder_before_training(scripts, monkeypatch, tmp_path,
                                                                            capsys, where, why):  # fmt: skip
    check = scripts("scripts/check_committed_quickstart.py")
    calls = []
    monkeypatch.setattr(check.cli, "main", lambda argv: calls.append(argv) or 0)
    (tmp_path / "file").write_text("")
    keep = {"full": tmp_path, "under a file": tmp_path / "file" / "runs", "a file": tmp_path / "file"}[where]
    with pytest.raises(SystemExit) as e:
        check.main(["--keep", str(keep)])
    assert e.value.code == 2 and calls == []  # refused before any training
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--keep {keep}" in err and why in err and "Traceback" not in err, err
