"""CPU tests of custom_kernels.quant_matvec: references vs a float64 numpy oracle, dispatch,
backend selection, the dialect and the kernel registry (GPU kernels run in test_kernels_gpu.py)."""

from __future__ import annotations

import math

import mlx.core as mx
import re

import numpy as np
import pytest

import custom_kernels
from custom_kernels import dialect
from custom_kernels import quant_matvec as qm
from custom_kernels.registry import all_kernel_specs, bf16_to_f32, f32_to_bf16

FORMATS = {"q4_0": (qm.Q4_0, 96), "q8_0": (qm.Q8_0, 96), "q6_k": (qm.Q6_K, 512)}


def _within(got: np.ndarray, want: np.ndarray, bound: np.ndarray, rel: float) -> None:
    """|got - want| <= rel * bound element-wise, where bound = sum |x||w| (the error scale of a dot)."""
    err = np.abs(got.astype(np.float64) - want)
    worst = float((err / bound).max())
    assert worst <= rel, f"relative error {worst:.3g} > {rel:g}"


def _to_mx(x64: np.ndarray, dtype: mx.Dtype) -> tuple[mx.array, np.ndarray]:
    """An MLX array in ``dtype`` and its exact float64 values."""
    arr = mx.array(x64.astype(np.float32)).astype(dtype)
    return arr, np.array(arr.astype(mx.float32)).astype(np.float64)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantize_matches_gguf(fmt):
    ggml_type, k = FORMATS[fmt]
    rng = np.random.default_rng(1)
    raw = qm.random_blocks(rng, ggml_type, (5,), k)
    got = np.array(qm.dequantize(mx.array(raw), ggml_type, k)).astype(np.float64)
    want = qm.dequantize_f64(raw, ggml_type)
    assert np.count_nonzero(want) > 0.9 * want.size  # fresh random weights, not zeros
    np.testing.assert_allclose(got, want, rtol=2**-23, atol=0)


def test_quantized_real_weights_roundtrip():
    """gguf-py's own Q4_0/Q8_0 quantizer output dequantizes identically here."""
    from gguf import GGMLQuantizationType, quants

    w = np.random.default_rng(2).standard_normal((7, 64)).astype(np.float32)
    for ggml_type in (qm.Q4_0, qm.Q8_0):
        raw = quants.quantize(w, GGMLQuantizationType(ggml_type))
        got = np.array(qm.dequantize(mx.array(raw), ggml_type, 64))
        np.testing.assert_array_equal(got, quants.dequantize(raw, GGMLQuantizationType(ggml_type)))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_dense_reference_vs_float64(fmt, dtype):
    ggml_type, k = FORMATS[fmt]
    rng = np.random.default_rng(3)
    n = 37  # not a multiple of any rows-per-threadgroup
    raw = qm.random_blocks(rng, ggml_type, (n,), k)
    w64 = qm.dequantize_f64(raw, ggml_type)
    blocks = mx.array(raw)
    for m in range(1, 9):
        x, x64 = _to_mx(rng.standard_normal((m, k)), dtype)
        out = qm.matvec_reference(x, blocks, ggml_type, n)
        assert out.shape == (m, n) and out.dtype == dtype
        got = np.array(out.astype(mx.float32))
        bound = np.abs(x64) @ np.abs(w64).T
        rel = 1e-5 if dtype == mx.float32 else 2**-8
        _within(got, x64 @ w64.T, bound, rel)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("per_slot", [False, True])
def test_gather_reference_vs_float64(fmt, per_slot):
    ggml_type, k = FORMATS[fmt]
    rng = np.random.default_rng(4)
    experts, n, slots = 6, 13, 3
    raw = qm.random_blocks(rng, ggml_type, (experts, n), k)
    w64 = qm.dequantize_f64(raw, ggml_type)
    for m in (1, 4, 8):  # m * slots < experts selects experts; more dequantizes the stack (gather_mm)
        ids = np.stack([rng.permutation(experts)[:slots] for _ in range(m)]).astype(np.int32)
        x, x64 = _to_mx(rng.standard_normal((m, slots, k) if per_slot else (m, k)), mx.float32)
        out = qm.matvec_gather_reference(x, mx.array(ids), mx.array(raw), ggml_type, n)
        assert out.shape == (m, slots, n)
        xs = x64 if per_slot else np.broadcast_to(x64[:, None], (m, slots, k))
        want = np.einsum("msnk,msk->msn", w64[ids], xs)
        bound = np.einsum("msnk,msk->msn", np.abs(w64[ids]), np.abs(xs))
        _within(np.array(out), want, bound, 1e-5)


def test_dense_reference_in_row_chunks(monkeypatch):
    """A weight larger than the dequantization chunk gives the same result in pieces."""
    rng = np.random.default_rng(9)
    raw = mx.array(qm.random_blocks(rng, qm.Q8_0, (50,), 64))
    x = mx.array(rng.standard_normal((2, 64)).astype(np.float32))
    whole = qm.matvec_reference(x, raw, qm.Q8_0, 50)
    monkeypatch.setattr(qm, "_CHUNK_WEIGHTS", 64 * 7)  # 7-row chunks, the last one short
    assert mx.array_equal(qm.matvec_reference(x, raw, qm.Q8_0, 50), whole).item()


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_gate_up_reference_vs_float64(fmt):
    ggml_type, k = FORMATS[fmt]
    rng = np.random.default_rng(5)
    experts, f, slots, m = 5, 11, 2, 3
    raw = qm.random_blocks(rng, ggml_type, (experts, 2 * f), k)
    w64 = qm.dequantize_f64(raw, ggml_type)
    ids = np.stack([rng.permutation(experts)[:slots] for _ in range(m)]).astype(np.int32)
    x, x64 = _to_mx(rng.standard_normal((m, k)), mx.float32)
    out = np.array(qm.gate_up_gather_reference(x, mx.array(ids), mx.array(raw), ggml_type, f))
    gu = np.einsum("msnk,mk->msn", w64[ids], x64)
    g, u = gu[..., :f], gu[..., f:]
    want = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * u
    mag = np.einsum("msnk,mk->msn", np.abs(w64[ids]), np.abs(x64))
    _within(out, want, (np.abs(g) + mag[..., :f]) * (np.abs(u) + mag[..., f:]), 1e-5)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_dense_gate_up_vs_float64(fmt):
    """A dense MLP's gate|up as one [2F, ...] matrix (reference and public op; on CPU the op is the
    reference), for [..., K] inputs of 1..8 rows and of more (prefill)."""
    ggml_type, k = FORMATS[fmt]
    rng = np.random.default_rng(23)
    f = 13
    raw = qm.random_blocks(rng, ggml_type, (2 * f,), k)
    w64 = qm.dequantize_f64(raw, ggml_type)
    for shape in ((1, k), (2, 3, k), (12, k)):
        x, x64 = _to_mx(rng.standard_normal(shape), mx.float32)
        gu, mag = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
        g, u = gu[..., :f], gu[..., f:]
        want = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * u
        bound = (np.abs(g) + mag[..., :f]) * (np.abs(u) + mag[..., f:])
        for out in (qm.gate_up_reference(x, mx.array(raw), ggml_type, f), qm.gate_up(x, mx.array(raw), ggml_type, f)):
            assert out.shape == (*shape[:-1], f) and out.dtype == mx.float32
            _within(np.array(out), want, bound, 1e-5)
    with pytest.raises(ValueError, match="Q4_0 or Q8_0"):
        q6 = qm.random_blocks(rng, qm.Q6_K, (2 * f,), 256)
        qm.gate_up(mx.ones((1, 256)), mx.array(q6), qm.Q6_K, f)


