"""Samplers and logits processors (gemma4_mlx.sampling): supports, distributions, seeding, processors."""

import gemma4_mlx  # noqa: F401  (first: MLX's CPU BLAS)
import mlx.core as mx
import numpy as np
import pytest

from gemma4_mlx.sampling import (
    apply_repetition_penalty,
    choose,
    greedy,
    make_logits_processors,
    make_sampler,
    min_p_mask,
    top_k_candidates,
    top_p_mask,
)

N_DRAWS = 20000


def logprobs_of(probs) -> mx.array:
    return mx.log(mx.array(np.asarray([probs], dtype=np.float32)))


def draws(sampler, logprobs: mx.array, n: int = N_DRAWS) -> np.ndarray:
    """n samples from one row of logprobs [1, V], drawn in one batched call -> counts [V]."""
    batch = mx.broadcast_to(logprobs, (n, logprobs.shape[-1]))
    tokens = np.array(sampler(batch))
    assert tokens.shape == (n,)
    return np.bincount(tokens, minlength=logprobs.shape[-1])


def test_greedy_at_temperature_zero_ignores_filters():
    lp = logprobs_of([0.1, 0.2, 0.6, 0.1])
    for sampler in (make_sampler(), make_sampler(temp=0.0, top_k=1, top_p=0.1, min_p=0.5)):
        assert sampler is greedy
        assert sampler(lp).tolist() == [2]
    batch = mx.array([[0.0, 3.0, 1.0], [5.0, -1.0, 2.0]])
    out = greedy(batch)
    assert out.dtype == mx.int32 and out.tolist() == [1, 0]


def test_choose_gives_make_samplers_the_logits_and_others_the_logprobs():
    """make_sampler's samplers are marked shift-invariant and get the logits (the token does not wait
    for the logsumexp); any other callable gets the logprobs, as mlx-lm's samplers do."""
    logits = mx.array([[2.0, 7.5, 7.5, -1.0], [0.0, -3.0, 4.0, 1.0]])
    want_lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    seen = []

    def spy(scores):
        seen.append(scores)
        return mx.argmax(scores, axis=-1)

    y, lp = choose(logits, spy)
    assert y.dtype == mx.int32 and y.tolist() == [1, 2]
    np.testing.assert_array_equal(np.array(seen[0]), want_lp)
    np.testing.assert_array_equal(np.array(lp), want_lp)
    spy.shift_invariant = True
    choose(logits, spy)
    assert seen[1] is logits
    for sampler in (make_sampler(), make_sampler(temp=0.7, top_k=2, seed=0), make_sampler(temp=1.0, min_p=0.1)):
        assert sampler.shift_invariant


@pytest.mark.parametrize("settings", [dict(temp=0.7), dict(temp=1.0, top_k=40), dict(temp=1.3, top_p=0.9),
                                      dict(temp=1.0, min_p=0.05), dict(temp=0.8, top_k=64, top_p=0.95, min_p=0.02,
                                                                       min_tokens_to_keep=3)])  # fmt: skip
def test_make_samplers_draw_the_same_from_logits_and_logprobs(settings):
    """What `shift_invariant` promises: the same seed draws the same tokens from the logits as from
    the logprobs (the logits shifted by their logsumexp), row by row."""
    logits = mx.random.normal((300, 2000), key=mx.random.key(7)) * 4
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    a = make_sampler(**settings, seed=3)(logits)
    b = make_sampler(**settings, seed=3)(logprobs)
    assert a.tolist() == b.tolist() and len(set(a.tolist())) > 20


def test_temperature_matches_softmax_of_scaled_logits():
    logits = np.array([1.0, 0.5, 0.0, -0.5, -1.0], dtype=np.float32)
    lp = mx.array(logits[None] - np.log(np.exp(logits).sum()))
    for temp in (0.5, 1.0, 2.0):
        counts = draws(make_sampler(temp=temp, seed=11), lp)
        expected = np.exp(logits / temp) / np.exp(logits / temp).sum()
        assert np.abs(counts / N_DRAWS - expected).max() < 0.015, (temp, counts / N_DRAWS, expected)


def test_top_k_keeps_exactly_k_even_with_ties():
    lp = mx.zeros((1, 50))  # all tokens tie: selection must still keep exactly k
    for k in (1, 3, 7):
        counts = draws(make_sampler(temp=1.0, top_k=k, seed=k), lp, 4000)
        assert (counts > 0).sum() == k
    probs = np.array([0.05, 0.3, 0.05, 0.2, 0.15, 0.25])
    counts = draws(make_sampler(temp=1.0, top_k=3, seed=1), logprobs_of(probs))
    assert set(np.nonzero(counts)[0]) == {1, 3, 5}
    kept = probs[[1, 3, 5]] / probs[[1, 3, 5]].sum()  # renormalised inside the kept set
    assert np.abs(counts[[1, 3, 5]] / N_DRAWS - kept).max() < 0.015
    values, index = top_k_candidates(mx.array([[1.0, 9.0, 3.0, 7.0]]), 2)
    assert sorted(index.tolist()[0]) == [1, 3] and sorted(values.tolist()[0]) == [7.0, 9.0]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = [0.1, 0.5, 0.05, 0.3, 0.05]  # sorted: 0.5 (1), 0.3 (3), 0.1 (0), 0.05, 0.05
    lp = logprobs_of(probs)
    assert np.nonzero(np.array(top_p_mask(lp, 0.4)[0]))[0].tolist() == [1]
    assert np.nonzero(np.array(top_p_mask(lp, 0.75)[0]))[0].tolist() == [1, 3]
    assert np.nonzero(np.array(top_p_mask(lp, 0.85)[0]))[0].tolist() == [0, 1, 3]
    assert np.nonzero(np.array(top_p_mask(lp, 0.4, min_tokens_to_keep=2)[0]))[0].tolist() == [1, 3]
    counts = draws(make_sampler(temp=1.0, top_p=0.75, seed=3), lp)
    assert set(np.nonzero(counts)[0]) == {1, 3}
    assert abs(counts[1] / N_DRAWS - 0.5 / 0.8) < 0.015


