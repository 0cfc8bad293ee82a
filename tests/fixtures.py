"""Tiny random Gemma 4 reference checkpoints (HF directories + GGUFs) and their transformers reference.

Three variants, built with transformers' own classes and weights drawn so that logits are peaked
(docs/fixtures.md), saved as HF directories in the published config layout with the fixture tokenizer
and a generation_config.json, and converted to GGUF lazily by `gemma4_mlx.convert`:

- ``dense``:   6 layers (5 sliding + 1 full), K=V on the full layer, 2 kv heads sliding / 1 global.
- ``moe``:     26B-style: dense MLP + 8 experts (top-2) in every layer, K=V (4 kv heads / 2 global);
               saved in several safetensors shards (with an index) to exercise sharded reading.
- ``eseries``: E2B-style: 10 layers (S,S,S,S,F)x2, per-layer inputs (64), last 5 layers KV-shared,
               double-wide MLP on shared layers; the shared layers' unused k/v/k_norm are stored in
               the safetensors like in the published files.

Common: vocab 1024 (= tokenizer), hidden 256, 8 query heads, head_dim 64 / global 128, window 16,
final_logit_softcapping 30, bf16 safetensors.

Pytest (session-scoped) fixtures:
    gemma4_fixtures                     FixtureStore: .get(variant) -> Gemma4Fixture, .gguf(variant, type)
    dense_fixture / moe_fixture / eseries_fixture   Gemma4Fixture
    any_fixture                         Gemma4Fixture parametrised over the three variants
    fixture_gguf                        factory (variant, type) -> Path of the converted GGUF

Gemma4Fixture: .variant, .hf_dir, .config (config.json dict), .model_config (ModelConfig),
.gguf(type) -> Path, .torch_model(dtype) (cached, eval mode), .logits(ids, dtype) -> numpy [B, T, V],
.hf_tensors() -> {HF name: float32 numpy}. The saved generation_config has do_sample=True: pass
do_sample=False to torch generate() for greedy references.

Cache: $GEMMA4_FIXTURE_DIR/<key> if set (kept across runs), else pytest's tmp dir. <key> hashes this
file, the converter and the modules it uses, and the torch/transformers versions, so stale files are
rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("dense", "moe", "eseries")
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")

_SLIDING, _FULL = "sliding_attention", "full_attention"

_COMMON: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=256,
    head_dim=64,
    global_head_dim=128,
    num_attention_heads=8,
    sliding_window=16,
    final_logit_softcapping=30.0,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=1024,
    bos_token_id=2,
    eos_token_id=[1, 106],
    pad_token_id=0,
)

# Gemma4TextConfig keyword arguments per variant (on top of _COMMON)
VARIANT_CONFIGS: dict[str, dict[str, Any]] = {
    "dense": dict(
        num_hidden_layers=6,
        layer_types=[_SLIDING] * 5 + [_FULL],
        intermediate_size=512,
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
    ),
    "moe": dict(
        num_hidden_layers=6,
        layer_types=[_SLIDING] * 5 + [_FULL],
        intermediate_size=320,
        num_key_value_heads=4,
        num_global_key_value_heads=2,
        attention_k_eq_v=True,
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=96,
    ),
    "eseries": dict(
        num_hidden_layers=10,
        layer_types=([_SLIDING] * 4 + [_FULL]) * 2,
        intermediate_size=384,
        num_key_value_heads=1,
        num_global_key_value_heads=None,
        attention_k_eq_v=False,
        hidden_size_per_layer_input=64,
        num_kv_shared_layers=5,
        use_double_wide_mlp=True,
    ),
}
_SEEDS = {"dense": 1001, "moe": 2002, "eseries": 3003}
_MAX_SHARD = {"moe": "4MB"}  # several shards + model.safetensors.index.json
GENERATION_CONFIG = dict(do_sample=True, temperature=1.0, top_p=0.95, top_k=64)

# discriminativeness floor checked when a fixture is built (docs/fixtures.md: ~5 / ~0.45)
MIN_LOGIT_STD = 2.0
MIN_TOP1_PROB = 0.2

_KEY_SOURCES = ("tests/fixtures.py", "gemma4_mlx/convert.py", "gemma4_mlx/weights.py", "gemma4_mlx/config.py",
                "gemma4_mlx/quants.py", "gemma4_mlx/gguf.py", "gemma4_mlx/tokenizer.py",
                "gemma4_mlx/tokenizer_train.py", "gemma4_mlx/chat_template.jinja")
_MARKER = ".gemma4-fixture-cache"


def cache_key() -> str:
    """Hash of the sources that determine the fixture files (and the torch/transformers versions)."""
    from importlib.metadata import version

    h = hashlib.sha256(f"torch {version('torch')} transformers {version('transformers')}".encode())
    for rel in _KEY_SOURCES:
        p = REPO / rel
        h.update(rel.encode() + b"\0" + (p.read_bytes() if p.exists() else b"<missing>") + b"\0")
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------
# building


def _randomize(model, seed: int) -> None:
    """Draw every parameter and the layer_scalar buffers per docs/fixtures.md, rounded to bf16."""
    import torch

    H = model.config.hidden_size
    g = torch.Generator().manual_seed(seed)

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=g) * (hi - lo) + lo

    def normal(shape, std):
        return torch.randn(shape, generator=g) * std

    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("layer_scalar"))
    with torch.no_grad():
        for name, p in sorted(tensors.items()):
            if name == "lm_head.weight":  # tied to embed_tokens
                continue
            if name.endswith("layer_scalar"):
                v = uniform(p.shape, 0.5, 1.0)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                v = uniform(p.shape, 0.1, 0.3)
            elif name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
                v = uniform(p.shape, 2.0, 4.0)
            elif name == "model.norm.weight":
                v = uniform(p.shape, 4.0, 6.0)
            elif "norm" in name:
                v = uniform(p.shape, 0.5, 1.5)
            elif name.endswith("router.proj.weight"):
                v = normal(p.shape, 2.0)
            elif name.endswith(("router.scale", "router.per_expert_scale")):
                v = uniform(p.shape, 0.5, 1.5)
            elif "embed_tokens" in name:
                v = normal(p.shape, H ** -0.5)
            else:
                v = normal(p.shape, 1.0 / 16)
            p.copy_(v.to(torch.bfloat16).to(p.dtype))


def _published_config(hf_dir: Path, variant: str) -> None:
    """Rewrite transformers' config.json into the published layout: no per_layer_config, top-level
    global_head_dim and num_global_key_value_heads."""
    path = hf_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("per_layer_config", None)
    cfg["global_head_dim"] = _COMMON["global_head_dim"]
    cfg["num_global_key_value_heads"] = VARIANT_CONFIGS[variant]["num_global_key_value_heads"]
    path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")


def _add_unused_shared_kv(hf_dir: Path, model, seed: int) -> None:
    """Store k_proj/v_proj/k_norm for KV-shared layers, as the published E2B/E4B files do
    (transformers builds no such modules and ignores the keys when loading)."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = model.config
    files = sorted(hf_dir.glob("*.safetensors"))
    assert len(files) == 1, "unused-KV injection expects a single-file checkpoint"
    tensors = load_file(files[0])
    g = torch.Generator().manual_seed(seed + 7)
    first_shared = cfg.num_hidden_layers - cfg.num_kv_shared_layers
    for i in range(first_shared, cfg.num_hidden_layers):
        full = cfg.layer_types[i] == _FULL
        d = cfg.per_layer_config[i].head_dim
        kv = cfg.per_layer_config[i].num_key_value_heads
        p = f"model.layers.{i}.self_attn."
        tensors[p + "k_proj.weight"] = (torch.randn(kv * d, cfg.hidden_size, generator=g) / 16).to(torch.bfloat16)
        if not (cfg.attention_k_eq_v and full):
            tensors[p + "v_proj.weight"] = (torch.randn(kv * d, cfg.hidden_size, generator=g) / 16).to(torch.bfloat16)
        tensors[p + "k_norm.weight"] = (torch.rand(d, generator=g) * 0.2 + 0.1).to(torch.bfloat16)
    save_file(tensors, files[0], metadata={"format": "pt"})


