"""The native CPU matvec (gemma4_mlx/cpu_matvec.c): exact against float64 numpy, strict argument
checks, and the model's tied head through it equal to MLX's own matmul path."""

import shutil
import sysconfig

import mlx.core as mx
import numpy as np
import pytest

from fixtures import probe_ids
from gemma4_mlx import cpu_matvec
from gemma4_mlx.cache import make_cache
from gemma4_mlx.checkpoint import load_gguf, load_hf
from gemma4_mlx.compiled_step import CompiledDecoder
from gemma4_mlx.generate import generate_step

SIMD = ("auto", "scalar")


def _compiler_present() -> bool:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return any(shutil.which(c) for c in (cc, "cc", "gcc", "clang"))


@pytest.fixture
def native():
    """The extension module, restored to its run-time SIMD choice afterwards."""
    if not cpu_matvec.available() and not _compiler_present():
        pytest.skip("no C compiler: the extension is optional there")
    from gemma4_mlx import _cpu_matvec

    yield _cpu_matvec
    _cpu_matvec.set_simd("auto")


def _rel_err(got, ref) -> float:
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


def test_extension_is_built_where_a_compiler_is():
    if not _compiler_present():
        pytest.skip("no C compiler on this machine")
    assert cpu_matvec.available(), cpu_matvec.unavailable_reason()
    from gemma4_mlx import _cpu_matvec

    assert _cpu_matvec.simd() in ("avx2+fma", "scalar")
    assert cpu_matvec.describe().startswith("CPU matvec: native")


@pytest.mark.parametrize("simd", SIMD)
def test_float_weights_match_float64(native, simd):
    native.set_simd(simd)
    rng = np.random.default_rng(1)
    # N = 4 * 64 * 2 + 13: not a multiple of the 64-row chunks nor of the 4-row blocks;
    # K = 37 and 264 (= 8 * 33): a scalar tail after the 8-wide loop, and none
    for K in (37, 264):
        w = rng.standard_normal((525, K)).astype(np.float32)
        w16 = (w.view(np.uint32) >> 16).astype(np.uint16)  # bf16 bits (truncated)
        for M in range(1, 9):
            x = rng.standard_normal((M, K)).astype(np.float32)
            for weight, ref in ((w, cpu_matvec.reference_matmul(x, w)), (w16, cpu_matvec.reference_matmul(x, w16))):
                for threads in (1, 3):
                    out = np.full((M, 525), np.nan, np.float32)
                    fn = native.matmul_f32 if weight.dtype == np.float32 else native.matmul_bf16
                    fn(x, weight, out, threads)
                    assert _rel_err(out, ref) < 2e-6, (simd, K, M, weight.dtype, threads)


@pytest.mark.parametrize("simd", SIMD)
@pytest.mark.parametrize("bits", (4, 8))
def test_affine_weights_match_float64(native, simd, bits):
    native.set_simd(simd)
    rng = np.random.default_rng(2)
    K, N = 288, 203  # K = 9 groups of 32 (odd), N prime
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
    packed, scales, biases = (np.array(a) for a in mx.quantize(w, group_size=32, bits=bits))
    # the numpy unpacking is MLX's own layout
    deq = np.array(mx.dequantize(mx.array(packed), mx.array(scales), mx.array(biases), group_size=32, bits=bits))
    assert np.abs(cpu_matvec.dequantize_affine_np(packed, scales, biases, bits) - deq).max() < 1e-6
    for M in range(1, 9):
        x = rng.standard_normal((M, K)).astype(np.float32)
        ref = cpu_matvec.reference_affine(x, packed, scales, biases, bits)
        out = np.empty((M, N), np.float32)
        native.matmul_affine(x, packed, scales, biases, out, bits, 2)
        assert _rel_err(out, ref) < 2e-6, (simd, M)


