"""Compile every kernel's generated Metal and CUDA text on the CPU CI machine.

Metal: the text is wrapped exactly as ``mx.fast.metal_kernel`` wraps it (template header, the
generated signature with attributes found in the body, explicit instantiation) and compiled with
the system C++ compiler against a minimal shim of the Metal standard library. That proves the
text is well-formed C++ with the types and functions Metal provides; the Metal emulator
(tests/metal_emulator/) runs it.

CUDA: the text is wrapped as ``mx.fast.cuda_kernel`` wraps it for NVRTC (default header,
``namespace mlx::core::cu``, ``using``/``constexpr`` template lines, ``const T*`` inputs,
``Shape`` by value) and compiled for sm_90 with the local ``nvcc`` (skipped when absent).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from custom_kernels.registry import KernelSpec, all_kernel_specs

SPECS = all_kernel_specs()

# MLX's get_type_string (Metal) and dtype_to_cuda_type (CUDA) for the dtypes kernels use.
METAL_TYPES = {"float32": "float", "float16": "float16_t", "bfloat16": "bfloat16_t", "uint8": "uint8_t",
               "uint16": "uint16_t", "uint32": "uint32_t", "int32": "int32_t", "int64": "int64_t",
               "bool": "bool"}  # fmt: skip
CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "uint8": "uint8_t",
              "uint16": "uint16_t", "uint32": "uint32_t", "int32": "int32_t", "int64": "int64_t",
              "bool": "bool"}  # fmt: skip

# mx.fast.metal_kernel adds an attribute parameter when its name occurs in the body, in this order.
METAL_ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"), ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"), ("grid_origin", "uint3"), ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"), ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"), ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"), ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"), ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"), ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"), ("threads_per_simdgroup", "uint"), ("threads_per_threadgroup", "uint3"),
]  # fmt: skip

# Just enough of <metal_stdlib> for the kernels to compile as C++ (types and declarations only).
METAL_SHIM = r"""
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#define device
#define constant
#define threadgroup
#define thread
typedef unsigned int uint;
typedef unsigned short ushort;
struct uint3 { uint x, y, z; };
struct uint2 { uint x, y; };
struct uint4 { uint x, y, z, w; };
struct ushort2 { ushort x, y; };
struct ushort4 { ushort x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct half { ushort bits; half() = default; half(float); operator float() const; };
struct half2 { half x, y; };
struct half4 { half x, y, z, w; };
struct bfloat16_t { ushort bits; bfloat16_t() = default; bfloat16_t(float); operator float() const; };
typedef half float16_t;
template <typename To, typename From> To as_type(From v) {
  static_assert(sizeof(To) == sizeof(From), "as_type size");
  To t; std::memcpy(&t, &v, sizeof(To)); return t;
}
enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);
float simd_sum(float);
float simd_max(float);
float simd_shuffle_xor(float, ushort);
namespace metal { namespace precise { float tanh(float); } }
float sqrt(float); float cos(float); float sin(float); float exp2(float);
"""


def _case_templates(spec: KernelSpec) -> list[tuple[list, dict]]:
    """Distinct (template, inputs) pairs from the spec's cases."""
    seen, out = set(), []
    for case in spec.cases(np.random.default_rng(0)):
        key = repr(case.template)
        if key not in seen:
            seen.add(key)
            out.append((case.template, case))
    return out


def _input_dtype(case, name: str) -> str:
    return case.input_dtypes.get(name, str(case.inputs[name].dtype))


def _tvalue(v, types: dict) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"  # MLX streams bools without boolalpha
    if isinstance(v, int):
        return str(v)
    return types[v]


