"""``metal_kernel``: an ``mx.fast.metal_kernel`` look-alike that runs the Metal text on the CPU.

    k = metal_kernel(name, input_names, output_names, source, header="")
    outs = k(inputs=[...], output_shapes=[...], output_dtypes=[...], grid=(gx, gy, gz),
             threadgroup=(tx, ty, tz), template=[("T", "float32"), ("N", 4)])

Each call: generate MLX's Metal text (mlx_source), rewrite it for the shim (rewrite), compile it
with a per-lane entry point (build, cached), then run the grid twice — lanes and threadgroups in
forward order, then in reverse — on guarded buffers (guard pages + poison around every buffer,
inputs read-only, outputs poisoned with NaN bits unless ``init_value``). Both runs must give
bit-identical outputs (else "lane_order": a race or a missing barrier). Returns numpy arrays;
bfloat16 as np.uint16 bit patterns.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from . import build, dtypes, mlx_source, rewrite
from .errors import CompileError, EmulatorError

_RUN_LOCK = threading.Lock()  # the runtime has global state; ctypes releases the GIL during a run


def _runtime() -> ctypes.CDLL:
    lib = build.runtime_library()
    if not getattr(lib, "_emu_typed", False):
        lib.emu_buffer_new.restype = ctypes.c_void_p
        lib.emu_buffer_new.argtypes = [ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
        lib.emu_buffer_protect_readonly.argtypes = [ctypes.c_void_p]
        lib.emu_buffer_check.restype = ctypes.c_int
        lib.emu_buffer_check.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_longlong)]
        lib.emu_buffer_free.argtypes = [ctypes.c_void_p]
        lib.emu_run.restype = ctypes.c_int
        lib.emu_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32),
                                ctypes.POINTER(ctypes.c_uint32), ctypes.c_int, ctypes.c_int, ctypes.c_double,
                                ctypes.c_char_p, ctypes.c_size_t]  # fmt: skip
        lib._emu_typed = True
    return lib


def _driver(gen: mlx_source.GeneratedKernel) -> str:
    """C++ entry point that calls the kernel for one lane with its buffers and attributes."""
    args = []
    k = -1  # index into the buffer-pointer array (attributes are not buffers)
    for p in gen.params:
        k += p.kind != "attribute"
        if p.kind == "attribute":
            if p.ctype == "uint3":
                args.append(f"metal::uint3(a->{p.name}[0], a->{p.name}[1], a->{p.name}[2])")
            else:
                args.append(f"(uint)a->{p.name}")
        elif p.kind == "output":
            t = f"metal::atomic<{p.ctype}>" if p.atomic else p.ctype
            args.append(f"({t}*)args[{k}]")
        elif p.by_ref:
            args.append(f"*(const {p.ctype}*)args[{k}]")
        else:
            args.append(f"(const {p.ctype}*)args[{k}]")
    call = ",\n      ".join(args)
    return (
        '\nextern "C" void emu_kernel_lane(void* const* args, const emu_thread_attrs* a) {\n'
        f"  (void)args; (void)a;\n  {gen.function_name}{gen.template_args}(\n      {call});\n}}\n"
    )


def translation_unit(gen: mlx_source.GeneratedKernel, kernel_name: str) -> str:
    """Shim include + the MLX text (rewritten, line numbers kept) + the lane entry point.

    Raises ValueError when the text uses ``threadgroup`` in a way the emulator cannot represent.
    """
    body = rewrite.to_cpp(gen.text)
    return (
        '#include "metal_emu.h"\n'
        f'#line 1 "{kernel_name}.metal"\n'
        f"{body}\n"
        f'#line 1 "emulator_driver.cpp"\n'
        f"{_driver(gen)}"
    )


@dataclass
class _Arg:
    """One buffer handed to the kernel: its guarded allocation and what it holds."""

    ptr: int
    name: str
    nbytes: int
    output_index: int = -1


def _as_array(x: Any, dtype_override: str | None) -> tuple[np.ndarray, str]:
    """(numpy storage array, MLX dtype name) for one input: numpy, Python scalar or mx.array."""
    if isinstance(x, bool):
        arr, name = np.array(x, dtype=np.bool_), "bool"
    elif isinstance(x, int):
        arr, name = np.array(x, dtype=np.int32), "int32"
    elif isinstance(x, float):
        arr, name = np.array(x, dtype=np.float32), "float32"
    elif isinstance(x, np.ndarray) or np.isscalar(x):
        arr = np.asarray(x)
        name = dtypes.dtype_name(arr.dtype)
    else:  # mx.array
        import mlx.core as mx

        name = dtypes.dtype_name(x.dtype)
        arr = np.array(x.view(mx.uint16) if name == "bfloat16" else x)
    if dtype_override is not None:
        name = dtypes.dtype_name(dtype_override)
        want = dtypes.DTYPES[name].storage
        if arr.dtype != want:
            raise TypeError(f"input of dtype {name} must be stored as numpy {want}, got {arr.dtype}")
    return arr, name


class EmulatedKernel:
    """Same constructor and call signature as ``mx.fast.metal_kernel`` (plus emulator options)."""

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
                 header: str = "", ensure_row_contiguous: bool = True, atomic_outputs: bool = False):
        self.name = name
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs

    # ---- code generation ----
    def generate(self, input_infos: Sequence[mlx_source.InputInfo], output_dtypes: Sequence[str],
                 template: Sequence[tuple[str, Any]] = ()) -> mlx_source.GeneratedKernel:
        """The exact Metal text MLX would compile for this instantiation."""
        return mlx_source.generate(self.name, self.input_names, self.output_names, self.source, self.header,
                                   input_infos, [dtypes.dtype_name(d) for d in output_dtypes], template,
                                   self.atomic_outputs)  # fmt: skip

    def library(self, gen: mlx_source.GeneratedKernel) -> ctypes.CDLL:
        """Compiled (cached) library for one generated text; raises CompileError."""
        try:
            tu = translation_unit(gen, self.name)
        except ValueError as e:
            raise CompileError(self.name, str(e)) from None
        try:
            path = build.build(tu, gen.function_name)
        except build.BuildError as e:
            raise CompileError(self.name, _trim_diagnostics(e.stderr) + f"\n(source: {e.source_path})",
                               str(e.source_path)) from None  # fmt: skip
        _runtime()  # the runtime must be loaded (RTLD_GLOBAL) before any kernel library
        return build.load(path)

    # ---- execution ----
    def __call__(self, *, inputs: Sequence[Any], output_shapes: Sequence[Sequence[int]],
                 output_dtypes: Sequence[Any], grid: Sequence[int], threadgroup: Sequence[int],
                 template: Sequence[tuple[str, Any]] | None = None, init_value: float | None = None,
                 verbose: bool = False, stream: Any = None, input_dtypes: Sequence[str | None] | None = None,
                 check_lane_order: bool | None = None, exited_lanes_in_simd_ok: bool = False,
                 timeout_s: float = 60.0) -> list[np.ndarray]:
        """Run the kernel; returns the outputs as numpy arrays (bfloat16 as uint16 bits).

        input_dtypes: per-input MLX dtype name overrides (needed for bfloat16 given as uint16).
        check_lane_order: require bit-identical outputs from forward and reverse lane order
        (default: on unless the kernel uses atomics). exited_lanes_in_simd_ok: let lanes that
        returned early sit out SIMD-group functions (valid Metal, a bug on CUDA; default off).
        timeout_s: CPU seconds one run may take before it fails with check "timeout".
        """
        del stream
        template = list(template or [])
        if len(inputs) != len(self.input_names):
            raise ValueError(f"[metal_kernel] Expected `inputs` to have size {len(self.input_names)} "
                             f"but got size {len(inputs)}.")  # fmt: skip
        if len(output_shapes) != len(self.output_names) or len(output_dtypes) != len(self.output_names):
            raise ValueError(f"[metal_kernel] Expected {len(self.output_names)} output shapes and dtypes.")
        arrays, gen = self._prepare_inputs(inputs, input_dtypes, output_dtypes, template)
        out_names = [dtypes.dtype_name(d) for d in output_dtypes]
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{gen.text}\n```")
        lib = self.library(gen)
        if check_lane_order is None:
            check_lane_order = not self.atomic_outputs and "atomic_" not in (self.source + self.header)
        fn = ctypes.cast(lib.emu_kernel_lane, ctypes.c_void_p).value
        runs = []
        with _RUN_LOCK:
            for reverse in (False, True):
                runs.append(self._run_once(fn, gen, arrays, output_shapes, out_names, grid, threadgroup,
                                           init_value, reverse, exited_lanes_in_simd_ok, timeout_s))  # fmt: skip
        if check_lane_order:
            for i, (a, b) in enumerate(zip(*runs)):
                if a.tobytes() != b.tobytes():
                    diff = np.flatnonzero(a.view(np.uint8).reshape(-1) != b.view(np.uint8).reshape(-1))
                    first = int(diff[0]) // max(a.itemsize, 1)
                    raise EmulatorError(self.name, "lane_order",
                                        f"output '{self.output_names[i]}' differs between forward and reverse "
                                        f"lane order (first at flat element {first}): a data race — a missing "
                                        f"threadgroup_barrier or lanes writing the same location")  # fmt: skip
        return runs[0]

    def prepare(self, *, inputs: Sequence[Any], output_dtypes: Sequence[Any],
                template: Sequence[tuple[str, Any]] | None = None,
                input_dtypes: Sequence[str | None] | None = None) -> None:
        """Compile (or find in the cache) the library a call with these arguments needs."""
        _, gen = self._prepare_inputs(inputs, input_dtypes, output_dtypes, list(template or []))
        self.library(gen)

    def _prepare_inputs(self, inputs: Sequence[Any], input_dtypes: Sequence[str | None] | None,
                        output_dtypes: Sequence[Any], template: Sequence[tuple[str, Any]]
                        ) -> tuple[list[np.ndarray], mlx_source.GeneratedKernel]:  # fmt: skip
        overrides = list(input_dtypes) if input_dtypes is not None else [None] * len(inputs)
        arrays, names = [], []
        for x, o in zip(inputs, overrides):
            arr, dn = _as_array(x, o)
            if self.ensure_row_contiguous and arr.ndim > 0:
                arr = np.ascontiguousarray(arr)  # (ascontiguousarray would make a 0-d array 1-d)
            arrays.append(arr)
            names.append(dn)
        infos = [mlx_source.InputInfo(dn, a.ndim, int(a.size)) for a, dn in zip(arrays, names)]
        return arrays, self.generate(infos, [dtypes.dtype_name(d) for d in output_dtypes], template)

    def _run_once(self, fn: int, gen: mlx_source.GeneratedKernel, arrays: list[np.ndarray],
                  output_shapes: Sequence[Sequence[int]], out_names: list[str], grid: Sequence[int],
                  threadgroup: Sequence[int], init_value: float | None, reverse: bool,
                  exited_ok: bool, timeout_s: float) -> list[np.ndarray]:  # fmt: skip
        rt = _runtime()
        bufs: list[_Arg] = []
        outputs = [np.empty(tuple(s), dtype=dtypes.DTYPES[d].storage) for s, d in zip(output_shapes, out_names)]

        def new_buffer(data: bytes | None, nbytes: int, label: str, itemsize: int, readonly: bool,
                       output_index: int = -1) -> int:  # fmt: skip
            ptr = rt.emu_buffer_new(max(nbytes, 1), label.encode(), itemsize)
            if not ptr:
                raise MemoryError("emu_buffer_new failed")
            if data is not None:
                ctypes.memmove(ptr, data, nbytes)
            if readonly:
                rt.emu_buffer_protect_readonly(ptr)
            bufs.append(_Arg(ptr, label, nbytes, output_index))
            return ptr

        try:
            ptrs: list[int] = []
            for p in gen.params:
                if p.kind == "attribute":
                    continue
                if p.kind == "input":
                    data, nbytes = _input_bytes(arrays[p.index])
                    ptrs.append(new_buffer(data, nbytes, p.name, arrays[p.index].itemsize, True))
                elif p.kind in ("shape", "strides", "ndim"):
                    a = arrays[p.index]
                    if p.kind == "shape":
                        meta = np.array(a.shape, dtype=np.int32)
                    elif p.kind == "strides":
                        meta = np.array([s // a.itemsize for s in a.strides], dtype=np.int64)
                    else:
                        meta = np.array([a.ndim], dtype=np.int32)
                    ptrs.append(new_buffer(meta.tobytes(), meta.nbytes, p.name, meta.itemsize, True))
                else:  # output
                    out = outputs[p.index]
                    if init_value is not None:
                        init = _init_fill(init_value, out_names[p.index], out.shape)
                        ptr = new_buffer(init.tobytes(), out.nbytes, p.name, out.itemsize, False, p.index)
                    else:  # poisoned (NaN bits) by the runtime
                        ptr = new_buffer(None, out.nbytes, p.name, out.itemsize, False, p.index)
                    ptrs.append(ptr)
            argv = (ctypes.c_void_p * max(len(ptrs), 1))(*ptrs)
            g = (ctypes.c_uint32 * 3)(*[int(v) for v in grid])
            t = (ctypes.c_uint32 * 3)(*[int(v) for v in threadgroup])
            err = ctypes.create_string_buffer(4096)
            rc = rt.emu_run(fn, ctypes.cast(argv, ctypes.c_void_p), g, t, int(reverse), int(exited_ok),
                            float(timeout_s), err, len(err))  # fmt: skip
            order = "reverse" if reverse else "forward"
            if rc != 0:
                check, _, detail = err.value.decode(errors="replace").partition("\t")
                raise EmulatorError(self.name, check, f"{detail} ({order} lane order)")
            for b in bufs:
                off = ctypes.c_longlong(0)
                if rt.emu_buffer_check(b.ptr, ctypes.byref(off)):
                    where = (f"{-off.value} bytes before its start" if off.value < 0
                             else f"at byte offset {off.value} (size {b.nbytes} bytes)")  # fmt: skip
                    raise EmulatorError(self.name, "oob_write",
                                        f"write outside buffer '{b.name}' {where} ({order} lane order)")
            for b in bufs:
                if b.output_index >= 0:
                    out = outputs[b.output_index]
                    ctypes.memmove(out.ctypes.data, b.ptr, out.nbytes)
        finally:
            for b in bufs:
                rt.emu_buffer_free(b.ptr)
        return outputs


def _input_bytes(a: np.ndarray) -> tuple[bytes, int]:
    """Bytes the kernel sees for one input: the array itself, or for a strided view (only with
    ensure_row_contiguous=False) the memory it spans, which ``x_strides`` then indexes."""
    if a.flags.c_contiguous:
        return a.tobytes(), a.nbytes
    if any(s < 0 for s in a.strides):
        raise ValueError("the emulator supports only non-negative strides")
    span = sum((n - 1) * s for n, s in zip(a.shape, a.strides)) + a.itemsize if a.size else 0
    return ctypes.string_at(a.ctypes.data, span), span


def _init_fill(value: float, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if dtype == "bfloat16":
        bits = np.array([value], dtype=np.float32).view(np.uint32)
        b = ((bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return np.full(shape, b[0], dtype=np.uint16)
    return np.full(shape, value, dtype=dtypes.DTYPES[dtype].storage)


def _trim_diagnostics(stderr: str, max_lines: int = 40) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    errors = [i for i, ln in enumerate(lines) if "error" in ln]
    start = max(errors[0] - 2, 0) if errors else 0
    return "\n".join(lines[start:start + max_lines])


def metal_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
                 header: str = "", ensure_row_contiguous: bool = True, atomic_outputs: bool = False,
                 compile_options: Any = None) -> EmulatedKernel:  # fmt: skip
    """Drop-in for ``mx.fast.metal_kernel`` returning an EmulatedKernel (compile_options ignored)."""
    del compile_options
    return EmulatedKernel(name, input_names, output_names, source, header, ensure_row_contiguous, atomic_outputs)
