"""custom_kernels.router on the CPU: the MLX reference against the float64 oracle (ties to the
lower index), argument checks, and the model's Router keeping its MLX path unless the family is on."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from custom_kernels import router as rt


@pytest.mark.parametrize("e,k,ties", [(128, 8, False), (128, 8, True), (45, 5, False), (8, 8, True)])
def test_reference_matches_oracle(e, k, ties):
    rng = np.random.default_rng(e + k)
    x = (rng.standard_normal((6, e)) * 3).astype(np.float32)
    if ties:
        x[:, 1::3] = x[:, 0:1]
    scale = rng.uniform(0.5, 2.0, e).astype(np.float32)
    want_w, want_i = rt.route_f64(x, scale, k)
    w, i = rt.route(mx.array(x), mx.array(scale), k)  # the reference on CPU builds
    assert w.dtype == mx.float32 and i.dtype == mx.int32 and w.shape == i.shape == (6, k)
    assert np.array_equal(np.array(i), want_i)
    assert np.allclose(np.array(w), want_w, rtol=1e-5, atol=1e-7)


def test_leading_dims_and_errors():
    x = mx.random.normal((2, 3, 16))
    w, i = rt.route(x, mx.ones((16,)), 4)
    assert w.shape == i.shape == (2, 3, 4)
    for bad, match in (((x, mx.ones((15,)), 4), "per_expert_scale"), ((x, mx.ones((16,)), 0), "top_k"),
                       ((x, mx.ones((16,)), 17), "top_k")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            rt.route(*bad)


def test_router_same_experts_as_its_mlx_path():
    """The model's Router (MLX path) and the op's reference choose the same experts with the same
    weights (the MLX path's argpartition leaves them unordered)."""
    from gemma4_mlx.model import Router

    class Cfg:
        top_k_experts, rms_norm_eps, hidden_size, num_experts = 4, 1e-6, 64, 16

    r = Router(Cfg())
    r.proj.weight = mx.random.normal((16, 64)) * 0.3
    r.per_expert_scale = mx.random.uniform(0.5, 2.0, (16,))
    h = mx.random.normal((3, 64))
    w, i = r(h)
    logits = r.proj(mx.fast.rms_norm(h, None, r.eps) * r.scale * r.root)
    w2, i2 = rt.route_reference(logits, r.per_expert_scale, 4)
    for row in range(3):
        got = dict(zip(np.array(i[row]).tolist(), np.array(w[row]).tolist()))
        want = dict(zip(np.array(i2[row]).tolist(), np.array(w2[row]).tolist()))
        assert got.keys() == want.keys()
        assert all(abs(got[e] - want[e]) <= 1e-6 * abs(want[e]) + 1e-7 for e in want)


def test_kernel_dispatch_keeps_lead_dims(monkeypatch):
    """The GPU dispatch hands the kernel [..., E] logits as they are and gets [..., k] outputs (no
    reshape nodes): run through the Metal emulator, it gives the oracle's choice for every row."""
    from pathlib import Path

    import custom_kernels

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))  # tests/metal_emulator
    from metal_emulator import metal_kernel

    monkeypatch.setattr(custom_kernels, "backend", lambda: "metal")
    monkeypatch.setattr(mx.fast, "metal_kernel", metal_kernel)
    custom_kernels.clear_kernel_cache()
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((2, 3, 45)) * 3).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, 45).astype(np.float32)
    try:
        w, i = rt.route(mx.array(x), mx.array(scale), 5)
        mx.eval(w, i)
    finally:
        custom_kernels.clear_kernel_cache()
    assert w.shape == i.shape == (2, 3, 5)
    want_w, want_i = rt.route_f64(x.reshape(6, 45), scale, 5)
    assert np.array_equal(np.array(i).reshape(6, 5), want_i)
    assert np.allclose(np.array(w).reshape(6, 5), want_w, rtol=1e-5, atol=1e-7)


def test_router_logits_reference_and_errors():
    x = mx.random.normal((2, 3, 64)).astype(mx.bfloat16)
    w = (mx.random.normal((10, 64)) * 0.1).astype(mx.bfloat16)
    assert mx.array_equal(rt.router_logits(x, w), x @ w.T)  # the reference on CPU builds
    with pytest.raises(ValueError, match="w \\[E, H\\]"):
        rt.router_logits(x, w[:, :32])


