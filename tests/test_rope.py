"""custom_kernels.rope on the CPU: the MLX reference against the float64 oracle, argument checks,
and the model's Attention.heads taking the fused branch (reference on CPU) against its MLX path
for sliding / full (proportional RoPE), K = V and KV-shared layers."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from custom_kernels import rope


@pytest.mark.parametrize("heads,full,pos0", [((4, 2, 64, False), False, 9), ((2, 1, 128, True), True, 300),
                                             ((3, 0, 64, False), False, 0)])  # fmt: skip
def test_reference_matches_oracle(heads, full, pos0):
    hq, hkv, d, k_eq_v = heads
    rng = np.random.default_rng(d + hq)
    y = (rng.standard_normal((2, 3, (hq + (1 if k_eq_v else 2) * hkv) * d)) * 2).astype(np.float32)
    w_q, w_k = rng.uniform(0.3, 2, d).astype(np.float32), rng.uniform(0.3, 2, d).astype(np.float32)
    pos = np.arange(pos0, pos0 + 3, dtype=np.int32)
    periods = [1e6 ** (2 * i / d) for i in range(d // 8)] + [np.inf] * (d // 2 - d // 8)
    inv = rope.inverse_frequencies(d, periods=periods) if full else rope.inverse_frequencies(d, base=10_000.0)
    want = rope.norm_rope_np(y, heads, w_q, w_k, pos, 1e-6, inv)
    got = rope.norm_rope(mx.array(y), heads, mx.array(w_q), mx.array(w_k), mx.array(pos), 1e-6, mx.array(inv))
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            assert g.shape == w.shape
            assert np.allclose(np.array(g), w, rtol=1e-4, atol=1e-4)


def test_stacked_reference_is_k_then_v():
    """norm_rope(stacked=True) on CPU (its reference): q, and k's rows then v's in one array."""
    rng = np.random.default_rng(5)
    heads = (4, 2, 64, False)
    y = mx.array(rng.standard_normal((2, 3, 8 * 64)).astype(np.float32))
    w, pos = mx.array(rng.uniform(0.5, 2, 64).astype(np.float32)), mx.arange(7, 10, dtype=mx.int32)
    inv = mx.array(rope.inverse_frequencies(64, base=1e4))
    q, k, v = rope.norm_rope(y, heads, w, w, pos, 1e-6, inv)
    q2, kv = rope.norm_rope(y, heads, w, w, pos, 1e-6, inv, stacked=True)
    assert kv.shape == (4, 2, 3, 64)
    assert np.array_equal(np.array(kv), np.concatenate([np.array(k), np.array(v)]))
    assert np.array_equal(np.array(q2), np.array(q))
    with pytest.raises(ValueError, match="kv heads"):
        rope.norm_rope(mx.zeros((1, 1, 128)), (2, 0, 64, False), w, None, pos[:1], 1e-6, inv, stacked=True)


def test_errors():
    y, w, pos = mx.zeros((1, 1, 3 * 64)), mx.ones((64,)), mx.array([0], dtype=mx.int32)
    inv = mx.array(rope.inverse_frequencies(64, base=1e4))
    with pytest.raises(ValueError, match="expected for heads"):
        rope.norm_rope(y, (2, 1, 64, False), w, w, pos, 1e-6, inv)
    with pytest.raises(ValueError, match="multiple of 64"):
        rope.norm_rope(mx.zeros((1, 1, 96)), (3, 0, 32, False), mx.ones((32,)), None, pos, 1e-6, inv[:16])
    with pytest.raises(ValueError, match="positions"):
        rope.norm_rope(y, (1, 1, 64, False), w, w, mx.array([0, 1], dtype=mx.int32), 1e-6, inv)
    with pytest.raises(ValueError, match="inv_freq"):
        rope.norm_rope(y, (1, 1, 64, False), w, w, pos, 1e-6, inv[:8])
    for bad in (dict(), dict(base=1e4, periods=[1.0] * 32), dict(periods=[1.0] * 8)):
        with pytest.raises(ValueError):
            rope.inverse_frequencies(64, **bad)


class _Joined:
    """Stands in for quantized.FusedBlockLinear: the q|k|v projections as one output."""

    def __init__(self, modules):
        self.modules = modules

    def intact(self):
        return True

    def matvec(self, x):
        return mx.concatenate([m(x) for m in self.modules], axis=-1)


def test_attention_heads_fused_branch_equals_mlx_path(monkeypatch):
    from gemma4_mlx import model as model_mod
    from gemma4_mlx.config import FULL, SLIDING, ModelConfig

    cfg = ModelConfig(hidden_size=64, num_hidden_layers=4, intermediate_size=96, num_attention_heads=4,
                      num_key_value_heads=2, layer_types=[SLIDING, FULL, SLIDING, FULL], vocab_size=101,
                      head_dim=64, global_head_dim=128, num_global_key_value_heads=1, attention_k_eq_v=True,
                      sliding_window=4, num_kv_shared_layers=2, max_position_embeddings=256)  # fmt: skip
    mx.random.seed(2)
    m = model_mod.Model(cfg)
    x = mx.random.normal((1, 3, 64))
    offset = 7
    q_pos = offset + mx.arange(3, dtype=mx.int32)
    seen = set()
    for layer in m.model.layers:
        attn = layer.self_attn
        for norm in ("q_norm", "k_norm"):
            if norm in attn:
                attn[norm].weight = mx.random.uniform(0.5, 1.5, attn[norm].weight.shape)
        want = attn.heads(x, offset, q_pos)
        if not attn.spec.kv_shared:
            names = ["q_proj", "k_proj"] + ([] if attn.spec.k_eq_v else ["v_proj"])
            attn.qkv_proj = _Joined([attn[n] for n in names])
        monkeypatch.setattr(model_mod, "use_kernel", lambda family: family == "norm_rope")
        got = attn.heads(x, offset, q_pos)
        monkeypatch.undo()
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if w is not None:
                assert g.shape == w.shape and np.allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-5)
        seen.add((attn.spec.type, attn.spec.kv_shared, attn.spec.k_eq_v))
    assert len(seen) == 4  # sliding / full, owner / KV-shared
