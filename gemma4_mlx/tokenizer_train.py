"""Build small Gemma-4-shaped BPE tokenizers (for fixtures and demo models) and save them as HF repos do.

`build_gemma4_tokenizer` trains a `tokenizers` BPE (BpeTrainer) and lays the vocabulary out like the real
Gemma 4 files: ids 0..106 the special / unused tokens at their real Gemma 4 ids, 107 = "\\n", 108..363 the
256 byte-fallback tokens <0x00>..<0xFF>, then the learned part, which starts with the multi-newline tokens
"\\n\\n" and "\\n\\n\\n" (merge ranks 0 and 1), then the learned single characters, then the learned merges.

Pipeline (identical to what transformers' GemmaTokenizer builds): normaliser Replace(" " -> "▁"), no prefix
space, BPE over UTF-8 characters with byte fallback, decoder Replace("▁" -> " ") + ByteFallback + Fuse.

Training splits the text into pieces that never mix newlines with other characters (so no learned token does,
and merging across a newline boundary can never happen): single newlines, runs of "▁" (spaces), single digits
and words with at most one leading "▁". Newline runs are therefore built only by the two hand-placed merges,
which makes plain BPE over a newline run identical to llama.cpp's `gemma4` rule (emit the whole run if it is a
token, else BPE the run) and to HF's BPE over the whole text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from .tokenizer import (
    BYTE_TOKENS,
    FIRST_BYTE_ID,
    GEMMA4_SPECIAL_TOKENS,
    NEWLINE_ID,
    gemma4_tokenizer_json,
    reserved_gemma4_tokens,
)

__all__ = ["DEFAULT_TRAINING_TEXT", "build_gemma4_tokenizer", "save_hf_tokenizer"]

# Pieces the trainer counts: one newline, a run of spaces that is followed by another space (the last space
# stays with the next word), one digit (optionally after a space), a word with at most one leading space,
# a trailing run of spaces.
_TRAINING_PIECES = r"\n|▁+(?=▁)|▁?\p{N}|▁?[^▁\n\p{N}]+|▁+"

# "\n\n" and "\n\n\n" are the first learned tokens; these two merges build them.
_NEWLINE_MERGES: list[tuple[str, str]] = [("\n", "\n"), ("\n\n", "\n")]

DEFAULT_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. The five boxing wizards jump quickly.
A tokenizer turns text into a sequence of integers, and a language model turns that sequence back into text.
Gemma is a family of open models. This small vocabulary exists so that tests and demos can run without any
downloaded data: it is trained on this paragraph and the ones below, and nothing else.

When the weather is good, we walk along the river and talk about books, music, mathematics and the sea.
She said: "I think it's going to rain later, so take an umbrella!" He answered: "Maybe. We'll see."
Numbers matter too: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 4096 65536 3.14159 2.71828 -17 +23 1e-6.
Dates and times: 2024-05-14, 12:30:45, 7/4/1976, the 21st century, 1,000,000 people, 99.9% uptime, $19.99.

Der schnelle braune Fuchs springt über den faulen Hund. Größe, Maß, Straße, Öl, Ärger, Übung, schön.
Wir fahren morgen früh nach München und besuchen die Brüder Grimm im Märchenmuseum; danach gibt es Kaffee.
Le cœur a ses raisons que la raison ne connaît point. Où est la bibliothèque ? À bientôt, déjà vu, garçon.
L'été dernier, nous avons mangé des crêpes à Noël chez ma sœur ; c'était très agréable et un peu étrange.
El niño comió una manzana en la mañana. ¿Dónde está la estación? ¡Qué día tan bonito! Año, señor, canción.
Ελληνικά: καλημέρα κόσμε. Русский: привет, мир! Как дела? Українська: дякую. Türkçe: teşekkürler, güle güle.

中文：今天天气很好，我们去公园散步吧。机器学习模型需要大量的数据。你好，世界！
日本語：こんにちは、世界。東京は大きな都市です。カタカナ、ひらがな、漢字を使います。
한국어: 안녕하세요, 세계! 오늘은 날씨가 좋습니다. 감사합니다.
हिन्दी: नमस्ते दुनिया। العربية: مرحبا بالعالم. עברית: שלום עולם. ไทย: สวัสดีชาวโลก

Emoji: 😀 😃 😄 🎉 🚀 ❤️ 👍🏽 🇩🇪 🇫🇷 🇯🇵 👩‍💻 🐍 🦊 ☕ ✨ 🌍 — and symbols: © ® ™ € £ ¥ ° ± × ÷ ≤ ≥ ≠ ∞ → ← ↑ ↓ ✓.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]


class Counter:
    def __init__(self, start=0):
        self.count = start

    def increment(self, step=1):
        self.count += step
        return self.count

for i in range(10):
    if i % 2 == 0:
        print(f"{i} is even")
    else:
        print(f"{i} is odd")

{"name": "gemma", "layers": 30, "hidden_size": 2560, "vocab": [1, 2, 3], "ok": true, "value": null}
<html><body><p class="note">Hello &amp; welcome</p></body></html>
SELECT id, name FROM users WHERE age >= 18 ORDER BY name ASC LIMIT 10;
x = a * b + c / d - (e ** 2) % f; y = [i for i in range(100) if i > 3]; z = {k: v for k, v in items}
#include <stdio.h>
int main(void) { printf("hello, world\\n"); return 0; }
$ git commit -m "Fix the tokenizer" && git push origin main

Indented text:
    four spaces
        eight spaces
\ttab\tseparated\tvalues
trailing spaces   \n  leading spaces
many     spaces     between     words

Paragraphs are separated by blank lines.


Two blank lines above, three below.



The end of a paragraph, then a question? Yes! Then an exclamation... and an ellipsis; a colon: a dash - a slash /.
Common words: the of and to in is that it was for on are as with his they at be this from have or by one had not
but what all were when we there can an your which their said if do will each about how up out them then she many
some so these would other into has more her two like him see time could no make than first been its who now people
my made over did down only way find use may water long little very after words called just where most know get
through back much before go good new write our used me man too any day same right look think also around another
came come work three word must because does part even place well such here take why things help put years different
away again off went old number great tell men say small every found still between name should home big give air
line set own under read last never us left end along while might next sound below saw something thought both few
those always looked show large often together asked house world going want school important until form food keep
children feet land side without boy once animals life enough took sometimes four head above kind began almost live
page got earth need far hand high year mother light parts country father let night following picture being study
second eyes soon times story boys since white days ever paper hard near sentence better best across during today
others however sure means knew its try told young miles sun ways thing whole hear example heard several change answer
room sea against top turned learn point city play toward five using himself usually money seen car morning
"""


