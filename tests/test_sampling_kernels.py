"""custom_kernels.sampling on the CPU: the MLX reference against the float64 oracle (greedy, fixed-u
picks, top-k ties, top-p / min-p edges, temperature, distributions), the public dispatch, launch
geometry, and both kernels end to end through ``sample`` on the Metal emulator.

The per-kernel emulator cases live in the registry (tests/test_metal_kernels_emulated.py) and the
generated text is compiled by tests/test_metal_compile.py (g++ and nvcc)."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import custom_kernels
from custom_kernels import sampling as sp
from gemma4_mlx.sampling import make_sampler

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/metal_emulator
from metal_emulator import metal_kernel


def _rows(x: np.ndarray, n: int) -> mx.array:
    """One row [V] repeated n times -> mx f32 [n, V]."""
    return mx.array(np.ascontiguousarray(np.broadcast_to(x, (n, x.size)), dtype=np.float32))


def _midpoints(probs: np.ndarray) -> np.ndarray:
    """u in the middle of every token's CDF interval (the inverse-CDF pick is then unambiguous)."""
    cdf = np.concatenate([[0.0], np.cumsum(probs)])
    return ((cdf[:-1] + cdf[1:]) / 2).astype(np.float32)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.where(np.isnan(x), -np.inf, x).astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def _check_every_rank(row: np.ndarray, temp, top_k, top_p, min_p, keep=1, fn=sp.sample_reference):
    """fn picks the oracle's token for u at the middle of each kept token's CDF interval (tokens of
    probability > 1e-4, whose interval f32 rounding cannot miss); logprobs are log_softmax of the
    untempered row. Returns the oracle's kept tokens."""
    ids, probs = sp.oracle_distribution(row, temp, top_k, top_p, min_p, keep)
    wide = probs > 1e-4
    u = _midpoints(probs)[wide]
    tokens, logprobs = fn(_rows(row, u.size), temp, top_k, top_p, min_p, mx.array(u), min_tokens_to_keep=keep)
    assert tokens.dtype == mx.int32 and logprobs.dtype == mx.float32
    assert np.array(tokens).tolist() == ids[wide].tolist(), (temp, top_k, top_p, min_p, keep)
    np.testing.assert_allclose(np.array(logprobs), _log_softmax(row)[ids[wide]], rtol=1e-5, atol=1e-5)
    return ids


# ----------------------------------------------------------------------------------------------
# Reference vs the float64 oracle
# ----------------------------------------------------------------------------------------------


def test_oracle_on_a_hand_computed_case():
    """The oracle itself, on numbers worked out by hand: logits log([4, 3, 2, 1]) (probs .4 .3 .2 .1)."""
    row = np.log(np.array([1.0, 4.0, 2.0, 3.0]))
    assert sp.oracle_ranking(row).tolist() == [1, 3, 2, 0]
    ids, probs = sp.oracle_distribution(row, 1.0, 0, 0.75, 0.0)  # mass before: 0, .4, .7, .9
    assert ids.tolist() == [1, 3, 2] and np.allclose(probs, [4 / 9, 3 / 9, 2 / 9])
    ids, probs = sp.oracle_distribution(row, 1.0, 0, 1.0, 0.5)  # p >= .5 * .4
    assert ids.tolist() == [1, 3, 2]
    ids, probs = sp.oracle_distribution(row, 1.0, 2, 1.0, 0.0)
    assert ids.tolist() == [1, 3] and np.allclose(probs, [4 / 7, 3 / 7])
    ids, _ = sp.oracle_distribution(row, 1.0, 0, 0.1, 0.0, min_tokens_to_keep=3)
    assert ids.tolist() == [1, 3, 2]
    assert [sp.oracle_pick(ids, np.array([0.5, 0.3, 0.2]), u) for u in (0.0, 0.49, 0.5, 0.79, 0.8, 0.999)] == [
        1, 1, 3, 3, 2, 2]  # fmt: skip


