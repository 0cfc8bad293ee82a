"""Static SASS of the one-launch MoE expert kernel, without a GPU: registers and instructions per
block step (16 rows x 32 weights: two mma.sync) of each loop that holds mma instructions.

    python bench/tools/kernel_sass.py [--cuobjdump PATH] [--slots 8 --f 704 --h 2816]

The kernel text is wrapped as MLX wraps a custom kernel (tests/test_metal_compile.py's cuda_text
harness), instantiated for each geometry of bench/kernels.py's MOE_VARIANTS at the given shapes
(default 26B-A4B's), compiled by the local nvcc for sm_90 and disassembled by cuobjdump (not in
nvcc's minimal install: `pip download --no-deps nvidia-cuda-cuobjdump` has it under nvidia/cu13/bin).
The kernel is bound by its instructions' latency (bench/NOTES.md, sessions 19-20), so instructions
per block step is the number a text change should cut before it goes to the GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import test_metal_compile as harness  # noqa: E402  (the MLX-style CUDA wrapping)

from custom_kernels import moe_experts as me  # noqa: E402


def cuda_source(slots: int, f: int, h: int, configs) -> tuple[str, list[str]]:
    """One translation unit with a kernel per geometry (named k_s<sets>_w<warps>) and their names."""
    spec = me.kernel_specs()[0]
    case = spec.cases(np.random.default_rng(0))[0]  # parameter types and ranks only
    params = []
    for name in spec.input_names:
        params.append(f"const {harness.CUDA_TYPES[harness._input_dtype(case, name)]}* {name}")
        for sfx, ctype in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
            if case.inputs[name].ndim > 0 and name + sfx in spec.cuda_source:
                params.append(f"const __grid_constant__ {ctype} {name}{sfx}")
    params += [f"{harness.CUDA_TYPES[d]}* {n}" for n, d in zip(spec.output_names, case.output_dtypes)]
    src = harness.MLX_CUDA_DEFAULT_HEADER + spec.cuda_header + "namespace mlx::core::cu {\n"
    names = []
    for cfg in configs:
        plan, _ = me.plan_moe_experts(slots, f, h, cfg)
        name = f"k_s{cfg.sets}_w{cfg.warps}"
        names.append(name)
        src += f"__global__ void {name}(" + ", ".join(params) + ") {\n"
        for n, v in plan.template:
            src += f"  using {n} = __nv_bfloat16;\n" if v == "bfloat16" else f"  constexpr int {n} = {v};\n"
        src += spec.cuda_source + "\n}\n"
    return src + "}\n", names


def mma_loops(sass: str) -> dict[str, list[tuple[int, int]]]:
    """Per kernel name: (instructions, mma instructions) of each loop (a backward branch's body)
    that holds HMMA."""
    out = {}
    for part in re.split(r"\n\s+Function : ", sass)[1:]:
        name = re.search(r"k_s\d+_w\d+", part.split("\n", 1)[0]).group(0)
        ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", part)]
        at = {a: i for i, (a, _) in enumerate(ins)}
        loops = []
        for i, (a, text) in enumerate(ins):
            target = re.search(r"BRA (0x[0-9a-f]+)", text)
            if target and int(target.group(1), 16) < a and int(target.group(1), 16) in at:
                body = [t for _, t in ins[at[int(target.group(1), 16)]:i + 1]]
                mma = sum("HMMA" in t for t in body)
                if mma:
                    loops.append((len(body), mma))
        out[name] = loops
    return out


def main(argv=None) -> int:
    from kernels import MOE_VARIANTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump"), help="cuobjdump binary")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--f", type=int, default=704)
    ap.add_argument("--h", type=int, default=2816)
    args = ap.parse_args(argv)
    if shutil.which("nvcc") is None or not args.cuobjdump:
        print("needs nvcc and cuobjdump (--cuobjdump)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        inc = os.path.join(tmp, "mlx", "backend", "cuda", "device")
        os.makedirs(inc)
        with open(os.path.join(inc, "utils.cuh"), "w") as fh:
            fh.write(harness.MLX_CUDA_UTILS_STUB)
        src, names = cuda_source(args.slots, args.f, args.h, MOE_VARIANTS)
        cu, cubin = os.path.join(tmp, "moe.cu"), os.path.join(tmp, "moe.cubin")
        with open(cu, "w") as fh:
            fh.write(src)
        build = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", cubin, f"-I{tmp}", cu],
                               capture_output=True, text=True)  # fmt: skip
        if build.returncode:
            print(build.stdout + build.stderr, file=sys.stderr)
            return 1
        regs = dict(re.findall(r"Function properties for \S*?(k_s\d+_w\d+)\S*[\s\S]*?Used (\d+) registers", build.stderr))
        if not regs:  # ptxas prints "Compiling entry function" then "Used N registers" per kernel
            regs = dict(re.findall(r"entry function '\S*?(k_s\d+_w\d+)\S*'[\s\S]*?Used (\d+) registers", build.stderr))
        sass = subprocess.run([args.cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    loops = mma_loops(sass)
    print(f"moe_experts, S={args.slots} F={args.f} H={args.h}: registers; instructions per block step of each mma loop")
    for name in names:
        per_step = ", ".join(f"{2 * n / m:.1f}" for n, m in loops.get(name, []))
        print(f"  {name:10s} {regs.get(name, '?'):>3s} registers; {per_step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
