"""Source-to-source steps that turn MLX's Metal text into C++ for the shim, keeping line numbers.

1. Metal attributes MLX writes (``[[kernel]]``, ``[[buffer(3)]]``, ``[[host_name("...")]]``,
   ``[[thread_position_in_grid]]`` ...) are blanked; the compiler then runs with
   ``-Werror=attributes``, so any other Metal attribute is a compile error instead of being ignored.
2. ``threadgroup``:
   - as a pointer/reference qualifier (``threadgroup float* p``) it is dropped;
   - a storage declaration ``threadgroup T name[A][B];`` becomes a static ``emu::tg_storage`` (one
     shared object per threadgroup, poisoned at its start, canaries around it) plus a reference
     ``name`` to it, all on the same line;
   - anything else raises ``ValueError`` (reported as a compile error).
"""

from __future__ import annotations

import re

from .mlx_source import METAL_ATTRIBUTES

_ATTRIBUTE_NAMES = [a for a, _ in METAL_ATTRIBUTES] + [
    "kernel",
    "max_total_threads_per_threadgroup",
]
_ATTRIBUTE_RE = re.compile(
    r"\[\[\s*(?:"
    + "|".join(_ATTRIBUTE_NAMES)
    + r"|buffer\s*\(\s*\d+\s*\)|threadgroup\s*\(\s*\d+\s*\)|host_name\s*\(\s*\"[^\"\n]*\"\s*\)"
    + r")(?:\s*\(\s*\d+\s*\))?\s*\]\]"
)
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")
_TG_RE = re.compile(r"\bthreadgroup\b")


def mask_comments_and_strings(text: str) -> str:
    """``text`` with comment bodies and string/char literal contents replaced by spaces.

    Newlines and every other character keep their positions, so offsets map 1:1 to ``text``.
    """
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if text[k] != "\n":
                    out[k] = " "
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            for k in range(i + 1, min(j, n)):
                out[k] = " "
            i = j + 1
        else:
            i += 1
    return "".join(out)


def _blank(text: str, start: int, end: int) -> str:
    return text[:start] + "".join(ch if ch == "\n" else " " for ch in text[start:end]) + text[end:]


def strip_metal_attributes(text: str) -> str:
    """Blank out the Metal attributes MLX generates (positions and newlines are kept)."""
    masked = mask_comments_and_strings(text)
    # host_name("...") has its string masked; match on a copy where the quotes survive.
    spans = [m.span() for m in _ATTRIBUTE_RE.finditer(masked)]
    for s, e in reversed(spans):
        text = _blank(text, s, e)
    return text


def _skip_ws(masked: str, i: int) -> int:
    while i < len(masked) and masked[i].isspace():
        i += 1
    return i


def _skip_template_args(masked: str, i: int) -> int:
    depth = 0
    while i < len(masked):
        if masked[i] == "<":
            depth += 1
        elif masked[i] == ">":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


def rewrite_threadgroup(text: str) -> str:
    """Rewrite every ``threadgroup`` keyword as described in the module doc. Raises ValueError."""
    masked = mask_comments_and_strings(text)
    edits: list[tuple[int, int, str]] = []
    for m in _TG_RE.finditer(masked):
        start = m.start()
        i = m.end()
        # Type tokens: identifiers, '::', template argument lists.
        idents: list[tuple[int, int]] = []
        while True:
            i = _skip_ws(masked, i)
            if masked.startswith("::", i):
                i += 2
                continue
            if i < len(masked) and masked[i] == "<":
                i = _skip_template_args(masked, i)
                continue
            im = _IDENT_RE.match(masked, i)
            if im:
                idents.append(im.span())
                i = im.end()
                continue
            break
        nxt = masked[i] if i < len(masked) else ""
        line = text.count("\n", 0, start) + 1
        if nxt in "*&" or (nxt == ")" and idents) or (nxt == "(" and len(idents) >= 1 and masked[i + 1:i + 2] in "*&"):
            edits.append((start, m.end(), ""))  # address-space qualifier of a pointer/reference/cast
            continue
        if nxt in "[;" and len(idents) >= 2:
            end = masked.find(";", i)
            if end < 0:
                raise ValueError(f"line {line}: unterminated threadgroup declaration")
            dims = masked[i:end]
            if "," in dims or "=" in dims or "{" in dims:
                raise ValueError(
                    f"line {line}: declare one threadgroup variable per statement, without initializer"
                )
            name_s, name_e = idents[-1]
            name = text[name_s:name_e]
            type_text = text[idents[0][0]:name_s].strip()
            alias = f"__emu_tg_t_{name}"
            storage = f"__emu_tg_{name}"
            repl = (
                f"using {alias} = {type_text}{text[i:end].strip()}; "
                f"static ::emu::tg_storage<{alias}> {storage}; "
                f'{alias}& {name} = {storage}.get("{name}")'
            )
            edits.append((start, end, repl))
            continue
        raise ValueError(
            f"line {line}: cannot emulate this use of 'threadgroup' "
            f"(supported: 'threadgroup T name[N];' declarations and threadgroup pointers/references)"
        )
    for s, e, r in reversed(edits):
        text = text[:s] + r + text[e:]
    return text


def to_cpp(metal_text: str) -> str:
    """Both rewrites; raises ValueError for threadgroup uses the emulator cannot represent."""
    return rewrite_threadgroup(strip_metal_attributes(metal_text))
