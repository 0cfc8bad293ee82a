"""The compiled fixed-shape decode step: same logits as eager decoding, one trace, no cache copies."""

import mlx.core as mx
import numpy as np
import pytest

from fixtures import probe_ids
from gemma4_mlx.cache import make_cache
from gemma4_mlx.checkpoint import load_hf
from gemma4_mlx.compiled_step import CompiledDecoder


def test_compiled_decode_equals_eager_decode(any_fixture):
    model = load_hf(any_fixture.hf_dir, dtype=mx.float32, progress=False)
    ids = probe_ids(110, seed=21, vocab=model.cfg.vocab_size)[0]
    cache = make_cache(model.cfg)
    model(mx.array(ids[None, :10]), cache)
    eager = [np.array(model(mx.array(ids[None, t : t + 1]), cache)[:, -1]) for t in range(10, 110)]
    cache = make_cache(model.cfg)
    model(mx.array(ids[None, :10]), cache)
    decoder = CompiledDecoder(model, cache, capacity=128)
    compiled = [np.array(decoder(mx.array(ids[None, t : t + 1]))) for t in range(10, 110)]
    assert decoder.length == 110  # the sliding ring (window 16 + slack 32) wrapped twice
    a, b = np.concatenate(eager), np.concatenate(compiled)
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()


def test_step_past_capacity_raises(dense_fixture):
    import pytest

    model = load_hf(dense_fixture.hf_dir, dtype=mx.float32, progress=False)
    cache = make_cache(model.cfg)
    model(mx.array([[2, 300, 301]]), cache)
    decoder = CompiledDecoder(model, cache, capacity=5)
    decoder(mx.array([[302]]))
    decoder(mx.array([[303]]))
    with pytest.raises(ValueError, match="full"):
        decoder(mx.array([[304]]))


@pytest.mark.parametrize("one_buffer", [False, True], ids=["kv_two_buffers", "kv_one_buffer"])
def test_one_trace_and_no_cache_copies(dense_fixture, one_buffer):
    model = load_hf(dense_fixture.hf_dir, dtype=mx.float32, progress=False)
    ids = probe_ids(40, seed=22, vocab=model.cfg.vocab_size)[0]
    cache = make_cache(model.cfg)
    model(mx.array(ids[None, :8]), cache)
    capacity = 1 << 15
    decoder = CompiledDecoder(model, cache, capacity=capacity, one_buffer=one_buffer)
    for t in range(8, 12):
        mx.eval(decoder(mx.array(ids[None, t : t + 1])))
    # a full-attention layer's K (or V) buffer: half of a one K|V buffer
    buffer_bytes = max(a.nbytes for a in decoder.state) // (2 if one_buffer else 1)
    assert buffer_bytes >= 8 << 20
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for t in range(12, 40):
        mx.eval(decoder(mx.array(ids[None, t : t + 1])))
    grew = mx.get_peak_memory() - base
    # a step that copied one full-layer K or V buffer would add at least its size to the peak
    assert grew < buffer_bytes // 2, f"peak grew by {grew} bytes; one cache buffer is {buffer_bytes}"
    # and no stray reference keeps a second set of cache buffers alive between steps
    from mlx.utils import tree_flatten

    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    state = sum(a.nbytes for a in decoder.state)
    extra = mx.get_active_memory() - weights - state
    assert extra < buffer_bytes // 2, f"{extra} bytes alive beyond weights and one set of cache buffers"
    assert decoder.traces == 1


