"""This project vs mlx-lm on MLX's CPU backend: prefill and decode speed on the same random checkpoint.

    python bench/cpu_vs_mlx_lm.py            # ~0.38B model, 512-token prefill, 128-token decode, 3 rounds
    python bench/cpu_vs_mlx_lm.py --quick    # tiny model, 1 round, ~1 min: checks the program works
    python bench/cpu_vs_mlx_lm.py --ops      # per-op decode matmuls only: MLX vs the native matvec

What it does, in one process (gemma4_mlx is imported first, so the fast BLAS it preloads, if any,
serves every f32 matmul of the process, mlx-lm's included; bf16 and quantized matmuls use MLX's own
kernels and never reach BLAS):

1. Builds once, under --cache-dir (default ~/.cache/gemma4_mlx/bench), a random Gemma 4 text model
   with the real layer pattern (5 sliding : 1 full, K=V full layers with 1 KV head, head dims
   256 / 512, window 1024, vocab 262144, tied head; default hidden 1024, 12 layers, MLP 2048,
   4 heads) as an HF directory: config.json from `ModelConfig.to_hf()` (published gemma4_text
   layout), bf16 `model.safetensors` written with `mx.save_safetensors` (weights drawn as
   docs/fixtures.md says, so logits are peaked), and a 262144-id tokenizer from
   `build_gemma4_tokenizer` (both loaders want one). Then a Q4_0 GGUF of it with
   `gemma4_mlx.convert.convert(..., "q4_0")`.
2. Loads the engines: this project's `load_hf` in bf16 and f32 and `load_gguf` of the Q4_0 file
   with bf16 activations (ours-q4) and with f32 ones (ours-q4-f32: what `gemma4_mlx.load` picks on
   a CPU with a verified fast BLAS); ours-f32-nonative: ours-f32 with the native CPU matvec
   (gemma4_mlx/cpu_matvec.py, the tied head at decode) switched off, the head through MLX;
   ours-f32-refblas: ours-f32 in a child process started with GEMMA4_MLX_BLAS=off (MLX's bundled
   reference BLAS: the "fast BLAS off" case; it warms up inside each of its runs, with a 16-token
   prompt); mlx-lm's `mlx_lm.load` in bf16, the same weights cast to f32, and its own
   4-bit affine quantization (`mlx_lm.utils.quantize_model`, bits 4, --mlxlm-group-size, default
   32 = Q4_0's block; scales/biases bf16, as `mlx_lm.convert -q` makes them).
3. Rounds, interleaved (engine A, B, C, ... then again): each run is one greedy generation from a
   fixed random prompt with each library's own `generate_step`. Prefill = time to the first token
   (prompt forward + first sample); decode = tokens 2..N over the time from the first to the last
   token (both libraries compute one token ahead, so the rate is the steady-state one). The table
   reports medians and the ratio ours / mlx-lm at the same precision.
   An engine whose decode has run longer than --decode-budget-s stops early (the rate is over the
   tokens it made), and an engine whose first run took longer than --repeat-limit-s is not
   repeated: mlx-lm's 4-bit CPU path runs at ~0.2 GFLOP/s and would otherwise take an hour.
4. Profiles one decode step per engine: each part of a sliding and a full layer (q/k/v/o
   projections, the attention core over the run's context, the MLP), the tied head and the logits
   tail timed alone (median of several evals), times the number of layers of each kind; "other"
   is the measured step time minus these parts (norms, RoPE, cache writes, masks, graph building).

--ops times the decode matmuls alone on random weights of the model's shapes (tied head, MLP):
MLX f32 (BLAS sgemm), bf16 and quantized_matmul against the native matvec's f32, bf16 and affine
4/8-bit paths at 1, 4 and 8 rows; JSON in bench/results/cpu_matvec_ops-<date>T<time>.json.

Results: a markdown table on stdout and JSON (hardware, versions, BLAS, load average, every run,
medians, ratios, profile) in bench/results/cpu_vs_mlx_lm-<date>T<time>[-quick].json (or --out).
"""

from __future__ import annotations

# First, before anything imports mlx.core: gemma4_mlx puts a fast BLAS under MLX's CPU backend.
import gemma4_mlx  # noqa: I001
from gemma4_mlx import blas

import argparse
import datetime
import hashlib
import importlib.metadata as md
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from gemma4_mlx import cpu_matvec
from gemma4_mlx.checkpoint import load_gguf, load_hf
from gemma4_mlx.config import FULL, SLIDING, ModelConfig, num_params
from gemma4_mlx.convert import convert
from gemma4_mlx.generate import generate_step as ours_generate_step
from gemma4_mlx.model import Model
from gemma4_mlx.tokenizer_train import DEFAULT_TRAINING_TEXT, build_gemma4_tokenizer, save_hf_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def _sources_sha256() -> str:
    """Hash of the gemma4_mlx sources as imported now (the checkout may change while a run goes on)."""
    h = hashlib.sha256()
    pkg = Path(gemma4_mlx.__file__).parent
    for f in sorted([*pkg.glob("*.py"), *pkg.glob("*.c")]):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


SOURCES_SHA256 = _sources_sha256()


def _cpu_default_dtype() -> str | None:
    """The activation dtype gemma4_mlx.load picks on this CPU when none is given (None: no such rule)."""
    import gemma4_mlx.generate  # noqa: F401  (the package attribute `generate` is the function)

    fn = getattr(sys.modules["gemma4_mlx.generate"], "default_dtype", None)
    return None if fn is None else str(fn())
