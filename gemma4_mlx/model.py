"""Gemma 4 text models as MLX modules (gemma4-spec.md §3-§4).

Parameter names mirror transformers' `Gemma4ForCausalLM` (`model.layers.N.self_attn.q_proj.weight`
...), so HF safetensors map 1:1; the one difference is that the fused expert tensors carry a
`.weight` suffix (`experts.gate_up_proj.weight`), as in GGUF.
"""

from __future__ import annotations

import itertools
import math

import mlx.core as mx
import mlx.nn as nn

from custom_kernels import use_kernel
from custom_kernels.attention import MAX_QUERY_ROWS, decode_attention, new_attention_counters
from custom_kernels.matvec_norm import matvec_norm_supported, matvec_residual_norm, new_matvec_norm_counters
from custom_kernels.norm import residual_norm, residual_norm_moe, residual_norm_moe_out, residual_norm_reference
from custom_kernels.quant_matvec import gelu_tanh
from custom_kernels.rope import inverse_frequencies, norm_rope
from custom_kernels.router import (new_router_counters, residual_norm_route, route, route_logits, route_logits_supported,
                                   router_logits)

from . import cpu_matvec
from .cache import StaticKVCache, StaticRotatingKVCache
from .config import LayerSpec, ModelConfig


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight (no "1 + w"), computed in fp32. `with_scale=False`: no weight."""

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        if with_scale:
            self.weight = mx.ones((dim,))

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.get("weight"), self.eps)


def add_norm(h, a, post_norm: RMSNorm, next_norm: RMSNorm | None = None, scale=None):
    """The residual stream after a branch: out = (h + post_norm(a)) [* scale], and next_norm(out)
    (None without next_norm). One launch on GPUs (custom_kernels.norm), MLX ops otherwise."""
    w_next = None if next_norm is None else next_norm.weight
    fused = residual_norm if use_kernel("norm") else residual_norm_reference
    return fused(h, a, post_norm.weight, w_next, post_norm.eps, scale)


def linear_add_norm(linear, y, h, post_norm: RMSNorm, next_norm: RMSNorm | None = None, scale=None, counters=None):
    """add_norm(h, linear(y), post_norm, next_norm, scale): one launch where `linear` holds raw
    Q4_0 / Q8_0 blocks and custom_kernels.matvec_norm takes the call (family "matvec_norm";
    counters: the call site's new_matvec_norm_counters())."""
    w_next = None if next_norm is None else next_norm.weight
    if (counters is None or getattr(linear, "blocks", None) is None
            or not matvec_norm_supported(y, linear.ggml_type, linear.out_dims, h, post_norm.weight, w_next, scale)):
        return add_norm(h, linear(y), post_norm, next_norm, scale)
    return matvec_residual_norm(y, linear.blocks, linear.ggml_type, linear.out_dims, h, post_norm.weight, w_next,
                                post_norm.eps, scale, counters)  # fmt: skip


class ExpertLinear(nn.Module):
    """A stack of E expert matrices weight [E, out, in]; `x[..., k, 1, in]` @ weight[idx].T."""

    def __init__(self, num_experts: int, in_dims: int, out_dims: int):
        super().__init__()
        self.weight = mx.zeros((num_experts, out_dims, in_dims))

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if "scales" in self:
            return mx.gather_qmm(x, self.weight, self.scales, self.get("biases"), rhs_indices=indices,
                                 transpose=True, group_size=self.group_size, bits=self.bits).astype(x.dtype)
        w = self.weight
        if w.dtype != mx.float32 and mx.default_device() == mx.cpu:
            # MLX's CPU gather_mm supports only float32 (0.32.4).
            return mx.gather_mm(x.astype(mx.float32), w.astype(mx.float32).swapaxes(-1, -2),
                                rhs_indices=indices).astype(x.dtype)
        return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=indices)


def scaled_embedding(table, tokens: mx.array, scale: float) -> mx.array:
    """table(tokens) * scale [..., H], the scale rounded to the table's dtype as in HF (a
    BlockEmbedding does both in one launch where it can)."""
    e = table.scaled(tokens, scale) if hasattr(table, "scaled") else None
    if e is not None:
        return e
    e = table(tokens)
    return e * mx.array(scale, dtype=mx.float32).astype(e.dtype)


