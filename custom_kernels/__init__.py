"""Custom MLX kernels for Gemma 4 (Metal and CUDA from one source, pure-MLX references on CPU).

Backend selection and the kernel-object cache live here; each op family is one module
(e.g. ``custom_kernels.quant_matvec``) holding its pure-MLX reference, the kernel body written
once in the shared dialect (``custom_kernels.dialect``), and one dispatch function per op.

- ``backend()``: "metal", "cuda" or "cpu" — which kernel dialect this MLX build can run.
- ``use_reference()``: True when ops must run their pure-MLX reference (CPU builds, or the
  environment variable ``GEMMA4_MLX_KERNELS=reference``).
- ``get_kernel(name, ...)``: the ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` object for one
  kernel source, built on first use and cached. Nothing is built at import time: constructing a
  ``cuda_kernel`` raises on builds without CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from .dialect import compact_text, prune_helpers, short_names

__all__ = ["backend", "use_reference", "use_kernel", "get_kernel", "mlx_kernel_name", "clear_kernel_cache",
           "KernelSource", "MX_DTYPES", "cuda_arch", "dtype_name", "template_args", "KERNELS_ENV", "KERNELS_OFF_ENV", "UNPROVEN_ENV", "KERNEL_TEXT_ENV",
           "PROVEN", "CUDA_ONLY", "FAMILIES", "geometry_override", "geometry_fields", "replace_geometry",
           "ticket_counters", "check_ticket_counters"]

KERNELS_ENV = "GEMMA4_MLX_KERNELS"
"""Environment variable: ``reference`` forces the pure-MLX references even on a GPU build."""

KERNELS_OFF_ENV = "GEMMA4_MLX_KERNELS_OFF"
"""Comma-separated op families to keep on their MLX reference path even when on by default (A/B
measurements of one family against the rest, or a workaround); it wins over UNPROVEN_ENV."""

KERNEL_TEXT_ENV = "GEMMA4_MLX_KERNEL_TEXT"
"""Environment variable: the form of the CUDA kernels' text handed to MLX. MLX 0.32's CUDA
``CustomKernel::eval_gpu`` hashes a kernel's whole generated source on every evaluation (its
module key), so the text's length is host time per launch: std::_Hash_bytes called from there took
11.6% of a 26B-A4B decode step's host samples (py-spy --native, bench/NOTES.md, session 21).
By default (``pruned``) MLX gets ``dialect.compact_text`` of the text (no comments, indentation or
blank lines: ~22% fewer bytes) without the header's helper functions the kernel never calls
(``dialect.prune_helpers``: ~27% fewer again); ``compact`` keeps every helper; ``full`` hands the
text as written (readable in MLX's PTX cache directory, which keeps each module's source).
tests/test_metal_compile.py checks that nvcc emits the same PTX for all three forms of every kernel.
In one process on the H200 (session 22) ``pruned`` ran a 26B-A4B step with 3.75 against 4.07 ms of
host time per token (267.1 against 244.3 tok/s, ahead in 3 of 3 rounds), an E4B step with 4.66 against
4.82 ms (ahead in 4 of 5 rounds; its tok/s medians, 200.7 against 208.3, within that machine's spread).
``short`` (opt-in, not yet measured on a GPU): ``pruned`` with ``dialect.short_names`` (the names
the text declares shortened, its most repeated words as macros: ~18% fewer bytes again over the
registry); nvcc emits the same PTX for it too."""

UNPROVEN_ENV = "GEMMA4_MLX_UNPROVEN_KERNELS"
"""Comma-separated op families the model uses only when named here: families not on by default,
because they have not passed ``pytest -m gpu`` on real hardware yet or showed no measured gain there
(on Metal the CUDA_ONLY ones)."""

PROVEN = frozenset({"quant_matvec", "quant_matvec_stream", "attention", "sampling", "router", "gate_up_split",
                    "norm", "norm_rope", "gate_up_runs", "quant_matvec_runs", "quant_matvec_runs_m",
                    "matvec_gelu_mul", "moe_one_launch", "norm_moe", "router_proj", "norm_moe_out",
                    "router_fused", "attention_fused", "quant_matvec_tiles", "attention_mma",
                    "attention_mma8", "attention_mma_staged", "kv_one_write", "embedding"})  # fmt: skip
"""Op families whose GPU kernels passed ``pytest -m gpu`` (H200, CUDA): on by default. The first
four passed together with the model-level checks (every kernel on) on 2026-11-30 (99 tests; 100 in
session 6); "router" passed its operator and module tests in session 7 (111 tests); "gate_up_split"
(a dense MLP's one-token gate|up through the split-K gate/up kernel, CUDA only) its operator and
model tests in session 8 (the whole `pytest -m gpu` ran at the commit before it: 163 passed); "norm"
(the residual add between two RMS norms in one launch) its operator and model tests in session 9;
"norm_rope" (q/k/v norms and RoPE in one launch) passed them in session 7 and became a CUDA default
in session 11 on its measured gain (E4B +12% at 4K in alternated processes); "gate_up_runs" (a dense
MLP's one-token gate|up through the Q4_0 runs kernel, CUDA only) passed its operator and model tests
in session 12 and took the gate|up from 37-45 to 22.5 us per E4B layer and from 102 to 86-90 us per
31B layer (31B decode at 4K 62.5-63.2 -> 65.0-65.8 tok/s in alternated processes); its 16-row form
(quant_matvec.RUNS_ROWS) passed the whole `pytest -m gpu` in session 13 and took the 31B gate|up to
71 us (decode 65.7-67.7 -> 71.3-72.7 tok/s in alternated processes); "quant_matvec_runs" (one-token
Q4_0 dense rows through the runs kernel where its grid is wide, quant_matvec.dense_runs_wide: the
31B projections) passed them in sessions 12-13 and became a CUDA default in session 15 with its
staged bulk-copy form (31B q|k|v / o_proj / down 31 / 15 / 32 us against 33 / 16 / 37);
"quant_matvec_runs_m" (2..8 bf16 tokens with Q4_0 rows, dense and gate|up, through the runs16m
kernels, CUDA only) passed its operator tests and memcheck in session 16 and took the 31B FFN gate
at M = 8 from 39.1 to 26.3 us and the fused gate|up from 123 to 51.5 us; "matvec_gelu_mul" (an
E-series layer's per-layer-input gate and its gelu * input in one launch of the f32-FMA kernel)
passed its operator and model tests in session 18 (E4B at 4K 221.6 / 227.5 tok/s against 213.9 /
226.4 in alternated processes: one launch fewer per layer, a gain inside the run-to-run spread);
"moe_one_launch" (a MoE layer's one-token Q4_0 experts in one launch, custom_kernels.moe_experts,
CUDA only) passed its registry cases, operator tests, the MoE model test and compute-sanitizer in
session 20 (26B-A4B expert path 28.8 us per call against the two launches' 39.2; decode at 4K
233.7 / 243.0 tok/s against 218.2 / 243.3 in alternated processes); "norm_moe" (a MoE layer's
residual add after attention with the three norms of it the layer reads, one launch) and
"router_proj" (the router's bf16 projection as one kernel) passed their operator tests in sessions
9-11 and the model tests (every family on) since; they became CUDA defaults together in session 21,
when settings alternated in one process (bench/tools/inprocess_ab.py, 26B-A4B at 4K, 4 rounds) gave
197.4 tok/s median against 185.6 without them (ahead in all 4 rounds, host 5.04 against 5.31 ms);
"norm_moe_out" (a MoE layer's end: both branch post-norms, their sum and the residual norm step in
one launch, custom_kernels.norm) passed its registry cases, operator tests, compute-sanitizer and the
model tests in session 21 and became a CUDA default there (26B-A4B at 4K 210.0 tok/s median against
195.3 in one process, ahead in all 3 rounds); "router_fused" (a MoE router's projection and route in
one launch, custom_kernels.router.route_logits, CUDA only) passed its registry cases, operator test,
compute-sanitizer and the model tests in session 22 and became a CUDA default there (26B-A4B at 4K
276.4 tok/s median against 272.3 in one process, ahead in all 4 rounds, host 3.60 against 3.67 ms);
"attention_fused" (decode attention's partitions and their merge in one launch where the merge is
small: the sliding layers at one token, custom_kernels.attention's g4_attn_decode, CUDA only)
passed its registry cases, operator tests (bit-equal to the two launches), compute-sanitizer and
the model tests in session 22 and became a CUDA default there (in one process at 4K: 26B-A4B 281.8
tok/s median against 259.4, host lower in 4 of 4 rounds; E4B 226.2 against 201.7, ahead in 4 of 4);
"quant_matvec_tiles" (one bf16 token with Q4_0 dense rows or a dense gate|up of K 3840..6144, 16
whole rows per threadgroup copied front to back into shared memory, custom_kernels.quant_tiles,
CUDA on Hopper only) passed its registry cases, operator tests, compute-sanitizer and the model
tests in session 23 and became a CUDA default there (31B at 4K in one process 90.2 tok/s median
against 85.4, ahead in 3 of 3 rounds); "attention_mma" (decode attention's partitions on tensor
cores, the kv head's query rows as the mma's 16 rows, then a merge whose 8 warps split the
partitions: custom_kernels.attention's g4_attn_decode_mma and g4_attn_decode_merge_wide, CUDA sm_80+,
bf16; the model uses it where a kv head serves at least MMA_MIN_ROWS query rows and the one launch
does not apply: the 31B, 26B-A4B and 12B full layers) passed its registry cases, its operator tests
at the real shapes and a model-level test of the compiled step in session 27 and became a CUDA
default there (31B full layer at 32K 300 -> 176 us per call; in one process 31B at 32K 82.7
tok/s median against 76.2, 12B at 32K 143.5 against 133.7, 31B at 4K 93.3 against 92.4, ahead in
every round); its registry cases passed compute-sanitizer memcheck, racecheck and synccheck in
session 28; "attention_mma8" (the same for 4..8 query rows per kv head with both products
transposed, slots and head dims as the mma's 16 rows and the query rows its 8 columns: no padding
rows, half the mmas; custom_kernels.attention's g4_attn_decode_mma8, CUDA sm_80+, bf16: the 31B,
26B-A4B and E4B full layers, and E2B's full and sliding layers, unmeasured) passed its registry cases under compute-sanitizer memcheck,
racecheck and synccheck, its operator tests at the real shapes and the model-level tests in
session 29 and became a CUDA default there (per call at 32K, partial + merge: 31B full layer
175 -> 135 us and 26B-A4B 114 -> 81 against g4_attn_decode_mma, E4B 137 -> 69 against the
f32-FMA kernels); "attention_mma_staged" (attention_mma's partial kernel with each tile's K and V
rows bulk-copied into shared memory a tile ahead, ~132 thread blocks: custom_kernels.attention's
g4_attn_decode_mma_staged, CUDA on Hopper; after attention_mma8, it takes the 16-row full layers:
12B's) passed its registry cases under compute-sanitizer in session 28, its operator tests at the
real shapes and the model-level test of the compiled step in session 29 and became a CUDA default
(Hopper) there: 12B's full layer at 32K 114 -> 72 us per call (partial + merge), at 4K 43 -> 34;
in one process 12B at 32K 144.1 against 139.2 tok/s (session 28, 2 of 2 rounds) and 149.8 against
145.8 (session 29, 2 of 3), at 4K equal (151.5 against 151.7: host-bound); "kv_one_write" (a
compiled decode step's static caches hold K and V in one buffer [2B, H, S, D], written by one
scatter per layer from custom_kernels.rope's stacked g4_norm_rope_kv output; attention reads the
whole buffer as K, its first B rows, and a view of the rest as V: a layer's two cache scatters
become one scatter and one view) passed its registry cases, its operator test against
g4_norm_rope, compute-sanitizer memcheck and racecheck and the model tests (bit-equal logits to two
buffers) in sessions 30-31 and became a CUDA default in session 31 (in one process at 4K: 26B-A4B
279.8 against 251.0 tok/s, 3 of 3 rounds, and 203.6 against 177.4, 5 of 5; E2B 194.1 against
178.0, 3 of 3; 12B 161.1 against 148.4 and E4B 221.0 / 222.6 against 216.6 / 215.2, 2 of 3 each;
31B equal, GPU-bound: 89.7 against 91.7 at 4K, 88.1 against 87.7 at 32K); "embedding" (a token's
embedding row, and an E-series token's per-layer row, gathered from its Q8_0 / Q4_0 blocks,
dequantized and scaled in one launch, custom_kernels.embedding: one graph node for ~14 MLX ops)
passed the Metal emulator, its GPU operator tests (bit-equal to the MLX ops) and compute-sanitizer
memcheck in session 31 and the model tests (every family on) in session 32, and became a CUDA
default there (in one process at 4K: E2B 196.4 against 188.1 tok/s, 3 of 3 rounds; 26B-A4B 159.7
against 157.4, 3 of 3; E4B undecided, its rounds swinging 15-25%: ahead in 2 of 3 rounds in two
runs, behind in 2 of 3 in a third, 256.1 against 252.0 in session 31).
The exact texts that passed are pinned in gpu_tested.json (tests/test_kernel_provenance.py)."""

CUDA_ONLY = frozenset({"gate_up_split", "norm", "norm_rope", "gate_up_runs", "quant_matvec_runs", "quant_matvec_runs_m",
                       "matvec_gelu_mul", "moe_one_launch", "norm_moe", "router_proj", "norm_moe_out",
                       "router_fused", "attention_fused", "quant_matvec_tiles", "attention_mma",
                       "attention_mma8", "attention_mma_staged", "kv_one_write", "embedding"})  # fmt: skip
"""PROVEN families whose gain was measured on CUDA only: on Metal they stay opt-in (UNPROVEN_ENV)."""

OPT_IN = frozenset({"matvec_norm", "attention_staged", "mlp_one_launch", "moe_route_fold", "norm_route"})
"""Families written but not on by default on any backend (UNPROVEN_ENV turns them on):
"norm_route" (a MoE layer's post-attention residual norms and its router's projection and route in
one launch, custom_kernels.router.residual_norm_route, CUDA only; needs "norm_moe", "router_fused"
and "router" on; not used with "moe_route_fold", which takes the router's input): written in
session 33, bit for bit g4_residual_norm_moe then g4_route_logits on the H200 (operator and model
tests, compute-sanitizer) but not faster: 26B-A4B at 4K in one process 289.2 against 293.1 tok/s;
it reaches the experts ~7 us sooner per MoE layer, but the dense MLP, which ran beside the route,
then runs beside the experts and slows them by ~10 us (bench/NOTES.md);
"moe_route_fold" (a MoE layer's router projection and route folded into the one-launch experts
kernel as its first tickets, custom_kernels.moe_experts.q4_0_moe_routed, CUDA sm_80+; needs
"moe_one_launch", "router_fused" and "router" on: one launch per MoE layer fewer): passed its
registry cases and its operator test (bit-equal to route_logits then the experts kernel) in
session 32 but lost there: 26B-A4B at 4K in one process 274.0 against 296.0 tok/s, 0 of 3 rounds
(its waiting expert tickets take every SM, so the dense MLP's branch no longer runs beside the
route: bench/NOTES.md);
"mlp_one_launch" (a dense Q4_0 MLP's one bf16 token through the g4_q4_0_moe_experts text as its
only slot, id 0 of one-expert views of the MLP's blocks, weight 1: gate|up, GeGLU and down in one
launch instead of two; CUDA sm_80+, and only where its shared memory allows two threadgroups per SM:
moe_experts.MLP_SHARED_LIMIT): its kernel passed the operator test at 26B-A4B's, E2B's, E4B's and
12B's dense shapes and the model tests in session 32 (the op's None above the limit, E4B's and
12B's, has not run on a GPU), but showed no gain there: in one process at 4K 26B-A4B
158.3 against 157.4 tok/s (2 of 3 rounds), E2B 186.3 against 188.1 (1 of 3), and E4B (before the
shared-memory limit, with the text whose down tickets used 2 of 16 warps at one slot) 104.8
against 160.4;
"attention_staged" (the one-launch decode attention with each tile's K and V rows bulk-copied
into shared memory before the query rows load, custom_kernels.attention's g4_attn_decode_staged,
CUDA on Hopper only; used where "attention_fused" is): bit-equal to the one launch and passed
its GPU tests in session 26, 20-45% less GPU time per call in bench/attention.py (31B sliding
29.9 -> 23.6 us, 12B 45.6 -> 25.3) but only 21.7 -> 20.7 us per 31B sliding layer inside the
decode step, and no decode gain in one process (31B at 4K 92.2 against 92.8 tok/s);
"matvec_norm" (a one-token Q4_0 / Q8_0 split-K projection and the residual norm after it in one
launch, custom_kernels.matvec_norm, CUDA only): passed its registry cases, operator tests,
compute-sanitizer and the model tests in session 22, but lost on the GPU: 33 launches fewer per
12 E4B layers and 0.11 ms less of other ops, yet its kernels took 0.33 ms more (the grid's last
block normalizing the row alone, and 96 registers at E4B's width), so E4B at 4K read 206.0 against
212.7 tok/s in one process (bench/NOTES.md)."""

FAMILIES = PROVEN | OPT_IN
"""Every op family the model can use."""

_kernel_cache: dict[tuple, Callable] = {}


def geometry_fields(cfg, env: str) -> dict[str, int]:
    """The fields environment variable `env` ("name=INT,name=INT") sets on launch-geometry
    dataclass `cfg`: {} when unset or empty; ValueError for a name cfg lacks or a non-integer."""
    text = os.environ.get(env, "").strip()
    fields = {f.name for f in dataclasses.fields(cfg)}
    changes = {}
    for item in text.split(",") if text else []:
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in fields or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"{env}: '{item.strip()}' is not NAME=INTEGER with NAME one of {', '.join(sorted(fields))}")
        changes[name] = int(value)
    return changes


def replace_geometry(cfg, changes: dict, env: str):
    """dataclasses.replace(cfg, **changes), its ValueError naming `env` and what it says."""
    try:
        return dataclasses.replace(cfg, **changes)
    except ValueError as exc:
        raise ValueError(f"{env}={os.environ.get(env, '').strip()}: {exc}") from None


def geometry_override(cfg, env: str):
    """cfg (a frozen dataclass of launch geometry) with the fields named in environment variable
    `env` ("name=INT,name=INT") replaced: a tuning knob for trying geometries inside a model on
    a GPU the defaults were not measured on. Unset or empty: cfg itself. Bad text: ValueError."""
    changes = geometry_fields(cfg, env)
    return replace_geometry(cfg, changes, env) if changes else cfg


def ticket_counters(words: int) -> mx.array:
    """Zeroed uint32 [words]: the counters of a kernel whose thread blocks take tickets (the last
    one finishes the work and zeroes them for the next call); one array per call site or layer.
    Made from host memory, not by mx.zeros: a lazy zeros op would sit in the graph that first uses
    it, and a compiled step traced then would fill fresh counters every step (mx.compile merges the
    layers' identical zeros ops into one buffer, which calls one after another may share)."""
    import numpy as np

    return mx.array(np.zeros(words, np.uint32))


def check_ticket_counters(counters: mx.array, words: int, made_by: str) -> None:
    """ValueError unless counters is uint32 [words] (what `made_by`() returns)."""
    if counters.dtype != mx.uint32 or counters.shape != (words,):
        raise ValueError(f"counters must be uint32 [{words}] ({made_by}()), got {counters.dtype} {counters.shape}")


def backend() -> str:
    """The GPU dialect this MLX build runs: "metal", "cuda", or "cpu" when there is no GPU backend."""
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def cuda_arch() -> int:
    """The CUDA device's compute capability as major * 10 + minor (90: Hopper), or 0 when MLX does
    not report one (not a CUDA build). Kernels with Hopper-only instructions (bulk copies,
    mbarrier transaction counts) check it: on older GPUs their families take other kernels."""
    return _device_arch() if backend() == "cuda" else 0


@functools.lru_cache(maxsize=1)
def _device_arch() -> int:
    info = mx.device_info()
    return 10 * int(info.get("compute_capability_major", 0)) + int(info.get("compute_capability_minor", 0))


def use_reference() -> bool:
    """True when ops must use their pure-MLX reference instead of a custom kernel.

    That is the case on CPU-only builds and whenever ``GEMMA4_MLX_KERNELS=reference`` is set
    (read on every call, so tests and benchmarks can switch it at run time).
    """
    mode = os.environ.get(KERNELS_ENV, "").strip().lower()
    if mode not in ("", "auto", "kernel", "kernels", "reference"):
        raise ValueError(f"{KERNELS_ENV}={mode!r}: expected 'reference' or unset")
    return mode == "reference" or backend() == "cpu"


def _families_named(env: str) -> frozenset[str]:
    """The op families environment variable ``env`` lists (comma-separated); ValueError for a name
    that is not a family, so a typo cannot silently leave a kernel on or off."""
    return _parse_families(env, os.environ.get(env, ""))


@functools.lru_cache(maxsize=64)
def _parse_families(env: str, text: str) -> frozenset[str]:
    named = frozenset(f.strip() for f in text.split(",") if f.strip())
    unknown = named - FAMILIES
    if unknown:
        raise ValueError(f"{env}: unknown kernel families {sorted(unknown)}; known: {', '.join(sorted(FAMILIES))}")
    return named


def use_kernel(family: str) -> bool:
    """True when the model should call op family ``family``'s custom kernel: a GPU build, no
    ``GEMMA4_MLX_KERNELS=reference``, the family not named in ``GEMMA4_MLX_KERNELS_OFF``, and
    proven on hardware (or opted into through ``GEMMA4_MLX_UNPROVEN_KERNELS``). A kernel becomes
    a default only after it climbs the correctness ladder (design.md), including ``pytest -m gpu``."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; known: {', '.join(sorted(FAMILIES))}")
    off, opted = _families_named(KERNELS_OFF_ENV), _families_named(UNPROVEN_ENV)
    if use_reference() or family in off:
        return False
    if family in opted:
        return True
    return family in PROVEN and (family not in CUDA_ONLY or backend() == "cuda")


def mlx_kernel_name(name: str, header: str, source: str) -> str:
    """The name handed to MLX for one kernel text: `name` plus a digest of (header, source).

    MLX keys its compiled kernels by name (and template arguments) only: in memory, and on CUDA also
    in its PTX disk cache (MLX_PTX_CACHE_DIR, by default under the temp directory), which outlives
    the process. A name that stayed the same while its text changed (a new gemma4-mlx version, an
    edited kernel) would load the old compiled kernel; with the digest it cannot."""
    digest = hashlib.sha256(f"{header}\0{source}".encode()).hexdigest()[:16]
    return f"{name}_{digest}"


def get_kernel(
    name: str,
    input_names: tuple[str, ...],
    output_names: tuple[str, ...],
    metal: tuple[str, str],
    cuda: tuple[str, str],
    *,
    cuda_shared_memory: int = 0,
) -> Callable:
    """The MLX custom-kernel object for one kernel source on the current backend, cached; MLX gets
    the name `mlx_kernel_name(name, header, source)` of the text it is handed (on CUDA compacted,
    see KERNEL_TEXT_ENV).

    ``metal`` and ``cuda`` are (header, source) pairs exactly as passed to
    ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel``. Template instantiations (dtype and
    integer constants) are compiled and cached by MLX per call signature, so one object serves
    every (dtype, constants) combination of this source. Raises RuntimeError on a CPU build.
    """
    which = backend()
    header, source = metal if which == "metal" else cuda
    text_form = os.environ.get(KERNEL_TEXT_ENV, "").strip() or "pruned"
    if text_form not in ("compact", "full", "pruned", "short"):
        raise ValueError(f"{KERNEL_TEXT_ENV} must be 'compact', 'full', 'pruned' or 'short', got {text_form!r}")
    key = (which, name, input_names, output_names, header, source, cuda_shared_memory, text_form)
    kernel = _kernel_cache.get(key)
    if kernel is not None:
        return kernel
    if which == "cuda" and text_form != "full":  # Metal: as written (no Apple GPU measured it)
        try:
            header, source = compact_text(header), compact_text(source)
        except ValueError as exc:
            raise ValueError(f"kernel {name!r}: {exc}") from None
        if text_form in ("pruned", "short"):
            header = prune_helpers(header, source)
        if text_form == "short":
            header, source = short_names(header, source, (*input_names, *output_names))
    mlx_name = mlx_kernel_name(name, header, source)
    if which == "metal":
        kernel = mx.fast.metal_kernel(
            name=mlx_name,
            input_names=list(input_names),
            output_names=list(output_names),
            source=source,
            header=header,
        )
    elif which == "cuda":
        kernel = mx.fast.cuda_kernel(
            name=mlx_name,
            input_names=list(input_names),
            output_names=list(output_names),
            source=source,
            header=header,
            shared_memory=cuda_shared_memory,
        )
    else:
        raise RuntimeError(f"custom kernel {name!r} requested on a CPU-only MLX build")
    _kernel_cache[key] = kernel
    return kernel


def clear_kernel_cache() -> None:
    """Forget every cached kernel object (MLX keeps its own compiled libraries)."""
    _kernel_cache.clear()


@dataclass(frozen=True)
class KernelSource:
    """One kernel: its MLX custom-kernel signature and its text per dialect,
    ``text = {"metal": (header, source), "cuda": (header, source)}``."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    text: dict

    def kernel(self, cuda_shared_memory: int = 0) -> Callable:
        """The cached MLX kernel object for this backend (see get_kernel), on CUDA created with
        ``cuda_shared_memory`` bytes of dynamic shared memory."""
        return get_kernel(self.name, self.input_names, self.output_names, self.text["metal"], self.text["cuda"],
                          cuda_shared_memory=cuda_shared_memory)  # fmt: skip


MX_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
"""Activation / cache dtypes the kernels are instantiated for, by template name."""


def dtype_name(dtype: mx.Dtype) -> str:
    """"float32" | "bfloat16" | "float16" for a kernel template; TypeError for anything else."""
    for name, d in MX_DTYPES.items():
        if d == dtype:
            return name
    raise TypeError(f"unsupported dtype {dtype}; the kernels take float32, bfloat16 or float16")


def template_args(template: list) -> list:
    """A launch template [(name, dtype name | int | bool)] with dtype names turned into MLX dtypes."""
    return [(name, MX_DTYPES[v] if isinstance(v, str) else v) for name, v in template]
