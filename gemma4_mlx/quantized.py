"""Layers whose weights stay in a GGUF block format (Q4_0 / Q8_0).

On every backend the weight is held as MLX affine group-32 quantization, which maps Q4_0 / Q8_0
losslessly (scale d, bias -8d / -128d; gemma4_mlx.quants). Scales and biases are held in f32: the
file's fp16 d is exact there, while MLX rounds d*q+b twice when scales are fp16 (and bf16 would round
d itself). Outputs are cast back to the activation dtype (MLX promotes bf16 x f32 to f32).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import cpu_matvec
from .quants import Q4_0, Q6_K, Q8_0

BITS = {Q4_0: 4, Q8_0: 8}
GROUP_SIZE = 32


def _dequantize_on_cpu(rows: int) -> bool:
    """True where dequantize-to-f32 + BLAS beats mx.quantized_matmul (CPU, fast BLAS, many rows)."""
    if mx.default_device() != mx.cpu:
        return False
    from . import blas

    return blas.quantized_matmul_strategy(rows) == "dequantize_f32"


class QuantizedLinear(nn.Module):
    """y = x @ W.T for W [out, in] stored as (weight uint32, scales, biases), group 32."""

    def __init__(self, in_dims: int, out_dims: int, bits: int):
        super().__init__()
        self.bits = bits
        self.group_size = GROUP_SIZE
        self.weight = mx.zeros((out_dims, in_dims * bits // 32), mx.uint32)
        self.scales = mx.zeros((out_dims, in_dims // GROUP_SIZE), mx.float32)
        self.biases = mx.zeros((out_dims, in_dims // GROUP_SIZE), mx.float32)

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        y = cpu_matvec.affine_linear(self, x)  # CPU decode, outside mx.compile: the native matvec
        if y is not None:
            return y.astype(x.dtype)
        if _dequantize_on_cpu(rows):
            # Prefill on CPU: one layer's f32 weight through the fast BLAS beats MLX's CPU
            # quantized kernel ~40x at 512 rows (bench/cpu_matmul.py); freed after the matmul.
            w = mx.dequantize(self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits)
            return (x.astype(mx.float32) @ w.T).astype(x.dtype)
        y = mx.quantized_matmul(x, self.weight, self.scales, self.biases, transpose=True,
                                group_size=self.group_size, bits=self.bits)
        return y.astype(x.dtype)


class QuantizedEmbedding(QuantizedLinear):
    """Token embedding [V, H] in block format; `as_linear` is the tied output head."""

    def __init__(self, num_embeddings: int, dims: int, bits: int, dtype=mx.bfloat16):
        super().__init__(dims, num_embeddings, bits)
        self.dtype = dtype

    def __call__(self, tokens: mx.array) -> mx.array:
        w = mx.dequantize(self.weight[tokens], self.scales[tokens], self.biases[tokens],
                          group_size=self.group_size, bits=self.bits)
        return w.astype(self.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        return QuantizedLinear.__call__(self, x)


def quantized_experts(num_experts: int, in_dims: int, out_dims: int, bits: int) -> dict:
    """Parameter placeholders of a quantized ExpertLinear (weight/scales/biases [E, out, ...])."""
    return dict(
        weight=mx.zeros((num_experts, out_dims, in_dims * bits // 32), mx.uint32),
        scales=mx.zeros((num_experts, out_dims, in_dims // GROUP_SIZE), mx.float32),
        biases=mx.zeros((num_experts, out_dims, in_dims // GROUP_SIZE), mx.float32),
    )


# ---------------------------------------------------------------------------------------------
# Raw GGUF blocks (GPU backends): the file's bytes are the only copy of the weight, read by the
# fused dequant-matvec kernels of custom_kernels.quant_matvec for 1..8 rows (decode, speculative
# verification); more rows (prefill) go through the op's reference (dequantize + matmul).

BLOCK_TYPES = (Q4_0, Q8_0, Q6_K)  # types the dense matvec kernels read
EXPERT_BLOCK_TYPES = (Q4_0, Q8_0)  # types the expert-gather kernels read


class BlockLinear(nn.Module):
    """y = x @ W.T with W [out, in] held as raw GGUF blocks uint8 [out, row_bytes]."""

    def __init__(self, in_dims: int, out_dims: int, ggml_type: int):
        super().__init__()
        from custom_kernels.quant_matvec import row_bytes

        self.ggml_type = ggml_type
        self.in_dims, self.out_dims = in_dims, out_dims
        self.blocks = mx.zeros((out_dims, row_bytes(ggml_type, in_dims)), mx.uint8)

    def __call__(self, x: mx.array) -> mx.array:
        from custom_kernels.quant_matvec import quant_matvec

        return quant_matvec(x, self.blocks, self.ggml_type, self.out_dims)

    def gelu_mul(self, x: mx.array, mul: mx.array) -> mx.array:
        """gelu_tanh(self(x)) * mul, mul [..., out] in x.dtype: one launch where the op family
        "matvec_gelu_mul" is on (custom_kernels.quant_matvec.quant_matvec_gelu_mul)."""
        from custom_kernels.quant_matvec import quant_matvec_gelu_mul

        return quant_matvec_gelu_mul(x, self.blocks, self.ggml_type, self.out_dims, mul)


class BlockEmbedding(BlockLinear):
    """Token embedding [V, H] as raw blocks; `as_linear` is the tied head (Q8_0 / Q6_K in official files)."""

    def __init__(self, num_embeddings: int, dims: int, ggml_type: int, dtype=mx.bfloat16):
        super().__init__(dims, num_embeddings, ggml_type)
        self.dtype = dtype

    def __call__(self, tokens: mx.array) -> mx.array:
        from custom_kernels.quant_matvec import dequantize

        return dequantize(self.blocks[tokens], self.ggml_type, self.in_dims).astype(self.dtype)

    def scaled(self, tokens: mx.array, scale: float) -> mx.array | None:
        """Embeddings times `scale` rounded to the dtype, [..., H], for Q8_0 / Q4_0 rows
        (custom_kernels.embedding: one launch where family "embedding" is on); None for other
        block types (the caller scales self(tokens))."""
        from custom_kernels.embedding import embed_rows, embedding_supported

        if not embedding_supported(self.ggml_type, self.dtype):
            return None
        ids = tokens if tokens.dtype == mx.int32 else tokens.astype(mx.int32)
        return embed_rows(self.blocks, ids, self.ggml_type, self.in_dims, scale, self.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        return BlockLinear.__call__(self, x)


class BlockExperts(nn.Module):
    """E GeGLU experts as raw blocks: gate|up [E, 2F, H] and down [E, H, F] (Q4_0 / Q8_0)."""

    def __init__(self, num_experts: int, hidden: int, width: int, gate_up_type: int, down_type: int):
        super().__init__()
        from custom_kernels.quant_matvec import row_bytes

        self.width, self.hidden = width, hidden
        self.gate_up_type, self.down_type = gate_up_type, down_type
        self.gate_up_blocks = mx.zeros((num_experts, 2 * width, row_bytes(gate_up_type, hidden)), mx.uint8)
        self.down_blocks = mx.zeros((num_experts, hidden, row_bytes(down_type, width)), mx.uint8)
        if gate_up_type == down_type == Q4_0:  # the one-launch kernels' tickets (not parameters)
            from custom_kernels.moe_experts import new_counters, new_routed_counters

            self._counters = new_counters()
            self._routed_counters = new_routed_counters()

    def route_and_run(self, x: mx.array, x_router: mx.array, router) -> mx.array | None:
        """The router's choice for x_router (model.Router) and the experts on x in one launch ->
        [..., H], or None where custom_kernels.moe_experts.q4_0_moe_routed does not take the call
        (family "moe_route_fold" off, not Q4_0, not one bf16 token, a router that is not a plain
        bf16 projection)."""
        w = router.plain_weight
        if not (self.gate_up_type == self.down_type == Q4_0) or w is None:
            return None
        from custom_kernels.moe_experts import q4_0_moe_routed

        return q4_0_moe_routed(x, x_router, w, router.per_expert_scale, router.top_k, self.gate_up_blocks,
                               self.down_blocks, self._routed_counters, self.width)  # fmt: skip

    def __call__(self, x: mx.array, weights: mx.array, indices: mx.array) -> mx.array:
        """x [..., H], router weights fp32 / indices [..., k] -> [..., H] in x.dtype."""
        from custom_kernels import quant_matvec as qm

        ids = indices if indices.dtype == mx.int32 else indices.astype(mx.int32)
        if self.gate_up_type == self.down_type == Q4_0:
            from custom_kernels.moe_experts import q4_0_moe_experts

            return q4_0_moe_experts(x, ids, weights, self.gate_up_blocks, self.down_blocks, self._counters, self.width)
        gate_up_gather = {Q4_0: qm.q4_0_gate_up_gather, Q8_0: qm.q8_0_gate_up_gather}[self.gate_up_type]
        moe_down = {Q4_0: qm.q4_0_moe_down, Q8_0: qm.q8_0_moe_down}[self.down_type]
        # the ops take any lead dims, so a decode step has no reshape node here
        gate_up = gate_up_gather(x, ids, self.gate_up_blocks, self.width)  # [..., k, F]
        # down projection and router-weighted sum over the k slots, f32 sums
        return moe_down(gate_up, ids, weights, self.down_blocks, self.hidden)


class FusedBlockLinear:
    """BlockLinear modules that read one input, as one matrix: blocks uint8 [sum(out), row_bytes]
    is the only copy of their weights, and each module's `blocks` becomes a row-slice view of it.

    One matvec launch instead of one per module (q|k|v; gate|up with the GeGLU product fused in).
    A plain object, not an nn.Module: the model's parameters keep the checkpoint's names (the
    views). If a module's `blocks` is later replaced (load_weights), `intact()` turns False and the
    model falls back to the separate modules."""

    def __init__(self, modules: list[BlockLinear]):
        self.modules = modules
        self.ggml_type = modules[0].ggml_type
        self.sizes = [m.out_dims for m in modules]
        self.blocks = mx.concatenate([m.blocks for m in modules], axis=0)
        mx.eval(self.blocks)
        bounds = [0]
        for n in self.sizes:
            bounds.append(bounds[-1] + n)
        self.splits = bounds[1:-1]
        for m, a, b in zip(modules, bounds[:-1], bounds[1:]):
            m.blocks = self.blocks[a:b]
        self.views = [m.blocks for m in modules]
        # the gate/up kernel's one-expert form [1, sum(out), row_bytes]: an evaluated view (no
        # copy), so a decode step holds no expand node for it
        self.one_expert = self.blocks[None]
        mx.eval(self.views, self.one_expert)

    def intact(self) -> bool:
        """True while every module still holds its view of the fused matrix."""
        return all(m.blocks is v for m, v in zip(self.modules, self.views))

    def matvec(self, x: mx.array) -> mx.array:
        """x [..., K] -> [..., sum(out_i)]: the modules' outputs side by side."""
        from custom_kernels.quant_matvec import quant_matvec

        return quant_matvec(x, self.blocks, self.ggml_type, sum(self.sizes))

    def __call__(self, x: mx.array) -> list[mx.array]:
        """x [..., K] -> one output [..., out_i] per module (views of one matvec's result)."""
        return mx.split(self.matvec(x), self.splits, axis=-1)

    def gelu_product(self, x: mx.array) -> mx.array:
        """Two modules (gate, up) of equal width F: gelu_tanh(x @ gate.T) * (x @ up.T) [..., F]."""
        from custom_kernels.quant_matvec import gate_up

        return gate_up(x, self.blocks, self.ggml_type, self.sizes[0], one_expert=self.one_expert)


