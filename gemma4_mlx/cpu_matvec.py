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

import functools
import os

import numpy as np

MAX_ROWS = 8
ENV_VAR = "GEMMA4_MLX_CPU_MATVEC"
THREADS_ENV_VAR = "GEMMA4_MLX_CPU_MATVEC_THREADS"
HEAD_BF16_ENV_VAR = "GEMMA4_MLX_CPU_HEAD_BF16"
_OFF_VALUES = {"off", "0", "no", "false", "none"}

try:
    from . import _cpu_matvec as _native
    _IMPORT_ERROR: str | None = None
except ImportError as exc:  # not built (no compiler at install time) or a stale build
    _native = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

_hook: dict = {"tried": False, "installed": False, "reason": "not tried"}

__all__ = ["MAX_ROWS", "available", "enabled", "unavailable_reason", "describe", "threads", "matmul",
           "matmul_affine", "affine_linear", "decode_eagerly", "head_ready", "head_logits", "install_sgemm_hook",
           "sgemm_hook_forward_target", "hook_status", "set_hook_enabled", "reference_matmul", "reference_affine",
           "dequantize_affine_np"]


def available() -> bool:
    """True when the C extension is built and importable."""
    return _native is not None


def enabled() -> bool:
    """available() and not switched off with GEMMA4_MLX_CPU_MATVEC=off (which also switches an
    installed sgemm hook to plain forwarding, from this call on)."""
    on = available() and os.environ.get(ENV_VAR, "").strip().lower() not in _OFF_VALUES
    if _hook["installed"]:
        _native.sgemm_hook_state(1 if on else 0)
    return on


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