@pytest.mark.parametrize("ggml_type, op", [(qm.Q4_0, qm.q4_0_moe_down), (qm.Q8_0, qm.q8_0_moe_down)])
def test_moe_down_reference_vs_float64(ggml_type, op):
    """Fused down projection + router-weighted sum over slots (reference and public op; on CPU
    the op is the reference): sum_s w[m, s] W[ids[m, s]] @ x[m, s]."""
    rng = np.random.default_rng(19)
    experts, n, slots, m, k = 6, 13, 3, 2, 96
    raw = qm.random_blocks(rng, ggml_type, (experts, n), k)
    w64 = qm.dequantize_f64(raw, ggml_type)
    ids = np.stack([rng.permutation(experts)[:slots] for _ in range(m)]).astype(np.int32)
    wts = rng.random((m, slots)).astype(np.float32)
    x, x64 = _to_mx(rng.standard_normal((m, slots, k)), mx.float32)
    want = np.einsum("ms,msnk,msk->mn", wts.astype(np.float64), w64[ids], x64)
    bound = np.einsum("ms,msnk,msk->mn", wts.astype(np.float64), np.abs(w64[ids]), np.abs(x64))
    for fn in (lambda: qm.moe_down_reference(x, mx.array(ids), mx.array(wts), mx.array(raw), ggml_type, n),
               lambda: op(x, mx.array(ids), mx.array(wts), mx.array(raw), n)):  # fmt: skip
        out = fn()
        assert out.shape == (m, n) and out.dtype == mx.float32
        _within(np.array(out), want, bound, 1e-5)
    with pytest.raises(ValueError):
        op(x[:, 0], mx.array(ids), mx.array(wts), mx.array(raw), n)  # x must be [M, k, K]


def test_stream_plans_and_copy_width():
    """Stream kernels: copy width from the row length, grids covering every row / feature."""
    assert [qm.stream_copy_width(qm.row_bytes(qm.Q4_0, k)) for k in (5376, 2816, 384, 704, 96)] == [16, 16, 8, 4, 0]
    assert qm.stream_supported(mx.bfloat16, 5376) and not qm.stream_supported(mx.float32, 5376)
    assert not qm.stream_supported(mx.bfloat16, 96)  # 3 blocks per row: 54 bytes, 2-byte aligned only
    for kind, n, k in (("dense", 21504, 5376), ("gather", 2816, 704), ("gate_up", 704, 2816), ("down_sum", 2816, 704)):
        plan = qm.plan_stream(kind, 1, n, k, 8, kind != "dense")
        cfg = qm.default_stream_config(kind, 1, n, k, {"dense": 1, "down_sum": 1}.get(kind, 8))
        per_block = {"gate_up": 8 * cfg.tiles * cfg.warps, "down_sum": 16 * cfg.tiles}.get(kind, 16 * cfg.tiles * cfg.warps)
        assert plan.threadgroup == (32 * cfg.warps, 1, 1) and plan.grid[0] // plan.threadgroup[0] * per_block >= n
        assert plan.grid[1] == {"dense": 1, "down_sum": 1}.get(kind, 8)
    with pytest.raises(ValueError):
        qm.StreamConfig(2, 8, 4)  # 73 KiB of static shared memory


def test_runs_plans_and_geometry(monkeypatch):
    """Runs kernels: by default the 16-row form; the 8-row form (rows=8): 8 dense rows (4 gate|up
    pairs) per threadgroup, warps doubled while the grid is small and a row has runs for them, the
    environment override, and the inputs they refuse."""
    monkeypatch.delenv(qm.RUNS_GEOMETRY_ENV, raising=False)
    assert qm.default_runs_config("gate_up", 21504, 5376) == qm.RunsConfig(1, 0, 16, 0, qm.RUNS_STAGES, qm.RUNS_BULK)
    assert (qm.RUNS_STAGES, qm.RUNS_BULK) == (2, 1)
    assert qm.RUNS_ROWS == 16 and qm.RunsConfig().rows == 16
    monkeypatch.setenv(qm.RUNS_GEOMETRY_ENV, "rows=12")
    with pytest.raises(ValueError, match=qm.RUNS_GEOMETRY_ENV):
        qm.default_runs_config("dense", 10, 256)
    monkeypatch.setenv(qm.RUNS_GEOMETRY_ENV, "rows=8")
    cases = {("dense", 43008, 5376): 1, ("dense", 5376, 21504): 4, ("dense", 5376, 8192): 4,
             ("gate_up", 10240, 2560): 1, ("dense", 2560, 10240): 8, ("dense", 40, 256): 1}  # fmt: skip
    for (kind, n, k), warps in cases.items():
        assert qm.default_runs_config(kind, n, k).warps == warps, (kind, n, k)
        plan = qm.plan_runs(kind, n, k)
        per_set = 4 if kind == "gate_up" else 8
        assert plan.threadgroup == (32 * warps, 1, 1) and plan.output_shape == (1, n)
        assert plan.grid[0] // plan.threadgroup[0] == -(-n // per_set)
    assert qm.runs_supported(mx.bfloat16, 2560) and not qm.runs_supported(mx.bfloat16, 2592)
    assert not qm.runs_supported(mx.float32, 2560)
    with pytest.raises(ValueError, match="multiple of 256"):
        qm.plan_runs("dense", 10, 2592)
    with pytest.raises(ValueError):
        qm.RunsConfig(3)
    monkeypatch.setenv(qm.RUNS_GEOMETRY_ENV, "warps=2")
    assert qm.plan_runs("dense", 43008, 5376).threadgroup == (64, 1, 1)
    assert qm.default_runs_config("dense", 43008, 5376).rows == 16
    # the 16-row form: 16 dense rows (8 gate|up pairs) per threadgroup, its own kernel, no prefetch
    monkeypatch.setenv(qm.RUNS_GEOMETRY_ENV, "rows=16,stages=0")
    for (kind, n, k), warps in {("dense", 43008, 5376): 1, ("dense", 16384, 5376): 2, ("gate_up", 21504, 5376): 1, ("dense", 5376, 21504): 8,
                                ("gate_up", 10240, 2560): 2}.items():  # fmt: skip
        cfg = qm.default_runs_config(kind, n, k)
        assert (cfg.rows, cfg.warps) == (16, warps), (kind, n, k)
        plan = qm.plan_runs(kind, n, k)
        assert plan.grid[0] // plan.threadgroup[0] == -(-n // (8 if kind == "gate_up" else 16))
        assert dict(plan.template) == {"T": "bfloat16", "NW": warps, "L2P": 0}
        assert qm._runs_def(kind, 16).name.endswith("_runs16")
    with pytest.raises(ValueError, match="no prefetch"):
        qm.RunsConfig(1, 1, 16)
    with pytest.raises(ValueError, match="rows"):
        qm.RunsConfig(1, 0, 12)
    # the staged 16-row form: its own kernel, warps doubled only while the stage slots fit in 48 KB
    for stages, cases in ((1, {("gate_up", 21504, 5376): 1, ("dense", 16384, 5376): 2, ("dense", 5376, 21504): 8}),
                          (2, {("dense", 5376, 21504): 4, ("gate_up", 10240, 2560): 2}),
                          (3, {("dense", 5376, 21504): 2, ("gate_up", 10240, 2560): 2})):  # fmt: skip
        monkeypatch.setenv(qm.RUNS_GEOMETRY_ENV, f"stages={stages}")
        for (kind, n, k), warps in cases.items():
            cfg = qm.default_runs_config(kind, n, k)
            assert (cfg.rows, cfg.warps, cfg.stages) == (16, warps, stages), (kind, n, k)
            plan = qm.plan_runs(kind, n, k)
            assert dict(plan.template) == {"T": "bfloat16", "NW": warps, "STG": stages}
            assert plan.grid[0] // plan.threadgroup[0] == -(-n // (8 if kind == "gate_up" else 16))
    assert qm._runs_def("dense", 16, True).name == "g4_q4_0_matvec_runs16s"
    monkeypatch.setenv(qm.RUNS_GEOMETRY_ENV, "bulk=0")  # the 16-byte cp.async staged form
    cfg = qm.default_runs_config("gate_up", 21504, 5376)
    assert (cfg.stages, cfg.bulk) == (qm.RUNS_STAGES, 0)
    for override in ("stages=0", "rows=8", "dynamic=1"):  # forms without bulk copies drop the default
        monkeypatch.setenv(qm.RUNS_GEOMETRY_ENV, override)
        assert qm.default_runs_config("dense", 5376, 21504).bulk == 0, override
    monkeypatch.delenv(qm.RUNS_GEOMETRY_ENV)
    assert dict(qm.plan_runs("gate_up", 21504, 5376).template) == {"T": "bfloat16", "NW": 1, "STG": qm.RUNS_STAGES}
    assert qm._runs_def("gate_up", 16, True, True).name == "g4_q4_0_gate_up_runs16b"
    monkeypatch.setenv(qm.RUNS_GEOMETRY_ENV, "dynamic=1,stages=2")  # slots past 48 KB: 8 warps x 2 slots
    cfg = qm.default_runs_config("dense", 5376, 21504)
    assert (cfg.warps, cfg.stages, cfg.bulk, cfg.dynamic) == (8, 2, 0, 1)
    assert qm.runs_dynamic_bytes(cfg) == 8 * 2 * qm.RUNS_STAGE_BYTES
    assert qm.runs_dynamic_bytes(qm.RunsConfig(8, 0, 16, 0, 1)) == 0
    assert qm._runs_def("dense", 16, True, False, True).name == "g4_q4_0_matvec_runs16d"
    for bad in (dict(rows=8, stages=2), dict(stages=5), dict(stages=-1), dict(l2_prefetch=1, stages=2),
                dict(warps=8, stages=2), dict(warps=4, stages=3), dict(bulk=1), dict(stages=2, bulk=2),
                dict(dynamic=1), dict(stages=2, bulk=1, dynamic=1)):  # fmt: skip
        with pytest.raises(ValueError):
            qm.RunsConfig(**bad)
    monkeypatch.setenv(qm.RUNS_GEOMETRY_ENV, "warps=5")
    with pytest.raises(ValueError, match=qm.RUNS_GEOMETRY_ENV):
        qm.default_runs_config("dense", 10, 256)
    monkeypatch.delenv(qm.RUNS_GEOMETRY_ENV)
    x = mx.zeros((2, 256), mx.bfloat16)
    with pytest.raises(ValueError, match="one token"):
        qm.launch_dense_runs(x, mx.zeros((8, 144), mx.uint8), 8)
    with pytest.raises(TypeError):
        qm.launch_gate_up_runs(x[:1].astype(mx.float32), mx.zeros((8, 144), mx.uint8), 4)
    with pytest.raises(ValueError, match="do not hold"):  # 9 rows for N = 8
        qm.launch_dense_runs(x[:1], mx.zeros((9, 144), mx.uint8), 8)
    with pytest.raises(ValueError, match="do not hold"):  # gate|up: 2F rows of K / 32 * 18 bytes
        qm.launch_gate_up_runs(x[:1], mx.zeros((8, 144), mx.uint8), 5)
    with pytest.raises(ValueError, match="do not hold"):
        qm.launch_gate_up_runs(x[:1], mx.zeros((8, 126), mx.uint8), 4)