def test_router_logits_dispatch_and_router_wiring(monkeypatch):
    """The projection kernel through its GPU dispatch on the Metal emulator: [..., E] logits in x's
    dtype within bf16 rounding of float64; with family "router_proj" the model's Router routes
    through it to the experts of its MLX path."""
    from pathlib import Path

    import custom_kernels
    from gemma4_mlx import model as model_module

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))  # tests/metal_emulator
    from metal_emulator import metal_kernel

    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 2, 132)).astype(np.float32)
    w = (rng.standard_normal((9, 132)) * 0.1).astype(np.float32)
    xb, wb = mx.array(x).astype(mx.bfloat16), mx.array(w).astype(mx.bfloat16)
    want = np.array(xb.astype(mx.float32)).astype(np.float64) @ np.array(wb.astype(mx.float32)).astype(np.float64).T
    h = mx.array(rng.standard_normal((1, 3, 132)).astype(np.float32))  # f32 router: logits stay a float dtype

    from gemma4_mlx.model import Router

    class Cfg:
        top_k_experts, rms_norm_eps, hidden_size, num_experts = 3, 1e-6, 132, 9

    router = Router(Cfg())
    router.proj.weight = mx.array(w)
    w_mlx, i_mlx = router(h)
    monkeypatch.setattr(custom_kernels, "backend", lambda: "metal")
    launched = []

    def as_mlx(*args, **kwargs):  # the emulator returns numpy arrays (bf16 as uint16 bits)
        kernel = metal_kernel(*args, **kwargs)
        name = kwargs.get("name", args[0] if args else "")
        return lambda **call: launched.append(name) or [mx.array(o) for o in kernel(**call)]

    monkeypatch.setattr(mx.fast, "metal_kernel", as_mlx)
    custom_kernels.clear_kernel_cache()
    calls = []
    monkeypatch.setattr(model_module, "router_logits", lambda *a: calls.append(1) or rt.router_logits(*a))
    monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "router_proj")
    try:
        got = rt.router_logits(xb, wb)
        mx.eval(got)
        w_k, i_k = router(h)
        mx.eval(w_k, i_k)
    finally:
        custom_kernels.clear_kernel_cache()
    got = got.view(mx.bfloat16)
    assert got.shape == (1, 2, 9)
    assert np.allclose(np.array(got.astype(mx.float32)), want, rtol=2**-8, atol=1e-3)
    assert calls == [1] and sum(n.startswith("g4_router_logits") for n in launched) == 2  # both calls ran it
    for t in range(3):  # same experts (the MLX path's order is argpartition's), same weights
        got_e = dict(zip(np.array(i_k[0, t]).tolist(), np.array(w_k[0, t]).tolist()))
        want_e = dict(zip(np.array(i_mlx[0, t]).tolist(), np.array(w_mlx[0, t]).tolist()))
        assert got_e.keys() == want_e.keys()
        assert all(abs(got_e[e] - want_e[e]) <= 1e-5 * abs(want_e[e]) for e in want_e)


def _recording_cuda_kernel(seen: list):
    """A stand-in for mx.fast.cuda_kernel: its kernels record each call's arguments in `seen` and
    return zeros of the requested outputs."""

    def make(**kw):
        def launch(**call):
            seen.append(call)
            return [mx.zeros(s, d) for s, d in zip(call["output_shapes"], call["output_dtypes"])]

        return launch

    return make


