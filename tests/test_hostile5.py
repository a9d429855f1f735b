"""Hostile inputs, round 5: the GPU driver's import and resume of a corrupted tarball, its exit status when
no run started, a reused autotune.json of the wrong shape, records that pass the store's check yet broke the
reports, and deeply nested JSON. One regression test per finding, each against an independent expectation
(zlib's own verdict, hand-made tarballs and records, argparse's help, the file system after the fault)."""

import argparse
import json
import tarfile
import time
import zlib
from pathlib import Path

import pytest
import torch
from test_hostile4_report import FOLDER, provenance_rows, quick, write_tar

from prodigy_core import report, results
from prodigy_core.experiments import load_experiment, select


@pytest.fixture
def roots(tmp_path):
    return tmp_path / "results", tmp_path / "figures"


def import_argv(tarball: Path, roots: tuple[Path, Path]) -> list[str]:
    return ["import", str(tarball), "--results-root", str(roots[0]), "--figures-root", str(roots[1])]


def one_error_line(err: str, start: str) -> str:
    err = err.strip()
    assert err.startswith(start) and "\n" not in err and "Traceback" not in err, err
    return err


# ------------------------------------------------------------------ 1: a gzip stream's CRC and length


def long_record_tarball(path: Path) -> Path:
    """A results tarball of one record with a long accuracy curve (a compressed body worth corrupting)."""
    ((name, record),) = quick(n=1)
    record["accuracy_curve"] = [[i, 50.0 + (i * 37 % 1000) / 100] for i in range(1, 200)]
    record["final_accuracy"] = record["accuracy_curve"][-1][1]
    return write_tar(path, [(name, record)])


def corrupted(data: bytes, where: str) -> bytes:
    """`data` (a gzip file) with one bit flipped: in the stored CRC or length, or the first bit of the
    compressed body after which zlib still inflates it whole, to bytes of the same length whose tar header
    block is intact and whose record differs: what only the CRC catches."""
    if where != "body":
        at = len(data) - (8 if where == "crc" else 4)
        return data[:at] + bytes([data[at] ^ 0x04]) + data[at + 1 :]
    start = data.index(b"\0", 10) + 1 if data[3] & 0x08 else 10  # after the header's file name
    original = zlib.decompress(data[start:], wbits=-15)  # raw deflate: no check
    for at in range(start, len(data) - 8):
        flipped = data[:at] + bytes([data[at] ^ 0x04]) + data[at + 1 :]
        try:
            inflated = zlib.decompress(flipped[start:], wbits=-15)
        except zlib.error:
            continue
        if len(inflated) == len(original) and inflated[:512] == original[:512] and inflated != original:
            return flipped
    raise AssertionError("no bit of the body inflates to other bytes")


@pytest.mark.parametrize("where, check", [("body", "data"), ("crc", "data"), ("length", "length")])
def test_r5_1_a_tarball_failing_its_gzip_crc_or_length_is_refused_before_anything_is_written(
    gpu_run, tmp_path, roots, capsys, where, check
):
    """A results tarball whose gzip stream fails its CRC (a bit of the body or of the stored CRC flipped) or
    its length check, as zlib itself says, is refused in one line (exit 2) with nothing written; tarfile
    alone stops at the end-of-archive blocks and had imported the body's other bytes as the record. A
    --resume of it stops in the preflight the same way."""
    tarball = long_record_tarball(tmp_path / "r.tar.gz")
    tarball.write_bytes(corrupted(tarball.read_bytes(), where))
    with pytest.raises(zlib.error, match=f"incorrect {check} check"):
        zlib.decompress(tarball.read_bytes(), wbits=31)
    assert gpu_run.main(import_argv(tarball, roots)) == gpu_run.EXIT_PREFLIGHT
    err = one_error_line(capsys.readouterr().err, "gpu_run import: error: ")
    assert "corrupted" in err and ("CRC" in err or "length" in err.lower())
    assert not roots[0].exists() and not roots[1].exists()
    out = tmp_path / "out"
    argv = ["--simulate", "--data", str(tmp_path), "--out", str(out), "--resume", str(tarball)]
    assert gpu_run.main(argv) == gpu_run.EXIT_PREFLIGHT
    one_error_line(capsys.readouterr().err, "gpu_run: error: --resume ")
    assert not out.exists()