def _fusable(modules: list) -> bool:
    return (len(modules) >= 2 and all(isinstance(m, BlockLinear) and not isinstance(m, BlockEmbedding)
                                      for m in modules)
            and len({(m.ggml_type, m.in_dims) for m in modules}) == 1)  # fmt: skip


class MLPStacks:
    """A dense MLP's Q4_0 gate|up (fused) and down as one-expert stacks [1, 2F, H/32*18] and [1, H,
    F/32*18] (evaluated views, no copies) with its own counters: its one token through the
    one-launch expert kernel (custom_kernels.moe_experts.q4_0_mlp_one_launch, family
    "mlp_one_launch"). A plain object like FusedBlockLinear: if a module's blocks are replaced
    (load_weights), `intact()` turns False and the MLP runs its two launches."""

    def __init__(self, gate_up: FusedBlockLinear, down: BlockLinear):
        from custom_kernels.moe_experts import new_counters

        self.gate_up, self.down, self.width = gate_up, down, gate_up.sizes[0]
        self.down_blocks = down.blocks
        self.down_stack = down.blocks[None]
        mx.eval(self.down_stack)
        self.counters = new_counters()

    def intact(self) -> bool:
        return self.gate_up.intact() and self.down.blocks is self.down_blocks

    def __call__(self, x: mx.array) -> mx.array | None:
        """x [..., H] -> the MLP's output [..., H] from one launch, or None (the kernel does not
        take the call, or the weights changed)."""
        from custom_kernels.moe_experts import q4_0_mlp_one_launch

        if not self.intact():
            return None
        return q4_0_mlp_one_launch(x, self.gate_up.one_expert, self.down_stack, self.counters, self.width)


