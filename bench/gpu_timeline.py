"""GPU timeline of steady decode steps, read from a CUDA profiler trace (torch.profiler over CUPTI).

Answers what bench/decode.py's totals cannot: per token, how long the GPU is busy and idle, which
kernels take the busy time (ours by family, MLX's own, cuBLAS), how many launches there are, and
how the idle time splits into launch gaps (< 5 us between kernels) and longer waits for the host.
torch is only the profiler here: CUPTI records every kernel of the process, MLX's included (MLX's
CUDA wheel and torch use the same nvidia-* runtime packages). The model is bench/decode.py's
(random weights in real shapes), optionally cut to its first N layers (bench/step_settings.py).

    python bench/gpu_timeline.py [--model 31B] [--layers 12] [--context 4096] [--steps 8] [--mlx-lm]
        [--variant NAME="GEMMA4_MLX_ATTENTION_GEOMETRY=min_chunk=64 GEMMA4_MLX_MATVEC_GEOMETRY=..."]

Each --variant runs our model again (weights built once) with those environment variables set
while its decode step is traced: the launch-geometry overrides of custom_kernels take effect there.
"""

from __future__ import annotations

import gemma4_mlx  # noqa: F401,I001  first: the BLAS preload must come before mlx.core is imported

import argparse
import collections
import datetime
import json
import os
import re
import sys
import tempfile
import time

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode  # noqa: E402  (bench/decode.py)
from hardware import commit, environment, hardware_info, parse_variant, sources_digest, write_result  # noqa: E402,F401
from step_settings import model_config  # noqa: E402

# first match wins; names are CUPTI's kernel names (ours start with g4_, see custom_kernels)
CATEGORIES = (
    ("attention (ours)", r"g4_attn"),
    ("sampling (ours)", r"g4_sample"),
    ("matvec (ours)", r"g4_"),
    ("gemm/gemv (cuBLAS)", r"gemm|gemv|cublas|xmma|cutlass|sm90_|splitk"),
    ("sdpa (MLX)", r"sdpa|attention"),
    ("norm (MLX)", r"rms_?norm|layer_?norm"),
    ("rope (MLX)", r"rope"),
    ("quantized matmul (MLX)", r"qmm|qmv|quantized|affine"),
    ("copy / slice update (MLX)", r"copy|slice|scatter|gather|memcpy|memset|concat"),
    ("reduce / sort (MLX)", r"reduce|arg_?|sort|scan|logsumexp|softmax"),
)
LAUNCH_GAP_US = 5.0
KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def category(name: str) -> str:
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "other (MLX fused / elementwise)"


def kernels_of_trace(trace: dict) -> list[tuple[str, float, float]]:
    """(name, start_us, duration_us) of every device activity in a Chrome trace, by start time."""
    out = [(e["name"], float(e["ts"]), float(e.get("dur", 0.0))) for e in trace.get("traceEvents", [])
           if e.get("ph") == "X" and e.get("cat") in KERNEL_CATS]
    return sorted(out, key=lambda k: k[1])


def summarize(kernels: list[tuple[str, float, float]], steps: int, top: int = 25) -> dict:
    """Per-step GPU time of a profiled window of `steps` decode steps.

    window: first kernel start to last kernel end; busy: union of kernel intervals (overlapping
    kernels count once); idle = window - busy, split into launch gaps (< LAUNCH_GAP_US) and waits."""
    if not kernels or steps < 1:
        raise ValueError("no kernels in the trace (was the profiler attached to the GPU work?)")
    start, end = kernels[0][1], max(ts + d for _, ts, d in kernels)
    busy, cur_s, cur_e = 0.0, kernels[0][1], kernels[0][1] + kernels[0][2]
    small_gap = big_gap = 0.0
    n_small = n_big = 0
    for _, ts, d in kernels[1:]:
        if ts > cur_e:
            busy += cur_e - cur_s
            gap = ts - cur_e
            if gap < LAUNCH_GAP_US:
                small_gap, n_small = small_gap + gap, n_small + 1
            else:
                big_gap, n_big = big_gap + gap, n_big + 1
            cur_s, cur_e = ts, ts + d
        else:
            cur_e = max(cur_e, ts + d)
    busy += cur_e - cur_s
    by_cat, by_name = collections.defaultdict(lambda: [0.0, 0]), collections.defaultdict(lambda: [0.0, 0])
    for name, _, d in kernels:
        for table, key in ((by_cat, category(name)), (by_name, name)):
            table[key][0] += d
            table[key][1] += 1

    def per_step(table: dict, limit: int | None = None) -> list[dict]:
        rows = sorted(table.items(), key=lambda kv: -kv[1][0])[:limit]
        return [dict(name=k[:160], us=v[0] / steps, launches=v[1] / steps) for k, v in rows]

    window = end - start
    return dict(steps=steps, window_us=window / steps, busy_us=busy / steps, idle_us=(window - busy) / steps,
                launch_gap_us=small_gap / steps, launch_gaps=n_small / steps, wait_us=big_gap / steps,
                waits=n_big / steps, launches=len(kernels) / steps, kernel_us=sum(d for *_, d in kernels) / steps,
                categories=per_step(by_cat), top_kernels=per_step(by_name, top))


