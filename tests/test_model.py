"""Model-level correctness on the tiny fixtures (dense/K=V, MoE, E-series) against transformers."""

import mlx.core as mx
import numpy as np
import pytest

from fixtures import probe_ids
from gemma4_mlx.cache import cache_length, make_cache, rollback
from gemma4_mlx.checkpoint import load_gguf, load_hf

WINDOW = 16  # fixture sliding window


def rel_err(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def f32_models(gemma4_fixtures):
    cache = {}

    def get(fx):
        if fx.variant not in cache:
            cache[fx.variant] = load_hf(fx.hf_dir, dtype=mx.float32, progress=False)
        return cache[fx.variant]
    return get


def ids_for(fx, n, seed):
    return probe_ids(n, seed=seed, vocab=fx.model_config.vocab_size)[0]


@pytest.mark.parametrize("n", [11, 3 * WINDOW + 5])
def test_full_forward_matches_transformers(any_fixture, f32_models, n):
    model = f32_models(any_fixture)
    ids = ids_for(any_fixture, n, seed=n)
    ref = any_fixture.logits(ids)
    out = np.array(model(mx.array(ids[None])))
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= 1e-5
    assert (out.argmax(-1) == ref.argmax(-1)).all()


def test_incremental_decode_matches_full_forward(any_fixture, f32_models):
    """Token by token through the caches, several wraps of the sliding ring (capacity W + slack)."""
    model = f32_models(any_fixture)
    ids = ids_for(any_fixture, 130, seed=7)
    full = np.array(model(mx.array(ids[None])))
    cache = make_cache(model.cfg)
    ring = next(c for c in cache if c is not None and hasattr(c, "window"))
    steps = []
    for t in range(len(ids)):
        steps.append(np.array(model(mx.array(ids[None, t : t + 1]), cache)))
    assert ring.offset > 2 * ring.capacity  # the ring wrapped more than twice
    assert rel_err(np.concatenate(steps, 1), full) <= 1e-5


def test_chunked_prefill_matches_full_forward(any_fixture, f32_models):
    model = f32_models(any_fixture)
    ids = ids_for(any_fixture, 100, seed=8)
    full = np.array(model(mx.array(ids[None])))
    cache = make_cache(model.cfg)
    chunks = [np.array(model(mx.array(ids[None, a : a + c]), cache))
              for a, c in [(0, 5), (5, 40), (45, 1), (46, 54)]]
    assert rel_err(np.concatenate(chunks, 1), full) <= 1e-5


def test_greedy_continuation_matches_transformers_generate(any_fixture, f32_models):
    import torch

    model = f32_models(any_fixture)
    prompt = ids_for(any_fixture, 20, seed=9)
    torch_model = any_fixture.torch_model()
    with torch.no_grad():
        ref = torch_model.generate(torch.tensor(prompt[None]), max_new_tokens=32, do_sample=False,
                                   min_new_tokens=32).numpy()[0, len(prompt):]
    cache = make_cache(model.cfg)
    logits = model(mx.array(prompt[None]), cache)
    out = []
    for _ in range(32):
        tok = int(mx.argmax(logits[0, -1]))
        out.append(tok)
        logits = model(mx.array([[tok]]), cache)
    assert out == ref.tolist()


def test_rollback_then_redecode_equals_uninterrupted(any_fixture, f32_models):
    model = f32_models(any_fixture)
    ids = ids_for(any_fixture, 70, seed=10)
    cache = make_cache(model.cfg)
    straight = np.array(model(mx.array(ids[None]), cache))
    cache = make_cache(model.cfg)
    model(mx.array(ids[None, :60]), cache)
    detour = probe_ids(8, seed=99, vocab=model.cfg.vocab_size)[0]
    for t in detour:  # speculative tokens that get rejected
        model(mx.array([[int(t)]]), cache)
    rollback(cache, 60)
    assert cache_length(cache) == 60
    resumed = [np.array(model(mx.array(ids[None, t : t + 1]), cache)) for t in range(60, 70)]
    assert rel_err(np.concatenate(resumed, 1), straight[:, 60:]) <= 1e-5


def test_gguf_f32_equals_hf(any_fixture, f32_models):
    model_hf = f32_models(any_fixture)
    model_gguf, _ = load_gguf(any_fixture.gguf("f32"), dtype=mx.float32, progress=False)
    ids = ids_for(any_fixture, 40, seed=11)
    a = np.array(model_hf(mx.array(ids[None])))
    b = np.array(model_gguf(mx.array(ids[None])))
    assert rel_err(a, b) <= 1e-6


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_quantized_gguf_matches_dequantized_float_forward(any_fixture, qtype):
    path = any_fixture.gguf(qtype)
    quantized, _ = load_gguf(path, dtype=mx.float32, progress=False)
    reference, _ = load_gguf(path, dtype=mx.float32, progress=False, keep_quantized=False)
    ids = ids_for(any_fixture, 40, seed=12)
    q = np.array(quantized(mx.array(ids[None])), np.float64)
    r = np.array(reference(mx.array(ids[None])), np.float64)
    nmse = float(((q - r) ** 2).mean() / (r ** 2).mean())
    print(f"{any_fixture.variant} {qtype}: NMSE vs dequantized f32 forward {nmse:.2e}")
    assert (q.argmax(-1) == r.argmax(-1)).all()
    assert nmse < 1e-8


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_raw_block_weights_match_affine_weights(any_fixture, qtype):
    """The GPU weight format (raw GGUF blocks read by custom_kernels, here through the ops'
    references) gives the logits of the CPU format (MLX affine) and of dequantized floats."""
    from gemma4_mlx.quantized import BlockExperts, BlockLinear

    path = any_fixture.gguf(qtype)
    blocks, _ = load_gguf(path, dtype=mx.float32, progress=False, weight_format="blocks")
    affine, _ = load_gguf(path, dtype=mx.float32, progress=False, weight_format="affine")
    assert isinstance(blocks.layers[0].mlp.gate_proj, BlockLinear)
    for layer in blocks.layers:  # one matrix per layer for q|k|v (k|v unless KV-shared) and gate|up
        attn = layer.self_attn
        assert (getattr(attn, "qkv_proj", None) is not None) == (not attn.spec.kv_shared)
        assert layer.mlp.gate_up_proj.intact()
    if any_fixture.variant == "moe":
        assert isinstance(blocks.layers[0].experts, BlockExperts)
    ids = ids_for(any_fixture, 24, seed=15)
    cache_b, cache_a = make_cache(blocks.cfg), make_cache(affine.cfg)
    for chunk in (ids[:16], ids[16:17], ids[17:18]):  # prefill, then two decode steps (M = 1)
        a = np.array(affine(mx.array(chunk[None]), cache_a))
        b = np.array(blocks(mx.array(chunk[None]), cache_b))
        assert rel_err(b, a) <= 1e-5
        assert (a.argmax(-1) == b.argmax(-1)).all()


def test_batch_of_two_decodes_one_token_at_a_time(any_fixture):
    """Two sequences decoded together through the fused raw-block projections (one token's heads
    come from one split along the head axis, strided views for B = 2) give each sequence's own
    logits."""
    path = any_fixture.gguf("q8_0")
    model, _ = load_gguf(path, dtype=mx.float32, progress=False, weight_format="blocks")
    ids = np.stack([ids_for(any_fixture, 12, seed=21), ids_for(any_fixture, 12, seed=22)])
    cache = make_cache(model.cfg)
    model(mx.array(ids[:, :9]), cache)
    steps = [np.array(model(mx.array(ids[:, t : t + 1]), cache)) for t in range(9, 12)]
    for b in range(2):
        alone = np.array(model(mx.array(ids[b : b + 1])))[0, 9:]
        assert rel_err(np.concatenate([s_[b] for s_ in steps]), alone) <= 1e-5


def _moe_family_path_equals_default(moe_fixture, monkeypatch, family: str, op: str, seed: int, calls_per_layer: int,
                                    prepare=None):
    """The MoE fixture's logits (prefill, then two one-token steps) with only `family` on, its op
    (model module name `op`) counted, against the default path's; the number of op calls."""
    import gemma4_mlx.model as model_module

    model, _ = load_gguf(moe_fixture.gguf("q8_0"), dtype=mx.float32, progress=False, weight_format="blocks")
    if prepare:
        prepare(model)
    ids = ids_for(moe_fixture, 14, seed=seed)

    def run():
        cache = make_cache(model.cfg)
        return np.concatenate([np.array(model(mx.array(c[None]), cache)) for c in (ids[:12], ids[12:13], ids[13:])], 1)

    default = run()
    calls = []
    real = getattr(model_module, op)

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(model_module, op, counted)
    monkeypatch.setattr(model_module, "use_kernel", lambda name: name == family)
    assert rel_err(run(), default) <= 1e-6
    moe_layers = sum(layer.spec.moe for layer in model.layers)
    assert len(calls) == 3 * calls_per_layer * moe_layers > 0


def test_moe_layer_with_the_norm_moe_path_equals_the_default(moe_fixture, monkeypatch):
    """Family "norm_moe" restructures a MoE layer (one op for the residual add and the three norms
    of h; the router takes its precomputed input). Here its op runs its MLX reference (CPU), so the
    wiring is checked: the same logits, prefill and one-token steps."""
    _moe_family_path_equals_default(moe_fixture, monkeypatch, "norm_moe", "residual_norm_moe", 23, 1)


def test_moe_layer_with_the_norm_moe_out_path_equals_the_default(moe_fixture, monkeypatch):
    """Family "norm_moe_out" ends a MoE layer with one op (both branch norms, their sum and the
    residual norm step with the layer scalar and the next layer's input norm). Its op runs its MLX
    reference here (CPU), so the wiring is checked: the same logits, prefill and one-token steps."""

    def scalars(model):  # layer scalars other than 1, so a dropped or misplaced one shows
        for layer in model.layers:
            layer.layer_scalar = mx.array([0.5 + 0.1 * layer.spec.index], dtype=mx.float32)

    _moe_family_path_equals_default(moe_fixture, monkeypatch, "norm_moe_out", "residual_norm_moe_out", 29, 1, scalars)


def test_fused_projections_share_one_copy_and_fall_back_when_replaced(any_fixture):
    """fuse_projections: each module's blocks is a view of the fused matrix holding the file's
    bytes; a module whose blocks are replaced afterwards turns the fused path off (same logits)."""
    from gemma4_mlx.gguf import read_gguf
    from gemma4_mlx.weights import hf_to_gguf_name

    path = any_fixture.gguf("q4_0")
    model, _ = load_gguf(path, dtype=mx.float32, progress=False, weight_format="blocks")
    mlp, attn = model.layers[0].mlp, model.layers[0].self_attn
    g = read_gguf(path)
    try:
        want = np.array(g.tensors[hf_to_gguf_name("model.layers.0.mlp.up_proj.weight")].data).reshape(-1)
    finally:
        g.close()
    assert (np.array(mlp.up_proj.blocks).reshape(-1) == want).all()
    assert mlp.gate_up_proj.blocks.shape[0] == mlp.gate_proj.out_dims + mlp.up_proj.out_dims
    ids = mx.array(ids_for(any_fixture, 9, seed=4)[None])
    fused = np.array(model(ids))
    mlp.update({"gate_proj": {"blocks": mx.array(np.array(mlp.gate_proj.blocks))}})
    attn.update({"q_proj": {"blocks": mx.array(np.array(attn.q_proj.blocks))}})
    assert not mlp.gate_up_proj.intact() and not attn.qkv_proj.intact()
    assert rel_err(np.array(model(ids)), fused) <= 1e-5


def test_bf16_argmax_agrees_with_f32(any_fixture, f32_models):
    """bf16 top-1 agreement with f32, judged against transformers' own bf16 run on the same ids.

    These random fixtures are chaotic under bf16 rounding (transformers' bf16 agrees with its f32
    at 90-98% of positions: the MoE router flips experts), so the issue's 99% is asserted only
    where the f32 top-2 margin is clear; overall agreement must be within 3 points of transformers'."""
    import torch

    f32 = f32_models(any_fixture)
    bf16 = load_hf(any_fixture.hf_dir, dtype=mx.bfloat16, progress=False)
    torch_bf16 = any_fixture.torch_model(torch.bfloat16)
    ours, theirs, clear_ours, clear = 0, 0, 0, 0
    total = 0
    for seed in range(4):
        ids = ids_for(any_fixture, 64, seed=100 + seed)
        ref = np.array(f32(mx.array(ids[None])))[0]
        a = ref.argmax(-1)
        b = np.array(bf16(mx.array(ids[None]))).argmax(-1)[0]
        with torch.no_grad():
            c = torch_bf16(torch.tensor(ids[None]), use_cache=False).logits.float().numpy().argmax(-1)[0]
        top2 = np.sort(ref, -1)[:, -2:]
        margin = (top2[:, 1] - top2[:, 0]) > 1.0
        ours += int((a == b).sum())
        theirs += int((a == c).sum())
        clear_ours += int(((a == b) & margin).sum())
        clear += int(margin.sum())
        total += len(a)
    print(f"{any_fixture.variant}: bf16 top-1 agreement ours {ours / total:.3f}, transformers {theirs / total:.3f}, "
          f"on clear-margin positions ours {clear_ours / clear:.3f} ({clear} positions)")
    assert ours / total >= theirs / total - 0.03
    # MoE: a bf16 rounding can flip the router's top-k choice even where the f32 margin is clear
    assert clear_ours / clear >= (0.95 if any_fixture.variant == "moe" else 0.99)


def test_hidden_states_hook(dense_fixture, f32_models):
    model = f32_models(dense_fixture)
    ids = ids_for(dense_fixture, 9, seed=13)
    logits, hidden = model(mx.array(ids[None]), return_hidden_states=True)
    assert len(hidden) == model.cfg.num_hidden_layers + 1
    # the last hidden state through the final norm and head reproduces the logits
    again = model.logits(model.model.norm(hidden[-1]))
    assert np.array_equal(np.array(again), np.array(logits))
    assert np.array_equal(np.array(model(mx.array(ids[None]))), np.array(logits))


_LOGITS_SCRIPT = """
import sys, numpy as np
import gemma4_mlx
import mlx.core as mx
from gemma4_mlx import blas
from gemma4_mlx.checkpoint import load_gguf
model, _ = load_gguf(sys.argv[1], dtype=mx.float32, progress=False)
ids = np.load(sys.argv[2])
np.save(sys.argv[3], np.array(model(mx.array(ids))))
print(blas.active()["verified"])
"""


def test_logits_equal_with_and_without_fast_blas(dense_fixture, tmp_path):
    """The f32 model through the preloaded BLAS equals the reference-BLAS run (Q4_0 prefill path too)."""
    import os
    import subprocess
    import sys

    from gemma4_mlx import blas

    if not blas.active()["verified"]:
        pytest.skip("no fast BLAS installed (CI installs Debian's OpenBLAS)")
    ids = ids_for(dense_fixture, 40, seed=14)[None]
    np.save(tmp_path / "ids.npy", ids)
    outs = {}
    for name, mode in (("fast", None), ("reference", "off")):
        for qtype in ("f32", "q4_0"):
            env = dict(os.environ)
            env.pop("GEMMA4_MLX_BLAS", None)
            if mode:
                env["GEMMA4_MLX_BLAS"] = mode
            out = tmp_path / f"{name}-{qtype}.npy"
            r = subprocess.run([sys.executable, "-c", _LOGITS_SCRIPT, str(dense_fixture.gguf(qtype)),
                                str(tmp_path / "ids.npy"), str(out)], env=env, capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            outs[name, qtype] = (np.load(out), r.stdout.strip())
    assert outs["fast", "f32"][1] == "True"
    assert outs["reference", "f32"][1] == "False"
    for qtype in ("f32", "q4_0"):
        fast, ref = outs["fast", qtype][0], outs["reference", qtype][0]
        assert rel_err(fast, ref) <= 1e-5
        assert (fast.argmax(-1) == ref.argmax(-1)).all()


def test_split_even_values_and_nodes(tmp_path):
    """_split_even gives mx.split's parts, for 42 per-layer inputs through 6 Split nodes and no
    Slice node (MLX turns one split into more than 10 parts into a slice per part)."""
    import re

    from gemma4_mlx.model import _split_even

    for n in (1, 10, 11, 42):
        a = mx.arange(2 * n * 3).reshape(2, n * 3) * 2
        parts = _split_even(a, n)
        assert len(parts) == n
        assert all(np.array_equal(np.array(p), np.array(a)[:, 3 * i : 3 * i + 3]) for i, p in enumerate(parts))
    parts = _split_even(mx.arange(42 * 3) * 2, 42)  # not evaluated: its graph
    mx.export_to_dot(str(tmp_path / "g.dot"), *parts)
    names = re.findall(r'label\s*=\s*"([A-Za-z]+)', (tmp_path / "g.dot").read_text())
    assert names.count("Slice") == 0 and names.count("Split") == 6  # the groups 10, 10, 10, 10, 2, then each group
    with pytest.raises(ValueError, match="equal parts"):
        _split_even(mx.zeros((2, 43)), 42)


def test_moe_layer_with_the_norm_route_path_equals_the_default(moe_fixture, monkeypatch):
    """Family "norm_route" takes a MoE layer's post-attention norms and its route as one op. With
    the op's MLX reference standing in for it (CPU), the logits equal the default path's, prefill
    and one-token steps: the layer hands it the right norms, router weight, scales and top-k, its
    router's counters, and uses its outputs where _moe_inputs' and the router's went."""
    import gemma4_mlx.model as model_module
    from custom_kernels import router as rt

    counters = []

    def stand_in(*args):
        if not model_module.use_kernel("norm_route"):
            return None
        counters.append(args[-1])
        return rt.residual_norm_route_reference(*args[:-1])

    monkeypatch.setattr(model_module, "residual_norm_route", stand_in)
    _moe_family_path_equals_default(moe_fixture, monkeypatch, "norm_route", "residual_norm_route", 31, 1)
    # three runs through every MoE layer, each layer with its router's own counters
    assert counters and len({id(c) for c in counters}) == len(counters) // 3
    assert all(c.dtype == mx.uint32 and c.size == rt.ROUTER_COUNTER_WORDS for c in counters)
