"""GPU tests: every quant_matvec kernel (Metal or CUDA, whichever this MLX build runs) against a
float64 numpy result on the same GGUF blocks. Outputs are poisoned with NaN before each launch, so
an element the kernel fails to write fails the test. Run with ``pytest -m gpu``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import custom_kernels
from custom_kernels import quant_matvec as qm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(custom_kernels.backend() == "cpu", reason="no GPU backend (CPU-only MLX build)"),
]

NAN = float("nan")
CONFIGS = [None, qm.KernelConfig(4, 2, 2), qm.KernelConfig(4, 4, 4), qm.KernelConfig(2, 1, 1),
           qm.KernelConfig(3, 2, 2), qm.KernelConfig(8, 1, 4)]  # fmt: skip  (None = dispatch default)
IN_PLACE_CONFIGS = [qm.KernelConfig(2, 2, 2, 1), qm.KernelConfig(4, 2, 2, 1), qm.KernelConfig(2, 2, 1, 1),
                    qm.KernelConfig(2, 2, 4, 1)]  # fmt: skip
K_SPLIT_CONFIGS = [qm.KernelConfig(2, 4, 2, 0, 4), qm.KernelConfig(2, 4, 2, 1, 4), qm.KernelConfig(2, 2, 2, 0, 2),
                   qm.KernelConfig(2, 8, 2, 1, 2), qm.KernelConfig(5, 8, 1, 0, 8)]  # fmt: skip


def _acts(rng, shape, dtype):
    x = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    return x, np.array(x.astype(mx.float32)).astype(np.float64)


def _check(out: mx.array, want: np.ndarray, bound: np.ndarray, dtype, what: str) -> None:
    got = np.array(out.astype(mx.float32)).astype(np.float64)
    assert not np.isnan(got).any(), f"{what}: {int(np.isnan(got).sum())} outputs never written"
    rel = float((np.abs(got - want) / bound).max())
    limit = 1e-5 if dtype == mx.float32 else 2**-8  # f32 accumulation; bf16 output rounding
    assert rel <= limit, f"{what}: relative error {rel:.3g} > {limit:g}"


def _gelu_times(gu: np.ndarray, mag: np.ndarray, f: int) -> tuple[np.ndarray, np.ndarray]:
    """gelu_tanh(gate) * up from [.., 2F] float64 products, and the error bound from |W| @ |x|."""
    g, u = gu[..., :f], gu[..., f:]
    want = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * u
    return want, (np.abs(g) + mag[..., :f]) * (np.abs(u) + mag[..., f:])


def _expert_products(w64: np.ndarray, rows: np.ndarray, ids: np.ndarray, per_slot: bool):
    """(W[ids[m, s]] @ row(m, s), |W| @ |row|) for every (token, slot) -> two [M, k, N] float64
    arrays; row(m, s) is rows[m * k + s] per slot, else rows[m]. One BLAS product per expert
    stack instead of materializing W[ids] ([M, k, N, K] floats)."""
    m, slots = ids.shape
    full = np.matmul(w64, rows.T)  # [E, N, rows]
    mag = np.matmul(np.abs(w64), np.abs(rows).T)
    r = np.arange(m * slots).reshape(m, slots) if per_slot else np.repeat(np.arange(m)[:, None], slots, 1)
    return full[ids, :, r], mag[ids, :, r]


@pytest.mark.parametrize("fmt,k", [("q4_0", 1056), ("q8_0", 1056), ("q6_k", 1280)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_dense_kernels(fmt, k, dtype):
    """Dispatch geometry at M = 1..8, N = 37 and 1001 (each template instantiation is one NVRTC /
    Metal compile, so other geometries are covered by test_dense_geometries)."""
    ggml_type = {"q4_0": qm.Q4_0, "q8_0": qm.Q8_0, "q6_k": qm.Q6_K}[fmt]
    rng = np.random.default_rng(10)
    for n in (37, 1001):
        raw = qm.random_blocks(rng, ggml_type, (n,), k)
        w64 = qm.dequantize_f64(raw, ggml_type)
        blocks = mx.array(raw)
        for m in range(1, 9) if dtype == mx.float32 else (1, 3, 8):
            x, x64 = _acts(rng, (m, k), dtype)
            out = qm.launch_dense(x, blocks, ggml_type, n, init_value=NAN)
            assert out.dtype == dtype and out.shape == (m, n)
            _check(out, x64 @ w64.T, np.abs(x64) @ np.abs(w64).T, dtype, f"{fmt} M={m} N={n} K={k}")
            # a second run agrees bit for bit; the public op (dispatch) is as accurate
            assert mx.array_equal(qm.launch_dense(x, blocks, ggml_type, n), out).item()
            _check(qm.quant_matvec(x, blocks, ggml_type, n), x64 @ w64.T, np.abs(x64) @ np.abs(w64).T, dtype, "dispatch")


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_dense_gelu_mul_kernels(fmt, dtype, monkeypatch):
    """gelu_tanh(x W^T) * mul in one launch (family matvec_gelu_mul): the dispatch geometry (split K
    on CUDA), a plain one and a split one, at E4B's per-layer-input gate shape (256 x 2560) and an
    odd N, M = 1, 3, 8; poisoned outputs; the public op with the family on is as accurate, and takes
    the kernel exactly where quant_matvec's route is the f32-FMA kernel (one Q4_0 token on CUDA)."""
    ggml_type = {"q4_0": qm.Q4_0, "q8_0": qm.Q8_0}[fmt]
    monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "matvec_gelu_mul")
    launch, launched = qm.launch_dense_gelu_mul, []
    monkeypatch.setattr(qm, "launch_dense_gelu_mul", lambda *a, **kw: launched.append(1) or launch(*a, **kw))
    rng = np.random.default_rng(17)
    for n, k in ((256, 2560), (37, 1056)):
        raw = qm.random_blocks(rng, ggml_type, (n,), k)
        w64 = qm.dequantize_f64(raw, ggml_type)
        blocks = mx.array(raw)
        for m in (1, 3, 8):
            x, x64 = _acts(rng, (m, k), dtype)
            mul, mul64 = _acts(rng, (m, n), dtype)
            y = x64 @ w64.T
            want = 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y**3))) * mul64
            bound = (np.abs(y) + np.abs(x64) @ np.abs(w64).T) * np.abs(mul64)
            for cfg in (None, qm.KernelConfig(4, 2, 2), qm.KernelConfig(2, 4, 2, 0, 4)):
                out = launch(x, blocks, ggml_type, n, mul, cfg, init_value=NAN)
                assert out.dtype == dtype and out.shape == (m, n)
                _check(out, want, bound, dtype, f"{fmt} M={m} N={n} K={k} {cfg}")
            launched.clear()
            _check(qm.quant_matvec_gelu_mul(x, blocks, ggml_type, n, mul), want, bound, dtype, "dispatch")
            assert bool(launched) == (qm._dense_route(x, ggml_type, n) == "fma"), (fmt, m, n, dtype)


