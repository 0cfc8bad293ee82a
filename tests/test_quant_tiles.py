"""custom_kernels.quant_tiles on the CPU: launch plans, shared-memory layout, refusals and the
routing of quant_matvec / gate_up when family quant_matvec_tiles is on (CUDA faked, launches
stubbed). The kernels themselves run in tests/test_kernels_gpu.py (-k tiles) and
tests/test_registry_cases_gpu.py."""

from __future__ import annotations

import mlx.core as mx
import pytest

import custom_kernels
from custom_kernels import quant_matvec as qm
from custom_kernels import quant_tiles as qt


def test_row_stride_is_an_odd_number_of_16_byte_words():
    """Rows of an even number of 16-byte words get 16 bytes of padding, so lane (g, t)'s reads of
    rows g = 0..7 fall in 8 distinct groups of 4 banks."""
    for k in range(256, 12289, 256):
        rb, rs = qm.row_bytes(qm.Q4_0, k), qt.tiles_row_stride(k)
        assert rs in (rb, rb + 16) and (rs // 16) % 2 == 1 and rs % 16 == 0, k
        banks = {(g * rs // 4 + t) % 32 for g in range(8) for t in range(4)}
        assert len(banks) == 32, k
        assert qt.tiles_shared_bytes(k) == 16 * rs
    assert qt.tiles_row_stride(5376) == 3024 and qt.tiles_row_stride(8192) == 4624


def test_plans_and_refusals(monkeypatch):
    monkeypatch.delenv(qt.TILES_GEOMETRY_ENV, raising=False)
    assert qt.default_tiles_config() == qt.TilesConfig(8, 2, 1)
    plan = qt.plan_tiles("dense", 1, 21504, 5376, qt.TilesConfig(8, 4, 0))
    assert plan.grid == (1344 * 256, 1, 1) and plan.threadgroup == (256, 1, 1) and plan.output_shape == (1, 21504)
    assert dict(plan.template) == {"T": "bfloat16", "NW": 8, "RS": 3024, "NC": 4, "BI": 0}
    for m, pitch in ((1, 2), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8)):  # the bias table's tokens
        assert dict(qt.plan_tiles("dense", m, 64, 512, qt.TilesConfig(8, 4, 1)).template)["BI"] == pitch
    plan = qt.plan_tiles("gate_up", 8, 21504, 5376, qt.TilesConfig(4, 1))
    assert plan.grid == (2688 * 128, 1, 1) and plan.output_shape == (8, 21504) and dict(plan.template)["NC"] == 1
    assert qt.plan_tiles("dense", 3, 17, 256, qt.TilesConfig(4)).grid == (2 * 128, 1, 1)  # a partial last tile
    monkeypatch.setenv(qt.TILES_GEOMETRY_ENV, "warps=2,chunks=8")
    assert qt.default_tiles_config() == qt.TilesConfig(2, 8, 1)
    monkeypatch.setenv(qt.TILES_GEOMETRY_ENV, "bias=0")
    assert qt.default_tiles_config() == qt.TilesConfig(8, 2, 0)
    for bad in ("warps=3", "chunks=3", "rows=2", "bias=2"):
        monkeypatch.setenv(qt.TILES_GEOMETRY_ENV, bad)
        with pytest.raises(ValueError, match=qt.TILES_GEOMETRY_ENV):
            qt.default_tiles_config()
    monkeypatch.delenv(qt.TILES_GEOMETRY_ENV)
    for args, match in ((("dense", 1, 64, 1056), "multiple of 256"), (("dense", 9, 64, 512), "1..8 tokens"),
                        (("dense", 1, 0, 512), "output row"), (("other", 1, 64, 512), "kind"),
                        (("dense", 1, 64, 21504), "shared memory")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            qt.plan_tiles(*args)
    assert qt.tiles_supported(mx.bfloat16, 10240) and not qt.tiles_supported(mx.bfloat16, 21504)
    assert not qt.tiles_supported(mx.float32, 5376) and not qt.tiles_supported(mx.bfloat16, 1056)
    with pytest.raises(TypeError, match="bfloat16"):
        qt.launch_dense_tiles(mx.zeros((1, 512)), mx.zeros((64, 288), mx.uint8), 64)
    with pytest.raises(RuntimeError, match="compute capability"):  # a CPU build
        qt.launch_dense_tiles(mx.zeros((1, 512), mx.bfloat16), mx.zeros((64, 288), mx.uint8), 64)


def test_launch_shared_raises_the_limit_where_the_static_arrays_would_cross_48_kb():
    """A tile at or below MLX's raise threshold whose sum with part_s and the barriers is over 48 KB
    is asked as just above the threshold (the H200 refused such a launch as asked); the rest as it is."""
    c = lambda warps, chunks: qt.TilesConfig(warps, chunks, 0)  # noqa: E731
    assert qt.tiles_launch_shared(5120, c(8, 4)) == qt.MLX_RAISE_ABOVE + 16  # 46,336 + 4,128 static
    assert qt.tiles_launch_shared(5120, c(8, 1)) == qt.MLX_RAISE_ABOVE + 16  # 46,336 + 4,104
    assert qt.tiles_launch_shared(5120, c(1, 4)) == qt.tiles_shared_bytes(5120) == 46336  # + 544
    assert qt.tiles_launch_shared(5376, c(8, 4)) == qt.tiles_shared_bytes(5376) == 48384  # MLX raises it
    assert qt.tiles_launch_shared(3840, c(8, 4)) == qt.tiles_shared_bytes(3840) == 34560


def test_bias_table_bytes():
    """The bias form's table after the tile: each block's sums of 2, 4 or 8 tokens, twice, in f32
    (at K = 5376 and one token 2,688 bytes: four thread blocks of 8 warps still fit an SM's 228 KB)."""
    c = qt.TilesConfig
    assert qt.tiles_shared_bytes(5376, 1, 1) == 48384 + 168 * 2 * 2 * 4 == 51072
    assert qt.tiles_shared_bytes(5376, 2, 1) == 51072 and qt.tiles_shared_bytes(5376, 3, 1) == 48384 + 168 * 32
    assert qt.tiles_shared_bytes(5376, 8, 1) == 48384 + 168 * 64 and qt.tiles_shared_bytes(5376, 8, 0) == 48384
    for cfg in (c(8, 4, 1), qt.TilesConfig()):  # and the default, 2 chunks
        static = 4 * cfg.warps * 16 * 8 + 8 * cfg.chunks
        assert 4 * (qt.tiles_launch_shared(5376, cfg, 1) + static + 1024) <= 228 * 1024
    # K = 5120: the table takes the tile (46,336 bytes) past MLX's raise threshold: asked as it is
    assert qt.tiles_shared_bytes(5120, 1, 1) == 46336 + 160 * 16 and qt.tiles_launch_shared(5120, c(8, 4, 1), 1) == 48896


def test_routing_on_cuda(monkeypatch):
    """On an sm_90 CUDA build (faked, launches stubbed), family quant_matvec_tiles (a CUDA default)
    takes one bf16 token with Q4_0 rows of K in [TILES_MIN_K, TILES_MAX_K] (dense and gate|up);
    2..8 tokens, f32 x, K outside the range (E4B's 2560, 26B-A4B's 2816, 31B's o_proj 8192 and down
    21504), K not a multiple of 256 and Q8_0 keep their kernels; GEMMA4_MLX_KERNELS_OFF turns it off."""
    for env in (qt.TILES_GEOMETRY_ENV, custom_kernels.KERNELS_ENV, custom_kernels.UNPROVEN_ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(qm, "backend", lambda: "cuda")
    monkeypatch.setattr(custom_kernels, "backend", lambda: "cuda")
    monkeypatch.setattr(custom_kernels, "_device_arch", lambda: 90)
    routed = []
    for module, name in ((qt, "launch_dense_tiles"), (qt, "launch_gate_up_tiles"), (qm, "launch_dense_runs_m"),
                         (qm, "launch_gate_up_runs_m"), (qm, "launch_dense_runs"), (qm, "launch_gate_up_runs"),
                         (qm, "launch_dense_stream"), (qm, "launch_dense_mma"), (qm, "launch_dense"),
                         (qm, "launch_gate_up")):  # fmt: skip
        monkeypatch.setattr(module, name, lambda *a, _name=name, **kw: routed.append(_name) or mx.zeros((1,)))
    cases = (((1, 5376), mx.bfloat16, qm.Q4_0, True), ((1, 1, 3840), mx.bfloat16, qm.Q4_0, True),
             ((1, 4096), mx.bfloat16, qm.Q4_0, True), ((8, 5376), mx.bfloat16, qm.Q4_0, False),
             ((2, 1, 3840), mx.bfloat16, qm.Q4_0, False), ((1, 2560), mx.bfloat16, qm.Q4_0, False),
             ((1, 2816), mx.bfloat16, qm.Q4_0, False), ((1, 8192), mx.bfloat16, qm.Q4_0, False),
             ((1, 21504), mx.bfloat16, qm.Q4_0, False), ((1, 5376), mx.float32, qm.Q4_0, False),
             ((1, 6144), mx.bfloat16, qm.Q4_0, True), ((1, 6400), mx.bfloat16, qm.Q4_0, False),
             ((1, 3584), mx.bfloat16, qm.Q4_0, False),
             ((1, 5376), mx.bfloat16, qm.Q8_0, False))  # fmt: skip
    for off in ("", "quant_matvec_tiles"):
        monkeypatch.setenv(custom_kernels.KERNELS_OFF_ENV, off)
        for shape, dtype, fmt, tiles in cases:
            blocks = mx.zeros((64, qm.row_bytes(fmt, shape[-1])), mx.uint8)
            routed.clear()
            qm.quant_matvec(mx.zeros(shape, dtype), blocks, fmt, 64)
            assert (routed == ["launch_dense_tiles"]) == (tiles and not off), (shape, dtype, fmt, off, routed)
            routed.clear()
            qm.gate_up(mx.zeros(shape, dtype), blocks, fmt, 32)
            assert (routed == ["launch_gate_up_tiles"]) == (tiles and not off), (shape, dtype, fmt, off, routed)