def _split_even(a: mx.array, n: int, most: int = 10) -> list[mx.array]:
    """a [..., n * D] -> n arrays [..., D] through Split nodes of at most `most` outputs each: MLX
    makes a split into more than 10 parts n Slice nodes (E4B's 42 per-layer inputs: 42 nodes of a
    decode step, 6 this way)."""
    if a.shape[-1] % n:
        raise ValueError(f"cannot split {a.shape[-1]} elements into {n} equal parts")
    if n <= most:
        return mx.split(a, n, axis=-1)
    d = a.shape[-1] // n
    sizes = [min(most, n - i) for i in range(0, n, most)]
    groups = mx.split(a, list(itertools.accumulate(s * d for s in sizes[:-1])), axis=-1)
    return [part for g, s in zip(groups, sizes) for part in mx.split(g, s, axis=-1)]


def _split_heads(y: mx.array, heads: int) -> mx.array:
    """[B, T, heads * d] -> [B, heads, T, d]. One token: a reshape alone (one graph node, not two;
    every node costs host time in a decode step)."""
    B, T, _ = y.shape
    if T == 1:
        return y.reshape(B, heads, 1, -1)
    return y.reshape(B, T, heads, -1).transpose(0, 2, 1, 3)


def _merge_heads(y: mx.array) -> mx.array:
    """[B, heads, T, d] -> [B, T, heads * d] (one token: a reshape alone)."""
    B, _, T, _ = y.shape
    if T == 1:
        return y.reshape(B, 1, -1)
    return y.transpose(0, 2, 1, 3).reshape(B, T, -1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        H, d = cfg.hidden_size, spec.head_dim
        self.spec = spec
        self.q_proj = nn.Linear(H, spec.num_heads * d, bias=False)
        self.o_proj = nn.Linear(spec.num_heads * d, H, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        if not spec.kv_shared:
            self.k_proj = nn.Linear(H, spec.num_kv_heads * d, bias=False)
            if not spec.k_eq_v:
                self.v_proj = nn.Linear(H, spec.num_kv_heads * d, bias=False)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.v_norm = RMSNorm(d, cfg.rms_norm_eps, with_scale=False)
        self._counters = new_attention_counters()  # the one-launch decode attention's tickets (not a parameter)
        if spec.is_sliding:
            self._rope = dict(base=spec.rope_theta, freqs=None)
            self._inv_freq = mx.array(inverse_frequencies(d, base=spec.rope_theta))
        else:
            # Proportional RoPE: pairs (i, i + d/2), frequency theta^(-2i/d) for the first
            # rope_pairs pairs, 0 (an infinite period) for the rest. MLX takes periods.
            n = spec.rope_pairs
            periods = [spec.rope_theta ** (2 * i / d) for i in range(n)] + [math.inf] * (d // 2 - n)
            self._rope = dict(base=None, freqs=mx.array(periods, dtype=mx.float32))
            self._inv_freq = mx.array(inverse_frequencies(d, periods=periods))

    def rope(self, x: mx.array, offset) -> mx.array:
        """x [B, heads, T, d] at positions offset..offset+T-1 (offset: int or int32 array)."""
        return mx.fast.rope(x, self.spec.head_dim, traditional=False, scale=1.0, offset=offset, **self._rope)

    def project(self, x: mx.array) -> list[mx.array]:
        """q, then k and v where this layer computes them (k only when K = V) [B, T, heads * d]:
        one launch through `qkv_proj` (quantized.fuse_projections) when the weights are fused."""
        fused = getattr(self, "qkv_proj", None)
        if fused is not None and fused.intact():
            return fused(x)
        s = self.spec
        names = ["q_proj"] + ([] if s.kv_shared else ["k_proj"] if s.k_eq_v else ["k_proj", "v_proj"])
        return [self[n](x) for n in names]

    def heads(self, x: mx.array, offset, q_pos: mx.array, stacked: bool = False):
        """q [B, heads, T, d] after q_norm and RoPE; k (k_norm, RoPE) and v (v_norm) [B, kv heads,
        T, d] where this layer computes them, else None; with ``stacked`` (q, kv, None), kv = k's
        rows then v's [2B, kv heads, T, d] (a one-buffer cache's update). One launch for the norms
        and RoPE on GPUs (custom_kernels.rope) when the projection output is one array."""
        B, T, _ = x.shape
        s = self.spec
        fused = getattr(self, "qkv_proj", None)
        one_output = s.kv_shared or (fused is not None and fused.intact())
        if one_output and T <= MAX_QUERY_ROWS and use_kernel("norm_rope"):
            y = self.q_proj(x) if s.kv_shared else fused.matvec(x)
            hkv = 0 if s.kv_shared else s.num_kv_heads
            out = norm_rope(y, (s.num_heads, hkv, s.head_dim, s.k_eq_v), self.q_norm.weight,
                            None if s.kv_shared else self.k_norm.weight, q_pos, self.q_norm.eps,
                            self._inv_freq, stacked=stacked)  # fmt: skip
            return (*out, None) if stacked else out
        counts = [s.num_heads] + ([] if s.kv_shared else [s.num_kv_heads] * (1 if s.k_eq_v else 2))
        if T == 1 and len(counts) > 1 and fused is not None and fused.intact():
            # one token: the fused output becomes heads once, then one split along the head axis
            y = fused.matvec(x).reshape(B, sum(counts), 1, s.head_dim)
            q, *kv = mx.split(y, list(itertools.accumulate(counts))[:-1], axis=1)
        else:
            q, *kv = (_split_heads(t, n) for t, n in zip(self.project(x), counts))
        q = self.rope(self.q_norm(q), offset)
        if s.kv_shared:
            return q, None, None
        k = kv[0]
        v = self.v_norm(k if s.k_eq_v else kv[1])
        k = self.rope(self.k_norm(k), offset)
        return (q, mx.concatenate([k, v]), None) if stacked else (q, k, v)

    def __call__(self, x, offset, q_pos, cache, shared_kv, mask_fn):
        """x [B, T, H] -> [B, T, H]: o_proj(attend(...))."""
        return self.o_proj(self.attend(x, offset, q_pos, cache, shared_kv, mask_fn))

    def attend(self, x, offset, q_pos, cache, shared_kv, mask_fn):
        """x [B, T, H] -> the heads' attention output [B, T, heads * d] (o_proj's input); offset:
        positions held before this step (int, or the int32 array of a compiled step), q_pos: int32
        [T] this step's positions (offset + 0..T-1, computed once per step by TextModel). Owners
        update `cache` and publish (K, V, positions, n_slots) in shared_kv[type] for the KV-shared
        consumers of this step (K may be a one-buffer cache's whole K|V buffer, [2B, ...], and V a
        view of its last B rows); consumers read it from there."""
        T = x.shape[1]
        s = self.spec
        q, k, v = self.heads(x, offset, q_pos, stacked=getattr(cache, "one_buffer", False))
        n_slots = None
        if s.kv_shared:
            keys, values, positions, n_slots = shared_kv[s.type]
        else:
            if cache is not None:
                keys, values, positions = cache.update(k, v)
                n_slots = cache.valid_slots if isinstance(cache, (StaticKVCache, StaticRotatingKVCache)) else None
            else:
                keys, values, positions = k, v, q_pos
            shared_kv[s.type] = (keys, values, positions, n_slots)
        if T <= MAX_QUERY_ROWS and use_kernel("attention"):
            # decode / verification on a GPU: split-GQA kernel straight over the cache buffers, its
            # output already [B, T, heads * d]
            counters = self._counters if use_kernel("attention_fused") else None  # one launch where it pays
            out = decode_attention(q, keys, values, positions, q_pos, s.sliding_window, n_slots=n_slots,
                                   merged=True, counters=counters, staged=use_kernel("attention_staged"),
                                   mma=use_kernel("attention_mma"), mma_staged=use_kernel("attention_mma_staged"),
                                   mma8=use_kernel("attention_mma8"))  # fmt: skip
        else:
            if keys.shape[0] != values.shape[0]:  # a one-buffer cache's: K is its first B rows
                keys = keys[: values.shape[0]]
            out = _merge_heads(mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0,
                                                                    mask=mask_fn(s, positions)))  # fmt: skip
        return out


class MLP(nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def __call__(self, x):
        y = self.one_launch_output(x)
        return self.down_proj(self.hidden(x)) if y is None else y

    def one_launch_output(self, x):
        """The MLP's output [..., H] from one launch (quantized.MLPStacks, family "mlp_one_launch"),
        or None where that does not apply."""
        stacks = getattr(self, "one_launch", None)
        if stacks is None or stacks.down is not self.down_proj:  # a module swapped after fuse_projections
            return None
        return stacks(x)

    def hidden(self, x):
        """gelu_tanh(gate_proj(x)) * up_proj(x): down_proj's input [..., width]."""
        fused = getattr(self, "gate_up_proj", None)  # quantized.fuse_projections: one launch
        if fused is not None and fused.intact():
            return fused.gelu_product(x)
        return gelu_tanh(self.gate_proj(x)) * self.up_proj(x)


class Router(nn.Module):
    """Expert choice (§3.6): weightless norm x scale x H^-1/2 -> logits -> fp32 softmax -> top-k,
    renormalised, times per_expert_scale. Returns (weights [..., k] fp32, indices [..., k])."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.top_k_experts
        self.eps = cfg.rms_norm_eps
        self.root = cfg.hidden_size ** -0.5
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = mx.ones((cfg.hidden_size,))
        self.per_expert_scale = mx.ones((cfg.num_experts,))
        self._counters = new_router_counters()  # route_logits' tickets (not a parameter)

    def __call__(self, h):
        return self.select(self.normed(h))

    def normed(self, h):
        """The router's input: weightless norm of h times scale and H^-1/2 [..., H]."""
        return mx.fast.rms_norm(h, None, self.eps) * self.scale * self.root

    @property
    def plain_weight(self) -> mx.array | None:
        """The projection's weight [E, H] where it is a plain bias-free nn.Linear (what the router
        kernels take), else None."""
        proj = self.proj
        return proj.weight if type(proj) is nn.Linear and "bias" not in proj else None

    def select(self, r):
        """(weights [..., k] fp32, indices [..., k]) from the normed input r."""
        proj = self.proj
        plain = self.plain_weight is not None
        fused = plain and use_kernel("router_fused") and use_kernel("router")
        if fused and route_logits_supported(r, proj.weight, self.top_k):  # projection and route, one launch
            return route_logits(r, proj.weight, self.per_expert_scale, self.top_k, self._counters)
        if use_kernel("router_proj") and plain:
            logits = router_logits(r, proj.weight)  # one launch, no view nodes (custom_kernels.router)
        else:
            logits = proj(r)
        if use_kernel("router"):  # one launch for softmax, top-k and weights
            return route(logits, self.per_expert_scale, self.top_k)
        probs = mx.softmax(logits.astype(mx.float32), axis=-1)
        idx = mx.argpartition(-probs, self.top_k - 1, axis=-1)[..., : self.top_k]
        w = mx.take_along_axis(probs, idx, axis=-1)
        w = w / w.sum(axis=-1, keepdims=True)
        return w * self.per_expert_scale[idx].astype(mx.float32), idx


class Experts(nn.Module):
    """E GeGLU experts with fused gate|up weights [E, 2F, H] and down weights [E, H, F]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.width = F
        self.gate_up_proj = ExpertLinear(E, H, 2 * F)
        self.down_proj = ExpertLinear(E, F, H)

    def __call__(self, x, weights, indices):
        x = mx.expand_dims(x, (-2, -3))  # [..., 1, 1, H]
        gate_up = self.gate_up_proj(x, indices)  # [..., k, 1, 2F]
        gate, up = gate_up[..., : self.width], gate_up[..., self.width :]
        y = self.down_proj(gelu_tanh(gate) * up, indices).squeeze(-2)  # [..., k, H]
        return (y.astype(mx.float32) * weights[..., None]).sum(axis=-2).astype(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.spec = spec
        self.self_attn = Attention(cfg, spec)
        self.mlp = MLP(H, spec.intermediate_size)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps)
        self.layer_scalar = mx.ones((1,))
        self._tickets = [new_matvec_norm_counters() for _ in range(3)]  # linear_add_norm's call sites
        if spec.moe:
            self.router = Router(cfg)
            self.experts = Experts(cfg)
            self.pre_feedforward_layernorm_2 = RMSNorm(H, eps)
            self.post_feedforward_layernorm_1 = RMSNorm(H, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(H, eps)
        self.ple = cfg.hidden_size_per_layer_input > 0
        if self.ple:
            D = cfg.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(H, D, bias=False)
            self.per_layer_projection = nn.Linear(D, H, bias=False)
            self.post_per_layer_input_norm = RMSNorm(H, eps)

    def __call__(self, h, x, offset, q_pos, cache, shared_kv, mask_fn, per_layer_input=None, next_norm=None):
        """h: the residual stream [B, T, H], x: input_layernorm(h) -> (this layer's output h,
        next_norm(h)): the next layer's input norm (or the final norm) is fused into this layer's
        last residual add."""
        attn = self.self_attn
        if not self.spec.moe:
            y = attn.attend(x, offset, q_pos, cache, shared_kv, mask_fn)
            h, x = linear_add_norm(attn.o_proj, y, h, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                                   counters=self._tickets[0])  # fmt: skip
            last = not self.ple  # else the per-layer input's branch ends the layer
            end = (next_norm if last else None, self.layer_scalar if last else None)
            y = self.mlp.one_launch_output(x)
            if y is None:
                h, x = linear_add_norm(self.mlp.down_proj, self.mlp.hidden(x), h, self.post_feedforward_layernorm,
                                       *end, self._tickets[1])  # fmt: skip
            else:
                h, x = add_norm(h, y, self.post_feedforward_layernorm, *end)
            return (h, x) if last else self._ple(h, per_layer_input, next_norm)
        a = attn(x, offset, q_pos, cache, shared_kv, mask_fn)
        routed = self._norm_route(h, a)
        if routed is None:
            h, x, x_experts, x_router = self._moe_inputs(h, a)
            moe = self._moe_branch(x_experts, x_router)
        else:
            h, x, x_experts, weights, indices = routed
            moe = self.experts(x_experts, weights, indices)
        if not self.ple and use_kernel("norm_moe_out"):  # the layer's end in one launch
            return residual_norm_moe_out(h, self.mlp(x), moe, self.post_feedforward_layernorm_1.weight,
                                         self.post_feedforward_layernorm_2.weight,
                                         self.post_feedforward_layernorm.weight,
                                         None if next_norm is None else next_norm.weight,
                                         self.post_feedforward_layernorm.eps, self.layer_scalar)  # fmt: skip
        # post_ff_norm_1(mlp) + post_ff_norm_2(moe): the residual-norm op (one launch for the
        # second norm and the add on GPUs)
        m, _ = add_norm(self.post_feedforward_layernorm_1(self.mlp(x)), moe, self.post_feedforward_layernorm_2)
        if self.ple:
            h, _ = add_norm(h, m, self.post_feedforward_layernorm)
            return self._ple(h, per_layer_input, next_norm)
        return add_norm(h, m, self.post_feedforward_layernorm, next_norm, self.layer_scalar)

    def _ple(self, h, per_layer_input, next_norm):
        """An E-series layer's end: its per-layer input gated by h, projected, added through its
        norm, times the layer scalar -> (h, next_norm(h))."""
        gate = self.per_layer_input_gate
        if hasattr(gate, "gelu_mul") and per_layer_input.dtype == h.dtype:
            g = gate.gelu_mul(h, per_layer_input)  # BlockLinear: one launch where family matvec_gelu_mul is on
        else:
            g = gelu_tanh(gate(h)) * per_layer_input
        return linear_add_norm(self.per_layer_projection, g, h, self.post_per_layer_input_norm, next_norm,
                               self.layer_scalar, self._tickets[2])  # fmt: skip

    def _moe_branch(self, x, x_router):
        """The experts' weighted sum for x [..., H]: the route and the experts in one launch where
        BlockExperts.route_and_run takes it (family "moe_route_fold"), else the router, then the
        experts."""
        route_and_run = getattr(self.experts, "route_and_run", None)
        moe = None if route_and_run is None else route_and_run(x, x_router, self.router)
        return self.experts(x, *self.router.select(x_router)) if moe is None else moe

    def _norm_route(self, h, a):
        """_moe_inputs and the route in one launch (family "norm_route",
        custom_kernels.router.residual_norm_route) -> (h, x, x for the experts, weights, indices),
        or None (also with "moe_route_fold" on: it takes the router's input)."""
        if not use_kernel("norm_route") or use_kernel("moe_route_fold"):  # one check per MoE layer when off
            return None
        r = self.router
        w = r.plain_weight
        if w is None:
            return None
        return residual_norm_route(h, a, self.post_attention_layernorm.weight, self.pre_feedforward_layernorm.weight,
                                   self.pre_feedforward_layernorm_2.weight, r.scale, r.root,
                                   self.post_attention_layernorm.eps, w, r.per_expert_scale, r.top_k, r._counters)  # fmt: skip

    def _moe_inputs(self, h, a):
        """A MoE layer after attention: h + post_attention_norm(a) and the three norms of it the
        layer reads -> (h, x for the dense MLP, x for the experts, the router's input). One launch
        with op family "norm_moe" (custom_kernels.norm), else five or six."""
        if use_kernel("norm_moe"):
            r = self.router
            return residual_norm_moe(h, a, self.post_attention_layernorm.weight, self.pre_feedforward_layernorm.weight,
                                     self.pre_feedforward_layernorm_2.weight, r.scale, r.root,
                                     self.post_attention_layernorm.eps)  # fmt: skip
        h, x = add_norm(h, a, self.post_attention_layernorm, self.pre_feedforward_layernorm)
        return h, x, self.pre_feedforward_layernorm_2(h), self.router.normed(h)


class TextModel(nn.Module):
    """Embeddings, decoder layers and final norm (HF `Gemma4TextModel`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, spec) for spec in cfg.layers]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        D = cfg.hidden_size_per_layer_input
        if D:
            self.embed_tokens_per_layer = nn.Embedding(cfg.vocab_size_per_layer_input, cfg.num_hidden_layers * D)
            self.per_layer_model_projection = nn.Linear(cfg.hidden_size, cfg.num_hidden_layers * D, bias=False)
            self.per_layer_projection_norm = RMSNorm(D, cfg.rms_norm_eps)

    def embed(self, tokens: mx.array) -> mx.array:
        """Scaled token embeddings [B, T, H]; the scale is rounded to the weight dtype as in HF."""
        return scaled_embedding(self.embed_tokens, tokens, self.cfg.hidden_size ** 0.5)

    def per_layer_inputs(self, tokens: mx.array, h: mx.array) -> list[mx.array]:
        """PLE inputs (§4.1) from token ids and the scaled embeddings h: one [B, T, D] per layer
        (one split node for all of them, not a slice and a squeeze per layer)."""
        cfg = self.cfg
        L, D = cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
        t = scaled_embedding(self.embed_tokens_per_layer, tokens, D ** 0.5)
        p = self.per_layer_model_projection(h) * (cfg.hidden_size ** -0.5)
        p = self.per_layer_projection_norm(p.reshape(*h.shape[:-1], L, D))
        ple = (p + t.reshape(*tokens.shape, L, D)) * (2.0 ** -0.5)
        return _split_even(ple.reshape(*tokens.shape, L * D), L)

    def __call__(self, tokens, cache=None, hidden_states: list | None = None):
        B, T = tokens.shape
        first = next((c for c in (cache or []) if c is not None), None)
        offset = 0 if first is None else first.offset
        h = self.embed(tokens)
        if hidden_states is not None:
            hidden_states.append(h)
        ple = self.per_layer_inputs(tokens, h) if self.cfg.hidden_size_per_layer_input else None
        q_pos = mx.arange(T, dtype=mx.int32) if first is None else first.query_positions(T)
        masks = {}

        def mask_fn(spec: LayerSpec, k_pos: mx.array):
            key = (spec.type, k_pos.shape[0])
            if key not in masks:
                diff = q_pos[:, None] - k_pos[None, :]
                ok = (k_pos[None, :] >= 0) & (diff >= 0)
                if spec.is_sliding:
                    ok = ok & (diff < spec.sliding_window)
                masks[key] = ok
            return masks[key]

        shared_kv: dict = {}
        x = self.layers[0].input_layernorm(h)
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h, x = layer(h, x, offset, q_pos, cache[i] if cache else None, shared_kv, mask_fn,
                         ple[i] if ple is not None else None, next_norm)
            if hidden_states is not None:
                hidden_states.append(h)
        return x  # self.norm(h)


class Model(nn.Module):
    """Gemma 4 causal LM: `model(tokens [B, T], cache) -> logits [B, T, V]` (fp32, softcapped)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = TextModel(cfg)

    def __call__(self, tokens: mx.array, cache: list | None = None, return_hidden_states: bool = False):
        """tokens: int [B, T]; cache: from `cache.make_cache` (None: no cache, positions start at 0).

        With return_hidden_states=True returns (logits, hidden) where hidden lists the embedding
        output followed by every layer's output [B, T, H] (before the final norm)."""
        hidden = [] if return_hidden_states else None
        y = self.model(tokens, cache, hidden)
        logits = self.logits(y)
        return (logits, hidden) if return_hidden_states else logits

    def logits(self, y: mx.array) -> mx.array:
        """Tied head and final softcap on final-normed hidden states y [..., H] -> fp32 [..., V].

        On the CPU, for 1..8 rows outside mx.compile, the head runs through the native matvec
        (cpu_matvec.head_logits): y is evaluated here and the logits come back computed."""
        logits = cpu_matvec.head_logits(self, y) if self.native_head_ready(y) else None
        if logits is None:
            logits = self.model.embed_tokens.as_linear(y).astype(mx.float32)
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def native_head_ready(self, y: mx.array | None = None) -> bool:
        """True when `logits` runs the head through the native CPU matvec (cpu_matvec.head_ready)."""
        return cpu_matvec.head_ready(self, y)

    @property
    def layers(self):
        return self.model.layers
