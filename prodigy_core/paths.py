"""Where things live: the project folder that receives every output (`project_dir`; `results_dir`,
`figures_dir`, `data_dir` under it unless PRODIGY_RESULTS_DIR, PRODIGY_FIGURES_DIR, PRODIGY_DATA_DIR say
otherwise), and the package's own params files and notebooks (`params_dirs`, `package_folder`: the
repository's in a source checkout, `prodigy_core/_bundled/` in a wheel). A clone's committed `figures/` is the
reference that `python scripts/regenerate.py` alone rewrites (`COMMITTED_FIGURES`). Every lookup is made when
called, not at import, so a notebook or a test that changes directory or environment sees the change. Rules:
docs/usage.md ("Installed without a clone; where outputs go").
"""

from __future__ import annotations

import contextlib
import os
from importlib.resources import files
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE_ROOT = PACKAGE_DIR.parent  # the repository in a source checkout; site-packages in an installation
BUNDLED = "_bundled"  # prodigy_core/_bundled/{params,notebooks} in a wheel (see setup.py)
ENV_RESULTS, ENV_FIGURES, ENV_DATA = "PRODIGY_RESULTS_DIR", "PRODIGY_FIGURES_DIR", "PRODIGY_DATA_DIR"
# The scale a notebook opened in JupyterLab runs at: "interactive" (something real in about two minutes on 2
# cores, each notebook says what); CI sets PRODIGY_SCALE=smoke (the root conftest.py); papermill injects one.
ENV_SCALE, INTERACTIVE = "PRODIGY_SCALE", "interactive"
SCALES = ("smoke", "mini", "paper")  # a params file's scales (`experiments.load_experiment`)
OUTPUTS = "outputs"  # <project>/outputs: where tables and figures go by default (git-ignored)
COMMITTED_FIGURES = SOURCE_ROOT / "figures"  # a clone's committed reference tables (absent in a wheel)


def is_source_checkout() -> bool:
    """True when the package runs from a clone (editable install or the repository on sys.path)."""
    return (SOURCE_ROOT / "pyproject.toml").is_file() and (SOURCE_ROOT / "params").is_dir()


def project_dir(cwd: str | os.PathLike | None = None) -> Path:
    """The nearest ancestor of `cwd` (default: the working directory) holding `params/`, else `cwd`."""
    start = Path(cwd if cwd is not None else os.getcwd()).resolve()
    found = next((p for p in (start, *start.parents) if (p / "params").is_dir()), start)
    folder = package_containing(found)
    if folder is not None:
        raise ValueError(
            f"the working directory {start} is inside the installed package ({folder}); outputs would "
            "be written there: cd to a project folder (`prodigy-fl init DIR` makes one) or set "
            f"{ENV_RESULTS}, {ENV_FIGURES} and {ENV_DATA}"
        )
    return found


def package_containing(path: str | os.PathLike) -> Path | None:
    """The package folder (or, installed, site-packages) that `path` is in or is; None when outside."""
    path = Path(path).resolve()
    for folder in [PACKAGE_DIR] + ([] if is_source_checkout() else [SOURCE_ROOT]):
        if path == folder or folder in path.parents:
            return folder
    return None


def _from_env(variable: str, default: str) -> Path:
    value = os.environ.get(variable)
    return Path(value) if value else project_dir() / default


def results_dir() -> Path:
    """Env PRODIGY_RESULTS_DIR, else <project>/results."""
    return _from_env(ENV_RESULTS, "results")


def figures_dir() -> Path:
    """Env PRODIGY_FIGURES_DIR, else <project>/outputs (never the committed figures/)."""
    return _from_env(ENV_FIGURES, OUTPUTS)


def data_dir() -> Path:
    """Env PRODIGY_DATA_DIR, else <project>/data (downloaded and decoded datasets)."""
    return _from_env(ENV_DATA, "data")


def notebook_scale() -> str:
    """A notebook's default scale: env PRODIGY_SCALE (CI: "smoke"), else "interactive"; an unknown one is an
    error naming the variable."""
    scale = os.environ.get(ENV_SCALE) or INTERACTIVE
    if scale not in (INTERACTIVE, *SCALES):
        raise ValueError(f"env {ENV_SCALE}={scale!r} is unknown; valid: {', '.join((INTERACTIVE, *SCALES))} "
                         f"(unset it for {INTERACTIVE})")  # fmt: skip
    return scale


def package_folder(name: str) -> Path:
    """The package's own `params` or `notebooks`: the repository's in a source checkout, else the copy
    bundled in the wheel."""
    if is_source_checkout():
        return SOURCE_ROOT / name
    return Path(str(files("prodigy_core").joinpath(BUNDLED, name)))


def params_dirs() -> list[Path]:
    """Where params files are looked up by name, first match wins: the project's params/ (a user's edited
    copies), then the package's."""
    folders = []
    with contextlib.suppress(ValueError):  # working inside the package: only its own params
        folders.append(project_dir() / "params")
    folders.append(package_folder("params"))
    unique = list(dict.fromkeys(p.resolve() for p in folders))
    return [p for p in unique if p.is_dir()]


def describe(variable: str, default: str) -> str:
    """For --help: what a folder resolves to now, e.g. 'env PRODIGY_RESULTS_DIR, else <project>/results
    (now: /home/me/exp/results)'."""
    try:
        now = str(_from_env(variable, default))
    except ValueError as e:
        now = f"error: {e}"
    return f"env {variable}, else <project folder>/{default}; now: {now}"


__all__ = [
    "data_dir",
    "describe",
    "figures_dir",
    "is_source_checkout",
    "notebook_scale",
    "package_folder",
    "package_containing",
    "params_dirs",
    "project_dir",
    "results_dir",
]
