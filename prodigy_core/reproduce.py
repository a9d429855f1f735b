"""Re-execute the paper's notebooks with papermill (``prodigy-fl reproduce --scale smoke|mini|paper``).

Entry points: `reproduce`, `notebook_parameters` (what papermill injects into a notebook's cell tagged
``parameters``: the scale and run controls, and at mini and paper scale the top-level keys of its params
file). The notebooks (the project's, else the package's) run with the project folder as working directory;
executed copies go to its git-ignored build/ folder, the tables and figures to outputs/ through
`prodigy_core.report`. Scales (the interactive one included), outputs and progress lines: docs/usage.md.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from prodigy_core import paths
from prodigy_core.experiments import PROGRESS_ENV, SCALES
from prodigy_core.names import did_you_mean

NOTEBOOKS_DIR = paths.package_folder("notebooks")  # the package's own; a project's notebooks/ comes first
KERNEL = "python3"
KERNEL_ARGUMENTS = ["--IPKernelApp.log_level=ERROR"]  # the kernel's start-up log: errors only

# name -> (notebook in NOTEBOOKS_DIR, params file in PARAMS_DIR or None when the notebook has none)
NOTEBOOKS: dict[str, tuple[str, str | None]] = {
    "quickstart": ("00_quickstart.ipynb", "quickstart_digits.yaml"),
    "table1_cifar10": ("table1_cifar10.ipynb", "table1_cifar10.yaml"),
    "table2_femnist_n20": ("table2_femnist_n20.ipynb", "table2_femnist_n20.yaml"),
    "table3_femnist_n100": ("table3_femnist_n100.ipynb", "table3_femnist_n100.yaml"),
    "table4_fraction_byzantine": ("table4_fraction_byzantine.ipynb", "table4_fraction_byzantine.yaml"),
    "table5_n_clients": ("table5_n_clients.ipynb", "table5_n_clients.yaml"),
    "figure1_pairwise_distances": ("figure1_pairwise_distances.ipynb", "figure1_pairwise_distances.yaml"),
    "explore_attacks": ("explore_attacks.ipynb", None),
}


def notebook_parameters(
    params_file: str | None, scale: str, executor: str = "local", jobs: int | str | None = None
) -> dict[str, Any]:
    """Parameters papermill injects: the run controls, plus at mini and paper scale every top-level key of
    the params file (which the notebook hands to ``load_experiment`` as overrides). ``jobs=None``: the
    notebook's own choice (1 at smoke scale, else "auto", as `prodigy-fl quickstart` runs)."""
    parameters: dict[str, Any] = {"scale": scale, "executor": executor, "jobs": jobs}
    if scale != "smoke" and params_file is not None:
        from prodigy_core.experiments import resolve_params

        with open(resolve_params(params_file)) as fh:
            parameters = {**yaml.safe_load(fh), **parameters}
    return parameters


def reproduce(
    scale: str = "smoke",
    only: Sequence[str] | None = None,
    executor: str = "local",
    jobs: int | str | None = None,
    *,
    notebooks: Mapping[str, tuple[str, str | None]] | None = None,
    notebooks_dir: str | Path | None = None,
    build_dir: str | Path | None = None,
) -> int:
    """Execute the notebooks (all, or those named in ``only``: a name of `NOTEBOOKS` or its notebook's file,
    e.g. ``quickstart`` or ``notebooks/00_quickstart.ipynb``) and return 0, or 1 when any failed.

    A failure is reported on stderr as ``notebook <name>: cell <n>: <error>: <message>`` and the remaining
    notebooks still run. Executed notebooks are written to ``build_dir`` (default <project folder>/build/)
    as ``<name>.ipynb``.
    """
    import papermill
    from papermill.exceptions import PapermillExecutionError

    notebooks = dict(NOTEBOOKS if notebooks is None else notebooks)
    project = paths.project_dir()
    if notebooks_dir is None:
        notebooks_dir = project / "notebooks" if (project / "notebooks").is_dir() else NOTEBOOKS_DIR
    notebooks_dir = Path(notebooks_dir)
    build_dir = Path(build_dir) if build_dir is not None else project / "build"
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} is unknown; valid: {', '.join(SCALES)}")
    by_file = {Path(notebook).stem: name for name, (notebook, _) in notebooks.items()}
    only = [name if name in notebooks else by_file.get(Path(name).stem, name) for name in only or []]
    for name in only:
        if name not in notebooks:
            raise ValueError(f"unknown notebook {name!r}{did_you_mean(name, notebooks)}")
    if not notebooks_dir.is_dir():
        raise FileNotFoundError(
            f"notebooks folder {notebooks_dir} not found: run `prodigy-fl init` to make a project folder"
        )
    build_dir.mkdir(parents=True, exist_ok=True)
    failed = []
    selected = [name for name in notebooks if not only or name in only]
    for i, name in enumerate(selected, start=1):
        notebook, params_file = notebooks[name]
        output = build_dir / f"{name}.ipynb"
        print(f"[{i}/{len(selected)}] notebook {name} ({notebook}, {scale} scale) ...", file=sys.stderr)
        tic = time.perf_counter()
        try:
            with _environment({PROGRESS_ENV: "text"}):  # the kernel inherits it: text bars, not widgets
                papermill.execute_notebook(
                    str(notebooks_dir / notebook),
                    str(output),
                    parameters=notebook_parameters(params_file, scale, executor, jobs),
                    cwd=str(project),  # outputs go to the project folder, never beside installed notebooks
                    kernel_name=KERNEL,
                    progress_bar=False,  # cell counts say little: the cells' own output streams instead
                    stdout_file=sys.stdout,
                    stderr_file=sys.stderr,
                    extra_arguments=KERNEL_ARGUMENTS,
                )
        except PapermillExecutionError as e:
            failed.append(name)
            print(
                f"notebook {name}: cell {e.exec_count}: {e.ename}: {e.evalue} (see {output})", file=sys.stderr
            )
            continue
        except Exception as e:  # a missing file, a kernel that died: still name the notebook, go on
            failed.append(name)
            print(f"notebook {name}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        print(f"notebook {name}: ok in {time.perf_counter() - tic:.1f} s -> {output}", file=sys.stderr)
    if failed:
        print(f"reproduce: {len(failed)} notebook(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration (a kernel started inside inherits them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