@pytest.mark.parametrize("fmt,k", [("q4_0", 5376), ("q8_0", 1056), ("q6_k", 1280)])
def test_dense_geometries(fmt, k):
    """Other launch geometries (rows per SIMD group, SIMD groups, lanes per block), f32, M = 1 and 7;
    the in-place decode and split-K variants (Q4_0 / Q8_0) at several geometries in f32 and bf16."""
    ggml_type = {"q4_0": qm.Q4_0, "q8_0": qm.Q8_0, "q6_k": qm.Q6_K}[fmt]
    rng = np.random.default_rng(15)
    n = 1003
    raw = qm.random_blocks(rng, ggml_type, (n,), k)
    w64 = qm.dequantize_f64(raw, ggml_type)
    blocks = mx.array(raw)
    in_place = [] if ggml_type == qm.Q6_K else IN_PLACE_CONFIGS + K_SPLIT_CONFIGS
    for dtype, configs in ((mx.float32, CONFIGS[1:] + in_place), (mx.bfloat16, in_place)):
        for m in (1, 7):
            x, x64 = _acts(rng, (m, k), dtype)
            for cfg in configs:
                out = qm.launch_dense(x, blocks, ggml_type, n, config=cfg, init_value=NAN)
                _check(out, x64 @ w64.T, np.abs(x64) @ np.abs(w64).T, dtype, f"{fmt} M={m} N={n} K={k} {cfg}")


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("per_slot", [False, True])
def test_gather_kernels(fmt, dtype, per_slot):
    ggml_type = {"q4_0": qm.Q4_0, "q8_0": qm.Q8_0}[fmt]
    rng = np.random.default_rng(11)
    experts, slots = 16, 8
    for n, k in ((1408, 2816), (2816, 704), (37, 96)):  # 26B-A4B gate_up / down widths, odd tail
        raw = qm.random_blocks(rng, ggml_type, (experts, n), k)
        w64 = qm.dequantize_f64(raw, ggml_type)
        blocks = mx.array(raw)
        for m in (1, 3, 8):
            ids = np.stack([rng.permutation(experts)[:slots] for _ in range(m)]).astype(np.int32)
            x, x64 = _acts(rng, (m, slots, k) if per_slot else (m, k), dtype)
            want, bound = _expert_products(w64, x64.reshape(-1, k), ids, per_slot)
            for cfg in CONFIGS[:2] if m == 1 else CONFIGS[:1]:
                out = qm.launch_gather(x, mx.array(ids), blocks, ggml_type, n, config=cfg, init_value=NAN)
                assert out.shape == (m, slots, n) and out.dtype == dtype
                _check(out, want, bound, dtype, f"{fmt} gather M={m} N={n} K={k} {cfg}")


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gate_up_kernels(fmt, dtype):
    ggml_type = {"q4_0": qm.Q4_0, "q8_0": qm.Q8_0}[fmt]
    rng = np.random.default_rng(12)
    experts, slots = 16, 8
    for f, k in ((704, 2816), (19, 160)):
        raw = qm.random_blocks(rng, ggml_type, (experts, 2 * f), k)
        w64 = qm.dequantize_f64(raw, ggml_type)
        blocks = mx.array(raw)
        for m in (1, 2, 8):
            ids = np.stack([rng.permutation(experts)[:slots] for _ in range(m)]).astype(np.int32)
            x, x64 = _acts(rng, (m, k), dtype)
            want, bound = _gelu_times(*_expert_products(w64, x64, ids, False), f)
            split = [qm.KernelConfig(2, 4, 2, 0, 4), qm.KernelConfig(1, 8, 1, 0, 2)]
            for cfg in CONFIGS[:2] + split if m == 1 else CONFIGS[:1] + split[:1]:
                out = qm.launch_gate_up(x, mx.array(ids), blocks, ggml_type, f, config=cfg, init_value=NAN)
                assert out.shape == (m, slots, f) and out.dtype == dtype
                _check(out, want, bound, dtype, f"{fmt} gate_up M={m} F={f} K={k} {cfg}")


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_dense_gate_up_op(fmt, dtype):
    """qm.gate_up (a dense MLP's fused gate|up) at M = 1..8: at M = 1 the runs kernel for bf16 Q4_0
    with K a multiple of 256 (family gate_up_runs), else the split-K gate/up kernel with one expert
    (family gate_up_split)."""
    ggml_type = {"q4_0": qm.Q4_0, "q8_0": qm.Q8_0}[fmt]
    rng = np.random.default_rng(31)
    for f, k in ((1001, 1056), (21, 5376)):
        raw = qm.random_blocks(rng, ggml_type, (2 * f,), k)
        w64 = qm.dequantize_f64(raw, ggml_type)
        for m in range(1, 9):
            x, x64 = _acts(rng, (m, k), dtype)
            want, bound = _gelu_times(x64 @ w64.T, np.abs(x64) @ np.abs(w64).T, f)
            out = qm.gate_up(x, mx.array(raw), ggml_type, f)
            assert out.shape == (m, f) and out.dtype == dtype
            _check(out, want, bound, dtype, f"{fmt} dense gate_up M={m} F={f} K={k}")


