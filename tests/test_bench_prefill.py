"""bench/prefill.py on the CPU: one row per prompt length with each engine's median time to the first
token (rounds in turn after a warm-up), and its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_prefill_rows_and_json(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench/prefill.py"), "--model", "tiny-dense", "--prompts", "8", "20",
           "--rounds", "3", "--no-mlx-lm", "--out", str(tmp_path / "pf.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    assert [line.split(":")[0] for line in r.stdout.splitlines() if " prompt " in line] == [
        "tiny-dense prompt 8", "tiny-dense prompt 20"]
    doc = json.loads((tmp_path / "pf.json").read_text())
    assert doc["mlx_lm"] is False and [row["prompt"] for row in doc["rows"]] == [8, 20]
    for row in doc["rows"]:
        ours = row["gemma4_mlx"]
        assert len(ours["rounds"]) == 3 and ours["seconds"] == sorted(ours["rounds"])[1]
        assert abs(ours["tok_s"] * ours["seconds"] - row["prompt"]) < 1e-6 and "ours_over_mlx_lm" not in row