def test_gpu_attention_path_matches(any_fixture, monkeypatch):
    """The model's GPU decode path (custom_kernels.attention.decode_attention over whole cache
    buffers, here through its reference) gives the logits of the SDPA path, eager and compiled."""
    import gemma4_mlx.model as model_module

    model = load_hf(any_fixture.hf_dir, dtype=mx.float32, progress=False)
    ids = probe_ids(70, seed=23, vocab=model.cfg.vocab_size)[0]

    def run():
        cache = make_cache(model.cfg)
        model(mx.array(ids[None, :10]), cache)
        eager = [np.array(model(mx.array(ids[None, t : t + 1]), cache)[:, -1]) for t in range(10, 40)]
        decoder = CompiledDecoder(model, cache, capacity=72)
        compiled = [np.array(decoder(mx.array(ids[None, t : t + 1]))) for t in range(40, 70)]
        return np.concatenate(eager + compiled)

    sdpa = run()
    monkeypatch.setattr(model_module, "use_kernel", lambda family: family == "attention")
    kernel_path = run()
    assert np.abs(kernel_path - sdpa).max() <= 1e-5 * np.abs(sdpa).max()


@pytest.mark.parametrize("attention_kernel", [False, True], ids=["sdpa", "decode_attention"])
def test_one_buffer_caches_decode_the_same_bits(any_fixture, monkeypatch, attention_kernel):
    """K and V in one buffer per cache (one scatter a layer; attention reads the buffer's first B
    rows as K and a view of the rest as V): the compiled step's logits are bit-identical to two
    buffers', through the SDPA path and through decode_attention (its reference on CPU), and each
    owning cache keeps one buffer instead of two."""
    import gemma4_mlx.model as model_module

    if attention_kernel:
        monkeypatch.setattr(model_module, "use_kernel", lambda family: family == "attention")
    model = load_hf(any_fixture.hf_dir, dtype=mx.float32, progress=False)
    ids = probe_ids(80, seed=24, vocab=model.cfg.vocab_size)[0]

    def run(one_buffer):
        cache = make_cache(model.cfg)
        model(mx.array(ids[None, :10]), cache)
        decoder = CompiledDecoder(model, cache, capacity=96, one_buffer=one_buffer)
        logits = [np.array(decoder(mx.array(ids[None, t : t + 1]))) for t in range(10, 80)]
        return np.concatenate(logits), decoder.state

    (two, two_state), (one, one_state) = run(False), run(True)
    assert np.array_equal(one, two)
    owners = sum(1 for c in make_cache(model.cfg) if c is not None)
    assert (len(two_state), len(one_state)) == (1 + 2 * owners, 1 + owners)
    assert sum(a.nbytes for a in one_state) == sum(a.nbytes for a in two_state)


def test_one_buffer_caches_through_fused_projections(any_fixture, monkeypatch):
    """The same with the GPU weight format (q8_0 blocks: q|k|v one fused projection), where the
    heads come from norm_rope's stacked form (its reference on CPU) instead of MLX's split heads."""
    import gemma4_mlx.model as model_module
    from gemma4_mlx.checkpoint import load_gguf

    monkeypatch.setattr(model_module, "use_kernel", lambda family: family in ("norm_rope", "attention"))
    model, _ = load_gguf(any_fixture.gguf("q8_0"), dtype=mx.float32, progress=False, weight_format="blocks")
    stacked = []
    real_norm_rope = model_module.norm_rope
    monkeypatch.setattr(model_module, "norm_rope", lambda *a, **kw: stacked.append(kw["stacked"]) or real_norm_rope(*a, **kw))
    ids = probe_ids(40, seed=25, vocab=model.cfg.vocab_size)[0]

    def run(one_buffer):
        cache = make_cache(model.cfg)
        model(mx.array(ids[None, :8]), cache)
        decoder = CompiledDecoder(model, cache, capacity=64, one_buffer=one_buffer)
        return np.concatenate([np.array(decoder(mx.array(ids[None, t : t + 1]))) for t in range(8, 40)])

    two = run(False)
    assert stacked and not any(stacked)  # norm_rope ran (prefill's 8 tokens and each step), unstacked
    stacked.clear()
    one = run(True)
    assert True in stacked, "the stacked norm_rope branch did not run"  # the steps' (prefill: unstacked)
    assert np.array_equal(one, two)


