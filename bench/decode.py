"""Decode tokens/s of Gemma 4 31B, 26B-A4B, E4B and 12B on random weights in their real shapes: this
project (gemma4_mlx) and mlx-lm side by side in one process, against the floor set by the device copy
bandwidth measured in the same run, with a per-stage breakdown.

    python bench/decode.py                    # GPU: the whole matrix (31B at 4K first), JSON after every row
    python bench/decode.py --plot             # ... and the PNG of tokens/s vs context
    python bench/decode.py --models 31B --contexts 4096
    python bench/decode.py --readme-table     # no run: the markdown tables of the latest results
    python bench/decode.py --readme-table --plot   # ... and the plot of them
    python bench/decode.py --quick            # tiny shapes, runs on CPU (CI checks the JSON with it)

What one row (model x context) measures:

* Weights, built on the device without files. gemma4_mlx: `Model(cfg)` with every projection a
  `BlockLinear` of random Q4_0 blocks, experts a `BlockExperts` of Q4_0 blocks, the token
  embedding / tied head (and E4B's per-layer embedding) a `BlockEmbedding` of Q8_0 blocks, the
  router projection and the norms random bf16 (what the GPU backends load from a Q4_0 GGUF).
  mlx-lm: `mlx_lm.models.gemma4_text.Model` in the same shapes quantized by mlx-lm's own
  `quantize_model` (affine 4-bit, group --mlxlm-group-size, default 64, bf16 scales/biases; its
  gemma4 predicate makes the router 8-bit), every quantized tensor then refilled with random bits.
* Context: each engine's own caches filled directly with random bf16 K/V of N positions (full
  layers: N slots; sliding layers: their ring, with the slot positions a prefill would leave), no
  prefill. gemma4_mlx then decodes through `CompiledDecoder` (the compiled fixed-shape step that
  generate_step uses); mlx-lm through its model call on its KVCache / RotatingKVCache (the full
  caches preallocated to the run's final length, so no 256-token growth copy falls in a timed window).
* Timing: greedy decode, pipelined as both libraries' generate_step do: step n+1 is built and
  `mx.async_eval`ed before token n is waited for; each step is model -> the library's greedy
  sampler, on the device, the sampled token fed back (mlx-lm's sampler takes the logprobs, logits
  minus logsumexp; ours takes the logits, as its generate_step does, and leaves the logprobs
  unevaluated: gemma4_mlx.sampling.choose). tokens/s =
  S / (time from token W to token W+S) after W warm-up tokens; --rounds rounds, the two engines
  interleaved in each; the median round is reported. --sync instead evaluates every token before
  building the next. The context grows by the tokens decoded (context_end in the JSON).
* Floor = copy bandwidth / (weight bytes read per token + KV bytes read per token at that context).
  Weight bytes per token: every tensor once, except the embedding tables (one row; the tied head
  is read whole) and the experts (top_k / E of them). KV bytes: each attending layer reads
  min(N, window) (sliding) or N (full) positions of K and V in bf16 (KV-shared layers re-read their
  producer's). Copy bandwidth: `a + 1` over a 1 GiB float32 array, bytes read + written.
* Breakdown on CUDA: a CUPTI trace of the pipelined step (bench/gpu_timeline.py, through
  torch.profiler): GPU time per token of the projections, attention, other ops, head and sampling
  kernels, GPU busy time and the token's window. Elsewhere (or without torch), timed variants,
  not a profiler: the step time with the head skipped (the decoder
  returns the final hidden state), with the attention core skipped (scaled_dot_product_attention /
  decode_attention replaced by a function returning q; K/V projections and cache writes kept),
  with sampling skipped (logits only), the projections alone (every linear / expert matvec of all
  layers on random inputs, one graph per token, compiled for gemma4_mlx), and the step with the
  top-k 64 / top-p 0.95 / temp 1 sampler. Stages (ms per token): sampling = full - logits;
  head = logits - no-head; attention = logits - no-attention; projections; overhead = full - the
  four (norms, RoPE, cache writes, elementwise ops, launch gaps; can be negative within noise).
* Also per engine: the peak memory growth over 8 synchronous steps, against one K/V buffer
  (a step that copied a whole cache buffer would show it).

JSON: bench/results/decode-<backend>-<date>[-quick].json (hardware, versions, the method above,
every number, targets), rewritten after every row; --budget-s bounds the run (rows not started in
time are marked skipped). The plot: bench/results/decode-<date>.png (needs matplotlib; skipped
with a message otherwise).
"""

from __future__ import annotations

import gemma4_mlx  # noqa: I001  first: the BLAS preload must come before mlx.core is imported

import argparse
import contextlib
import datetime
import gc
import glob
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Callable

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hardware import commit, hardware_info, sources_digest  # noqa: E402  (bench/hardware.py)
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import custom_kernels  # noqa: E402
from gemma4_mlx.cache import RotatingKVCache, make_cache  # noqa: E402
from gemma4_mlx.compiled_step import CompiledDecoder  # noqa: E402
from gemma4_mlx.config import FULL, SLIDING, ModelConfig, num_params, preset  # noqa: E402
from gemma4_mlx.model import Experts, Model  # noqa: E402
from gemma4_mlx.quantized import BlockEmbedding, BlockExperts, BlockLinear, fuse_projections  # noqa: E402
from gemma4_mlx.quants import Q4_0, Q8_0  # noqa: E402
from gemma4_mlx.sampling import choose, make_sampler  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
OURS, MLX_LM = "gemma4_mlx", "mlx_lm"
MODELS = ("31B", "26B-A4B", "E4B", "12B")  # run order = priority
PRESET_NAMES = ("31B", "26B-A4B", "E4B", "12B", "E2B")
CONTEXTS = (4096, 128, 32768)  # run order: 4K first
EXTRA_CONTEXTS = {"31B": (131072,)}
BREAKDOWN_CONTEXTS = (4096, 32768)
TOP_P_SAMPLER = dict(temp=1.0, top_k=64, top_p=0.95)
TARGETS = (  # (name, model, context, kind, goal)
    ("31B decode at 4K (tok/s)", "31B", 4096, "tok_s", 160.0),
    ("31B at 4K vs mlx-lm (x)", "31B", 4096, "ratio", 3.5),
    ("31B 32K / 4K", "31B", 32768, "ratio_4k", 0.85),
    ("26B-A4B decode at 4K (tok/s)", "26B-A4B", 4096, "tok_s", 350.0),
    ("E4B decode at 4K (tok/s)", "E4B", 4096, "tok_s", 400.0),
)


def _tiny(**kw) -> ModelConfig:
    base = dict(hidden_size=256, num_hidden_layers=6, intermediate_size=512, num_attention_heads=4,
                num_key_value_heads=2, layer_types=[SLIDING] * 5 + [FULL], vocab_size=2048, head_dim=64,
                global_head_dim=128, sliding_window=32, max_position_embeddings=4096)
    base.update(kw)
    return ModelConfig(**base)


