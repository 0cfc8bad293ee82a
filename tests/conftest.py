"""Shared pytest setup: the tiny Gemma 4 fixture checkpoints of tests/fixtures.py, no
GEMMA4_MLX_KERNELS_OFF, and bench/graph_count.py as a fixture."""

import gemma4_mlx  # noqa: F401,I001  first: puts a fast BLAS under MLX before anything imports mlx.core

import os
import sys
from pathlib import Path

import pytest

from custom_kernels import KERNELS_OFF_ENV
from fixtures import *  # noqa: F401,F403  (session fixtures: dense_fixture, moe_fixture, eseries_fixture, ...)


def pytest_configure(config):
    """Tests choose kernel families themselves: a GEMMA4_MLX_KERNELS_OFF in the caller's shell would
    silently move a `pytest -m gpu` run (the one gpu_tested.json pins) off the kernels it tests,
    including the session fixtures' weight format, so it is dropped before anything is built."""
    os.environ.pop(KERNELS_OFF_ENV, None)


@pytest.fixture
def graph_count(monkeypatch):
    """bench/graph_count.py, with what its pretend_cuda() patches (backends, mx.fast ops) restored
    after the test, and its stand-ins' cached zero outputs freed (at real layer shapes they hold
    megabytes that later tests' memory checks would count)."""
    import mlx.core as mx

    bench = str(Path(__file__).resolve().parents[1] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import graph_count as gc

    import custom_kernels

    for module in gc.PRETEND_MODULES:
        if hasattr(module, "backend"):
            monkeypatch.setattr(module, "backend", module.backend)
    monkeypatch.setattr(custom_kernels, "_device_arch", custom_kernels._device_arch)
    for name in ("cuda_kernel", "rms_norm", "rope"):
        monkeypatch.setattr(mx.fast, name, getattr(mx.fast, name))
    yield gc
    custom_kernels.clear_kernel_cache()
    gc._ZEROS.clear()
