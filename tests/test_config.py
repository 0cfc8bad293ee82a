"""Config derivation: the presets reproduce gemma4-spec §2; HF and GGUF forms agree; bad input is rejected."""

import json

import pytest

from gemma4_mlx.config import FULL, SLIDING, ConfigError, ModelConfig, PRESETS, num_params, preset


def full_indices(cfg):
    return [s.index for s in cfg.layers if s.type == FULL]


# (variant, full-layer indices, kv heads sliding/full, head dims, ffn widths by layer, producers)
def test_e2b_table():
    c = preset("E2B")
    assert full_indices(c) == [4, 9, 14, 19, 24, 29, 34]
    assert {s.num_kv_heads for s in c.layers} == {1}
    assert [s.intermediate_size for s in c.layers] == [6144] * 15 + [12288] * 20
    assert c.first_kv_shared_layer == 15
    for s in c.layers[15:]:
        assert s.kv_shared and s.kv_producer == (14 if s.type == FULL else 13)
    assert all(s.kv_producer is None and not s.kv_shared for s in c.layers[:15])
    assert [s.index for s in c.layers if s.kv_store] == [13, 14]
    assert c.layers[14].head_dim == 512 and c.layers[13].head_dim == 256
    assert not any(s.k_eq_v for s in c.layers)
    assert c.hidden_size_per_layer_input == 256 and c.sliding_window == 512


def test_e4b_table():
    c = preset("E4B")
    assert full_indices(c) == [5, 11, 17, 23, 29, 35, 41]
    assert {s.num_kv_heads for s in c.layers} == {2}
    assert {s.intermediate_size for s in c.layers} == {10240}
    assert c.first_kv_shared_layer == 24
    for s in c.layers[24:]:
        assert s.kv_producer == (23 if s.type == FULL else 22)
    assert [s.index for s in c.layers if s.kv_store] == [22, 23]


@pytest.mark.parametrize("name,H,L,nq,kv_s,kv_f,ffn,window,stores", [
    ("12B", 3840, 48, 16, 8, 1, 15360, 1024, [46, 47]),
    ("26B-A4B", 2816, 30, 16, 8, 2, 2112, 1024, [28, 29]),
    ("31B", 5376, 60, 32, 16, 4, 21504, 1024, [58, 59]),
])
def test_dense_and_moe_tables(name, H, L, nq, kv_s, kv_f, ffn, window, stores):
    c = preset(name)
    assert c.hidden_size == H and c.num_hidden_layers == L
    assert full_indices(c) == list(range(5, L, 6))
    for s in c.layers:
        full = s.type == FULL
        assert s.num_heads == nq
        assert s.num_kv_heads == (kv_f if full else kv_s)
        assert s.head_dim == (512 if full else 256)
        assert s.k_eq_v == full
        assert s.intermediate_size == ffn
        assert s.sliding_window == (None if full else window)
        assert s.kv_producer is None and not s.kv_shared
        assert s.rope_pairs == (64 if full else 128)
        assert s.rope_theta == (1e6 if full else 1e4)
    assert [s.index for s in c.layers if s.kv_store] == stores
    assert c.layers[0].moe == (name == "26B-A4B")


def test_projection_shapes_match_spec():
    shapes = preset("31B").expected_tensor_shapes()
    assert shapes["blk.0.attn_q.weight"][0] == (8192, 5376)
    assert shapes["blk.0.attn_k.weight"][0] == (4096, 5376)
    assert shapes["blk.59.attn_q.weight"][0] == (16384, 5376)
    assert shapes["blk.59.attn_k.weight"][0] == (2048, 5376)
    assert "blk.59.attn_v.weight" not in shapes
    moe = preset("26B-A4B").expected_tensor_shapes()
    assert moe["blk.5.ffn_gate_up_exps.weight"][0] == (128, 1408, 2816)
    assert moe["blk.5.ffn_down_exps.weight"][0] == (128, 2816, 704)
    e2b = preset("E2B").expected_tensor_shapes()
    assert e2b["blk.20.ffn_gate.weight"][0] == (12288, 1536)
    assert e2b["blk.20.attn_k.weight"][1] is False  # present in files, unused
    assert e2b["per_layer_token_embd.weight"][0] == (262144, 35 * 256)


def test_tensor_counts_match_published_dumps():
    # gemma4-spec §7.3: 31B = 833, 26B = 658, E2B = 601 (rope_freqs counted; shared layers carry K/V)
    for name, count in [("31B", 833), ("26B-A4B", 658), ("E2B", 601)]:
        assert len(preset(name).expected_tensor_shapes()) == count, name


def test_param_counts_are_plausible():
    assert 30e9 < num_params(preset("31B")) < 32e9
    assert 25e9 < num_params(preset("26B-A4B")) < 27e9


