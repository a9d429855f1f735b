"""Hostile inputs and faults (issue 18): one regression test per finding, each against an independent
expectation (a brute-force reference, an invariant, or the file system's state after the fault)."""

import errno
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from prodigy_core import cli, results, training
from prodigy_core.aggregators import AGGREGATOR_NAMES, make_aggregator
from prodigy_core.config import ConfigError, RunConfig, parse_value
from prodigy_core.experiments import Task, execute, experiment_from_spec, load_experiment, run_grid
from prodigy_core.training import RunResult, run

# A digits run of a second or less.
TINY = dict(dataset="digits", n_clients=6, n_byzantine=0, defense="average", attack="none", rounds=2,
            local_steps=1, batch_size=32, eval_every=2, checkpoint_every=1, device="cpu")  # fmt: skip
TINY_SET = [f"--set={k}={v}" for k, v in TINY.items()]


def tiny(**changes) -> RunConfig:
    return RunConfig(**{**TINY, **changes})


def same_result(a: RunResult, b: RunResult) -> bool:
    return (a.final_accuracy, a.final_loss, a.accuracy_curve) == (
        b.final_accuracy,
        b.final_loss,
        b.accuracy_curve,
    )


def one_error_line(err: str, *parts: str) -> None:
    """One `prodigy-fl: error: ...` line (after a progress bar, if one ran), no traceback."""
    lines = [
        line.partition("prodigy-fl: error: ")[2] for line in err.splitlines() if "prodigy-fl: error: " in line
    ]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(p in lines[0] for p in parts), err


# --------------------------------------------------------------------------- 3: exact trimmed mean


def bf_trimmed_mean(G: torch.Tensor, f: int) -> torch.Tensor:
    """Sort every coordinate in float64 and average the middle N - 2f values."""
    N = G.shape[0]
    return G.double().sort(dim=0).values[f : N - f].mean(dim=0)


@pytest.mark.parametrize("name", ["trimmed_mean", "nnm+trimmed_mean"])
@pytest.mark.parametrize("magnitude", [1e6, 1e8, 1e30, -1e30])
def test_trimmed_mean_is_exact_whatever_the_dropped_values(name, magnitude):
    N, f = 10, 3
    gen = torch.Generator().manual_seed(0)
    G = torch.rand(N, 1000, generator=gen) * 6 - 3  # honest values in [-3, 3]
    G[:f] = magnitude
    out = make_aggregator(name, f)(G).double()
    # nnm+: the mixing of the brute force is NNM's own (checked elsewhere); f huge rows stay far from it
    mixed = G if name == "trimmed_mean" else make_aggregator("nnm+average", f).pre[0](G)
    torch.testing.assert_close(out, bf_trimmed_mean(mixed, f), rtol=0, atol=1e-5)


def test_trimmed_mean_with_ties_at_the_kept_range_ends():
    G = torch.tensor([[1e8], [1e8], [2.0], [2.0], [2.0], [-1e8], [5.0]])
    assert make_aggregator("trimmed_mean", 2)(G).item() == 3.0  # kept: 2, 2, 5


# ---------------------------------------------------------------------- 4: non-finite rows, every rule

BAD_VALUES = {"inf": math.inf, "nan": math.nan, "-inf": -math.inf}
ROBUST_NAMES = [n for n in AGGREGATOR_NAMES if n.split("+")[-1] not in ("average", "none")]
SETTINGS = [(10, 3), (10, 2), (7, 3), (11, 2), (30, 3)]


@pytest.mark.parametrize("name", ROBUST_NAMES)
def test_every_accepted_robust_rule_is_finite_with_f_non_finite_rows(name):
    """The README's promise for every name make_aggregator accepts: finite while at most f rows are
    non-finite (all +inf, all NaN, all -inf, or one bad entry per row); a setting it cannot keep is rejected
    with the bound."""
    accepted = 0
    for N, f in SETTINGS:
        try:
            make_aggregator(name, f, n_clients=N)
        except ValueError as e:
            assert re.search(r"needs .*\d.*got N=\d+", str(e)), str(e)
            continue
        accepted += 1
        for seed in range(12):  # x 5 settings: 60 inputs per name
            gen = torch.Generator().manual_seed(seed)
            G = torch.randn(N, 8, generator=gen)
            rows = torch.randperm(N, generator=gen)[:f]
            value = list(BAD_VALUES.values())[seed % 3]
            if seed % 2:
                G[rows] = value
            else:
                G[rows, seed % 8] = value
            torch.manual_seed(seed)  # bucketing's shuffle
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                out = make_aggregator(name, f, n_clients=N)(G)
            assert torch.isfinite(out).all(), (name, N, f, seed)
    assert accepted, f"{name} accepts none of {SETTINGS}"


