"""Text generation: `load`, `generate_step`, `stream_generate`, `generate`, and the CLI.

    python -m gemma4_mlx.generate --model PATH --prompt "Hello" [--max-tokens 100 --temp 1.0 ...]

Library use (mlx-lm's names and conventions):

    from gemma4_mlx.generate import load, generate, stream_generate
    model, tokenizer = load("gemma-4-E2B-it-Q4_0.gguf")          # or an HF dir, a cached repo id, "demo"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    text = generate(model, tokenizer, ids, max_tokens=64, verbose=True)
    for r in stream_generate(model, tokenizer, ids, max_tokens=64, sampler=make_sampler(temp=1.0)):
        print(r.text, end="", flush=True)

For research: `model(tokens int [B, T], cache=None, return_hidden_states=True)` returns (logits fp32
[B, T, V], hidden) where hidden lists the scaled embeddings then every layer's output [B, T, H] (before
the final norm); `model.logits(model.model.norm(h))` projects any of them through the tied head.

Thinking: Gemma 4 writes its reasoning as `<|channel>thought\\n ... <channel|>` before the answer.
stream_generate routes that channel to `GenerationResponse.reasoning` and keeps it out of `.text`
(split on the token ids of `<|channel>` / `<channel|>`; `split_thinking=False` keeps the raw text).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from . import cpu_matvec
from .cache import cache_length, detach, make_cache
from .checkpoint import LoadError, load_gguf, load_hf
from .compiled_step import CompiledDecoder
from .config import ConfigError
from .gguf import GGUFError
from .model import Model
from .sampling import LogitsProcessor, Sampler, choose, make_logits_processors, make_sampler
from .tokenizer import Tokenizer

__all__ = ["GenerationDefaults", "GenerationResponse", "LoadError", "load", "resolve_model_path",
           "generate_step", "stream_generate", "generate", "ThinkingSplitter", "main"]

DTYPES = {"bfloat16": mx.bfloat16, "float32": mx.float32}


# ------------------------------------------------------------------------------------------
# loading


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling settings recommended by the checkpoint (None: not given). Attached to a loaded model
    as `model.generation_defaults`."""

    temp: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")