def test_mlx_wrappers(native):
    rng = np.random.default_rng(3)
    x = mx.array(rng.standard_normal((2, 3, 64)).astype(np.float32)).astype(mx.bfloat16)  # 6 rows, bf16
    w = mx.array(rng.standard_normal((100, 64)).astype(np.float32))
    x64 = np.array(x.astype(mx.float32)).reshape(6, 64)
    y = cpu_matvec.matmul(x, w)
    assert y.dtype == mx.float32 and y.shape == (2, 3, 100)
    assert _rel_err(np.array(y).reshape(6, 100), cpu_matvec.reference_matmul(x64, np.array(w))) < 2e-6
    wb = w.astype(mx.bfloat16)
    yb = cpu_matvec.matmul(x[0, 0], wb)
    assert yb.shape == (100,)
    assert _rel_err(yb, cpu_matvec.reference_matmul(x64[:1], np.array(wb.view(mx.uint16)))[0]) < 2e-6
    q = mx.quantize(w, group_size=32, bits=4)
    ya = cpu_matvec.matmul_affine(x[:, :1], *q, 4)
    assert ya.shape == (2, 1, 100)
    ref = cpu_matvec.reference_affine(x64[[0, 3]], *(np.array(a) for a in q), 4)
    assert _rel_err(np.array(ya).reshape(2, 100), ref) < 2e-6
    with pytest.raises(ValueError, match="1..8 rows"):
        cpu_matvec.matmul(mx.zeros((9, 64)), w)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_matvec.matmul(x, w.astype(mx.float16))


def test_bad_arguments_raise(native):
    f32 = np.float32
    x, w, out = np.ones((2, 64), f32), np.ones((10, 64), f32), np.empty((2, 10), f32)
    native.matmul_f32(x, w, out, 2)  # the good call
    bad = [
        ((x.astype(np.float64), w, out), "x must be float32"),
        ((x, w.astype(np.float64), out), "w must be float32"),
        ((x, w, out.astype(np.float64)), "out must be float32"),
        ((x, np.ones((10, 63), f32), out), "columns"),
        ((np.ones((9, 64), f32), w, np.empty((9, 10), f32)), "1..8 rows"),
        ((np.ones((0, 64), f32), w, np.empty((0, 10), f32)), "1..8 rows"),
        ((x, w, np.empty((2, 11), f32)), "out must have shape"),
        ((x, w, np.empty((1, 10), f32)), "out must have shape"),
        ((np.ones(64, f32), w, out), "2-D"),
        ((np.ones((64, 2), f32).T, w, out), "C-contiguous"),
        ((x, np.ones((64, 10), f32).T, out), "C-contiguous"),
        ((x, w, np.empty((10, 2), f32).T), "C-contiguous"),
        ((x, w, memoryview(out.tobytes()).cast("B").cast("f", (2, 10))), "writable"),
        ((x, w.astype(">f4"), out), "w must be float32"),  # big-endian: not this machine's floats
        # MLX arrays export views with their real strides whatever the request: checked here
        ((x, _evaluated(mx.ones((64, 10)).T), out), "C-contiguous"),
        ((x, _evaluated(mx.broadcast_to(mx.ones((1, 64)), (1 << 20, 64))), np.empty((2, 1 << 20), f32)),
         "C-contiguous"),
        ((x, w, out, "2"), None),
    ]
    for args, match in bad:
        if match is None:
            with pytest.raises(TypeError):
                native.matmul_f32(*args)
            continue
        with pytest.raises(ValueError, match=match):
            native.matmul_f32(*args[:3], 2)
    with pytest.raises(ValueError, match="bfloat16 bits"):
        native.matmul_bf16(x, w, out, 2)
    packed, scales = np.zeros((10, 8), np.uint32), np.ones((10, 2), f32)
    native.matmul_affine(x, packed, scales, scales, out, 4, 2)  # the good call
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        native.matmul_affine(x, packed, scales, scales, out, 5, 2)
    with pytest.raises(ValueError, match="words per row"):
        native.matmul_affine(x, packed, scales, scales, out, 8, 2)
    with pytest.raises(ValueError, match="packed uint32"):
        native.matmul_affine(x, packed.view(np.int32), scales, scales, out, 4, 2)
    with pytest.raises(ValueError, match="scales and biases must have shape"):
        native.matmul_affine(x, packed, scales[:, :1].copy(), scales, out, 4, 2)
    with pytest.raises(ValueError, match="float32"):
        native.matmul_affine(x, packed, scales.astype(np.float16), scales, out, 4, 2)
    with pytest.raises(ValueError, match="multiple of the group size"):
        native.matmul_affine(np.ones((2, 48), f32), np.zeros((10, 6), np.uint32), np.ones((10, 1), f32),
                             np.ones((10, 1), f32), out, 4, 2)


