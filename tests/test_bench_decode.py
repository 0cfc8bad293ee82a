"""bench/decode.py on the CPU: the --quick run's JSON, caches filled directly vs a real prefill, byte
counts, the attention stand-in, the timer, and the reports (README table, targets, plot)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from gemma4_mlx.cache import RotatingKVCache, make_cache
from gemma4_mlx.compiled_step import CompiledDecoder
from gemma4_mlx.quantized import BlockExperts

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "decode.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bd = _load_bench()


def _has_mlx_lm() -> bool:
    return bd.mlx_lm_available()


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _kv_bytes_by_hand(cfg, n: int) -> int:
    total = 0
    for s in cfg.layers:
        length = min(n, cfg.sliding_window) if s.is_sliding else n
        total += 2 * length * s.num_kv_heads * s.head_dim * 2
    return total


def _check_stages(stages: dict) -> None:
    for key in ("full", "sampling", "head", "attention", "projections", "overhead", "sampling_top_p"):
        assert stages[key] is not None and np.isfinite(stages[key]), key
    parts = stages["sampling"] + stages["head"] + stages["attention"] + stages["projections"]
    assert stages["overhead"] == pytest.approx(stages["full"] - parts)
    assert stages["projections"] > 0


def test_quick_run_writes_the_json(tmp_path):
    out, png = tmp_path / "decode.json", tmp_path / "decode.png"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--no-mlx-lm", "--models", "tiny-moe,tiny-ple",
           "--contexts", "100", "--out", str(out), "--plot", "--plot-out", str(png)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["complete"] and doc["quick"]
    assert doc["copy_bandwidth"]["GBps"] > 0
    assert doc["versions"]["mlx"] == mx.__version__ and doc["versions"]["mlx_lm"] is None
    assert doc["hardware"]["backend"] in ("cpu", "cuda", "metal")
    assert {"timing", "weights", "context", "floor", "breakdown"} <= set(doc["method"])
    assert [(r["model"], r["context"]) for r in doc["rows"]] == [("tiny-moe", 100), ("tiny-ple", 100)]
    for r in doc["rows"]:
        cfg = bd.QUICK_MODELS[r["model"]]()
        e = r[bd.OURS]
        assert bd.MLX_LM not in r
        assert r["kv_bytes_per_token"] == _kv_bytes_by_hand(cfg, r["context"])
        weights = doc["models"][r["model"]][bd.OURS]["weight_bytes"]
        assert 0 < weights["per_token"] < weights["total"]
        assert e["bytes_per_token"] == weights["per_token"] + r["kv_bytes_per_token"]
        assert e["tok_s"] > 0 and e["ms_per_token"] == pytest.approx(1e3 / e["tok_s"])
        assert len(e["rounds"]) == 1
        assert e["floor_tok_s"] == pytest.approx(doc["copy_bandwidth"]["GBps"] * 1e9 / e["bytes_per_token"])
        assert e["frac_floor"] == pytest.approx(e["tok_s"] / e["floor_tok_s"])
        assert e["context_end"] > r["context"]
        assert e["cache_buffer_bytes"] > 0 and "step_peak_growth_bytes" in e
        variants = e["breakdown_variants"]  # --quick: a breakdown at its last context, 100
        assert "error" not in variants["no_attention"]  # the stand-in replaced the attention core
        assert all(variants[k]["tok_s"] > 0 for k in ("logits", "no_head", "no_attention", "projections"))
        _check_stages(e["stages_ms"])
    assert [t["met"] for t in doc["targets"]] == [None] * len(bd.TARGETS)
    assert "| tiny-ple | 100 |" in proc.stdout
    assert png.exists() == _has_matplotlib()


def test_trace_breakdown_and_its_table(monkeypatch):
    """On CUDA the breakdown comes from gpu_timeline.profile_steps (a CUPTI trace): its summary is
    reduced to ms-ready stage times, and the README table prints them; the profiler is faked here."""
    import gpu_timeline

    step_list = [("g4_q4_0_matvec", 30.0), ("g4_attn_decode_partial", 20.0), ("rms_norm", 4.0),
                 ("g4_q4_0_matvec", 50.0), ("g4_q8_0_matvec", 400.0), ("g4_sample_merge", 10.0)]
    calls = []

    def fake_profile(step, first, steps, path):
        calls.append(steps)
        return dict(window_us=600.0, busy_us=520.0, wait_us=70.0, launches=6.0, one_step=step_list,
                    stages=gpu_timeline.stages(step_list))

    monkeypatch.setattr(gpu_timeline, "profile_steps", fake_profile)
    t = bd.trace_breakdown(lambda prev: prev + 1, mx.array([5], mx.int32), steps=8)
    assert calls == [8]
    assert t["stages_us"] == {"projections": 80.0, "attention": 20.0, "other ops": 4.0, "head": 400.0, "sampling": 10.0}
    assert t["stage_launches"]["projections"] == 2 and t["busy_us"] == 520.0
    row = _row("31B", 4096, 170.0, 45.0)
    row[bd.OURS]["trace"] = t
    doc = dict(date="2026-12-01T10:00:00", hardware=dict(backend="cuda"), versions={}, copy_bandwidth=dict(GBps=3500.0),
               args=dict(mlxlm_group_size=64), rows=[row], targets=[])
    assert "| 31B | 4096 | gemma4_mlx | 0.60 | 0.52 | 0.08 | 0.02 | 0.00 | 0.40 | 0.01 | 6 |" in bd.readme_table(doc)


def test_breakdown_contexts_option():
    assert bd.breakdown_contexts(None, False) == set(bd.BREAKDOWN_CONTEXTS)
    assert bd.breakdown_contexts("", False) == set() and bd.breakdown_contexts("128, 4096", True) == {128, 4096}


def test_breakdown_budget_ignores_the_compiling_first_round():
    """Session 9 on the H200: the 31B row's first round compiled kernels for 151 s, and 2x the main
    rounds skipped a trace breakdown that takes seconds. A trace is now given 30 s + 3x the warm
    rounds (each engine's fastest); the timed variants keep 2x the main rounds."""
    round_s = {"gemma4_mlx": [151.0, 0.67], "mlx_lm": [1.30, 0.92]}
    assert bd.breakdown_seconds(round_s, 155.0, traced=True) == pytest.approx(30.0 + 3 * (0.67 + 0.92))
    assert bd.breakdown_seconds(round_s, 155.0, traced=False) == 310.0
    assert bd.breakdown_seconds({}, 10.0, traced=True) == 30.0
    # the fastest warm round: a first round can look faster only if nothing compiled (one round: it counts)
    assert bd.breakdown_seconds({"gemma4_mlx": [0.5, 0.9, 0.7]}, 5.0, traced=True) == pytest.approx(30.0 + 3 * 0.7)
    assert bd.breakdown_seconds({"gemma4_mlx": [4.0]}, 5.0, traced=True) == pytest.approx(42.0)


@pytest.mark.parametrize("n", [16, 100])
def test_direct_fill_matches_a_prefill(n):
    """The filled caches have the shapes, offsets and ring slot positions a real prefill leaves, and
    the compiled decoder decodes from them."""
    mx.random.seed(1)
    cfg = bd.QUICK_MODELS["tiny-dense"]()
    model = bd.build_ours(cfg)
    prefilled = make_cache(cfg)
    tokens = mx.array(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, n)).astype(np.int32))
    model.model(tokens, prefilled)
    filled = bd.ours_cache(cfg, n)
    for a, b in zip(prefilled, filled):
        assert a.offset == b.offset == n
        assert a.keys.dtype == b.keys.dtype == mx.bfloat16
        if isinstance(a, RotatingKVCache):
            assert a.keys.shape == b.keys.shape and a.values.shape == b.values.shape
            assert np.array_equal(np.array(a.positions), np.array(b.positions))
        else:  # a grew in 256-slot chunks; b holds exactly the n positions (the static copy takes [:n])
            assert a.keys[:, :, :n].shape == b.keys.shape and a.values[:, :, :n].shape == b.values.shape
    decoder = CompiledDecoder(model, filled, capacity=256)
    logits = decoder(mx.array([[3]], mx.int32))
    assert logits.shape == (1, cfg.vocab_size) and np.isfinite(np.array(logits)).all()