def test_greedy_is_first_argmax_with_untempered_logprob():
    rng = np.random.default_rng(1)
    x = sp.random_logits(rng, 6, 1537, levels=12)  # many ties at the maximum
    x[3] = -np.inf
    x[3, [17, 900]] = 2.0  # tie between two finite entries
    x[4, :] = 5.0  # all equal
    tokens, logprobs = sp.sample_reference(mx.array(x), 0.0)
    want = [int(sp.oracle_ranking(r)[0]) for r in x]
    assert np.array(tokens).tolist() == want
    assert want[3] == 17 and want[4] == 0
    np.testing.assert_allclose(np.array(logprobs), [_log_softmax(r)[t] for r, t in zip(x, want)], rtol=1e-6,
                               atol=1e-6)  # fmt: skip
    # temp 0 ignores the filters and needs no randomness; top_k = 1 is the same selection at any temperature
    t2, _ = sp.sample_reference(mx.array(x), 0.0, 5, 0.1, 0.5)
    t3, _ = sp.sample_reference(mx.array(x), 0.7, 1, 1.0, 0.0, mx.array(np.full(6, 0.9, np.float32)))
    assert np.array(t2).tolist() == want and np.array(t3).tolist() == want


def test_reference_logprob_is_accurate_on_a_full_vocabulary_row():
    """262144 logits: the reference's logprobs (two-level sums) are within 2e-5 of float64, greedy
    and sampled, although a sequential f32 sum of the row is off by ~3e-4 relative."""
    rng = np.random.default_rng(12)
    row = (rng.standard_normal(262144) * 3.0).astype(np.float32)
    want = _log_softmax(row)
    tokens, logprobs = sp.sample_reference(_rows(row, 1), 0.0)
    assert tokens.item() == int(np.argmax(row)) and abs(logprobs.item() - want.max()) < 2e-5
    u = mx.array(np.array([0.1, 0.5, 0.9], dtype=np.float32))
    tokens, logprobs = sp.sample_reference(_rows(row, 3), 1.0, 64, 0.95, 0.0, u)
    np.testing.assert_allclose(np.array(logprobs), want[np.array(tokens)], atol=2e-5)


@pytest.mark.parametrize("k", [1, 7, 64, 300, 1000])
def test_sorted_top_k_reference_is_the_exact_ranking(k):
    rng = np.random.default_rng(k)
    x = sp.random_logits(rng, 3, 1000, levels=20)  # ~50 ties per value: the k-th value is tied
    values, index = sp.sorted_top_k_reference(mx.array(x), k)
    for r in range(3):
        order = sp.oracle_ranking(x[r])[:k]
        assert np.array(index[r]).tolist() == order.tolist()
        want = np.where(np.isnan(x[r, order]), -np.inf, x[r, order])
        assert np.array_equal(np.array(values[r]), want)


@pytest.mark.parametrize("temp", [0.6, 1.0, 1.7])
@pytest.mark.parametrize("top_k,top_p,min_p,keep", [
    (0, 1.0, 0.0, 1), (40, 1.0, 0.0, 1), (64, 0.9, 0.0, 1), (0, 0.8, 0.0, 1), (0, 1.0, 0.05, 1),
    (40, 0.7, 0.1, 1), (17, 0.3, 0.0, 4), (5, 1.0, 0.0, 1),
])  # fmt: skip
def test_reference_picks_the_oracle_token_for_every_rank(temp, top_k, top_p, min_p, keep):
    rng = np.random.default_rng(int(temp * 10) + top_k)
    row = (rng.standard_normal(300) * 2.0).astype(np.float32)
    row[[5, 77]] = -np.inf
    _check_every_rank(row, temp, top_k, top_p, min_p, keep)


def test_reference_random_u_agrees_with_oracle_away_from_boundaries():
    rng = np.random.default_rng(5)
    row = (rng.standard_normal(2000) * 3.0).astype(np.float32)
    u = rng.random(512).astype(np.float32)
    for temp, top_k, top_p, min_p in ((1.0, 64, 0.95, 0.0), (0.7, 0, 0.9, 0.02), (1.3, 1024, 1.0, 0.0)):
        ids, probs = sp.oracle_distribution(row, temp, top_k, top_p, min_p)
        tokens, _ = sp.sample_reference(_rows(row, u.size), temp, top_k, top_p, min_p, mx.array(u))
        cdf = np.cumsum(probs)
        clear = np.abs(u[:, None] - cdf[None, :]).min(axis=1) > 1e-5
        want = np.array([sp.oracle_pick(ids, probs, float(v)) for v in u])
        assert clear.sum() >= 480
        assert (np.array(tokens)[clear] == want[clear]).all(), (temp, top_k, top_p, min_p)


