"""Does mx.fast.cuda_kernel's `shared_memory` argument reach the launch, above 48 KB too? (CUDA)

The staged runs kernels would take 8 warps x 2 slots (74 KB) for the dense projections if the
kernel could have more than the 48 KB of static shared memory (bench/NOTES.md, session 14). Each
size runs in its own process, since a launch that touches shared memory it was not given can
leave the CUDA context unusable:

    python3 bench/tools/dynamic_smem_probe.py            # every size, one subprocess each
    python3 bench/tools/dynamic_smem_probe.py 98304      # one size, in this process

The kernel fills `extern __shared__` words 0..n-1 from x, and after a barrier every thread writes
out[i] = shared[n - 1 - i] * 3 + 1, so an output that checks out means all n words were there.
"""

from __future__ import annotations

import gemma4_mlx  # noqa: F401,I001  first: the BLAS preload must come before mlx.core is imported

import subprocess
import sys

import mlx.core as mx
import numpy as np

SIZES = (16384, 49152, 65536, 98304, 163840, 227328)  # bytes; the H200 allows up to 227 KB per block

_SOURCE = """
  extern __shared__ uint32_t words[];
  const int n = x_shape[0];
  for (int i = threadIdx.x; i < n; i += blockDim.x) words[i] = x[i];
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = words[n - 1 - i] * 3u + 1u;
"""


def probe(nbytes: int) -> bool:
    """True when a one-block kernel given `nbytes` of dynamic shared memory used all of it."""
    n = nbytes // 4
    kernel = mx.fast.cuda_kernel(name=f"g4_probe_dyn_smem_{nbytes}", input_names=["x"], output_names=["out"],
                                 source=_SOURCE, shared_memory=nbytes)  # fmt: skip
    x = np.random.default_rng(0).integers(0, 2**31, n, dtype=np.uint32)
    (out,) = kernel(inputs=[mx.array(x)], grid=(256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(n,)],
                    output_dtypes=[mx.uint32])  # fmt: skip
    return bool(np.array_equal(np.array(out), x[::-1] * np.uint32(3) + np.uint32(1)))


def main(argv: list[str]) -> int:
    if not (getattr(mx, "cuda", None) and mx.cuda.is_available()):
        print("dynamic_smem_probe: needs MLX's CUDA backend")
        return 2
    if argv:
        ok = probe(int(argv[0]))
        print(f"{int(argv[0])} bytes: {'ok' if ok else 'WRONG OUTPUT'}")
        return 0 if ok else 1
    for nbytes in SIZES:
        run = subprocess.run([sys.executable, __file__, str(nbytes)], capture_output=True, text=True, timeout=120)
        last = (run.stdout.strip().splitlines() or run.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"{nbytes:7d} bytes: rc {run.returncode}: {last[:160]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
