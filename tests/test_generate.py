"""Generation API (gemma4_mlx.generate): load, generate_step, stream_generate, generate, thinking split, demo model."""

import hashlib
import importlib
import shutil

import gemma4_mlx  # noqa: F401  (first: MLX's CPU BLAS)
import mlx.core as mx
import numpy as np
import pytest

from fixtures import discriminativeness, probe_ids
from gemma4_mlx import demo
from gemma4_mlx.cache import RotatingKVCache, cache_length, make_cache
from gemma4_mlx.checkpoint import LoadError
from gemma4_mlx.generate import (
    GenerationDefaults,
    ThinkingSplitter,
    generate,
    generate_step,
    load,
    resolve_model_path,
    stream_generate,
)
from gemma4_mlx.sampling import make_logits_processors, make_sampler

CHANNEL_OPEN, CHANNEL_CLOSE, TURN_END = 100, 101, 106


@pytest.fixture(scope="module")
def dense(fixture_gguf):
    """(model, tokenizer) of the dense fixture's F32 GGUF, float32 activations."""
    return load(fixture_gguf("dense", "f32"), dtype="float32", progress=False)


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory):
    """A GEMMA4_MLX_CACHE directory holding the demo model (built once per session)."""
    directory = tmp_path_factory.getbasetemp() / "gemma4-demo-cache"
    demo.demo_path(directory, announce=False)
    return directory


def prompt_ids(n=20):
    return probe_ids(n)[0].tolist()


def scripted(script, n_prompt, vocab):
    """A logits processor that forces the model to emit `script` (then repeat its last token)."""
    def force(history, logits):
        target = script[min(history.size - n_prompt, len(script) - 1)]
        return mx.where(mx.arange(vocab) == target, 0.0, -1e9)[None].astype(mx.float32)
    return force


# ------------------------------------------------------------------------------------------ decoding


@pytest.fixture(scope="module")
def demo_model(demo_cache):
    """(model, tokenizer) of the demo GGUF (Q8_0 matrices, float32 activations)."""
    return load(demo.demo_path(demo_cache), dtype="float32", progress=False)  # f32: MLX's fast CPU path


@pytest.mark.parametrize("which", ["dense", "demo_model"])
def test_greedy_equals_argmax_over_full_forwards(which, request):
    model, tok = request.getfixturevalue(which)
    ids = prompt_ids(20) if which == "dense" else tok.apply_chat_template([{"role": "user", "content": "Hello"}])
    n = 24 if which == "dense" else 16  # past the sliding window (16 / 32): the ring cache wraps
    assert len(ids) + n > model.cfg.sliding_window + 2
    ref = list(ids)
    for _ in range(n):
        ref.append(int(mx.argmax(model(mx.array([ref]))[0, -1]).item()))
    expected = ref[len(ids):]
    assert [t for t, _ in generate_step(ids, model, max_tokens=n)] == expected
    chunked = [t for t, _ in generate_step(ids, model, max_tokens=n, prefill_step_size=7)]
    assert chunked == expected
    if which == "demo_model":  # the dense fixture's greedy text settles on one token; the demo's keeps varying
        assert len(set(expected)) > 6


def test_sampled_continuation_equals_sampling_over_full_forwards(dense):
    model, _ = dense
    ids = prompt_ids(20)
    sampler = make_sampler(temp=2.0, seed=21)
    ref = list(ids)
    for _ in range(30):
        logits = model(mx.array([ref]))[:, -1]
        ref.append(int(sampler(logits).item()))  # make_sampler's samplers take the logits (sampling.choose)
    expected = ref[len(ids):]
    got = [t for t, _ in generate_step(ids, model, max_tokens=30, sampler=make_sampler(temp=2.0, seed=21))]
    assert got == expected
    assert len(set(expected)) > 5


def test_logprobs_are_normalised_full_forward_log_softmax(dense):
    model, _ = dense
    ids = prompt_ids(12)
    (token, logprobs), = list(generate_step(ids, model, max_tokens=1))
    full = model(mx.array([ids]))[0, -1]
    expected = full - mx.logsumexp(full)
    assert logprobs.shape == (model.cfg.vocab_size,) and logprobs.dtype == mx.float32
    assert np.allclose(np.array(logprobs), np.array(expected), atol=1e-4)
    assert token == int(mx.argmax(logprobs).item())