def _hf_cache_snapshot(repo_id: str) -> Path:
    """The local snapshot directory of an HF repo id already in the HF cache; never downloads."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # no huggingface_hub: read the cache layout directly
        return _scan_hf_cache(repo_id)
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        raise LoadError(f"{repo_id}: no such file or directory, and not in the local Hugging Face cache "
                        f"(nothing is downloaded; fetch it first, e.g. `hf download {repo_id}`)") from None


def _scan_hf_cache(repo_id: str) -> Path:
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface")), "hub")
    repo_dir = Path(hub) / ("models--" + repo_id.replace("/", "--"))
    ref = repo_dir / "refs" / "main"
    snapshots = repo_dir / "snapshots"
    if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
        return snapshots / ref.read_text().strip()
    found = sorted(p for p in snapshots.glob("*") if p.is_dir()) if snapshots.is_dir() else []
    if len(found) == 1:
        return found[0]
    raise LoadError(f"{repo_id}: no such file or directory, and not in the local Hugging Face cache ({hub}); "
                    f"nothing is downloaded")


def _pick_gguf(directory: Path, label: str, quant: str | None = None) -> Path | None:
    """The one .gguf in a directory (matching `quant` in its name if given); None if there is none."""
    files = sorted(p for p in directory.glob("*.gguf") if "mmproj" not in p.name.lower())
    if quant:
        files = [p for p in files if quant.lower() in p.name.lower()]
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise LoadError(f"{label}: several GGUF files ({names}); pass one file"
                        + ("" if quant else " or REPO:QUANT"))
    return files[0] if files else None


def resolve_model_path(spec: str | os.PathLike) -> tuple[str, Path]:
    """("gguf" | "hf", path) for a .gguf file, an HF directory, a directory holding one .gguf, an HF repo id
    (optionally "repo:QUANT" to pick a GGUF in it) found in the local HF cache, or "demo" (built on first
    use). Raises LoadError naming the path and the problem."""
    text = os.fspath(spec)
    if text == "demo":
        from .demo import demo_path

        return "gguf", demo_path()
    path = Path(text).expanduser()
    quant = None
    if not path.exists():
        if not _REPO_ID.match(text):
            raise LoadError(f"{text}: no such file or directory")
        repo_id, _, quant = text.partition(":")
        path = _hf_cache_snapshot(repo_id)
    if path.is_file():
        return "gguf", path
    if not path.is_dir():
        raise LoadError(f"{text}: not a file or directory")
    if (path / "config.json").is_file() and not quant:
        has_weights = (path / "model.safetensors.index.json").is_file() or any(path.glob("*.safetensors"))
        if not has_weights:
            gguf = _pick_gguf(path, text)
            if gguf is not None:
                return "gguf", gguf
            raise LoadError(f"{text}: directory has a config.json but no weights (*.safetensors or .gguf)")
        if not (path / "tokenizer.json").is_file():
            raise LoadError(f"{text}: directory has weights but no tokenizer.json")
        return "hf", path
    gguf = _pick_gguf(path, text, quant)
    if gguf is None:
        what = f"no .gguf file matching {quant!r}" if quant else "no config.json, *.safetensors or .gguf file"
        raise LoadError(f"{text}: directory has {what}")
    return "gguf", gguf


def _gguf_defaults(md: dict) -> GenerationDefaults:
    def get(key, cast):
        v = md.get(f"general.sampling.{key}")
        if v is None:
            return None
        return int(v) if cast is int else float(f"{float(v):.7g}")  # f32 0.949999988 -> 0.95

    return GenerationDefaults(temp=get("temp", float), top_p=get("top_p", float), top_k=get("top_k", int),
                              min_p=get("min_p", float))


def _hf_defaults(path: Path) -> GenerationDefaults:
    f = path / "generation_config.json"
    if not f.is_file():
        return GenerationDefaults()
    try:
        gen = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise LoadError(f"{f}: not valid JSON ({e})") from None
    if gen.get("do_sample") is False:
        return GenerationDefaults(temp=0.0)

    def get(key, cast):
        return None if gen.get(key) is None else cast(gen[key])

    return GenerationDefaults(temp=get("temperature", float), top_p=get("top_p", float), top_k=get("top_k", int),
                              min_p=get("min_p", float))


def default_dtype():
    """bf16 on GPUs; on the CPU f32 when a fast BLAS is verified (~20x faster than MLX's bf16 there,
    see gemma4_mlx/blas.py), else bf16."""
    if mx.default_device() == mx.cpu:
        from . import blas

        return blas.cpu_compute_dtype()
    return mx.bfloat16


def load(path: str | os.PathLike, dtype=None, progress: bool = True) -> tuple[Model, Tokenizer]:
    """Load (model, tokenizer) from a .gguf file, an HF directory, an HF repo id in the local HF cache,
    or "demo". dtype: mx.bfloat16 (default) or mx.float32, or their names, for every tensor that is not
    Q4_0/Q8_0. The model carries `generation_defaults` (GenerationDefaults) from the file's
    general.sampling.* keys or generation_config.json. Raises LoadError (a ValueError) with one line
    naming the path and the cause."""
    if dtype is None:
        dtype = default_dtype()
    elif isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    kind, resolved = resolve_model_path(path)
    label = os.fspath(path) if os.fspath(path) == str(resolved) else f"{os.fspath(path)} ({resolved})"
    try:
        if kind == "gguf":
            model, metadata = load_gguf(resolved, dtype=dtype, progress=progress)
            tokenizer = Tokenizer.from_gguf_metadata(metadata)
            defaults = _gguf_defaults(metadata)
        else:
            model = load_hf(resolved, dtype=dtype, progress=progress)
            tokenizer = Tokenizer.from_hf_dir(resolved)
            defaults = _hf_defaults(resolved)
    except LoadError as e:
        msg = str(e)
        raise LoadError(msg if str(resolved) in msg else f"{label}: {msg}") from None
    except GGUFError as e:
        raise LoadError(f"{label}: not a valid GGUF file ({e})") from None
    except (ConfigError, OSError, ValueError, KeyError) as e:
        raise LoadError(f"{label}: {e}") from None
    model.generation_defaults = defaults
    return model, tokenizer


# ------------------------------------------------------------------------------------------
# token generation


def _free_positions(cache: list) -> int | None:
    """Positions the cache can still take (None: unbounded); only bounded full-attention caches count."""
    rooms = [c.max_size - c.offset for c in cache if c is not None and getattr(c, "max_size", None) is not None]
    return min(rooms) if rooms else None


def _last_logits(model, tokens: mx.array, cache: list) -> mx.array:
    """Forward tokens int [1, T] through the model with the cache; logits fp32 [1, V] of the last position
    (the tied head runs on that position only)."""
    if isinstance(model, Model):
        h = model.model(tokens, cache)
        return model.logits(h[:, -1, :])
    return model(tokens, cache)[:, -1, :]


def generate_step(prompt: mx.array | Sequence[int], model, *, max_tokens: int = 256,
                  sampler: Sampler | None = None, logits_processors: list[LogitsProcessor] | None = None,
                  max_kv_size: int | None = None, prompt_cache: list | None = None,
                  prefill_step_size: int = 2048,
                  prompt_progress_callback: Callable[[int, int], None] | None = None,
                  compiled: bool = True,
                  ) -> Iterator[tuple[int, mx.array]]:
    """Yield (token id, logprobs fp32 [V]) for up to max_tokens new tokens after `prompt` (ids, 1-D).
    The logprobs are computed when read (sampling.choose: make_sampler's samplers pick from the logits).

    prompt_cache: caches from `cache.make_cache` holding a prefix already (the prompt continues it); by
    default a fresh cache bounded by max_kv_size. The prompt is prefilled in chunks of
    prefill_step_size; decoding runs one step ahead of the consumer (`mx.async_eval`), so a stop after a
    token leaves that token in the cache too. Generation ends early (no error) when a bounded cache is
    full; a prompt that does not fit raises ValueError. compiled: decode through one `mx.compile`d
    step over fixed-shape caches (compiled_step.py); a prompt_cache's buffers move into that step and
    come back (CompiledDecoder.hand_back) when this generator is exhausted or closed (`gen.close()`,
    or its last reference dropped): until then the cache raises on use (cache.detach).
    compiled=False: eager steps that update prompt_cache as they go. On the CPU, models with
    Q4_0/Q8_0 linears decode eagerly (cpu_matvec.decode_eagerly: their native matvec is faster).
    Read the logprobs on the thread that runs this generator (they are evaluated when read)."""
    tokens = mx.array(prompt, dtype=mx.int32) if not isinstance(prompt, mx.array) else prompt.astype(mx.int32)
    tokens = tokens.reshape(-1)
    n_prompt = tokens.size
    if n_prompt == 0:
        raise ValueError("the prompt is empty: nothing to continue")
    if prefill_step_size < 1:
        raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}")
    cache = prompt_cache if prompt_cache is not None else make_cache(model.cfg, max_kv_size=max_kv_size)
    free = _free_positions(cache)
    if free is not None and n_prompt > free:
        raise ValueError(f"the prompt ({n_prompt} tokens) does not fit the KV cache ({free} free positions; "
                         f"raise --max-kv-size)")
    sampler = sampler or make_sampler()
    processors = list(logits_processors or [])
    history = tokens

    def next_token(logits: mx.array) -> tuple[mx.array, mx.array]:
        nonlocal history
        for process in processors:
            logits = process(history, logits)
        y, logprobs = choose(logits, sampler)
        if processors:
            history = mx.concatenate([history, y])
        return y, logprobs[0]

    def state():
        return [c.state for c in cache if c is not None]

    # prefill: all tokens but the last only fill the cache. Evaluating just the cache states lets
    # MLX drop the work no cache needs (the last layer's attention output and MLP, the KV-shared
    # layers of the E-series); the last token then runs through everything alone.
    done = 0
    if prompt_progress_callback:
        prompt_progress_callback(0, n_prompt)
    while n_prompt - done > 1:
        step = min(prefill_step_size, n_prompt - 1 - done)
        chunk = tokens[None, done:done + step]
        # the body only: the head's output is never needed here (and on the CPU the native head
        # would evaluate it right away)
        model.model(chunk, cache) if isinstance(model, Model) else model(chunk, cache)
        mx.eval(state())
        done += step
        if prompt_progress_callback:
            prompt_progress_callback(done, n_prompt)
    y, logprobs = next_token(_last_logits(model, tokens[None, done:], cache))
    mx.async_eval(y)  # the logprobs are computed when read (sampling.choose)
    if prompt_progress_callback:
        prompt_progress_callback(n_prompt, n_prompt)

    decoder = None
    if compiled and isinstance(model, Model) and max_tokens > 1 and not cpu_matvec.decode_eagerly(model):
        length = cache_length(cache)
        capacity = -(-(length + max_tokens) // 256) * 256
        if free is not None:
            capacity = min(capacity, length + _free_positions(cache))
        decoder = CompiledDecoder(model, cache, capacity)
        detach(cache)  # the decoder holds the positions now; hand_back returns them

    def room() -> int | None:
        if decoder is not None:
            return decoder.capacity - decoder.length if free is not None else None
        return _free_positions(cache)

    try:
        n = 0
        while n < max_tokens:
            following = None
            room_left = room()
            if n + 1 < max_tokens and (room_left is None or room_left > 0):
                logits = decoder(y[None]) if decoder is not None else _last_logits(model, y[None], cache)
                following = next_token(logits)
                mx.async_eval(following[0])
            yield int(y.item()), logprobs
            n += 1
            if following is None:
                return
            y, logprobs = following
    finally:  # also when the consumer stops early (the generator is closed)
        if decoder is not None:
            if decoder.state is not None:
                decoder.hand_back(cache)
            else:  # a step failed after its buffers were given to MLX: say so on every later use
                detach(cache, "lost its positions when a compiled decode step failed: make a new cache")


class ThinkingSplitter:
    """Token-id state machine separating the thought channel from the answer while streaming.

    `<|channel>` opens the channel, `<channel|>` closes it; the channel's first line (its name,
    "thought") is dropped. add(token) and flush() return (answer text, reasoning text) increments."""

    MAX_NAME = 32

    def __init__(self, tokenizer: Tokenizer, enabled: bool = True):
        self._detok = tokenizer.detokenizer()
        self.open_id = tokenizer.token_to_id("<|channel>") if enabled else None
        self.close_id = tokenizer.token_to_id("<channel|>") if enabled else None
        self.in_channel = False
        self._header: str | None = None  # channel text before its first newline, while undecided

    def _reasoning(self, s: str) -> str:
        if self._header is None:
            return s
        self._header += s
        name, newline, rest = self._header.partition("\n")
        if newline:
            self._header = None
            return rest if len(name) <= self.MAX_NAME and " " not in name.strip() else name + newline + rest
        if len(self._header) > self.MAX_NAME or " " in self._header.strip():
            s, self._header = self._header, None
            return s
        return ""

    def add(self, token: int) -> tuple[str, str]:
        if token == self.open_id and not self.in_channel:
            text = self._detok.flush()
            self.in_channel, self._header = True, ""
            return text, ""
        if token == self.close_id and self.in_channel:
            reasoning = self._reasoning(self._detok.flush())
            self.in_channel, self._header = False, None
            return "", reasoning
        s = self._detok.add(token)
        return ("", self._reasoning(s)) if self.in_channel else (s, "")

    def flush(self) -> tuple[str, str]:
        s = self._detok.flush()
        if not self.in_channel:
            return s, ""
        reasoning = self._reasoning(s)
        if self._header:  # an unfinished channel with nothing but a name so far
            reasoning, self._header = reasoning + self._header, None
        return "", reasoning


@dataclass
class GenerationResponse:
    """One streamed step. text / reasoning: new answer / thought-channel text since the previous item;
    token: the id generated at this step (None only when nothing was generated); logprobs fp32 [V];
    finish_reason: None, then "stop" (a stop token) or "length" (max_tokens or a full KV cache) on
    the last item. Rates in tokens per second; peak_memory in GB."""

    text: str
    token: int | None
    logprobs: mx.array | None
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    reasoning: str = ""
    from_draft: bool = False


def stream_generate(model, tokenizer: Tokenizer, prompt: str | Sequence[int] | mx.array, max_tokens: int = 256, *,
                    sampler: Sampler | None = None, logits_processors: list[LogitsProcessor] | None = None,
                    max_kv_size: int | None = None, prompt_cache: list | None = None,
                    stop_tokens: Iterable[int] | None = None, split_thinking: bool = True,
                    **kwargs: Any) -> Iterator[GenerationResponse]:
    """Yield GenerationResponse items for up to max_tokens new tokens; the last one has finish_reason.

    prompt: text (encoded with <bos>, special-token strings stay text) or token ids (e.g. from
    `tokenizer.apply_chat_template`). Stops at tokenizer.eos_ids (<eos>, <turn|>) plus stop_tokens;
    the stop token's text is not emitted. Other keywords go to generate_step (prefill_step_size,
    prompt_progress_callback)."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_bos=True)
    elif isinstance(prompt, mx.array):
        ids = prompt.reshape(-1).tolist()
    else:
        ids = [int(t) for t in prompt]
    stop = set(tokenizer.eos_ids) | set(int(t) for t in (stop_tokens or ()))
    free = _free_positions(prompt_cache) if prompt_cache is not None else max_kv_size
    if free is not None and len(ids) <= free:
        max_tokens = min(max_tokens, free - len(ids) + 1)  # the last token is never fed back
    splitter = ThinkingSplitter(tokenizer, enabled=split_thinking)

    tic = time.perf_counter()
    prompt_tps = generation_tps = 0.0
    n = 0
    token, logprobs, finish = None, None, "length"
    text = reasoning = ""

    def response(text, reasoning, finish_reason=None):
        return GenerationResponse(text=text, token=token, logprobs=logprobs, prompt_tokens=len(ids),
                                  prompt_tps=prompt_tps, generation_tokens=n, generation_tps=generation_tps,
                                  peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish_reason,
                                  reasoning=reasoning)

    if max_tokens > 0:
        # the caller's prompt_cache or none (then generate_step owns its cache)
        steps = generate_step(ids, model, max_tokens=max_tokens, sampler=sampler,
                              logits_processors=logits_processors, max_kv_size=max_kv_size,
                              prompt_cache=prompt_cache, **kwargs)
        try:
            for token, logprobs in steps:
                n += 1
                now = time.perf_counter()
                if n == 1:
                    prompt_tps = len(ids) / max(now - tic, 1e-9)
                    tic = now
                else:
                    generation_tps = (n - 1) / max(now - tic, 1e-9)
                if token in stop:
                    finish = "stop"
                    break
                text, reasoning = splitter.add(token)
                if n == max_tokens:
                    break
                yield response(text, reasoning)
                text = reasoning = ""
        finally:  # the compiled step hands a prompt_cache back now, before the last item
            steps.close()
    tail_text, tail_reasoning = splitter.flush()
    yield response(text + tail_text, reasoning + tail_reasoning, finish)


