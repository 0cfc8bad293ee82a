"""Decode attention (custom_kernels.attention) at the real layer shapes, under launch geometries.

For each model's sliding layer (a full ring: window + slack slots) and full layer (a cache of N
valid positions in a capacity rounded up as the decode step does), one run reports per geometry:
microseconds per call, GB/s of the K and V bytes the call must read, and that rate as a fraction
of the copy bandwidth measured in the same run; where they apply, the one-launch kernel
(g4_attn_decode) and its staged form (g4_attn_decode_staged) at each geometry; the tensor-core
partial kernel (g4_attn_decode_mma, its staged form or g4_attn_decode_mma8, then
g4_attn_decode_merge_wide) at each of MMA_GEOMETRIES; plus mx.fast.scaled_dot_product_attention over
the valid K/V (what mlx-lm runs) and over the whole capacity with the mask (what a fixed-shape step
could run). Times are GPU kernel time per call from a CUPTI trace (torch.profiler;
bench/gpu_timeline.py): wall-clock time of back-to-back calls is MLX's host cost per op at these
sizes (~25 us whatever the geometry), so it is printed but not used. Caches rotate over >= 8 sets
(>= 512 MiB) so the L2 cannot serve them.

    python bench/attention.py [--models 31B,26B-A4B,12B,E4B] [--contexts 4096,32768] [--geometries default]
        [--mma-geometries mma,mma_t528] [--quick]
"""

from __future__ import annotations

import gemma4_mlx  # noqa: F401,I001  first: the BLAS preload must come before mlx.core is imported

import argparse
import datetime
import os
import sys

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode  # noqa: E402  (bench/decode.py)
import gpu_timeline  # noqa: E402  (bench/gpu_timeline.py: CUPTI kernel times)
import kernels  # noqa: E402  (bench/kernels.py: timing harness, copy bandwidth)
from custom_kernels import attention as at  # noqa: E402
from custom_kernels import backend, cuda_arch  # noqa: E402
from hardware import commit, hardware_info, sources_digest, write_result  # noqa: E402

SLACK = 32  # ring slots beyond the window (cache.RotatingKVCache's default)
# name -> AttentionConfig fields over the backend's default_config (None: the default itself)
GEOMETRIES = {
    "default": None,
    "chunk128": dict(min_chunk=128, target_groups=1024),
    "chunk64_t2048": dict(min_chunk=64, target_groups=2048),
    "chunk32_t2048": dict(min_chunk=32, target_groups=2048),
    "chunk64_t2048_tile64": dict(min_chunk=64, target_groups=2048, tile=64),
    # query rows split over more threadgroups (each reads its partition's K/V again, mostly from L2):
    # for full layers with one or two K/V heads (12B: 136 threadgroups at 4K with the default 16 rows;
    # E4B: 272, its 4 rows per K/V head in one tile)
    "rows8": dict(rows=8),
    "rows4": dict(rows=4),
    "rows2": dict(rows=2),
    "rows1": dict(rows=1),
}

# name -> AttentionConfig fields over default_mma_config's, for g4_attn_decode_mma (family attention_mma)
MMA_GEOMETRIES = {
    "mma": None,
    "mma_t132": dict(target_groups=132),
    "mma_t528": dict(target_groups=528),
    "mma_t1056": dict(target_groups=1056),
    "mma_w4": dict(simd_groups=4),  # D = 512: 4 warps of 128 dims (the default is 8 of 64)
    "mma_c32_t528": dict(min_chunk=32, target_groups=528),
    # g4_attn_decode_mma_staged (family attention_mma_staged): K and V tiles bulk-copied a tile ahead,
    # fields over default_mma_config(D, staged=True)'s
    "mma_staged": None,
    "mma_staged_t264": dict(target_groups=264),
    "mma_staged_p0": dict(row_pad=0),  # rows unpadded: the padding's share of the bank conflicts
    "mma_staged_s3p0": dict(stages=3, row_pad=0),  # a second tile in flight (D = 512: unpadded to fit)
    "mma_staged_s3": dict(stages=3),  # D = 256 only (padded rows: too large at 512)
    # g4_attn_decode_mma8 (family attention_mma8): <= 8 rows, the products transposed (2 blocks per SM)
    "mma8": None,
    "mma8_t528": dict(target_groups=528),
    "mma8_w4": dict(simd_groups=4),
}


def layer_shapes(cfg) -> dict:
    """{'sliding': spec, 'full': spec} of the first layer of each type (a consumer's producer's)."""
    out = {}
    for spec in cfg.layers:
        out.setdefault("full" if spec.sliding_window is None else "sliding", spec)
    return out


