"""What every benchmark JSON carries about where it ran: the hardware (backend, MLX device info,
nvidia-smi) and the code (git commit and a digest of the package sources)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import platform
import subprocess

import custom_kernels
import mlx.core as mx

ROOT = pathlib.Path(__file__).resolve().parents[1]


def hardware_info() -> dict:
    info: dict = {"backend": custom_kernels.backend(), "machine": platform.machine(), "system": platform.system()}
    if hasattr(os, "getloadavg"):  # a run started while other work was still ending reads low (session 15)
        info["load_average"] = [round(v, 2) for v in os.getloadavg()]
    try:
        info["mlx_device_info"] = {k: (v if isinstance(v, (int, float, str)) else str(v))
                                   for k, v in mx.device_info().items()}  # fmt: skip
    except Exception:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=10)  # fmt: skip
        if out.returncode == 0:
            info["nvidia_smi"] = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def commit() -> str:
    """`git rev-parse --short HEAD` of the checkout ('' if unknown). A copied tree may carry stale
    git metadata (the GPU machine's copy once reported an old commit): sources_digest() is the check."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)  # fmt: skip
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def sources_digest() -> str:
    """sha256 (16 hex digits) over the paths and bytes of gemma4_mlx/ and custom_kernels/ *.py: the
    code that ran, whatever git says (recompute it at any commit to match a result)."""
    h = hashlib.sha256()
    for path in sorted((*ROOT.glob("gemma4_mlx/**/*.py"), *ROOT.glob("custom_kernels/**/*.py"))):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def write_result(doc: dict, stem: str, path: str | None = None) -> str:
    """Write a bench JSON to `path` or bench/results/<stem>-<doc's date to the minute>.json."""
    path = path or str(ROOT / "bench" / "results" / f"{stem}-{doc['date'][:16].replace(':', '')}.json")
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"wrote {path}")
    return path


def parse_variant(text: str, allow_empty: bool = False) -> tuple[str, dict[str, str]]:
    """'NAME=VAR=VALUE VAR2=VALUE2' -> (NAME, {VAR: VALUE, VAR2: VALUE2}); 'NAME=' -> (NAME, {})
    only with allow_empty (a baseline setting). SystemExit on anything else."""
    name, sep, rest = text.partition("=")
    env = {}
    for item in rest.split():
        var, eq, value = item.partition("=")
        if not eq or not var:
            raise SystemExit(f"{text!r}: expected NAME=VAR=VALUE [VAR=VALUE ...]")
        env[var] = value
    if not name or not sep or not (env or allow_empty):
        raise SystemExit(f"{text!r}: expected NAME=VAR=VALUE [VAR=VALUE ...]")
    return name, env


@contextlib.contextmanager
def environment(env: dict[str, str]):
    """The process environment with `env` set for a with-block, restored afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