# --quick: the three structural families (dense K=V, MoE, per-layer inputs + KV sharing), tiny.
QUICK_MODELS = {
    "tiny-dense": lambda: _tiny(num_global_key_value_heads=1, attention_k_eq_v=True),
    "tiny-moe": lambda: _tiny(intermediate_size=128, num_global_key_value_heads=1, attention_k_eq_v=True,
                              enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=64),
    "tiny-ple": lambda: _tiny(num_hidden_layers=8, num_key_value_heads=1, layer_types=([SLIDING] * 3 + [FULL]) * 2,
                              num_kv_shared_layers=3, hidden_size_per_layer_input=64, vocab_size_per_layer_input=2048),
}  # fmt: skip
QUICK_CONTEXTS = (16, 100)  # 100 > the ring (window 32 + slack 32): wraps it


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# random weights, made on the device


def _random_bytes(shape: tuple[int, ...]) -> mx.array:
    """Uniform random uint8 [*shape] (last axis even), drawn as uint16 to halve the draws."""
    *lead, last = shape
    return mx.view(mx.random.randint(0, 1 << 16, (*lead, last // 2), dtype=mx.uint16), mx.uint8)


def _signed_scales(shape: tuple[int, ...]) -> mx.array:
    """float32 in +-[0.002, 0.02] (the size of real Q4_0 / affine scales)."""
    mag = mx.random.uniform(0.002, 0.02, shape)
    return mx.where(mx.random.bernoulli(0.5, shape), mag, -mag)


def device_blocks(ggml_type: int, lead: tuple[int, ...], k: int) -> mx.array:
    """Random Q4_0 / Q8_0 GGUF blocks uint8 [*lead, k // 32 * block_bytes]: fp16 scale d then a random
    payload (every payload byte pattern is a valid weight)."""
    block_bytes = {Q4_0: 18, Q8_0: 34}[ggml_type]
    nb = k // 32
    d = mx.view(_signed_scales((*lead, nb, 1)).astype(mx.float16), mx.uint8)  # [*lead, nb, 2]
    blocks = mx.concatenate([d, _random_bytes((*lead, nb, block_bytes - 2))], axis=-1)
    return blocks.reshape(*lead, nb * block_bytes)


def random_float(name: str, shape: tuple[int, ...], dtype=mx.bfloat16) -> mx.array:
    """A random stand-in for a float parameter, by its name: norms and scales near 1, projections
    N(0, 1/in)."""
    leaf = name.split(".")[-1]
    if leaf == "layer_scalar":
        x = mx.random.uniform(0.5, 1.0, shape)
    elif "norm" in name or leaf in ("scale", "per_expert_scale"):
        x = mx.random.uniform(0.5, 1.5, shape)
    else:
        x = mx.random.normal(shape) * shape[-1] ** -0.5
    return x.astype(dtype)


def _set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    *parents, leaf = path.split(".")
    obj = root
    for p in parents:
        obj = obj[int(p)] if p.isdigit() else getattr(obj, p)
    if leaf.isdigit():
        obj[int(leaf)] = module
    else:
        setattr(obj, leaf, module)


def _randomize_floats(model: nn.Module) -> None:
    """Every floating-point parameter still in its init dtype (float32) -> random bf16, by name."""
    new = [(name, random_float(name, a.shape)) for name, a in tree_flatten(model.parameters())
           if a.dtype == mx.float32]  # fmt: skip
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())


def build_ours(cfg: ModelConfig) -> Model:
    """gemma4_mlx Model as the GPU backends load a Q4_0 GGUF: Q4_0 BlockLinear projections (q|k|v
    and gate|up fused), Q4_0 BlockExperts, Q8_0 BlockEmbedding for the token (tied head) and
    per-layer embeddings, bf16 router and norms. Each tensor is generated and evaluated on the
    device as it is placed."""
    model = Model(cfg)  # lazy random init: nothing is computed for the modules swapped below
    swaps = []
    for path, m in model.named_modules():
        if isinstance(m, nn.Embedding):
            swaps.append((path, BlockEmbedding(m.weight.shape[0], m.weight.shape[1], Q8_0, mx.bfloat16)))
        elif isinstance(m, nn.Linear) and not path.endswith("router.proj"):
            out_dims, in_dims = m.weight.shape
            swaps.append((path, BlockLinear(in_dims, out_dims, Q4_0)))
        elif isinstance(m, Experts):
            swaps.append((path, BlockExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, Q4_0, Q4_0)))
    for path, module in swaps:
        if isinstance(module, BlockExperts):
            e, f, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
            module.gate_up_blocks = device_blocks(Q4_0, (e, 2 * f), h)
            mx.eval(module.gate_up_blocks)
            module.down_blocks = device_blocks(Q4_0, (e, h), f)
        else:
            module.blocks = device_blocks(module.ggml_type, (module.out_dims,), module.in_dims)
        mx.eval(module.parameters())
        _set_module(model, path, module)
    _randomize_floats(model)
    fuse_projections(model)  # as load_gguf does for block weights
    return model


def build_mlx_lm(cfg: ModelConfig, group_size: int):
    """mlx-lm's gemma4_text Model in the same shapes, quantized by mlx-lm's quantize_model (4-bit
    affine, its own predicate), every quantized tensor refilled with random bits / scales (bf16)."""
    from mlx_lm.models import gemma4_text
    from mlx_lm.utils import quantize_model

    config = cfg.to_hf()
    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(config))  # lazy random init
    with contextlib.redirect_stdout(sys.stderr):  # its "[INFO] Quantized model with ..." line
        quantize_model(model, config, group_size, 4)
    for _, m in model.named_modules():
        if hasattr(m, "scales") and hasattr(m, "bits"):
            w = m.weight.shape
            m.weight = mx.view(_random_bytes((*w[:-1], 4 * w[-1])), mx.uint32)
            scales = _signed_scales(m.scales.shape)
            m.scales = scales.astype(mx.bfloat16)
            m.biases = (scales * -(2 ** (m.bits - 1))).astype(mx.bfloat16)
            mx.eval(m.parameters())
    _randomize_floats(model)
    return model


def weight_bytes(model: nn.Module, cfg: ModelConfig) -> dict:
    """Resident weight bytes, and bytes read per decoded token (embedding tables: one row, the tied
    head whole; experts: top_k / E of them; everything else once)."""
    total = per_token = head = 0
    for name, a in tree_flatten(model.parameters()):
        b = a.nbytes
        total += b
        if name.startswith("model.embed_tokens."):
            head += b
            per_token += b + b / a.shape[0]
        elif name.startswith("model.embed_tokens_per_layer."):
            per_token += b / a.shape[0]
        elif ".experts." in name:
            per_token += b * cfg.top_k_experts / cfg.num_experts
        else:
            per_token += b
    return dict(total=total, per_token=int(per_token), head=head)


