"""Token embedding rows straight from raw Q8_0 / Q4_0 blocks, dequantized and scaled in one launch.

``embed_rows(blocks, tokens, ggml_type, k, scale, dtype)`` computes, for every token id,

    out[..., i] = round(round(w[token, i]) * round(scale)),   w = the table's row dequantized in f32

with ``round`` to ``dtype`` (bf16 or f32): what ``dequantize(blocks[tokens]).astype(dtype) *
mx.array(scale).astype(dtype)`` computes in MLX ops (Gemma scales its token embeddings by
sqrt(hidden), the E-series per-layer embeddings by sqrt(D), with the scale rounded to the weight
dtype as in HF). blocks uint8 [V, K // 32 * bb], tokens int32 [...] -> [..., K].

Why a kernel: in MLX ops the gather and the dequantization are ~14 graph nodes (gather, slices,
squeezes, the f16 scale's bit view, casts), each costing MLX's host a few microseconds every decode
step, and a host-bound step (E4B: two tables per token) pays them all; the kernel is one node.

Kernel (one body for Metal and CUDA, custom_kernels.dialect): one thread per output element; a
token id outside [0, V) gives a row of NaN instead of reading past the table.

Family "embedding": a CUDA default since session 32 (opt-in on Metal). Bit-equal to the reference
on the H200 (session 31); in one process at 4K E2B 196.4 against 188.1 tok/s, ahead in 3 of 3
rounds, 26B-A4B 159.7 against 157.4 (3 of 3); E4B undecided (its rounds swing 15-25%).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import KernelSource, dtype_name, template_args, use_kernel
from .dialect import emit
from .quant_matvec import Q4_0, Q8_0, dequantize, row_bytes

__all__ = ["embed_rows", "embed_rows_reference", "embedding_supported", "kernel_specs"]

# Template: T (output dtype), K (row width, a multiple of 32), Q8 (true: Q8_0 blocks, false: Q4_0).
_BODY = r"""
  // gemma4-mlx embedding: one element of one token's dequantized, scaled row
  constexpr int BB = Q8 ? 34 : 18;   // bytes per block of 32 weights
  const int i = $tg_x * TG + $tid;   // element in the row
  const int n = $tg_y;               // token
  if (i >= K) return;
  const int token = tokens[n];
  $device T* o = out + (size_t)n * K + i;
  if (token < 0 || token >= (int)blocks_shape[0]) {
    *o = static_cast<T>(g4_nan());
    return;
  }
  const $device uint8_t* blk = blocks + (size_t)token * (K / 32 * BB) + (size_t)(i / 32) * BB;
  const float d = g4_half_bits(g4_u16(blk));
  const int j = i % 32;
  float q;
  if (Q8) {
    q = (float)(((int)blk[2 + j] ^ 128) - 128);  // int8
  } else {
    const uint32_t b = blk[2 + (j % 16)];
    q = (float)(int)(j < 16 ? (b & 15u) : (b >> 4)) - 8.0f;
  }
  const float w = static_cast<float>(static_cast<T>(q * d));
  *o = static_cast<T>(w * scale[0]);
