"""Hostile round 6 (2026-11-28): what an audit of every entry point's bad input broke, each as a test."""

from __future__ import annotations

import json

import pytest
import torch
from test_data import write_leaf

from prodigy_core import lab, results
from prodigy_core.aggregators import make_aggregator
from prodigy_core.attacks import make_attack
from prodigy_core.cli import main
from prodigy_core.config import ConfigError, RunConfig
from prodigy_core.data import DataError, leaf_writer_counts, load_federation


def one_error_line(capsys, args: list[str]) -> str:
    """Run the CLI expecting exit 2 with one `prodigy-fl: error:` line and no traceback; that line."""
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("prodigy-fl: error: ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    return err


# ------------------------------------------------------------------ params keys YAML does not read as names


@pytest.mark.parametrize(
    "text, named",
    [
        ("base: {rounds: 2000}\nmini: {2000: 60}\n", ["mini", "2000", "rounds"]),  # `rounds:` forgotten
        ("base: {rounds: 20, on: 2}\n", ["True", "dataset"]),  # YAML 1.1 reads `on` as true
        ("base: {rounds: 20}\ngrid: {1: [2]}\n", ["1"]),
    ],
)
def test_a_params_key_yaml_reads_as_a_number_or_bool_is_one_error_line(tmp_path, capsys, text, named):
    """A non-string key reached the did-you-mean hint, and difflib raised "TypeError: 'int' object is not
    iterable" from deep inside: a traceback that named neither the key nor the file."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    err = one_error_line(capsys, ["grid", str(path), "--mini", "--dry-run"])
    assert str(path) in err and all(word in err for word in named)


def test_run_config_names_a_non_string_field():
    with pytest.raises(ConfigError, match=r"unknown field 1; valid: dataset"):
        RunConfig.from_dict({1: 2})


# ------------------------------------------------------------------------------- a LEAF writer listed twice


def test_a_leaf_writer_in_two_files_is_an_error_not_a_silent_loss_of_one_copy(tmp_path, capsys):
    """Two LEAF outputs copied into one folder: the writer's samples in the later file replaced those in
    the earlier one (1,347 training samples became 987 in the audit), the writer fell below the 350 cut and
    every later writer moved up a client; `prodigy-fl data femnist` called the folder valid."""
    leaf = write_leaf(tmp_path / "leaf", {"w1": [0, 1, 2], "w2": [3, 4]}, {"w1": [5], "w2": [6]})
    assert leaf_writer_counts(leaf) == {"w1": (3, 1), "w2": (2, 1)}
    again = {"users": ["w1"], "num_samples": [1], "user_data": {"w1": {"x": [[0.0] * 784], "y": [7]}}}
    (leaf / "train" / "part_2.json").write_text(json.dumps(again))
    with pytest.raises(DataError, match=r"writer w1 is listed in both .*part_1.json and .*part_2.json"):
        leaf_writer_counts(leaf)
    err = one_error_line(capsys, ["data", "femnist", str(leaf)])
    assert "w1" in err and "keep one copy" in err


def test_a_leaf_writer_listed_twice_in_one_file_is_an_error(tmp_path):
    leaf = write_leaf(tmp_path / "leaf", {"w1": [0, 1], "w2": [3]}, {"w1": [5], "w2": [6]})
    path = leaf / "test" / "part_1.json"
    content = json.loads(path.read_text())
    content["users"].append("w1")
    content["num_samples"].append(1)
    path.write_text(json.dumps(content))
    with pytest.raises(DataError, match=r"writer w1 is listed twice in .*part_1.json"):
        leaf_writer_counts(leaf)


def test_the_loader_refuses_a_writer_in_two_files_too(tmp_path, monkeypatch):
    """The sample reader (`_read_leaf_split`) checks on its own: the counts come from a cache that a folder
    edited within one mtime tick could leave stale."""
    from prodigy_core import data

    leaf = write_leaf(tmp_path / "leaf", {"w1": [0, 1], "w2": [3]}, {"w1": [5], "w2": [6]})
    again = {"users": ["w2"], "num_samples": [1], "user_data": {"w2": {"x": [[0.0] * 784], "y": [7]}}}
    (leaf / "test" / "part_2.json").write_text(json.dumps(again))
    with pytest.raises(DataError, match=r"writer w2 is listed in both .*part_1.json and .*part_2.json"):
        data._read_leaf_split(leaf / "test")


# ------------------------------------------------------------------------------------- report finds nothing


def test_report_without_results_names_the_folder_it_read_and_the_scale_that_has_records(tmp_path, capsys):
    """It said only "no stored results; run `prodigy-fl grid X`": a mistyped --results-dir, or runs made
    at another scale, sent the user to retrain, and into the default folder (the --results-dir left out)."""
    err = one_error_line(capsys, ["report", "quickstart_digits", "--results-dir", str(tmp_path)])
    assert f"{tmp_path / 'quickstart_digits'} is not there" in err
    assert f"`prodigy-fl grid quickstart_digits --results-dir {tmp_path}`" in err
    (tmp_path / "quickstart_digits-smoke").mkdir()
    (tmp_path / "quickstart_digits-smoke" / "0123456789abcdef.json").write_text("{}")
    err = one_error_line(capsys, ["report", "quickstart_digits", "--results-dir", str(tmp_path)])
    assert "records at another scale: smoke (--smoke)" in err
    assert main(["report", "quickstart_digits", "--smoke", "--results-dir", str(tmp_path)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the warning that the record is invalid
    assert "quickstart_digits-smoke holds 1 record file(s), none of this grid's runs" in last


# ---------------------------------------------------------------------- smoke scale and a named data folder


def test_smoke_with_a_named_femnist_folder_that_is_not_there_is_its_error_not_a_stand_in(tmp_path, capsys):
    """A typo in data_dir at --smoke trained on digits labelled "offline stand-in", as if no data were on
    this machine; without --smoke the same typo was already an error. A folder found by default that is
    malformed still gives the stand-in (CI without data)."""
    typo = tmp_path / "leaf-typo"
    err = one_error_line(
        capsys, ["grid", "table2_femnist_n20", "--smoke", "--dry-run", "--set", f"data_dir={typo}"]
    )
    assert f"LEAF directory {typo} does not exist: give the folder that holds train/ and test/" in err


def test_smoke_with_a_named_folder_of_too_few_writers_says_so_in_its_label(tmp_path, capsys):
    leaf = write_leaf(tmp_path / "two", {"w1": [0], "w2": [1]}, {"w1": [2], "w2": [3]})
    assert main(["grid", "table2_femnist_n20", "--smoke", "--dry-run", "--set", f"data_dir={leaf}"]) == 0
    assert "digits (stand-in for femnist: two has fewer than 10 eligible writers)" in capsys.readouterr().out


def test_run_prints_this_runs_stand_in_label_not_the_stored_records(tmp_path, capsys, monkeypatch):
    """A digits smoke run and a CIFAR-10 one on a machine without CIFAR-10 are the same computation (one
    key): the second printed the first's label (none), or a plain digits run the CIFAR-10 one's."""
    monkeypatch.setenv("PRODIGY_DATA_DIR", str(tmp_path / "no-data"))
    folder = ["--results-dir", str(tmp_path / "r"), "--set", "rounds=1"]
    assert main(["run", "--smoke", "--set", "dataset=cifar10", *folder]) == 0
    assert "accuracy [stand-in: digits (offline stand-in for cifar10)] ->" in "".join(capsys.readouterr())
    assert main(["run", "--smoke", *folder]) == 0
    printed = "".join(capsys.readouterr())
    assert "stored result" in printed and "stand-in" not in printed


# ---------------------------------------------------------------------------- a record it cannot move aside


def test_an_invalid_record_in_a_folder_it_cannot_write_is_one_line_naming_the_cause(tmp_path, monkeypatch):
    """The audit made the folder immutable: "Operation not permitted: <record>" named no cause and no fix
    (the quarantine's rename failed before the writability check). A rename that fails is simulated here."""
    folder = tmp_path / "exp"
    folder.mkdir()
    (folder / "0123456789abcdef.json").write_text('{"trunc')

    def refuse(src, dst):
        raise PermissionError(1, "Operation not permitted", str(src))

    monkeypatch.setattr(results.os, "rename", refuse)
    why = r"not a valid result record .*cannot be moved aside.*not permitted; make .*exp writable or pass"
    with pytest.raises(ValueError, match=why):
        results.stored_record(folder, "0123456789abcdef")
    assert (folder / "0123456789abcdef.json").read_text() == '{"trunc'  # kept as it was


# ----------------------------------------------------------------------------- CIFAR-10 with a file missing


def test_a_cifar10_batch_folder_missing_a_file_names_the_file(tmp_path):
    batches = tmp_path / "cifar-10-batches-py"
    batches.mkdir()
    for name in (*(f"data_batch_{i}" for i in range(1, 5)), "test_batch", "batches.meta"):
        (batches / name).write_bytes(b"x")
    with pytest.raises(DataError, match=r"cifar-10-batches-py is incomplete: data_batch_5 missing"):
        load_federation("cifar10", 2, "iid", seed=0, data_dir=tmp_path)


# ------------------------------------------------------------------------------- git-setup's Jupyter config


@pytest.mark.parametrize("content", [b'{"ContentsManager": {"x": 1},\n', b"{\xff}"])
def test_a_malformed_jupyter_config_is_named(tmp_path, content):
    """`git-setup` printed only "Expecting property name enclosed in double quotes: line 2 column 1", not
    which of the environment's files was broken."""
    path = lab.config_file(str(tmp_path))
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"{path}: not valid JSON .*: fix or remove it"):
        lab.install_hook(str(tmp_path))
    assert path.read_bytes() == content


def test_git_setup_on_a_config_it_cannot_use_leaves_git_as_it_was(tmp_path, git_installed):
    """`git-setup` installed nbstripout as git's filter first and read the Jupyter config after, so a broken
    config stopped it half done (the filter in, no hook). The config is checked first now: git untouched."""
    import subprocess

    repo = tmp_path / "clone"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    path = lab.config_file(str(tmp_path / "env"))
    path.parent.mkdir(parents=True)
    path.write_text('{"ContentsManager": "x"}')
    with pytest.raises(ValueError, match="ContentsManager='x' is not an object of settings"):
        lab.setup_git(repo, prefix=str(tmp_path / "env"))
    filters = subprocess.run(["git", "-C", str(repo), "config", "--local", "--get-regexp", "filter"],
                             capture_output=True, text=True, check=False)  # fmt: skip
    assert filters.stdout == ""  # no nbstripout filter installed
    assert not (repo / ".git" / "info" / "attributes").exists()
    assert path.read_text() == '{"ContentsManager": "x"}'


# ------------------------------------------------------------------------------------------- the Python API


def test_none_is_not_a_defense_or_an_attack_name():
    """`str(None)` is "none": `make_aggregator(cfg.get("defense"), f)` silently built the plain average, and
    `make_attack(None)` no attack."""
    with pytest.raises(ValueError, match=r"defense must be a name such as 'prodigy'.*got None"):
        make_aggregator(None, 2)
    with pytest.raises(ValueError, match=r"attack must be a name such as 'alie'.*got None"):
        make_attack(None)


def test_wrong_argument_types_are_named_not_a_traceback_from_inside():
    with pytest.raises(ValueError, match=r"krum: n_clients must be an integer >= 1, got n_clients='10'"):
        make_aggregator("krum", 2, "10")
    assert make_aggregator("krum", 2, torch.tensor(10)).rule.f == 2  # an integer of another type is one
    with pytest.raises(ValueError, match=r"cclip: params must be a mapping of settings.*got \[1\]"):
        make_aggregator("cclip", 2, 10, params=[1])
    with pytest.raises(ValueError, match=r"attack 'foe': params must be a mapping of settings.*got \[1\]"):
        make_attack("foe", params=[1])
    honest, own = torch.randn(7, 3), torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"alie: server must be the pipeline it plays against.*got None"):
        make_attack("alie").craft(honest, own, None)
    sent = make_attack("foe_0.1").craft(honest, own, make_aggregator("median", 3))
    assert sent.shape == own.shape and bool(torch.isfinite(sent).all())  # a server: it crafts