def discriminativeness(logits: np.ndarray) -> tuple[float, float]:
    """(mean per-position logit std, mean top-1 probability) of logits [..., V]."""
    x = np.asarray(logits, dtype=np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return float(x.std(-1).mean()), float(p.max(-1).mean())


def probe_ids(n: int = 48, seed: int = 5, vocab: int = 1024) -> np.ndarray:
    """Deterministic token ids [1, n] starting with <bos>, for quick checks."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(108, vocab, size=(1, n))
    ids[0, 0] = 2
    return ids


def build_hf_checkpoint(variant: str, out_dir: Path, tokenizer_dir: Path) -> None:
    """Build, randomise and save one variant (bf16 safetensors, published config layout, tokenizer
    files copied from tokenizer_dir, generation_config.json). Checks the logits are discriminative."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig, GenerationConfig

    kwargs = {**_COMMON, **VARIANT_CONFIGS[variant]}
    config = Gemma4TextConfig(**kwargs)
    torch.manual_seed(_SEEDS[variant])
    model = Gemma4ForCausalLM._from_config(config, attn_implementation="eager",
                                           experts_implementation="eager", dtype=torch.float32)
    _randomize(model, _SEEDS[variant])
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(probe_ids())).logits.numpy()
    std, top1 = discriminativeness(logits)
    if std < MIN_LOGIT_STD or top1 < MIN_TOP1_PROB:
        raise AssertionError(f"fixture {variant}: logits not discriminative (std {std:.2f}, top-1 {top1:.2f})")

    out_dir.mkdir(parents=True)
    model.to(torch.bfloat16).save_pretrained(out_dir, max_shard_size=_MAX_SHARD.get(variant, "1GB"))
    _published_config(out_dir, variant)
    if config.num_kv_shared_layers:
        _add_unused_shared_kv(out_dir, model, _SEEDS[variant])
    gen = GenerationConfig(bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0, **GENERATION_CONFIG)
    gen.save_pretrained(out_dir)
    for f in tokenizer_dir.iterdir():
        shutil.copy2(f, out_dir / f.name)