def test_one_buffer_cache_takes_stacked_rows_only():
    """A one-buffer static cache refuses (keys, values) and K's rows alone, a two-buffer one (kv,
    None): a model path that handed the wrong form would otherwise write K rows into V's half."""
    from gemma4_mlx.cache import KVCache, make_static

    full = KVCache()
    full.update(mx.zeros((1, 2, 3, 4)), mx.ones((1, 2, 3, 4)))
    (one,) = make_static([full], capacity=8, one_buffer=True)
    assert one.one_buffer and one.keys.shape == (2, 2, 8, 4)
    assert np.array_equal(np.array(one.keys[1, :, :3]), np.ones((2, 3, 4)))  # V's rows after K's
    with pytest.raises(ValueError, match="one-buffer"):
        one.update(mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)))
    (two,) = make_static([full], capacity=8)
    with pytest.raises(ValueError, match="one-buffer"):
        two.update(mx.zeros((2, 2, 1, 4)), None)
    with pytest.raises(ValueError, match="one-buffer"):  # K's rows alone would broadcast into V's half
        one.update(mx.zeros((1, 2, 1, 4)), None)
    keys, values, _ = one.update(mx.concatenate([mx.full((1, 2, 1, 4), 5.0), mx.full((1, 2, 1, 4), 7.0)]), None)
    assert keys.shape == (2, 2, 8, 4) and values.shape == (1, 2, 8, 4)
    assert np.array(values)[0, :, 3].tolist() == [[7.0] * 4] * 2 and np.array(keys)[0, :, 3].tolist() == [[5.0] * 4] * 2


def test_one_buffer_layout_with_two_sequences():
    """B = 2: a one-buffer full cache and ring hold K's two rows, then V's; attention's K, V after
    an update equal the two-buffer caches' (K's first B rows, V's view)."""
    from gemma4_mlx.cache import KVCache, RotatingKVCache, make_static

    rng = np.random.default_rng(6)

    def kv(t):
        return tuple(mx.array(rng.standard_normal((2, 3, t, 4)).astype(np.float32)) for _ in range(2))

    full, ring = KVCache(), RotatingKVCache(4, 2)
    for c, prompt in ((full, kv(5)), (ring, kv(5))):
        c.update(*prompt)
    ones, twos = make_static([full, ring], capacity=8, one_buffer=True), make_static([full, ring], capacity=8)
    for one, two in zip(ones, twos):
        assert one.keys.shape[0] == 4
        assert np.array_equal(np.array(one.keys[:2]), np.array(two.keys))
        assert np.array_equal(np.array(one.keys[2:]), np.array(two.values))
        k, v = kv(1)
        K1, V1, P1 = one.update(mx.concatenate([k, v]), None)
        K2, V2, P2 = two.update(k, v)
        assert np.array_equal(np.array(K1[:2]), np.array(K2)) and np.array_equal(np.array(V1), np.array(V2))
        assert np.array_equal(np.array(P1), np.array(P2))


def test_static_ring_positions_match_the_ring_including_after_rollback():
    """The static ring computes its slot positions instead of writing them: they equal the dynamic
    ring's wherever that holds a token inside the window, and after a rollback the slots it emptied
    are masked for every later query (claimed position more than a window behind)."""
    from gemma4_mlx.cache import RotatingKVCache, StaticRotatingKVCache

    window, slack = 16, 8
    rng = np.random.default_rng(3)

    def kv(t):
        return (mx.array(rng.standard_normal((1, 2, t, 4)).astype(np.float32)),) * 2

    for prefill, rollback_to in ((5, None), (30, None), (40, 33)):
        ring = RotatingKVCache(window, slack)
        ring.update(*kv(prefill))
        if rollback_to is not None:
            ring.rollback(rollback_to)
        static = StaticRotatingKVCache.from_cache(ring)
        for _ in range(2 * (window + slack)):
            q = ring.offset  # the query position of this step
            _, _, want = ring.update(*kv(1))
            _, _, got = static.update(*kv(1))
            want, got = np.array(want), np.array(got)
            visible = lambda p: (p >= 0) & (p <= q) & (q - p < window)  # noqa: E731
            assert np.array_equal(visible(want), visible(got)), (prefill, rollback_to, q)
            assert np.array_equal(want[visible(want)], got[visible(got)])
            # attention's valid-slot bound: every slot at or past it holds no position, so bounding
            # the kernels by it masks nothing the positions did not mask already
            bound = static.valid_slots
            assert bound.shape == (1,) and bound.item() == min(q + 1, window + slack)
            assert (got[bound.item():] == -1).all()


