"""GPU: the embedding kernel (custom_kernels.embedding) bit-equal to its MLX-ops reference at the
real row widths (31B, 26B-A4B, E4B, E2B token rows; E4B's and E2B's per-layer rows), Q8_0 and Q4_0,
f32 and bf16, one and several tokens; ids outside the table give NaN rows. Run with ``pytest -m gpu``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import custom_kernels
from custom_kernels import embedding
from custom_kernels.quant_matvec import Q4_0, Q8_0, random_blocks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(custom_kernels.backend() == "cpu", reason="no GPU backend (CPU-only MLX build)"),
]

WIDTHS = [5376, 2816, 2560, 1536, 42 * 256, 35 * 256]


@pytest.mark.parametrize("k", WIDTHS)
@pytest.mark.parametrize("ggml_type", [Q8_0, Q4_0])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_kernel_equals_reference(k, ggml_type, dtype, monkeypatch):
    rng = np.random.default_rng(k)
    vocab = 300
    blocks = mx.array(random_blocks(rng, ggml_type, (vocab,), k))
    for ids in ([[7]], [[0, 299, 123, 7, 7]]):
        tokens = mx.array(ids, mx.int32)
        want = embedding.embed_rows_reference(blocks, tokens, ggml_type, k, k**0.5, dtype)
        monkeypatch.delenv(custom_kernels.KERNELS_OFF_ENV, raising=False)  # a CUDA default
        assert custom_kernels.use_kernel("embedding")
        got = embedding.embed_rows(blocks, tokens, ggml_type, k, k**0.5, dtype)
        assert got.shape == want.shape == (*tokens.shape, k) and got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got.astype(mx.float32)), np.asarray(want.astype(mx.float32)))


def test_ids_outside_the_table_give_nan_rows(monkeypatch):
    rng = np.random.default_rng(0)
    blocks = mx.array(random_blocks(rng, Q8_0, (10,), 256))
    monkeypatch.delenv(custom_kernels.KERNELS_OFF_ENV, raising=False)  # a CUDA default
    out = np.asarray(embedding.embed_rows(blocks, mx.array([3, 10, -1, 9], mx.int32), Q8_0, 256, 16.0, mx.bfloat16)
                     .astype(mx.float32))  # fmt: skip
    assert np.isnan(out[1]).all() and np.isnan(out[2]).all()
    assert np.isfinite(out[0]).all() and np.isfinite(out[3]).all()
