"""JupyterLab and git: a saved notebook whose content git would not change stays out of `git status`.

Git lists a file whose size changed as modified without running its clean filter, so a notebook saved by
JupyterLab (outputs, the kernel's metadata) shows as modified although the nbstripout filter makes it the
committed file again (`git diff` is empty). `refresh_git_index`, JupyterLab's post-save hook, refreshes git's
record of such a file (``git add`` of an unchanged content: nothing is staged). JupyterLab's post-save hook is
`after_save`: it hands the path to a background thread and returns, so that a save (and every autosave) never
waits for git and the nbstripout filter it runs (seconds on a loaded machine); `install_hook` registers it.
Entry points: `after_save`, `refresh_git_index`, `install_hook`, `setup_git` (`prodigy-fl git-setup`).
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HOOK = "prodigy_core.lab.after_save"
FORMER_HOOKS = ("prodigy_core.lab.refresh_git_index",)  # what git-setup wrote before: replaced, not refused
# What nbstripout strips besides outputs: language_info names the Python of whoever saved last
# (.gitattributes and .pre-commit-config.yaml say the same; tests/test_notebooks.py checks it).
NBSTRIPOUT_EXTRA_KEYS = "metadata.language_info"
LOCK_RETRIES, LOCK_WAIT_S = 20, 0.1  # up to 2 s for another git command to release the index


def setup_git(folder: Path, prefix: str | None = None) -> list[str]:
    """The one-time setup of a clone for notebooks: nbstripout as git's filter for them (with
    `NBSTRIPOUT_EXTRA_KEYS`) and JupyterLab's post-save hook (`install_hook`, for the Python environment at
    ``prefix``, this one by default). Returns what it did."""
    top = _git(folder, "rev-parse", "--show-toplevel")
    if top.returncode != 0:
        raise ValueError(f"{folder} is not in a git clone: run git-setup inside your clone of prodigy-fl")
    repo = Path(top.stdout.strip())
    hook_file, config = _hook_config(prefix)  # a config it cannot use stops it before git's is changed
    strip = subprocess.run([sys.executable, "-m", "nbstripout", "--install"], cwd=repo,
                           capture_output=True, text=True, check=False)  # fmt: skip
    if strip.returncode != 0:
        raise ValueError(
            f"nbstripout --install failed ({(strip.stderr or strip.stdout).strip()[:200]}): it comes with "
            'the dev extra, pip install -e ".[dev]"'
        )
    _git(repo, "config", "filter.nbstripout.extrakeys", NBSTRIPOUT_EXTRA_KEYS)
    hook = _write_config(hook_file, config)
    return [
        f"nbstripout filters notebooks in {repo} (extra keys: {NBSTRIPOUT_EXTRA_KEYS})",
        f"JupyterLab's post-save hook in {hook} (undo: remove ContentsManager.post_save_hook)",
    ]


def _git(folder: Path, *args: str) -> subprocess.CompletedProcess:
    """git in ``folder``; file names are literal, never globs (``analysis[1].ipynb`` is that one file)."""
    command = ["git", "--literal-pathspecs", "-C", str(folder), *args]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def refresh_git_index(os_path: str, model: Any = None, contents_manager: Any = None) -> bool:
    """After JupyterLab saves ``os_path``: when the file is tracked by git, not in a merge, and its content
    after git's filters equals what the index holds (``git diff --quiet``), ``git add`` it, which only
    refreshes git's stat record (the staged content is unchanged). True when it did. Never raises: a save
    must not fail because of git."""
    path = Path(os_path)
    if path.suffix != ".ipynb":
        return False
    try:
        folder, name = path.parent, path.name
        staged = _git(folder, "ls-files", "--stage", "--", name).stdout.splitlines()
        if len(staged) != 1 or staged[0].split()[2] != "0":  # untracked, or unmerged (stages 1-3)
            return False
        if _git(folder, "diff", "--quiet", "--", name).returncode != 0:
            return False  # a real change (or git failed): the user's to stage
        for _ in range(
            LOCK_RETRIES
        ):  # another git command (a `git status`, an editor's poll) may hold the index
            added = _git(folder, "add", "--", name)
            if added.returncode == 0 or "index.lock" not in added.stderr:
                return added.returncode == 0
            time.sleep(LOCK_WAIT_S)
        return False
    except (OSError, IndexError):
        return False


_saved: queue.Queue[str] = queue.Queue()
_worker: threading.Thread | None = None
_worker_lock = threading.Lock()


def after_save(os_path: str, model: Any = None, contents_manager: Any = None) -> None:
    """JupyterLab's post-save hook: `refresh_git_index` of ``os_path`` in a background thread, so that the
    server answers the save at once. Saves of one notebook queued while git is busy are refreshed once."""
    global _worker
    if not str(os_path).endswith(".ipynb"):
        return
    _saved.put(str(os_path))
    with _worker_lock:
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_refresh_saved, name="prodigy-git-refresh", daemon=True)
            _worker.start()


def _refresh_saved() -> None:
    while True:
        burst = [_saved.get()]
        while not _saved.empty():  # saves queued while git was busy (autosaves): each notebook once
            burst.append(_saved.get_nowait())
        try:
            for path in sorted(set(burst)):
                refresh_git_index(path)
        finally:  # a worker that died is replaced by the next save
            for _ in burst:
                _saved.task_done()


def wait_for_refreshes() -> None:
    """Block until every path handed to `after_save` so far has been refreshed (tests, scripts)."""
    _saved.join()


def config_file(prefix: str | None = None) -> Path:
    """This Python environment's Jupyter server config (<prefix>/etc/jupyter is on `jupyter --paths`; its
    ``jupyter_server_config.d`` snippets enable extensions only, so the hook goes in the file itself)."""
    return Path(prefix or sys.prefix) / "etc" / "jupyter" / "jupyter_server_config.json"


def install_hook(prefix: str | None = None) -> Path:
    """Register `refresh_git_index` as JupyterLab's post-save hook for the Python environment at ``prefix``
    (this one by default): ``ContentsManager.post_save_hook`` in `config_file`, the file's other settings
    kept. A different hook already there is an error (never replaced). Returns the file's path."""
    return _write_config(*_hook_config(prefix))


