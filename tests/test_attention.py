"""custom_kernels.attention on CPU: the pure-MLX reference against a float64 oracle, the model's own
attention (mx.fast.scaled_dot_product_attention with TextModel's mask) on cache-shaped inputs and
inside a model forward, and the launch planning. The kernels themselves run in
tests/test_metal_kernels_emulated.py (Metal text on the CPU emulator), tests/test_metal_compile.py
(Metal + CUDA text compiled) and tests/test_attention_gpu.py (-m gpu)."""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest

import custom_kernels
from custom_kernels import attention as at
from custom_kernels.registry import all_kernel_specs
from gemma4_mlx.cache import KVCache, RotatingKVCache, make_cache
from gemma4_mlx.config import FULL, SLIDING, ModelConfig
from gemma4_mlx.model import Model

F32_LIMIT = 1e-5  # |error| / bound for f32 (bound: see at.attention_f64)
BF16_LIMIT = 2**-8 + F32_LIMIT  # bf16 output rounding (unit roundoff 2^-8) on top


def _arr(x: np.ndarray, dtype) -> tuple[mx.array, np.ndarray]:
    """(MLX array in dtype, its exact values in float64)."""
    a = mx.array(x.astype(np.float32)).astype(dtype)
    return a, np.array(a.astype(mx.float32)).astype(np.float64)


def _ring_positions(capacity: int, last: int, empty=()) -> np.ndarray:
    """Ring after writing positions 0..last: slot p % capacity holds its latest p; then ``empty``."""
    pos = np.full(capacity, -1, np.int32)
    for p in range(last + 1):
        pos[p % capacity] = p
    pos[list(empty)] = -1
    return pos


def _problem(rng, B, n_q, n_kv, M, D, positions, q_positions, window, dtype=mx.float32, garbage=1e4):
    """Random q / caches; slots nobody may attend hold large finite garbage (must not leak in)."""
    S = len(positions)
    scale = 1.5 * D**-0.25  # scores ~ N(0, 2.25)
    q, q64 = _arr(rng.standard_normal((B, n_q, M, D)) * scale, dtype)
    k_np = rng.standard_normal((B, n_kv, S, D)) * scale
    v_np = rng.standard_normal((B, n_kv, S, D))
    used = at._mask_np(np.asarray(q_positions), np.asarray(positions), window).any(axis=0)
    k_np[:, :, ~used] = garbage
    v_np[:, :, ~used] = -garbage
    k, k64 = _arr(k_np, dtype)
    v, v64 = _arr(v_np, dtype)
    pos = mx.array(np.asarray(positions, np.int32))
    qpos = mx.array(np.asarray(q_positions, np.int32))
    want, bound = at.attention_f64(q64, k64, v64, np.asarray(positions), np.asarray(q_positions), window)
    return (q, k, v, pos, qpos), want, bound


def _rel_error(out: mx.array, want: np.ndarray, bound: np.ndarray) -> float:
    got = np.array(out.astype(mx.float32)).astype(np.float64)
    assert np.isfinite(got).all()
    return float((np.abs(got - want) / np.maximum(bound, 1e-30)).max())


# (D, G, M, layout): every GQA ratio at both head dims, M = 1..8, ring and preallocated full caches
CASES = [
    (256, 2, 1, "ring"), (256, 4, 3, "ring"), (256, 8, 8, "ring"), (256, 16, 2, "ring"),
    (512, 2, 5, "full"), (512, 4, 1, "full"), (512, 8, 4, "full"), (512, 16, 7, "full"),
    (512, 8, 6, "ring"), (256, 2, 8, "full"),
]  # fmt: skip


def _layout(rng, layout: str, M: int):
    """(positions, q_positions, window): a wrapped ring with empty slots (slots out of order) or a
    full cache of capacity 96 holding 0..len-1, queries ending at the newest position."""
    if layout == "ring":
        window, capacity, last = 11, 14, 40 + int(rng.integers(0, 14))
        pos = _ring_positions(capacity, last, empty=(int(rng.integers(0, capacity)),))
        return pos, np.arange(last - M + 1, last + 1), window
    length = 37 + M
    pos = np.where(np.arange(96) < length, np.arange(96), -1).astype(np.int32)
    return pos, np.arange(length - M, length), None


