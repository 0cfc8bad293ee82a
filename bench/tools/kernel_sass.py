"""Static SASS of the one-launch MoE expert kernel, the tiles kernels or the tensor-core decode
attention, without a GPU: registers and instructions per block step (16 rows x 32 weights: two
mma.sync; attention: per 32-slot tile) of each loop that holds mma instructions (--ops: and the
loop's opcode counts).

    python bench/tools/kernel_sass.py [--cuobjdump PATH] [--slots 8 --f 704 --h 2816]
    python bench/tools/kernel_sass.py --family tiles [--kind gate_up --n 21504 --k 5376] [--ops]
    python bench/tools/kernel_sass.py --family attention [--n-q 32 --n-kv 4 --head-dim 512] [--ops]

The kernel text is wrapped as MLX wraps a custom kernel (tests/test_metal_compile.py's cuda_text
harness), instantiated for each geometry of bench/kernels.py's MOE_VARIANTS at the given shapes
(default 26B-A4B's), for the tiles kernel's default config with bias 0 and 1 (default: the 31B
gate|up), or for g4_attn_decode_mma and g4_attn_decode_mma8 at their default geometries (default:
31B's full layer at one token; mma8 where the layer has at most 8 rows per kv head), compiled by the local nvcc for sm_90 and disassembled by cuobjdump (not in
nvcc's minimal install: `pip download --no-deps nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm` have
cuobjdump and the nvdisasm it calls under nvidia/cu13/bin; put that folder on PATH).
The kernels are bound by their instructions' latency (bench/NOTES.md, sessions 19-20), so instructions
per block step is the number a text change should cut before it goes to the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from custom_kernels import quant_tiles as qt  # noqa: E402


def cuda_source(spec, instances: dict[str, list[tuple[str, object]]]) -> str:
    """One translation unit holding spec's kernel once per instance: {kernel name: template args}."""
    case = spec.cases(np.random.default_rng(0))[0]  # parameter types and ranks only
    params = []
    for name in spec.input_names:
        params.append(f"const {harness.CUDA_TYPES[harness._input_dtype(case, name)]}* {name}")
        for sfx, ctype in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
            if case.inputs[name].ndim > 0 and name + sfx in spec.cuda_source:
                params.append(f"const __grid_constant__ {ctype} {name}{sfx}")
    params += [f"{harness.CUDA_TYPES[d]}* {n}" for n, d in zip(spec.output_names, case.output_dtypes)]
    src = harness.MLX_CUDA_DEFAULT_HEADER + spec.cuda_header + "namespace mlx::core::cu {\n"
    for name, template in instances.items():
        src += f"__global__ void {name}(" + ", ".join(params) + ") {\n"
        for n, v in template:
            src += f"  using {n} = __nv_bfloat16;\n" if v == "bfloat16" else f"  constexpr int {n} = {v};\n"
        src += spec.cuda_source + "\n}\n"
    return src + "}\n"


def moe_instances(slots: int, f: int, h: int):
    """(spec, {name: template}) of the expert kernel at each of bench/kernels.py's MOE_VARIANTS."""
    from kernels import MOE_VARIANTS

    return me.kernel_specs()[0], {f"k_s{c.sets}_w{c.warps}": me.plan_moe_experts(slots, f, h, c)[0].template
                                  for c in MOE_VARIANTS}  # fmt: skip


def tiles_instances(kind: str, n: int, k: int):
    """(spec, {name: template}) of a tiles kernel (dense or gate_up) at the default config, with
    bias 0 and 1."""
    spec = {s.name: s for s in qt.kernel_specs()}[qt._DEFS[kind].name]
    base = qt.default_tiles_config()
    return spec, {f"k_tiles_{kind}_k{k}_bias{b}": qt.plan_tiles(kind, 1, n, k, dataclasses.replace(base, bias=b)).template
                  for b in (0, 1)}  # fmt: skip


def attention_instances(n_q: int, n_kv: int, head_dim: int):
    """[(spec, {name: template})] of the tensor-core decode-attention kernels at a layer's shape."""
    from custom_kernels import attention as at

    specs = {s.name: s for s in at.kernel_specs()}
    out = [(specs["g4_attn_decode_mma"], {"k_mma": at.plan_decode_mma(1, n_q, n_kv, 1, 32768, head_dim, None).partial_template})]
    if n_q // n_kv <= at.MMA8_MAX_ROWS:
        plan = at.plan_decode_mma(1, n_q, n_kv, 1, 32768, head_dim, None, mma8=True)
        out.append((specs["g4_attn_decode_mma8"], {"k_mma8": plan.partial_template}))
    return out


