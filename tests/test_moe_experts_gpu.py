"""GPU tests of the one-launch MoE expert kernel (custom_kernels.moe_experts) against float64 numpy
on the same blocks, against the two-launch path, and for its ticket counters: calls one after
another, a chain of dependent calls in one graph, misaligned inputs, an expert id out of range.
Run with ``pytest -m gpu``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import custom_kernels
from custom_kernels import moe_experts as me
from custom_kernels import quant_matvec as qm
from test_kernels_gpu import _misaligned  # noqa: E402  (the same bytes at an offset)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(custom_kernels.backend() != "cuda" or custom_kernels.cuda_arch() < qm.MMA_ARCH,
                       reason="CUDA kernel (cp.async + tensor cores)"),  # fmt: skip
]

E, SLOTS, F, H = 16, 8, 704, 2816  # 26B-A4B's expert shapes, 16 of its 128 experts
GEOMETRIES = [me.MoeConfig(s, w) for w in (8, 16) for s in (1, 2, 3, 4)]
SOME = [me.MoeConfig(2, 8), me.MoeConfig(3, 16)]  # geometries the slower tests take


@pytest.fixture(scope="module")
def layer():
    rng = np.random.default_rng(41)
    gu, dn = qm.random_blocks(rng, qm.Q4_0, (E, 2 * F), H), qm.random_blocks(rng, qm.Q4_0, (E, H), F)
    return dict(rng=rng, gu=gu, dn=dn, gu64=qm.dequantize_f64(gu, qm.Q4_0), dn64=qm.dequantize_f64(dn, qm.Q4_0),
                gu_mx=mx.array(gu), dn_mx=mx.array(dn))  # fmt: skip


def _inputs(rng, slots=SLOTS):
    x = mx.array(rng.standard_normal((1, H)).astype(np.float32)).astype(mx.bfloat16)
    ids = rng.permutation(E)[:slots].astype(np.int32)
    wts = rng.random(slots).astype(np.float32)
    return x, ids, wts


def _check_against_f64(layer, x, ids, wts, out, gelu):
    """h against f64 gelu(g) * u; out against f64 from the kernel's own bf16 h (what its down half
    read), both to bf16 output rounding relative to the sums of magnitudes."""
    x64 = np.array(x.astype(mx.float32)).astype(np.float64)[0]
    w = layer["gu64"][ids]  # [k, 2F, H]
    f = w.shape[1] // 2
    g, u = w[:, :f] @ x64, w[:, f:] @ x64
    gm, um = np.abs(w[:, :f]) @ np.abs(x64), np.abs(w[:, f:]) @ np.abs(x64)
    h_got = np.array(gelu.astype(mx.float32)).astype(np.float64)
    assert not np.isnan(h_got).any()
    rel = np.abs(h_got - qm._gelu_tanh_f64(g) * u) / ((np.abs(g) + gm) * (np.abs(u) + um))
    assert rel.max() <= 2**-8, f"h: relative error {rel.max():.3g}"
    d = layer["dn64"][ids]  # [k, H, F]
    want = np.einsum("s,shf,sf->h", wts.astype(np.float64), d, h_got)
    bound = np.einsum("s,shf,sf->h", wts.astype(np.float64), np.abs(d), np.abs(h_got))
    got = np.array(out.astype(mx.float32)).astype(np.float64).reshape(-1)
    assert not np.isnan(got).any()
    rel = np.abs(got - want) / bound
    assert rel.max() <= 2**-8, f"out: relative error {rel.max():.3g}"


@pytest.mark.parametrize("cfg", GEOMETRIES, ids=str)
def test_against_float64_and_two_launch_path(layer, cfg):
    rng = layer["rng"]
    for slots in (SLOTS, 3, 1):
        x, ids, wts = _inputs(rng, slots)
        counters = me.new_counters()
        out, gelu = me.launch_moe_experts(x, mx.array(ids[None]), mx.array(wts[None]), layer["gu_mx"], layer["dn_mx"],
                                          counters, F, cfg)  # fmt: skip
        mx.eval(out, gelu)
        assert out.shape == (1, H) and out.dtype == mx.bfloat16 and gelu.shape == (slots, F)
        _check_against_f64(layer, x, ids, wts, out, gelu)
        assert not np.array(counters).any(), "counters not reset"
        two = qm.q4_0_moe_down(qm.q4_0_gate_up_gather(x, mx.array(ids[None]), layer["gu_mx"], F), mx.array(ids[None]),
                               mx.array(wts[None]), layer["dn_mx"], H)  # fmt: skip
        a, b = np.array(out.astype(mx.float32)), np.array(two.astype(mx.float32))
        assert np.abs(a - b).max() <= 2**-6 * np.abs(b).max(), "one launch and two launches disagree"


@pytest.mark.parametrize("cfg", SOME, ids=str)
def test_calls_one_after_another_and_chained(layer, cfg):
    """The same counters serve many calls: evaluated one by one, and as a chain of 12 dependent
    calls in one graph (each launch starts after the last one reset the counters): same values."""
    rng = layer["rng"]
    x, ids, wts = _inputs(rng)
    ids_mx, wts_mx, counters = mx.array(ids[None]), mx.array(wts[None]), me.new_counters()

    def step(v):
        out = me.launch_moe_experts(v, ids_mx, wts_mx, layer["gu_mx"], layer["dn_mx"], counters, F, cfg)[0]
        o = out.astype(mx.float32)
        return (o * mx.rsqrt((o * o).mean() + 1e-6)).astype(mx.bfloat16)

    one_by_one, v = [], x
    for _ in range(12):
        v = step(v)
        mx.eval(v)
        one_by_one.append(np.array(v.astype(mx.float32)))
    chain, v = [], x
    for _ in range(12):
        v = step(v)
        chain.append(v)
    mx.eval(chain)
    for i, (a, b) in enumerate(zip(one_by_one, chain)):
        assert np.array_equal(a, np.array(b.astype(mx.float32))), f"call {i} differs in a chain"
    assert not np.array(counters).any()


@pytest.mark.parametrize("cfg", SOME, ids=str)
def test_misaligned_inputs(layer, cfg):
    """x 2 bytes off 8-byte alignment, expert stacks 2 or 4 bytes off 16: the copy fallbacks (2-byte
    loads; the down rows' 4-byte copies)."""
    rng = layer["rng"]
    x, ids, wts = _inputs(rng)
    x_off = mx.concatenate([mx.zeros((1,), mx.bfloat16), x.reshape(-1)])[1:].reshape(1, H)
    for offset in (2, 4):
        out, gelu = me.launch_moe_experts(x_off, mx.array(ids[None]), mx.array(wts[None]), _misaligned(layer["gu"], offset),
                                          _misaligned(layer["dn"], offset), me.new_counters(), F, cfg)  # fmt: skip
        mx.eval(out, gelu)
        _check_against_f64(layer, x, ids, wts, out, gelu)


@pytest.mark.parametrize("cfg", SOME, ids=str)
def test_fixture_shape(cfg):
    """The MoE fixture's shapes (H = 256, F = 96, 2 of 8 experts), where F is not a multiple of 64:
    against float64, as the model-level test then runs it."""
    rng = np.random.default_rng(43)
    f, h, e = 96, 256, 8
    gu, dn = qm.random_blocks(rng, qm.Q4_0, (e, 2 * f), h), qm.random_blocks(rng, qm.Q4_0, (e, h), f)
    gu64, dn64 = qm.dequantize_f64(gu, qm.Q4_0), qm.dequantize_f64(dn, qm.Q4_0)
    x = mx.array(rng.standard_normal((1, h)).astype(np.float32)).astype(mx.bfloat16)
    ids, wts = rng.permutation(e)[:2].astype(np.int32), rng.random(2).astype(np.float32)
    out, gelu = me.launch_moe_experts(x, mx.array(ids[None]), mx.array(wts[None]), mx.array(gu), mx.array(dn),
                                      me.new_counters(), f, cfg)  # fmt: skip
    _check_against_f64(dict(gu64=gu64, dn64=dn64), x, ids, wts, out, gelu)


def test_expert_out_of_range(layer):
    """An id outside [0, E): its h row and the whole output are NaN; the next call is right."""
    rng = layer["rng"]
    x, ids, wts = _inputs(rng)
    bad = ids.copy()
    bad[2] = E + 3
    counters = me.new_counters()
    out, gelu = me.launch_moe_experts(x, mx.array(bad[None]), mx.array(wts[None]), layer["gu_mx"], layer["dn_mx"],
                                      counters, F)  # fmt: skip
    h = np.array(gelu.astype(mx.float32))
    assert np.isnan(np.array(out.astype(mx.float32))).all() and np.isnan(h[2]).all()
    assert np.isfinite(np.delete(h, 2, axis=0)).all()
    out, gelu = me.launch_moe_experts(x, mx.array(ids[None]), mx.array(wts[None]), layer["gu_mx"], layer["dn_mx"],
                                      counters, F)  # fmt: skip
    mx.eval(out, gelu)
    _check_against_f64(layer, x, ids, wts, out, gelu)


def test_op_routes_by_family(layer, monkeypatch):
    """q4_0_moe_experts takes the kernel with the family on (a CUDA default, or named in
    UNPROVEN_ENV), the two-launch path with it in KERNELS_OFF and for more than one token."""
    rng = layer["rng"]
    x, ids, wts = _inputs(rng)
    args = (mx.array(ids[None]), mx.array(wts[None]), layer["gu_mx"], layer["dn_mx"], me.new_counters(), F)
    calls = []
    real = me.launch_moe_experts
    monkeypatch.setattr(me, "launch_moe_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, "moe_one_launch")
    off = me.q4_0_moe_experts(x, *args)
    assert not calls
    monkeypatch.delenv(custom_kernels.KERNELS_OFF_ENV)
    monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "moe_one_launch")
    on = me.q4_0_moe_experts(x, *args)
    assert calls == [1]
    a, b = np.array(on.astype(mx.float32)), np.array(off.astype(mx.float32))
    assert np.abs(a - b).max() <= 2**-6 * np.abs(b).max()
    x2 = mx.concatenate([x, x])
    two = me.q4_0_moe_experts(x2, mx.array(np.stack([ids, ids])), mx.array(np.stack([wts, wts])), *args[2:])
    assert calls == [1] and two.shape == (2, H)


@pytest.mark.parametrize("h, f", [(2816, 2112), (2560, 10240), (1536, 6144), (3840, 15360)],
                         ids=["26B-A4B", "E4B", "E2B", "12B"])  # fmt: skip
def test_dense_mlp_in_one_launch(h, f, monkeypatch):
    """Family "mlp_one_launch": a dense MLP's token through the kernel as one slot (id 0, weight 1)
    of one-expert views of its blocks, at the real dense shapes. Its h against the two launches'
    GeGLU product (gate|up kernel): at most one bf16 step apart, in few entries; its output against
    float64 from its own h (W_down @ h): bf16 rounding plus f32 sums; the op (q4_0_mlp_one_launch)
    gives that output, and the same bits on a second call (the counters were reset), where its
    shared memory is within MLP_SHARED_LIMIT, and None above it."""
    rng = np.random.default_rng(h + f)
    gu = mx.array(qm.random_blocks(rng, qm.Q4_0, (2 * f,), h))
    dn = mx.array(qm.random_blocks(rng, qm.Q4_0, (h,), f))
    x = mx.array(rng.standard_normal((1, 1, h)).astype(np.float32)).astype(mx.bfloat16)
    hidden = np.array(qm.gate_up(x, gu, qm.Q4_0, f).astype(mx.float32)).astype(np.float64).reshape(-1)
    ids, wts = mx.array(np.zeros((1, 1, 1), np.int32)), mx.array(np.ones((1, 1, 1), np.float32))
    out, h_k = me.launch_moe_experts(x, ids, wts, gu[None], dn[None], me.new_counters(), f)
    h_got = np.array(h_k.astype(mx.float32)).astype(np.float64).reshape(-1)
    step = np.abs(hidden) * 2.0**-7 + 1e-30  # one bf16 step at the value
    assert np.isfinite(h_got).all() and (np.abs(h_got - hidden) <= step).all()
    assert (h_got != hidden).mean() <= 0.01, f"{(h_got != hidden).mean():.2%} of h differs"
    d64 = qm.dequantize_f64(np.array(dn), qm.Q4_0)
    want, bound = d64 @ h_got, np.abs(d64) @ np.abs(h_got)
    got = np.array(out.astype(mx.float32)).astype(np.float64).reshape(-1)
    assert np.isfinite(got).all()
    assert (np.abs(got - want) <= 2.0**-8 * np.abs(want) + 1e-5 * bound.max()).all()  # as the registry cases
    monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "mlp_one_launch")
    counters = me.new_counters()
    one = me.q4_0_mlp_one_launch(x, gu[None], dn[None], counters, f)
    if me.shared_bytes(1, f, h) > me.MLP_SHARED_LIMIT:  # E4B, 12B: the op keeps the two launches
        assert one is None
        return
    again = me.q4_0_mlp_one_launch(x, gu[None], dn[None], counters, f)
    assert one is not None and one.shape == (1, 1, h) and one.dtype == mx.bfloat16
    for a in (one, again):
        np.testing.assert_array_equal(np.array(a.astype(mx.float32)).reshape(-1), got)