@pytest.mark.parametrize("D, G, M, layout", CASES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_reference_matches_f64_oracle(D, G, M, layout, dtype):
    rng = np.random.default_rng(D + 31 * G + 7 * M)
    pos, qpos, window = _layout(rng, layout, M)
    args, want, bound = _problem(rng, 2, 2 * G, 2, M, D, pos, qpos, window, dtype)
    out = at.decode_attention_reference(*args, window)
    assert out.shape == (2, 2 * G, M, D) and out.dtype == dtype
    assert _rel_error(out, want, bound) <= (F32_LIMIT if dtype == mx.float32 else BF16_LIMIT)


def test_attend_mask_causal_and_window_edges():
    """A sliding query sees exactly W keys including itself; causal inside a chunk of M rows; -1 and
    future positions never."""
    W, cap = 8, 11
    pos = _ring_positions(cap, 30)  # full ring holding 20..30, out of order
    mask = np.array(at.attend_mask(mx.array([30]), mx.array(pos), W))
    assert mask.sum() == W and set(pos[mask[0]]) == set(range(23, 31))
    qpos = np.arange(25, 31)  # a chunk of 6 rows
    mask = np.array(at.attend_mask(mx.array(qpos), mx.array(pos), W))
    for row, p in zip(mask, qpos):
        assert set(pos[row]) == set(range(max(20, p - W + 1), p + 1))
    pos[3] = -1
    pos[4] = 99  # a rolled-back slot
    full = np.array(at.attend_mask(mx.array([30]), mx.array(pos), None))[0]
    assert not full[3] and not full[4] and full.sum() == cap - 2


def test_window_edge_key_does_not_leak():
    """The key at p - W (one past the window) holds a huge value; the output matches the oracle."""
    rng = np.random.default_rng(3)
    W = 6
    pos = _ring_positions(W + 1, 20)  # ring of W + 1 slots: one slot is just outside the window
    args, want, bound = _problem(rng, 1, 4, 2, 1, 256, pos, [20], W, garbage=0.0)
    q, k, v, p, qp = args
    edge = int(np.flatnonzero(pos == 20 - W)[0])
    v = mx.array(np.array(v)).at[:, :, edge].add(1e6)
    assert _rel_error(at.decode_attention_reference(q, k, v, p, qp, W), want, bound) <= F32_LIMIT
    wider = at.decode_attention_reference(q, k, v, p, qp, W + 1)  # the same key inside: it shows
    assert float(mx.abs(wider).max()) > 1e3


def test_slot_order_does_not_matter():
    """Permuting ring slots (K, V and positions together) gives the same result."""
    rng = np.random.default_rng(4)
    pos = _ring_positions(16, 50, empty=(2, 9))
    (q, k, v, p, qp), _, _ = _problem(rng, 1, 8, 2, 3, 256, pos, [48, 49, 50], 12)
    perm = mx.array(rng.permutation(16))
    a = at.decode_attention_reference(q, k, v, p, qp, 12)
    b = at.decode_attention_reference(q, k[:, :, perm], v[:, :, perm], p[perm], qp, 12)
    assert mx.allclose(a, b, rtol=1e-6, atol=1e-6).item()


def test_row_without_keys_is_zero():
    rng = np.random.default_rng(5)
    pos = _ring_positions(8, 10)  # positions 3..10
    args, want, _ = _problem(rng, 1, 2, 1, 2, 128, pos, [10, 40], 4)  # row at 40 sees nothing
    out = np.array(at.decode_attention_reference(*args, 4))
    assert np.all(out[:, :, 1] == 0) and np.all(want[:, :, 1] == 0) and np.abs(out[:, :, 0]).max() > 0


def test_dispatch_is_reference_on_cpu(monkeypatch):
    rng = np.random.default_rng(6)
    pos, qpos, window = _layout(rng, "ring", 2)
    args, _, _ = _problem(rng, 1, 4, 2, 2, 256, pos, qpos, window, mx.bfloat16)
    ref = at.decode_attention_reference(*args, window)
    if custom_kernels.backend() == "cpu":
        assert mx.array_equal(at.decode_attention(*args, window, n_slots=5), ref).item()
    monkeypatch.setenv(custom_kernels.KERNELS_ENV, "reference")
    assert mx.array_equal(at.decode_attention(*args, window), ref).item()
    with pytest.raises(ValueError):
        at.decode_attention(args[0], args[1], args[2], args[3][:-1], args[4], window)


# ----------------------------------------------------------------------------------------------
# Against the model's attention
# ----------------------------------------------------------------------------------------------


def _model_mask(q_pos: mx.array, k_pos: mx.array, spec_window: int | None) -> mx.array:
    """The mask of TextModel.mask_fn (gemma4_mlx/model.py), as the model builds it."""
    diff = q_pos[:, None] - k_pos[None, :]
    ok = (k_pos[None, :] >= 0) & (diff >= 0)
    if spec_window is not None:
        ok = ok & (diff < spec_window)
    return ok


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_matches_model_sdpa_on_cache_shaped_inputs(dtype):
    """The model's caches fed chunk by chunk (ring wraps, T > 1 chunks with the ring concatenated,
    a full cache growing in steps): SDPA with the model's mask vs the reference on what update()
    returns. bf16: SDPA rounds scores and probabilities to bf16 (measured up to 0.023 apart), so
    there the reference is held to the f64 oracle and SDPA only to 0.05."""
    rng = np.random.default_rng(7)
    B, n_kv, G = 1, 2, 4
    for cache, D, window in ((RotatingKVCache(6, slack=3), 256, 6), (KVCache(step=16), 512, None)):
        offset = 0
        for T in (5, 1, 1, 3, 1, 1, 1, 8, 1, 2, 1):
            k = mx.array(rng.standard_normal((B, n_kv, T, D)).astype(np.float32) * D**-0.25).astype(dtype)
            v = mx.array(rng.standard_normal((B, n_kv, T, D)).astype(np.float32)).astype(dtype)
            q = mx.array(rng.standard_normal((B, G * n_kv, T, D)).astype(np.float32) * 2 * D**-0.25).astype(dtype)
            keys, values, positions = cache.update(k, v)
            q_pos = mx.arange(offset, offset + T, dtype=mx.int32)
            offset += T
            mask = _model_mask(q_pos, positions, window)
            assert mx.array_equal(mask, at.attend_mask(q_pos, positions, window)).item()
            want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0, mask=mask)
            got = at.decode_attention_reference(q, keys, values, positions, q_pos, window)
            assert got.dtype == want.dtype == dtype
            diff = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
            assert diff <= (1e-5 if dtype == mx.float32 else 5e-2), (type(cache).__name__, T, diff)
            exact, bound = at.attention_f64(*(np.array(a.astype(mx.float32)).astype(np.float64)
                                              for a in (q, keys, values)), np.array(positions), np.array(q_pos),
                                            window)  # fmt: skip
            assert _rel_error(got, exact, bound) <= (F32_LIMIT if dtype == mx.float32 else BF16_LIMIT)


