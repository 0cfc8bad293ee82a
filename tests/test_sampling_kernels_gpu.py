"""GPU tests of custom_kernels.sampling (Metal or CUDA, whichever this MLX build runs) at the real
vocabulary size V = 262144: pass 1 against the float64 oracle bit for bit, greedy and top-k
k in {1, 40, 64, 1024} (with top-p / min-p) against the oracle and against ``sample_reference``
for many u. Run with ``pytest -m gpu tests/test_sampling_kernels_gpu.py``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import custom_kernels
from custom_kernels import sampling as sp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(custom_kernels.backend() == "cpu", reason="no GPU backend (CPU-only MLX build)"),
]

V = 262144
KS = [1, 40, 64, 1024]


def _logits(kind: str, seed: int) -> np.ndarray:
    """One row [V] f32: "normal" (continuous, 3 sigma) or "ties" (a 64-level grid: thousands of
    exact ties, also at the top), both with some -inf and NaN entries."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        x = (rng.standard_normal(V) * 3.0).astype(np.float32)
    else:
        x = sp.random_logits(rng, 1, V, levels=64)[0]
    x[rng.choice(V, 50, replace=False)] = -np.inf
    x[rng.choice(V, 5, replace=False)] = np.nan
    return x


def _rows(x: np.ndarray, n: int) -> mx.array:
    return mx.array(np.ascontiguousarray(np.broadcast_to(x, (n, x.size))))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.where(np.isnan(x), -np.inf, x).astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def _reference_on_cpu(*args, **kwargs):
    with mx.stream(mx.cpu):
        tokens, logprobs = sp.sample_reference(*args, **kwargs)
        mx.eval(tokens, logprobs)
    return np.array(tokens), np.array(logprobs)