def test_gather_invalid_expert_gives_nan():
    rng = np.random.default_rng(13)
    blocks = mx.array(qm.random_blocks(rng, qm.Q4_0, (4, 40), 64))
    x = mx.array(rng.standard_normal((1, 64)).astype(np.float32))
    ids = mx.array(np.array([[1, 7, -1]], dtype=np.int32))  # 7 and -1 are not experts
    out = np.array(qm.launch_gather(x, ids, blocks, qm.Q4_0, 40, init_value=0.0))
    assert np.isfinite(out[0, 0]).all() and np.isnan(out[0, 1:]).all()


def test_dispatch_uses_kernel_and_reference_switch(monkeypatch):
    rng = np.random.default_rng(14)
    raw = qm.random_blocks(rng, qm.Q8_0, (300,), 512)
    w64 = qm.dequantize_f64(raw, qm.Q8_0)
    x, x64 = _acts(rng, (2, 4, 512), mx.float32)  # M = 8 rows in [2, 4]
    want, bound = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    kernel = qm.q8_0_matvec(x, mx.array(raw), 300)
    _check(kernel, want, bound, mx.float32, "dispatch")
    monkeypatch.setenv(custom_kernels.KERNELS_ENV, "reference")
    reference = qm.q8_0_matvec(x, mx.array(raw), 300)
    assert kernel.shape == reference.shape == (2, 4, 300)
    # MLX's CUDA f32 matmul runs on TF32 tensor cores (seen on the H200: 7e-4 relative), so on
    # CUDA the reference path is only accurate to ~2^-10; the kernel is the accurate one.
    err = np.abs(np.array(reference).astype(np.float64) - want) / bound
    assert err.max() <= (2**-9 if custom_kernels.backend() == "cuda" else 1e-5)


@pytest.mark.skipif(custom_kernels.backend() != "cuda", reason="CUDA tensor-core kernel")
def test_q4_0_mma_kernel():
    """The CUDA tensor-core Q4_0 kernel (bf16 activations): M = 1..8, odd N, its geometries."""
    rng = np.random.default_rng(16)
    for n, k in ((1001, 1056), (70, 5376)):
        raw = qm.random_blocks(rng, qm.Q4_0, (n,), k)
        w64 = qm.dequantize_f64(raw, qm.Q4_0)
        blocks = mx.array(raw)
        for m in range(1, 9):
            x, x64 = _acts(rng, (m, k), mx.bfloat16)
            want, bound = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
            for cfg in (None, qm.MmaConfig(1, 1), qm.MmaConfig(4, 2)) if m in (2, 8) else (None,):
                out = qm.launch_dense_mma(x, blocks, n, config=cfg, init_value=NAN)
                assert out.shape == (m, n) and out.dtype == mx.bfloat16
                _check(out, want, bound, mx.bfloat16, f"q4_0 mma M={m} N={n} K={k} {cfg}")
                # f32 accumulation of exact products: agrees with the f32 FMA kernel to f32 rounding
                fma = qm.launch_dense(x, blocks, qm.Q4_0, n).astype(mx.float32)
                assert mx.allclose(out.astype(mx.float32), fma, rtol=2**-7, atol=1e-6 * float(bound.max())).item()


