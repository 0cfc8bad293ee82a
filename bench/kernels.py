"""Bandwidth of the fused GGUF dequant-matvec kernels (custom_kernels.quant_matvec) at real shapes.

For every projection of Gemma 4 31B, 26B-A4B, 12B and E4B (sliding and full attention layers,
MLP, the tied 262144 x H head, and the 26B-A4B expert path at M = 1 with 8 experts), one run reports:

  * time per call and GB/s of each kernel at M = 1 and M = 8 (Q4_0 projections; Q8_0 and Q6_K
    head), bytes = weight bytes read + activations read + outputs written;
  * the device copy bandwidth measured in the same run (``a + 1`` over a 1 GiB float32 array,
    bytes read + written) and every kernel's fraction of it; on CUDA also a read-only probe kernel
    over the same 1 GiB and (--focus) over the same bytes as the 31B FFN weights, i.e. what any
    kernel that only reads those bytes reaches here;
  * ``mx.quantized_matmul`` (``mx.gather_qmm`` for experts) on the MLX affine form of the same
    weights (lossless mapping; bf16 scales/biases, as mlx-lm stores them) in the same run;
  * M=8 / M=1 time ratios.

Weights are random GGUF blocks (valid fp16 scales); each shape rotates through enough weight sets
(at least 8, and at least 512 MiB in all) that the GPU's L2 cache cannot serve them.

    python bench/kernels.py                 # GPU (Metal or CUDA): all models
    python bench/kernels.py --models 31B    # one model
    python bench/kernels.py --sweep         # also time launch geometries (R, NSG, LPB) on key shapes
    python bench/kernels.py --quick         # tiny shapes; also runs on CPU (references), for CI-less checks

Writes bench/results/kernels-<backend>-<date>.json (hardware, versions, every number).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hardware import commit, hardware_info, sources_digest  # noqa: E402  (bench/hardware.py)
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import custom_kernels  # noqa: E402
from custom_kernels import quant_matvec as qm  # noqa: E402
from custom_kernels import moe_experts as me  # noqa: E402
from custom_kernels import quant_tiles as qt  # noqa: E402

VOCAB = 262144
# (name, N, K) per model: attention at sliding (s) and full (f) layers, MLP, head.
MODELS = {
    "31B": dict(H=5376, proj=[("attn_q(s)", 8192, 5376), ("attn_k/v(s)", 4096, 5376), ("attn_q(f)", 16384, 5376),
                              ("attn_k(f)", 2048, 5376), ("attn_o(s)", 5376, 8192), ("attn_o(f)", 5376, 16384),
                              ("ffn_gate/up", 21504, 5376), ("ffn_down", 5376, 21504)]),
    "26B-A4B": dict(H=2816, proj=[("attn_q(s)", 4096, 2816), ("attn_k/v(s)", 2048, 2816), ("attn_q(f)", 8192, 2816),
                                  ("attn_k(f)", 1024, 2816), ("attn_o(s)", 2816, 4096), ("attn_o(f)", 2816, 8192),
                                  ("ffn_gate/up", 2112, 2816), ("ffn_down", 2816, 2112)],
                    experts=dict(E=128, top_k=8, F=704)),
    "12B": dict(H=3840, proj=[("attn_q(s)", 4096, 3840), ("attn_k/v(s)", 2048, 3840), ("attn_q(f)", 8192, 3840),
                              ("attn_k(f)", 512, 3840), ("attn_o(s)", 3840, 4096), ("attn_o(f)", 3840, 8192),
                              ("ffn_gate/up", 15360, 3840), ("ffn_down", 3840, 15360)]),
    "E4B": dict(H=2560, proj=[("attn_q(s)", 2048, 2560), ("attn_k/v(s)", 512, 2560), ("attn_q(f)", 4096, 2560),
                              ("attn_k/v(f)", 1024, 2560), ("attn_o(s)", 2560, 2048), ("attn_o(f)", 2560, 4096),
                              ("ffn_gate/up", 10240, 2560), ("ffn_down", 2560, 10240)]),
}  # fmt: skip
QUICK = {"tiny": dict(H=256, proj=[("proj", 96, 256), ("down", 256, 96)], head=512, experts=dict(E=8, top_k=2, F=64))}
SWEEP_SHAPES = [("31B", "ffn_gate/up", 21504, 5376)]
MIN_SET_BYTES = 512 << 20
TARGET_ROUND_S = 0.03


# --------------------------------------------------------------------------------------------
# random weights on the device


def random_blocks(ggml_type: int, shape: tuple[int, ...], k: int) -> mx.array:
    """Random GGUF blocks uint8 [*shape, row_bytes] with finite nonzero fp16 scales, made on device."""
    f = qm._fmt(ggml_type)
    nb = k // f.block_weights
    payload = mx.random.randint(0, 256, (*shape, nb, f.block_bytes), dtype=mx.uint8)
    d = mx.random.uniform(0.002, 0.02, (*shape, nb)).astype(mx.float16)
    d_bytes = mx.view(d, mx.uint8).reshape(*shape, nb, 2)
    at = 208 if ggml_type == qm.Q6_K else 0
    blocks = mx.concatenate([payload[..., :at], d_bytes, payload[..., at + 2 :]], axis=-1)
    return blocks.reshape(*shape, nb * f.block_bytes)


def to_affine(blocks: mx.array, ggml_type: int, k: int, dtype) -> tuple[mx.array, mx.array, mx.array]:
    """Lossless Q4_0/Q8_0 -> MLX affine group-32 triple (w uint32, scales, biases) in MLX ops;
    scales/biases cast to ``dtype`` (bf16: mlx-lm's layout, 5.0 / 9.0 bits per weight)."""
    lead = blocks.shape[:-1]
    nb = k // 32
    b = blocks.reshape(*lead, nb, qm._fmt(ggml_type).block_bytes)
    d = mx.view(b[..., 0:2].astype(mx.uint16)[..., 0] | (b[..., 1].astype(mx.uint16) << 8), mx.float16)
    if ggml_type == qm.Q4_0:
        qs = b[..., 2:18]
        even, odd = qs[..., 0::2], qs[..., 1::2]
        packed = mx.concatenate([(even & 15) | (odd << 4), (even >> 4) | (odd & 240)], axis=-1)
        zero = -8.0
    else:
        packed = b[..., 2:34] ^ 128
        zero = -128.0
    w = mx.view(mx.contiguous(packed), mx.uint32).reshape(*lead, -1)
    scales = d.astype(mx.float32)
    return w, scales.astype(dtype), (scales * zero).astype(dtype)


def n_sets(set_bytes: int, quick: bool) -> int:
    if quick:
        return 4
    return int(min(4096, max(8, math.ceil(MIN_SET_BYTES / set_bytes))))


# --------------------------------------------------------------------------------------------
# timing


def time_rotating(calls: list, quick: bool) -> float:
    """Median seconds per call of a list of zero-argument callables (one per weight set), each
    round evaluating all of them (repeated to ~TARGET_ROUND_S) as one graph. The lazy graph is
    built before the clock starts: Python's per-call cost is not the kernel's (a decode step is
    compiled once and replayed), while MLX's own per-op scheduling cost is counted."""
    mx.eval([c() for c in calls])  # warm-up: compile, allocate
    outs = [c() for c in calls]
    mx.synchronize()
    t = time.perf_counter()
    mx.eval(outs)
    mx.synchronize()
    one = max(time.perf_counter() - t, 1e-6)
    reps = 1 if quick else max(1, int(TARGET_ROUND_S / one))
    rounds = 2 if quick else 7
    samples = []
    for _ in range(rounds):
        outs = [c() for _ in range(reps) for c in calls]
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        samples.append((time.perf_counter() - t) / (reps * len(calls)))
    return statistics.median(samples)


def timed(calls: list, quick: bool, nbytes: int) -> dict:
    """time_us / GBps: back-to-back calls of a round (time_rotating). The calls of a round are
    independent, so MLX's CUDA graph may run their kernels concurrently, which flatters kernels that
    do not fill the GPU alone. On CUDA (with torch's profiler at hand) also serial_us / serial_GBps:
    GPU kernel time per call with each call evaluated on its own (bench/gpu_timeline.py), which is
    how a decode step runs them, one after another."""
    sec = time_rotating(calls, quick)
    out = dict(time_us=sec * 1e6, bytes=nbytes, GBps=nbytes / sec / 1e9)
    if custom_kernels.backend() == "cuda" and not quick:
        try:
            from gpu_timeline import kernel_time_per_call  # noqa: PLC0415  (needs torch)

            us = kernel_time_per_call(calls[:16], reps=2)["gpu_us"]
            out.update(serial_us=us, serial_GBps=nbytes / us / 1e3)
        except ImportError:
            pass
    return out


def host_split(calls: list, quick: bool) -> dict:
    """Where the time of a round goes: ``host_us`` per call until mx.async_eval returns (MLX's
    scheduling and graph building/launch on the host), ``total_us`` per call until the device is
    done. host ~ total means the host (MLX's per-op cost) bounds the round, not the kernels."""
    mx.eval([c() for c in calls])
    reps = 2 if quick else max(1, 200 // len(calls))
    host, total = [], []
    for _ in range(2 if quick else 5):
        outs = [c() for _ in range(reps) for c in calls]
        mx.synchronize()
        t0 = time.perf_counter()
        mx.async_eval(outs)
        t1 = time.perf_counter()
        mx.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / len(outs))
        total.append((t2 - t0) / len(outs))
    return {"host_us": statistics.median(host) * 1e6, "total_us": statistics.median(total) * 1e6}


_NOOP_KERNEL = None


def overhead_probe(quick: bool) -> list[dict]:
    """Per-op floor: back-to-back launches of a one-thread custom kernel and of a tiny mx.add (no
    memory traffic to speak of), host enqueue vs total per op."""
    global _NOOP_KERNEL
    rows = []
    xs = [mx.random.normal((64,)) for _ in range(8)]
    mx.eval(xs)
    if custom_kernels.backend() == "cuda":
        if _NOOP_KERNEL is None:
            _NOOP_KERNEL = mx.fast.cuda_kernel(name="g4_bench_noop", input_names=["a", "b"], output_names=["o"],
                                               source="if (threadIdx.x == 0) o[0] = a[0];")  # fmt: skip

        def noop(a, b):
            return _NOOP_KERNEL(inputs=[a, b], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)],
                                output_dtypes=[mx.float32])[0]  # fmt: skip

        rows.append(dict(name="custom kernel, 1 thread", **host_split([lambda a=a: noop(a, a) for a in xs], quick)))
        # the same kernel also binding a 26B-A4B layer's expert stacks' size of uint8 (428 M elements):
        # MLX's CUDA encoder counts bound inputs toward MLX_MAX_MB_PER_BUFFER, and a commit costs the host
        big = [mx.zeros((64 if quick else 428 << 20,), dtype=mx.uint8) for _ in range(2)]
        mx.eval(big)
        words = [mx.view(b, mx.uint32) for b in big]  # the same bytes, a quarter of the elements
        for name, bound in (("same, binding 428 MB of uint8", big), ("same, binding them as uint32", words)):
            calls = [lambda a=a, b=bound[i % 2]: noop(a, b) for i, a in enumerate(xs)]
            rows.append(dict(name=name, **host_split(calls, quick)))
        del big, words, calls
    rows.append(dict(name="mx.add on 64 floats", **host_split([lambda a=a: a + 1.0 for a in xs], quick)))
    for r in rows:
        print(f"  overhead: {r['name']:28} host {r['host_us']:6.1f} us/op  total {r['total_us']:6.1f} us/op", flush=True)
    return rows