@pytest.mark.skipif(not _has_mlx_lm(), reason="mlx-lm is not installed")
@pytest.mark.parametrize("n", [16, 100])
def test_mlx_lm_fill_matches_its_prefill(n):
    mx.random.seed(2)
    cfg = bd.QUICK_MODELS["tiny-ple"]()
    lm = bd.build_mlx_lm(cfg, 64)
    prefilled = lm.make_cache()
    tokens = mx.array(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, n)).astype(np.int32))
    mx.eval(lm(tokens, cache=prefilled))
    filled = bd.mlx_lm_cache(lm, cfg, n, extra=8)
    for a, b in zip(prefilled, filled):
        assert a.offset == b.offset == n
    for step in range(1, 3):  # a prefill keeps all n tokens in a ring until the first decode step trims it
        token = mx.array([[5]], mx.int32)
        mx.eval(lm(token, cache=prefilled), lm(token, cache=filled))
        for a, b in zip(prefilled, filled):
            assert a.offset == b.offset == n + step
            if hasattr(a, "max_size"):  # ring: same slots (mlx-lm's private write index is not compared:
                assert a.keys.shape == b.keys.shape  # it differed between runs in one full-suite run)
            else:  # full layer: b preallocated, no growth
                assert b.keys.shape[2] >= n + 8


