"""CPU check of tests/test_registry_cases_gpu.py's harness (the GPU file only runs on CUDA): with a
stand-in for mx.fast.cuda_kernel that returns each case's expected values, every case passes the
comparison; with one that writes nothing (the poison stays), every case fails it. So a harness bug
cannot make the GPU run pass or fail for the wrong reason."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import test_registry_cases_gpu as gpu_cases
from metal_emulator.errors import EmulatorError


def _stand_in(case, write: bool):
    """mx.fast.cuda_kernel's stand-in for one case: checks what the harness hands over, then returns
    the expected values (write) or the poisoned outputs as they were before the launch."""

    def factory(*, name, input_names, output_names, source, header, shared_memory):
        assert shared_memory == case.cuda_shared_memory
        def call(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template, init_value):
            assert all(not isinstance(v, str) for _, v in template)  # dtype names became MLX dtypes
            for n, a in zip(input_names, inputs, strict=True):
                want = case.input_dtypes.get(n)
                assert a.dtype == (getattr(mx, want) if want else mx.array(case.inputs[n]).dtype)
            if write:  # a case may check only its first outputs
                unchecked = [mx.zeros(s, d) for s, d in zip(output_shapes[len(case.expected):],
                                                            output_dtypes[len(case.expected):])]  # fmt: skip
                return [mx.array(e).astype(d) for e, d in zip(case.expected, output_dtypes)] + unchecked
            return [mx.full(s, init_value).astype(d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

        return call

    return factory


@pytest.mark.parametrize("write", [True, False], ids=["written", "unwritten"])
def test_harness_passes_right_outputs_and_fails_unwritten(monkeypatch, write):
    failed = []
    for spec, i, case in gpu_cases.CASES:
        monkeypatch.setattr(mx.fast, "cuda_kernel", _stand_in(case, write), raising=False)
        try:
            gpu_cases.check(spec, case, gpu_cases._launch(spec, case))
        except EmulatorError:
            failed.append(f"{spec.name}-{i}")
    assert failed == ([] if write else [f"{s.name}-{i}" for s, i, _ in gpu_cases.CASES])
    assert all(any(np.isfinite(e).any() for e in c.expected) for _, _, c in gpu_cases.CASES)
