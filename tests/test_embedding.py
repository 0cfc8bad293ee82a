"""The embedding op (custom_kernels.embedding) on the CPU: its reference against the numpy oracle,
its input checks, the model's use of it, and the graph nodes the kernel saves a decode step (the
kernel itself runs in the Metal emulator, tests/test_metal_kernels_emulated.py, and on a GPU,
tests/test_embedding_gpu.py)."""

from __future__ import annotations

import types

import mlx.core as mx
import numpy as np
import pytest

import custom_kernels
from custom_kernels import embedding
from custom_kernels.quant_matvec import Q4_0, Q6_K, Q8_0, dequantize_f64, random_blocks
from custom_kernels.registry import bf16_to_f32, f32_to_bf16


@pytest.mark.parametrize("ggml_type", [Q8_0, Q4_0])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_reference_is_the_rounded_rows_times_the_rounded_scale(ggml_type, dtype):
    rng = np.random.default_rng(3)
    blocks = random_blocks(rng, ggml_type, (23,), 128)
    ids = np.array([[4, 22, 0]], np.int32)
    out = embedding.embed_rows(mx.array(blocks), mx.array(ids), ggml_type, 128, 128**0.5, dtype)
    assert out.shape == (1, 3, 128) and out.dtype == dtype

    def rnd(v):
        v = np.asarray(v, np.float32)
        return bf16_to_f32(f32_to_bf16(v)) if dtype == mx.bfloat16 else v

    rows = dequantize_f64(blocks, ggml_type).astype(np.float32)[ids]
    want = rnd(rnd(rows) * rnd(np.float32(128**0.5)))
    np.testing.assert_array_equal(np.asarray(out.astype(mx.float32)), want)


def test_bad_inputs_raise():
    blocks = mx.zeros((5, 34 * 2), mx.uint8)
    ids = mx.array([1], mx.int32)
    with pytest.raises(ValueError, match="Q8_0 or Q4_0"):
        embedding.embed_rows(blocks, ids, Q6_K, 64, 1.0, mx.float32)
    with pytest.raises(ValueError, match="blocks uint8"):
        embedding.embed_rows(blocks, ids, Q8_0, 96, 1.0, mx.float32)
    with pytest.raises(ValueError, match="int32"):
        embedding.embed_rows(blocks, ids.astype(mx.uint32), Q8_0, 64, 1.0, mx.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        embedding.embed_rows(blocks, ids, Q8_0, 48, 1.0, mx.float32)


def test_only_q8_0_and_q4_0_rows_in_f32_or_bf16_take_the_kernel():
    assert embedding.embedding_supported(Q8_0, mx.bfloat16) and embedding.embedding_supported(Q4_0, mx.float32)
    assert not embedding.embedding_supported(Q6_K, mx.bfloat16)
    assert not embedding.embedding_supported(Q8_0, mx.float16)


def _eseries_cfg():
    import decode

    from gemma4_mlx.config import FULL, SLIDING

    return decode._tiny(head_dim=256, global_head_dim=512, num_hidden_layers=4, num_key_value_heads=1,
                        layer_types=[SLIDING] * 3 + [FULL], hidden_size_per_layer_input=64,
                        vocab_size_per_layer_input=2048)  # fmt: skip


def test_the_kernel_makes_each_table_one_node_of_the_step(graph_count, monkeypatch):
    """With family "embedding" an E-series step's two scaled embeddings (token and per-layer) are
    one kernel each: the gathers go, and the step has at least 20 nodes fewer."""
    cfg = _eseries_cfg()
    monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, "embedding")  # a CUDA default
    base = graph_count.step_counts(cfg, 40)["body"]
    monkeypatch.delenv(custom_kernels.KERNELS_OFF_ENV)
    fused = graph_count.step_counts(cfg, 40)["body"]
    assert base["Gather"] >= 2 and fused.get("Gather", 0) == base["Gather"] - 2
    assert fused["CustomKernel"] - base["CustomKernel"] == 2
    assert sum(base.values()) - sum(fused.values()) >= 20