def test_weight_and_kv_bytes():
    mx.random.seed(3)
    cfg = bd.QUICK_MODELS["tiny-moe"]()
    model = bd.build_ours(cfg)
    layer = model.layers[0]
    assert layer.self_attn.q_proj.blocks.shape == (cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size // 32 * 18)
    head = model.model.embed_tokens.blocks
    assert head.shape == (cfg.vocab_size, cfg.hidden_size // 32 * 34)  # Q8_0 tied head
    assert isinstance(layer.experts, BlockExperts) and layer.router.proj.weight.dtype == mx.bfloat16
    assert layer.input_layernorm.weight.dtype == mx.bfloat16
    counts = bd.weight_bytes(model, cfg)
    experts = sum(m.experts.gate_up_blocks.nbytes + m.experts.down_blocks.nbytes for m in model.layers)
    expected = counts["total"] - experts * (1 - cfg.top_k_experts / cfg.num_experts) + head.nbytes / cfg.vocab_size
    assert counts["head"] == head.nbytes
    assert counts["per_token"] == int(expected)
    # random blocks: every fp16 scale finite and nonzero, of both signs
    d = np.array(head).reshape(cfg.vocab_size, -1, 34)[..., :2].copy().view(np.float16)
    assert np.isfinite(d).all() and (d != 0).all() and (d > 0).any() and (d < 0).any()
    tiny = bd.QUICK_MODELS["tiny-dense"]()
    # 5 sliding layers (2 kv heads, dim 64, window 32) + 1 full layer (1 kv head, dim 128), K and V, bf16
    assert bd.kv_bytes_read(tiny, 100) == 5 * 2 * 32 * 2 * 64 * 2 + 2 * 100 * 1 * 128 * 2


def test_attention_stand_in_is_applied_and_restored():
    mx.random.seed(4)
    cfg = bd.QUICK_MODELS["tiny-dense"]()
    model = bd.build_ours(cfg)
    original = mx.fast.scaled_dot_product_attention
    token = mx.array([[9]], mx.int32)
    mx.random.seed(5)
    normal = np.array(bd.ours_decoder(model, cfg, 40, 8)(token))
    with bd.attention_skipped(bd._ours_attention_targets()) as counter:
        mx.random.seed(5)
        skipped = np.array(bd.ours_decoder(model, cfg, 40, 8)(token))
    assert counter["calls"] == cfg.num_hidden_layers
    assert mx.fast.scaled_dot_product_attention is original
    assert not np.allclose(normal, skipped)
    mx.random.seed(5)
    again = np.array(bd.ours_decoder(model, cfg, 40, 8)(token))
    np.testing.assert_array_equal(normal, again)


@pytest.mark.parametrize("sync", [False, True])
def test_timer_runs_warmup_plus_steps(sync):
    calls = []

    def step(prev):
        calls.append(1)
        return prev + 1

    res = bd.time_tokens(step, mx.array([0]), warmup=2, steps=5, sync=sync)
    assert len(calls) == 2 + 5 + 1
    assert res["tok_s"] > 0 and res["ms_per_token"] == pytest.approx(1e3 / res["tok_s"])


def _row(model, ctx, ours, lm):
    row = dict(model=model, context=ctx, kv_bytes_per_token=0)
    row[bd.OURS] = dict(tok_s=ours, floor_tok_s=200.0, frac_floor=ours / 200.0)
    if lm:
        row[bd.MLX_LM] = dict(tok_s=lm, floor_tok_s=210.0, frac_floor=lm / 210.0)
        row["ratio_vs_mlx_lm"] = ours / lm
    return row


def test_targets_table_latest_and_plot(tmp_path, monkeypatch):
    rows = [_row("31B", 4096, 170.0, 45.0), _row("31B", 32768, 140.0, 40.0), _row("26B-A4B", 4096, 300.0, 120.0),
            dict(model="E4B", context=4096, skipped="budget")]
    rows[0][bd.OURS].update(cache_buffer_bytes=1000, step_peak_growth_bytes=20)
    rows[1][bd.OURS].update(cache_buffer_bytes=1000, step_peak_growth_bytes=900)
    rows[0][bd.OURS]["stages_ms"] = dict(full=5.9, projections=4.0, attention=0.5, head=0.5, sampling=0.1,
                                         overhead=0.8, sampling_top_p=0.3)
    rows[1][bd.OURS]["stages_ms"] = dict(full=7.1, projections=4.0, attention=0.5, head=-0.2, sampling=0.1,
                                         overhead=2.7, sampling_top_p=None)
    rows[1][bd.OURS]["rounds"] = [140.0, 125.0]
    targets = {t["name"]: t for t in bd.evaluate_targets(rows)}
    assert targets["31B decode at 4K (tok/s)"]["met"] is True
    assert targets["31B at 4K vs mlx-lm (x)"]["value"] == pytest.approx(170 / 45) and targets["31B at 4K vs mlx-lm (x)"]["met"]
    assert targets["31B 32K / 4K"]["value"] == pytest.approx(140 / 170) and targets["31B 32K / 4K"]["met"] is False
    assert targets["26B-A4B decode at 4K (tok/s)"]["met"] is False
    assert targets["E4B decode at 4K (tok/s)"]["met"] is None
    doc = dict(date="2026-12-01T10:00:00", hardware=dict(backend="cuda", nvidia_smi="NVIDIA H200, 143771 MiB"),
               versions=dict(mlx="0.32.4", mlx_lm="0.32.2", commit="abc"), copy_bandwidth=dict(GBps=3500.0),
               args=dict(mlxlm_group_size=64), rows=rows, targets=list(targets.values()))
    table = bd.readme_table(doc)
    assert "| 31B | 4096 | 170.0 | 45.0 | 3.78x | 200 | 85.0 |" in table
    assert "| E4B | 4096 | skipped (budget) |" in table
    assert "| 31B | 4096 | gemma4_mlx | 5.90 | 4.00 | 0.50 | 0.50 | 0.10 | 0.80 | 0.30 | – |" in table
    assert "| 31B | 32768 | gemma4_mlx | 7.10 | 4.00 | 0.50 | <0 | 0.10 | 2.70 | – | 0.86 |" in table
    assert "| 31B 32K / 4K | 0.85 | 0.82 | no |" in table
    assert "worst 0.90 (gemma4_mlx, 31B at 32768) — a step may copy a cache buffer" in table
    # latest full run by recorded date; --quick results are never "latest"
    for name, date in (("decode-cuda-2026-12-01.json", "2026-12-01T10:00:00"),
                       ("decode-cuda-2026-11-30.json", "2026-11-30T23:00:00"),
                       ("decode-cpu-2026-12-02-quick.json", "2026-12-02T00:00:00")):
        (tmp_path / name).write_text(json.dumps(dict(doc, date=date)))
    assert bd.latest_results(str(tmp_path)) == str(tmp_path / "decode-cuda-2026-12-01.json")
    # --readme-table prints the table of --results without running anything
    proc = subprocess.run([sys.executable, str(SCRIPT), "--readme-table", "--results",
                           str(tmp_path / "decode-cuda-2026-12-01.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "| 31B | 32768 | 140.0 | 40.0 | 3.50x |" in proc.stdout
    png = tmp_path / "p.png"
    assert bd.plot(doc, str(png)) == _has_matplotlib() == png.exists()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails: skipped, no file
    assert bd.plot(doc, str(tmp_path / "q.png")) is False and not (tmp_path / "q.png").exists()
    assert os.path.basename(bd.default_plot_path(doc)) == "decode-2026-12-01.png"


@pytest.mark.skipif(not _has_mlx_lm(), reason="mlx-lm is not installed")
def test_quick_run_with_mlx_lm(tmp_path):
    out = tmp_path / "d.json"
    assert bd.main(["--quick", "--models", "tiny-moe", "--contexts", "100", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    lm = row[bd.MLX_LM]
    assert doc["versions"]["mlx_lm"]
    assert lm["tok_s"] > 0 and row["ratio_vs_mlx_lm"] == pytest.approx(row[bd.OURS]["tok_s"] / lm["tok_s"])
    lm_weights = doc["models"]["tiny-moe"][bd.MLX_LM]["weight_bytes"]
    assert lm["bytes_per_token"] == lm_weights["per_token"] + row["kv_bytes_per_token"]
    assert "error" not in lm["breakdown_variants"]["no_attention"]
    _check_stages(lm["stages_ms"])
    _check_stages(row[bd.OURS]["stages_ms"])


def test_full_step_picks_from_the_logits_unless_asked_for_logprobs_first(monkeypatch):
    """OursEngine.full_step picks as generate_step does (sampling.choose: the greedy sampler gets the
    decoder's logits themselves); with GEMMA4_BENCH_LOGPROBS_FIRST=1 set while the step is built, the
    sampler gets the logprobs, as mlx-lm's step does."""
    engine = bd.OursEngine(bd.QUICK_MODELS["tiny-dense"]())
    engine.start(16, 8)
    decoded, seen = [], []
    decoder = engine.decoder
    engine.decoder = lambda token: decoded.append(decoder(token)) or decoded[-1]

    def spy(scores):
        seen.append(scores)
        return mx.argmax(scores, axis=-1).astype(mx.int32)

    spy.shift_invariant = True
    token = mx.array([5], mx.int32)
    picked = engine.full_step(spy)(token)
    assert seen[0] is decoded[0] and int(picked[0]) == int(mx.argmax(decoded[0][0]))
    monkeypatch.setenv("GEMMA4_BENCH_LOGPROBS_FIRST", "1")
    picked = engine.full_step(spy)(token)
    logprobs = decoded[1] - mx.logsumexp(decoded[1], axis=-1, keepdims=True)
    np.testing.assert_array_equal(np.array(seen[1]), np.array(logprobs))
    assert int(picked[0]) == int(mx.argmax(decoded[1][0]))