def test_r5_1_b_an_intact_tarball_is_still_read_whole(gpu_run, tmp_path):
    """Reading the stream to its end changes nothing for an intact tarball: its one record, byte for byte."""
    tarball = long_record_tarball(tmp_path / "r.tar.gz")
    with tarfile.open(tarball) as tar:
        expected = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
    assert gpu_run.read_tarball(tarball) == expected


# ------------------------------------------------------------ 2, 5: no run started, a step never prepared


def driver_of(gpu_run, tmp_path, **fields) -> object:
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir(parents=True)
    work.mkdir()
    args = argparse.Namespace(**{"simulate": True, "profile": "paper", "out": out, "group_size": 16,
                                 "deadline": 235.0, "fail_step": None, **fields})  # fmt: skip
    return gpu_run.Driver(args, work)


def summary_lines(driver) -> dict[str, str]:
    """summary.txt's lines by their first word (a step's row by its step)."""
    lines = (driver.work / "summary.txt").read_text().splitlines()
    return {line.split(" | ")[0] if " | " in line else line.split()[0]: line for line in lines}


def test_r5_2_a_command_in_which_no_run_fitted_the_deadline_fails_and_names_its_steps(gpu_run, tmp_path):
    """Every run fits the whole --deadline (216 s of 235) but none the 182 s left after the setup: no group
    trains, so the command fails (exit 1, as the docstring and benchmarks/README.md promise) and every step
    is listed under "never started"; once a step has trained, the others stopped by the deadline are not a
    failure."""
    driver = driver_of(gpu_run, tmp_path)
    driver.ready["digits"] = object()  # made ready in 43 s, then a 10 s profile
    driver.start = time.monotonic() - 53
    driver.estimate = lambda batch: 216.0 * len(batch)
    steps = gpu_run.plan("paper", simulate=True)
    for step in steps:
        driver.run_step(step)
    driver.write_summary(final=True)
    lines = summary_lines(driver)
    assert all(lines[s.name].endswith("| stopped by the deadline (235 s)") for s in steps)
    assert lines["never"] == "never started: " + ", ".join(s.name for s in steps)
    assert driver.failed()
    driver.rows[0].update(done=1, seconds=200.0)  # the first step trained a group
    assert not driver.failed()


def test_r5_5_a_step_whose_data_set_was_never_prepared_counts_its_runs(gpu_run, tmp_path, monkeypatch):
    """FEMNIST's steps all made by earlier commands, 40 s left when Table I's first step comes up (too little
    to prepare CIFAR-10): its summary row counts the step's runs as planned, and the cheapest run left is
    not "none left"."""
    driver = driver_of(gpu_run, tmp_path, simulate=False, deadline=500.0, data=tmp_path)
    driver.ready["femnist"] = object()
    monkeypatch.setattr(gpu_run, "made", lambda folder, c: c.dataset == "femnist")
    driver.start = time.monotonic() - 460
    steps = gpu_run.plan("paper", simulate=False)
    for step in steps:
        driver.run_step(step)
    driver.write_summary(final=True)
    lines = summary_lines(driver)
    for step in steps:
        if step.params != "table1_cifar10":
            continue
        planned = len(select(load_experiment(step.params, scale="paper"), step.only).configs)
        assert lines[step.name].startswith(f"{step.name} | {planned} | 0 | 0 | 0 | not started")
    assert "the cheapest run left: none left" not in lines["used"]
    assert driver.failed()  # nothing trained while runs were left


# ------------------------------------------------------------------ 3, 4: a reused autotune.json


def digits_report(**entry) -> dict:
    """An autotune report made on this machine for the digits, as `autotune.autotune` writes one."""
    from benchmarks import autotune

    tune = {"chosen": {"precision": "fp32", "engine": "batched"}, "timings": [], "gate": [],
            "step_s": {"1": 0.01}, "server_s": {"prodigy/alie": 0.001}, **entry}  # fmt: skip
    return {"fingerprint": autotune.fingerprint(torch.device("cpu")), "datasets": {"digits": tune}}


