"""GPU: the one-launch projection + residual norm (custom_kernels.matvec_norm, CUDA only) against
the two launches it replaces, at the decode shapes that take it. Run with ``pytest -m gpu``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import custom_kernels
from custom_kernels import matvec_norm as mn
from custom_kernels import norm
from custom_kernels import quant_matvec as qm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(custom_kernels.backend() != "cuda", reason="the matvec_norm kernels are CUDA only"),
]

# (name, N, K): E4B's o_proj, FFN down and per-layer projection, 12B's o_proj
SHAPES = [("E4B o_proj", 2560, 2048), ("E4B down", 2560, 10240), ("E4B per-layer", 2560, 256), ("12B o_proj", 3840, 4096)]


@pytest.mark.parametrize("name, n, k", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("ggml_type", [qm.Q4_0, qm.Q8_0], ids=["q4_0", "q8_0"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_one_launch_equals_the_two(name, n, k, ggml_type, dtype, monkeypatch):
    """out and the next norm's input as quant_matvec then residual_norm give them, up to the f32
    order of the norm's two sums (1 bf16 ulp); with and without the layer scalar and the next norm;
    one counters array for every call (each call's last threadgroup sets it back to zero). The
    tiles family is off: on Hopper it takes 12B's o_proj at bf16 (test below), and this kernel
    replaces only the split-K one."""
    monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "matvec_norm")
    monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, "quant_matvec_tiles")
    rng = np.random.default_rng(n + k + ggml_type)
    blocks = mx.array(qm.random_blocks(rng, ggml_type, (n,), k))
    counters = mn.new_matvec_norm_counters()
    rtol, atol = (2**-7, 2**-7) if dtype == mx.bfloat16 else (1e-5, 1e-5)
    for scale_on, next_on in ((True, True), (False, True), (True, False)):
        y = mx.array(rng.standard_normal((1, 1, k)).astype(np.float32)).astype(dtype)
        h = mx.array((rng.standard_normal((1, 1, n)) * 2).astype(np.float32)).astype(dtype)
        w_a, w_n = (mx.array((1 + 0.3 * rng.standard_normal(n)).astype(np.float32)).astype(dtype) for _ in range(2))
        scale = mx.array([0.8], dtype=dtype) if scale_on else None
        w_next = w_n if next_on else None
        assert mn.matvec_norm_supported(y, ggml_type, n, h, w_a, w_next, scale), name
        got = mn.matvec_residual_norm(y, blocks, ggml_type, n, h, w_a, w_next, 1e-6, scale, counters)
        want = norm.residual_norm(h, qm.quant_matvec(y, blocks, ggml_type, n), w_a, w_next, 1e-6, scale)
        for g, w, what in zip(got, want, ("out", "x")):
            if w is None:
                assert g is None
                continue
            assert g.shape == w.shape and g.dtype == w.dtype
            gv, wv = (np.array(a.astype(mx.float32)) for a in (g, w))
            assert np.isfinite(gv).all(), f"{name} {what}: unwritten or non-finite"
            assert np.allclose(gv, wv, rtol=rtol, atol=atol), f"{name} {what}: max diff {np.abs(gv - wv).max():.3g}"
        assert not np.array(counters).any(), f"{name}: counters not reset"


def test_declines_rows_the_tiles_kernel_takes(monkeypatch):
    """12B's o_proj (Q4_0, bf16, K = 4096) goes to the tiles kernel on Hopper, so the one-launch
    form declines it and matvec_residual_norm gives the two ops' result."""
    monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "matvec_norm")
    n, k = 3840, 4096
    rng = np.random.default_rng(7)
    y = mx.array(rng.standard_normal((1, 1, k)).astype(np.float32)).astype(mx.bfloat16)
    if qm._dense_route(y, qm.Q4_0, n) != "tiles":
        pytest.skip("no tiles kernel on this GPU (Hopper only)")
    blocks = mx.array(qm.random_blocks(rng, qm.Q4_0, (n,), k))
    h = mx.array(rng.standard_normal((1, 1, n)).astype(np.float32)).astype(mx.bfloat16)
    w_a = w_n = mx.ones((n,), dtype=mx.bfloat16)
    assert not mn.matvec_norm_supported(y, qm.Q4_0, n, h, w_a, w_n, None)
    got = mn.matvec_residual_norm(y, blocks, qm.Q4_0, n, h, w_a, w_n, 1e-6, None, mn.new_matvec_norm_counters())
    want = norm.residual_norm(h, qm.quant_matvec(y, blocks, qm.Q4_0, n), w_a, w_n, 1e-6, None)
    for g, w in zip(got, want):
        assert np.array_equal(np.array(g.astype(mx.float32)), np.array(w.astype(mx.float32)))