def test_static_caches_share_one_step_position():
    """make_static gives every cache one StepPosition: a step's derived positions are computed once
    (the same arrays for every layer of a kind) and all caches advance to one next position."""
    from gemma4_mlx.cache import KVCache, RotatingKVCache, StaticKVCache, StaticRotatingKVCache, make_static

    kv = (mx.zeros((1, 2, 5, 4)),) * 2
    rings, fulls = [RotatingKVCache(8, 4) for _ in range(2)], [KVCache() for _ in range(2)]
    for c in rings + fulls:
        c.update(*kv)
    static = make_static([rings[0], fulls[0], None, rings[1], fulls[1]], capacity=16)
    assert isinstance(static[0], StaticRotatingKVCache) and isinstance(static[1], StaticKVCache)
    step = static[0].step
    assert all(c.step is step for c in static if c is not None) and static[1].offset.item() == 5
    one = (mx.ones((1, 2, 1, 4)),) * 2
    out = [c.update(*one) for c in static if c is not None]
    assert out[0][2] is out[2][2] and out[1][2] is out[3][2]  # one positions array per kind
    assert all(c.step is static[0].step for c in static if c is not None) and static[0].step is not step
    assert static[1].offset.item() == 6 and np.array(out[1][2]).tolist()[:7] == [0, 1, 2, 3, 4, 5, -1]
    assert np.array(out[1][0])[0, 0, 5].tolist() == [1.0] * 4  # the token went to slot 5
    # every cache kind answers the next tokens' positions; the static ones share one array
    assert np.array(rings[0].query_positions(3)).tolist() == [5, 6, 7]
    assert np.array(fulls[0].query_positions(2)).tolist() == [5, 6]
    assert static[0].query_positions(1) is static[1].query_positions(1)
    assert np.array(static[1].query_positions(1)).tolist() == [6]
    fulls[1].update(*kv)
    with pytest.raises(ValueError, match="different numbers of positions"):
        make_static([fulls[0], fulls[1]], capacity=16)


def test_first_layer_full_attention_prefill_and_decode():
    """A model whose first layer is a full-attention one (its growing KVCache has an int `step`,
    its growth chunk, not a StepPosition): prefill, eager decode and the compiled step agree."""
    from gemma4_mlx.config import FULL, SLIDING, ModelConfig
    from gemma4_mlx.model import Model

    cfg = ModelConfig(hidden_size=64, num_hidden_layers=3, intermediate_size=128, num_attention_heads=2,
                      num_key_value_heads=1, layer_types=[FULL, SLIDING, FULL], vocab_size=64, head_dim=32,
                      global_head_dim=32, sliding_window=8, max_position_embeddings=256)  # fmt: skip
    mx.random.seed(0)
    model = Model(cfg)
    prompt = mx.array([[1, 5, 9, 2, 7, 3]], dtype=mx.int32)
    eager, compiled_cache = make_cache(cfg), make_cache(cfg)
    mx.eval(model(prompt, eager), model(prompt, compiled_cache))
    decoder = CompiledDecoder(model, compiled_cache, 64)
    token = mx.array([[4]], dtype=mx.int32)
    for _ in range(3):
        want = model(token, eager)[:, -1, :]
        got = decoder(token)
        assert np.allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
        token = mx.argmax(want, axis=-1).reshape(1, 1).astype(mx.int32)


