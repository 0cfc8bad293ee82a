"""One kernel body, two dialects: emit Metal and CUDA text for MLX custom kernels.

A kernel body is written once, in MLX's custom-kernel style (the function body only; MLX writes
the signature), using two kinds of portable names:

1. ``$name`` placeholders, replaced here by text (so the emitted source reads like hand-written
   Metal or CUDA, and so Metal attribute names appear literally in the body, which is how
   ``mx.fast.metal_kernel`` decides which attributes to pass):

   ============== =========================================== ===============================
   placeholder    Metal                                       CUDA
   ============== =========================================== ===============================
   $lane          (int)thread_index_in_simdgroup              (int)(threadIdx.x & 31u)
   $simd          (int)simdgroup_index_in_threadgroup         (int)(threadIdx.x >> 5)
   $tid           (int)thread_position_in_threadgroup.x       (int)threadIdx.x
   $tg_x/$tg_y/.. (int)threadgroup_position_in_grid.x/y/z     (int)blockIdx.x/y/z
   $device        device                                      (nothing)
   $thread        thread                                      (nothing)
   $shared        threadgroup                                 __shared__
   $barrier       threadgroup_barrier(mem_flags::...)         __syncthreads()
   $simd_barrier  simdgroup_barrier(mem_flags::mem_none)      __syncwarp()
   $unroll        _Pragma("clang loop unroll(full)")          _Pragma("unroll")
   ============== =========================================== ===============================

   Threadgroups are one-dimensional (x) and SIMD groups are 32 lanes on both backends.

2. ``g4_*`` helper functions with the same names and meaning in both preludes (see PRELUDE_*):
   SIMD reductions and shuffles, bit casts, fp16/bf16 bit conversions, vector loads of
   activations into f32 registers (overloaded on float / bfloat16 / float16 pointers), 16-bit
   weight loads, and gelu_tanh.

The header passed to MLX is ``prelude(dialect)`` plus any kernel-specific helpers. Template
arguments (``T``, integer and bool constants) are used as plain identifiers: MLX makes them C++
template parameters on Metal and ``using``/``constexpr`` lines at the top of the body on CUDA.
Inputs are ``const T*`` on CUDA and ``const device T*`` on Metal (``constant`` below 8 elements,
so index small inputs directly rather than binding them to ``$device`` pointers).
"""

from __future__ import annotations

import itertools
import re

DIALECTS = ("metal", "cuda")

_PLACEHOLDERS: dict[str, dict[str, str]] = {
    "lane": {"metal": "(int)thread_index_in_simdgroup", "cuda": "(int)(threadIdx.x & 31u)"},
    "simd": {"metal": "(int)simdgroup_index_in_threadgroup", "cuda": "(int)(threadIdx.x >> 5)"},
    "tid": {"metal": "(int)thread_position_in_threadgroup.x", "cuda": "(int)threadIdx.x"},
    "tg_x": {"metal": "(int)threadgroup_position_in_grid.x", "cuda": "(int)blockIdx.x"},
    "tg_y": {"metal": "(int)threadgroup_position_in_grid.y", "cuda": "(int)blockIdx.y"},
    "tg_z": {"metal": "(int)threadgroup_position_in_grid.z", "cuda": "(int)blockIdx.z"},
    "device": {"metal": "device", "cuda": ""},
    "thread": {"metal": "thread", "cuda": ""},
    "shared": {"metal": "threadgroup", "cuda": "__shared__"},
    "barrier": {
        "metal": "threadgroup_barrier(mem_flags::mem_threadgroup)",
        "cuda": "__syncthreads()",
    },
    "simd_barrier": {"metal": "simdgroup_barrier(mem_flags::mem_none)", "cuda": "__syncwarp()"},
    "unroll": {"metal": '_Pragma("clang loop unroll(full)")', "cuda": '_Pragma("unroll")'},
}

_PLACEHOLDER_RE = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")

