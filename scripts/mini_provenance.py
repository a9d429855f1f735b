"""Write figures/mini/PROVENANCE.md: the machine, torch, code, date and wall time of every run behind the
committed mini-scale tables, read from their records.

    python scripts/mini_provenance.py [--results-dir DIR] [--note TEXT ...] [--out FILE] [--force]

One row per record of every `<experiment>-mini` folder under the results folder: its table, defense, attack,
beta, variant, rounds, data source, final accuracy, wall time (the sum of its per-round times: training,
attack and aggregation; evaluations excluded), device, engine and threads, and the date its record was
written. `--note` adds a line under the machine (e.g. that other jobs shared it: its timings are then upper
bounds). Run it after `prodigy-fl report ... --mini`, in the commit that adds the tables. A table whose runs
the results folder lacks is never dropped: the file is left as it is unless `--force` (or another `--out`).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
from pathlib import Path

from prodigy_core import paths
from prodigy_core import results as store
from prodigy_core.config import field_defaults

OUT = Path(__file__).resolve().parents[1] / "figures" / "mini" / "PROVENANCE.md"
DEFAULTS = field_defaults()


def config_of(record: dict) -> dict:
    """A record's config with the default of each field it lacks (as its key was made: `from_dict`)."""
    return {**DEFAULTS, **record["config"]}


def rows(results_dir: Path) -> list[str]:
    out = []
    for folder in sorted(results_dir.glob("*-mini")):
        records = store.read_records(folder)  # valid records of finished runs only
        setting = ("local_momentum", "variant", "defense", "attack")
        for record in sorted(records, key=lambda r: tuple(config_of(r)[k] for k in setting)):
            c = config_of(record)
            env = record.get("environment") if isinstance(record.get("environment"), dict) else {}
            written = (folder / f"{record['key']}.json").stat().st_mtime
            day = datetime.datetime.fromtimestamp(written, datetime.timezone.utc).date()
            times = record.get("round_times") if isinstance(record.get("round_times"), list) else []
            minutes = sum(t for t in times if store.finite_number(t)) / 60
            cells = [
                folder.name,
                c["defense"],
                c["attack"],
                c["local_momentum"],
                c["variant"],
                c["rounds"],
                c["data_source"] or "-",
                f"{record['final_accuracy']:.2f}",
                f"{minutes:.0f}",
                f"{env.get('device', '-')}, {env.get('engine', '-')}, {env.get('threads', '-')} thread(s)",
                env.get("torch", "-"),
                day,
            ]
            out.append("| " + " | ".join(str(x) for x in cells) + " |")
    return out


RUN_IDENTITY = 7  # results, defense, attack, beta, variant, rounds, data source: which run a row is


def run_identity(row: str) -> tuple[str, ...]:
    """Which run a row of the runs table is: its first RUN_IDENTITY cells."""
    return tuple(c.strip() for c in row.strip("|").split("|"))[:RUN_IDENTITY]


def listed_runs(text: str) -> set[tuple[str, ...]]:
    """The runs a PROVENANCE.md lists (the rows of its runs table)."""
    table = text.partition("## Runs behind the tables")[2]
    rows = [x for x in table.splitlines() if x.startswith("| ") and not x.startswith("| results |")]
    return {run_identity(row) for row in rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results-dir", type=Path, default=None, help="default: the project's results/")
    parser.add_argument("--note", action="append", default=[], help="a line about the machine or the runs")
    parser.add_argument("--out", type=Path, default=OUT, help=f"default: {OUT.relative_to(OUT.parents[2])}")
    parser.add_argument("--force", action="store_true", help="write even if runs the file lists would go")
    args = parser.parse_args(argv)
    results_dir = args.results_dir or paths.results_dir()
    table = rows(results_dir)
    if not table:
        print(f"no mini records under {results_dir} (an `<experiment>-mini` folder of records); pass "
              "--results-dir where `prodigy-fl grid ... --mini` wrote them", file=sys.stderr)  # fmt: skip
        return 1
    if args.out.is_file() and not args.force:
        new = {run_identity(row) for row in table}
        lost = sorted(listed_runs(args.out.read_text(encoding="utf-8")) - new)
        if lost:
            print(f"mini_provenance: {args.out} lists {len(lost)} run(s) whose records are not under "
                  f"{results_dir} (e.g. {' / '.join(lost[0])}); rewriting would drop them: left as it is "
                  "(--force writes anyway, --out FILE writes elsewhere)", file=sys.stderr)  # fmt: skip
            return 2
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=OUT.parent).stdout.strip()  # fmt: skip
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()  # fmt: skip
    notes = "".join(f"{note}\n" for note in args.note)
    curves = "".join(f"\n## `{path.name}`\n" + "".join(line.removeprefix("# ") + "\n" for line in
                     path.read_text().splitlines() if line.startswith("#"))
                     for path in sorted(OUT.parent.glob("*.csv")))  # fmt: skip
    text = (
        "# Provenance of the mini-scale outputs in this folder\n\n"
        f"Written by `scripts/mini_provenance.py` at commit {commit} (each run's code: the commits up to "
        f"this one; its record names its torch and engine). Machine: {cpu}, Python "
        f"{platform.python_version()}.\n{notes}{curves}\n## Runs behind the tables\n\n"
        "Wall time: the sum of a run's per-round times (training, attack and aggregation; evaluations "
        "excluded). Date: when its record was written (UTC).\n\n"
        "| results | defense | attack | beta | variant | rounds | data source | accuracy (%) | minutes | "
        "where | torch | date |\n" + "|---" * 12 + "|\n" + "\n".join(table) + "\n"
    )
    args.out.write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
