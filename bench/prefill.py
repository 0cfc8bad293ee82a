"""Prefill: time to the first token of gemma4_mlx and mlx-lm on random weights in real shapes, one process.

    python bench/prefill.py --model 26B-A4B --prompts 512 2048 --rounds 2 [--no-mlx-lm] [--out f.json]

Each library's own generate_step with max_tokens=2 and its default prefill chunk (2048), timed from
the call to the first yielded token, as a user of either library waits for it: the whole prompt
through the model into a fresh cache, the last position's logits and greedy pick, and what each
builds before that first yield (both queue the second token's step first: ours makes its
fixed-shape caches and traces its compiled step, mlx-lm builds one eager step). gemma4_mlx: bench/decode.py's model (Q4_0 projections and
experts, Q8_0 embedding / tied head); mlx-lm: its gemma4_text model in the same shapes quantized by
its own quantize_model (4-bit affine, group --mlxlm-group-size). Per prompt length, the engines in
turn, --rounds rounds after one warm-up each; the median round is reported with prompt tokens/s
and ours / mlx-lm. Random prompt ids; no chat template. JSON to --out (default bench/results/).
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
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode  # noqa: E402  (bench/decode.py)
from hardware import commit, hardware_info, sources_digest, write_result  # noqa: E402
from step_settings import model_config  # noqa: E402

from gemma4_mlx.generate import generate_step  # noqa: E402


def time_to_first_token(step_fn, prompt) -> float:
    """Seconds from the call to the first token step_fn(prompt) yields (evaluated)."""
    t0 = time.perf_counter()
    steps = step_fn(prompt)
    token, _ = next(steps)
    int(token.item() if isinstance(token, mx.array) else token)
    seconds = time.perf_counter() - t0
    steps.close()
    mx.synchronize()  # the queued second step ends before the next timing starts
    return seconds


def engines(cfg, with_mlx_lm: bool, group_size: int) -> dict:
    """name -> function(prompt ids list) -> that library's generate_step generator (two tokens)."""
    ours = decode.build_ours(cfg)
    out = {decode.OURS: lambda ids: generate_step(ids, ours, max_tokens=2)}
    if with_mlx_lm:
        from mlx_lm.generate import generate_step as lm_generate_step

        lm = decode.build_mlx_lm(cfg, group_size)
        out[decode.MLX_LM] = lambda ids: lm_generate_step(mx.array(ids), lm, max_tokens=2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="26B-A4B")
    ap.add_argument("--layers", type=int, default=None, help="only the model's first N layers (last must be full)")
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-mlx-lm", action="store_true")
    ap.add_argument("--mlxlm-group-size", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = model_config(args.model, args.layers)
    with_lm = not args.no_mlx_lm and decode.mlx_lm_available()
    runs = engines(cfg, with_lm, args.mlxlm_group_size)
    rng = np.random.default_rng(0)
    rows = []
    for n in args.prompts:
        prompt = rng.integers(10, cfg.vocab_size, size=n).tolist()
        times = {name: [] for name in runs}
        for name, fn in runs.items():
            time_to_first_token(fn, prompt)  # warm-up: kernels built, allocator primed
        for r in range(args.rounds):
            for name in list(runs)[r % len(runs):] + list(runs)[: r % len(runs)]:
                times[name].append(time_to_first_token(runs[name], prompt))
        row = dict(model=args.model, prompt=n)
        for name, ts in times.items():
            s = statistics.median(ts)
            row[name] = dict(seconds=s, tok_s=n / s, rounds=ts)
        if decode.MLX_LM in row:
            row["ours_over_mlx_lm"] = row[decode.OURS]["tok_s"] / row[decode.MLX_LM]["tok_s"]
        rows.append(row)
        print(f"{args.model} prompt {n}: " + ", ".join(f"{k} {row[k]['seconds']:.3f} s ({row[k]['tok_s']:.0f} tok/s)"
                                                     for k in runs)
              + (f", {row['ours_over_mlx_lm']:.2f}x mlx-lm" if "ours_over_mlx_lm" in row else ""), flush=True)
    doc = dict(bench="prefill", date=datetime.datetime.now().isoformat(timespec="seconds"), model=args.model,
               layers=args.layers or cfg.num_hidden_layers, rounds=args.rounds, mlx_lm=with_lm, commit=commit(),
               sources=sources_digest(), hardware=hardware_info(), versions=dict(mlx=mx.__version__), rows=rows)
    write_result(doc, f"prefill-{args.model}", args.out)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
