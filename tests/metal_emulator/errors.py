"""Errors raised by the Metal emulator; every message names the kernel and the failed check."""

from __future__ import annotations


class EmulatorError(AssertionError):
    """A kernel failed an emulator check.

    ``kernel`` is the kernel name given to ``metal_kernel``; ``check`` names the check, e.g.
    "compile", "out_of_bounds", "oob_write", "threadgroup_oob", "array_bounds",
    "barrier_divergence", "simd_divergence", "simd_nonuniform_argument", "lane_order",
    "mismatch", "unwritten_output". Subclass of AssertionError so pytest reports it as a failure.
    """

    def __init__(self, kernel: str, check: str, detail: str):
        self.kernel = kernel
        self.check = check
        self.detail = detail
        super().__init__(f"metal kernel '{kernel}': {check}: {detail}")


class CompileError(EmulatorError):
    """The generated Metal text does not compile against the emulator's shim (check "compile")."""

    def __init__(self, kernel: str, detail: str, source_path: str = ""):
        self.source_path = source_path
        super().__init__(kernel, "compile", detail)