def test_model_embeddings_unchanged_on_the_reference_path(graph_count):  # the fixture puts bench/ on the path
    """Model.embed and the per-layer inputs through scaled_embedding give the bits of the MLX ops
    they replaced (a BlockEmbedding's rows times the scale rounded to its dtype)."""
    import decode

    model = decode.build_ours(_eseries_cfg())
    tm = model.model
    tokens = mx.array([[5, 17, 1]], mx.int32)
    for table, scale, got in ((tm.embed_tokens, tm.cfg.hidden_size**0.5, tm.embed(tokens)),
                              (tm.embed_tokens_per_layer, tm.cfg.hidden_size_per_layer_input**0.5,
                               tm.embed_tokens_per_layer.scaled(tokens, tm.cfg.hidden_size_per_layer_input**0.5))):  # fmt: skip
        e = table(tokens)
        want = e * mx.array(scale, dtype=mx.float32).astype(e.dtype)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got.astype(mx.float32)), np.asarray(want.astype(mx.float32)))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_kernels_scale_is_rounded_as_mlx_rounds_it(dtype):
    """The kernel gets the scale rounded on the host (a constant, not graph nodes): the value MLX's
    cast gives, for the scales Gemma 4 uses (sqrt of every hidden and per-layer width)."""
    for width in (256, 1536, 2560, 2816, 3840, 5376):
        want = mx.array(width**0.5, dtype=mx.float32).astype(dtype).astype(mx.float32).item()
        assert embedding._rounded(width**0.5, dtype) == want


def test_empty_and_very_long_token_arrays_take_the_reference(monkeypatch):
    """No launch for zero tokens (it would write past an empty output) or for more tokens than a
    launch's grid takes: the kernel is never called, here where a call would raise."""
    def no_kernel(*a, **k):
        raise AssertionError("the kernel was called")

    monkeypatch.setattr(embedding, "use_kernel", lambda family: True)
    monkeypatch.setattr(embedding, "_EMBED", types.SimpleNamespace(kernel=no_kernel))
    blocks = mx.array(random_blocks(np.random.default_rng(0), Q8_0, (4,), 64))
    assert embedding.embed_rows(blocks, mx.zeros((1, 0), mx.int32), Q8_0, 64, 8.0, mx.bfloat16).shape == (1, 0, 64)
    long = mx.zeros((embedding.MAX_TOKENS + 1,), mx.int32)
    assert embedding.embed_rows(blocks, long, Q8_0, 64, 8.0, mx.bfloat16).shape == (embedding.MAX_TOKENS + 1, 64)
    with pytest.raises(AssertionError, match="kernel was called"):
        embedding.embed_rows(blocks, mx.zeros((3,), mx.int32), Q8_0, 64, 8.0, mx.bfloat16)


def test_other_block_types_are_scaled_by_the_caller():
    """A Q6_K table (official files' tied embeddings): BlockEmbedding.scaled declines (None) and
    scaled_embedding multiplies the dequantized rows by the scale rounded to the dtype."""
    from gemma4_mlx.model import scaled_embedding
    from gemma4_mlx.quantized import BlockEmbedding

    table = BlockEmbedding(8, 256, Q6_K, mx.bfloat16)
    table.blocks = mx.array(random_blocks(np.random.default_rng(2), Q6_K, (8,), 256))
    tokens = mx.array([[1, 7]], mx.int32)
    assert table.scaled(tokens, 16.0) is None
    got = scaled_embedding(table, tokens, 16.0)
    want = table(tokens) * mx.array(16.0, dtype=mx.bfloat16)
    assert got.dtype == mx.bfloat16
    np.testing.assert_array_equal(np.asarray(got.astype(mx.float32)), np.asarray(want.astype(mx.float32)))