PRELUDE_METAL = r"""
#include <metal_stdlib>
#include <metal_simdgroup>
using namespace metal;

// gemma4-mlx dialect prelude (Metal)
static inline float g4_simd_sum(float v) { return simd_sum(v); }
static inline float g4_simd_max(float v) { return simd_max(v); }
static inline float g4_shuffle_xor(float v, int mask) { return simd_shuffle_xor(v, (ushort)mask); }
static inline float g4_as_float(uint32_t bits) { return as_type<float>(bits); }
static inline float g4_nan() { return as_type<float>(0x7fc00000u); }
static inline uint32_t g4_as_uint(float v) { return as_type<uint32_t>(v); }
static inline float g4_half_bits(uint32_t bits) { return float(as_type<half>((ushort)bits)); }
static inline float g4_bf16_bits(uint32_t bits) { return as_type<float>(bits << 16); }
static inline uint32_t g4_u16(const device uint8_t* p) { return (uint32_t)(*((const device ushort*)p)); }
static inline float g4_gelu_tanh(float v) {
  return 0.5f * v * (1.0f + metal::precise::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)));
}
static inline void g4_load2(const device float* p, thread float* o) {
  float2 a = *((const device float2*)p); o[0] = a.x; o[1] = a.y;
}
static inline void g4_load4(const device float* p, thread float* o) {
  float4 a = *((const device float4*)p); o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
}
static inline void g4_load2(const device bfloat16_t* p, thread float* o) {
  uint32_t a = *((const device uint32_t*)p);
  o[0] = as_type<float>(a << 16); o[1] = as_type<float>(a & 0xffff0000u);
}
static inline void g4_load4(const device bfloat16_t* p, thread float* o) {
  uint2 a = *((const device uint2*)p);
  o[0] = as_type<float>(a.x << 16); o[1] = as_type<float>(a.x & 0xffff0000u);
  o[2] = as_type<float>(a.y << 16); o[3] = as_type<float>(a.y & 0xffff0000u);
}
static inline void g4_load2(const device half* p, thread float* o) {
  half2 a = *((const device half2*)p); o[0] = float(a.x); o[1] = float(a.y);
}
static inline void g4_load4(const device half* p, thread float* o) {
  half4 a = *((const device half4*)p);
  o[0] = float(a.x); o[1] = float(a.y); o[2] = float(a.z); o[3] = float(a.w);
}
"""

PRELUDE_CUDA = r"""
// gemma4-mlx dialect prelude (CUDA; MLX already includes cuda_fp16.h, cuda_bf16.h, cooperative_groups)
__device__ __forceinline__ float g4_simd_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float g4_simd_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float g4_shuffle_xor(float v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}
__device__ __forceinline__ float g4_as_float(uint32_t bits) { return __uint_as_float(bits); }
__device__ __forceinline__ float g4_nan() { return __uint_as_float(0x7fc00000u); }
__device__ __forceinline__ uint32_t g4_as_uint(float v) { return __float_as_uint(v); }
__device__ __forceinline__ float g4_half_bits(uint32_t bits) {
  return __half2float(__ushort_as_half((unsigned short)bits));
}
__device__ __forceinline__ float g4_bf16_bits(uint32_t bits) { return __uint_as_float(bits << 16); }
__device__ __forceinline__ uint32_t g4_u16(const uint8_t* p) {
  return (uint32_t)__ldg(reinterpret_cast<const unsigned short*>(p));
}
__device__ __forceinline__ float g4_gelu_tanh(float v) {
  return 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
}
__device__ __forceinline__ void g4_load2(const float* p, float* o) {
  float2 a = __ldg(reinterpret_cast<const float2*>(p)); o[0] = a.x; o[1] = a.y;
}
__device__ __forceinline__ void g4_load4(const float* p, float* o) {
  float4 a = __ldg(reinterpret_cast<const float4*>(p)); o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
}
__device__ __forceinline__ void g4_load2(const __nv_bfloat16* p, float* o) {
  uint32_t a = __ldg(reinterpret_cast<const unsigned int*>(p));
  o[0] = __uint_as_float(a << 16); o[1] = __uint_as_float(a & 0xffff0000u);
}
__device__ __forceinline__ void g4_load4(const __nv_bfloat16* p, float* o) {
  uint2 a = __ldg(reinterpret_cast<const uint2*>(p));
  o[0] = __uint_as_float(a.x << 16); o[1] = __uint_as_float(a.x & 0xffff0000u);
  o[2] = __uint_as_float(a.y << 16); o[3] = __uint_as_float(a.y & 0xffff0000u);
}
__device__ __forceinline__ void g4_load2(const __half* p, float* o) {
  float2 a = __half22float2(*reinterpret_cast<const __half2*>(p)); o[0] = a.x; o[1] = a.y;
}
__device__ __forceinline__ void g4_load4(const __half* p, float* o) {
  const __half2* h = reinterpret_cast<const __half2*>(p);
  float2 a = __half22float2(h[0]); float2 b = __half22float2(h[1]);
  o[0] = a.x; o[1] = a.y; o[2] = b.x; o[3] = b.y;
}
"""