@pytest.mark.skipif(custom_kernels.backend() != "cuda", reason="CUDA stream kernels (cp.async + tensor cores)")
def test_q4_0_stream_dense_kernel():
    """The CUDA stream Q4_0 kernel (bf16): M = 1..8, odd N, 16/8/4-byte copies (K = 5376, 384,
    704: the last has a partial group of 8 blocks), other geometries, and a weight view whose base
    is not 16-byte aligned (2-byte copy fallback); agrees with the f32-FMA kernel."""
    rng = np.random.default_rng(17)
    for n, k in ((1001, 5376), (70, 704), (37, 384)):
        raw = qm.random_blocks(rng, qm.Q4_0, (n,), k)
        w64 = qm.dequantize_f64(raw, qm.Q4_0)
        blocks = mx.array(raw)
        for m in range(1, 9) if k == 5376 else (1, 8):  # each (M, geometry) is one NVRTC compile
            x, x64 = _acts(rng, (m, k), mx.bfloat16)
            want, bound = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
            cfgs = (None, qm.StreamConfig(2, 2, 3), qm.StreamConfig(1, 1, 2, 64), qm.StreamConfig(1, 2, 2, 32),
                    qm.StreamConfig(1, 4, 2, 16), qm.StreamConfig(1, 8, 2), qm.StreamConfig(1, 4, 4, 8, True),
                    qm.StreamConfig(1, 2, 2, 32, True)) if m in (1, 8) and k == 5376 else (None,)  # fmt: skip
            for cfg in cfgs:
                out = qm.launch_dense_stream(x, blocks, n, config=cfg, init_value=NAN)
                assert out.shape == (m, n) and out.dtype == mx.bfloat16
                _check(out, want, bound, mx.bfloat16, f"q4_0 stream M={m} N={n} K={k} {cfg}")
            fma = qm.launch_dense(x, blocks, qm.Q4_0, n).astype(mx.float32)
            assert mx.allclose(out.astype(mx.float32), fma, rtol=2**-7, atol=1e-6 * float(bound.max())).item()
    # a view 2 bytes into a flat buffer: the kernel sees a pointer that is only 2-byte aligned
    n, k = 45, 1024
    raw = qm.random_blocks(rng, qm.Q4_0, (n,), k)
    flat = mx.array(np.concatenate([np.zeros(2, np.uint8), raw.reshape(-1)]))
    view = flat[2:].reshape(n, -1)
    w64 = qm.dequantize_f64(raw, qm.Q4_0)
    x, x64 = _acts(rng, (1, k), mx.bfloat16)
    out = qm.launch_dense_stream(x, view, n, init_value=NAN)
    _check(out, x64 @ w64.T, np.abs(x64) @ np.abs(w64).T, mx.bfloat16, "q4_0 stream, unaligned view")


@pytest.mark.skipif(custom_kernels.backend() != "cuda", reason="CUDA stream kernels (cp.async + tensor cores)")
@pytest.mark.parametrize("per_slot", [False, True])
def test_q4_0_stream_expert_kernels(per_slot):
    """Stream gather (26B-A4B down: K = 704, 4-byte copies) and fused gate/up (K = 2816, 16-byte
    copies) vs float64, M = 1..3 tokens x 8 slots, an odd tail, an invalid expert id -> NaN."""
    rng = np.random.default_rng(18)
    experts, slots = 16, 8
    for n, k in ((2816, 704), (1408, 2816), (37, 320)):
        raw = qm.random_blocks(rng, qm.Q4_0, (experts, n), k)
        w64 = qm.dequantize_f64(raw, qm.Q4_0)
        blocks = mx.array(raw)
        for m in (1, 3):
            ids = np.stack([rng.permutation(experts)[:slots] for _ in range(m)]).astype(np.int32)
            x, x64 = _acts(rng, (m, slots, k) if per_slot else (m, k), mx.bfloat16)
            want, bound = _expert_products(w64, x64.reshape(-1, k), ids, per_slot)
            out = qm.launch_gather_stream(x, mx.array(ids), blocks, n, init_value=NAN)
            assert out.shape == (m, slots, n) and out.dtype == mx.bfloat16
            _check(out, want, bound, mx.bfloat16, f"q4_0 stream gather M={m} N={n} K={k}")
            if per_slot or n % 2:
                continue
            f = n // 2
            gu_want, gu_bound = _gelu_times(want, bound, f)
            for cfg in (None, qm.StreamConfig(2, 2, 3), qm.StreamConfig(1, 2, 2, 32)):
                out = qm.launch_gate_up_stream(x, mx.array(ids), blocks, f, config=cfg, init_value=NAN)
                assert out.shape == (m, slots, f)
                _check(out, gu_want, gu_bound, mx.bfloat16, f"stream gate_up M={m} F={f} {cfg}")
    ids = mx.array(np.array([[1, 99, -1]], dtype=np.int32))
    x = mx.array(rng.standard_normal((1, 704)).astype(np.float32)).astype(mx.bfloat16)
    stack = mx.array(qm.random_blocks(rng, qm.Q4_0, (4, 40), 704))
    out = np.array(qm.launch_gather_stream(x, ids, stack, 40, init_value=0.0).astype(mx.float32))
    assert np.isfinite(out[0, 0]).all() and np.isnan(out[0, 1:]).all()
    out = np.array(qm.launch_gate_up_stream(x, ids, stack, 20, init_value=0.0).astype(mx.float32))
    assert np.isfinite(out[0, 0]).all() and np.isnan(out[0, 1:]).all()