class _RecordingCache:
    """Wraps a model cache and records the positions its update() returns (nothing else changes)."""

    def __init__(self, cache, index: int, log: dict):
        self._cache, self._index, self._log = cache, index, log

    def update(self, keys, values):
        k, v, positions = self._cache.update(keys, values)
        self._log[self._index] = positions
        return k, v, positions

    def __getattr__(self, name):
        return getattr(self._cache, name)


def _tiny_config() -> ModelConfig:
    """5 layers (S, S, F, S, F), the last two KV-shared; GQA 4 on sliding and 8 on full layers."""
    return ModelConfig(hidden_size=64, num_hidden_layers=5, intermediate_size=96, num_attention_heads=8,
                       num_key_value_heads=2, layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL], vocab_size=101,
                       head_dim=32, global_head_dim=64, num_global_key_value_heads=1, attention_k_eq_v=True,
                       sliding_window=4, num_kv_shared_layers=2, max_position_embeddings=256)  # fmt: skip


def test_plugged_into_model_reproduces_logits(monkeypatch):
    """Every attention call of a model forward (prefill chunk, then decode steps past the window with
    a wrapping ring, KV-shared layers) computed by decode_attention from the cache's positions gives
    the logits of the unmodified model. Nothing in the model is patched: its caches are wrapped to
    record positions and mx.fast.scaled_dot_product_attention is swapped for the duration."""
    cfg = _tiny_config()
    mx.random.seed(8)
    model = Model(cfg)
    model.eval()
    rng = np.random.default_rng(8)
    tokens = rng.integers(0, cfg.vocab_size, size=(1, 18)).astype(np.int32)
    chunks = [tokens[:, :6]] + [tokens[:, i : i + 1] for i in range(6, 18)]

    reference_cache = make_cache(cfg, rollback_slack=1)
    reference_logits = [model(mx.array(c), reference_cache) for c in chunks]
    mx.eval(reference_logits)

    sdpa = mx.fast.scaled_dot_product_attention
    positions_log: dict[int, mx.array] = {}
    state = {"layer": 0, "offset": 0, "calls": 0, "worst": 0.0}

    def attention(q, k, v, *, scale, mask=None, **kwargs):
        spec = cfg.layers[state["layer"]]
        state["layer"] += 1
        positions = positions_log[spec.kv_producer if spec.kv_shared else spec.index]
        q_pos = mx.arange(state["offset"], state["offset"] + q.shape[2], dtype=mx.int32)
        assert scale == 1.0 and mx.array_equal(mask, at.attend_mask(q_pos, positions, spec.sliding_window)).item()
        out = at.decode_attention(q, k, v, positions, q_pos, spec.sliding_window)
        state["worst"] = max(state["worst"], float(mx.abs(out - sdpa(q, k, v, scale=scale, mask=mask)).max()))
        state["calls"] += 1
        return out

    caches = [c if c is None else _RecordingCache(c, i, positions_log)
              for i, c in enumerate(make_cache(cfg, rollback_slack=1))]  # fmt: skip
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", attention)
    for chunk, want in zip(chunks, reference_logits):
        state["layer"] = 0
        got = model(mx.array(chunk), caches)
        state["offset"] += chunk.shape[1]
        assert float(mx.abs(got - want).max()) <= 1e-4 * max(1.0, float(mx.abs(want).max()))
    assert state["calls"] == len(chunks) * cfg.num_hidden_layers
    assert state["worst"] <= 1e-5


# ----------------------------------------------------------------------------------------------
# Kernel-side logic checkable on CPU: partitions, plans, the oracle of the emulator cases
# ----------------------------------------------------------------------------------------------


def test_valid_slot_bound_forms():
    """n_slots as None, a Python/numpy int, a 0-d array (a static cache's length) or [1]: int32 [1]
    clipped to [0, S]; Python ints through a Full node (made on the device, not a host constant)."""
    for given, want in ((None, 40), (7, 7), (np.int64(99), 40), (-3, 0), (mx.array(12, dtype=mx.int32), 12),
                        (mx.array([50]), 40), (mx.array([-1]), 0)):  # fmt: skip
        got = at._slots_array(given, 40)
        assert got.dtype == mx.int32 and got.shape == (1,) and got.item() == want
    for given in (None, 7):  # a node, evaluated where the kernels run: no array the host wrote
        dot = io.StringIO()
        mx.export_to_dot(dot, at._slots_array(given, 40))
        assert "Full" in dot.getvalue()