# ---------------------------------------------------------------------------------------------
# the model's tied head


def _mlx_head(model, y):
    """The head through MLX's own matmul (what logits() does without the native path)."""
    logits = model.model.embed_tokens.as_linear(y).astype(mx.float32)
    cap = model.cfg.final_logit_softcapping
    return mx.tanh(logits / cap) * cap


@pytest.mark.parametrize("fmt", ("f32", "bf16", "q4_0"))
def test_model_head_native_equals_mlx(native, dense_fixture, fmt):
    if fmt == "q4_0":
        model, _ = load_gguf(dense_fixture.gguf("q4_0"), dtype=mx.float32, progress=False, weight_format="affine")
    else:
        model = load_hf(dense_fixture.hf_dir, dtype=mx.float32 if fmt == "f32" else mx.bfloat16, progress=False)
    ids = mx.array(probe_ids(5, seed=31, vocab=model.cfg.vocab_size))
    y = model.model(ids)  # [1, 5, H]
    assert model.native_head_ready(y) and not model.native_head_ready(mx.concatenate([y, y], axis=1))
    got = model.logits(y)
    assert got.dtype == mx.float32 and got.shape == (1, 5, model.cfg.vocab_size)
    if fmt == "bf16":  # MLX rounds a bf16 matmul's output to bf16; the native sums stay f32
        w = np.array(model.model.embed_tokens.weight.astype(mx.float32), np.float64)
        ref = np.array(y.astype(mx.float32), np.float64)[0] @ w.T
        ref = np.tanh(ref / 30.0) * 30.0
        assert np.abs(np.array(got)[0] - ref).max() < 1e-4
        assert np.abs(np.array(got) - np.array(_mlx_head(model, y))).max() < 0.2
    else:
        want = np.array(_mlx_head(model, y))
        assert np.abs(np.array(got) - want).max() <= 1e-5 * np.abs(want).max()


def test_head_inside_compile_falls_back(native, dense_fixture):
    model = load_hf(dense_fixture.hf_dir, dtype=mx.float32, progress=False)
    y = model.model(mx.array(probe_ids(3, seed=32, vocab=model.cfg.vocab_size)))
    compiled = mx.compile(model.logits)(y)  # the MLX matmul inside the trace: no eval error
    assert np.abs(np.array(compiled) - np.array(model.logits(y))).max() < 1e-4


def test_greedy_tokens_native_equal_mlx(native, dense_fixture, monkeypatch):
    model = load_hf(dense_fixture.hf_dir, dtype=mx.float32, progress=False)
    prompt = probe_ids(12, seed=33, vocab=model.cfg.vocab_size)[0].tolist()
    cache = make_cache(model.cfg)
    model(mx.array([prompt]), cache)
    assert CompiledDecoder(model, cache, capacity=256).head_outside  # the body compiled, the head native
    native_tokens = [t for t, _ in generate_step(prompt, model, max_tokens=24)]
    monkeypatch.setenv(cpu_matvec.ENV_VAR, "off")
    assert not model.native_head_ready()
    cache = make_cache(model.cfg)
    model(mx.array([prompt]), cache)
    assert not CompiledDecoder(model, cache, capacity=256).head_outside
    mlx_tokens = [t for t, _ in generate_step(prompt, model, max_tokens=24)]
    assert native_tokens == mlx_tokens
    assert len(set(native_tokens)) > 3  # not one token repeated: the comparison means something