@pytest.mark.skipif(custom_kernels.backend() != "cuda", reason="CUDA stream kernels (cp.async + tensor cores)")
def test_q4_0_stream_down_sum_kernel():
    """Fused MoE down projection + router-weighted slot sum (26B-A4B: K = 704, N = 2816, 8 of 16
    experts), M = 1..3 tokens, other geometries, odd N; an invalid expert makes its token NaN."""
    rng = np.random.default_rng(20)
    experts, slots = 16, 8
    for n, k in ((2816, 704), (37, 1024)):
        raw = qm.random_blocks(rng, qm.Q4_0, (experts, n), k)
        w64 = qm.dequantize_f64(raw, qm.Q4_0)
        blocks = mx.array(raw)
        for m in (1, 3):
            ids = np.stack([rng.permutation(experts)[:slots] for _ in range(m)]).astype(np.int32)
            wts = rng.random((m, slots)).astype(np.float32)
            x, x64 = _acts(rng, (m, slots, k), mx.bfloat16)
            per, mag = _expert_products(w64, x64.reshape(-1, k), ids, True)  # [M, k, N]
            want, bound = np.einsum("ms,msn->mn", wts, per), np.einsum("ms,msn->mn", wts, mag)
            for cfg in (None, qm.StreamConfig(1, 4, 4), qm.StreamConfig(2, 2, 3), qm.StreamConfig(1, 4, 2, 16),
                        qm.StreamConfig(1, 8, 2, 8, True)):  # fmt: skip
                out = qm.launch_down_sum_stream(x, mx.array(ids), mx.array(wts), blocks, n, config=cfg, init_value=NAN)
                assert out.shape == (m, n) and out.dtype == mx.bfloat16
                _check(out, want, bound, mx.bfloat16, f"stream down_sum M={m} N={n} K={k} {cfg}")
    ids = mx.array(np.array([[1, 2], [3, 99]], dtype=np.int32))
    x = mx.array(rng.standard_normal((2, 2, 704)).astype(np.float32)).astype(mx.bfloat16)
    out = np.array(qm.launch_down_sum_stream(x, ids, mx.ones((2, 2)), mx.array(qm.random_blocks(rng, qm.Q4_0, (4, 40), 704)),
                                             40, init_value=0.0).astype(mx.float32))  # fmt: skip
    assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()


@pytest.mark.skipif(custom_kernels.backend() != "cuda", reason="CUDA stream kernels (cp.async + tensor cores)")
def test_stream_dispatch(monkeypatch):
    """With STREAM_KERNELS on, the public Q4_0 ops (dense, gathered, gate/up, moe_down) use the
    stream kernels for bf16 and stay as accurate; f32 activations keep the FMA kernel."""
    monkeypatch.setattr(qm, "STREAM_KERNELS", True)
    monkeypatch.setattr(qm, "STREAM_MIN_ROWS", 1)
    rng = np.random.default_rng(21)
    raw = qm.random_blocks(rng, qm.Q4_0, (300,), 512)
    w64 = qm.dequantize_f64(raw, qm.Q4_0)
    for dtype in (mx.bfloat16, mx.float32):
        x, x64 = _acts(rng, (2, 3, 512), dtype)
        _check(qm.q4_0_matvec(x, mx.array(raw), 300), x64 @ w64.T, np.abs(x64) @ np.abs(w64).T, dtype, "dispatch")
    stack = qm.random_blocks(rng, qm.Q4_0, (6, 40), 512)
    s64 = qm.dequantize_f64(stack, qm.Q4_0)
    ids = np.array([[0, 5], [2, 1]], dtype=np.int32)
    x, x64 = _acts(rng, (2, 512), mx.bfloat16)
    want, bound = _expert_products(s64, x64, ids, False)
    _check(qm.q4_0_matvec_gather(x, mx.array(ids), mx.array(stack), 40), want, bound, mx.bfloat16, "gather dispatch")
    _check(qm.q4_0_gate_up_gather(x, mx.array(ids), mx.array(stack), 20), *_gelu_times(want, bound, 20),
           mx.bfloat16, "gate_up dispatch")  # fmt: skip
    xs, xs64 = _acts(rng, (2, 2, 512), mx.bfloat16)
    wts = np.array([[0.25, 0.75], [0.5, 0.5]], dtype=np.float32)
    per, mag = _expert_products(s64, xs64.reshape(-1, 512), ids, True)
    _check(qm.q4_0_moe_down(xs, mx.array(ids), mx.array(wts), mx.array(stack), 40), np.einsum("ms,msn->mn", wts, per),
           np.einsum("ms,msn->mn", wts, mag), mx.bfloat16, "moe_down dispatch")  # fmt: skip


