"""On-device token selection over the vocabulary without a full sort: greedy and
temperature + top-k (k <= 1024) + top-p + min-p, returning the token id and its logprob.

    tokens, logprobs = sample(logits, temp, top_k, top_p, min_p, key_or_uniform)
    # logits f32 [B, V]; tokens int32 [B]; logprobs f32 [B]

Semantics (the contract the kernels, ``sample_reference`` and the tests' float64 oracle share):

1. NaN logits count as -inf; -0.0 counts as +0.0. Logits are otherwise finite or -inf.
2. Candidates are ranked by value descending, ties by lower vocabulary index (a total order, so
   every step below is deterministic). ``top_k`` keeps the first K = top_k ranks (top_k 0 or
   >= V: all V). Greedy (``temp == 0``) is rank 0: the argmax with the lowest index on ties.
3. On the K kept ranks r = 0..K-1, in that order: s_r = x_r * (1 / temp) (f32), weights
   w_r = exp(s_r - s_0) (w = 1 where s_r == s_0). top-p keeps rank r when the weight before it,
   sum_{j<r} w_j, is < top_p * sum_j w_j (top_p >= 1: off); min-p keeps r when w_r >= min_p
   (i.e. p_r >= min_p * p_max; min_p <= 0: off). Both keep prefixes of the ranking; the kept
   prefix is n = min(K, max(min_tokens_to_keep, min(n_top_p, n_min_p))), cut further to the
   ranks of positive weight (a zero-weight rank is never drawn). This is Hugging Face's order
   (temperature, top-k, top-p / min-p on the kept set), as gemma4_mlx.sampling.make_sampler does.
4. Draw by inverse CDF with one uniform u in [0, 1) per row: the chosen rank is the number of
   kept ranks whose inclusive prefix sum of weights is <= u * (sum of the kept weights), clamped
   to the last kept rank. Same u, same token; the caller's seeded ``mx.random`` key chain decides
   u (``key_or_uniform`` is either u itself, f32 [B] or a scalar, or an ``mx.random`` key).
5. The logprob is log_softmax of the *untempered* logits at the chosen token,
   x_t - logsumexp(x) over all V (what gemma4_mlx.generate reports: its ``logprobs`` are
   ``logits - logsumexp(logits)``; passing those logprobs here gives the same tokens and logprobs).

Kernels (one body for Metal and CUDA, see custom_kernels.dialect), two launches:

- ``g4_sample_select`` (pass 1): the vocabulary is cut into slices of TG x EPT logits, one
  threadgroup per (slice, row); every thread holds EPT consecutive logits as order-preserving
  uint32 keys in registers. The threadgroup finds the KC-th best key by bisection on the key bits
  (32 rounds of a threadgroup-wide count), takes every key above it and the lowest-index ties,
  and writes the KC candidates (value, index) in index order, plus the slice's max and
  sum exp(x - max) for the logprob. No sort, no atomics.
- ``g4_sample_merge`` (pass 2): one threadgroup per row loads all NB x KC candidates (still in
  index order, so ties again go to the lower index), selects the K best the same way, bitonic-sorts
  those K (value desc, index asc) in shared memory, applies temperature, top-p and min-p on that
  order, and draws with u through a threadgroup-wide prefix sum; it also combines the slice
  statistics into logsumexp. Greedy and top_k = 1 take a shortcut (max, then lowest index).

exp and log in the kernels are written out with basic float operations (range reduction and a
short polynomial, < 1 ulp / < 1e-6 absolute on the ranges used), so the result does not depend on
a backend's math library or fast-math mode; the kernels use no atomics and no SIMD functions
beyond sum, max and xor-shuffle.

Dispatch: on a GPU build ``sample`` runs the two kernels when K <= 1024 and the candidates fit
(``default_config``); otherwise, on CPU builds, or with ``GEMMA4_MLX_KERNELS=reference``, it runs
``sample_reference`` (MLX ops: one O(V) partition on 64-bit (value, index) keys, then a sort of
K keys; top_k = 0 sorts all V).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import KernelSource, use_reference
from .dialect import DIALECTS, prelude, render

__all__ = [
    "MAX_CANDIDATES",
    "MAX_TOP_K",
    "SampleConfig",
    "SamplePlan",
    "default_config",
    "kernel_specs",
    "launch_merge",
    "launch_select",
    "oracle_distribution",
    "oracle_pick",
    "oracle_ranking",
    "oracle_select_pass",
    "plan_sample",
    "random_logits",
    "sample",
    "sample_reference",
    "sorted_top_k_reference",
    "uniform_draw",
]

MAX_TOP_K = 1024
"""Largest K the kernels take; larger K (or top_k = 0 with a large vocabulary) uses the reference."""

MAX_CANDIDATES = 16384
"""Largest number of pass-1 candidates (slices x KC) the merge kernel holds (16 per thread)."""

_MAX_MERGE_PER_THREAD = 16


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


def _check_args(logits: mx.array, temp: float, top_k: int, top_p: float, min_p: float,
                min_tokens_to_keep: int) -> tuple[int, int]:  # fmt: skip
    """Validate; return (B, V)."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
    if temp < 0:
        raise ValueError(f"temperature must be >= 0, got {temp}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not 0.0 <= min_p < 1.0:
        raise ValueError(f"min_p must be in [0, 1), got {min_p}")
    if min_tokens_to_keep < 1:
        raise ValueError(f"min_tokens_to_keep must be >= 1, got {min_tokens_to_keep}")
    b, v = logits.shape
    if b < 1 or v < 1:
        raise ValueError(f"logits must be non-empty, got shape {logits.shape}")
    return b, v


def _kept_count(top_k: int, temp: float, v: int) -> int:
    """K: ranks kept by top-k (1 when greedy)."""
    if temp == 0:
        return 1
    return v if top_k == 0 or top_k >= v else top_k


def uniform_draw(key_or_uniform, batch: int) -> mx.array:
    """u f32 [batch] from an ``mx.random`` key (uint32 [2]) or from given uniforms (scalar or [batch])."""
    if key_or_uniform is None:
        raise ValueError("sampling at temperature > 0 needs key_or_uniform (an mx.random key or u in [0, 1))")
    if isinstance(key_or_uniform, mx.array) and key_or_uniform.dtype == mx.uint32:
        return mx.random.uniform(shape=(batch,), key=key_or_uniform)
    u = mx.array(key_or_uniform, dtype=mx.float32) if not isinstance(key_or_uniform, mx.array) else key_or_uniform
    u = u.astype(mx.float32)
    if u.ndim == 0 or u.shape == (1,):
        return mx.broadcast_to(u.reshape(1), (batch,))
    if u.shape != (batch,):
        raise ValueError(f"uniforms must be a scalar or [B={batch}], got shape {u.shape}")
    return u


# --------------------------------------------------------------------------------------------
# Pure-MLX reference
# --------------------------------------------------------------------------------------------


def _canonical(logits: mx.array) -> mx.array:
    """f32 logits with NaN -> -inf and -0.0 -> +0.0."""
    x = logits.astype(mx.float32)
    x = mx.where(mx.isnan(x), -mx.inf, x)
    return mx.where(x == 0, mx.array(0.0, dtype=mx.float32), x)


def _rank_keys(x: mx.array) -> mx.array:
    """uint64 keys [B, V] of canonical f32 x whose ascending order is (value desc, index asc)."""
    bits = mx.view(x, mx.uint32)
    ascending = mx.where(bits >= 0x80000000, ~bits, bits | 0x80000000)  # monotone in the value
    index = mx.arange(x.shape[-1], dtype=mx.uint64)
    return ((~ascending).astype(mx.uint64) << 32) | index


def sorted_top_k_reference(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k best logits of each row, ranked (value desc, index asc; NaN as -inf):
    (values f32 [B, k], indices int32 [B, k]). One O(V) partition, then a sort of k keys."""
    x = _canonical(logits)
    v = x.shape[-1]
    if not 1 <= k <= v:
        raise ValueError(f"k must be in [1, {v}], got {k}")
    keys = _rank_keys(x)
    if k < v:
        keys = mx.take_along_axis(keys, mx.argpartition(keys, k - 1, axis=-1)[..., :k], axis=-1)
    keys = mx.sort(keys, axis=-1)
    index = (keys & 0xFFFFFFFF).astype(mx.int32)
    return mx.take_along_axis(x, index, axis=-1), index


def _padded_blocks(a: mx.array, block: int) -> mx.array:
    """[B, N] -> [B, ceil(N / block), block], zero-padded."""
    b, n = a.shape
    pad = -n % block
    if pad:
        a = mx.concatenate([a, mx.zeros((b, pad), dtype=a.dtype)], axis=-1)
    return a.reshape(b, -1, block)


def _block_len(n: int) -> int:
    """Power of two near sqrt(n), at least 32: the inner length of a two-level sum over n."""
    return max(32, 1 << ((max(n, 1) - 1).bit_length() + 1) // 2)


def _row_sum(a: mx.array) -> mx.array:
    """f32 [B, N] -> [B]: two-level sum (MLX's CPU sum of one long row is sequential: ~3e-4
    relative error at N = 262144)."""
    if a.shape[-1] <= 32:
        return a.sum(axis=-1)
    return _padded_blocks(a, _block_len(a.shape[-1])).sum(axis=-1).sum(axis=-1)


def _prefix_sums(w: mx.array) -> tuple[mx.array, mx.array]:
    """Inclusive and exclusive prefix sums of f32 [B, N] along N, two-level (block totals, then
    prefix sums inside blocks), so the rounding error grows with about sqrt(N), not N."""
    b, n = w.shape
    if n <= 32:
        return mx.cumsum(w, axis=-1), mx.cumsum(w, axis=-1, inclusive=False)
    blocks = _padded_blocks(w, _block_len(n))
    offsets = mx.cumsum(blocks.sum(axis=-1), axis=-1, inclusive=False)[..., None]
    incl = (offsets + mx.cumsum(blocks, axis=-1)).reshape(b, -1)[:, :n]
    excl = (offsets + mx.cumsum(blocks, axis=-1, inclusive=False)).reshape(b, -1)[:, :n]
    return incl, excl


def _first_argmax(x: mx.array) -> mx.array:
    """int32 [B]: the lowest index of the row maximum (x canonical)."""
    top = x.max(axis=-1, keepdims=True)
    index = mx.arange(x.shape[-1], dtype=mx.int32)
    return mx.min(mx.where(x == top, index, x.shape[-1]), axis=-1).astype(mx.int32)


def sample_reference(logits: mx.array, temp: float, top_k: int = 0, top_p: float = 1.0,
                     min_p: float = 0.0, key_or_uniform=None, *,
                     min_tokens_to_keep: int = 1) -> tuple[mx.array, mx.array]:  # fmt: skip
    """Reference of ``sample`` in MLX ops (same arguments, same semantics, see the module doc)."""
    b, v = _check_args(logits, temp, top_k, top_p, min_p, min_tokens_to_keep)
    x = _canonical(logits)
    top = x.max(axis=-1)
    log_total = mx.log(_row_sum(mx.exp(x - top[:, None])))  # logprob = (x_t - top) - log_total
    if temp == 0:
        token = _first_argmax(x)
        value = mx.take_along_axis(x, token[:, None], axis=-1)[:, 0]
        return token, (value - top) - log_total
    u = uniform_draw(key_or_uniform, b)
    k = _kept_count(top_k, temp, v)
    values, index = sorted_top_k_reference(x, k)
    s = values * (1.0 / temp)
    s0 = s[:, :1]
    w = mx.where(s == s0, mx.array(1.0, dtype=mx.float32), mx.exp(s - s0))
    incl, excl = _prefix_sums(w)
    total = incl[:, -1:]
    n_p = mx.sum(excl < top_p * total, axis=-1) if top_p < 1.0 else mx.full((b,), k, dtype=mx.int32)
    n_m = mx.sum(w >= min_p, axis=-1) if min_p > 0.0 else mx.full((b,), k, dtype=mx.int32)
    n = mx.minimum(mx.maximum(mx.minimum(n_p, n_m), min_tokens_to_keep), k)
    n_eff = mx.minimum(n, mx.sum(w > 0, axis=-1)).astype(mx.int32)  # >= 1: w_0 = 1
    kept_total = mx.take_along_axis(incl, (n_eff - 1)[:, None], axis=-1)
    rank = mx.arange(k, dtype=mx.int32)
    below = mx.sum((incl <= u[:, None] * kept_total) & (rank < n_eff[:, None]), axis=-1)
    pick = mx.minimum(below, n_eff - 1).astype(mx.int32)[:, None]
    token = mx.take_along_axis(index, pick, axis=-1)[:, 0]
    return token, (mx.take_along_axis(values, pick, axis=-1)[:, 0] - top) - log_total


# --------------------------------------------------------------------------------------------
# float64 numpy oracle (tests and the emulator cases)
# --------------------------------------------------------------------------------------------


def _canonical_np(row: np.ndarray) -> np.ndarray:
    x = np.asarray(row, dtype=np.float64).copy()
    x[np.isnan(x)] = -np.inf
    x[x == 0] = 0.0
    return x


def oracle_ranking(row: np.ndarray) -> np.ndarray:
    """Vocabulary indices of one row [V] ranked (value desc, index asc; NaN as -inf)."""
    x = _canonical_np(row)
    return np.lexsort((np.arange(x.size), -x))


def oracle_distribution(row: np.ndarray, temp: float, top_k: int = 0, top_p: float = 1.0,
                        min_p: float = 0.0, min_tokens_to_keep: int = 1) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The filtered, renormalised distribution of one row [V] in float64:
    (token ids in rank order, their probabilities), per the module doc."""
    x = _canonical_np(row)
    order = oracle_ranking(x)
    if temp == 0:
        return order[:1], np.ones(1)
    k = _kept_count(top_k, temp, x.size)
    order = order[:k]
    s = x[order] / temp
    w = np.where(s == s[0], 1.0, np.exp(s - s[0]))
    excl = np.cumsum(w) - w
    n_p = k if top_p >= 1.0 else int(np.sum(excl < top_p * w.sum()))
    n_m = k if min_p <= 0.0 else int(np.sum(w >= min_p))
    n = min(k, max(min_tokens_to_keep, min(n_p, n_m)))
    n = min(n, int(np.sum(w > 0)))
    return order[:n], w[:n] / w[:n].sum()


def oracle_pick(tokens: np.ndarray, probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw: the first token whose cumulative probability exceeds u."""
    below = int(np.sum(np.cumsum(probs) <= u))
    return int(tokens[min(below, len(tokens) - 1)])


def oracle_select_pass(logits: np.ndarray, kc: int, slice_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What pass 1 writes for logits [B, V]: per slice of ``slice_len`` the ``kc`` best entries in
    index order (slots past the vocabulary: -inf, index V) -> (values f64 [B, NB*kc],
    indices [B, NB*kc], stats [B, NB, 2] = (slice max, sum exp(x - max)))."""
    b, v = logits.shape
    nb = -(-v // slice_len)
    vals = np.full((b, nb * kc), -np.inf)
    idx = np.full((b, nb * kc), v, dtype=np.int64)
    stats = np.zeros((b, nb, 2))
    for r in range(b):
        x = _canonical_np(logits[r])
        for blk in range(nb):
            lo, hi = blk * slice_len, min(v, (blk + 1) * slice_len)
            part = x[lo:hi]
            best = np.sort(oracle_ranking(part)[:kc]) + lo
            vals[r, blk * kc : blk * kc + best.size] = x[best]
            idx[r, blk * kc : blk * kc + best.size] = best
            m = part.max()
            stats[r, blk] = (m, np.exp(part - m).sum() if m > -np.inf else 0.0)
    return vals, idx, stats


# --------------------------------------------------------------------------------------------
# Kernel text (shared dialect; @FN@ / @TG@ are this module's spellings of a helper function's
# qualifiers and of the shared-memory address space of a pointer)
# --------------------------------------------------------------------------------------------

_FN = {"metal": "static inline", "cuda": "__device__ __forceinline__"}
_TG = {"metal": "threadgroup", "cuda": ""}

BLOCK_SUM = r"""@FN@ float g4s_block_sum(float v, @TG@ float* red, int phase, int tid, int nsg) {
  v = g4_simd_sum(v);
  if ((tid & 31) == 0) red[32 * phase + (tid >> 5)] = v;
  $barrier;
  float s = 0.0f;
  for (int i = 0; i < nsg; ++i) s += red[32 * phase + i];
  return s;
}
"""
"""A threadgroup-wide float sum over nsg SIMD groups (text with the @FN@ / @TG@ tokens and $barrier);
norm.py's kernel shares it."""

_HELPERS = (
    r"""
// gemma4-mlx sampling helpers
#define G4S_NEG_INF_KEY 0x007fffffu

// Order-preserving uint32 key of a float (NaN -> key of -inf, -0 -> key of +0). Key 0 (below
// every value) marks an empty slot.
@FN@ uint32_t g4s_key(float x) {
  uint32_t b = g4_as_uint(x);
  if ((b & 0x7fffffffu) > 0x7f800000u) b = 0xff800000u;
  if (b == 0x80000000u) b = 0u;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The float of a key; empty slots (key < key of -inf) read as -inf.
@FN@ float g4s_value(uint32_t k) {
  if (k < G4S_NEG_INF_KEY) k = G4S_NEG_INF_KEY;
  return g4_as_float((k & 0x80000000u) ? (k ^ 0x80000000u) : ~k);
}

// e^x with basic float operations: x <= -87 (and -inf) gives 0; Cody-Waite reduction by ln 2,
// degree-7 Taylor polynomial on |r| <= 0.35 (< 1 ulp).
@FN@ float g4s_exp(float x) {
  if (!(x > -87.0f)) return 0.0f;
  if (x > 88.0f) x = 88.0f;
  const float t = x * 1.44269504088896341f;
  const int n = (int)(t < 0.0f ? t - 0.5f : t + 0.5f);
  const float fn = (float)n;
  const float r = (x - fn * 0.693145751953125f) - fn * 1.428606765330187e-6f;
  float p = 1.984126984e-4f;
  p = p * r + 1.388888889e-3f;
  p = p * r + 8.333333333e-3f;
  p = p * r + 4.166666667e-2f;
  p = p * r + 1.666666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * g4_as_float((uint32_t)(n + 127) << 23);
}

// Natural log of a positive normal float: exponent and mantissa m in [0.71, 1.42),
// log m = 2 atanh((m - 1) / (m + 1)) by its series to z^11.
@FN@ float g4s_log(float s) {
  const uint32_t b = g4_as_uint(s);
  int e = (int)(b >> 23) - 127;
  float m = g4_as_float((b & 0x007fffffu) | 0x3f800000u);
  if (m > 1.41421356f) { m = m * 0.5f; e += 1; }
  const float z = (m - 1.0f) / (m + 1.0f);
  const float z2 = z * z;
  float p = 9.090909091e-2f;
  p = p * z2 + 1.111111111e-1f;
  p = p * z2 + 1.428571429e-1f;
  p = p * z2 + 2.0e-1f;
  p = p * z2 + 3.333333333e-1f;
  p = p * z2 + 1.0f;
  const float fe = (float)e;
  return fe * 0.693145751953125f + (fe * 1.428606765330187e-6f + 2.0f * z * p);
}

// Threadgroup-wide reductions over nsg SIMD groups of 32 lanes; every thread gets the same
// result. red holds 2 x 32 floats of shared memory; consecutive calls must alternate phase
// (0, 1, 0, ...), which makes one barrier per call enough.
"""
    + BLOCK_SUM
    + r"""
@FN@ float g4s_block_max(float v, @TG@ float* red, int phase, int tid, int nsg) {
  v = g4_simd_max(v);
  if ((tid & 31) == 0) red[32 * phase + (tid >> 5)] = v;
  $barrier;
  float m = red[32 * phase];
  for (int i = 1; i < nsg; ++i) m = red[32 * phase + i] > m ? red[32 * phase + i] : m;
  return m;
}

// Exclusive prefix sum of v over the threads in tid order (butterfly scan inside each SIMD
// group, then the SIMD-group totals); *total receives the sum over all threads.
@FN@ float g4s_block_scan(float v, @TG@ float* red, int phase, int tid, int nsg, $thread float* total) {
  const int lane = tid & 31;
  float excl = 0.0f;
  float sum = v;
  for (int o = 1; o < 32; o <<= 1) {
    const float other = g4_shuffle_xor(sum, o);
    if (lane & o) excl += other;
    sum += other;
  }
  if (lane == 0) red[32 * phase + (tid >> 5)] = sum;
  $barrier;
  float base = 0.0f;
  float all = 0.0f;
  for (int i = 0; i < nsg; ++i) {
    const float s = red[32 * phase + i];
    if (i < (tid >> 5)) base += s;
    all += s;
  }
  *total = all;
  return base + excl;
}
"""
)

# Selection of the NSEL best of the TG x EPT keys held EPT per thread (thread-major positions,
# i.e. index order). Defines tau, take and, per thread, out (its first output slot) and eqr.
_SELECT_TOP = r"""
    // tau = the largest key with at least NSEL keys >= tau (bisection on the key bits)
    uint32_t tau = 0u;
    for (int bit = 31; bit >= 0; --bit) {
      const uint32_t cand = tau | (1u << bit);
      float c = 0.0f;
      $unroll for (int j = 0; j < EPT; ++j) c += key[j] >= cand ? 1.0f : 0.0f;
      if (g4s_block_sum(c, red, ph ^= 1, tid, NSG) >= (float)NSEL) tau = cand;
    }
    // every key > tau, then the ties at tau with the lowest positions
    float ngt = 0.0f;
    float neq = 0.0f;
    $unroll for (int j = 0; j < EPT; ++j) {
      ngt += key[j] > tau ? 1.0f : 0.0f;
      neq += key[j] == tau ? 1.0f : 0.0f;
    }
    float gt_total = 0.0f;
    float eq_total = 0.0f;
    const int gt_before = (int)g4s_block_scan(ngt, red, ph ^= 1, tid, NSG, &gt_total);
    const int eq_before = (int)g4s_block_scan(neq, red, ph ^= 1, tid, NSG, &eq_total);
    const int take = NSEL - (int)gt_total;
    int out = gt_before + (eq_before < take ? eq_before : take);
    int eqr = eq_before;
"""

# K = 1: the best value, then its lowest position. Defines pos_best (position, or TG * EPT).
_SELECT_ONE = r"""
    float vmax = NEG_INF;
    $unroll for (int j = 0; j < EPT; ++j) {
      const float v = g4s_value(key[j]);
      if (key[j] >= G4S_NEG_INF_KEY && v > vmax) vmax = v;
    }
    const uint32_t kbest = g4s_key(g4s_block_max(vmax, red, ph ^= 1, tid, NSG));
    float pos = (float)(TG * EPT);
    $unroll for (int j = EPT - 1; j >= 0; --j) pos = key[j] == kbest ? (float)(tid * EPT + j) : pos;
    const int pos_best = (int)(-g4s_block_max(-pos, red, ph ^= 1, tid, NSG));
"""

# Template: KC (candidates per slice), EPT (logits per thread), TG (threads per threadgroup).
_SELECT_BODY = (
    r"""
  // gemma4-mlx sample_select (pass 1): the KC best logits of one slice of TG * EPT, in index
  // order, and the slice's max and sum of exp(x - max)
  constexpr int NSG = TG / 32;
  constexpr int L = TG * EPT;
  constexpr int NSEL = KC;
  $shared float red[64];
  const float NEG_INF = g4_as_float(0xff800000u);
  const int V = logits_shape[1];
  const int NB = (V + L - 1) / L;
  const int row = $tg_y;
  const int blk = $tg_x;
  const int tid = $tid;
  const int first = blk * L + tid * EPT;
  int ph = 0;
  uint32_t key[EPT];
  $unroll for (int j = 0; j < EPT; ++j) {
    key[j] = first + j < V ? g4s_key(logits[(size_t)row * V + first + j]) : 0u;
  }
  float mt = NEG_INF;
  $unroll for (int j = 0; j < EPT; ++j) {
    const float v = g4s_value(key[j]);
    if (key[j] >= G4S_NEG_INF_KEY && v > mt) mt = v;
  }
  float st = 0.0f;
  $unroll for (int j = 0; j < EPT; ++j) {
    if (key[j] > G4S_NEG_INF_KEY) st += g4s_exp(g4s_value(key[j]) - mt);
  }
  const float mb = g4s_block_max(mt, red, ph ^= 1, tid, NSG);
  const float sb = g4s_block_sum(mt > NEG_INF ? st * g4s_exp(mt - mb) : 0.0f, red, ph ^= 1, tid, NSG);
  const size_t slot = (size_t)row * NB + blk;
  if (tid == 0) {
    stats[2 * slot] = mb;
    stats[2 * slot + 1] = sb;
  }
  $device float* ov = cand_val + slot * KC;
  $device int* oi = cand_idx + slot * KC;
  if (KC == 1) {
"""
    + _SELECT_ONE
    + r"""
    $unroll for (int j = 0; j < EPT; ++j) {
      if (tid * EPT + j == pos_best) {
        ov[0] = g4s_value(key[j]);
        oi[0] = first + j < V ? first + j : V;
      }
    }
  } else {
"""
    + _SELECT_TOP
    + r"""
    $unroll for (int j = 0; j < EPT; ++j) {
      const bool gt = key[j] > tau;
      const bool eq = key[j] == tau;
      if (gt || (eq && eqr < take)) {
        ov[out] = g4s_value(key[j]);
        oi[out] = first + j < V ? first + j : V;
        ++out;
      }
      eqr += eq ? 1 : 0;
    }
  }
"""
)

# Template: K (ranks kept by top-k), KP (power of two >= K), EPT (candidates per thread), TG.
_MERGE_BODY = (
    r"""
  // gemma4-mlx sample_merge (pass 2): global top-K of the pass-1 candidates, temperature,
  // top-p, min-p, inverse-CDF draw with u; logprob of the untempered logits
  constexpr int NSG = TG / 32;
  constexpr int RPT = (KP + TG - 1) / TG;
  constexpr int NSEL = K;
  $shared float red[64];
  $shared uint32_t sk[KP];
  $shared int si[KP];
  $shared float kept_total[1];
  const float NEG_INF = g4_as_float(0xff800000u);
  const int C = cand_val_shape[1];
  const int NB = stats_shape[1];
  const int row = $tg_y;
  const int tid = $tid;
  int ph = 0;
  // logsumexp of the row from the slices' (max, sum exp(x - max))
  float ml = NEG_INF;
  for (int b = tid; b < NB; b += TG) {
    const float m = stats[((size_t)row * NB + b) * 2];
    ml = m > ml ? m : ml;
  }
  const float M = g4s_block_max(ml, red, ph ^= 1, tid, NSG);
  float sl = 0.0f;
  for (int b = tid; b < NB; b += TG) {
    const float m = stats[((size_t)row * NB + b) * 2];
    const float s = stats[((size_t)row * NB + b) * 2 + 1];
    if (s > 0.0f) sl += s * g4s_exp(m - M);
  }
  const float S = g4s_block_sum(sl, red, ph ^= 1, tid, NSG);
  // candidates, EPT consecutive per thread (their array order is vocabulary order)
  const int first = tid * EPT;
  uint32_t key[EPT];  // (indices are read again only for the selected slots)
  $unroll for (int j = 0; j < EPT; ++j) {
    key[j] = first + j < C ? g4s_key(cand_val[(size_t)row * C + first + j]) : 0u;
  }
  int pick = 0;
  if (K == 1) {
"""
    + _SELECT_ONE
    + r"""
    $unroll for (int j = 0; j < EPT; ++j) {
      if (first + j == pos_best) {
        sk[0] = key[j];
        si[0] = cand_idx[(size_t)row * C + first + j];
      }
    }
    $barrier;
  } else {
    for (int p = K + tid; p < KP; p += TG) {
      sk[p] = 0u;
      si[p] = 0x7fffffff;
    }
"""
    + _SELECT_TOP
    + r"""
    $unroll for (int j = 0; j < EPT; ++j) {
      const bool gt = key[j] > tau;
      const bool eq = key[j] == tau;
      if (gt || (eq && eqr < take)) {
        sk[out] = key[j];
        si[out] = first + j < C ? cand_idx[(size_t)row * C + first + j] : 0x7fffffff;
        ++out;
      }
      eqr += eq ? 1 : 0;
    }
    $barrier;
    // bitonic sort of the KP slots: key descending, then index ascending
    for (int size = 2; size <= KP; size <<= 1) {
      for (int stride = size >> 1; stride > 0; stride >>= 1) {
        for (int i = tid; i < KP / 2; i += TG) {
          const int lo = 2 * i - (i & (stride - 1));
          const int hi = lo + stride;
          const uint32_t ka = sk[lo];
          const uint32_t kb = sk[hi];
          const int ia = si[lo];
          const int ib = si[hi];
          const bool b_first = kb > ka || (kb == ka && ib < ia);
          if (b_first == ((lo & size) == 0)) {
            sk[lo] = kb;
            sk[hi] = ka;
            si[lo] = ib;
            si[hi] = ia;
          }
        }
        $barrier;
      }
    }
    // weights w_r = exp(s_r - s_0) on ranks r = tid * RPT + q, their prefix sums, the filters
    const float inv_t = params[0];
    const float top_p = params[1];
    const float min_p = params[2];
    const int keep_min = (int)params[3];
    const float s0 = g4s_value(sk[0]) * inv_t;
    float w[RPT];
    float lsum = 0.0f;
    $unroll for (int q = 0; q < RPT; ++q) {
      const int r = tid * RPT + q;
      float wq = 0.0f;
      if (r < K) {
        const float s = g4s_value(sk[r]) * inv_t;
        wq = s == s0 ? 1.0f : g4s_exp(s - s0);
      }
      w[q] = wq;
      lsum += wq;
    }
    float W = 0.0f;
    const float base = g4s_block_scan(lsum, red, ph ^= 1, tid, NSG, &W);
    float incl[RPT];
    float acc = base;
    float np = 0.0f;
    float nm = 0.0f;
    float npos = 0.0f;
    $unroll for (int q = 0; q < RPT; ++q) {
      const int r = tid * RPT + q;
      const float excl = acc;
      acc = acc + w[q];
      incl[q] = acc;
      if (r < K) {
        np += (top_p >= 1.0f || excl < top_p * W) ? 1.0f : 0.0f;
        nm += (min_p <= 0.0f || w[q] >= min_p) ? 1.0f : 0.0f;
        npos += w[q] > 0.0f ? 1.0f : 0.0f;
      }
    }
    const int n_p = (int)g4s_block_sum(np, red, ph ^= 1, tid, NSG);
    const int n_m = (int)g4s_block_sum(nm, red, ph ^= 1, tid, NSG);
    const int n_pos = (int)g4s_block_sum(npos, red, ph ^= 1, tid, NSG);
    int n = n_p < n_m ? n_p : n_m;
    n = n > keep_min ? n : keep_min;
    n = n < K ? n : K;
    const int n_eff = n < n_pos ? n : n_pos;
    $unroll for (int q = 0; q < RPT; ++q) {
      if (tid * RPT + q == n_eff - 1) kept_total[0] = incl[q];
    }
    $barrier;
    const float target = u[row] * kept_total[0];
    float below = 0.0f;
    $unroll for (int q = 0; q < RPT; ++q) {
      below += (tid * RPT + q < n_eff && incl[q] <= target) ? 1.0f : 0.0f;
    }
    const int nb_below = (int)g4s_block_sum(below, red, ph ^= 1, tid, NSG);
    pick = nb_below < n_eff - 1 ? nb_below : n_eff - 1;
  }
  if (tid == 0) {
    token[row] = si[pick];
    logprob[row] = S > 0.0f ? (g4s_value(sk[pick]) - M) - g4s_log(S) : g4_nan();
  }
"""
)


def _text(body: str, dialect: str) -> tuple[str, str]:
    """(header, source) of one kernel body for ``dialect``."""

    def sub(t: str) -> str:
        return render(t.replace("@FN@", _FN[dialect]).replace("@TG@", _TG[dialect]), dialect)

    return prelude(dialect) + sub(_HELPERS), sub(body)


_SELECT = KernelSource("g4_sample_select", ("logits",), ("cand_val", "cand_idx", "stats"),
                     {d: _text(_SELECT_BODY, d) for d in DIALECTS})  # fmt: skip
_MERGE = KernelSource("g4_sample_merge", ("cand_val", "cand_idx", "stats", "u", "params"), ("token", "logprob"),
                    {d: _text(_MERGE_BODY, d) for d in DIALECTS})  # fmt: skip


# --------------------------------------------------------------------------------------------
# Launch planning
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleConfig:
    """Launch geometry: pass 1 threads per threadgroup and logits per thread (a slice is their
    product), pass 2 threads (one threadgroup per row). Threads: multiples of 32, <= 1024."""

    select_threads: int
    select_per_thread: int
    merge_threads: int

    def __post_init__(self):
        for t in (self.select_threads, self.merge_threads):
            if t % 32 or not 32 <= t <= 1024:
                raise ValueError(f"threads per threadgroup must be a multiple of 32 in [32, 1024], got {t}")
        if not 1 <= self.select_per_thread <= 32:
            raise ValueError(f"select_per_thread must be in [1, 32], got {self.select_per_thread}")


_SELECT_GEOMETRIES = ((256, 8), (512, 8), (1024, 8), (1024, 16))  # slices of 2K, 4K, 8K, 16K logits


def default_config(v: int, k: int) -> SampleConfig | None:
    """The smallest slice (most threadgroups in pass 1) whose NB x min(k, slice) candidates fit
    the merge kernel; None when k > MAX_TOP_K or nothing fits (then ``sample`` uses the reference).
    Pass 2: 1024 threads when there are more than 4096 candidates, else 256 (128 for k = 1)."""
    if not 1 <= k <= min(v, MAX_TOP_K):
        return None
    for threads, per_thread in _SELECT_GEOMETRIES:
        slice_len = threads * per_thread
        c = -(-v // slice_len) * min(k, slice_len)
        if c <= MAX_CANDIDATES:
            merge = 1024 if c > 4096 else (128 if k == 1 else 256)
            return SampleConfig(threads, per_thread, merge)
    return None


@dataclass(frozen=True)
class SamplePlan:
    """Both launches for logits [B, V] and K kept ranks (templates as MLX takes them)."""

    slices: int  # NB
    per_slice: int  # KC
    candidates: int  # C = NB * KC
    select_template: list
    select_grid: tuple[int, int, int]
    select_threadgroup: tuple[int, int, int]
    merge_template: list
    merge_grid: tuple[int, int, int]
    merge_threadgroup: tuple[int, int, int]


def plan_sample(b: int, v: int, k: int, config: SampleConfig | None = None) -> SamplePlan:
    """Launch plan of the two kernels (raises ValueError when the geometry cannot hold k)."""
    cfg = config or default_config(v, k)
    if cfg is None or not 1 <= k <= min(v, MAX_TOP_K):
        raise ValueError(f"the sampling kernels take 1 <= k <= min(V, {MAX_TOP_K}); got k={k}, V={v}")
    slice_len = cfg.select_threads * cfg.select_per_thread
    nb = -(-v // slice_len)
    kc = min(k, slice_len)
    c = nb * kc
    per_thread = -(-c // cfg.merge_threads)
    if per_thread > _MAX_MERGE_PER_THREAD:
        raise ValueError(f"{c} candidates need more than {_MAX_MERGE_PER_THREAD} per merge thread")
    kp = 1 << (k - 1).bit_length()
    return SamplePlan(
        nb, kc, c,
        [("KC", kc), ("EPT", cfg.select_per_thread), ("TG", cfg.select_threads)],
        (nb * cfg.select_threads, b, 1), (cfg.select_threads, 1, 1),
        [("K", k), ("KP", kp), ("EPT", per_thread), ("TG", cfg.merge_threads)],
        (cfg.merge_threads, b, 1), (cfg.merge_threads, 1, 1),
    )  # fmt: skip


def _kernel(source: KernelSource):
    """The kernel object of `source` (a seam: the CPU tests swap in the Metal emulator here)."""
    return source.kernel()


def launch_select(logits: mx.array, plan: SamplePlan) -> tuple[mx.array, mx.array, mx.array]:
    """Pass 1 (GPU builds only): logits f32 [B, V] -> (candidate values f32 [B, C], their indices
    int32 [B, C], slice stats f32 [B, NB, 2])."""
    b = logits.shape[0]
    return tuple(_kernel(_SELECT)(
        inputs=[logits], template=plan.select_template, grid=plan.select_grid,
        threadgroup=plan.select_threadgroup,
        output_shapes=[(b, plan.candidates), (b, plan.candidates), (b, plan.slices, 2)],
        output_dtypes=[mx.float32, mx.int32, mx.float32],
    ))  # fmt: skip


def launch_merge(cand_val: mx.array, cand_idx: mx.array, stats: mx.array, u: mx.array, params: mx.array,
                 plan: SamplePlan) -> tuple[mx.array, mx.array]:  # fmt: skip
    """Pass 2 (GPU builds only) -> (tokens int32 [B], logprobs f32 [B]). params f32 [4] =
    (1 / temp, top_p, min_p, min_tokens_to_keep); u f32 [B]."""
    b = cand_val.shape[0]
    token, logprob = _kernel(_MERGE)(
        inputs=[cand_val, cand_idx, stats, u, params], template=plan.merge_template, grid=plan.merge_grid,
        threadgroup=plan.merge_threadgroup, output_shapes=[(b,), (b,)], output_dtypes=[mx.int32, mx.float32],
    )  # fmt: skip
    return token, logprob


def _params(temp: float, top_p: float, min_p: float, min_tokens_to_keep: int) -> np.ndarray:
    inv_t = np.float32(1.0 / temp) if temp > 0 else np.float32(1.0)
    return np.array([inv_t, top_p, min_p, min_tokens_to_keep], dtype=np.float32)


# --------------------------------------------------------------------------------------------
# Dispatch (public API)
# --------------------------------------------------------------------------------------------


def sample(logits: mx.array, temp: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
           key_or_uniform=None, *, min_tokens_to_keep: int = 1,
           config: SampleConfig | None = None) -> tuple[mx.array, mx.array]:  # fmt: skip
    """Select one token per row of logits f32 [B, V] -> (tokens int32 [B], logprobs f32 [B]).

    temp 0: greedy (argmax, lowest index on ties; the filters and key_or_uniform are ignored).
    temp > 0: top_k (0 = off), then top_p (1.0 = off) and min_p (0.0 = off) on the kept ranks,
    then an inverse-CDF draw with u from key_or_uniform (an ``mx.random`` key, or u f32 [B] /
    scalar in [0, 1)). The logprob is log_softmax of the untempered logits at the token
    (x_t - logsumexp(x)). Custom kernels on GPU builds for K <= 1024, else ``sample_reference``.
    """
    b, v = _check_args(logits, temp, top_k, top_p, min_p, min_tokens_to_keep)
    k = _kept_count(top_k, temp, v)
    cfg = config or default_config(v, k)
    if use_reference() or cfg is None:
        return sample_reference(logits, temp, top_k, top_p, min_p, key_or_uniform,
                                min_tokens_to_keep=min_tokens_to_keep)  # fmt: skip
    plan = _plan(b, v, k, cfg)
    u = mx.zeros((b,), dtype=mx.float32) if temp == 0 else uniform_draw(key_or_uniform, b)
    cand_val, cand_idx, stats = launch_select(logits.astype(mx.float32), plan)
    params = mx.array(_params(temp, top_p, min_p, min_tokens_to_keep))
    return launch_merge(cand_val, cand_idx, stats, u, params, plan)


@functools.lru_cache(maxsize=64)
def _plan(b: int, v: int, k: int, cfg: SampleConfig) -> SamplePlan:
    """plan_sample, made once per shape (the top-k sampler asks for one every token)."""
    return plan_sample(b, v, k, cfg)


# --------------------------------------------------------------------------------------------
# Emulator / compile-test registry (see custom_kernels.registry)
# --------------------------------------------------------------------------------------------


def random_logits(rng: np.random.Generator, b: int, v: int, levels: int = 96) -> np.ndarray:
    """f32 [B, V] logits on a grid of ``levels`` values in [-6, 6) (many exact ties), with a few
    -inf, NaN, -0.0 and +0.0 entries."""
    x = (rng.integers(0, levels, size=(b, v)) * (12.0 / levels) - 6.0).astype(np.float32)
    for r in range(b):
        spots = rng.choice(v, size=min(v, 6), replace=False)
        x[r, spots[:2]] = -np.inf
        x[r, spots[2:3]] = np.nan
        x[r, spots[3:4]] = -0.0
        x[r, spots[4:5]] = 0.0
    return x


def _select_case(rng, b, v, k, cfg: SampleConfig):
    from .registry import KernelCase

    logits = random_logits(rng, b, v)
    plan = plan_sample(b, v, k, cfg)
    vals, idx, stats = oracle_select_pass(logits, plan.per_slice, cfg.select_threads * cfg.select_per_thread)
    return KernelCase(
        inputs={"logits": logits}, template=plan.select_template, grid=plan.select_grid,
        threadgroup=plan.select_threadgroup,
        output_shapes=[(b, plan.candidates), (b, plan.candidates), (b, plan.slices, 2)],
        output_dtypes=["float32", "int32", "float32"], expected=[vals, idx, stats],
        rtol=1e-5, atol=1e-6, label=f"B={b} V={v} k={k} {cfg}",
    )  # fmt: skip


def _safe_midpoint(edges: np.ndarray, rng: np.random.Generator) -> float:
    """The middle of a random gap wider than 1e-4 between consecutive sorted ``edges`` (the
    widest gap when none is), so a value there is far from every edge in f32 terms."""
    widths = np.diff(edges)
    gaps = np.flatnonzero(widths > 1e-4)
    i = int(rng.choice(gaps)) if gaps.size else int(np.argmax(widths))
    return float((edges[i] + edges[i + 1]) / 2)


def _merge_case(rng, b, v, k, temp, cfg: SampleConfig, filters: bool):
    """Pass-2 launch on the oracle's pass-1 output. top_p, min_p and u are drawn away from every
    decision boundary, so the expected token is exact despite f32 rounding."""
    from .registry import KernelCase

    logits = random_logits(rng, b, v)
    plan = plan_sample(b, v, k, cfg)
    vals, idx, stats = oracle_select_pass(logits, plan.per_slice, cfg.select_threads * cfg.select_per_thread)
    u = np.zeros(b, dtype=np.float32)
    tokens = np.zeros(b)
    logprobs = np.zeros(b)
    top_p, min_p, keep_min = 1.0, 0.0, 1
    x64 = np.where(np.isnan(logits), -np.inf, logits).astype(np.float64)
    for r in range(b):
        if filters and temp > 0 and r == 0:  # the same filters for every row: decided on row 0
            order = oracle_ranking(logits[r])[:k]
            s = x64[r, order] / temp
            w = np.exp(s - s[0])
            mass = np.concatenate([[0.0], np.cumsum(w) / w.sum()])
            top_p = _safe_midpoint(mass[: k // 2 + 2], rng)
            levels = np.unique(w)  # ascending; min_p between two of the lower half of them
            min_p = _safe_midpoint(levels[: max(2, levels.size // 2)], rng) if levels.size > 1 else 0.5
            keep_min = 2
        ids, probs = oracle_distribution(logits[r], temp, k, top_p, min_p, keep_min)
        if temp > 0:
            u[r] = np.float32(_safe_midpoint(np.concatenate([[0.0], np.cumsum(probs)]), rng))
        tokens[r] = oracle_pick(ids, probs, float(u[r]))
        m = x64[r].max()
        logprobs[r] = x64[r, int(tokens[r])] - (m + np.log(np.exp(x64[r] - m).sum()))
    params = _params(temp, top_p, min_p, keep_min)
    return KernelCase(
        inputs={"cand_val": vals.astype(np.float32), "cand_idx": idx.astype(np.int32),
                "stats": stats.astype(np.float32), "u": u, "params": params},
        template=plan.merge_template, grid=plan.merge_grid, threadgroup=plan.merge_threadgroup,
        output_shapes=[(b,), (b,)], output_dtypes=["int32", "float32"], expected=[tokens, logprobs],
        rtol=1e-5, atol=2e-5, label=f"B={b} V={v} k={k} temp={temp} top_p={top_p:.4f} min_p={min_p:.4f} {cfg}",
    )  # fmt: skip


def _select_cases(rng: np.random.Generator):
    return [
        _select_case(rng, 2, 1000, 1, SampleConfig(64, 4, 64)),
        _select_case(rng, 1, 2999, 40, SampleConfig(64, 8, 64)),
        _select_case(rng, 2, 777, 64, SampleConfig(32, 3, 64)),  # last slice shorter than k
        _select_case(rng, 1, 333, 40, SampleConfig(32, 1, 64)),  # k > slice: every logit kept
    ]


def _merge_cases(rng: np.random.Generator):
    return [
        _merge_case(rng, 2, 1000, 1, 0.0, SampleConfig(64, 4, 64), False),
        _merge_case(rng, 3, 2999, 40, 0.8, SampleConfig(64, 8, 64), True),
        _merge_case(rng, 1, 3001, 64, 1.5, SampleConfig(128, 8, 96), False),
        _merge_case(rng, 2, 1203, 7, 1.0, SampleConfig(64, 4, 32), True),
    ]


def kernel_specs():
    """KernelSpec of both sampling kernels, with small cases (odd V, ties, -inf/NaN, k up to 64)."""
    from .registry import KernelSpec

    return [
        KernelSpec(_SELECT.name, _SELECT.input_names, _SELECT.output_names, *_SELECT.text["metal"],
                   *_SELECT.text["cuda"], _select_cases),
        KernelSpec(_MERGE.name, _MERGE.input_names, _MERGE.output_names, *_MERGE.text["metal"],
                   *_MERGE.text["cuda"], _merge_cases),
    ]  # fmt: skip