def test_route_logits_falls_back_and_checks_counters(monkeypatch):
    """route_logits: off CUDA (here) the two ops; on CUDA one launch with the template, grid and
    outputs the kernel expects (a stand-in MLX kernel records them); wrong counters refused."""
    import custom_kernels

    rng = np.random.default_rng(8)
    x = mx.array(rng.standard_normal((1, 2, 64)).astype(np.float32))
    w = mx.array((rng.standard_normal((9, 64)) * 0.2).astype(np.float32))
    scale = mx.array(rng.uniform(0.5, 2.0, 9).astype(np.float32))
    counters = rt.new_router_counters()
    got = rt.route_logits(x, w, scale, 3, counters)
    want = rt.route(rt.router_logits(x, w), scale, 3)
    assert all(mx.array_equal(a, b) for a, b in zip(got, want)) and not rt.route_logits_supported(x, w, 3)
    seen = []
    stand_in = _recording_cuda_kernel(seen)
    monkeypatch.setattr(custom_kernels, "backend", lambda: "cuda")
    monkeypatch.setattr(rt, "backend", lambda: "cuda")
    monkeypatch.setattr(mx.fast, "cuda_kernel", stand_in)
    custom_kernels.clear_kernel_cache()
    try:
        assert rt.route_logits_supported(x, w, 3) and not rt.route_logits_supported(mx.zeros((9, 64)), w, 3)
        wts, idx = rt.route_logits(x, w, scale, 3, counters)
        with pytest.raises(ValueError, match="counters must be uint32"):
            rt.route_logits(x, w, scale, 3, mx.zeros((8,), mx.int32))
    finally:
        custom_kernels.clear_kernel_cache()
    (call,) = seen
    assert wts.shape == idx.shape == (1, 2, 3) and wts.dtype == mx.float32 and idx.dtype == mx.int32
    assert call["inputs"][3] is counters and call["output_shapes"][0] == (1, 2, 9)
    assert dict(call["template"])["EPL"] == 1 and dict(call["template"])["K"] == 3 and dict(call["template"])["H"] == 64
    assert call["grid"] == (32 * 4 * 3, 2, 1) and call["threadgroup"] == (128, 1, 1)


def test_router_with_router_fused_wiring(monkeypatch):
    """Family "router_fused" routes a Router through route_logits where that runs in one launch
    (here its two-op fallback stands in), to the experts of the default path; elsewhere the Router
    keeps its router_proj / MLX path."""
    from gemma4_mlx import model as model_module
    from gemma4_mlx.model import Router

    class Cfg:
        top_k_experts, rms_norm_eps, hidden_size, num_experts = 3, 1e-6, 64, 9

    router = Router(Cfg())
    router.proj.weight = mx.random.normal((9, 64)) * 0.2
    assert "_counters" not in router.parameters()
    h = mx.random.normal((1, 4, 64))
    want = router(h)
    calls = []
    monkeypatch.setattr(model_module, "route_logits", lambda *a: calls.append(a[4]) or rt.route_logits(*a))
    monkeypatch.setattr(model_module, "use_kernel", lambda family: family in ("router_fused", "router"))
    router(h)
    assert not calls  # a call route_logits would not run in one launch keeps the Router's own path
    monkeypatch.setattr(model_module, "route_logits_supported", lambda *a: True)
    got = router(h)
    assert len(calls) == 1 and calls[0] is router._counters
    for t in range(4):  # the MLX path's top-k comes unordered
        a = dict(zip(np.array(got[1][0, t]).tolist(), np.array(got[0][0, t]).tolist()))
        b = dict(zip(np.array(want[1][0, t]).tolist(), np.array(want[0][0, t]).tolist()))
        assert a.keys() == b.keys() and all(abs(a[e] - b[e]) <= 1e-5 * abs(b[e]) for e in b)


def test_norm_route_registry_cases_agree_with_the_reference():
    """g4_residual_norm_route's cases: residual_norm_route_reference (MLX ops) on the same inputs
    gives their out, x, x2, logits and weights within each output's tolerance, the ids exactly."""
    from custom_kernels.registry import bf16_to_f32

    spec = next(s for s in rt.kernel_specs() if s.name == "g4_residual_norm_route")
    cases = spec.cases(np.random.default_rng(0))
    assert len(cases) == 5 and not spec.metal_source
    for case in cases:
        assert list(case.inputs) == list(spec.input_names)
        val = {n: mx.array(bf16_to_f32(v)).astype(mx.bfloat16) if case.input_dtypes.get(n) == "bfloat16" else mx.array(v)
               for n, v in case.inputs.items()}  # fmt: skip
        d = dict(case.template)
        got = rt.residual_norm_route_reference(val["h"], val["a"], val["w_a"], val["w_next"], val["w_next2"],
                                               val["r_scale"], float(val["r_root"][0].item()), float(val["eps"][0].item()),
                                               val["w"], val["e_scale"], d["K"])  # fmt: skip
        _, _, _, xr = rt.residual_norm_moe_reference(val["h"], val["a"], val["w_a"], val["w_next"], val["w_next2"],
                                                     val["r_scale"], float(val["r_root"][0].item()), float(val["eps"][0].item()))  # fmt: skip
        logits = rt.router_logits_reference(xr, val["w"])
        np.testing.assert_array_equal(np.array(got[4]).reshape(-1), case.expected[5].reshape(-1))
        for i, arr in zip((0, 1, 2, 3, 4), (got[0], got[1], got[2], logits, got[3])):
            want = case.expected[i]
            have = np.array(arr.astype(mx.float32)).reshape(want.shape)
            rtol, atol = case.tolerance(i)
            assert (np.abs(have - want) <= atol + rtol * np.abs(want)).all(), (case.label, spec.output_names[i])


