"""Fast BLAS for MLX's Linux CPU backend, and the CPU compute-dtype decisions that follow from it.

MLX's Linux CPU wheel (``mlx-cpu``) links the netlib *reference* BLAS/LAPACK it bundles in
``site-packages/mlx_cpu.libs``. ``libmlx.so`` imports ``cblas_sgemm`` (every float32 matmul goes
through it, M = 1 included: it imports no gemv), ``cblas_dgemm``/``cblas_cgemm`` and LAPACK
routines (``sgetrf_``, ``ssyevd_``, ...) and binds them lazily through its PLT, searching the
process's *global* symbol scope before its own dependencies. So a library that exports the
standard ``cblas_*`` / LAPACK symbols and is loaded with ``RTLD_GLOBAL`` *before* ``mlx.core`` is
first imported takes those calls over (20-40x faster GEMMs on a 2-core x86 machine; see
bench/NOTES.md). bf16/fp16 matmuls use MLX's own kernels and never reach BLAS.

``preload()`` runs when ``gemma4_mlx`` is imported and picks, in this order:

1. ``GEMMA4_MLX_BLAS=/path/to/lib.so`` (explicit); ``GEMMA4_MLX_BLAS=off`` disables the step and
   its warnings;
2. ``libmkl_rt`` of the ``mkl`` PyPI package (``pip install gemma4-mlx[cpu-fast]``);
3. a system OpenBLAS (Debian/Ubuntu: ``apt-get install libopenblas0-pthread``).

A candidate is loaded here only after a child process has loaded it the same way, run small f32
GEMMs through MLX and matched numpy (float64): a BLAS that crashes or computes wrong results on
this CPU is never loaded into this process. The verdict is cached per library file, mlx version,
CPU and ``OPENBLAS_*``/``MKL_*`` settings under ``$XDG_CACHE_HOME/gemma4-mlx/`` (default
``~/.cache``), so the child runs once. ``active()`` then re-checks in this process (a small GEMM
against numpy, and which library libmlx's ``cblas_sgemm`` slot is actually bound to).

When ``mlx.core`` was imported before ``gemma4_mlx``, or no BLAS is found, a ``BlasWarning`` is
issued once and MLX keeps the reference BLAS. Silence it with ``GEMMA4_MLX_BLAS=off`` or
``warnings.filterwarnings("ignore", module="gemma4_mlx.blas")``. Nothing happens on macOS or
with a CUDA build of MLX (unless ``GEMMA4_MLX_BLAS`` names a library explicitly).

This module imports only the standard library at top level (it must run before ``mlx.core``);
``python gemma4_mlx/blas.py --verify PATH`` is the child-process check.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import json
import os
import struct
import sys
import warnings

ENV_VAR = "GEMMA4_MLX_BLAS"
_OFF_VALUES = {"off", "0", "no", "none", "false", "reference"}
# settings that change which kernels a BLAS runs: part of the verification cache key
_KERNEL_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_VERBOSE", "MKL_DEBUG_CPU_TYPE",
               "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "MKL_THREADING_LAYER", "MKL_INTERFACE_LAYER")
_OPENBLAS_NAMES = ("libopenblas.so.0", "libopenblasp.so.0", "libopenblas.so", "libopenblasp.so")
_OPENBLAS_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                  "/usr/lib", "/usr/local/lib")
_VERIFY_TIMEOUT_S = 120
# relative error (max |mlx - numpy float64| / max |numpy|) a correct f32 GEMM stays far below
_GEMM_TOL = 1e-5

# Rows M of the activation from which a Q4_0/Q8_0 layer is faster dequantized to f32 + BLAS GEMM
# than through mx.quantized_matmul (MLX's CPU kernel: ~1.6 GFLOP/s, linear in M). Measured with
# bench/cpu_matmul.py (2-core EPYC, MLX 0.32.4): see bench/NOTES.md.
QUANTIZED_DEQUANT_MIN_ROWS = 8


class BlasWarning(UserWarning):
    """No fast BLAS could be put under MLX's CPU backend (reason in the message)."""