class _Printer:
    """Streams text to stdout; the thought channel between visible [thinking] ... [/thinking] marks."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.in_reasoning = False

    def write(self, r: GenerationResponse) -> None:
        if r.reasoning:
            if not self.in_reasoning:
                self.stream.write("[thinking]\n")
                self.in_reasoning = True
            self.stream.write(r.reasoning)
        if r.text or (self.in_reasoning and r.finish_reason):
            if self.in_reasoning:
                self.stream.write("\n[/thinking]\n")
                self.in_reasoning = False
            self.stream.write(r.text)
        self.stream.flush()


def print_stats(r: GenerationResponse, stream=None) -> None:
    """The three closing lines of mlx-lm's verbose output."""
    stream = stream or sys.stdout
    stream.write(f"Prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.3f} tokens-per-sec\n")
    stream.write(f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.3f} tokens-per-sec\n")
    stream.write(f"Peak memory: {r.peak_memory:.3f} GB\n")
    stream.flush()


def generate(model, tokenizer: Tokenizer, prompt: str | Sequence[int] | mx.array, verbose: bool = False,
             **kwargs: Any) -> str:
    """The generated answer text (thought channel excluded). verbose: stream it to stdout between
    `==========` rulers (thoughts marked [thinking] ... [/thinking]) and print the three stats lines.
    Keywords as for stream_generate."""
    printer = _Printer() if verbose else None
    pieces = []
    last = None
    for last in stream_generate(model, tokenizer, prompt, **kwargs):
        if printer and not pieces:  # the ruler once the prompt is in (a prompt error prints nothing)
            print("=" * 10, flush=True)
        pieces.append(last.text)
        if printer:
            printer.write(last)
    if verbose and last is not None:
        print("\n" + "=" * 10)
        print_stats(last)
    return "".join(pieces)


