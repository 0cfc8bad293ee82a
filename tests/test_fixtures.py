"""The tiny Gemma 4 fixtures are discriminative, in the published layout, and reload in transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fixtures import _COMMON, GENERATION_CONFIG, VARIANT_CONFIGS, VARIANTS, discriminativeness, probe_ids


def test_logits_are_discriminative(any_fixture):
    ids = probe_ids()
    logits = any_fixture.logits(ids)
    std, top1 = discriminativeness(logits)
    assert std > 2.0, f"{any_fixture.variant}: logit std {std:.2f}"
    assert top1 > 0.2, f"{any_fixture.variant}: mean top-1 probability {top1:.2f}"
    # not the tied-embedding degeneracy "predict the current token"
    argmax = logits[0].argmax(-1)
    assert (argmax == ids[0]).mean() < 0.2
    assert len(np.unique(argmax)) > 10


def test_float64_gold_matches_float32(any_fixture):
    import torch

    ids = probe_ids(32)
    f32 = any_fixture.logits(ids)
    f64 = any_fixture.logits(ids, dtype=torch.float64)
    assert f32.dtype == np.float32 and f64.dtype == np.float64
    rel = np.abs(f32 - f64).max() / np.abs(f64).max()
    assert rel < 1e-5
    assert (f32.argmax(-1) == f64.argmax(-1)).all()


def test_published_config_layout(any_fixture):
    cfg = json.loads((any_fixture.hf_dir / "config.json").read_text())
    want = VARIANT_CONFIGS[any_fixture.variant]
    assert cfg["model_type"] == "gemma4_text"
    assert cfg["architectures"] == ["Gemma4ForCausalLM"]
    assert "per_layer_config" not in cfg
    assert cfg["global_head_dim"] == 128 and cfg["head_dim"] == 64
    assert cfg["num_global_key_value_heads"] == want["num_global_key_value_heads"]
    assert cfg["final_logit_softcapping"] == 30.0
    assert cfg["sliding_window"] == 16
    assert cfg["dtype"] == "bfloat16"
    for key, value in want.items():
        assert cfg[key] == value, key
    gen = json.loads((any_fixture.hf_dir / "generation_config.json").read_text())
    for key, value in GENERATION_CONFIG.items():
        assert gen[key] == value


def test_model_vocab_equals_tokenizer(any_fixture):
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(any_fixture.hf_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == any_fixture.config["vocab_size"] == 1024
    assert [tok.id_to_token(i) for i in (0, 1, 2, 3, 4, 105, 106)] == [
        "<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"]


def test_transformers_reloads_identically(any_fixture):
    """Reloading the published-layout config rebuilds transformers' per-layer geometry, and every
    checkpoint tensor lands in the model (none missing, unused shared-layer K/V ignored)."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    built = Gemma4TextConfig(**{**_COMMON, **VARIANT_CONFIGS[any_fixture.variant]})
    model, info = Gemma4ForCausalLM.from_pretrained(any_fixture.hf_dir, dtype=torch.float32,
                                                    attn_implementation="eager", output_loading_info=True)
    cfg = model.config
    L = cfg.num_hidden_layers
    geometry = [(cfg.per_layer_config[i].head_dim, cfg.per_layer_config[i].num_key_value_heads) for i in range(L)]
    assert geometry == [(built.per_layer_config[i].head_dim, built.per_layer_config[i].num_key_value_heads)
                        for i in range(L)]
    assert cfg.layer_types == built.layer_types
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]

    stored = any_fixture.hf_tensors()
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    for name, value in state.items():
        if name == "lm_head.weight":
            np.testing.assert_array_equal(value, stored["model.embed_tokens.weight"])
        else:
            np.testing.assert_array_equal(value, stored[name], err_msg=name)
    unused = sorted(set(stored) - set(state))
    if any_fixture.variant == "eseries":
        # published E-series files carry k/v/k_norm for the KV-shared layers 5..9
        assert unused == sorted(f"model.layers.{i}.self_attn.{n}" for i in range(5, 10)
                                for n in ("k_proj.weight", "v_proj.weight", "k_norm.weight"))
    else:
        assert unused == []


def test_layer_scalars_randomized(any_fixture):
    stored = any_fixture.hf_tensors()
    scalars = np.array([v[0] for k, v in stored.items() if k.endswith("layer_scalar")])
    assert len(scalars) == any_fixture.config["num_hidden_layers"]
    assert ((scalars >= 0.5) & (scalars <= 1.0)).all() and len(np.unique(scalars)) > 1


def test_variant_structure():
    moe, es = VARIANT_CONFIGS["moe"], VARIANT_CONFIGS["eseries"]
    assert moe["enable_moe_block"] and moe["num_experts"] == 8 and moe["top_k_experts"] == 2
    first_shared = es["num_hidden_layers"] - es["num_kv_shared_layers"]
    # llama.cpp assumes: last layer before the shared block is full, the one before it sliding
    assert es["layer_types"][first_shared - 1] == "full_attention"
    assert es["layer_types"][first_shared - 2] == "sliding_attention"
    assert es["layer_types"][-1] == "full_attention"
    for v in VARIANTS:
        assert VARIANT_CONFIGS[v]["num_hidden_layers"] >= 6


def test_moe_checkpoint_is_sharded(moe_fixture):
    index = json.loads((moe_fixture.hf_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_gguf_factory_caches(fixture_gguf):
    first = fixture_gguf("dense", "q8_0")
    stamp = first.stat().st_mtime_ns
    assert fixture_gguf("dense", "q8_0") == first
    assert first.stat().st_mtime_ns == stamp
    with pytest.raises(KeyError):
        fixture_gguf("dense", "q5_k")
    with pytest.raises(KeyError):
        fixture_gguf("llama", "f32")