_PRELUDES = {"metal": PRELUDE_METAL, "cuda": PRELUDE_CUDA}


def _check(dialect: str) -> None:
    if dialect not in DIALECTS:
        raise ValueError(f"unknown dialect {dialect!r}; expected one of {DIALECTS}")


def placeholders() -> tuple[str, ...]:
    """Names usable as ``$name`` in a kernel body."""
    return tuple(_PLACEHOLDERS)


def render(text: str, dialect: str) -> str:
    """Replace every ``$name`` placeholder in ``text`` with its ``dialect`` spelling.

    Raises KeyError on an unknown placeholder, so a typo cannot reach a GPU compiler.
    """
    _check(dialect)

    def sub(match: re.Match) -> str:
        name = match.group(1)
        if name not in _PLACEHOLDERS:
            raise KeyError(f"unknown dialect placeholder ${name}")
        return _PLACEHOLDERS[name][dialect]

    return _PLACEHOLDER_RE.sub(sub, text)


def prelude(dialect: str) -> str:
    """The shared helper functions (``g4_*``) for ``dialect``; goes first in every kernel header."""
    _check(dialect)
    return _PRELUDES[dialect]


def header(dialect: str, extra: str = "") -> str:
    """Kernel header for ``dialect``: the prelude, then ``extra`` (rendered) helper code."""
    return prelude(dialect) + (render(extra, dialect) if extra else "")


def local_tokens(text: str, local: dict | None, dialect: str) -> str:
    """``text`` with a module's own per-dialect tokens replaced: ``local`` = {dialect: {token: text}}
    (e.g. "@FN@" for a helper function's qualifiers)."""
    for token, value in (local or {}).get(dialect, {}).items():
        text = text.replace(token, value)
    return text


def emit(body: str, extra_header: str = "", local: dict | None = None) -> dict[str, tuple[str, str]]:
    """Both dialects of one kernel: {"metal": (header, source), "cuda": (header, source)}, the
    module's ``local`` tokens (local_tokens) replaced in the body and the extra header before
    rendering."""
    return {d: (header(d, local_tokens(extra_header, local, d)), render(local_tokens(body, local, d), d)) for d in DIALECTS}


def compact_text(text: str) -> str:
    """``text`` (C++ / CUDA / Metal) without comments, indentation, blank lines or line splices,
    meaning what it meant: backslash-newlines are spliced first (as the preprocessor does, so a
    ``//`` comment or a string continued that way keeps its extent), a comment inside a ``#`` line
    becomes one space, elsewhere a block comment keeps its line breaks (a ``#`` after it still
    starts a line); string and character literals are kept as they are. ValueError on an
    unterminated block comment or literal."""
    text = text.replace("\\\n", "")
    out, i, n = [], 0, len(text)
    line_start, directive = True, False
    while i < n:
        c = text[i]
        if c == "\n":
            line_start, directive = True, False
        elif line_start and not c.isspace() and not text.startswith(("//", "/*"), i):
            line_start, directive = False, c == "#"
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            if j >= n or text[j] != c:
                raise ValueError(f"unterminated literal at offset {i}")
            out.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise ValueError(f"unterminated block comment at offset {i}")
            breaks = 0 if directive else text.count("\n", i, j)
            out.append(" " + "\n" * breaks)
            line_start = line_start or breaks > 0
            i = j + 2
        else:
            out.append(c)
            i += 1
    lines = (line.strip() for line in "".join(out).split("\n"))
    return "".join(line + "\n" for line in lines if line)


_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _top_level_items(text: str) -> list[str]:
    """``text`` cut into its top-level items: preprocessor lines, and declarations or definitions
    ending at a ``;`` or a closing ``}`` (plus an optional ``;``) at brace depth 0, each with the
    rest of its line if that is blank; literals skipped."""
    items, depth, start, i, n = [], 0, 0, 0, len(text)

    def line_rest(j: int) -> int:
        k = j
        while k < n and text[k] in " \t":
            k += 1
        return k + 1 if k < n and text[k] == "\n" else j
    while i < n:
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            continue
        if depth == 0 and c == "#" and not text[start:i].strip():
            j = text.find("\n", i)
            j = n if j < 0 else j + 1
            items.append(text[start:j])
            start = i = j
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                j = i + 1
                if text.startswith(";", j):
                    j += 1
                j = line_rest(j)
                items.append(text[start:j])
                start, i = j, j
                continue
        elif c == ";" and depth == 0:
            j = line_rest(i + 1)
            items.append(text[start:j])
            start = i = j
            continue
        i += 1
    if text[start:].strip():
        items.append(text[start:])
    return items


