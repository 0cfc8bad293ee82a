"""Rules the CUDA kernel texts must keep that no CPU compiler checks: a pointer into shared memory
never reaches a load through the read-only cache (``__ldg`` / ``__ldcg``, and the prelude helpers
built on them), which reads global memory only (on the H200: "Invalid __global__ read", session 33)."""

from __future__ import annotations

import re

import pytest

from custom_kernels.dialect import prelude
from custom_kernels.registry import all_kernel_specs

_HELPER = re.compile(r"__device__ __forceinline__ [\w:<> ]+? (g4_\w+)\([^)]*\)\s*\{([^}]*)\}")
GLOBAL_ONLY = sorted({m.group(1) for m in _HELPER.finditer(prelude("cuda")) if re.search(r"__ldc?g\(", m.group(2))})
GLOBAL_ONLY += ["__ldg", "__ldcg"]


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
    assert {"g4_load4", "g4_load2", "__ldg"} <= set(GLOBAL_ONLY)
    bug = "__shared__ __align__(16) T g4_xr[D];\n{ const T* xr = g4_xr;\n g4_load4(xr + c, a);\n g4_load4(wr + c, b); }"
    assert global_only_loads_of_shared(bug) == ["g4_load4(xr"]
    fixed = bug.replace("g4_load4(xr + c, a);", "a[0] = static_cast<float>(xr[c]);")
    assert global_only_loads_of_shared(fixed) == []
    cast = "__shared__ uint32_t s[8];\nconst uint2* q = reinterpret_cast<const uint2*>(s + 2);\nuint2 v = __ldg(q);"
    assert global_only_loads_of_shared(cast) == ["__ldg(q"]


@pytest.mark.parametrize("spec", all_kernel_specs(), ids=lambda s: s.name)
def test_no_shared_pointer_reaches_a_global_only_load(spec):
    assert not global_only_loads_of_shared(spec.cuda_header + "\n" + spec.cuda_source), spec.name
