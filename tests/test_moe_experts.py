"""CPU tests of custom_kernels.moe_experts: the op's fallback equals the two-op reference, the
registry cases' float64 expectations agree with that reference, launch plans, and routing on a
faked CUDA build (launch stubbed). The kernel itself runs in tests/test_moe_experts_gpu.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import custom_kernels
from custom_kernels import moe_experts as me
from custom_kernels import quant_matvec as qm
from custom_kernels.registry import bf16_to_f32


def _layer(rng, experts=6, f=64, h=256):
    gu = mx.array(qm.random_blocks(rng, qm.Q4_0, (experts, 2 * f), h))
    dn = mx.array(qm.random_blocks(rng, qm.Q4_0, (experts, h), f))
    return gu, dn


def test_cpu_op_is_the_two_op_reference():
    rng = np.random.default_rng(3)
    gu, dn = _layer(rng)
    x = mx.array(rng.standard_normal((1, 1, 256)).astype(np.float32)).astype(mx.bfloat16)
    ids = mx.array(np.array([[[4, 0, 2]]], np.int32))
    wts = mx.array(rng.random((1, 1, 3)).astype(np.float32))
    got = me.q4_0_moe_experts(x, ids, wts, gu, dn, me.new_counters(), 64)
    want = me.moe_experts_reference(x, ids, wts, gu, dn, 64)
    assert got.shape == (1, 1, 256) and got.dtype == mx.bfloat16
    assert np.array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))


def test_registry_cases_agree_with_the_reference():
    """Each case's float64 expectation (out and h) holds for the MLX reference on the same inputs,
    within the case's own tolerance; the out-of-range case expects NaN everywhere in out."""
    spec = next(s for s in me.kernel_specs() if s.name == "g4_q4_0_moe_experts")
    for case in spec.cases(np.random.default_rng(0)):
        assert list(case.inputs) == list(spec.input_names) and case.cuda_shared_memory > 0
        x = mx.array(bf16_to_f32(case.inputs["x"])).astype(mx.bfloat16)
        ids, wts = mx.array(case.inputs["ids"]), mx.array(case.inputs["wts"])
        gu, dn = mx.array(case.inputs["wgu"]), mx.array(case.inputs["wdn"])
        f = case.output_shapes[1][1]
        if np.isnan(case.expected[0]).all():
            assert (np.array(ids) >= gu.shape[0]).any()
            continue
        gelu = qm.gate_up_gather_reference(x, ids, gu, qm.Q4_0, f)
        out = qm.moe_down_reference(gelu, ids, wts, dn, qm.Q4_0, x.shape[-1])
        for got, want in ((out, case.expected[0]), (gelu.reshape(case.output_shapes[1]), case.expected[1])):
            got = np.array(got.astype(mx.float32)).reshape(want.shape)
            assert (np.abs(got - want) <= case.atol + case.rtol * np.abs(want)).all(), case.label


def test_routed_registry_cases_agree_with_the_reference():
    """g4_q4_0_moe_routed's cases: the MLX reference path on the same inputs (router projection,
    route, the experts' two ops) gives their logits, ids, weights, h and out within each output's
    tolerance; the ids exactly."""
    from custom_kernels import router

    spec = next(s for s in me.kernel_specs() if s.name == "g4_q4_0_moe_routed")
    cases = spec.cases(np.random.default_rng(0))
    assert len(cases) == 4
    for case in cases:
        assert list(case.inputs) == list(spec.input_names) and case.cuda_shared_memory > 0
        x = mx.array(bf16_to_f32(case.inputs["x"])).astype(mx.bfloat16)
        xr = mx.array(bf16_to_f32(case.inputs["xr"])).astype(mx.bfloat16)
        wr = mx.array(bf16_to_f32(case.inputs["router"])).astype(mx.bfloat16)
        logits = router.router_logits_reference(xr[None], wr)
        wts, ids = router.route_reference(logits, mx.array(case.inputs["scale"]), case.output_shapes[3][0])
        gu, dn = mx.array(case.inputs["wgu"]), mx.array(case.inputs["wdn"])
        gelu = qm.gate_up_gather_reference(x, ids, gu, qm.Q4_0, case.output_shapes[1][1])
        out = qm.moe_down_reference(gelu, ids, wts, dn, qm.Q4_0, x.shape[-1])
        np.testing.assert_array_equal(np.array(ids).reshape(-1), case.expected[4])
        for i, got in enumerate((out, gelu, logits, wts)):
            want = case.expected[i]
            got = np.array(got.astype(mx.float32)).reshape(want.shape)
            rtol, atol = case.tolerance(i)
            assert (np.abs(got - want) <= atol + rtol * np.abs(want)).all(), (case.label, spec.output_names[i])


