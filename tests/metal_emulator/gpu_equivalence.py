"""Equivalence spot check: the emulator's output of a Metal kernel vs the CUDA instantiation of the
same body on a GPU, on identical inputs (f32 activations; relative difference <= 1e-6).

    python -m metal_emulator.gpu_equivalence prepare DIR   # here (CPU): emulate, save inputs + outputs
    python -m metal_emulator.gpu_equivalence check DIR     # on the CUDA machine: run, compare, report

(run from tests/, or with tests/ on PYTHONPATH).
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import numpy as np

KERNELS = ("g4_q4_0_matvec", "g4_q8_0_gate_up_gather")


def _cases():
    from custom_kernels.registry import all_kernel_specs

    rng = np.random.default_rng(2026)
    for spec in all_kernel_specs():
        if spec.name in KERNELS:
            for case in spec.cases(rng):
                if "float32" in case.output_dtypes and not getattr(case, "input_dtypes", None):
                    yield spec, case
                    break


def prepare(out_dir: Path) -> None:
    from metal_emulator import metal_kernel

    out_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for spec, case in _cases():
        kernel = metal_kernel(spec.name, list(spec.input_names), list(spec.output_names), spec.metal_source,
                              header=spec.metal_header)
        outs = kernel(inputs=[case.inputs[n] for n in spec.input_names], output_shapes=case.output_shapes,
                      output_dtypes=case.output_dtypes, grid=case.grid, threadgroup=case.threadgroup,
                      template=case.template)
        records.append(dict(name=spec.name, input_names=spec.input_names, output_names=spec.output_names,
                            cuda_header=spec.cuda_header, cuda_source=spec.cuda_source,
                            inputs=case.inputs, template=case.template, grid=case.grid,
                            threadgroup=case.threadgroup, output_shapes=case.output_shapes,
                            output_dtypes=case.output_dtypes, emulated=[np.asarray(o) for o in outs]))
        print(f"{spec.name}: emulated {case.output_shapes}")
    with open(out_dir / "cases.pkl", "wb") as f:
        pickle.dump(records, f)


def check(in_dir: Path) -> int:
    import mlx.core as mx

    with open(in_dir / "cases.pkl", "rb") as f:
        records = pickle.load(f)
    report, worst = [], 0.0
    for r in records:
        kernel = mx.fast.cuda_kernel(name=r["name"], input_names=list(r["input_names"]),
                                     output_names=list(r["output_names"]), source=r["cuda_source"],
                                     header=r["cuda_header"])
        template = [(k, getattr(mx, v) if isinstance(v, str) else v) for k, v in r["template"]]
        outs = kernel(inputs=[mx.array(r["inputs"][n]) for n in r["input_names"]],
                      output_shapes=r["output_shapes"], output_dtypes=[getattr(mx, d) for d in r["output_dtypes"]],
                      grid=r["grid"], threadgroup=r["threadgroup"], template=template, init_value=float("nan"))
        for name, got, emu in zip(r["output_names"], outs, r["emulated"]):
            got = np.array(got, dtype=np.float64)
            emu = emu.astype(np.float64)
            rel = float(np.abs(got - emu).max() / max(np.abs(emu).max(), 1e-30))
            worst = max(worst, rel)
            report.append(dict(kernel=r["name"], output=name, shape=list(got.shape), max_rel_diff=rel,
                               nan=int(np.isnan(got).sum())))
            print(f"{r['name']}.{name} {got.shape}: max |cuda - emulator| / max |emulator| = {rel:.3g}")
    print(json.dumps(dict(worst=worst, rows=report)))
    return 0 if worst <= 1e-6 else 1


if __name__ == "__main__":
    cmd, path = sys.argv[1], Path(sys.argv[2])
    sys.exit(prepare(path) if cmd == "prepare" else check(path))