BUILDER_VERSION = "1"  # bump when the drawn weights change
SEED = 20260503
ALL_ENGINES = ("ours-bf16", "mlxlm-bf16", "ours-q4", "ours-q4-f32", "mlxlm-q4", "ours-f32", "mlxlm-f32",
               "ours-f32-nonative", "ours-f32-refblas")
# engines that run in a child process, because their BLAS must be chosen before mlx.core is imported:
# name -> (engine the child loads, environment it runs with)
CHILD_ENGINES = {"ours-f32-refblas": ("ours-f32", {"GEMMA4_MLX_BLAS": "off"})}
# (ours, other) pairs for the ratio table
PAIRS = (("bf16", "ours-bf16", "mlxlm-bf16"), ("4-bit", "ours-q4", "mlxlm-q4"),
         ("f32", "ours-f32", "mlxlm-f32"), ("4-bit, ours with f32 activations", "ours-q4-f32", "mlxlm-q4"),
         ("ours f32 vs mlx-lm bf16", "ours-f32", "mlxlm-bf16"),
         ("ours 4-bit vs mlx-lm bf16", "ours-q4", "mlxlm-bf16"),
         ("ours 4-bit f32-act vs mlx-lm bf16", "ours-q4-f32", "mlxlm-bf16"),
         ("ours f32 without the native matvec vs mlx-lm bf16", "ours-f32-nonative", "mlxlm-bf16"),
         ("ours f32 with MLX's reference BLAS vs mlx-lm bf16", "ours-f32-refblas", "mlxlm-bf16"),
         ("ours f32: fast BLAS on / off", "ours-f32", "ours-f32-refblas"))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# the checkpoint


def bench_config(quick: bool) -> ModelConfig:
    """The benchmark model: real Gemma 4 layer pattern, vocab 262144 (tiny sizes with quick)."""
    if quick:
        return ModelConfig(hidden_size=256, num_hidden_layers=6, intermediate_size=512, num_attention_heads=4,
                           num_key_value_heads=2, num_global_key_value_heads=1, attention_k_eq_v=True,
                           layer_types=[SLIDING] * 5 + [FULL], vocab_size=4096, head_dim=64,
                           global_head_dim=128, sliding_window=32, max_position_embeddings=8192)
    return ModelConfig(hidden_size=1024, num_hidden_layers=12, intermediate_size=2048, num_attention_heads=4,
                       num_key_value_heads=2, num_global_key_value_heads=1, attention_k_eq_v=True,
                       layer_types=([SLIDING] * 5 + [FULL]) * 2, vocab_size=262144, head_dim=256,
                       global_head_dim=512, sliding_window=1024, max_position_embeddings=131072)


def _draw(name: str, shape: tuple[int, ...], key: mx.array, cfg: ModelConfig) -> mx.array:
    """float32 values for one HF tensor (docs/fixtures.md: peaked logits without the tied-embedding
    copy-the-input collapse); linear weights N(0, 1/sqrt(in_features)), = 1/16 at H = 256."""
    def uniform(lo, hi):
        return mx.random.uniform(lo, hi, shape, key=key)

    leaf = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
    if leaf == "layer_scalar":
        return uniform(0.5, 1.0)
    if leaf in ("q_norm", "k_norm"):
        return uniform(0.1, 0.3)
    if leaf in ("post_attention_layernorm", "post_feedforward_layernorm"):
        return uniform(2.0, 4.0)
    if name == "model.norm.weight":
        return uniform(4.0, 6.0)
    if leaf.endswith("norm") or leaf.endswith("layernorm"):
        return uniform(0.5, 1.5)
    if leaf == "embed_tokens":
        return mx.random.normal(shape, key=key) * cfg.hidden_size ** -0.5
    return mx.random.normal(shape, key=key) * shape[-1] ** -0.5


def _checkpoint_dir(cache_root: Path, cfg: ModelConfig) -> Path:
    blob = json.dumps({"cfg": cfg.to_hf(), "seed": SEED, "builder": BUILDER_VERSION}, sort_keys=True)
    tag = hashlib.sha256(blob.encode()).hexdigest()[:12]
    return cache_root / f"gemma4-random-h{cfg.hidden_size}-l{cfg.num_hidden_layers}-v{cfg.vocab_size}-{tag}"


