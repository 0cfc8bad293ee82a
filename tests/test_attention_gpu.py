"""GPU tests of custom_kernels.attention (Metal or CUDA, whichever this MLX build runs): the decode
attention kernels against a float64 numpy oracle on the real Gemma 4 layer shapes. Outputs (the
partition states too) are poisoned with NaN before each launch, and cache slots no query may attend
hold NaN, so an unwritten output or a read of a masked slot fails. Run with ``pytest -m gpu``."""

from __future__ import annotations

import zlib

import mlx.core as mx
import numpy as np
import pytest

import custom_kernels
from custom_kernels import attention as at

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(custom_kernels.backend() == "cpu", reason="no GPU backend (CPU-only MLX build)"),
]

NAN = float("nan")
F32_LIMIT = 1e-5  # |error| / bound (at.attention_f64) with f32 q and cache
BF16_LIMIT = 2**-8 + 1e-5  # bf16 output rounding


def _ring(capacity: int, last: int) -> np.ndarray:
    """A ring after writing positions 0..last: slot p % capacity holds its latest p (-1 if none)."""
    pos = np.full(capacity, -1, np.int32)
    first = max(0, last - capacity + 1)
    pos[np.arange(first, last + 1) % capacity] = np.arange(first, last + 1)
    return pos


def _problem(rng, B, n_q, n_kv, M, D, positions, q_positions, window, dtype, n_slots=None):
    """MLX inputs with NaN in every slot no query may attend, plus (oracle out, bound) in float64."""
    S = len(positions)
    positions = np.asarray(positions, np.int32)
    q_positions = np.asarray(q_positions, np.int32)
    scale = 1.5 * D**-0.25
    q = mx.array((rng.standard_normal((B, n_q, M, D)) * scale).astype(np.float32)).astype(dtype)
    k = mx.array((rng.standard_normal((B, n_kv, S, D)) * scale).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((B, n_kv, S, D)).astype(np.float32)).astype(dtype)
    q64, k64, v64 = (np.array(a.astype(mx.float32)).astype(np.float64) for a in (q, k, v))
    want, bound = at.attention_f64(q64, k64, v64, positions, q_positions, window)
    used = at._mask_np(q_positions, positions, window).any(axis=0)
    if n_slots is not None:
        assert not used[n_slots:].any(), "n_slots must bound the attendable slots"
    unused = mx.array(~used)[None, None, :, None]
    k, v = mx.where(unused, NAN, k).astype(dtype), mx.where(unused, NAN, v).astype(dtype)
    return (q, k, v, mx.array(positions), mx.array(q_positions)), want, bound


def _check(out: mx.array, want: np.ndarray, bound: np.ndarray, dtype, what: str) -> None:
    got = np.array(out.astype(mx.float32)).astype(np.float64)
    assert not np.isnan(got).any(), f"{what}: {int(np.isnan(got).sum())} outputs NaN (unwritten or leaked)"
    rel = float((np.abs(got - want) / np.maximum(bound, 1e-30)).max())
    limit = F32_LIMIT if dtype == mx.float32 else BF16_LIMIT
    assert rel <= limit, f"{what}: relative error {rel:.3g} > {limit:g}"


# (name, n_q, n_kv, D, layout): the decode shapes of the published models
SHAPES = [
    ("31B sliding", 32, 16, 256, "ring"),
    ("31B full", 32, 4, 512, "full"),
    ("12B full", 16, 1, 512, "full"),
    ("E4B sliding", 8, 2, 256, "ring"),
    ("26B full", 16, 2, 512, "full"),
]


def _layout(name: str, layout: str, M: int):
    """(positions, q_positions, window, n_slots) for a wrapped 1024-window ring (capacity 1056)
    or a preallocated full cache of capacity 4096 holding 0..3000."""
    if layout == "ring":
        window = 512 if name.startswith("E") else 1024
        last = 5000 + M
        return _ring(window + 32, last), np.arange(last - M + 1, last + 1), window, None
    length = 3001
    pos = np.where(np.arange(4096) < length, np.arange(4096), -1).astype(np.int32)
    return pos, np.arange(length - M, length), None, length