BAD_ENTRIES = [
    ({"server_s": {"prodigy/alie": None}}, "server_s="),
    ({"server_s": {"prodigy/alie": "0.1 s"}}, "server_s="),
    ({"server_s": 0.5}, "server_s="),
    ({"step_s": {"x1": 0.01}}, "step_s="),
    ({"step_s": [0.01, 0.02]}, "step_s="),
    ({"step_s": {"1": float("inf")}}, "step_s="),
    ({"step_s": {"0": 0.01}}, "step_s="),
    ({"chosen": {"precision": "fp8"}}, "chosen="),
    ({"chosen": "bf16"}, "chosen="),
    ({"timings": None}, "timings="),
    ({"timings": [{"error": "not timed: the timing budget was spent", "engine": "batched"}]}, "timings="),
    ({"gflop_per_image": "0.3"}, "gflop_per_image="),
]


@pytest.mark.parametrize("entry, field", BAD_ENTRIES)
def test_r5_3_a_reused_autotune_of_the_wrong_shape_is_not_reused_and_the_autotune_runs(
    gpu_run, tmp_path, monkeypatch, entry, field
):
    """A --autotune FILE whose digits entry has a field the driver reads of the wrong type, a non-finite or
    non-positive time, or an unknown choice is not reused: the log says "not reused:" and which field, and
    the autotune runs here; the same report with valid fields is reused as it is."""
    from benchmarks import autotune

    calls = []
    monkeypatch.setattr(autotune, "autotune", lambda *a, **k: calls.append(1) or digits_report())
    config = load_experiment("quickstart_digits", scale="smoke").configs[0]
    for report_, tuned in ((digits_report(**entry), [1]), (digits_report(), [])):
        calls.clear()
        given = tmp_path / "autotune.json"
        given.write_text(json.dumps(report_))
        driver = driver_of(gpu_run, tmp_path / str(len(tuned)), autotune=given, resume=None, tolerances=None)
        driver.autotune("digits", config)
        log = (driver.work / "log.txt").read_text()
        assert calls == tuned
        if tuned:
            assert f"{given} not reused: its digits entry's {field}" in log
        else:
            assert "autotune digits: reused from" in log


def test_r5_3_b_a_missing_autotune_file_is_said_in_the_preflight(gpu_run, tmp_path, capsys):
    """--autotune naming no file stops in the preflight with one line saying so, before $OUT is written."""
    out = tmp_path / "out"
    given = tmp_path / "typo.json"
    argv = ["--simulate", "--data", str(tmp_path), "--out", str(out), "--autotune", str(given)]
    assert gpu_run.main(argv) == gpu_run.EXIT_PREFLIGHT
    err = one_error_line(capsys.readouterr().err, "gpu_run: error: --autotune ")
    assert "typo.json: no such file" in err
    assert not out.exists()


def test_r5_4_a_resumed_tarball_with_dot_slash_names_keeps_its_autotune(gpu_run, tmp_path):
    """A --resume tarball repacked with `tar -C dir -czf x .` names its members ./autotune.json and so on:
    its autotune.json is found as in the tarball gpu_run writes, and reused."""
    from benchmarks import autotune

    members = [("./autotune.json", digits_report()), *[(f"./{n}", r) for n, r in quick(n=1)]]
    tarball = write_tar(tmp_path / "x.tar.gz", members)
    args = argparse.Namespace(autotune=None, resume=tarball)
    args.resumed = gpu_run.read_tarball(tarball, "gpu_run --resume")
    driver = gpu_run.Driver.__new__(gpu_run.Driver)
    driver.args = args
    found, source = driver.earlier_autotune()
    assert source == f"{tarball}:autotune.json" and found == digits_report()
    assert autotune.mismatch(found, autotune.fingerprint(torch.device("cpu")), ["digits"]) is None


# ------------------------------------------------------------------ 6: --work, the import's usage line


def test_r5_6_a_work_folder_that_is_a_file_is_one_line_in_the_preflight(gpu_run, tmp_path, capsys):
    """--work naming a file: exit 2 and one line naming --work, no traceback."""
    work = tmp_path / "work"
    work.write_text("a file")
    argv = ["--simulate", "--data", str(tmp_path), "--out", str(tmp_path / "out"), "--work", str(work)]
    assert gpu_run.main(argv) == gpu_run.EXIT_PREFLIGHT
    assert "is not a folder" in one_error_line(capsys.readouterr().err, f"gpu_run: error: --work {work} ")


