"""bench/gpu_timeline.py's trace reading, on a made-up Chrome trace with known busy and idle time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def _event(name, ts, dur, cat="kernel"):
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur)


def test_summary_splits_busy_gaps_and_waits():
    import gpu_timeline as gt

    trace = {"traceEvents": [
        _event("g4_attn_decode_partial_ab12", 100.0, 10.0),
        _event("g4_q4_0_matvec_stream_cd34", 0.0, 50.0),
        _event("rms_norm_kernel", 52.0, 8.0),      # gap 2 us: a launch gap
        _event("overlaps_previous", 55.0, 10.0),    # overlaps rms_norm: busy counts it once
        _event("cudaLaunchKernel", 0.0, 500.0, cat="cuda_runtime"),  # host-side: ignored
        _event("Memcpy DtoD", 200.0, 20.0, cat="gpu_memcpy"),         # waits: 35 us and 90 us
    ]}
    kernels = gt.kernels_of_trace(trace)
    assert [k[0] for k in kernels][0] == "g4_q4_0_matvec_stream_cd34"
    s = gt.summarize(kernels, steps=2)
    assert s["window_us"] == pytest.approx(220.0 / 2)
    assert s["busy_us"] == pytest.approx((50 + 13 + 10 + 20) / 2)
    assert s["launch_gap_us"] == pytest.approx(2.0 / 2) and s["launch_gaps"] == pytest.approx(0.5)
    assert s["wait_us"] == pytest.approx((35 + 90) / 2) and s["waits"] == pytest.approx(1.0)
    assert s["busy_us"] + s["idle_us"] == pytest.approx(s["window_us"])
    cats = {row["name"]: row["us"] for row in s["categories"]}
    assert cats["matvec (ours)"] == pytest.approx(25.0)
    assert cats["attention (ours)"] == pytest.approx(5.0)
    assert cats["norm (MLX)"] == pytest.approx(4.0)
    assert cats["copy / slice update (MLX)"] == pytest.approx(10.0)
    assert s["launches"] == pytest.approx(2.5)


def test_empty_trace_is_an_error():
    import gpu_timeline as gt

    with pytest.raises(ValueError, match="no kernels"):
        gt.summarize(gt.kernels_of_trace({"traceEvents": []}), steps=1)


def test_one_step_is_the_last_whole_step_with_short_names():
    import gpu_timeline as gt

    names = ["void mlx::core::cu::arg_reduce_general<float, mlx::core::cu::ArgMax<float>, 1024, 4>(float const*)",
             "mlx::core::cu::custom_kernel_g4_q4_0_matvec_bc3a74415ad82e11_bfloat16_t_1_2_2_2(__nv_bfloat16 const*)",
             "void mlx::core::cu::rms_norm_small<__nv_bfloat16, 128, 6, false, 8>(__nv_bfloat16 const*)"]
    kernels = [(names[1], 0, 9), (names[0], 10, 1), (names[2], 12, 2), (names[1], 15, 30), (names[0], 50, 1),
               (names[1], 52, 30)]
    step = gt.one_step(kernels)
    assert [n for n, _ in step] == ["rms_norm_small<__nv_bfloat16, 128, 6, false, 8>",
                                    "g4_q4_0_matvec_bfloat16_t_1_2_2_2",
                                    "arg_reduce_general<float, ArgMax<float>, 1024, 4>"]
    assert [d for _, d in step] == [2, 30, 1]
    assert gt.one_step(kernels[:3]) == []


def test_stages_split_one_step():
    import gpu_timeline as gt

    step = [("rms_norm_small<x>", 5.0), ("g4_q4_0_matvec_bf16", 30.0), ("rope_single<x>", 3.0),
            ("g4_attn_decode_partial_x", 50.0), ("g4_attn_decode_merge_x", 4.0), ("g4_q4_0_gate_up_x", 80.0),
            ("rms_norm_small<x>", 5.0), ("g4_q8_0_matvec_bf16", 460.0), ("logsumexp<float>", 20.0),
            ("arg_reduce_general<float, ArgMax<float>>", 27.0)]
    s = gt.stages(step)
    assert s["head"] == {"us": 460.0, "launches": 1}
    assert s["sampling"] == {"us": 47.0, "launches": 2}
    assert s["projections"] == {"us": 110.0, "launches": 2}
    assert s["attention"] == {"us": 54.0, "launches": 2}
    assert s["other ops"] == {"us": 13.0, "launches": 3}
    assert gt.stages([("rms_norm_small<x>", 5.0)]) == {}


def test_variant_parsing():
    import gpu_timeline as gt

    name, env = gt.parse_variant("c64=GEMMA4_MLX_ATTENTION_GEOMETRY=min_chunk=64,target_groups=2048 "
                                 "GEMMA4_MLX_MATVEC_GEOMETRY=rows_per_simd=1")
    assert name == "c64"
    assert env == {"GEMMA4_MLX_ATTENTION_GEOMETRY": "min_chunk=64,target_groups=2048",
                   "GEMMA4_MLX_MATVEC_GEOMETRY": "rows_per_simd=1"}
    for bad in ("novalue", "x=", "=A=1", "x=A"):
        with pytest.raises(SystemExit):
            gt.parse_variant(bad)


def test_variants_run_with_their_environment(monkeypatch, tmp_path):
    """On the CPU (no profiler activity): each variant decodes with its variables set, restored after."""
    import json
    import os

    import gpu_timeline as gt

    monkeypatch.delenv("GEMMA4_MLX_ATTENTION_GEOMETRY", raising=False)
    out = tmp_path / "t.json"
    gt.main(["--model", "tiny-dense", "--context", "40", "--steps", "2", "--warmup", "1", "--out", str(out),
             "--variant", "v=GEMMA4_MLX_ATTENTION_GEOMETRY=min_chunk=64", "--variant", "bad=GEMMA4_MLX_MATVEC_GEOMETRY=x=1"])
    doc = json.loads(out.read_text())
    assert set(doc["engines"]) == {"gemma4_mlx", "gemma4_mlx:v", "gemma4_mlx:bad"}
    assert doc["engines"]["gemma4_mlx:v"]["env"] == {"GEMMA4_MLX_ATTENTION_GEOMETRY": "min_chunk=64"}
    assert doc["engines"]["gemma4_mlx:v"]["plain"]["tok_s"] > 0
    assert "GEMMA4_MLX_ATTENTION_GEOMETRY" not in os.environ
