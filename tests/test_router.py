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
