"""Rules the CUDA kernel texts must keep that no CPU compiler checks: a pointer into shared memory
never reaches a load through the read-only cache (``__ldg`` / ``__ldcg``, and the prelude helpers
built on them), which reads global memory only (on the H200: "Invalid __global__ read", session 33)."""

from __future__ import annotations

import re

import pytest

from custom_kernels.dialect import prelude
from custom_kernels.registry import all_kernel_specs

def helper_bodies(text: str) -> dict[str, str]:
    """{name: body} of the __device__ functions named g4_* in `text` (bodies found by brace matching;
    an overloaded name: its bodies joined)."""
    out = {}
    for m in re.finditer(r"__device__[^;{()]*?\b(g4_\w+)\s*\(", text):
        start = text.find("{", m.end())
        if start < 0 or ";" in text[m.end():start].split(")")[-1]:
            continue  # a declaration, not a definition
        depth, i = 0, start
        while i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                break
            i += 1
        out[m.group(1)] = out.get(m.group(1), "") + text[start:i + 1]
    return out


def global_only_helpers(text: str) -> set[str]:
    """__ldg, __ldcg and the g4_* helpers of `text` that load through them, directly or by calling
    one another (to a closure)."""
    bodies, names = helper_bodies(text), {"__ldg", "__ldcg"}
    while True:
        more = {n for n, body in bodies.items() if re.search(r"\b(%s)\(" % "|".join(names), body)} - names
        if not more:
            return names
        names |= more


_HEADERS = "\n".join({spec.cuda_header for spec in all_kernel_specs()} | {prelude("cuda")})
GLOBAL_ONLY = sorted(global_only_helpers(_HEADERS))


def shared_names(text: str) -> set[str]:
    """Names declared __shared__ in `text` and the local pointers initialised from them (to a
    closure): `T* p = s + k;`, `const T* p = reinterpret_cast<const T*>(s);` and the like."""
    names = {m.group(1) for m in re.finditer(r"__shared__[^;]*?\b(\w+)\s*(?:\[[^;\]]*\])*\s*;", text)}
    while True:
        alias = re.compile(r"\*\s*(\w+)\s*=\s*(?:\([^;=]*?\)\s*)?(?:\w+_cast<[^;]*?>\()?\s*&?\s*(?:%s)\b" % "|".join(map(re.escape, names)))
        more = {m.group(1) for m in alias.finditer(text)} - names if names else set()
        if not more:
            return names
        names |= more


def global_only_loads_of_shared(text: str) -> list[str]:
    """Calls in `text` that hand a shared-memory name (or an alias of one) to a global-only load."""
    names = shared_names(text)
    if not names:
        return []
    call = re.compile(r"\b(%s)\(\s*(?:\([^()]*\)\s*)?(?:\w+_cast<[^;]*?>\()?\s*&?\s*(%s)\b"
                      % ("|".join(GLOBAL_ONLY), "|".join(map(re.escape, names))))
    return [m.group(0) for m in call.finditer(text)]


def test_the_rule_finds_the_session_33_bug():
    assert {"g4_load4", "g4_load2", "__ldg", "g4_ldcg4"} <= set(GLOBAL_ONLY)
    nested = "__device__ __forceinline__ float g4_a(const float* p) { if (p) { return __ldg(p); } return 0.0f; }\n"
    nested += "__device__ inline float g4_b(const float* p) { return g4_a(p) * 2.0f; }\n"
    assert {"g4_a", "g4_b"} <= global_only_helpers(nested)
    bug = "__shared__ __align__(16) T g4_xr[D];\n{ const T* xr = g4_xr;\n g4_load4(xr + c, a);\n g4_load4(wr + c, b); }"
    assert global_only_loads_of_shared(bug) == ["g4_load4(xr"]
    fixed = bug.replace("g4_load4(xr + c, a);", "a[0] = static_cast<float>(xr[c]);")
    assert global_only_loads_of_shared(fixed) == []
    cast = "__shared__ uint32_t s[8];\nconst uint2* q = reinterpret_cast<const uint2*>(s + 2);\nuint2 v = __ldg(q);"
    assert global_only_loads_of_shared(cast) == ["__ldg(q"]


@pytest.mark.parametrize("spec", all_kernel_specs(), ids=lambda s: s.name)
def test_no_shared_pointer_reaches_a_global_only_load(spec):
    assert not global_only_loads_of_shared(spec.cuda_header + "\n" + spec.cuda_source), spec.name
