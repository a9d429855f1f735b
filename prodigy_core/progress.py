"""Where progress goes: a widget bar in JupyterLab with ipywidgets, a text bar otherwise (a terminal,
papermill, a kernel without the ``lab`` extra), and in a notebook the per-run lines on stdout (stderr is drawn
as a pink error box there); in a terminal they stay on stderr, so that stdout carries only results.

Importing ``prodigy_core`` settles ``tqdm.auto`` once, quietly: in a kernel without ipywidgets it is the text
bar, without tqdm's "IProgress not found" warning (`quiet_tqdm_auto`).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, TextIO


def in_notebook() -> bool:
    """True inside a Jupyter kernel (JupyterLab, papermill, nbval); False in a terminal or plain Python."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def widgets_available() -> bool:
    """Whether ipywidgets (the ``lab`` extra) can be imported."""
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def bar_class(text: bool = False) -> Any:
    """tqdm's widget bar in a notebook kernel that has ipywidgets (unless ``text``), else its text bar."""
    if not text and in_notebook() and widgets_available():
        from tqdm.notebook import tqdm
    else:
        from tqdm.std import tqdm
    return tqdm


def line_stream() -> TextIO:
    """Where one-line progress messages go: stdout in a notebook, stderr in a terminal."""
    return sys.stdout if in_notebook() else sys.stderr


def quiet_tqdm_auto() -> None:
    """Import ``tqdm.auto`` with its "IProgress not found" warning silenced: in a kernel without ipywidgets
    it falls back to the text bar, which is what we want, and says nothing (every later import of
    ``tqdm.auto``, ours or a library's, gets the same module)."""
    if "tqdm.autonotebook" in sys.modules:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        import tqdm.auto  # noqa: F401