def test_bucketing_median_rejects_what_its_buckets_cannot_tolerate_with_the_bound():
    # 10 clients in buckets of 2: 5 buckets, of which 3 bad rows can spoil 3, a majority
    bound = r"bucketing\+median with 10 clients \(5 vectors.*N > 2f = 6, got N=5"
    with pytest.raises(ValueError, match=bound):
        make_aggregator("bucketing+median", 3, n_clients=10)
    make_aggregator("bucketing+median", 2, n_clients=10)  # 2 of 5 buckets: tolerated


# ------------------------------------------------------------------------------ 6: scale-equivariance

# GeoMed's nu and CClip's tau are absolute lengths (documented), so they are not scale-equivariant.
EQUIVARIANT = [n for n in AGGREGATOR_NAMES if n.split("+")[-1] not in ("geomed", "cclip")]


@pytest.mark.parametrize("name", EQUIVARIANT)
@pytest.mark.parametrize("scale", [1e19, 1e-25])
def test_rules_are_scale_equivariant_over_the_float32_range(name, scale):
    N, f = 30, 3  # every rule accepts it, bucketed ones included
    G = torch.randn(N, 64, generator=torch.Generator().manual_seed(1))
    # mild outliers: far ones would give every honest client the same NNM neighbourhood, hence equal mixed
    # vectors, whose ProDiGy scores are rounding noise at any scale
    G[:f] = G[:f] + 1.0
    torch.manual_seed(0)
    reference = make_aggregator(name, f)(G).double()
    torch.manual_seed(0)
    scaled = make_aggregator(name, f)(G * scale).double() / scale
    assert torch.isfinite(scaled).all()
    # G * scale rounds every entry once (float32), and the scaled geometry comes from float64 products
    torch.testing.assert_close(scaled, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))


# ------------------------------------------------------------- 1, 7, 8: checkpoints that cannot be resumed