@pytest.mark.parametrize("name, n_q, n_kv, D, layout", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_kernel_matches_oracle(name, n_q, n_kv, D, layout, dtype):
    """M = 1, 3 and 8 (decode and MTP verification), poisoned outputs; with n_slots (the valid
    length) and without (every slot scanned); a second launch is bit-identical."""
    rng = np.random.default_rng(zlib.crc32(name.encode()) + D)
    for M in (1, 3, 8):
        pos, qpos, window, n_slots = _layout(name, layout, M)
        args, want, bound = _problem(rng, 1, n_q, n_kv, M, D, pos, qpos, window, dtype, n_slots)
        out = at.launch_decode_attention(*args, window, n_slots=n_slots, init_value=NAN)
        assert out.shape == (1, n_q, M, D) and out.dtype == dtype
        _check(out, want, bound, dtype, f"{name} M={M} {dtype}")
        assert mx.array_equal(at.launch_decode_attention(*args, window, n_slots=n_slots), out).item()
        if n_slots is not None:
            every = at.launch_decode_attention(*args, window, init_value=NAN)
            _check(every, want, bound, dtype, f"{name} M={M} {dtype} all slots")


@pytest.mark.parametrize("config", [
    at.AttentionConfig(rows=8, simd_groups=4, tile=32, min_chunk=256, target_groups=512),
    at.AttentionConfig(rows=16, simd_groups=8, tile=64, min_chunk=128, target_groups=1024),
    at.AttentionConfig(rows=4, simd_groups=4, tile=8, min_chunk=64, target_groups=64),
    at.AttentionConfig(rows=16, simd_groups=4, tile=32, min_chunk=32, target_groups=8192, max_parts=512),
])  # fmt: skip
def test_geometries(config):
    """Other geometries: query tiles (several per kv head), tiles, partition sizes; D = 512 and 256."""
    rng = np.random.default_rng(20)
    for n_q, n_kv, D, M, layout in ((16, 2, 512, 5, "full"), (16, 8, 256, 7, "ring")):
        if 32 * config.simd_groups < D // 4:  # the threads must cover D
            continue
        pos, qpos, window, n_slots = _layout("x", layout, M)
        args, want, bound = _problem(rng, 2 if layout == "ring" else 1, n_q, n_kv, M, D, pos, qpos, window,
                                     mx.float32, n_slots)  # fmt: skip
        out = at.launch_decode_attention(*args, window, n_slots=n_slots, config=config, init_value=NAN)
        _check(out, want, bound, mx.float32, f"{config} D={D} M={M}")


def test_long_context_partitions():
    """Capacity 65536 (a full layer, 12B shape: 1024 partitions, max_parts lifted by min_groups):
    valid lengths from one partition to all of them, one cache, the positions array and n_slots
    changing as in decode."""
    rng = np.random.default_rng(21)
    S, D = 65536, 512
    assert at.plan_decode(1, 16, 1, 1, S, D, "bfloat16", "bfloat16", None).parts == 1024
    pos_full = np.arange(S, dtype=np.int32)
    (q, k, v, _, qp), _, _ = _problem(rng, 1, 16, 1, 1, D, pos_full, [S - 1], None, mx.bfloat16)
    q64, k64, v64 = (np.array(a.astype(mx.float32)).astype(np.float64) for a in (q, k, v))
    for length in (700, 50000, S):
        pos = np.where(pos_full < length, pos_full, -1).astype(np.int32)
        want, bound = at.attention_f64(q64, k64, v64, pos, np.array([length - 1]), None)
        qpos = mx.array([length - 1], dtype=mx.int32)
        out = at.launch_decode_attention(q, k, v, mx.array(pos), qpos, None, n_slots=length, init_value=NAN)
        _check(out, want, bound, mx.bfloat16, f"length {length}")


def test_rows_without_keys_and_empty_cache():
    rng = np.random.default_rng(22)
    pos = _ring(64, 40)  # positions 0..40, the rest empty
    args, want, bound = _problem(rng, 1, 8, 2, 2, 256, pos, [40, 200], 16, mx.float32)
    out = at.launch_decode_attention(*args, 16, init_value=NAN)
    _check(out, want, bound, mx.float32, "row past the window")
    assert float(mx.abs(out[:, :, 1]).max()) == 0.0
    empty = at.launch_decode_attention(*args, 16, n_slots=0, init_value=NAN)
    assert float(mx.abs(empty).max()) == 0.0


def test_compiled_step_is_shape_stable():
    """One mx.compile trace serves every decode position and valid length (arrays, not constants)."""
    rng = np.random.default_rng(23)
    S, D = 2048, 512
    traces = []

    def step(q, k, v, positions, q_positions, n_slots):
        traces.append(1)
        return at.decode_attention(q, k, v, positions, q_positions, None, n_slots=n_slots)

    compiled = mx.compile(step)
    for length in (1, 300, 1999, S):
        pos = np.where(np.arange(S) < length, np.arange(S), -1).astype(np.int32)
        (q, k, v, p, qp), want, bound = _problem(rng, 1, 8, 1, 1, D, pos, [length - 1], None, mx.float32, length)
        out = compiled(q, k, v, p, qp, mx.array([length], dtype=mx.int32))
        _check(out, want, bound, mx.float32, f"compiled, length {length}")
    assert len(traces) == 1


def test_dispatch_uses_kernel_and_reference_switch(monkeypatch):
    rng = np.random.default_rng(24)
    pos, qpos, window, _ = _layout("31B sliding", "ring", 2)
    args, want, bound = _problem(rng, 1, 8, 4, 2, 256, pos, qpos, window, mx.bfloat16)
    kernel = at.decode_attention(*args, window)
    assert mx.array_equal(kernel, at.launch_decode_attention(*args, window)).item()
    _check(kernel, want, bound, mx.bfloat16, "dispatch")
    monkeypatch.setenv(custom_kernels.KERNELS_ENV, "reference")
    q, k, v, p, qp = args
    clean = [mx.where(mx.isnan(a), 0.0, a).astype(a.dtype) for a in (k, v)]  # the reference needs finite slots
    reference = at.decode_attention(q, *clean, p, qp, window)
    assert reference.shape == kernel.shape and reference.dtype == kernel.dtype
    # MLX's CUDA f32 matmul runs on TF32 tensor cores: the reference path is only ~1e-3 there
    err = np.abs(np.array(reference.astype(mx.float32)).astype(np.float64) - want) / bound
    assert err.max() <= (2**-7 if custom_kernels.backend() == "cuda" else BF16_LIMIT)


@pytest.mark.parametrize("M", [1, 4])
def test_merged_output_shape(M):
    """merged=True (what the model's attention asks for: [B, M, n_q * D]; at M = 1 the merge kernel
    writes that shape itself) holds the oracle's values, and bit-equals the plain output transposed."""
    rng = np.random.default_rng(40 + M)
    last = 1500  # a full ring
    args, want, bound = _problem(rng, 2, 32, 16, M, 256, _ring(1024, last), np.arange(last - M + 1, last + 1), 1024,
                                 mx.bfloat16)  # fmt: skip
    merged = at.decode_attention(*args, 1024, merged=True)
    plain = at.decode_attention(*args, 1024)
    assert merged.shape == (2, M, 32 * 256)
    _check(merged.reshape(2, M, 32, 256).transpose(0, 2, 1, 3), want, bound, mx.bfloat16, f"merged M={M}")
    assert mx.array_equal(merged, plain.transpose(0, 2, 1, 3).reshape(2, M, -1)).item()


@pytest.mark.skipif(custom_kernels.backend() != "cuda", reason="g4_attn_decode is CUDA only")
@pytest.mark.parametrize("name, n_q, n_kv, D, layout", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_fused_kernel_equals_the_two_launches(name, n_q, n_kv, D, layout, dtype):
    """g4_attn_decode (family "attention_fused"): bit for bit the two launches' output at M = 1, 3
    and 8 with poisoned outputs, and within the oracle's bound; one counters array for every call
    (each call's last threadgroup sets it back to zero). The sliding rings take it with the default
    geometry at M = 1; other calls with partitions long enough that the merge fits
    FUSED_MERGE_BYTES."""
    rng = np.random.default_rng(zlib.crc32(name.encode()) + D + 7)
    counters = at.new_attention_counters()
    base = at.default_config(D)
    for M in (1, 3, 8):
        pos, qpos, window, n_slots = _layout(name, layout, M)
        args, want, bound = _problem(rng, 1, n_q, n_kv, M, D, pos, qpos, window, dtype, n_slots)
        dt = custom_kernels.dtype_name(dtype)
        config = None
        plan = at.plan_decode(1, n_q, n_kv, M, len(pos), D, dt, dt, window)
        assert at.fused_supported(plan) == (layout == "ring" and M == 1), f"{name}: merge of {plan.merge_bytes} bytes"
        chunk = base.min_chunk
        while not at.fused_supported(plan):
            chunk *= 2
            config = at.AttentionConfig(**{**base.__dict__, "min_chunk": chunk})
            plan = at.plan_decode(1, n_q, n_kv, M, len(pos), D, dt, dt, window, config)
        fused = at.launch_decode_attention(*args, window, n_slots=n_slots, config=config, init_value=NAN,
                                           counters=counters)  # fmt: skip
        two = at.launch_decode_attention(*args, window, n_slots=n_slots, config=config)
        _check(fused, want, bound, dtype, f"{name} M={M} {dtype} fused, {plan.parts} partitions")
        assert mx.array_equal(fused, two).item(), f"{name} M={M} {dtype}: not the two launches' bits"
        assert not np.array(counters).any(), f"{name} M={M}: counters not reset"


@pytest.mark.skipif(custom_kernels.backend() != "cuda", reason="g4_attn_decode is CUDA only")
def test_fused_kernel_rows_without_keys_and_empty_cache():
    """The one launch with a row past its window (zeros), and with no valid slot at all (no active
    partition: partition 0 writes the zeros)."""
    rng = np.random.default_rng(25)
    counters = at.new_attention_counters()
    args, want, bound = _problem(rng, 1, 8, 2, 2, 256, _ring(64, 40), [40, 200], 16, mx.float32)
    assert at.fused_supported(at.plan_decode(1, 8, 2, 2, 64, 256, "float32", "float32", 16))
    out = at.launch_decode_attention(*args, 16, init_value=NAN, counters=counters)
    _check(out, want, bound, mx.float32, "fused, row past the window")
    assert float(mx.abs(out[:, :, 1]).max()) == 0.0
    empty = at.launch_decode_attention(*args, 16, n_slots=0, init_value=NAN, counters=counters)
    assert float(mx.abs(empty).max()) == 0.0
    assert not np.array(counters).any()


# (name, n_q, n_kv, window): the sliding layers the one launch takes (E2B's, 8 query rows per K/V
# head, merge more partition state than FUSED_MERGE_BYTES and keep the two launches)
SLIDING = [("31B", 32, 16, 1024), ("26B-A4B / 12B", 16, 8, 1024), ("E4B", 8, 2, 512)]


def _offset_view(x: mx.array, offset: int) -> mx.array:
    """The same values as x, as a row-contiguous view `offset` bytes into a buffer."""
    n = offset // x.itemsize
    return mx.concatenate([mx.zeros((n,), x.dtype), x.reshape(-1)])[n:].reshape(x.shape)


@pytest.mark.skipif(custom_kernels.backend() != "cuda" or custom_kernels.cuda_arch() < at.STAGED_ARCH,
                    reason="g4_attn_decode_staged needs CUDA on Hopper")  # fmt: skip
@pytest.mark.parametrize("name, n_q, n_kv, window", SLIDING, ids=[s[0] for s in SLIDING])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_staged_kernel_equals_the_one_launch(name, n_q, n_kv, window, dtype):
    """g4_attn_decode_staged (family "attention_staged"): bit for bit g4_attn_decode on a wrapped
    ring at one token, with the default geometry (one-tile partitions) and with partitions of three
    tiles (the next tile's copies after a tile; the registry cases add a short last tile), poisoned outputs
    and NaN in every slot no query may attend; within the oracle's bound; caches 8 bytes off
    16-byte alignment take the global loads, the same bits; the counters left at zero."""
    rng = np.random.default_rng(zlib.crc32(name.encode()) + 31)
    counters = at.new_attention_counters()
    args, want, bound = _problem(rng, 1, n_q, n_kv, 1, 256, _ring(window + 32, 7000), [7000], window, dtype)
    dt = custom_kernels.dtype_name(dtype)
    base = at.default_config(256)
    for config in (None, at.AttentionConfig(**{**base.__dict__, "min_chunk": 96})):
        plan = at.plan_decode(1, n_q, n_kv, 1, window + 32, 256, dt, dt, window, config)
        assert at.staged_supported(plan), f"{name}: {at.staged_shared_bytes(plan)} bytes of shared memory"
        run = lambda a, staged: at.launch_decode_attention(*a, window, config=config, init_value=NAN,  # noqa: E731
                                                            counters=counters, staged=staged)  # fmt: skip
        one, staged = run(args, False), run(args, True)
        what = f"{name} {dtype} {plan.parts} partitions"
        _check(staged, want, bound, dtype, what + " staged")
        assert mx.array_equal(staged, one).item(), f"{what}: staged not the one launch's bits"
        q, k, v, pos, qpos = args
        off = run((q, _offset_view(k, 8), _offset_view(v, 8), pos, qpos), True)
        assert mx.array_equal(off, one).item(), f"{what}: caches off alignment not the one launch's bits"
        assert not np.array(counters).any(), f"{what}: counters not reset"


MMA_SHAPES = [s for s in SHAPES if s[1] // s[2] <= at.MMA_MAX_ROWS] + [
    # E2B's one kv head: 8 rows on both layer types, so its sliding layers take the tensor-core
    # kernel too (its ring's merge is too large for the one launch; tests/test_attention_dispatch.py)
    ("E2B sliding", 8, 1, 256, "ring"),
    ("E2B full", 8, 1, 512, "full"),
]


@pytest.mark.skipif(custom_kernels.backend() != "cuda" or custom_kernels.cuda_arch() < at.MMA_ARCH,
                    reason="g4_attn_decode_mma needs CUDA sm_80+")  # fmt: skip
@pytest.mark.parametrize("name, n_q, n_kv, D, layout", MMA_SHAPES, ids=[s[0] for s in MMA_SHAPES])
@pytest.mark.parametrize("variant", ["mma", "mma_staged", "mma8"])
def test_mma_kernel_matches_oracle(name, n_q, n_kv, D, layout, variant):
    """g4_attn_decode_mma (family "attention_mma"), its staged form g4_attn_decode_mma_staged
    (family "attention_mma_staged", Hopper; the same bits) and g4_attn_decode_mma8 (family
    "attention_mma8", up to 8 rows) at the real layer shapes, bf16: every M up to 16 (8) query rows
    per kv head, the default geometry and one with other warps and uneven partitions, poisoned
    outputs and NaN in every slot no query may attend; within the oracle's bound; a second launch
    bit-identical; inputs 8 bytes off 16-byte alignment (the 2-byte loads) the same bits."""
    staged, mma8 = variant == "mma_staged", variant == "mma8"
    if staged and custom_kernels.cuda_arch() < at.STAGED_ARCH:
        pytest.skip("the staged form needs Hopper (bulk copies)")
    G = n_q // n_kv
    if mma8 and G > at.MMA8_MAX_ROWS:
        pytest.skip(f"{G} query heads per kv head: more than g4_attn_decode_mma8's {at.MMA8_MAX_ROWS} rows")
    rng = np.random.default_rng(zlib.crc32(name.encode()) + 27)
    other = at.AttentionConfig(rows=16, simd_groups=max(1, D // 128), tile=32, min_chunk=32, target_groups=37)
    max_rows = at.MMA8_MAX_ROWS if mma8 else at.MMA_MAX_ROWS
    for M in [m for m in (1, 2, 4, 8) if G * m <= max_rows]:
        pos, qpos, window, n_slots = _layout(name, layout, M)
        args, want, bound = _problem(rng, 1, n_q, n_kv, M, D, pos, qpos, window, mx.bfloat16, n_slots)
        assert at.mma_supported("bfloat16", "bfloat16", n_q, n_kv, M, D)
        for config in (None, other):
            run = lambda a: at.launch_decode_attention(*a, window, n_slots=n_slots, init_value=NAN, mma=True,  # noqa: E731
                                                       mma_config=config, mma_staged=staged, mma8=mma8)  # fmt: skip
            out = run(args)
            what = f"{name} M={M} {config or 'default'}"
            assert out.shape == (1, n_q, M, D) and out.dtype == mx.bfloat16
            _check(out, want, bound, mx.bfloat16, what)
            assert mx.array_equal(run(args), out).item(), f"{what}: not deterministic"
            q, k, v, p, qp = args
            off = run((_offset_view(q, 8), _offset_view(k, 8), _offset_view(v, 8), p, qp))
            assert mx.array_equal(off, out).item(), f"{what}: misaligned inputs not the same bits"
            if staged:  # the staged form's arithmetic is the unstaged kernel's (on the same partitions)
                plain = at.launch_decode_attention(*args, window, n_slots=n_slots, mma=True,
                                                   mma_config=config or at.default_mma_config(D, staged=True))  # fmt: skip
                assert mx.array_equal(plain, out).item(), f"{what}: staged not g4_attn_decode_mma's bits"


@pytest.mark.skipif(custom_kernels.backend() != "cuda" or custom_kernels.cuda_arch() < at.MMA_ARCH,
                    reason="g4_attn_decode_mma needs CUDA sm_80+")  # fmt: skip
def test_mma_kernel_long_context_and_empty():
    """12B's full-layer shape in a 32768-slot capacity: valid lengths from a part of one tile to all
    slots (the default geometry's partitions, active ones changing with n_slots as in decode); and a
    cache with no valid slot gives zeros (rows without keys)."""
    rng = np.random.default_rng(28)
    S, D = 32768, 512
    pos_full = np.arange(S, dtype=np.int32)
    (q, k, v, _, _), _, _ = _problem(rng, 1, 16, 1, 1, D, pos_full, [S - 1], None, mx.bfloat16)
    q64, k64, v64 = (np.array(a.astype(mx.float32)).astype(np.float64) for a in (q, k, v))
    for length in (17, 3001, 30000, S):
        pos = np.where(pos_full < length, pos_full, -1).astype(np.int32)
        want, bound = at.attention_f64(q64, k64, v64, pos, np.array([length - 1]), None)
        out = at.launch_decode_attention(q, k, v, mx.array(pos), mx.array([length - 1], dtype=mx.int32), None,
                                         n_slots=length, init_value=NAN, mma=True)  # fmt: skip
        _check(out, want, bound, mx.bfloat16, f"length {length}")
    empty = at.launch_decode_attention(q, k, v, mx.array(np.full(S, -1, np.int32)), mx.array([5], dtype=mx.int32),
                                       None, n_slots=0, init_value=NAN, mma=True)  # fmt: skip
    assert not np.array(empty.astype(mx.float32)).any(), "no valid slot: zeros expected"


@pytest.mark.skipif(custom_kernels.backend() != "cuda" or custom_kernels.cuda_arch() < at.MMA_ARCH,
                    reason="g4_attn_decode_mma needs CUDA sm_80+")  # fmt: skip
def _mma_geometry_model(full_kv_heads: int):
    """(cfg, bf16 model, 88 token ids): 12B's attention geometry (sliding layers D = 256, 16 query
    on 8 kv heads; a full layer D = 512, 16 query heads on `full_kv_heads`, K = V), random weights."""
    from gemma4_mlx.config import FULL, SLIDING, ModelConfig
    from gemma4_mlx.model import Model

    cfg = ModelConfig(hidden_size=512, num_hidden_layers=4, intermediate_size=1024, num_attention_heads=16,
                      num_key_value_heads=8, num_global_key_value_heads=full_kv_heads, attention_k_eq_v=True,
                      layer_types=[SLIDING, SLIDING, SLIDING, FULL], vocab_size=1024, head_dim=256,
                      global_head_dim=512, sliding_window=32, max_position_embeddings=4096)  # fmt: skip
    mx.random.seed(27)
    model = Model(cfg)
    model.set_dtype(mx.bfloat16)
    return cfg, model, mx.array(np.random.default_rng(27).integers(0, cfg.vocab_size, 88, dtype=np.int32))


@pytest.mark.parametrize("full_kv_heads", [1, 2])
def test_one_buffer_caches_under_the_tensor_core_kernels(full_kv_heads):
    """kv_one_write under the default tensor-core attention (the full layer at 16 rows per kv head:
    g4_attn_decode_mma_staged on Hopper, at 8: g4_attn_decode_mma8, reading K's first B rows of the
    [2B, ...] buffer and V through a view): the compiled step's logits over 48 teacher-forced tokens
    are bit-equal to two cache buffers'."""
    from gemma4_mlx.cache import make_cache
    from gemma4_mlx.compiled_step import CompiledDecoder

    cfg, model, ids = _mma_geometry_model(full_kv_heads)

    def logits(one_buffer: bool) -> np.ndarray:
        cache = make_cache(cfg)
        mx.eval(model(ids[None, :40], cache))
        decoder = CompiledDecoder(model, cache, capacity=4096, one_buffer=one_buffer)
        assert decoder.one_buffer is one_buffer
        return np.stack([np.array(decoder(ids[None, t : t + 1]).astype(mx.float32))[0] for t in range(40, 88)])

    np.testing.assert_array_equal(logits(True), logits(False))


@pytest.mark.parametrize("variant, full_kv_heads", [("mma", 1), ("mma", 2), ("mma_staged", 1), ("mma8", 2)])
def test_mma_kernel_in_the_compiled_step(monkeypatch, variant, full_kv_heads):
    """A bf16 model with 12B's attention geometry (sliding layers D = 256, 16 query on 8 kv heads;
    a full layer D = 512, 16 query heads on one kv head, K = V; or on two: 8 rows per kv head, as
    31B's and 26B-A4B's) and random weights: the compiled decode step with the full layer on tensor
    cores (the defaults: at 16 rows g4_attn_decode_mma_staged on Hopper, at 8 g4_attn_decode_mma8;
    or with attention_mma8 and attention_mma_staged off g4_attn_decode_mma at both; then the wide
    merge over the partitions of a 4096-slot capacity, large enough that the f32-FMA one launch
    does not take the layer first) gives the step's logits with the f32-FMA kernels (attention_mma
    off), teacher-forced over 48 tokens after a 40-token prompt, within bf16 rounding, and the same
    greedy token wherever the top two logits are further apart than the largest difference."""
    from gemma4_mlx.cache import make_cache
    from gemma4_mlx.compiled_step import CompiledDecoder

    if variant == "mma_staged" and custom_kernels.cuda_arch() < at.STAGED_ARCH:
        pytest.skip("the staged form needs Hopper (bulk copies)")
    cfg, model, ids = _mma_geometry_model(full_kv_heads)
    capacity = 4096
    assert at.mma_supported("bfloat16", "bfloat16", 16, full_kv_heads, 1, 512)
    assert not at.fused_supported(at.plan_decode(1, 16, full_kv_heads, 1, capacity, 512, "bfloat16", "bfloat16", None)), (
        "the one launch would take the full layer before the tensor-core kernels")  # fmt: skip

    def logits(on: bool) -> np.ndarray:
        monkeypatch.delenv(custom_kernels.UNPROVEN_ENV, raising=False)
        monkeypatch.delenv(custom_kernels.KERNELS_OFF_ENV, raising=False)
        if not on:
            monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, "attention_mma")
        elif variant == "mma":
            monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, "attention_mma8,attention_mma_staged")
        cache = make_cache(cfg)
        mx.eval(model(ids[None, :40], cache))
        decoder = CompiledDecoder(model, cache, capacity=capacity)
        return np.stack([np.array(decoder(ids[None, t : t + 1]).astype(mx.float32))[0] for t in range(40, 88)])

    base, mma = logits(False), logits(True)
    diff = np.abs(mma - base).max()
    assert diff > 0, "the two steps gave the same bits: the tensor-core path was not taken"
    assert diff <= 2**-6 * np.abs(base).max(), f"logits differ by {diff:.3g} (max |logit| {np.abs(base).max():.3g})"
    top2 = np.sort(base, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * diff
    assert clear.sum() >= 24, "too few clear argmaxes to compare"
    assert (mma.argmax(-1) == base.argmax(-1))[clear].all()