def test_plans():
    plan, smem = me.plan_moe_experts(8, 704, 2816)  # 26B-A4B, default: 235 gate|up + 176 down tickets of 16 warps
    assert plan.grid == (411 * 512, 1, 1) and plan.threadgroup == (512, 1, 1)
    assert smem == 3 * 11 * 2304 + 2 * 2816 + 16  # the gate|up pieces and x set it
    assert dict(plan.template)["SMEM"] == smem  # each shared size its own instantiation
    plan, smem = me.plan_moe_experts(8, 704, 2816, me.MoeConfig(sets=2, warps=8))  # 352 + 176 tickets
    assert plan.grid == (528 * 256, 1, 1) and plan.threadgroup == (256, 1, 1) and dict(plan.template)["NW"] == 8
    assert smem == 8 * (16 * 396 + 2 * 704) + 16 > 2 * 11 * 2304 + 2 * 2816 + 16  # the down rows and h set it
    assert me.plan_moe_experts(2, 96, 256)[1] == 3 * 2304 + 2 * 256 + 16 > 2 * (16 * 54 + 2 * 96) + 16
    plan, smem = me.plan_moe_experts(3, 64, 256, me.MoeConfig(sets=2, warps=16))  # 24 sets -> 12 tickets, 16 down tickets
    assert plan.grid == (28 * 512, 1, 1) and plan.threadgroup == (512, 1, 1) and dict(plan.template)["NW"] == 16
    with pytest.raises(ValueError, match="at most 8"):
        me.plan_moe_experts(9, 704, 2816)
    with pytest.raises(ValueError, match="H % 256"):
        me.plan_moe_experts(8, 704, 2880)
    with pytest.raises(ValueError, match="F % 32"):
        me.plan_moe_experts(8, 80, 2816)
    with pytest.raises(ValueError, match="shared memory"):
        me.plan_moe_experts(8, 4096, 2816)  # the staged down rows would not fit
    with pytest.raises(ValueError, match="sets"):
        me.MoeConfig(sets=5)
    with pytest.raises(ValueError, match="warps"):
        me.MoeConfig(warps=4)


