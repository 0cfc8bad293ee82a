"""Primitives of one decode step's graph as a GPU build runs it, counted on any machine (CPU too).

MLX spends host time per primitive of the graph it evaluates (bench/NOTES.md, session 4: ~0.4 ms
per 31B layer, ~5.5 us per primitive on average), so the primitive count per layer is the number
to cut. On a CPU build the model would take the reference paths, so this script pretends to be a
CUDA build on an sm_90 GPU (the H200 the step is measured on): custom_kernels.backend() answers
"cuda", its compute capability 90, and mx.fast.cuda_kernel returns a stand-in
whose outputs are one `Depends` primitive on all the kernel's inputs (counted as CustomKernel).
Nothing is evaluated; the graph of one uncompiled step (token -> final hidden state, and the head)
is exported with mx.export_to_dot and counted by primitive name.

    python bench/graph_count.py [--model 31B] [--layers 6] [--context 64] [--unfused] [--compiled [--kernels]] [--out counts.json]

--compiled counts instead the step gemma4_mlx.compiled_step.CompiledDecoder replays per token (after
mx.compile's fusion of elementwise ops: what a decode step evaluates) and times its replays here
(the stand-in kernels cost almost nothing, so on a CPU build that time is mostly host work);
--kernels also prints the custom kernels it launches, in order (the JSON's "kernels").
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
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode  # noqa: E402  (bench/decode.py)
from hardware import commit, hardware_info, sources_digest  # noqa: E402
from step_settings import model_config  # noqa: E402

import custom_kernels  # noqa: E402
from custom_kernels import attention, matvec_norm, moe_experts, norm, quant_matvec, router, sampling  # noqa: E402

_ZEROS: dict = {}
_FAST_CALLS: collections.Counter = collections.Counter()  # stand-in mx.fast ops, by GPU primitive name


def _zeros(shape, dtype) -> mx.array:
    key = (tuple(shape), dtype)
    if key not in _ZEROS:
        _ZEROS[key] = mx.zeros(shape, dtype)
        mx.eval(_ZEROS[key])
    return _ZEROS[key]


def _fast_stand_in(name: str):
    """mx.fast.rms_norm / rope are one primitive on a GPU but a composite of ~8 ops on the CPU:
    a stand-in with one Depends primitive, counted under the GPU primitive's name."""

    def call(x, *args, **kwargs):
        _FAST_CALLS[name] += 1
        deps = [a for a in (*args, *kwargs.values()) if isinstance(a, mx.array)]
        return mx.depends([_zeros(x.shape, x.dtype)], [x, *deps])[0]

    return call


LAUNCHES: list[str] = []
"""The custom kernels' names (without MLX's text digest) in the order a traced step launched them."""