_state: dict = {"done": False, "name": None, "path": None, "source": None, "child_ok": False,
                "verified": False, "provider": None, "fast": False, "reason": "preload() not run",
                "max_rel_err": None, "in_process_checked": False}


# --------------------------------------------------------------------------------------------
# public API


def preload() -> None:
    """Find, verify (cached child process) and load an optimized BLAS with RTLD_GLOBAL before
    mlx.core is imported; idempotent. Never raises: problems become one BlasWarning."""
    if _state["done"]:
        return
    _state["done"] = True
    try:
        _preload()
    except Exception as exc:  # an optional speed-up must never break `import gemma4_mlx`
        _state["reason"] = f"fast-BLAS preload failed: {exc!r}"
        _warn(_state["reason"])


def active() -> dict:
    """Which BLAS MLX's CPU backend uses, checked once in this process.

    Returns a new dict: ``name`` (e.g. 'OpenBLAS 0.3.21 ... Zen', 'Intel(R) oneAPI Math Kernel
    Library Version 2026.2 ...', 'reference (netlib, bundled with mlx)' or None), ``path`` (the
    library file loaded, or None), ``source`` ('env', 'mkl', 'openblas', 'preloaded' or None),
    ``provider`` (file that libmlx's ``cblas_sgemm`` is bound to), ``fast`` (provider is not the
    bundled reference BLAS), ``verified`` (fast, and f32 GEMMs through MLX matched numpy both in
    the child check and here), ``max_rel_err`` and ``reason`` (what happened, in words).
    Imports mlx.core (the check runs a small GEMM on the CPU stream)."""
    if not _state["done"]:
        preload()
    if not _state["in_process_checked"] and _mlx_cpu_blas_in_use():
        _state["in_process_checked"] = True
        err = _gemm_rel_error()
        provider = sgemm_provider()
        fast = provider is not None and not _is_bundled_reference(provider)
        _state.update(max_rel_err=err, provider=provider, fast=fast)
        if _state["path"] is None and provider is not None:  # e.g. LD_PRELOAD or no preload at all
            _state["path"] = provider
            _state["name"] = _library_label(provider) if fast else "reference (netlib, bundled with mlx)"
        good = err <= _GEMM_TOL
        _state["verified"] = bool(fast and good and (_state["child_ok"] or _state["source"] is None))
        if fast and not good:
            _state["reason"] = (f"{_state['name']}: f32 GEMM through MLX is wrong in this process "
                                f"(relative error {err:.2e}); set {ENV_VAR}=off")
            warnings.warn(_state["reason"], BlasWarning, stacklevel=2)
    return {k: _state[k] for k in ("name", "path", "source", "provider", "fast", "verified",
                                   "max_rel_err", "reason")}


def describe() -> str:
    """One line for a CLI's --verbose, e.g. 'BLAS: OpenBLAS 0.3.21 ... (verified) [/usr/lib/...]'."""
    info = active()
    if info["name"] is None:
        return f"BLAS: none preloaded ({info['reason']})"
    tag = "verified" if info["verified"] else ("fast, NOT verified" if info["fast"] else "slow")
    return f"BLAS: {info['name']} ({tag}) [{info['provider'] or info['path']}]"


def cpu_compute_dtype():
    """Dtype for dense (unquantized) matmuls on MLX's CPU backend.

    Returns ``mx.float32`` when a fast BLAS is active and verified (or on macOS, whose MLX CPU
    backend links Accelerate), else ``mx.bfloat16``.
    Measured with bench/cpu_matmul.py (2-core EPYC, MLX 0.32.4, 512x1536 @ 1536x6144): f32 through
    OpenBLAS/MKL runs at ~100-130 GFLOP/s, bf16 (MLX's own kernel, no BLAS) at ~6 GFLOP/s, f32
    through the bundled reference BLAS at ~3-4 GFLOP/s; at M = 1 f32 + MKL reads ~20 GB/s against
    ~2 GB/s for bf16. Only for the CPU device: GPU backends keep bf16 activations."""
    import mlx.core as mx

    return mx.float32 if sys.platform == "darwin" or active()["verified"] else mx.bfloat16