class _Payload:
    """Pickles as a call of exec: loading it with weights_only=False would write the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",)


def _truncated(path: Path, cfg: RunConfig) -> None:
    with training.killed_after(1):
        training.run(cfg, progress=False, checkpoint_dir=path.parent)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("kind", ["crafted", "garbage", "truncated", "empty"])
def test_an_unreadable_checkpoint_runs_no_code_is_moved_aside_and_the_run_restarts(tmp_path, kind):
    cfg = tiny()
    ckpt, marker = tmp_path / f"{cfg.key()}.pt", tmp_path / "marker"
    if kind == "crafted":
        torch.save({"key": cfg.key(), "round": 1, "payload": _Payload(marker)}, ckpt)
    elif kind == "truncated":
        _truncated(ckpt, cfg)
    else:
        ckpt.write_bytes(b"" if kind == "empty" else b"not a checkpoint\n")
    with pytest.warns(RuntimeWarning, match=rf"checkpoint .*{cfg.key()}\.pt cannot be resumed.*round 0"):
        resumed = run(cfg, progress=False, checkpoint_dir=tmp_path)
    assert not marker.exists()  # no code from the file ran
    assert len(list(tmp_path.glob(f"{cfg.key()}.pt.unreadable-*"))) == 1 and not ckpt.exists()
    assert same_result(resumed, run(cfg, progress=False))  # from round 0


def test_a_run_killed_before_its_first_evaluation_resumes(tmp_path):
    cfg = tiny(rounds=3, eval_every=3)
    with training.killed_after(1):  # killed: no accuracy yet
        training.run(cfg, progress=False, checkpoint_dir=tmp_path)
    assert torch.load(tmp_path / f"{cfg.key()}.pt", weights_only=True)["result"]["final_accuracy"] is None
    rounds = []
    resumed = run(cfg, progress=True, checkpoint_dir=tmp_path, on_round=lambda r, *_: rounds.append(r))
    assert rounds == [2, 3] and same_result(resumed, run(cfg, progress=False))


def test_force_ignores_and_replaces_a_checkpoint(tmp_path, monkeypatch):
    cfg = tiny(rounds=3)
    with training.killed_after(2):
        training.run(cfg, progress=False, checkpoint_dir=tmp_path)
    rounds = []
    forced = run(cfg, progress=False, checkpoint_dir=tmp_path, resume=False,
                 on_round=lambda r, *_: rounds.append(r))  # fmt: skip
    assert rounds == [1, 2, 3] and not (tmp_path / f"{cfg.key()}.pt").exists()
    assert same_result(forced, run(cfg, progress=False))
    # the command line and the grid pass --force down as resume=False
    seen = []

    def spy(config, **kwargs):
        seen.append(kwargs["resume"])
        raise ValueError("stop here")

    monkeypatch.setattr(training, "run", spy)
    assert cli.main(["run", *TINY_SET, "--force", "--results-dir", str(tmp_path)]) != 0
    spec = {"experiment": "forced", "base": TINY}
    for force in (False, True):
        run_grid(experiment_from_spec(spec), force=force, results_dir=tmp_path, progress=False)
    assert seen == [False, True, False]


# --------------------------------------------------------------------------------- 2: experiment names


@pytest.mark.parametrize("name", ["..", ".", "../up", "a/b", "a..b", ".hidden", "a\\b", ""])
def test_an_experiment_name_is_a_safe_folder_name(name):
    with pytest.raises(ConfigError, match=r"experiment=.* must be a folder name: letters, digits"):
        experiment_from_spec({"experiment": name, "base": TINY})


def test_a_safe_experiment_name_is_accepted():
    assert (
        experiment_from_spec({"experiment": "table1_cifar10.v2-b", "base": TINY}).name
        == "table1_cifar10.v2-b"
    )


# --------------------------------------------------------------------- 5, 11: records validated on load


SEEDS = {"experiment": "seeds", "base": TINY, "seeds": [0, 1]}


@pytest.mark.parametrize(
    "content, why",
    [
        ("{}", "key None is not its file name"),
        ("[]", "a record is a JSON object, this is list"),
        ("null", "a record is a JSON object, this is NoneType"),
        ("{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        ("OTHER", "is not its file name"),  # the other seed's record, copied under this name
        ("HUGE", "final_accuracy=1000000000.0 is not a percentage in [0, 100]"),
    ],
)
def test_an_invalid_record_is_named_left_out_moved_aside_and_rerun(tmp_path, fake_training, content, why):
    experiment = experiment_from_spec(SEEDS)
    run_grid(experiment, results_dir=tmp_path, progress=False)
    folder = tmp_path / "seeds"
    first, other = (results.record_path(folder, c.key()) for c in experiment.configs)
    if content == "OTHER":
        content = other.read_text()
    elif content == "HUGE":
        content = json.dumps({**json.loads(first.read_text()), "final_accuracy": 1e9})
    bad = content if isinstance(content, bytes) else content.encode()
    first.write_bytes(bad)
    with pytest.warns(RuntimeWarning, match=re.escape(f"{first}: not a valid result record")) as caught:
        df = results.load(experiment, tmp_path)
    assert why in str(caught[0].message)
    assert list(df["seed"]) == [1]  # counted neither as seed 0 nor twice as seed 1
    fake_training.clear()
    with pytest.warns(RuntimeWarning, match=re.escape(f"{first}: not a valid result record")):
        df = run_grid(experiment, results_dir=tmp_path, progress=False)
    assert fake_training == [0] and list(df["seed"]) == [0, 1]  # rerun
    moved = list(folder.glob(f"{first.name}.invalid-*"))
    assert len(moved) == 1 and moved[0].read_bytes() == bad  # kept, byte for byte


def test_a_run_with_an_invalid_json_record_present_reruns_it(tmp_path, capsys):
    """Row 17: `run` names the file in one warning line, moves it aside and reruns."""
    key = tiny().key()
    path = results.record_path(tmp_path / "runs", key)
    path.parent.mkdir(parents=True)
    path.write_text('{"key": \n')
    assert cli.main(["run", *TINY_SET, "--results-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert f"prodigy-fl: warning: {path}: not a valid result record: not valid JSON" in err
    assert "Traceback" not in err and results.stored_record(path.parent, key) is not None
    assert len(list(path.parent.glob(f"{key}.json.invalid-*"))) == 1


# ---------------------------------------------------------------------------- 9: workers and their parent

CHILD = """
import os, sys, time
from prodigy_core.experiments import worker_pool
pool = worker_pool(2)
futures = [pool.submit(time.sleep, 120) for _ in range(2)]
while len(pool._processes) < 2:
    time.sleep(0.05)
