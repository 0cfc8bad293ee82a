"""Build a `Model` from a GGUF file or a Hugging Face safetensors directory.

Weights are converted one tensor at a time and evaluated right away, so the peak memory of a load
stays close to the final weight memory. Q4_0 / Q8_0 GGUF tensors stay quantized (quantized.py);
every other type becomes `dtype` (bf16 by default, f32 for exact comparisons).
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
from custom_kernels import use_kernel
from tqdm import tqdm

from . import quants
from .config import ModelConfig
from .gguf import GGMLType, read_gguf
from .model import ExpertLinear, Model
from .quantized import (BITS, BLOCK_TYPES, EXPERT_BLOCK_TYPES, GROUP_SIZE, BlockEmbedding, BlockExperts,
                        BlockLinear, QuantizedEmbedding, QuantizedLinear, fuse_projections, quantized_experts)
from .weights import ROPE_FREQS, UnknownTensorName, gguf_to_hf_name, is_multimodal_tower, strip_hf_prefix


class LoadError(ValueError):
    """A checkpoint that cannot be loaded; the message says which file and why."""


_SHARED_KV = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight")


def _module_name(cfg: ModelConfig, hf_name: str) -> str | None:
    """HF tensor name (any prefix) -> our parameter name, or None for tensors we do not use."""
    if is_multimodal_tower(hf_name):
        return None
    name = strip_hf_prefix(hf_name)
    if name == "lm_head.weight" or "rotary_emb" in name:
        return None
    parts = name.split(".")
    if parts[0] == "layers":
        i = int(parts[1])
        rest = ".".join(parts[2:])
        if cfg.layers[i].kv_shared and rest in _SHARED_KV:
            return None
        if rest in ("experts.gate_up_proj", "experts.down_proj"):
            name += ".weight"
    return "model." + name


def _progress(items, desc: str, show: bool):
    return tqdm(items, desc=desc, unit="tensor", disable=not show, leave=False)


def load_hf(path: str | os.PathLike, dtype=mx.bfloat16, progress: bool = True) -> Model:
    """From a directory with config.json and *.safetensors (sharded or not; multimodal towers skipped)."""
    path = Path(path)
    cfg = ModelConfig.from_hf(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{path} has a config.json but no *.safetensors weights")
    model = Model(cfg)
    params = {}
    for f in files:
        try:
            tensors = mx.load(str(f))
        except Exception as e:  # MLX raises plain RuntimeError/ValueError on malformed files
            raise LoadError(f"cannot read {f}: {e}") from None
        for hf_name in _progress(list(tensors), f"loading {f.name}", progress):
            name = _module_name(cfg, hf_name)
            if name is None:
                continue
            arr = tensors.pop(hf_name).astype(dtype)
            mx.eval(arr)
            params[name] = arr
        del tensors
    _assign(model, params, str(path))
    return model


_CHUNK_BYTES = 16 << 20


def _row_chunks(t, mapping=None):
    """Row ranges (a, b) of a GGUF tensor, about _CHUNK_BYTES of file bytes each. With the file's
    mapping, each chunk's pages are dropped once the consumer moves on (it has copied them)."""
    rows = t.shape[0]
    row_bytes = t.nbytes // rows
    step = max(1, _CHUNK_BYTES // max(row_bytes, 1))
    for a in range(0, rows, step):
        b = min(a + step, rows)
        yield a, b
        if mapping is not None:
            _release_pages(mapping, t.offset + a * row_bytes, (b - a) * row_bytes)


def _filled(shape, dtype, chunks) -> mx.array:
    """An evaluated array of `shape` filled chunk by chunk ((row_start, row_end, mx.array) pairs).

    Each slice update is evaluated at once and done in place (the buffer is donated), so the peak is
    the final array plus one chunk, not a second full copy."""
    out = mx.zeros(shape, dtype)
    for a, b, chunk in chunks:
        out[a:b] = chunk
        mx.eval(out)
    return out


def _gguf_array(t, dtype, mapping=None) -> mx.array:
    """A float GGUF tensor (any non-Q4_0/Q8_0 type) as an evaluated MLX array of `dtype`, converted
    in row chunks so the peak stays near the final size."""
    raw = t.data.reshape(t.shape[0], -1)

    def chunk(a, b):
        rows = raw[a:b]
        sub = (b - a, *t.shape[1:])
        if t.ggml_type == GGMLType.F32:
            return mx.array(rows.view(np.float32).reshape(sub)).astype(dtype)
        if t.ggml_type == GGMLType.F16:
            return mx.array(rows.view(np.float16).reshape(sub)).astype(dtype)
        if t.ggml_type == GGMLType.BF16:
            return mx.array(rows.view(np.uint16).reshape(sub)).view(mx.bfloat16).astype(dtype)
        return mx.array(quants.dequantize(rows, t.ggml_type, sub)).astype(dtype)

    return _filled(t.shape, dtype, ((a, b, chunk(a, b)) for a, b in _row_chunks(t, mapping)))


def _set_module(model: Model, path: str, module) -> None:
    *parents, leaf = path.split(".")
    obj = model
    for p in parents:
        obj = obj[int(p)] if p.isdigit() else getattr(obj, p)
    setattr(obj, leaf, module)


def _get_module(model: Model, path: str):
    obj = model
    for p in path.split("."):
        obj = obj[int(p)] if p.isdigit() else getattr(obj, p)
    return obj


def load_gguf(path: str | os.PathLike, dtype=mx.bfloat16, progress: bool = True,
              keep_quantized: bool = True, weight_format: str = "auto") -> tuple[Model, dict]:
    """From a llama.cpp `gemma4` GGUF file (strictly validated; see gguf.py). Returns (model, metadata).

    weight_format: "blocks" keeps Q4_0/Q8_0/Q6_K tensors as the file's raw blocks for the fused
    GPU kernels (custom_kernels.quant_matvec), each layer's q|k|v and gate|up joined into one matrix
    (quantized.fuse_projections); "affine" maps Q4_0/Q8_0 to MLX affine quantization
    (mx.quantized_matmul, the CPU path); "auto" picks blocks when custom kernels are in use.
    keep_quantized=False dequantizes every quantized tensor to `dtype` (a float reference model)."""
    if weight_format not in ("auto", "blocks", "affine"):
        raise ValueError(f"weight_format must be auto, blocks or affine, got {weight_format!r}")
    blocks = weight_format == "blocks" or (weight_format == "auto" and use_kernel("quant_matvec"))
    g = read_gguf(path)
    try:
        cfg = ModelConfig.from_gguf(g.metadata, g.tensors)
        model = Model(cfg)
        params = {}
        for gname, t in _progress(list(g.tensors.items()), f"loading {Path(path).name}", progress):
            if gname == ROPE_FREQS:
                continue
            try:
                name = _module_name(cfg, gguf_to_hf_name(gname))
            except UnknownTensorName as e:
                raise LoadError(f"{path}: {e}") from None
            if name is None:
                continue
            params.update(_gguf_params(model, g, gname, t, name, dtype,
                                       "float" if not keep_quantized else "blocks" if blocks else "affine"))
            _release_pages(g.mapping, t.offset, t.nbytes)
            mx.clear_cache()  # freed conversion chunks go back to the OS, not MLX's buffer cache
        _assign(model, params, str(path))
        params.clear()  # the fused matrices replace the separate blocks: hold no other reference
        if blocks and keep_quantized:
            fuse_projections(model)
    finally:
        g.close()
    return model, g.metadata


def _gguf_params(model: Model, g, gname: str, t, name: str, dtype, fmt: str) -> dict:
    """MLX parameters for one GGUF tensor; swaps in the module its format needs (fmt: blocks, affine
    or float). Every returned array is evaluated."""
    if fmt == "blocks" and len(t.shape) == 3 and _expert_blocks(g.tensors, gname):
        mod_path = name.rsplit(".", 2)[0]  # model.layers.N.experts
        if not isinstance(_get_module(model, mod_path), BlockExperts):
            gu = g.tensors[gname.replace("ffn_down_exps", "ffn_gate_up_exps")]
            dn = g.tensors[gname.replace("ffn_gate_up_exps", "ffn_down_exps")]
            _set_module(model, mod_path, BlockExperts(gu.shape[0], gu.shape[2], gu.shape[1] // 2,
                                                      gu.ggml_type, dn.ggml_type))
        key = "gate_up_blocks" if "gate_up" in gname else "down_blocks"
        return {f"{mod_path}.{key}": _raw_blocks(t, g.mapping)}
    if fmt == "blocks" and len(t.shape) == 2 and t.ggml_type in BLOCK_TYPES:
        mod_path = name.rsplit(".", 1)[0]
        out_dims, in_dims = t.shape
        if mod_path.endswith(("embed_tokens", "embed_tokens_per_layer")):
            module = BlockEmbedding(out_dims, in_dims, t.ggml_type, dtype)
        else:
            module = BlockLinear(in_dims, out_dims, t.ggml_type)
        _set_module(model, mod_path, module)
        return {f"{mod_path}.blocks": _raw_blocks(t, g.mapping)}
    if fmt != "float" and t.ggml_type in BITS and len(t.shape) >= 2:
        bits = BITS[t.ggml_type]
        mod_path = name.rsplit(".", 1)[0]
        if len(t.shape) == 3:
            expert = _get_module(model, mod_path)
            assert isinstance(expert, ExpertLinear)
            for k, v in quantized_experts(*t.shape[:1], t.shape[2], t.shape[1], bits).items():
                setattr(expert, k, v)
            expert.bits, expert.group_size = bits, GROUP_SIZE
        else:
            out_dims, in_dims = t.shape
            if mod_path.endswith(("embed_tokens", "embed_tokens_per_layer")):
                module = QuantizedEmbedding(out_dims, in_dims, bits, dtype)
            else:
                module = QuantizedLinear(in_dims, out_dims, bits)
            _set_module(model, mod_path, module)
        to_affine = quants.q4_0_to_mlx_affine if bits == 4 else quants.q8_0_to_mlx_affine
        raw = t.data.reshape(t.shape[0], -1)
        outs = None
        for a, b in _row_chunks(t, g.mapping):
            parts = to_affine(raw[a:b], (b - a, *t.shape[1:]))
            if outs is None:
                outs = [mx.zeros((t.shape[0], *p.shape[1:]), dt)
                        for p, dt in zip(parts, (mx.uint32, mx.float32, mx.float32))]
            for out, part in zip(outs, parts):
                out[a:b] = mx.array(part).astype(out.dtype)
            del parts
            mx.eval(outs)
        return dict(zip((f"{mod_path}.weight", f"{mod_path}.scales", f"{mod_path}.biases"), outs))
    return {name: _gguf_array(t, dtype, g.mapping)}


def _release_pages(mapping, offset: int, length: int) -> None:
    """Drop the mapped file pages of bytes already copied into MLX, so the load's resident memory
    stays near the final weight memory (file-backed pages would otherwise count twice)."""
    if mapping is None or not hasattr(mapping, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    start = (offset // page) * page
    try:
        mapping.madvise(mmap.MADV_DONTNEED, start, offset + length - start)
    except (OSError, ValueError):
        pass


def _raw_blocks(t, mapping=None) -> mx.array:
    """A GGUF tensor's bytes as uint8 [..., row_bytes] (rows along the last numpy axis)."""
    raw = t.data.reshape(*t.shape[:-1], -1)
    return _filled(raw.shape, mx.uint8, ((a, b, mx.array(raw[a:b])) for a, b in _row_chunks(t, mapping)))


def _expert_blocks(tensors, gname: str) -> bool:
    """Both expert tensors of this layer are of a type the expert-gather kernels read."""
    if "_exps.weight" not in gname:
        return False
    gu = tensors.get(gname.replace("ffn_down_exps", "ffn_gate_up_exps"))
    dn = tensors.get(gname.replace("ffn_gate_up_exps", "ffn_down_exps"))
    return (gu is not None and dn is not None and gu.ggml_type in EXPERT_BLOCK_TYPES
            and dn.ggml_type in EXPERT_BLOCK_TYPES)


def _assign(model: Model, params: dict, source: str) -> None:
    """Load params into the model; every parameter must be present with the right shape."""
    expected = dict(_flatten(model.parameters()))
    missing = sorted(set(expected) - set(params))
    if missing:
        raise LoadError(f"{source}: missing tensor for {missing[0]}" +
                        (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(set(params) - set(expected))
    if extra:
        raise LoadError(f"{source}: unexpected tensor {extra[0]}")
    for k, v in params.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise LoadError(f"{source}: tensor {k} has shape {tuple(v.shape)}, the config implies "
                            f"{tuple(expected[k].shape)}")
    model.load_weights(list(params.items()), strict=True)
    mx.eval(model.parameters())


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree
