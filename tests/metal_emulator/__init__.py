"""CPU emulator for the Metal kernels of custom_kernels (test-side tool; see README.md).

Public API:
- ``metal_kernel(name, input_names, output_names, source, header="", ...)`` -> ``EmulatedKernel``,
  called like an ``mx.fast.metal_kernel`` object; returns numpy outputs.
- ``check_case(kernel, case)``: run one ``KernelCase`` and compare with its expected outputs.
- ``generate_metal_source(...)``: the exact Metal text MLX would compile.
- ``EmulatorError`` / ``CompileError``: failures, naming the kernel and the check.
"""

from .check import check_case
from .errors import CompileError, EmulatorError
from .kernel import EmulatedKernel, metal_kernel
from .mlx_source import InputInfo, generate as generate_metal_source

__all__ = ["metal_kernel", "EmulatedKernel", "check_case", "generate_metal_source", "InputInfo",
           "EmulatorError", "CompileError"]
