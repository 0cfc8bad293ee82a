"""KV caches for Gemma 4: a growable (or preallocated) cache for full-attention layers, a ring for
sliding-window layers, and `make_cache` that gives one cache per layer that owns K/V (KV-shared
consumer layers read their producer's K/V within the same forward step and own no cache).

Every cache stores K/V after norm/RoPE as [B, n_kv_heads, capacity, head_dim] plus the absolute
position held by each slot (-1 for an empty slot), so masks are built from positions, never from
slot indices, and a ring may hold its slots in any order. A compiled step's static caches may hold
K and V in one buffer [2B, n_kv_heads, capacity, head_dim], K's rows first (`make_static`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .config import ModelConfig


class _Holdable:
    """What both dynamic caches share: `held`, None while the cache is usable, else why it is not
    (its buffers are inside a compiled decode: `detach`); every use then raises that reason."""

    held: str | None = None

    def _usable(self) -> None:
        if self.held is not None:
            raise ValueError(f"this KV cache {self.held}")


class KVCache(_Holdable):
    """Full-attention cache: slots 0..offset-1 hold positions 0..offset-1.

    Grows in `step`-sized chunks, or is preallocated to `max_size` positions (then writing past it
    raises)."""

    def __init__(self, step: int = 256, max_size: int | None = None):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.step = step
        self.max_size = max_size

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def query_positions(self, t: int) -> mx.array:
        """int32 [t]: the positions of the next t tokens (before their update)."""
        self._usable()
        return self.offset + mx.arange(t, dtype=mx.int32)

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        if self.max_size is not None and needed > self.max_size:
            raise ValueError(f"KV cache is full: {needed} positions needed, --max-kv-size is {self.max_size}")
        if needed <= self.capacity:
            return
        B, H, _, Dk = keys.shape
        Dv = values.shape[3]
        if self.max_size is not None:
            new_cap = self.max_size
        else:
            new_cap = ((needed + self.step - 1) // self.step) * self.step
        k = mx.zeros((B, H, new_cap, Dk), keys.dtype)
        v = mx.zeros((B, H, new_cap, Dv), values.dtype)
        if self.keys is not None:
            k[:, :, : self.offset] = self.keys[:, :, : self.offset]
            v[:, :, : self.offset] = self.values[:, :, : self.offset]
        self.keys, self.values = k, v

    def update(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Append keys/values [B, H, T, D]; return (K, V, positions) over all valid slots."""
        self._usable()
        T = keys.shape[2]
        start = self.offset
        self._grow(keys, values, start + T)
        self.keys[:, :, start : start + T] = keys
        self.values[:, :, start : start + T] = values
        self.offset = start + T
        return (self.keys[:, :, : self.offset], self.values[:, :, : self.offset],
                mx.arange(self.offset, dtype=mx.int32))

    def rollback(self, length: int) -> None:
        """Forget every position >= length."""
        self._usable()
        if not 0 <= length <= self.offset:
            raise ValueError(f"cannot roll back a cache of length {self.offset} to {length}")
        self.offset = length

    def restore(self, keys: mx.array, values: mx.array, length: int) -> None:
        """Hold keys / values [B, H, capacity >= length, D] whose slots 0..length-1 are positions
        0..length-1 (a compiled decoder's buffers, handed back)."""
        if not length <= keys.shape[2] <= (self.max_size or keys.shape[2]):
            raise ValueError(f"{keys.shape[2]} slots cannot hold {length} positions within max_size {self.max_size}")
        self.keys, self.values, self.offset, self.held = keys, values, length, None

    @property
    def state(self):
        self._usable()
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class RotatingKVCache(_Holdable):
    """Sliding-window cache: a ring of `window + slack` slots; slot of position p is p % capacity.

    A query at position q sees keys at q-window+1 .. q. The `slack` extra slots keep the tokens a
    `rollback` of up to `slack` positions needs (speculative decoding, prefix reuse)."""

    def __init__(self, window: int, slack: int = 32):
        self.window = window
        self.slack = slack
        self.capacity = window + slack
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.positions: mx.array | None = None  # [capacity] int32, -1 = empty
        self.offset = 0  # number of positions written so far (= next position)

    def query_positions(self, t: int) -> mx.array:
        """int32 [t]: the positions of the next t tokens (before their update)."""
        self._usable()
        return self.offset + mx.arange(t, dtype=mx.int32)

    def update(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Append keys/values [B, H, T, D] for positions offset..offset+T-1.

        Returns (K, V, positions) covering the ring before this write plus the new tokens, so a
        chunk of T > 1 tokens sees the whole window of every query in it."""
        self._usable()
        B, H, T, Dk = keys.shape
        Dv = values.shape[3]
        C = self.capacity
        if self.keys is None:
            self.keys = mx.zeros((B, H, C, Dk), keys.dtype)
            self.values = mx.zeros((B, H, C, Dv), values.dtype)
            self.positions = mx.full((C,), -1, mx.int32)
        new_pos = mx.arange(self.offset, self.offset + T, dtype=mx.int32)
        if T == 1:
            slot = self.offset % C
            self.keys[:, :, slot : slot + 1] = keys
            self.values[:, :, slot : slot + 1] = values
            self.positions[slot : slot + 1] = new_pos
            self.offset += 1
            return self.keys, self.values, self.positions
        # Before the ring has wrapped only slots 0..offset-1 hold tokens: attend over those alone
        # (a first prefill chunk then sees just its own keys, not C empty slots).
        held = min(self.offset, C)
        K = mx.concatenate([self.keys[:, :, :held], keys], axis=2)
        V = mx.concatenate([self.values[:, :, :held], values], axis=2)
        P = mx.concatenate([self.positions[:held], new_pos])
        keep = min(T, C)  # only the last C new tokens can stay in the ring
        slots = mx.array([(self.offset + T - keep + i) % C for i in range(keep)], dtype=mx.int32)
        self.keys[:, :, slots] = keys[:, :, T - keep :]
        self.values[:, :, slots] = values[:, :, T - keep :]
        self.positions[slots] = new_pos[T - keep :]
        self.offset += T
        return K, V, P

    def rollback(self, length: int) -> None:
        """Forget every position >= length; at most `slack` positions back."""
        self._usable()
        if not 0 <= length <= self.offset:
            raise ValueError(f"cannot roll back a cache of length {self.offset} to {length}")
        if self.offset - length > self.slack and self.offset > self.capacity:
            raise ValueError(f"sliding-window cache can roll back at most {self.slack} positions "
                             f"({self.offset} -> {length} requested)")
        if self.positions is not None:
            self.positions = mx.where(self.positions >= length, -1, self.positions)
        self.offset = length

    def restore(self, keys: mx.array, values: mx.array, length: int) -> None:
        """Hold a ring keys / values [B, H, capacity, D] after decoding from this cache's offset to
        `length` (a compiled decoder's ring, handed back): the slots written since hold the latest
        position p < length with p % capacity == s, the others keep the positions they had (-1
        where a rollback emptied them)."""
        if keys.shape[2] != self.capacity:
            raise ValueError(f"a ring of {self.capacity} slots cannot take {keys.shape[2]}")
        if length < self.offset:
            raise ValueError(f"a ring of {self.offset} positions cannot go back to {length} by a restore")
        latest = ring_latest(length - 1, self.capacity)
        before = self.positions if self.positions is not None else mx.full((self.capacity,), -1, mx.int32)
        self.positions = mx.where(latest >= self.offset, latest, before)
        self.keys, self.values, self.offset, self.held = keys, values, length, None

    @property
    def state(self):
        self._usable()
        return [] if self.keys is None else [self.keys, self.values, self.positions]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def make_cache(cfg: ModelConfig, max_kv_size: int | None = None, rollback_slack: int = 32) -> list:
    """One cache per layer: KVCache / RotatingKVCache for layers that own K/V, None for consumers."""
    caches = []
    for layer in cfg.layers:
        if layer.kv_shared:
            caches.append(None)
        elif layer.is_sliding:
            caches.append(RotatingKVCache(layer.sliding_window, rollback_slack))
        else:
            caches.append(KVCache(max_size=max_kv_size))
    return caches


DECODING = "is inside a compiled decode that has not ended: finish or close that generator first (gen.close())"


def detach(cache: list, reason: str = DECODING) -> None:
    """Drop every cache's K/V buffers (a compiled decoder holds copies of them, or the same arrays,
    which it can then update in place; CompiledDecoder.hand_back restores them) and mark the
    caches `held` for `reason` until then. A ring keeps its positions (restore needs them)."""
    for c in cache:
        if c is not None:
            c.keys = c.values = None
            c.held = reason


def cache_length(cache: list) -> int:
    """Number of positions held (all owning caches agree)."""
    first = next((c for c in cache if c is not None), None)
    if first is None:
        return 0
    first._usable()
    return first.offset


def rollback(cache: list, length: int) -> None:
    """Roll every cache of a model back to `length` positions."""
    for c in cache:
        if c is not None:
            c.rollback(length)


def value_rows(kv: mx.array) -> mx.array:
    """V [B, H, S, D] of a one-buffer cache kv [2B, H, S, D] (K's rows, then V's): a view of its
    last B rows (a slice, not an integer index: MLX 0.32 gathers, a copy, for `kv[1]`)."""
    return kv[kv.shape[0] // 2 :]


def write_slots(buffer: mx.array, update: mx.array, slots: mx.array) -> mx.array:
    """`buffer` [B, H, S, D] with `update` [B, H, T, D] written at slots (int32 [T]) of axis 2.

    A scatter, not a slice update with an array start: MLX 0.32's CUDA DynamicSliceUpdate sizes its
    copy grid by the whole destination, so each write cost ~38 us on a 31B cache buffer at 4K
    context, growing with the buffer (bench/gpu_timeline.py); the scatter's grid is the update's.
    Inside a compiled step the buffer is donated, so neither copies it."""
    return mx.put_along_axis(buffer, slots.reshape(1, 1, -1, 1), update, axis=2)


_IOTA: dict[int, mx.array] = {}


def ring_latest(last, capacity: int) -> mx.array:
    """int32 [capacity]: per slot s of a ring, the latest position p <= last (an int or int32
    scalar) with p % capacity == s; negative where there is none yet."""
    return last - (last - iota(capacity)) % capacity


def iota(n: int) -> mx.array:
    """int32 [n] = 0..n-1, made once per n from host memory: in a compiled decode step a constant,
    not an Arange node evaluated every step (every graph node costs host time per token)."""
    a = _IOTA.get(n)
    if a is None:
        a = _IOTA[n] = mx.array(np.arange(n, dtype=np.int32))
    return a


class StepPosition:
    """The positions every static cache of one decode step holds before it (all layers advance
    together), and what derives from it: computed once per step and shared by the layers instead
    of once per layer (~6 tiny kernels and ~10 graph nodes per layer otherwise)."""

    def __init__(self, offset: mx.array):
        self.offset = offset  # int32 scalar
        self._memo: dict = {}

    def _once(self, key, fn):
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    def slots(self, t: int) -> mx.array:
        """int32 [t]: the slots (= positions) of this step's t tokens in a full cache."""
        return self._once(("slots", t), lambda: self.offset + iota(t))

    def advanced(self, t: int) -> "StepPosition":
        """The next step's position (one object for every cache, so they keep sharing)."""
        return self._once(("advanced", t), lambda: StepPosition(self.offset + t))

    def valid(self, capacity: int) -> mx.array:
        """int32 [capacity]: slot s of a full cache holds position s if s < offset, else -1."""
        def compute():
            slots = iota(capacity)
            return mx.where(slots < self.offset, slots, -1)

        return self._once(("valid", capacity), compute)

    def ring(self, capacity: int) -> tuple[mx.array, mx.array]:
        """(slot int32 [1] this step's token goes to, positions int32 [capacity] after writing it)
        of a ring of `capacity` slots. Slot s holds the latest position p <= offset with
        p % capacity == s (-1 before the ring fills): computed, not stored. Slots a rollback emptied
        are given their previous lap's position, more than the window behind every later query
        (rollback is bounded by the slack), so the mask is unchanged."""

        def compute():
            latest = ring_latest(self.offset, capacity)
            return (self.offset % capacity).reshape(1), mx.where(latest >= 0, latest, -1)

        return self._once(("ring", capacity), compute)

    def filled(self, capacity: int) -> mx.array:
        """int32 [1]: slots of a `capacity`-slot ring holding a position, min(offset, capacity)
        (once per step, computed on the GPU: attention's valid-slot bound; with a constant the host
        wrote, the sliding kernels ran at half speed in some processes on the H200, bench/NOTES.md
        sessions 15-16)."""
        return self._once(("filled", capacity), lambda: mx.minimum(self.offset, capacity).reshape(1))


def _one_buffer_check(keys: mx.array, values: mx.array) -> None:
    if keys.shape != values.shape or keys.dtype != values.dtype:
        raise ValueError(f"one K|V buffer needs K and V alike, got {keys.shape} {keys.dtype} / "
                         f"{values.shape} {values.dtype}")  # fmt: skip


class _StaticWrites:
    """What the two static caches share: the buffers (``values`` None: ``keys`` is one K|V buffer
    [2B, H, S, D], K's rows then V's, written by one scatter from a stacked update) and the write."""

    def __init__(self, keys: mx.array, values: mx.array | None, step: StepPosition):
        self.keys, self.values, self.step = keys, values, step

    @property
    def one_buffer(self) -> bool:
        """True when K and V live in one buffer: `update` then takes (kv [2B, H, T, D], None)."""
        return self.values is None

    def _write(self, keys: mx.array, values: mx.array | None, at: mx.array) -> tuple[mx.array, mx.array]:
        """Write this step's rows at slots `at`; -> the (K, V) attention reads: with one buffer the
        whole buffer as K (attention reads its first B rows) and a view of its V rows."""
        rows = self.keys.shape[0]
        if self.one_buffer != (values is None) or keys.shape[0] != rows or (values is not None and values.shape[0] != rows):
            raise ValueError(f"a one-buffer cache takes (kv [{rows}, ...], None), a two-buffer cache (keys, values) "
                             f"of {rows} rows each; got {keys.shape} / {None if values is None else values.shape}")  # fmt: skip
        self.keys = write_slots(self.keys, keys, at)
        if self.one_buffer:
            return self.keys, value_rows(self.keys)
        self.values = write_slots(self.values, values, at)
        return self.keys, self.values

    @property
    def state(self):
        return [self.keys] if self.one_buffer else [self.keys, self.values]


class StaticKVCache(_StaticWrites):
    """Full-attention cache of fixed capacity for a compiled decode step: its length is a shared
    StepPosition and every update writes slots at that array offset (write_slots), so shapes
    never change."""

    @classmethod
    def from_cache(cls, cache: KVCache, capacity: int, step: StepPosition | None = None,
                   one_buffer: bool = False) -> "StaticKVCache":  # fmt: skip
        if cache.keys is None:
            raise ValueError("prefill the cache before making it static")
        n = cache.offset
        keys, values = cache.keys[:, :, :n], cache.values[:, :, :n]

        def padded(*held: mx.array) -> mx.array:  # held [B, H, n, D] each -> their rows in [*, H, capacity, D]
            B, H, _, D = held[0].shape
            buffer = mx.zeros((len(held) * B, H, capacity, D), held[0].dtype)
            for i, a in enumerate(held):
                buffer[i * B : (i + 1) * B, :, :n] = a
            return buffer

        if one_buffer:
            _one_buffer_check(keys, values)
            keys, values = padded(keys, values), None
        else:
            keys, values = padded(keys), padded(values)
        return cls(keys, values, step or StepPosition(mx.array(n, dtype=mx.int32)))

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def offset(self) -> mx.array:
        """int32 scalar: positions held (before an update: the step's first position)."""
        return self.step.offset

    def query_positions(self, t: int) -> mx.array:
        """int32 [t]: the step's t positions, shared by every static cache of the step (constants
        off the step position: no arange node per step)."""
        return self.step.slots(t)

    def update(self, keys: mx.array, values: mx.array | None) -> tuple[mx.array, mx.array, mx.array]:
        """Write keys / values [B, H, T, D] (one buffer: (kv [2B, H, T, D], None)) at the step's
        slots -> (K, V, positions) for attention (one buffer: K the whole buffer, V a view)."""
        T = keys.shape[2]
        K, V = self._write(keys, values, self.step.slots(T))
        self.step = self.step.advanced(T)
        return K, V, self.step.valid(self.capacity)

    @property
    def valid_slots(self) -> mx.array:
        """int32 scalar: slots holding a position (after an update: the ones attention may read)."""
        return self.step.offset


class StaticRotatingKVCache(_StaticWrites):
    """A RotatingKVCache ring for a compiled decode step (one token per update), its write
    position a shared StepPosition."""

    def __init__(self, keys: mx.array, values: mx.array | None, step: StepPosition):
        super().__init__(keys, values, step)
        self.positions = None  # int32 [capacity] after an update

    @classmethod
    def from_cache(cls, cache: RotatingKVCache, step: StepPosition | None = None,
                   one_buffer: bool = False) -> "StaticRotatingKVCache":  # fmt: skip
        if cache.keys is None:
            raise ValueError("prefill the cache before making it static")
        keys, values = cache.keys, cache.values
        if one_buffer:  # [2B, H, C, D]: K's rows, then V's
            _one_buffer_check(keys, values)
            keys, values = mx.concatenate([keys, values]), None
        return cls(keys, values, step or StepPosition(mx.array(cache.offset, dtype=mx.int32)))

    @property
    def offset(self) -> mx.array:
        return self.step.offset

    def query_positions(self, t: int) -> mx.array:
        """int32 [t]: the step's t positions (see StaticKVCache.query_positions)."""
        return self.step.slots(t)

    def update(self, keys: mx.array, values: mx.array | None) -> tuple[mx.array, mx.array, mx.array]:
        """One token's rows, as StaticKVCache.update, at the ring slot of the step's position."""
        if keys.shape[2] != 1:
            raise ValueError("a static ring cache takes one token per step")
        slot, self.positions = self.step.ring(self.keys.shape[2])
        K, V = self._write(keys, values, slot)
        self.step = self.step.advanced(1)
        return K, V, self.positions

    @property
    def valid_slots(self) -> mx.array:
        """int32 [1]: slots holding a position (after an update: the ones attention may read)."""
        return self.step.filled(self.keys.shape[2])


def make_static(cache: list, capacity: int, one_buffer: bool = False) -> list:
    """Fixed-shape copies of prefilled caches sharing one StepPosition: full layers get `capacity`
    slots; with ``one_buffer`` each holds K and V in one buffer (see _StaticWrites). Every cache
    must hold the same number of positions (as after any forward pass)."""
    lengths = {c.offset for c in cache if c is not None}
    if len(lengths) != 1:
        raise ValueError(f"caches hold different numbers of positions {sorted(lengths)}; a decode step "
                         "advances them together")  # fmt: skip
    step = StepPosition(mx.array(lengths.pop(), dtype=mx.int32))
    out = []
    for c in cache:
        if c is None:
            out.append(None)
        elif isinstance(c, RotatingKVCache):
            out.append(StaticRotatingKVCache.from_cache(c, step, one_buffer))
        else:
            out.append(StaticKVCache.from_cache(c, capacity, step, one_buffer))
    return out
