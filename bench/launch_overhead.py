"""Cost of one kernel launch in MLX on this device: chains of N dependent small ops evaluated at once.

Decode of a 60-layer model runs ~25 kernels per layer; if each costs more host time than its GPU work,
the step is launch-bound whatever the kernels' bandwidth. Per op kind (rms_norm, a 64x64 matmul, a
trivial custom kernel, a 1-element slice update), eager and inside mx.compile, N dependent calls on
tiny inputs are evaluated in one `mx.eval`; time per op = wall time / N (median of 5).

    python bench/launch_overhead.py [--n 2000] [--out bench/results/launch-<backend>-<date>.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hardware import hardware_info  # noqa: E402

import custom_kernels  # noqa: E402

_COPY_SOURCE = "unsigned int i = threadIdx.x + blockIdx.x * blockDim.x; out[i] = inp[i] + 1.0f;"
_COPY_METAL = "uint i = thread_position_in_grid.x; out[i] = inp[i] + 1.0f;"


def _custom_add_one():
    """A kernel that adds 1 to a float32 vector of 256 (one threadgroup): the cheapest custom launch."""
    if custom_kernels.backend() == "cuda":
        k = mx.fast.cuda_kernel(name="launch_probe", input_names=["inp"], output_names=["out"],
                                source=_COPY_SOURCE)
    elif custom_kernels.backend() == "metal":
        k = mx.fast.metal_kernel(name="launch_probe", input_names=["inp"], output_names=["out"],
                                 source=_COPY_METAL)
    else:
        return None

    def add_one(x):
        return k(inputs=[x], output_shapes=[x.shape], output_dtypes=[x.dtype],
                 grid=(x.size, 1, 1), threadgroup=(x.size, 1, 1))[0]
    return add_one


def _chains(n: int) -> dict:
    w = mx.ones((256,), mx.bfloat16)
    m = mx.random.normal((64, 64)).astype(mx.bfloat16) * 0.1
    chains = {
        "rms_norm": (lambda x: mx.fast.rms_norm(x, w, 1e-6), mx.ones((1, 256), mx.bfloat16)),
        "matmul_64": (lambda x: x @ m, mx.ones((1, 64), mx.bfloat16)),
        "slice_update": (lambda x: mx.slice_update(x, x[:, :1] + 1, mx.array([0]), axes=(1,)),
                         mx.ones((1, 256), mx.float32)),
    }
    add_one = _custom_add_one()
    if add_one is not None:
        chains["custom_kernel"] = (add_one, mx.ones((256,), mx.float32))

    out = {}
    for name, (op, x0) in chains.items():
        def run(x, op=op):
            for _ in range(n):
                x = op(x)
            return x
        for mode, fn in (("eager", run), ("compiled", mx.compile(run))):
            mx.eval(fn(x0))  # warm-up / trace
            times = []
            for _ in range(5):
                mx.synchronize()
                t = time.perf_counter()
                mx.eval(fn(x0))
                mx.synchronize()
                times.append(time.perf_counter() - t)
            out[f"{name}/{mode}"] = statistics.median(times) / n * 1e6
            print(f"{name:14s} {mode:9s} {out[f'{name}/{mode}']:7.2f} us per op", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="ops per chain")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    per_op = _chains(args.n)
    date = datetime.datetime.now().strftime("%Y-%m-%d")
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"launch-{custom_kernels.backend()}-{date}.json")
    doc = dict(bench="launch_overhead", date=date, n=args.n, hardware=hardware_info(),
               versions=dict(mlx=mx.__version__), us_per_op=per_op)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
