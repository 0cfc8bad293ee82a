"""custom_kernels.prefetch: the L2 prefetch hint (family "l2_prefetch", opt-in, CUDA sm_90 only)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import custom_kernels
from custom_kernels import prefetch

cuda = pytest.mark.skipif(custom_kernels.cuda_arch() < 90, reason="needs an sm_90 CUDA device")


def test_plan_bounds():
    """At most MAX_BYTES, whole 16-byte words, one thread per CHUNK, whole threadgroups."""
    for nbytes in (15, 16, 1000, prefetch.CHUNK + 1, 5 * prefetch.MAX_BYTES):
        count, threads = prefetch._plan(nbytes)
        assert count == min(nbytes, prefetch.MAX_BYTES) // 16 * 16
        assert threads % prefetch.THREADS == 0 and threads * prefetch.CHUNK >= count
        assert (threads - prefetch.THREADS) * prefetch.CHUNK < count or count == 0


def test_no_kernel_off_cuda(monkeypatch):
    """Off an sm_90 CUDA device, and with the references forced, the op adds nothing to the graph."""
    w, after = mx.zeros((64, 18), mx.uint8), mx.ones((4,))
    monkeypatch.setattr(prefetch, "cuda_arch", lambda: 80)
    assert prefetch.l2_prefetch(w, after) is None
    monkeypatch.setattr(prefetch, "cuda_arch", lambda: 90)
    monkeypatch.setenv(custom_kernels.KERNELS_ENV, "reference")
    assert prefetch.l2_prefetch(w, after) is None
    monkeypatch.delenv(custom_kernels.KERNELS_ENV)
    assert prefetch.l2_prefetch(w[:0], after) is None  # nothing to prefetch


def test_model_adds_one_prefetch_per_layer(graph_count, monkeypatch):
    """The decode step with the family opted in, on a (pretend) sm_90 device: one kernel and the
    Depends that keeps it per layer, nothing else (graph_count's stand-in kernels are Depends nodes
    themselves, so it reports both under CustomKernel)."""
    import decode

    cfg = decode._tiny(head_dim=256, global_head_dim=512, num_global_key_value_heads=1, attention_k_eq_v=True)
    base = graph_count.step_counts(cfg, 40)["body"]
    monkeypatch.setattr(prefetch, "cuda_arch", lambda: 90)
    monkeypatch.setenv(custom_kernels.UNPROVEN_ENV, "l2_prefetch")
    with_prefetch = graph_count.step_counts(cfg, 40)["body"]
    layers = cfg.num_hidden_layers
    extra = {k: with_prefetch.get(k, 0) - base.get(k, 0) for k in set(base) | set(with_prefetch)}
    assert {k: v for k, v in extra.items() if v} == {"CustomKernel": 2 * layers}


@cuda
@pytest.mark.gpu
def test_prefetch_token_and_values():
    """On the GPU: the token is zero, the prefetched array is unchanged, and a compiled function that
    ties the token in with mx.depends returns what it returns without it."""
    rng = np.random.default_rng(3)
    w = mx.array(rng.integers(0, 256, size=(3000, 1584), dtype=np.uint8))  # 4.75 MB, not a whole chunk
    x = mx.array(rng.standard_normal((1, 1584)).astype(np.float32))

    def plain(x):
        return (x * 2.0).sum(axis=-1) + w[:, :4].astype(mx.float32).sum()

    def with_prefetch(x):
        token = prefetch.l2_prefetch(w, x)
        y = x * 2.0
        (y,) = mx.depends([y], [token])
        return y.sum(axis=-1) + w[:, :4].astype(mx.float32).sum()

    token = prefetch.l2_prefetch(w, x)
    assert token is not None and token.dtype == mx.uint32 and np.array(token).tolist() == [0]
    want = np.array(plain(x))
    for fn in (with_prefetch, mx.compile(with_prefetch)):
        np.testing.assert_array_equal(np.array(fn(x)), want)
    np.testing.assert_array_equal(np.array(w[:2, :8]), np.array(w[:2, :8]))  # still readable