# ------------------------------------------------------- the training, store and report audit (helper-28)


def test_two_processes_taking_over_one_stale_lock_never_both_hold_it(tmp_path, monkeypatch):
    """B read the stale lock, was descheduled, A took it over and wrote its own; B then renamed A's fresh
    lock away as "the stale one" and both trained the run. B now sees that what it moved is not the lock it
    judged, puts it back and backs off."""
    import socket
    import threading

    lock = tmp_path / "k.lock"
    lock.write_text(json.dumps({"pid": 2**22 + 12345, "host": socket.gethostname(), "started": 0}))  # dead
    a, b = results.Claims(tmp_path, skip_done=False), results.Claims(tmp_path, skip_done=False)
    paused, go, alive = threading.Event(), threading.Event(), results._pid_alive

    def slow_pid_alive(pid):  # B stops between reading the lock and renaming it
        value = alive(pid)
        if threading.current_thread().name == "B":
            paused.set()
            go.wait(10)
        return value

    monkeypatch.setattr(results, "_pid_alive", slow_pid_alive)
    got: dict[str, bool] = {}
    thread = threading.Thread(target=lambda: got.__setitem__("B", b.claim("k")), name="B")
    thread.start()
    assert paused.wait(10)
    got["A"] = a.claim("k")
    held_by_a = json.loads(lock.read_text())
    go.set()
    thread.join()
    assert got == {"A": True, "B": False}
    assert json.loads(lock.read_text()) == held_by_a  # A's lock, back in place
    a.release_all()
    b.release_all()
    assert not lock.exists() and not list(tmp_path.glob("k.lock.stale.*"))


