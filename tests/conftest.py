"""Shared pytest setup: the tiny Gemma 4 fixture checkpoints of tests/fixtures.py."""

import gemma4_mlx  # noqa: F401  first: puts a fast BLAS under MLX before anything imports mlx.core

from fixtures import *  # noqa: F401,F403  (session fixtures: dense_fixture, moe_fixture, eseries_fixture, ...)


import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def graph_count(monkeypatch):
    """bench/graph_count.py, with what its pretend_cuda() patches (backends, mx.fast ops) restored
    after the test."""
    import mlx.core as mx

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import graph_count as gc

    import custom_kernels
    from custom_kernels import attention, quant_matvec, sampling

    for module in (custom_kernels, quant_matvec, attention, sampling):
        if hasattr(module, "backend"):
            monkeypatch.setattr(module, "backend", module.backend)
    for name in ("cuda_kernel", "rms_norm", "rope"):
        monkeypatch.setattr(mx.fast, name, getattr(mx.fast, name))
    yield gc
    custom_kernels.clear_kernel_cache()
