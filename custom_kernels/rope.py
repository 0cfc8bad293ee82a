"""Attention heads after the projection, in one launch: q_norm + RoPE on the query heads, k_norm +
RoPE on the key heads and the weightless v_norm on the value heads, each written in the
[B, heads, T, d] layout attention reads (MLX ops take five launches for it: three rms_norm, two
rope, plus copies where the split views are not contiguous).

    q, k, v = norm_rope(y, heads, w_q, w_k, positions, eps, inv_freq)
    # y [B, T, (HQ + HKV (+ HKV)) * d]: the q|k|v projection output (k only when K = V: then the
    # value heads are the key heads before k_norm); HKV = 0 for KV-shared layers (k, v None)
    q, kv = norm_rope(y, heads, w_q, w_k, positions, eps, inv_freq, stacked=True)
    # kv [2B, HKV, T, d]: k's rows, then v's (g4_norm_rope_kv), what a one-buffer static cache
    # (gemma4_mlx.cache) writes with one scatter

Semantics (kernel, ``norm_rope_reference`` and the tests' oracle), rounding as MLX's ops do: per head
row x of d elements, n = T(w * T(x * r(x))) (no w for v), r(x) = 1 / sqrt(mean(x^2) + eps) in f32;
then for q and k, pair (i, i + d/2) at position p: theta = p * f_i in f32, with f_i the inverse
frequencies (``inverse_frequencies``: base^(-i / (d/2)), or 1 / periods[i] for proportional RoPE, 0
for an infinite period), and (n_i cos theta - n_{i+d/2} sin theta, n_i sin theta + n_{i+d/2} cos theta)
rounded to T. MLX's rope computes f_i on the device (exp2 of an f32 product): a few ulp apart,
which p multiplies; the kernel takes them from the host so the result is reproducible.

Kernel (one body for Metal and CUDA, custom_kernels.dialect): one SIMD group per head row; lane l
holds the pairs l, l + 32, ... (D / 64 of them), so a SIMD sum gives the norm and each lane
rotates its own pairs.

Family "norm_rope": on by default on CUDA (passed ``pytest -m gpu`` on the H200; E4B decode +12% at
4K in alternated processes, bench/NOTES.md session 11), opt-in on Metal (not measured there).
Family "kv_one_write": the stacked form g4_norm_rope_kv, the same body with v written after k in
one output; on by default on CUDA (its registry cases, operator test, compute-sanitizer and the
model tests passed on the H200, bench/NOTES.md sessions 30-31), opt-in on Metal.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import KernelSource, dtype_name, template_args, use_reference
from .dialect import emit

__all__ = ["inverse_frequencies", "kernel_specs", "norm_rope", "norm_rope_reference", "norm_rope_np"]

# Template: T, D (head dim, multiple of 64), HQ, HKV (0: q only), KEQV, TQ (tokens per sequence),
# NSG (SIMD groups per threadgroup).
_BODY = r"""
  // gemma4-mlx norm_rope: q_norm + RoPE, k_norm + RoPE, v_norm, out in [B, heads, T, D]
  constexpr int NH = HQ + 2 * HKV;   // head rows per token
  constexpr int W = (HQ + (KEQV ? 1 : 2) * HKV) * D;  // projection row width
  constexpr int P = D / 64;          // pairs per lane
  const int lane = $lane;
  const int g = $tg_x * NSG + $simd;
  const int rows = y_shape[0] * y_shape[1];
  if (g >= rows * NH) return;
  const int r = g / NH;
  const int j = g % NH;
  const int b = r / TQ;
  const int t = r % TQ;
  const bool is_q = j < HQ;
  const bool is_k = !is_q && j < HQ + HKV;
  const int head = is_q ? j : is_k ? j - HQ : j - HQ - HKV;
  const int col = is_q ? j * D : is_k ? HQ * D + head * D : (KEQV ? HQ * D : (HQ + HKV) * D) + head * D;
  const $device T* src = y + (size_t)r * W + col;
  float x1[P];
  float x2[P];
  float ss = 0.0f;
  $unroll for (int p = 0; p < P; ++p) {
    x1[p] = static_cast<float>(src[lane + 32 * p]);
    x2[p] = static_cast<float>(src[lane + 32 * p + D / 2]);
    ss += x1[p] * x1[p] + x2[p] * x2[p];
  }
  const float rn = 1.0f / @SQRT@(g4_simd_sum(ss) / (float)D + eps[0]);
  const int nh = is_q ? HQ : HKV;
  const size_t dst = (((size_t)b * nh + head) * TQ + t) * D;
  const float pos = static_cast<float>(positions[t]);
  $unroll for (int p = 0; p < P; ++p) {
    const int i = lane + 32 * p;
    float n1 = g4r_round<T>(x1[p] * rn);
    float n2 = g4r_round<T>(x2[p] * rn);
    if (is_q || is_k) {
      const $device T* w = is_q ? w_q : w_k;
      n1 = g4r_round<T>(static_cast<float>(w[i]) * n1);
      n2 = g4r_round<T>(static_cast<float>(w[i + D / 2]) * n2);
      const float theta = pos * inv_freq[i];
      const float c = @COS@(theta);
      const float s = @SIN@(theta);
      $device T* o = is_q ? q_out : @K_OUT@;
      o[dst + i] = static_cast<T>(n1 * c - n2 * s);
      o[dst + i + D / 2] = static_cast<T>(n1 * s + n2 * c);
    } else {
      @V_OUT@[dst + i] = static_cast<T>(n1);
      @V_OUT@[dst + i + D / 2] = static_cast<T>(n2);
    }
  }
