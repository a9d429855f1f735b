"""Regenerate every committed output that this machine can make, and say how long each took.

    python scripts/regenerate.py            # the convergence curve, the quickstart tables, figures/gpu
    python scripts/regenerate.py --check    # overwrite nothing; exit 1 when a check fails

`--check` compares the quickstart tables with the committed ones (`check_committed_quickstart.py`: to the
digit on the tables' machine, within 2 std elsewhere) and reruns the convergence curve into a scratch file,
checking only that it still converges (its numbers are not compared: another CPU rounds them differently);
figures/gpu is not checked (its import is deterministic from the committed tarball).

1. `scripts/quickstart_convergence.py`: the curve the quickstart's rounds come from (about 20 s);
2. `scripts/check_committed_quickstart.py --update`: the quickstart over 3 seeds and 1 seed, every run trained
   anew (about 12 minutes on a 2-core CPU);
3. `benchmarks/gpu_run.py import figures/gpu/results.tar.gz`: figures/gpu from its committed records.

Not here: figures/mini (its CPU runs' records were not kept: figures/mini/README.md; new mini runs cost 18-26
minutes each on a 2-core CPU, `prodigy-fl grid table2_femnist_n20 --mini ...` then `prodigy-fl report ...
--mini`) and new GPU records (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def steps(check: bool) -> list[tuple[str, list[str]]]:
    py = sys.executable
    scratch = str(Path(tempfile.gettempdir()) / "quickstart_convergence-check.csv")  # --out is checked
    curve = [py, "scripts/quickstart_convergence.py"] + (["--out", scratch] if check else [])
    quickstart = [py, "scripts/check_committed_quickstart.py"] + ([] if check else ["--update"])
    gpu = [py, "benchmarks/gpu_run.py", "import", "figures/gpu/results.tar.gz"]
    return [("convergence curve", curve), ("quickstart tables", quickstart)] + (
        [] if check else [("figures/gpu", gpu)]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = "overwrite nothing: compare the quickstart tables, rerun the curve"
    parser.add_argument("--check", action="store_true", help=what)
    args = parser.parse_args(argv)
    total, failed = time.monotonic(), []
    for name, command in steps(args.check):
        tic = time.monotonic()
        code = subprocess.run(command, cwd=ROOT).returncode
        print(
            f"== {name}: {'ok' if code == 0 else f'exit {code}'} in {time.monotonic() - tic:.0f} s",
            flush=True,
        )
        if code:
            failed.append(name)
    print(
        f"== regenerated in {time.monotonic() - total:.0f} s"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