@pytest.mark.parametrize("ggml_type,dtype", [(qm.Q4_0, mx.bfloat16), (qm.Q4_0, mx.float32), (qm.Q8_0, mx.bfloat16)])
def test_expert_ops_with_lead_dims(ggml_type, dtype):
    """The expert ops with ids [2, 3, k] / [1, 1, k] (a decode step passes them unreshaped; the kernels
    read the slot count from ids' last dimension): bit-equal to the same call on [M, k] ids, in the
    caller's shape (the kernels' accuracy is checked against float64 by the tests above)."""
    rng = np.random.default_rng(31)
    gate_up = {qm.Q4_0: qm.q4_0_gate_up_gather, qm.Q8_0: qm.q8_0_gate_up_gather}[ggml_type]
    gather = {qm.Q4_0: qm.q4_0_matvec_gather, qm.Q8_0: qm.q8_0_matvec_gather}[ggml_type]
    down = {qm.Q4_0: qm.q4_0_moe_down, qm.Q8_0: qm.q8_0_moe_down}[ggml_type]
    gu_stack = mx.array(qm.random_blocks(rng, ggml_type, (8, 2 * 96), 512))
    dn_stack = mx.array(qm.random_blocks(rng, ggml_type, (8, 512), 96))

    def same(a, b):
        return np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))

    for lead in ((2, 3), (1, 1)):
        m = int(np.prod(lead))
        x, _ = _acts(rng, (*lead, 512), dtype)
        ids = mx.array(np.stack([rng.permutation(8)[:4] for _ in range(m)]).astype(np.int32).reshape(*lead, 4))
        wts = mx.array(rng.random((*lead, 4)).astype(np.float32))
        h = gate_up(x, ids, gu_stack, 96)
        h_flat = gate_up(x.reshape(m, 512), ids.reshape(m, 4), gu_stack, 96)
        assert h.shape == (*lead, 4, 96) and same(h.reshape(m, 4, 96), h_flat)
        g = gather(h, ids, dn_stack, 512)
        g_flat = gather(h_flat, ids.reshape(m, 4), dn_stack, 512)
        assert g.shape == (*lead, 4, 512) and same(g.reshape(m, 4, 512), g_flat)
        y = down(h, ids, wts, dn_stack, 512)
        y_flat = down(h_flat, ids.reshape(m, 4), wts.reshape(m, 4), dn_stack, 512)
        assert y.shape == (*lead, 512) and same(y.reshape(m, 512), y_flat)


def _misaligned(raw: np.ndarray, offset: int) -> mx.array:
    """The same bytes as raw, as a row-contiguous view whose data starts `offset` bytes into a buffer."""
    flat = mx.array(np.concatenate([np.zeros(offset, np.uint8), raw.reshape(-1)]))
    return flat[offset:].reshape(raw.shape)