def _function_name(item: str) -> str | None:
    """The name of a plain function definition (``... name(args) { ... }``), else None: directives,
    declarations, structs, variables and operators are never pruned."""
    head = item.split("{", 1)[0]
    if item.lstrip().startswith("#") or "{" not in item or "(" not in head or "=" in head.split("(", 1)[0]:
        return None
    if re.search(r"\b(struct|union|class|operator|enum)\b", head):
        return None
    names = _IDENT_RE.findall(head.split("(", 1)[0])
    return names[-1] if names else None


def prune_helpers(header: str, source: str) -> str:
    """``header`` without the function definitions that neither ``source`` nor a kept item names
    (found by identifier, so every overload of a used name stays). Everything that is not a plain
    function definition (directives, types, variables, operators) stays. The compiler sees the same
    code for the kernel: an uncalled inline or template function emits nothing."""
    items = _top_level_items(header)
    names = [_function_name(item) for item in items]
    used = set(_IDENT_RE.findall(source))
    for item, name in zip(items, names):
        if name is None:
            used |= set(_IDENT_RE.findall(item))
    kept: set[str] = set()
    grew = True
    while grew:
        grew = False
        for item, name in zip(items, names):
            if name is not None and name in used and name not in kept:
                kept.add(name)
                used |= set(_IDENT_RE.findall(item))
                grew = True
    return "".join(item for item, name in zip(items, names) if name is None or name in kept)


_KEYWORDS = frozenset("""alignas alignof asm auto bool break case catch char class const constexpr const_cast
continue decltype default delete do double dynamic_cast else enum explicit extern false float for friend goto if
inline int long mutable namespace new noexcept nullptr operator private protected public register reinterpret_cast
return short signed sizeof static static_assert static_cast struct switch template this throw true try typedef
typeid typename union unsigned using virtual void volatile while and and_eq bitand bitor compl not not_eq or or_eq
xor xor_eq""".split())

_NOT_TYPES = _KEYWORDS - frozenset("auto bool char const constexpr double float int long short signed unsigned void "
                                   "volatile".split())  # fmt: skip
"""Words before an identifier that do not make it a declaration (``return x;`` declares nothing)."""

_QUALIFIERS = frozenset({"const", "volatile", "unsigned", "signed"})

_CUDA_NAMES = frozenset({"threadIdx", "blockIdx", "blockDim", "gridDim", "warpSize", "inf"})
"""Names CUDA (or MLX's wrapper: ``inf``) defines that a text may use as if it declared them."""

_OPAQUE = r"""#[^\n]*|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'"""  # a directive line, a string or char literal
_TOKEN_RE = re.compile(_OPAQUE + r"|[A-Za-z_][A-Za-z0-9_]*|\d[\w.]*|::|->|\S")
_CODE_RE = re.compile(_OPAQUE + r"""|[^#"']+""")  # opaque pieces, and the code between them


def _declarations(tokens: list[str], keep: set[str], known: frozenset = frozenset()) -> tuple[list[str], set[str]]:
    """(names declared in `tokens`: an identifier after a type word, then `=`, `;`, `,`, `[`, `(`,
    `)` or `:`; the ones declared at brace depth 0 and followed by `(`: functions), adding to `keep`
    the names that must stay (see short_names), among them a name used before the text declares it
    (not `known`): that use names something else (a template argument an inner scope shadows)."""
    declared, functions, tpl, braces, early = [], set(), 0, 0, set()
    for i, tok in enumerate(tokens):
        prev = tokens[i - 1] if i else ""
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if tok.startswith("#"):
            keep.update(_IDENT_RE.findall(tok))
            continue
        braces += {"{": 1, "}": -1}.get(tok, 0)
        if prev == "template" and tok == "<":
            tpl = 1
            continue
        if tpl:  # inside a template parameter list
            tpl += {"<": 1, ">": -1}.get(tok, 0)
            if _IDENT_RE.fullmatch(tok):
                keep.add(tok)
            continue
        if not _IDENT_RE.fullmatch(tok) or tok in _KEYWORDS:
            continue
        if prev in (".", "->", "::") or nxt == "::" or tok.startswith("__"):
            keep.add(tok)
        elif (_IDENT_RE.fullmatch(prev) and prev not in _NOT_TYPES and nxt in ("=", ";", ",", "[", "(", ")", ":")
              and not (nxt == ")" and prev in _QUALIFIERS)):  # `(const uint32_t)v` casts  # fmt: skip
            declared.append(tok)
            if braces == 0 and nxt == "(":
                functions.add(tok)
        elif tok not in declared and tok not in known:
            early.add(tok)
    keep |= early & set(declared)
    return declared, functions


