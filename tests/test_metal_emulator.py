"""Self-tests of the CPU Metal emulator (tests/metal_emulator): the MLX signature it generates,
the semantics of the Metal subset it implements, and — most important — that deliberately broken
kernels fail, each with an error naming the kernel and the check."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/metal_emulator, whatever the import mode
from metal_emulator import EmulatorError, InputInfo, build, check_case, generate_metal_source, metal_kernel  # noqa: E402
from metal_emulator.check import compare  # noqa: E402
from metal_emulator.kernel import translation_unit  # noqa: E402


def run(name: str, source: str, inputs: dict, out_shape, grid, threadgroup, *, header: str = "",
        template=None, out_dtype: str = "float32", input_dtypes=None, **kw) -> np.ndarray:  # fmt: skip
    """Run a one-output toy kernel; returns the output."""
    k = metal_kernel(name, list(inputs), ["out"], source, header)
    dts = [input_dtypes.get(n) for n in inputs] if input_dtypes else None
    return k(inputs=list(inputs.values()), output_shapes=[out_shape], output_dtypes=[out_dtype], grid=grid,
             threadgroup=threadgroup, template=template, input_dtypes=dts, **kw)[0]  # fmt: skip


def raises(kernel: str, check: str):
    """pytest.raises for an EmulatorError of ``check`` whose message names ``kernel`` and ``check``."""
    return pytest.raises(EmulatorError, match=rf"metal kernel '{kernel}': {check}: ")


RNG = np.random.default_rng(1234)

# ---------------------------------------------------------------------------------------------
# A correct block reduction and its broken variants
# ---------------------------------------------------------------------------------------------

BLOCK_SUM = """
  threadgroup float partial[32];
  const uint lane = thread_index_in_simdgroup;
  const uint sg = simdgroup_index_in_threadgroup;
  const uint row = threadgroup_position_in_grid.x;
  float acc = 0.0f;
  for (uint j = thread_position_in_threadgroup.x; j < (uint)n; j += threads_per_threadgroup.x)
    acc += x[row * n + j];
  acc = @REDUCE@;
  if (lane == 0) partial[sg] = acc;
  @BARRIER@
  if (sg == 0) {
    float v = lane < simdgroups_per_threadgroup ? partial[lane] : 0.0f;
    v = simd_sum(v);
    if (lane == 0) out[row] = v;
  }
"""
BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"
SHUFFLE_REDUCE = "SHUFFLE_SUM(acc)"
SHUFFLE_HEADER = """
#define SHUFFLE_SUM(v) shuffle_sum(v, @START@)
inline float shuffle_sum(float v, ushort start) {
  for (ushort o = start; o > 0; o >>= 1) v += simd_shuffle_down(v, o);
  return simd_broadcast(v, 0);
}
"""


def block_sum(name: str, reduce: str = "simd_sum(acc)", barrier: str = BARRIER, start: int = 16,
              rows: int = 3, n: int = 157, threads: int = 96):  # fmt: skip
    x = RNG.standard_normal((rows, n)).astype(np.float32)
    src = BLOCK_SUM.replace("@REDUCE@", reduce).replace("@BARRIER@", barrier)
    out = run(name, src, {"x": x, "n": np.int32(n)}, (rows,), (threads * rows, 1, 1), (threads, 1, 1),
              header=SHUFFLE_HEADER.replace("@START@", str(start)))  # fmt: skip
    return out, x.astype(np.float64).sum(axis=1)


def test_block_sum_correct():
    out, ref = block_sum("block_sum")
    compare("block_sum", "out", out, "float32", ref, 1e-5, 1e-5)
    out, ref = block_sum("block_sum_shuffle", reduce=SHUFFLE_REDUCE)
    compare("block_sum_shuffle", "out", out, "float32", ref, 1e-5, 1e-5)


def test_missing_barrier_is_caught():
    with raises("block_sum_no_barrier", "lane_order"):
        block_sum("block_sum_no_barrier", barrier="")


def test_wrong_simd_reduction_is_caught():
    out, ref = block_sum("block_sum_short_shuffle", reduce=SHUFFLE_REDUCE, start=8)  # lanes 16..31 lost
    with raises("block_sum_short_shuffle", "mismatch"):
        compare("block_sum_short_shuffle", "out", out, "float32", ref, 1e-5, 1e-5)


def test_simd_function_in_divergent_branch_is_caught():
    with raises("block_sum_divergent", "simd_divergence"):
        block_sum("block_sum_divergent", reduce="(lane < 16 ? simd_sum(acc) : acc)")


def test_early_return_before_barrier_is_caught():
    src = """
      threadgroup float s[64];
      uint i = thread_position_in_grid.x;
      if (i >= (uint)n) return;
      s[thread_position_in_threadgroup.x] = x[i];
      threadgroup_barrier(mem_flags::mem_threadgroup);
      out[i] = s[thread_position_in_threadgroup.x ^ 1];
    """
    with raises("early_return", "barrier_divergence"):
        run("early_return", src, {"x": np.ones(50, np.float32), "n": np.int32(50)}, (50,), (64, 1, 1), (64, 1, 1))


def test_shuffle_with_nonuniform_argument_is_caught():
    src = "out[thread_position_in_grid.x] = simd_shuffle_down(x[thread_position_in_grid.x], (ushort)(thread_index_in_simdgroup % 2));"
    with raises("nonuniform_delta", "simd_nonuniform_argument"):
        run("nonuniform_delta", src, {"x": np.ones(32, np.float32)}, (32,), (32, 1, 1), (32, 1, 1))


# ---------------------------------------------------------------------------------------------
# Tails and bounds
# ---------------------------------------------------------------------------------------------

SCALE = """
  uint i = thread_position_in_grid.x;
  if (i @CMP@ (uint)n) out[i] = 2.0f * x[i];