def test_r5_6_b_the_docstring_shows_the_import_options_argparse_accepts(gpu_run, capsys):
    """Every option of the docstring's import usage line is one the import's argparse lists in its help."""
    usage = next(line for line in gpu_run.__doc__.splitlines() if "gpu_run.py import TARBALL" in line)
    options = [word.strip("[]") for word in usage.split() if word.startswith("[--")]
    assert options
    with pytest.raises(SystemExit):
        gpu_run.main(["import", "--help"])
    help_text = capsys.readouterr().out
    assert all(option in help_text for option in options), (options, help_text)


# ------------------------------------------------------------------ 7: records the reports could not read


def record_of(**fields) -> tuple[str, dict]:
    ((name, record),) = quick(n=1)
    return name, {**record, **fields}


@pytest.mark.parametrize(
    "curve",
    [[[float("inf"), 50.0]], [[1, float("nan")]], [[10**400, 50.0]], [[1, -float("inf")]]],
    ids=["inf round", "nan accuracy", "round past a float", "-inf accuracy"],
)
def test_r5_7_a_a_curve_of_non_finite_numbers_is_not_a_valid_record(curve):
    """check_record refuses an accuracy curve holding NaN, an infinity or an integer no float holds."""
    name, record = record_of(accuracy_curve=curve)
    assert "accuracy_curve=" in results.check_record(record, Path(name))
    assert results.check_record(record_of()[1], Path(name)) is None


@pytest.mark.parametrize("share", ["n/a", [0.5], 1.5, float("nan")])
def test_r5_7_b_a_detection_share_that_is_not_one_is_not_a_valid_record(share):
    """detection_precision / detection_recall: absent, null or in [0, 1]; anything else is refused."""
    for field in ("detection_precision", "detection_recall"):
        name, record = record_of(**{field: share})
        assert f"{field}=" in results.check_record(record, Path(name))
        assert results.check_record(record_of(**{field: 0.5})[1], Path(name)) is None


def test_r5_7_c_records_with_a_detection_precision_and_no_recall_are_reported(gpu_run, tmp_path, roots):
    """Attacked records with a detection precision and no recall (which the store accepts): imported, the
    report written with the recall shown as missing, PROVENANCE.md written."""
    members = [(n, {**r, "detection_precision": 0.5}) for n, r in quick(n=2)]
    gpu_run.import_results(write_tar(tmp_path / "r.tar.gz", members), *roots)
    table = (roots[1] / "gpu" / "smoke" / "quickstart_digits.md").read_text()
    frame = report.detection_frame(results.load(load_experiment("quickstart_digits", scale="smoke"),
                                                roots[0] / "gpu"))  # fmt: skip
    assert frame["detection precision"].tolist() == [0.5, 0.5] and frame["detection recall"].isna().all()
    assert "detection recall" in table
    assert len(provenance_rows(roots[1])) == 2


def test_r5_7_d_round_times_past_a_float_still_give_provenance(gpu_run, tmp_path, roots):
    """A record whose round_times hold an integer past a float's range: imported and listed in PROVENANCE.md
    (its seconds from the numbers a float holds)."""
    name, record = record_of(round_times=[10**400, 0.5])
    gpu_run.import_results(write_tar(tmp_path / "r.tar.gz", [(name, record)]), *roots)
    (row,) = provenance_rows(roots[1])
    assert row[7] == "0.5"


def test_r5_7_e_a_report_that_fails_is_one_line_and_provenance_is_still_written(
    gpu_run, tmp_path, roots, capsys, monkeypatch
):
    """Whatever a report raises, the import says it in one line naming the results folder, the records stay
    in, and PROVENANCE.md is written."""

    def broken(*args, **kwargs):
        raise KeyError("detection_recall\nsecond line")

    monkeypatch.setattr(report, "write_report", broken)
    gpu_run.import_results(write_tar(tmp_path / "r.tar.gz", quick(n=2)), *roots)
    err = capsys.readouterr().err.strip().splitlines()
    (line,) = [e for e in err if "no report of" in e]
    assert "quickstart_digits-smoke" in line and "KeyError" in line
    assert len(list((roots[0] / "gpu").rglob("*.json"))) == 2 and len(provenance_rows(roots[1])) == 2


# ------------------------------------------------------------------ 8: JSON nested past the recursion limit

DEEP = "[" * 100_000 + "]" * 100_000