def build_checkpoint(cache_root: Path, cfg: ModelConfig) -> tuple[Path, Path]:
    """(HF directory, Q4_0 GGUF path), built once under cache_root (atomic: temp dir + rename)."""
    hf_dir = _checkpoint_dir(cache_root, cfg)
    gguf_path = hf_dir / "model-q4_0.gguf"
    if not (hf_dir / "model.safetensors").is_file():
        log(f"building the random checkpoint in {hf_dir}")
        tmp = hf_dir.with_name(hf_dir.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            (tmp / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
            names = sorted(name for name, _ in tree_flatten(Model(cfg).parameters()))
            shapes = dict((name, tuple(p.shape)) for name, p in tree_flatten(Model(cfg).parameters()))
            keys = mx.random.split(mx.random.key(SEED), len(names))
            arrays = {}
            for i, name in enumerate(names):
                arr = _draw(name, shapes[name], keys[i], cfg).astype(mx.bfloat16)
                mx.eval(arr)
                arrays[name] = arr
            mx.save_safetensors(str(tmp / "model.safetensors"), arrays, metadata={"format": "pt"})
            del arrays
            tok = build_gemma4_tokenizer([DEFAULT_TRAINING_TEXT], vocab_size=cfg.vocab_size)
            save_hf_tokenizer(tok, tmp)
            shutil.rmtree(hf_dir, ignore_errors=True)
            os.replace(tmp, hf_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if not gguf_path.is_file():
        log(f"converting to Q4_0: {gguf_path}")
        convert(hf_dir, gguf_path, "q4_0")
    return hf_dir, gguf_path


# --------------------------------------------------------------------------------------------
# engines


class Engine:
    """One (library, precision) combination with a loaded model."""

    def __init__(self, name: str, model, family: str, note: str):
        self.name = name
        self.model = model
        self.family = family  # "ours" | "mlx-lm"
        self.note = note

    def steps(self, prompt: list[int], max_tokens: int):
        """The library's own generate_step, greedy: yields (token id, logprobs)."""
        if self.family == "ours":
            steps = ours_generate_step(prompt, self.model, max_tokens=max_tokens)
            return _native_off(steps) if self.name.endswith("-nonative") else steps
        from mlx_lm.generate import generate_step

        return generate_step(mx.array(prompt, dtype=mx.int32), self.model, max_tokens=max_tokens)

    def sync(self) -> None:
        """Wait for work the generator left in flight (mlx-lm computes one token past the last)."""
        mx.synchronize()
        if self.family == "mlx-lm":
            mx.synchronize(sys.modules["mlx_lm.generate"].generation_stream)


def _native_off(steps):
    """Run a generator with the native CPU matvec switched off (the head through MLX's matmul)."""
    saved = os.environ.get(cpu_matvec.ENV_VAR)
    try:
        while True:
            os.environ[cpu_matvec.ENV_VAR] = "off"
            try:
                item = next(steps)
            except StopIteration:
                return
            finally:
                if saved is None:
                    os.environ.pop(cpu_matvec.ENV_VAR, None)
                else:
                    os.environ[cpu_matvec.ENV_VAR] = saved
            yield item
    finally:
        steps.close()


def _weight_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def load_engines(names: list[str], hf_dir: Path, gguf_path: Path, group_size: int) -> dict[str, Engine]:
    engines: dict[str, Engine] = {}
    for name in names:
        t = time.perf_counter()
        if name == "ours-bf16":
            e = Engine(name, load_hf(hf_dir, dtype=mx.bfloat16, progress=False), "ours",
                       "load_hf, bf16 weights and activations")
        elif name == "ours-f32":
            e = Engine(name, load_hf(hf_dir, dtype=mx.float32, progress=False), "ours",
                       "load_hf(dtype=float32)")
        elif name == "ours-f32-nonative":
            e = Engine(name, load_hf(hf_dir, dtype=mx.float32, progress=False), "ours",
                       f"load_hf(dtype=float32), {cpu_matvec.ENV_VAR}=off during its runs (head and layers through MLX/BLAS)")
        elif name == "ours-q4":
            model, _ = load_gguf(gguf_path, dtype=mx.bfloat16, progress=False)
            e = Engine(name, model, "ours", "load_gguf of the Q4_0 file (f32 scales/biases, bf16 activations)")
        elif name == "ours-q4-f32":
            model, _ = load_gguf(gguf_path, dtype=mx.float32, progress=False)
            e = Engine(name, model, "ours", "load_gguf(dtype=float32) of the Q4_0 file (f32 activations)")
        elif name.startswith("mlxlm-"):
            import mlx_lm
            from mlx_lm.utils import load_model, quantize_model

            if name == "mlxlm-bf16":
                model, _tokenizer = mlx_lm.load(str(hf_dir))
                e = Engine(name, model, "mlx-lm", "mlx_lm.load (bf16)")
            elif name == "mlxlm-f32":
                model, _ = load_model(hf_dir)
                model.set_dtype(mx.float32)
                e = Engine(name, model, "mlx-lm", "mlx_lm.utils.load_model + set_dtype(float32)")
            elif name == "mlxlm-q4":
                model, config = load_model(hf_dir)
                model, _ = quantize_model(model, config, group_size=group_size, bits=4)
                e = Engine(name, model, "mlx-lm",
                           f"mlx_lm.utils.quantize_model bits 4 group {group_size} (bf16 scales)")
            else:
                raise ValueError(f"unknown engine {name}")
        else:
            raise ValueError(f"unknown engine {name}")
        mx.eval(e.model.parameters())
        e.weight_bytes = _weight_bytes(e.model)
        log(f"loaded {name} in {time.perf_counter() - t:.1f} s ({e.weight_bytes / 1e9:.2f} GB)")
        engines[name] = e
    return engines


# --------------------------------------------------------------------------------------------
# measurement


def run_once(engine: Engine, prompt: list[int], n_decode: int, decode_budget_s: float, min_decode: int = 8) -> dict:
    """One greedy generation: prefill (time to first token) and decode rate (tokens 2..N)."""
    mx.clear_cache()
    load_before = os.getloadavg()[0]
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    tokens: list[int] = []
    t_first = t_last = None
    gen = engine.steps(prompt, n_decode)
    for token, _ in gen:
        now = time.perf_counter()
        tokens.append(int(token))
        if t_first is None:
            t_first = now
        t_last = now
        if len(tokens) >= n_decode or (now - t_first > decode_budget_s and len(tokens) >= min_decode):
            break
    gen.close()
    engine.sync()
    wall = time.perf_counter() - t0
    prefill_s = t_first - t0
    decode_s = t_last - t_first
    n_dec = len(tokens) - 1
    return {
        "engine": engine.name,
        "prompt_tokens": len(prompt),
        "prefill_s": prefill_s,
        "prefill_tps": len(prompt) / prefill_s,
        "decode_tokens": n_dec,
        "decode_s": decode_s,
        "decode_tps": n_dec / decode_s if n_dec > 0 and decode_s > 0 else None,
        "wall_s": wall,
        "cpu_util": (time.process_time() - cpu0) / wall,  # process CPU seconds per wall second (2 cores: <= 2)
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": os.getloadavg()[0],
        "tokens": tokens,
    }


def _time_eval(fn, reps: int) -> float:
    """Median seconds of mx.eval(fn()) after one warm-up."""
    mx.eval(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def profile_decode_step(engine: Engine, cfg: ModelConfig, context: int, step_s: float | None) -> dict:
    """Seconds per decode step spent in each part (one sliding and one full layer measured, times
    their counts). Both libraries' modules have the same attribute names (q_proj, mlp.gate_proj,
    embed_tokens.as_linear ...), so one profiler serves both."""
    layers = engine.model.model.layers
    dtype = layers[0].input_layernorm.weight.dtype
    H = cfg.hidden_size
    slow = engine.name == "mlxlm-q4"
    reps = 3 if slow else 7
    key = mx.random.key(7)
    x = mx.random.normal((1, 1, H), key=key).astype(dtype)
    parts: dict[str, float] = {}
    counts = {SLIDING: sum(t == SLIDING for t in cfg.layer_types), FULL: sum(t == FULL for t in cfg.layer_types)}
    for kind, count in counts.items():
        if not count:
            continue
        idx = cfg.layer_types.index(kind)
        spec = cfg.layers[idx]
        layer = layers[idx]
        attn = layer.self_attn
        d, nh, nkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
        proj = {"q_proj": x, "k_proj": x, "o_proj": mx.random.normal((1, 1, nh * d), key=key).astype(dtype)}
        if not spec.k_eq_v:
            proj["v_proj"] = x
        t_proj = sum(_time_eval(lambda m=getattr(attn, n), a=a: m(a), reps) for n, a in proj.items())
        xm = mx.random.normal((1, 1, spec.intermediate_size), key=key).astype(dtype)
        t_mlp = (_time_eval(lambda: layer.mlp.gate_proj(x), reps) + _time_eval(lambda: layer.mlp.up_proj(x), reps)
                 + _time_eval(lambda: layer.mlp.down_proj(xm), reps))
        # attention core as each library runs it at this context: ours attends over its ring
        # (window + 32 slots) with a position mask; mlx-lm over the filled positions, no mask
        if kind == FULL:
            kv_len = context
        elif engine.family == "ours":
            kv_len = cfg.sliding_window + 32  # RotatingKVCache(window, slack=32) returns its whole ring
        else:
            kv_len = min(context, cfg.sliding_window)
        q = mx.random.normal((1, nh, 1, d), key=key).astype(dtype)
        k = mx.random.normal((1, nkv, kv_len, d), key=key).astype(dtype)
        mask = mx.ones((1, kv_len), dtype=mx.bool_) if engine.family == "ours" else None
        t_sdpa = _time_eval(lambda: mx.fast.scaled_dot_product_attention(q, k, k, scale=1.0, mask=mask), reps)
        tag = "sliding" if kind == SLIDING else "full"
        parts[f"{tag} attn projections (x{count})"] = t_proj * count
        parts[f"{tag} attn core, {kv_len} keys (x{count})"] = t_sdpa * count
        parts[f"{tag} MLP (x{count})"] = t_mlp * count
    head = engine.model.model.embed_tokens
    if engine.family == "ours" and not engine.name.endswith("-nonative") and engine.model.native_head_ready(x):
        parts["tied head 1 x H @ H x V"] = _time_eval(lambda: engine.model._native_head(x), reps)
    else:
        parts["tied head 1 x H @ H x V"] = _time_eval(lambda: head.as_linear(x), reps)
    logits = mx.random.normal((1, cfg.vocab_size), key=key)
    cap = cfg.final_logit_softcapping or 30.0

    def tail():
        lg = mx.tanh(logits / cap) * cap
        lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
        return mx.argmax(lp, axis=-1)

    parts["logits tail (softcap, logsumexp, argmax; f32 V)"] = _time_eval(tail, reps)
    total = sum(parts.values())
    out = {"context": context, "activation_dtype": str(dtype), "parts_s": parts, "sum_parts_s": total}
    if step_s is not None:
        out["step_s"] = step_s
        out["other_s"] = step_s - total
    return out


def _fresh_cache(engine: Engine, cfg: ModelConfig, idx: int):
    """A new cache for layer idx alone, as each library makes it."""
    if engine.family == "ours":
        from gemma4_mlx.cache import make_cache

        return make_cache(cfg)[idx]
    return engine.model.make_cache()[idx]


def profile_prefill(engine: Engine, cfg: ModelConfig, prompt: list[int], reps: int = 3) -> dict:
    """Seconds of a prefill of len(prompt) tokens per part: the model cut to one sliding / one full
    layer (its `model.model.layers` list swapped for one layer, a fresh cache) minus the model cut to
    no layer gives a whole layer; its projections and MLP are timed alone on the same number of
    rows; "attention rest" = layer - projections - MLP (norms, RoPE, masks, cache writes and the
    attention core, which is where the two libraries differ: ours attends over its whole sliding
    ring plus the chunk, mlx-lm over the chunk). Multiplied by the number of layers of each kind."""
    tm = engine.model.model
    layers = tm.layers
    dtype = layers[0].input_layernorm.weight.dtype
    T = len(prompt)
    tokens = mx.array(prompt, dtype=mx.int32)[None]
    key = mx.random.key(11)
    x = mx.random.normal((1, T, cfg.hidden_size), key=key).astype(dtype)

    def forward(sel: list[int]) -> float:
        tm.layers = [layers[i] for i in sel]
        try:
            def fn():
                cache = [_fresh_cache(engine, cfg, i) for i in sel]
                return tm(tokens, cache=cache)
            return _time_eval(fn, reps)
        finally:
            tm.layers = layers

    base = forward([])
    parts: dict[str, float] = {"embedding + final norm": base}
    for kind in (SLIDING, FULL):
        count = sum(t == kind for t in cfg.layer_types)
        if not count:
            continue
        idx = cfg.layer_types.index(kind)
        spec, layer = cfg.layers[idx], layers[idx]
        attn = layer.self_attn
        whole = forward([idx]) - base
        d, nh = spec.head_dim, spec.num_heads
        proj = {"q_proj": x, "k_proj": x,
                "o_proj": mx.random.normal((1, T, nh * d), key=key).astype(dtype)}
        if not spec.k_eq_v:
            proj["v_proj"] = x
        t_proj = sum(_time_eval(lambda m=getattr(attn, n), a=a: m(a), reps) for n, a in proj.items())
        xm = mx.random.normal((1, T, spec.intermediate_size), key=key).astype(dtype)
        t_mlp = (_time_eval(lambda: layer.mlp.gate_proj(x), reps) + _time_eval(lambda: layer.mlp.up_proj(x), reps)
                 + _time_eval(lambda: layer.mlp.down_proj(xm), reps))
        tag = "sliding" if kind == SLIDING else "full"
        parts[f"{tag} attn projections (x{count})"] = t_proj * count
        parts[f"{tag} MLP (x{count})"] = t_mlp * count
        parts[f"{tag} attention rest (x{count})"] = (whole - t_proj - t_mlp) * count
    return {"prompt_tokens": T, "activation_dtype": str(dtype), "parts_s": parts,
            "sum_parts_s": sum(parts.values())}


def matvec_ops(cfg: ModelConfig, rows: tuple[int, ...], reps: int) -> list[dict]:
    """Per-op decode matmuls on random weights of the model's shapes (the tied head V x H, an MLP
    gate H -> F and down F -> H): MLX's own matmul (f32 through the preloaded BLAS's sgemm, bf16,
    mx.quantized_matmul with f32 activations/scales) against the native matvec (cpu_matvec), for
    each row count. Median ms of `reps` evals and the weight bytes read per second."""
    H, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    key = mx.random.key(5)
    out = []
    for label, n, k in (("tied head", V, H), ("MLP gate/up", F, H), ("MLP down", H, F)):
        w32 = (mx.random.normal((n, k), key=key) * k ** -0.5).astype(mx.float32)
        w16 = w32.astype(mx.bfloat16)
        q = {bits: mx.quantize(w32, group_size=32, bits=bits) for bits in (4, 8)}
        mx.eval(w32, w16, *q[4], *q[8])
        weights_bytes = {"f32": w32.nbytes, "bf16": w16.nbytes,
                         **{f"q{b}": sum(a.nbytes for a in q[b]) for b in (4, 8)}}
        for m in rows:
            x = mx.random.normal((m, k), key=key)
            xb = x.astype(mx.bfloat16)
            mx.eval(x, xb)
            ops = {
                "mlx f32 (BLAS sgemm)": ("f32", lambda: x @ w32.T),
                "mlx bf16": ("bf16", lambda: xb @ w16.T),
                "native f32": ("f32", lambda: cpu_matvec.matmul(x, w32)),
                "native bf16": ("bf16", lambda: cpu_matvec.matmul(x, w16)),
            }
            for bits in (4, 8):
                ops[f"mlx q{bits} quantized_matmul (f32 act.)"] = (
                    f"q{bits}", lambda b=bits: mx.quantized_matmul(x, *q[b], transpose=True, group_size=32, bits=b))
                ops[f"native q{bits} (MLX affine g32)"] = (f"q{bits}", lambda b=bits: cpu_matvec.matmul_affine(x, *q[b], b))
            for op, (fmt, fn) in ops.items():
                if op.startswith("native") and not cpu_matvec.available():
                    continue
                t = _time_eval(fn, reps)
                row = {"matmul": label, "N": n, "K": k, "rows": m, "op": op, "weight_format": fmt,
                       "ms": t * 1e3, "weight_GB_per_s": weights_bytes[fmt] / t / 1e9}
                out.append(row)
                log(f"{label} {n}x{k} M={m} {op}: {t * 1e3:.2f} ms, {row['weight_GB_per_s']:.1f} GB/s")
        del w32, w16, q
        mx.clear_cache()
    return out


def print_ops(ops: list[dict]) -> None:
    print("\n| matmul | rows | op | ms (median) | weight GB/s |")
    print("|---|---|---|---|---|")
    for r in ops:
        print(f"| {r['matmul']} {r['N']}x{r['K']} | {r['rows']} | {r['op']} | {r['ms']:.2f} | "
              f"{r['weight_GB_per_s']:.1f} |")


# --------------------------------------------------------------------------------------------
# reporting


def hardware_info() -> dict:
    cpu = platform.processor()
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not cpu.strip():
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                if line.startswith("flags") and not flags:
                    have = set(line.split(":", 1)[1].split())
                    flags = " ".join(f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16")
                                     if f in have)
    except OSError:
        pass

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "gemma4_mlx"],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    return {
        "gemma4_mlx_sources_sha256": SOURCES_SHA256,
        "gemma4_mlx_cpu_default_dtype": _cpu_default_dtype(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_flags": flags,
        "cpu_count": os.cpu_count(),
        "memory_bytes": mem,
        "python": platform.python_version(),
        "versions": {"mlx": version("mlx"), "mlx-cpu": version("mlx-cpu"), "mlx-lm": version("mlx-lm"),
                     "gemma4_mlx": gemma4_mlx.__version__, "gemma4_mlx_commit": commit,
                     "gemma4_mlx_sources_dirty": dirty, "numpy": version("numpy")},
        "blas": blas.active(),
        "cpu_matvec": cpu_matvec.describe(),
        "mlx_default_device": str(mx.default_device()),
    }


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict], engines: list[str]) -> dict:
    out = {}
    for name in engines:
        rs = [r for r in runs if r["engine"] == name]
        if not rs:
            continue
        out[name] = {
            "runs": len(rs),
            "prefill_tps_median": _median([r["prefill_tps"] for r in rs]),
            "prefill_tps_all": [round(r["prefill_tps"], 3) for r in rs],
            "decode_tps_median": _median([r["decode_tps"] for r in rs]),
            "decode_tps_all": [None if r["decode_tps"] is None else round(r["decode_tps"], 3) for r in rs],
            "decode_tokens": [r["decode_tokens"] for r in rs],
        }
    return out


def ratios(summary: dict, runs: list[dict]) -> dict:
    """ours / mlx-lm: ratio of the medians, and the median of per-round ratios (runs of the same
    round are minutes apart, so a paired ratio is less exposed to the machine's load drifting)."""
    out = {}
    by_round = {(r["engine"], r["round"]): r for r in runs}
    for label, a, b in PAIRS:
        if a in summary and b in summary:
            sa, sb = summary[a], summary[b]
            paired = [(by_round[(a, k)], by_round[(b, k)]) for (e, k) in by_round if e == a and (b, k) in by_round]
            out[label] = {
                "ours": a, "mlx_lm": b,
                "prefill": sa["prefill_tps_median"] / sb["prefill_tps_median"],
                "decode": (sa["decode_tps_median"] / sb["decode_tps_median"]
                           if sa["decode_tps_median"] and sb["decode_tps_median"] else None),
                "prefill_paired": [ra["prefill_tps"] / rb["prefill_tps"] for ra, rb in paired],
                "decode_paired": [ra["decode_tps"] / rb["decode_tps"] for ra, rb in paired
                                  if ra["decode_tps"] and rb["decode_tps"]],
            }
    return out


def agreement(runs: list[dict]) -> dict:
    """Greedy tokens in common (leading run) between ours and mlx-lm at the same precision: a check
    that both libraries compute the same model (bf16 rounding may split them after a while)."""
    first = {}
    for r in runs:
        first.setdefault(r["engine"], r["tokens"])
    out = {}
    for label, a, b in (PAIRS[0], PAIRS[2]):  # 4-bit: different quantizers, different weights
        if a in first and b in first:
            ta, tb = first[a], first[b]
            n = min(len(ta), len(tb))
            same = next((i for i in range(n) if ta[i] != tb[i]), n)
            out[label] = {"leading_tokens_equal": same, "compared": n}
    return out


def print_report(result: dict) -> None:
    s, cfgd = result["summary"], result["model"]
    hw = result["hardware"]
    print(f"\nModel: hidden {cfgd['hidden_size']}, {cfgd['num_hidden_layers']} layers, vocab {cfgd['vocab_size']}, "
          f"{cfgd['params'] / 1e9:.3f}B params; prompt {result['settings']['prompt_tokens']} tokens, "
          f"decode {result['settings']['decode_tokens']} tokens")
    print(f"CPU: {hw['cpu']} x{hw['cpu_count']}; BLAS: {hw['blas']['name']} (verified={hw['blas']['verified']}); "
          f"mlx {hw['versions']['mlx']}, mlx-lm {hw['versions']['mlx-lm']}, gemma4_mlx {hw['versions']['gemma4_mlx']} "
          f"({hw['versions']['gemma4_mlx_commit']})")
    print("\n| engine | prefill tok/s (median) | decode tok/s (median) | runs | decode tokens | weights GB |")
    print("|---|---|---|---|---|---|")
    for name, v in s.items():
        dec = "—" if v["decode_tps_median"] is None else f"{v['decode_tps_median']:.3f}"
        print(f"| {name} | {v['prefill_tps_median']:.2f} | {dec} | {v['runs']} | "
              f"{','.join(map(str, v['decode_tokens']))} | {result['weights_gb'][name]:.2f} |")
    print("\n| ours / mlx-lm | prefill (ratio of medians) | decode | prefill per round | decode per round |")
    print("|---|---|---|---|---|")
    for label, v in result["ratios"].items():
        dec = "—" if v["decode"] is None else f"{v['decode']:.2f}x"
        pp = ", ".join(f"{x:.2f}" for x in v["prefill_paired"]) or "—"
        dp = ", ".join(f"{x:.2f}" for x in v["decode_paired"]) or "—"
        print(f"| {label} ({v['ours']} / {v['mlx_lm']}) | {v['prefill']:.2f}x | {dec} | {pp} | {dp} |")
    if result.get("agreement"):
        print("\nGreedy agreement (leading equal tokens of the first run): "
              + ", ".join(f"{k}: {v['leading_tokens_equal']}/{v['compared']}" for k, v in result["agreement"].items()))
    loads = [r["loadavg_1m_before"] for r in result["runs"]]
    utils = [r["cpu_util"] for r in result["runs"]]
    print(f"Load average (1 min) before runs: {min(loads):.2f}-{max(loads):.2f}; "
          f"process CPU use per wall second: {min(utils):.2f}-{max(utils):.2f} (of {hw['cpu_count']})")
    if result.get("profile"):
        print("\nDecode step profile (ms per token; parts timed alone, 'other' = measured step - parts):")
        names = list(result["profile"])
        all_parts = []
        for n in names:
            for p in result["profile"][n]["parts_s"]:
                base = p.split(",")[0] if "attn core" in p else p
                if base not in all_parts:
                    all_parts.append(base)
        print("| part | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for base in all_parts:
            cells = []
            for n in names:
                val = next((v for p, v in result["profile"][n]["parts_s"].items()
                            if (p.split(",")[0] if "attn core" in p else p) == base), None)
                cells.append("—" if val is None else f"{val * 1e3:.1f}")
            print(f"| {base} | " + " | ".join(cells) + " |")
        for row, key in (("sum of parts", "sum_parts_s"), ("measured step", "step_s"), ("other", "other_s")):
            cells = [("—" if result["profile"][n].get(key) is None else f"{result['profile'][n][key] * 1e3:.1f}")
                     for n in names]
            print(f"| {row} | " + " | ".join(cells) + " |")
    if result.get("prefill_profile"):
        pp = result["prefill_profile"]
        names = list(pp)
        print(f"\nPrefill profile (s for {result['settings']['prompt_tokens']} tokens; one-layer model runs "
              "minus a no-layer run; projections and MLP timed alone):")
        print("| part | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for part in pp[names[0]]["parts_s"]:
            cells = [f"{pp[n]['parts_s'].get(part, float('nan')):.2f}" for n in names]
            print(f"| {part} | " + " | ".join(cells) + " |")
        for row, key in (("sum of parts", "sum_parts_s"), ("measured prefill (median)", "measured_s")):
            print(f"| {row} | " + " | ".join(f"{pp[n][key]:.2f}" for n in names) + " |")


# --------------------------------------------------------------------------------------------


def write_result(result: dict, args, stem: str, started: datetime.datetime) -> Path:
    """The JSON to --out, else bench/results/<stem>-<date>T<HHMM>[-quick].json."""
    out = Path(args.out) if args.out else (
        ROOT / "bench" / "results" / f"{stem}-{started:%Y-%m-%dT%H%M}{'-quick' if args.quick else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {out} ({result['elapsed_s']:.0f} s in all)")
    return out


def run_in_child(name: str, args, prompt_tokens: int, decode_tokens: int, warmup: bool) -> dict:
    """One run_once of a CHILD_ENGINES engine in a fresh process (its own BLAS); warm-up first when
    asked (a short prompt: compiles the decode step, starts threads). Returns its run dict, with the
    child's BLAS in "blas"."""
    base, env = CHILD_ENGINES[name]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-run", base, "--cache-dir", args.cache_dir,
           "--prompt-tokens", str(prompt_tokens), "--decode-tokens", str(decode_tokens),
           "--decode-budget-s", str(args.decode_budget_s)] + (["--quick"] if args.quick else []) + (
           ["--child-warmup"] if warmup else [])  # fmt: skip
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: child run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r["engine"] = name
    return r


def child_run(args) -> int:
    """--child-run ENGINE: load it, (warm up,) time one generation, print the run dict as JSON."""
    cfg = bench_config(args.quick)
    hf_dir, gguf_path = build_checkpoint(Path(args.cache_dir).expanduser(), cfg)
    engine = load_engines([args.child_run], hf_dir, gguf_path, args.mlxlm_group_size)[args.child_run]
    prompt = np.random.default_rng(SEED).integers(364, cfg.vocab_size, args.prompt_tokens).tolist()
    if args.child_warmup:
        run_once(engine, prompt[:16], 3, args.decode_budget_s, min_decode=1)
    r = run_once(engine, prompt, args.decode_tokens, args.decode_budget_s)
    r["blas"] = blas.active()["name"]
    r["weight_bytes"] = engine.weight_bytes
    print(json.dumps(r))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, 64-token prompt, 16 tokens, 1 round")
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "gemma4_mlx", "bench"))
    p.add_argument("--engines", default=",".join(ALL_ENGINES), help=f"comma list from {','.join(ALL_ENGINES)}")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; quick 1)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 512 (quick 64)")
    p.add_argument("--decode-tokens", type=int, default=None, help="default 128 (quick 16)")
    p.add_argument("--decode-budget-s", type=float, default=150.0,
                   help="stop a decode after this many seconds (at least 8 tokens); the rate is over what was made")
    p.add_argument("--repeat-limit-s", type=float, default=300.0,
                   help="an engine whose first run took longer is not repeated in later rounds")
    p.add_argument("--mlxlm-group-size", type=int, default=32, choices=(32, 64, 128))
    p.add_argument("--no-profile", action="store_true", help="skip the decode-step profile")
    p.add_argument("--ops", action="store_true",
                   help="only the per-op decode matmuls (head, MLP) on random weights: MLX vs the native matvec")
    p.add_argument("--ops-rows", default="1,4,8", help="row counts for --ops (default 1,4,8)")
    p.add_argument("--ops-reps", type=int, default=9, help="evals per op for --ops (median)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/cpu_vs_mlx_lm-<date>T<HHMM>[-quick].json)")
    p.add_argument("--child-run", default=None, help=argparse.SUPPRESS)  # internal: one engine, one run
    p.add_argument("--child-warmup", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_run:
        mx.set_default_device(mx.cpu)
        return child_run(args)

    rounds = args.rounds or (1 if args.quick else 3)
    n_prompt = args.prompt_tokens or (64 if args.quick else 512)
    n_decode = args.decode_tokens or (16 if args.quick else 128)
    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in names if e not in ALL_ENGINES]
    if bad:
        p.error(f"unknown engine(s) {bad}; choose from {ALL_ENGINES}")
    mx.set_default_device(mx.cpu)

    started = datetime.datetime.now()
    hw = hardware_info()
    log(f"BLAS: {hw['blas']['name']} verified={hw['blas']['verified']}; load average {os.getloadavg()}")
    log(hw["cpu_matvec"])
    cfg = bench_config(args.quick)
    if args.ops:
        load_before = os.getloadavg()
        ops = matvec_ops(cfg, tuple(int(r) for r in args.ops_rows.split(",")), args.ops_reps)
        print_ops(ops)
        result = {"benchmark": "cpu_vs_mlx_lm --ops", "date": started.isoformat(timespec="seconds"),
                  "argv": sys.argv[1:] if argv is None else list(argv), "hardware": hw,
                  "threads": cpu_matvec.threads(), "reps": args.ops_reps, "ops": ops,
                  "loadavg_before": load_before, "loadavg_end": os.getloadavg(),
                  "elapsed_s": (datetime.datetime.now() - started).total_seconds()}
        write_result(result, args, "cpu_matvec_ops", started)
        return 0
    hf_dir, gguf_path = build_checkpoint(Path(args.cache_dir).expanduser(), cfg)
    engines = load_engines([n for n in names if n not in CHILD_ENGINES], hf_dir, gguf_path, args.mlxlm_group_size)

    rng = np.random.default_rng(SEED)
    prompt = rng.integers(364, cfg.vocab_size, n_prompt).tolist()  # past the special and byte ids

    # warm-up (not timed): first calls compile mx.compile'd functions, start BLAS threads and
    # allocate buffers; the whole prompt, except for mlx-lm's 4-bit engine (minutes per prompt)
    for name in names:
        if name in CHILD_ENGINES:  # warms up inside each of its child runs
            continue
        t = time.perf_counter()
        run_once(engines[name], prompt[:16] if name == "mlxlm-q4" else prompt, 3, args.decode_budget_s,
                 min_decode=1)
        log(f"warm-up {name}: {time.perf_counter() - t:.1f} s")

    runs: list[dict] = []
    first_run_s: dict[str, float] = {}
    for rnd in range(rounds):
        for name in names:
            if rnd > 0 and first_run_s.get(name, 0.0) > args.repeat_limit_s:
                continue
            if name in CHILD_ENGINES:
                r = run_in_child(name, args, n_prompt, n_decode, warmup=True)
            else:
                r = run_once(engines[name], prompt, n_decode, args.decode_budget_s)
            r["round"] = rnd
            runs.append(r)
            first_run_s.setdefault(name, r["wall_s"])
            dec = "—" if r["decode_tps"] is None else f"{r['decode_tps']:.3f}"
            log(f"round {rnd + 1}/{rounds} {name}: prefill {r['prefill_tps']:.2f} tok/s ({r['prefill_s']:.1f} s), "
                f"decode {dec} tok/s over {r['decode_tokens']} tokens; load {r['loadavg_1m_before']:.2f}, "
                f"cpu {r['cpu_util']:.2f}")

    summary = summarize(runs, names)
    profile, prefill_profile = {}, {}
    if not args.no_profile:
        for name in [n for n in names if n not in CHILD_ENGINES]:
            step = summary[name]["decode_tps_median"]
            log(f"profiling one decode step of {name}")
            profile[name] = profile_decode_step(engines[name], cfg, n_prompt + n_decode // 2,
                                                1.0 / step if step else None)
        for name in [n for n in names if n not in CHILD_ENGINES]:
            if name == "mlxlm-q4":  # ~0.2 GFLOP/s: a one-layer prefill alone takes minutes
                continue
            log(f"profiling the prefill of {name}")
            prefill_profile[name] = profile_prefill(engines[name], cfg, prompt)
            prefill_profile[name]["measured_s"] = n_prompt / summary[name]["prefill_tps_median"]

    result = {
        "benchmark": "cpu_vs_mlx_lm",
        "date": started.isoformat(timespec="seconds"),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "quick": args.quick,
        "hardware": hw,
        "model": {**{k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                                 "num_attention_heads", "num_key_value_heads",
                                                 "num_global_key_value_heads", "head_dim", "global_head_dim",
                                                 "sliding_window", "vocab_size", "attention_k_eq_v")},
                  "layer_types": "".join("F" if t == FULL else "S" for t in cfg.layer_types),
                  "params": num_params(cfg), "checkpoint": str(hf_dir), "gguf_q4_0": str(gguf_path)},
        "settings": {"prompt_tokens": n_prompt, "decode_tokens": n_decode, "rounds": rounds,
                     "decode_budget_s": args.decode_budget_s, "repeat_limit_s": args.repeat_limit_s,
                     "mlxlm_group_size": args.mlxlm_group_size, "sampling": "greedy", "prompt_seed": SEED,
                     "order": names},
        "engines": {n: (engines[n].note if n in engines else
                        f"{CHILD_ENGINES[n][0]} in a child process with {CHILD_ENGINES[n][1]}") for n in names},
        "weights_gb": {n: (engines[n].weight_bytes if n in engines else
                           next(r["weight_bytes"] for r in runs if r["engine"] == n)) / 1e9
                       for n in names if n in engines or any(r["engine"] == n for r in runs)},
        "runs": runs,
        "summary": summary,
        "ratios": ratios(summary, runs),
        "agreement": agreement(runs),
        "profile": profile,
        "prefill_profile": prefill_profile,
        "cpu_matvec_end": {"describe": cpu_matvec.describe(), "sgemm_hook": cpu_matvec.hook_status()},
        "loadavg_end": os.getloadavg(),
        "elapsed_s": (datetime.datetime.now() - started).total_seconds(),
    }
    print_report(result)
    write_result(result, args, "cpu_vs_mlx_lm", started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