def metal_text(spec: KernelSpec, cases: list) -> str:
    """The library source MLX builds for these instantiations (minus MLX's own utils prelude)."""
    template = cases[0][0]
    src = spec.metal_header
    tparams = ", ".join(
        ("bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "typename") + " " + n
        for n, v in template
    )
    case = cases[0][1]
    params, index = [], 0
    for name in spec.input_names:
        arr = case.inputs[name]
        where = "constant" if arr.size < 8 else "device"
        ref = "&" if arr.ndim == 0 else "*"
        params.append(f"  const {where} {METAL_TYPES[_input_dtype(case, name)]}{ref} {name} [[buffer({index})]]")
        index += 1
        for suffix, ctype in (("_shape", "const constant int*"), ("_strides", "const constant size_t*"),
                              ("_ndim", "const constant int&")):  # fmt: skip
            if arr.ndim > 0 and name + suffix in spec.metal_source:
                params.append(f"  {ctype} {name}{suffix} [[buffer({index})]]")
                index += 1
    for name, dtype in zip(spec.output_names, case.output_dtypes):
        params.append(f"  device {METAL_TYPES[dtype]}* {name} [[buffer({index})]]")
        index += 1
    params += [f"  {t} {a} [[{a}]]" for a, t in METAL_ATTRIBUTES if a in spec.metal_source]
    fname = f"custom_kernel_{spec.name}"
    src += f"template <{tparams}>\n[[kernel]] void {fname}(\n" + ",\n".join(params) + ") {\n"
    src += spec.metal_source + "\n}\n"
    for tmpl, _ in cases:
        args = "<" + ", ".join(_tvalue(v, METAL_TYPES) for _, v in tmpl) + ">"
        host = fname + "_" + "_".join(_tvalue(v, METAL_TYPES) for _, v in tmpl)
        src += f'\ntemplate [[host_name("{host}")]] [[kernel]] decltype({fname}{args}) {fname}{args};\n'
    return src


METAL_SPECS = [s for s in SPECS if s.metal_source]  # an empty Metal source marks a CUDA-only kernel


@pytest.mark.skipif(shutil.which("g++") is None, reason="no system C++ compiler (g++)")
@pytest.mark.parametrize("spec", METAL_SPECS, ids=[s.name for s in METAL_SPECS])
def test_metal_text_compiles(spec: KernelSpec, tmp_path: Path):
    (tmp_path / "metal_stdlib").write_text(METAL_SHIM)
    (tmp_path / "metal_simdgroup").write_text("#pragma once\n")
    # dtype-only instantiations per case signature (signatures differ by dtype: one TU each)
    by_sig: dict[tuple, list] = {}
    for tmpl, case in _case_templates(spec):
        sig = tuple(_input_dtype(case, n) for n in spec.input_names) + tuple(case.output_dtypes)
        by_sig.setdefault(sig, []).append((tmpl, case))
    for i, cases in enumerate(by_sig.values()):
        src = tmp_path / f"{spec.name}_{i}.cpp"
        src.write_text(metal_text(spec, cases))
        res = subprocess.run(
            ["g++", "-std=c++17", "-fsyntax-only", "-Wno-attributes", "-Wno-unknown-pragmas",
             f"-I{tmp_path}", str(src)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert res.returncode == 0, f"{src.name}:\n{res.stderr[-4000:]}"


def test_each_dialect_has_only_its_own_spellings():
    metal_only = r"\b(simd_sum|thread_index_in_simdgroup|threadgroup_position_in_grid|device|threadgroup)\b"
    cuda_only = r"\b(threadIdx|blockIdx|__shfl_xor_sync|__syncthreads|__device__|__ldg)\b"
    for spec in SPECS:
        for text in (spec.metal_header, spec.metal_source):
            assert "$" not in text and not re.search(cuda_only, text), spec.name
        for text in (spec.cuda_header, spec.cuda_source):
            assert "$" not in text and not re.search(metal_only, text), spec.name
        assert re.search(cuda_only, spec.cuda_source)
        assert not spec.metal_source or re.search(metal_only, spec.metal_source)


# ----------------------------------------------------------------------------------------------
# CUDA (NVRTC-style wrapping, compiled by nvcc)
# ----------------------------------------------------------------------------------------------

MLX_CUDA_UTILS_STUB = r"""
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
namespace mlx::core::cu {
constexpr int MAX_NDIM = 10;
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}
"""

# mlx/backend/cuda/custom_kernel.cpp default_header
MLX_CUDA_DEFAULT_HEADER = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

#define inf cuda::std::numeric_limits<float>::infinity()

"""


def cuda_text(specs: list[KernelSpec]) -> str:
    """One translation unit with a __global__ function per case instantiation of ``specs`` (which
    share one header), wrapped as MLX wraps a custom kernel for NVRTC."""
    src = MLX_CUDA_DEFAULT_HEADER + specs[0].cuda_header
    src += "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    for spec in specs:
        for tmpl, case in _case_templates(spec):
            suffix = "".join("_" + _tvalue(v, CUDA_TYPES) for _, v in tmpl)
            params = []
            for name in spec.input_names:
                arr = case.inputs[name]
                params.append(f"    const {CUDA_TYPES[_input_dtype(case, name)]}* {name}")
                for sfx, ctype in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                    if arr.ndim > 0 and name + sfx in spec.cuda_source:
                        params.append(f"    const __grid_constant__ {ctype} {name}{sfx}")
            for name, dtype in zip(spec.output_names, case.output_dtypes):
                params.append(f"    {CUDA_TYPES[dtype]}* {name}")
            src += f"__global__ void custom_kernel_{spec.name}{suffix}(\n" + ",\n".join(params) + ") {\n"
            for n, v in tmpl:
                if isinstance(v, bool):
                    src += f"  constexpr bool {n} = {'true' if v else 'false'};\n"
                elif isinstance(v, int):
                    src += f"  constexpr int {n} = {v};\n"
                else:
                    src += f"  using {n} = {CUDA_TYPES[v]};\n"
            src += "\n" + spec.cuda_source + "\n}\n\n"
    return src + "} // namespace mlx::core::cu\n"


def _cuda_spec_groups(tmp_path: Path) -> list[list[KernelSpec]]:
    """The registry's specs grouped by CUDA header (one translation unit each), with MLX's device
    utils stub written under tmp_path for nvcc's include path."""
    inc = tmp_path / "mlx" / "backend" / "cuda" / "device"
    inc.mkdir(parents=True)
    (inc / "utils.cuh").write_text(MLX_CUDA_UTILS_STUB)
    by_header: dict[str, list[KernelSpec]] = {}
    for spec in SPECS:
        by_header.setdefault(spec.cuda_header, []).append(spec)
    return list(by_header.values())


def _nvcc(src: Path, tmp_path: Path, output: str, *extra: str) -> subprocess.CompletedProcess:
    """nvcc for sm_90 of one source to `output` ("cubin" or "ptx") next to it, MLX's device utils stub
    under tmp_path on the include path."""
    cmd = ["nvcc", "-std=c++17", "-arch=sm_90", f"-{output}", "-o", str(src.with_suffix("." + output)),
           f"-I{tmp_path}", *extra, str(src)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def _failure(src: Path, res: subprocess.CompletedProcess) -> str | None:
    return None if res.returncode == 0 else f"{src.name}:\n{(res.stdout + res.stderr)[-3000:]}"


def _a_few_at_a_time(job, items) -> list[str]:
    """job(item) -> failure or None over items, a few at a time (dozens of concurrent nvcc processes
    would swamp a small CI machine); the failures."""
    import concurrent.futures
    import os

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        return [f for f in pool.map(job, items) if f]


def _nvcc_all(sources: list[Path], tmp_path: Path, output: str) -> list[str]:
    """Compile each source (_nvcc); the failures."""
    return _a_few_at_a_time(lambda src: _failure(src, _nvcc(src, tmp_path, output)), sources)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_text_compiles(tmp_path: Path):
    sources = []
    for i, specs in enumerate(_cuda_spec_groups(tmp_path)):
        src = tmp_path / f"kernels_{i}.cu"
        src.write_text(cuda_text(specs))
        sources.append(src)
    # -cubin: NVCC front end, NVVM and ptxas for sm_90 (no host compilation needed)
    failures = _nvcc_all(sources, tmp_path, "cubin")
    assert not failures, "\n\n".join(failures)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_compact_cuda_text_compiles_to_the_same_ptx(tmp_path: Path):
    """MLX gets the CUDA text compacted (custom_kernels.KERNEL_TEXT_ENV): for every registry
    instantiation nvcc emits the same PTX from it as from the text as written and pinned, so the
    GPU runs that pinned the text cover the compact form too."""
    import dataclasses

    from custom_kernels.dialect import compact_text, prune_helpers, short_names

    groups = _cuda_spec_groups(tmp_path)
    sources, pruned_groups, pruned_keys = [], [], []
    for i, specs in enumerate(groups):
        compact = [dataclasses.replace(s, cuda_header=compact_text(s.cuda_header), cuda_source=compact_text(s.cuda_source))
                   for s in specs]  # fmt: skip
        assert len(cuda_text(compact)) < len(cuda_text(specs))
        # pruned: the helpers get_kernel hands with each kernel; kernels whose pruned headers are
        # equal share a translation unit, compiled beside the same kernels with the full text
        by_pruned: dict[str, list[int]] = {}
        for k, spec in enumerate(compact):
            by_pruned.setdefault(prune_helpers(spec.cuda_header, spec.cuda_source), []).append(k)
        assert all(len(h) < len(compact[0].cuda_header) for h in by_pruned)
        forms = [("full", specs), ("compact", compact)]
        for g, (pruned_header, ks) in enumerate(by_pruned.items()):
            forms.append((f"pruned{g}", [dataclasses.replace(compact[k], cuda_header=pruned_header) for k in ks]))
            forms.append((f"single{g}", [specs[k] for k in ks]))
            for k in ks:  # short: one kernel per unit (its names are shortened with its own body)
                h, src = short_names(pruned_header, compact[k].cuda_source, (*specs[k].input_names, *specs[k].output_names))
                assert len(h) + len(src) < len(pruned_header) + len(compact[k].cuda_source)
                forms.append((f"short{g}_{k}", [dataclasses.replace(compact[k], cuda_header=h, cuda_source=src)]))
                forms.append((f"one{g}_{k}", [specs[k]]))
        pruned_groups.append(len(by_pruned))
        pruned_keys.append(list(by_pruned.items()))
        for form, group in forms:
            src = tmp_path / f"kernels_{i}_{form}.cu"
            src.write_text(cuda_text(group))
            sources.append(src)
    def pair(i: int, a: str, b: str) -> list[Path]:
        return [tmp_path / f"kernels_{i}_{form}.cu" for form in (a, b)]

    pairs = []
    for i in range(len(groups)):
        pairs.append(pair(i, "full", "compact"))
        pairs += [pair(i, f"pruned{g}", f"single{g}") for g in range(pruned_groups[i])]
        pairs += [pair(i, f"short{g}_{k}", f"one{g}_{k}") for g, (_, ks) in enumerate(pruned_keys[i]) for k in ks]
    assert sorted(p for two in pairs for p in two) == sorted(sources)
    failures = _nvcc_pairs_at_one_path(pairs, tmp_path)
    assert not failures, "\n\n".join(failures)

    def ptx(i: int, form: str) -> str:
        return _comparable((tmp_path / f"kernels_{i}_{form}.ptx").read_text())

    for i in range(len(groups)):
        full = ptx(i, "full")
        assert ".entry" in full and ptx(i, "compact") == full, f"kernels_{i}: the compact text compiles differently"
        for g in range(pruned_groups[i]):
            assert ptx(i, f"pruned{g}") == ptx(i, f"single{g}"), f"kernels_{i}, group {g}: the pruned text compiles differently"
        for k in range(len(groups[i])):
            g = next(g for g, (_, ks) in enumerate(pruned_keys[i]) if k in ks)
            short, one = (_symbols_in_order(ptx(i, f"{form}{g}_{k}")) for form in ("short", "one"))
            assert short == one, f"{groups[i][k].name}: the short text compiles differently"


def _nvcc_pairs_at_one_path(pairs: list[list[Path]], tmp_path: Path, paths: int = 4) -> list[str]:
    """PTX next to each source of `pairs`, the two of a pair compiled one after the other from one
    path (a pair's directory, unit.cu): nvcc's output depends on the source's path (its hash names
    internal symbols, and NVVM's choices can move with it), so the texts compared are compiled alike.
    Where a pair's PTX differs, it is compiled again from up to `paths` paths in all: NVVM can
    optimize one program two ways at one path (one g4_q4_0_moe_experts instantiation, in two of 14
    temporary directories: one vector load or two scalar ones, session 35), while two programs
    that differ differ at every path. The failures."""

    def one(job: tuple[int, list[Path]]) -> str | None:
        n, two = job
        for attempt in range(paths):
            unit = tmp_path / "one_path" / str(n) / str(attempt) / "unit.cu"
            unit.parent.mkdir(parents=True)
            for src in two:
                shutil.copyfile(src, unit)
                failure = _failure(src, _nvcc(unit, tmp_path, "ptx"))
                if failure:
                    return failure
                shutil.copyfile(unit.with_suffix(".ptx"), src.with_suffix(".ptx"))
            a, b = (_symbols_in_order(_comparable(src.with_suffix(".ptx").read_text())) for src in two)
            if a == b:
                break
        return None

    return _a_few_at_a_time(one, enumerate(pairs))


# nvcc names internal-linkage globals (cuda::std's customization-point objects) after the file
_INTERNAL = re.compile(r"_ZN\d+_INTERNAL_[0-9a-f]{8}_\d+_\w+?_cu_[0-9a-f]{8}")


def _comparable(ptx: str) -> str:
    """`ptx` without the names that carry no meaning: internal symbols and register numbers."""
    return _registers_in_order(_INTERNAL.sub("_INTERNAL_", ptx))


def _registers_in_order(ptx: str) -> str:
    """`ptx` with each virtual register named by its order of first appearance within its kind
    (%r, %rd, %f, ...): NVVM can number one program's registers two ways (two registers of one
    g4_q4_0_moe_experts instantiation moved with the path, session 33)."""
    names: dict[str, str] = {}
    per_kind: dict[str, int] = {}

    def rename(m: re.Match) -> str:
        if m.group(0) not in names:
            n = per_kind[m.group(1)] = per_kind.get(m.group(1), -1) + 1
            names[m.group(0)] = f"%{m.group(1)}_{n}"
        return names[m.group(0)]

    return re.sub(r"%([a-z]+)(\d+)\b", rename, ptx)


def _symbols_in_order(ptx: str) -> str:
    """`ptx` with each mangled symbol named by its order of first appearance: the short text
    renames shared-memory arrays, whose names PTX keeps."""
    order: dict[str, str] = {}
    return re.sub(r"_Z\w+", lambda m: order.setdefault(m.group(0), f"_SYM{len(order)}"), ptx)



@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_norm_route_largest_call_fits_the_registers(tmp_path: Path):
    """custom_kernels.router.residual_norm_route's largest accepted call (NORM_ROUTE_MAX_D,
    NORM_ROUTE_MAX_EXPERTS, NORM_ROUTE_MAX_TOP_K), f32 and bf16: ptxas' registers per thread times
    the launch's threads fit an SM's 64K (the f32 launch at 672 threads of two quads failed to start
    on the H200, session 33)."""
    import dataclasses

    from custom_kernels import router as rt
    from custom_kernels.norm import row_geometry

    spec = next(s for s in SPECS if s.name == "g4_residual_norm_route")
    d, e, k = rt.NORM_ROUTE_MAX_D, rt.NORM_ROUTE_MAX_EXPERTS, rt.NORM_ROUTE_MAX_TOP_K
    tg, _ = row_geometry(d, 1024)
    cases = [rt._norm_route_case(np.random.default_rng(0), d, e, k, dtype, 1024) for dtype in ("float32", "bfloat16")]
    largest = dataclasses.replace(spec, cases=lambda rng: cases)
    src = tmp_path / "norm_route.cu"
    src.write_text(cuda_text([largest]))
    _cuda_spec_groups(tmp_path)  # MLX's device utils stub on the include path
    res = _nvcc(src, tmp_path, "cubin", "--resource-usage")
    assert res.returncode == 0, res.stderr[-3000:]
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", res.stdout + res.stderr)]
    assert len(registers) == 2 and all(n * tg <= 65536 for n in registers), (tg, registers)
