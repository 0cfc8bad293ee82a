"""Every Metal kernel of custom_kernels, run on the CPU Metal emulator against its reference.

Kernels are found through ``custom_kernels.registry.all_kernel_specs()`` (each op module's
``kernel_specs()``), so a new kernel is covered as soon as it is registered. Each KernelSpec's
``cases(rng)`` gives small launches (odd tails included) with numpy expectations; every case is
run with the exact ``metal_source``/``metal_header`` handed to ``mx.fast.metal_kernel``, in forward
and reverse lane order, on guarded, poisoned buffers (see tests/metal_emulator/README.md).
Test ids are ``<kernel name>-<case index>``.
"""

from __future__ import annotations

import os
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from custom_kernels.registry import KernelSpec, all_kernel_specs

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/metal_emulator, whatever the import mode
from metal_emulator import CompileError, EmulatedKernel, check_case, metal_kernel  # noqa: E402

SPECS: list[KernelSpec] = all_kernel_specs()
_KERNELS: dict[str, EmulatedKernel] = {}


def _kernel(spec: KernelSpec) -> EmulatedKernel:
    k = _KERNELS.get(spec.name)
    if k is None:
        k = metal_kernel(spec.name, spec.input_names, spec.output_names, spec.metal_source, spec.metal_header,
                         atomic_outputs=getattr(spec, "atomic_outputs", False))  # fmt: skip
        _KERNELS[spec.name] = k
    return k


def _cases(spec: KernelSpec) -> list:
    # Seeded per kernel, so adding a kernel does not change the other kernels' inputs.
    return spec.cases(np.random.default_rng(zlib.crc32(spec.name.encode())))


CASES = [(spec, i, case) for spec in SPECS if spec.metal_source for i, case in enumerate(_cases(spec))]


@pytest.fixture(scope="module", autouse=True)
def _compile_all_in_parallel():
    """Build every kernel instantiation up front on all cores (cached by hash across runs).

    Compile errors are left for the individual test to report."""

    def build(item):
        spec, _, case = item
        try:
            _kernel(spec).prepare(
                inputs=[case.inputs[n] for n in spec.input_names],
                input_dtypes=[case.input_dtypes.get(n) for n in spec.input_names],
                output_dtypes=case.output_dtypes, template=case.template)  # fmt: skip
        except (CompileError, ValueError, TypeError):
            pass

    for spec in SPECS:
        _kernel(spec)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(build, CASES))


def test_every_kernel_has_cases():
    """A registered Metal kernel without test cases would silently escape the emulator."""
    assert SPECS, "custom_kernels registers no kernel"
    empty = [s.name for s in SPECS if s.metal_source and not _cases(s)]
    assert not empty, f"kernels without emulator cases: {empty}"


@pytest.mark.parametrize("spec, index, case", [pytest.param(*c, id=f"{c[0].name}-{c[1]}") for c in CASES])
def test_metal_kernel_emulated(spec: KernelSpec, index: int, case) -> None:
    label = f"case {index}" + (f": {case.label}" if getattr(case, "label", "") else "")
    check_case(_kernel(spec), case, label)
