"""Samplers and logits processors, all on device (MLX ops; nothing is read back to the host).

    sampler = make_sampler(temp=1.0, top_p=0.95, top_k=64)
    token = sampler(logprobs)                       # logprobs (or logits) fp32 [B, V] -> ids int32 [B]
    for process in make_logits_processors(logit_bias={106: -5.0}, repetition_penalty=1.1):
        logits = process(tokens, logits)            # tokens int [N] (context so far), logits [B, V]

Order inside a sampler (Hugging Face's): temperature, top-k, top-p, min-p, then a categorical draw.
With top-k set, top-p and min-p work on the k kept candidates only (a sort of k values, not of the
whole vocabulary). Randomness comes from MLX's global generator (`mx.random.seed`) unless the sampler
is given its own `seed`, in which case it owns an explicit key chain: the same seed gives the same
tokens whatever else uses the global generator.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import mlx.core as mx
from custom_kernels import use_kernel

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

__all__ = ["Sampler", "LogitsProcessor", "make_sampler", "make_logits_processors", "greedy", "choose",
           "top_k_candidates", "top_p_mask", "min_p_mask", "apply_repetition_penalty"]


def greedy(scores: mx.array) -> mx.array:
    """argmax over the last axis (the first on ties): [B, V] -> int32 [B]. MLX's argmax, not the
    k = 1 selection kernels: on the H200 those cost the host more than they save the GPU
    (bench/NOTES.md, session 34)."""
    return mx.argmax(scores, axis=-1).astype(mx.int32)


greedy.shift_invariant = True


def choose(logits: mx.array, sampler: Sampler) -> tuple[mx.array, mx.array]:
    """(token ids int32 [B], logprobs f32 [B, V]) of logits f32 [B, V]; logprobs = logits - logsumexp.

    The samplers of make_sampler (marked `shift_invariant`) give the same draw for scores shifted by a
    constant per row, so they get the logits themselves: the token then does not wait for the
    logsumexp, and the logprobs stay lazy (computed only when read). On the H200 a 26B-A4B step's
    sampling kernels go from 52.6 us in 4 launches to 29.2 us in 2 (bench/NOTES.md, session 34).
    Other samplers get the logprobs, as mlx-lm's do."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    scores = logits if getattr(sampler, "shift_invariant", False) else logprobs
    return sampler(scores).astype(mx.int32), logprobs