def build_tokenizer_dir(out_dir: Path) -> None:
    """The fixture tokenizer (vocab 1024, trained on the package's default text) as HF files, with the
    package's built-in chat template."""
    from gemma4_mlx.tokenizer import builtin_chat_template
    from gemma4_mlx.tokenizer_train import DEFAULT_TRAINING_TEXT, build_gemma4_tokenizer, save_hf_tokenizer

    tok = build_gemma4_tokenizer(DEFAULT_TRAINING_TEXT, vocab_size=_COMMON["vocab_size"])
    if tok.get_vocab_size() != _COMMON["vocab_size"]:
        raise AssertionError(f"fixture tokenizer has {tok.get_vocab_size()} tokens, expected {_COMMON['vocab_size']}")
    out_dir.mkdir(parents=True)
    save_hf_tokenizer(tok, out_dir, chat_template=builtin_chat_template())


# ------------------------------------------------------------------------------------------
# the store


def _atomic_build(target: Path, build) -> Path:
    """Run build(tmp_dir) and rename tmp_dir to target; a concurrent builder's result wins."""
    if target.exists():
        return target
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


class Gemma4Fixture:
    """One variant: its HF directory, lazily converted GGUFs and the transformers reference."""

    def __init__(self, store: "FixtureStore", variant: str, hf_dir: Path):
        self.store = store
        self.variant = variant
        self.hf_dir = hf_dir
        self.config: dict[str, Any] = json.loads((hf_dir / "config.json").read_text())
        self._models: dict[Any, Any] = {}
        self._hf_tensors: dict[str, np.ndarray] | None = None
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"Gemma4Fixture({self.variant!r}, {self.hf_dir})"

    @property
    def model_config(self):
        from gemma4_mlx.config import ModelConfig

        return ModelConfig.from_hf(self.config)

    def gguf(self, out_type: str = "f32") -> Path:
        """Path of this variant converted to `out_type` (one of GGUF_TYPES); converted on first use."""
        return self.store.gguf(self.variant, out_type)

    def hf_tensors(self) -> dict[str, np.ndarray]:
        """Every tensor of the saved checkpoint as float32 numpy, HF names (read with safetensors.torch);
        cached, do not modify."""
        from safetensors.torch import load_file

        with self._lock:
            if self._hf_tensors is None:
                out = {}
                for f in sorted(self.hf_dir.glob("*.safetensors")):
                    out.update({k: v.float().numpy() for k, v in load_file(f).items()})
                for v in out.values():
                    v.flags.writeable = False
                self._hf_tensors = out
            return self._hf_tensors

    def torch_model(self, dtype=None):
        """Gemma4ForCausalLM loaded from hf_dir in `dtype` (default torch.float32), eager attention and
        experts, eval mode; cached for the session. Do not modify it."""
        import torch
        from transformers import Gemma4ForCausalLM

        dtype = dtype or torch.float32
        with self._lock:
            if dtype not in self._models:
                model = Gemma4ForCausalLM.from_pretrained(self.hf_dir, dtype=dtype, attn_implementation="eager",
                                                          experts_implementation="eager")
                self._models[dtype] = model.eval()
            return self._models[dtype]

    def logits(self, token_ids, dtype=None) -> np.ndarray:
        """transformers logits (after softcapping) for token ids [T] or [B, T] -> numpy [B, T, V] in the
        model dtype (float32 by default; torch.float64 for the gold)."""
        import torch

        model = self.torch_model(dtype)
        ids = torch.as_tensor(np.asarray(token_ids), dtype=torch.long)
        if ids.ndim == 1:
            ids = ids[None]
        with torch.no_grad():
            return model(ids, use_cache=False).logits.numpy()