def test_routing_on_faked_cuda(monkeypatch):
    """Faked CUDA (launch stubbed): the kernel by default (a CUDA default since session 20) for bf16,
    one token, at most 8 slots, H % 256 == 0 and F % 32 == 0; the two ops otherwise, with the family
    in KERNELS_OFF, and on Metal, opted in or not (no Metal text). Bad counters are an error."""
    rng = np.random.default_rng(4)
    gu, dn = _layer(rng)
    calls = []
    monkeypatch.setattr(me, "backend", lambda: "cuda")
    monkeypatch.setattr(custom_kernels, "backend", lambda: "cuda")
    monkeypatch.setattr(me, "cuda_arch", lambda: 90)
    monkeypatch.setattr(me, "launch_moe_experts", lambda x, *a, **k: calls.append(x.shape) or (mx.zeros(x.shape, x.dtype), None))
    monkeypatch.setattr(me, "q4_0_gate_up_gather", lambda x, ids, *a: calls.append("gate_up") or x)
    monkeypatch.setattr(me, "q4_0_moe_down", lambda x, *a: calls.append("down") or x)
    for env in (custom_kernels.KERNELS_OFF_ENV, custom_kernels.KERNELS_ENV, custom_kernels.UNPROVEN_ENV):
        monkeypatch.delenv(env, raising=False)
    x = mx.zeros((1, 256), mx.bfloat16)
    ids, wts = mx.array(np.array([[1, 2]], np.int32)), mx.ones((1, 2))
    me.q4_0_moe_experts(x, ids, wts, gu, dn, me.new_counters(), 64)
    assert calls == [(1, 256)]  # a CUDA default
    me.q4_0_moe_experts(x.astype(mx.float32), ids, wts, gu, dn, me.new_counters(), 64)  # f32: two ops
    me.q4_0_moe_experts(mx.zeros((2, 256), mx.bfloat16), mx.array(np.array([[1, 2], [0, 3]], np.int32)),
                        mx.ones((2, 2)), gu, dn, me.new_counters(), 64)  # two tokens: two ops  # fmt: skip
    assert calls == [(1, 256)] + ["gate_up", "down"] * 2
    calls.clear()
    gu96, dn96 = _layer(rng, f=96)  # F = 96 (the MoE fixture's): the kernel
    me.q4_0_moe_experts(x, ids, wts, gu96, dn96, me.new_counters(), 96)
    assert calls == [(1, 256)]
    calls.clear()
    gu10, dn10 = _layer(rng, experts=10)  # 9 slots, and H = 288 (not a multiple of 256): two ops
    me.q4_0_moe_experts(x, mx.array(np.arange(9, dtype=np.int32)[None]), mx.ones((1, 9)), gu10, dn10, me.new_counters(), 64)
    gu288, dn288 = _layer(rng, h=288)
    me.q4_0_moe_experts(mx.zeros((1, 288), mx.bfloat16), ids, wts, gu288, dn288, me.new_counters(), 64)
    assert calls == ["gate_up", "down"] * 2
    calls.clear()
    monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, "moe_one_launch")
    me.q4_0_moe_experts(x, ids, wts, gu, dn, me.new_counters(), 64)
    monkeypatch.delenv(custom_kernels.KERNELS_OFF_ENV)
    monkeypatch.setattr(me, "backend", lambda: "metal")
    monkeypatch.setattr(custom_kernels, "backend", lambda: "metal")
    me.q4_0_moe_experts(x, ids, wts, gu, dn, me.new_counters(), 64)  # CUDA_ONLY: off on Metal
    monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "moe_one_launch")
    me.q4_0_moe_experts(x, ids, wts, gu, dn, me.new_counters(), 64)  # opted in, but no Metal text
    assert calls == ["gate_up", "down"] * 3
    monkeypatch.setattr(me, "backend", lambda: "cuda")
    monkeypatch.setattr(custom_kernels, "backend", lambda: "cuda")
    with pytest.raises(ValueError, match="counters"):
        me.q4_0_moe_experts(x, ids, wts, gu, dn, mx.zeros((4,), mx.int32), 64)


def test_bad_inputs_are_clear_errors():
    """Stacks of the wrong shape or dtype, ids of another dtype or weights of another shape: a
    ValueError naming what was expected, before any launch (a wrong stack would be read out of
    bounds by the kernel)."""
    rng = np.random.default_rng(6)
    gu, dn = _layer(rng)
    x = mx.zeros((1, 256), mx.bfloat16)
    ids, wts = mx.array(np.array([[1, 2]], np.int32)), mx.ones((1, 2))
    for bad in ((x, ids, wts, gu[:, :100], dn), (x, ids, wts, gu, dn[:, :, :30]), (x, ids, wts, gu, dn.astype(mx.int8)),
                (x, ids.astype(mx.int64), wts, gu, dn), (x, ids, mx.ones((1, 3)), gu, dn),
                (mx.zeros((1, 512), mx.bfloat16), ids, wts, gu, dn)):  # fmt: skip
        with pytest.raises(ValueError, match="moe_experts"):
            me.q4_0_moe_experts(*bad, me.new_counters(), 64)