def quantized_matmul_strategy(rows: int) -> str:
    """How to multiply ``rows`` activation rows by a Q4_0/Q8_0 weight on MLX's CPU backend.

    'quantized_matmul': ``mx.quantized_matmul`` on the packed weight with **float32 activations
    and float32 scales/biases** (bf16 ones make MLX's CPU kernel ~8x slower);
    'dequantize_f32': dequantize this layer's weight to f32 (one layer at a time, freed after
    use, so memory stays <= one layer's f32 size above the quantized weights) and run the f32
    BLAS GEMM. The second wins from QUANTIZED_DEQUANT_MIN_ROWS rows on when a fast BLAS is
    verified: MLX's quantized kernel is ~1.6 GFLOP/s and linear in rows (6.3 s for 512x1536 @
    6144x1536 Q4), dequantize + GEMM ~0.15 s."""
    if rows >= QUANTIZED_DEQUANT_MIN_ROWS and active()["verified"]:
        return "dequantize_f32"
    return "quantized_matmul"


def got_cell(symbol: str = "cblas_sgemm") -> ctypes.c_void_p | None:
    """The loaded libmlx.so's GOT slot for ``symbol`` as a ctypes pointer cell (read or written in
    place), or None (not Linux, libmlx not loaded, no such relocation). Reads the slot's offset from
    libmlx's ELF relocations; libmlx binds it lazily, on the first f32 matmul."""
    if not sys.platform.startswith("linux"):
        return None
    libmlx = _loaded_library("libmlx.so")
    if libmlx is None:
        return None
    slot = _got_slot(libmlx, symbol)
    if slot is None:
        return None
    handle = ctypes.CDLL(libmlx, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)._handle
    link_map = ctypes.c_void_p()
    if _dl().dlinfo(ctypes.c_void_p(handle), 2, ctypes.byref(link_map)) != 0:  # RTLD_DI_LINKMAP
        return None
    load_bias = ctypes.c_size_t.from_address(link_map.value).value  # struct link_map.l_addr
    return ctypes.c_void_p.from_address(load_bias + slot)


def sgemm_provider(symbol: str = "cblas_sgemm") -> str | None:
    """Real path of the library that the loaded libmlx.so's slot for ``symbol`` is bound to (through
    cpu_matvec's sgemm hook, when that is in place, the library it forwards to), or None (not
    Linux, libmlx not loaded, or not bound yet)."""
    cell = got_cell(symbol)
    if cell is None:
        return None
    target = cell.value
    if symbol == "cblas_sgemm" and __package__:  # (not in the check child, which runs this file alone)
        from .cpu_matvec import sgemm_hook_forward_target

        target = sgemm_hook_forward_target(target)
    where = _dladdr_path(target)
    if where is None or os.path.realpath(where) == os.path.realpath(_loaded_library("libmlx.so")):
        return None  # still points at libmlx's own PLT stub
    return os.path.realpath(where)


# --------------------------------------------------------------------------------------------
# preload