def test_top_k_keeps_exactly_k_lowest_index_ties():
    x = np.zeros(1000, dtype=np.float32)
    x[[900, 3]] = 2.0  # two clear winners, then 998 tied entries
    for k in (2, 3, 10, 57):
        ids = _check_every_rank(x, 1.0, k, 1.0, 0.0)
        assert ids.tolist() == [3, 900] + [i for i in range(1000) if i not in (3, 900)][: k - 2]


def test_top_p_and_min_p_edges():
    rng = np.random.default_rng(3)
    row = (rng.standard_normal(500) * 2.0).astype(np.float32)
    best = int(np.argmax(row))
    # a tiny top_p keeps only the best token whatever u is; min_tokens_to_keep widens it
    u = mx.array(np.linspace(0.0, 0.999, 9, dtype=np.float32))
    tokens, _ = sp.sample_reference(_rows(row, 9), 1.0, 0, 1e-6, 0.0, u)
    assert np.array(tokens).tolist() == [best] * 9
    assert _check_every_rank(row, 1.0, 0, 1e-6, 0.0, keep=3).size == 3
    # top_p 1.0 and min_p 0.0 filter nothing; min_p close to 1 keeps only the maximum's ties
    assert _check_every_rank(row, 1.0, 50, 1.0, 0.0).size == 50
    tied = np.array([1.0, 3.0, 0.0, 3.0, 2.9], dtype=np.float32)
    assert _check_every_rank(tied, 1.0, 0, 1.0, 0.99).tolist() == [1, 3]
    # top-p on the kept set: top_k 2 of probs (.4, .3, ...) renormalised to (4/7, 3/7); top_p .5 keeps 1
    four = np.log(np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32))
    assert _check_every_rank(four, 1.0, 2, 0.5, 0.0).tolist() == [0]
    assert _check_every_rank(four, 1.0, 2, 0.6, 0.0).tolist() == [0, 1]
    assert _check_every_rank(four, 1.0, 0, 0.6, 0.0).tolist() == [0, 1]
    # -inf (and NaN) entries are never drawn, even for u at the top of [0, 1) or u clamped at 1
    masked = np.array([np.nan, 1.0, -np.inf, 0.5, -np.inf], dtype=np.float32)
    for u_top in (np.float32(1 - 2**-24), np.float32(1.0)):
        tokens, _ = sp.sample_reference(_rows(masked, 1), 1.0, 0, 1.0, 0.0, mx.array(np.array([u_top])))
        assert np.array(tokens).tolist() == [3]
    assert _check_every_rank(masked, 1.0, 4, 1.0, 0.0).tolist() == [1, 3]


@pytest.mark.parametrize("temp", [0.5, 1.0, 2.0])
def test_temperature_scaling_with_stratified_u(temp):
    """Stratified u_i = (i + 1/2) / N makes the inverse-CDF counts N p_r up to rounding."""
    row = np.array([1.0, 0.5, 0.0, -0.5, -1.0, 2.0], dtype=np.float32)
    n = 6000
    u = ((np.arange(n) + 0.5) / n).astype(np.float32)
    tokens, _ = sp.sample_reference(_rows(row, n), temp, 0, 1.0, 0.0, mx.array(u))
    counts = np.bincount(np.array(tokens), minlength=row.size)
    expected = np.exp(row / temp) / np.exp(row / temp).sum()
    assert np.abs(counts - n * expected).max() <= 1.5, (counts, n * expected)


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    return float(((counts - n * probs) ** 2 / (n * probs)).sum())


