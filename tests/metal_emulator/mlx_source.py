"""The exact Metal text ``mx.fast.metal_kernel`` compiles for one call, and its parameter list.

Follows MLX's write_signature / write_template (mlx/backend/common/metal_kernel.cpp):

- ``header`` first, then ``template <typename T, int N, bool B>`` when template args are given;
- ``[[kernel]] void custom_kernel_<name>[_<template hash>]_<input dtypes>_<output dtypes>(``;
- per input: ``const device T* x [[buffer(i)]]`` (``constant`` when it has fewer than 8 elements,
  ``const constant T& x`` when 0-d), then, only for ndim > 0 and only if the *source* contains the
  substring, ``const constant int* x_shape``, ``const constant int64_t* x_strides``,
  ``const constant int& x_ndim``;
- per output: ``device T* y`` (``device atomic<T>* y`` with atomic_outputs);
- the thread-position attributes whose names occur in the source, in MLX's fixed order;
- the body, ``}``, and for templates an explicit instantiation with ``[[host_name(...)]]``.

MLX (before the header) prepends its Metal utils; the emulator's shim stands in for them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from . import dtypes

MAX_CONSTANT_ARRAY_SIZE = 8

# (attribute, Metal type) in the order MLX lists them.
METAL_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)


@dataclass(frozen=True)
class InputInfo:
    """What the signature depends on for one input: dtype name, ndim and element count."""

    dtype: str
    ndim: int
    size: int


@dataclass(frozen=True)
class Param:
    """One kernel parameter.

    kind: "input" | "shape" | "strides" | "ndim" | "output" | "attribute"; ``index`` is the
    input/output position for buffers; ``ctype`` the C type of one element (attributes: uint/uint3);
    ``by_ref`` for ``const constant T&`` parameters.
    """

    kind: str
    name: str
    ctype: str
    index: int = -1
    by_ref: bool = False
    atomic: bool = False


@dataclass(frozen=True)
class GeneratedKernel:
    """The MLX text (``text``), the kernel function name, its template args (``<...>``) and params."""

    text: str
    function_name: str
    template_args: str
    params: tuple[Param, ...]


def _template_value(value: Any) -> tuple[str, str]:
    """(C++ template parameter kind, MLX's spelling of the value) for one template argument."""
    if isinstance(value, bool):
        return "bool", "1" if value else "0"
    if isinstance(value, int):
        return "int", str(value)
    return "typename", dtypes.get(value).metal


def template_text(template: Sequence[tuple[str, Any]]) -> str:
    """MLX's write_template: ``<float, 4, 1>`` (bools as 1/0)."""
    return "<" + ", ".join(_template_value(v)[1] for _, v in template) + ">"


def function_name(name: str, template: Sequence[tuple[str, Any]], inputs: Sequence[InputInfo],
                  output_dtypes: Sequence[str]) -> str:
    """``custom_kernel_<name>`` + template hash + one suffix per input and output dtype."""
    fn = "custom_kernel_" + name
    if template:
        h = re.sub(r"<|>|(, )", "_", template_text(template))[:-1]
        fn += "_" + h
    for info in inputs:
        fn += "_" + dtypes.get(info.dtype).metal
        if info.ndim == 0:
            fn += "s"
        elif info.size < MAX_CONSTANT_ARRAY_SIZE:
            fn += "c"
    for d in output_dtypes:
        fn += "_" + dtypes.get(d).metal
    return fn


def used_attributes(source: str) -> list[tuple[str, str]]:
    """The thread-position attributes MLX adds for ``source`` (substring match, MLX order)."""
    return [(a, t) for a, t in METAL_ATTRIBUTES if a in source]


def generate(name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
             header: str, inputs: Sequence[InputInfo], output_dtypes: Sequence[str],
             template: Sequence[tuple[str, Any]] = (), atomic_outputs: bool = False) -> GeneratedKernel:
    """The full Metal text MLX builds for this call (minus MLX's utils prelude)."""
    if len(inputs) != len(input_names):
        raise ValueError(f"expected {len(input_names)} inputs, got {len(inputs)}")
    if len(output_dtypes) != len(output_names):
        raise ValueError(f"expected {len(output_names)} output dtypes, got {len(output_dtypes)}")
    if not output_names:
        raise ValueError("[metal_kernel] Must specify at least one output.")
    fname = function_name(name, template, inputs, output_dtypes)
    attributes = used_attributes(source)
    params: list[Param] = []
    out = [header]
    if template:
        out.append("template <" + ", ".join(f"{_template_value(v)[0]} {n}" for n, v in template) + ">\n")
    out.append(f"[[kernel]] void {fname}(\n")
    index = 0
    for i, (n, info) in enumerate(zip(input_names, inputs)):
        ctype = dtypes.get(info.dtype).metal
        location = "constant" if info.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if info.ndim == 0 else "*"
        out.append(f"  const {location} {ctype}{ref} {n} [[buffer({index})]],\n")
        params.append(Param("input", n, ctype, i, by_ref=info.ndim == 0))
        index += 1
        if info.ndim > 0:
            if f"{n}_shape" in source:
                out.append(f"  const constant int* {n}_shape [[buffer({index})]],\n")
                params.append(Param("shape", f"{n}_shape", "int", i))
                index += 1
            if f"{n}_strides" in source:
                out.append(f"  const constant int64_t* {n}_strides [[buffer({index})]],\n")
                params.append(Param("strides", f"{n}_strides", "int64_t", i))
                index += 1
            if f"{n}_ndim" in source:
                out.append(f"  const constant int& {n}_ndim [[buffer({index})]],\n")
                params.append(Param("ndim", f"{n}_ndim", "int", i, by_ref=True))
                index += 1
    n_in = len(inputs)
    for i, (n, d) in enumerate(zip(output_names, output_dtypes)):
        ctype = dtypes.get(d).metal
        t = f"atomic<{ctype}>" if atomic_outputs else ctype
        out.append(f"  device {t}* {n} [[buffer({index})]]")
        # MLX's own end-of-list test (counts inputs and outputs, not shape parameters).
        if index < n_in + len(output_names) - 1 or attributes:
            out.append(",\n")
        else:
            out.append(") {\n")
        params.append(Param("output", n, ctype, i, atomic=atomic_outputs))
        index += 1
    for k, (attr, t) in enumerate(attributes):
        out.append(f"  {t} {attr} [[{attr}]]")
        out.append(",\n" if k < len(attributes) - 1 else ") {\n")
        params.append(Param("attribute", attr, t))
    out.append(source)
    out.append("\n}\n")
    targs = ""
    if template:
        targs = template_text(template)
        tdef = fname + targs
        out.append(f'\ntemplate [[host_name("{fname}")]] [[kernel]] decltype({tdef}) {tdef};\n')
    return GeneratedKernel("".join(out), fname, targs, tuple(params))