def _preload() -> None:
    if not sys.platform.startswith("linux"):
        _state["reason"] = "not Linux: MLX uses Accelerate/Metal, nothing to do"
        return
    explicit = os.environ.get(ENV_VAR, "").strip()
    if explicit.lower() in _OFF_VALUES:
        _state["reason"] = f"disabled by {ENV_VAR}={explicit}"
        return
    if not explicit and _mlx_gpu_build():
        _state["reason"] = "CUDA build of MLX: the CPU BLAS step is skipped"
        return
    if "mlx.core" in sys.modules:
        _state["reason"] = ("mlx.core was imported before gemma4_mlx, so MLX keeps the BLAS it "
                            "started with; import gemma4_mlx first")
        if not _provider_is_fast_now():
            _warn(_state["reason"])
        return
    already = _global_cblas_path()
    if already is not None:  # LD_PRELOAD or an earlier RTLD_GLOBAL load already provides it
        candidates = [("preloaded", already)]
    elif explicit:
        if not os.path.exists(explicit):
            _state["reason"] = f"{ENV_VAR}={explicit}: no such file"
            _warn(_state["reason"])
            return
        candidates = [("env", explicit)]
    else:
        candidates = [(src, p) for src, p in (("mkl", _find_mkl()), ("openblas", _find_openblas()))
                      if p is not None]
    if not candidates:
        _state["reason"] = ("no optimized BLAS found (pip install 'gemma4-mlx[cpu-fast]', or "
                            "apt-get install libopenblas0-pthread, or set "
                            f"{ENV_VAR}=/path/to/libblas.so); MLX's f32 matmuls stay ~30x slower")
        _warn(_state["reason"])
        return
    failures = []
    for source, path in candidates:
        verdict = _verified_in_child(path)
        if not verdict.get("ok"):
            failures.append(f"{path}: {verdict.get('error', 'check failed')}")
            continue
        if source != "preloaded":
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        how = ("was already in the global symbol scope (LD_PRELOAD or an earlier load)"
               if source == "preloaded" else "loaded with RTLD_GLOBAL before mlx.core")
        _state.update(name=verdict.get("label") or os.path.basename(path), path=path,
                      source=source, child_ok=True, max_rel_err=verdict.get("max_rel_err"),
                      reason=f"{source}: {how}")
        return
    _state["reason"] = "no BLAS passed the check, MLX keeps the reference BLAS: " + "; ".join(failures)
    _warn(_state["reason"])


def _warn(message: str) -> None:
    warnings.warn(f"gemma4_mlx: {message}", BlasWarning, stacklevel=3)


def _mlx_gpu_build() -> bool:
    """True when the installed MLX is a CUDA build (distribution mlx-cuda*)."""
    import importlib.metadata as md

    for name in ("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda"):
        try:
            md.distribution(name)
            return True
        except md.PackageNotFoundError:
            pass
    return False


def _mlx_cpu_blas_in_use() -> bool:
    return sys.platform.startswith("linux") and (_state["path"] is not None
                                                  or not _mlx_gpu_build())


def _find_mkl() -> str | None:
    """libmkl_rt.so.N from the installed `mkl` distribution, or None."""
    import importlib.metadata as md

    try:
        dist = md.distribution("mkl")
    except md.PackageNotFoundError:
        return None
    found = sorted(str(dist.locate_file(f)) for f in (dist.files or [])
                   if os.path.basename(str(f)).startswith("libmkl_rt.so"))
    found = [p for p in found if os.path.exists(p)]
    return os.path.abspath(found[-1]) if found else None


def _find_openblas() -> str | None:
    """A system OpenBLAS exporting cblas_sgemm (pthread or openmp build), or None."""
    for d in _OPENBLAS_DIRS:
        for name in _OPENBLAS_NAMES:
            path = os.path.join(d, name)
            if os.path.exists(path):
                return path
    hits = sorted(glob.glob("/usr/lib/*/openblas*/libopenblas*.so.0"))
    return hits[0] if hits else None


def _global_cblas_path() -> str | None:
    """File providing cblas_sgemm in the global scope already (LD_PRELOAD etc.), or None."""
    try:
        addr = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
    except AttributeError:
        return None
    return _dladdr_path(addr)


def _provider_is_fast_now() -> bool:
    """mlx.core already imported: bind cblas_sgemm with a tiny matmul, then look at the slot."""
    import mlx.core as mx

    a = mx.ones((2, 2), dtype=mx.float32)
    mx.eval(mx.matmul(a, a, stream=mx.cpu))
    provider = sgemm_provider()
    return provider is not None and not _is_bundled_reference(provider)


