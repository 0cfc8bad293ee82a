"""bench/tools/ab_decode.sh on the CPU (decode.py --quick): every setting runs in its own process
with its environment, in turn, and leaves its JSON and a printed tokens/s row."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ab_decode_alternates_settings(tmp_path):
    env = {**os.environ, "AB_ARGS": "--quick --steps 4 --warmup 1"}
    r = subprocess.run(["bash", str(ROOT / "bench/tools/ab_decode.sh"), str(tmp_path), "1", "tiny-dense", "32",
                        "plain=", "ref=GEMMA4_MLX_KERNELS=reference", "bad=GEMMA4_MLX_KERNELS=bogus"],
                       env=env, capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "plain round 1 (rc 0):" and "ref round 1 (rc 0):" in lines
    assert "bad round 1 (rc 1):" in lines  # its environment reached it: decode.py refused the value
    assert sum(line.startswith("| tiny-dense | 32 |") for line in lines) == 2
    for label in ("plain", "ref"):
        doc = json.loads((tmp_path / f"ab-{label}-1.json").read_text())
        assert doc["rows"][0]["model"] == "tiny-dense" and doc["rows"][0]["gemma4_mlx"]["tok_s"] > 0
