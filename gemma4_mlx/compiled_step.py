"""The decode step compiled once and replayed per token.

After prefill, the caches are copied into fixed-shape buffers (cache.make_static) whose lengths are
int32 arrays; one token's forward is then a pure function of (token, cache buffers) with constant
shapes, so `mx.compile` traces it once per cache capacity. The old buffers are dropped before the
step is evaluated, so MLX can update them in place (donation) instead of copying the whole cache.
"""

from __future__ import annotations

import mlx.core as mx

from custom_kernels import use_kernel

from .cache import StepPosition, cache_length, make_static, value_rows


def _flatten(caches: list) -> list[mx.array]:
    """[the caches' shared position, then each cache's buffers (K and V, or its one K|V buffer)]."""
    live = [c for c in caches if c is not None]
    return [live[0].step.offset, *(a for c in live for a in c.state)]


def _rebuild(kinds: list, arrays: list[mx.array]) -> list:
    """kinds: per layer None or (cache class, one_buffer)."""
    step = StepPosition(arrays[0])
    buffers = iter(arrays[1:])
    return [None if kind is None else kind[0](next(buffers), None if kind[1] else next(buffers), step)
            for kind in kinds]  # fmt: skip


class CompiledDecoder:
    """Decode one token at a time through a compiled step over fixed-shape caches.

    model: gemma4_mlx.model.Model; cache: prefilled caches from cache.make_cache; capacity: slots
    for full-attention layers (>= the final length; a step past it raises ValueError).
    `decoder(token int32 [1, 1]) -> logits fp32 [1, V]`. On the CPU with the native matvec
    (model.native_head_ready()) the step compiles the body only and the head runs after it.
    one_buffer: K and V of each cache in one buffer (cache.make_static); default
    `use_kernel("kv_one_write")`.
    """

    def __init__(self, model, cache: list, capacity: int, one_buffer: bool | None = None):
        self.model = model
        self.one_buffer = use_kernel("kv_one_write") if one_buffer is None else one_buffer
        static = make_static(cache, capacity, self.one_buffer)
        # keep only the cache kinds: holding the first buffers would keep a second copy alive
        self.kinds = [None if c is None else (type(c), c.one_buffer) for c in static]
        self.state = _flatten(static)
        del static
        mx.eval(self.state)
        self.capacity = capacity
        self.length = cache_length(cache)  # positions held, tracked on the host (no sync per step)

        kinds = self.kinds
        traces = self._traces = [0]
        # CPU with the native matvec: the head is a call outside MLX's graph, so the compiled step
        # stops at the final-normed hidden state and the head runs after it (GPU: all compiled).
        self.head_outside = model.native_head_ready()
        head_inside = not self.head_outside

        def step(token, *state):  # refers to no `self`: no reference cycle keeps the buffers alive
            traces[0] += 1  # the Python body runs only when MLX traces the step
            caches = _rebuild(kinds, list(state))
            h = model.model(token, caches)[:, -1, :]
            return (model.logits(h) if head_inside else h, *_flatten(caches))

        self._step = mx.compile(step)

    @property
    def traces(self) -> int:
        """How often MLX traced the step (1 for a whole generation)."""
        return self._traces[0]

    def hand_back(self, cache: list) -> None:
        """Give the decoded positions back to `cache`, the caches this decoder was made from (emptied
        by cache.detach or not): each takes the decoder's buffers (one K|V buffer as two views) and
        its length. The decoder cannot step after this."""
        if self.state is None:
            raise ValueError("this decoder's buffers are gone (handed back, or a step failed)")
        if len(cache) != len(self.kinds) or any((k is None) != (c is None) for k, c in zip(self.kinds, cache)):
            raise ValueError("hand_back takes the caches the decoder was made from")
        buffers = iter(self.state[1:])
        for kind, c in zip(self.kinds, cache):
            if c is None:
                continue
            keys = next(buffers)
            if kind[1]:  # one K|V buffer: K's rows, then V's
                keys, values = keys[: keys.shape[0] // 2], value_rows(keys)
            else:
                values = next(buffers)
            c.restore(keys, values, self.length)
        self.state = None

    def __call__(self, token: mx.array) -> mx.array:
        if self.length + token.shape[-1] > self.capacity:
            # a write past the buffer end (a scatter index) is not checked by MLX: never let it happen
            raise ValueError(f"the compiled decode step is full ({self.capacity} positions)")
        state, self.state = self.state, None
        try:
            out, *new_state = self._step(token, *state)
        except BaseException:  # nothing was evaluated: the buffers are still this decoder's
            self.state = state
            raise
        del state  # the step's graph holds the only references: MLX may update the buffers in place
        self.state = new_state
        self.length += token.shape[-1]
        return self.model.logits(out) if self.head_outside else out