def _hook_config(prefix: str | None) -> tuple[Path, dict[str, Any]]:
    """`config_file` and its settings with the hook set (`install_hook`), checked, not written yet."""
    path = config_file(prefix)
    try:
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        config = json.loads(text) if text.strip() else {}
    except (ValueError, UnicodeDecodeError) as e:  # UnicodeDecodeError is a ValueError: named for the reader
        raise ValueError(f"{path}: not valid JSON ({e}): fix or remove it") from None
    if not isinstance(config, dict):
        raise ValueError(
            f"{path} is not a JSON object of settings ({type(config).__name__}): fix or remove it"
        )
    if config.get("ContentsManager") is None:
        config["ContentsManager"] = {}
    section = config["ContentsManager"]
    if not isinstance(section, dict):
        raise ValueError(
            f"{path}: ContentsManager={section!r} is not an object of settings: fix or remove it"
        )
    for name, other in config.items():  # a subclass's hook (FileContentsManager) wins over ContentsManager's
        hook = other.get("post_save_hook") if isinstance(other, dict) else None
        if name != "ContentsManager" and hook not in (None, HOOK, *FORMER_HOOKS):
            raise ValueError(
                f"{path} sets {name}.post_save_hook={hook!r}, which JupyterLab runs instead of "
                f"ContentsManager's: call {HOOK} from it, or remove it and run git-setup again"
            )
    if section.get("post_save_hook") not in (None, HOOK, *FORMER_HOOKS):
        raise ValueError(
            f"{path} already sets ContentsManager.post_save_hook={section['post_save_hook']!r}; call "
            f"{HOOK} from it, or remove it and run git-setup again"
        )
    section["post_save_hook"] = HOOK
    return path, config


def _write_config(path: Path, config: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


__all__ = [
    "HOOK",
    "NBSTRIPOUT_EXTRA_KEYS",
    "after_save",
    "config_file",
    "install_hook",
    "refresh_git_index",
    "setup_git",
    "wait_for_refreshes",
]