def _is_bundled_reference(path: str) -> bool:
    """True for the netlib BLAS/LAPACK that the mlx wheel bundles (mlx_cpu.libs/libblas-*.so)."""
    base = os.path.basename(path)
    return "mlx" in os.path.dirname(path) and base.startswith(("libblas", "liblapack"))


# --------------------------------------------------------------------------------------------
# verification (child process, cached)


def _cache_file() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "gemma4-mlx", "blas-verified.json")


def _cache_key(path: str) -> str:
    import importlib.metadata as md

    real = os.path.realpath(path)
    st = os.stat(real)
    try:
        mlx_version = md.version("mlx")
    except md.PackageNotFoundError:
        mlx_version = "?"
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = "".join(line for line in f if line.startswith(("model name", "flags"))
                          ).split("\n\n")[0]
    except OSError:
        pass
    env = "|".join(f"{k}={os.environ.get(k, '')}" for k in _KERNEL_ENV)
    raw = f"{real}|{st.st_size}|{st.st_mtime_ns}|{mlx_version}|{sys.executable}|{env}|{cpu}"
    return hashlib.sha256(raw.encode()).hexdigest()


def _verified_in_child(path: str) -> dict:
    """{'ok', 'label', 'max_rel_err', 'provider' | 'error'} for `path`, from the cache or a child."""
    key = _cache_key(path)
    cache_path = _cache_file()
    try:
        with open(cache_path) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        cache = {}
    if key in cache and isinstance(cache[key], dict):
        return cache[key]
    import subprocess

    env = dict(os.environ, **{ENV_VAR: "off"})
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--verify", path],
                              capture_output=True, text=True, env=env, timeout=_VERIFY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"check timed out after {_VERIFY_TIMEOUT_S} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
        return {"ok": False, "error": f"check process exited {proc.returncode} {tail[0][:200]}"}
    verdict = json.loads(lines[-1])
    cache[key] = verdict
    try:
        os.makedirs(os.path.dirname(cache_path), exist_ok=True)
        tmp = f"{cache_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(cache, f)
        os.replace(tmp, cache_path)
    except OSError:
        pass
    return verdict


def _gemm_rel_error() -> float:
    """Largest relative error of a few f32 MLX matmuls on the CPU stream (shapes that take the
    BLAS path: row/column vectors, odd sizes, transposed operands, a batch) against numpy float64."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(1234)
    worst = 0.0
    for m, k, n, b_transposed, batch in ((1, 96, 80, True, 1), (7, 130, 65, False, 1),
                                          (64, 256, 192, True, 1), (33, 512, 96, False, 1),
                                          (17, 64, 33, False, 3)):
        a = rng.standard_normal((batch, m, k)).astype(np.float32)
        b = rng.standard_normal((batch, n, k) if b_transposed else (batch, k, n)).astype(np.float32)
        ma, mb = mx.array(a), mx.array(b)
        got = mx.matmul(ma, mb.swapaxes(-1, -2) if b_transposed else mb, stream=mx.cpu)
        got = np.array(got.astype(mx.float32), dtype=np.float64)
        b64 = b.astype(np.float64)
        ref = a.astype(np.float64) @ (b64.swapaxes(-1, -2) if b_transposed else b64)
        if got.shape != ref.shape or not np.all(np.isfinite(got)):
            return float("inf")
        worst = max(worst, float(np.abs(got - ref).max() / np.abs(ref).max()))
    return worst


def _library_label(path: str) -> str:
    """'OpenBLAS 0.3.21 DYNAMIC_ARCH ... (core Zen)', the MKL version string, or the file name."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return os.path.basename(path)
    try:
        fn = lib.openblas_get_config
        fn.restype = ctypes.c_char_p
        label = fn().decode(errors="replace").strip()
        try:
            core = lib.openblas_get_corename
            core.restype = ctypes.c_char_p
            label += f" (core {core().decode(errors='replace')})"
        except AttributeError:
            pass
        return label
    except AttributeError:
        pass
    try:
        fn = lib.MKL_Get_Version_String
        buf = ctypes.create_string_buffer(256)
        fn(buf, ctypes.c_int(len(buf)))
        return buf.value.decode(errors="replace").strip()
    except AttributeError:
        pass
    try:
        fn = lib.bli_info_get_version_str
        fn.restype = ctypes.c_char_p
        return "BLIS " + fn().decode(errors="replace")
    except AttributeError:
        return os.path.basename(path)


