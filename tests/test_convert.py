"""HF -> GGUF converter: names, metadata, dtype rule, values, and CLI errors on the tiny fixtures."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from fixtures import GGUF_TYPES, REPO
from gemma4_mlx import quants
from gemma4_mlx.config import ModelConfig
from gemma4_mlx.convert import ConvertError, convert, output_ggml_type
from gemma4_mlx.gguf import read_gguf
from gemma4_mlx.weights import UnknownTensorName, gguf_to_hf_name, hf_to_gguf_name, is_multimodal_tower

F32, F16, Q4_0, Q8_0, BF16 = 0, 1, 2, 8, 30
REQUESTED = {"f32": F32, "f16": F16, "bf16": BF16, "q8_0": Q8_0, "q4_0": Q4_0}
FILE_TYPE = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2}
U32, I32, F32V, BOOL, STR, ARR = 4, 5, 6, 7, 8, 9

# tensors per layer / global, from gemma4-spec §7.3, scaled to the fixtures:
#   dense: 5 sliding x 14 + 1 full (K=V: no attn_v) x 13 + 3 global
#   moe:   5 x 22 + 1 x 21 + 3;  eseries: 10 x 17 (shared layers keep k/v/k_norm) + 6
TENSOR_COUNTS = {"dense": 5 * 14 + 13 + 3, "moe": 5 * 22 + 21 + 3, "eseries": 10 * 17 + 6}


def expected_names(cfg: dict) -> set[str]:
    """GGUF tensor names implied by a fixture config.json (written independently of config.py)."""
    names = {"token_embd.weight", "output_norm.weight", "rope_freqs.weight"}
    if cfg["hidden_size_per_layer_input"]:
        names |= {"per_layer_token_embd.weight", "per_layer_model_proj.weight", "per_layer_proj_norm.weight"}
    for i, kind in enumerate(cfg["layer_types"]):
        per = ["attn_norm", "attn_q", "attn_k", "attn_output", "attn_q_norm", "attn_k_norm", "post_attention_norm",
               "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm", "layer_output_scale"]
        if not (cfg["attention_k_eq_v"] and kind == "full_attention"):
            per.append("attn_v")
        if cfg["enable_moe_block"]:
            per += ["ffn_gate_inp", "ffn_gate_up_exps", "ffn_down_exps", "pre_ffw_norm_2", "post_ffw_norm_1",
                    "post_ffw_norm_2"]
            names |= {f"blk.{i}.ffn_gate_inp.scale", f"blk.{i}.ffn_down_exps.scale"}
        if cfg["hidden_size_per_layer_input"]:
            per += ["inp_gate", "proj", "post_norm"]
        names |= {f"blk.{i}.{p}.weight" for p in per}
    return names


def expected_type(name: str, shape: tuple[int, ...], out_type: str) -> int:
    if len(shape) <= 1 or name.endswith("_norm.weight") or "ffn_gate_inp" in name or not name.endswith(".weight"):
        return F32
    return REQUESTED[out_type]


def hf_source(name: str, hf: dict[str, np.ndarray]) -> np.ndarray:
    return hf["model." + gguf_to_hf_name(name)]


# ------------------------------------------------------------------------------ name table


def test_name_table_round_trip(any_fixture):
    for hf_name in any_fixture.hf_tensors():
        g = hf_to_gguf_name(hf_name)
        assert g is not None, hf_name
        assert gguf_to_hf_name(g) == hf_name.removeprefix("model.")
        assert hf_to_gguf_name("model.language_model." + hf_name.removeprefix("model.")) == g


def test_name_table_specific_names():
    assert hf_to_gguf_name("model.language_model.layers.3.layer_scalar") == "blk.3.layer_output_scale.weight"
    assert hf_to_gguf_name("model.layers.0.experts.gate_up_proj") == "blk.0.ffn_gate_up_exps.weight"
    assert hf_to_gguf_name("model.layers.0.experts.down_proj") == "blk.0.ffn_down_exps.weight"
    assert hf_to_gguf_name("model.layers.0.router.per_expert_scale") == "blk.0.ffn_down_exps.scale"
    assert hf_to_gguf_name("model.layers.0.router.scale") == "blk.0.ffn_gate_inp.scale"
    assert hf_to_gguf_name("model.layers.12.router.proj.weight") == "blk.12.ffn_gate_inp.weight"
    assert hf_to_gguf_name("model.language_model.embed_tokens_per_layer.weight") == "per_layer_token_embd.weight"
    assert hf_to_gguf_name("layers.7.per_layer_projection.weight") == "blk.7.proj.weight"
    assert gguf_to_hf_name("blk.20.post_norm.weight") == "layers.20.post_per_layer_input_norm.weight"
    assert gguf_to_hf_name("output_norm.weight") == "norm.weight"
    for skipped in ("model.vision_tower.encoder.layers.0.mlp.gate_proj.linear.weight",
                    "model.embed_audio.embedding_projection.weight", "model.audio_tower.x.input_max",
                    "model.embed_vision.embedding_projection.weight", "lm_head.weight"):
        assert hf_to_gguf_name(skipped) is None
    assert is_multimodal_tower("model.vision_tower.patch_embedder.input_proj.weight")
    assert not is_multimodal_tower("model.language_model.layers.0.mlp.up_proj.weight")
    for bad in ("model.layers.0.self_attn.w_proj.weight", "model.foo.weight", "layers.x.mlp.up_proj.weight"):
        with pytest.raises(UnknownTensorName):
            hf_to_gguf_name(bad)
    with pytest.raises(KeyError):
        gguf_to_hf_name("rope_freqs.weight")
    with pytest.raises(KeyError):
        gguf_to_hf_name("blk.0.attn_qkv.weight")


# ------------------------------------------------------------------------------ layout


@pytest.mark.parametrize("out_type", GGUF_TYPES)
def test_tensor_names_types_and_shapes(any_fixture, out_type):
    f = read_gguf(any_fixture.gguf(out_type))
    cfg = any_fixture.config
    assert set(f.tensors) == expected_names(cfg)
    assert len(f.tensors) == TENSOR_COUNTS[any_fixture.variant]
    assert f.metadata["general.file_type"] == FILE_TYPE[out_type]
    hf = any_fixture.hf_tensors()
    for name, t in f.tensors.items():
        want_shape = (cfg["global_head_dim"] // 2,) if name == "rope_freqs.weight" else hf_source(name, hf).shape
        assert t.shape == want_shape, name
        assert t.ggml_type == expected_type(name, t.shape, out_type), (name, t.type_name)
        assert t.ggml_type == output_ggml_type(name, t.shape, REQUESTED[out_type])


def test_ne_order_with_gguf_py(moe_fixture):
    """The independent gguf-py reader sees ne = reversed numpy shape (experts [H, 2F, E])."""
    from gguf import GGUFReader

    r = GGUFReader(str(moe_fixture.gguf("q8_0")))
    ne = {t.name: [int(x) for x in t.shape] for t in r.tensors}
    assert ne["blk.0.ffn_gate_up_exps.weight"] == [256, 192, 8]
    assert ne["blk.0.ffn_down_exps.weight"] == [96, 256, 8]
    assert ne["blk.0.attn_q.weight"] == [256, 512]
    assert ne["blk.5.attn_q.weight"] == [256, 1024]
    assert ne["blk.5.attn_k.weight"] == [256, 256]
    assert ne["token_embd.weight"] == [256, 1024]
    assert ne["blk.0.ffn_gate_inp.weight"] == [256, 8]


def test_rope_freqs(any_fixture):
    f = read_gguf(any_fixture.gguf("q4_0"))
    t = f.tensors["rope_freqs.weight"]
    assert t.ggml_type == F32
    vals = np.frombuffer(t.data, dtype="<f4")
    n_rot = int(0.25 * 128 // 2)
    assert n_rot == 16
    np.testing.assert_array_equal(vals, np.array([1.0] * n_rot + [1e30] * (64 - n_rot), dtype=np.float32))


# ------------------------------------------------------------------------------ metadata


def _expected_metadata(variant: str) -> dict[str, tuple[object, object]]:
    """gemma4.* key -> (value, type) for a fixture variant (gemma4-spec §7.2)."""
    L = {"dense": 6, "moe": 6, "eseries": 10}[variant]
    pattern = [True] * 5 + [False] if L == 6 else ([True] * 4 + [False]) * 2
    md = {
        "block_count": (L, U32), "context_length": (4096, U32), "embedding_length": (256, U32),
        "attention.head_count": (8, U32),
        "attention.key_length": (128, U32), "attention.value_length": (128, U32),
        "attention.key_length_swa": (64, U32), "attention.value_length_swa": (64, U32),
        "attention.sliding_window": (16, U32), "attention.sliding_window_pattern": (pattern, (ARR, BOOL)),
        "attention.layer_norm_rms_epsilon": (1e-6, F32V),
        "rope.freq_base": (1e6, F32V), "rope.freq_base_swa": (1e4, F32V),
        "rope.dimension_count": (128, U32), "rope.dimension_count_swa": (64, U32),
        "final_logit_softcapping": (30.0, F32V),
    }
    if variant == "dense":
        md.update({"feed_forward_length": (512, U32), "attention.head_count_kv": ([2] * 5 + [1], (ARR, I32)),
                   "attention.shared_kv_layers": (0, U32), "embedding_length_per_layer_input": (0, U32)})
    elif variant == "moe":
        md.update({"feed_forward_length": (320, U32), "attention.head_count_kv": ([4] * 5 + [2], (ARR, I32)),
                   "attention.shared_kv_layers": (0, U32), "embedding_length_per_layer_input": (0, U32),
                   "expert_count": (8, U32), "expert_used_count": (2, U32),
                   "expert_feed_forward_length": (96, U32)})
    else:
        md.update({"feed_forward_length": ([384] * 5 + [768] * 5, (ARR, I32)),
                   "attention.head_count_kv": (1, U32), "attention.shared_kv_layers": (5, U32),
                   "embedding_length_per_layer_input": (64, U32)})
    return {"gemma4." + k: v for k, v in md.items()}


def test_metadata_keys_types_values(any_fixture):
    f = read_gguf(any_fixture.gguf("bf16"))
    md, ty = f.metadata, f.metadata_types
    assert md["general.architecture"] == "gemma4" and ty["general.architecture"] == STR
    assert (md["general.file_type"], ty["general.file_type"]) == (32, U32)
    assert (md["general.quantization_version"], ty["general.quantization_version"]) == (2, U32)
    assert (md["general.sampling.top_k"], ty["general.sampling.top_k"]) == (64, I32)
    assert ty["general.sampling.top_p"] == F32V and md["general.sampling.top_p"] == pytest.approx(0.95, rel=1e-6)
    assert ty["general.sampling.temp"] == F32V and md["general.sampling.temp"] == 1.0

    want = _expected_metadata(any_fixture.variant)
    assert {k for k in md if k.startswith("gemma4.")} == set(want)
    for key, (value, vtype) in want.items():
        assert ty[key] == vtype, key
        got = md[key]
        if isinstance(value, list):
            assert list(np.asarray(got).tolist()) == value, key
        elif vtype == F32V:
            assert got == pytest.approx(value, rel=1e-6), key
        else:
            assert got == value, key

    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(any_fixture.hf_dir / "tokenizer.json"))
    assert md["tokenizer.ggml.model"] == "gemma4"
    assert md["tokenizer.ggml.tokens"] == [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    assert md["tokenizer.ggml.bos_token_id"] == 2
    assert len(md["tokenizer.ggml.merges"]) > 0


def test_config_round_trip(any_fixture):
    f = read_gguf(any_fixture.gguf("f32"))
    from_gguf = ModelConfig.from_gguf(f.metadata, f.tensors)
    from_hf = ModelConfig.from_hf(any_fixture.hf_dir)
    # GGUF stores floats as f32: compare float fields at f32 precision, everything else exactly
    floats = [f.name for f in dataclasses.fields(ModelConfig) if isinstance(getattr(from_hf, f.name), float)]
    for name in floats:
        assert getattr(from_gguf, name) == pytest.approx(getattr(from_hf, name), rel=1e-7), name
    assert from_gguf.replace(**{n: getattr(from_hf, n) for n in floats}) == from_hf
    assert from_gguf.layers == from_hf.layers


# ------------------------------------------------------------------------------ values


def test_f32_and_bf16_values_exact(any_fixture):
    """The fixture checkpoints are bf16, so both F32 and BF16 files hold the HF values exactly."""
    hf = any_fixture.hf_tensors()
    for out_type in ("f32", "bf16"):
        f = read_gguf(any_fixture.gguf(out_type))
        for name, t in f.tensors.items():
            if name == "rope_freqs.weight":
                continue
            got = quants.dequantize(t.data, t.ggml_type, t.shape)
            np.testing.assert_array_equal(got, hf_source(name, hf), err_msg=f"{out_type} {name}")


def test_f16_values(dense_fixture):
    hf = dense_fixture.hf_tensors()
    f = read_gguf(dense_fixture.gguf("f16"))
    for name, t in f.tensors.items():
        if name == "rope_freqs.weight":
            continue
        want = hf_source(name, hf)
        if t.ggml_type == F16:
            np.testing.assert_array_equal(np.frombuffer(t.data, "<f2").reshape(t.shape), want.astype(np.float16))
        else:
            np.testing.assert_array_equal(quants.dequantize(t.data, t.ggml_type, t.shape), want)


@pytest.mark.parametrize("out_type", ["q8_0", "q4_0"])
def test_quantized_values_bit_exact(any_fixture, out_type):
    """Quantised tensors are exactly quants.quantize(HF tensor); F32 tensors exactly the HF values;
    dequantised weights are within the format's error of the HF weights."""
    hf = any_fixture.hf_tensors()
    f = read_gguf(any_fixture.gguf(out_type))
    n_quant = 0
    for name, t in f.tensors.items():
        if name == "rope_freqs.weight":
            continue
        want = hf_source(name, hf)
        if t.ggml_type == F32:
            np.testing.assert_array_equal(quants.dequantize(t.data, F32, t.shape), want)
            continue
        n_quant += 1
        expected = quants.quantize(want, REQUESTED[out_type]).reshape(-1)
        assert np.array_equal(np.asarray(t.data).reshape(-1), expected), name
        got = quants.dequantize(t.data, t.ggml_type, t.shape)
        nmse = float(((got - want) ** 2).mean() / (want ** 2).mean())
        assert nmse < (1e-4 if out_type == "q8_0" else 2e-2), (name, nmse)
    assert n_quant >= 10