def mma_loops(sass: str, names) -> dict[str, list[list[str]]]:
    """Per kernel name: the instructions of each loop (a backward branch's body) that holds HMMA."""
    out = {}
    for part in re.split(r"\n\s+Function : ", sass)[1:]:
        header = part.split("\n", 1)[0]
        name = max((n for n in names if f"{len(n)}{n}" in header), key=len, default=None)
        ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", part)]
        at = {a: i for i, (a, _) in enumerate(ins)}
        loops = []
        for i, (a, text) in enumerate(ins):
            target = re.search(r"BRA (0x[0-9a-f]+)", text)
            if target and int(target.group(1), 16) < a and int(target.group(1), 16) in at:
                body = [t for _, t in ins[at[int(target.group(1), 16)]:i + 1]]
                if any("HMMA" in t for t in body):
                    loops.append(body)
        out[name] = loops
    return out


def opcode_counts(body: list[str]) -> dict[str, int]:
    """Opcode (predicate and modifiers dropped) -> count, most frequent first."""
    ops = [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body]
    return dict(sorted(((o, ops.count(o)) for o in set(ops)), key=lambda kv: -kv[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump"), help="cuobjdump binary")
    ap.add_argument("--family", choices=("moe", "tiles", "attention"), default="moe")
    ap.add_argument("--slots", type=int, default=8, help="moe: expert slots")
    ap.add_argument("--f", type=int, default=704, help="moe: expert width")
    ap.add_argument("--h", type=int, default=2816, help="moe: hidden size")
    ap.add_argument("--kind", choices=("dense", "gate_up"), default="gate_up", help="tiles: which kernel")
    ap.add_argument("--n", type=int, default=21504, help="tiles: N (dense) or F (gate_up)")
    ap.add_argument("--k", type=int, default=5376, help="tiles: K")
    ap.add_argument("--n-q", type=int, default=32, help="attention: query heads")
    ap.add_argument("--n-kv", type=int, default=4, help="attention: kv heads")
    ap.add_argument("--head-dim", type=int, default=512, help="attention: head dim")
    ap.add_argument("--ops", action="store_true", help="also print each loop's opcode counts")
    args = ap.parse_args(argv)
    if shutil.which("nvcc") is None or not args.cuobjdump:
        print("needs nvcc and cuobjdump (--cuobjdump)", file=sys.stderr)
        return 2
    if args.family == "moe":
        units = [moe_instances(args.slots, args.f, args.h)]
        title = f"moe_experts, S={args.slots} F={args.f} H={args.h}"
    elif args.family == "tiles":
        units = [tiles_instances(args.kind, args.n, args.k)]
        title = f"{units[0][0].name}, N={args.n} K={args.k}, {qt.default_tiles_config()}"
    else:
        units = attention_instances(args.n_q, args.n_kv, args.head_dim)
        title = f"decode attention, n_q={args.n_q} n_kv={args.n_kv} D={args.head_dim}"
        print(f"{title}: registers; instructions (mma.sync) per 32-slot tile of each mma loop")
        for spec, instances in units:
            if (rc := report(args, spec, instances, per_tile=True)) != 0:
                return rc
        return 0
    print(f"{title}: registers; instructions per block step (two mma.sync: 16 rows x 32 weights) of each mma loop")
    return report(args, *units[0])


def report(args, spec, instances: dict, per_tile: bool = False) -> int:
    """Compile spec at instances, print registers and each mma loop's instructions: per block step
    (two mma.sync) or, with ``per_tile``, per iteration with its mma count."""
    with tempfile.TemporaryDirectory() as tmp:
        inc = os.path.join(tmp, "mlx", "backend", "cuda", "device")
        os.makedirs(inc)
        with open(os.path.join(inc, "utils.cuh"), "w") as fh:
            fh.write(harness.MLX_CUDA_UTILS_STUB)
        cu, cubin = os.path.join(tmp, "k.cu"), os.path.join(tmp, "k.cubin")
        with open(cu, "w") as fh:
            fh.write(cuda_source(spec, instances))
        build = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", cubin, f"-I{tmp}", cu],
                               capture_output=True, text=True)  # fmt: skip
        if build.returncode:
            print(build.stdout + build.stderr, file=sys.stderr)
            return 1
        # ptxas prints "Compiling entry function '<mangled>'" then "Used N registers" per kernel
        regs = {}
        for mangled, n in re.findall(r"entry function '(\S+)'[\s\S]*?Used (\d+) registers", build.stderr):
            regs.update({name: n for name in instances if f"{len(name)}{name}" in mangled})
        sass = subprocess.run([args.cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    loops = mma_loops(sass, list(instances))
    for name in instances:
        if per_tile:
            per_step = ", ".join(f"{len(b)} ({sum('HMMA' in t for t in b)})" for b in loops.get(name, []))
        else:
            per_step = ", ".join(f"{2 * len(b) / sum('HMMA' in t for t in b):.1f}" for b in loops.get(name, []))
        print(f"  {name:10s} {regs.get(name, '?'):>3s} registers; {per_step}")
        if args.ops:
            for b in loops.get(name, []):
                print("    " + ", ".join(f"{o} {c}" for o, c in opcode_counts(b).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