def copy_bandwidth(quick: bool) -> dict:
    """Device copy rate: a + 1 over a float32 array (1 GiB; 16 MiB with --quick), bytes read + written."""
    n = (1 << 22) if quick else (1 << 28)
    arrays = [mx.random.uniform(shape=(n,)) for _ in range(2)]
    mx.eval(arrays)
    sec = time_rotating([lambda a=a: a + 1.0 for a in arrays], quick)
    nbytes = 2 * 4 * n
    out = {"bytes": nbytes, "time_us": sec * 1e6, "GBps": nbytes / sec / 1e9}
    if custom_kernels.backend() == "cuda" and not custom_kernels.use_reference():
        views = [mx.view(a, mx.uint8).reshape(-1, 4096) for a in arrays]
        rsec = time_rotating([lambda v=v: read_probe(v) for v in views], quick)
        out["read_GBps"] = 4 * n / rsec / 1e9  # the read probe over the same arrays: bytes read only
    return out


# --------------------------------------------------------------------------------------------
# cases


_READ_KERNEL = None
_READ_GRID = (2048, 256)  # blocks, threads of the grid-stride order: >= 8 blocks per SM on an H200
READ_ORDERS = {0: "grid-stride", 1: "warp owns 4 rows, reads them in order", 2: "warp owns 16 rows, 144 B of each per step",
               3: "runs16: lane (g, t) reads 72-byte runs of rows g, g + 8", 4: "warp owns 16 rows, 576 B of each per step"}