def _threads_for(weight_bytes: int) -> int:
    """threads(), fewer for a small weight (cpu_matvec.c: MIN_BYTES_PER_THREAD per thread)."""
    return max(1, min(threads(), weight_bytes // _native.min_bytes_per_thread()))


def describe() -> str:
    """One line for --verbose, e.g. 'CPU matvec: native (avx2+fma, 2 threads)'."""
    reason = unavailable_reason()
    if reason is not None:
        return f"CPU matvec: MLX (native matvec unused: {reason})"
    hook = "MLX f32 matmuls too" if _hook["installed"] else f"MLX f32 matmuls: {_hook['reason']}"
    return (f"CPU matvec: native ({_native.simd()}, {threads()} threads) at <= {MAX_ROWS} rows for the head and "
            f"Q4_0/Q8_0 linears; {hook}")


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
    t = _threads_for(weight.nbytes)
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
    t = _threads_for(w.nbytes + scales.nbytes + biases.nbytes)
    return _call(lambda xv, wv, sv, bv, out: lib.matmul_affine(xv, wv, sv, bv, out, bits, t),
                 x, w, scales, biases, w.shape[0])


# ------------------------------------------------------------------------------------------------
# Quantized linears (Q4_0 / Q8_0 files on the CPU) at decode

def _outside_transforms(op, *args):
    """op(*args), or None inside mx.compile / mx.vmap, where the native call cannot evaluate its
    inputs (MLX's "[eval] Attempting to eval an array during function transformations" error)."""
    try:
        return op(*args)
    except ValueError as exc:
        if "function transformation" in str(exc):
            return None
        raise


def _affine_ok(layer) -> bool:
    import mlx.core as mx

    return (layer.bits in (4, 8) and layer.group_size == 32 and layer.scales.dtype == mx.float32
            and layer.biases.dtype == mx.float32)


@functools.lru_cache(maxsize=None)
def _affine_op(bits: int):
    """x @ dequantize(w, scales, biases).T natively, as an MLX custom function whose vjp is MLX's own
    (cotangent @ W for x; the frozen quantized tensors get zeros), so mx.grad / mx.vjp through a
    native call are right instead of silently zero."""
    import mlx.core as mx

    @mx.custom_function
    def op(x, w, scales, biases):
        return matmul_affine(x, w, scales, biases, bits)

    @op.vjp
    def op_vjp(primals, cotangent, output):
        x, w, scales, biases = primals
        cot = cotangent[0] if isinstance(cotangent, (list, tuple)) else cotangent
        dx = mx.quantized_matmul(cot.astype(mx.float32), w, scales, biases, transpose=False, group_size=32, bits=bits)
        return dx.astype(x.dtype), mx.zeros_like(w), mx.zeros_like(scales), mx.zeros_like(biases)

    return op


@functools.lru_cache(maxsize=None)
def _float_op():
    """y @ W.T natively (W f32 or bf16; an f32 W may be read through its exact bf16 copy), with an
    MLX vjp for both y and W (the tied embedding is a trainable parameter)."""
    import mlx.core as mx

    @mx.custom_function
    def op(y, weight, read):
        return matmul(y, read)

    @op.vjp
    def op_vjp(primals, cotangent, output):
        y, weight, read = primals
        cot = (cotangent[0] if isinstance(cotangent, (list, tuple)) else cotangent).astype(mx.float32)
        dy = (cot @ weight.astype(mx.float32)).astype(y.dtype)
        dw = (cot.reshape(-1, cot.shape[-1]).T @ y.astype(mx.float32).reshape(-1, y.shape[-1])).astype(weight.dtype)
        return dy, dw, mx.zeros_like(read)

    return op


def affine_linear(layer, x):
    """x [..., K] @ W.T -> float32 [..., N] for a QuantizedLinear `layer` (affine g32, 4/8-bit, f32
    scales and biases) through the native matvec, or None where it does not apply: not the CPU, the
    extension off, more than MAX_ROWS rows, or inside mx.compile / mx.vmap (where nothing may be
    evaluated). Under mx.grad the gradient comes from MLX ops (see _affine_op)."""
    import mlx.core as mx

    if (mx.default_device() != mx.cpu or not enabled() or not _affine_ok(layer)
            or not 1 <= x.size // max(x.shape[-1], 1) <= MAX_ROWS):
        return None
    return _outside_transforms(_affine_op(layer.bits), x, layer.weight, layer.scales, layer.biases)


EAGER_MIN_WEIGHTS = 1 << 19
"""Mean weights per quantized linear from which eager native decode beats the compiled step: on the
2-core bench machine a 0.3B Q4_0 model (1.4M weights per linear) decodes at 12.2 vs 5.8 tok/s, the
demo model (0.14M per linear, overheads dominate) at 38 vs 43 tok/s."""


def decode_eagerly(model) -> bool:
    """True when decoding `model` step by step outside mx.compile is the faster CPU path: its dense
    quantized linears then run natively (inside a compiled step they must take mx.quantized_matmul,
    ~2.5 ms against ~0.3 ms per 2048x1024 linear on the 2-core bench machine), which pays once the
    linears are large (EAGER_MIN_WEIGHTS) against the cost of building each step's graph."""
    import mlx.core as mx

    from .quantized import QuantizedEmbedding, QuantizedLinear

    if mx.default_device() != mx.cpu or not enabled():
        return False
    sizes = [m.weight.size * 32 // m.bits for _, m in model.named_modules()
             if isinstance(m, QuantizedLinear) and not isinstance(m, QuantizedEmbedding)]
    return bool(sizes) and sum(sizes) / len(sizes) >= EAGER_MIN_WEIGHTS


# ------------------------------------------------------------------------------------------------
# The model's tied head (Model.logits) on the CPU

def head_ready(model, y=None) -> bool:
    """True when model.logits(y) should run the tied head here: CPU device, the extension built and
    enabled, an f32 / bf16 embedding or an affine group-32 4/8-bit one with f32 scales, and (given
    y [..., H]) at most MAX_ROWS rows."""
    import mlx.core as mx
    import mlx.nn as nn

    from .quantized import QuantizedEmbedding

    if mx.default_device() != mx.cpu or not enabled():
        return False
    if y is not None and not 1 <= y.size // max(y.shape[-1], 1) <= MAX_ROWS:
        return False
    emb = model.model.embed_tokens
    if isinstance(emb, QuantizedEmbedding):
        return _affine_ok(emb)
    return type(emb) is nn.Embedding and emb.weight.dtype in (mx.float32, mx.bfloat16)


def head_logits(model, y):
    """Head logits fp32 [..., V] (before the softcap) of y [..., H]; None inside mx.compile /
    mx.vmap, where nothing may be evaluated (gradients are MLX's: see _float_op / _affine_op)."""
    from .quantized import QuantizedEmbedding

    emb = model.model.embed_tokens
    if isinstance(emb, QuantizedEmbedding):
        return _outside_transforms(_affine_op(emb.bits), y, emb.weight, emb.scales, emb.biases)
    # _head_weight may evaluate (once per weight): inside the guard too
    return _outside_transforms(lambda: _float_op()(y, emb.weight, _head_weight(model, emb.weight)))


def _head_weight(model, weight):
    """The array the native head reads: a bf16 copy of an f32 embedding whose values are all bf16
    numbers (a bf16 checkpoint loaded in f32: the copy is exact), else the weight itself. bf16
    halves the bytes streamed per token (262144 x 1024 head, 2-core EPYC: 17 vs 31 ms,
    bench/NOTES.md) for +50% of the embedding's memory. Made once per weight array and kept on the
    model; GEMMA4_MLX_CPU_HEAD_BF16=0 reads the f32 weight instead."""
    import mlx.core as mx

    if weight.dtype != mx.float32 or os.environ.get(HEAD_BF16_ENV_VAR, "1").strip().lower() in _OFF_VALUES:
        return weight
    cached = model.__dict__.get("_head_bf16")
    if cached is None or cached[0] is not weight:
        exact = bool(mx.all((weight.view(mx.uint32) & 0xFFFF) == 0).item())
        copy = weight.astype(mx.bfloat16) if exact else None
        if copy is not None:
            mx.eval(copy)
        cached = (weight, copy)
        object.__setattr__(model, "_head_bf16", cached)  # not a parameter: bypass Module's setattr
    return weight if cached[1] is None else cached[1]


# ------------------------------------------------------------------------------------------------
# MLX's own f32 matmuls at 1..8 rows (the decoder layers' linears inside the compiled step)

def install_sgemm_hook() -> bool:
    """Route MLX's f32 matmuls of 1..8 rows (x @ W.T) through the native matvec; True if in place.

    MLX's Linux CPU backend calls ``cblas_sgemm`` for every f32 matmul, M = 1 included, through
    its lazily bound GOT slot (see blas.py). This writes the extension's hook into that slot; the
    hook serves row-major x @ W.T calls with 1..8 rows and forwards every other call (prefill
    GEMMs) to the BLAS the slot held (the preloaded OpenBLAS / MKL, or the bundled reference).
    Checked before it stays: the slot must be resolved and writable, and an MLX matvec must go
    through the hook and match numpy. Idempotent; never raises (the reason is in hook_status()).
    Linux + MLX's CPU build only; nothing on macOS or with a GPU build of MLX. `import gemma4_mlx`
    calls it once, after the BLAS preload."""
    if _hook["tried"]:
        return _hook["installed"]
    _hook["tried"] = True
    try:
        _hook["reason"] = _install_hook()
    except Exception as exc:  # an optional speed-up must never break a forward
        _hook["reason"] = f"not installed: {exc!r}"
    _hook["installed"] = _hook["reason"] == "installed"
    return _hook["installed"]


def sgemm_hook_forward_target(address: int | None) -> int | None:
    """`address` itself, unless it is the installed sgemm hook: then the cblas_sgemm it forwards to."""
    if _hook["installed"] and address == _hook.get("address"):
        return _hook["forward"]
    return address


def hook_status() -> dict:
    """{'installed': bool, 'reason': str, 'calls': matvec calls the hook served}."""
    calls = _native.sgemm_hook_state()[2] if _native is not None else 0
    return {"installed": _hook["installed"], "reason": _hook["reason"], "calls": calls}


def set_hook_enabled(on: bool) -> None:
    """Switch the hook's matvec path (off: every call goes to the BLAS); for comparisons."""
    if _native is not None:
        _native.sgemm_hook_state(1 if on else 0)


def _install_hook() -> str:
    import ctypes
    import sys

    import mlx.core as mx

    from . import blas

    if not enabled():
        return f"not installed: {unavailable_reason()}"
    if not sys.platform.startswith("linux") or not blas._mlx_cpu_blas_in_use():
        return "not installed: not MLX's Linux CPU build"
    blas.active()  # record (and verify) the BLAS libmlx resolved, before its slot points here
    a = mx.ones((2, 8), dtype=mx.float32)
    mx.eval(mx.matmul(a, a.T, stream=mx.cpu))  # binds the lazy slot now
    cell = blas.got_cell("cblas_sgemm")
    if cell is None:
        return "not installed: libmlx's cblas_sgemm slot not found"
    if not _writable(ctypes.addressof(cell)):
        return "not installed: libmlx's GOT is read-only (full RELRO)"
    current = cell.value
    if blas.sgemm_provider() is None:
        return "not installed: cblas_sgemm is not bound yet"
    hook = _native.sgemm_hook(current, threads(), 1)
    cell.value = hook
    _hook.update(address=hook, forward=current)
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 100), dtype=np.float32), rng.standard_normal((37, 100), dtype=np.float32)
    before = _native.sgemm_hook_state()[2]
    got = np.array(mx.matmul(mx.array(x), mx.array(w).T, stream=mx.cpu))
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    served = _native.sgemm_hook_state()[2] - before
    if served != 1 or np.abs(got - ref).max() > 1e-5 * np.abs(ref).max():
        cell.value = current
        _native.sgemm_hook_state(0)
        return f"not installed: check failed (calls served {served})"
    return "installed"


def _writable(address: int) -> bool:
    """The page holding `address` is mapped writable in this process (/proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                span, perms = line.split()[:2]
                lo, hi = (int(v, 16) for v in span.split("-"))
                if lo <= address < hi:
                    return "w" in perms
    except (OSError, ValueError):
        pass
    return False


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