def test_geometry_override(monkeypatch):
    """GEMMA4_MLX_MOE_GEOMETRY=sets=N,warps=W picks the gate|up sets per ticket and the warps per
    threadgroup (template values of the same text); bad values are errors."""
    class Planned(Exception):
        pass

    def plan(k, f, h, cfg):
        raise Planned(cfg.sets, cfg.warps)

    monkeypatch.setattr(me, "plan_moe_experts", plan)
    args = (mx.zeros((1, 256), mx.bfloat16), mx.zeros((1, 2), mx.int32), mx.ones((1, 2)), None, None, None, 64)
    for env, want in (("", (me.SETS, me.WARPS)), ("sets=1", (1, me.WARPS)), ("sets=3,warps=16", (3, 16))):
        monkeypatch.setenv(me.MOE_GEOMETRY_ENV, env)
        with pytest.raises(Planned) as got:
            me.launch_moe_experts(*args)
        assert got.value.args == want
    for bad in ("sets=0", "sets=5", "warps=4", "rows=2"):
        monkeypatch.setenv(me.MOE_GEOMETRY_ENV, bad)
        with pytest.raises(ValueError, match="GEMMA4_MLX_MOE_GEOMETRY"):
            me.launch_moe_experts(*args)


def _fake_cuda(monkeypatch):
    """A CUDA build on an sm_90 GPU, as far as custom_kernels and moe_experts can tell."""
    for mod in (me, custom_kernels):
        monkeypatch.setattr(mod, "backend", lambda: "cuda")
    monkeypatch.setattr(me, "cuda_arch", lambda: 90)
    monkeypatch.delenv(custom_kernels.KERNELS_ENV, raising=False)
    monkeypatch.delenv(custom_kernels.KERNELS_OFF_ENV, raising=False)
    monkeypatch.delenv(custom_kernels.UNPROVEN_ENV, raising=False)


def test_mlp_one_launch_routing_on_faked_cuda(monkeypatch):
    """q4_0_mlp_one_launch (family "mlp_one_launch", opt-in): None with the family off, on a CPU
    build, for two tokens or f32; with it on under faked CUDA, one launch of the expert kernel with
    one slot (id 0, weight 1) on the one-expert stacks."""
    rng = np.random.default_rng(5)
    gu, dn = _layer(rng, experts=1, f=128)
    x, counters = mx.zeros((1, 1, 256), mx.bfloat16), me.new_counters()
    _fake_cuda(monkeypatch)
    assert me.q4_0_mlp_one_launch(x, gu, dn, counters, 128) is None  # family off
    monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "mlp_one_launch")
    monkeypatch.setattr(me, "backend", lambda: "cpu")
    assert me.q4_0_mlp_one_launch(x, gu, dn, counters, 128) is None  # the op's own check: a CPU build
    monkeypatch.setattr(me, "backend", lambda: "cuda")
    calls = []

    def launch(x, ids, wts, *a, **k):
        calls.append((np.array(ids).tolist(), np.array(wts).tolist()))
        return mx.zeros(x.shape, x.dtype), None

    monkeypatch.setattr(me, "launch_moe_experts", launch)
    assert me.q4_0_mlp_one_launch(x, gu, dn, counters, 128).shape == (1, 1, 256)
    assert calls == [([[[0]]], [[[1.0]]])]
    assert me.q4_0_mlp_one_launch(mx.zeros((1, 2, 256), mx.bfloat16), gu, dn, counters, 128) is None
    assert me.q4_0_mlp_one_launch(x.astype(mx.float32), gu, dn, counters, 128) is None
    assert len(calls) == 1
    # one threadgroup per SM (E4B's F = 10240) lost to the two launches; 26B-A4B's and E2B's fit two
    assert me.shared_bytes(1, 10240, 2560) > me.MLP_SHARED_LIMIT >= max(me.shared_bytes(1, 2112, 2816), me.shared_bytes(1, 6144, 1536))
    limit = me.MLP_SHARED_LIMIT
    monkeypatch.setattr(me, "MLP_SHARED_LIMIT", me.shared_bytes(1, 128, 256) - 1)
    assert me.q4_0_mlp_one_launch(x, gu, dn, counters, 128) is None and len(calls) == 1
    monkeypatch.setattr(me, "MLP_SHARED_LIMIT", limit)
    assert me.q4_0_mlp_one_launch(x, gu, dn, counters, 128) is not None and len(calls) == 2
    monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, "moe_one_launch")  # the kernel it launches, off
    assert me.q4_0_mlp_one_launch(x, gu, dn, counters, 128) is None and len(calls) == 2