"""

_HELPERS = r"""
// gemma4-mlx rope helpers: v rounded to the activation dtype U and back, as MLX's ops round results
template <typename U> @FN@ float g4r_round(float v) { return static_cast<float>(static_cast<U>(v)); }
"""

_LOCAL = {
    "metal": {"@FN@": "static inline", "@SQRT@": "sqrt", "@COS@": "cos", "@SIN@": "sin"},
    "cuda": {"@FN@": "__device__ __forceinline__", "@SQRT@": "sqrtf", "@COS@": "cosf", "@SIN@": "sinf"},
}  # fmt: skip


_INPUTS = ("y", "w_q", "w_k", "positions", "inv_freq", "eps")
_NORM_ROPE = KernelSource("g4_norm_rope", _INPUTS, ("q_out", "k_out", "v_out"),
                          emit(_BODY.replace("@K_OUT@", "k_out").replace("@V_OUT@", "v_out"), _HELPERS, _LOCAL))
# v's rows after k's B * HKV * TQ rows of D
_V_AFTER_K = "(kv_out + (size_t)y_shape[0] * HKV * TQ * D)"
_NORM_ROPE_KV = KernelSource("g4_norm_rope_kv", _INPUTS, ("q_out", "kv_out"),
                             emit(_BODY.replace("@K_OUT@", "kv_out").replace("@V_OUT@", _V_AFTER_K), _HELPERS, _LOCAL))

SIMD_GROUPS = 4


def _template(dtype: str, d: int, hq: int, hkv: int, k_eq_v: bool, tq: int) -> list:
    return [("T", dtype), ("D", d), ("HQ", hq), ("HKV", hkv), ("KEQV", k_eq_v), ("TQ", tq), ("NSG", SIMD_GROUPS)]


def inverse_frequencies(d: int, base: float | None = None, periods=None) -> np.ndarray:
    """float32 [d/2]: RoPE's inverse frequencies, base^(-i / (d/2)) or 1 / periods (0 where a period
    is infinite), computed in float64 and rounded once."""
    if (base is None) == (periods is None):
        raise ValueError("give either base or periods")
    if periods is not None:
        p = np.asarray(periods, np.float64)
        if p.shape != (d // 2,):
            raise ValueError(f"periods [{d // 2}] expected, got {p.shape}")
        return (1.0 / p).astype(np.float32)
    return (float(base) ** (-np.arange(d // 2) / (d // 2))).astype(np.float32)


def _check(y, heads, w_q, w_k, positions, inv_freq, stacked: bool = False) -> tuple[int, int, int, bool]:
    hq, hkv, d, k_eq_v = heads
    if stacked and not hkv:
        raise ValueError("stacked k|v output needs kv heads (HKV > 0)")
    width = (hq + (1 if k_eq_v else 2) * hkv) * d
    if y.ndim != 3 or y.shape[-1] != width:
        raise ValueError(f"y [B, T, {width}] expected for heads {heads}, got {y.shape}")
    if d % 64 or w_q.shape != (d,) or (hkv and (w_k is None or w_k.shape != (d,))):
        raise ValueError(f"head dim must be a multiple of 64 with norm weights [{d}], got {w_q.shape}")
    if positions.shape != (y.shape[1],) or positions.dtype != mx.int32:
        raise ValueError(f"positions int32 [{y.shape[1]}] expected, got {positions.dtype} {positions.shape}")
    if inv_freq.shape != (d // 2,) or inv_freq.dtype != mx.float32:
        raise ValueError(f"inv_freq float32 [{d // 2}] expected, got {inv_freq.dtype} {inv_freq.shape}")
    return hq, hkv, d, k_eq_v


def norm_rope_reference(y, heads, w_q, w_k, positions, eps: float, inv_freq, stacked: bool = False):
    """MLX ops (what Attention computes without the kernel, with RoPE's periods 1 / inv_freq) ->
    (q, k, v) [B, heads, T, d] (k, v None when HKV = 0), or with ``stacked`` (q, kv), kv = k's rows
    then v's [2B, HKV, T, d]. Positions must be consecutive (MLX's rope takes an offset)."""
    hq, hkv, d, k_eq_v = _check(y, heads, w_q, w_k, positions, inv_freq, stacked)
    B, T, _ = y.shape
    rope = dict(base=None, freqs=1.0 / inv_freq)

    def heads_of(a, n):
        return a.reshape(B, T, n, d)

    def rotate(a):
        return mx.fast.rope(a.transpose(0, 2, 1, 3), d, traditional=False, scale=1.0, offset=positions[0], **rope)

    q = rotate(mx.fast.rms_norm(heads_of(y[..., : hq * d], hq), w_q, eps))
    if not hkv:
        return q, None, None
    k_raw = heads_of(y[..., hq * d : (hq + hkv) * d], hkv)
    v_raw = k_raw if k_eq_v else heads_of(y[..., (hq + hkv) * d :], hkv)
    k = rotate(mx.fast.rms_norm(k_raw, w_k, eps))
    v = mx.fast.rms_norm(v_raw, None, eps).transpose(0, 2, 1, 3)
    return (q, mx.concatenate([k, v])) if stacked else (q, k, v)


def fusable(y, w_q, w_k) -> bool:
    """True when the kernel computes what the reference does: one activation dtype (f32 or bf16)
    for y and the weights."""
    return y.dtype in (mx.float32, mx.bfloat16) and w_q.dtype == y.dtype and (w_k is None or w_k.dtype == y.dtype)


def norm_rope(y, heads, w_q, w_k, positions, eps: float, inv_freq, stacked: bool = False):
    """The module's op: the kernel on GPU builds when `fusable`, ``norm_rope_reference`` otherwise.
    heads = (HQ, HKV, d, k_eq_v); positions int32 [T] (this step's, consecutive); inv_freq float32
    [d/2] (``inverse_frequencies``). -> (q, k, v), or with ``stacked`` (q, kv [2B, HKV, T, d]: k's
    rows then v's, g4_norm_rope_kv)."""
    hq, hkv, d, k_eq_v = _check(y, heads, w_q, w_k, positions, inv_freq, stacked)
    if use_reference() or not fusable(y, w_q, w_k):
        return norm_rope_reference(y, heads, w_q, w_k, positions, eps, inv_freq, stacked)
    B, T, _ = y.shape
    groups = -(-B * T * (hq + 2 * hkv) // SIMD_GROUPS)
    kv_shapes = [(2 * B, hkv, T, d)] if stacked else [(B, hkv, T, d) if hkv else (1,)] * 2
    q, *kv = (_NORM_ROPE_KV if stacked else _NORM_ROPE).kernel()(
        inputs=[y, w_q, w_k if hkv else w_q, positions, inv_freq, mx.array([eps], dtype=mx.float32)],
        template=template_args(_template(dtype_name(y.dtype), d, hq, hkv, k_eq_v, T)),
        grid=(32 * SIMD_GROUPS * groups, 1, 1),
        threadgroup=(32 * SIMD_GROUPS, 1, 1),
        output_shapes=[(B, hq, T, d), *kv_shapes],
        output_dtypes=[y.dtype] * (1 + len(kv_shapes)),
    )  # fmt: skip
    return (q, *kv) if hkv else (q, None, None)


# --------------------------------------------------------------------------------------------
# numpy oracle and emulator / compile-test registry (see custom_kernels.registry)
# --------------------------------------------------------------------------------------------


def norm_rope_np(y, heads, w_q, w_k, positions, eps: float, inv_freq, bf16: bool = False):
    """float64 oracle on y [B, T, W] (f32 values) with the module's roundings -> (q, k, v); the angle
    p * f in float32 as the kernel computes it."""
    from .registry import bf16_to_f32, f32_to_bf16

    hq, hkv, d, k_eq_v = heads

    def rnd(v):
        return bf16_to_f32(f32_to_bf16(np.asarray(v, np.float32))).astype(np.float64) if bf16 else np.asarray(v, np.float64)

    B, T, _ = y.shape
    y = y.astype(np.float64)
    half = d // 2
    f = np.asarray(inv_freq, np.float32)
    theta = (np.asarray(positions, np.float32)[:, None] * f[None, :]).astype(np.float64)  # [T, half]
    c, s = np.cos(theta)[None, None], np.sin(theta)[None, None]

    def norm(a, n, w, rotate):
        a = a.reshape(B, T, n, d).transpose(0, 2, 1, 3)  # [B, n, T, d]
        r = 1.0 / np.sqrt((a**2).mean(axis=-1, keepdims=True) + eps)
        x = rnd(a * r)
        if w is not None:
            x = rnd(np.asarray(w, np.float64) * x)
        if not rotate:
            return x
        x1, x2 = x[..., :half], x[..., half:]
        return rnd(np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1))

    q = norm(y[..., : hq * d], hq, w_q, True)
    if not hkv:
        return q, None, None
    k_raw = y[..., hq * d : (hq + hkv) * d]
    v_raw = k_raw if k_eq_v else y[..., (hq + hkv) * d :]
    return q, norm(k_raw, hkv, w_k, True), norm(v_raw, hkv, None, False)


def _case(rng, B, T, hq, hkv, d, k_eq_v, full, dtype, pos0, stacked=False):
    from .registry import KernelCase, bf16_to_f32, f32_to_bf16

    bf16 = dtype == "bfloat16"
    width = (hq + (1 if k_eq_v else 2) * hkv) * d
    y = (rng.standard_normal((B, T, width)) * 2 + 0.3).astype(np.float32)
    w_q, w_k = rng.uniform(0.3, 2.0, d).astype(np.float32), rng.uniform(0.3, 2.0, d).astype(np.float32)
    if bf16:
        y, w_q, w_k = (bf16_to_f32(f32_to_bf16(a)) for a in (y, w_q, w_k))
    positions = np.arange(pos0, pos0 + T, dtype=np.int32)
    if full:  # proportional: the first quarter of the pairs rotate, the rest have infinite periods
        n = d // 8
        inv = inverse_frequencies(d, periods=[1e6 ** (2 * i / d) for i in range(n)] + [np.inf] * (d // 2 - n))
    else:
        inv = inverse_frequencies(d, base=10_000.0)
    heads = (hq, hkv, d, k_eq_v)
    q, k, v = norm_rope_np(y, heads, w_q, w_k, positions, 1e-6, inv, bf16)
    enc = (lambda a: f32_to_bf16(a)) if bf16 else (lambda a: a)
    kv_shapes = [(2 * B, hkv, T, d)] if stacked else [(B, hkv, T, d) if hkv else (1,)] * 2
    kv = ([np.concatenate([k, v])] if stacked else [k, v]) if hkv else []
    groups = -(-B * T * (hq + 2 * hkv) // SIMD_GROUPS)
    tol = dict(rtol=8e-3, atol=2e-2) if bf16 else dict(rtol=2e-5, atol=2e-5)
    return KernelCase(
        inputs={"y": enc(y), "w_q": enc(w_q), "w_k": enc(w_k), "positions": positions, "inv_freq": inv,
                "eps": np.array([1e-6], np.float32)},
        template=_template(dtype, d, hq, hkv, k_eq_v, T), grid=(32 * SIMD_GROUPS * groups, 1, 1),
        threadgroup=(32 * SIMD_GROUPS, 1, 1), output_shapes=[(B, hq, T, d), *kv_shapes],
        output_dtypes=[dtype] * (1 + len(kv_shapes)), expected=[q, *kv],
        input_dtypes={n: "bfloat16" for n in ("y", "w_q", "w_k")} if bf16 else {},
        label=f"B={B} T={T} hq={hq} hkv={hkv} d={d}{' k=v' if k_eq_v else ''}{' full' if full else ''} {dtype}",
        **tol,
    )  # fmt: skip


def _cases(rng: np.random.Generator):
    return [_case(rng, 1, 1, 4, 2, 64, False, False, "float32", 37),
            _case(rng, 2, 3, 2, 1, 128, False, True, "float32", 1000),
            _case(rng, 1, 2, 3, 1, 64, True, False, "bfloat16", 5),
            _case(rng, 1, 1, 5, 0, 128, False, True, "float32", 4097)]  # fmt: skip


def _stacked_cases(rng: np.random.Generator):
    return [_case(rng, 1, 1, 8, 2, 128, False, False, "bfloat16", 4095, stacked=True),
            _case(rng, 2, 3, 2, 1, 128, False, True, "float32", 1000, stacked=True),
            _case(rng, 1, 2, 3, 1, 64, True, False, "bfloat16", 5, stacked=True)]  # fmt: skip


def kernel_specs():
    """KernelSpecs of the norm + RoPE kernels (GQA heads, K = V, q only, proportional RoPE, T > 1,
    B > 1; the stacked form's k|v output)."""
    from .registry import KernelSpec

    return [KernelSpec(k.name, k.input_names, k.output_names, *k.text["metal"], *k.text["cuda"], cases)
            for k, cases in ((_NORM_ROPE, _cases), (_NORM_ROPE_KV, _stacked_cases))]  # fmt: skip