@pytest.mark.parametrize("name", [n for n in PRESETS if "assistant" not in n])
def test_hf_and_gguf_round_trip(name):
    c = preset(name)
    assert ModelConfig.from_hf(json.loads(json.dumps(c.to_hf()))) == c
    md, types = c.to_gguf_metadata()
    assert set(md) == set(types)
    md["tokenizer.ggml.tokens"] = ["x"] * c.vocab_size
    md["tokenizer.ggml.eos_token_id"] = 1
    back = ModelConfig.from_gguf(md)
    assert back.layers == c.layers
    assert back.hidden_size_per_layer_input == c.hidden_size_per_layer_input


def test_gguf_metadata_types():
    md, ty = preset("31B").to_gguf_metadata()
    assert ty["gemma4.attention.head_count_kv"] == (9, 5)
    assert list(md["gemma4.attention.head_count_kv"][:6]) == [16, 16, 16, 16, 16, 4]
    assert ty["gemma4.attention.sliding_window_pattern"] == (9, 7)
    md2, ty2 = preset("E2B").to_gguf_metadata()
    assert ty2["gemma4.feed_forward_length"] == (9, 5)
    assert ty2["gemma4.attention.head_count_kv"] == 4


def test_nested_multimodal_and_per_layer_config_layouts():
    c = preset("26B-A4B")
    text = c.to_hf()
    nested = {"model_type": "gemma4", "text_config": dict(text, model_type="gemma4_text"), "vision_config": {}}
    assert ModelConfig.from_hf(nested) == c
    per_layer = dict(text)
    per_layer.pop("global_head_dim")
    per_layer.pop("num_global_key_value_heads")
    per_layer["per_layer_config"] = {str(i): {"head_dim": 512, "num_key_value_heads": 2}
                                     for i, t in enumerate(text["layer_types"]) if t == FULL}
    assert ModelConfig.from_hf(per_layer) == c
    unified = {"model_type": "gemma4_unified", "text_config": dict(preset("12B").to_hf(), model_type="gemma4_unified_text")}
    assert ModelConfig.from_hf(unified) == preset("12B")


def test_rejects_bad_configs(tmp_path):
    with pytest.raises(ConfigError, match="unsupported model_type"):
        ModelConfig.from_hf({"model_type": "llama"})
    with pytest.raises(ConfigError, match="lacks required key 'hidden_size'"):
        ModelConfig.from_hf({"model_type": "gemma4_text", "num_hidden_layers": 6, "intermediate_size": 1,
                             "num_attention_heads": 1, "num_key_value_heads": 1})
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_hf(tmp_path)
    bad = preset("31B").to_hf()
    bad["layer_types"] = bad["layer_types"][:-1] + [SLIDING]
    with pytest.raises(ConfigError, match="last layer"):
        ModelConfig.from_hf(bad)
    bad = preset("31B").to_hf()
    bad["num_attention_heads"] = 33
    with pytest.raises(ConfigError, match="not a multiple"):
        ModelConfig.from_hf(bad)


def test_gguf_inconsistencies_are_named():
    c = preset("E2B")
    md, _ = c.to_gguf_metadata()
    md["tokenizer.ggml.tokens"] = ["x"] * c.vocab_size
    bad = dict(md)
    bad["gemma4.feed_forward_length"] = [6144] * 14 + [12288] * 21
    with pytest.raises(ConfigError, match=r"feed_forward_length\[14\]"):
        ModelConfig.from_gguf(bad)
    bad = dict(md)
    bad["gemma4.attention.sliding_window_pattern"] = [True] * 34
    with pytest.raises(ConfigError, match="sliding_window_pattern has 34"):
        ModelConfig.from_gguf(bad)
    bad = dict(md)
    del bad["gemma4.embedding_length"]
    with pytest.raises(ConfigError, match="lacks gemma4.embedding_length"):
        ModelConfig.from_gguf(bad)
    with pytest.raises(ConfigError, match="architecture"):
        ModelConfig.from_gguf(dict(md, **{"general.architecture": "llama"}))


class _T:
    def __init__(self, shape):
        self.shape = shape


def test_tensor_shape_cross_check():
    c = preset("26B-A4B")
    md, _ = c.to_gguf_metadata()
    shapes = {k: s for k, (s, req) in c.expected_tensor_shapes().items() if req}
    tensors = {k: _T(s) for k, s in shapes.items()}
    assert ModelConfig.from_gguf(md, tensors).layers == c.layers
    tensors["blk.3.ffn_down_exps.weight"] = _T((128, 2816, 705))
    with pytest.raises(ConfigError, match=r"blk.3.ffn_down_exps.weight has shape \(128, 2816, 705\)"):
        ModelConfig.from_gguf(md, tensors)
    tensors = {k: _T(s) for k, s in shapes.items()}
    del tensors["blk.7.attn_q.weight"]
    with pytest.raises(ConfigError, match="blk.7.attn_q.weight is missing"):
        ModelConfig.from_gguf(md, tensors)
    tensors = {k: _T(s) for k, s in shapes.items()}
    tensors["blk.99.attn_q.weight"] = _T((1, 1))
    with pytest.raises(ConfigError, match="blk.99.attn_q.weight is not part"):
        ModelConfig.from_gguf(md, tensors)