def test_fuse_projections_gives_q4_0_mlps_their_stacks(graph_count):  # the fixture puts bench/ on the path
    """quantized.fuse_projections: a Q4_0 MLP gets `one_launch` (MLPStacks) whose stacks are its
    blocks as one-expert views; replacing a module's blocks (load_weights) turns it off."""
    import decode

    model = decode.build_ours(decode._tiny(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]))
    mlp = model.model.layers[0].mlp
    stacks = mlp.one_launch
    assert stacks.gate_up.one_expert.shape == (1, *mlp.gate_up_proj.blocks.shape)
    assert stacks.down_stack.shape == (1, *mlp.down_proj.blocks.shape)
    np.testing.assert_array_equal(np.array(stacks.down_stack[0]), np.array(mlp.down_proj.blocks))
    assert stacks.intact() and stacks(mx.zeros((1, 1, 256), mx.bfloat16)) is None  # the family is off
    mlp.down_proj.blocks = mx.array(np.array(mlp.down_proj.blocks))
    assert not stacks.intact()


def test_moe_routed_routing_on_faked_cuda(monkeypatch):
    """q4_0_moe_routed (family "moe_route_fold", opt-in): None with the family off (or
    moe_one_launch / router_fused / router off), on a CPU build, for two tokens, f32, a router of
    another width or top_k above E; with it on under faked CUDA, one launch with the router's weight, scale and top-k."""
    rng = np.random.default_rng(9)
    gu, dn = _layer(rng, experts=6, f=64)
    x, wr = mx.zeros((1, 1, 256), mx.bfloat16), mx.zeros((6, 256), mx.bfloat16)
    scale, counters = mx.ones((6,)), me.new_routed_counters()
    args = (wr, scale, 2, gu, dn, counters, 64)
    _fake_cuda(monkeypatch)
    assert me.q4_0_moe_routed(x, x, *args) is None  # family off
    monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "moe_route_fold")
    monkeypatch.setattr(me, "backend", lambda: "cpu")
    assert me.q4_0_moe_routed(x, x, *args) is None  # the op's own check: a CPU build
    monkeypatch.setattr(me, "backend", lambda: "cuda")
    calls = []

    def launch(x, xr, w, s, k, *a, **kw):
        calls.append((w is wr, s is scale, k))
        return (mx.zeros(x.shape, x.dtype),)

    monkeypatch.setattr(me, "launch_moe_routed", launch)
    assert me.q4_0_moe_routed(x, x, *args).shape == (1, 1, 256) and calls == [(True, True, 2)]
    two = mx.zeros((1, 2, 256), mx.bfloat16)
    assert me.q4_0_moe_routed(two, two, *args) is None
    assert me.q4_0_moe_routed(x.astype(mx.float32), x.astype(mx.float32), *args) is None
    assert me.q4_0_moe_routed(x, x, mx.zeros((6, 128), mx.bfloat16), *args[1:]) is None
    assert me.q4_0_moe_routed(x, x, wr[:1], scale[:1], 2, gu[:1], dn[:1], counters, 64) is None  # top_k > E
    assert me.q4_0_moe_routed(x, x, wr, scale, 0, gu, dn, counters, 64) is None  # top_k 0
    for bad in ((wr[:5], scale), (wr, scale[:5])):  # router and stacks disagree on E: an error, not a fallback
        with pytest.raises(ValueError, match="moe_routed"):
            me.q4_0_moe_routed(x, x, *bad, 2, gu, dn, counters, 64)
    with pytest.raises(ValueError, match="new_routed_counters"):
        me.q4_0_moe_routed(x, x, *args[:5], me.new_counters(), 64)
    for off in ("moe_one_launch", "router_fused", "router"):
        monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, off)
        assert me.q4_0_moe_routed(x, x, *args) is None
    assert len(calls) == 1
