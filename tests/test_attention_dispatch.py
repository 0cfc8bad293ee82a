"""Which decode-attention kernels the real models' layers launch on an H200 (CUDA sm_90), counted on
the CPU: bench/graph_count.py's stand-in kernels record every launch of one decode step of a
two-layer model (one sliding, one full layer) with each preset's attention geometry (heads, kv
heads, head dims, window) and a full layer's capacity as the decode step sizes it."""

from __future__ import annotations

import dataclasses
import re

import mlx.core as mx
import pytest

# layer -> the g4_attn* kernels one decode token launches there, by default (CUDA sm_90)
EXPECTED = {
    # sliding layers (2 query rows per kv head, E4B's 4): the f32-FMA one launch (attention_fused);
    # full layers with 8 rows (31B, 26B-A4B) or 4 (E4B): g4_attn_decode_mma8 (attention_mma8),
    # with 16 (12B): g4_attn_decode_mma_staged (attention_mma_staged, Hopper); then the wide merge
    "31B": (["g4_attn_decode"], ["g4_attn_decode_mma8", "g4_attn_decode_merge_wide"]),
    "26B-A4B": (["g4_attn_decode"], ["g4_attn_decode_mma8", "g4_attn_decode_merge_wide"]),
    "12B": (["g4_attn_decode"], ["g4_attn_decode_mma_staged", "g4_attn_decode_merge_wide"]),
    "E4B": (["g4_attn_decode"], ["g4_attn_decode_mma8", "g4_attn_decode_merge_wide"]),
    # E2B's one kv head gives 8 rows on both layer types; its sliding ring's merge is too large for
    # the one launch, so the sliding layers take the tensor-core kernel too
    "E2B": (["g4_attn_decode_mma8", "g4_attn_decode_merge_wide"], ["g4_attn_decode_mma8", "g4_attn_decode_merge_wide"]),
}


def _launches(graph_count, monkeypatch, cfg, context: int, one_buffer: bool = False) -> list[str]:
    """Names of the kernels one uncompiled decode step of `cfg` launches (stand-ins, in call order);
    one_buffer: the caches' K and V in one buffer (kv_one_write)."""
    from gemma4_mlx.cache import make_static

    model, cache = graph_count._model_and_caches(cfg, context, True)  # pretends CUDA sm_90 first
    calls: list[str] = []

    def recording(**kw):
        launch, name = graph_count._stand_in_kernel(**kw), re.sub(r"_[0-9a-f]{16}$", "", kw["name"])

        def call(**args):
            calls.append(name)
            return launch(**args)

        return call

    monkeypatch.setattr(mx.fast, "cuda_kernel", recording)
    import custom_kernels

    custom_kernels.clear_kernel_cache()
    caches = make_static(cache, -(-(context + 8) // 256) * 256, one_buffer)
    mx.eval(model.model(mx.array([[3]], mx.int32), caches))
    return calls


def _preset_launches(graph_count, monkeypatch, name: str, one_buffer: bool = False) -> list[str]:
    import decode

    from gemma4_mlx.config import FULL, SLIDING

    preset = decode.preset(name)
    cfg = dataclasses.replace(preset, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                              layer_types=[SLIDING, FULL], vocab_size=2048, num_kv_shared_layers=0,
                              enable_moe_block=False, hidden_size_per_layer_input=0)  # fmt: skip
    spec = {s.type: (s.num_heads, s.num_kv_heads, s.head_dim, s.sliding_window) for s in cfg.layers}
    assert spec == {s.type: (s.num_heads, s.num_kv_heads, s.head_dim, s.sliding_window) for s in preset.layers}
    return _launches(graph_count, monkeypatch, cfg, 4096, one_buffer)


def _attention_launches(graph_count, monkeypatch, name: str) -> list[str]:
    return [c for c in _preset_launches(graph_count, monkeypatch, name) if c.startswith("g4_attn")]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_attention_kernels_of_each_model(graph_count, monkeypatch, name):
    sliding, full = EXPECTED[name]
    calls = _attention_launches(graph_count, monkeypatch, name)
    assert calls == sliding + full, f"{name}: {calls}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_attention_kernels_without_mma8_and_staged(graph_count, monkeypatch, name):
    """With attention_mma8 and attention_mma_staged off, layers of 8 or more rows per kv head take
    g4_attn_decode_mma (MMA_MIN_ROWS) and E4B's full layers (4 rows) the f32-FMA partitions and
    merge; the one-launch sliding layers are unchanged."""
    import custom_kernels

    monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, "attention_mma8,attention_mma_staged")
    tensor_cores = ["g4_attn_decode_mma", "g4_attn_decode_merge_wide"]
    sliding, full = EXPECTED[name]
    sliding = tensor_cores if name == "E2B" else sliding
    full = ["g4_attn_decode_partial", "g4_attn_decode_merge"] if name == "E4B" else tensor_cores
    assert _attention_launches(graph_count, monkeypatch, name) == sliding + full


def test_attention_kernels_below_hopper(graph_count, monkeypatch):
    """On sm_80 (no bulk copies) 12B's full layer (16 rows) falls back to g4_attn_decode_mma; the
    8-row layers keep mma8 (it needs only mma.sync)."""
    monkeypatch.setattr(graph_count, "PRETEND_ARCH", 80)
    assert _attention_launches(graph_count, monkeypatch, "12B") == [
        "g4_attn_decode", "g4_attn_decode_mma", "g4_attn_decode_merge_wide"]  # fmt: skip
    assert _attention_launches(graph_count, monkeypatch, "31B") == ["g4_attn_decode", *EXPECTED["31B"][1]]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_one_buffer_caches_launch_the_same_attention_kernels(graph_count, monkeypatch, name):
    """kv_one_write's caches (K and V in one buffer; attention gets the whole buffer as K and a view
    as V): the same attention kernels as two buffers, and norm_rope's stacked form g4_norm_rope_kv
    instead of the three-output g4_norm_rope."""
    sliding, full = EXPECTED[name]
    calls = _preset_launches(graph_count, monkeypatch, name, one_buffer=True)
    assert [c for c in calls if c.startswith("g4_attn")] == sliding + full
    assert calls.count("g4_norm_rope_kv") == 2 and "g4_norm_rope" not in calls
