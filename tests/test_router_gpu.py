"""GPU: the routing kernel against the float64 oracle at the 26B-A4B shape and others, and the
model's Router with the family on against its MLX path. Run with ``pytest -m gpu``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import custom_kernels
from custom_kernels import router as rt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(custom_kernels.backend() == "cpu", reason="no GPU backend (CPU-only MLX build)"),
]


@pytest.mark.parametrize("e,k", [(128, 8), (45, 5), (300, 32), (8, 8)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_kernel_matches_oracle(e, k, dtype):
    rng = np.random.default_rng(e * k)
    for rows in (1, 3, 8):
        x = mx.array((rng.standard_normal((rows, e)) * 3).astype(np.float32)).astype(dtype)
        scale = mx.array(rng.uniform(0.5, 2.0, e).astype(np.float32))
        want_w, want_i = rt.route_f64(np.array(x.astype(mx.float32)), np.array(scale), k)
        w, i = rt.route(x, scale, k)
        assert np.array_equal(np.array(i), want_i), f"E={e} k={k} rows={rows}"
        assert np.allclose(np.array(w), want_w, rtol=1e-5, atol=1e-7)


def test_router_module_with_the_family_on(monkeypatch):
    from gemma4_mlx.model import Router

    class Cfg:
        top_k_experts, rms_norm_eps, hidden_size, num_experts = 8, 1e-6, 2816, 128

    r = Router(Cfg())
    r.proj.weight = mx.random.normal((128, 2816)) * 0.05
    r.per_expert_scale = mx.random.uniform(0.5, 2.0, (128,))
    h = mx.random.normal((1, 5, 2816)).astype(mx.bfloat16)
    w_mlx, i_mlx = r(h)
    monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "router")
    w, i = r(h)
    for t in range(5):
        got = dict(zip(np.array(i[0, t]).tolist(), np.array(w[0, t]).tolist()))
        want = dict(zip(np.array(i_mlx[0, t]).tolist(), np.array(w_mlx[0, t]).tolist()))
        assert got.keys() == want.keys()
        assert all(abs(got[e] - want[e]) <= 1e-5 * abs(want[e]) for e in want)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_router_logits_kernel(dtype):
    """g4_router_logits (family "router_proj") at the 26B-A4B shape (128 x 2816) and an odd one
    (E = 45, H = 260), 1 / 3 / 8 tokens with lead dims, against float64."""
    rng = np.random.default_rng(9)
    for e, h in ((128, 2816), (45, 260)):
        w = mx.array((rng.standard_normal((e, h)) * 0.05).astype(np.float32)).astype(dtype)
        w64 = np.array(w.astype(mx.float32)).astype(np.float64)
        for lead in ((1, 1), (1, 3), (2, 4)):
            x = mx.array(rng.standard_normal((*lead, h)).astype(np.float32)).astype(dtype)
            x64 = np.array(x.astype(mx.float32)).astype(np.float64)
            got = rt.router_logits(x, w)
            assert got.shape == (*lead, e) and got.dtype == dtype
            want, bound = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
            err = np.abs(np.array(got.astype(mx.float32)) - want)
            limit = 2.0**-8 * np.abs(want) + 1e-6 * bound if dtype == mx.bfloat16 else 1e-5 * bound
            assert (err <= limit).all(), f"E={e} H={h} lead={lead}: max error {err.max():.3g}"


def test_router_module_with_router_proj(monkeypatch):
    """The model's Router with families router and router_proj on picks the experts of its MLX path."""
    from gemma4_mlx.model import Router

    class Cfg:
        top_k_experts, rms_norm_eps, hidden_size, num_experts = 8, 1e-6, 2816, 128

    r = Router(Cfg())
    r.proj.weight = (mx.random.normal((128, 2816)) * 0.05).astype(mx.bfloat16)
    r.per_expert_scale = mx.random.uniform(0.5, 2.0, (128,))
    h = mx.random.normal((1, 5, 2816)).astype(mx.bfloat16)
    r.scale = mx.ones((2816,), mx.bfloat16)
    monkeypatch.setenv(custom_kernels.KERNELS_ENV, "reference")
    w_mlx, i_mlx = r(h)
    monkeypatch.delenv(custom_kernels.KERNELS_ENV)
    monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "router_proj")
    w, i = r(h)
    same = 0
    for t in range(5):
        got = dict(zip(np.array(i[0, t]).tolist(), np.array(w[0, t]).tolist()))
        want = dict(zip(np.array(i_mlx[0, t]).tolist(), np.array(w_mlx[0, t]).tolist()))
        same += got.keys() == want.keys()
    assert same >= 4  # bf16 logits rounded after another summation order may swap a near-tie at the k-th expert


