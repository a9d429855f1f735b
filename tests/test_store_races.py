"""The results store under races and kills, found by a review of its concurrency code (helper-34): a live
lock that cannot be read, two processes taking over one garbage lock, a link that NFS reports as failed, a
process killed inside `save_record` or `atomic_write`, and a pool worker that dies after writing records."""

import errno
import json
import os
import time
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool

import pytest
from test_results import record

from prodigy_core import experiments, results
from prodigy_core.config import RunConfig
from prodigy_core.safe_io import write_json_atomic


def age(path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_live_lock_that_cannot_be_read_is_judged_by_its_heartbeat(tmp_path, monkeypatch):
    """Another user's lock under umask 077, or a passing NFS error: it was taken for garbage once 10 s old
    (two thirds of the time between heartbeats), removed, and the run trained twice."""
    holder = results.Claims(tmp_path)
    assert holder.claim("k")
    lock = tmp_path / "k.lock"
    real_open = os.open

    def denied(path, flags, *args, **kwargs):  # what a second user gets (these tests may run as root)
        if str(path) == str(lock):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    other = results.Claims(tmp_path)
    age(lock, 12)
    assert not other.claim("k")
    assert "unreadable (Permission denied), last heartbeat 12 s ago" in results.lock_state(lock)
    age(lock, results.LOCK_STALE_S + 1)  # no heartbeat for that long: its claimant is gone
    assert other.claim("k")
    monkeypatch.undo()
    assert json.loads(lock.read_text()) == other._written["k"]
    holder.release_all()  # the lock is other's now: left in place
    assert json.loads(lock.read_text()) == other._written["k"]
    other.release_all()


def test_a_lock_that_cannot_even_be_looked_at_is_busy(tmp_path, monkeypatch):
    """An ESTALE from lstat on NFS: the take-over raised UnboundLocalError instead of backing off."""
    holder = results.Claims(tmp_path)
    assert holder.claim("k")
    real_lstat = os.lstat

    def stale_handle(path, *args, **kwargs):
        if str(path).endswith("k.lock"):
            raise OSError(errno.ESTALE, "Stale file handle", str(path))
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", stale_handle)
    assert not results.Claims(tmp_path).claim("k")
    monkeypatch.undo()
    holder.release_all()


def test_two_processes_taking_over_one_garbage_lock_never_both_hold_it(tmp_path, monkeypatch):
    """B judged an old empty lock garbage; A took it over and claimed before B acted, and B removed A's
    fresh lock and claimed too. B now moves the lock aside first, sees it is not the one it judged, and puts
    it back."""
    lock = tmp_path / "k.lock"
    lock.write_text("")  # a claim killed between create and write, where there are no hard links
    age(lock, 60)
    a, b = results.Claims(tmp_path), results.Claims(tmp_path)
    real_rename, real_remove, armed = os.rename, results._remove, [True]

    def a_first(act):  # the step that takes the judged lock away: A claims just before B's
        def hooked(*args):
            if armed and armed.pop():
                assert a.claim("k")
            return act(*args)

        return hooked

    monkeypatch.setattr(os, "rename", a_first(real_rename))
    monkeypatch.setattr(results, "_remove", a_first(real_remove))
    assert not b.claim("k")
    assert "k" in a.held and json.loads(lock.read_text()) == a._written["k"]
    a.release_all()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no grave left either


def test_a_link_made_but_reported_as_existing_is_a_claim(tmp_path, monkeypatch):
    """NFS: a retried link finds the name it made and says EEXIST. The claim returned False, and its own
    live lock then kept every grid of this host off the run."""
    real_link = os.link

    def lost_reply(src, dst, **kwargs):
        real_link(src, dst, **kwargs)
        raise FileExistsError(errno.EEXIST, "File exists", str(dst))

    monkeypatch.setattr(os, "link", lost_reply)
    claims = results.Claims(tmp_path)
    assert claims.claim("k") and claims.held == {"k"}
    assert json.loads((tmp_path / "k.lock").read_text())["pid"] == os.getpid()
    assert not results.Claims(tmp_path).claim("k")  # and it excludes others
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.lock"]


def test_what_a_kill_inside_save_record_leaves_is_not_read_and_is_cleared(tmp_path):
    """save_record writes the record, then removes the failure record and the checkpoint. A kill between
    left both for good: a load with failures had two rows for the run, one of them 'failed'."""
    config = RunConfig()
    key = config.key()
    results.save_failure(tmp_path, key, config.to_dict(), RuntimeError("CUDA out of memory"), "e")
    checkpoint = results.checkpoint_dir(tmp_path) / f"{key}.pt"
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(b"weights")
    write_json_atomic(results.record_path(tmp_path, key), {"key": key, "experiment": "e", "status": "done",
                                                           **record(config, 50.0)})  # fmt: skip
    rows = results.read_records(tmp_path, include_failed=True)
    assert [(r["key"], r["status"]) for r in rows] == [(key, "done")]
    results.Claims(tmp_path).clear_finished([key])
    assert not results.failure_path(tmp_path, key).exists() and not checkpoint.exists()
    assert not (tmp_path / f"{key}.lock").exists()


def test_a_finished_run_claimed_again_keeps_its_files(tmp_path):
    """A --force rerun holds the run's lock: its checkpoint is its own, not a leftover to clear."""
    config = RunConfig()
    key = config.key()
    results.save_record(tmp_path, key, record(config, 50.0), "e")
    rerun = results.Claims(tmp_path, skip_done=False)
    assert rerun.claim(key)
    checkpoint = results.checkpoint_dir(tmp_path) / f"{key}.pt"
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(b"weights")
    results.Claims(tmp_path).clear_finished([key])
    assert checkpoint.exists() and json.loads((tmp_path / f"{key}.lock").read_text()) == rerun._written[key]
    rerun.release_all()


def test_a_force_reruns_failure_after_the_record_is_shown_and_kept(tmp_path):
    """The record is older than the failure here: a --force rerun failed, which a load with failures shows
    and a later grid keeps (only a failure older than the record is a kill's leftover)."""
    config = RunConfig()
    key = config.key()
    results.save_record(tmp_path, key, record(config, 50.0), "e")
    age(results.record_path(tmp_path, key), 60)
    results.save_failure(tmp_path, key, config.to_dict(), RuntimeError("CUDA out of memory"), "e")
    rows = results.read_records(tmp_path, include_failed=True)
    assert sorted(r["status"] for r in rows) == ["done", "failed"]
    results.Claims(tmp_path).clear_finished([key])
    assert results.failure_path(tmp_path, key).exists()


def test_a_killed_writers_temporary_files_are_cleared_once_old(tmp_path):
    """A kill inside atomic_write or a lock's creation leaves its temporary file: checkpoints are a model's
    size each, and nothing removed them."""
    (tmp_path / "checkpoints").mkdir()
    old = [tmp_path / n for n in (".k.json.ab12.tmp", ".k.lock.cd34.tmp", "checkpoints/.k.pt.ef56.tmp")]
    fresh = tmp_path / "checkpoints/.j.pt.0123.tmp"  # being written now
    others = [tmp_path / ".notes.tmp", tmp_path / ".my.csv.ab12.tmp"]  # not the store's: never touched
    for path in [*old, fresh, *others]:
        path.write_bytes(b"x")
    for path in [*old, *others]:
        age(path, results.LOCK_STALE_S + 1)
    results.Claims(tmp_path).clear_finished([])
    assert [p.exists() for p in old] == [False, False, False]
    assert fresh.exists() and all(p.exists() for p in others)


def test_a_pool_worker_that_dies_after_storing_its_records_is_not_trained_again(tmp_path, monkeypatch):
    """The pool gave a dead worker's runs to a fresh pool without looking at the store: a group that wrote
    its records and was then killed trained again, from round 0 (its checkpoints were gone)."""
    configs = [RunConfig(seed=s) for s in (1, 2)]
    keys = [c.key() for c in configs]
    tasks = {k: experiments.Task(c.to_dict(), str(tmp_path / "checkpoints"), None, str(tmp_path), "e", key=k)
             for k, c in zip(keys, configs, strict=True)}  # fmt: skip
    trained: list[str] = []

    class DiesAfterWriting:  # the first work item's worker writes its records, then is killed
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, fn, work, threads):
            future = Future()
            for task in work:
                trained.append(task.key)
                results.save_record(tmp_path, task.key, record(RunConfig.from_dict(task.config), 50.0), "e")
            if len(trained) == len(work):
                future.set_exception(BrokenProcessPool("killed after writing its records"))
            else:
                future.set_result([(t.key, {"final_accuracy": 50.0}) for t in work])
            return future

    monkeypatch.setattr(experiments, "worker_pool", lambda jobs: DiesAfterWriting())
    claims = results.Claims(tmp_path)
    outcomes = {k: o for k, o, _ in experiments._pool_outcomes(tasks, [keys], claims, jobs=1, threads=1)}
    assert sorted(trained) == sorted(keys)  # each trained once
    assert {k: o["final_accuracy"] for k, o in outcomes.items()} == {k: 50.0 for k in keys}
    claims.release_all()