@pytest.mark.parametrize("experts, slots, cfg", [(128, 8, None), (128, 8, me.MoeConfig(2, 8)), (45, 3, None)],
                         ids=["26B-A4B", "26B-A4B-8warps", "45-experts"])  # fmt: skip
def test_routed_launch_equals_route_then_experts(experts, slots, cfg, monkeypatch):
    """Family "moe_route_fold": the route folded into the expert launch gives the bits of
    router.route_logits then q4_0_moe_experts (the same sums in the same order), at 26B-A4B's
    shapes (128 experts, top 8, H 2816, F 704); its logits, ids and weights too; the same bits on
    a second and third call (the counters were reset), and a chain of dependent calls in one graph."""
    from custom_kernels import router

    rng = np.random.default_rng(experts + slots)
    gu = mx.array(qm.random_blocks(rng, qm.Q4_0, (experts, 2 * F), H))
    dn = mx.array(qm.random_blocks(rng, qm.Q4_0, (experts, H), F))
    x = mx.array(rng.standard_normal((1, 1, H)).astype(np.float32)).astype(mx.bfloat16)
    xr = mx.array(rng.standard_normal((1, 1, H)).astype(np.float32)).astype(mx.bfloat16)
    wr = mx.array((rng.standard_normal((experts, H)) * 0.05).astype(np.float32)).astype(mx.bfloat16)
    scale = mx.array(rng.uniform(0.5, 2.0, experts).astype(np.float32))
    wts, ids = router.route_logits(xr, wr, scale, slots, router.new_router_counters())
    want = me.launch_moe_experts(x, ids, wts, gu, dn, me.new_counters(), F, cfg)[0]
    counters = me.new_routed_counters()
    out, h, logits, w_k, ids_k = me.launch_moe_routed(x, xr, wr, scale, slots, gu, dn, counters, F, cfg)
    np.testing.assert_array_equal(np.array(ids_k), np.array(ids).reshape(-1))
    np.testing.assert_array_equal(np.array(w_k), np.array(wts).reshape(-1))
    np.testing.assert_array_equal(np.array(logits.astype(mx.float32)),
                                  np.array(router.router_logits(xr, wr).astype(mx.float32)).reshape(-1))  # fmt: skip
    got = np.array(out.astype(mx.float32))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, np.array(want.astype(mx.float32)))
    for _ in range(2):
        again = me.launch_moe_routed(x, xr, wr, scale, slots, gu, dn, counters, F, cfg)[0]
        np.testing.assert_array_equal(np.array(again.astype(mx.float32)), got)
    if cfg is None:  # the op, and a chain: each call's output is the next one's x and router input
        monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "moe_route_fold")
        y, z = x, x
        for _ in range(3):
            y = me.q4_0_moe_routed(y, y, wr, scale, slots, gu, dn, counters, F)
            w_c, i_c = router.route_logits(z, wr, scale, slots, router.new_router_counters())
            z = me.q4_0_moe_experts(z, i_c, w_c, gu, dn, me.new_counters(), F)
        np.testing.assert_array_equal(np.array(y.astype(mx.float32)), np.array(z.astype(mx.float32)))
