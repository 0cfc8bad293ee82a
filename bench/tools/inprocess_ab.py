"""Decode rates of several kernel settings in one process, alternated round by round (GPU).

Separate processes move 5-15% between runs on the lent H200 (bench/NOTES.md), more than most
single changes gain; here the model's weights are built once and every setting gets its own
compiled decoder over its own caches, traced with that setting's environment, so the rounds compare
settings on the same weights, allocator and clocks:

    python bench/tools/inprocess_ab.py --model 26B-A4B --context 4096 --rounds 4 --steps 128 \
        default= nm="GEMMA4_MLX_UNPROVEN_KERNELS=norm_moe,router_proj" [--steady nm --steady-seconds 8]

SETTING = label=[VAR=VALUE ...] (space-separated). A setting's variables are set only while its
decoder is traced, so they must be ones the step reads then (kernel families, geometries,
GEMMA4_MLX_KERNEL_TEXT); what is read when the model is built or by MLX at start-up (MLX_*) does not
vary between settings: compare those in separate processes (bench/tools/ab_decode.sh).
Each round runs every setting once (pipelined
greedy decode like bench/decode.py: warm-up, then --steps timed tokens); the order rotates by one
setting per round. --steady NAME then decodes with that setting for --steady-seconds inside
`steady_decode`, a frame a sampling profiler (py-spy --native) can select on. JSON to --out.
"""

from __future__ import annotations

import gemma4_mlx  # noqa: F401,I001  first: the BLAS preload must come before mlx.core is imported

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import decode  # noqa: E402  (bench/decode.py)
from hardware import commit, environment, hardware_info, parse_variant, sources_digest, write_result  # noqa: E402
from step_settings import model_config  # noqa: E402


def steady_decode(step, first: mx.array, seconds: float) -> int:
    """Pipelined decode for `seconds`; the number of tokens. A profiler selects on this frame."""
    out, n, end = step(first), 0, time.perf_counter() + seconds
    mx.async_eval(out)
    while time.perf_counter() < end:
        nxt = step(out)
        mx.async_eval(nxt)
        mx.eval(out)
        out, n = nxt, n + 1
    mx.eval(out)
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("settings", nargs="+", metavar="label=[VAR=VALUE ...]")
    ap.add_argument("--model", default="26B-A4B")
    ap.add_argument("--layers", type=int, default=None, help="only the model's first N layers (last must be full)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=128, help="timed tokens per setting per round")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steady", default=None, help="label of a setting to decode with afterwards, for a profiler")
    ap.add_argument("--steady-seconds", type=float, default=8.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    settings = [parse_variant(s, allow_empty=True) for s in args.settings]
    labels = [label for label, _ in settings]
    if len(set(labels)) != len(labels):
        raise SystemExit("setting labels must differ")
    if args.steady is not None and args.steady not in labels:
        raise SystemExit(f"--steady {args.steady!r} is not one of {labels}")
    cfg = model_config(args.model, args.layers)
    engine = decode.OursEngine(cfg)
    tokens = args.rounds * (args.warmup + args.steps + 1) + 16
    extra = tokens + (int(args.steady_seconds * 2000) if args.steady else 0)
    first = mx.array([5], mx.int32)
    steps = {}
    for label, env in settings:  # each decoder is traced (and its kernels built) under its own setting
        with environment(env):
            t0 = time.time()
            engine.start(args.context, extra)
            steps[label] = engine.full_step()
            decode.time_tokens(steps[label], first, 1, 2)
            print(f"{label}: ready in {time.time() - t0:.1f} s", flush=True)
    engine.stop()  # each step keeps its own decoder
    rows = {label: [] for label in labels}
    for r in range(args.rounds):
        order = labels[r % len(labels):] + labels[: r % len(labels)]
        for label in order:
            res = decode.time_tokens(steps[label], first, args.warmup, args.steps)
            rows[label].append(res)
            print(f"round {r + 1} {label}: {res['tok_s']:.1f} tok/s, host {res.get('host_ms', 0):.3f} ms", flush=True)
    summary = {label: dict(median_tok_s=statistics.median(x["tok_s"] for x in rows[label]),
                           median_host_ms=statistics.median(x.get("host_ms", 0.0) for x in rows[label]))
               for label in labels}  # fmt: skip
    for label in labels:
        s = summary[label]
        print(f"{label}: median {s['median_tok_s']:.1f} tok/s, host {s['median_host_ms']:.3f} ms", flush=True)
    doc = dict(bench="inprocess_ab", date=datetime.datetime.now().isoformat(timespec="seconds"), model=args.model,
               layers=args.layers or cfg.num_hidden_layers, context=args.context, rounds=args.rounds, steps=args.steps,
               settings=dict(settings), commit=commit(), sources=sources_digest(), hardware=hardware_info(),
               versions=dict(mlx=mx.__version__), rows=rows, summary=summary)  # fmt: skip
    if args.steady:
        n = steady_decode(steps[args.steady], first, args.steady_seconds)
        doc["steady"] = dict(label=args.steady, seconds=args.steady_seconds, tokens=n)
        print(f"steady {args.steady}: {n} tokens in {args.steady_seconds} s", flush=True)
    write_result(doc, f"inprocess_ab-{args.model}", args.out)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