def read_probe(w: mx.array, order: int = 0) -> mx.array:
    """CUDA only: every 16-byte word of w read once, XOR-folded to one uint32 per warp: the rate a
    kernel that only reads these bytes reaches in this harness. w: bytes [N, row_bytes] (total a
    multiple of 16). order 0: grid-stride over the whole array (each warp instruction 512
    contiguous bytes); 1: each warp reads its 4 consecutive rows front to back (rows 16-byte
    aligned); 2: the stream matvec's order, each warp 16 rows, a 144-byte piece of each per step
    (row_bytes a multiple of 144); 3: the runs16 kernels' order (each warp 16 rows; lane (g, t) reads
    runs 8j + 2t and 8j + 2t + 1 of rows g and g + 8, 72 bytes each as four 16-byte loads and one
    8-byte load; rows a multiple of 16, row_bytes of 144); 4: a staged order (each warp 16 rows,
    576 bytes of each per step, the warp's lanes on consecutive 16-byte words; row_bytes a multiple
    of 16; the staged runs16 kernels copy 288 bytes per row and step this way)."""
    global _READ_KERNEL
    if _READ_KERNEL is None:
        _READ_KERNEL = mx.fast.cuda_kernel(name="g4_bench_read", input_names=["w"], output_names=["o"], source="""
  const uint4* p = reinterpret_cast<const uint4*>(w);
  const size_t rb16 = (size_t)w_shape[1] / 16;
  const size_t n16 = (size_t)w_shape[0] * rb16;
  const size_t gt = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int lane = (int)(threadIdx.x & 31u);
  uint32_t acc = 0;
  if (ORDER == 0) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = gt;
    for (; i + 3 * stride < n16; i += 4 * stride) {
      const uint4 a = __ldg(p + i), b = __ldg(p + i + stride), c = __ldg(p + i + 2 * stride), d = __ldg(p + i + 3 * stride);
      acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n16; i += stride) { const uint4 a = __ldg(p + i); acc ^= a.x ^ a.y ^ a.z ^ a.w; }
  } else if (ORDER == 1) {
    const size_t begin = (gt >> 5) * 4 * rb16, end = min(begin + 4 * rb16, n16);
    _Pragma("unroll 4") for (size_t i = begin + lane; i < end; i += 32) { const uint4 a = __ldg(p + i); acc ^= a.x ^ a.y ^ a.z ^ a.w; }
  } else if (ORDER == 3) {
    const uint8_t* wb = reinterpret_cast<const uint8_t*>(w);
    const size_t rb = (size_t)w_shape[1];
    const size_t ra = (gt >> 5) * 16 + (lane >> 2);
    const int t = lane & 3;
    const int C = (int)(rb / 72);
    if (ra + 8 < (size_t)w_shape[0]) {
      for (int j = 0; 8 * j < C; ++j) {
        _Pragma("unroll") for (int ph = 0; ph < 2; ++ph) {
          const int c = 8 * j + 2 * t + ph;
          if (c < C) {
            _Pragma("unroll") for (int h = 0; h < 2; ++h) {
              const uint8_t* run = wb + (ra + 8 * h) * rb + (size_t)c * 72;
              const uint2 e = __ldg(reinterpret_cast<const uint2*>(run + (ph ? 0 : 64)));
              const uint4* v = reinterpret_cast<const uint4*>(run + (ph ? 8 : 0));
              acc ^= e.x ^ e.y;
              _Pragma("unroll") for (int s = 0; s < 4; ++s) { const uint4 a = __ldg(v + s); acc ^= a.x ^ a.y ^ a.z ^ a.w; }
            }
          }
        }
      }
    }
  } else if (ORDER == 4) {
    const size_t row0 = (gt >> 5) * 16;
    for (size_t p0 = 0; p0 < rb16; p0 += 36) {
      const int n = rb16 - p0 < 36 ? (int)(rb16 - p0) : 36;
      _Pragma("unroll 6") for (int i = lane; i < 16 * 36; i += 32) {
        const size_t row = row0 + i / 36;
        const int piece = i % 36;
        if (piece < n && row < (size_t)w_shape[0]) { const uint4 a = __ldg(p + row * rb16 + p0 + piece); acc ^= a.x ^ a.y ^ a.z ^ a.w; }
      }
    }
  } else {
    const size_t row0 = (gt >> 5) * 16;
    const int steps = (int)(rb16 / 9);
    _Pragma("unroll 2") for (int g = 0; g < steps; ++g) {
      for (int c = lane; c < 16 * 9; c += 32) {
        const size_t row = row0 + c / 9;
        if (row < (size_t)w_shape[0]) { const uint4 a = __ldg(p + row * rb16 + 9 * g + c % 9); acc ^= a.x ^ a.y ^ a.z ^ a.w; }
      }
    }
  }
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) o[gt >> 5] = acc;
""")  # fmt: skip
    n, rb = w.shape
    if order == 0:
        blocks, threads = _READ_GRID
    else:
        threads = 128
        warps = -(-n // (4 if order == 1 else 16))
        blocks = -(-warps // (threads // 32))
    return _READ_KERNEL(inputs=[w], template=[("ORDER", order)], grid=(blocks * threads, 1, 1),
                        threadgroup=(threads, 1, 1), output_shapes=[(blocks * threads // 32,)],
                        output_dtypes=[mx.uint32], init_value=0)[0]  # fmt: skip


def read_probe_rows(model, name, n, k, weights, quick) -> list[dict]:
    """Time read_probe in each order over the same rotating weight sets as a kernel row (each
    checked against numpy's XOR of the same bytes)."""
    w0 = weights[0]
    want = np.bitwise_xor.reduce(np.array(w0).reshape(-1).view(np.uint32))
    rows = []
    for order, what in READ_ORDERS.items():
        if (order in (2, 3) and w0.shape[1] % 144) or (order == 3 and w0.shape[0] % 16):
            continue
        got = np.bitwise_xor.reduce(np.array(read_probe(w0, order)))
        if w0.nbytes % 16 or got != want:
            raise RuntimeError(f"read probe {what}: XOR {got:#x} != {want:#x} (or bytes not a multiple of 16)")
        calls = [lambda w=w: read_probe(w, order) for w in weights]
        rows.append(dict(model=model, name=name, impl=f"read probe: {what}", N=n, K=k, M=1, sets=len(weights),
                         **timed(calls, quick, w0.nbytes)))  # fmt: skip
    return rows


def path_read_row(model, name, n, k, nbytes, quick) -> dict:
    """The read probe (grid-stride, one launch) over as many bytes as a path reads, on rotating
    contiguous sets: what a single kernel that only reads those bytes reaches in this harness, back
    to back and serial (the ceiling of any one-launch form of the path, before its own work)."""
    rows16 = -(-nbytes // 4096)
    sets = [mx.random.randint(0, 256, (rows16, 4096), dtype=mx.uint8) for _ in range(n_sets(rows16 * 4096, quick))]
    mx.eval(sets)
    calls = [lambda w=w: read_probe(w) for w in sets]
    row = dict(model=model, name=name, impl="read probe: path's bytes", N=n, K=k, M=1, sets=len(sets),
               **timed(calls, quick, rows16 * 4096), **host_split(calls, quick))  # fmt: skip
    del sets, calls
    return row


def _dtype_bytes(dtype) -> int:
    return {mx.float32: 4, mx.bfloat16: 2, mx.float16: 2}[dtype]


def dense_case(model, name, ggml_type, n, k, ms, dtype, quick, on_gpu, config=None, with_qmm=True, mma=True,
               stream=True, fma=True, read=False, runs=True, dispatch=False):  # fmt: skip
    """Kernel (and quantized_matmul; and the CUDA tensor-core kernel for Q4_0 bf16 unless mma is
    False, with its default geometry or the MmaConfig given as mma; and the CUDA runs kernels
    unless runs is False: at M = 1 each one-token form, at every M the runs16m geometries of
    RUNS_M_VARIANTS) at each M in ms on rotating [N, K] weight sets; with read, first the CUDA read
    probe over the same sets; with dispatch, also qm.quant_matvec itself (what the model calls)."""
    rb = qm.row_bytes(ggml_type, k)
    sets = n_sets(n * rb, quick)
    weights = [random_blocks(ggml_type, (n,), k) for _ in range(sets)]
    mx.eval(weights)
    rows = []
    if read and on_gpu and custom_kernels.backend() == "cuda":
        rows.extend(read_probe_rows(model, name, n, k, weights, quick))
    for m in ms:
        x = mx.random.normal((m, k)).astype(dtype)
        mx.eval(x)
        nbytes = n * rb + m * k * _dtype_bytes(dtype) + m * n * _dtype_bytes(dtype)
        if fma:
            if on_gpu:
                calls = [lambda w=w: qm.launch_dense(x, w, ggml_type, n, config=config) for w in weights]
            else:
                calls = [lambda w=w: qm.quant_matvec(x, w, ggml_type, n) for w in weights]
            t = timed(calls, quick, nbytes)
            cfg = config or qm.default_config(ggml_type, "dense", m, n, k)
            rows.append(dict(model=model, name=name, impl=f"{qm._fmt(ggml_type).name}_matvec", N=n, K=k, M=m,
                             sets=sets, **t, config=[cfg.rows_per_simd, cfg.simd_groups, cfg.lanes_per_block]))  # fmt: skip
        if (stream and on_gpu and ggml_type == qm.Q4_0 and custom_kernels.backend() == "cuda"
                and qm.stream_supported(dtype, k)):  # fmt: skip
            scfg = stream if isinstance(stream, qm.StreamConfig) else qm.default_stream_config("dense", m, n, k)
            calls = [lambda w=w: qm.launch_dense_stream(x, w, n, config=scfg) for w in weights]
            rows.append(dict(model=model, name=name, impl="q4_0_matvec_stream", N=n, K=k, M=m, sets=sets,
                             **timed(calls, quick, nbytes),
                             config=[scfg.tiles, scfg.warps, scfg.stages, scfg.group_blocks, int(scfg.rotate)],
                             **host_split(calls[:8], quick)))  # fmt: skip  # fmt: skip
        if (runs and on_gpu and ggml_type == qm.Q4_0 and m == 1 and custom_kernels.backend() == "cuda"
                and qm.runs_supported(dtype, k)):  # fmt: skip
            for rcfg in runs_variants("dense", n, k):
                calls = [lambda w=w, c=rcfg: qm.launch_dense_runs(x, w, n, config=c) for w in weights]
                rows.append(dict(model=model, name=name, impl=_runs_impl("q4_0_matvec", rcfg), N=n, K=k, M=m,
                                 sets=sets, **timed(calls, quick, nbytes),
                                 config=[rcfg.rows, rcfg.warps, rcfg.stages, rcfg.bulk, rcfg.dynamic]))  # fmt: skip
        if (runs and on_gpu and ggml_type == qm.Q4_0 and custom_kernels.backend() == "cuda" and qm.runs_supported(dtype, k)
                and qm._arch_at_least(qm.BULK_ARCH)):  # fmt: skip
            for mcfg in RUNS_M_VARIANTS:
                calls = [lambda w=w, c=mcfg: qm.launch_dense_runs_m(x, w, n, config=c) for w in weights]
                rows.append(dict(model=model, name=name, impl=_runs_m_impl("q4_0_matvec", mcfg), N=n, K=k, M=m,
                                 sets=sets, **timed(calls, quick, nbytes), config=[mcfg.warps, mcfg.stages]))  # fmt: skip
        if dispatch:
            calls = [lambda w=w: qm.quant_matvec(x, w, ggml_type, n) for w in weights]
            rows.append(dict(model=model, name=name, impl=f"{qm._fmt(ggml_type).name}_matvec (dispatch)", N=n, K=k,
                             M=m, sets=sets, **timed(calls, quick, nbytes)))  # fmt: skip
        if mma and on_gpu and ggml_type == qm.Q4_0 and dtype == mx.bfloat16 and custom_kernels.backend() == "cuda":
            mcfg = mma if isinstance(mma, qm.MmaConfig) else qm.default_mma_config(n)
            calls = [lambda w=w: qm.launch_dense_mma(x, w, n, config=mcfg) for w in weights]
            rows.append(dict(model=model, name=name, impl="q4_0_matvec_mma", N=n, K=k, M=m, sets=sets,
                             **timed(calls, quick, nbytes),
                             config=[mcfg.tiles, mcfg.warps]))  # fmt: skip
    if with_qmm and ggml_type in (qm.Q4_0, qm.Q8_0):
        bits = 4 if ggml_type == qm.Q4_0 else 8
        affine = [to_affine(w, ggml_type, k, dtype) for w in weights]
        del weights
        mx.eval(affine)
        abytes = sum(a.nbytes for a in affine[0])
        for m in ms:
            x = mx.random.normal((m, k)).astype(dtype)
            calls = [lambda a=a: mx.quantized_matmul(x, *a, transpose=True, group_size=32, bits=bits) for a in affine]
            nbytes = abytes + m * k * _dtype_bytes(dtype) + m * n * _dtype_bytes(dtype)
            rows.append(dict(model=model, name=name, impl=f"mx.quantized_matmul_{bits}bit", N=n, K=k, M=m,
                             sets=sets, **timed(calls, quick, nbytes)))  # fmt: skip
    return rows


RUNS_STAGES = (1, 2, 3)
"""Stage counts of the staged runs16 form timed beside the default runs kernel."""


def runs_variants(kind: str, n: int, k: int) -> list:
    """The default RunsConfig, then the staged 16-row form at each of RUNS_STAGES with 16-byte and
    with bulk copies (warps as default_runs_config would choose for that stage count), and with 2
    slots in dynamic shared memory where that allows more warps than static."""
    out = [qm.default_runs_config(kind, n, k)]
    for stages in RUNS_STAGES:
        warps = qm.runs_warps(kind, n, k, 16, stages)
        out += [c for c in (qm.RunsConfig(warps, 0, 16, 0, stages, bulk) for bulk in (0, 1)) if c != out[0]]
    dyn = qm.RunsConfig(qm.runs_warps(kind, n, k, 16, 2, qm.RUNS_DYNAMIC_LIMIT), 0, 16, 0, 2, 0, 1)
    return out + ([dyn] if dyn.warps * 2 * qm.RUNS_STAGE_BYTES > qm.RUNS_SHARED_LIMIT else [])


RUNS_M_VARIANTS = tuple(qm.RunsMConfig(w, s) for w, s in ((1, 2), (2, 2), (4, 2), (8, 2), (2, 3), (4, 3)))
"""Geometries (warps, stages) of the runs16m kernels timed at every M."""
MOE_VARIANTS = tuple(me.MoeConfig(s, w) for w in (8, 16) for s in (2, 3, 4))
"""One-launch expert kernel geometries timed as rows (the default is the plain row)."""


def _runs_m_impl(prefix: str, cfg) -> str:
    return f"{prefix}_runs16m_w{cfg.warps}s{cfg.stages}"


def _runs_impl(prefix: str, cfg) -> str:
    form = "b" if cfg.bulk else "d" if cfg.dynamic else "s"
    return f"{prefix}_runs{cfg.rows}" + (f"{form}{cfg.stages}" if cfg.stages else "")


def gate_up_case(model, f, k, ms, dtype, quick, on_gpu):
    """A dense MLP's gate and up projections on rotating [2F, K] Q4_0 sets: two matvecs on the row
    halves + the GeGLU product in MLX ops (the unfused model) vs qm.gate_up (one launch); at M = 1
    on CUDA also each runs kernel form (runs_variants)."""
    rb = qm.row_bytes(qm.Q4_0, k)
    sets = n_sets(2 * f * rb, quick)
    weights = [random_blocks(qm.Q4_0, (2 * f,), k) for _ in range(sets)]
    mx.eval(weights)
    rows = []
    for m in ms:
        x = mx.random.normal((m, k)).astype(dtype)
        mx.eval(x)
        nbytes = 2 * f * rb + m * k * _dtype_bytes(dtype) + m * f * _dtype_bytes(dtype)
        variants = {
            "gate+up+gelu (3 ops)": lambda w: qm.gelu_tanh(qm.quant_matvec(x, w[:f], qm.Q4_0, f))
            * qm.quant_matvec(x, w[f:], qm.Q4_0, f),
            "gate_up fused (1 op)": lambda w: qm.gate_up(x, w, qm.Q4_0, f),
        }
        if m == 1 and on_gpu and custom_kernels.backend() == "cuda" and qm.runs_supported(dtype, k):
            for rcfg in runs_variants("gate_up", f, k):
                variants[_runs_impl("gate_up", rcfg)] = lambda w, c=rcfg: qm.launch_gate_up_runs(x, w, f, config=c)
        if on_gpu and custom_kernels.backend() == "cuda" and qm.runs_supported(dtype, k) and qm._arch_at_least(qm.BULK_ARCH):
            for mcfg in RUNS_M_VARIANTS:
                variants[_runs_m_impl("gate_up", mcfg)] = lambda w, c=mcfg: qm.launch_gate_up_runs_m(x, w, f, config=c)
        for impl, fn in variants.items():
            calls = [lambda w=w, fn=fn: fn(w) for w in weights]
            rows.append(dict(model=model, name="ffn_gate+up", impl=impl, N=2 * f, K=k, M=m, sets=sets,
                             **timed(calls, quick, nbytes),
                             **host_split(calls[:8], quick)))  # fmt: skip
    return rows


def expert_case(model, ex, h, dtype, quick, on_gpu, stream_configs=None, with_mlx=True):
    """26B-A4B expert path at M = 1: fused gate/up (gelu*up) + down over top_k random experts."""
    e, top_k, f = ex["E"], ex["top_k"], ex["F"]
    gu_rb, dn_rb = qm.row_bytes(qm.Q4_0, h), qm.row_bytes(qm.Q4_0, f)
    layer_bytes = e * (2 * f * gu_rb + h * dn_rb)
    sets = n_sets(layer_bytes, quick)
    layers = [(random_blocks(qm.Q4_0, (e, 2 * f), h), random_blocks(qm.Q4_0, (e, h), f)) for _ in range(sets)]
    mx.eval(layers)
    rng = np.random.default_rng(0)
    ids = [mx.array(rng.permutation(e)[:top_k][None].astype(np.int32)) for _ in range(sets)]
    x = mx.random.normal((1, h)).astype(dtype)
    mx.eval(x, ids)

    def ours(i):
        gu, dn = layers[i]
        if on_gpu:
            a = qm.launch_gate_up(x, ids[i], gu, qm.Q4_0, f)
            return qm.launch_gather(a, ids[i], dn, qm.Q4_0, h)
        a = qm.q4_0_gate_up_gather(x, ids[i], gu, f)
        return qm.q4_0_matvec_gather(a, ids[i], dn, h)

    act = _dtype_bytes(dtype)
    nbytes = top_k * (2 * f * gu_rb + h * dn_rb) + (h + 2 * top_k * f + top_k * h) * act
    label = f"experts top{top_k} (gate_up+down)"
    rows = []
    variants = [("q4_0_gate_up+gather", ours, None)]
    if on_gpu and custom_kernels.backend() == "cuda" and qm.stream_supported(dtype, h) and qm.stream_supported(dtype, f):
        for cfg in stream_configs or [None]:
            def streamed(i, cfg=cfg):
                gu, dn = layers[i]
                a = qm.launch_gate_up_stream(x, ids[i], gu, f, config=cfg)
                return qm.launch_gather_stream(a, ids[i], dn, h, config=cfg)

            variants.append(("q4_0_gate_up+gather_stream", streamed, cfg))
        if not stream_configs:  # the model's whole expert step: + the router-weighted sum over slots
            wts = mx.full((1, top_k), 1.0 / top_k)

            def old_summed(i):
                out = ours(i).astype(mx.float32) * wts[..., None]
                return out.sum(axis=1).astype(dtype)

            def fused(i):
                gu, dn = layers[i]
                a = qm.launch_gate_up_stream(x, ids[i], gu, f)
                return qm.launch_down_sum_stream(a, ids[i], wts, dn, h)

            variants += [("q4_0_gate_up+gather+wsum (mlx)", old_summed, None), ("q4_0_gate_up+down_sum_stream", fused, None)]
            if dtype == mx.bfloat16 and me.moe_experts_supported(x, ids[0], f, h):
                # as in a decode step, each call's x is the previous call's output (one chain per
                # round): the one-launch kernel's counters serve calls that run one after another.
                # The values are not renormalized (they drift to inf / NaN): no kernel's time
                # depends on them, and a normalization would add launches to the rows.
                counters = [me.new_counters() for _ in range(sets)]
                state = [x]

                def chained(path):
                    def call(i):
                        state[0] = path(i, state[0])
                        return state[0]

                    return call

                def two(i, v):
                    gu, dn = layers[i]
                    return qm.launch_down_sum_stream(qm.launch_gate_up_stream(v, ids[i], gu, f), ids[i], wts, dn, h)

                def one(i, v, cfg=None):
                    gu, dn = layers[i]
                    return me.launch_moe_experts(v, ids[i], wts, gu, dn, counters[i], f, cfg)[0]

                variants += [("gate_up+down_sum_stream, chained", chained(two), None),
                             ("moe_experts (1 launch), chained", chained(one), None)]  # fmt: skip
                # the geometry's knobs (template values of the same text)
                variants += [(f"moe_experts sets={c.sets} warps={c.warps}, chained", chained(lambda i, v, c=c: one(i, v, c)), None)
                             for c in MOE_VARIANTS if c != me.MoeConfig()]  # fmt: skip
    for impl, fn, cfg in variants:
        calls = [lambda i=i, fn=fn: fn(i) for i in range(sets)]
        extra = {} if cfg is None else {"config": [cfg.tiles, cfg.warps, cfg.stages, cfg.group_blocks, int(cfg.rotate)]}
        rows.append(dict(model=model, name=label, impl=impl, N=2 * f, K=h, M=1, E=e, sets=sets,
                         **timed(calls, quick, nbytes), **extra, **host_split(calls, quick)))  # fmt: skip
    if on_gpu and custom_kernels.backend() == "cuda" and not stream_configs:
        rows.append(path_read_row(model, label, 2 * f, h, nbytes, quick))
    if not with_mlx:
        return rows
    affine = [(to_affine(gu, qm.Q4_0, h, dtype), to_affine(dn, qm.Q4_0, f, dtype)) for gu, dn in layers]
    del layers
    mx.eval(affine)
    abytes = top_k * (sum(a.nbytes for a in affine[0][0]) + sum(a.nbytes for a in affine[0][1])) // e
    x3 = x.reshape(1, 1, h)

    def mlx_path(i):
        (gw, gs, gb), (dw, ds, db) = affine[i]
        flat = ids[i].reshape(-1)
        gu = mx.gather_qmm(x3, gw, gs, gb, rhs_indices=flat, transpose=True, group_size=32, bits=4)  # [k,1,2F]
        a = qm.gelu_tanh(gu[..., :f]) * gu[..., f:]
        return mx.gather_qmm(a, dw, ds, db, rhs_indices=flat, transpose=True, group_size=32, bits=4)

    nbytes = abytes + (h + 2 * top_k * f + top_k * h) * act
    rows.append(dict(model=model, name=f"experts top{top_k} (gate_up+down)", impl="mx.gather_qmm_4bit", N=2 * f,
                     K=h, M=1, E=e, sets=sets, **timed([lambda i=i: mlx_path(i) for i in range(sets)], quick, nbytes)))  # fmt: skip
    return rows


def sweep(dtype, quick, on_gpu):
    """Launch geometries on key shapes (GPU only), one batch of rows per geometry (one compile
    each): the f32-FMA kernel at M = 1 for R in {1, 2, 4} x NSG in {2, 4, 8} x LPB in {2, 4}; on
    CUDA the tensor-core kernel at M = 1 and 8 for tiles in {1, 2, 4} x warps in {2, 4, 8}."""
    if not on_gpu:
        return
    for model, name, n, k in SWEEP_SHAPES:
        for r in (1, 2, 4):
            for nsg in (2, 4, 8):
                for lpb in (2, 4):
                    cfg = qm.KernelConfig(r, nsg, lpb)
                    try:
                        yield dense_case(model, name, qm.Q4_0, n, k, (1,), dtype, quick, on_gpu, cfg, False, False,
                                         runs=False)  # fmt: skip
                    except Exception as exc:  # e.g. a geometry the device rejects
                        yield [dict(model=model, name=name, M=1, config=[r, nsg, lpb], error=str(exc)[:200])]
        if custom_kernels.backend() != "cuda" or dtype != mx.bfloat16:
            continue
        for tiles in (1, 2, 4):
            for warps in (2, 4, 8):
                mcfg = qm.MmaConfig(tiles, warps)
                try:
                    rows = dense_case(model, name, qm.Q4_0, n, k, (1, 8), dtype, quick, on_gpu, None, False, mcfg,
                                      runs=False)  # fmt: skip
                    yield [r for r in rows if r["impl"] == "q4_0_matvec_mma"]
                except Exception as exc:
                    yield [dict(model=model, name=name, M=8, config=[tiles, warps], error=str(exc)[:200])]
# --------------------------------------------------------------------------------------------


def tiles_shapes() -> list[tuple[str, str, str, int, int]]:
    """(model, tensor, kind, N or F, K) of the tiles comparison, from MODELS: each model's one-token
    dense rows as the model runs them (q|k|v fused, gate|up fused) at a sliding layer, and the FFN
    down; the tiles kernels can take K <= 12,288, the model routes K 3840..6144 to them."""
    out = []
    for model in ("31B", "12B", "26B-A4B", "E4B"):
        spec = MODELS[model]
        proj = {name: (n, k) for name, n, k in spec["proj"]}
        q, h = proj["attn_q(s)"]
        out += [(model, "attn_q|k|v(s)", "dense", q + 2 * proj["attn_k/v(s)"][0], h),
                (model, "attn_o(s)", "dense", *proj["attn_o(s)"]),
                (model, "ffn_gate|up", "gate_up", proj["ffn_gate/up"][0], h)]
        if proj["ffn_down"][1] <= 12288:
            out.append((model, "ffn_down", "dense", *proj["ffn_down"]))
    return out


TILES_CONFIGS = tuple(qt.TilesConfig(w, c, b) for w, c, b in ((8, 2, 0), (8, 4, 0), (8, 2, 1), (8, 4, 1)))


def tiles_case(model, name, kind, n, k, ms, dtype, quick, on_gpu) -> list[dict]:
    """On rotating Q4_0 sets: what the model runs today (qm.quant_matvec / qm.gate_up: the dispatch,
    family quant_matvec_tiles as the environment leaves it) against the tiles kernels at each of
    TILES_CONFIGS, at each M in ms; back to back and serial (GPU time, one call per eval)."""
    rows_n = 2 * n if kind == "gate_up" else n
    rb = qm.row_bytes(qm.Q4_0, k)
    weights = [random_blocks(qm.Q4_0, (rows_n,), k) for _ in range(n_sets(rows_n * rb, quick))]
    mx.eval(weights)
    out = []
    for m in ms:
        x = mx.random.normal((m, k)).astype(dtype)
        mx.eval(x)
        nbytes = rows_n * rb + m * k * _dtype_bytes(dtype) + m * n * _dtype_bytes(dtype)
        dispatch, tiles = ((lambda w: qm.gate_up(x, w, qm.Q4_0, n), qt.launch_gate_up_tiles) if kind == "gate_up"
                           else (lambda w: qm.quant_matvec(x, w, qm.Q4_0, n), qt.launch_dense_tiles))  # fmt: skip
        variants = {"dispatch": dispatch}
        if on_gpu and custom_kernels.backend() == "cuda" and qt.tiles_supported(dtype, k):
            for cfg in TILES_CONFIGS:
                variants[f"tiles w{cfg.warps}c{cfg.chunks}" + ("b" if cfg.bias else "")] = lambda w, c=cfg: tiles(x, w, n, c)
        for impl, fn in variants.items():
            calls = [lambda w=w, fn=fn: fn(w) for w in weights]
            out.append(dict(model=model, name=name, impl=impl, N=rows_n, K=k, M=m, sets=len(weights),
                            **timed(calls, quick, nbytes)))  # fmt: skip
    return out


STREAM_SWEEP = [(1, 4, 4, 8), (1, 4, 4, 8, True), (1, 8, 2, 8, True), (1, 4, 2, 16, True), (1, 2, 2, 32, True),
                (1, 4, 2, 16), (1, 8, 2, 8), (1, 2, 2, 32), (1, 2, 3, 16)]  # (tiles, warps, stages, group_blocks, rotate)


def focus(args, dtype, on_gpu, add, rows, sweep_rows, overhead_rows) -> None:
    """Issue-4 targets only: per-op overhead, 31B FFN gate/down and attn_q(s) at M = 1 and 8 (FMA,
    tensor-core and stream kernels; the read probe on the gate's bytes), the 31B gate|up fused vs
    separate, the 26B-A4B expert path (FMA and stream kernels, host/device
    split), then stream geometries on the FFN gate at M = 1 and on the expert path."""
    overhead_rows.extend(overhead_probe(args.quick))
    model = "tiny" if args.quick else "31B"
    if args.runs_m:
        shapes = [("tiny", *QUICK["tiny"]["proj"][0])] if args.quick else [
            ("31B", "ffn_gate/up", 21504, 5376), ("31B", "ffn_down", 5376, 21504), ("31B", "attn_q(s)", 8192, 5376),
            ("E4B", "ffn_gate/up", 10240, 2560), ("E4B", "ffn_down", 2560, 10240)]  # fmt: skip
        for shape_model, name, n, k in shapes:
            add(dense_case(shape_model, name, qm.Q4_0, n, k, (1, 2, 4, 8), dtype, args.quick, on_gpu, with_qmm=False,
                           mma=False, fma=False, dispatch=True), rows)  # fmt: skip
        name, n, k = QUICK["tiny"]["proj"][0] if args.quick else ("ffn_gate/up", 21504, 5376)
        add(gate_up_case(model, n, k, (1, 2, 4, 8), dtype, args.quick, on_gpu), rows)
        return
    if args.tiles:
        shapes = [("tiny", "proj", "dense", 96, 256), ("tiny", "gate|up", "gate_up", 48, 512)] if args.quick else tiles_shapes()
        for shape_model, name, kind, n, k in shapes:
            add(tiles_case(shape_model, name, kind, n, k, (1,), dtype, args.quick, on_gpu), rows)
        if not args.quick:
            rb = qm.row_bytes(qm.Q4_0, 5376)
            weights = [random_blocks(qm.Q4_0, (21504,), 5376) for _ in range(n_sets(21504 * rb, False))]
            mx.eval(weights)
            add([r for r in read_probe_rows("31B", "ffn_gate/up", 21504, 5376, weights, False) if "grid-stride" in r["impl"]], rows)
        return
    if args.probe_only:
        name, n, k = QUICK["tiny"]["proj"][0] if args.quick else ("ffn_gate/up", 21504, 5376)
        add(dense_case(model, name, qm.Q4_0, n, k, (1,), dtype, args.quick, on_gpu, with_qmm=False, mma=False,
                       read=True), rows)  # fmt: skip
        add(gate_up_case(model, n, k, (1, 8), dtype, args.quick, on_gpu), rows)
        return
    shapes = QUICK["tiny"]["proj"] if args.quick else [("ffn_gate/up", 21504, 5376), ("ffn_down", 5376, 21504),
                                                        ("attn_q(s)", 8192, 5376)]  # fmt: skip
    for name, n, k in [] if args.experts_only else shapes[:1] if args.sweep_only else shapes:
        add(dense_case(model, name, qm.Q4_0, n, k, (1, 8), dtype, args.quick, on_gpu, with_qmm=False,
                       mma=not args.sweep_only, read=True), rows)  # fmt: skip
    if not args.experts_only:
        name, n, k = shapes[0]
        add(gate_up_case(model, n, k, (1, 8), dtype, args.quick, on_gpu), rows)
    ex_model = "tiny" if args.quick else "26B-A4B"
    spec = QUICK["tiny"] if args.quick else MODELS["26B-A4B"]
    if not args.sweep_only:
        add(expert_case(ex_model, spec["experts"], spec["H"], dtype, args.quick, on_gpu, with_mlx=False), rows)
    if not on_gpu or custom_kernels.backend() != "cuda" or args.experts_only:
        return
    name, n, k = shapes[0]
    for geometry in STREAM_SWEEP:
        try:
            cfg = qm.StreamConfig(*geometry)
            got = dense_case(model, name, qm.Q4_0, n, k, (1, 8), dtype, args.quick, on_gpu, with_qmm=False, mma=False,
                             stream=cfg, fma=False, runs=False)  # fmt: skip
        except Exception as exc:  # noqa: BLE001  (a geometry the device rejects)
            got = [dict(model=model, name=name, M=1, config=list(geometry), error=str(exc)[:200])]
        add(got, sweep_rows)
    cfgs = [qm.StreamConfig(*c) for c in STREAM_SWEEP[1:5]]
    add([r for r in expert_case(ex_model, spec["experts"], spec["H"], dtype, args.quick, on_gpu, cfgs, False)
         if "stream" in r["impl"]], sweep_rows)  # fmt: skip


def hardware() -> dict:
    return hardware_info()


def _ratios(rows: list[dict]) -> list[dict]:
    """M=8 / M=1 time ratio per (model, tensor, impl)."""
    by_key = {(r["model"], r["name"], r["impl"], r["M"]): r for r in rows if "time_us" in r}
    return [dict(model=mo, name=na, impl=im, ratio_M8_M1=r["time_us"] / by_key[(mo, na, im, 1)]["time_us"])
            for (mo, na, im, m), r in by_key.items() if m == 8 and (mo, na, im, 1) in by_key]  # fmt: skip


def _print_row(r: dict) -> None:
    if "time_us" not in r:
        print(f"  {r.get('model')} {r.get('name')} M={r.get('M')} {r.get('config')}: {r.get('error')}", flush=True)
        return
    cfg = f" {r['config']}" if "config" in r else ""
    split = f" host {r['host_us']:.1f}/{r['total_us']:.1f} us" if "host_us" in r else ""
    serial = (f" serial {r['serial_us']:.1f} us {100 * r['frac_copy_serial']:.1f}%" if "frac_copy_serial" in r
              else "")  # fmt: skip
    print(f"{r['model']:8} {r['name'][:20]:20} {r['impl'][:26]:26} {r['N']:7d} {r['K']:6d} {r['M']:2d} "
          f"{r['time_us']:9.1f} {r['GBps']:7.0f} {100 * r['frac_copy']:5.1f}%{serial}{cfg}{split}", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, few repetitions (runs on CPU too)")
    ap.add_argument("--models", default="31B,26B-A4B,12B,E4B", help="comma-separated subset of " + ",".join(MODELS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--sweep", action="store_true", help="also time launch geometries on key shapes")
    ap.add_argument("--no-qmm", action="store_true", help="skip the mx.quantized_matmul comparison")
    ap.add_argument("--experts-only", action="store_true", help="with --focus: only the overhead probe and the "
                    "expert path (e.g. to rerun it under other MLX_* graph settings)")  # fmt: skip
    ap.add_argument("--sweep-only", action="store_true", help="with --focus: only the stream geometry sweep")
    ap.add_argument("--probe-only", action="store_true", help="with --focus: only the read probes on the 31B FFN "
                    "gate's bytes, the M = 1 kernels there (FMA, stream, the rows kernel's geometries; the rows "
                    "kernel on the Q8_0 head too) and the fused vs separate gate|up")  # fmt: skip
    ap.add_argument("--runs-m", action="store_true", help="with --focus: only the 31B FFN gate, down and attn_q(s), "
                    "E4B's FFN gate and down, and the 31B fused gate|up at M = 1, 2, 4, 8: the dispatch, the stream and runs kernels and the "
                    "runs16m geometries")  # fmt: skip
    ap.add_argument("--tiles", action="store_true", help="with --focus: only the dispatch against the tiles kernels "
                    "(custom_kernels.quant_tiles) on the dense one-token shapes they take")  # fmt: skip
    ap.add_argument("--focus", action="store_true", help="only the issue-4 targets (31B FFN, 26B-A4B experts), "
                    "the per-op overhead probe and a sweep of the CUDA stream kernels' geometry")  # fmt: skip
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/kernels-<backend>-<date>.json)")
    args = ap.parse_args()

    dtype = getattr(mx, args.dtype)
    on_gpu = not custom_kernels.use_reference()
    models = QUICK if args.quick else {m: MODELS[m] for m in args.models.split(",")}
    backend = custom_kernels.backend()
    date = datetime.datetime.now().strftime("%Y-%m-%d")
    out = args.out or os.path.join(ROOT, "bench", "results", f"kernels-{backend}-{date}{'-quick' if args.quick else ''}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    t0 = time.time()
    copy = copy_bandwidth(args.quick)
    rows: list[dict] = []
    sweep_rows: list[dict] = []
    overhead_rows: list[dict] = []

    def save(done: bool) -> None:  # after every model, so an interrupted run keeps its numbers
        doc = dict(
            bench="bench/kernels.py", date=datetime.datetime.now().isoformat(timespec="seconds"), args=vars(args),
            hardware=hardware(), versions=dict(mlx=mx.__version__, numpy=np.__version__, python=platform.python_version(),
                                               commit=commit(), sources=sources_digest()),
            copy_bandwidth=copy, results=rows, ratios=_ratios(rows), sweep=sweep_rows, overhead=overhead_rows,
            env={k: v for k, v in os.environ.items() if k.startswith("MLX_")}, complete=done,
            seconds=time.time() - t0,
        )  # fmt: skip
        with open(out, "w") as fh:
            json.dump(doc, fh, indent=1)

    def add(new: list[dict], into: list[dict]) -> None:
        for r in new:
            if "GBps" in r:
                r["frac_copy"] = r["GBps"] / copy["GBps"]
                if "serial_GBps" in r:
                    r["frac_copy_serial"] = r["serial_GBps"] / copy["GBps"]
            _print_row(r)
        into.extend(new)

    print(f"backend {backend}  kernels {'on' if on_gpu else 'off (references)'}  "
          f"copy bandwidth {copy['GBps']:.0f} GB/s (a + 1 on {copy['bytes'] // 2 >> 20} MiB)"
          + (f", read-only {copy['read_GBps']:.0f} GB/s" if "read_GBps" in copy else ""))  # fmt: skip
    print(f"{'model':8} {'tensor':20} {'impl':26} {'N':>7} {'K':>6} {'M':>2} {'us':>9} {'GB/s':>7} {'copy%':>6}")
    if args.focus:
        focus(args, dtype, on_gpu, add, rows, sweep_rows, overhead_rows)
        models = {}
    for model, spec in models.items():
        h = spec["H"]
        for name, n, k in spec["proj"]:
            add(dense_case(model, name, qm.Q4_0, n, k, (1, 8), dtype, args.quick, on_gpu, with_qmm=not args.no_qmm), rows)
        head_n = spec.get("head", VOCAB)
        for t in (qm.Q8_0, qm.Q6_K):
            add(dense_case(model, "head (tied)", t, head_n, h, (1, 8), dtype, args.quick, on_gpu,
                           with_qmm=not args.no_qmm), rows)  # fmt: skip
        if "experts" in spec:
            add(expert_case(model, spec["experts"], h, dtype, args.quick, on_gpu), rows)
        save(False)
        print(f"  ({model} done, {time.time() - t0:.0f} s)", flush=True)
    if args.sweep:
        for batch in sweep(dtype, args.quick, on_gpu):
            add(batch, sweep_rows)
            save(False)
    print(f"\n{'model':8} {'tensor':20} {'impl':26} M8/M1")
    for q in _ratios(rows):
        print(f"{q['model']:8} {q['name'][:20]:20} {q['impl'][:26]:26} {q['ratio_M8_M1']:.2f}")
    save(True)
    print(f"\nwrote {out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
