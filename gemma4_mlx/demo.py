"""The built-in demo model: a small random-weight Gemma 4 GGUF, built once into a cache directory.

    python -m gemma4_mlx.generate --model demo --prompt "Hello"

It has a real Gemma 4 layer pattern (8 layers: 3 sliding + 1 full, twice; K=V on the full layers;
window 32), the Gemma 4 token layout with a small BPE trained on `DEFAULT_TRAINING_TEXT`, the
built-in chat template, Q8_0 matrices, and Gemma 4's recommended sampling (temperature 1.0, top-p 0.95,
top-k 64) in `general.sampling.*`, so the CLI samples by default as with a converted real model. Its weights are random (drawn as docs/fixtures.md says, so
that the next-token distribution is peaked), so its text is meaningless: it exists to show the whole
path working on a fresh machine in seconds, and as a default for the examples.

The file is `$GEMMA4_MLX_CACHE/demo-<hash>.gguf` (default `~/.cache/gemma4_mlx`), where <hash> covers the
sources that determine its bytes, so a changed builder makes a new file. The build is deterministic (same
bytes every time) and atomic (temporary file + rename).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from . import quants
from .config import FULL, SLIDING, ModelConfig
from .convert import output_ggml_type
from .gguf import write_gguf
from .tokenizer import FIRST_BYTE_ID, NEWLINE_ID, Tokenizer
from .tokenizer_train import DEFAULT_TRAINING_TEXT, build_gemma4_tokenizer

__all__ = ["DEMO_VOCAB_SIZE", "demo_config", "demo_tokenizer", "build_demo_gguf", "demo_cache_dir", "demo_path"]

# DEFAULT_TRAINING_TEXT yields 1125 ids before the trainer would pad with <unusedN> tokens.
DEMO_VOCAB_SIZE = 1125
DEMO_SEED = 4242
_FILE_TYPE_MOSTLY_Q8_0 = 7
_SOURCES = ("demo.py", "config.py", "convert.py", "gguf.py", "quants.py", "tokenizer.py", "tokenizer_train.py",
            "chat_template.jinja")


def demo_config(vocab_size: int = DEMO_VOCAB_SIZE) -> ModelConfig:
    """Hidden 256, 8 layers (S S S F) x 2, 4 heads of 64 (global 128), 2 KV heads sliding / 1 global with K=V."""
    return ModelConfig(
        hidden_size=256,
        num_hidden_layers=8,
        intermediate_size=1024,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        layer_types=([SLIDING] * 3 + [FULL]) * 2,
        vocab_size=vocab_size,
        head_dim=64,
        global_head_dim=128,
        sliding_window=32,
        final_logit_softcapping=30.0,
        max_position_embeddings=8192,
    )


def demo_tokenizer() -> Tokenizer:
    """The demo's tokenizer: `build_gemma4_tokenizer(DEFAULT_TRAINING_TEXT)` with the built-in chat template."""
    trained = build_gemma4_tokenizer([DEFAULT_TRAINING_TEXT], vocab_size=DEMO_VOCAB_SIZE)
    return Tokenizer(json.loads(trained.to_str()))


def _draw(name: str, shape: tuple[int, ...], rng: np.random.Generator, hidden: int) -> np.ndarray:
    """float32 values for one GGUF tensor, per docs/fixtures.md (peaked logits, no copy-the-input collapse),
    except post-attention norm scales U(0.5, 1.0) instead of U(2, 4): with the larger attention output,
    generated text falls into one repeated token after a few steps; with these it keeps varying."""
    if name.endswith("layer_output_scale.weight"):
        return rng.uniform(0.5, 1.0, shape)
    if name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
        return rng.uniform(0.1, 0.3, shape)
    if name.endswith("post_attention_norm.weight"):
        return rng.uniform(0.5, 1.0, shape)
    if name.endswith("post_ffw_norm.weight"):
        return rng.uniform(2.0, 4.0, shape)
    if name == "output_norm.weight":
        return rng.uniform(4.0, 6.0, shape)
    if name.endswith("norm.weight"):
        return rng.uniform(0.5, 1.5, shape)
    if name == "token_embd.weight":
        return rng.normal(0.0, hidden ** -0.5, shape)
    return rng.normal(0.0, 1.0 / 16, shape)


