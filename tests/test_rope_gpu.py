"""GPU: the norm + RoPE kernel against the float64 oracle and MLX's own ops at the real head
shapes (31B, 26B-A4B, E4B; sliding and proportional RoPE, K = V, KV-shared q only), T = 1..8.
Run with ``pytest -m gpu``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import custom_kernels
from custom_kernels import rope
from custom_kernels.registry import bf16_to_f32, f32_to_bf16

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(custom_kernels.backend() == "cpu", reason="no GPU backend (CPU-only MLX build)"),
]

SHAPES = [  # (HQ, HKV, d, k_eq_v, proportional)
    (32, 16, 256, False, False), (32, 4, 512, True, True),   # 31B sliding / full
    (16, 8, 256, False, False), (16, 2, 512, True, True),    # 26B-A4B
    (8, 2, 256, False, False), (8, 2, 512, False, True),     # E4B
    (8, 0, 256, False, False), (8, 0, 512, False, True),     # KV-shared layers: q only
]  # fmt: skip


def _periods(d):
    n = d // 8
    return np.array([1e6 ** (2 * i / d) for i in range(n)] + [np.inf] * (d // 2 - n), np.float32)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_kernel_matches_oracle_and_mlx(shape, dtype):
    hq, hkv, d, k_eq_v, full = shape
    heads = (hq, hkv, d, k_eq_v)
    bf16 = dtype == mx.bfloat16
    rng = np.random.default_rng(hq * d + hkv)
    for T, pos0 in ((1, 0), (1, 4095), (3, 700), (8, 32760), (1, 131071)):
        y = (rng.standard_normal((1, T, (hq + (1 if k_eq_v else 2) * hkv) * d)) * 2 + 0.2).astype(np.float32)
        w_q, w_k = rng.uniform(0.3, 2, d).astype(np.float32), rng.uniform(0.3, 2, d).astype(np.float32)
        if bf16:
            y, w_q, w_k = (bf16_to_f32(f32_to_bf16(a)) for a in (y, w_q, w_k))
        pos = np.arange(pos0, pos0 + T, dtype=np.int32)
        inv = rope.inverse_frequencies(d, periods=_periods(d)) if full else rope.inverse_frequencies(d, base=1e4)
        want = rope.norm_rope_np(y, heads, w_q, w_k, pos, 1e-6, inv, bf16=bf16)
        args = (mx.array(y).astype(dtype), heads, mx.array(w_q).astype(dtype), mx.array(w_k).astype(dtype),
                mx.array(pos), 1e-6, mx.array(inv))  # fmt: skip
        got = rope.norm_rope(*args)
        ref = rope.norm_rope_reference(*args)
        for g, w, r in zip(got, want, ref):
            assert (g is None) == (w is None) == (r is None)
            if w is None:
                continue
            g32 = np.array(g.astype(mx.float32))
            if bf16:  # one bf16 step where an f32 ulp moves a value across a rounding boundary
                assert np.allclose(g32, w, rtol=8e-3, atol=2e-2), (T, pos0)
            else:
                assert np.allclose(g32, w, rtol=2e-5, atol=2e-5), (T, pos0)
            if pos0 < 8192:  # MLX's rope: its frequencies 1 / (1 / f) may be an ulp off f, which p multiplies
                assert np.allclose(g32, np.array(r.astype(mx.float32)), rtol=1e-2, atol=3e-2), (T, pos0)


def test_outputs_fully_written():
    rng = np.random.default_rng(3)
    heads = (32, 16, 256, False)
    y = mx.array(rng.standard_normal((1, 2, 64 * 256)).astype(np.float32)).astype(mx.bfloat16)
    w = mx.ones((256,), mx.bfloat16)
    mx.eval(mx.full((1 << 22,), float("nan"), mx.bfloat16))
    inv = mx.array(rope.inverse_frequencies(256, base=10_000.0))
    out = rope.norm_rope(y, heads, w, w, mx.array([5, 6], dtype=mx.int32), 1e-6, inv)
    again = rope.norm_rope(y, heads, w, w, mx.array([5, 6], dtype=mx.int32), 1e-6, inv)
    for a, b in zip(out, again):
        a32, b32 = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
        assert not np.isnan(a32).any() and np.array_equal(a32, b32)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[1]])
@pytest.mark.parametrize("B,T", [(1, 1), (2, 3)])
def test_stacked_kernel_equals_the_three_outputs(shape, B, T):
    """g4_norm_rope_kv (the kv_one_write family's: k's rows then v's in one [2B, HKV, T, d]
    output) gives g4_norm_rope's bits, every element written (outputs poisoned with NaN first)."""
    hq, hkv, d, k_eq_v, full = shape
    rng = np.random.default_rng(hq + d + B)
    y = mx.array(rng.standard_normal((B, T, (hq + (1 if k_eq_v else 2) * hkv) * d)).astype(np.float32) * 2)
    y = y.astype(mx.bfloat16)
    w_q, w_k = (mx.array(rng.uniform(0.3, 2, d).astype(np.float32)).astype(mx.bfloat16) for _ in range(2))
    inv = mx.array(rope.inverse_frequencies(d, periods=_periods(d)) if full else rope.inverse_frequencies(d, base=1e4))
    pos = mx.arange(4000, 4000 + T, dtype=mx.int32)
    mx.eval(mx.full((1 << 24,), float("nan"), mx.bfloat16))  # freed memory the outputs may reuse
    q, k, v = rope.norm_rope(y, (hq, hkv, d, k_eq_v), w_q, w_k, pos, 1e-6, inv)
    q2, kv = rope.norm_rope(y, (hq, hkv, d, k_eq_v), w_q, w_k, pos, 1e-6, inv, stacked=True)
    assert kv.shape == (2 * B, hkv, T, d)
    want = np.array(mx.concatenate([k, v]).astype(mx.float32))
    got = np.array(kv.astype(mx.float32))
    assert not np.isnan(got).any()
    assert np.array_equal(got, want) and np.array_equal(np.array(q2.astype(mx.float32)), np.array(q.astype(mx.float32)))