def test_same_seed_same_text_other_seed_other_text(dense):
    model, tok = dense
    ids = prompt_ids(10)

    def run(seed):
        sampler = make_sampler(temp=1.0, top_p=0.95, top_k=64, seed=seed)
        return [r.token for r in stream_generate(model, tok, ids, max_tokens=16, sampler=sampler, stop_tokens=())]

    assert run(1) == run(1)
    assert run(1) != run(2)

    def run_global(seed):
        mx.random.seed(seed)
        return generate(model, tok, ids, max_tokens=16, sampler=make_sampler(temp=1.0))

    assert run_global(5) == run_global(5)


def _same_caches(a: list, b: list) -> None:
    """Two cache lists hold the same positions and the same K/V rows for them."""
    assert cache_length(a) == cache_length(b)
    for x, y in zip(a, b, strict=True):
        if x is None:
            assert y is None
            continue
        if isinstance(x, RotatingKVCache):
            np.testing.assert_array_equal(np.array(x.positions), np.array(y.positions))
            held = np.array(x.positions) >= 0
        else:
            held = np.arange(x.keys.shape[2]) < x.offset
        for u, v in ((x.keys, y.keys), (x.values, y.values)):
            np.testing.assert_allclose(np.array(u)[:, :, held], np.array(v)[:, :, held], rtol=1e-5, atol=1e-5)