def top_k_candidates(scores: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k highest scores per row: (values [B, k], vocabulary indices int32 [B, k]), unordered.

    Exactly k candidates even with ties (selection by index, via argpartition)."""
    idx = mx.argpartition(-scores, k - 1, axis=-1)[..., :k].astype(mx.int32)
    return mx.take_along_axis(scores, idx, axis=-1), idx


def _log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def top_p_mask(logprobs: mx.array, top_p: float, min_tokens_to_keep: int = 1) -> mx.array:
    """Nucleus mask (bool, same shape as logprobs [B, N], normalised log-probabilities): keep the
    smallest set of most likely tokens whose probabilities sum to >= top_p (and at least
    min_tokens_to_keep)."""
    order = mx.argsort(-logprobs, axis=-1)
    probs_sorted = mx.exp(mx.take_along_axis(logprobs, order, axis=-1))
    mass_before = mx.cumsum(probs_sorted, axis=-1) - probs_sorted
    rank = mx.arange(logprobs.shape[-1])
    keep_sorted = (mass_before < top_p) | (rank < min_tokens_to_keep)
    keep = mx.zeros(logprobs.shape, dtype=mx.bool_)
    return mx.put_along_axis(keep, order, keep_sorted, axis=-1)


def min_p_mask(logprobs: mx.array, min_p: float, min_tokens_to_keep: int = 1) -> mx.array:
    """Min-p mask (bool [B, N]): keep tokens with p >= min_p * p_max (and the min_tokens_to_keep most
    likely ones)."""
    threshold = logprobs.max(axis=-1, keepdims=True) + math.log(min_p)
    keep = logprobs >= threshold
    if min_tokens_to_keep > 1:
        n = min(min_tokens_to_keep, logprobs.shape[-1])
        _, idx = top_k_candidates(logprobs, n)
        keep = mx.put_along_axis(keep, idx, mx.array(True), axis=-1)
    return keep


def make_sampler(temp: float = 0.0, top_p: float = 1.0, min_p: float = 0.0, top_k: int = 0,
                 min_tokens_to_keep: int = 1, seed: int | None = None) -> Sampler:
    """A function scores fp32 [B, V] -> sampled token ids int32 [B]. The scores are logprobs or logits:
    the draw depends on them only up to a constant per row (`shift_invariant`, which `choose` uses).

    temp 0: greedy (argmax; the other settings are ignored). top_k 0, top_p 1.0 and min_p 0.0 are
    "off". seed: None draws from MLX's global generator (seed it with `mx.random.seed`); an int gives
    the sampler its own key chain."""
    if temp < 0:
        raise ValueError(f"temperature must be >= 0, got {temp}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not 0.0 <= min_p < 1.0:
        raise ValueError(f"min_p must be in [0, 1), got {min_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if min_tokens_to_keep < 1:
        raise ValueError(f"min_tokens_to_keep must be >= 1, got {min_tokens_to_keep}")
    if temp == 0:
        return greedy

    key = [mx.random.key(seed)] if seed is not None else None

    def sample(logprobs: mx.array) -> mx.array:
        if 0 < top_k <= 1024 and use_kernel("sampling"):
            # GPU: two-pass top-k selection without a full sort (custom_kernels/sampling.py)
            from custom_kernels.sampling import sample as sample_kernel

            if key is not None:
                key[0], draw_key = mx.random.split(key[0])
            else:
                draw_key = mx.random.uniform(shape=(logprobs.shape[0],))
            tokens, _ = sample_kernel(logprobs.astype(mx.float32), temp, top_k, top_p, min_p, draw_key,
                                      min_tokens_to_keep=min_tokens_to_keep)
            return tokens
        scores = logprobs.astype(mx.float32) * (1.0 / temp)
        index = None
        if 0 < top_k < scores.shape[-1]:
            scores, index = top_k_candidates(scores, top_k)
        if top_p < 1.0 or min_p > 0.0:
            lp = _log_softmax(scores)
            keep = None
            if top_p < 1.0:
                keep = top_p_mask(lp, top_p, min_tokens_to_keep)
            if min_p > 0.0:
                m = min_p_mask(lp, min_p, min_tokens_to_keep)
                keep = m if keep is None else keep & m
            scores = mx.where(keep, scores, -mx.inf)
        if key is not None:
            key[0], draw_key = mx.random.split(key[0])
            choice = mx.random.categorical(scores, axis=-1, key=draw_key)
        else:
            choice = mx.random.categorical(scores, axis=-1)
        choice = choice.astype(mx.int32)
        if index is not None:
            choice = mx.take_along_axis(index, choice[..., None], axis=-1).squeeze(-1)
        return choice

    sample.shift_invariant = True
    return sample


def apply_repetition_penalty(logits: mx.array, context: mx.array, penalty: float) -> mx.array:
    """CTRL-style penalty on logits [B, V] for every token id in context int [N]: positive logits are
    divided by `penalty`, negative ones multiplied."""
    if context.size == 0:
        return logits
    index = mx.broadcast_to(context.astype(mx.int32)[None], (logits.shape[0], context.size))
    picked = mx.take_along_axis(logits, index, axis=-1)
    picked = mx.where(picked < 0, picked * penalty, picked / penalty)
    return mx.put_along_axis(logits, index, picked, axis=-1)


def make_logits_processors(logit_bias: Mapping[int, float] | None = None,
                           repetition_penalty: float | None = None,
                           repetition_context_size: int | None = 20) -> list[LogitsProcessor]:
    """Processors (tokens int [N] = prompt + generated so far, logits fp32 [B, V]) -> logits [B, V].

    logit_bias: token id -> additive bias. repetition_penalty (> 0; 1.0 or None: off) over the last
    repetition_context_size tokens (None: all of them)."""
    processors: list[LogitsProcessor] = []
    if logit_bias:
        ids = mx.array([int(i) for i in logit_bias], dtype=mx.int32)
        bias = mx.array([float(v) for v in logit_bias.values()], dtype=mx.float32)

        def add_bias(tokens: mx.array, logits: mx.array) -> mx.array:
            return logits.at[:, ids].add(bias)

        processors.append(add_bias)
    if repetition_penalty is not None and repetition_penalty != 1.0:
        if repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
        if repetition_context_size is not None and repetition_context_size < 1:
            raise ValueError(f"repetition_context_size must be >= 1, got {repetition_context_size}")

        def penalize(tokens: mx.array, logits: mx.array) -> mx.array:
            context = tokens if repetition_context_size is None else tokens[-repetition_context_size:]
            return apply_repetition_penalty(logits, context, repetition_penalty)

        processors.append(penalize)
    return processors
