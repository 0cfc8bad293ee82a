"""Gemma 4 model configuration: from HF config.json or GGUF metadata, per-layer facts derived once.

`ModelConfig` holds the checkpoint's hyper-parameters with HF names; `ModelConfig.layers` is the
derived per-layer table (`LayerSpec`) that the model, the caches and the kernels read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

SLIDING = "sliding_attention"
FULL = "full_attention"

# GGUF value type codes (gguf-spec): used for to_gguf_metadata's type table.
_U32, _I32, _F32, _BOOL, _STR, _ARR = 4, 5, 6, 7, 8, 9


class ConfigError(ValueError):
    """A config or GGUF metadata that is missing, inconsistent or unsupported."""


@dataclass(frozen=True)
class LayerSpec:
    """Facts about one decoder layer, derived from the config."""

    index: int
    type: str  # SLIDING or FULL
    head_dim: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    k_eq_v: bool  # values come from k_proj (full layers of 12B/26B/31B): no v_proj
    kv_shared: bool  # consumer layer: reads another layer's K/V, computes none itself
    kv_producer: int | None  # index of the layer whose K/V a consumer reads (None: owns its cache,
    #                           or an assistant layer that reads the target model's K/V)
    kv_store: bool  # last non-consumer layer of its type (what an MTP assistant reads)
    rope_theta: float
    partial_rotary_factor: float  # fraction of head_dim that is rotated (1.0 sliding, 0.25 full)
    sliding_window: int | None  # keys per query including itself, sliding layers only
    moe: bool

    @property
    def is_sliding(self) -> bool:
        return self.type == SLIDING

    @property
    def rope_pairs(self) -> int:
        """Number of rotated (i, i + d/2) pairs; frequencies use the full head_dim denominator."""
        return int(self.partial_rotary_factor * self.head_dim // 2)


@dataclass
class ModelConfig:
    """Gemma 4 text-model hyper-parameters (HF names). Call `.layers` for the per-layer table."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    layer_types: list[str]
    vocab_size: int = 262144
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    attention_k_eq_v: bool = False
    sliding_window: int = 1024
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = 30.0
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 262144
    enable_moe_block: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    rope_theta: float = 10_000.0  # sliding layers, default RoPE
    global_rope_theta: float = 1_000_000.0  # full layers, proportional RoPE
    global_partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262144
    bos_token_id: int = 2
    eos_token_id: list[int] = field(default_factory=lambda: [1, 106])
    pad_token_id: int = 0
    # MTP assistant (drafter) only
    backbone_hidden_size: int = 0
    use_ordered_embeddings: bool = False
    num_centroids: int = 0
    centroid_intermediate_top_k: int = 0

    def __post_init__(self):
        self.validate()
        self.layers: list[LayerSpec] = self._derive_layers()

    # ------------------------------------------------------------------ derivation

    @property
    def is_assistant(self) -> bool:
        return self.backbone_hidden_size > 0

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def validate(self) -> None:
        L = self.num_hidden_layers
        if len(self.layer_types) != L:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {L}")
        bad = set(self.layer_types) - {SLIDING, FULL}
        if bad:
            raise ConfigError(f"unknown layer types {sorted(bad)}")
        if self.layer_types[-1] != FULL:
            raise ConfigError(f"the last layer must be {FULL}, got {self.layer_types[-1]}")
        if not 0 <= self.num_kv_shared_layers <= L:
            raise ConfigError(f"num_kv_shared_layers {self.num_kv_shared_layers} outside [0, {L}]")
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "global_head_dim", "vocab_size", "sliding_window"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for h in self._kv_heads_by_type().values():
            if self.num_attention_heads % h:
                raise ConfigError(f"num_attention_heads {self.num_attention_heads} is not a multiple of kv heads {h}")
        if self.enable_moe_block and not (self.num_experts and self.top_k_experts and self.moe_intermediate_size):
            raise ConfigError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
        if self.enable_moe_block and not 0 < self.top_k_experts <= self.num_experts:
            raise ConfigError(f"top_k_experts {self.top_k_experts} outside [1, num_experts={self.num_experts}]")
        if 0 < self.num_kv_shared_layers < L and not self.is_assistant:
            producers = set(self.layer_types[: self.first_kv_shared_layer])
            consumers = set(self.layer_types[self.first_kv_shared_layer:])
            if not consumers <= producers:
                raise ConfigError(f"KV-shared layers of types {sorted(consumers - producers)} have no producer layer")

    def _kv_heads_by_type(self) -> dict[str, int]:
        full = self.num_key_value_heads
        if self.attention_k_eq_v and self.num_global_key_value_heads:
            full = self.num_global_key_value_heads
        return {SLIDING: self.num_key_value_heads, FULL: full}

    def _derive_layers(self) -> list[LayerSpec]:
        kv_heads = self._kv_heads_by_type()
        first_shared = self.first_kv_shared_layer
        last_of_type = {t: max((i for i in range(first_shared) if self.layer_types[i] == t), default=None)
                        for t in (SLIDING, FULL)}
        layers = []
        for i, t in enumerate(self.layer_types):
            sliding = t == SLIDING
            shared = i >= first_shared
            width = self.intermediate_size * (2 if self.use_double_wide_mlp and shared else 1)
            layers.append(LayerSpec(
                index=i,
                type=t,
                head_dim=self.head_dim if sliding else self.global_head_dim,
                num_heads=self.num_attention_heads,
                num_kv_heads=kv_heads[t],
                intermediate_size=width,
                k_eq_v=self.attention_k_eq_v and not sliding,
                kv_shared=shared,
                kv_producer=last_of_type[t] if shared else None,
                kv_store=(not shared) and last_of_type[t] == i,
                rope_theta=self.rope_theta if sliding else self.global_rope_theta,
                partial_rotary_factor=1.0 if sliding else self.global_partial_rotary_factor,
                sliding_window=self.sliding_window if sliding else None,
                moe=self.enable_moe_block,
            ))
        return layers

    # ------------------------------------------------------------------ HF config.json

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | str | os.PathLike) -> "ModelConfig":
        """From a config.json dict, a config.json path or a checkpoint directory.

        Accepts `gemma4` / `gemma4_unified` (reads `text_config`), `gemma4_text` /
        `gemma4_unified_text`, and `gemma4_assistant` configs; both the published layout
        (`global_head_dim`, `num_global_key_value_heads`) and transformers' `per_layer_config`.
        """
        if not isinstance(config, Mapping):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            try:
                with open(path, encoding="utf-8") as f:
                    config = json.load(f)
            except FileNotFoundError:
                raise ConfigError(f"no config.json at {path}") from None
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path} is not valid JSON: {e}") from None
        top = dict(config)
        model_type = top.get("model_type", "")
        supported = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text",
                     "gemma4_assistant", "gemma4_unified_assistant")
        if model_type not in supported:
            raise ConfigError(f"unsupported model_type {model_type!r} (expected one of {', '.join(supported)})")
        c = dict(top.get("text_config") or top)
        assistant = model_type.endswith("assistant")
        try:
            L = c["num_hidden_layers"]
            layer_types = list(c.get("layer_types") or
                               [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(L)])
            global_head_dim = c.get("global_head_dim")
            global_kv = c.get("num_global_key_value_heads")
            per_layer = c.get("per_layer_config") or {}
            for idx, overrides in per_layer.items():
                if str(idx).isdigit() and layer_types[int(idx)] == FULL:
                    global_head_dim = overrides.get("head_dim", global_head_dim)
                    global_kv = overrides.get("num_key_value_heads", global_kv)
            rope = c.get("rope_parameters") or {}
            full_rope = rope.get(FULL) or {}
            sliding_rope = rope.get(SLIDING) or {}
            if full_rope.get("factor", 1.0) not in (None, 1.0):
                raise ConfigError(f"rope factor {full_rope['factor']} is not supported")
            eos = c.get("eos_token_id", top.get("eos_token_id", [1, 106]))
            kw = dict(
                hidden_size=c["hidden_size"],
                num_hidden_layers=L,
                intermediate_size=c["intermediate_size"],
                num_attention_heads=c["num_attention_heads"],
                num_key_value_heads=c["num_key_value_heads"],
                layer_types=layer_types,
                vocab_size=c.get("vocab_size", 262144),
                head_dim=c.get("head_dim", 256),
                global_head_dim=global_head_dim or 512,
                num_global_key_value_heads=global_kv,
                attention_k_eq_v=bool(c.get("attention_k_eq_v", False)),
                sliding_window=c.get("sliding_window", 1024),
                rms_norm_eps=c.get("rms_norm_eps", 1e-6),
                final_logit_softcapping=c.get("final_logit_softcapping"),
                num_kv_shared_layers=c.get("num_kv_shared_layers", 0) or 0,
                use_double_wide_mlp=bool(c.get("use_double_wide_mlp", False)),
                hidden_size_per_layer_input=c.get("hidden_size_per_layer_input", 0) or 0,
                vocab_size_per_layer_input=c.get("vocab_size_per_layer_input", 262144) or 262144,
                enable_moe_block=bool(c.get("enable_moe_block", False)),
                num_experts=c.get("num_experts"),
                top_k_experts=c.get("top_k_experts"),
                moe_intermediate_size=c.get("moe_intermediate_size"),
                rope_theta=sliding_rope.get("rope_theta", 10_000.0),
                global_rope_theta=full_rope.get("rope_theta", 1_000_000.0),
                global_partial_rotary_factor=full_rope.get("partial_rotary_factor", 0.25),
                max_position_embeddings=c.get("max_position_embeddings", 262144),
                bos_token_id=c.get("bos_token_id", 2),
                eos_token_id=list(eos) if isinstance(eos, (list, tuple)) else [eos],
                pad_token_id=c.get("pad_token_id", 0),
            )
            if assistant:
                kw.update(backbone_hidden_size=top.get("backbone_hidden_size") or c.get("backbone_hidden_size"),
                          use_ordered_embeddings=bool(top.get("use_ordered_embeddings", False)),
                          num_centroids=top.get("num_centroids", 0) or 0,
                          centroid_intermediate_top_k=top.get("centroid_intermediate_top_k", 0) or 0)
        except KeyError as e:
            raise ConfigError(f"config.json lacks required key {e.args[0]!r}") from None
        return cls(**kw)

    def to_hf(self) -> dict[str, Any]:
        """A `gemma4_text` config.json dict in the published layout (top-level global head dim / kv heads)."""
        d = {
            "architectures": ["Gemma4ForCausalLM"],
            "model_type": "gemma4_text",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "global_head_dim": self.global_head_dim,
            "num_global_key_value_heads": self.num_global_key_value_heads,
            "attention_k_eq_v": self.attention_k_eq_v,
            "layer_types": list(self.layer_types),
            "vocab_size": self.vocab_size,
            "sliding_window": self.sliding_window,
            "rms_norm_eps": self.rms_norm_eps,
            "final_logit_softcapping": self.final_logit_softcapping,
            "num_kv_shared_layers": self.num_kv_shared_layers,
            "use_double_wide_mlp": self.use_double_wide_mlp,
            "hidden_size_per_layer_input": self.hidden_size_per_layer_input,
            "vocab_size_per_layer_input": self.vocab_size_per_layer_input,
            "enable_moe_block": self.enable_moe_block,
            "num_experts": self.num_experts,
            "top_k_experts": self.top_k_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "rope_parameters": {
                SLIDING: {"rope_type": "default", "rope_theta": self.rope_theta},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": self.global_partial_rotary_factor,
                       "rope_theta": self.global_rope_theta},
            },
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_activation": "gelu_pytorch_tanh",
            "tie_word_embeddings": True,
            "attention_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id),
            "pad_token_id": self.pad_token_id,
        }
        return d

    # ------------------------------------------------------------------ GGUF metadata

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], tensors: Mapping[str, Any] | None = None) -> "ModelConfig":
        """From GGUF metadata (`gemma4.*` keys); `tensors` (name -> object with .shape, numpy order,
        and for rope_freqs a .data/ggml_type readable as f32) fills what metadata does not carry
        (vocab size, K=V, rotary fraction) and is cross-checked against the derived shapes."""
        arch = metadata.get("general.architecture")
        if arch != "gemma4":
            raise ConfigError(f"general.architecture is {arch!r}, expected 'gemma4'")
        p = "gemma4."

        def get(key, default=KeyError):
            if p + key in metadata:
                return metadata[p + key]
            if default is KeyError:
                raise ConfigError(f"GGUF metadata lacks {p + key}")
            return default

        L = int(get("block_count"))

        def f32(key, default):
            # GGUF stores f32: go back to the shortest decimal, so 1e-6 reads as 1e-6 again
            import numpy as np

            return float(str(np.float32(get(key, default))))

        def per_layer(key, default=KeyError) -> list[int] | None:
            v = get(key, default)
            if v is None:
                return None
            if hasattr(v, "__len__") and not isinstance(v, str):
                vals = [int(x) for x in v]
                if len(vals) != L:
                    raise ConfigError(f"{p}{key} has {len(vals)} entries but block_count is {L}")
                return vals
            return [int(v)] * L

        pattern = get("attention.sliding_window_pattern", None)
        if pattern is None:
            layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(L)]
        else:
            if len(pattern) != L:
                raise ConfigError(f"{p}attention.sliding_window_pattern has {len(pattern)} entries, block_count is {L}")
            layer_types = [SLIDING if bool(x) else FULL for x in pattern]
        heads = per_layer("attention.head_count")
        if len(set(heads)) != 1:
            raise ConfigError(f"{p}attention.head_count varies per layer ({sorted(set(heads))}); not a Gemma 4 layout")
        kv = per_layer("attention.head_count_kv")
        kv_by_type = {}
        for t, h in zip(layer_types, kv):
            if kv_by_type.setdefault(t, h) != h:
                raise ConfigError(f"{p}attention.head_count_kv differs between {t} layers")
        ffn = per_layer("feed_forward_length")
        n_shared = int(get("attention.shared_kv_layers", 0))
        base_ffn = ffn[0]
        double_wide = any(f != base_ffn for f in ffn)
        for i, f in enumerate(ffn):
            want = base_ffn * (2 if double_wide and i >= L - n_shared else 1)
            if f != want:
                raise ConfigError(f"{p}feed_forward_length[{i}] = {f} fits neither a uniform width nor the "
                                  f"double-wide rule (expected {want})")
        global_head_dim = int(get("attention.key_length", 512))
        if int(get("attention.value_length", global_head_dim)) != global_head_dim:
            raise ConfigError(f"{p}attention.value_length differs from key_length")
        head_dim = int(get("attention.key_length_swa", 256))

        vocab = None
        k_eq_v = None
        partial = 0.25
        if tensors is not None:
            emb = tensors.get("token_embd.weight")
            if emb is None:
                raise ConfigError("GGUF has no token_embd.weight tensor")
            vocab = int(emb.shape[0])
            first_full = next((i for i, t in enumerate(layer_types) if t == FULL and i < L - n_shared), None)
            if first_full is not None:
                k_eq_v = f"blk.{first_full}.attn_v.weight" not in tensors
            rf = tensors.get("rope_freqs.weight")
            if rf is not None:
                partial = _rotary_fraction(rf, global_head_dim)
        if vocab is None:
            toks = metadata.get("tokenizer.ggml.tokens")
            vocab = len(toks) if toks is not None else 262144
        if k_eq_v is None:
            k_eq_v = kv_by_type.get(FULL) != kv_by_type.get(SLIDING, kv_by_type.get(FULL))
        kv_full = kv_by_type.get(FULL, kv[0])
        kv_sliding = kv_by_type.get(SLIDING, kv_full)
        if not k_eq_v and kv_full != kv_sliding:
            raise ConfigError("full layers have their own kv head count but also a v projection; "
                              "transformers only uses separate global kv heads when K=V")
        eos = metadata.get("tokenizer.ggml.eos_token_ids")
        eos = [int(x) for x in eos] if eos is not None else [int(metadata.get("tokenizer.ggml.eos_token_id", 1))]
        if 106 not in eos:
            eos.append(106)
        ple = int(get("embedding_length_per_layer_input", 0))
        ple_vocab = vocab
        if ple and tensors is not None and "per_layer_token_embd.weight" in tensors:
            ple_vocab = int(tensors["per_layer_token_embd.weight"].shape[0])
        softcap = get("final_logit_softcapping", None)
        n_exp = int(get("expert_count", 0))
        cfg = cls(
            hidden_size=int(get("embedding_length")),
            num_hidden_layers=L,
            intermediate_size=base_ffn,
            num_attention_heads=heads[0],
            num_key_value_heads=kv_sliding,
            layer_types=layer_types,
            vocab_size=vocab,
            head_dim=head_dim,
            global_head_dim=global_head_dim,
            num_global_key_value_heads=kv_full if k_eq_v else None,
            attention_k_eq_v=bool(k_eq_v),
            sliding_window=int(get("attention.sliding_window")),
            rms_norm_eps=f32("attention.layer_norm_rms_epsilon", 1e-6),
            final_logit_softcapping=f32("final_logit_softcapping", 0.0) if softcap else None,
            num_kv_shared_layers=n_shared,
            use_double_wide_mlp=double_wide,
            hidden_size_per_layer_input=ple,
            vocab_size_per_layer_input=ple_vocab,
            enable_moe_block=n_exp > 0,
            num_experts=n_exp or None,
            top_k_experts=int(get("expert_used_count", 0)) or None,
            moe_intermediate_size=int(get("expert_feed_forward_length", 0)) or None,
            rope_theta=f32("rope.freq_base_swa", 10_000.0),
            global_rope_theta=f32("rope.freq_base", 1_000_000.0),
            global_partial_rotary_factor=partial,
            max_position_embeddings=int(get("context_length", 262144)),
            bos_token_id=int(metadata.get("tokenizer.ggml.bos_token_id", 2)),
            eos_token_id=eos,
            pad_token_id=int(metadata.get("tokenizer.ggml.padding_token_id", 0)),
        )
        if tensors is not None:
            cfg.check_tensor_shapes({name: tuple(t.shape) for name, t in tensors.items()})
        return cfg

    def to_gguf_metadata(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(metadata, metadata_types) for general.architecture and every `gemma4.*` key llama.cpp writes.

        Type codes follow GGUF: 4 u32, 5 i32, 6 f32, 7 bool, 8 string, (9, elem) arrays."""
        L = self.num_hidden_layers
        p = "gemma4."
        md: dict[str, Any] = {"general.architecture": "gemma4"}
        ty: dict[str, Any] = {"general.architecture": _STR}

        def put(key, value, code):
            md[p + key] = value
            ty[p + key] = code

        put("block_count", L, _U32)
        put("context_length", self.max_position_embeddings, _U32)
        put("embedding_length", self.hidden_size, _U32)
        widths = [layer.intermediate_size for layer in self.layers]
        if len(set(widths)) == 1:
            put("feed_forward_length", widths[0], _U32)
        else:
            put("feed_forward_length", widths, (_ARR, _I32))
        put("attention.head_count", self.num_attention_heads, _U32)
        kv = [layer.num_kv_heads for layer in self.layers]
        if self.num_global_key_value_heads is not None:
            put("attention.head_count_kv", kv, (_ARR, _I32))
        else:
            put("attention.head_count_kv", self.num_key_value_heads, _U32)
        put("attention.key_length", self.global_head_dim, _U32)
        put("attention.value_length", self.global_head_dim, _U32)
        put("attention.key_length_swa", self.head_dim, _U32)
        put("attention.value_length_swa", self.head_dim, _U32)
        put("attention.sliding_window", self.sliding_window, _U32)
        put("attention.sliding_window_pattern", [t == SLIDING for t in self.layer_types], (_ARR, _BOOL))
        put("attention.shared_kv_layers", self.num_kv_shared_layers, _U32)
        put("attention.layer_norm_rms_epsilon", float(self.rms_norm_eps), _F32)
        put("embedding_length_per_layer_input", self.hidden_size_per_layer_input, _U32)
        put("rope.freq_base", float(self.global_rope_theta), _F32)
        put("rope.freq_base_swa", float(self.rope_theta), _F32)
        put("rope.dimension_count", self.global_head_dim, _U32)
        put("rope.dimension_count_swa", self.head_dim, _U32)
        if self.final_logit_softcapping:
            put("final_logit_softcapping", float(self.final_logit_softcapping), _F32)
        if self.enable_moe_block:
            put("expert_count", self.num_experts, _U32)
            put("expert_used_count", self.top_k_experts, _U32)
            put("expert_feed_forward_length", self.moe_intermediate_size, _U32)
        return md, ty

    def rope_freqs(self) -> list[float]:
        """The GGUF `rope_freqs.weight` divisors for full layers: 1.0 for rotated pairs, 1e30 for the rest."""
        pairs = self.global_head_dim // 2
        n_rot = int(self.global_partial_rotary_factor * self.global_head_dim // 2)
        return [1.0] * n_rot + [1e30] * (pairs - n_rot)

    # ------------------------------------------------------------------ tensor shapes

    def expected_tensor_shapes(self) -> dict[str, tuple[tuple[int, ...], bool]]:
        """GGUF tensor name -> (numpy shape, required). Shared layers' K/V tensors are optional."""
        H, V = self.hidden_size, self.vocab_size
        out: dict[str, tuple[tuple[int, ...], bool]] = {
            "token_embd.weight": ((V, H), True),
            "output_norm.weight": ((H,), True),
            "rope_freqs.weight": ((self.global_head_dim // 2,), False),
        }
        D = self.hidden_size_per_layer_input
        if D:
            out["per_layer_token_embd.weight"] = ((self.vocab_size_per_layer_input, self.num_hidden_layers * D), True)
            out["per_layer_model_proj.weight"] = ((self.num_hidden_layers * D, H), True)
            out["per_layer_proj_norm.weight"] = ((D,), True)
        for s in self.layers:
            b = f"blk.{s.index}."
            d, nq, nkv, F = s.head_dim, s.num_heads, s.num_kv_heads, s.intermediate_size
            kv_required = not s.kv_shared
            out.update({
                b + "attn_norm.weight": ((H,), True),
                b + "attn_q.weight": ((nq * d, H), True),
                b + "attn_k.weight": ((nkv * d, H), kv_required),
                b + "attn_output.weight": ((H, nq * d), True),
                b + "attn_q_norm.weight": ((d,), True),
                b + "attn_k_norm.weight": ((d,), kv_required),
                b + "post_attention_norm.weight": ((H,), True),
                b + "ffn_norm.weight": ((H,), True),
                b + "ffn_gate.weight": ((F, H), True),
                b + "ffn_up.weight": ((F, H), True),
                b + "ffn_down.weight": ((H, F), True),
                b + "post_ffw_norm.weight": ((H,), True),
                b + "layer_output_scale.weight": ((1,), True),
            })
            if not s.k_eq_v:
                out[b + "attn_v.weight"] = ((nkv * d, H), kv_required)
            if s.moe:
                E, Fe = self.num_experts, self.moe_intermediate_size
                out.update({
                    b + "ffn_gate_inp.weight": ((E, H), True),
                    b + "ffn_gate_inp.scale": ((H,), True),
                    b + "ffn_gate_up_exps.weight": ((E, 2 * Fe, H), True),
                    b + "ffn_down_exps.weight": ((E, H, Fe), True),
                    b + "ffn_down_exps.scale": ((E,), True),
                    b + "pre_ffw_norm_2.weight": ((H,), True),
                    b + "post_ffw_norm_1.weight": ((H,), True),
                    b + "post_ffw_norm_2.weight": ((H,), True),
                })
            if D:
                out.update({
                    b + "inp_gate.weight": ((D, H), True),
                    b + "proj.weight": ((H, D), True),
                    b + "post_norm.weight": ((H,), True),
                })
        return out

    def check_tensor_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Raise ConfigError naming the first tensor whose shape disagrees with the config, a missing
        required tensor, or an unknown tensor (GGUF names, numpy-order shapes)."""
        expected = self.expected_tensor_shapes()
        for name, (shape, required) in expected.items():
            if name not in shapes:
                if required:
                    raise ConfigError(f"tensor {name} is missing (the metadata implies it)")
                continue
            if tuple(shapes[name]) != shape:
                raise ConfigError(f"tensor {name} has shape {tuple(shapes[name])} but the metadata implies {shape}")
        unknown = sorted(set(shapes) - set(expected))
        if unknown:
            raise ConfigError(f"tensor {unknown[0]} is not part of a Gemma 4 text model with this metadata"
                              + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _rotary_fraction(rope_freqs, head_dim: int) -> float:
    """Fraction of head_dim rotated, read from a GGUF rope_freqs tensor (divisor 1.0 = rotated pair)."""
    import numpy as np

    data = getattr(rope_freqs, "data", rope_freqs)
    ggml_type = getattr(rope_freqs, "ggml_type", 0)
    if ggml_type != 0:
        raise ConfigError(f"rope_freqs.weight must be F32, got ggml type {ggml_type}")
    vals = np.frombuffer(memoryview(np.ascontiguousarray(data)).cast("B"), dtype="<f4")
    if len(vals) != head_dim // 2:
        raise ConfigError(f"rope_freqs.weight has {len(vals)} entries, expected {head_dim // 2}")
    rotated = vals < 1e10
    n_rot = int(rotated.sum())
    if not rotated[:n_rot].all() or not np.allclose(vals[:n_rot], 1.0):
        raise ConfigError("rope_freqs.weight is not of the proportional form [1.0]*n + [1e30]*rest")
    return 2 * n_rot / head_dim


def _pattern(L: int, period: int) -> list[str]:
    return [FULL if (i + 1) % period == 0 else SLIDING for i in range(L)]


def _preset(**kw) -> ModelConfig:
    return ModelConfig(**kw)


# The five published text variants and their MTP assistants (gemma4-spec.md §2).
PRESETS: dict[str, ModelConfig] = {
    "E2B": _preset(hidden_size=1536, num_hidden_layers=35, intermediate_size=6144, num_attention_heads=8,
                   num_key_value_heads=1, layer_types=_pattern(35, 5), sliding_window=512,
                   num_kv_shared_layers=20, use_double_wide_mlp=True, hidden_size_per_layer_input=256,
                   max_position_embeddings=131072),
    "E4B": _preset(hidden_size=2560, num_hidden_layers=42, intermediate_size=10240, num_attention_heads=8,
                   num_key_value_heads=2, layer_types=_pattern(42, 6), sliding_window=512,
                   num_kv_shared_layers=18, hidden_size_per_layer_input=256, max_position_embeddings=131072),
    "12B": _preset(hidden_size=3840, num_hidden_layers=48, intermediate_size=15360, num_attention_heads=16,
                   num_key_value_heads=8, num_global_key_value_heads=1, attention_k_eq_v=True,
                   layer_types=_pattern(48, 6), sliding_window=1024),
    "26B-A4B": _preset(hidden_size=2816, num_hidden_layers=30, intermediate_size=2112, num_attention_heads=16,
                       num_key_value_heads=8, num_global_key_value_heads=2, attention_k_eq_v=True,
                       layer_types=_pattern(30, 6), sliding_window=1024, enable_moe_block=True,
                       num_experts=128, top_k_experts=8, moe_intermediate_size=704),
    "31B": _preset(hidden_size=5376, num_hidden_layers=60, intermediate_size=21504, num_attention_heads=32,
                   num_key_value_heads=16, num_global_key_value_heads=4, attention_k_eq_v=True,
                   layer_types=_pattern(60, 6), sliding_window=1024),
    # Assistants: every layer reads the target's K/V (num_kv_shared_layers == num_hidden_layers).
    "E2B-assistant": _preset(hidden_size=256, num_hidden_layers=4, intermediate_size=2048, num_attention_heads=4,
                             num_key_value_heads=1, layer_types=[SLIDING] * 3 + [FULL], sliding_window=512,
                             num_kv_shared_layers=4, final_logit_softcapping=None, backbone_hidden_size=1536,
                             use_ordered_embeddings=True, num_centroids=2048, centroid_intermediate_top_k=32),
    # E4B and 12B assistant sizes are UNCONFIRMED (gemma4-spec §2.4); kv heads must equal the target's.
    "E4B-assistant": _preset(hidden_size=256, num_hidden_layers=4, intermediate_size=2048, num_attention_heads=4,
                             num_key_value_heads=2, layer_types=[SLIDING] * 3 + [FULL], sliding_window=512,
                             num_kv_shared_layers=4, final_logit_softcapping=None, backbone_hidden_size=2560,
                             use_ordered_embeddings=True, num_centroids=2048, centroid_intermediate_top_k=32),
    "12B-assistant": _preset(hidden_size=1024, num_hidden_layers=4, intermediate_size=8192, num_attention_heads=16,
                             num_key_value_heads=8, num_global_key_value_heads=1, attention_k_eq_v=True,
                             layer_types=[SLIDING] * 3 + [FULL], sliding_window=1024, num_kv_shared_layers=4,
                             final_logit_softcapping=None, backbone_hidden_size=3840),
    "26B-A4B-assistant": _preset(hidden_size=1024, num_hidden_layers=4, intermediate_size=8192,
                                 num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2,
                                 attention_k_eq_v=True, layer_types=[SLIDING] * 3 + [FULL], sliding_window=1024,
                                 num_kv_shared_layers=4, final_logit_softcapping=None, backbone_hidden_size=2816),
    "31B-assistant": _preset(hidden_size=1024, num_hidden_layers=4, intermediate_size=8192, num_attention_heads=32,
                             num_key_value_heads=16, num_global_key_value_heads=4, attention_k_eq_v=True,
                             layer_types=[SLIDING] * 3 + [FULL], sliding_window=1024, num_kv_shared_layers=4,
                             final_logit_softcapping=None, backbone_hidden_size=5376),
}


def preset(name: str) -> ModelConfig:
    """A copy of a published variant's config, e.g. preset("31B")."""
    try:
        return dataclasses.replace(PRESETS[name])
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None


def num_params(cfg: ModelConfig) -> int:
    """Parameter count of the text model implied by the config (tied head counted once)."""
    return sum(math.prod(shape) for shape, required in cfg.expected_tensor_shapes().values() if required)