def one_step(kernels: list[tuple[str, float, float]], marker: str = r"g4_sample_merge|ArgMax") -> list[tuple[str, float]]:
    """(short name, duration us) of the kernels of the last whole step: after the second-to-last
    launch whose name matches `marker` (the sampler's last kernel, once per step) up to the last."""
    ends = [i for i, k in enumerate(kernels) if re.search(marker, k[0])]
    if len(ends) < 2:
        return []
    return [(short_name(n), round(d, 2)) for n, _, d in kernels[ends[-2] + 1:ends[-1] + 1]]


def stages(step: list[tuple[str, float]]) -> dict:
    """Issue 5's stage breakdown of one step's kernel sequence (one_step): `head` is the step's
    last weight matvec, `sampling` everything after it (softcap, log-softmax, selection),
    `projections` the other weight matvecs (ours), `attention` the attention kernels, `other ops`
    the rest (norms, RoPE, cache writes, residuals, position arithmetic); us and launches each.
    For mlx-lm, whose matvecs are MLX's qmv kernels and whose attention runs through generic
    kernels, that attention lands in `other ops`."""
    matvec = [i for i, (n, _) in enumerate(step) if n.startswith("g4_q") or n.startswith("qmv")]
    if not matvec:
        return {}
    head = matvec[-1]
    out = {k: dict(us=0.0, launches=0) for k in ("projections", "attention", "other ops", "head", "sampling")}
    for i, (name, us) in enumerate(step):
        if i == head:
            key = "head"
        elif i > head:
            key = "sampling"
        elif i in matvec:
            key = "projections"
        elif name.startswith("g4_attn") or "sdpa" in name:
            key = "attention"
        else:
            key = "other ops"
        out[key]["us"] += us
        out[key]["launches"] += 1
    return out


def short_name(name: str) -> str:
    """A kernel name without its argument list and namespace (ours: without the text digest)."""
    name = re.sub(r"^void ", "", name.split("(")[0]).replace("mlx::core::cu::", "")
    return re.sub(r"custom_kernel_(g4_[a-z0-9_]+?)_[0-9a-f]{16}", r"\1", name)[:90]


