"""gemma4_mlx.blas: fast-BLAS preload under MLX's Linux CPU backend.

Every check runs in a child process: the BLAS has to be loaded before mlx.core is first imported,
and which library libmlx binds is a property of the whole process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux CPU backend only")

# Prints what the process ended up with: blas.active(), the library libmlx's cblas_sgemm slot is
# bound to, every mapped file, and the dtype/strategy decisions.
PROBE = """
import json
import gemma4_mlx
from gemma4_mlx import blas
import mlx.core as mx
info = blas.active()
a = mx.ones((64, 64), dtype=mx.float32)
mx.eval(mx.matmul(a, a, stream=mx.cpu))
maps = set()
for line in open("/proc/self/maps"):
    parts = line.split(None, 5)
    if len(parts) == 6 and parts[5].strip().startswith("/"):
        maps.add(parts[5].strip())
print(json.dumps({"info": info, "provider": blas.sgemm_provider(), "maps": sorted(maps),
                  "describe": blas.describe(), "dtype": str(blas.cpu_compute_dtype()),
                  "q1": blas.quantized_matmul_strategy(1),
                  "q512": blas.quantized_matmul_strategy(512)}))
"""

# f32 "logits" of a small residual MLP + tied head through MLX's CPU matmuls, saved to argv[1].
LOGITS = """
import sys
import numpy as np
import gemma4_mlx
import mlx.core as mx
import mlx.nn as nn
rng = np.random.default_rng(7)
hidden, ffn, vocab = 256, 768, 4096
x = mx.array(rng.standard_normal((9, hidden), dtype=np.float32))
w_up = mx.array(rng.standard_normal((ffn, hidden), dtype=np.float32) / 16)
w_down = mx.array(rng.standard_normal((hidden, ffn), dtype=np.float32) / 28)
emb = mx.array(rng.standard_normal((vocab, hidden), dtype=np.float32) / 16)
with mx.stream(mx.cpu):
    h = x + nn.gelu_approx(x @ w_up.T) @ w_down.T
    logits = mx.concatenate([h @ emb.T, h[-1:] @ emb.T])  # prefill rows and one decode row
    np.save(sys.argv[1], np.array(logits))