def _sample(x: np.ndarray, u: np.ndarray, *args, chunk: int = 128, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """Kernel ``sample`` of one row for every u (rows of ``chunk`` at a time)."""
    toks, lps = [], []
    for a in range(0, u.size, chunk):
        t, lp = sp.sample(_rows(x, u[a : a + chunk].size), *args, key_or_uniform=mx.array(u[a : a + chunk]), **kwargs)
        toks.append(np.array(t))
        lps.append(np.array(lp))
    return np.concatenate(toks), np.concatenate(lps)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_select_pass_is_exact(k, kind):
    """Pass 1 writes exactly the oracle's per-slice candidates (values and indices, index order) and
    slice statistics to f32 accuracy, on two different rows."""
    x = np.stack([_logits(kind, 1), _logits(kind, 2)])
    plan = sp.plan_sample(2, V, k)
    cfg = sp.default_config(V, k)
    vals, idx, stats = sp.launch_select(mx.array(x), plan)
    want_vals, want_idx, want_stats = sp.oracle_select_pass(x, plan.per_slice, cfg.select_threads * cfg.select_per_thread)
    assert np.array_equal(np.array(idx), want_idx)
    assert np.array_equal(np.array(vals), want_vals.astype(np.float32))
    np.testing.assert_allclose(np.array(stats), want_stats, rtol=2e-6)


@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_greedy_is_first_argmax(kind):
    x = np.stack([_logits(kind, s) for s in range(4)])
    x[2, [7, 200000]] = 1e4  # a tie between two clear maxima: the lower index wins
    tokens, logprobs = sp.sample(mx.array(x), 0.0)
    want = [int(sp.oracle_ranking(r)[0]) for r in x]
    assert np.array(tokens).tolist() == want and want[2] == 7
    ref_tokens, ref_logprobs = _reference_on_cpu(mx.array(x), 0.0)
    assert ref_tokens.tolist() == want
    np.testing.assert_allclose(np.array(logprobs), [_log_softmax(r)[t] for r, t in zip(x, want)], atol=1e-4)
    np.testing.assert_allclose(np.array(logprobs), ref_logprobs, atol=1e-4)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_top_k_every_rank_matches_oracle_and_reference(k, kind):
    """u at the middle of every kept rank's CDF interval (ranks of probability > 1e-5): the kernel
    returns exactly the oracle's token for each, like the reference; logprobs agree."""
    x = _logits(kind, 10 + k)
    temp = 0.9
    ids, probs = sp.oracle_distribution(x, temp, k)
    assert ids.size == k
    cdf = np.concatenate([[0.0], np.cumsum(probs)])
    wide = probs > 1e-5
    u = ((cdf[:-1] + cdf[1:]) / 2).astype(np.float32)[wide]
    tokens, logprobs = _sample(x, u, temp, k)
    assert tokens.tolist() == ids[wide].tolist()
    np.testing.assert_allclose(logprobs, _log_softmax(x)[ids[wide]], atol=1e-4)
    sub = slice(0, 64)  # the CPU reference on a subset (it sorts 262144 keys per row)
    ref_tokens, ref_logprobs = _reference_on_cpu(_rows(x, u[sub].size), temp, k, 1.0, 0.0, mx.array(u[sub]))
    assert ref_tokens.tolist() == tokens[sub].tolist()
    np.testing.assert_allclose(ref_logprobs, logprobs[sub], atol=1e-4)


@pytest.mark.parametrize("k,temp,top_p,min_p,keep", [
    (40, 0.8, 0.91, 0.0, 1), (64, 1.0, 0.95, 0.05, 1), (64, 0.7, 1.0, 0.2, 1), (1024, 1.0, 0.9, 0.0, 1),
    (1024, 1.3, 0.98, 0.01, 1), (64, 1.0, 0.3, 0.0, 5),
])  # fmt: skip
@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_filters_with_random_u(k, temp, top_p, min_p, keep, kind):
    """512 random u: the kernel's token equals the oracle's wherever u is not within 1e-5 of a CDF
    edge (at least 95% of them), and equals the reference's on those u."""
    x = _logits(kind, 100 + k)
    ids, probs = sp.oracle_distribution(x, temp, k, top_p, min_p, keep)
    # the filter decisions must not sit on an f32 rounding edge
    s = np.where(np.isnan(x), -np.inf, x).astype(np.float64)[sp.oracle_ranking(x)[:k]] / temp
    w = np.exp(s - s[0])
    mass_before = (np.cumsum(w) - w) / w.sum()
    assert top_p >= 1.0 or np.abs(mass_before - top_p).min() > 1e-5
    assert min_p <= 0.0 or np.abs(w - min_p).min() > 1e-5
    u = np.random.default_rng(k).random(512).astype(np.float32)
    tokens, logprobs = _sample(x, u, temp, k, top_p, min_p, min_tokens_to_keep=keep)
    want = np.array([sp.oracle_pick(ids, probs, float(v)) for v in u])
    clear = np.abs(u[:, None] - np.cumsum(probs)[None, :]).min(axis=1) > 1e-5
    assert clear.mean() >= 0.95
    assert (tokens[clear] == want[clear]).all()
    assert np.isin(tokens, ids).all()
    sub = slice(0, 64)
    ref_tokens, _ = _reference_on_cpu(_rows(x, 64), temp, k, top_p, min_p, mx.array(u[sub]),
                                      min_tokens_to_keep=keep)  # fmt: skip
    assert (ref_tokens[clear[sub]] == tokens[sub][clear[sub]]).all()
    np.testing.assert_allclose(logprobs, _log_softmax(x)[tokens], atol=1e-4)


def test_deterministic_batched_and_compiled():
    """Same u -> bit-identical outputs; rows are independent; the op works inside mx.compile."""
    x = mx.array(np.stack([_logits("normal", 40), _logits("ties", 41), _logits("normal", 42)]))
    u = mx.array(np.array([0.3, 0.9, 0.01], dtype=np.float32))
    a = sp.sample(x, 1.0, 64, 0.95, 0.0, u)
    b = sp.sample(x, 1.0, 64, 0.95, 0.0, u)
    assert all(mx.array_equal(p, q).item() for p, q in zip(a, b))
    for r in range(3):
        single = sp.sample(x[r : r + 1], 1.0, 64, 0.95, 0.0, u[r : r + 1])
        assert single[0].item() == a[0][r].item()
    compiled = mx.compile(lambda logits, uu: sp.sample(logits, 1.0, 64, 0.95, 0.0, uu))
    c = compiled(x, u)
    assert all(mx.array_equal(p, q).item() for p, q in zip(a, c))
    key_a = sp.sample(x, 1.0, 40, 1.0, 0.0, mx.random.key(5))
    key_b = sp.sample(x, 1.0, 40, 1.0, 0.0, mx.random.key(5))
    assert mx.array_equal(key_a[0], key_b[0]).item()


@pytest.mark.parametrize("top_k", [0, 64, 2000])
def test_reference_on_the_gpu_matches_the_cpu(top_k):
    """``sample`` on the GPU equals the reference on the CPU stream: top_k 0 (the reference sorts
    all V uint64 keys on the GPU), 2000 > MAX_TOP_K (the reference partitions them on the GPU),
    64 (the kernels)."""
    x = mx.array(np.stack([_logits("ties", 50), _logits("normal", 51)]))
    u = mx.array(np.array([0.25, 0.75], dtype=np.float32))
    gpu_tokens, gpu_logprobs = sp.sample(x, 1.0, top_k, 0.9, 0.0, u)
    cpu_tokens, cpu_logprobs = _reference_on_cpu(x, 1.0, top_k, 0.9, 0.0, u)
    assert np.array(gpu_tokens).tolist() == cpu_tokens.tolist()
    np.testing.assert_allclose(np.array(gpu_logprobs), cpu_logprobs, atol=1e-4)