def kv_bytes_read(cfg: ModelConfig, n: int, itemsize: int = 2) -> int:
    """K and V bytes the attention of all layers reads for one token at context n."""
    total = 0
    for s in cfg.layers:
        length = min(n, s.sliding_window) if s.is_sliding else n
        total += 2 * length * s.num_kv_heads * s.head_dim * itemsize
    return total


# --------------------------------------------------------------------------------------------
# caches filled directly (no prefill)


def _kv(heads: int, length: int, dim: int) -> mx.array:
    return mx.random.normal((1, heads, length, dim)).astype(mx.bfloat16)


def ours_cache(cfg: ModelConfig, n: int) -> list:
    """gemma4_mlx caches (cache.make_cache) holding n random positions, as a prefill would leave them."""
    cache = make_cache(cfg)
    for s, c in zip(cfg.layers, cache):
        if c is None:
            continue
        if isinstance(c, RotatingKVCache):
            cap = c.capacity
            slots = np.arange(cap)
            pos = slots + cap * ((n - 1 - slots) // cap)  # newest position held by each slot
            c.keys, c.values = _kv(s.num_kv_heads, cap, s.head_dim), _kv(s.num_kv_heads, cap, s.head_dim)
            c.positions = mx.array(np.where(slots < n, pos, -1).astype(np.int32))
        else:
            c.keys, c.values = _kv(s.num_kv_heads, n, s.head_dim), _kv(s.num_kv_heads, n, s.head_dim)
        c.offset = n
        mx.eval(c.state)
    return cache


def ours_decoder(model, cfg: ModelConfig, n: int, extra: int) -> CompiledDecoder:
    """CompiledDecoder over fresh random caches of n positions, room for `extra` more tokens."""
    return CompiledDecoder(model, ours_cache(cfg, n), -(-(n + extra) // 256) * 256)


def mlx_lm_cache(lm, cfg: ModelConfig, n: int, extra: int) -> list:
    """mlx-lm caches (model.make_cache()) holding n random positions: full layers preallocated to
    n + extra slots (rounded to its 256 step); rings as its prefill leaves them once trimmed (n < window:
    n slots that grow by its own rule; else the window in time order, the next write going to slot 0)."""
    from mlx_lm.models.cache import RotatingKVCache as LmRotatingKVCache

    cache = lm.make_cache()
    for s, c in zip(cfg.layers, cache):
        if isinstance(c, LmRotatingKVCache):
            size = min(n, c.max_size)
            c.keys, c.values = _kv(s.num_kv_heads, size, s.head_dim), _kv(s.num_kv_heads, size, s.head_dim)
            c._idx = size  # its prefill leaves the ring in time order; the next write rotates to slot 0
        else:
            cap = -(-(n + extra) // 256) * 256
            c.keys, c.values = _kv(s.num_kv_heads, cap, s.head_dim), _kv(s.num_kv_heads, cap, s.head_dim)
        c.offset = n
        mx.eval(c.keys, c.values)
    return cache


# --------------------------------------------------------------------------------------------
# timing


def time_tokens(step: Callable, first: mx.array, warmup: int, steps: int, sync: bool = False) -> dict:
    """Run warmup + steps chained decode steps (step(previous output) -> output, lazy; an output may be
    a list of arrays).

    Pipelined (default): step k+1 is built and async_eval'ed before output k is waited for (as
    generate_step does); sync: output k is evaluated before step k+1 is built. Returns tok_s = steps /
    (completion of output warmup+steps - completion of output warmup), ms_per_token, and the median
    gap between completions in that window."""
    stamps, host = [], []
    out = step(first)
    if sync:
        mx.eval(out)
        stamps.append(time.perf_counter())
        for _ in range(warmup + steps):
            out = step(out)
            mx.eval(out)
            stamps.append(time.perf_counter())
    else:
        mx.async_eval(out)
        for k in range(warmup + steps + 1):
            nxt = None
            if k < warmup + steps:
                t = time.perf_counter()
                nxt = step(out)
                mx.async_eval(nxt)
                if k >= warmup:
                    host.append(time.perf_counter() - t)
            mx.eval(out)
            stamps.append(time.perf_counter())
            out = nxt
    span = stamps[-1] - stamps[warmup]
    gaps = np.diff(stamps[warmup:])
    # host_ms: building a step and handing it to the device (async_eval encodes every kernel on this
    # thread); when it approaches ms_per_token the step is bound by per-op host cost, not the GPU
    out = dict(tok_s=steps / span, ms_per_token=1e3 * span / steps, median_gap_ms=1e3 * float(np.median(gaps)))
    if host:
        out["host_ms"] = 1e3 * float(np.median(host))
    return out


def copy_bandwidth(quick: bool) -> dict:
    """Device copy rate: b = b + 1 over a float32 array (1 GiB; 16 MiB with --quick), chained so that at
    most two buffers are alive, bytes read + written; median of 7 rounds of ~30 ms."""
    n = (1 << 22) if quick else (1 << 28)
    a = mx.random.uniform(shape=(n,))
    mx.eval(a)

    def chain(reps: int) -> float:
        b = a
        for _ in range(reps):
            b = b + 1.0
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(b)
        mx.synchronize()
        return (time.perf_counter() - t) / reps

    one = chain(2)
    reps = max(2, int(0.03 / max(one, 1e-6)))
    sec = statistics.median(chain(reps) for _ in range(2 if quick else 7))
    return dict(bytes=8 * n, time_us=sec * 1e6, GBps=8 * n / sec / 1e9)


def step_memory_growth(step, first, steps: int = 8) -> int:
    """Peak memory growth (bytes) over `steps` synchronous steps after one warm step."""
    out = step(first)
    mx.eval(out)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for _ in range(steps):
        out = step(out)
        mx.eval(out)
    return int(mx.get_peak_memory() - base)


@contextlib.contextmanager
def attention_skipped(targets: list[tuple[object, str]]):
    """Replace each (object, attribute) attention function by one returning its first argument (q:
    [B, n_q, T, D], the attention output's shape). Yields a dict whose "calls" counts the stand-in's
    calls (0: the model no longer calls any of them, so the variant measured nothing)."""
    counter = {"calls": 0}

    def stand_in(q, *args, **kwargs):
        counter["calls"] += 1
        return q

    saved = [(obj, attr, getattr(obj, attr)) for obj, attr in targets if hasattr(obj, attr)]
    try:
        for obj, attr, _ in saved:
            setattr(obj, attr, stand_in)
        yield counter
    finally:
        for obj, attr, fn in saved:
            setattr(obj, attr, fn)


def _ours_attention_targets() -> list[tuple[object, str]]:
    targets = [(mx.fast, "scaled_dot_product_attention")]
    for name, module in list(sys.modules.items()):
        if (name.startswith("gemma4_mlx") or name == "custom_kernels.attention") and module is not None:
            targets += [(module, attr) for attr in ("decode_attention", "launch_decode_attention") if hasattr(module, attr)]
    return targets


class Headless(nn.Module):
    """A model view whose `logits` is the final hidden state [1, H] itself: CompiledDecoder over it
    runs the decode step with the tied head (and softcap) skipped."""

    def __init__(self, model: Model):
        super().__init__()
        self.model = model.model

    def logits(self, h: mx.array) -> mx.array:
        return h

    def native_head_ready(self, y: mx.array | None = None) -> bool:
        return False  # no head to run outside the compiled step


def _first_arg_dims(m) -> int:
    if isinstance(m, BlockLinear):
        return m.in_dims
    if hasattr(m, "bits"):  # mlx affine QuantizedLinear: uint32 words of 32 // bits weights
        return m.weight.shape[-1] * 32 // m.bits
    return m.weight.shape[-1]


def projections_ours(model: Model) -> Callable[[mx.array], list]:
    """Every linear / expert matvec of all layers (and the per-layer-input projection) on random bf16
    inputs, compiled into one function of a dummy argument (the head is not included)."""
    cfg = model.cfg
    calls = []
    roots = [("", layer) for layer in model.layers]
    if cfg.hidden_size_per_layer_input:
        roots.append(("", model.model.per_layer_model_projection))
    for _, root in roots:
        for _, m in root.named_modules():
            if isinstance(m, BlockExperts):
                calls.append((m, "experts"))
            elif isinstance(m, (BlockLinear, nn.Linear)):
                calls.append((m, _first_arg_dims(m)))
    return _projection_fn(calls, cfg, compiled=True)


def projections_mlx_lm(lm, cfg: ModelConfig) -> Callable[[mx.array], list]:
    """The same for mlx-lm (QuantizedLinear modules and SwitchGLU experts), not compiled (as its model)."""
    calls = []
    roots = list(lm.model.layers)
    if cfg.hidden_size_per_layer_input:
        roots.append(lm.model.per_layer_model_projection)
    for root in roots:
        for path, m in root.named_modules():
            if path.endswith("switch_glu"):
                calls.append((m, "switch_glu"))
            elif isinstance(m, (nn.QuantizedLinear, nn.Linear)):
                calls.append((m, _first_arg_dims(m)))
    return _projection_fn(calls, cfg, compiled=False)


def _projection_fn(calls, cfg: ModelConfig, compiled: bool):
    dims = sorted({d for _, d in calls if isinstance(d, int)} | {cfg.hidden_size})
    xs = {d: mx.random.normal((1, 1, d)).astype(mx.bfloat16) for d in dims}
    k, e = cfg.top_k_experts or 1, cfg.num_experts or 1
    ids = mx.array(np.random.default_rng(0).permutation(e)[:k].astype(np.int32)).reshape(1, 1, k)
    weights = mx.full((1, 1, k), 1.0 / k, mx.float32)
    mx.eval(list(xs.values()), ids, weights)

    def run(_):
        outs = []
        for m, d in calls:
            if d == "experts":
                outs.append(m(xs[cfg.hidden_size], weights, ids))
            elif d == "switch_glu":
                outs.append(m(xs[cfg.hidden_size], ids))
            else:
                outs.append(m(xs[d]))
        return outs

    fn = mx.compile(run) if compiled else run
    return lambda prev: fn(mx.array(0))


# --------------------------------------------------------------------------------------------
# engines: per (model, context) step functions


def _logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class OursEngine:
    name = OURS
    variants_on_main_cache = 2  # breakdown variants decoded on the main decoder (logits, top-p)

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.model = build_ours(cfg)
        self.greedy = make_sampler()
        self.top_p = make_sampler(**TOP_P_SAMPLER, seed=0)
        self.decoder = None

    def start(self, n: int, extra: int) -> None:
        self.decoder = ours_decoder(self.model, self.cfg, n, extra)

    def stop(self) -> None:
        self.decoder = None

    def full_step(self, sampler=None):
        """One token as generate_step picks it (sampling.choose: make_sampler's samplers take the
        logits; the logprobs are not evaluated). With GEMMA4_BENCH_LOGPROBS_FIRST=1 set while the step
        is built, the sampler takes the evaluated logprobs, as mlx-lm's does (the pre-session-34 step)."""
        sampler, dec = sampler or self.greedy, self.decoder
        if os.environ.get("GEMMA4_BENCH_LOGPROBS_FIRST") == "1":
            return lambda tok: sampler(_logprobs(dec(tok.reshape(1, 1))))
        return lambda tok: choose(dec(tok.reshape(1, 1)), sampler)[0]

    def logits_step(self, decoder=None):
        """Logits (or the headless decoder's hidden state) of a fixed token, with the cache buffers as
        outputs too, so their writes (and the K/V projections feeding them) stay live in every variant."""
        dec, token = decoder or self.decoder, mx.array([[7]], mx.int32)

        def step(_):
            logits = dec(token)
            return [logits, *dec.state]

        return step

    def memory_probe(self) -> dict:
        one_kv = max(a.nbytes for a in self.decoder.state) // (2 if self.decoder.one_buffer else 1)
        return dict(cache_buffer_bytes=one_kv,  # one K or V buffer (half of a one-buffer cache's)
                    step_peak_growth_bytes=step_memory_growth(self.full_step(), mx.array([3], mx.int32)))

    def variants(self, n: int, extra: int, run) -> dict:
        """Breakdown variants; run(step) -> timing dict. The main decoder is dropped on the way."""
        out = {"logits": run(self.logits_step()), "top_p_sampler": run(self.full_step(self.top_p))}
        self.stop()
        gc.collect()
        dec = ours_decoder(Headless(self.model), self.cfg, n, extra)
        out["no_head"] = run(self.logits_step(dec))
        del dec
        gc.collect()
        with attention_skipped(_ours_attention_targets()) as counter:
            dec = ours_decoder(self.model, self.cfg, n, extra)
            out["no_attention"] = run(self.logits_step(dec))  # traced (and timed) with the stand-in in place
        del dec
        gc.collect()
        if not counter["calls"]:
            out["no_attention"] = dict(error="no attention function was called: stand-in not applied")
        out["projections"] = run(projections_ours(self.model))
        return out


class MlxLmEngine:
    name = MLX_LM
    variants_on_main_cache = 4  # logits, top-p, no-head, no-attention all continue the one cache

    def __init__(self, cfg: ModelConfig, group_size: int):
        from mlx_lm.sample_utils import make_sampler as lm_make_sampler

        self.cfg = cfg
        self.model = build_mlx_lm(cfg, group_size)
        self.greedy = lm_make_sampler(temp=0.0)
        self.top_p = lm_make_sampler(**TOP_P_SAMPLER)
        self.cache = None

    def start(self, n: int, extra: int) -> None:
        self.cache = mlx_lm_cache(self.model, self.cfg, n, extra)

    def stop(self) -> None:
        self.cache = None

    def full_step(self, sampler=None):
        sampler, model, cache = sampler or self.greedy, self.model, self.cache
        return lambda tok: sampler(_logprobs(model(tok.reshape(1, 1), cache=cache)[:, -1, :]))

    def logits_step(self, headless: bool = False):
        """As OursEngine.logits_step: the cache arrays are outputs too (mlx-lm updates them in Python)."""
        model, cache, token = self.model, self.cache, mx.array([[7]], mx.int32)
        forward = model.model if headless else model

        def step(_):
            out = forward(token, cache=cache)[:, -1, :]
            return [out] + [a for c in cache for a in (c.keys, c.values)]

        return step

    def memory_probe(self) -> dict:
        return dict(cache_buffer_bytes=max(c.keys.nbytes for c in self.cache),
                    step_peak_growth_bytes=step_memory_growth(self.full_step(), mx.array([3], mx.int32)))

    def variants(self, n: int, extra: int, run) -> dict:
        from mlx_lm.models import gemma4_text

        out = {"logits": run(self.logits_step()), "top_p_sampler": run(self.full_step(self.top_p)),
               "no_head": run(self.logits_step(headless=True))}
        with attention_skipped([(gemma4_text, "scaled_dot_product_attention")]) as counter:
            out["no_attention"] = run(self.logits_step())
        if not counter["calls"]:
            out["no_attention"] = dict(error="no attention function was called: stand-in not applied")
        out["projections"] = run(projections_mlx_lm(self.model, self.cfg))
        return out


def trace_available() -> bool:
    """torch's profiler (CUPTI) importable: the GPU machine's image has it, CI does not."""
    try:
        import torch.profiler  # noqa: F401,PLC0415
    except ImportError:
        return False
    return True


TRACE_STAGES = ("projections", "attention", "other ops", "head", "sampling")


def trace_breakdown(step, first: mx.array, steps: int = 8) -> dict:
    """The stage split of one engine's pipelined decode step from a CUPTI trace of `steps` tokens
    (bench/gpu_timeline.py): us per token of each stage's kernels (TRACE_STAGES, from the last
    whole step), GPU busy time and the window per token (the GPU waits for the host the rest)."""
    import gpu_timeline  # noqa: PLC0415  (bench/gpu_timeline.py; imports torch's profiler)

    time_tokens(step, first, 2, 2)
    with tempfile.TemporaryDirectory() as tmp:
        s = gpu_timeline.profile_steps(step, first, steps, os.path.join(tmp, "trace.json"))
    return dict(window_us=s["window_us"], busy_us=s["busy_us"], wait_us=s["wait_us"], launches=s["launches"],
                stages_us={k: s["stages"][k]["us"] for k in TRACE_STAGES if k in s["stages"]},
                stage_launches={k: s["stages"][k]["launches"] for k in TRACE_STAGES if k in s["stages"]})


def breakdown_seconds(round_s: dict, main_s: float, traced: bool) -> float:
    """Time a row's stage breakdown should be given before --budget-s: a trace costs a few warm
    rounds (each engine's fastest after its first, which also compiles the kernels, minutes in a
    fresh CUDA process); the timed variants compile and time four more steps, ~2x the main rounds."""
    if not traced:
        return 2 * main_s
    return 30.0 + 3 * sum(min(v[1:] or v) for v in round_s.values() if v)


def round_spread_ms(entry: dict) -> float | None:
    """Max - min ms per token over an engine's rounds (None with fewer than two)."""
    rates = [r for r in entry.get("rounds") or [] if r]
    return 1e3 / min(rates) - 1e3 / max(rates) if len(rates) > 1 else None


def stages(full_ms: float, variants: dict) -> dict:
    """ms per token of each stage from the timed variants (see the module docstring)."""
    ms = {k: v.get("ms_per_token") for k, v in variants.items()}
    out = dict(full=full_ms)

    def diff(a, b):
        return None if a is None or b is None else a - b

    out["sampling"] = diff(full_ms, ms.get("logits"))
    out["head"] = diff(ms.get("logits"), ms.get("no_head"))
    out["attention"] = diff(ms.get("logits"), ms.get("no_attention"))
    out["projections"] = ms.get("projections")
    parts = [out[k] for k in ("sampling", "head", "attention", "projections")]
    out["overhead"] = None if None in parts else full_ms - sum(parts)
    out["sampling_top_p"] = diff(ms.get("top_p_sampler"), ms.get("logits"))
    return out


# --------------------------------------------------------------------------------------------
# the run


def hardware() -> dict:
    return {**hardware_info(), "kernels": not custom_kernels.use_reference(),
            "kernel_families": sorted(f for f in custom_kernels.FAMILIES if custom_kernels.use_kernel(f))}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def mlx_lm_available() -> bool:
    try:
        import mlx_lm.models.gemma4_text  # noqa: F401
        import mlx_lm.utils  # noqa: F401
    except Exception:
        return False
    return True


def model_summary(cfg: ModelConfig) -> dict:
    return dict(hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads,
                kv_heads_sliding=cfg.num_key_value_heads, kv_heads_full=cfg.layers[-1].num_kv_heads,
                head_dim=cfg.head_dim, global_head_dim=cfg.global_head_dim, window=cfg.sliding_window,
                vocab=cfg.vocab_size, ffn=cfg.intermediate_size, experts=cfg.num_experts, top_k=cfg.top_k_experts,
                kv_shared_layers=cfg.num_kv_shared_layers, per_layer_input=cfg.hidden_size_per_layer_input,
                params=num_params(cfg))  # fmt: skip


def evaluate_targets(rows: list[dict]) -> list[dict]:
    """The issue's targets against the rows measured so far (met None: not measured)."""
    by = {(r["model"], r["context"]): r for r in rows}

    def tok_s(model, ctx, engine=OURS):
        e = (by.get((model, ctx)) or {}).get(engine) or {}
        return e.get("tok_s")

    out = []
    for name, model, ctx, kind, goal in TARGETS:
        if kind == "tok_s":
            value = tok_s(model, ctx)
        elif kind == "ratio":
            a, b = tok_s(model, ctx), tok_s(model, ctx, MLX_LM)
            value = a / b if a and b else None
        else:
            a, b = tok_s(model, ctx), tok_s(model, 4096)
            value = a / b if a and b else None
        out.append(dict(name=name, model=model, context=ctx, goal=goal, value=value,
                        met=None if value is None else value >= goal))
    return out


def run_matrix(args) -> str:
    quick = args.quick
    backend = custom_kernels.backend()
    date = datetime.datetime.now().strftime("%Y-%m-%d")
    out_path = args.out or os.path.join(RESULTS, f"decode-{backend}-{date}{'-quick' if quick else ''}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    t0 = time.time()
    deadline = t0 + args.budget_s
    mx.random.seed(args.seed)
    with_lm = not args.no_mlx_lm and mlx_lm_available()
    if not args.no_mlx_lm and not with_lm:
        log("mlx-lm is not importable: measuring gemma4_mlx alone")
    models = args.models.split(",") if args.models else list(QUICK_MODELS if quick else MODELS)
    known = QUICK_MODELS if quick else PRESET_NAMES
    unknown = [m for m in models if m not in known]
    if unknown:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}; {'--quick ' if quick else ''}models: {', '.join(known)}")
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else None
    breakdown_at = breakdown_contexts(args.breakdown_contexts, quick)
    plan = []
    for m in models:
        ctxs = contexts or (list(QUICK_CONTEXTS) if quick else list(CONTEXTS) + list(EXTRA_CONTEXTS.get(m, ())))
        plan += [(m, n) for n in ctxs]

    copy = copy_bandwidth(quick)
    log(f"backend {backend}, kernels {'on' if not custom_kernels.use_reference() else 'off (references)'}, "
        f"copy bandwidth {copy['GBps']:.0f} GB/s, mlx-lm {'on' if with_lm else 'off'}")  # fmt: skip
    doc = dict(
        bench="bench/decode.py", date=datetime.datetime.now().isoformat(timespec="seconds"), args=vars(args),
        quick=quick, hardware=hardware(), env={k: v for k, v in os.environ.items() if k.startswith("GEMMA4_")},
        versions=dict(mlx=mx.__version__, mlx_lm=_version("mlx-lm") if with_lm else None, numpy=np.__version__,
                      python=platform.python_version(), commit=commit(), sources=sources_digest(), gemma4_mlx=gemma4_mlx.__version__),
        copy_bandwidth=copy,
        method=dict(
            timing=("sync: mx.eval of every token before the next step is built" if args.sync else
                    "pipelined like generate_step: step n+1 built and async_eval'ed before token n is waited for")
                   + f"; greedy on device ({OURS} from the logits, {MLX_LM} from the logprobs, as each library's "
                     f"generate_step does); {args.warmup} warm-up + {args.steps} timed tokens per round, "
                     f"{args.rounds} rounds, engines interleaved, median round",
            weights=f"{OURS}: Q4_0 BlockLinear/BlockExperts, Q8_0 BlockEmbedding (tied head, per-layer embedding), "
                    f"bf16 router and norms; {MLX_LM}: quantize_model affine 4-bit group {args.mlxlm_group_size}, "
                    "bf16 scales/biases (router 8-bit by its predicate); random values",
            context="caches filled with random bf16 K/V of N positions (no prefill); context grows by the tokens "
                    "decoded (context_end)",
            floor="copy GB/s / (weight bytes per token + KV bytes per token); embeddings one row, tied head whole, "
                  "experts top_k/E; each attending layer reads min(N, window) or N positions of K and V (bf16)",
            breakdown="timed variants: sampling = full - logits-only; head = logits - no-head; attention = logits - "
                      "no-attention (attention core replaced by q); projections = all layers' matvecs alone on random "
                      "inputs; overhead = full - those four",
        ),
        models={}, rows=[], targets=[], complete=False,
    )  # fmt: skip

    def save(done: bool = False) -> None:
        doc["targets"] = evaluate_targets(doc["rows"])
        doc["complete"], doc["seconds"] = done, time.time() - t0
        with open(out_path, "w") as fh:
            json.dump(doc, fh, indent=1)

    save()
    by_model: dict[str, list[int]] = {}
    for m, n in plan:
        by_model.setdefault(m, []).append(n)
    for m, ctxs in by_model.items():
        if time.time() > deadline:
            doc["rows"] += [dict(model=m, context=n, skipped="budget") for n in ctxs]
            save()
            continue
        cfg = QUICK_MODELS[m]() if quick else preset(m)
        info = doc["models"].setdefault(m, dict(config=model_summary(cfg)))
        engines = []
        for kind in ([OURS, MLX_LM] if with_lm else [OURS]):
            t = time.time()
            try:
                engine = OursEngine(cfg) if kind == OURS else MlxLmEngine(cfg, args.mlxlm_group_size)
            except Exception as exc:  # e.g. out of memory: keep going with what can run
                info[kind] = dict(error=f"{type(exc).__name__}: {exc}"[:400])
                log(f"{m} {kind}: build failed: {info[kind]['error']}")
                continue
            info[kind] = dict(weight_bytes=weight_bytes(engine.model, cfg), build_s=time.time() - t)
            log(f"{m} {kind}: built in {time.time() - t:.1f} s, "
                f"{info[kind]['weight_bytes']['total'] / 1e9:.2f} GB, {info[kind]['weight_bytes']['per_token'] / 1e9:.2f} GB/token")  # fmt: skip
            engines.append(engine)
            del engine  # the list holds the only reference: freed before the next model is built
        save()
        for n in ctxs:
            if time.time() > deadline:
                doc["rows"].append(dict(model=m, context=n, skipped="budget"))
                save()
                continue
            doc["rows"].append(measure_row(m, cfg, n, engines, info, copy, args, n in breakdown_at, deadline))
            print_row(doc["rows"][-1])
            save()
        del engines
        gc.collect()
        mx.clear_cache()
    save(done=True)
    log(f"wrote {out_path} ({time.time() - t0:.0f} s)")
    return out_path


def measure_row(m, cfg, n, engines, info, copy, args, breakdown: bool, deadline: float) -> dict:
    row: dict = dict(model=m, context=n, kv_bytes_per_token=kv_bytes_read(cfg, n))
    t_row = time.time()
    per_round = args.warmup + args.steps + 1
    decoded = args.rounds * per_round + 2  # tokens the main rounds add to the context

    def extra(e) -> int:  # room: main rounds, the memory probe (9), breakdown variants on the same cache
        return decoded + 9 + per_round * e.variants_on_main_cache + 8

    live = []
    for e in engines:
        try:
            t = time.time()
            e.start(n, extra(e))
            row.setdefault("start_s", {})[e.name] = time.time() - t
            live.append(e)
        except Exception as exc:
            row[e.name] = dict(error=f"{type(exc).__name__}: {exc}"[:400])
    rounds: dict[str, list] = {e.name: [] for e in live}
    first = mx.array([5], mx.int32)

    def run(step, warmup=args.warmup):
        return time_tokens(step, first, warmup, args.steps, args.sync)

    for r in range(args.rounds):
        for e in live:
            if e.name in row:  # failed earlier
                continue
            try:
                t = time.time()
                rounds[e.name].append(run(e.full_step(), args.warmup + (2 if r == 0 else 0)))
                row.setdefault("round_s", {}).setdefault(e.name, []).append(time.time() - t)
            except Exception as exc:
                row[e.name] = dict(error=f"{type(exc).__name__}: {exc}"[:400])
    main_s = time.time() - t_row
    for e in live:
        if e.name in row:
            continue
        res = rounds[e.name]
        best = sorted(res, key=lambda d: d["tok_s"])[len(res) // 2]
        wb = info[e.name]["weight_bytes"]["per_token"]
        floor_bytes = wb + row["kv_bytes_per_token"]
        entry = dict(tok_s=best["tok_s"], ms_per_token=best["ms_per_token"], rounds=[d["tok_s"] for d in res],
                     median_gap_ms=best["median_gap_ms"], host_ms=best.get("host_ms"), bytes_per_token=floor_bytes,
                     floor_tok_s=copy["GBps"] * 1e9 / floor_bytes, context_end=n + decoded)  # fmt: skip
        entry["frac_floor"] = entry["tok_s"] / entry["floor_tok_s"]
        entry["effective_GBps"] = entry["tok_s"] * floor_bytes / 1e9
        try:
            entry.update(e.memory_probe())
        except Exception as exc:
            entry["memory_probe_error"] = f"{type(exc).__name__}: {exc}"[:400]
        row[e.name] = entry
    if OURS in row and MLX_LM in row and "tok_s" in row[OURS] and "tok_s" in row[MLX_LM]:
        row["ratio_vs_mlx_lm"] = row[OURS]["tok_s"] / row[MLX_LM]["tok_s"]
    traced = custom_kernels.backend() == "cuda" and trace_available()
    if breakdown and time.time() + breakdown_seconds(row.get("round_s", {}), main_s, traced) > deadline:
        row["breakdown_skipped"] = "budget"
    elif breakdown:
        for e in live:
            entry = row.get(e.name) or {}
            if "tok_s" not in entry:
                continue
            try:
                if traced:
                    entry["trace"] = trace_breakdown(e.full_step(), first)
                else:
                    variants = e.variants(n, extra(e), lambda step: run(step))
                    entry["breakdown_variants"] = variants
                    entry["stages_ms"] = stages(entry["ms_per_token"], variants)
            except Exception as exc:
                entry["breakdown_error"] = f"{type(exc).__name__}: {exc}"[:400]
    for e in live:
        e.stop()
    gc.collect()
    mx.clear_cache()
    row["seconds"] = time.time() - t_row
    return row


def print_row(r: dict) -> None:
    if "skipped" in r:
        print(f"  {r['model']:8} {r['context']:>7}: skipped ({r['skipped']})", flush=True)
        return
    parts = []
    for name in (OURS, MLX_LM):
        e = r.get(name)
        if not e:
            continue
        if "tok_s" in e:
            parts.append(f"{name} {e['tok_s']:7.1f} tok/s ({100 * e['frac_floor']:4.1f}% of floor "
                         f"{e['floor_tok_s']:.0f})")  # fmt: skip
        else:
            parts.append(f"{name} error: {e.get('error')}")
    ratio = f"  x{r['ratio_vs_mlx_lm']:.2f}" if "ratio_vs_mlx_lm" in r else ""
    print(f"  {r['model']:8} {r['context']:>7}: " + "; ".join(parts) + ratio, flush=True)
    for name in (OURS, MLX_LM):
        st = (r.get(name) or {}).get("stages_ms")
        if st:
            print(f"           {name} stages (ms): " + ", ".join(
                f"{k} {v:.2f}" if v is not None else f"{k} -" for k, v in st.items()), flush=True)
        tr = (r.get(name) or {}).get("trace")
        if tr:
            print(f"           {name} GPU trace (ms): window {tr['window_us'] / 1e3:.2f}, busy {tr['busy_us'] / 1e3:.2f}, "
                  + ", ".join(f"{k} {v / 1e3:.2f}" for k, v in tr["stages_us"].items()), flush=True)


# --------------------------------------------------------------------------------------------
# reports from a results JSON


def latest_results(directory: str = RESULTS) -> str | None:
    """The newest complete-or-not full run (not --quick) in directory, by its recorded date."""
    best = None
    for path in glob.glob(os.path.join(directory, "decode-*.json")):
        if path.endswith("-quick.json"):
            continue
        try:
            with open(path) as fh:
                date = json.load(fh).get("date", "")
        except (OSError, ValueError):
            continue
        key = (date, os.path.getmtime(path))
        if best is None or key > best[0]:
            best = (key, path)
    return best[1] if best else None


def _fmt(v, spec: str = ".1f", none: str = "–") -> str:
    return none if v is None else format(v, spec)


def readme_table(doc: dict) -> str:
    """Markdown: header line, tokens/s table, stage table, targets."""
    hw = doc.get("hardware", {})
    device = hw.get("nvidia_smi", "").split(",")[0] or (hw.get("mlx_device_info") or {}).get("device_name") or hw.get("backend")
    v = doc.get("versions", {})
    lines = [f"Decode, batch 1, random weights in the real shapes (bench/decode.py, {doc.get('date', '')[:10]}, "
             f"{device}, MLX {v.get('mlx')}, mlx-lm {v.get('mlx_lm') or 'not run'}, commit {v.get('commit') or '?'}; "
             f"copy bandwidth {doc['copy_bandwidth']['GBps']:.0f} GB/s{'' if doc.get('complete', True) else '; partial run'}). gemma4_mlx: Q4_0 + Q8_0 head; mlx-lm: 4-bit "
             f"group {doc.get('args', {}).get('mlxlm_group_size')}. Floor = copy bandwidth / (weight + KV bytes per token).",
             "",
             "| model | context | gemma4_mlx tok/s | mlx-lm tok/s | vs mlx-lm | floor tok/s | % of floor |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in doc.get("rows", []):
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['context']} | skipped ({r['skipped']}) | | | | |")
            continue
        o, lm = r.get(OURS) or {}, r.get(MLX_LM) or {}
        lines.append(f"| {r['model']} | {r['context']} | {_fmt(o.get('tok_s'), '.1f', 'error' if o else '–')} | "
                     f"{_fmt(lm.get('tok_s'), '.1f', 'error' if lm else '–')} | {_fmt(r.get('ratio_vs_mlx_lm'), '.2f')}x | "
                     f"{_fmt(o.get('floor_tok_s'), '.0f')} | {_fmt(o.get('frac_floor') and 100 * o['frac_floor'], '.1f')} |")  # fmt: skip
    staged = [(r, name) for r in doc.get("rows", []) for name in (OURS, MLX_LM) if (r.get(name) or {}).get("stages_ms")]
    if staged:
        lines += ["", "Per-stage ms per token (timed variants; overhead = the rest: norms, RoPE, cache writes, launch gaps; "
                      "a stage is a difference of two timed runs, so one smaller than the spread between the step's "
                      "rounds is noise, and a negative one reads <0):",
                  "", "| model | context | engine | step | projections | attention | head | sampling (greedy) | overhead | "
                      "top-p sampler | round spread |",
                  "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r, name in staged:
            s = r[name]["stages_ms"]
            lines.append(f"| {r['model']} | {r['context']} | {name} | " + " | ".join(
                "<0" if (s.get(k) or 0) < 0 else _fmt(s.get(k), ".2f")
                for k in ("full", "projections", "attention", "head", "sampling", "overhead", "sampling_top_p"))
                + f" | {_fmt(round_spread_ms(r[name]), '.2f')} |")  # fmt: skip
    traced = [(r, name) for r in doc.get("rows", []) for name in (OURS, MLX_LM) if (r.get(name) or {}).get("trace")]
    if traced:
        lines += ["", "Stages from a GPU trace of the step (CUPTI; ms per token of each stage's kernels, from one whole "
                      "step; busy = GPU time, window = the token's time on the GPU timeline):",
                  "", "| model | context | engine | window | busy | " + " | ".join(TRACE_STAGES) + " | launches |",
                  "|---|---:|---|" + "---:|" * (len(TRACE_STAGES) + 3)]  # fmt: skip
        for r, name in traced:
            t = r[name]["trace"]
            lines.append(f"| {r['model']} | {r['context']} | {name} | {t['window_us'] / 1e3:.2f} | {t['busy_us'] / 1e3:.2f} | "
                         + " | ".join(_fmt(t["stages_us"].get(k) and t["stages_us"][k] / 1e3, ".2f")
                                      for k in TRACE_STAGES) + f" | {t['launches']:.0f} |")  # fmt: skip
    probes = [(r, name, r[name]) for r in doc.get("rows", []) for name in (OURS, MLX_LM)
              if "step_peak_growth_bytes" in (r.get(name) or {})]  # fmt: skip
    if probes:
        worst = max(probes, key=lambda p: p[2]["step_peak_growth_bytes"] / p[2]["cache_buffer_bytes"])
        r, name, e = worst
        share = e["step_peak_growth_bytes"] / e["cache_buffer_bytes"]
        lines += ["", f"Cache-copy check (peak memory growth over 8 decode steps / one K or V buffer): worst "
                      f"{share:.2f} ({name}, {r['model']} at {r['context']}){' — a step may copy a cache buffer (or just has other temporaries that large: bench/gpu_timeline.py lists its copy kernels)' if share > 0.5 else ''}."]  # fmt: skip
    if doc.get("targets"):
        lines += ["", "| target | goal | measured | met |", "|---|---:|---:|---|"]
        for t in doc["targets"]:
            met = "–" if t["met"] is None else ("yes" if t["met"] else "no")
            lines.append(f"| {t['name']} | {t['goal']:g} | {_fmt(t['value'], '.2f')} | {met} |")
    return "\n".join(lines)


def plot(doc: dict, path: str) -> bool:
    """tokens/s vs context, one panel per model: gemma4_mlx, mlx-lm, the Q4_0 floor, and the issue's
    tokens/s target where there is one. False (and a message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written", flush=True)
        return False
    models = list(dict.fromkeys(r["model"] for r in doc.get("rows", []) if "skipped" not in r))
    cols = min(2, max(1, len(models)))
    rows_n = max(1, math.ceil(len(models) / cols))
    fig, axes = plt.subplots(rows_n, cols, figsize=(5.5 * cols, 3.8 * rows_n), squeeze=False)
    goals = {t[1]: t[4] for t in TARGETS if t[3] == "tok_s"}
    for ax, m in zip(axes.flat, models):
        rows = sorted((r for r in doc["rows"] if r["model"] == m and "skipped" not in r), key=lambda r: r["context"])
        for name, style, label in ((OURS, "-o", "gemma4_mlx (Q4_0, Q8_0 head)"), (MLX_LM, "--s", "mlx-lm (4-bit)")):
            pts = [(r["context"], r[name]["tok_s"]) for r in rows if "tok_s" in (r.get(name) or {})]
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        pts = [(r["context"], r[OURS]["floor_tok_s"]) for r in rows if "floor_tok_s" in (r.get(OURS) or {})]
        if pts:
            ax.plot(*zip(*pts), ":x", color="gray", label="floor (Q4_0 bytes / copy bandwidth)")
        if m in goals:
            ax.axhline(goals[m], color="red", lw=0.8, ls="-.", label=f"target {goals[m]:g} tok/s")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_title(m, fontsize=10)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tok/s (batch 1)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    hw = doc.get("hardware", {})
    device = (hw.get("nvidia_smi") or hw.get("backend") or "").split(",")[0]
    fig.suptitle(f"Gemma 4 decode on random weights, {device}, {doc.get('date', '')[:10]} (bench/decode.py)", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}", flush=True)
    return True


def default_plot_path(doc: dict) -> str:
    return os.path.join(RESULTS, f"decode-{doc.get('date', '')[:10]}{'-quick' if doc.get('quick') else ''}.png")


def breakdown_contexts(text: str | None, quick: bool) -> set[int]:
    """--breakdown-contexts: None -> the defaults; "" -> none; "4096,32768" -> those."""
    if text is None:
        return set(QUICK_CONTEXTS[-1:] if quick else BREAKDOWN_CONTEXTS)
    return {int(c) for c in text.split(",") if c.strip()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny models and contexts, few tokens (runs on CPU)")
    ap.add_argument("--models", default=None,
                    help=f"comma-separated, run in this order (default {','.join(MODELS)}; quick {','.join(QUICK_MODELS)})")
    ap.add_argument("--contexts", default=None, help="comma-separated (default 4096,128,32768; +131072 for 31B)")
    ap.add_argument("--breakdown-contexts", default=None, help="contexts with a stage breakdown (default 4096,32768; \"\" for none)")
    ap.add_argument("--steps", type=int, default=None, help="timed tokens per round (default 32; quick 4)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up tokens per round (default 4; quick 1)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; quick 1)")
    ap.add_argument("--sync", action="store_true", help="evaluate every token before building the next step")
    ap.add_argument("--mlxlm-group-size", type=int, default=64, choices=(32, 64, 128))
    ap.add_argument("--no-mlx-lm", action="store_true", help="measure gemma4_mlx alone")
    ap.add_argument("--budget-s", type=float, default=540.0, help="start no row after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/decode-<backend>-<date>.json)")
    ap.add_argument("--plot", action="store_true", help="write the PNG (after the run, or of --results)")
    ap.add_argument("--plot-out", default=None, help="PNG path (default bench/results/decode-<date>.png)")
    ap.add_argument("--readme-table", action="store_true",
                    help="print the markdown tables of --results (default: the latest full run) and exit")
    ap.add_argument("--results", default=None, help="results JSON for --readme-table / --plot")
    args = ap.parse_args(argv)
    for name, full, quick in (("steps", 32, 4), ("warmup", 4, 1), ("rounds", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.steps < 2 or args.rounds < 1 or args.warmup < 0:
        ap.error("--steps >= 2, --rounds >= 1, --warmup >= 0")

    if args.readme_table or args.results:  # --results means "report on these", never "run"
        path = args.results or latest_results()
        if not path:
            print("no results: run bench/decode.py first", file=sys.stderr)
            return 1
        with open(path) as fh:
            doc = json.load(fh)
        if args.readme_table or not args.plot:
            print(readme_table(doc))
        if args.plot:
            plot(doc, args.plot_out or default_plot_path(doc))
        return 0
    path = run_matrix(args)
    with open(path) as fh:
        doc = json.load(fh)
    print()
    print(readme_table(doc))
    if args.plot:
        plot(doc, args.plot_out or default_plot_path(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