def kernel_time_per_call(calls: list, reps: int = 4) -> dict:
    """GPU time per call of zero-argument callables (each launching one op's kernels), from a CUPTI
    trace: the sum of kernel durations / calls, launches per call, and the time per call of each
    kernel (by short name). Each call is evaluated on
    its own: independent ops evaluated together become parallel branches of one CUDA graph, and
    overlapping kernels stretch each other's durations (and flatter a wall-clock rate), whereas a
    decode step runs its kernels one after another. MLX's host cost per op cannot hide in it."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    mx.eval([c() for c in calls])
    mx.synchronize()
    n = 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for c in calls:
                mx.eval(c())
                n += 1
        mx.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            kernels = kernels_of_trace(json.load(fh))
    by_kernel: dict[str, float] = {}
    for name, _, d in kernels:
        key = short_name(name).split("<")[0]
        key = re.sub(r"^(g4_[a-z0-9_]+?)_(bfloat16|float|half|u?int|[0-9]).*", r"\1", key)
        by_kernel[key] = by_kernel.get(key, 0.0) + d / n
    return dict(gpu_us=sum(d for *_, d in kernels) / n, launches=len(kernels) / n, by_kernel=by_kernel)


def profile_steps(step, first, steps: int, trace_path: str) -> dict:
    """Profile `steps` pipelined decode steps (after the caller's warm-up) and summarize the trace."""
    import torch  # noqa: PLC0415  (the profiler only; present on the GPU machine's image)
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    mx.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timing = decode.time_tokens(step, first, 0, steps)
        mx.synchronize()
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as fh:
        trace = json.load(fh)
    kernels = kernels_of_trace(trace)
    out = summarize(kernels, steps + 1)  # time_tokens evaluates steps + 1 outputs
    out["one_step"] = one_step(kernels)
    out["stages"] = stages(out["one_step"])
    out["timing_under_profiler"] = timing
    out["torch"] = torch.__version__
    return out


def print_summary(label: str, s: dict) -> None:
    print(f"== {label}: per token {s['window_us'] / 1e3:.2f} ms on the GPU timeline, busy {s['busy_us'] / 1e3:.2f} ms "
          f"({100 * s['busy_us'] / s['window_us']:.0f}%), launch gaps {s['launch_gap_us'] / 1e3:.2f} ms "
          f"({s['launch_gaps']:.0f}), waits {s['wait_us'] / 1e3:.2f} ms ({s['waits']:.0f}), "
          f"{s['launches']:.0f} launches", flush=True)
    for row in s["categories"]:
        print(f"   {row['us']:9.1f} us  {row['launches']:6.1f} x  {row['name']}")
    if s.get("stages"):
        print("   stages of one step: " + ", ".join(f"{k} {v['us']:.0f} us ({v['launches']})"
                                                  for k, v in s["stages"].items()))
    print("   top kernels:")
    for row in s["top_kernels"][:15]:
        print(f"   {row['us']:9.1f} us  {row['launches']:6.1f} x  {row['name'][:110]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="31B")
    ap.add_argument("--layers", type=int, default=None, help="only the model's first N layers (last must be full)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8, help="profiled tokens")
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--mlx-lm", action="store_true", help="profile mlx-lm's model on the same shapes too")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ENV",
                    help="also run ours with these space-separated VAR=VALUE settings (repeatable)")
    ap.add_argument("--trace-dir", default=None, help="keep the Chrome traces here")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    variants = [("", {})] + [parse_variant(v) for v in args.variant]
    cfg = model_config(args.model, args.layers)
    doc = dict(bench="gpu_timeline", date=datetime.datetime.now().isoformat(timespec="seconds"),
               model=args.model, layers=args.layers or cfg.num_hidden_layers, context=args.context,
               steps=args.steps, commit=commit(), sources=sources_digest(), hardware=hardware_info(),
               versions=dict(mlx=mx.__version__), engines={})
    ours = decode.OursEngine(cfg)
    runs = [(ours, name, env) for name, env in variants]
    runs += [(decode.MlxLmEngine(cfg, 64), "", {})] if args.mlx_lm else []
    trace_dir = args.trace_dir or tempfile.mkdtemp()
    first = mx.array([5], mx.int32)
    for e, name, env in runs:
        label = f"{e.name}:{name}" if name else e.name
        with environment(env):
            run_engine(e, label, env, args, doc, first, trace_dir)
    write_result(doc, f"gpu_timeline-{args.model}", args.out)
    return 0


def run_engine(e, label: str, env: dict, args, doc: dict, first: mx.array, trace_dir: str) -> None:
    """Time, then profile, one engine's decode step (its environment already set) into doc."""
    try:
        t0 = time.time()
        e.start(args.context, 2 * (args.warmup + args.steps) + 8)
        step = e.full_step()
        res = dict(env=env, plain=decode.time_tokens(step, first, args.warmup, args.steps),
                   start_s=time.time() - t0)  # fmt: skip
        doc["engines"][label] = res
        print(f"{label}: {res['plain']['tok_s']:.1f} tok/s, {res['plain']['ms_per_token']:.2f} ms/token, host "
              f"{res['plain'].get('host_ms', 0):.2f} ms (unprofiled)", flush=True)
        try:
            res.update(profile_steps(step, first, args.steps, os.path.join(trace_dir, f"trace-{label.replace(':', '-')}.json")))
            print_summary(label, res)
        except (ImportError, ValueError, RuntimeError, AssertionError) as exc:
            res["profile_error"] = f"{type(exc).__name__}: {exc}"[:400]
            print(f"{label}: no profile: {res['profile_error']}", flush=True)
    except ValueError as exc:  # a variant's geometry the kernels reject
        doc["engines"][label] = dict(env=env, error=str(exc)[:400])
        print(f"{label}: failed: {exc}", flush=True)
    finally:
        e.stop()


if __name__ == "__main__":
    sys.exit(main())
