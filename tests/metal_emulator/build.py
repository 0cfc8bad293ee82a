"""Compile C++ to shared libraries with the system compiler, cached by content hash.

The cache directory is ``$METAL_EMULATOR_CACHE`` if set, else ``<tmp>/metal_emulator_<uid>``.
A library's file name is the SHA-256 of its source text, the compiler flags, the compiler's
version and every file of the shim, so editing any of them rebuilds. Writes are atomic
(temporary file + rename), so concurrent test processes can share the cache.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import uuid
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
INCLUDE_DIR = PACKAGE_DIR / "include"
RUNTIME_SOURCE = PACKAGE_DIR / "runtime" / "emu_runtime.cpp"

KERNEL_FLAGS = (
    "-std=c++17", "-O1", "-fPIC",
    "-fwrapv", "-fno-strict-aliasing", "-ffp-contract=off", "-fno-fast-math",
    "-ftrivial-auto-var-init=pattern",          # uninitialized locals are garbage, not zero
    # Fixed-size array indices, pointer alignment, shift counts, integer division by zero; the
    # __ubsan_handle_* functions are the runtime's (reported with .metal line numbers), so the
    # library is linked in a second step without libubsan.
    "-fsanitize=bounds,alignment,shift-exponent,integer-divide-by-zero", "-fno-sanitize-recover=all",
    "-Werror=attributes",                        # an unknown Metal attribute is an error
    "-Wno-unknown-pragmas", "-Wno-literal-suffix",
    "-U_FORTIFY_SOURCE",
)  # fmt: skip
KERNEL_LINK_FLAGS = ("-shared",)
RUNTIME_FLAGS = ("-std=c++17", "-O2", "-shared", "-fPIC", "-U_FORTIFY_SOURCE", "-Wall")


class BuildError(Exception):
    """The compiler rejected a source; ``stderr`` holds its diagnostics."""

    def __init__(self, stderr: str, source_path: Path):
        super().__init__(stderr)
        self.stderr = stderr
        self.source_path = source_path


def compiler() -> str:
    """The C++ compiler: ``$CXX`` or g++. Raises RuntimeError when none is installed."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"the Metal emulator needs a C++17 compiler; '{cxx}' was not found")
    return cxx


@functools.lru_cache(maxsize=None)
def _compiler_identity(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout


@functools.lru_cache(maxsize=None)
def _shim_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(INCLUDE_DIR.iterdir()):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def cache_dir() -> Path:
    """Directory for compiled libraries (created on demand)."""
    d = os.environ.get("METAL_EMULATOR_CACHE")
    path = Path(d) if d else Path(tempfile.gettempdir()) / f"metal_emulator_{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def build(source: str, tag: str, flags: tuple[str, ...] = KERNEL_FLAGS) -> Path:
    """Compile ``source`` into a shared library (or reuse the cached one) and return its path.

    Raises BuildError with the compiler's diagnostics when compilation fails.
    """
    cxx = compiler()
    h = hashlib.sha256()
    for part in (source, " ".join(flags), " ".join(KERNEL_LINK_FLAGS), _compiler_identity(cxx), _shim_digest()):
        h.update(part.encode())
        h.update(b"\0")
    key = h.hexdigest()[:24]
    safe_tag = "".join(c if c.isalnum() or c in "_-" else "_" for c in tag)[:60]
    out = cache_dir() / f"{safe_tag}-{key}.so"
    src = out.with_suffix(".cpp")
    if out.exists():
        return out
    unique = uuid.uuid4().hex[:12]  # several processes or threads may build the same library
    tmp_src = src.with_name(f"{src.stem}.{unique}.tmp.cpp")
    tmp_out = out.with_name(f"{out.stem}.{unique}.tmp.so")
    tmp_src.write_text(source)
    if flags == KERNEL_FLAGS:  # compile (with the precompiled shim), then link without libubsan
        tmp_obj = out.with_name(f"{out.stem}.{unique}.tmp.o")
        steps = [[cxx, *flags, f"-I{_precompiled_shim(cxx, flags)}", f"-I{INCLUDE_DIR}", "-c", str(tmp_src),
                  "-o", str(tmp_obj)],
                 [cxx, *KERNEL_LINK_FLAGS, str(tmp_obj), "-o", str(tmp_out)]]  # fmt: skip
    else:
        tmp_obj = None
        steps = [[cxx, *flags, f"-I{INCLUDE_DIR}", str(tmp_src), "-o", str(tmp_out)]]
    try:
        for cmd in steps:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                tmp_out.unlink(missing_ok=True)
                raise BuildError(proc.stderr.replace(str(tmp_src), str(src)), src)
    finally:
        os.replace(tmp_src, src)
        if tmp_obj is not None:
            tmp_obj.unlink(missing_ok=True)
    os.replace(tmp_out, out)
    return out


def _precompiled_shim(cxx: str, flags: tuple[str, ...]) -> Path:
    """Directory holding metal_emu.h.gch for ``flags`` (built once; saves ~1/3 of each compile).

    It is searched before the include directory; GCC ignores a PCH that does not match and then
    reads the header itself, so a stale PCH cannot change results."""
    h = hashlib.sha256((" ".join(flags) + _compiler_identity(cxx) + _shim_digest()).encode()).hexdigest()[:16]
    d = cache_dir() / f"pch-{h}"
    gch = d / "metal_emu.h.gch"
    if not gch.exists():
        d.mkdir(exist_ok=True)
        tmp = d / f"metal_emu.h.{uuid.uuid4().hex[:12]}.tmp"
        proc = subprocess.run([cxx, *flags, f"-I{INCLUDE_DIR}", "-x", "c++-header",
                               str(INCLUDE_DIR / "metal_emu.h"), "-o", str(tmp)],
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode == 0:
            os.replace(tmp, gch)
        else:  # compile without it; the kernel build will report the header's errors
            tmp.unlink(missing_ok=True)
    return d


_loaded: dict[Path, ctypes.CDLL] = {}
_lock = threading.Lock()


def load(path: Path, global_symbols: bool = False) -> ctypes.CDLL:
    """Load (once) a shared library built by ``build``."""
    with _lock:
        lib = _loaded.get(path)
        if lib is None:
            mode = ctypes.RTLD_GLOBAL if global_symbols else ctypes.RTLD_LOCAL
            lib = ctypes.CDLL(str(path), mode=mode)
            _loaded[path] = lib
        return lib


def runtime_library() -> ctypes.CDLL:
    """The emulator runtime (scheduler, buffers, fault handling), built and loaded globally."""
    path = build(RUNTIME_SOURCE.read_text(), "emu_runtime", RUNTIME_FLAGS)
    return load(path, global_symbols=True)
