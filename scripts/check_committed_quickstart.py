"""Regenerate the quickstart from scratch and compare it with the committed figures/quickstart_digits.* (one
seed, what `prodigy-fl quickstart` writes) and figures/quickstart_digits_3seeds.* (`--seeds 3`, the README's).

    python scripts/check_committed_quickstart.py               # exit 1 and list the cells that differ
    python scripts/check_committed_quickstart.py --update      # then copy the new files into figures/
    python scripts/check_committed_quickstart.py --keep DIR    # and keep the runs in DIR (a new folder)

Every run is trained anew (a temporary results folder, or --keep's new one: nothing is loaded from
results/), with the code of this checkout, so the table it writes is what the committed code produces. Run
it before committing a change to prodigy_core/ or params/quickstart_digits.yaml (126 runs: about half an
hour to an hour on 2 cores). Each table's provenance line (the runs hash and the code hash) must be the
committed one, and its cells too: digit for digit where the committed table was trained on this machine
(its "trained on" line: torch's CPU capability, torch, threads per run), elsewhere each within 2 std of the
committed 3-seed table; the script says which check it made. The cheap half of the check runs in CI:
tests/test_report.py compares the provenance line of both committed tables (a hash of the grid's run keys
and of prodigy_core's files) with the current ones, and trains two cells anew to check them the same way.
`prodigy-fl quickstart` itself writes into the git-ignored outputs/; only this script's
--update (run by scripts/regenerate.py) writes figures/.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from prodigy_core import cli, report

NAME = "quickstart_digits"
SEEDS = (3, 1)  # the README's table (quickstart_digits_3seeds.*) and the default command's
COMMITTED = Path(__file__).resolve().parents[1] / "figures"


def compare(old: str, new: str, name: str, reference: str) -> bool:
    """Check the regenerated table `new` against the committed `old`: digit for digit where both were
    trained on the same machine (their "trained on" line: CPU kernels, torch, threads per run), else each
    cell within report.WITHIN_STD std of the committed 3-seed table `reference` (another CPU type rounds
    differently, and a last-bit difference can move a cell by a seed's spread). Prints which check it made
    and every cell that fails it; True if none does and the runs and code hash are the committed ones."""
    made_on, here = report.read_machine(old), report.read_machine(new)
    same_provenance = report.read_provenance(old) == report.read_provenance(new)
    if not same_provenance:  # the runs hash, or the code hash (prodigy_core/ changed since the table)
        before, after = report.read_provenance(old), report.read_provenance(new)
        print(f"{name}: provenance (runs and code hash): committed {before}, now {after}",
              file=sys.stderr)  # fmt: skip
    if made_on == here:
        print(f"{name}: digit for digit (both trained on {report.machine_line(here)})", file=sys.stderr)
        old_cells, new_cells = report.markdown_cells(old), report.markdown_cells(new)
        differ = [(k, v, new_cells.get(k)) for k, v in old_cells.items() if new_cells.get(k) != v]
        missing = sorted(set(new_cells) - set(old_cells))
        for (row, column), before, after in differ:
            print(f"{name}: {row} / {column}: committed {before}, now {after}", file=sys.stderr)
        for row, column in missing:
            print(f"{name}: {row} / {column}: not in the committed table", file=sys.stderr)
        return not differ and not missing and same_provenance
    print(f"{name}: within {report.WITHIN_STD} std of the committed 3-seed table, not digit for digit: "
          f"committed on {report.machine_line(made_on) if made_on else 'an unnamed machine'}, "
          f"now on {report.machine_line(here or {})}", file=sys.stderr)  # fmt: skip
    text, within, compared = report.compare_with_reference(new, reference)
    for line in text.splitlines():
        if "**" in line and "(" in line:  # a row with a cell outside (bold)
            print(f"{name}: {line}", file=sys.stderr)
    print(f"{name}: {within} of {compared} cells within", file=sys.stderr)
    return within == compared > 0 and same_provenance


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help="copy the regenerated files into figures/")
    parser.add_argument("--seeds", type=int, nargs="+", choices=SEEDS, default=list(SEEDS),
                        help="which tables (default both: 3 1; 1 alone: 42 runs instead of 126)")  # fmt: skip
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="keep the runs in DIR, a new or empty folder (scripts/precision_check.py "
                        "--results-dir DIR then finds its fp32 half there)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.keep is not None and args.keep.exists() and (not args.keep.is_dir() or any(args.keep.iterdir())):
        parser.error(f"--keep {args.keep}: not an empty folder (every run is trained anew: name a new one)")
    if args.keep is not None:
        cli.check_out(parser, args.keep, "quickstart-runs", folder=True, option="--keep")
    tic = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="quickstart-check-") as tmp:
        out = Path(tmp) / "figures"
        runs = args.keep or Path(tmp) / "results"
        ok = True
        for seeds in args.seeds:  # 3 seeds first; the one-seed table then reuses seed 0's records
            argv = [
                "quickstart",
                "--seeds",
                str(seeds),
                "--results-dir",
                str(runs),
                "--out-dir",
                str(out),
            ]
            if (
                cli.main(argv) != 0
            ):  # the default --jobs auto: one thread per run, as for the committed tables
                return 1
            name = cli.quickstart_name(seeds)
            old_path = COMMITTED / f"{name}.md"
            old = old_path.read_text(encoding="utf-8") if old_path.exists() else ""
            reference_path = COMMITTED / f"{cli.quickstart_name(3)}.md"
            reference = reference_path.read_text(encoding="utf-8") if reference_path.exists() else ""
            ok &= compare(old, (out / f"{name}.md").read_text(encoding="utf-8"), name, reference)
        print(f"regenerated in {time.monotonic() - tic:.0f} s", file=sys.stderr)
        if args.update:
            for path in sorted(out.glob(f"{NAME}*")):  # the tables made here (--seeds)
                shutil.copyfile(path, COMMITTED / path.name)
                print(f"updated {COMMITTED / path.name}", file=sys.stderr)
            return 0
        verdict = "are what this code produces" if ok else "differ: rerun with --update and commit figures/"
        print(f"the committed quickstart tables {verdict}", file=sys.stderr)
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