def test_runs_families(monkeypatch):
    """gate_up_runs (a dense MLP's gate|up) and quant_matvec_runs (dense rows) are on by default on
    CUDA only, for bf16 x and K a multiple of 256; dense rows only where the grid is wide (the
    31B projections, not E4B's); GEMMA4_MLX_KERNELS_OFF turns either off."""
    for family in ("gate_up_runs", "quant_matvec_runs"):
        assert family in custom_kernels.PROVEN and family in custom_kernels.CUDA_ONLY
    monkeypatch.delenv(custom_kernels.UNPROVEN_ENV, raising=False)
    monkeypatch.delenv(custom_kernels.KERNELS_OFF_ENV, raising=False)
    for which in ("metal", "cuda"):
        monkeypatch.setattr(qm, "backend", lambda which=which: which)
        monkeypatch.setattr(custom_kernels, "backend", lambda which=which: which)
        assert qm._use_runs(mx.bfloat16, 2560, "gate_up_runs") == (which == "cuda")
        assert qm._use_runs(mx.bfloat16, 2560, "quant_matvec_runs") == (which == "cuda")
    assert not qm._use_runs(mx.bfloat16, 2592, "gate_up_runs") and not qm._use_runs(mx.float32, 2560, "gate_up_runs")
    assert qm._use_runs(mx.bfloat16, 2560, "quant_matvec_runs")
    monkeypatch.delenv(qm.RUNS_GEOMETRY_ENV, raising=False)
    # 31B q|k|v (sliding and full layers), o_proj, down; E4B q|k|v, o_proj, down; 12B down
    for (n, k), wide in {(16384, 5376): True, (18432, 5376): True, (5376, 8192): True, (5376, 21504): True,
                         (3072, 2560): False, (2560, 2048): False, (2560, 10240): False,
                         (3840, 15360): False}.items():  # fmt: skip
        assert qm.dense_runs_wide(n, k) == wide, (n, k)
    cfg = qm.default_runs_config("dense", 5376, 21504)
    assert (cfg.warps, cfg.stages, cfg.bulk) == (8, qm.RUNS_DENSE_STAGES, qm.RUNS_BULK) == (8, 1, 1)
    # a geometry override changes the kernel's form, never which rows take it
    for override in ("warps=1", "stages=2", "rows=8", "bulk=0"):
        monkeypatch.setenv(qm.RUNS_GEOMETRY_ENV, override)
        assert qm.dense_runs_wide(5376, 21504) and not qm.dense_runs_wide(2560, 10240), override
    monkeypatch.delenv(qm.RUNS_GEOMETRY_ENV)
    monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, "gate_up_runs,quant_matvec_runs")
    assert not qm._use_runs(mx.bfloat16, 2560, "gate_up_runs")
    assert not qm._use_runs(mx.bfloat16, 2560, "quant_matvec_runs")


