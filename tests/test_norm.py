"""custom_kernels.norm on the CPU: the MLX reference against the numpy oracle, and argument checks
(the model's restructured layers are checked against transformers by tests/test_model.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from custom_kernels import norm


@pytest.mark.parametrize("d,scale,nxt", [(64, False, True), (96, True, True), (128, True, False)])
def test_reference_matches_oracle(d, scale, nxt):
    rng = np.random.default_rng(d)
    h, a = rng.standard_normal((3, d)).astype(np.float32) * 4, rng.standard_normal((3, d)).astype(np.float32)
    w_a, w_n = rng.uniform(0.2, 2, d).astype(np.float32), rng.uniform(0.2, 2, d).astype(np.float32)
    s = 0.75
    want_out, want_x = norm.residual_norm_np(h, a, w_a, w_n if nxt else None, 1e-6, np.float32(s) if scale else None)
    out, x = norm.residual_norm(mx.array(h), mx.array(a), mx.array(w_a), mx.array(w_n) if nxt else None, 1e-6,
                                mx.array([float(s)]) if scale else None)  # fmt: skip
    assert np.allclose(np.array(out), want_out, rtol=1e-5, atol=1e-5)
    assert (x is None) == (not nxt)
    if nxt:
        assert np.allclose(np.array(x), want_x, rtol=1e-5, atol=1e-5)


def test_errors_and_fusable():
    h = mx.zeros((2, 8))
    for args, match in (((h, mx.zeros((2, 6)), mx.ones((8,)), None), "expected"),
                        ((h, h, mx.ones((7,)), None), "expected")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            norm.residual_norm(*args, 1e-6)
    with pytest.raises(ValueError, match="one value"):
        norm.residual_norm(h, h, mx.ones((8,)), None, 1e-6, mx.ones((2,)))
    w = mx.ones((8,))
    assert norm.fusable(h, h, w, w, mx.ones((1,)))
    assert not norm.fusable(h.astype(mx.bfloat16), h.astype(mx.bfloat16), w.astype(mx.bfloat16), None, mx.ones((1,)))
    six = mx.zeros((2, 6))  # rows of 6: the kernel loads quads, so these take the reference
    assert not norm.fusable(six, six, mx.ones((6,)), None)


def test_rows_not_a_multiple_of_four_use_the_reference(monkeypatch):
    """As on a GPU build (no reference switch), rows of 7 must not reach the kernel."""
    monkeypatch.setattr(norm, "use_reference", lambda: False)
    monkeypatch.setattr(norm, "_RESIDUAL_NORM", None)  # a kernel launch would fail on None
    rng = np.random.default_rng(7)
    h, a = (rng.standard_normal((2, 7)).astype(np.float32) for _ in range(2))
    w = rng.uniform(0.5, 1.5, 7).astype(np.float32)
    want_out, want_x = norm.residual_norm_np(h, a, w, w, 1e-6)
    out, x = norm.residual_norm(mx.array(h), mx.array(a), mx.array(w), mx.array(w), 1e-6)
    assert np.allclose(np.array(out), want_out, rtol=1e-5, atol=1e-5)
    assert np.allclose(np.array(x), want_x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d,max_threads,tg,quads", [(5376, 1024, 672, 2), (5376, 512, 448, 3), (2560, 1024, 640, 1),
                                                    (68, 1024, 32, 1), (360, 32, 32, 3)])  # fmt: skip
def test_geometry_covers_the_row(d, max_threads, tg, quads):
    assert norm.row_geometry(d, max_threads) == (tg, quads)
    assert tg % 32 == 0 and tg <= max_threads and 4 * tg * quads >= d > 4 * tg * (quads - 1)


def test_moe_reference_matches_oracle():
    rng = np.random.default_rng(11)
    d = 96
    h, a = rng.standard_normal((2, d)).astype(np.float32) * 4, rng.standard_normal((2, d)).astype(np.float32)
    w = [rng.uniform(0.2, 2, d).astype(np.float32) for _ in range(4)]
    want = norm.residual_norm_moe_np(h, a, *w, d ** -0.5, 1e-6)
    got = norm.residual_norm_moe(mx.array(h), mx.array(a), *(mx.array(t) for t in w), d ** -0.5, 1e-6)
    assert len(got) == 4
    for g, e in zip(got, want):
        assert np.allclose(np.array(g), e, rtol=1e-5, atol=1e-5)
    # x, x2 and the router input share one normalised out: x2 / x = w_next2 / w_next elementwise
    assert np.allclose(np.array(got[2]) * w[1], np.array(got[1]) * w[2], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="expected"):
        norm.residual_norm_moe(mx.array(h), mx.array(a), *(mx.array(t) for t in w[:3]), mx.ones((d + 1,)), 0.1, 1e-6)


@pytest.mark.parametrize("scale,nxt", [(True, True), (False, False)])
def test_moe_out_reference_matches_oracle(scale, nxt):
    rng = np.random.default_rng(13)
    d = 96
    h, mlp, moe = (rng.standard_normal((3, d)).astype(np.float32) * f for f in (4, 0.3, 2))
    w = [rng.uniform(0.2, 2, d).astype(np.float32) for _ in range(4)]
    s = np.float32(0.75)
    want = norm.residual_norm_moe_out_np(h, mlp, moe, *w[:3], w[3] if nxt else None, 1e-6, s if scale else None)
    args = [mx.array(t) for t in (h, mlp, moe, *w)]
    got = norm.residual_norm_moe_out(*args[:6], args[6] if nxt else None, 1e-6, mx.array([float(s)]) if scale else None)
    assert (got[1] is None) == (not nxt)
    for g, e in zip(got, want):
        if e is not None:
            assert np.allclose(np.array(g), e, rtol=1e-5, atol=1e-5)
    # the same as the model's two residual-norm steps it replaces, composed here independently
    m, _ = norm.residual_norm_reference(mx.fast.rms_norm(args[1], args[3], 1e-6), args[2], args[4], None, 1e-6)
    two = norm.residual_norm_reference(args[0], m, args[5], args[6] if nxt else None, 1e-6, mx.array([float(s)]) if scale else None)
    assert np.array_equal(np.array(two[0]), np.array(got[0]))
    with pytest.raises(ValueError, match="expected"):
        norm.residual_norm_moe_out(*args[:3], mx.ones((d + 1,)), *args[4:], 1e-6)