def fuse_projections(model) -> int:
    """Join each layer's BlockLinear q|k|v (attention `qkv_proj`) and gate|up (MLP `gate_up_proj`,
    Q4_0 / Q8_0 only) into FusedBlockLinear matrices, and give a Q4_0 MLP its one-launch stacks
    (`one_launch`, MLPStacks); returns how many matrices were made. Call once the
    weights are loaded: peak memory grows by one fused matrix at a time, then the separate copies
    are freed (the caller must hold no other reference to them)."""
    made = 0
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [m for m in (attn.get("q_proj"), attn.get("k_proj"), attn.get("v_proj")) if m is not None]
        if _fusable(qkv):
            attn.qkv_proj = FusedBlockLinear(qkv)
            made += 1
        gu = [mlp.get("gate_proj"), mlp.get("up_proj")]
        if _fusable(gu) and gu[0].ggml_type in (Q4_0, Q8_0) and gu[0].out_dims == gu[1].out_dims:
            mlp.gate_up_proj = FusedBlockLinear(gu)
            made += 1
            down = mlp.get("down_proj")
            if gu[0].ggml_type == Q4_0 and isinstance(down, BlockLinear) and down.ggml_type == Q4_0:
                mlp.one_launch = MLPStacks(mlp.gate_up_proj, down)
    return made