def test_min_p_is_relative_to_the_most_likely_token():
    probs = [0.5, 0.3, 0.15, 0.05]
    lp = logprobs_of(probs)
    assert np.array(min_p_mask(lp, 0.5)[0]).tolist() == [True, True, False, False]  # p >= 0.25
    assert np.array(min_p_mask(lp, 0.2)[0]).tolist() == [True, True, True, False]  # p >= 0.10
    assert np.array(min_p_mask(lp, 0.9, min_tokens_to_keep=3)[0]).tolist() == [True, True, True, False]
    counts = draws(make_sampler(temp=1.0, min_p=0.5, seed=4), lp)
    assert set(np.nonzero(counts)[0]) == {0, 1}
    assert abs(counts[0] / N_DRAWS - 0.5 / 0.8) < 0.015


def test_top_p_after_top_k_works_on_the_kept_set():
    probs = [0.4, 0.3, 0.2, 0.1]
    # top-k 2 keeps {0, 1} renormalised to 0.571 / 0.429: top-p 0.5 keeps only token 0
    counts = draws(make_sampler(temp=1.0, top_k=2, top_p=0.5, seed=5), logprobs_of(probs), 2000)
    assert set(np.nonzero(counts)[0]) == {0}
    counts = draws(make_sampler(temp=1.0, top_k=3, top_p=0.7, seed=5), logprobs_of(probs), 4000)
    assert set(np.nonzero(counts)[0]) == {0, 1}


def test_seeded_sampler_is_reproducible():
    lp = mx.zeros((1, 1000))
    def run(seed):
        sampler = make_sampler(temp=1.0, seed=seed)
        return [sampler(lp).item() for _ in range(20)]

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert len(set(run(7))) > 10  # the key chain advances between calls
    mx.random.seed(3)
    a = [make_sampler(temp=1.0)(lp).item() for _ in range(10)]
    mx.random.seed(3)
    b = [make_sampler(temp=1.0)(lp).item() for _ in range(10)]
    assert a == b


def test_sampler_rejects_bad_settings():
    for kwargs in (dict(temp=-1.0), dict(temp=1.0, top_p=0.0), dict(temp=1.0, top_p=1.5), dict(temp=1.0, min_p=1.0),
                   dict(temp=1.0, top_k=-1), dict(temp=1.0, min_tokens_to_keep=0)):
        with pytest.raises(ValueError):
            make_sampler(**kwargs)


def test_logit_bias_adds_to_the_named_tokens():
    (bias,) = make_logits_processors(logit_bias={2: 5.0, 0: -1.5})
    logits = mx.array([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]])
    out = bias(mx.array([1, 2]), logits)
    assert out.tolist() == [[-0.5, 2.0, 8.0, 4.0], [-1.5, 0.0, 5.0, 0.0]]
    assert logits.tolist()[0] == [1.0, 2.0, 3.0, 4.0]  # input untouched
    (force,) = make_logits_processors(logit_bias={3: 100.0})
    assert greedy(force(mx.array([0]), mx.array([[9.0, 0.0, 0.0, -50.0]]))).tolist() == [3]


def test_repetition_penalty_over_the_recent_context():
    (penalty,) = make_logits_processors(repetition_penalty=2.0, repetition_context_size=3)
    logits = mx.array([[4.0, -4.0, 4.0, -4.0, 4.0, 1.0]])
    history = mx.array([0, 1, 2, 2, 3])  # last 3: 2, 2, 3 (token 2 twice: penalised once)
    out = penalty(history, logits)
    assert out.tolist() == [[4.0, -4.0, 2.0, -8.0, 4.0, 1.0]]
    assert logits.tolist() == [[4.0, -4.0, 4.0, -4.0, 4.0, 1.0]]
    out = apply_repetition_penalty(mx.array([[3.0, -3.0]] * 2), mx.array([0, 1]), 1.5)
    assert np.allclose(np.array(out), [[2.0, -4.5]] * 2)
    assert make_logits_processors() == []
    assert make_logits_processors(repetition_penalty=1.0) == []
    with pytest.raises(ValueError):
        make_logits_processors(repetition_penalty=0.0)


def test_gpu_sampling_path_keeps_top_k_and_seed(monkeypatch):
    """make_sampler's GPU path (custom_kernels.sampling, here through its reference): draws stay in
    the top-k, a seed repeats the sequence, greedy-like settings pick the argmax."""
    import mlx.core as mx
    import numpy as np

    import gemma4_mlx.sampling as sampling

    monkeypatch.setattr(sampling, "use_kernel", lambda family: family == "sampling")
    logits = mx.random.normal((1, 3000), key=mx.random.key(4)) * 3
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    top40 = set(np.argsort(-np.array(lp[0]))[:40].tolist())
    first = sampling.make_sampler(temp=0.8, top_k=40, top_p=0.9, seed=1)
    draws = [int(first(lp)[0]) for _ in range(200)]
    assert set(draws) <= top40 and len(set(draws)) > 5
    again = sampling.make_sampler(temp=0.8, top_k=40, top_p=0.9, seed=1)
    assert [int(again(lp)[0]) for _ in range(50)] == draws[:50]
    one = sampling.make_sampler(temp=1.0, top_k=1, seed=2)
    assert int(one(lp)[0]) == int(mx.argmax(lp[0]))