print(" ".join(str(pid) for pid in pool._processes), flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"  # an unreaped zombie has exited
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX process model")
def test_pool_workers_exit_when_the_grid_process_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    try:
        workers = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(workers) == 2 and all(_alive(pid) for pid in workers)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in workers)


def test_a_worker_writes_the_record_of_the_run_it_finished(tmp_path, monkeypatch):
    cfg = tiny()
    finished = RunResult(config=cfg.to_dict(), final_accuracy=42.0, final_loss=1.0)
    monkeypatch.setattr(training, "run", lambda config, **kw: finished)
    record = execute(Task(cfg.to_dict(), str(tmp_path / "ckpt"), None, str(tmp_path), "exp"))
    assert results.stored_record(tmp_path, cfg.key()) == {"key": cfg.key(), "experiment": "exp",
                                                          "status": "done", **record}  # fmt: skip


# ----------------------------------------------------------------------- 10, 11: locks and heartbeats


def _lock(folder: Path, key: str, content: object, age: float) -> Path:
    path = folder / f"{key}.lock"
    path.write_text(json.dumps(content))
    os.utime(path, (time.time() - age, time.time() - age))
    return path


@pytest.mark.parametrize(
    "content",
    [{"pid": 1, "host": socket.gethostname()}, {"pid": 12345, "host": "another-host"}, [], None, "x"],
)
def test_a_lock_without_a_heartbeat_is_taken_over_a_fresh_one_is_not(tmp_path, content):
    claims = results.Claims(tmp_path)
    _lock(tmp_path, "fresh", content, age=1)
    _lock(tmp_path, "stale", content, age=results.LOCK_STALE_S + 1)
    assert not claims.claim("fresh")  # a live holder (or a lock being written): respected
    assert claims.claim("stale")
    assert json.loads((tmp_path / "stale.lock").read_text())["pid"] == os.getpid()
    claims.release_all()


def test_a_held_lock_gets_a_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "LOCK_HEARTBEAT_S", 0.02)
    claims = results.Claims(tmp_path)
    assert claims.claim("k")
    lock = tmp_path / "k.lock"
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    deadline = time.monotonic() + 5
    while time.time() - lock.stat().st_mtime > 60 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert time.time() - lock.stat().st_mtime < 60
    claims.release_all()
    assert not lock.exists() and claims._beat is None


def test_the_grid_lists_runs_left_undone_and_exits_1(tmp_path, fake_training, capsys):
    params = tmp_path / "seeds.yaml"
    params.write_text(json.dumps(SEEDS))
    experiment = load_experiment(params)
    busy = experiment.configs[1]
    folder = tmp_path / "res" / "seeds"
    folder.mkdir(parents=True)
    _lock(folder, busy.key(), {"pid": 4242, "host": "another-host"}, age=1)
    assert cli.main(["grid", str(params), "--results-dir", str(tmp_path / "res")]) == 1
    err = capsys.readouterr().err
    assert (
        fake_training == [0]
        and f"undone seed=1: claimed by another process ({folder / busy.key()}.lock)" in err
    )
    assert "1 left undone" in err
    (folder / f"{busy.key()}.lock").unlink()
    assert cli.main(["grid", str(params), "--results-dir", str(tmp_path / "res")]) == 0