def case(spec, n: int, sets: int | None, quick: bool) -> dict:
    """Random caches for one layer at context n: rotating sets of (k, v), positions, q."""
    sliding = spec.sliding_window is not None
    slots = spec.sliding_window + SLACK if sliding else -(-(n + 64) // 256) * 256
    valid = min(n, slots)
    kv_bytes = 2 * spec.num_kv_heads * (min(n, spec.sliding_window) if sliding else n) * spec.head_dim * 2
    sets = sets or kernels.n_sets(2 * spec.num_kv_heads * slots * spec.head_dim * 2, quick)
    shape = (1, spec.num_kv_heads, slots, spec.head_dim)
    kvs = [(mx.random.normal(shape).astype(mx.bfloat16), mx.random.normal(shape).astype(mx.bfloat16))
           for _ in range(sets)]
    pos = np.arange(slots)
    if sliding:
        pos = pos + slots * ((n - 1 - pos) // slots)
    positions = mx.array(np.where(np.arange(slots) < valid, pos, -1).astype(np.int32))
    q = (mx.random.normal((1, spec.num_heads, 1, spec.head_dim)) * spec.head_dim**-0.5).astype(mx.bfloat16)
    mx.eval(kvs, positions, q)
    return dict(kvs=kvs, positions=positions, q=q, q_pos=mx.array([n - 1], mx.int32), slots=slots, valid=valid,
                window=spec.sliding_window, kv_bytes=kv_bytes)


def gpu_time(calls: list) -> dict:
    """Serial CUPTI kernel time per call on CUDA (bench/gpu_timeline.py); {} elsewhere."""
    return gpu_timeline.kernel_time_per_call(calls) if backend() == "cuda" else {}


def time_geometries(c: dict, geometries: dict, mma_geometries: dict, quick: bool) -> list[dict]:
    rows = []
    D = c["q"].shape[-1]

    def calls(cfg, **launch):
        return [lambda k=k, v=v: at.launch_decode_attention(
            c["q"], k, v, c["positions"], c["q_pos"], c["window"], None if c["window"] else c["valid"], cfg, **launch)
            for k, v in c["kvs"]]  # fmt: skip

    def timed(impl, name, plan, runs):
        groups = plan.partial_grid[0] // plan.partial_threadgroup[0] * plan.parts * plan.partial_grid[2]
        return dict(impl=impl, geometry=name, parts=plan.parts, groups=groups,
                    wall_us=kernels.time_rotating(runs, quick) * 1e6, **gpu_time(runs))

    for name, fields in geometries.items():
        try:
            cfg = None if fields is None else at.AttentionConfig(**{**at.default_config(D).__dict__, **fields})
            plan = at.plan_decode(1, c["q"].shape[1], c["kvs"][0][0].shape[1], 1, c["slots"], D, "bfloat16",
                                  "bfloat16", c["window"], cfg)  # fmt: skip
            rows.append(timed("g4_attn", name, plan, calls(cfg)))
        except ValueError as exc:
            rows.append(dict(impl="g4_attn", geometry=name, error=str(exc)))
            continue
        # the one launch (family attention_fused) and its staged form (attention_staged), where they apply
        for impl, staged, ok in (("g4_attn_decode", False, at.fused_supported),
                                 ("g4_attn_decode_staged", True, at.staged_supported)):  # fmt: skip
            if ok(plan):
                rows.append(timed(impl, name, plan, calls(cfg, counters=at.new_attention_counters(), staged=staged)))
    n_q, n_kv = c["q"].shape[1], c["kvs"][0][0].shape[1]
    if mma_geometries and at.mma_supported("bfloat16", "bfloat16", n_q, n_kv, 1, D):
        for name, fields in mma_geometries.items():
            staged, mma8 = name.startswith("mma_staged"), name.startswith("mma8")
            base = at.default_mma_config(D, staged)
            cfg = base if fields is None else at.AttentionConfig(**{**base.__dict__, **fields})
            if fields and cfg == base:
                continue  # the default itself at this head dim
            if staged and cuda_arch() < at.STAGED_ARCH:
                continue
            try:
                plan = at.plan_decode_mma(1, n_q, n_kv, 1, c["slots"], D, c["window"], cfg, staged, mma8)
            except ValueError:
                continue  # stages that do not fit this head dim's shared memory, mma8 past 8 rows
            impl = "g4_attn_decode_mma_staged" if staged else "g4_attn_decode_mma8" if mma8 else "g4_attn_decode_mma"
            rows.append(timed(impl, name, plan, calls(None, mma=True, mma_config=cfg, mma_staged=staged, mma8=mma8)))
    valid = c["valid"]
    slots_k = [(k[:, :, :valid], v[:, :, :valid]) for k, v in c["kvs"]]
    sdpa = mx.fast.scaled_dot_product_attention  # GQA by broadcasting the kv heads
    sdpa_calls = [lambda k=k, v=v: sdpa(c["q"], k, v, scale=1.0) for k, v in slots_k]
    sec = kernels.time_rotating(sdpa_calls, quick)
    rows.append(dict(impl="mx.fast.scaled_dot_product_attention", geometry="-", wall_us=sec * 1e6,
                     **gpu_time(sdpa_calls)))
    # what a fixed-shape step could run instead: the whole capacity, the invalid slots masked out
    keep = (c["positions"] >= 0) & (c["positions"] <= c["q_pos"][0])
    if c["window"]:
        keep = keep & (c["q_pos"][0] - c["positions"] < c["window"])
    for label, mask in (("bool mask", keep), ("additive mask", mx.where(keep, 0.0, -mx.inf).astype(mx.bfloat16))):
        masked = [lambda k=k, v=v: sdpa(c["q"], k, v, scale=1.0, mask=mask) for k, v in c["kvs"]]
        sec = kernels.time_rotating(masked, quick)
        rows.append(dict(impl="mx.fast.sdpa capacity", geometry=label, wall_us=sec * 1e6, **gpu_time(masked)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="31B,26B-A4B,12B,E4B")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--geometries", default=",".join(GEOMETRIES))
    ap.add_argument("--mma-geometries", default=",".join(MMA_GEOMETRIES), help='"" for none')
    ap.add_argument("--quick", action="store_true", help="tiny models and contexts (runs on CPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    quick = args.quick
    models = ["tiny-dense"] if quick else args.models.split(",")
    contexts = [100] if quick else [int(x) for x in args.contexts.split(",")]
    geometries = {g: GEOMETRIES[g] for g in args.geometries.split(",")}
    mma_geometries = {g: MMA_GEOMETRIES[g] for g in args.mma_geometries.split(",") if g}
    if backend() == "cpu" and not quick:
        raise SystemExit("the attention kernels run on Metal/CUDA; use --quick on the CPU (reference path)")
    copy = kernels.copy_bandwidth(quick)
    print(f"backend {backend()}  copy bandwidth {copy['GBps']:.0f} GB/s", flush=True)
    doc = dict(bench="attention", date=datetime.datetime.now().isoformat(timespec="seconds"),
               commit=commit(), sources=sources_digest(), hardware=hardware_info(), versions=dict(mlx=mx.__version__),
               copy_bandwidth=copy, results=[])  # fmt: skip
    for m in models:
        cfg = decode.QUICK_MODELS[m]() if m in decode.QUICK_MODELS else decode.preset(m)
        for kind, spec in layer_shapes(cfg).items():
            for n in contexts if kind == "full" else contexts[:1]:
                c = case(spec, n, 2 if quick else None, quick)
                rows = time_geometries(c, geometries, mma_geometries, quick) if backend() != "cpu" else []
                for r in rows:
                    r.update(model=m, layer=kind, context=n, n_q=spec.num_heads, n_kv=spec.num_kv_heads,
                             head_dim=spec.head_dim, slots=c["slots"], kv_bytes=c["kv_bytes"])
                    if "wall_us" in r:
                        us = r.get("gpu_us", r["wall_us"])  # wall clock only where there is no CUPTI
                        r["GBps"] = c["kv_bytes"] / us / 1e3
                        r["copy_frac"] = r["GBps"] / copy["GBps"]
                        print(f"{m:8s} {kind:7s} n={n:6d} {r['impl'][:24]:24s} {r['geometry']:22s} "
                              f"GPU {r.get('gpu_us', float('nan')):7.1f} us ({r.get('launches', 0):.0f} launches, "
                              f"wall {r['wall_us']:6.1f}) {r['GBps']:6.0f} GB/s {100 * r['copy_frac']:5.1f}%"
                              + (f"  parts {r['parts']} groups {r['groups']}" if "parts" in r else "")
                              + "".join(f"  {k.removeprefix('g4_attn_decode_')} {v:.1f}"
                                        for k, v in r.get("by_kernel", {}).items() if k.startswith("g4_")),
                              flush=True)  # fmt: skip
                    else:
                        print(f"{m:8s} {kind:7s} n={n:6d} {r['geometry']}: {r['error']}", flush=True)
                doc["results"].extend(rows)
                del c
    write_result(doc, f"attention-{backend()}", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
