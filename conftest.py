"""Every pytest run (tests/ and the notebooks under nbval) reads and writes results and figures in a fresh
temporary folder, never the user's results/ and figures/: a run already stored there would otherwise be
loaded instead of trained, and a broken training loop would still pass. The data folder (PRODIGY_DATA_DIR)
is an empty one too: a CIFAR-10 decoded into the user's data/ would turn the smoke profile's digits stand-in
into real CIFAR-10 (tests that need data name their folders). The notebooks run at smoke scale
(PRODIGY_SCALE, `prodigy_core.paths.notebook_scale`).

The variables are set when this file is imported, before any test module (or tests/conftest.py) imports
prodigy_core, and before nbval starts a notebook's kernel, which inherits them.
"""

import os
import shutil
import tempfile
from pathlib import Path

OUTPUT_VARIABLES = ("PRODIGY_RESULTS_DIR", "PRODIGY_FIGURES_DIR", "PRODIGY_DATA_DIR", "PRODIGY_SCALE")
_SESSION_DIR = Path(tempfile.mkdtemp(prefix="prodigy-fl-tests-"))
_SAVED = {name: os.environ.get(name) for name in OUTPUT_VARIABLES}
os.environ["PRODIGY_RESULTS_DIR"] = str(_SESSION_DIR / "results")
os.environ["PRODIGY_FIGURES_DIR"] = str(_SESSION_DIR / "figures")
os.environ["PRODIGY_DATA_DIR"] = str(_SESSION_DIR / "data")
os.environ["PRODIGY_SCALE"] = "smoke"  # the notebooks' default when opened in Lab is "interactive" (minutes)
# Under pytest-xdist (pyproject's `-n auto`: one worker per core) every worker, and what it starts (notebook
# kernels, CLI subprocesses), computes on one thread: two workers of two OpenMP threads each on two cores spin
# against each other and take longer than one process alone. Set before any test module imports torch.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"


def pytest_report_header(config):
    return f"results and figures go to {_SESSION_DIR} (removed at the end)"


def pytest_unconfigure(config):
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)
    for name, value in _SAVED.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
