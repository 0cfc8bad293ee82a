"""bench/attention.py's problem setup: caches as a decode step at context n would hold them."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_cases_hold_the_newest_positions():
    import attention as ab
    import decode

    shapes = ab.layer_shapes(decode.QUICK_MODELS["tiny-dense"]())
    assert set(shapes) == {"sliding", "full"} and shapes["full"].sliding_window is None
    ring = ab.case(shapes["sliding"], 100, 2, True)
    pos = np.array(ring["positions"])
    assert ring["slots"] == shapes["sliding"].sliding_window + ab.SLACK
    assert sorted(pos) == list(range(100 - ring["slots"], 100))  # a full ring of the newest positions
    assert all(p % ring["slots"] == s for s, p in enumerate(pos))
    full = ab.case(shapes["full"], 100, 2, True)
    pos = np.array(full["positions"])
    assert full["slots"] % 256 == 0 and full["slots"] >= 100 + 64
    assert (pos[:100] == np.arange(100)).all() and (pos[100:] == -1).all()
    assert full["kv_bytes"] == 2 * shapes["full"].num_kv_heads * 100 * shapes["full"].head_dim * 2
    assert len(full["kvs"]) == 2 and full["kvs"][0][0].shape[2] == full["slots"]
