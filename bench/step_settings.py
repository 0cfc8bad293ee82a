"""Decode-step time under MLX's command-buffer settings, each setting in a fresh process.

MLX reads MLX_MAX_OPS_PER_BUFFER, MLX_MAX_MB_PER_BUFFER, MLX_USE_CUDA_GRAPHS and
MLX_CUDA_GRAPH_CACHE_SIZE once, when the device starts, so every setting runs in its own child. Each
child builds one model with random weights in real shapes (bench/decode.py's builders), fills a
context of N positions and times greedy decode as bench/decode.py does (pipelined: tok_s, host_ms =
host time to build and hand over one step; and synchronous: every token evaluated before the next).
It also counts the primitives of one uncompiled step's graph (before mx.compile fuses elementwise
ops), by kind.

Cold start: `first_steps_s` is the time of each child's first two steps (tracing, mx.compile and
the NVRTC builds of every kernel). With --repeat 2 --ptx-cache DIR the same setting runs twice
against one MLX PTX disk cache (MLX_PTX_CACHE_DIR): the second child shows what the cache saves,
and the listing after each child (files, longest name) shows what MLX managed to write there.

    python bench/step_settings.py [--model 31B] [--context 4096] [--settings default,mb,...] [--mlx-lm]
    python bench/step_settings.py --settings default --repeat 2 --ptx-cache /tmp/ptx [--layers 6]
"""

from __future__ import annotations

import gemma4_mlx  # noqa: F401,I001  first: the BLAS preload must come before mlx.core is imported

import argparse
import collections
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode  # noqa: E402  (bench/decode.py)
from gemma4_mlx.config import ConfigError  # noqa: E402
from hardware import hardware_info, write_result  # noqa: E402

BIG = "1000000"
SETTINGS = {
    "default": {},
    "mb": {"MLX_MAX_MB_PER_BUFFER": BIG},
    "mb_ops100": {"MLX_MAX_MB_PER_BUFFER": BIG, "MLX_MAX_OPS_PER_BUFFER": "100"},
    "mb_ops200_cache": {"MLX_MAX_MB_PER_BUFFER": BIG, "MLX_MAX_OPS_PER_BUFFER": "200",
                        "MLX_CUDA_GRAPH_CACHE_SIZE": "1000"},
    "mb_ops1000_cache": {"MLX_MAX_MB_PER_BUFFER": BIG, "MLX_MAX_OPS_PER_BUFFER": "1000",
                         "MLX_CUDA_GRAPH_CACHE_SIZE": "1000"},
    "no_graphs": {"MLX_USE_CUDA_GRAPHS": "0", "MLX_MAX_MB_PER_BUFFER": BIG},
}
KNOBS = ("MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER", "MLX_USE_CUDA_GRAPHS", "MLX_CUDA_GRAPH_CACHE_SIZE")