def test_stream_generate_decodes_through_the_compiled_step(dense, monkeypatch):
    """stream_generate (the CLI's path) decodes through one compiled step traced once, with or
    without a prompt_cache of the caller's; that cache then holds what eager decoding leaves in it
    (buffers handed back: same positions, same K/V), and the tokens are the eager ones."""
    gen = importlib.import_module("gemma4_mlx.generate")  # the package's `generate` is the function
    built = []

    class Recorded(gen.CompiledDecoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(gen, "CompiledDecoder", Recorded)
    model, tok = dense
    ids = prompt_ids(12)
    own = [r.token for r in stream_generate(model, tok, ids, max_tokens=50, stop_tokens=())]
    assert len(built) == 1 and built[0].traces == 1
    cache, eager_cache = make_cache(model.cfg), make_cache(model.cfg)
    given = [r.token for r in stream_generate(model, tok, ids, max_tokens=50, prompt_cache=cache, stop_tokens=())]
    assert len(built) == 2 and built[1].traces == 1
    eager = [r.token for r in stream_generate(model, tok, ids, max_tokens=50, prompt_cache=eager_cache,
                                              stop_tokens=(), compiled=False)]  # fmt: skip
    assert len(built) == 2 and own == given == eager
    assert cache_length(cache) == len(ids) + len(eager) - 1 > model.cfg.sliding_window + 32  # the ring wrapped
    _same_caches(cache, eager_cache)


def test_compiled_generation_continues_a_prompt_cache(dense):
    """A prompt_cache decoded through the compiled step, stopped early by the consumer (the
    generator closed) or run to its end, continues as one long generation does."""
    model, _ = dense
    ids = prompt_ids(20)
    whole = [t for t, _ in generate_step(ids, model, max_tokens=60)]
    cache, eager_cache = make_cache(model.cfg), make_cache(model.cfg)
    for n, (t, _) in enumerate(generate_step(ids, model, max_tokens=60, prompt_cache=cache)):
        if n == 29:
            break  # the generator, no longer referenced, is closed: the 30 yielded tokens are in the cache
    for n, (t, _) in enumerate(generate_step(ids, model, max_tokens=60, prompt_cache=eager_cache, compiled=False)):
        if n == 29:
            break
    _same_caches(cache, eager_cache)
    assert cache_length(cache) == len(ids) + 30
    rest = [t for t, _ in generate_step([whole[30]], model, max_tokens=29, prompt_cache=cache)]
    assert rest == whole[31:60]
    assert cache_length(cache) == len(ids) + 30 + 1 + 28  # run to its end: the last token is not fed back


def test_a_prompt_cache_is_held_until_its_generator_ends(dense, monkeypatch):
    """While a compiled generation holds a prompt_cache, using it raises (no silent continuation
    from nothing); closing the generator hands it back. stream_generate hands it back before its
    last item. A step that fails raises its own error and leaves the tokens decoded before it."""
    gen = importlib.import_module("gemma4_mlx.generate")
    model, tok = dense
    ids = prompt_ids(20)
    cache = make_cache(model.cfg)
    steps = generate_step(ids, model, max_tokens=10, prompt_cache=cache)
    for n, _ in enumerate(steps):
        if n == 3:
            break
    with pytest.raises(ValueError, match="close that generator"):
        cache_length(cache)
    with pytest.raises(ValueError, match="close that generator"):
        model(mx.array([ids[:2]]), cache)
    steps.close()
    assert cache_length(cache) == len(ids) + 4

    cache = make_cache(model.cfg)
    for r in stream_generate(model, tok, ids, max_tokens=6, prompt_cache=cache, stop_tokens=()):
        if r.finish_reason is not None:
            assert r.generation_tokens == 6 and cache_length(cache) == len(ids) + 5

    class Failing(gen.CompiledDecoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            step, calls = self._step, []

            def failing(*a):
                calls.append(1)
                if len(calls) == 4:
                    raise RuntimeError("boom")
                return step(*a)

            self._step = failing

    monkeypatch.setattr(gen, "CompiledDecoder", Failing)
    cache = make_cache(model.cfg)
    with pytest.raises(RuntimeError, match="boom"):
        list(generate_step(ids, model, max_tokens=10, prompt_cache=cache))
    assert cache_length(cache) == len(ids) + 3  # the three steps before the failing one


def test_stream_generate_fields(dense):
    model, tok = dense
    ids = prompt_ids(16)
    responses = list(stream_generate(model, tok, ids, max_tokens=12, logits_processors=make_logits_processors(
        logit_bias={i: -1e9 for i in tok.eos_ids})))
    assert len(responses) == 12
    assert [r.generation_tokens for r in responses] == list(range(1, 13))
    assert [r.finish_reason for r in responses] == [None] * 11 + ["length"]
    for r in responses:
        assert r.prompt_tokens == 16 and r.prompt_tps > 0 and r.peak_memory > 0
        assert isinstance(r.token, int) and r.logprobs.shape == (model.cfg.vocab_size,)
        assert abs(float(mx.logsumexp(r.logprobs).item())) < 1e-4
    assert responses[-1].generation_tps > 0
    text_prompt = list(stream_generate(model, tok, "Hello world", max_tokens=2))
    assert text_prompt[0].prompt_tokens == len(tok.encode("Hello world")) + 1  # <bos> added once


def test_streamed_text_equals_batch_decode(dense):
    model, tok = dense
    ids = prompt_ids(8)
    for split in (False, True):
        bias = {CHANNEL_OPEN: -1e9, CHANNEL_CLOSE: -1e9} if split else {}
        responses = list(stream_generate(model, tok, ids, max_tokens=40, split_thinking=split, stop_tokens=(),
                                         sampler=make_sampler(temp=1.5, seed=9),
                                         logits_processors=make_logits_processors(logit_bias=bias or None)))
        tokens = [r.token for r in responses]
        if responses[-1].finish_reason == "stop":
            tokens = tokens[:-1]
        assert "".join(r.text for r in responses) == tok.decode(tokens)
        assert len(tokens) > 5


def test_stops_at_turn_end_and_hides_the_thought_channel(dense, capsys):
    model, tok = dense
    ids = prompt_ids(6)
    script = [CHANNEL_OPEN, *tok.encode("thought\nLet me think: 2 + 2."), CHANNEL_CLOSE,
              *tok.encode("The answer is 4."), TURN_END, *tok.encode("never shown")]
    force = scripted(script, len(ids), model.cfg.vocab_size)
    responses = list(stream_generate(model, tok, ids, max_tokens=100, logits_processors=[force]))
    last = responses[-1]
    assert last.finish_reason == "stop" and last.token == TURN_END
    assert last.generation_tokens == script.index(TURN_END) + 1
    assert "".join(r.text for r in responses) == "The answer is 4."
    assert "".join(r.reasoning for r in responses) == "Let me think: 2 + 2."
    raw = list(stream_generate(model, tok, ids, max_tokens=100, logits_processors=[force], split_thinking=False))
    assert "".join(r.text for r in raw) == "<|channel>thought\nLet me think: 2 + 2.<channel|>The answer is 4."

    text = generate(model, tok, ids, max_tokens=100, logits_processors=[force], verbose=True)
    assert text == "The answer is 4."
    out = capsys.readouterr().out
    assert "[thinking]\nLet me think: 2 + 2.\n[/thinking]\nThe answer is 4." in out
    assert out.startswith("==========\n") and "\n==========\nPrompt: 6 tokens, " in out
    assert "never shown" not in out and "<turn|>" not in out
    assert "Generation: " in out and "Peak memory: " in out


def test_thinking_splitter_edge_cases(dense):
    _, tok = dense

    def split(ids):
        s = ThinkingSplitter(tok)
        parts = [s.add(t) for t in ids] + [s.flush()]
        return "".join(p[0] for p in parts), "".join(p[1] for p in parts)

    # no channel name line: the reasoning is kept whole
    assert split([CHANNEL_OPEN, *tok.encode("I am thinking hard\nyes"), CHANNEL_CLOSE, *tok.encode("ok")]) == \
        ("ok", "I am thinking hard\nyes")
    # an unclosed channel at the end of generation stays reasoning
    assert split([*tok.encode("A"), CHANNEL_OPEN, *tok.encode("thought\nhmm")]) == ("A", "hmm")
    # an empty thought channel (the template's thinking-off prefix, if the model repeats it)
    assert split([CHANNEL_OPEN, *tok.encode("thought\n"), CHANNEL_CLOSE, *tok.encode("Hi")]) == ("Hi", "")
    assert split([*tok.encode("plain text")]) == ("plain text", "")


def test_max_kv_size_finishes_with_length(dense):
    model, tok = dense
    ids = prompt_ids(20)
    no_stop = make_logits_processors(logit_bias={i: -1e9 for i in tok.eos_ids})
    responses = list(stream_generate(model, tok, ids, max_tokens=100, max_kv_size=24, logits_processors=no_stop))
    assert responses[-1].finish_reason == "length"
    assert responses[-1].generation_tokens == 5  # 4 free positions + the last token, never fed back
    steps = list(generate_step(ids, model, max_tokens=100, max_kv_size=24, logits_processors=no_stop))
    assert [t for t, _ in steps] == [r.token for r in responses]
    with pytest.raises(ValueError, match="does not fit"):
        list(generate_step(prompt_ids(30), model, max_tokens=5, max_kv_size=24))


def test_generate_step_continues_a_prompt_cache(dense):
    model, _ = dense
    ids = prompt_ids(18)
    whole = [t for t, _ in generate_step(ids, model, max_tokens=6)]
    cache = make_cache(model.cfg)
    for _ in generate_step(ids[:10], model, max_tokens=1, prompt_cache=cache):
        pass
    assert cache_length(cache) == 10
    assert [t for t, _ in generate_step(ids[10:], model, max_tokens=6, prompt_cache=cache)] == whole


def test_zero_max_tokens_yields_one_final_item(dense):
    model, tok = dense
    (r,) = list(stream_generate(model, tok, prompt_ids(4), max_tokens=0))
    assert r.finish_reason == "length" and r.token is None and r.text == "" and r.generation_tokens == 0


# ------------------------------------------------------------------------------------------ loading


def test_load_gguf_and_hf_dir_agree_with_generation_defaults(dense, dense_fixture):
    model, tok = dense
    hf_model, hf_tok = load(dense_fixture.hf_dir, dtype="float32", progress=False)
    ids = mx.array([prompt_ids(12)])
    assert np.array_equal(np.array(model(ids)), np.array(hf_model(ids)))
    assert tok.encode("Hello there") == hf_tok.encode("Hello there")
    expected = GenerationDefaults(temp=1.0, top_p=0.95, top_k=64, min_p=None)
    assert model.generation_defaults == expected
    assert hf_model.generation_defaults == expected
    bf16, _ = load(dense_fixture.hf_dir, dtype="bfloat16", progress=False)
    default, _ = load(dense_fixture.hf_dir, progress=False)
    from gemma4_mlx.generate import default_dtype

    assert default.model.norm.weight.dtype == default_dtype()
    assert bf16.model.norm.weight.dtype == mx.bfloat16


def test_load_errors_name_the_path_and_cause(tmp_path, fixture_gguf, dense_fixture):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(LoadError, match=f"{missing}: no such file or directory"):
        load(missing)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(dense_fixture.hf_dir / "config.json", no_weights)
    with pytest.raises(LoadError, match="config.json but no weights"):
        load(no_weights)
    no_tok = tmp_path / "no-tokenizer"
    no_tok.mkdir()
    for f in dense_fixture.hf_dir.glob("*"):
        if f.name != "tokenizer.json":
            shutil.copy(f, no_tok)
    with pytest.raises(LoadError, match="no tokenizer.json"):
        load(no_tok)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LoadError, match="no config.json"):
        load(empty)
    good = fixture_gguf("dense", "q8_0").read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good[: len(good) // 2])
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    for bad in (truncated, garbage, text):
        with pytest.raises(LoadError, match=str(bad)):
            load(bad, progress=False)
    with pytest.raises(LoadError, match="not in the local Hugging Face cache"):
        load("gemma4-mlx-tests-nonexistent-org/no-such-model")


def test_resolve_directory_with_one_gguf(tmp_path, fixture_gguf):
    (tmp_path / "m").mkdir()
    target = tmp_path / "m" / "model-Q8_0.gguf"
    shutil.copy(fixture_gguf("dense", "q8_0"), target)
    assert resolve_model_path(tmp_path / "m") == ("gguf", target)
    shutil.copy(fixture_gguf("dense", "q4_0"), tmp_path / "m" / "model-Q4_0.gguf")
    with pytest.raises(LoadError, match="several GGUF files"):
        resolve_model_path(tmp_path / "m")


# ------------------------------------------------------------------------------------------ demo


def test_demo_model_loads_and_is_discriminative(demo_cache, monkeypatch):
    monkeypatch.setenv("GEMMA4_MLX_CACHE", str(demo_cache))
    kind, path = resolve_model_path("demo")
    assert kind == "gguf" and path.parent == demo_cache and path.name.startswith("demo-")
    model, tok = load("demo", dtype="float32", progress=False)
    cfg = model.cfg
    assert cfg.vocab_size == tok.vocab_size == demo.DEMO_VOCAB_SIZE
    assert [s.type for s in cfg.layers].count("full_attention") == 2 and cfg.sliding_window == 32
    assert all(s.k_eq_v for s in cfg.layers if not s.is_sliding)
    assert model.generation_defaults == GenerationDefaults(temp=1.0, top_p=0.95, top_k=64)
    ids = probe_ids(48, vocab=tok.vocab_size)
    std, top1 = discriminativeness(np.array(model(mx.array(ids))))
    assert std > 2.0 and top1 > 0.2, (std, top1)
    greedy = [t for t, _ in generate_step(tok.apply_chat_template([{"role": "user", "content": "Hello"}]), model,
                                          max_tokens=24)]
    assert len(set(greedy)) > 8  # varied text, not one repeated token


def test_demo_build_is_deterministic(tmp_path, demo_cache):
    a = demo.build_demo_gguf(tmp_path / "a.gguf")
    digest = hashlib.sha256(a.read_bytes()).hexdigest()
    (cached,) = demo_cache.glob("demo-*.gguf")
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == digest
    assert [p.name for p in tmp_path.iterdir()] == ["a.gguf"]  # the temporary file was renamed