# ------------------------------------------------------------------------------------------
# CLI


def _str2bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("true", "t", "1", "yes", "y"):
        return True
    if v in ("false", "f", "0", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {s!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gemma4_mlx.generate",
                                description="Generate text with a Gemma 4 model (GGUF file, HF directory, "
                                            "cached HF repo id, or 'demo').")
    p.add_argument("--model", required=True,
                   help="a .gguf file, an HF directory, an HF repo id in the local HF cache (REPO or REPO:QUANT), "
                        "or 'demo' (a small random-weight model: meaningless text)")
    p.add_argument("--prompt", "-p", default="Hello", help="the user message ('-' reads stdin)")
    p.add_argument("--system-prompt", default=None, help="system message (with the chat template)")
    p.add_argument("--max-tokens", "-m", type=int, default=100, help="maximum new tokens (default 100)")
    p.add_argument("--temp", type=float, default=None,
                   help="temperature; 0 = greedy (default: the file's general.sampling.temp, else 0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default: the file's, else 1.0 = off)")
    p.add_argument("--top-k", type=int, default=None, help="top-k sampling (default: the file's, else 0 = off)")
    p.add_argument("--min-p", type=float, default=None, help="min-p sampling (default: the file's, else 0.0 = off)")
    p.add_argument("--min-tokens-to-keep", type=int, default=1, help="tokens top-p / min-p always keep")
    p.add_argument("--repetition-penalty", type=float, default=None, help="CTRL repetition penalty (e.g. 1.1)")
    p.add_argument("--repetition-context-size", type=int, default=20, help="tokens the penalty looks back over")
    p.add_argument("--seed", type=int, default=None, help="random seed (same seed, same text)")
    p.add_argument("--ignore-chat-template", action="store_true", help="feed the prompt as plain text after <bos>")
    p.add_argument("--chat-template-args", "--chat-template-config", dest="chat_template_args", default=None,
                   help='JSON object of chat template keywords, e.g. \'{"enable_thinking": true}\'')
    p.add_argument("--enable-thinking", action="store_true", help="let the model think first (shown in verbose mode)")
    p.add_argument("--max-kv-size", type=int, default=None,
                   help="bound the full-attention KV cache to this many positions (generation stops when full)")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prompt tokens per prefill chunk")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="activation / float-weight dtype (default: bfloat16 on GPUs; float32 on a CPU with a "
                        "fast BLAS, else bfloat16)")
    p.add_argument("--verbose", type=_str2bool, default=True,
                   help="True: stream with rulers and stats (default); False: print only the text")
    return p


def _sampling_settings(args, defaults: GenerationDefaults) -> dict:
    def pick(name, fallback):
        given = getattr(args, name)
        if given is not None:
            return given
        from_file = getattr(defaults, name)
        return from_file if from_file is not None else fallback

    return dict(temp=pick("temp", 0.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0), min_p=pick("min_p", 0.0))


def _prompt_ids(args, tokenizer: Tokenizer, template_args: dict) -> list[int]:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.ignore_chat_template:
        return tokenizer.encode(prompt, add_bos=True)
    messages = []
    if args.system_prompt is not None:
        messages.append({"role": "system", "content": args.system_prompt})
    messages.append({"role": "user", "content": prompt})
    kwargs = {"enable_thinking": args.enable_thinking, **template_args}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        template_args: dict = {}
        if args.chat_template_args is not None:
            try:
                template_args = json.loads(args.chat_template_args)
            except json.JSONDecodeError as e:
                raise ValueError(f"--chat-template-args is not valid JSON ({e})") from None
            if not isinstance(template_args, dict):
                raise ValueError("--chat-template-args must be a JSON object, e.g. '{\"enable_thinking\": true}'")
        if args.max_tokens < 0:
            raise ValueError(f"--max-tokens must be >= 0, got {args.max_tokens}")
        if args.max_kv_size is not None and args.max_kv_size < 1:
            raise ValueError(f"--max-kv-size must be >= 1, got {args.max_kv_size}")
        if args.seed is not None:
            mx.random.seed(args.seed)
        model, tokenizer = load(args.model, dtype=DTYPES[args.dtype] if args.dtype else None,
                                progress=sys.stderr.isatty())

        settings = _sampling_settings(args, model.generation_defaults)
        sampler = make_sampler(min_tokens_to_keep=args.min_tokens_to_keep, **settings)
        processors = make_logits_processors(repetition_penalty=args.repetition_penalty,
                                            repetition_context_size=args.repetition_context_size)
        ids = _prompt_ids(args, tokenizer, template_args)
        text = generate(model, tokenizer, ids, verbose=args.verbose, max_tokens=args.max_tokens, sampler=sampler,
                        logits_processors=processors, max_kv_size=args.max_kv_size,
                        prefill_step_size=args.prefill_step_size)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a clear line for the user's mistakes; bugs keep their traceback
        from jinja2 import TemplateError

        if not isinstance(e, (ValueError, OSError, TemplateError)):
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    if not args.verbose:
        print(text)
    elif mx.default_device() == mx.cpu:
        from . import blas, cpu_matvec

        print(blas.describe(), file=sys.stderr)
        print(cpu_matvec.describe(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