# ------------------------------------------------------------------------------ other inputs


def _copy_hf_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite_single_shard(hf_dir, edit):
    """Load every tensor of hf_dir, apply edit(dict) and save as one model.safetensors."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
        f.unlink()
    (hf_dir / "model.safetensors.index.json").unlink(missing_ok=True)
    edit(tensors)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})


def test_multimodal_checkpoint_equals_text_only(dense_fixture, tmp_path):
    """A `gemma4` (multimodal) config with model.language_model.* names and tower tensors converts to
    the same file contents as the text-only checkpoint."""
    import torch

    d = _copy_hf_dir(dense_fixture.hf_dir, tmp_path / "mm")

    def edit(t):
        for k in list(t):
            t[k.replace("model.", "model.language_model.", 1)] = t.pop(k)
        t["model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"] = torch.ones(4, 4)
        t["model.embed_vision.embedding_projection.weight"] = torch.ones(4, 4)
        t["model.audio_tower.layers.0.feed_forward1.ffw_layer_1.input_max"] = torch.ones(())

    _rewrite_single_shard(d, edit)
    text_cfg = json.loads((d / "config.json").read_text())
    mm_cfg = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
              "text_config": text_cfg, "vision_config": {"model_type": "gemma4_vision"},
              "tie_word_embeddings": True}
    (d / "config.json").write_text(json.dumps(mm_cfg))
    out = convert(d, tmp_path / "mm.gguf", "q8_0")
    a, b = read_gguf(out), read_gguf(dense_fixture.gguf("q8_0"))
    assert list(a.tensors) == list(b.tensors)
    for name in a.tensors:
        assert a.tensors[name].ggml_type == b.tensors[name].ggml_type
        assert np.array_equal(a.tensors[name].data, b.tensors[name].data), name
    assert {k: v for k, v in a.metadata.items() if k.startswith("gemma4.")}.keys() == \
        {k for k in b.metadata if k.startswith("gemma4.")}


def test_token_embd_trimmed_to_tokenizer(dense_fixture, tmp_path):
    import torch

    d = _copy_hf_dir(dense_fixture.hf_dir, tmp_path / "padded")
    extra = torch.randn(32, 256).to(torch.bfloat16)

    def edit(t):
        t["model.embed_tokens.weight"] = torch.cat([t["model.embed_tokens.weight"], extra])

    _rewrite_single_shard(d, edit)
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 1024 + 32
    (d / "config.json").write_text(json.dumps(cfg))
    f = read_gguf(convert(d, tmp_path / "padded.gguf", "f32"))
    t = f.tensors["token_embd.weight"]
    assert t.shape == (1024, 256)
    np.testing.assert_array_equal(quants.dequantize(t.data, F32, t.shape),
                                  dense_fixture.hf_tensors()["model.embed_tokens.weight"])


def test_missing_and_unknown_tensors(dense_fixture, tmp_path):
    import torch

    missing = _copy_hf_dir(dense_fixture.hf_dir, tmp_path / "missing")
    _rewrite_single_shard(missing, lambda t: t.pop("model.layers.2.mlp.down_proj.weight"))
    with pytest.raises(ConvertError, match="blk.2.ffn_down.weight"):
        convert(missing, tmp_path / "missing.gguf", "f32")

    unknown = _copy_hf_dir(dense_fixture.hf_dir, tmp_path / "unknown")
    _rewrite_single_shard(unknown, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.ones(2, 2)}))
    with pytest.raises(ConvertError, match="model.layers.0.mlp.extra_proj.weight"):
        convert(unknown, tmp_path / "unknown.gguf", "f32")
    assert not list(tmp_path.glob("*.gguf*")), "no partial output on failure"


def test_quant_fallback_rule():
    assert output_ggml_type("blk.0.ffn_down.weight", (256, 96), Q4_0) == Q4_0
    assert output_ggml_type("blk.0.ffn_down.weight", (256, 100), Q4_0) == BF16
    assert output_ggml_type("blk.0.ffn_down.weight", (256, 100), Q8_0) == BF16
    assert output_ggml_type("blk.0.ffn_down.weight", (256, 100), F16) == F16
    assert output_ggml_type("blk.0.ffn_gate_inp.weight", (8, 256), Q8_0) == F32
    assert output_ggml_type("blk.0.ffn_down_exps.scale", (8,), Q8_0) == F32
    assert output_ggml_type("per_layer_proj_norm.weight", (64,), BF16) == F32


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "gemma4_mlx.convert", *map(str, args), "--no-progress"],
                          capture_output=True, text=True, cwd=cwd or REPO, timeout=120)


def _assert_one_line_error(proc, *fragments):
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    for frag in fragments:
        assert frag in lines[0]
    assert "Traceback" not in proc.stderr


def test_cli_errors(tmp_path):
    _assert_one_line_error(_cli(tmp_path / "nope", tmp_path / "o.gguf"), "not a directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    _assert_one_line_error(_cli(empty, tmp_path / "o.gguf"), "config.json")
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    _assert_one_line_error(_cli(llama, tmp_path / "o.gguf"), "model_type", "llama")
    assert not (tmp_path / "o.gguf").exists()


def test_cli_converts(dense_fixture, tmp_path):
    proc = _cli(dense_fixture.hf_dir, tmp_path / "cli.gguf", "--type", "q4_0")
    assert proc.returncode == 0, proc.stderr
    a, b = read_gguf(tmp_path / "cli.gguf"), read_gguf(dense_fixture.gguf("q4_0"))
    assert list(a.tensors) == list(b.tensors)
    assert all(np.array_equal(a.tensors[n].data, b.tensors[n].data) for n in a.tensors)