def short_names(header: str, source: str, keep: tuple[str, ...] = ()) -> tuple[str, str]:
    """``header`` and ``source`` (compacted, as ``compact_text`` gives them) with short names for
    the ones the text declares (the kernel body's locals, the helper functions, the helpers' own
    locals and parameters where the body does not name them), the same in both, and the words the
    text repeats most as macros where that saves bytes. Never renamed: `keep` (MLX's names for the
    kernel's inputs and outputs), names in preprocessor lines or template parameter lists, members
    (after ``.`` / ``->``), names beside ``::``, names starting with ``__``, keywords and CUDA's
    built-in variables; MLX's template arguments are never declared by the text. The compiler sees
    the same program: nvcc emits the same PTX (tests/test_metal_compile.py)."""
    head_tokens, body_tokens = _TOKEN_RE.findall(header), _TOKEN_RE.findall(source)
    keep_set = set(_CUDA_NAMES) | set(keep) | {n + sfx for n in keep for sfx in ("_shape", "_strides", "_ndim")}
    head_declared, functions = _declarations(head_tokens, keep_set)
    body_declared, _ = _declarations(body_tokens, keep_set, frozenset(head_declared))
    body_names = {t for t in body_tokens if _IDENT_RE.fullmatch(t)}
    # helper functions only by this codebase's prefix: a header function named like a CUDA or MLX
    # one, or like a template argument, may be what some body's call means
    declared = body_declared + [n for n in head_declared
                                if (n in functions and n.startswith("g4")) or n in body_declared
                                or (n not in functions and n not in body_names)]  # fmt: skip
    used = keep_set | {t for t in head_tokens + body_tokens if _IDENT_RE.fullmatch(t)}
    used |= {name for tok in head_tokens + body_tokens if tok.startswith("#") for name in _IDENT_RE.findall(tok)}
    rename: dict[str, str] = {}
    fresh = (f"z{n:x}" for n in itertools.count())
    for name in dict.fromkeys(declared):
        if name in keep_set or len(name) <= 2:
            continue
        new = next(fresh)
        while new in used:
            new = next(fresh)
        rename[name] = new

    def sub(text: str) -> str:  # identifiers only: spacing, literals and directives stay as they are
        return _TOKEN_RE.sub(lambda m: rename.get(m.group(0), m.group(0)), text)

    header, source = sub(header), sub(source)
    # the words the texts repeat most, each a macro where that saves bytes
    used |= set(rename.values())
    defines = []
    for word in _MACRO_WORDS:
        pattern = re.compile(r"(?<![A-Za-z0-9_])" + re.escape(word) + r"(?![A-Za-z0-9_])")
        if word == _UNROLL:  # holds a string literal: counted (and replaced) as plain text
            hits = header.count(word) + source.count(word)
        else:
            hits = sum(len(pattern.findall(m.group(0))) for t in (header, source) for m in _CODE_RE.finditer(t)
                       if m.group(0)[0] not in "#\"'")  # fmt: skip
        new = next(fresh)
        while new in used:
            new = next(fresh)
        line = f"#define {new} {word}\n"
        if hits * (len(word) - len(new)) <= len(line):
            continue
        used.add(new)
        defines.append(line)
        if word == _UNROLL:
            glued = re.compile(re.escape(word) + r"(?=[A-Za-z0-9_])")  # `_Pragma("unroll")for`
            header, source = (glued.sub(new + " ", t).replace(word, new) for t in (header, source))
            continue

        def macro(text: str, pattern=pattern, new=new) -> str:
            return _CODE_RE.sub(lambda m: m.group(0) if m.group(0)[0] in "#\"'" else pattern.sub(new, m.group(0)), text)

        header, source = macro(header), macro(source)
    return "".join(defines) + header, source


_UNROLL = '_Pragma("unroll")'
_MACRO_WORDS = ("__device__ __forceinline__", "reinterpret_cast", _UNROLL, "static_cast", "const", "uint32_t",
                "__uint_as_float", "__shfl_xor_sync", "__syncthreads", "constexpr", "unsigned", "uint8_t",
                "threadIdx", "size_t", "float", "return", "__nv_bfloat16", "__ldg", "__shared__")  # fmt: skip