def test_one_token_dense_routing_on_cuda(monkeypatch):
    """On CUDA (faked, launches stubbed), a one-token bf16 Q4_0 projection goes to the runs kernel
    where dense_runs_wide holds (the 31B o_proj / down) and keeps its earlier kernel elsewhere (E4B's
    down, f32 x, two rows); GEMMA4_MLX_KERNELS_OFF=quant_matvec_runs turns the runs route off."""
    for env in (qm.RUNS_GEOMETRY_ENV, custom_kernels.UNPROVEN_ENV, custom_kernels.KERNELS_ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(qm, "backend", lambda: "cuda")
    monkeypatch.setattr(custom_kernels, "backend", lambda: "cuda")
    routed = []
    for name in ("launch_dense_runs", "launch_dense_runs_m", "launch_dense_stream", "launch_dense_mma", "launch_dense"):
        monkeypatch.setattr(qm, name, lambda *a, _name=name, **kw: routed.append(_name) or "stub")
    cases = (((1, 21504), mx.bfloat16, 5376, True), ((1, 1, 8192), mx.bfloat16, 5376, True),
             ((1, 10240), mx.bfloat16, 2560, False), ((1, 21504), mx.float32, 5376, False),
             ((2, 21504), mx.bfloat16, 5376, False))  # fmt: skip
    for off in ("", "quant_matvec_runs"):
        monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, off)
        for shape, dtype, n, runs in cases:
            routed.clear()
            blocks = mx.zeros((n, shape[-1] // 32 * 18), mx.uint8)
            assert qm.quant_matvec(mx.zeros(shape, dtype), blocks, qm.Q4_0, n) == "stub"
            assert (routed == ["launch_dense_runs"]) == (runs and not off), (shape, dtype, n, off, routed)


def test_many_token_routing_on_cuda(monkeypatch):
    """On CUDA (faked, launches stubbed), 2..8 bf16 tokens with Q4_0 blocks go to the runs16m kernels
    (dense and gate|up) unless GEMMA4_MLX_KERNELS_OFF names quant_matvec_runs_m; one token, f32 x, K
    not a multiple of 256 and Q8_0 blocks keep their kernels."""
    for env in (qm.RUNS_GEOMETRY_ENV, qm.RUNS_M_GEOMETRY_ENV, custom_kernels.UNPROVEN_ENV, custom_kernels.KERNELS_ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(qm, "backend", lambda: "cuda")
    monkeypatch.setattr(custom_kernels, "backend", lambda: "cuda")
    routed = []
    for name in ("launch_dense_runs_m", "launch_gate_up_runs_m", "launch_dense_runs", "launch_gate_up_runs",
                 "launch_dense_stream", "launch_dense_mma", "launch_dense", "launch_gate_up"):  # fmt: skip
        monkeypatch.setattr(qm, name, lambda *a, _name=name, **kw: routed.append(_name) or mx.zeros((1,)))
    for name in ("launch_dense_tiles", "launch_gate_up_tiles"):  # one token of K 5376: the tiles kernels
        monkeypatch.setattr(qm._tiles, name, lambda *a, _name=name, **kw: routed.append(_name) or mx.zeros((1,)))
    cases = (((8, 5376), mx.bfloat16, qm.Q4_0, True), ((2, 1, 512), mx.bfloat16, qm.Q4_0, True),
             ((1, 5376), mx.bfloat16, qm.Q4_0, False), ((8, 5376), mx.float32, qm.Q4_0, False),
             ((4, 1056), mx.bfloat16, qm.Q4_0, False), ((8, 5376), mx.bfloat16, qm.Q8_0, False))  # fmt: skip
    for off in ("", "quant_matvec_runs_m"):
        monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, off)
        for shape, dtype, fmt, runs_m in cases:
            blocks = mx.zeros((64, qm.row_bytes(fmt, shape[-1])), mx.uint8)
            routed.clear()
            qm.quant_matvec(mx.zeros(shape, dtype), blocks, fmt, 64)
            assert ("launch_dense_runs_m" in routed) == (runs_m and not off), (shape, dtype, fmt, off, routed)
            routed.clear()
            qm.gate_up(mx.zeros(shape, dtype), blocks, fmt, 32)
            assert ("launch_gate_up_runs_m" in routed) == (runs_m and not off), (shape, dtype, fmt, off, routed)


def test_runs_m_plans_and_geometry(monkeypatch):
    """runs16m: one threadgroup per `warps` row sets of 16 rows (8 gate + 8 up), 32 lanes a warp, the
    output [M, N]; its slots' shared memory; bad geometries, K, token counts and dtypes refused."""
    monkeypatch.delenv(qm.RUNS_M_GEOMETRY_ENV, raising=False)
    assert qm.default_runs_m_config() == qm.RunsMConfig(4, 2)
    plan = qm.plan_runs_m("dense", 8, 21504, 5376)
    assert plan.grid == (math.ceil(21504 / 16 / 4) * 128, 1, 1) and plan.threadgroup == (128, 1, 1)
    assert plan.output_shape == (8, 21504) and dict(plan.template) == {"T": "bfloat16", "NW": 4, "STG": 2}
    gu = qm.plan_runs_m("gate_up", 3, 21, 512, qm.RunsMConfig(2, 3))
    assert gu.grid == (2 * 64, 1, 1) and gu.output_shape == (3, 21)  # 3 sets of 8 outputs -> 2 threadgroups
    assert qm.runs_m_shared_bytes(qm.RunsMConfig(4, 2)) == 2 * (4 * 16 * 304 + 8 * 1056)
    monkeypatch.setenv(qm.RUNS_M_GEOMETRY_ENV, "warps=8,stages=3")
    assert qm.default_runs_m_config() == qm.RunsMConfig(8, 3)
    monkeypatch.delenv(qm.RUNS_M_GEOMETRY_ENV)
    for bad in (dict(warps=3), dict(stages=0), dict(stages=5)):
        with pytest.raises(ValueError):
            qm.RunsMConfig(**bad)
    with pytest.raises(ValueError, match="multiple of 256"):
        qm.plan_runs_m("dense", 2, 16, 2592)
    for m in (0, 9):
        with pytest.raises(ValueError, match="1..8 tokens"):
            qm.plan_runs_m("dense", m, 16, 512)
    for bad in (dict(warps=4.0), dict(warps=True), dict(stages=2.0)):
        with pytest.raises(ValueError):
            qm.RunsMConfig(**bad)
    with pytest.raises(ValueError, match="kind"):
        qm.plan_runs_m("gate", 2, 16, 512)
    with pytest.raises(ValueError, match="positive multiple of 256"):
        qm.plan_runs_m("dense", 2, 16, 0)
    with pytest.raises(ValueError, match="output row"):
        qm.plan_runs_m("gate_up", 2, 0, 512)
    with pytest.raises(TypeError, match="bfloat16"):
        qm.launch_dense_runs_m(mx.zeros((2, 512), mx.float32), mx.zeros((16, 288), mx.uint8), 16)
    with pytest.raises(ValueError):
        qm.launch_gate_up_runs_m(mx.zeros((2, 512), mx.bfloat16), mx.zeros((16, 288), mx.uint8), 9)
    if custom_kernels.backend() != "cuda":  # valid inputs: refused here with a reason, not a compile error
        with pytest.raises(RuntimeError, match="compute capability"):
            qm.launch_dense_runs_m(mx.zeros((2, 512), mx.bfloat16), mx.zeros((16, 288), mx.uint8), 16)


def test_runs_kernels_follow_the_compute_capability(monkeypatch):
    """On CUDA (faked): below sm_90 the staged runs kernels fill their slots with cp.async (no bulk
    copies), 2..8 tokens leave runs16m for the stream kernel and one token the tiles kernels for the
    runs kernels; below sm_80 (no bf16 mma.sync) Q4_0
    takes the f32-FMA kernels; an unreported capability (0) keeps the H200 defaults."""
    for env in (qm.RUNS_GEOMETRY_ENV, custom_kernels.UNPROVEN_ENV, custom_kernels.KERNELS_OFF_ENV, custom_kernels.KERNELS_ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(qm, "backend", lambda: "cuda")
    monkeypatch.setattr(custom_kernels, "backend", lambda: "cuda")
    routed = []
    for name in ("launch_dense_runs_m", "launch_dense_runs", "launch_dense_stream", "launch_dense_mma", "launch_dense"):
        monkeypatch.setattr(qm, name, lambda *a, _name=name, **kw: routed.append(_name) or mx.zeros((1,)))
    monkeypatch.setattr(qm._tiles, "launch_dense_tiles", lambda *a, **kw: routed.append("launch_dense_tiles") or mx.zeros((1,)))
    blocks = mx.zeros((21504, qm.row_bytes(qm.Q4_0, 5376)), mx.uint8)
    wide = mx.zeros((5376, qm.row_bytes(qm.Q4_0, 21504)), mx.uint8)  # K past the tiles kernels' range
    for arch, bulk, many, one, one_wide in ((0, 1, "launch_dense_runs_m", "launch_dense_tiles", "launch_dense_runs"),
                                            (90, 1, "launch_dense_runs_m", "launch_dense_tiles", "launch_dense_runs"),
                                            (80, 0, "launch_dense_stream", "launch_dense_runs", "launch_dense_runs"),
                                            (75, 0, "launch_dense", "launch_dense", "launch_dense")):  # fmt: skip
        monkeypatch.setattr(qm, "cuda_arch", lambda arch=arch: arch)
        assert qm.default_runs_config("gate_up", 21504, 5376).bulk == bulk, arch
        routed.clear()
        qm.quant_matvec(mx.zeros((8, 5376), mx.bfloat16), blocks, qm.Q4_0, 21504)
        qm.quant_matvec(mx.zeros((1, 5376), mx.bfloat16), blocks, qm.Q4_0, 21504)
        qm.quant_matvec(mx.zeros((1, 21504), mx.bfloat16), wide, qm.Q4_0, 5376)
        assert routed == [many, one, one_wide], (arch, routed)


def test_backend_and_reference_switch(monkeypatch):
    assert custom_kernels.backend() in ("metal", "cuda", "cpu")
    monkeypatch.setenv(custom_kernels.KERNELS_ENV, "reference")
    assert custom_kernels.use_reference()
    monkeypatch.setenv(custom_kernels.KERNELS_ENV, "fast-please")
    with pytest.raises(ValueError):
        custom_kernels.use_reference()
    monkeypatch.delenv(custom_kernels.KERNELS_ENV)
    assert custom_kernels.use_reference() == (custom_kernels.backend() == "cpu")


@pytest.mark.skipif(custom_kernels.backend() != "cpu", reason="CPU-build behaviour")
def test_cpu_dispatch_uses_reference_and_builds_no_kernel():
    custom_kernels.clear_kernel_cache()
    rng = np.random.default_rng(6)
    raw = mx.array(qm.random_blocks(rng, qm.Q4_0, (10,), 64))
    x = mx.array(rng.standard_normal((2, 3, 64)).astype(np.float32)).astype(mx.bfloat16)
    out = qm.q4_0_matvec(x, raw, 10)
    assert out.shape == (2, 3, 10) and out.dtype == mx.bfloat16
    want = qm.matvec_reference(x.reshape(6, 64), raw, qm.Q4_0, 10).reshape(2, 3, 10)
    assert mx.array_equal(out, want)
    assert not custom_kernels._kernel_cache
    with pytest.raises(RuntimeError):
        custom_kernels.get_kernel("k", ("a",), ("b",), ("", "b[0] = a[0];"), ("", "b[0] = a[0];"))


def test_kernel_names_carry_a_digest_of_their_text(monkeypatch):
    """MLX caches compiled kernels by name (CUDA also on disk, across processes): the name handed to
    MLX changes with the text, so an edited kernel can never load a stale compiled one."""
    a = custom_kernels.mlx_kernel_name("g4_k", "", "b[0] = a[0];")
    assert a == custom_kernels.mlx_kernel_name("g4_k", "", "b[0] = a[0];") and a.startswith("g4_k_")
    assert a.isidentifier()
    assert a != custom_kernels.mlx_kernel_name("g4_k", "", "b[0] = a[0] ;")
    assert a != custom_kernels.mlx_kernel_name("g4_k", "// header", "b[0] = a[0];")
    seen = []
    monkeypatch.setattr(custom_kernels, "backend", lambda: "cuda")
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: seen.append(kw["name"]) or object())
    monkeypatch.setenv(custom_kernels.KERNEL_TEXT_ENV, "full")
    custom_kernels.clear_kernel_cache()
    try:
        custom_kernels.get_kernel("g4_k", ("a",), ("b",), ("", "metal text"), ("", "b[0] = a[0];"))
    finally:
        custom_kernels.clear_kernel_cache()
    assert seen == [a]


def test_cuda_kernels_get_their_text_compacted(monkeypatch):
    """On CUDA, MLX gets the text without comments, indentation and uncalled helpers (its name
    digests that text); GEMMA4_MLX_KERNEL_TEXT=compact keeps the helpers, full hands the text as
    written, short renames what the text declares, anything else is refused. Metal keeps it."""
    header, source = "// helpers\n  inline float g4_two() { return 2.0f; }\n", "  /* body */ b[0] = a[0] * g4_two();  // twice\n"
    three = "inline float three() { return 3.0f; }\n"
    seen = []

    def stand_in(**kw):
        seen.append((kw["name"], kw["header"], kw["source"]))
        return object()

    monkeypatch.setattr(custom_kernels, "backend", lambda: "cuda")
    monkeypatch.setattr(mx.fast, "cuda_kernel", stand_in)
    custom_kernels.clear_kernel_cache()
    try:
        for form in ("", "full", "pruned"):
            monkeypatch.setenv(custom_kernels.KERNEL_TEXT_ENV, form)
            custom_kernels.get_kernel("g4_k", ("a",), ("b",), ("", "metal"), (header + three, source))
        monkeypatch.setenv(custom_kernels.KERNEL_TEXT_ENV, "compact")
        custom_kernels.get_kernel("g4_k", ("a",), ("b",), ("", "metal"), (header + three, source))
        monkeypatch.setenv(custom_kernels.KERNEL_TEXT_ENV, "short")
        custom_kernels.get_kernel("g4_k", ("a",), ("b",), ("", "metal"), (header + three, source))
        monkeypatch.setenv(custom_kernels.KERNEL_TEXT_ENV, "tiny")
        with pytest.raises(ValueError, match="GEMMA4_MLX_KERNEL_TEXT must be"):
            custom_kernels.get_kernel("g4_k", ("a",), ("b",), ("", "metal"), (header, source))
        monkeypatch.setenv(custom_kernels.KERNEL_TEXT_ENV, "compact")
        with pytest.raises(ValueError, match="kernel 'g4_bad': unterminated block comment"):
            custom_kernels.get_kernel("g4_bad", ("a",), ("b",), ("", "metal"), ("", "b[0] = a[0]; /* open"))
    finally:
        custom_kernels.clear_kernel_cache()
    pruned = ("inline float g4_two() { return 2.0f; }\n", "b[0] = a[0] * g4_two();\n")  # three() dropped
    compact = (pruned[0] + three, pruned[1])
    assert seen[0] == (custom_kernels.mlx_kernel_name("g4_k", *pruned), *pruned)
    assert seen[1] == (custom_kernels.mlx_kernel_name("g4_k", header + three, source), header + three, source)
    assert seen[2] == (custom_kernels.mlx_kernel_name("g4_k", *compact), *compact)
    short = ("inline float z0() { return 2.0f; }\n", "b[0] = a[0] * z0();\n")  # g4_two() renamed, a and b kept
    assert seen[3] == (custom_kernels.mlx_kernel_name("g4_k", *short), *short)
    assert len(seen) == 4  # "pruned" is the default form: the cached kernel object serves it
    monkeypatch.setattr(custom_kernels, "backend", lambda: "metal")
    monkeypatch.setattr(mx.fast, "metal_kernel", stand_in, raising=False)
    monkeypatch.delenv(custom_kernels.KERNEL_TEXT_ENV)
    try:
        custom_kernels.get_kernel("g4_k", ("a",), ("b",), (header, source), ("", "cuda"))
    finally:
        custom_kernels.clear_kernel_cache()
    assert seen[4] == (custom_kernels.mlx_kernel_name("g4_k", header, source), header, source)


def test_compact_text_keeps_tokens_lines_and_literals():
    text = (
        "#include <cuda_bf16.h>  // a comment after a directive\n"
        "#define TWICE(v) \\\n    (2 * (v))\n"
        "\n"
        "  /* a block\n     comment */ int x = 1; /* inline */ int y = 2;\n"
        "    const char* s = \"// not a comment /* nor this */\"; char q = '\\'';\n"
        "float f = a/b; // end\n"
    )
    assert dialect.compact_text(text) == (
        "#include <cuda_bf16.h>\n"
        "#define TWICE(v)     (2 * (v))\n"
        "int x = 1;   int y = 2;\n"
        "const char* s = \"// not a comment /* nor this */\"; char q = '\\'';\n"
        "float f = a/b;\n"
    )
    for bad in ("int x; /* open", "const char* s = \"open\nint y;"):
        with pytest.raises(ValueError, match="unterminated"):
            dialect.compact_text(bad)
    # the preprocessor's view: splices first, a comment in a directive is one space, a # after a
    # block comment's line break still starts a directive line
    assert dialect.compact_text("#define A 1 \\\n\nint y;\n") == "#define A 1\nint y;\n"
    assert dialect.compact_text("int a; // note \\\nint hidden;\nint b;\n") == "int a;\nint b;\n"
    assert dialect.compact_text("#define A 1 /* x\ny */ + 2\n") == "#define A 1   + 2\n"
    assert dialect.compact_text("int a; /* x\n */ #define B 1 /* y\n z */ + 2\n") == "int a;\n#define B 1   + 2\n"
    assert dialect.compact_text('const char* s = "ab\\\n  cd";\n') == 'const char* s = "ab  cd";\n'


def test_public_ops_match_references():
    """Whatever the backend, each public op agrees with its reference (exact on CPU)."""
    rng = np.random.default_rng(7)
    x = mx.array(rng.standard_normal((3, 64)).astype(np.float32))
    ids = mx.array(np.array([[0, 2], [1, 0], [2, 1]], dtype=np.int32))
    for op, t in ((qm.q4_0_matvec, qm.Q4_0), (qm.q8_0_matvec, qm.Q8_0)):
        raw = mx.array(qm.random_blocks(rng, t, (9,), 64))
        np.testing.assert_allclose(op(x, raw, 9), qm.matvec_reference(x, raw, t, 9), rtol=1e-5, atol=1e-5)
    raw6 = mx.array(qm.random_blocks(rng, qm.Q6_K, (9,), 256))
    x6 = mx.array(rng.standard_normal((1, 256)).astype(np.float32))
    np.testing.assert_allclose(qm.q6_k_matvec(x6, raw6, 9), qm.matvec_reference(x6, raw6, qm.Q6_K, 9), rtol=1e-5, atol=1e-5)
    for gop, uop, t in ((qm.q4_0_matvec_gather, qm.q4_0_gate_up_gather, qm.Q4_0),
                        (qm.q8_0_matvec_gather, qm.q8_0_gate_up_gather, qm.Q8_0)):  # fmt: skip
        stack = mx.array(qm.random_blocks(rng, t, (3, 10), 64))
        np.testing.assert_allclose(
            gop(x, ids, stack, 10), qm.matvec_gather_reference(x, ids, stack, t, 10), rtol=1e-5, atol=1e-5
        )
        np.testing.assert_allclose(
            uop(x, ids, stack, 5), qm.gate_up_gather_reference(x, ids, stack, t, 5), rtol=1e-5, atol=1e-5
        )


def test_expert_ops_take_lead_dims():
    """The expert ops flatten ids' lead dims into tokens (a decode step passes [B, T, k] ids and
    [B, T, H] rows unreshaped): same values as the [M, k] call, in the caller's shape; x whose
    lead dims match neither ids nor ids' tokens is refused."""
    rng = np.random.default_rng(11)
    x = mx.array(rng.standard_normal((2, 3, 64)).astype(np.float32))
    ids = mx.array(rng.integers(0, 4, (2, 3, 2)).astype(np.int32))
    w = mx.array(rng.random((2, 3, 2)).astype(np.float32))
    stack = mx.array(qm.random_blocks(rng, qm.Q4_0, (4, 10), 64))
    down = mx.array(qm.random_blocks(rng, qm.Q8_0, (4, 64), 32))
    gu = qm.q4_0_gate_up_gather(x, ids, stack, 5)
    assert gu.shape == (2, 3, 2, 5)
    flat = qm.q4_0_gate_up_gather(x.reshape(6, 64), ids.reshape(6, 2), stack, 5)
    np.testing.assert_allclose(gu.reshape(6, 2, 5), flat, rtol=1e-6, atol=1e-6)
    g = qm.q4_0_matvec_gather(x, ids, stack, 10)
    assert g.shape == (2, 3, 2, 10)
    np.testing.assert_allclose(g.reshape(6, 2, 10), qm.q4_0_matvec_gather(x.reshape(6, 64), ids.reshape(6, 2), stack, 10),
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    h = mx.array(rng.standard_normal((2, 3, 2, 32)).astype(np.float32))
    y = qm.q8_0_moe_down(h, ids, w, down, 64)
    assert y.shape == (2, 3, 64)
    want = qm.q8_0_moe_down(h.reshape(6, 2, 32), ids.reshape(6, 2), w.reshape(6, 2), down, 64)
    np.testing.assert_allclose(y.reshape(6, 64), want, rtol=1e-6, atol=1e-6)
    empty = qm.q4_0_gate_up_gather(mx.zeros((0, 64)), mx.zeros((0, 2), mx.int32), stack, 5)
    assert empty.shape == (0, 2, 5)  # no tokens: an empty result, as before lead dims
    with pytest.raises(ValueError, match="lead dims"):
        qm.q4_0_matvec_gather(x.reshape(3, 2, 64), ids, stack, 10)
    with pytest.raises(ValueError, match="moe_down"):
        qm.q8_0_moe_down(mx.ones((2, 3, 32)), ids, w, down, 64)  # a row per token, not per slot


def test_argument_errors():
    raw = mx.array(qm.random_blocks(np.random.default_rng(8), qm.Q4_0, (4,), 64))
    x = mx.zeros((1, 64))
    with pytest.raises(ValueError):
        qm.q4_0_matvec(x, raw, 5)  # wrong N
    with pytest.raises(ValueError):
        qm.q8_0_matvec(x, raw, 4)  # Q4_0 bytes read as Q8_0
    with pytest.raises(TypeError):
        qm.q4_0_matvec(x.astype(mx.int32), raw, 4)
    with pytest.raises(ValueError):
        qm.dequantize(raw, qm.Q6_K, 64)  # K not a multiple of 256
    ids = mx.array(np.zeros((2, 2), dtype=np.int32))
    with pytest.raises(ValueError):
        qm.q4_0_matvec_gather(x, ids, raw.reshape(1, 4, 36), 4)  # x has 1 row, ids 2
    with pytest.raises(ValueError, match="does not hold"):  # an output shape of another size
        qm.launch_dense(x, raw, qm.Q4_0, 4, out_shape=(1, 1, 5))
    with pytest.raises(ValueError, match="one_expert"):  # not the same blocks as [1, 2F, row_bytes]
        qm.gate_up(x, raw, qm.Q4_0, 2, one_expert=raw[None, :2])


def test_launch_plans_cover_every_row():
    for ggml_type in (qm.Q4_0, qm.Q8_0, qm.Q6_K):
        for kind in ("dense", "gather", "gate_up") if ggml_type != qm.Q6_K else ("dense",):
            for which in ("metal", "cuda"):
                for m, n, k in ((1, 21504, 5376), (8, 5376, 21504), (3, 37, 256), (1, 704, 2816)):
                    cfg = qm.default_config(ggml_type, kind, m, n, k, pairs=8, which=which)
                    plan = qm.plan_launch(ggml_type, kind, "bfloat16", m, n, k, 8, config=cfg)
                    tx = plan.threadgroup[0]
                    assert tx == 32 * cfg.simd_groups and plan.grid[0] % tx == 0
                    assert plan.grid[0] // tx * cfg.rows_per_simd * cfg.simd_groups >= n
                    assert plan.grid[1] == (1 if kind == "dense" else m * 8)


def test_dialect_render():
    body = "const int l = $lane; $shared float s[4]; $barrier;"
    metal, cuda = dialect.render(body, "metal"), dialect.render(body, "cuda")
    assert "thread_index_in_simdgroup" in metal and "threadgroup float" in metal
    assert "threadIdx.x & 31u" in cuda and "__shared__ float" in cuda and "__syncthreads()" in cuda
    with pytest.raises(KeyError):
        dialect.render("$laen", "metal")
    with pytest.raises(ValueError):
        dialect.render(body, "vulkan")
    both = dialect.emit(body, "inline float twice(float v) { return 2 * v; }")
    assert set(both) == {"metal", "cuda"} and all("g4_simd_sum" in h for h, _ in both.values())


def test_prune_helpers_keeps_what_the_kernel_reaches():
    header = (
        "#define G4_TWO 2.0f\n"
        "__device__ inline float g4_used(float v) { return g4_inner(v) * G4_TWO; }\n"
        "__device__ inline float g4_inner(float v) { return v + 1.0f; }\n"
        "__device__ inline float g4_inner(int v) { return (float)v; }\n"
        "template <typename U> __device__ inline float g4_unused(float v) { if (v > 0) { return v; } return -v; }\n"
        "struct g4_pair { float a; __device__ float operator[](int i) const { return i ? a : 0.0f; } };\n"
        "__device__ inline float g4_by_struct(g4_pair p) { return p[0]; }\n"
        "__constant__ float g4_table[2] = {1.0f, 2.0f};\n"
        "__device__ inline const char* g4_name() { return \"}{;\"; }\n"
    )
    pruned = dialect.prune_helpers(header, "out[0] = g4_used(x[0]) + g4_table[1];")
    assert pruned == "".join(line + "\n" for i, line in enumerate(header.splitlines()) if i in (0, 1, 2, 3, 5, 7))
    other = dialect.prune_helpers(header, "out[0] = g4_by_struct(p) + g4_name()[0];")
    assert "g4_by_struct(" in other and 'return "}{;"' in other and "struct g4_pair" in other
    assert "g4_used" not in other and "g4_inner" not in other and "g4_unused" not in other


def test_short_names_rename_only_what_the_text_declares():
    header = (
        "#define G4_TWO 2.0f\n"
        "__device__ __forceinline__ float g4_twice(float value, int count) { return value * G4_TWO + count; }\n"
        "struct g4_pair { float first; };\n"
    )
    source = (
        "const int width = x_shape[0] * NSG;\n"  # NSG: a template argument, used before the
        "if (width > 0) { constexpr int NSG = 4; out[0] = g4_twice(x[0], NSG); }\n"  # shadowing
        "g4_pair pair; pair.first = 1.0f; float first = pair.first;\n"
        "const char* label = \"width value\"; out[1] = g4_twice(first, width) + threadIdx.x;\n"
    )
    h, src = dialect.short_names(header, source, ("x", "out"))
    assert len(h) + len(src) < len(header) + len(source)
    for kept in ("x_shape", "NSG", "out[0]", "x[0]", ".first", "G4_TWO", "threadIdx", '"width value"', "g4_pair"):
        assert kept in h + src, kept
    for renamed in ("g4_twice", "value", "count", "width", "pair"):
        assert not re.search(rf"(?<![\w\"]){renamed}(?![\w\"])", h + src.replace('"width value"', "")), renamed
    assert "char* label" in src  # a pointer declaration: not recognised, so kept (a shorter text only)
    helper = re.search(r"float (\w+)\(float", h).group(1)  # the body calls the helper by its new name
    assert src.count(helper + "(") == 2
    # not renamed: a helper without the g4 prefix (it may mean a CUDA or MLX function), a cast's
    # type after `const`, alternative operator words
    h, src = dialect.short_names("__device__ float fmaxf2(float a) { return a; }\n",
                                 "out[0] = fmaxf2((const uint32_t)x[0]) + (not flag_value);\n", ("x", "out"))
    assert "fmaxf2" in h and "fmaxf2" in src and "(const uint32_t)" in src and "flag_value" in src


def test_bf16_bit_helpers():
    v = np.array([1.0, -2.5, 3.14159, 1e-3, 65504.0, 1.00390625], dtype=np.float32)
    back = bf16_to_f32(f32_to_bf16(v))
    np.testing.assert_allclose(back, np.array(mx.array(v).astype(mx.bfloat16).astype(mx.float32)), rtol=0)


def test_registry_lists_every_kernel_with_consistent_cases():
    assert {s.name for s in qm.kernel_specs()} <= {s.name for s in all_kernel_specs()}
    specs = qm.kernel_specs()  # the registry also holds other op families (attention, sampling)
    names = {s.name for s in specs}
    assert {"g4_q4_0_matvec", "g4_q8_0_matvec", "g4_q6_k_matvec", "g4_q4_0_matvec_gather",
            "g4_q8_0_matvec_gather", "g4_q4_0_gate_up_gather", "g4_q8_0_gate_up_gather"} <= names  # fmt: skip
    for spec in specs:
        cases = spec.cases(np.random.default_rng(0))
        assert cases
        for case in cases:
            assert list(case.inputs) == list(spec.input_names)
            assert all(g % t == 0 for g, t in zip(case.grid, case.threadgroup))
            assert [tuple(e.shape) for e in case.expected] == [tuple(s) for s in case.output_shapes]
            # the case's expected output agrees with the MLX reference on the same inputs
            x = case.inputs["x"]
            xm = mx.array(bf16_to_f32(x)).astype(mx.bfloat16) if case.input_dtypes.get("x") == "bfloat16" else mx.array(x)
            ggml_type = {"q4_0": qm.Q4_0, "q8_0": qm.Q8_0, "q6_k": qm.Q6_K}[spec.name.split("_", 1)[1][:4]]
            wq = mx.array(case.inputs["wq"])
            n = case.output_shapes[0][-1]
            if "down_sum" in spec.name:
                ids = mx.array(case.inputs["ids"])
                ref = qm.moe_down_reference(xm.reshape(*ids.shape, -1), ids, mx.array(case.inputs["wts"]), wq,
                                            ggml_type, n)  # fmt: skip
            elif spec.name.startswith("g4_q4_0_gate_up_runs"):  # a dense gate|up: no ids
                ref = qm.gate_up_reference(xm, wq, ggml_type, n)
            elif "gate_up" in spec.name:
                ref = qm.gate_up_gather_reference(xm, mx.array(case.inputs["ids"]), wq, ggml_type, n)
            elif "gather" in spec.name:
                ids = mx.array(case.inputs["ids"])
                xg = xm.reshape(*ids.shape, -1) if x.shape[0] != ids.shape[0] else xm
                ref = qm.matvec_gather_reference(xg, ids, wq, ggml_type, n)
            elif "gelu_mul" in spec.name:  # the product in f32, rounded once, as the kernels do
                mul = case.inputs["mul"]
                mul = bf16_to_f32(mul) if case.input_dtypes.get("mul") == "bfloat16" else mul
                y = qm.matvec_reference(xm.astype(mx.float32), wq, ggml_type, n)
                ref = (qm.gelu_tanh(y) * mx.array(mul.astype(np.float32))).astype(xm.dtype)
            else:
                ref = qm.matvec_reference(xm, wq, ggml_type, n)
            got = np.array(ref.astype(mx.float32)).reshape(case.output_shapes[0])
            ok = np.abs(got - case.expected[0]) <= case.atol + case.rtol * np.abs(case.expected[0])
            assert ok.all(), f"{spec.name} {case.label}"


def test_dense_m1_geometry_override(monkeypatch):
    """GEMMA4_MLX_MATVEC_GEOMETRY changes the dense M = 1 launch only; bad text fails clearly."""
    base = qm.default_config(qm.Q4_0, "dense", 1, 5376, 21504, which="cuda")
    monkeypatch.setenv(qm.DENSE_M1_GEOMETRY_ENV, "rows_per_simd=1,lanes_per_block=1")
    cfg = qm.default_config(qm.Q4_0, "dense", 1, 5376, 21504, which="cuda")
    assert (cfg.rows_per_simd, cfg.lanes_per_block, cfg.simd_groups) == (1, 1, base.simd_groups)
    assert qm.default_config(qm.Q4_0, "dense", 2, 5376, 21504, which="cuda").rows_per_simd == 4
    assert qm.default_config(qm.Q4_0, "gather", 1, 5376, 21504, which="cuda").rows_per_simd == 4
    plan = qm.plan_launch(qm.Q4_0, "dense", "bfloat16", 1, 5376, 21504)
    assert dict(plan.template)["R"] == 1 and dict(plan.template)["LPB"] == 1
    monkeypatch.setenv(qm.DENSE_M1_GEOMETRY_ENV, "lanes_per_block=3")
    with pytest.raises(ValueError, match="lanes_per_block must be"):
        qm.default_config(qm.Q4_0, "dense", 1, 5376, 21504, which="cuda")


def test_in_place_decode_plans(monkeypatch):
    """in_place selects the dense in-place decode kernel (opt-in); other kinds and Q6_K refuse it."""
    plan = qm.plan_launch(qm.Q4_0, "dense", "bfloat16", 1, 5376, 21504, config=qm.KernelConfig(2, 2, 2, 1))
    assert plan.in_place and not qm.plan_launch(qm.Q4_0, "dense", "bfloat16", 1, 5376, 21504).in_place
    assert qm._kernel_def(qm.Q8_0, "dense", True).name == "g4_q8_0_matvec_inplace"
    for ggml_type, kind in ((qm.Q6_K, "dense"), (qm.Q4_0, "gather")):
        with pytest.raises(ValueError, match="in_place"):
            qm.plan_launch(ggml_type, kind, "bfloat16", 1, 64, 256, 8, config=qm.KernelConfig(in_place=1))
    monkeypatch.setenv(qm.DENSE_M1_GEOMETRY_ENV, "in_place=1,lanes_per_block=1")
    assert qm.default_config(qm.Q4_0, "dense", 1, 5376, 21504, which="cuda").in_place == 1


def test_k_split_plans(monkeypatch):
    """k_split > 1 selects the dense split-K kernel: a threadgroup covers R * NSG / k_split rows,
    KS is a template constant; it must divide simd_groups; other kinds and Q6_K refuse it; CUDA's
    M = 1 default uses it below SPLIT_K_MAX_ROWS rows."""
    plan = qm.plan_launch(qm.Q4_0, "dense", "bfloat16", 1, 5376, 21504, config=qm.KernelConfig(2, 4, 2, 1, 4))
    assert plan.k_split and plan.in_place and ("KS", 4) in plan.template
    assert plan.grid == (5376 // 2 * 128, 1, 1) and plan.threadgroup == (128, 1, 1)
    assert qm._kernel_def(qm.Q8_0, "dense", False, True).name == "g4_q8_0_matvec_ksplit"
    gu = qm.plan_launch(qm.Q4_0, "gate_up", "bfloat16", 1, 21504, 5376, 1, config=qm.gate_up_split_config())
    assert gu.k_split and ("KS", 4) in gu.template and gu.grid == (21504 // 2 * 128, 1, 1)
    unsplit = qm.plan_launch(qm.Q4_0, "dense", "bfloat16", 1, 64, 256, config=qm.KernelConfig(4, 2, 2))
    assert not unsplit.k_split and not any(name == "KS" for name, _ in unsplit.template)
    with pytest.raises(ValueError, match="k_split"):
        qm.KernelConfig(2, 2, 2, 0, 4)
    for ggml_type, kind in ((qm.Q6_K, "dense"), (qm.Q4_0, "gather")):
        with pytest.raises(ValueError, match="k_split"):
            qm.plan_launch(ggml_type, kind, "bfloat16", 1, 64, 256, 8, config=qm.KernelConfig(4, 2, 2, 0, 2))
    cfg = lambda t, n, which="cuda", m=1: qm.default_config(t, "dense", m, n, 5376, which=which)  # noqa: E731
    assert (cfg(qm.Q4_0, 5376).k_split, cfg(qm.Q4_0, 5376).simd_groups) == (4, 4)  # decode projections
    assert cfg(qm.Q8_0, 37).k_split == 4 and cfg(qm.Q8_0, 262144).k_split == 1  # not the tied head
    assert cfg(qm.Q6_K, 5376).k_split == cfg(qm.Q4_0, 5376, "metal").k_split == cfg(qm.Q4_0, 5376, m=2).k_split == 1
    monkeypatch.setenv(qm.DENSE_M1_GEOMETRY_ENV, "simd_groups=8,k_split=4,in_place=1")
    assert qm.default_config(qm.Q4_0, "dense", 1, 5376, 21504, which="cuda").k_split == 4
    q6 = qm.default_config(qm.Q6_K, "dense", 1, 262144, 5376, which="cuda")  # a Q6_K head ignores both
    assert (q6.k_split, q6.in_place, q6.simd_groups) == (1, 0, 8)
    # fields the override leaves out adapt to the ones it names, for every shape of a model
    for text, split, head in (("simd_groups=2", (2, 2), (2, 1)), ("simd_groups=1,rows_per_simd=4", (1, 1), (1, 1)),
                              ("k_split=4", (4, 4), (4, 4)), ("k_split=2", (4, 2), (2, 2))):
        monkeypatch.setenv(qm.DENSE_M1_GEOMETRY_ENV, text)
        for (ggml_type, n), want in (((qm.Q8_0, 5376), split), ((qm.Q4_0, 262144), head)):
            cfg = qm.default_config(ggml_type, "dense", 1, n, 5376, which="cuda")
            assert (cfg.simd_groups, cfg.k_split) == want, (text, n)
        q6 = qm.default_config(qm.Q6_K, "dense", 1, 262144, 5376, which="cuda")
        assert q6.k_split == 1 and qm.plan_launch(qm.Q6_K, "dense", "bfloat16", 1, 262144, 5376, config=q6)
    monkeypatch.setenv(qm.DENSE_M1_GEOMETRY_ENV, "simd_groups=2,k_split=4")  # named both, inconsistent
    with pytest.raises(ValueError, match="GEMMA4_MLX_MATVEC_GEOMETRY=simd_groups=2,k_split=4: k_split must"):
        qm.default_config(qm.Q4_0, "dense", 1, 5376, 21504, which="cuda")


def test_gate_up_m1_defaults():
    """A dense FFN's fused gate|up (one expert) at M = 1: 8 warps, 2 stages; a token's 8 experts and
    M >= 2 keep 4 warps, 4 stages."""
    one = qm.default_stream_config("gate_up", 1, 21504, 5376, pairs=1)
    assert (one.warps, one.stages) == (8, 2) and one.shared_bytes() <= 48 * 1024
    assert qm.plan_stream("gate_up", 1, 21504, 5376, 1).threadgroup == (256, 1, 1)
    assert (qm.default_stream_config("gate_up", 1, 704, 2816, pairs=8).warps,
            qm.default_stream_config("gate_up", 2, 21504, 5376, pairs=2).warps) == (4, 4)  # fmt: skip


def test_gate_up_m1_geometry_override(monkeypatch):
    monkeypatch.setenv(qm.GATE_UP_M1_GEOMETRY_ENV, "warps=2,stages=6,rotate=1")
    cfg = qm.default_stream_config("gate_up", 1, 21504, 5376)
    assert (cfg.warps, cfg.stages, cfg.group_blocks, cfg.tiles, cfg.rotate) == (2, 6, 8, 1, 1)
    assert qm.default_stream_config("gate_up", 2, 21504, 5376).warps == 4
    assert qm.default_stream_config("dense", 1, 21504, 5376).warps == 4
    monkeypatch.setenv(qm.GATE_UP_M1_GEOMETRY_ENV, "warps=8,stages=8,group_blocks=64")
    with pytest.raises(ValueError, match="shared memory"):
        qm.default_stream_config("gate_up", 1, 21504, 5376)


def test_matvec_gelu_mul_op_and_routing(monkeypatch):
    """quant_matvec_gelu_mul: gelu_tanh(x W^T) * mul (checked against float64 numpy); bad mul shapes
    and dtypes are errors. On CUDA and Metal (faked, launches stubbed) it is one launch only with its
    family on (a CUDA default, opt-in on Metal, off when named in KERNELS_OFF) and where quant_matvec
    would take the f32-FMA kernel: E4B's per-layer-input gate at one token (Q4_0) or 1..8 (Q8_0;
    Metal: both), not on a runs-kernel shape, 2..8 Q4_0 tokens on CUDA (runs16m), or more than 8 rows."""
    rng = np.random.default_rng(5)
    n, k = 7, 96
    raw = qm.random_blocks(rng, qm.Q8_0, (n,), k)
    blocks = mx.array(raw)
    x64, mul64 = rng.standard_normal((2, k)), rng.standard_normal((2, n))
    x, mul = mx.array(x64.astype(np.float32)), mx.array(mul64.astype(np.float32))
    y = x64.astype(np.float32).astype(np.float64) @ qm.dequantize_f64(raw, qm.Q8_0).T
    want = 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y**3))) * mul64.astype(np.float32)
    got = np.array(qm.quant_matvec_gelu_mul(x, blocks, qm.Q8_0, n, mul))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    for bad in (mul[:1], mul.astype(mx.bfloat16), mx.zeros((2, n + 1))):
        with pytest.raises(ValueError, match="mul must be"):
            qm.quant_matvec_gelu_mul(x, blocks, qm.Q8_0, n, bad)
    with pytest.raises(ValueError, match="Q4_0 or Q8_0"):
        qm.launch_dense_gelu_mul(mx.zeros((1, 256)), mx.zeros((4, 210), mx.uint8), qm.Q6_K, 4, mx.zeros((1, 4)))
    with pytest.raises(ValueError, match="elements"):
        qm.launch_dense_gelu_mul(x, blocks, qm.Q8_0, n, mul[:1])

    for env in (qm.RUNS_GEOMETRY_ENV, qm.RUNS_M_GEOMETRY_ENV, custom_kernels.KERNELS_ENV, custom_kernels.KERNELS_OFF_ENV):
        monkeypatch.delenv(env, raising=False)
    routed = []
    for name in ("launch_dense_gelu_mul", "launch_dense_runs", "launch_dense_runs_m", "launch_dense_stream",
                 "launch_dense_mma", "launch_dense"):  # fmt: skip
        monkeypatch.setattr(qm, name, lambda *a, _name=name, **kw: routed.append(_name) or mx.zeros(kw["out_shape"]))
    monkeypatch.setattr(qm._tiles, "launch_dense_tiles",
                        lambda *a, **kw: routed.append("launch_dense_tiles") or mx.zeros(kw["out_shape"]))  # fmt: skip
    # (x shape, N, type) -> fused on (CUDA, Metal)
    cases = {((1, 1, 2560), 256, qm.Q4_0): (True, True), ((1, 2560), 256, qm.Q8_0): (True, True),  # E4B's gate
             ((3, 2560), 256, qm.Q4_0): (False, True),  # 2..8 Q4_0 tokens: runs16m on CUDA
             ((8, 2560), 256, qm.Q8_0): (True, True),
             ((1, 5376), 21504, qm.Q4_0): (False, True),  # a tiles-kernel shape on CUDA
             ((9, 2560), 256, qm.Q4_0): (False, False)}  # more than 8 rows: the reference  # fmt: skip
    for which in ("cuda", "metal"):
        monkeypatch.setattr(qm, "backend", lambda which=which: which)
        monkeypatch.setattr(custom_kernels, "backend", lambda which=which: which)
        for setting in ("off", "default", "opted in"):  # a CUDA default since session 18, opt-in on Metal
            monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, "matvec_gelu_mul" if setting == "off" else "")
            monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "matvec_gelu_mul" if setting == "opted in" else "")
            family_on = setting == "opted in" or (setting == "default" and which == "cuda")
            for (shape, n, ggml_type), fused in cases.items():
                routed.clear()
                xb = mx.zeros(shape, mx.bfloat16)
                wb = mx.zeros((n, qm.row_bytes(ggml_type, shape[-1])), mx.uint8)
                out = qm.quant_matvec_gelu_mul(xb, wb, ggml_type, n, mx.zeros((*shape[:-1], n), mx.bfloat16))
                assert out.shape == (*shape[:-1], n)
                want = fused[which == "metal"] and family_on
                assert (routed[:1] == ["launch_dense_gelu_mul"]) == want, (which, shape, n, setting, routed)