def test_head_reads_an_exact_bf16_copy_only(native, dense_fixture, monkeypatch):
    model = load_hf(dense_fixture.hf_dir, dtype=mx.float32, progress=False)  # bf16 checkpoint in f32
    emb = model.model.embed_tokens
    head = cpu_matvec._head_weight(model, emb.weight)
    assert head.dtype == mx.bfloat16 and mx.array_equal(head.astype(mx.float32), emb.weight)
    assert "_head_bf16" not in model.parameters()  # a cache, not a parameter
    monkeypatch.setenv("GEMMA4_MLX_CPU_HEAD_BF16", "0")
    assert cpu_matvec._head_weight(model, emb.weight) is emb.weight
    monkeypatch.delenv("GEMMA4_MLX_CPU_HEAD_BF16")
    emb.weight = emb.weight * 1.001  # no longer bf16 numbers: the head must read f32
    assert cpu_matvec._head_weight(model, emb.weight) is emb.weight
    y = model.model(mx.array([[2, 300, 301]]))
    want = np.array(_mlx_head(model, y))
    assert np.abs(np.array(model.logits(y)) - want).max() <= 1e-5 * np.abs(want).max()


def test_sgemm_hook_serves_mlx_matvecs_and_forwards_the_rest(native):
    if not cpu_matvec.install_sgemm_hook():
        reason = cpu_matvec.hook_status()["reason"]
        from gemma4_mlx import blas

        if blas._mlx_cpu_blas_in_use():  # MLX's Linux CPU build: the hook must go in
            pytest.fail(reason)
        pytest.skip(reason)
    assert cpu_matvec.describe().endswith("MLX f32 matmuls too")
    rng = np.random.default_rng(4)
    w = rng.standard_normal((300, 72), dtype=np.float32)
    for m, served in ((1, 1), (8, 1), (9, 0), (64, 0)):
        x = rng.standard_normal((m, 72), dtype=np.float32)
        before = cpu_matvec.hook_status()["calls"]
        got = np.array(mx.matmul(mx.array(x), mx.array(w).T, stream=mx.cpu))
        assert cpu_matvec.hook_status()["calls"] - before == served, m
        assert _rel_err(got, cpu_matvec.reference_matmul(x, w)) < 2e-6, m
    x = rng.standard_normal((2, 300), dtype=np.float32)  # x @ W (B not transposed): forwarded
    before = cpu_matvec.hook_status()["calls"]
    got = np.array(mx.matmul(mx.array(x), mx.array(w), stream=mx.cpu))
    assert cpu_matvec.hook_status()["calls"] == before
    assert _rel_err(got, x.astype(np.float64) @ w.astype(np.float64)) < 2e-6
    cpu_matvec.set_hook_enabled(False)
    try:
        before = cpu_matvec.hook_status()["calls"]
        mx.eval(mx.matmul(mx.array(w[:1]), mx.array(w).T, stream=mx.cpu))
        assert cpu_matvec.hook_status()["calls"] == before
    finally:
        cpu_matvec.set_hook_enabled(True)