def _misaligned_bf16(x: mx.array, offset: int) -> mx.array:
    """The same bf16 values as x, as a row-contiguous view `offset` bytes into a buffer."""
    flat = mx.concatenate([mx.zeros((offset // 2,), mx.bfloat16), x.reshape(-1)])
    return flat[offset // 2 :].reshape(x.shape)


@pytest.mark.skipif(custom_kernels.backend() != "cuda", reason="CUDA-only kernels (tensor cores, Hopper bulk copies)")
@pytest.mark.parametrize("n,k", [(2048, 5376), (1003, 2560), (77, 21504), (40, 256)])
def test_q4_0_runs_kernels(n, k):
    """The one-token runs kernels (dense and gate|up), 8-row form at every warp count with and
    without the prefetch of the next run, 16-row form at every warp count (and with the L2
    prefetch-size hint), staged 16-row form at 1, 2 and 4 stages with 16-byte or bulk copies and in
    dynamic shared memory, on aligned blocks and x
    and on blocks and x that start 2 bytes past a 16-byte boundary (the 2-byte-load fallbacks)."""
    rng = np.random.default_rng(41)
    raw = qm.random_blocks(rng, qm.Q4_0, (n,), k)
    w64 = qm.dequantize_f64(raw, qm.Q4_0)
    x, x64 = _acts(rng, (1, k), mx.bfloat16)
    want, bound = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    f = n // 2  # gate|up over the first 2F rows
    gu_want, gu_bound = _gelu_times(want[:, : 2 * f], bound[:, : 2 * f], f)
    blocks = mx.array(raw)
    x_off = _misaligned_bf16(x, 2)
    assert mx.array_equal(x_off, x).item()
    for warps, prefetch, rows, l2, stages, bulk, dyn in (
        (1, 0, 8, 0, 0, 0, 0), (2, 0, 8, 0, 0, 0, 0), (4, 0, 8, 0, 0, 0, 0), (8, 0, 8, 0, 0, 0, 0), (1, 1, 8, 0, 0, 0, 0),
        (2, 1, 8, 0, 0, 0, 0), (8, 1, 8, 0, 0, 0, 0), (1, 0, 16, 0, 0, 0, 0), (2, 0, 16, 0, 0, 0, 0), (4, 0, 16, 0, 0, 0, 0),
        (8, 0, 16, 0, 0, 0, 0), (1, 0, 16, 1, 0, 0, 0), (8, 0, 16, 1, 0, 0, 0), (1, 0, 16, 0, 1, 0, 0), (2, 0, 16, 0, 1, 0, 0),
        (8, 0, 16, 0, 1, 0, 0), (1, 0, 16, 0, 2, 0, 0), (2, 0, 16, 0, 2, 0, 0), (1, 0, 16, 0, 4, 0, 0), (1, 0, 16, 0, 1, 1, 0),
        (8, 0, 16, 0, 1, 1, 0), (1, 0, 16, 0, 2, 1, 0), (2, 0, 16, 0, 2, 1, 0), (1, 0, 16, 0, 4, 1, 0), (8, 0, 16, 0, 2, 0, 1),
        (4, 0, 16, 0, 4, 0, 1), (4, 0, 16, 0, 2, 1, 0)):  # fmt: skip
        cfg = qm.RunsConfig(warps, prefetch, rows, l2, stages, bulk, dyn)
        for what, xx, bb, bb2 in (("aligned", x, blocks, mx.array(raw[: 2 * f])),
                                  ("misaligned", x_off, _misaligned(raw, 2), _misaligned(raw[: 2 * f], 2))):  # fmt: skip
            out = qm.launch_dense_runs(xx, bb, n, cfg, init_value=NAN)
            assert out.shape == (1, n) and out.dtype == mx.bfloat16
            _check(out, want, bound, mx.bfloat16, f"runs dense {what} N={n} K={k} {cfg}")
            gu = qm.launch_gate_up_runs(xx, bb2, f, cfg, init_value=NAN)
            assert gu.shape == (1, f)
            _check(gu, gu_want, gu_bound, mx.bfloat16, f"runs gate_up {what} F={f} K={k} {cfg}")
        # run to run: bit for bit
        assert mx.array_equal(qm.launch_dense_runs(x, blocks, n, cfg), qm.launch_dense_runs(x, blocks, n, cfg)).item()


def _check_token_kernels(n: int, k: int, seed: int, configs, dense, gate_up, name: str) -> None:
    """dense(x, blocks, n, cfg, init_value=...) and gate_up(x, blocks, f, cfg, init_value=...) of
    1..8-token Q4_0 kernels against float64 at M = 1, 2, 5, 8 (x with lead dims too), each config,
    on aligned blocks and x, and with blocks, x or both starting 2 bytes past a 16-byte boundary;
    outputs poisoned first; bit for bit run to run."""
    rng = np.random.default_rng(seed)
    raw = qm.random_blocks(rng, qm.Q4_0, (n,), k)
    w64 = qm.dequantize_f64(raw, qm.Q4_0)
    f = n // 2
    blocks, blocks_gu = mx.array(raw), mx.array(raw[: 2 * f])
    for m, lead in ((1, (1,)), (2, (2,)), (5, (5,)), (8, (2, 4))):
        x, x64 = _acts(rng, (*lead, k), mx.bfloat16)
        x64 = x64.reshape(m, k)
        want, bound = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
        gu_want, gu_bound = _gelu_times(want[:, : 2 * f], bound[:, : 2 * f], f)
        x_off = _misaligned_bf16(x, 2)
        for cfg in configs:
            for what, xx, bb, bb2 in (("aligned", x, blocks, blocks_gu),
                                      ("misaligned", x_off, _misaligned(raw, 2), _misaligned(raw[: 2 * f], 2)),
                                      ("x misaligned", x_off, blocks, blocks_gu),
                                      ("weights misaligned", x, _misaligned(raw, 2), _misaligned(raw[: 2 * f], 2))):  # fmt: skip
                out = dense(xx, bb, n, cfg, init_value=NAN)
                assert out.shape == (m, n) and out.dtype == mx.bfloat16
                _check(out, want, bound, mx.bfloat16, f"{name} dense {what} M={m} N={n} K={k} {cfg}")
                gu = gate_up(xx, bb2, f, cfg, init_value=NAN)
                assert gu.shape == (m, f)
                _check(gu, gu_want, gu_bound, mx.bfloat16, f"{name} gate_up {what} M={m} F={f} K={k} {cfg}")
            for again in (lambda: dense(x, blocks, n, cfg), lambda: gate_up(x, blocks_gu, f, cfg),
                          lambda: dense(x_off, _misaligned(raw, 2), n, cfg)):  # fmt: skip
                assert mx.array_equal(again(), again()).item(), cfg


@pytest.mark.skipif(custom_kernels.backend() != "cuda", reason="CUDA-only kernels (tensor cores, Hopper bulk copies)")
@pytest.mark.parametrize("n,k", [(2048, 5376), (1003, 2560), (77, 21504), (40, 256), (300, 768)])
def test_q4_0_runs_m_kernels(n, k):
    """The runs16m kernels (dense and gate|up), every warp and stage count, as _check_token_kernels
    runs them (the misaligned inputs take the 2-byte copy fallback)."""
    configs = (qm.RunsMConfig(1, 1), qm.RunsMConfig(2, 2), qm.RunsMConfig(4, 2), qm.RunsMConfig(8, 4), qm.RunsMConfig(4, 3))
    _check_token_kernels(n, k, 47, configs, qm.launch_dense_runs_m, qm.launch_gate_up_runs_m, "runs16m")


@pytest.mark.skipif(custom_kernels.backend() != "cuda", reason="CUDA-only kernels (tensor cores, Hopper bulk copies)")
@pytest.mark.parametrize("n,k", [(2048, 5376), (1003, 2560), (77, 8192), (40, 256), (300, 768)])
def test_q4_0_tiles_kernels(n, k):
    """The tiles kernels (custom_kernels.quant_tiles, dense and gate|up), every warp and chunk
    count, with and without the bias form, as _check_token_kernels runs them (the misaligned
    inputs take the 2-byte copy and x fallbacks)."""
    from custom_kernels import quant_tiles as qt

    configs = (qt.TilesConfig(1, 1, 0), qt.TilesConfig(2, 8, 0), qt.TilesConfig(4, 2, 0), qt.TilesConfig(8, 4, 0),
               qt.TilesConfig(8, 1, 0), qt.TilesConfig(8, 4, 1), qt.TilesConfig(1, 1, 1), qt.TilesConfig(2, 8, 1))
    _check_token_kernels(n, k, 53, configs, qt.launch_dense_tiles, qt.launch_gate_up_tiles, "tiles")


def _check_dispatch(monkeypatch, module, names: tuple[str, str], k: int, shapes, seed: int) -> None:
    """q4_0_matvec and gate_up on bf16 x of each shape (300 Q4_0 rows of K = k) launch module's
    `names` (dense, gate|up; wrapped to record it) and stay within the reference bound."""
    monkeypatch.delenv(custom_kernels.KERNELS_OFF_ENV, raising=False)
    launched = []
    for name in names:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **kw: launched.append(_name) or _real(*a, **kw))
    rng = np.random.default_rng(seed)
    raw = qm.random_blocks(rng, qm.Q4_0, (300,), k)
    w64 = qm.dequantize_f64(raw, qm.Q4_0)
    for shape in shapes:
        launched.clear()
        x, x64 = _acts(rng, shape, mx.bfloat16)
        x64 = x64.reshape(-1, k)
        out = qm.q4_0_matvec(x, mx.array(raw), 300)
        assert out.shape == (*shape[:-1], 300)
        _check(out.reshape(-1, 300), x64 @ w64.T, np.abs(x64) @ np.abs(w64).T, mx.bfloat16, f"dispatch {shape}")
        gu = qm.gate_up(x, mx.array(raw), qm.Q4_0, 150)
        assert gu.shape == (*shape[:-1], 150)
        g_want, g_bound = _gelu_times(x64 @ w64.T, np.abs(x64) @ np.abs(w64).T, 150)
        _check(gu.reshape(-1, 150), g_want, g_bound, mx.bfloat16, f"gate_up dispatch {shape}")
        assert launched == list(names), shape


@pytest.mark.skipif(custom_kernels.backend() != "cuda", reason="CUDA-only kernels (tensor cores, Hopper bulk copies)")
def test_q4_0_tiles_dispatch(monkeypatch):
    """With family quant_matvec_tiles on (a CUDA default), one bf16 token with Q4_0 blocks of K in
    its range (dense and gate|up) goes to the tiles kernels and stays as accurate as the reference
    bound."""
    from custom_kernels import quant_tiles as qt

    _check_dispatch(monkeypatch, qt, ("launch_dense_tiles", "launch_gate_up_tiles"), 3840, ((1, 3840), (1, 1, 3840)), 59)


@pytest.mark.skipif(custom_kernels.backend() != "cuda", reason="CUDA-only kernels (tensor cores, Hopper bulk copies)")
def test_q4_0_runs_m_dispatch(monkeypatch):
    """With family quant_matvec_runs_m on (a CUDA default), 2..8 bf16 tokens with Q4_0 blocks (dense
    and gate|up) go to the runs16m kernels and stay as accurate as the reference bound."""
    _check_dispatch(monkeypatch, qm, ("launch_dense_runs_m", "launch_gate_up_runs_m"), 1024,
                    ((2, 1024), (1, 3, 1024), (8, 1024)), 49)  # fmt: skip


@pytest.mark.skipif(custom_kernels.backend() != "cuda", reason="CUDA-only kernels (tensor cores, Hopper bulk copies)")
def test_q4_0_runs_dispatch(monkeypatch):
    """With families quant_matvec_runs and gate_up_runs on (the CUDA defaults) and no grid-width bar for
    dense rows, one-token bf16 Q4_0 calls (dense, gate_up, x with lead dims) go to the runs kernels
    and stay as accurate; K not a multiple of 256 and f32 keep their kernels, and M = 2 takes others."""
    monkeypatch.delenv(custom_kernels.KERNELS_OFF_ENV, raising=False)
    monkeypatch.setattr(qm, "RUNS_DENSE_MIN_WARPS", 0)
    launched = []
    for name in ("launch_dense_runs", "launch_gate_up_runs"):
        real = getattr(qm, name)
        monkeypatch.setattr(qm, name, lambda *a, _real=real, _name=name, **kw: launched.append(_name) or _real(*a, **kw))
    rng = np.random.default_rng(43)
    for k, runs in ((512, True), (1056, False)):
        raw = qm.random_blocks(rng, qm.Q4_0, (300,), k)
        w64 = qm.dequantize_f64(raw, qm.Q4_0)
        for shape, dtype, expect in (((1, 1, k), mx.bfloat16, runs), ((1, k), mx.float32, False),
                                     ((2, k), mx.bfloat16, False)):  # fmt: skip
            launched.clear()
            x, x64 = _acts(rng, shape, dtype)
            out = qm.q4_0_matvec(x, mx.array(raw), 300)
            assert out.shape == (*shape[:-1], 300)
            _check(out, x64 @ w64.T, np.abs(x64) @ np.abs(w64).T, dtype, f"dispatch {shape} {dtype}")
            gu = qm.gate_up(x, mx.array(raw), qm.Q4_0, 150)
            g_want, g_bound = _gelu_times(x64 @ w64.T, np.abs(x64) @ np.abs(w64).T, 150)
            _check(gu, g_want, g_bound, dtype, f"gate_up dispatch {shape} {dtype}")
            assert launched == (["launch_dense_runs", "launch_gate_up_runs"] if expect else []), (shape, dtype, k)
