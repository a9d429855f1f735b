"""Shared fixtures."""

import os
from pathlib import Path

import pytest

from prodigy_core.data import default_femnist_dir


@pytest.fixture
def femnist_dir() -> Path:
    """The real FEMNIST LEAF subset (shared/data/femnist-leaf or env PRODIGY_FEMNIST_DIR): skipped with a
    reason when absent, except under CI=true, where it must be there."""
    found = default_femnist_dir()
    if found is None:
        reason = "FEMNIST LEAF subset not found (../shared/data/femnist-leaf or env PRODIGY_FEMNIST_DIR)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason + " but CI=true requires it")
        pytest.skip(reason)
    return found