def _stand_in_kernel(*, name: str = "?", **_kw):
    """What mx.fast.cuda_kernel returns here: outputs of the requested shapes that depend on every
    input through one Depends primitive (the zeros are evaluated leaves, not primitives); each
    call's kernel name goes to LAUNCHES."""
    base = re.sub(r"_[0-9a-f]{16}$", "", name)

    def call(*, inputs, output_shapes, output_dtypes, **_launch):
        LAUNCHES.append(base)
        outs = [_zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return mx.depends(outs, [x if isinstance(x, mx.array) else mx.array(x) for x in inputs])

    return call


PRETEND_ARCH = 90
"""The compute capability pretend_cuda reports: the H200's (Hopper), where the step was measured."""


PRETEND_MODULES = (custom_kernels, quant_matvec, attention, sampling, norm, moe_experts, router, matvec_norm)
"""The modules whose backend() pretend_cuda answers "cuda" (each imported it by name)."""


def pretend_cuda() -> None:
    """Route the model through the CUDA kernel paths of an sm_90 GPU without one (for counting only)."""
    for module in PRETEND_MODULES:
        if hasattr(module, "backend"):
            module.backend = lambda: "cuda"
    custom_kernels._device_arch = lambda: PRETEND_ARCH
    custom_kernels.clear_kernel_cache()
    mx.fast.cuda_kernel = _stand_in_kernel
    mx.fast.rms_norm = _fast_stand_in("RMSNorm")
    mx.fast.rope = _fast_stand_in("RoPE")


def count(arrays: list[mx.array], fast_calls: dict) -> dict:
    """Primitives by name in the graph of `arrays`; the Depends of the stand-ins are reported as
    the GPU primitives they stand for (`fast_calls` of them mx.fast ops, the rest CustomKernel)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "graph.dot")
        mx.export_to_dot(path, *arrays)
        with open(path) as fh:
            names = re.findall(r'label\s*=\s*"([A-Za-z_]+)', fh.read())
    counts = collections.Counter(x for x in names if x[0].isupper())
    depends = counts.pop("Depends", 0)
    counts.update(fast_calls)
    counts["CustomKernel"] = depends - sum(fast_calls.values())
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def step_counts(cfg, context: int, fused: bool = True) -> dict:
    """Build `cfg` as bench/decode.py does (Q4_0 blocks; fused projections unless `fused` is False)
    and count one decode step's primitives at `context` positions, as a CUDA build would run it."""
    from gemma4_mlx.cache import make_static

    model, cache = _model_and_caches(cfg, context, fused)
    caches = make_static(cache, -(-(context + 8) // 256) * 256, custom_kernels.use_kernel("kv_one_write"))
    mx.eval([c.state for c in caches if c is not None])  # the buffers' setup is not part of a step
    hidden = model.model(mx.array([[3]], mx.int32), caches)[:, -1, :]
    body = count([hidden], dict(_FAST_CALLS))
    step = count([model.logits(hidden)], dict(_FAST_CALLS))
    layers = cfg.num_hidden_layers
    return dict(layers=layers, context=context, body=body, with_head=step, body_total=sum(body.values()),
                per_layer=sum(body.values()) / layers,
                per_layer_by_kind={k: round(v / layers, 2) for k, v in body.items()})  # fmt: skip


def _model_and_caches(cfg, context: int, fused: bool):
    pretend_cuda()
    _FAST_CALLS.clear()
    fuse = decode.fuse_projections
    try:
        if not fused:
            decode.fuse_projections = lambda model: 0
        model = decode.build_ours(cfg)
    finally:
        decode.fuse_projections = fuse
    return model, decode.ours_cache(cfg, context)


def compiled_counts(cfg, context: int, replays: int = 30) -> dict:
    """Primitives of the compiled decode step (CompiledDecoder's, traced once) and the median wall
    time of `replays` replays of it here, each evaluated before the next (stand-in kernels)."""
    from gemma4_mlx.compiled_step import CompiledDecoder

    model, cache = _model_and_caches(cfg, context, True)
    decoder = CompiledDecoder(model, cache, -(-(context + replays + 16) // 256) * 256)
    token = mx.array([[3]], mx.int32)
    LAUNCHES.clear()
    outs = decoder._step(token, *decoder.state)  # the traced step, before anything is evaluated
    launches = list(LAUNCHES)
    counts = count(list(outs), dict(_FAST_CALLS))
    times = []
    state = list(outs[1:])
    for _ in range(replays + 3):
        t = time.perf_counter()
        outs = decoder._step(token, *state)
        mx.eval(outs)
        times.append(time.perf_counter() - t)
        state = list(outs[1:])
    layers = cfg.num_hidden_layers
    total = sum(counts.values())
    return dict(layers=layers, context=context, compiled=counts, compiled_total=total, per_layer=total / layers,
                head_in_step=not decoder.head_outside, replay_us=1e6 * float(np.median(times[3:])),
                kernels=launches)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="31B")
    ap.add_argument("--layers", type=int, default=6, help="the model's first N layers (last must be full)")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--unfused", action="store_true", help="without quantized.fuse_projections")
    ap.add_argument("--compiled", action="store_true", help="the compiled step and its replay time (see above)")
    ap.add_argument("--kernels", action="store_true", help="with --compiled: print the kernels in launch order")
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = ap.parse_args(argv)
    # where and with what it ran, taken before pretend_cuda() makes the backend answer "cuda"
    header = dict(bench="graph_count", date=datetime.datetime.now().isoformat(timespec="seconds"), commit=commit(),
                  sources=sources_digest(), hardware=hardware_info(), versions=dict(mlx=mx.__version__),
                  env={k: v for k, v in os.environ.items() if k.startswith("GEMMA4_MLX_")})  # fmt: skip
    if args.compiled:
        doc = dict(**header, model=args.model, **compiled_counts(model_config(args.model, args.layers), args.context))
        print(f"{args.model}, {doc['layers']} layers: {doc['compiled_total']} primitives in the compiled step "
              f"({doc['per_layer']:.1f} per layer), replay {doc['replay_us']:.0f} us here")
        for name, n in doc["compiled"].items():
            print(f"  {name[:60]:60s} {n:5d}  {n / doc['layers']:6.2f} per layer")
        if args.kernels:
            print("kernels in launch order:\n  " + "\n  ".join(doc["kernels"]))
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(doc, fh, indent=1)
        return 0
    doc = dict(**header, model=args.model, fused=not args.unfused,
               **step_counts(model_config(args.model, args.layers), args.context, not args.unfused))
    layers, body = doc["layers"], doc["body"]
    print(f"{args.model}, {layers} layers: {doc['body_total']} primitives in the body "
          f"({doc['per_layer']:.1f} per layer), {sum(doc['with_head'].values())} with the head")
    for name, n in body.items():
        print(f"  {name:24s} {n:5d}  {n / layers:6.2f} per layer")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