def test_the_grid_counts_the_runs_another_process_trained_meanwhile(
    tmp_path, fake_training, capsys, monkeypatch
):
    """Two processes on one grid: a run the other one claimed and finished while this one trained is counted
    as the other's (the counts add up to the grid), not left out of the summary."""
    from prodigy_core import experiments

    params = tmp_path / "seeds.yaml"
    params.write_text(json.dumps(SEEDS))
    busy = load_experiment(params).configs[1]
    folder = tmp_path / "res" / "seeds"
    folder.mkdir(parents=True)
    lock = _lock(folder, busy.key(), {"pid": 4242, "host": "another-host"}, age=1)
    train = experiments.execute

    def train_while_the_other_finishes(task, threads=None):
        record = {"config": busy.to_dict(), "final_accuracy": 10.0, "accuracy_curve": []}
        results.save_record(folder, busy.key(), record, "seeds")  # the other process, meanwhile
        lock.unlink()
        return train(task, threads)

    monkeypatch.setattr(experiments, "execute", train_while_the_other_finishes)
    assert cli.main(["grid", str(params), "--results-dir", str(tmp_path / "res")]) == 0
    assert fake_training == [0]
    assert (
        "seeds: 1 run trained, 1 by another process, 0 already stored, 0 failed;" in capsys.readouterr().err
    )


# ------------------------------------------------------------------ 12-17: one error line, exit 2


def test_an_unwritable_results_folder_is_found_before_training(tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(results.tempfile, "TemporaryFile", refuse)  # root ignores chmod: simulate it
    monkeypatch.setattr(training, "run", lambda *a, **k: pytest.fail("trained into a folder it cannot write"))
    assert cli.main(["run", *TINY_SET, "--results-dir", str(tmp_path)]) == 2
    one_error_line(capsys.readouterr().err, f"cannot write results into {tmp_path / 'runs'}", "--results-dir")


def test_a_results_dir_that_is_a_file_is_one_error_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert cli.main(["run", *TINY_SET, "--results-dir", str(tmp_path / "file")]) == 2
    one_error_line(capsys.readouterr().err, "cannot write results into", "PRODIGY_RESULTS_DIR")


class _FullDisk:
    """A file whose writes fail as on a full disk."""

    def __init__(self, fh):
        self.fh = fh

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()


def test_a_full_disk_is_one_error_line_and_leaves_no_empty_lock_or_temp_file(tmp_path, monkeypatch, capsys):
    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: _FullDisk(real_fdopen(fd, *a, **k)))
    with pytest.raises(OSError, match="No space left"):
        results.Claims(tmp_path / "locks").claim("k")
    assert list((tmp_path / "locks").iterdir()) == []  # no 0-byte lock
    assert cli.main(["run", *TINY_SET, "--results-dir", str(tmp_path / "res")]) == 2
    one_error_line(capsys.readouterr().err, "No space left on device")
    # no temp file, no empty lock: the run's lock (`prodigy-fl run` claims it, issue 42) is written first
    assert [p.name for p in (tmp_path / "res" / "runs").iterdir()] == []


def test_a_failed_checkpoint_write_names_the_file(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match=rf"cannot write the checkpoint .*{tiny(rounds=3).key()}\.pt"):
        run(tiny(rounds=3), progress=False, checkpoint_dir=tmp_path)


def test_a_checkpoint_folder_that_cannot_be_written_is_named_before_the_first_round(tmp_path, monkeypatch):
    """It was found at the first checkpoint (round 50 by default), the rounds before it lost, or, in a run too
    short to save one, when the run's end deleted it: the whole run lost."""
    from prodigy_core import training

    rounds = []
    monkeypatch.setattr(training, "server_round", lambda st, r, *args: rounds.append(r))
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match=rf"cannot write checkpoints into {tmp_path / 'file' / 'sub'} \(Not a "
                       r"directory\); pass checkpoint_dir to a writable folder"):  # fmt: skip
        run(tiny(rounds=3), progress=False, checkpoint_dir=tmp_path / "file" / "sub")
    assert rounds == []


@pytest.mark.parametrize(
    "args, parts",
    [
        (["--set", "dirichlet_alpha=.inf"], ["dirichlet_alpha=inf must be a finite number"]),
        (["--set", "dirichlet_alpha=inf"], ["dirichlet_alpha='inf' must be a number"]),
    ],
)
def test_infinite_dirichlet_alpha_is_one_error_line(tmp_path, capsys, args, parts):
    assert cli.main(["run", *args, "--results-dir", str(tmp_path)]) == 2
    one_error_line(capsys.readouterr().err, *parts)


