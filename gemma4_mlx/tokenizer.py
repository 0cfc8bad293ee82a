"""Gemma 4 tokenizer: BPE through the `tokenizers` library, special tokens, streaming detokenizer, chat template.

Built from GGUF metadata (`tokenizer.ggml.*`) or from a Hugging Face directory (`tokenizer.json`). Both give the
pipeline of transformers' GemmaTokenizer: normaliser Replace(" " -> "▁"), no prefix space, BPE over UTF-8
characters with byte fallback (<0xNN>), decoder "▁" -> " ", bytes, fuse (gemma4-spec §9.1).

Newline runs. llama.cpp's `gemma4` pre-tokenizer cuts the text into newline runs and other runs and emits a
newline run whole if it is a token. HF's tokenizer.json does no such split: BPE runs over everything between
added tokens. The two agree whenever no merge joins a newline with another character and every newline-run
token is reachable by merges (true for `tokenizer_train`'s tokenizers). For a GGUF vocabulary whose newline-run
tokens cannot be reached by merges, those tokens are registered as (non-special) added tokens, which is how HF
Gemma files carry them and gives the same whole-run result as llama.cpp.

Security model. `encode` never turns text into special tokens: the plain encoder does not match special added
tokens, and no BPE merge can spell one (if a file's merges could, those merges are removed from the plain
encoder). `apply_chat_template` gives special ids only to the template's own markup; every message content
(all roles, text parts, reasoning fields, tool-call argument strings, tool results) is encoded as plain text.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "BYTE_TOKENS",
    "FIRST_BYTE_ID",
    "GEMMA4_SPECIAL_TOKENS",
    "NEWLINE_ID",
    "StreamingDetokenizer",
    "Tokenizer",
    "builtin_chat_template",
    "gemma4_tokenizer_json",
    "reserved_gemma4_tokens",
    "strip_thinking",
]

# Real Gemma 4 ids of the named special tokens (gemma4-spec §9.2); every other id below 107 is <unusedN>.
GEMMA4_SPECIAL_TOKENS: dict[int, str] = {
    0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>",
    46: "<|tool>", 47: "<tool|>", 48: "<|tool_call>", 49: "<tool_call|>",
    50: "<|tool_response>", 51: "<tool_response|>", 52: '<|"|>',
    98: "<|think|>", 100: "<|channel>", 101: "<channel|>", 105: "<|turn>", 106: "<turn|>",
}
NEWLINE_ID = 107
FIRST_BYTE_ID = 108
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
# Special tokens that llama.cpp's converter types USER_DEFINED (4) so they are rendered in output (§7.6).
VISIBLE_SPECIAL_TOKENS = frozenset(
    {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>'}
)

# GGUF token types and metadata value type codes.
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
_GGUF_U32, _GGUF_I32, _GGUF_F32, _GGUF_BOOL, _GGUF_STRING, _GGUF_ARRAY = 4, 5, 6, 7, 8, 9

_BYTE_TOKEN_RE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")
# Message fields whose strings are conversation text (never markup).
_TEXT_FIELDS = ("content", "reasoning_content", "thinking", "reasoning")


def reserved_gemma4_tokens() -> list[str]:
    """Token strings of ids 0..106: the named special tokens at their Gemma 4 ids, <unused0>.. elsewhere."""
    tokens, unused = [], 0
    for i in range(NEWLINE_ID):
        if i in GEMMA4_SPECIAL_TOKENS:
            tokens.append(GEMMA4_SPECIAL_TOKENS[i])
        else:
            tokens.append(f"<unused{unused}>")
            unused += 1
    return tokens


def builtin_chat_template() -> str:
    """The Gemma 4 chat template shipped with gemma4_mlx (gemma4_mlx/chat_template.jinja)."""
    return _CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")


def strip_thinking(text: str) -> str:
    """Drop every <|channel>...<channel|> block (and an unclosed <|channel>... tail), then trim.

    The same rule the built-in template applies to model turns in the history.
    """
    return "".join(piece.split("<|channel>", 1)[0] for piece in text.split("<channel|>")).strip()


# ---------------------------------------------------------------------------------------------
# tokenizer.json construction
# ---------------------------------------------------------------------------------------------

def _added_token(token_id: int, content: str, special: bool) -> dict:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}


def gemma4_tokenizer_json(tokens: Sequence[str], merges: Iterable[tuple[str, str]], special_ids: Iterable[int],
                          plain_added_ids: Iterable[int] = (), bos_token: str = "<bos>",
                          unk_token: str = "<unk>") -> dict:
    """The HF tokenizer.json dict of a Gemma 4 BPE: tokens[i] is the string of id i, merges in rank order.

    special_ids become special added tokens (never produced from plain text), plain_added_ids non-special added
    tokens (matched literally before BPE). The first id of a repeated string is the one BPE produces.
    The pipeline is the one transformers' GemmaTokenizer builds, plus a post-processor that prepends bos_token.
    """
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    specials = sorted(set(special_ids))
    plain_added = sorted(set(plain_added_ids) - set(specials))
    added = [_added_token(i, tokens[i], True) for i in specials] + [_added_token(i, tokens[i], False)
                                                                     for i in plain_added]
    added.sort(key=lambda t: t["id"])
    post = None
    if bos_token in vocab:
        bos = vocab[bos_token]
        post = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos_token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos_token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos_token, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos_token: {"id": bos_token, "ids": [bos], "tokens": [bos_token]}},
        }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        # transformers' GemmaTokenizer pre-tokenizer: it runs after the normaliser, so it never matches.
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                          "invert": False},
        "post_processor": post,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ]},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": unk_token, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
            "vocab": vocab,
            "merges": [(left, right) for left, right in merges],
        },
    }


def _merge_pairs(merges: Sequence[Any]) -> list[tuple[str, str]]:
    """tokenizer.json / GGUF merges ("a b" strings or [a, b] pairs) as (a, b) tuples."""
    try:
        if merges and isinstance(merges[0], str):
            pairs = [tuple(m.split(" ")) for m in merges]
            if any(len(p) != 2 for p in pairs):
                raise ValueError
            return pairs  # type: ignore[return-value]
        return [(a, b) for a, b in merges]
    except (ValueError, TypeError, AttributeError):
        bad = next(m for m in merges if not (len(m.split(" ") if isinstance(m, str) else m) == 2))
        raise ValueError(f"merge {bad!r} is not a pair of tokens") from None


def _build_backend(spec: dict, merges: list[tuple[str, str]], blocked: frozenset[str] = frozenset(),
                   keep_vocab: frozenset[str] = frozenset(), with_special_tokens: bool = True) -> tokenizers.Tokenizer:
    """A `tokenizers.Tokenizer` for the tokenizer.json dict `spec` (its pipeline, BPE model, added tokens).

    The BPE model is built through the Python API (much faster than parsing a 262k-token JSON); if the added
    tokens do not get their ids that way, the whole dict is parsed instead. blocked: strings BPE must never
    produce: removed from the vocabulary (except those in keep_vocab) with every merge that uses or builds
    them. with_special_tokens=False leaves the special added tokens out.
    """
    model = spec["model"]
    vocab = model["vocab"]
    if blocked:
        vocab = {t: i for t, i in vocab.items() if t not in blocked or t in keep_vocab}
        merges = [(a, b) for a, b in merges if a not in blocked and b not in blocked and a + b not in blocked]
    added = [t for t in sorted(spec.get("added_tokens", []), key=lambda t: t["id"])
             if with_special_tokens or not t["special"]]
    shell = {k: v for k, v in spec.items() if k not in ("model", "added_tokens")}
    shell["added_tokens"] = []
    shell["model"] = {k: v for k, v in model.items() if k not in ("vocab", "merges")} | {"vocab": {}, "merges": []}
    backend = tokenizers.Tokenizer.from_str(json.dumps(shell))
    options = {k: model[k] for k in ("unk_token", "dropout", "continuing_subword_prefix", "end_of_word_suffix")
               if model.get(k) is not None}
    backend.model = tokenizers.models.BPE(vocab=vocab, merges=merges, byte_fallback=bool(model.get("byte_fallback")),
                                          fuse_unk=bool(model.get("fuse_unk")),
                                          ignore_merges=bool(model.get("ignore_merges")), **options)

    def added_token(t: dict) -> tokenizers.AddedToken:
        return tokenizers.AddedToken(t["content"], single_word=t.get("single_word", False),
                                     lstrip=t.get("lstrip", False), rstrip=t.get("rstrip", False),
                                     normalized=t.get("normalized", not t["special"]), special=t["special"])

    backend.add_special_tokens([added_token(t) for t in added if t["special"]])
    backend.add_tokens([added_token(t) for t in added if not t["special"]])
    if any(backend.token_to_id(t["content"]) != t["id"] for t in added):
        exact = dict(spec, added_tokens=added, model=dict(model, vocab=vocab, merges=[list(m) for m in merges]))
        backend = tokenizers.Tokenizer.from_str(json.dumps(exact))
    return backend


# ---------------------------------------------------------------------------------------------
# Streaming detokenizer
# ---------------------------------------------------------------------------------------------

class StreamingDetokenizer:
    """Incremental decode: add(token_id) returns the newly completed text, never half a UTF-8 character.

    The concatenation of all add() results followed by flush() equals Tokenizer.decode of the same ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._token_bytes = tokenizer._bytes_table()
        self._skip = tokenizer._special_ids if skip_special else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.tokens: list[int] = []

    def add(self, token_id: int) -> str:
        token_id = int(token_id)
        self.tokens.append(token_id)
        if token_id in self._skip:
            return ""
        return self._utf8.decode(self._token_bytes[token_id])

    def flush(self) -> str:
        """Text still held back (an incomplete UTF-8 sequence becomes U+FFFD); resets the decoder state."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text

    def reset(self) -> None:
        self._utf8.reset()
        self.tokens = []


# ---------------------------------------------------------------------------------------------
# Chat template environment (what transformers' apply_chat_template provides)
# ---------------------------------------------------------------------------------------------

class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _chat_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _all_chars(value: Any, chars: set[str]) -> None:
    if isinstance(value, str):
        chars.update(value)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _all_chars(k, chars)
            _all_chars(v, chars)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _all_chars(v, chars)


def _pick_sentinels(*values: Any) -> tuple[str, str]:
    """Two private-use characters that occur nowhere in values (messages, tools, kwargs, template)."""
    used: set[str] = set()
    for v in values:
        _all_chars(v, used)
    free = (chr(cp) for cp in range(0xF8FF, 0xDFFF, -1) if chr(cp) not in used)
    try:
        return next(free), next(free)
    except StopIteration:  # every BMP private-use character is in the input: use the supplementary planes
        free = (chr(cp) for cp in range(0xFFFFD, 0xEFFFF, -1) if chr(cp) not in used)
        return next(free), next(free)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _template_message(message: Mapping) -> dict:
    """A message as transformers hands it to templates: keys with None dropped; reasoning under
    `reasoning_content` and (unless set) `thinking` too."""
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _marks_consistent(marked: str, rendered: str, open_mark: str, close_mark: str) -> bool:
    """True if removing the marks gives the plain rendering and the marks alternate open, close, open, ..."""
    if marked.replace(open_mark, "").replace(close_mark, "") != rendered:
        return False
    marks = "".join(ch for ch in marked if ch == open_mark or ch == close_mark)
    return marks == (open_mark + close_mark) * (len(marks) // 2)


class _Marker:
    """Wraps conversation text in sentinels: leading/trailing whitespace stays outside, so `| trim` still works."""

    def __init__(self, open_mark: str, close_mark: str, strip_model_thoughts: bool):
        self.open, self.close = open_mark, close_mark
        self.strip_model_thoughts = strip_model_thoughts

    def text(self, s: str) -> str:
        core = s.strip()
        if not core:
            return s
        start = len(s) - len(s.lstrip())
        return s[:start] + self.open + core + self.close + s[start + len(core):]

    def tree(self, value: Any) -> Any:
        """Every string leaf (not dict keys) wrapped."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {k: self.tree(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.tree(v) for v in value]
        return value

    def parts(self, value: Any) -> Any:
        """Content: a string, a list of parts (only their "text" is wrapped), or a structure (tool results)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list) and all(isinstance(p, Mapping) and "type" in p for p in value):
            return [{**p, "text": self.text(p["text"])} if isinstance(p.get("text"), str) else p for p in value]
        return self.tree(value)

    def message(self, message: Mapping) -> dict:
        out = dict(message)
        for field in _TEXT_FIELDS:
            if field in out:
                value = out[field]
                if (field == "content" and self.strip_model_thoughts and isinstance(value, str)
                        and out.get("role") in ("assistant", "model")):
                    value = strip_thinking(value)
                out[field] = self.parts(value)
        calls = out.get("tool_calls")
        if isinstance(calls, list):
            new_calls = []
            for call in calls:
                if isinstance(call, Mapping):
                    call = dict(call)
                    fn = call.get("function")
                    if isinstance(fn, Mapping) and "arguments" in fn:
                        call["function"] = {**fn, "arguments": self.tree(fn["arguments"])}
                    elif "arguments" in call:
                        call["arguments"] = self.tree(call["arguments"])
                new_calls.append(call)
            out["tool_calls"] = new_calls
        return out


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

def _as_list(value: Any) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    return np.asarray(value).reshape(-1).tolist()


def _as_int(value: Any) -> int:
    return int(np.asarray(value).reshape(-1)[0]) if not isinstance(value, (int, np.integer)) else int(value)


def _as_str_list(value: Any) -> list[str]:
    if isinstance(value, list) and all(type(v) is str for v in value):
        return value
    return [_as_str(v) for v in (value if isinstance(value, (list, tuple)) else np.asarray(value).reshape(-1))]


def _as_str(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else str(value)


class Tokenizer:
    """Gemma 4 tokenizer. Build with `from_gguf_metadata` or `from_hf_dir` (or from a tokenizer.json dict).

    vocab_size: number of ids; bos_id; eos_ids: stop ids (the file's plus <eos> and <turn|>);
    chat_template: the file's template, else the built-in one.
    """

    def __init__(self, tokenizer_json: dict, *, bos_id: int | None = None, eos_id: int | None = None,
                 eos_ids: Iterable[int] = (), chat_template: str | None = None):
        model = tokenizer_json["model"]
        if model.get("type") != "BPE":
            raise ValueError(f"expected a BPE tokenizer.json, got model type {model.get('type')!r}")
        self._merges = _merge_pairs(model.get("merges", []))
        id_to_tok: dict[int, str] = {}
        for tok, i in model["vocab"].items():
            id_to_tok.setdefault(int(i), tok)
        self._special_ids: frozenset[int] = frozenset(t["id"] for t in tokenizer_json["added_tokens"] if t["special"])
        for t in tokenizer_json["added_tokens"]:
            id_to_tok[int(t["id"])] = t["content"]
        self.vocab_size = max(id_to_tok) + 1
        self._tokens: list[str | None] = [id_to_tok.get(i) for i in range(self.vocab_size)]
        self._token_ids: dict[str, int] = {}
        for i, tok in enumerate(self._tokens):
            if tok is not None:
                self._token_ids.setdefault(tok, i)
        for t in tokenizer_json["added_tokens"]:  # an added token's string maps to the added id
            self._token_ids[t["content"]] = int(t["id"])
        byte_fallback = bool(model.get("byte_fallback"))
        self._byte_ids: dict[int, int] = {}
        if byte_fallback:
            for tok, i in model["vocab"].items():
                m = _BYTE_TOKEN_RE.fullmatch(tok)
                if m and int(i) not in self._special_ids:
                    self._byte_ids[int(i)] = int(m.group(1), 16)

        self._plain = self._plain_backend(tokenizer_json, self._merges, self._special_ids)
        self._special_by_text = {self._tokens[i]: i for i in sorted(self._special_ids, reverse=True)}
        self._special_lengths = sorted({len(s) for s in self._special_by_text}, reverse=True)
        self._special_first = re.compile("[" + "".join(sorted({re.escape(s[0]) for s in self._special_by_text
                                                                 if s})) + "]") if self._special_by_text else None
        self._bytes_cache: list[bytes] | None = None

        self.bos_id = bos_id if bos_id is not None else self._token_ids.get("<bos>", 2)
        self.eos_id = eos_id if eos_id is not None else self._token_ids.get("<eos>", 1)
        stop = {self.eos_id, *map(int, eos_ids)}
        for name in ("<eos>", "<turn|>"):
            if name in self._token_ids:
                stop.add(self._token_ids[name])
        self.eos_ids: set[int] = stop
        self.chat_template: str = chat_template if chat_template else builtin_chat_template()
        self._env = _chat_environment()
        self._compiled: dict[str, Any] = {}

    # ---- construction -------------------------------------------------------------------------

    @staticmethod
    def _plain_backend(spec: dict, merges: list[tuple[str, str]], special_ids: Iterable[int]) -> tokenizers.Tokenizer:
        """The plain-text encoder: special added tokens are never matched and BPE can never produce them."""
        special = {t["content"] for t in spec["added_tokens"] if t["id"] in special_ids}
        if not any(a + b in special for a, b in merges):
            # No merge builds a special string (they are multi-character), so BPE alone cannot emit one.
            backend = _build_backend(spec, merges)
            backend.encode_special_tokens = True
            return backend
        unk = frozenset({spec["model"].get("unk_token")})  # must stay; with full byte fallback it is never used
        return _build_backend(spec, merges, blocked=frozenset(special), keep_vocab=unk, with_special_tokens=False)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """From GGUF `tokenizer.ggml.*` keys (tokens, merges, token_type, ids) and `tokenizer.chat_template`.

        Arrays may be lists or numpy/mlx arrays; strings may be bytes. Token types 2 (unknown), 3 (control),
        4 (user-defined) and 5 (unused) become special added tokens, 6 are the byte-fallback tokens.
        """
        model_name = _as_str(metadata.get("tokenizer.ggml.model", "gemma4"))
        if model_name not in ("gemma4", "llama"):
            raise ValueError(f"tokenizer.ggml.model {model_name!r} is not a Gemma-style BPE")
        if "tokenizer.ggml.merges" not in metadata:
            raise ValueError("GGUF metadata has no tokenizer.ggml.merges: cannot build the BPE")
        tokens = _as_str_list(metadata["tokenizer.ggml.tokens"])
        merges = _merge_pairs(_as_str_list(metadata["tokenizer.ggml.merges"]))
        if "tokenizer.ggml.token_type" in metadata:
            types = [int(t) for t in _as_list(metadata["tokenizer.ggml.token_type"])]
        else:
            types = [TOKEN_BYTE if _BYTE_TOKEN_RE.fullmatch(t) else TOKEN_NORMAL for t in tokens]
        if len(types) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(types)} token types")
        special = [i for i, t in enumerate(types) if t in (TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED,
                                                            TOKEN_UNUSED)]

        def ident(key: str, default: int) -> int:
            return _as_int(metadata[key]) if key in metadata else default

        bos = ident("tokenizer.ggml.bos_token_id", 2)
        eos = ident("tokenizer.ggml.eos_token_id", 1)
        unk = ident("tokenizer.ggml.unknown_token_id", 3)
        eos_ids = [int(x) for x in _as_list(metadata["tokenizer.ggml.eos_token_ids"])] \
            if "tokenizer.ggml.eos_token_ids" in metadata else []
        unk_token = tokens[unk] if 0 <= unk < len(tokens) else "<unk>"
        bos_token = tokens[bos] if 0 <= bos < len(tokens) else "<bos>"
        full = gemma4_tokenizer_json(tokens, merges, special, bos_token=bos_token, unk_token=unk_token)
        newline_runs = cls._unreachable_newline_runs(tokens, types, merges)
        if newline_runs:
            full = gemma4_tokenizer_json(tokens, merges, special, plain_added_ids=newline_runs,
                                         bos_token=bos_token, unk_token=unk_token)
        template = metadata.get("tokenizer.chat_template")
        return cls(full, bos_id=bos, eos_id=eos, eos_ids=eos_ids,
                   chat_template=_as_str(template) if template is not None else None)

    @staticmethod
    def _unreachable_newline_runs(tokens: list[str], types: list[int], merges: list[tuple[str, str]]) -> list[int]:
        """Ids of the newline-run tokens if some run of two or more newlines is a token no BPE merge path builds
        (BPE over a newline run can only use merges of newline runs, so a small BPE settles the question)."""
        runs = [i for i, t in enumerate(tokens) if t and types[i] == TOKEN_NORMAL and not t.strip("\n")]
        long_runs = [i for i in runs if len(tokens[i]) >= 2]
        if not long_runs:
            return []
        run_tokens = {tokens[i]: i for i in reversed(runs)}
        run_merges = [(a, b) for a, b in merges if a in run_tokens and b in run_tokens and a + b in run_tokens]
        bpe = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=run_tokens, merges=run_merges))
        encoded = bpe.encode_batch([tokens[i] for i in long_runs], add_special_tokens=False)
        if all(e.ids == [i] for e, i in zip(encoded, long_runs)):
            return []
        return runs

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """From a Hugging Face directory: tokenizer.json (+ tokenizer_config.json, chat_template.jinja,
        generation_config.json for extra stop ids)."""
        path = Path(path)
        with open(path / "tokenizer.json", encoding="utf-8") as f:
            data = json.load(f)
        config: dict = {}
        if (path / "tokenizer_config.json").is_file():
            with open(path / "tokenizer_config.json", encoding="utf-8") as f:
                config = json.load(f)
        template = None
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        elif isinstance(config.get("chat_template"), list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in config["chat_template"]}
            template = named.get("default")
        ids = {t["content"]: t["id"] for t in data.get("added_tokens", [])}

        def token_id(name: str) -> int | None:
            value = config.get(name)
            if isinstance(value, Mapping):
                value = value.get("content")
            return ids.get(value, data["model"]["vocab"].get(value)) if isinstance(value, str) else None

        eos_ids: list[int] = []
        if (path / "generation_config.json").is_file():
            with open(path / "generation_config.json", encoding="utf-8") as f:
                gen = json.load(f)
            eos = gen.get("eos_token_id")
            eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
        return cls(data, bos_id=token_id("bos_token"), eos_id=token_id("eos_token"), eos_ids=eos_ids,
                   chat_template=template)

    def to_gguf_metadata(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(metadata, metadata_types) for the `tokenizer.*` keys of a gemma4 GGUF (gemma4-spec §7.6).

        Types: GGUF codes (u32 4, i32 5, f32 6, bool 7, string 8) or (9, element code) for arrays.
        Token types: 6 byte, 4 for the rendered special tokens (channel/tool/<|"|>), 3 other special, 1 normal.
        """
        tokens = []
        for i, tok in enumerate(self._tokens):
            if tok is None:
                raise ValueError(f"id {i} has no token: the vocabulary has holes")
            tokens.append(tok)
        types = np.full(len(tokens), TOKEN_NORMAL, dtype=np.int32)
        for i in self._byte_ids:
            types[i] = TOKEN_BYTE
        for i in self._special_ids:
            types[i] = TOKEN_USER_DEFINED if tokens[i] in VISIBLE_SPECIAL_TOKENS else TOKEN_CONTROL
        merges = []
        for left, right in self._merges:
            if " " in left or " " in right:
                raise ValueError(f"merge ({left!r}, {right!r}) contains a space: not representable in GGUF")
            merges.append(f"{left} {right}")

        def ident(name: str, default: int) -> int:
            return self._token_ids.get(name, default)

        metadata: dict[str, Any] = {
            "tokenizer.ggml.model": "gemma4",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": np.full(len(tokens), -1000.0, dtype=np.float32),
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": self.bos_id,
            "tokenizer.ggml.eos_token_id": self.eos_id,
            "tokenizer.ggml.unknown_token_id": ident("<unk>", 3),
            "tokenizer.ggml.padding_token_id": ident("<pad>", 0),
            "tokenizer.ggml.mask_token_id": ident("<mask>", 4),
            "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": False,
            "tokenizer.chat_template": self.chat_template,
        }
        types_: dict[str, Any] = {
            "tokenizer.ggml.model": _GGUF_STRING,
            "tokenizer.ggml.tokens": (_GGUF_ARRAY, _GGUF_STRING),
            "tokenizer.ggml.scores": (_GGUF_ARRAY, _GGUF_F32),
            "tokenizer.ggml.token_type": (_GGUF_ARRAY, _GGUF_I32),
            "tokenizer.ggml.merges": (_GGUF_ARRAY, _GGUF_STRING),
            "tokenizer.ggml.bos_token_id": _GGUF_U32,
            "tokenizer.ggml.eos_token_id": _GGUF_U32,
            "tokenizer.ggml.unknown_token_id": _GGUF_U32,
            "tokenizer.ggml.padding_token_id": _GGUF_U32,
            "tokenizer.ggml.mask_token_id": _GGUF_U32,
            "tokenizer.ggml.add_bos_token": _GGUF_BOOL,
            "tokenizer.ggml.add_space_prefix": _GGUF_BOOL,
            "tokenizer.chat_template": _GGUF_STRING,
        }
        return metadata, types_

    # ---- encoding / decoding --------------------------------------------------------------------

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special (control and rendered-control) tokens."""
        return self._special_ids

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Plain text -> ids. Special-token strings in text stay ordinary text."""
        ids = self._plain.encode(text, add_special_tokens=False).ids if text else []
        return [self.bos_id, *ids] if add_bos else ids

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """Trusted markup -> ids, with every special-token string turned into its id (as HF's encode does)."""
        return self._encode_pieces(self._split_specials(text))

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """ids -> text: "▁" -> space, <0xNN> -> byte, UTF-8 decode (an invalid sequence gives U+FFFD)."""
        table = self._bytes_table()
        skip = self._special_ids if skip_special else ()
        return b"".join(table[int(i)] for i in ids if int(i) not in skip).decode("utf-8", errors="replace")

    def detokenizer(self, skip_special: bool = False) -> StreamingDetokenizer:
        return StreamingDetokenizer(self, skip_special=skip_special)

    def id_to_token(self, i: int) -> str | None:
        i = int(i)
        return self._tokens[i] if 0 <= i < self.vocab_size else None

    def token_to_id(self, s: str) -> int | None:
        return self._token_ids.get(s)

    def _bytes_table(self) -> list[bytes]:
        if self._bytes_cache is None:
            table = []
            for i, tok in enumerate(self._tokens):
                if i in self._byte_ids:
                    table.append(bytes([self._byte_ids[i]]))
                elif tok is None:
                    table.append(b"")
                elif i in self._special_ids:
                    table.append(tok.encode("utf-8"))
                else:
                    table.append(tok.replace("▁", " ").encode("utf-8"))
            self._bytes_cache = table
        return self._bytes_cache

    def _split_specials(self, text: str) -> list[str | int]:
        """text -> [text, special id, text, ...]: special-token strings matched leftmost-longest (as HF does)."""
        if self._special_first is None:
            return [text]
        out: list[str | int] = []
        pos = 0
        for m in self._special_first.finditer(text):
            start = m.start()
            if start < pos:
                continue
            for length in self._special_lengths:
                token_id = self._special_by_text.get(text[start:start + length])
                if token_id is not None:
                    out.append(text[pos:start])
                    out.append(token_id)
                    pos = start + length
                    break
        out.append(text[pos:])
        return out

    def _encode_pieces(self, pieces: list[str | int]) -> list[int]:
        """Pieces (text or special id) -> ids; adjacent texts are merged and BPE'd as one span, like HF does
        between two special tokens."""
        spans: list[str | int] = []
        for p in pieces:
            if isinstance(p, str):
                if spans and isinstance(spans[-1], str):
                    spans[-1] += p
                elif p:
                    spans.append(p)
            else:
                spans.append(p)
        texts = [s for s in spans if isinstance(s, str) and s]
        encoded = iter(self._plain.encode_batch(texts, add_special_tokens=False)) if texts else iter(())
        ids: list[int] = []
        for s in spans:
            if isinstance(s, str):
                if s:
                    ids.extend(next(encoded).ids)
            else:
                ids.append(s)
        return ids

    # ---- chat template ------------------------------------------------------------------------------

    def _template(self, source: str):
        compiled = self._compiled.get(source)
        if compiled is None:
            compiled = self._compiled[source] = self._env.from_string(source)
        return compiled

    def _token_text(self, i: int) -> str | None:
        return self._tokens[i] if 0 <= i < self.vocab_size else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            enable_thinking: bool = False, tools: list[dict] | None = None,
                            tokenize: bool = True, chat_template: str | None = None,
                            **template_kwargs: Any) -> list[int] | str:
        """Render messages with the chat template; ids (tokenize=True) or the exact rendered string.

        Template variables, as transformers passes them: messages (keys whose value is None dropped, reasoning
        also under `reasoning_content`/`thinking`), bos_token, eos_token, pad_token, unk_token, mask_token,
        documents (None), add_generation_prompt, enable_thinking, tools (JSON-schema dicts), **template_kwargs.
        chat_template overrides the tokenizer's template for this call.

        Tokenizing, user text is never parsed into control tokens: every conversation string (message
        content and text parts, reasoning fields, tool-call arguments, tool results) is rendered wrapped in
        two private-use sentinel characters absent from the input (its leading/trailing whitespace left
        outside, so the template's `| trim` works unchanged); special-token strings are matched only outside
        the sentinels; then the sentinels are removed and each span between two matched special tokens is
        BPE-encoded as plain text, exactly as HF's encoder does with the whole rendered string. If the
        template's thinking stripping moves whitespace across a sentinel, assistant contents are pre-processed
        with `strip_thinking` (the built-in template's rule) and rendered again. If the sentinel rendering
        still differs from the plain rendering (a template that inspects content characters), a warning is
        raised and the sentinel rendering is used. Tool schemas (`tools`) are trusted markup.
        """
        source = chat_template if chat_template is not None else self.chat_template
        template = self._template(source)
        messages = [_template_message(m) for m in messages]
        variables: dict[str, Any] = {
            "bos_token": self._token_text(self.bos_id) or "",
            "eos_token": self._token_text(self.eos_id) or "",
            "pad_token": self._token_text(self._token_ids.get("<pad>", 0)) or "",
            "unk_token": self._token_text(self._token_ids.get("<unk>", 3)) or "",
            "mask_token": self._token_text(self._token_ids.get("<mask>", 4)) or "",
            "documents": None,
            **template_kwargs,
        }
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise TypeError("tools must be JSON-schema dicts ({'type': 'function', 'function': {...}})")
        variables.update(add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking, tools=tools)
        rendered = template.render(messages=messages, **variables)
        if not tokenize:
            return rendered

        open_mark, close_mark = _pick_sentinels(messages, tools, template_kwargs, source)
        for strip_model_thoughts in (False, True):
            marker = _Marker(open_mark, close_mark, strip_model_thoughts)
            marked = template.render(messages=[marker.message(m) for m in messages], **variables)
            if _marks_consistent(marked, rendered, open_mark, close_mark):
                break
        else:
            warnings.warn("the chat template renders marked message text differently from the plain text "
                          "(it inspects content characters or cuts contents); token ids follow the marked "
                          "rendering", stacklevel=2)
        return self._encode_pieces(self._split_marked(marked, open_mark, close_mark))

    def _split_marked(self, text: str, open_mark: str, close_mark: str) -> list[str | int]:
        """Rendered text with sentinel-marked conversation spans -> pieces; specials matched only outside.

        A span runs from an open mark to the next close mark (an open mark whose close the template cut off
        extends the span to the next mark of either kind, so uncertain text is treated as conversation text)."""
        pieces: list[str | int] = []
        inside = False
        for part in re.split(f"({re.escape(open_mark)}|{re.escape(close_mark)})", text):
            if part == open_mark:
                inside = True
            elif part == close_mark:
                inside = False
            elif part:
                pieces.extend([part] if inside else self._split_specials(part))
        return pieces

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={sorted(self.eos_ids)})"
