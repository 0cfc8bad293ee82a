"""L2 prefetch of weights a later kernel reads (CUDA, sm_90; op family "l2_prefetch", opt-in).

    token = l2_prefetch(w, after)   # w: any contiguous array; after: any array; token: uint32 [1]

The kernel runs once ``after`` is computed (MLX's CUDA graph orders a node after the producers of
its inputs) and asks the Hopper bulk-copy unit to load the first min(w.nbytes, MAX_BYTES) bytes of
``w`` into L2 (``cp.async.bulk.prefetch.L2.global``, one instruction per CHUNK bytes), then ends
without waiting for them: the loads go on while the kernels after it run. Its output is one zero
word, and nothing in the model reads it; the caller ties the node into the graph with
``mx.depends`` on an array the weights' reader takes, which adds no edge to that reader (the
dependency is by buffer), so the prefetch overlaps the work between ``after`` and the reader.

Meant for a decode step's memory-idle stretches: issued after a layer's q/k/v, the o_proj weights
(24.8 MB at 31B, half the H200's 50 MB L2) load while the layer's attention runs, which reads little
at short contexts. A hint only: results are bit-identical with it on or off; the timing is the point
(bench/NOTES.md, session 18). Its reference is no kernel at all (CPU, Metal, older GPUs,
GEMMA4_MLX_KERNELS=reference): the op returns None and the caller adds nothing.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import KernelSource, cuda_arch, template_args, use_reference
from .dialect import prelude

__all__ = ["l2_prefetch", "kernel_specs", "MAX_BYTES", "CHUNK"]

MAX_BYTES = 32 << 20
"""At most this much of ``w`` is prefetched: the H200's L2 is 50 MB, and the kernels between the
prefetch and the reader stream their own bytes through it."""

CHUNK = 64 << 10
"""Bytes per prefetch instruction (one per thread); a multiple of 16, as the instruction needs."""

# Template: BYTES (bytes to prefetch, <= MAX_BYTES), CHUNK.
_BODY_CUDA = r"""
  // gemma4-mlx l2_prefetch: thread i hints the 16-byte words inside bytes [i CHUNK, (i + 1) CHUNK)
  // of w (the first BYTES) into L2; the instruction takes 16-byte aligned addresses and sizes
  const long long start = (long long)(blockIdx.x * blockDim.x + threadIdx.x) * CHUNK;
  if (blockIdx.x == 0 && threadIdx.x == 0) token[0] = 0u;
  if (start < BYTES) {
    const long long end = start + CHUNK < BYTES ? start + CHUNK : BYTES;
    const unsigned long long lo = ((unsigned long long)(w + start) + 15ull) & ~15ull;
    const unsigned long long hi = ((unsigned long long)(w + end)) & ~15ull;
    if (hi > lo) {
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(lo), "r"((unsigned int)(hi - lo)) : "memory");
    }
  }
"""

_PREFETCH = KernelSource("g4_l2_prefetch", ("w", "after"), ("token",),
                         {"metal": ("", ""), "cuda": (prelude("cuda"), _BODY_CUDA)})  # fmt: skip

THREADS = 128


def _plan(nbytes: int) -> tuple[int, int]:
    """(bytes to prefetch, threads in the grid) for an array of nbytes."""
    count = min(nbytes, MAX_BYTES) & ~15
    threads = -(-count // CHUNK)
    return count, -(-threads // THREADS) * THREADS


def l2_prefetch(w: mx.array, after: mx.array) -> mx.array | None:
    """On an sm_90 CUDA device: the token, uint32 [1] zeros computed after ``after``, whose kernel
    starts loading the first min(w.nbytes, MAX_BYTES) bytes of ``w`` (row-contiguous) into L2.
    Elsewhere (CPU, Metal, older GPUs, GEMMA4_MLX_KERNELS=reference) None: nothing to order."""
    count, threads = _plan(w.nbytes)
    if use_reference() or cuda_arch() < 90 or count == 0:
        return None
    if w.dtype != mx.uint8:
        w = mx.view(w, mx.uint8)  # a view: the same buffer, so the same bytes
    return _PREFETCH.kernel()(
        inputs=[w, after],
        template=template_args([("BYTES", count), ("CHUNK", CHUNK)]),
        grid=(threads, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.uint32],
    )[0]


def _case(rng: np.random.Generator, nbytes: int):
    from .registry import KernelCase

    w = rng.integers(0, 256, size=(nbytes,), dtype=np.uint8)
    count, threads = _plan(nbytes)
    return KernelCase(
        inputs={"w": w, "after": rng.standard_normal(8).astype(np.float32)},
        template=[("BYTES", count), ("CHUNK", CHUNK)],
        grid=(threads, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=["uint32"],
        expected=[np.zeros(1, np.uint32)],
        rtol=0.0,
        atol=0.0,
        label=f"{nbytes} bytes",
    )


def _cases(rng: np.random.Generator):
    # a tail shorter than 16 bytes (not prefetched), a partial last chunk, several threadgroups
    return [_case(rng, 1000), _case(rng, 3 * CHUNK + 4000), _case(rng, 130 * CHUNK + 48)]


def kernel_specs():
    """KernelSpec of the prefetch kernel (CUDA only: no Metal text)."""
    from .registry import KernelSpec

    return [KernelSpec(_PREFETCH.name, _PREFETCH.input_names, _PREFETCH.output_names, "", "",
                       *_PREFETCH.text["cuda"], _cases)]  # fmt: skip