@pytest.mark.parametrize("e,h,k", [(128, 2816, 8), (45, 260, 5)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_route_logits_kernel_equals_the_two_launches(e, h, k, dtype):
    """g4_route_logits (family "router_fused"): bit for bit the weights and indices of
    router_logits then route, for 1 / 3 / 8 tokens, three calls in a row on one counters array
    (the last block of each call sets them back to zero)."""
    rng = np.random.default_rng(e + h)
    w = mx.array((rng.standard_normal((e, h)) * 0.05).astype(np.float32)).astype(dtype)
    scale = mx.array(rng.uniform(0.5, 2.0, e).astype(np.float32))
    counters = rt.new_router_counters()
    for lead in ((1, 1), (1, 3), (2, 4), (1, 1)):
        x = mx.array(rng.standard_normal((*lead, h)).astype(np.float32)).astype(dtype)
        assert rt.route_logits_supported(x, w, k)
        got = rt.route_logits(x, w, scale, k, counters)
        want = rt.route(rt.router_logits(x, w), scale, k)
        mx.eval(got, want)
        assert np.array_equal(np.array(got[1]), np.array(want[1])), f"E={e} lead={lead}"
        assert np.array_equal(np.array(got[0]), np.array(want[0])), f"E={e} lead={lead}"
    assert not np.array(counters).any()


@pytest.mark.parametrize("d,e,k", [(2816, 128, 8), (360, 45, 5), (3072, 128, 8)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_residual_norm_route_equals_norm_then_route_logits(monkeypatch, d, e, k, dtype):
    """g4_residual_norm_route (family "norm_route"): bit for bit the out, x and x2 of
    g4_residual_norm_moe and the weights and ids of g4_route_logits on its router input, at
    26B-A4B's shape, an odd one and the longest row it takes (768 threads); four calls in a row on
    one counters array (back to zero after each), and in a chain of dependent calls in one graph."""
    from custom_kernels import norm

    monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "norm_route")
    rng = np.random.default_rng(d + e)

    def arr(v):
        return mx.array(np.asarray(v, np.float32)).astype(dtype)

    wv = [arr(rng.uniform(0.2, 2.0, d)) for _ in range(4)]
    w = arr(rng.standard_normal((e, d)) * 0.05)
    scale = mx.array(rng.uniform(0.5, 2.0, e).astype(np.float32))
    counters, two = rt.new_router_counters(), rt.new_router_counters()
    root, eps = d ** -0.5, 1e-6
    for _ in range(4):
        h, a = arr(rng.standard_normal((1, 1, d)) * 4), arr(rng.standard_normal((1, 1, d)) * 0.3 + 0.1)
        got = rt.residual_norm_route(h, a, *wv, root, eps, w, scale, k, counters)
        assert got is not None
        out, x, x2, xr = norm.residual_norm_moe(h, a, *wv, root, eps)
        want = (out, x, x2, *rt.route_logits(xr, w, scale, k, two))
        mx.eval(got, want)
        for i, (g, wnt) in enumerate(zip(got, want)):
            assert g.dtype == wnt.dtype and np.array_equal(np.array(g.astype(mx.float32) if g.dtype == mx.bfloat16 else g),
                                                           np.array(wnt.astype(mx.float32) if wnt.dtype == mx.bfloat16 else wnt)), i  # fmt: skip
    assert not np.array(counters).any()
    h1 = mx.zeros((1, 1, rt.NORM_ROUTE_MAX_D + 4), dtype)
    assert rt.residual_norm_route(h1, h1, *[mx.ones((h1.shape[-1],), dtype)] * 4, root, eps,
                                  mx.ones((e, h1.shape[-1]), dtype), scale, k, counters) is None  # fmt: skip
    # a chain: each call's out is the next call's h (one graph, the counters reused in order). The
    # reference's route_logits calls do not depend on one another, so MLX may run them at once:
    # each takes its own counters (shared ones raced there: session 34's GPU run)
    chain, ref, got, want = h, h, [], []
    for _ in range(3):
        step = rt.residual_norm_route(chain, a, *wv, root, eps, w, scale, k, counters)
        out, x, x2, xr = norm.residual_norm_moe(ref, a, *wv, root, eps)
        got.append(step)
        want.append((out, x, x2, *rt.route_logits(xr, w, scale, k, rt.new_router_counters())))
        chain, ref = step[0], out
    mx.eval(got, want)
    for g, wnt in zip((t for s in got for t in s), (t for s in want for t in s)):
        assert np.array_equal(np.array(g.astype(mx.float32)), np.array(wnt.astype(mx.float32)))
    assert not np.array(counters).any()