def test_releasing_a_lock_another_process_took_over_leaves_that_lock(tmp_path):
    """A suspended past LOCK_STALE_S: B took the run over; A woke, finished and deleted B's lock, so a third
    process could claim the run B was training."""
    import os
    import time

    a, b = results.Claims(tmp_path, skip_done=False), results.Claims(tmp_path, skip_done=False)
    assert a.claim("k")
    lock = tmp_path / "k.lock"
    old = time.time() - results.LOCK_STALE_S - 1
    os.utime(lock, (old, old))
    assert b.claim("k")
    b_lock = json.loads(lock.read_text())
    a.release("k")
    assert json.loads(lock.read_text()) == b_lock
    b.release("k")
    assert not lock.exists()
    a.release_all()
    b.release_all()


def test_a_resumed_run_records_the_environment_it_finished_in_and_the_earlier_one(tmp_path):
    """The checkpoint's result replaced this process's: a run started sequential at one thread and resumed
    batched at two recorded "sequential, 1 thread". Engine and threads are what last bits depend on."""
    from prodigy_core import training

    config = RunConfig(dataset="digits", n_clients=10, n_byzantine=3, rounds=4, eval_every=2,
                       checkpoint_every=2, engine="sequential", defense="prodigy", attack="alie")  # fmt: skip
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with training.killed_after(3):
            first = training.run(config, progress=False, checkpoint_dir=tmp_path)
        torch.set_num_threads(2)
        resumed = training.run(config.replace(engine="batched"), progress=False, checkpoint_dir=tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert (first.environment["engine"], first.environment["threads"]) == ("sequential", 1)
    env = resumed.environment
    assert (env["engine"], env["threads"]) == ("batched", 2)
    assert [(e["engine"], e["threads"], e["until_round"]) for e in env["earlier"]] == [("sequential", 1, 2)]


def test_the_diverged_footnote_says_what_a_diverged_run_scores_under_each_variant():
    """Under `authors` a diverged run keeps what their code reports (the class-0 share of a NaN network:
    10.58 on digits, 2.46 on our FEMNIST test set), not chance: the footnote said chance for both."""
    import pandas as pd

    from prodigy_core import report

    paper, authors = pd.DataFrame({"variant": ["paper"]}), pd.DataFrame({"variant": ["authors"]})
    assert report.diverged_note("one seed", paper).endswith("counts at chance accuracy")
    assert "class-0 share" in report.diverged_note("one seed", authors)
    assert "chance" not in report.diverged_legend("3 seeds", authors)
    both = report.diverged_legend("3 seeds", pd.concat([authors, paper]))
    assert both.startswith("† diverged in at least one seed (counted at chance accuracy or the accuracy")


def test_comparing_a_blocked_report_is_refused_not_one_block_silently():
    """Blocks repeat their row and column labels: the cells of all but the last block were overwritten, and
    "k of n cells" counted one block of eight."""
    from prodigy_core import report

    block = "| Defense | ALIE |\n|:---|---:|\n| ProDiGy | 50.00 |\n"
    two = f"## beta 0\n\n{block}\n## beta 0.9\n\n{block}"
    with pytest.raises(ValueError, match=r"a report of 2 blocks: compare one block's table at a time"):
        report.compare_with_reference(two, two)
    assert report.compare_with_reference(block, block)[1:] == (1, 1)
