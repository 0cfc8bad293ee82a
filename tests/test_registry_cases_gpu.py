"""Every kernel's CUDA text on its registry cases, on a GPU: the small launches with odd tails that
the Metal emulator runs (custom_kernels.registry), here through mx.fast.cuda_kernel with outputs
poisoned beforehand, compared with the cases' float64 expectations by the emulator's own check.

It covers every registered text, CUDA-only ones included, in a few seconds, which makes it the file
compute-sanitizer runs first (bench/tools/memcheck.sh). Run with ``pytest -m gpu``."""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import custom_kernels
from custom_kernels.registry import all_kernel_specs

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/metal_emulator, whatever the import mode
from metal_emulator.check import compare  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(custom_kernels.backend() != "cuda", reason="needs MLX's CUDA backend"),
]

SPECS = [spec for spec in all_kernel_specs() if spec.cuda_source]
# seeded per kernel as in tests/test_metal_kernels_emulated.py: the same inputs as the emulator's
CASES = [(spec, i, case) for spec in SPECS
         for i, case in enumerate(spec.cases(np.random.default_rng(zlib.crc32(spec.name.encode()))))]  # fmt: skip
INT_POISON = -7.0  # an index no kernel writes


def _launch(spec, case) -> list[np.ndarray]:
    kernel = mx.fast.cuda_kernel(name=custom_kernels.mlx_kernel_name(spec.name, spec.cuda_header, spec.cuda_source),
                                 input_names=list(spec.input_names), output_names=list(spec.output_names),
                                 source=spec.cuda_source, header=spec.cuda_header,
                                 shared_memory=case.cuda_shared_memory)  # fmt: skip
    inputs = []
    for name in spec.input_names:
        a = mx.array(case.inputs[name])
        override = case.input_dtypes.get(name)
        inputs.append(a.view(getattr(mx, override)) if override else a)
    out_dtypes = [getattr(mx, d) for d in case.output_dtypes]
    poison = getattr(case, "init_value", None)
    if poison is None:
        poison = float("nan") if any(mx.issubdtype(d, mx.floating) for d in out_dtypes) else INT_POISON
    outs = kernel(inputs=inputs, output_shapes=case.output_shapes, output_dtypes=out_dtypes, grid=case.grid,
                  threadgroup=case.threadgroup, template=[(k, getattr(mx, v) if isinstance(v, str) else v)
                                                          for k, v in case.template],
                  init_value=poison)  # fmt: skip
    return [np.array(o.astype(mx.float32)) if o.dtype == mx.bfloat16 else np.array(o) for o in outs]


def check(spec, case, outs: list[np.ndarray]) -> None:
    """Raise metal_emulator's EmulatorError unless every output matches the case's expectation."""
    for i, (name, out, dtype, expected) in enumerate(zip(spec.output_names, outs, case.output_dtypes, case.expected)):
        # bf16 outputs arrive as float32 values, so compare them as float32
        compare(spec.name, name, out, "float32" if dtype == "bfloat16" else dtype, expected, *case.tolerance(i),
                case.label)  # fmt: skip


@pytest.mark.parametrize("spec,index,case", CASES, ids=[f"{spec.name}-{i}" for spec, i, _ in CASES])
def test_cuda_text_on_registry_case(spec, index, case):
    check(spec, case, _launch(spec, case))


def test_every_kernel_has_a_case():
    """A registered CUDA text without cases would not be covered here (nor under memcheck)."""
    assert {spec.name for spec, _, _ in CASES} == {spec.name for spec in SPECS}