def test_a_file_system_that_refuses_modes_still_takes_records_and_locks(tmp_path, monkeypatch):
    """A FUSE mount whose chmod fails: every record, checkpoint and lock write raised from the mode."""

    def refused(fd, mode):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "fchmod", refused)
    write_json_atomic(tmp_path / "r.json", {"a": 1})
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1}
    assert results.Claims(tmp_path).claim("k") and (tmp_path / "k.lock").exists()


def test_a_ray_task_that_dies_after_storing_its_records_is_not_trained_again(tmp_path, monkeypatch):
    """Ray retried a task whose worker died (max_retries=1) without looking at the store; the retry is now
    the driver's: the stored runs are done, the others are submitted once more, then recorded as failed."""
    import sys
    import types

    configs = [RunConfig(seed=s) for s in (1, 2, 3)]
    keys = [c.key() for c in configs]
    tasks = {k: experiments.Task(c.to_dict(), str(tmp_path / "checkpoints"), None, str(tmp_path), "e", key=k)
             for k, c in zip(keys, configs, strict=True)}  # fmt: skip
    submitted: list[list[str]] = []

    class Remote:  # each task stores its first run's record, then its worker dies
        def options(self, **kwargs):
            return self

        def remote(self, here, work):
            submitted.append([t.key for t in work])
            results.save_record(tmp_path, work[0].key, record(RunConfig.from_dict(work[0].config), 50.0), "e")
            return len(submitted) - 1

    def get(ref):
        raise RuntimeError("the worker died")

    ray = types.SimpleNamespace(
        is_initialized=lambda: True, nodes=lambda: [{"Alive": True, "Resources": {"CPU": 4}}],
        remote=lambda **kw: lambda fn: Remote(), wait=lambda refs, num_returns: (refs[:1], refs[1:]), get=get,
        cancel=lambda *a, **k: None,
    )  # fmt: skip
    monkeypatch.setitem(sys.modules, "ray", ray)
    claims = results.Claims(tmp_path)
    outcomes = {k: o for k, o, _ in experiments._ray_outcomes(tasks, [keys], claims, 1, None, 1, 0)}
    claims.release_all()
    assert submitted == [keys, keys[1:]]  # the stored run not again; the rest once more
    assert outcomes[keys[0]]["final_accuracy"] == 50.0 and outcomes[keys[1]]["final_accuracy"] == 50.0
    assert isinstance(outcomes[keys[2]], RuntimeError)  # died twice: recorded as failed