def _tensors(cfg: ModelConfig, seed: int):
    """(GGUF name, ggml type, numpy shape, bytes) for every tensor, in llama.cpp's order."""
    rng = np.random.default_rng(seed)
    shapes = cfg.expected_tensor_shapes()
    out = []
    for name, (shape, required) in shapes.items():
        if name == "rope_freqs.weight":
            out.append((name, quants.F32, shape, np.asarray(cfg.rope_freqs(), dtype="<f4")))
            continue
        if not required:
            continue
        values = _draw(name, shape, rng, cfg.hidden_size).astype(np.float32)
        if name == "token_embd.weight":
            # Control / unused / byte tokens get small rows, so the tied head seldom picks them and the
            # demo prints words rather than markers and stray bytes.
            quiet = [i for i in range(FIRST_BYTE_ID + 256) if i != NEWLINE_ID]
            values[quiet] *= 0.25
        ggml_type = output_ggml_type(name, shape, quants.Q8_0)
        out.append((name, ggml_type, shape, quants.quantize(values, ggml_type)))
    return out


def build_demo_gguf(path: str | os.PathLike, seed: int = DEMO_SEED) -> Path:
    """Write the demo GGUF to `path` (via a temporary file and a rename); returns the path."""
    path = Path(path)
    tokenizer = demo_tokenizer()
    cfg = demo_config(tokenizer.vocab_size)
    model_md, model_ty = cfg.to_gguf_metadata()
    tok_md, tok_ty = tokenizer.to_gguf_metadata()
    md = {"general.architecture": model_md.pop("general.architecture"),
          "general.type": "model",
          "general.name": "gemma4-mlx demo (random weights)",
          "general.description": "Random weights: the generated text is meaningless.",
          # Gemma 4's recommended sampling, as converted files carry it (the CLI's defaults).
          "general.sampling.top_k": 64,
          "general.sampling.top_p": 0.95,
          "general.sampling.temp": 1.0,
          "general.file_type": _FILE_TYPE_MOSTLY_Q8_0,
          "general.quantization_version": 2}
    ty = {"general.architecture": model_ty.pop("general.architecture"), "general.type": 8, "general.name": 8,
          "general.description": 8, "general.sampling.top_k": 5, "general.sampling.top_p": 6,
          "general.sampling.temp": 6, "general.file_type": 4, "general.quantization_version": 4}
    md.update(model_md)
    ty.update(model_ty)
    md.update(tok_md)
    ty.update(tok_ty)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        write_gguf(tmp, md, ty, _tensors(cfg, seed))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _version_hash() -> str:
    import tokenizers

    h = hashlib.sha256(f"seed {DEMO_SEED} vocab {DEMO_VOCAB_SIZE} tokenizers {tokenizers.__version__}".encode())
    here = Path(__file__).parent
    for name in _SOURCES:
        p = here / name
        h.update(name.encode() + b"\0" + (p.read_bytes() if p.exists() else b"") + b"\0")
    return h.hexdigest()[:12]


def demo_cache_dir() -> Path:
    """$GEMMA4_MLX_CACHE, else ~/.cache/gemma4_mlx."""
    env = os.environ.get("GEMMA4_MLX_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gemma4_mlx"


def demo_path(cache_dir: str | os.PathLike | None = None, announce: bool = True) -> Path:
    """Path of the demo GGUF, built on first use (and stale demo files of other versions removed)."""
    directory = Path(cache_dir) if cache_dir is not None else demo_cache_dir()
    path = directory / f"demo-{_version_hash()}.gguf"
    if path.is_file():
        return path
    if announce:
        print(f"building the demo model (random weights) in {path} ...", file=sys.stderr, flush=True)
    build_demo_gguf(path)
    for stale in directory.glob("demo-*.gguf"):
        if stale != path and len(stale.stem) == len(path.stem):
            try:
                stale.unlink()
            except OSError:
                pass
    return path
