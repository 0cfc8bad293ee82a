"""CPU matmul measurements behind gemma4_mlx.blas (issue: CPU backend speed).

Each BLAS configuration runs in its own child process, because the BLAS has to be loaded before
mlx.core is first imported: 'reference' (GEMMA4_MLX_BLAS=off, MLX's bundled netlib BLAS),
'openblas' (system OpenBLAS) and 'mkl' (the mkl PyPI package), whichever are installed.

Measured, on nn.Linear-shaped weights W [N, K] applied as x [M, K] @ W.T:
  * f32 GEMM (M = 512) and matvec (M = 1) through each BLAS (plus the issue's K x N layout);
  * bf16 and fp16 matmuls (MLX's own kernels, no BLAS), in the reference child only;
  * mx.quantized_matmul, 4- and 8-bit affine group 32 (the lossless Q4_0/Q8_0 mapping), with
    f32 / bf16 activations and scales, at M = 1, 2, 4, 8, 16 and 512 (no BLAS: reference child);
  * dequantize-to-f32 (mx.dequantize, and an unpack written in MLX ops) + f32 BLAS GEMM, at the
    same M, in every child with a fast BLAS.
Shapes: mlp_up 6144x1536, mlp_down 1536x6144, head 32768x1536 (the 0.43B fixture's vocab).

    python bench/cpu_matmul.py            # ~4 min on 2 idle cores; writes bench/results/cpu_matmul-<date>.json
    python bench/cpu_matmul.py --quick    # smaller set, ~1 min

Prints a markdown summary (the section appended to bench/NOTES.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"mlp_up": (6144, 1536), "mlp_down": (1536, 6144), "head": (32768, 1536)}
SMALL_M = (1, 2, 4, 8, 16)
PREFILL_M = 512
# cases that take seconds per call (reference-BLAS f32, bf16/fp16 and quantized_matmul at M=512)
# run on this shape only: their cost is linear in N*K, so the others add time, not information
SLOW_PREFILL_CASE = "mlp_up"


# --------------------------------------------------------------------------------------------
# child side


def _timer(fn, budget_s: float, max_reps: int) -> tuple[float, float, int]:
    """(median s, min s, reps) of mx.eval(fn()) after one warm-up call; a call slower than
    budget_s is timed twice, the warm-up counting as one sample."""
    import mlx.core as mx

    t = time.perf_counter()
    mx.eval(fn())
    warm = time.perf_counter() - t
    times: list[float] = [warm] if warm > budget_s else []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
        if times[-1] > budget_s:  # slow case: one timed run is enough
            break
    return statistics.median(times), min(times), len(times)


def _record(results, fn, *, case, shape, m, impl, dtype, weight_bytes, budget_s=1.5, max_reps=30):
    med, best, reps = _timer(fn, budget_s, max_reps)
    n, k = shape
    row = {"case": case, "N": n, "K": k, "M": m, "impl": impl, "dtype": dtype,
           "median_ms": round(med * 1e3, 3), "min_ms": round(best * 1e3, 3), "reps": reps,
           "gflops": round(2.0 * m * n * k / med / 1e9, 3),
           "weight_gbps": round(weight_bytes / med / 1e9, 3)}
    results.append(row)
    print(json.dumps(row), file=sys.stderr, flush=True)


def _unpack_dequantize(wq, scales, biases, bits: int):
    """MLX-op dequantize of an affine group-32 weight: wq uint32 [N, K*bits/32] -> f32 [N, K]."""
    import mlx.core as mx

    n = wq.shape[0]
    k = wq.shape[1] * 32 // bits
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    q = (wq[..., None] >> shifts) & ((1 << bits) - 1)
    q = q.reshape(n, k // 32, 32).astype(mx.float32)
    return (q * scales[..., None] + biases[..., None]).reshape(n, k)


def worker(spec: dict) -> dict:
    """Run the cases of one BLAS configuration; returns {'blas': active(), 'results': [...]}."""
    sys.path.insert(0, ROOT)
    import gemma4_mlx  # noqa: F401  (preloads the BLAS named by GEMMA4_MLX_BLAS)
    from gemma4_mlx import blas

    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    info = blas.active()
    results: list[dict] = []
    shapes = {k: SHAPES[k] for k in spec["shapes"]}
    fast = info["fast"]
    for case, (n, k) in shapes.items():
        w32 = mx.random.normal((n, k), key=mx.random.key(1)) * 0.02
        x1 = mx.random.normal((PREFILL_M, k), key=mx.random.key(2))
        mx.eval(w32, x1)
        f32_bytes = n * k * 4
        for m in (1, PREFILL_M):
            if m == PREFILL_M and not fast and case != SLOW_PREFILL_CASE:
                continue
            x = x1[:m]
            mx.eval(x)
            _record(results, lambda: x @ w32.T, case=case, shape=(n, k), m=m, impl="blas x@W.T",
                    dtype="float32", weight_bytes=f32_bytes)
        if case == "mlp_up":  # the layout: weight stored K x N
            w_kn = mx.array(w32.T)
            mx.eval(w_kn)
            for m in (1, PREFILL_M):
                if m == PREFILL_M and not fast:
                    continue
                x = x1[:m]
                _record(results, lambda: x @ w_kn, case=case, shape=(n, k), m=m,
                        impl="blas x@W(KxN)", dtype="float32", weight_bytes=f32_bytes)
            del w_kn
        if spec["no_blas_cases"]:
            for dt_name, dt in (("bfloat16", mx.bfloat16), ("float16", mx.float16)):
                wd, xd = w32.astype(dt), x1.astype(dt)
                mx.eval(wd, xd)
                for m in (1, PREFILL_M):
                    if m == PREFILL_M and case != SLOW_PREFILL_CASE:
                        continue
                    x = xd[:m]
                    _record(results, lambda: x @ wd.T, case=case, shape=(n, k), m=m,
                            impl="mlx x@W.T", dtype=dt_name, weight_bytes=n * k * 2)
                del wd, xd
        for bits in (4, 8):
            wq, s16, b16 = mx.quantize(w32, group_size=32, bits=bits)
            s32, b32 = s16.astype(mx.float32), b16.astype(mx.float32)
            mx.eval(wq, s32, b32)
            q_bytes = wq.nbytes + s16.nbytes + b16.nbytes  # packed weight, fp16 scales/biases
            if spec["no_blas_cases"]:
                for m in SMALL_M + (PREFILL_M,):
                    if m == PREFILL_M and (not spec["qmm_prefill"] or case != SLOW_PREFILL_CASE):
                        continue
                    x = x1[:m]
                    _record(results, lambda: mx.quantized_matmul(x, wq, s32, b32, transpose=True,
                                                                 group_size=32, bits=bits),
                            case=case, shape=(n, k), m=m, impl=f"quantized_matmul q{bits}",
                            dtype="float32", weight_bytes=q_bytes, max_reps=10)
                sb, bb, xb = s32.astype(mx.bfloat16), b32.astype(mx.bfloat16), x1[:1].astype(mx.bfloat16)
                s16c, b16c = s32.astype(mx.float16), b32.astype(mx.float16)
                mx.eval(sb, bb, xb, s16c, b16c)
                _record(results, lambda: mx.quantized_matmul(xb, wq, sb, bb, transpose=True,
                                                             group_size=32, bits=bits),
                        case=case, shape=(n, k), m=1, impl=f"quantized_matmul q{bits}",
                        dtype="bfloat16", weight_bytes=q_bytes, max_reps=10)
                x = x1[:1]
                _record(results, lambda: mx.quantized_matmul(x, wq, s16c, b16c, transpose=True,
                                                             group_size=32, bits=bits),
                        case=case, shape=(n, k), m=1, impl=f"quantized_matmul q{bits} fp16-scales",
                        dtype="float32", weight_bytes=q_bytes, max_reps=10)
            _record(results, lambda: mx.dequantize(wq, s32, b32, group_size=32, bits=bits),
                    case=case, shape=(n, k), m=0, impl=f"mx.dequantize q{bits} only",
                    dtype="float32", weight_bytes=q_bytes)
            unpack = mx.compile(lambda a, b, c: _unpack_dequantize(a, b, c, bits))
            _record(results, lambda: unpack(wq, s32, b32), case=case, shape=(n, k), m=0,
                    impl=f"unpack-ops q{bits} only", dtype="float32", weight_bytes=q_bytes)
            if fast:
                for m in SMALL_M + (PREFILL_M,):
                    x = x1[:m]
                    _record(results, lambda: x @ mx.dequantize(wq, s32, b32, group_size=32,
                                                                bits=bits).T,
                            case=case, shape=(n, k), m=m, impl=f"mx.dequantize+blas q{bits}",
                            dtype="float32", weight_bytes=q_bytes)
                    _record(results, lambda: x @ unpack(wq, s32, b32).T, case=case, shape=(n, k),
                            m=m, impl=f"unpack-ops+blas q{bits}", dtype="float32",
                            weight_bytes=q_bytes)
            del wq, s16, b16, s32, b32
    return {"blas": info, "results": results}


# --------------------------------------------------------------------------------------------
# parent side


def _configs() -> dict[str, str]:
    """{'reference': 'off', 'openblas': path, 'mkl': path} for what is installed."""
    os.environ["GEMMA4_MLX_BLAS"] = "off"  # the parent only looks libraries up
    sys.path.insert(0, ROOT)
    from gemma4_mlx import blas

    found = {"reference": "off"}
    for name, path in (("openblas", blas._find_openblas()), ("mkl", blas._find_mkl())):
        if path:
            found[name] = path
    return found


def _machine() -> dict:
    import importlib.metadata as md

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "loadavg_at_start": list(os.getloadavg()),
            "python": platform.python_version(),
            "mlx": md.version("mlx"), "numpy": md.version("numpy"),
            "env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                                    "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                                    "MKL_NUM_THREADS") if os.environ.get(k)}}


def _find(rows, **want):
    for r in rows:
        if all(r.get(k) == v for k, v in want.items()):
            return r
    return None


def _cell(r: dict) -> str:
    """'median (min) ms, rate at min': GFLOP/s for M > 1, weight GB/s for M = 1."""
    best = r["min_ms"] / 1e3
    rate = (f"{2.0 * r['M'] * r['N'] * r['K'] / best / 1e9:.1f} GF/s" if r["M"] > 1
            else f"{r['weight_gbps'] * r['median_ms'] / r['min_ms']:.2f} GB/s")
    return f"{r['median_ms']:.1f} ({r['min_ms']:.1f}) ms, {rate}"


def summary(doc: dict) -> str:
    """Markdown section for bench/NOTES.md from a results document."""
    w = doc["workers"]
    m = doc["machine"]
    out = [f"## CPU matmul: BLAS, dtypes, quantized ({doc['date']}, bench/cpu_matmul.py)", "",
           f"{m['cpu']}, {m['cores']} cores, MLX {m['mlx']}; env {m['env'] or '{}'}; load average "
           f"{m['loadavg_at_start'][0]:.1f} at start, {m['loadavg_at_end'][0]:.1f} at end (a shared machine: "
           f"compare medians with min_ms in the JSON). "
           f"Weights W[N,K] applied as x[M,K] @ W.T; cells: median (min) ms, and GFLOP/s (M=512) or "
           f"weight GB/s (M=1) at the min. "
           f"JSON: bench/results/{doc['file']}", ""]
    blas_names = [b for b in ("reference", "openblas", "mkl") if b in w]
    out.append("| f32 through BLAS | " + " | ".join(blas_names) + " |")
    out.append("|---|" + "---|" * len(blas_names))
    for case in doc["shapes"]:
        for m_ in (PREFILL_M, 1):
            cells = []
            for b in blas_names:
                r = _find(w[b]["results"], case=case, M=m_, impl="blas x@W.T", dtype="float32")
                cells.append("—" if r is None else _cell(r))
            out.append(f"| {case} {SHAPES[case][0]}x{SHAPES[case][1]}, M={m_} | " + " | ".join(cells) + " |")
    ref = w["reference"]["results"]
    out += ["", "| no BLAS (MLX kernels) | M=1 | M=512 |", "|---|---|---|"]
    for case in doc["shapes"]:
        for impl, dt in (("mlx x@W.T", "bfloat16"), ("mlx x@W.T", "float16"),
                         ("quantized_matmul q4", "float32"), ("quantized_matmul q8", "float32"),
                         ("quantized_matmul q4", "bfloat16"), ("quantized_matmul q8", "bfloat16"),
                         ("quantized_matmul q4 fp16-scales", "float32"),
                         ("quantized_matmul q8 fp16-scales", "float32")):
            r1 = _find(ref, case=case, M=1, impl=impl, dtype=dt)
            r5 = _find(ref, case=case, M=PREFILL_M, impl=impl, dtype=dt)
            if r1 is None and r5 is None:
                continue
            c1 = "—" if r1 is None else _cell(r1)
            c5 = "—" if r5 is None else _cell(r5)
            out.append(f"| {case} {impl}, x {dt} | {c1} | {c5} |")
    for b in blas_names[1:]:
        rows = w[b]["results"]
        out += ["", f"Quantized with {b}: ms for M = {', '.join(map(str, SMALL_M + (PREFILL_M,)))}", "",
                "| case | " + " | ".join(f"M={x}" for x in SMALL_M + (PREFILL_M,)) + " |",
                "|---|" + "---|" * (len(SMALL_M) + 1)]
        for case in doc["shapes"]:
            for bits in (4, 8):
                for impl in (f"quantized_matmul q{bits}", f"mx.dequantize+blas q{bits}",
                             f"unpack-ops+blas q{bits}"):
                    src = ref if impl.startswith("quantized") else rows
                    cells = [_find(src, case=case, M=x, impl=impl, dtype="float32")
                             for x in SMALL_M + (PREFILL_M,)]
                    if all(c is None for c in cells):
                        continue
                    out.append(f"| {case} {impl} | " + " | ".join(
                        "—" if c is None else f"{c['median_ms']:.1f}" for c in cells) + " |")
        for case in doc["shapes"]:
            for bits in (4, 8):
                d1 = _find(rows, case=case, M=0, impl=f"mx.dequantize q{bits} only")
                d2 = _find(rows, case=case, M=0, impl=f"unpack-ops q{bits} only")
                if d1 and d2:
                    out.append(f"\n{case} q{bits} dequantize alone: mx.dequantize {d1['median_ms']:.1f} ms, "
                               f"unpack-ops {d2['median_ms']:.1f} ms")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="mlp_up only, no quantized_matmul at M=512")
    ap.add_argument("--out", help="JSON path (default bench/results/cpu_matmul-<date>.json)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    configs = _configs()
    shapes = ["mlp_up"] if args.quick else list(SHAPES)
    date = datetime.date.today().isoformat()
    out = args.out or os.path.join(ROOT, "bench", "results", f"cpu_matmul-{date}.json")
    doc = {"date": date, "file": os.path.basename(out), "machine": _machine(), "shapes": shapes,
           "workers": {}}
    for name, value in configs.items():
        spec = {"shapes": shapes, "no_blas_cases": name == "reference",
                "qmm_prefill": not args.quick}
        env = dict(os.environ, GEMMA4_MLX_BLAS=value)
        print(f"== {name} ({value})", file=sys.stderr, flush=True)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                               json.dumps(spec)], env=env, stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"worker {name} failed with exit code {proc.returncode}")
        doc["workers"][name] = json.loads(proc.stdout.strip().splitlines()[-1])
    doc["machine"]["loadavg_at_end"] = list(os.getloadavg())
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(summary(doc))


if __name__ == "__main__":
    main()