def test_partition_layout_covers_valid_slots():
    for n in (0, 1, 7, 31, 32, 33, 255, 256, 257, 1000, 4097, 262144):
        for parts in (1, 2, 3, 16, 128, 1024):
            for cmin, tile in ((8, 8), (256, 32), (64, 32)):
                chunk, active = at.partition_layout(n, parts, cmin, tile)
                assert chunk % tile == 0 and chunk >= cmin and active <= parts
                assert active * chunk >= n and (active == 0 or (active - 1) * chunk < n)


@pytest.mark.parametrize("which", ["cuda", "metal"])
def test_plans_for_gemma4_shapes(which):
    """Every Gemma 4 layer shape (D, G) at M = 1..8 plans within the backend's threadgroup memory;
    partitions grow with the capacity and never drop below min_chunk slots."""
    for D, G, n_kv in ((256, 2, 16), (512, 8, 4), (512, 16, 1), (256, 8, 1), (256, 4, 2), (512, 4, 2)):
        for M in range(1, 9):
            for S in (1056, 4096, 262144):
                plan = at.plan_decode(1, G * n_kv, n_kv, M, S, D, "bfloat16", "bfloat16", None, None, which)
                cfg = at.default_config(D, which)
                qt = dict(plan.partial_template)["QT"]
                assert plan.shared_bytes <= {"cuda": 48 * 1024, "metal": 32 * 1024}[which]
                assert qt * plan.partial_grid[2] >= G * M and plan.partial_grid[0] == 128 * n_kv
                cap = max(cfg.max_parts, -(-cfg.min_groups // n_kv))
                assert 1 <= plan.parts <= min(-(-S // cfg.min_chunk), cap)
                assert plan.merge_grid[0] == D // 4 * n_kv * G * M
    assert at.plan_decode(1, 32, 4, 1, 262144, 512, "bfloat16", "bfloat16", None, None, "cuda").parts == 512


def test_cuda_partitions_fill_the_gpu_and_stay_bounded():
    """CUDA plans (31B shapes): a sliding ring of 1056 slots splits into 33 one-tile partitions
    (528 threadgroups over 16 kv heads); full layers take one-tile partitions up to 512 of them, and
    longer caches longer partitions instead of more."""
    sliding = at.plan_decode(1, 32, 16, 1, 1056, 256, "bfloat16", "bfloat16", 1024, None, "cuda")
    assert sliding.parts == 33 and sliding.partial_grid[0] // 128 * sliding.parts == 528
    for slots, parts in ((1024, 32), (4352, 136), (33024, 512), (262144, 512)):
        assert at.plan_decode(1, 32, 4, 1, slots, 512, "bfloat16", "bfloat16", None, None, "cuda").parts == parts
    assert at.partition_layout(32800, 512, 32, 32) == (96, 342)
    with pytest.raises(ValueError, match="max_parts"):
        at.AttentionConfig(max_parts=0)
    with pytest.raises(ValueError, match="min_groups"):
        at.AttentionConfig(min_groups=-1)


def test_cuda_one_kv_head_keeps_min_groups():
    """12B's full layers (16 query heads on one K/V head, D 512): max_parts is lifted to 1024
    partitions so the grid keeps 1024 threadgroups at long contexts; short caches and layers with
    more K/V heads (31B: 4, E4B / 26B-A4B: 2) plan as before; batch 2 or two query tiles (M = 2)
    halve the partitions."""
    def parts(batch, n_q, n_kv, slots):
        return at.plan_decode(batch, n_q, n_kv, 1, slots, 512, "bfloat16", "bfloat16", None, None, "cuda").parts

    assert [parts(1, 16, 1, s) for s in (4096, 16384, 32768, 131072)] == [128, 512, 1024, 1024]
    assert parts(2, 16, 1, 131072) == 512 and parts(1, 32, 4, 131072) == 512 and parts(1, 8, 2, 131072) == 512
    two_rows = at.plan_decode(1, 16, 1, 2, 131072, 512, "bfloat16", "bfloat16", None, None, "cuda")
    assert two_rows.parts == 512 and two_rows.parts * two_rows.partial_grid[2] == 1024  # 2 query tiles
    assert at.plan_decode(1, 16, 1, 1, 131072, 512, "bfloat16", "bfloat16", None,
                          at.AttentionConfig(**{**at.default_config(512, "cuda").__dict__, "min_groups": 0}),
                          "cuda").parts == 512  # fmt: skip


def test_partials_oracle_merges_to_attention():
    """The float64 per-partition states (the partial kernel's expected outputs) merged as the merge
    kernel does reproduce the attention oracle, idle partitions included."""
    rng = np.random.default_rng(9)
    pos = _ring_positions(40, 90, empty=(1, 17))
    (q, k, v, p, qp), want, _ = _problem(rng, 2, 8, 2, 3, 128, pos, [88, 89, 90], 25, garbage=0.0)
    q64, k64, v64 = (np.array(a).astype(np.float64) for a in (q, k, v))
    for parts, n_slots in ((3, 40), (5, 40), (8, 40)):
        ml, acc = at.partials_f64(q64, k64, v64, pos, np.array([88, 89, 90]), 25, n_slots, parts, 8, 8)
        _, active = at.partition_layout(n_slots, parts, 8, 8)
        assert np.isnan(ml[:, active:]).all() and not np.isnan(ml[:, :active]).any()
        merged = at.merge_f64(ml, acc, n_slots, 8, 8).reshape(want.shape)
        assert np.allclose(merged, want, rtol=1e-12, atol=1e-12)


def test_kernels_registered_for_emulator_and_compile_tests():
    specs = {s.name: s for s in all_kernel_specs()}
    for name in ("g4_attn_decode_partial", "g4_attn_decode_merge"):
        spec = specs[name]
        assert spec.metal_source and spec.cuda_source and spec.cases(np.random.default_rng(0))
        assert "exp(" not in spec.metal_source.replace("g4_attn_exp(", "")  # the shim has no exp


def test_geometry_override(monkeypatch):
    """GEMMA4_MLX_ATTENTION_GEOMETRY replaces default_config's fields; bad text fails clearly."""
    base = at.default_config(256, "cuda")
    monkeypatch.setenv(at.GEOMETRY_ENV, "min_chunk=64, tile=16,target_groups=2048")
    cfg = at.default_config(256, "cuda")
    assert (cfg.min_chunk, cfg.tile, cfg.target_groups) == (64, 16, 2048)
    assert (cfg.rows, cfg.simd_groups) == (base.rows, base.simd_groups)
    for bad, match in (("chunk=64", "NAME=INTEGER"), ("min_chunk=x", "NAME=INTEGER"),
                       ("simd_groups=3", "simd_groups must be"), ("min_chunk=40", "multiple of tile")):
        monkeypatch.setenv(at.GEOMETRY_ENV, bad)
        with pytest.raises(ValueError, match=match):
            at.default_config(256, "cuda")


@pytest.mark.parametrize("M", [1, 3])
def test_merged_output(monkeypatch, M):
    """merged=True gives [B, M, n_q * D], each row's heads side by side: the reference path and the
    kernels' dispatch (Metal text on the emulator; at M = 1 the merge kernel writes that shape
    itself) agree with the plain output's transpose."""
    from pathlib import Path

    rng = np.random.default_rng(12 + M)
    pos, qpos, window = _layout(rng, "ring", M)
    args, want, bound = _problem(rng, 2, 4, 2, M, 128, pos, qpos, window)
    plain = at.decode_attention(*args, window)
    merged = at.decode_attention(*args, window, merged=True)
    assert merged.shape == (2, M, 4 * 128)
    assert mx.array_equal(merged, plain.transpose(0, 2, 1, 3).reshape(2, M, -1)).item()
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))  # tests/metal_emulator
    from metal_emulator import metal_kernel

    def as_mlx(*a, **kw):  # the emulator returns numpy arrays
        kernel = metal_kernel(*a, **kw)
        return lambda **call: [mx.array(o) for o in kernel(**call)]

    monkeypatch.setattr(custom_kernels, "backend", lambda: "metal")
    monkeypatch.setattr(mx.fast, "metal_kernel", as_mlx)
    custom_kernels.clear_kernel_cache()
    try:
        got = at.decode_attention(*args, window, merged=True)
        mx.eval(got)
    finally:
        custom_kernels.clear_kernel_cache()
    assert got.shape == (2, M, 4 * 128)
    got_heads = got.reshape(2, M, 4, 128).transpose(0, 2, 1, 3)
    assert _rel_error(got_heads, want, bound) <= F32_LIMIT


def test_fused_launch_rule(monkeypatch):
    """The one-launch kernel (family "attention_fused") takes a call where its merge is small:
    every Gemma 4 sliding ring at M = 1 (decode), not at M > 1 (more query rows per tile), nor the
    31B / 26B-A4B / 12B full layers at 4K (one threadgroup would read their 2-4 MB of partition state
    alone); never on a CPU or Metal build."""
    rings = ((256, 2, 16, 1024), (256, 4, 2, 512), (256, 2, 8, 1024))  # (D, G, n_kv, window)
    fulls = ((512, 8, 4), (512, 16, 1), (512, 8, 2))  # (D, G, n_kv)

    def plan(D, G, n_kv, M, S, window):
        return at.plan_decode(1, G * n_kv, n_kv, M, S, D, "bfloat16", "bfloat16", window, None, "cuda")

    monkeypatch.setattr(at, "backend", lambda: "cuda")
    for D, G, n_kv, window in rings:
        for M in range(1, 9):
            p = plan(D, G, n_kv, M, window + 32, window)
            assert p.merge_bytes == 4 * p.parts * dict(p.partial_template)["QT"] * D
            assert at.fused_supported(p) == (M == 1)  # more rows per query tile: a larger merge
    for D, G, n_kv in fulls:
        for M in range(1, 9):
            assert not at.fused_supported(plan(D, G, n_kv, M, 4096, None))
    # a geometry whose partial kernel leaves no room for the merge's threadgroup arrays
    tight = at.AttentionConfig(rows=64, simd_groups=1, tile=56, min_chunk=56, target_groups=8)
    p = at.plan_decode(1, 64, 1, 1, 112, 128, "bfloat16", "bfloat16", None, tight, "cuda")
    assert p.merge_bytes <= at.FUSED_MERGE_BYTES and not at.fused_supported(p)
    monkeypatch.setattr(at, "backend", lambda: "metal")
    assert not at.fused_supported(plan(256, 2, 16, 1, 1056, 1024))


def test_fused_kernel_text():
    """g4_attn_decode is CUDA only (an empty Metal text) and is the partial kernel's text with its
    idle exit replaced, then the ticket and the merge."""
    spec = {s.name: s for s in all_kernel_specs()}["g4_attn_decode"]
    assert not spec.metal_source and spec.input_names[-1] == "counters" and spec.output_names == ("ml", "pacc", "out")
    assert at._fused_body().startswith(at._PARTIAL_BODY[:at._PARTIAL_BODY.index("  if (start >= nslots)")].replace(
        "attn_decode_partial: split-GQA decode attention over one sequence partition",
        "attn_decode: the partial kernel, then the group's last partition merges"))  # fmt: skip
    for needed in ("atomicAdd(done, 1u)", "__threadfence();", "*done = 0u;", "__ldcg(ml +", "__fmul_rn(w,"):
        assert needed in spec.cuda_source, needed
    assert len(spec.cases(np.random.default_rng(0))) == 5


def test_counters_reach_the_reference_on_cpu():
    """On a CPU build decode_attention with counters is the reference (the counters untouched)."""
    if custom_kernels.backend() != "cpu":
        pytest.skip("CPU build only")
    rng = np.random.default_rng(10)
    pos, qpos, window = _layout(rng, "ring", 1)
    args, _, _ = _problem(rng, 1, 4, 2, 1, 256, pos, qpos, window, mx.bfloat16)
    counters = at.new_attention_counters()
    out = at.decode_attention(*args, window, counters=counters)
    assert mx.array_equal(out, at.decode_attention_reference(*args, window)).item()
    assert counters.shape == (256,) and counters.dtype == mx.uint32 and not np.array(counters).any()


def test_mma_plan_and_support(monkeypatch):
    """The tensor-core kernel (family "attention_mma") takes bf16 q and caches at D 256 / 512 with at
    most 16 query rows per kv head, on CUDA sm_80+ only; its plan: a warp per 64 head dims, 32-slot
    tiles, about target_groups blocks, the merge's template agreeing on TS and CMIN; bad geometries
    are errors."""
    monkeypatch.setattr(at, "backend", lambda: "cuda")
    monkeypatch.setattr(at, "cuda_arch", lambda: 90)
    assert at.mma_supported("bfloat16", "bfloat16", 16, 1, 1, 512)  # 12B full
    assert at.mma_supported("bfloat16", "bfloat16", 32, 4, 2, 512)  # 31B full, M = 2
    assert not at.mma_supported("bfloat16", "bfloat16", 32, 4, 3, 512)  # 24 rows
    assert not at.mma_supported("float32", "bfloat16", 16, 1, 1, 512)
    assert not at.mma_supported("bfloat16", "float16", 16, 1, 1, 512)
    assert not at.mma_supported("bfloat16", "bfloat16", 8, 2, 1, 128)
    monkeypatch.setattr(at, "cuda_arch", lambda: 75)
    assert not at.mma_supported("bfloat16", "bfloat16", 16, 1, 1, 512)
    monkeypatch.setattr(at, "backend", lambda: "metal")
    assert not at.mma_supported("bfloat16", "bfloat16", 16, 1, 1, 512)

    p = at.plan_decode_mma(1, 32, 4, 1, 32768, 512, None)  # 31B full at 32K
    t = dict(p.partial_template)
    assert (t["NW"], t["TS"], t["CMIN"], t["G"], t["M"], t["WIN"]) == (8, 32, 64, 8, 1, 0)
    assert p.partial_threadgroup == (256, 1, 1) and p.partial_grid == (256 * 4, 66, 1) and p.parts == 66
    assert dict(p.merge_template)["TS"] == 32 and dict(p.merge_template)["CMIN"] == 64
    assert p.partial_shapes == [(4, 66, 8, 2), (4, 66, 8, 512)] and p.shared_bytes == 32768
    assert at.plan_decode_mma(1, 32, 4, 1, 32768, 512, None, staged=True).parts == 33  # staged: ~132 blocks
    assert at.plan_decode_mma(1, 16, 1, 1, 128, 512, None).parts == 2  # short caches: >= 64 slots a partition
    assert dict(at.plan_decode_mma(1, 8, 2, 1, 1056, 256, 1024).partial_template)["NW"] == 4
    with pytest.raises(ValueError, match="32-slot tiles"):
        at.plan_decode_mma(1, 16, 1, 1, 128, 512, None, at.AttentionConfig(tile=64, min_chunk=64))
    with pytest.raises(ValueError, match="64-dim slices"):
        at.plan_decode_mma(1, 16, 1, 1, 128, 256, None, at.AttentionConfig(simd_groups=8, tile=32, min_chunk=32))
    with pytest.raises(ValueError, match="exceed"):
        at.plan_decode_mma(1, 32, 1, 1, 128, 256, None)
    staged = dict(at.plan_decode_mma(1, 32, 4, 1, 32768, 512, None, staged=True).partial_template)
    assert (staged["ST"], staged["RP"]) == (2, 16) and "ST" not in t and p.dynamic_bytes == 0
    assert at.mma_staged_shared_bytes(512, 2, 16) == 2 * 2 * 32 * 1040  # 2 stages of 32 K + 32 V rows, padded
    three = at.plan_decode_mma(1, 32, 4, 1, 32768, 512, None, at.AttentionConfig(tile=32, min_chunk=64, simd_groups=8,
                               stages=3, row_pad=0), staged=True)  # fmt: skip
    assert (dict(three.partial_template)["ST"], dict(three.partial_template)["RP"]) == (3, 0)
    assert three.dynamic_bytes == 3 * 2 * 32 * 1024  # beside the 32 KB exchange: just under Hopper's 227 KB
    with pytest.raises(ValueError, match="more than a thread block"):
        at.plan_decode_mma(1, 32, 4, 1, 32768, 512, None, at.AttentionConfig(tile=32, min_chunk=64, simd_groups=8,
                           stages=3, row_pad=16), staged=True)  # fmt: skip
    for bad in (dict(stages=1), dict(row_pad=8), dict(row_pad=-16)):
        with pytest.raises(ValueError, match="stages|row_pad"):
            at.AttentionConfig(**bad)
    monkeypatch.setenv(at.MMA_GEOMETRY_ENV, "target_groups=528")
    assert at.plan_decode_mma(1, 32, 4, 1, 32768, 512, None).parts == 132


def test_mma_kernel_text():
    """g4_attn_decode_mma is CUDA only, registered with cases, and its text has the pieces the
    design rests on: tensor-core products, the warps' scores summed through shared memory behind
    one barrier a tile, p split into bf16 hi + lo."""
    spec = {s.name: s for s in all_kernel_specs()}["g4_attn_decode_mma"]
    assert not spec.metal_source and spec.output_names == ("ml", "pacc")
    assert len(spec.cases(np.random.default_rng(0))) == 4
    assert spec.cuda_source.count("__syncthreads()") == 1 and spec.cuda_source.count("g4_attn_split(") == 4
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in spec.cuda_header
    staged = {s.name: s for s in all_kernel_specs()}["g4_attn_decode_mma_staged"]
    cases = staged.cases(np.random.default_rng(0))
    assert not staged.metal_source and len(cases) == 7
    for c in cases:
        t = dict(c.template)
        assert c.cuda_shared_memory == at.mma_staged_shared_bytes(t["D"], t["ST"], t["RP"])
    assert {(dict(c.template)["ST"], dict(c.template)["RP"]) for c in cases} == {(2, 16), (3, 0), (4, 16)}
    assert at._mma_staged_body().count("g4_bulk_copy(") == 2 and "fence.proxy.async" in staged.cuda_source


def test_mma8_kernel_text_and_plan():
    """g4_attn_decode_mma8 is CUDA only, registered with cases (pinned after its GPU run), one barrier a
    tile, the query rows as the mma's 8 columns; its plan takes 8 rows at most, unstaged, with the
    [row][slot] score exchange (20 KB at 8 warps)."""
    spec = {s.name: s for s in all_kernel_specs()}["g4_attn_decode_mma8"]
    assert not spec.metal_source and spec.output_names == ("ml", "pacc")
    cases = spec.cases(np.random.default_rng(0))
    assert len(cases) == 5 and all(dict(c.template)["G"] * dict(c.template)["M"] <= 8 for c in cases)
    assert spec.cuda_source.count("__syncthreads()") == 1 and spec.cuda_source.count("g4_attn_split(") == 2
    assert "s_part[2][NW][8][SP]" in spec.cuda_source
    p = at.plan_decode_mma(1, 32, 4, 1, 32768, 512, None, mma8=True)  # 31B full at 32K
    assert p.shared_bytes == 2 * 8 * 8 * 40 * 4 and p.dynamic_bytes == 0
    assert p.partial_template == at.plan_decode_mma(1, 32, 4, 1, 32768, 512, None).partial_template
    with pytest.raises(ValueError, match="at most 8"):
        at.plan_decode_mma(1, 16, 1, 1, 128, 512, None, mma8=True)
    with pytest.raises(ValueError, match="unstaged"):
        at.plan_decode_mma(1, 32, 4, 1, 128, 512, None, staged=True, mma8=True)


def test_mma_rule_in_decode_attention(monkeypatch):
    """decode_attention hands ``mma`` on only where a kv head serves at least MMA_MIN_ROWS query rows
    (the 31B / 26B-A4B / 12B full layers at one token; not E4B's 4 rows, nor the sliding layers' 2)."""
    seen = []
    monkeypatch.setattr(at, "use_reference", lambda: False)
    monkeypatch.setattr(at, "launch_decode_attention", lambda *a, mma=False, **k: seen.append(mma))
    for n_q, n_kv, M, want in ((32, 4, 1, True), (16, 1, 1, True), (16, 2, 1, True), (8, 2, 1, False),
                               (8, 2, 2, True), (32, 16, 1, False)):  # fmt: skip
        q = mx.zeros((1, n_q, M, 512), mx.bfloat16)
        kv = mx.zeros((1, n_kv, 64, 512), mx.bfloat16)
        at.decode_attention(q, kv, kv, mx.arange(64), mx.arange(M), None, mma=True)
        assert seen.pop() is want, (n_q, n_kv, M)
    at.decode_attention(mx.zeros((1, 16, 1, 512), mx.bfloat16), kv[:, :1], kv[:, :1], mx.arange(64), mx.arange(1))
    assert seen.pop() is False  # not asked for
    # the staged form takes MMA_STAGED_MIN_ROWS (E4B's full layers: 4 rows), on Hopper only
    for arch, want in ((90, True), (80, False)):
        monkeypatch.setattr(at, "cuda_arch", lambda arch=arch: arch)
        kv = mx.zeros((1, 2, 64, 512), mx.bfloat16)
        at.decode_attention(mx.zeros((1, 8, 1, 512), mx.bfloat16), kv, kv, mx.arange(64), mx.arange(1), None,
                            mma=True, mma_staged=True)  # fmt: skip
        assert seen.pop() is want, arch
    kv = mx.zeros((1, 16, 64, 512), mx.bfloat16)
    at.decode_attention(mx.zeros((1, 32, 1, 512), mx.bfloat16), kv, kv, mx.arange(64), mx.arange(1), None,
                        mma=True, mma_staged=True)  # fmt: skip
    assert seen.pop() is False  # the sliding layers' 2 rows
    # mma8: 4..8 rows take g4_attn_decode_mma8; 16 rows the 16-row kernel; 2 rows neither
    made = []
    monkeypatch.setattr(at, "launch_decode_attention", lambda *a, mma=False, mma8=False, **k: made.append((mma, mma8)))
    for n_q, n_kv, M, want in ((32, 4, 1, (True, True)), (8, 2, 1, (True, True)), (16, 1, 1, (True, False)),
                               (32, 16, 1, (False, True)), (4, 2, 2, (True, True))):  # fmt: skip
        kv = mx.zeros((1, n_kv, 64, 512), mx.bfloat16)
        at.decode_attention(mx.zeros((1, n_q, M, 512), mx.bfloat16), kv, kv, mx.arange(64), mx.arange(M), None,
                            mma=True, mma8=True)  # fmt: skip
        assert made.pop() == want, (n_q, n_kv, M)


def test_mma_launch_plumbing(monkeypatch):
    """launch_decode_attention on a faked Hopper CUDA build: with ``mma`` the tensor-core partial kernel
    and the wide merge are created and called with their plans (the staged form with its dynamic
    shared memory and ST / RP template values), and their output is what comes back."""
    from custom_kernels import template_args

    made, calls = {}, []

    def fake_cuda_kernel(name, input_names, output_names, source, header, shared_memory=0):
        made[name.rsplit("_", 1)[0]] = shared_memory

        def run(inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value=None):
            calls.append((name.rsplit("_", 1)[0], dict(template), grid, threadgroup))
            return [mx.full(s, 1.0, d) for s, d in zip(output_shapes, output_dtypes)]
        return run

    monkeypatch.setattr(custom_kernels, "backend", lambda: "cuda")
    monkeypatch.setattr(at, "backend", lambda: "cuda")
    monkeypatch.setattr(at, "cuda_arch", lambda: 90)
    monkeypatch.setattr(mx.fast, "cuda_kernel", fake_cuda_kernel, raising=False)
    custom_kernels.clear_kernel_cache()
    try:
        q = mx.zeros((1, 16, 1, 512), mx.bfloat16)
        kv = mx.zeros((1, 1, 256, 512), mx.bfloat16)
        for staged in (False, True):
            calls.clear()
            out = at.launch_decode_attention(q, kv, kv, mx.arange(256), mx.array([200]), None, n_slots=201, mma=True,
                                             mma_staged=staged, mma8=True)  # fmt: skip (16 rows: mma8 does not apply)
            assert out.shape == (1, 16, 1, 512) and out.dtype == mx.bfloat16 and (np.array(out.astype(mx.float32)) == 1).all()
            name = "g4_attn_decode_mma_staged" if staged else "g4_attn_decode_mma"
            plan = at.plan_decode_mma(1, 16, 1, 1, 256, 512, None, staged=staged)
            assert [c[0] for c in calls] == [name, "g4_attn_decode_merge_wide"]
            assert calls[0][1:] == (dict(template_args(plan.partial_template)), plan.partial_grid,
                                    plan.partial_threadgroup)  # fmt: skip
            assert calls[1][2:] == (plan.merge_grid, plan.merge_threadgroup)
            assert made[name] == plan.dynamic_bytes == (at.mma_staged_shared_bytes(512, 2, 16) if staged else 0)
        # 8 rows per kv head with mma8 (staged asked for too): the transposed kernel, then the wide merge
        calls.clear()
        q8, kv8 = mx.zeros((1, 32, 1, 512), mx.bfloat16), mx.zeros((1, 4, 256, 512), mx.bfloat16)
        out = at.launch_decode_attention(q8, kv8, kv8, mx.arange(256), mx.array([200]), None, n_slots=201, mma=True,
                                         mma_staged=True, mma8=True)  # fmt: skip
        plan = at.plan_decode_mma(1, 32, 4, 1, 256, 512, None, mma8=True)
        assert out.shape == (1, 32, 1, 512) and [c[0] for c in calls] == ["g4_attn_decode_mma8", "g4_attn_decode_merge_wide"]
        assert calls[0][1:] == (dict(template_args(plan.partial_template)), plan.partial_grid, plan.partial_threadgroup)
        assert made["g4_attn_decode_mma8"] == 0
    finally:
        custom_kernels.clear_kernel_cache()
