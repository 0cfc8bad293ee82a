"""Run one test case (custom_kernels.registry.KernelCase, duck-typed) and compare with its expectation.

Comparison (the registry's contract): outputs are converted to float64 (bfloat16 bits -> float32
exactly), and every element must satisfy ``|out - expected| <= atol + rtol * |expected|``; an
expected NaN must be NaN. Failures raise EmulatorError with check "unwritten_output" (the element
still holds the poison bit pattern the output was filled with) or "mismatch".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import dtypes
from .errors import EmulatorError
from .kernel import EmulatedKernel

_POISON = {2: np.uint16(0xFFA5), 4: np.uint32(0xFFA5FFA5), 8: np.uint64(0xFFA5FFA5FFA5FFA5)}


def as_float64(values: np.ndarray, dtype: str) -> np.ndarray:
    """Output/expected values as float64; bfloat16 given as uint16 bits is decoded."""
    a = np.asarray(values)
    if dtype == "bfloat16" and a.dtype == np.uint16:
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float64)


def _poisoned(out: np.ndarray) -> np.ndarray:
    pattern = _POISON.get(out.itemsize)
    if pattern is None or out.dtype == np.bool_:
        return np.zeros(out.shape, dtype=bool)
    return out.view(pattern.dtype) == pattern


def compare(kernel_name: str, output_name: str, out: np.ndarray, dtype: str, expected: np.ndarray,
            rtol: float, atol: float, label: str = "") -> None:  # fmt: skip
    """Raise EmulatorError unless ``out`` matches ``expected`` within tolerances (module doc)."""
    where = f" [{label}]" if label else ""
    exp = as_float64(expected, dtype)
    if exp.shape != out.shape:
        raise EmulatorError(kernel_name, "mismatch",
                            f"output '{output_name}'{where}: shape {out.shape}, expected {exp.shape}")
    poison = _poisoned(out) & ~np.isnan(exp)
    if poison.any():
        idx = np.argwhere(poison)
        raise EmulatorError(kernel_name, "unwritten_output",
                            f"output '{output_name}'{where}: {len(idx)} of {out.size} elements still hold the "
                            f"poison pattern (never written, or computed from poison: a read of unwritten "
                            f"threadgroup memory or out of bounds), first at index {tuple(int(v) for v in idx[0])}")  # fmt: skip
    got = as_float64(out, dtype)
    with np.errstate(invalid="ignore"):
        ok = np.abs(got - exp) <= atol + rtol * np.abs(exp)
    ok |= np.isnan(got) & np.isnan(exp)
    ok |= (got == exp)  # equal infinities
    if not ok.all():
        bad = np.argwhere(~ok)
        i = tuple(int(v) for v in bad[0])
        with np.errstate(invalid="ignore"):
            err = np.nanmax(np.where(ok, 0.0, np.abs(got - exp)))
        raise EmulatorError(kernel_name, "mismatch",
                            f"output '{output_name}'{where}: {len(bad)} of {out.size} elements outside "
                            f"rtol={rtol} atol={atol}; first at index {i}: got {got[i]!r}, expected {exp[i]!r}; "
                            f"max abs error {err:.3g}")  # fmt: skip


def check_case(kernel: EmulatedKernel, case: Any, label: str = "") -> list[np.ndarray]:
    """Run ``case`` (KernelCase) through ``kernel`` and compare every output; returns the outputs."""
    overrides = getattr(case, "input_dtypes", {}) or {}
    unknown = set(case.inputs) - set(kernel.input_names)
    missing = [n for n in kernel.input_names if n not in case.inputs]
    if unknown or missing:
        raise ValueError(f"case inputs {sorted(case.inputs)} do not match {kernel.input_names}")
    outs = kernel(
        inputs=[case.inputs[n] for n in kernel.input_names],
        input_dtypes=[overrides.get(n) for n in kernel.input_names],
        output_shapes=case.output_shapes,
        output_dtypes=case.output_dtypes,
        grid=case.grid,
        threadgroup=case.threadgroup,
        template=case.template,
        init_value=getattr(case, "init_value", None),
    )
    label = label or getattr(case, "label", "")
    for i, (name, out, dtype, exp) in enumerate(zip(kernel.output_names, outs, case.output_dtypes, case.expected)):
        rtol, atol = case.tolerance(i) if hasattr(case, "tolerance") else (case.rtol, case.atol)
        compare(kernel.name, name, out, dtypes.dtype_name(dtype), exp, rtol, atol, label)
    return outs