def test_quantized_linear_native_at_decode_rows(native, dense_fixture):
    """Q4_0 / Q8_0 linears on the CPU: 1..8 rows through the native matvec equal mx.quantized_matmul
    (f32 activations: same numbers up to summation order); inside mx.compile they fall back to MLX."""
    from gemma4_mlx.quantized import QuantizedLinear

    for qtype in ("q4_0", "q8_0"):
        model, _ = load_gguf(dense_fixture.gguf(qtype), dtype=mx.float32, progress=False, weight_format="affine")
        layer = model.layers[0].mlp.gate_proj
        assert isinstance(layer, QuantizedLinear)
        for rows in (1, 5, 8):
            x = mx.random.normal((1, rows, layer.weight.shape[1] * 32 // layer.bits), key=mx.random.key(rows))
            want = mx.quantized_matmul(x, layer.weight, layer.scales, layer.biases, transpose=True,
                                       group_size=32, bits=layer.bits)
            got = cpu_matvec.affine_linear(layer, x)
            assert got is not None and got.shape == want.shape
            assert np.abs(np.array(got) - np.array(want)).max() <= 1e-5 * np.abs(np.array(want)).max()
        assert cpu_matvec.affine_linear(layer, mx.zeros((9, x.shape[-1]))) is None  # prefill: MLX/BLAS
        compiled = mx.compile(layer)(x)  # the fallback inside the trace, not an eval error
        assert np.abs(np.array(compiled) - np.array(layer(x))).max() <= 1e-5 * np.abs(np.array(want)).max()


def test_quantized_model_decodes_eagerly_with_the_same_tokens(native, dense_fixture, monkeypatch):
    model, _ = load_gguf(dense_fixture.gguf("q4_0"), dtype=mx.float32, progress=False, weight_format="affine")
    assert not cpu_matvec.decode_eagerly(model)  # linears this small: the compiled step is faster
    monkeypatch.setattr(cpu_matvec, "EAGER_MIN_WEIGHTS", 0)
    assert cpu_matvec.decode_eagerly(model)
    assert not cpu_matvec.decode_eagerly(load_hf(dense_fixture.hf_dir, dtype=mx.float32, progress=False))
    prompt = probe_ids(12, seed=34, vocab=model.cfg.vocab_size)[0].tolist()
    native_tokens = [t for t, _ in generate_step(prompt, model, max_tokens=24)]
    monkeypatch.setenv(cpu_matvec.ENV_VAR, "off")
    assert not cpu_matvec.decode_eagerly(model)  # back to the compiled step with mx.quantized_matmul
    mlx_tokens = [t for t, _ in generate_step(prompt, model, max_tokens=24)]
    assert native_tokens == mlx_tokens and len(set(native_tokens)) > 3


def test_gradients_through_the_native_paths_are_mlx_gradients(native, dense_fixture, monkeypatch):
    """mx.grad through a native call (which runs outside MLX's graph) uses MLX's own vjp: equal to
    the gradients with the native matvec off, never silently zero."""
    from gemma4_mlx.quantized import QuantizedLinear

    qmodel, _ = load_gguf(dense_fixture.gguf("q4_0"), dtype=mx.float32, progress=False, weight_format="affine")
    layer = qmodel.layers[0].mlp.gate_proj
    assert isinstance(layer, QuantizedLinear)
    fmodel = load_hf(dense_fixture.hf_dir, dtype=mx.float32, progress=False)
    x = mx.random.normal((1, 2, fmodel.cfg.hidden_size), key=mx.random.key(7))

    def grads():
        gx = mx.grad(lambda v: layer(v).sum())(x)
        gy = mx.grad(lambda v: (fmodel.logits(v) ** 2).sum())(x)
        gw = mx.grad(lambda w: (fmodel.model.embed_tokens.as_linear(x) * 0 + _head_with(fmodel, w, x)).sum())(
            fmodel.model.embed_tokens.weight)
        return [np.array(g) for g in (gx, gy, gw)]

    native_grads = grads()
    monkeypatch.setenv(cpu_matvec.ENV_VAR, "off")
    mlx_grads = grads()
    for a, b in zip(native_grads, mlx_grads):
        assert np.abs(b).max() > 0
        assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


def _head_with(model, weight, y):
    """The head logits with `weight` as the tied embedding (for a gradient with respect to it)."""
    emb = model.model.embed_tokens
    saved, emb.weight = emb.weight, weight
    try:
        return model.logits(y)
    finally:
        emb.weight = saved


def _evaluated(a):
    mx.eval(a)
    return a