"""


def run_child(code: str, tmp_path, blas_env: str | None = None, args=()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GEMMA4_MLX_BLAS")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # no verdicts from earlier runs
    if blas_env is not None:
        env["GEMMA4_MLX_BLAS"] = blas_env
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def probe(tmp_path, blas_env: str | None = None) -> tuple[dict, str]:
    proc = run_child(PROBE, tmp_path, blas_env)
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def bundled_reference(path: str | None) -> bool:
    return path is not None and "mlx" in path and os.path.basename(path).startswith("libblas")


@pytest.fixture(scope="module")
def fast_blas_path() -> str:
    """The library preload() will pick; CI must have one (Debian OpenBLAS or the mkl extra)."""
    from gemma4_mlx import blas

    path = blas._find_mkl() or blas._find_openblas()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("no optimized BLAS installed: .ci/run must install libopenblas0-pthread")
        pytest.skip("no optimized BLAS installed (apt-get install libopenblas0-pthread)")
    return path


@linux_only
def test_fast_blas_is_the_one_mlx_calls(tmp_path, fast_blas_path):
    out, stderr = probe(tmp_path)
    info = out["info"]
    provider = out["provider"]
    assert "BlasWarning" not in stderr
    assert info["verified"] and info["fast"], info
    assert info["source"] in ("mkl", "openblas")
    # libmlx's cblas_sgemm GOT slot points into the preloaded library, not the bundled netlib one
    assert provider is not None and not bundled_reference(provider), provider
    assert provider == os.path.realpath(fast_blas_path) or info["source"] == "openblas"
    assert provider in out["maps"]
    assert any(bundled_reference(p) for p in out["maps"])  # still mapped (libmlx NEEDs it), unused
    assert out["dtype"] == "mlx.core.float32"
    assert (out["q1"], out["q512"]) == ("quantized_matmul", "dequantize_f32")
    assert "(verified)" in out["describe"]
    assert info["max_rel_err"] < 1e-5
    # the child-process verdict was cached for the next import
    cache = json.loads((tmp_path / "cache" / "gemma4-mlx" / "blas-verified.json").read_text())
    assert any(v.get("ok") and v.get("provider") == provider for v in cache.values())


@linux_only
def test_off_keeps_reference_blas_silently(tmp_path):
    out, stderr = probe(tmp_path, blas_env="off")
    assert "BlasWarning" not in stderr
    assert bundled_reference(out["provider"]), out["provider"]
    assert not out["info"]["fast"] and not out["info"]["verified"]
    assert out["dtype"] == "mlx.core.bfloat16"
    assert (out["q1"], out["q512"]) == ("quantized_matmul", "quantized_matmul")


@linux_only
def test_logits_with_fast_blas_equal_reference_blas(tmp_path, fast_blas_path):
    ref_file, fast_file = tmp_path / "ref.npy", tmp_path / "fast.npy"
    run_child(LOGITS, tmp_path, blas_env="off", args=[str(ref_file)])
    run_child(LOGITS, tmp_path, blas_env=fast_blas_path, args=[str(fast_file)])
    ref, fast = np.load(ref_file), np.load(fast_file)
    assert ref.dtype == np.float32 and ref.shape == (10, 4096)
    assert not np.array_equal(ref, fast)  # different summation order: really two BLASes
    np.testing.assert_allclose(fast, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))
    assert np.array_equal(fast.argmax(-1), ref.argmax(-1))


@linux_only
def test_explicit_path_is_used(tmp_path, fast_blas_path):
    out, _ = probe(tmp_path, blas_env=fast_blas_path)
    assert out["info"]["source"] == "env" and out["info"]["verified"]
    assert out["info"]["path"] == fast_blas_path


@linux_only
def test_warns_once_when_mlx_core_came_first(tmp_path):
    proc = run_child("import mlx.core\nimport gemma4_mlx\nimport gemma4_mlx.blas\n", tmp_path)
    assert proc.stderr.count("BlasWarning") == 1 and "imported before gemma4_mlx" in proc.stderr
    silenced = run_child("import warnings\nwarnings.filterwarnings('ignore', module='gemma4_mlx.blas')\n"
                         "import mlx.core\nimport gemma4_mlx\n", tmp_path)
    assert "BlasWarning" not in silenced.stderr


@linux_only
def test_missing_explicit_path_warns_and_carries_on(tmp_path):
    out, stderr = probe(tmp_path, blas_env=str(tmp_path / "no-such-libblas.so"))
    assert "BlasWarning" in stderr and "no such file" in stderr
    assert bundled_reference(out["provider"])


@linux_only
@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_wrong_blas_is_rejected_before_loading(tmp_path):
    """A library whose cblas_sgemm writes zeros fails the child check and is never loaded here."""
    src = tmp_path / "zero_blas.c"
    src.write_text(
        "void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha,\n"
        "                 const float *a, int lda, const float *b, int ldb, float beta,\n"
        "                 float *c, int ldc) {\n"
        "  for (int i = 0; i < m; i++) for (int j = 0; j < n; j++)\n"
        "    c[order == 101 ? i * ldc + j : j * ldc + i] = 0.0f;\n"
        "}\n")
    lib = tmp_path / "libzero_blas.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True)
    out, stderr = probe(tmp_path, blas_env=str(lib))
    assert "BlasWarning" in stderr and "no BLAS passed the check" in stderr
    assert str(lib) not in out["maps"]
    assert bundled_reference(out["provider"])
    assert not out["info"]["verified"]


@linux_only
def test_got_slot_lookup_in_libmlx():
    import mlx.core  # noqa: F401
    from gemma4_mlx import blas

    libmlx = blas._loaded_library("libmlx.so")
    assert libmlx is not None
    assert isinstance(blas._got_slot(libmlx, "cblas_sgemm"), int)
    assert isinstance(blas._got_slot(libmlx, "sgetrf_"), int)
    assert blas._got_slot(libmlx, "no_such_symbol_gemma4") is None


@linux_only
def test_nothing_found_warns_once_and_carries_on(tmp_path):
    code = f"""
import importlib.util, json, warnings
spec = importlib.util.spec_from_file_location("blas_copy", {os.path.join(ROOT, "gemma4_mlx", "blas.py")!r})
blas = importlib.util.module_from_spec(spec)
spec.loader.exec_module(blas)
blas._find_mkl = blas._find_openblas = lambda: None
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    blas.preload()
    blas.preload()
info = blas.active()
print(json.dumps({{"warnings": [str(w.message) for w in caught], "info": info}}))
"""
    proc = run_child(code, tmp_path)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["warnings"]) == 1 and "no optimized BLAS found" in out["warnings"][0]
    assert bundled_reference(out["info"]["provider"]) and not out["info"]["verified"]