def test_r5_8_deeply_nested_json_is_not_json_to_the_store_and_the_import(gpu_run, tmp_path, roots, capsys):
    """A record file of 100,000 nested lists: the store's readers skip it as not valid JSON (with their
    usual warning), the import skips that member as not JSON and imports the others."""
    folder = tmp_path / "store" / "quickstart_digits-smoke"
    folder.mkdir(parents=True)
    (folder / "0123456789abcdef.json").write_text(DEEP)
    with pytest.warns(RuntimeWarning, match="not valid JSON"):
        assert results.read_records(folder) == []
    with pytest.warns(RuntimeWarning, match="not valid JSON"):
        assert results.stored_record(folder, "0123456789abcdef") is None
    members = [*quick(n=1), (f"{FOLDER}/0123456789abcdef.json", DEEP)]
    gpu_run.import_results(write_tar(tmp_path / "r.tar.gz", members), *roots)
    assert f"skipped '{FOLDER}/0123456789abcdef.json': not JSON" in capsys.readouterr().err
    assert len(provenance_rows(roots[1])) == 1


# ------------------------------------------------------------------ 9: a second import


def test_r5_9_provenance_counts_the_records_of_earlier_imports(gpu_run, tmp_path, roots):
    """Two imports of different runs into one results/gpu/: the second PROVENANCE.md lists its own two
    records and says that the other two came from earlier imports (the reports use all four)."""
    gpu_run.import_results(write_tar(tmp_path / "a.tar.gz", quick(n=2, accuracy=11.0)), *roots)
    assert "earlier imports" not in (roots[1] / "gpu" / "PROVENANCE.md").read_text()
    gpu_run.import_results(write_tar(tmp_path / "b.tar.gz", quick(n=2, accuracy=22.0, start=2)), *roots)
    assert [row[6] for row in provenance_rows(roots[1])] == ["22.00", "23.00"]
    text = (roots[1] / "gpu" / "PROVENANCE.md").read_text()
    assert "2 records of results/gpu/ came from earlier imports" in text
    cells = report.markdown_cells((roots[1] / "gpu" / "smoke" / "quickstart_digits.md").read_text())
    assert sorted(v.strip("*") for v in cells.values() if v != "–") == ["11.00", "12.00", "22.00", "23.00"]


# ------------------------------------------------------------------ 10: a pax header of any declared size


def test_r5_10_a_pax_header_past_the_cap_is_refused_before_tarfile_reads_it(gpu_run, tmp_path, monkeypatch):
    """tarfile reads a pax (or long-name) header into memory whole, whatever size it declares, before
    read_tarball sees a member: a 200 KB tarball made it hold 200 MiB, past a 20 MiB cap, and was accepted.
    The decompressed stream is counted first (`expanded_bytes`), so a header of 2 MiB under a 1 MiB cap is
    refused in one line; intact gzip, bzip2, xz and plain tarballs are still read whole."""
    import bz2
    import gzip
    import lzma

    monkeypatch.setattr(gpu_run, "MAX_TOTAL_BYTES", 2**20)
    header = tarfile.TarInfo("././@PaxHeader")
    header.type, header.size = tarfile.XHDTYPE, 2 * 2**20
    log = tarfile.TarInfo("log.txt")
    log.size = 2
    body = header.tobuf(format=tarfile.USTAR_FORMAT) + b"\0" * header.size
    body += log.tobuf(format=tarfile.USTAR_FORMAT) + b"ok".ljust(512, b"\0") + b"\0" * 1024
    bomb = tmp_path / "pax.tar.gz"
    bomb.write_bytes(gzip.compress(body))
    assert bomb.stat().st_size < 2**20 / 100  # small on disk
    with pytest.raises(gpu_run.Refused, match=r"expands past 1,048,576 bytes .*its decompressed stream"):
        gpu_run.read_tarball(bomb)

    plain = io_tar([("log.txt", b"ok"), ("summary.txt", b"done")])
    for name, pack in [("t.tar.gz", gzip.compress), ("t.tar.bz2", bz2.compress), ("t.tar.xz", lzma.compress),
                       ("t.tar", lambda data: data)]:  # fmt: skip
        (tmp_path / name).write_bytes(pack(plain))
        assert gpu_run.read_tarball(tmp_path / name) == [("log.txt", b"ok"), ("summary.txt", b"done")], name


def io_tar(members: list[tuple[str, bytes]]) -> bytes:
    """An uncompressed tar archive of `members`, as bytes."""
    import io

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
