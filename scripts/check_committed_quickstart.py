"""Regenerate the quickstart from scratch and compare it with the committed figures/quickstart_digits.*.

    python scripts/check_committed_quickstart.py               # exit 1 and list the cells that differ
    python scripts/check_committed_quickstart.py --update      # then copy the new files into figures/

Every run is trained anew (a temporary results folder: nothing is loaded from results/), with the code of
this checkout, so the table it writes is what the committed code produces. Run it before committing a change
to prodigy_core/ or params/quickstart_digits.yaml (a few minutes on a laptop CPU). The cheap half of the
check runs in CI: tests/test_report.py compares the provenance line of the committed table (a hash of the
grid's run keys and of prodigy_core's files) with the current ones.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from prodigy_core import cli, report

NAME = "quickstart_digits"
COMMITTED = Path(__file__).resolve().parents[1] / "figures"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help="copy the regenerated files into figures/")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="quickstart-check-") as tmp:
        out = Path(tmp) / "figures"
        argv = [  # the quickstart's default --jobs auto: one thread per run, as for the committed table
            "quickstart",
            "--results-dir",
            f"{tmp}/results",
            "--out-dir",
            str(out),
        ]
        if cli.main(argv) != 0:
            return 1
        new = (out / f"{NAME}.md").read_text(encoding="utf-8")
        old_path = COMMITTED / f"{NAME}.md"
        old = old_path.read_text(encoding="utf-8") if old_path.exists() else ""
        old_cells, new_cells = report.markdown_cells(old), report.markdown_cells(new)
        differ = [(k, v, new_cells.get(k)) for k, v in old_cells.items() if new_cells.get(k) != v]
        missing = sorted(set(new_cells) - set(old_cells))
        same_provenance = report.read_provenance(old) == report.read_provenance(new)
        for (row, column), before, after in differ:
            print(f"{row} / {column}: committed {before}, now {after}", file=sys.stderr)
        for row, column in missing:
            print(f"{row} / {column}: not in the committed table", file=sys.stderr)
        if not same_provenance:
            print(f"provenance: committed {report.read_provenance(old)}, now {report.read_provenance(new)}",
                  file=sys.stderr)  # fmt: skip
        if args.update:
            for path in sorted(out.glob(f"{NAME}*")):
                shutil.copyfile(path, COMMITTED / path.name)
                print(f"updated {COMMITTED / path.name}", file=sys.stderr)
            return 0
        ok = not differ and not missing and same_provenance
        verdict = "is what this code produces" if ok else "differs: rerun with --update and commit figures/"
        print(f"the committed quickstart table {verdict}", file=sys.stderr)
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
