"""bench/step_settings.py end to end on the CPU: one child per setting, a JSON with both timings and
the primitive counts of the uncompiled step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_step_settings_writes_timings_and_primitive_counts(tmp_path):
    out = tmp_path / "settings.json"
    cmd = [sys.executable, str(ROOT / "bench" / "step_settings.py"), "--model", "tiny-dense", "--context", "40",
           "--settings", "default,mb", "--steps", "2", "--warmup", "0", "--count", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"default", "mb"}
    mb = doc["results"]["mb"]
    assert mb["env"]["MLX_MAX_MB_PER_BUFFER"] == "1000000" and doc["results"]["default"]["env"]["MLX_MAX_MB_PER_BUFFER"] is None
    for res in doc["results"].values():
        for mode in ("pipelined", "sync"):
            assert res["gemma4_mlx"][mode]["tok_s"] > 0
    counts = doc["results"]["default"]["primitives"]
    # six layers, seven norms each (input, q, k, v, post-attn, pre/post-FFN): the RMSNorm primitive on
    # a GPU, its decomposition (one Rsqrt per norm) on the CPU
    assert counts.get("RMSNorm", 0) + counts.get("Rsqrt", 0) >= 6 * 7
    assert "primitives" not in mb  # counted for the first setting only


def test_step_settings_rejects_unknown_settings():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "step_settings.py"), "--settings", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "unknown settings" in proc.stderr


def test_step_settings_repeats_a_setting_against_one_ptx_cache(tmp_path):
    out, cache = tmp_path / "cold.json", tmp_path / "ptx"
    cmd = [sys.executable, str(ROOT / "bench" / "step_settings.py"), "--model", "tiny-ple", "--layers", "4",
           "--context", "20", "--settings", "default", "--repeat", "2", "--ptx-cache", str(cache), "--steps", "2",
           "--warmup", "0", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert list(doc["results"]) == ["default", "default#2"] and doc["layers"] == 4
    for res in doc["results"].values():
        assert res["env"]["MLX_PTX_CACHE_DIR"] == str(cache)
        assert res["gemma4_mlx"]["first_steps_s"] > 0
        assert set(res["ptx_cache"]) == {"modules", "longest_name"}


def test_step_settings_rejects_a_cut_that_ends_on_a_sliding_layer():
    cmd = [sys.executable, str(ROOT / "bench" / "step_settings.py"), "--model", "tiny-dense", "--layers", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--layers 3" in proc.stderr and "full" in proc.stderr