def test_distribution_matches_oracle_and_make_sampler():
    """Random u from a seeded key: chi-square of the reference's draws against the oracle's filtered
    distribution, and of gemma4_mlx.sampling.make_sampler's draws (the same distribution)."""
    row = np.array([2.0, 1.7, 1.5, 1.1, 0.9, 0.4, 0.2, -0.3, -1.0, -2.0, -2.5, -4.0], dtype=np.float32)
    n = 30000
    for temp, top_k, top_p, min_p in ((1.0, 8, 0.9, 0.0), (0.8, 0, 1.0, 0.1), (1.5, 10, 0.95, 0.02)):
        ids, probs = sp.oracle_distribution(row, temp, top_k, top_p, min_p)
        p_full = np.zeros(row.size)
        p_full[ids] = probs
        tokens, _ = sp.sample_reference(_rows(row, n), temp, top_k, top_p, min_p, mx.random.key(7))
        ours = np.bincount(np.array(tokens), minlength=row.size)
        lp = mx.array(_log_softmax(row)[None].astype(np.float32))
        theirs = np.bincount(np.array(make_sampler(temp, top_p, min_p, top_k, seed=7)(
            mx.broadcast_to(lp, (n, row.size)))), minlength=row.size)  # fmt: skip
        for counts in (ours, theirs):
            assert counts[p_full == 0].sum() == 0
            # df = len(ids) - 1 <= 9: the 1e-4 upper quantile of chi-square(9) is 33.7
            assert _chi_square(counts[ids], probs) < 33.7, (temp, top_k, top_p, min_p, counts, n * p_full)


# ----------------------------------------------------------------------------------------------
# Public API: randomness, validation, dispatch, geometry
# ----------------------------------------------------------------------------------------------


def test_key_or_uniform():
    x = mx.array(sp.random_logits(np.random.default_rng(2), 4, 700))
    a, _ = sp.sample(x, 1.0, 40, 0.9, 0.0, mx.random.key(11))
    b, _ = sp.sample(x, 1.0, 40, 0.9, 0.0, mx.random.key(11))
    assert np.array_equal(np.array(a), np.array(b))
    u = mx.array(np.array([0.1, 0.5, 0.7, 0.95], dtype=np.float32))
    c, _ = sp.sample(x, 1.0, 40, 0.9, 0.0, u)
    d, _ = sp.sample(x, 1.0, 40, 0.9, 0.0, u)
    assert np.array_equal(np.array(c), np.array(d))
    e, _ = sp.sample(x, 1.0, 40, 0.9, 0.0, 0.5)  # scalar u for every row
    f, _ = sp.sample(x, 1.0, 40, 0.9, 0.0, mx.array(np.full(4, 0.5, np.float32)))
    assert np.array_equal(np.array(e), np.array(f))
    with pytest.raises(ValueError, match="key_or_uniform"):
        sp.sample(x, 1.0, 40)
    with pytest.raises(ValueError, match="uniforms"):
        sp.sample(x, 1.0, 40, 1.0, 0.0, mx.zeros((3,)))
    sp.sample(x, 0.0)  # greedy needs no randomness


@pytest.mark.parametrize("kwargs,match", [
    ({"temp": -1.0}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"min_p": 1.0}, "min_p"), ({"min_tokens_to_keep": 0}, "min_tokens"),
])  # fmt: skip
def test_argument_validation(kwargs, match):
    args = {"temp": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "key_or_uniform": 0.5} | kwargs
    keep = args.pop("min_tokens_to_keep", 1)
    with pytest.raises(ValueError, match=match):
        sp.sample(mx.zeros((1, 10)), min_tokens_to_keep=keep, **args)
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        sp.sample(mx.zeros((10,)), 0.0)


def test_dispatch_on_cpu_is_the_reference():
    assert custom_kernels.use_reference()
    x = mx.array(sp.random_logits(np.random.default_rng(4), 3, 900))
    u = mx.array(np.array([0.2, 0.6, 0.99], dtype=np.float32))
    for args in ((0.0,), (1.0, 40, 0.9, 0.05, u), (0.7, 0, 0.8, 0.0, u)):
        got = sp.sample(x, *args)
        want = sp.sample_reference(x, *args)
        assert all(np.array_equal(np.array(g), np.array(w)) for g, w in zip(got, want))