class FixtureStore:
    """All fixture variants under one cache directory (root/<variant>/hf, root/<variant>/<type>.gguf)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / _MARKER).touch()
        self._fixtures: dict[str, Gemma4Fixture] = {}
        self._lock = threading.RLock()

    def tokenizer_dir(self) -> Path:
        return _atomic_build(self.root / "tokenizer", build_tokenizer_dir)

    def get(self, variant: str) -> Gemma4Fixture:
        if variant not in VARIANTS:
            raise KeyError(f"unknown fixture variant {variant!r}; known: {', '.join(VARIANTS)}")
        with self._lock:
            if variant not in self._fixtures:
                tok_dir = self.tokenizer_dir()
                (self.root / variant).mkdir(exist_ok=True)
                hf_dir = _atomic_build(self.root / variant / "hf",
                                       lambda tmp: build_hf_checkpoint(variant, tmp, tok_dir))
                self._fixtures[variant] = Gemma4Fixture(self, variant, hf_dir)
            return self._fixtures[variant]

    def gguf(self, variant: str, out_type: str = "f32") -> Path:
        """The variant converted to out_type by gemma4_mlx.convert (cached on disk)."""
        from gemma4_mlx.convert import convert

        if out_type not in GGUF_TYPES:
            raise KeyError(f"unknown GGUF type {out_type!r}; known: {', '.join(GGUF_TYPES)}")
        fx = self.get(variant)
        path = self.root / variant / f"{variant}-{out_type}.gguf"
        with self._lock:
            if not path.exists():
                convert(fx.hf_dir, path, out_type, progress=False)
        return path


_STORES: dict[Path, FixtureStore] = {}


def fixture_store(root: Path | None = None) -> FixtureStore:
    """The process-wide store for `root` (default: $GEMMA4_FIXTURE_DIR/<cache_key()>); usable outside
    pytest, e.g. from benchmarks."""
    if root is None:
        env = os.environ.get("GEMMA4_FIXTURE_DIR")
        if not env:
            raise RuntimeError("fixture_store() without a root needs GEMMA4_FIXTURE_DIR")
        root = Path(env) / cache_key()
    root = Path(root).resolve()
    if root not in _STORES:
        _prune_stale(root)
        _STORES[root] = FixtureStore(root)
    return _STORES[root]


def _prune_stale(root: Path) -> None:
    """Remove sibling cache directories of other keys (only ones carrying our marker file)."""
    parent = root.parent
    if not parent.is_dir():
        return
    for d in parent.iterdir():
        if d != root and d.is_dir() and len(d.name) == 16 and (d / _MARKER).exists():
            shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------------------
# pytest fixtures


@pytest.fixture(scope="session")
def gemma4_fixtures(tmp_path_factory) -> FixtureStore:
    """The session's FixtureStore (persistent under $GEMMA4_FIXTURE_DIR when set)."""
    if os.environ.get("GEMMA4_FIXTURE_DIR"):
        return fixture_store()
    return fixture_store(tmp_path_factory.getbasetemp() / "gemma4-fixtures" / cache_key())


