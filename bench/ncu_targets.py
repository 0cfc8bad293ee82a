"""One launch of each decode-step kernel worth a Nsight Compute look, at real 31B shapes.

Each kernel is launched once per named target on fresh random weights, so a profiler that
filters on kernel names sees exactly one launch per target and no warm-up noise:

    ncu --clock-control none --set full -k regex:g4_ -o $OUT/step python3 bench/ncu_targets.py
    ncu --import $OUT/step.ncu-rep --page details > $OUT/step.txt

Targets (--targets, comma-separated; default all): fma (Q4_0 dense M = 1 on the FFN gate shape at
the dispatch geometry), fma_in_place (the same with the in-place decode), gate_up
(the fused gate|up stream kernel at M = 1), gate_up_split (the step's dense gate|up since session 8:
the split-K gate/up kernel at its default geometry), head (Q8_0 tied head), probe
(bench/kernels.read_probe in its 99.5% order over the gate's bytes), attn_sliding / attn_full
(decode attention partial + merge at a 4K context), attn_sliding_fused / attn_sliding_staged
(the sliding layer's one launch, g4_attn_decode, and its staged form), attn_full_mma_32k /
attn_full_mma_staged_32k (the full layer at a 32K context on tensor cores, g4_attn_decode_mma or
g4_attn_decode_mma_staged at their default geometries, then the wide merge); at E4B's short rows
(K = 2560, where every matvec is slower per byte: bench/NOTES.md session 11): gate_up_split_e4b
(20480 x 2560) and down_e4b (2560 x 10240, the same kernel family at long rows, for comparison); gate_up_runs /
gate_up_runs_e4b: the one-token runs kernel (tensor cores; its default form, the staged 16-row one
since session 14; GEMMA4_MLX_RUNS_GEOMETRY=stages=0 for runs16, rows=8 for the 8-row form) on the
same gate|up shapes.
"""

from __future__ import annotations

import gemma4_mlx  # noqa: F401,I001  first: the BLAS preload must come before mlx.core is imported

import argparse
import dataclasses
import os
import sys

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attention as attention_bench  # noqa: E402  (bench/attention.py)
import decode  # noqa: E402  (bench/decode.py)
import kernels  # noqa: E402  (bench/kernels.py)
from custom_kernels import attention as at  # noqa: E402
from custom_kernels import quant_matvec as qm  # noqa: E402

HIDDEN, FFN, VOCAB = 5376, 21504, 262144  # 31B
E4B_HIDDEN, E4B_FFN = 2560, 10240


def _blocks(ggml_type: int, shape: tuple[int, ...], k: int) -> mx.array:
    return kernels.random_blocks(ggml_type, shape, k)


def _fma(x):
    return qm.launch_dense(x, _blocks(qm.Q4_0, (FFN,), HIDDEN), qm.Q4_0, FFN)


def _fma_in_place(x):
    cfg = dataclasses.replace(qm.default_config(qm.Q4_0, "dense", 1, FFN, HIDDEN), in_place=1)
    return qm.launch_dense(x, _blocks(qm.Q4_0, (FFN,), HIDDEN), qm.Q4_0, FFN, config=cfg)


def _gate_up(x):
    w = _blocks(qm.Q4_0, (1, 2 * FFN), HIDDEN)
    return qm.launch_gate_up_stream(x, mx.zeros((1, 1), mx.int32), w, FFN)


def _gate_up_split(x, ffn=FFN):
    w = _blocks(qm.Q4_0, (1, 2 * ffn), x.shape[-1])
    return qm.launch_gate_up(x, mx.zeros((1, 1), mx.int32), w, qm.Q4_0, ffn, qm.gate_up_split_config(),
                             out_shape=(1, ffn))  # fmt: skip


def _gate_up_runs(x, ffn=FFN):
    return qm.launch_gate_up_runs(x, _blocks(qm.Q4_0, (2 * ffn,), x.shape[-1]), ffn)


def _down_e4b(x):
    return qm.launch_dense(x, _blocks(qm.Q4_0, (E4B_HIDDEN,), E4B_FFN), qm.Q4_0, E4B_HIDDEN)


def _head(x):
    return qm.launch_dense(x, _blocks(qm.Q8_0, (VOCAB,), HIDDEN), qm.Q8_0, VOCAB)


def _probe(x):
    w = _blocks(qm.Q4_0, (FFN,), HIDDEN)
    return kernels.read_probe(w, order=1)


def _attention(kind: str, one_launch: bool = False, staged: bool = False, mma_staged: bool | None = None,
               context: int = 4096):  # fmt: skip
    """mma_staged None: the f32-FMA kernels; False / True: the tensor-core kernel / its staged form."""
    def run(x):
        spec = attention_bench.layer_shapes(decode.preset("31B"))[kind]
        c = attention_bench.case(spec, context, 1, quick=False)
        k, v = c["kvs"][0]
        counters = at.new_attention_counters() if one_launch else None
        return at.launch_decode_attention(c["q"], k, v, c["positions"], c["q_pos"], c["window"],
                                          None if c["window"] else c["valid"], counters=counters,
                                          staged=staged, mma=mma_staged is not None,
                                          mma_staged=bool(mma_staged))  # fmt: skip

    return run


TARGETS = {"fma": _fma, "fma_in_place": _fma_in_place, "gate_up": _gate_up, "gate_up_split": _gate_up_split,
           "head": _head, "probe": _probe, "attn_sliding": _attention("sliding"), "attn_full": _attention("full"),
           "attn_sliding_fused": _attention("sliding", True), "attn_sliding_staged": _attention("sliding", True, True),
           "attn_full_mma_32k": _attention("full", mma_staged=False, context=32768),
           "attn_full_mma_staged_32k": _attention("full", mma_staged=True, context=32768),
           "gate_up_split_e4b": lambda x: _gate_up_split(x, E4B_FFN), "down_e4b": _down_e4b,
           "gate_up_runs": _gate_up_runs, "gate_up_runs_e4b": lambda x: _gate_up_runs(x, E4B_FFN)}  # fmt: skip
WIDTH = {"gate_up_split_e4b": E4B_HIDDEN, "down_e4b": E4B_FFN, "gate_up_runs_e4b": E4B_HIDDEN}  # x width (default HIDDEN)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default=",".join(TARGETS))
    args = ap.parse_args(argv)
    names = args.targets.split(",")
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise SystemExit(f"unknown targets {unknown}; choose from {', '.join(TARGETS)}")
    rng = np.random.default_rng(0)
    for name in names:
        x = mx.array(rng.standard_normal((1, WIDTH.get(name, HIDDEN))).astype(np.float32)).astype(mx.bfloat16)
        out = TARGETS[name](x)
        mx.eval(out)
        print(f"{name}: {out.shape} {out.dtype}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
