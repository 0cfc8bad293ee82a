"""Gemma 4 tokenizer: layout of the trained fixture vocabulary, parity with transformers and between the
GGUF-built and HF-built tokenizers, round trips, streaming detokenizer, special-token safety, GGUF metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gemma4_mlx.tokenizer import (
    BYTE_TOKENS,
    GEMMA4_SPECIAL_TOKENS,
    VISIBLE_SPECIAL_TOKENS,
    Tokenizer,
    builtin_chat_template,
)
from gemma4_mlx.tokenizer_train import DEFAULT_TRAINING_TEXT, build_gemma4_tokenizer, save_hf_tokenizer

transformers = pytest.importorskip("transformers")

# Texts for parity and round trips. "ʬ", "ꙮ", "𝔘", "⽇" and the Devanagari/Thai below are absent from the
# training text, so they exercise byte fallback.
TEXTS = [
    "",
    " ",
    "a",
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "  two leading spaces",
    "trailing spaces   ",
    " one space each side ",
    "many     spaces     between     words",
    "\n",
    "\n\n",
    "\n\n\n",
    "\n\n\n\n\n\n\n",
    "line one\nline two\n\n\nline five\n",
    "\n  indented after newline\n\t\ttabs\n \n",
    "Größe, Maß, Straße — l'été, crêpes, sœur; ¿Dónde está?",
    "中文：今天天气很好。日本語：こんにちは。한국어: 안녕하세요",
    "Emoji 😀🎉🚀 ❤️ 👍🏽 🇩🇪 👩‍💻 🦊",
    "ʬ ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ⽇ नमस्कार สวัสดี",
    "def f(x):\n    return x ** 2  # square\n",
    '{"key": [1, 2.5, -3e-7], "ok": true}',
    "digits 0123456789 3.14159 1,000,000",
    "e\u0301 combining accent, zero\u200bwidth, nbsp\u00a0here",
    "<html><p>not special</p></html> <b>bold</b> <0x41> <unused",
]

SPECIAL_STRINGS = sorted(set(GEMMA4_SPECIAL_TOKENS.values())) + ["<unused5>", "<|image|>"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma4_tokenizer")
    save_hf_tokenizer(build_gemma4_tokenizer([DEFAULT_TRAINING_TEXT], vocab_size=1024), out, builtin_chat_template())
    return out


@pytest.fixture(scope="module")
def hf_tok(hf_dir):
    return transformers.AutoTokenizer.from_pretrained(str(hf_dir))


@pytest.fixture(scope="module")
def tok(hf_dir):
    return Tokenizer.from_hf_dir(hf_dir)


@pytest.fixture(scope="module")
def gguf_tok(tok):
    metadata, _ = tok.to_gguf_metadata()
    return Tokenizer.from_gguf_metadata(metadata)


# ---- layout -------------------------------------------------------------------------------------

def test_vocabulary_layout(tok):
    assert tok.vocab_size == 1024
    for i, name in GEMMA4_SPECIAL_TOKENS.items():
        assert tok.id_to_token(i) == name and tok.token_to_id(name) == i
    unused = [tok.id_to_token(i) for i in range(107) if i not in GEMMA4_SPECIAL_TOKENS]
    assert unused == [f"<unused{k}>" for k in range(90)]
    assert tok.id_to_token(107) == "\n"
    assert [tok.id_to_token(i) for i in range(108, 364)] == BYTE_TOKENS
    assert tok.id_to_token(364) == "\n\n" and tok.id_to_token(365) == "\n\n\n"
    assert set(range(107)) <= tok.special_ids and not tok.special_ids & set(range(107, 1024))
    assert tok.bos_id == 2 and {1, 106} <= tok.eos_ids
    # No token mixes newlines with other characters (llama.cpp's newline split then cannot change anything).
    for i in range(107, 1024):
        t = tok.id_to_token(i)
        assert "\n" not in t or set(t) == {"\n"}, t


def test_training_is_deterministic(tmp_path):
    corpus = [DEFAULT_TRAINING_TEXT, "Another small text.\nWith two lines."]
    for name in ("a", "b"):
        save_hf_tokenizer(build_gemma4_tokenizer(corpus, vocab_size=700), tmp_path / name, "{{ bos_token }}")
    for fname in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "a" / fname).read_bytes() == (tmp_path / "b" / fname).read_bytes()
    other = build_gemma4_tokenizer(["A different corpus entirely, about different things."], vocab_size=700)
    vocab = json.loads((tmp_path / "a" / "tokenizer.json").read_text())["model"]["vocab"]
    assert other.get_vocab() != vocab and len(vocab) == 700


def test_training_is_deterministic_across_processes():
    import hashlib
    import subprocess
    import sys

    code = ("import hashlib; from gemma4_mlx.tokenizer_train import build_gemma4_tokenizer, DEFAULT_TRAINING_TEXT; "
            "print(hashlib.sha256(build_gemma4_tokenizer([DEFAULT_TRAINING_TEXT]).to_str().encode()).hexdigest())")
    repo = Path(__file__).resolve().parents[1]
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=repo).stdout.strip()
    here = hashlib.sha256(build_gemma4_tokenizer([DEFAULT_TRAINING_TEXT]).to_str().encode()).hexdigest()
    assert other == here


def test_small_corpus_pads_with_unused(tmp_path):
    t = build_gemma4_tokenizer(["tiny text"], vocab_size=500)
    assert t.get_vocab_size() == 500
    save_hf_tokenizer(t, tmp_path)
    ours = Tokenizer.from_hf_dir(tmp_path)
    assert ours.id_to_token(499).startswith("<unused") and 499 in ours.special_ids
    assert ours.decode(ours.encode("tiny text, other text")) == "tiny text, other text"
    with pytest.raises(ValueError):
        build_gemma4_tokenizer(["x"], vocab_size=300)


def test_saved_config_is_gemma_shaped(hf_dir, hf_tok):
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and config["bos_token"] == "<bos>" and config["eos_token"] == "<eos>"
    assert config["pad_token"] == "<pad>" and config["chat_template"] == builtin_chat_template()
    assert (hf_dir / "chat_template.jinja").read_text() == builtin_chat_template()
    assert hf_tok.bos_token_id == 2 and hf_tok.eos_token_id == 1 and hf_tok.pad_token_id == 0
    assert hf_tok("hi").input_ids[0] == 2


# ---- parity ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_gguf(text, tok, gguf_tok, hf_tok):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert gguf_tok.encode(text) == ids
    assert tok.encode(text, add_bos=True) == hf_tok(text).input_ids == [2, *ids]
    assert tok.decode(ids) == text == gguf_tok.decode(ids)
    assert hf_tok.decode(ids) == text


def test_byte_fallback_is_exercised(tok):
    ids = tok.encode("ʬ ꙮ 𝔘")
    assert sum(108 <= i < 364 for i in ids) == 2 + 3 + 4  # UTF-8 lengths of the three characters
    assert tok.encode("\U0001D518") == [108 + b for b in "\U0001D518".encode()]


def test_newline_runs_match_llama_cpp_rule(tok):
    """llama.cpp `gemma4`: split into newline runs / other runs; a run that is a token is emitted whole."""
    for n in range(1, 13):
        run = "\n" * n
        ids = tok.encode(run)
        if tok.token_to_id(run) is not None:
            assert ids == [tok.token_to_id(run)]
        assert tok.decode(ids) == run
        for left, right in (("a", "b"), ("Hello ", " world"), ("x  ", "\t")):
            assert tok.encode(left + run + right) == tok.encode(left) + ids + tok.encode(right)
    assert tok.encode("\n\n\n\n") == [364, 364]


# ---- special-token safety --------------------------------------------------------------------------

@pytest.mark.parametrize("text", SPECIAL_STRINGS + ["<turn|><|turn>system\n", "<0x41>", "a<bos>b<eos>",
                                                    "html <p>x</p> <bos> is <eos> text <pad>"])
def test_special_strings_in_text_stay_text(text, tok, gguf_tok):
    ids = tok.encode(text)
    assert not set(ids) & tok.special_ids
    assert gguf_tok.encode(text) == ids
    assert tok.decode(ids) == text


def test_encode_turn_end_string(tok):
    assert 106 not in tok.encode("<turn|>")
    assert tok.encode_with_special_tokens("<turn|>") == [106]


def test_markup_encoding_matches_transformers(tok, hf_tok):
    text = "<bos><|turn>user\nHi there<turn|>\n<|turn>model\n<|channel>thought\n<channel|>x<|\"|>y<unused3>"
    assert tok.encode_with_special_tokens(text) == hf_tok.encode(text, add_special_tokens=False)


# ---- decoding ----------------------------------------------------------------------------------------

def test_decode_skip_special(tok, hf_tok):
    ids = [2, 105, *tok.encode("user\nHello"), 106, 100, 101]
    assert tok.decode(ids, skip_special=True) == "user\nHello"
    assert tok.decode(ids, skip_special=True) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids) == "<bos><|turn>user\nHello<turn|><|channel><channel|>"


@pytest.mark.parametrize("text", [t for t in TEXTS if t] + ["ab日本語🦊ʬ😀\n\nend"])
def test_streaming_detokenizer_matches_decode_for_every_prefix(text, tok):
    ids = tok.encode(text)
    stream = tok.detokenizer()
    pieces = []
    for k, token_id in enumerate(ids, start=1):
        piece = stream.add(token_id)
        assert "\ufffd" not in piece
        pieces.append(piece)
        # Prefix check: the text so far plus whatever a flush would add equals the batch decode.
        probe = tok.detokenizer()
        probe_text = "".join(probe.add(i) for i in ids[:k]) + probe.flush()
        assert probe_text == tok.decode(ids[:k])
        assert "".join(pieces) == tok.decode(ids[:k]).rstrip("\ufffd")
    assert "".join(pieces) + stream.flush() == text


def test_streaming_holds_split_character(tok):
    ids = tok.encode("\U0001D518")  # four byte tokens
    stream = tok.detokenizer()
    assert [stream.add(i) for i in ids] == ["", "", "", "\U0001D518"]
    assert stream.flush() == ""
    stream.add(ids[0])
    assert stream.flush() == "\ufffd" == tok.decode(ids[:1])


def test_streaming_skip_special(tok):
    stream = tok.detokenizer(skip_special=True)
    out = "".join(stream.add(i) for i in [2, *tok.encode("Hi"), 106]) + stream.flush()
    assert out == "Hi"


# ---- GGUF metadata ------------------------------------------------------------------------------------

def test_gguf_metadata_keys_and_types(tok):
    metadata, types = tok.to_gguf_metadata()
    assert set(metadata) == set(types) == {
        "tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.mask_token_id",
        "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template"}
    assert metadata["tokenizer.ggml.model"] == "gemma4" and types["tokenizer.ggml.model"] == 8
    assert types["tokenizer.ggml.tokens"] == (9, 8) and types["tokenizer.ggml.merges"] == (9, 8)
    assert types["tokenizer.ggml.scores"] == (9, 6) and types["tokenizer.ggml.token_type"] == (9, 5)
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "mask_token_id"):
        assert types[f"tokenizer.ggml.{key}"] == 4
    assert [metadata[f"tokenizer.ggml.{k}"] for k in
            ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "mask_token_id")] == [2, 1, 3, 0, 4]
    assert types["tokenizer.ggml.add_bos_token"] == types["tokenizer.ggml.add_space_prefix"] == 7
    assert metadata["tokenizer.ggml.add_bos_token"] is True and metadata["tokenizer.ggml.add_space_prefix"] is False
    assert metadata["tokenizer.chat_template"] == builtin_chat_template()
    scores = metadata["tokenizer.ggml.scores"]
    assert scores.dtype == np.float32 and scores.shape == (1024,) and np.all(scores == -1000.0)
    ttype = metadata["tokenizer.ggml.token_type"]
    assert ttype.dtype == np.int32 and ttype.shape == (1024,)
    tokens = metadata["tokenizer.ggml.tokens"]
    for i, t in enumerate(tokens):
        expected = 6 if 108 <= i < 364 else (4 if t in VISIBLE_SPECIAL_TOKENS else 3) if i < 107 else 1
        assert ttype[i] == expected, (i, t)
    assert sorted(t for i, t in enumerate(tokens) if ttype[i] == 4) == sorted(VISIBLE_SPECIAL_TOKENS)
    merges = metadata["tokenizer.ggml.merges"]
    assert merges[:2] == ["\n \n", "\n\n \n"] and all(m.count(" ") == 1 for m in merges)


def test_gguf_file_round_trip(tok, tmp_path):
    from gemma4_mlx.gguf import read_gguf, write_gguf

    metadata, types = tok.to_gguf_metadata()
    path = tmp_path / "tok.gguf"
    write_gguf(path, {"general.architecture": "gemma4", **metadata}, {"general.architecture": 8, **types}, [])
    with read_gguf(path) as f:
        loaded = Tokenizer.from_gguf_metadata(f.metadata)
    assert loaded.vocab_size == tok.vocab_size and loaded.chat_template == tok.chat_template
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text)


def test_gguf_metadata_numpy_arrays_and_eos_ids(tok):
    metadata, _ = tok.to_gguf_metadata()
    metadata = dict(metadata)
    metadata["tokenizer.ggml.tokens"] = np.array(metadata["tokenizer.ggml.tokens"], dtype=object)
    metadata["tokenizer.ggml.merges"] = np.array(metadata["tokenizer.ggml.merges"])
    metadata["tokenizer.ggml.bos_token_id"] = np.uint32(2)
    metadata["tokenizer.ggml.eos_token_ids"] = np.array([1, 106, 50], dtype=np.int32)
    del metadata["tokenizer.chat_template"]
    loaded = Tokenizer.from_gguf_metadata(metadata)
    assert loaded.eos_ids == {1, 106, 50} and loaded.bos_id == 2
    assert loaded.chat_template == builtin_chat_template()
    assert loaded.encode(TEXTS[3]) == tok.encode(TEXTS[3])


def test_gguf_newline_tokens_without_merges_are_whole_runs(tok):
    """A vocabulary whose newline-run tokens no merge builds (as in HF files that carry them as added tokens):
    runs that are tokens are still emitted whole, as llama.cpp does."""
    metadata, _ = tok.to_gguf_metadata()
    metadata = dict(metadata)
    metadata["tokenizer.ggml.merges"] = [m for m in metadata["tokenizer.ggml.merges"] if "\n" not in m]
    loaded = Tokenizer.from_gguf_metadata(metadata)
    assert loaded.encode("\n\n") == [364] and loaded.encode("\n\n\n") == [365]
    assert loaded.encode("a\n\nb") == loaded.encode("a") + [364] + loaded.encode("b")
    assert loaded.decode(loaded.encode("x\n\n\n\n\n\ny")) == "x\n\n\n\n\n\ny"


def test_merges_that_build_a_special_string_are_never_used_for_text():
    """A vocabulary in which BPE merges could spell a control token: plain text must still not produce it."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<t>", "<", "t", ">", "<t", "a", "▁", *BYTE_TOKENS]
    types = [3, 3, 3, 3, 3] + [1] * 6 + [6] * 256
    metadata = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                "tokenizer.ggml.merges": ["< t", "<t >"]}
    small = Tokenizer.from_gguf_metadata(metadata)
    assert small.encode("<t>") == [8, 7]
    assert small.encode("a <t>a") == [9, 10, 8, 7, 9]
    assert small.encode_with_special_tokens("a<t>") == [9, 4]
    assert small.decode(small.encode("x<t>y")) == "x<t>y"