@pytest.mark.parametrize("k", [1, 40, 64, 128, 256, 512, 1024])
def test_default_geometry_fits_the_kernels(k):
    v = 262144
    cfg = sp.default_config(v, k)
    plan = sp.plan_sample(2, v, k, cfg)
    assert plan.candidates <= sp.MAX_CANDIDATES and plan.candidates >= k
    assert plan.slices * cfg.select_threads * cfg.select_per_thread >= v
    tmpl = dict(plan.merge_template)
    assert tmpl["EPT"] * cfg.merge_threads >= plan.candidates and tmpl["EPT"] <= 16
    assert tmpl["KP"] >= k and tmpl["KP"] & (tmpl["KP"] - 1) == 0
    assert plan.select_grid == (plan.slices * cfg.select_threads, 2, 1)
    assert sp.default_config(v, 1025) is None and sp.default_config(v, 0) is None
    assert sp.default_config(50, 64) is None  # K is at most V (top_k >= V means "all V")
    assert sp.default_config(50, 50) is not None


# ----------------------------------------------------------------------------------------------
# Both kernels, end to end through ``sample``, on the Metal emulator
# ----------------------------------------------------------------------------------------------


class _EmulatedKernel:
    """Adapts an emulated Metal kernel to the MLX custom-kernel call (mx arrays in and out)."""

    def __init__(self, kdef):
        self.k = metal_kernel(kdef.name, kdef.input_names, kdef.output_names, *kdef.text["metal"][::-1])

    def __call__(self, *, inputs, output_dtypes, **kw):
        ins = [np.array(a) for a in inputs]
        outs = self.k(inputs=ins, output_dtypes=[str(d).split(".")[-1] for d in output_dtypes], **kw)
        return [mx.array(o) for o in outs]


@pytest.fixture
def emulated(monkeypatch):
    kernels = {}

    def kernel(kdef):
        if kdef.name not in kernels:
            kernels[kdef.name] = _EmulatedKernel(kdef)
        return kernels[kdef.name]

    monkeypatch.setattr(sp, "_kernel", kernel)
    monkeypatch.setattr(sp, "use_reference", lambda: False)
    return kernels


def test_sample_through_emulated_kernels(emulated):
    """Greedy and top-k 40 + top-p + min-p with u at every kept rank's CDF midpoint: the kernels'
    tokens are the oracle's, their logprobs log_softmax of the untempered logits (same shapes and
    geometry as the registry cases, so the emulator reuses their builds)."""
    rng = np.random.default_rng(9)
    x = sp.random_logits(rng, 3, 1000, levels=40)
    tokens, logprobs = sp.sample(mx.array(x), 0.0, config=sp.SampleConfig(64, 4, 64))
    want = [int(sp.oracle_ranking(r)[0]) for r in x]
    assert np.array(tokens).tolist() == want
    np.testing.assert_allclose(np.array(logprobs), [_log_softmax(r)[t] for r, t in zip(x, want)], atol=2e-5)
    assert set(emulated) == {"g4_sample_select", "g4_sample_merge"}

    row = (rng.standard_normal(2999) * 2.0).astype(np.float32)
    row[rng.choice(2999, 25, replace=False)] = row.max()  # 25 ties at the top
    for temp, top_p, min_p, keep in ((0.8, 0.9, 0.0, 1), (1.2, 1.0, 0.3, 1), (1.0, 0.5, 0.0, 3)):
        ids, probs = sp.oracle_distribution(row, temp, 40, top_p, min_p, keep)
        u = _midpoints(probs)[:8]
        tokens, logprobs = sp.sample(_rows(row, u.size), temp, 40, top_p, min_p, mx.array(u),
                                     min_tokens_to_keep=keep, config=sp.SampleConfig(64, 8, 64))  # fmt: skip
        assert np.array(tokens).tolist() == ids[: u.size].tolist(), (temp, top_p, min_p)
        np.testing.assert_allclose(np.array(logprobs), _log_softmax(row)[ids[: u.size]], atol=2e-5)
