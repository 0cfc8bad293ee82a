"""Native multi-threaded CPU matvec for 1..8 activation rows (decode), and its numpy reference.

`matmul(x, weight)` computes x [..., K] @ W[N, K].T -> float32 [..., N] for an MLX float32 or
bfloat16 weight, and `matmul_affine(x, w, scales, biases, bits)` for MLX affine group-32 4/8-bit
weights (what Q4_0 / Q8_0 GGUF weights load as on the CPU), through the C extension
`gemma4_mlx._cpu_matvec` (cpu_matvec.c: pthreads over the weight rows, AVX2+FMA when the CPU has
it). The call is outside MLX's graph: the inputs are evaluated first and the result comes back as
a new MLX array, so it cannot run inside `mx.compile` / `mx.vmap` / gradients (ValueError there).

Why: on MLX's CPU backend every f32 matmul is a `cblas_sgemm` call, M = 1 included, and OpenBLAS
0.3.21's sgemm reads the weight at 5-7 GB/s there; bf16 and quantized matmuls use MLX's own
single-threaded kernels (see bench/NOTES.md). Decode streams each weight once per token.

The extension is optional (setup.py builds it when a C compiler is present); `available()` says
whether it was built, `unavailable_reason()` why not. ``GEMMA4_MLX_CPU_MATVEC=off`` disables its
use in the model; ``GEMMA4_MLX_CPU_MATVEC_THREADS=N`` sets the thread count (default: the cores
this process may run on).
"""

from __future__ import annotations

import os

import numpy as np

MAX_ROWS = 8
ENV_VAR = "GEMMA4_MLX_CPU_MATVEC"
THREADS_ENV_VAR = "GEMMA4_MLX_CPU_MATVEC_THREADS"
_OFF_VALUES = {"off", "0", "no", "false", "none"}

try:
    from . import _cpu_matvec as _native
    _IMPORT_ERROR: str | None = None
except ImportError as exc:  # not built (no compiler at install time) or a stale build
    _native = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

__all__ = ["MAX_ROWS", "available", "enabled", "unavailable_reason", "describe", "threads", "matmul",
           "matmul_affine", "reference_matmul", "reference_affine", "dequantize_affine_np"]


def available() -> bool:
    """True when the C extension is built and importable."""
    return _native is not None


def enabled() -> bool:
    """available() and not switched off with GEMMA4_MLX_CPU_MATVEC=off."""
    return available() and os.environ.get(ENV_VAR, "").strip().lower() not in _OFF_VALUES


def unavailable_reason() -> str | None:
    """Why the extension cannot be used (None when it can)."""
    if _native is None:
        return f"gemma4_mlx._cpu_matvec is not built ({_IMPORT_ERROR}); reinstall with a C compiler"
    if not enabled():
        return f"switched off ({ENV_VAR}={os.environ.get(ENV_VAR)})"
    return None


def threads() -> int:
    """Worker threads per call: GEMMA4_MLX_CPU_MATVEC_THREADS, else the usable cores."""
    given = os.environ.get(THREADS_ENV_VAR, "").strip()
    if given:
        try:
            return max(1, int(given))
        except ValueError:
            raise ValueError(f"{THREADS_ENV_VAR} must be an integer, got {given!r}") from None
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def describe() -> str:
    """One line for --verbose, e.g. 'CPU matvec: native (avx2+fma, 2 threads)'."""
    reason = unavailable_reason()
    if reason is not None:
        return f"CPU matvec: MLX (native matvec unused: {reason})"
    return f"CPU matvec: native ({_native.simd()}, {threads()} threads) for the head at <= {MAX_ROWS} rows"


def _require():
    if _native is None:
        raise RuntimeError(unavailable_reason())
    return _native


def _rows_f32(x):
    """x [..., K] -> (evaluated C-contiguous float32 [M, K], leading shape)."""
    import mlx.core as mx

    lead = tuple(x.shape[:-1])
    x2 = mx.contiguous(x.reshape(-1, x.shape[-1]).astype(mx.float32))
    mx.eval(x2)  # raises ValueError inside mx.compile / vmap / grad
    return x2, lead


def _call(fn, x, *args):
    """Run one native call on MLX inputs (evaluated here); -> float32 [..., N] as an MLX array."""
    import mlx.core as mx

    x2, lead = _rows_f32(x)
    n = args[-1]
    if x2.shape[0] > MAX_ROWS:
        raise ValueError(f"the native matvec takes 1..{MAX_ROWS} rows, got {x2.shape[0]}")
    out = np.empty((x2.shape[0], n), dtype=np.float32)
    arrays = args[:-1]
    mx.eval(*[a for a in arrays if isinstance(a, mx.array)])
    fn(memoryview(x2), *[memoryview(a) if isinstance(a, mx.array) else a for a in arrays], out)
    return mx.array(out).reshape(*lead, n)


def matmul(x, weight):
    """x [..., K] (any float dtype, <= 8 rows in all) @ weight[N, K].T -> float32 [..., N] (MLX).

    weight: an MLX float32 or bfloat16 array (row-contiguous). Float32 accumulation."""
    import mlx.core as mx

    lib = _require()
    t = threads()
    if weight.dtype == mx.float32:
        return _call(lambda xv, wv, out: lib.matmul_f32(xv, wv, out, t), x, weight, weight.shape[0])
    if weight.dtype == mx.bfloat16:
        return _call(lambda xv, wv, out: lib.matmul_bf16(xv, wv, out, t), x, weight.view(mx.uint16),
                     weight.shape[0])
    raise ValueError(f"the native matvec reads float32 or bfloat16 weights, got {weight.dtype}")


def matmul_affine(x, w, scales, biases, bits: int):
    """x [..., K] @ dequantize(w, scales, biases).T -> float32 [..., N] (MLX), <= 8 rows in all.

    w: uint32 [N, K * bits / 32] (MLX affine, group 32), scales / biases float32 [N, K / 32]."""
    lib = _require()
    t = threads()
    return _call(lambda xv, wv, sv, bv, out: lib.matmul_affine(xv, wv, sv, bv, out, bits, t),
                 x, w, scales, biases, w.shape[0])


# ------------------------------------------------------------------------------------------------
# numpy reference (float64)


def reference_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float64 x [M, K] @ w[N, K].T; w float32, or uint16 holding bfloat16 bits."""
    w = np.asarray(w)
    if w.dtype == np.uint16:
        w = (w.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(x, np.float64) @ w.astype(np.float64).T


def dequantize_affine_np(w: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int) -> np.ndarray:
    """float64 [N, K] from MLX affine group-32 packing: value j of a row sits at bits
    (j % (32 / bits)) * bits of uint32 word j // (32 / bits); w = scale * q + bias."""
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)
    q = (np.asarray(w, np.uint32)[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
    q = q.reshape(w.shape[0], -1).astype(np.float64)
    groups = q.shape[1] // 32
    s = np.repeat(np.asarray(scales, np.float64), 32, axis=1)[:, : groups * 32]
    b = np.repeat(np.asarray(biases, np.float64), 32, axis=1)[:, : groups * 32]
    return q * s + b


def reference_affine(x: np.ndarray, w: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int) -> np.ndarray:
    """float64 x [M, K] @ dequantize(w).T."""
    return np.asarray(x, np.float64) @ dequantize_affine_np(w, scales, biases, bits).T
