"""Layer groups of a hybrid KV cache: which layers share a block table, and where they sit.

Layers are grouped by attention kind (their sliding window; 0 = full attention), and every group
has the same number G of layers, so a page (one block of B tokens in every layer of a group) has
the same size in every group and one pool of N page ids serves them all. The KV tensor is
[G, 2, N, B, H_kv, D]: layer l, at position p(l) of its group g(l), reads and writes kv[p(l)]
(exactly the [2, N, B, H_kv, D] view a layer had in a one-group pool) through group g's block
table. A page belongs to one group at a time, so the layers at position p of different groups
never touch the same memory. No kernel needs to know about groups.

G is the size of the smallest kind (Gemma 3 270M: 3 full + 15 sliding layers -> G = 3, one full
and five sliding groups). Fewer, larger groups mean fewer block tables to build per step; a kind
whose layer count G does not divide gets a last group with empty positions (padding, counted).
A model without sliding layers is one group of all its layers: the classic layout.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVGroupLayout:
    group_size: int  # G: layers per group (positions of the KV tensor's first dimension)
    group_windows: tuple[int, ...]  # per group: its sliding window in tokens, 0 = full
    layer_group: tuple[int, ...]  # per layer: its group
    layer_position: tuple[int, ...]  # per layer: its position inside the group
    num_layers: int

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def padding_slots(self) -> int:
        """Group positions with no layer: pool memory no layer uses."""
        return self.group_size * self.num_groups - self.num_layers

    @property
    def is_hybrid(self) -> bool:
        return self.num_groups > 1

    def group_layers(self, group: int) -> list[int]:
        return [layer for layer, g in enumerate(self.layer_group) if g == group]


def pages_for_tokens(group_windows: tuple[int, ...] | list[int], num_tokens: int,
                     block_size: int, chunk: int = 1) -> int:
    """Pages one sequence of num_tokens tokens holds at most, computing at most `chunk` tokens
    per step: every block in a full group; in a sliding group the blocks its window reads plus
    the chunk's (blocks are allocated for a chunk first and released at the next step)."""
    spanned = -(-num_tokens // block_size)
    total = 0
    for window in group_windows:
        if not window:
            total += spanned
        else:
            reach = window - 1 + max(chunk, 1)
            total += min(spanned, -(-reach // block_size) + 1)
    return total


def longest_sequence(group_windows: tuple[int, ...] | list[int], num_blocks: int,
                     block_size: int, chunk: int, limit: int) -> int:
    """The most tokens (up to `limit`) one sequence can reach alone in a pool of num_blocks
    pages: num_blocks x block_size for a one-group full-attention pool, more when sliding groups
    hold only their windows (unbounded, so `limit`, when every group slides)."""
    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        if pages_for_tokens(group_windows, middle, block_size, chunk) <= num_blocks:
            low = middle
        else:
            high = middle - 1
    return low


def group_layers_by_window(windows: list[int] | tuple[int, ...]) -> KVGroupLayout:
    """The layout for layers with these windows (0 = full attention). Full groups come first,
    so group 0 is a full-attention group whenever the model has one."""
    if not windows:
        raise ValueError("a model needs at least one layer")
    kinds = sorted(set(windows))  # 0 (full) first
    members = {kind: [layer for layer, w in enumerate(windows) if w == kind] for kind in kinds}
    size = min(len(layers) for layers in members.values())
    group_windows, layer_group, layer_position = [], [0] * len(windows), [0] * len(windows)
    for kind in kinds:
        layers = members[kind]
        for start in range(0, len(layers), size):
            for position, layer in enumerate(layers[start:start + size]):
                layer_group[layer], layer_position[layer] = len(group_windows), position
            group_windows.append(kind)
    return KVGroupLayout(size, tuple(group_windows), tuple(layer_group), tuple(layer_position),
                         len(windows))


def layout_for(config, hybrid: bool = True) -> KVGroupLayout:
    """The model's layout; hybrid=False (or no sliding layers): one group of every layer, each
    layer keeping every token (the full-attention counterfactual)."""
    windows = [config.window_of(layer) for layer in range(config.num_layers)]
    if not hybrid or not any(windows):
        return group_layers_by_window([0] * config.num_layers)
    return group_layers_by_window(windows)
