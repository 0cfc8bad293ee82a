"""Tensor names of the Gemma 4 text model: Hugging Face safetensors <-> llama.cpp GGUF.

One table (gemma4-spec.md sections 6 and 7.3). HF names are given here WITHOUT the model prefix
(``model.`` for ``Gemma4ForCausalLM``, ``model.language_model.`` for the multimodal classes), e.g.
``layers.3.self_attn.q_proj.weight``; GGUF names are llama.cpp's, e.g. ``blk.3.attn_q.weight``.

Shapes are not changed by the mapping: a GGUF tensor's numpy shape equals the HF (PyTorch) shape,
e.g. q_proj [out, in] -> attn_q numpy (out, in) = ne [in, out]; experts.gate_up_proj [E, 2F, H] ->
ffn_gate_up_exps numpy (E, 2F, H) = ne [H, 2F, E].
"""

from __future__ import annotations

import re

__all__ = [
    "UnknownTensorName",
    "GLOBAL_HF_TO_GGUF",
    "LAYER_HF_TO_GGUF",
    "ROPE_FREQS",
    "strip_hf_prefix",
    "is_multimodal_tower",
    "hf_to_gguf_name",
    "gguf_to_hf_name",
]


class UnknownTensorName(KeyError):
    """A tensor name that is neither part of the Gemma 4 text model nor a known skippable tensor."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


# model-level tensors: HF name (no prefix) -> GGUF name
GLOBAL_HF_TO_GGUF: dict[str, str] = {
    "embed_tokens.weight": "token_embd.weight",  # also the tied output head
    "norm.weight": "output_norm.weight",
    # per-layer embeddings (E2B/E4B)
    "embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}

# per-layer tensors: HF suffix after ``layers.N.`` -> GGUF suffix after ``blk.N.``
LAYER_HF_TO_GGUF: dict[str, str] = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "layer_scalar": "layer_output_scale.weight",  # buffer [1], no .weight in HF
    # per-layer embeddings (E2B/E4B)
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
    # MoE (26B-A4B): router and fused experts
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",  # [E, 2F, H], rows 0..F-1 = gate
    "experts.down_proj": "ffn_down_exps.weight",  # [E, H, F]
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
}

# synthesised by the converter (proportional RoPE of full layers); no HF counterpart
ROPE_FREQS = "rope_freqs.weight"

_GGUF_TO_HF_GLOBAL = {v: k for k, v in GLOBAL_HF_TO_GGUF.items()}
_GGUF_TO_HF_LAYER = {v: k for k, v in LAYER_HF_TO_GGUF.items()}

# first name component (after ``model.``) of multimodal parts that a text GGUF does not contain
_TOWER_PREFIXES = (
    "vision_tower.",
    "embed_vision.",
    "audio_tower.",
    "embed_audio.",
    "vision_embedder.",
    "multi_modal_projector.",
)
# text-model tensors that are not written: the tied head and runtime rotary buffers
_SKIPPED_TEXT = re.compile(r"^(lm_head\.weight|(layers\.\d+\.self_attn\.)?rotary_emb\..*)$")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def _strip_model(hf_name: str) -> str:
    return hf_name[len("model."):] if hf_name.startswith("model.") else hf_name


def is_multimodal_tower(hf_name: str) -> bool:
    """True for vision/audio tower and multimodal embedder tensors (e.g. ``model.vision_tower.*``,
    ``model.embed_audio.*``, 12B ``model.vision_embedder.*``)."""
    return _strip_model(hf_name).startswith(_TOWER_PREFIXES)


def strip_hf_prefix(hf_name: str) -> str:
    """``model.language_model.X`` / ``model.X`` / ``language_model.X`` / ``X`` -> ``X``."""
    name = _strip_model(hf_name)
    if name.startswith("language_model."):
        name = _strip_model(name[len("language_model."):])
    return name


def hf_to_gguf_name(hf_name: str) -> str | None:
    """HF checkpoint tensor name (with or without prefix) -> GGUF name.

    Returns None for tensors a text GGUF does not contain: vision/audio towers, the tied
    ``lm_head.weight`` and rotary buffers. Raises UnknownTensorName for anything else not in the table.
    """
    if is_multimodal_tower(hf_name):
        return None
    name = strip_hf_prefix(hf_name)
    if _SKIPPED_TEXT.match(name):
        return None
    if name in GLOBAL_HF_TO_GGUF:
        return GLOBAL_HF_TO_GGUF[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in LAYER_HF_TO_GGUF:
        return f"blk.{int(m.group(1))}.{LAYER_HF_TO_GGUF[m.group(2)]}"
    raise UnknownTensorName(f"unknown Gemma 4 tensor name {hf_name!r} (not in the HF->GGUF table)")


def gguf_to_hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> HF text-model name without prefix (``blk.3.attn_q.weight`` ->
    ``layers.3.self_attn.q_proj.weight``). ``rope_freqs.weight`` has no HF counterpart and, like
    any unknown name, raises UnknownTensorName."""
    if gguf_name in _GGUF_TO_HF_GLOBAL:
        return _GGUF_TO_HF_GLOBAL[gguf_name]
    m = _BLK_RE.match(gguf_name)
    if m and m.group(2) in _GGUF_TO_HF_LAYER:
        return f"layers.{int(m.group(1))}.{_GGUF_TO_HF_LAYER[m.group(2)]}"
    if gguf_name == ROPE_FREQS:
        raise UnknownTensorName(f"{ROPE_FREQS!r} is synthesised by the converter and has no HF name")
    raise UnknownTensorName(f"unknown Gemma 4 GGUF tensor name {gguf_name!r}")