def test_a_held_lock_moved_away_under_its_claim_is_written_again_by_the_heartbeat(tmp_path):
    """A take-over killed between renaming a live lock aside and putting it back left the run unlocked while
    it trained, for good: a third process could claim and train it too. The heartbeat puts it back."""
    claims = results.Claims(tmp_path)
    assert claims.claim("k")
    lock = tmp_path / "k.lock"
    lock.rename(tmp_path / "k.lock.stale.otherhost.4072.ab12cd34")  # the killed take-over's grave
    claims._beat_once("k")
    assert json.loads(lock.read_text()) == claims._written["k"]
    claims.release_all()
    assert not lock.exists()
    claims._beat_once("k")  # a released claim is not put back
    assert not lock.exists()


def test_a_held_lock_that_another_process_claimed_meanwhile_is_named(tmp_path):
    """The lock went from under a live claim and another process claimed the run in the gap."""
    mine, other = results.Claims(tmp_path, skip_done=False), results.Claims(tmp_path, skip_done=False)
    assert mine.claim("k")
    (tmp_path / "k.lock").unlink()
    assert other.claim("k")
    with pytest.warns(RuntimeWarning, match="is another process's now; both may train it"):
        mine._beat_once("k")
    assert json.loads((tmp_path / "k.lock").read_text()) == other._written["k"]  # left as it is
    mine.release_all()  # and not removed: it is other's
    assert json.loads((tmp_path / "k.lock").read_text()) == other._written["k"]
    other.release_all()