def _byte_fallback_layout() -> list[str]:
    """Token strings of ids 0..363: special/unused tokens, "\\n", the 256 byte tokens."""
    tokens = reserved_gemma4_tokens()
    assert len(tokens) == NEWLINE_ID
    tokens.append("\n")
    assert len(tokens) == FIRST_BYTE_ID
    tokens.extend(BYTE_TOKENS)
    return tokens


def build_gemma4_tokenizer(texts: Iterable[str], vocab_size: int = 1024) -> Tokenizer:
    """Train a Gemma-4-shaped BPE tokenizer on `texts`; returns a `tokenizers.Tokenizer` of exactly vocab_size ids.

    Deterministic: the same texts give the same vocabulary, merges and files. If the texts cannot fill the
    vocabulary, the remaining ids are padded with further "<unusedN>" special tokens.
    """
    fixed = _byte_fallback_layout()
    n_fixed = len(fixed) + len(_NEWLINE_MERGES)
    if vocab_size < n_fixed + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small: the fixed Gemma 4 layout needs {n_fixed} ids")

    trainer_tok = Tokenizer(models.BPE(byte_fallback=True))
    trainer_tok.normalizer = normalizers.Replace(" ", "▁")
    trainer_tok.pre_tokenizer = pre_tokenizers.Split(Regex(_TRAINING_PIECES), behavior="isolated")
    # Registered so that literal special-token strings in the training text are cut out, never learned.
    trainer_tok.add_special_tokens(list(GEMMA4_SPECIAL_TOKENS.values()))
    learned_budget = vocab_size - n_fixed
    trainer = trainers.BpeTrainer(
        vocab_size=learned_budget + 1,  # + "\n", which the trainer's alphabet holds but the layout fixes at 107
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
    )
    trainer_tok.train_from_iterator((t for t in texts), trainer=trainer)
    trained = json.loads(trainer_tok.to_str())["model"]

    tokens = list(fixed)
    present = set(tokens)
    for newline_run in ("\n\n", "\n\n\n"):
        tokens.append(newline_run)
        present.add(newline_run)
    merges: list[tuple[str, str]] = list(_NEWLINE_MERGES)

    # Single characters first (in the trainer's id order), then merged tokens in merge order.
    trained_by_id = sorted(trained["vocab"].items(), key=lambda kv: kv[1])
    for piece, _ in trained_by_id:
        if len(tokens) >= vocab_size:
            break
        if len(piece) == 1 and piece not in present:
            tokens.append(piece)
            present.add(piece)
    for left, right in (m if isinstance(m, (list, tuple)) else m.split(" ") for m in trained["merges"]):
        if len(tokens) >= vocab_size:
            break
        merged = left + right
        # A merge is kept only if its parts exist and its result is new: a learned string that equals a fixed
        # token (e.g. the text "<0x41>") would make BPE emit that token's id for ordinary text.
        if left in present and right in present and merged not in present and "\n" not in merged:
            tokens.append(merged)
            present.add(merged)
            merges.append((left, right))
    unused = NEWLINE_ID - len(GEMMA4_SPECIAL_TOKENS)  # <unused0>..<unused89> fill the gaps below 107
    padding = []
    while len(tokens) + len(padding) < vocab_size:
        padding.append(f"<unused{unused + len(padding)}>")
    special_ids = {i for i, t in enumerate(fixed) if i < NEWLINE_ID}
    special_ids |= set(range(len(tokens), len(tokens) + len(padding)))
    tokens.extend(padding)
    return Tokenizer.from_str(json.dumps(gemma4_tokenizer_json(tokens, merges, special_ids)))


_TOKENIZER_CONFIG_BASE = {
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
    "mask_token": "<mask>",
    "clean_up_tokenization_spaces": False,
    "padding_side": "left",
    "spaces_between_special_tokens": False,
    "tokenizer_class": "GemmaTokenizer",
}


def save_hf_tokenizer(tok: Tokenizer, out_dir: str | os.PathLike, chat_template: str | None = None) -> None:
    """Write tokenizer.json, tokenizer_config.json and (if chat_template) chat_template.jinja into out_dir.

    The layout is that of the google/gemma-4-* repos, so `transformers.AutoTokenizer.from_pretrained(out_dir)`
    and `gemma4_mlx.tokenizer.Tokenizer.from_hf_dir(out_dir)` load it. Files are byte-identical for the same
    tokenizer (sorted, fixed formatting).
    """
    os.makedirs(out_dir, exist_ok=True)
    data = json.loads(tok.to_str())
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=2)
        f.write("\n")
    config = dict(_TOKENIZER_CONFIG_BASE)
    config["model_max_length"] = 131072
    config["added_tokens_decoder"] = {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
        for t in data["added_tokens"]
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
        with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(chat_template)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2, sort_keys=True)
        f.write("\n")