"""


@pytest.mark.parametrize("n", [37, 40])  # tail inside the 16-byte slack (37) / at the guard page (40)
def test_off_by_one_tail_is_caught(n):
    x = RNG.standard_normal(n).astype(np.float32)
    out = run("scale", SCALE.replace("@CMP@", "<"), {"x": x, "n": np.int32(n)}, (n,), (64, 1, 1), (32, 1, 1))
    np.testing.assert_array_equal(out, 2 * x)
    with pytest.raises(EmulatorError, match=r"metal kernel 'scale_tail': (out_of_bounds|oob_write): .*('x'|'out')"):
        run("scale_tail", SCALE.replace("@CMP@", "<="), {"x": x, "n": np.int32(n)}, (n,), (64, 1, 1), (32, 1, 1))


def test_out_of_bounds_write_is_caught():
    src = "uint i = thread_position_in_grid.x; out[i + 70] = x[i];"
    with raises("oob_write_far", "out_of_bounds") as e:
        run("oob_write_far", src, {"x": np.ones(64, np.float32)}, (64,), (64, 1, 1), (32, 1, 1))
    assert "past the end of buffer 'out'" in str(e.value)
    src = "uint i = thread_position_in_grid.x; out[int(i) - 2] = x[i];"
    with raises("oob_write_before", "oob_write") as e:
        run("oob_write_before", src, {"x": np.ones(64, np.float32)}, (64,), (64, 1, 1), (32, 1, 1))
    assert "outside buffer 'out' 8 bytes before its start" in str(e.value)


def test_out_of_bounds_read_is_caught():
    src = "uint i = thread_position_in_grid.x; out[i] = x[i + 8];"
    with raises("oob_read", "out_of_bounds") as e:
        run("oob_read", src, {"x": np.ones(64, np.float32)}, (64,), (64, 1, 1), (32, 1, 1))
    assert "past the end of buffer 'x'" in str(e.value)


def test_read_of_slack_gives_poison_and_unwritten_output_is_named():
    class Case:
        inputs = {"x": np.ones(5, np.float32)}
        template, grid, threadgroup = [], (6, 1, 1), (32, 1, 1)
        output_shapes, output_dtypes = [(6,)], ["float32"]
        expected, rtol, atol = [np.ones(6)], 0.0, 0.0

    k = metal_kernel("slack_read", ["x"], ["out"], "uint i = thread_position_in_grid.x; out[i] = x[i];")
    with raises("slack_read", "unwritten_output"):  # x[5] reads the NaN poison after the data
        check_case(k, Case)
    k = metal_kernel("skip_last", ["x"], ["out"], "uint i = thread_position_in_grid.x; if (i < 5) out[i] = x[i];")
    with raises("skip_last", "unwritten_output") as e:
        check_case(k, Case)
    assert "first at index (5,)" in str(e.value)


def test_write_to_input_is_caught():
    src = "uint i = thread_position_in_grid.x; ((device float*)x)[i] = 1.0f; out[i] = x[i];"
    with raises("input_write", "input_write"):
        run("input_write", src, {"x": np.ones(64, np.float32)}, (64,), (64, 1, 1), (32, 1, 1))


def test_threadgroup_out_of_bounds_write_is_caught():
    src = """
      threadgroup float s[32];
      uint t = thread_position_in_threadgroup.x;
      s[t] = x[thread_position_in_grid.x];   // 33 threads, 32 slots
      threadgroup_barrier(mem_flags::mem_threadgroup);
      out[thread_position_in_grid.x] = s[t % 32];
    """
    with raises("tg_oob", "(threadgroup_oob|array_bounds)"):
        run("tg_oob", src, {"x": np.ones(33, np.float32)}, (33,), (33, 1, 1), (33, 1, 1))
    # Through a pointer the array bounds check cannot see it; the canaries still do.
    src = src.replace("s[t] = x", "threadgroup float* p = s; p[t] = x")
    with raises("tg_oob_ptr", "threadgroup_oob") as e:
        run("tg_oob_ptr", src, {"x": np.ones(33, np.float32)}, (33,), (33, 1, 1), (33, 1, 1))
    assert "threadgroup variable 's'" in str(e.value)


def test_thread_array_index_out_of_bounds_is_caught():
    src = """
      float acc[4];
      for (int j = 0; j <= n; ++j) acc[j] = x[j];
      out[thread_position_in_grid.x] = acc[0];
    """
    with raises("thread_array", "array_bounds"):
        run("thread_array", src, {"x": np.ones(8, np.float32), "n": np.int32(4)}, (1,), (1, 1, 1), (1, 1, 1))


def test_race_on_device_memory_is_caught():
    src = "out[0] = float(thread_position_in_grid.x);"  # every lane writes the same element
    with raises("race", "lane_order"):
        run("race", src, {"x": np.ones(1, np.float32)}, (1,), (64, 1, 1), (32, 1, 1))


def test_unsupported_builtin_is_a_compile_error():
    for name, src in [
        ("quad_fn", "out[0] = quad_sum(x[0]);"),
        ("swizzle", "float4 v = float4(1.0f); float2 w = v.xy; out[0] = w.x;"),
        ("texture", "texture2d<float> t; out[0] = x[0];"),
        ("unknown_attr", "[[unknown_metal_attribute]] float y = x[0]; out[0] = y;"),
        ("tg_init", "threadgroup float s[4] = {0}; out[0] = s[0] + x[0];"),
        ("erf", "out[0] = erf(x[0]);")  # not in Metal either,
    ]:
        with raises(name, "compile"):
            run(name, src, {"x": np.ones(8, np.float32)}, (1,), (1, 1, 1), (1, 1, 1))


def test_threadgroup_too_large_is_rejected():
    with raises("too_many_threads", "threadgroup_size"):
        run("too_many_threads", "out[0] = x[0];", {"x": np.ones(8, np.float32)}, (1,), (2048, 1, 1), (2048, 1, 1))


# ---------------------------------------------------------------------------------------------
# MLX signature generation
# ---------------------------------------------------------------------------------------------


def test_signature_matches_mlx():
    src = "out[0] = a[0] + b[0] + c + float(a_shape[0]) + float(a_ndim) + thread_position_in_grid.x + simd_sum(1.0f);"
    gen = generate_metal_source(
        "sig", ["a", "b", "c"], ["out", "out2"], src, "// header\n",
        [InputInfo("bfloat16", 2, 12), InputInfo("float32", 1, 7), InputInfo("float32", 0, 1)],
        ["float32", "int32"], [("T", "bfloat16"), ("N", 4), ("B", True)])  # fmt: skip
    assert gen.function_name == "custom_kernel_sig__bfloat16_t_4_1_bfloat16_t_floatc_floats_float_int32_t"
    assert gen.text == (
        "// header\n"
        "template <typename T, int N, bool B>\n"
        f"[[kernel]] void {gen.function_name}(\n"
        "  const device bfloat16_t* a [[buffer(0)]],\n"
        "  const constant int* a_shape [[buffer(1)]],\n"
        "  const constant int& a_ndim [[buffer(2)]],\n"
        "  const constant float* b [[buffer(3)]],\n"
        "  const constant float& c [[buffer(4)]],\n"
        "  device float* out [[buffer(5)]],\n"
        "  device int32_t* out2 [[buffer(6)]],\n"
        "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {\n"
        f"{src}\n}}\n\n"
        f'template [[host_name("{gen.function_name}")]] [[kernel]] decltype({gen.function_name}<bfloat16_t, 4, 1>) '
        f"{gen.function_name}<bfloat16_t, 4, 1>;\n"
    )
    plain = generate_metal_source("p", ["a"], ["o"], "o[0] = a[0];", "", [InputInfo("float32", 1, 64)], ["float32"])
    assert plain.text == "[[kernel]] void custom_kernel_p_float_float(\n  const device float* a [[buffer(0)]],\n" \
                         "  device float* o [[buffer(1)]]) {\no[0] = a[0];\n}\n"  # fmt: skip


def test_shape_strides_and_noncontiguous_input():
    src = """
      uint i = thread_position_in_grid.x, j = thread_position_in_grid.y;
      out[i * 3 + j] = x[i * x_strides[0] + j * x_strides[1]] + float(x_shape[0] * 10 + x_ndim);
    """
    base = RNG.standard_normal((6, 8)).astype(np.float32)
    view = base[::2, 1:7:2]  # (3, 3), strides (16, 2) elements
    k = metal_kernel("strided", ["x"], ["out"], src, ensure_row_contiguous=False)
    out = k(inputs=[view], output_shapes=[(9,)], output_dtypes=["float32"], grid=(3, 3, 1), threadgroup=(4, 4, 1))[0]
    np.testing.assert_array_equal(out, (view + 32).reshape(-1))
    k = metal_kernel("strided_copy", ["x"], ["out"], src)  # MLX copies to row-contiguous first
    out = k(inputs=[view], output_shapes=[(9,)], output_dtypes=["float32"], grid=(3, 3, 1), threadgroup=(4, 4, 1))[0]
    np.testing.assert_array_equal(out, (view + 32).reshape(-1))


# ---------------------------------------------------------------------------------------------
# Semantics of the Metal subset
# ---------------------------------------------------------------------------------------------


def test_thread_attributes_and_trimmed_edge_threadgroups():
    src = """
      uint3 p = thread_position_in_grid;
      uint idx = p.x + p.y * grid_size.x;
      out[idx * 6 + 0] = threads_per_threadgroup.x;
      out[idx * 6 + 1] = threads_per_threadgroup.y;
      out[idx * 6 + 2] = thread_index_in_threadgroup;
      out[idx * 6 + 3] = simdgroup_index_in_threadgroup * 100 + thread_index_in_simdgroup;
      out[idx * 6 + 4] = threadgroups_per_grid.x * 10 + threadgroups_per_grid.y;
      out[idx * 6 + 5] = dispatch_threads_per_threadgroup.x + x[0];
    """
    gx, gy, tx, ty = 10, 5, 8, 4
    out = run("attrs", src, {"x": np.zeros(1, np.uint32)}, (gx * gy * 6,), (gx, gy, 1), (tx, ty, 1),
              out_dtype="uint32").reshape(gy, gx, 6)  # fmt: skip
    for y in range(gy):
        for x in range(gx):
            ax = tx if x < 8 else gx - 8
            ay = ty if y < 4 else gy - 4
            lin = (x % tx) + (y % ty) * ax
            assert tuple(out[y, x]) == (ax, ay, lin, (lin // 32) * 100 + lin % 32, 22, tx), (x, y)


def test_simd_functions():
    src = """
      uint l = thread_index_in_simdgroup;
      float v = x[thread_position_in_grid.x];
      uint o = thread_position_in_grid.x * 8;
      out[o + 0] = simd_shuffle_down(v, 5);
      out[o + 1] = simd_shuffle_up(v, 3);
      out[o + 2] = simd_shuffle_xor(v, 6);
      out[o + 3] = simd_shuffle(v, (ushort)((l * 7) % 32));
      out[o + 4] = simd_prefix_exclusive_sum(v);
      out[o + 5] = simd_prefix_inclusive_sum(v);
      out[o + 6] = simd_max(v) + simd_min(v);
      out[o + 7] = simd_broadcast(v, 9) + float(uint64_t(simd_ballot(v > 0.0f)) == 0) + (simd_is_first() ? 1000.0f : 0.0f);
    """
    x = RNG.integers(-50, 50, 64).astype(np.float32)
    out = run("simd_fns", src, {"x": x}, (64 * 8,), (64, 1, 1), (64, 1, 1)).reshape(64, 8)
    for t in range(64):
        g, lane = divmod(t, 32)
        s = x[32 * g:32 * g + 32]
        exp = [s[lane + 5] if lane + 5 < 32 else s[lane], s[lane - 3] if lane >= 3 else s[lane], s[lane ^ 6],
               s[(lane * 7) % 32], s[:lane].sum(), s[:lane + 1].sum(), s.max() + s.min(),
               s[9] + float(not (s > 0).any()) + (1000.0 if lane == 0 else 0.0)]  # fmt: skip
        np.testing.assert_array_equal(out[t], np.array(exp, np.float32), err_msg=f"thread {t}")


def test_partial_simdgroup_reads_poison_from_missing_lanes():
    src = "out[thread_position_in_grid.x] = simd_shuffle_down(x[thread_position_in_grid.x], 4);"
    out = run("partial_sg", src, {"x": np.arange(40, dtype=np.float32)}, (40,), (40, 1, 1), (40, 1, 1))
    x = np.arange(40, dtype=np.float32)
    np.testing.assert_array_equal(out[:28], x[4:32])  # SIMD group 0: lane l reads lane l + 4 ...
    np.testing.assert_array_equal(out[28:32], x[28:32])  # ... except the top 4 lanes, which keep theirs
    np.testing.assert_array_equal(out[32:36], x[36:40])  # SIMD group 1 has only 8 lanes:
    assert np.isnan(out[36:]).all()  # its lanes 4..7 read lanes 8..11, which do not exist -> poison


def test_bfloat16_half_and_vectors():
    src = """
      uint i = thread_position_in_grid.x;
      bfloat16_t a = x[i];
      half h = half(float(a));
      float4 v = float4(float(a), 1.0f, float(h), 2.0f);
      float2 w = float2(v.x, v.w) * 2.0f + float2(0.5f);
      bfloat16_t s = a * a;                      // rounded to bfloat16
      out[i] = T(w.x + w.y + dot(v, float4(1.0f)) + float(s) + float(as_type<ushort>(a) & 1u));
    """
    xf = RNG.standard_normal(45).astype(np.float32)
    bits = (xf.view(np.uint32) >> 16).astype(np.uint16)  # truncate to bf16
    a = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    sq = (a * a).astype(np.float32).view(np.uint32).astype(np.uint64)
    s = (((sq + 0x7FFF + ((sq >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    h = a.astype(np.float16).astype(np.float64)
    ref = (2 * a + 0.5) + (2 * 2 + 0.5) + (a + 1 + h + 2) + s + (bits & 1)
    out = run("bf16_vec", src, {"x": bits}, (45,), (45, 1, 1), (32, 1, 1), template=[("T", "bfloat16")],
              out_dtype="bfloat16", input_dtypes={"x": "bfloat16"})  # fmt: skip
    compare("bf16_vec", "out", out, "bfloat16", ref, 8e-3, 1e-6)


def test_atomics_and_init_value():
    src = "atomic_fetch_add_explicit(&out[thread_position_in_grid.x % 4], x[thread_position_in_grid.x], memory_order_relaxed);"
    x = np.arange(64, dtype=np.uint32)
    k = metal_kernel("atomic_sum", ["x"], ["out"], src, atomic_outputs=True)
    out = k(inputs=[x], output_shapes=[(4,)], output_dtypes=["uint32"], grid=(64, 1, 1), threadgroup=(32, 1, 1),
            init_value=7)[0]  # fmt: skip
    np.testing.assert_array_equal(out, x.reshape(16, 4).sum(0) + 7)


def test_compiled_library_is_cached():
    k = metal_kernel("cached", ["x"], ["out"], "out[thread_position_in_grid.x] = x[thread_position_in_grid.x];")
    gen = k.generate([InputInfo("float32", 1, 8)], ["float32"])
    tu = translation_unit(gen, k.name)
    path = build.build(tu, gen.function_name)
    mtime = path.stat().st_mtime_ns
    t0 = time.perf_counter()
    assert build.build(tu, gen.function_name) == path
    assert time.perf_counter() - t0 < 0.5 and path.stat().st_mtime_ns == mtime
    assert build.build(tu + "\n", gen.function_name) != path  # any change is a new library


def test_simdgroup_matrix_multiply_and_layout():
    src = """
      const uint sg = simdgroup_index_in_threadgroup;  // one 8-row block of the output per SIMD group
      simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
      for (int k = 0; k < K; k += 8) {
        simdgroup_bfloat8x8 a;
        simdgroup_float8x8 b;
        simdgroup_load(a, A + sg * 8 * K + k, K);
        simdgroup_load(b, Bt + k, K, ulong2(0, 0), true);  // B given transposed, [8, K]
        simdgroup_multiply_accumulate(acc, a, b, acc);
      }
      simdgroup_store(acc, out + sg * 64, 8);
      simdgroup_float8x8 eye(2.0f);
      uint l = thread_index_in_simdgroup;
      layout[sg * 64 + l * 2] = eye.thread_elements()[0];
      layout[sg * 64 + l * 2 + 1] = eye.thread_elements()[1];
    """
    a = RNG.standard_normal((16, 24)).astype(np.float32)
    a_bits = (a.view(np.uint32) >> 16).astype(np.uint16)
    a_val = (a_bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    bt = RNG.standard_normal((8, 24)).astype(np.float32)
    k = metal_kernel("sg_matmul", ["A", "Bt"], ["out", "layout"], src)
    out, layout = k(inputs=[a_bits, bt], input_dtypes=["bfloat16", None], output_shapes=[(16, 8), (128,)],
                    output_dtypes=["float32", "float32"], grid=(64, 1, 1), threadgroup=(64, 1, 1),
                    template=[("K", 24)])  # fmt: skip
    compare("sg_matmul", "out", out, "float32", a_val @ bt.T.astype(np.float64) + 1.0, 1e-5, 1e-5)
    for lane in range(32):  # Apple's per-lane element layout, seen through the diagonal matrix
        row = (lane // 4 & 4) + (lane // 2) % 4
        col = (lane // 4 & 2) * 2 + (lane % 2) * 2
        assert tuple(layout[2 * lane:2 * lane + 2]) == (2.0 * (row == col), 2.0 * (row == col + 1))


def test_endless_loop_times_out():
    src = "uint i = 0; while (x[i % 2] > 0.0f) { i += 2; } out[0] = float(i);"  # spins forever
    with raises("spin", "timeout"):
        run("spin", src, {"x": np.ones(2, np.float32)}, (1,), (1, 1, 1), (1, 1, 1), timeout_s=0.3)


def test_misaligned_vector_load_is_caught():
    src = "float4 v = *((const device float4*)(x + 1)); out[0] = v.x + v.y + v.z + v.w;"
    with raises("misaligned", "misaligned_access"):
        run("misaligned", src, {"x": np.ones(16, np.float32)}, (1,), (1, 1, 1), (1, 1, 1))


def test_exited_lanes_may_sit_out_simd_functions_when_allowed():
    src = "uint i = thread_position_in_grid.x; if (i >= 20) return; out[i] = simd_sum(x[i]);"
    x = np.arange(32, dtype=np.float32)
    with raises("exit_then_sum", "simd_divergence"):
        run("exit_then_sum", src, {"x": x}, (32,), (32, 1, 1), (32, 1, 1))
    out = run("exit_then_sum", src, {"x": x}, (32,), (32, 1, 1), (32, 1, 1), exited_lanes_in_simd_ok=True)
    np.testing.assert_array_equal(out[:20], np.full(20, x[:20].sum(), np.float32))


@pytest.mark.parametrize("name, src, check", [
    ("shift_too_far", "uint s = uint(x[0]); out[0] = float(1u << s);", "shift_out_of_range"),
    ("divide_by_zero", "int d = int(x[1]) - 40; out[0] = float(7 / d);", "integer_division"),
])  # fmt: skip
def test_undefined_integer_operations_are_caught(name, src, check):
    with raises(name, check) as e:
        run(name, src, {"x": np.full(4, 40, np.float32)}, (1,), (1, 1, 1), (1, 1, 1))
    assert f"{name}.metal:4:" in str(e.value)  # the location in the MLX text


def test_builtin_coverage():
    """Instantiate many shim templates (lazily compiled otherwise) and check a few values."""
    src = """
      uint l = thread_index_in_simdgroup;
      float f = x[l];
      half h = half(f);
      bfloat16_t b = bfloat16_t(f);
      float4 v4 = float4(f, 2.0f * f, -f, 1.0f);
      half4 h4 = half4(v4);
      bfloat4 b4 = bfloat4(v4);
      uint2 u2 = uint2(l, 2u * l);
      int2 i2 = int2(u2) - int2(3);
      float acc = 0.0f;
      acc += simd_sum(f) + float(simd_sum(h)) + float(simd_sum(b)) + simd_max(v4).y + simd_min(v4).z;
      acc += float(simd_prefix_exclusive_sum(int(l))) + float(simd_shuffle_xor(v4, 1).x);
      acc += simd_broadcast_first(f) + float(simd_product(l == 0 ? 2u : 1u)) + float(simd_or(l));
      acc += float(simd_all(f == f)) + float(simd_any(f > 1e30f));
      acc += metal::fast::exp(f) - metal::precise::exp(f) + float(exp(b)) - float(exp(float(b)));
      acc += clamp(f, -1.0f, 1.0f) + mix(0.0f, f, 0.5f) + step(0.0f, f) + sign(f) + fma(f, f, 1.0f);
      acc += rsqrt(abs(v4) + 1.0f).x + dot(h4, half4(1.0h)) + float(dot(b4, bfloat4(1.0f)));
      acc += max(v4, 0.5f).w + min(u2, uint2(1)).x + float(abs(i2).y) + float(max(i2.x, -1));
      acc += float(popcount(u2.y)) + float(extract_bits(0xF0u, 4u, 4u)) + float(clz(1u)) + float(ctz(8u));
      acc += float(select(float4(1.0f), float4(2.0f), v4 > 0.0f).x) + float(all(v4 == v4)) + float(any(u2 > 100u));
      acc += float(isnan(f)) + float(isinf(-INFINITY)) + float(Limits<bfloat16_t>::max > 0.0f);
      acc += float(numeric_limits<half>::infinity() > h) + as_type<float>(as_type<uint>(f)) - f;
      acc += float(as_type<half2>(uint(0x3C003C00u)).y) + float(h * h) - f * f + float(b * 2);
      acc += (sizeof(float3) == 16 ? 1.0f : 0.0f) + (alignof(half4) == 8 ? 1.0f : 0.0f);
      acc += float(tanh(h)) + metal::precise::tanh(f) + float(fmax(h, half(0))) + float(ceil(b4).x);
      threadgroup atomic_uint counter;
      if (l == 0) atomic_store_explicit(&counter, 0u, memory_order_relaxed);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      atomic_fetch_max_explicit(&counter, l, memory_order_relaxed);
      threadgroup_barrier(mem_flags::mem_threadgroup | mem_flags::mem_device);
      acc += float(atomic_load_explicit(&counter, memory_order_relaxed));
      simdgroup_barrier(mem_flags::mem_none);
      device float* o = out + l * 8;
      o[0] = simd_sum(f);
      o[1] = float(simd_sum(b));
      o[2] = float(simd_prefix_exclusive_sum(int(l)));
      o[3] = simd_shuffle_xor(v4, 1).y;
      o[4] = float(extract_bits(0xF0u, 4u, 4u)) + float(clz(1u)) + float(ctz(8u));
      o[5] = float(dot(h4, half4(1.0h)));
      o[6] = float(atomic_load_explicit(&counter, memory_order_relaxed));
      o[7] = acc;
    """
    x = np.linspace(-1.5, 1.5, 32).astype(np.float32)
    out = run("builtins", src, {"x": x}, (256,), (32, 1, 1), (32, 1, 1)).reshape(32, 8)
    lanes = np.arange(32)
    bf = (x.view(np.uint32) + 0x7FFF + ((x.view(np.uint32) >> 16) & 1)) >> 16 << 16
    np.testing.assert_allclose(out[:, 0], x.sum(dtype=np.float64), atol=1e-5)
    np.testing.assert_allclose(out[:, 1], bf.view(np.float32).sum(dtype=np.float64), atol=0.1)
    np.testing.assert_array_equal(out[:, 2], lanes * (lanes - 1) / 2)
    np.testing.assert_array_equal(out[:, 3], 2 * x[lanes ^ 1])
    np.testing.assert_array_equal(out[:, 4], 15 + 31 + 3)
    np.testing.assert_allclose(out[:, 5], 2 * x.astype(np.float16).astype(np.float64) + 1, rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(out[:, 6], 31)
    assert np.isfinite(out[:, 7]).all()
