"""generate_step's three decode paths, timed through the library API on random weights in a real shape.

    python bench/tools/generate_paths.py --model 26B-A4B --prompt 64 --tokens 128 --rounds 3

compiled: generate_step owns its cache and decodes through the compiled fixed-shape step (what
stream_generate, generate and the CLI do since session 34); prompt_cache: the caller's cache moves
into the compiled step and is handed back at the end (since session 34; before, a prompt_cache
meant eager steps); eager: compiled=False, every step built op by op, the cache updated in place
(what stream_generate did before session 34). Per round and path, in turn: wall time to the first
token (prefill), to the second (the compiled step's trace and buffer copies fall here), and the
decode rate over tokens 2..N as the consumer receives them. Greedy; the model is built once
(bench/decode.py's weights). JSON to --out.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import decode  # noqa: E402  (bench/decode.py)
from hardware import commit, hardware_info, sources_digest, write_result  # noqa: E402
from step_settings import model_config  # noqa: E402

from gemma4_mlx.cache import make_cache  # noqa: E402
from gemma4_mlx.cpu_matvec import decode_eagerly  # noqa: E402
from gemma4_mlx.generate import generate_step  # noqa: E402


def timed_generation(model, prompt: list[int], tokens: int, **options) -> dict:
    """Seconds to the first and second token, and tokens/s over tokens 2..N (options: generate_step's)."""
    t0 = time.perf_counter()
    stamps = []
    for _ in generate_step(prompt, model, max_tokens=tokens, **options):
        stamps.append(time.perf_counter())
    return dict(first_s=stamps[0] - t0, second_s=stamps[1] - t0,
                tok_s=(len(stamps) - 2) / (stamps[-1] - stamps[1]), tokens=len(stamps))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="26B-A4B")
    ap.add_argument("--layers", type=int, default=None, help="only the model's first N layers (last must be full)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=128, help="generated tokens per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tokens < 3:
        raise SystemExit("--tokens must be >= 3")
    cfg = model_config(args.model, args.layers)
    model = decode.build_ours(cfg)
    prompt = np.random.default_rng(0).integers(10, cfg.vocab_size, size=args.prompt).tolist()
    paths = {"compiled": lambda: {}, "prompt_cache": lambda: dict(prompt_cache=make_cache(cfg)),
             "eager": lambda: dict(compiled=False)}  # fmt: skip
    timed_generation(model, prompt, 4)  # kernels built once, outside the rounds
    rows = {name: [] for name in paths}
    for r in range(args.rounds):
        for name in list(paths)[r % len(paths):] + list(paths)[: r % len(paths)]:
            res = timed_generation(model, prompt, args.tokens, **paths[name]())
            rows[name].append(res)
            print(f"round {r + 1} {name}: first {res['first_s']:.3f} s, second {res['second_s']:.3f} s, "
                  f"{res['tok_s']:.1f} tok/s", flush=True)  # fmt: skip
    summary = {name: {k: statistics.median(x[k] for x in rows[name]) for k in ("first_s", "second_s", "tok_s")}
               for name in paths}  # fmt: skip
    summary["compiled_over_eager"] = summary["compiled"]["tok_s"] / summary["eager"]["tok_s"]
    summary["prompt_cache_over_eager"] = summary["prompt_cache"]["tok_s"] / summary["eager"]["tok_s"]
    # on the CPU, Q4_0 models decode eagerly on both paths (cpu_matvec.decode_eagerly)
    doc = dict(bench="generate_paths", date=datetime.datetime.now().isoformat(timespec="seconds"), model=args.model,
               layers=args.layers or cfg.num_hidden_layers, prompt=args.prompt, tokens=args.tokens,
               rounds=args.rounds, compiled_step_used=not decode_eagerly(model), commit=commit(),
               sources=sources_digest(), hardware=hardware_info(), versions=dict(mlx=mx.__version__), rows=rows,
               summary=summary)  # fmt: skip
    write_result(doc, f"generate_paths-{args.model}", args.out)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
