"""LayerGroup: which layers of a hybrid model share block ids, a window, or a recurrent state
(pure validation; the cache side lives in `pagedkv.groups` and `pagedkv.cache.hybrid_cache`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .validate import positive_int

GROUP_KINDS = ("full", "sliding", "state")
"""The kinds of layer group: full attention, sliding-window attention, recurrent state."""

MAX_STATE_BYTES = 2**31 - 1
"""The most bytes one layer's state slot may take."""


def _state_specs(state: object, where: str) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
    """`state` as ((shape, dtype), ...), each shape a tuple of positive ints and each dtype one
    numpy accepts; ValueError naming the bad entry."""
    if isinstance(state, (str, bytes)) or not hasattr(state, "__iter__"):
        raise ValueError(f"{where}: state must be a sequence of (shape, dtype) pairs, got {state!r:.80}")
    specs = []
    for i, item in enumerate(state):
        try:
            shape, dtype = item
        except (TypeError, ValueError):
            raise ValueError(f"{where}: state[{i}] must be a (shape, dtype) pair, got {item!r:.80}") from None
        if isinstance(shape, int):
            shape = (shape,)
        if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
            raise ValueError(f"{where}: state[{i}] shape must be a tuple of ints, got {shape!r:.80}")
        dims = tuple(positive_int(d, f"{where}: state[{i}] shape entry") for d in shape)
        if not dims:
            raise ValueError(f"{where}: state[{i}] shape is empty")
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise ValueError(f"{where}: state[{i}] dtype {dtype!r:.60} is not a numpy dtype") from None
        if dt.itemsize == 0 or dt.hasobject:
            raise ValueError(f"{where}: state[{i}] dtype {dt} has no fixed size")
        specs.append((dims, dt))
    if not specs:
        raise ValueError(f"{where}: a state group needs at least one (shape, dtype) tensor in state")
    return tuple(specs)


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share one kind of per-sequence memory.

    `kind` is "full" (every token's K/V kept), "sliding" (only the blocks that intersect a
    sequence's last `window` tokens are held) or "state" (one fixed-size recurrent state slot
    per sequence and layer, its tensors `state`: `(shape, dtype)` pairs, any dtype numpy
    accepts, ml_dtypes' bfloat16 included). `block_size` (attention groups only) defaults to
    the config's. `checkpoint_every` (state groups only), in tokens, asks for a state
    checkpoint at every multiple of it (it must be a multiple of the config's match unit, see
    `KvCacheConfig`). Checked at construction: ValueError naming the field and value."""

    kind: str
    layers: tuple
    window: int | None = None
    block_size: int | None = None
    state: tuple = ()
    checkpoint_every: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"LayerGroup kind must be one of {GROUP_KINDS}, got {self.kind!r}")
        where = f"LayerGroup({self.kind!r})"
        if isinstance(self.layers, (str, bytes)) or not hasattr(self.layers, "__iter__"):
            raise ValueError(f"{where}: layers must be a sequence of layer indices, got {self.layers!r:.80}")
        layers = tuple(self.layers)
        for layer in layers:
            if type(layer) is not int and not isinstance(layer, np.integer) or int(layer) < 0:
                raise ValueError(f"{where}: layers holds {layer!r}, not a layer index (an int >= 0)")
        layers = tuple(int(x) for x in layers)
        if not layers:
            raise ValueError(f"{where}: layers is empty")
        if len(set(layers)) != len(layers):
            dup = next(x for x in layers if layers.count(x) > 1)
            raise ValueError(f"{where}: layer {dup} is listed twice")
        object.__setattr__(self, "layers", layers)
        attention = self.kind != "state"
        if self.kind == "sliding":
            if self.window is None:
                raise ValueError(f"{where}: a sliding group needs window (in tokens)")
            object.__setattr__(self, "window", positive_int(self.window, f"{where}: window"))
        elif self.window is not None:
            raise ValueError(f"{where}: window is only for sliding groups, got {self.window!r}")
        if self.block_size is not None:
            if not attention:
                raise ValueError(f"{where}: block_size is only for attention groups, got {self.block_size!r}")
            object.__setattr__(self, "block_size", positive_int(self.block_size, f"{where}: block_size"))
        if attention:
            if tuple(self.state):
                raise ValueError(f"{where}: state is only for state groups")
            if self.checkpoint_every is not None:
                raise ValueError(f"{where}: checkpoint_every is only for state groups")
            object.__setattr__(self, "state", ())
            return
        specs = _state_specs(self.state, where)
        if self.slot_bytes_of(specs) > MAX_STATE_BYTES:
            raise ValueError(f"{where}: one layer's state is {self.slot_bytes_of(specs)} bytes, past {MAX_STATE_BYTES}")
        object.__setattr__(self, "state", specs)
        if self.checkpoint_every is not None:
            object.__setattr__(
                self, "checkpoint_every", positive_int(self.checkpoint_every, f"{where}: checkpoint_every")
            )

    @staticmethod
    def slot_bytes_of(specs) -> int:
        """Bytes of one layer's state: the sum of its tensors' sizes."""
        return sum(int(np.prod(shape)) * dt.itemsize for shape, dt in specs)

    def is_attention(self) -> bool:
        """True for "full" and "sliding" groups (they hold K/V blocks)."""
        return self.kind != "state"

    def state_bytes_per_layer(self) -> int:
        """Bytes of one sequence's state in one layer of a state group (0 for attention)."""
        return self.slot_bytes_of(self.state) if self.kind == "state" else 0


def check_layer_groups(groups: tuple, num_layers: int, block_size: int, blocks_per_seq: int | None) -> tuple:
    """`groups` checked against a config: every layer in exactly one group, at least one
    attention group, attention block sizes each dividing the largest, checkpoint_every a
    multiple of the largest attention block size, no `cache_blocks_per_seq` beside them.
    Returns the tuple; ValueError naming the problem otherwise."""
    groups = tuple(groups)
    if not groups:
        return ()
    for i, group in enumerate(groups):
        if not isinstance(group, LayerGroup):
            raise ValueError(f"layer_groups[{i}] must be a LayerGroup, got {type(group).__name__}")
    if blocks_per_seq is not None:
        raise ValueError("cache_blocks_per_seq and layer_groups cannot be combined: give the window to a sliding group")
    owner: dict[int, int] = {}
    for g, group in enumerate(groups):
        for layer in group.layers:
            if layer >= num_layers:
                raise ValueError(f"layer_groups[{g}] names layer {layer} but num_layers is {num_layers}")
            if layer in owner:
                raise ValueError(f"layer {layer} is in layer_groups[{owner[layer]}] and layer_groups[{g}]")
            owner[layer] = g
    missing = [layer for layer in range(num_layers) if layer not in owner]
    if missing:
        raise ValueError(f"layer {missing[0]} is in no layer group ({len(missing)} layer(s) missing)")
    sizes = [g.block_size or block_size for g in groups if g.is_attention()]
    if not sizes:
        raise ValueError("layer_groups needs at least one attention group (full or sliding)")
    unit = max(sizes)
    for g, group in enumerate(groups):
        if group.is_attention() and unit % (group.block_size or block_size):
            raise ValueError(
                f"layer_groups[{g}] block_size {group.block_size or block_size} does not divide the largest "
                f"attention block size {unit}"
            )
        if group.checkpoint_every is not None and group.checkpoint_every % unit:
            raise ValueError(
                f"layer_groups[{g}] checkpoint_every is {group.checkpoint_every}, not a multiple of the "
                f"match unit {unit} (the largest attention block size)"
            )
    return groups


def match_unit(groups: tuple, block_size: int) -> int:
    """Tokens between two positions a hybrid prefix match may end at: the largest attention
    block size (every attention group's blocks end there)."""
    return max(g.block_size or block_size for g in groups if g.is_attention())