@pytest.mark.parametrize("one_buffer", [False, True], ids=["kv_two_buffers", "kv_one_buffer"])
def test_hand_back_gives_the_caches_what_eager_decoding_leaves(dense_fixture, one_buffer):
    """CompiledDecoder.hand_back: the detached caches it was made from take its buffers (one K|V
    buffer as K and V views) and length; positions and K/V equal eager decoding's, the ring wrapped;
    the decoder then refuses to step or hand back again, and other caches are refused."""
    from gemma4_mlx.cache import RotatingKVCache, detach

    model = load_hf(dense_fixture.hf_dir, dtype=mx.float32, progress=False)
    ids = probe_ids(70, seed=23, vocab=model.cfg.vocab_size)[0]
    eager, cache = make_cache(model.cfg), make_cache(model.cfg)
    model(mx.array(ids[None, :10]), eager)
    model(mx.array(ids[None, :10]), cache)
    for t in range(10, 70):
        model(mx.array(ids[None, t : t + 1]), eager)
    decoder = CompiledDecoder(model, cache, capacity=256, one_buffer=one_buffer)
    detach(cache)
    for t in range(10, 70):
        decoder(mx.array(ids[None, t : t + 1]))
    with pytest.raises(ValueError, match="made from"):
        decoder.hand_back(make_cache(model.cfg)[:-1] + [None])
    decoder.hand_back(cache)
    for a, b in zip(cache, eager, strict=True):
        if isinstance(a, RotatingKVCache):
            np.testing.assert_array_equal(np.array(a.positions), np.array(b.positions))
            held = np.array(b.positions) >= 0
            assert held.all()  # 70 positions in a ring of 48 slots: every slot holds one
        else:
            held = np.arange(a.keys.shape[2]) < 70
        assert a.offset == b.offset == 70 and a.keys.shape[:2] == b.keys.shape[:2]
        for u, v in ((a.keys, b.keys), (a.values, b.values)):
            np.testing.assert_allclose(np.array(u)[:, :, held], np.array(v)[:, :, held], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="gone"):
        decoder.hand_back(cache)


def test_restore_checks_the_buffers():
    from gemma4_mlx.cache import KVCache, RotatingKVCache

    full, ring = KVCache(max_size=16), RotatingKVCache(window=4, slack=2)
    with pytest.raises(ValueError, match="max_size"):
        full.restore(mx.zeros((1, 1, 32, 2)), mx.zeros((1, 1, 32, 2)), 8)
    with pytest.raises(ValueError, match="cannot hold"):
        KVCache().restore(mx.zeros((1, 1, 4, 2)), mx.zeros((1, 1, 4, 2)), 8)
    with pytest.raises(ValueError, match="6 slots"):
        ring.restore(mx.zeros((1, 1, 8, 2)), mx.zeros((1, 1, 8, 2)), 3)
    ring.restore(mx.zeros((1, 1, 6, 2)), mx.zeros((1, 1, 6, 2)), 3)
    assert ring.positions.tolist() == [0, 1, 2, -1, -1, -1] and ring.offset == 3
    ring.restore(mx.zeros((1, 1, 6, 2)), mx.zeros((1, 1, 6, 2)), 8)
    assert ring.positions.tolist() == [6, 7, 2, 3, 4, 5]
    ring.rollback(6)  # slots of positions 6 and 7 emptied; a decode to 7 rewrites slot 0 only
    ring.restore(mx.zeros((1, 1, 6, 2)), mx.zeros((1, 1, 6, 2)), 7)
    assert ring.positions.tolist() == [6, -1, 2, 3, 4, 5] and ring.offset == 7
    with pytest.raises(ValueError, match="go back"):
        ring.restore(mx.zeros((1, 1, 6, 2)), mx.zeros((1, 1, 6, 2)), 5)