@pytest.fixture(scope="session")
def dense_fixture(gemma4_fixtures) -> Gemma4Fixture:
    return gemma4_fixtures.get("dense")


@pytest.fixture(scope="session")
def moe_fixture(gemma4_fixtures) -> Gemma4Fixture:
    return gemma4_fixtures.get("moe")


@pytest.fixture(scope="session")
def eseries_fixture(gemma4_fixtures) -> Gemma4Fixture:
    return gemma4_fixtures.get("eseries")


@pytest.fixture(scope="session", params=VARIANTS)
def any_fixture(request, gemma4_fixtures) -> Gemma4Fixture:
    """Each variant in turn."""
    return gemma4_fixtures.get(request.param)


@pytest.fixture(scope="session")
def fixture_gguf(gemma4_fixtures):
    """Factory: fixture_gguf(variant, out_type="f32") -> Path of the converted GGUF."""
    return gemma4_fixtures.gguf


__all__ = [
    "VARIANTS", "GGUF_TYPES", "VARIANT_CONFIGS", "GENERATION_CONFIG", "Gemma4Fixture", "FixtureStore",
    "fixture_store", "cache_key", "discriminativeness", "probe_ids",
    "gemma4_fixtures", "dense_fixture", "moe_fixture", "eseries_fixture", "any_fixture", "fixture_gguf",
]


def export_ggufs(out_dir: Path, types: tuple[str, ...] = ("q4_0", "q8_0")) -> list[Path]:
    """Copy every variant's GGUF of `types` to out_dir as <variant>-<type>.gguf: what
    tests/test_model_gpu.py reads from $GEMMA4_FIXTURE_GGUFS on a machine without torch (the H200).
    Fixtures are built under $GEMMA4_FIXTURE_DIR, else ~/.cache/gemma4_mlx/fixtures."""
    import shutil

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if os.environ.get("GEMMA4_FIXTURE_DIR"):
        store = fixture_store()
    else:
        store = fixture_store(Path.home() / ".cache" / "gemma4_mlx" / "fixtures" / cache_key())
    paths = []
    for variant in VARIANTS:
        for t in types:
            dst = out_dir / f"{variant}-{t}.gguf"
            shutil.copyfile(store.gguf(variant, t), dst)
            paths.append(dst)
    return paths


if __name__ == "__main__":  # python3 tests/fixtures.py .gpufix
    import sys

    import gemma4_mlx  # noqa: F401  (the BLAS preload before mlx.core)

    for p in export_ggufs(Path(sys.argv[1] if len(sys.argv) > 1 else ".gpufix")):
        print(p)
