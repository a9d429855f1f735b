"""Crash-safe files (prodigy_core.safe_io): a write leaves the old content or the complete new one."""

import json
import math

import pytest

from prodigy_core import safe_io


def test_atomic_write_round_trips_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "a" / "r.json"
    safe_io.write_json_atomic(path, {"x": [1, 2.5], "nan": float("nan")})
    back = json.loads(path.read_text())
    assert back["x"] == [1, 2.5] and math.isnan(back["nan"])
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]


def test_a_failed_write_keeps_the_old_record_whole(tmp_path):
    path = tmp_path / "r.json"
    safe_io.write_json_atomic(path, {"final_accuracy": 50.0})
    with pytest.raises(TypeError):
        safe_io.write_json_atomic(path, {"final_accuracy": object()})  # not serialisable: fails mid-write
    assert json.loads(path.read_text()) == {"final_accuracy": 50.0}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