def test_a_params_file_that_is_not_utf8_is_named(tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("title: caf\xe9\n".encode("latin-1"))
    assert cli.main(["grid", str(path), "--results-dir", str(tmp_path)]) == 2
    one_error_line(capsys.readouterr().err, str(path), "not UTF-8 text")


# ----------------------------------------------------------------- 18-23: nonsense rejected with a fix


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"lr": math.nan}, "lr=nan must be a finite number (default 0.05)"),
        ({"lr": math.inf}, "lr=inf must be a finite number"),
        ({"weight_decay": math.nan}, "weight_decay=nan must be a finite number (null for the default)"),
        ({"lr_decay_factor": -5}, "lr_decay_factor=-5.0 must be > 0"),
        ({"lr_decay_at": -3}, "lr_decay_at=-3 must be a round >= 0, or null"),
        ({"record_distances_at": [0, 5]}, "record_distances_at=[0, 5]: [0] not in 1..rounds=100"),
        ({"record_distances_at": [101]}, "[101] not in 1..rounds=100"),
        ({"attack": "alei", "n_byzantine": 3}, "unknown attack 'alei' (did you mean 'alie'?)"),
        ({"rounds": "1e2"}, "rounds='1e2' must be an integer, not str (YAML reads 1e2 as text: write 100)"),
        ({"rounds": 100.0}, "rounds=100.0 must be an integer, not float (write 100)"),
        ({"weight_decay": "1e-3"}, "weight_decay='1e-3' must be a number or null (YAML reads 1e-3 as text"),
        ({"lr_decay_at": "x"}, "lr_decay_at='x' must be an integer or null"),
    ],
)
def test_nonsense_is_rejected_with_the_field_and_the_fix(changes, message):
    with pytest.raises(ConfigError) as caught:
        RunConfig.from_dict(changes)
    assert message in str(caught.value)


def test_a_command_line_number_in_e_notation_is_a_number():
    assert parse_value("lr", "1e-3") == 0.001 and parse_value("rounds", "1e2") == 100.0


@pytest.mark.parametrize("grid", [{}, [], [{}], [{"defense": ["prodigy"]}, {}]])
def test_an_empty_grid_is_rejected(grid):
    with pytest.raises(ConfigError, match=r"grid=.*(is empty|has an empty mapping)"):
        experiment_from_spec({"experiment": "x", "base": TINY, "grid": grid})


def test_defense_and_attack_are_case_insensitive_and_stored_under_one_key():
    mixed = RunConfig(defense="ProDiGy", attack="ALIE", n_byzantine=3)
    assert (mixed.defense, mixed.attack) == ("prodigy", "alie")
    assert mixed.key() == RunConfig(defense="prodigy", attack="alie", n_byzantine=3).key()


# ------------------------------------------------------------------------- 24: report --set, help texts


def test_report_takes_the_set_values_the_grid_ran_with(tmp_path, fake_training, capsys):
    params = tmp_path / "seeds.yaml"
    params.write_text(json.dumps({**SEEDS, "report": {"rows": "seed"}}))
    where = ["--results-dir", str(tmp_path / "res")]
    assert cli.main(["grid", str(params), "--set", "rounds=3", *where]) == 0
    assert cli.main(["report", str(params), *where, "--out-dir", str(tmp_path)]) == 2  # rounds=2: no run
    assert cli.main(["report", str(params), "--set", "rounds=3", *where, "--out-dir", str(tmp_path)]) == 0


def test_every_option_of_every_command_has_a_help_text():
    """--executor, --scale, quickstart --jobs had none; --only said "params files" but wants notebooks."""
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict)).choices
    missing = [f"{name} {'/'.join(a.option_strings) or a.dest}" for name, sub in commands.items()
               for a in sub._actions if a.option_strings and not a.help]  # fmt: skip
    assert missing == []
    reproduce = commands["reproduce"].format_help()
    assert "notebooks, by name" in reproduce and "params files" not in reproduce