"""

_EMBED = KernelSource("g4_embed_rows", ("blocks", "tokens", "scale"), ("out",), emit(_BODY, "", {}))

_FORMATS = {Q8_0: True, Q4_0: False}

MAX_TOKENS = 65535
"""Tokens one launch takes (the grid's y, which CUDA caps at 65535); longer calls, prefill only,
take the reference (the kernel saves host time per decode step, not GPU time)."""


def _threads(k: int) -> int:
    """Threads per threadgroup: the largest of 256 / 128 / 64 / 32 dividing k (a whole grid)."""
    return next(t for t in (256, 128, 64, 32) if k % t == 0)


def _template(dtype: str, k: int, q8: bool) -> list:
    return [("T", dtype), ("K", k), ("Q8", q8), ("TG", _threads(k))]


def _check(blocks: mx.array, tokens: mx.array, ggml_type: int, k: int) -> None:
    if ggml_type not in _FORMATS:
        raise ValueError(f"embed_rows takes Q8_0 or Q4_0 blocks, got ggml type {ggml_type}")
    if k % 32:
        raise ValueError(f"row width must be a multiple of 32, got {k}")
    if blocks.dtype != mx.uint8 or blocks.ndim != 2 or blocks.shape[1] != row_bytes(ggml_type, k):
        raise ValueError(f"blocks uint8 [V, {row_bytes(ggml_type, k)}] expected for K={k}, got {blocks.dtype} {blocks.shape}")
    if tokens.dtype != mx.int32:
        raise ValueError(f"tokens must be int32, got {tokens.dtype}")


def embed_rows_reference(blocks: mx.array, tokens: mx.array, ggml_type: int, k: int, scale: float, dtype) -> mx.array:
    """MLX ops: the rows gathered, dequantized, rounded to dtype, times the scale rounded to dtype."""
    e = dequantize(blocks[tokens], ggml_type, k).astype(dtype)
    return e * mx.array(scale, dtype=mx.float32).astype(dtype)


def _rounded(scale: float, dtype) -> float:
    """`scale` rounded to dtype (f32 or bf16, nearest even), computed here rather than as graph nodes."""
    from .registry import bf16_to_f32, f32_to_bf16

    v = np.array([scale], np.float32)
    return float((bf16_to_f32(f32_to_bf16(v)) if dtype == mx.bfloat16 else v)[0])


def embedding_supported(ggml_type: int, dtype) -> bool:
    """True when the kernel computes what the reference does: Q8_0 / Q4_0 rows, f32 or bf16 out."""
    return ggml_type in _FORMATS and dtype in (mx.float32, mx.bfloat16)


def embed_rows(blocks: mx.array, tokens: mx.array, ggml_type: int, k: int, scale: float, dtype) -> mx.array:
    """The op: the kernel where family "embedding" is on and `embedding_supported`, for 1 to
    MAX_TOKENS tokens; else the reference. -> [*tokens.shape, k] in dtype."""
    _check(blocks, tokens, ggml_type, k)
    n = tokens.size
    if not (use_kernel("embedding") and embedding_supported(ggml_type, dtype) and 0 < n <= MAX_TOKENS):
        return embed_rows_reference(blocks, tokens, ggml_type, k, scale, dtype)
    (out,) = _EMBED.kernel()(
        inputs=[blocks, tokens, mx.array([_rounded(scale, dtype)], mx.float32)],  # a constant: no graph node
        template=template_args(_template(dtype_name(dtype), k, _FORMATS[ggml_type])),
        grid=(k, n, 1),
        threadgroup=(_threads(k), 1, 1),
        output_shapes=[(*tokens.shape, k)],
        output_dtypes=[dtype],
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# numpy oracle and emulator / compile-test registry (see custom_kernels.registry)
# --------------------------------------------------------------------------------------------


def _case(rng: np.random.Generator, ggml_type: int, vocab: int, k: int, tokens: list[int], dtype: str, scale: float):
    from .quant_matvec import dequantize_f64, random_blocks
    from .registry import KernelCase, bf16_to_f32, f32_to_bf16

    blocks = random_blocks(rng, ggml_type, (vocab,), k)
    ids = np.asarray(tokens, np.int32)
    bf16 = dtype == "bfloat16"

    def rnd(v):
        v = np.asarray(v, np.float32)
        return bf16_to_f32(f32_to_bf16(v)) if bf16 else v

    rows = dequantize_f64(blocks, ggml_type).astype(np.float32)  # exact: q * d in f32
    valid = (ids >= 0) & (ids < vocab)
    w = np.where(valid[:, None], rows[np.clip(ids, 0, vocab - 1)], np.nan)
    s = rnd(np.float32(scale))
    expected = rnd(rnd(w) * s).astype(np.float64)
    return KernelCase(
        inputs={"blocks": blocks, "tokens": ids, "scale": np.array([s], np.float32)},
        template=_template(dtype, k, _FORMATS[ggml_type]), grid=(k, len(tokens), 1),
        threadgroup=(_threads(k), 1, 1), output_shapes=[(len(tokens), k)], output_dtypes=[dtype],
        expected=[expected], rtol=0.0, atol=0.0,
        label=f"{'Q8_0' if ggml_type == Q8_0 else 'Q4_0'} V={vocab} K={k} tokens={tokens} {dtype}",
    )  # fmt: skip


def _cases(rng: np.random.Generator):
    return [_case(rng, Q8_0, 40, 96, [3, 39, 0], "bfloat16", 96**0.5),
            _case(rng, Q4_0, 17, 256, [16], "float32", 256**0.5),
            _case(rng, Q8_0, 9, 64, [8, 9, -1, 2], "float32", 8.0),
            _case(rng, Q4_0, 12, 160, [11, 5], "bfloat16", 160**0.5)]  # fmt: skip


def kernel_specs():
    """KernelSpecs of the embedding kernel (Q8_0 and Q4_0, f32 and bf16, one and several tokens,
    out-of-range ids, row widths that take 32 / 256 threads per threadgroup)."""
    from .registry import KernelSpec

    return [KernelSpec(_EMBED.name, _EMBED.input_names, _EMBED.output_names, *_EMBED.text["metal"],
                       *_EMBED.text["cuda"], _cases)]  # fmt: skip