def test_residual_norm_route_routing_on_faked_cuda(monkeypatch):
    """residual_norm_route (family "norm_route", opt-in): None with the family or one it needs off,
    on a CPU build, for two tokens, a router of another dtype, top_k past E and past the launch's
    register limits (E, top_k); on (faked) CUDA one launch with the
    norms' and the route's template, E / (TG / 32) threadgroups, the router's counters last and
    out, x, x2, weights, ids back; wrong counters or per-expert scales an error."""
    import custom_kernels

    rng = np.random.default_rng(12)
    h, a = (mx.array(rng.standard_normal((1, 1, 64)).astype(np.float32)) for _ in range(2))
    wv = [mx.array(rng.uniform(0.5, 2.0, 64).astype(np.float32)) for _ in range(4)]
    w = mx.array(rng.standard_normal((9, 64)).astype(np.float32))
    scale, counters = mx.ones((9,)), rt.new_router_counters()

    def call(h=h, a=a, w=w, k=3, scale=scale, counters=counters):
        return rt.residual_norm_route(h, a, wv[0], wv[1], wv[2], wv[3], 0.125, 1e-6, w, scale, k, counters)

    seen = []
    stand_in = _recording_cuda_kernel(seen)
    monkeypatch.setattr(mx.fast, "cuda_kernel", stand_in)
    monkeypatch.setattr(custom_kernels, "backend", lambda: "cuda")
    monkeypatch.setattr(rt, "backend", lambda: "cuda")
    custom_kernels.clear_kernel_cache()
    try:
        assert call() is None  # family off
        monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "norm_route")
        for needed in ("norm_moe", "router_fused", "router"):
            monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, needed)
            assert call() is None, needed
        monkeypatch.delenv(custom_kernels.KERNELS_OFF_ENV)
        assert call(h=mx.concatenate([h, h], 1), a=mx.concatenate([a, a], 1)) is None  # two tokens
        assert call(w=w.astype(mx.bfloat16)) is None and call(k=10) is None  # mixed dtypes, k > E
        assert not seen
        out, x, x2, wts, ids = call()
        with pytest.raises(ValueError, match="counters must be uint32"):
            call(counters=mx.zeros((8,), mx.int32))
        with pytest.raises(ValueError, match="per_expert_scale"):
            call(scale=mx.ones((8,)))
    finally:
        custom_kernels.clear_kernel_cache()
    (c,) = seen
    assert out.shape == x.shape == x2.shape == (1, 1, 64) and wts.shape == ids.shape == (1, 1, 3)
    assert wts.dtype == mx.float32 and ids.dtype == mx.int32 and c["inputs"][-1] is counters
    t = dict(c["template"])
    assert (t["D"], t["H"], t["TG"], t["QUADS"], t["E"], t["K"], t["EPL"], t["NEXT"], t["SCALE"], t["LPG"]) == (64, 64, 32, 1, 9, 3, 1, True, False, 1)
    assert c["grid"] == (32 * 9, 1, 1) and c["threadgroup"] == (32, 1, 1)
    assert c["output_shapes"][3] == (1, 1, 9) and c["output_dtypes"][3] == mx.float32
    wide = mx.zeros((rt.NORM_ROUTE_MAX_EXPERTS + 1, 64))
    assert call(w=wide, scale=mx.ones((wide.shape[0],))) is None
    k_past = rt.NORM_ROUTE_MAX_TOP_K + 1
    assert call(w=mx.zeros((k_past + 3, 64)), scale=mx.ones((k_past + 3,)), k=k_past) is None
    monkeypatch.setattr(rt, "backend", lambda: "cpu")
    assert call() is None  # a CPU build