def primitive_counts(model, cfg, n: int) -> dict:
    """Primitives in one uncompiled decode step's graph (token -> final hidden state), by name."""
    from custom_kernels import use_kernel
    from gemma4_mlx.cache import make_static

    caches = make_static(decode.ours_cache(cfg, n), -(-(n + 8) // 256) * 256, use_kernel("kv_one_write"))
    mx.eval([c.state for c in caches if c is not None])  # the buffers' setup is not part of a step
    out = model.model(mx.array([[3]], mx.int32), caches)
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as fh:
        mx.export_to_dot(fh.name, out)
        text = fh.read()
    names = re.findall(r'label\s*=\s*"([A-Za-z_]+)', text)
    counts = collections.Counter(x for x in names if x[0].isupper())
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def model_config(name: str, layers: int | None):
    """The bench config of `name`, cut to its first `layers` layers (the last one must be full attention)."""
    cfg = decode.QUICK_MODELS[name]() if name in decode.QUICK_MODELS else decode.preset(name)
    if layers is None:
        return cfg
    if not 0 < layers <= cfg.num_hidden_layers:
        raise SystemExit(f"--layers must be in 1..{cfg.num_hidden_layers}")
    shared = max(0, cfg.num_kv_shared_layers - (cfg.num_hidden_layers - layers))
    try:
        return dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=cfg.layer_types[:layers],
                                   num_kv_shared_layers=shared)
    except ConfigError as exc:
        raise SystemExit(f"--layers {layers}: {exc}") from None


def ptx_listing(path: str) -> dict:
    """What MLX's PTX disk cache holds: compiled modules (.ptx files) and the longest file name."""
    try:
        names = os.listdir(path)
    except OSError:
        return dict(modules=0, longest_name=0)
    return dict(modules=sum(n.endswith(".ptx") for n in names), longest_name=max(map(len, names), default=0))


def child(args) -> dict:
    cfg = model_config(args.model, args.layers)
    t = time.time()
    out: dict = dict(env={k: os.environ.get(k) for k in (*KNOBS, "MLX_PTX_CACHE_DIR")})
    engines = [decode.OursEngine(cfg)]
    if args.mlx_lm:
        engines.append(decode.MlxLmEngine(cfg, 64))
    extra = 3 * (args.warmup + args.steps + 2) + 8
    first = mx.array([5], mx.int32)
    for e in engines:
        e.start(args.context, extra)
        t0 = time.time()
        decode.time_tokens(e.full_step(), first, 2, 2)  # traces, compiles, JIT-builds kernels
        res = dict(first_steps_s=time.time() - t0)
        res["pipelined"] = decode.time_tokens(e.full_step(), first, args.warmup, args.steps)
        res["sync"] = decode.time_tokens(e.full_step(), first, args.warmup, args.steps, sync=True)
        out[e.name] = res
        e.stop()
    if args.count:
        out["primitives"] = primitive_counts(engines[0].model, cfg, args.context)
    out["seconds"] = time.time() - t
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="31B")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated of {', '.join(SETTINGS)}")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--mlx-lm", action="store_true", help="time mlx-lm's model under each setting too")
    ap.add_argument("--count", action="store_true", help="count the step's primitives (first setting only)")
    ap.add_argument("--layers", type=int, default=None, help="only the model's first N layers (last must be full)")
    ap.add_argument("--repeat", type=int, default=1, help="run each setting N times (cold-start checks)")
    ap.add_argument("--ptx-cache", default=None, help="MLX_PTX_CACHE_DIR for every child; listed after each")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        ap.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    model_config(args.model, args.layers)  # a bad --layers fails here, before any child runs
    doc = dict(bench="step_settings", date=datetime.datetime.now().isoformat(timespec="seconds"),
               model=args.model, layers=args.layers, context=args.context, steps=args.steps,
               hardware=hardware_info(), versions=dict(mlx=mx.__version__), results={})
    runs = [(s if r == 0 else f"{s}#{r + 1}", s) for s in settings for r in range(args.repeat)]
    for i, (name, setting) in enumerate(runs):
        env = {k: v for k, v in os.environ.items() if k not in KNOBS}
        env.update(SETTINGS[setting])
        if args.ptx_cache:
            env["MLX_PTX_CACHE_DIR"] = os.path.abspath(args.ptx_cache)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model,
               "--context", str(args.context), "--steps", str(args.steps), "--warmup", str(args.warmup)]
        cmd += ["--mlx-lm"] if args.mlx_lm else []
        cmd += ["--count"] if args.count and i == 0 else []
        cmd += ["--layers", str(args.layers)] if args.layers else []
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:
            doc["results"][name] = dict(error=(proc.stderr or proc.stdout)[-1500:])
            print(f"{name}: failed\n{proc.stderr[-1500:]}", flush=True)
            continue
        res = doc["results"][name] = json.loads(lines[-1][len("RESULT "):])
        if args.ptx_cache:
            res["ptx_cache"] = ptx_listing(args.ptx_cache)
            print(f"{name}: PTX cache after it: {res['ptx_cache']}", flush=True)
        for eng in (decode.OURS, decode.MLX_LM):
            if eng in res:
                p, s = res[eng]["pipelined"], res[eng]["sync"]
                print(f"{name:18s} {eng:10s} {p['tok_s']:6.1f} tok/s  {p['ms_per_token']:6.2f} ms/token  host "
                      f"{p.get('host_ms', 0):6.2f} ms  sync {s['ms_per_token']:6.2f} ms  (first steps "
                      f"{res[eng]['first_steps_s']:.0f} s)", flush=True)
        if "primitives" in res:
            print("primitives per step:", res["primitives"], flush=True)
    write_result(doc, f"step_settings-{args.model}", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
