"""custom_kernels.matvec_norm on any machine: the two-op fallback, when the one launch applies, and
the kernel text it is built from (its GPU test: tests/test_matvec_norm_gpu.py; registry cases
compile with nvcc in tests/test_metal_compile.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import custom_kernels
from custom_kernels import matvec_norm as mn
from custom_kernels import norm
from custom_kernels import quant_matvec as qm
from custom_kernels.registry import all_kernel_specs


def _inputs(rng, n, k, dtype=mx.bfloat16, rows=1):
    y = mx.array(rng.standard_normal((rows, k)).astype(np.float32)).astype(dtype)
    h = mx.array(rng.standard_normal((rows, n)).astype(np.float32)).astype(dtype)
    w = mx.array((1 + 0.3 * rng.standard_normal(n)).astype(np.float32)).astype(dtype)
    return y, h, w


def test_fallback_is_the_two_ops():
    """Where the one launch does not apply (here: no GPU), the op is quant_matvec then residual_norm:
    against a float64 dequantize-then-matmul and the norm module's numpy oracle, with the layer
    scalar and the next norm, and without the next norm."""
    rng = np.random.default_rng(0)
    wq = qm.random_blocks(rng, qm.Q4_0, (64,), 256)
    blocks = mx.array(wq)
    y, h, w = _inputs(rng, 64, 256, dtype=mx.float32)
    w_next = mx.array((1 + 0.3 * rng.standard_normal(64)).astype(np.float32))
    scale = mx.array([0.5], dtype=mx.float32)
    counters = mn.new_matvec_norm_counters()
    a = (np.array(y).astype(np.float64) @ qm.dequantize_f64(wq, qm.Q4_0).T).astype(np.float32)
    for nxt in (w_next, None):
        out, x = mn.matvec_residual_norm(y, blocks, qm.Q4_0, 64, h, w, nxt, 1e-6, scale, counters)
        want_out, want_x = norm.residual_norm_np(np.array(h), a, np.array(w), None if nxt is None else np.array(nxt),
                                                 1e-6, 0.5)  # fmt: skip
        assert np.allclose(np.array(out), want_out, rtol=1e-4, atol=1e-4)
        assert (x is None) == (nxt is None)
        if nxt is not None:
            assert np.allclose(np.array(x), want_x, rtol=1e-4, atol=1e-4)
    assert not np.array(counters).any()


def test_when_the_one_launch_applies(monkeypatch):
    """On CUDA with the family on: one token of Q4_0 / Q8_0 rows on the split-K FMA route, one dtype,
    N a multiple of 4 within MAX_QUADS quads per thread; never on a CPU build or with the family off."""
    rng = np.random.default_rng(1)
    y, h, w = _inputs(rng, 2560, 2048)
    assert not mn.matvec_norm_supported(y, qm.Q4_0, 2560, h, w, w, None)  # CPU, family off
    for module in (custom_kernels, qm, mn, norm):
        monkeypatch.setattr(module, "backend", lambda: "cuda")
    monkeypatch.setattr(custom_kernels, "_device_arch", lambda: 90)
    assert not mn.matvec_norm_supported(y, qm.Q4_0, 2560, h, w, w, None)  # family off
    monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "matvec_norm")
    for t in (qm.Q4_0, qm.Q8_0):
        assert mn.matvec_norm_supported(y, t, 2560, h, w, w, None)
        assert mn.matvec_norm_supported(y, t, 2560, h, w, None, mx.array([0.5], dtype=mx.bfloat16))
    assert not mn.matvec_norm_supported(y, qm.Q6_K, 2560, h, w, w, None)
    y2, h2, _ = _inputs(rng, 2560, 2048, rows=2)
    assert not mn.matvec_norm_supported(y2, qm.Q4_0, 2560, h2, w, w, None)  # two tokens
    assert not mn.matvec_norm_supported(y, qm.Q4_0, 2560, h.astype(mx.float32), w, w, None)  # two dtypes
    yb, hb, wb = _inputs(rng, 4104, 2048)
    assert not mn.matvec_norm_supported(yb, qm.Q4_0, 4104, hb, wb, wb, None)  # 9 quads per thread
    yc, hc, wc = _inputs(rng, 2562, 2048)
    assert not mn.matvec_norm_supported(yc, qm.Q4_0, 2562, hc, wc, wc, None)  # N not a multiple of 4


def test_kernel_text():
    """g4_{q4_0,q8_0}_matvec_norm: CUDA only, the split-K dense kernel's text, then the ticket, then
    the residual-norm kernel's body reading the row back through L2 (and not through __ldg)."""
    specs = {s.name: s for s in all_kernel_specs()}
    for t, name in ((qm.Q4_0, "g4_q4_0_matvec_norm"), (qm.Q8_0, "g4_q8_0_matvec_norm")):
        spec = specs[name]
        assert not spec.metal_source and spec.input_names[-1] == "counters"
        assert spec.output_names == ("out", "hout", "xn")
        split = specs[name.replace("_norm", "_ksplit")].cuda_source
        assert spec.cuda_source.startswith(split.rstrip("\n").rsplit("\n", 1)[0])
        for needed in ("atomicAdd(done, 1u)", "g4_ldcg4(out + base + c", "hout[base + c + i]", "xn[base + c + i]"):
            assert needed in spec.cuda_source, needed
        assert "g4_load4(a + base" not in spec.cuda_source
        assert len(spec.cases(np.random.default_rng(0))) == 3


def test_counters_checked(monkeypatch):
    rng = np.random.default_rng(2)
    blocks = mx.array(qm.random_blocks(rng, qm.Q4_0, (64,), 256))
    y, h, w = _inputs(rng, 64, 256)
    monkeypatch.setattr(mn, "matvec_norm_supported", lambda *a: True)
    with pytest.raises(ValueError, match="counters must be uint32"):
        mn.matvec_residual_norm(y, blocks, qm.Q4_0, 64, h, w, w, 1e-6, None, mx.zeros((4,), mx.int32))
