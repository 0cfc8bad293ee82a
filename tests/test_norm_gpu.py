"""GPU: the residual-norm kernel against the numpy oracle and MLX's own ops at the real row
lengths, and the model's layers with the family on. Run with ``pytest -m gpu``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import custom_kernels
from custom_kernels import norm
from custom_kernels.registry import bf16_to_f32, f32_to_bf16

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(custom_kernels.backend() == "cpu", reason="no GPU backend (CPU-only MLX build)"),
]


def _inputs(rng, rows, d, bf16):
    vals = [rng.standard_normal((rows, d)) * 4, rng.standard_normal((rows, d)) * 0.3 + 0.1,
            rng.uniform(0.2, 2.0, d), rng.uniform(0.2, 2.0, d), np.array([0.75])]  # fmt: skip
    vals = [v.astype(np.float32) for v in vals]
    return [bf16_to_f32(f32_to_bf16(v)) for v in vals] if bf16 else vals


@pytest.mark.parametrize("d", [5376, 2816, 2560, 3840, 1536, 68, 70])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("scale,nxt", [(False, True), (True, True), (True, False)])
def test_kernel_matches_oracle_and_mlx(d, dtype, scale, nxt):
    rng = np.random.default_rng(d)
    bf16 = dtype == mx.bfloat16
    for rows in (1, 3, 8):
        h, a, w_a, w_n, s = _inputs(rng, rows, d, bf16)
        want_out, want_x = norm.residual_norm_np(h, a, w_a, w_n if nxt else None, 1e-6, s[0] if scale else None, bf16)
        args = [mx.array(t).astype(dtype) for t in (h, a, w_a, w_n, s)]
        out, x = norm.residual_norm(args[0], args[1], args[2], args[3] if nxt else None, 1e-6,
                                    args[4] if scale else None)  # fmt: skip
        ref_out, ref_x = norm.residual_norm_reference(args[0], args[1], args[2], args[3] if nxt else None, 1e-6,
                                                      args[4] if scale else None)  # fmt: skip
        pairs = [(out, want_out, ref_out)] + ([(x, want_x, ref_x)] if nxt else [])
        assert (x is None) == (not nxt)
        for got, want, ref in pairs:
            g = np.array(got.astype(mx.float32))
            if bf16:  # one bf16 step where the f32 sum order moves a value across a rounding boundary
                assert np.allclose(g, want, rtol=8e-3, atol=1e-2)
                assert np.sum(g != np.array(ref.astype(mx.float32))) <= max(2, 0.01 * g.size)  # nearly all bits equal MLX's
            else:
                assert np.allclose(g, want, rtol=2e-5, atol=1e-5)
                assert np.allclose(g, np.array(ref), rtol=2e-5, atol=1e-5)


def _assert_matches(got, want, ref, bf16: bool) -> None:
    """A kernel output against the numpy oracle and MLX's own ops: bf16 within one rounding step of
    the oracle (the f32 sum order can move a value across a boundary) and nearly every bit equal to
    MLX's; f32 within the sum order's last bits of both."""
    g = np.array(got.astype(mx.float32))
    assert not np.isnan(g).any()
    if bf16:
        assert np.allclose(g, want, rtol=8e-3, atol=1e-2)
        assert np.sum(g != np.array(ref.astype(mx.float32))) <= max(2, 0.01 * g.size)
    else:
        assert np.allclose(g, want, rtol=2e-5, atol=1e-5)
        assert np.allclose(g, np.array(ref), rtol=2e-5, atol=1e-5)


def test_poisoned_outputs_overwritten():
    """Every element written: two launches on fresh buffers agree exactly (MLX does not zero
    outputs, so an unwritten element would hold whatever the allocator left there)."""
    rng = np.random.default_rng(1)
    h, a, w_a, w_n, s = (mx.array(t).astype(mx.bfloat16) for t in _inputs(rng, 5, 2816, True))
    mx.eval(mx.full((1 << 22,), float("nan"), mx.bfloat16))
    first = norm.residual_norm(h, a, w_a, w_n, 1e-6, s)
    mx.eval(first)
    again = norm.residual_norm(h, a, w_a, w_n, 1e-6, s)
    for u, v in zip(first, again):
        assert not np.isnan(np.array(u.astype(mx.float32))).any()
        assert np.array_equal(np.array(u.astype(mx.float32)), np.array(v.astype(mx.float32)))


@pytest.mark.parametrize("d", [2816, 5376, 68])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_moe_kernel_matches_oracle_and_mlx(d, dtype):
    """g4_residual_norm_moe (family "norm_moe"): out, x, x2 and the router input against the numpy
    oracle and MLX's own ops, 1 and 3 rows."""
    rng = np.random.default_rng(d + 5)
    bf16 = dtype == mx.bfloat16
    for rows in (1, 3):
        h, a, w_a, w_n, _ = _inputs(rng, rows, d, bf16)
        w_n2, r_scale = (_inputs(rng, 1, d, bf16)[2] for _ in range(2))
        root = d ** -0.5
        want = norm.residual_norm_moe_np(h, a, w_a, w_n, w_n2, r_scale, root, 1e-6, bf16)
        args = [mx.array(t).astype(dtype) for t in (h, a, w_a, w_n, w_n2, r_scale)]
        got = norm.residual_norm_moe(*args, root, 1e-6)
        ref = norm.residual_norm_moe_reference(*args, root, 1e-6)
        for g_, w_, r_ in zip(got, want, ref):
            _assert_matches(g_, w_, r_, bf16)


@pytest.mark.parametrize("d", [2816, 5376, 68])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("scale,nxt", [(True, True), (False, True), (True, False)])
def test_moe_out_kernel_matches_oracle_and_mlx(d, dtype, scale, nxt):
    """g4_residual_norm_moe_out (family "norm_moe_out"): out and x against the numpy oracle and
    MLX's own ops, 1 and 3 rows, after a NaN-filled buffer is freed (no NaN may come back; the
    oracle comparison is what catches an unwritten element)."""
    rng = np.random.default_rng(d + 9)
    bf16 = dtype == mx.bfloat16
    for rows in (1, 3):
        h, mlp, w_mlp, w_n, s = _inputs(rng, rows, d, bf16)
        moe, w_moe, w_post = _inputs(rng, rows, d, bf16)[1:4]
        want = norm.residual_norm_moe_out_np(h, mlp, moe, w_mlp, w_moe, w_post, w_n if nxt else None, 1e-6,
                                             s[0] if scale else None, bf16)  # fmt: skip
        args = [mx.array(t).astype(dtype) for t in (h, mlp, moe, w_mlp, w_moe, w_post, w_n, s)]
        call = (*args[:6], args[6] if nxt else None, 1e-6, args[7] if scale else None)
        mx.eval(mx.full((1 << 22,), float("nan"), dtype))
        got = norm.residual_norm_moe_out(*call)
        ref = norm.residual_norm_moe_out_reference(*call)
        assert (got[1] is None) == (not nxt)
        for g_, w_, r_ in zip(got, want, ref):
            if w_ is not None:
                _assert_matches(g_, w_, r_, bf16)