def _verify_main(path: str) -> int:
    """Child process: load `path` globally, import mlx.core, check f32 GEMMs, print one JSON line."""
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    err = _gemm_rel_error()
    provider = sgemm_provider()
    verdict = {"ok": False, "label": _library_label(path), "max_rel_err": err, "provider": provider}
    if provider is None or _is_bundled_reference(provider):
        verdict["error"] = f"libmlx's cblas_sgemm is bound to {provider}, not to the loaded library"
    elif not err <= _GEMM_TOL:
        verdict["error"] = f"f32 GEMM relative error {err:.2e} > {_GEMM_TOL:.0e}"
    else:
        verdict["ok"] = True
    print(json.dumps(verdict))
    return 0


# --------------------------------------------------------------------------------------------
# ELF / dynamic-linker helpers (Linux)


@functools.lru_cache(maxsize=None)
def _dl():
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "dlinfo"):
        libc = ctypes.CDLL("libdl.so.2")
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    libc.dlinfo.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    return libc


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _dladdr_path(addr: int | None) -> str | None:
    if not addr:
        return None
    info = _DlInfo()
    if _dl().dladdr(ctypes.c_void_p(addr), ctypes.byref(info)) == 0 or not info.dli_fname:
        return None
    return info.dli_fname.decode(errors="replace")


def _loaded_library(basename: str) -> str | None:
    """Path of a mapped library with this file name, from /proc/self/maps, or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and os.path.basename(parts[5].strip()) == basename:
                    return parts[5].strip()
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=None)
def _got_slot(elf_path: str, symbol: str) -> int | None:
    """Virtual address (relative to the load bias) of the GOT slot that the dynamic linker fills
    for `symbol` (a JUMP_SLOT or GLOB_DAT relocation) in a 64-bit little-endian ELF file."""
    slot_types = {7, 6, 1026, 1025}  # x86_64 JUMP_SLOT/GLOB_DAT, aarch64 JUMP_SLOT/GLOB_DAT
    with open(elf_path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            return None
        shoff, = struct.unpack_from("<Q", head, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]

        def read(idx: int) -> bytes:
            sec = sections[idx]
            f.seek(sec[4])
            return f.read(sec[5])

        for sec in sections:
            if sec[1] != 4:  # SHT_RELA
                continue
            symtab_idx = sec[6]
            if sections[symtab_idx][1] != 11:  # relocations against .dynsym only
                continue
            rela, dynsym = read(sections.index(sec)), read(symtab_idx)
            dynstr = read(sections[symtab_idx][6])
            want = symbol.encode() + b"\0"
            for off in range(0, len(rela) - 23, 24):
                r_offset, r_info = struct.unpack_from("<QQ", rela, off)
                if (r_info & 0xFFFFFFFF) not in slot_types:
                    continue
                st_name, = struct.unpack_from("<I", dynsym, (r_info >> 32) * 24)
                if dynstr[st_name:st_name + len(want)] == want:
                    return r_offset
    return None


if __name__ == "__main__":
    # run as a script, sys.path[0] is this package's folder: keep its modules (gguf.py, ...)
    # from shadowing installed packages that mlx/numpy may import
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    if len(sys.argv) == 3 and sys.argv[1] == "--verify":
        sys.exit(_verify_main(sys.argv[2]))
    print("usage: python blas.py --verify /path/to/libblas.so", file=sys.stderr)
    sys.exit(2)
