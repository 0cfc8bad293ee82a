"""Registry of every custom kernel: the contract with the Metal emulator and the compile tests.

Each op module in ``custom_kernels`` exposes ``kernel_specs() -> list[KernelSpec]``;
``all_kernel_specs()`` imports every such module and collects them, so a new kernel is picked
up by the emulator and the compile tests without registering it anywhere else.

Conventions of ``KernelCase`` (what a harness must do to run one case):

- ``inputs``: name -> numpy array, in the kernel's ``input_names`` order. The MLX dtype of an
  input is its numpy dtype, except for the names listed in ``input_dtypes``: bfloat16 inputs are
  given as ``np.uint16`` bit patterns with ``input_dtypes[name] == "bfloat16"``.
- ``template``: [(name, value)] exactly as MLX's ``template=`` takes them, with dtypes spelled
  as MLX dtype names (``str``: "float32", "bfloat16", "float16", ...). Other values are ``int`` or
  ``bool`` (test ``isinstance(v, bool)`` before ``int``: bool is an int subclass).
- ``grid`` / ``threadgroup``: in threads, as MLX takes them (grid = total threads; here always a
  whole number of threadgroups).
- ``output_dtypes``: MLX dtype names; a "bfloat16" output is compared after converting its bits to
  float32 (``bf16_to_f32``).
- ``expected``: float64 values computed by numpy from the same inputs (dequantize-then-matmul);
  the check is ``abs(out - expected) <= atol + rtol * abs(expected)`` element-wise. Expected NaN
  entries must be NaN in the output.
- Outputs must be poisoned (e.g. filled with NaN) before the kernel runs; every element is
  written by the kernel.
"""

from __future__ import annotations

import hashlib
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

__all__ = ["KernelCase", "KernelSpec", "all_kernel_specs", "text_digest", "f32_to_bf16", "bf16_to_f32"]


@dataclass(frozen=True)
class KernelCase:
    """One launch of a kernel on small inputs with its expected outputs (see module doc)."""

    inputs: dict[str, np.ndarray]
    template: list[tuple[str, Any]]  # Any: MLX dtype name (str), int or bool
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list[tuple[int, ...]]
    output_dtypes: list[str]  # "float32" | "bfloat16" | "float16" | ...
    expected: list[np.ndarray]
    rtol: float
    atol: float
    input_dtypes: dict[str, str] = field(default_factory=dict)  # name -> MLX dtype name override
    label: str = ""  # human-readable description for test ids
    cuda_shared_memory: int = 0  # dynamic shared memory (bytes) the CUDA kernel is created with
    output_tolerances: list[tuple[float, float]] | None = None  # (rtol, atol) per output, else rtol and atol

    def __post_init__(self):
        if self.output_tolerances is not None and len(self.output_tolerances) != len(self.expected):
            raise ValueError(f"{self.label}: {len(self.output_tolerances)} output tolerances for {len(self.expected)} outputs")

    def tolerance(self, i: int) -> tuple[float, float]:
        """(rtol, atol) output i is checked with."""
        return self.output_tolerances[i] if self.output_tolerances else (self.rtol, self.atol)


@dataclass(frozen=True)
class KernelSpec:
    """One kernel source in both dialects, exactly as handed to MLX, plus its test cases."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    metal_header: str  # mx.fast.metal_kernel(header=...)
    metal_source: str  # mx.fast.metal_kernel(source=...)
    cuda_header: str  # mx.fast.cuda_kernel(header=...)
    cuda_source: str  # mx.fast.cuda_kernel(source=...)
    cases: Callable[[np.random.Generator], list[KernelCase]]  # small shapes incl. odd tails


_NOT_OP_MODULES = {"dialect", "registry"}


def all_kernel_specs() -> list[KernelSpec]:
    """Every kernel in custom_kernels, from each op module's ``kernel_specs()`` (sorted by name)."""
    import custom_kernels

    specs: list[KernelSpec] = []
    for info in pkgutil.iter_modules(custom_kernels.__path__):
        if info.name.startswith("_") or info.name in _NOT_OP_MODULES:
            continue
        module = importlib.import_module(f"custom_kernels.{info.name}")
        provider = getattr(module, "kernel_specs", None)
        if provider is not None:
            specs.extend(provider())
    names = [s.name for s in specs]
    if len(names) != len(set(names)):
        raise RuntimeError(f"duplicate kernel names in custom_kernels: {sorted(names)}")
    return sorted(specs, key=lambda s: s.name)


def text_digest(spec: KernelSpec) -> str:
    """16 hex digits of SHA-256 over both dialects' header and source: what custom_kernels/
    gpu_tested.json pins for the texts that passed ``pytest -m gpu``."""
    h = hashlib.sha256()
    for part in (spec.metal_header, spec.metal_source, spec.cuda_header, spec.cuda_source):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def f32_to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 values -> bfloat16 bit patterns (uint16), round to nearest even."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 values (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
