"""The pool map of a memory report and the address of a token in the KV cache.

Reads the block tables recorded in a report (at the peak step, or another recorded step) and
says, for every physical block, who holds it: free, one sequence, several (ref > 1), or
nobody but still cached (a reusable prefix block). Layout of the cache: docs/contracts.md §1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any


class BlockState(IntEnum):
    FREE = 0
    OWNED = 1          # ref count 1
    SHARED = 2         # ref count > 1 (forked samples or prefix-cache hits)
    CACHED_FREE = 3    # ref count 0 but still hashed: a later prompt can reuse it


@dataclass(slots=True)
class PoolMap:
    step: int
    block_size: int
    states: list[BlockState]
    owners: list[list[str]]           # request ids holding each block (in table order)
    ref_counts: dict[int, int]        # recorded ref count of every used block
    cached_ids_known: bool            # False: only the count of cached-free blocks is known
    cached_free_count: int
    sequences: list[dict[str, Any]] = field(default_factory=list)

    def count(self, state: BlockState) -> int:
        return sum(1 for s in self.states if s is state)

    @property
    def blocks_used(self) -> int:
        return self.count(BlockState.OWNED) + self.count(BlockState.SHARED)

    @property
    def blocks_cached_free(self) -> int:
        return self.count(BlockState.CACHED_FREE) if self.cached_ids_known else self.cached_free_count

    def counts(self) -> dict[str, int]:
        used, cached = self.blocks_used, self.blocks_cached_free
        return {"num_blocks": len(self.states), "blocks_used": used,
                "blocks_shared": self.count(BlockState.SHARED), "blocks_cached_free": cached,
                "blocks_free": len(self.states) - used - cached}

    def as_dict(self) -> dict:
        """For `inspect-memory --json`: counts, per-block state codes and owners."""
        return {"step": self.step, **self.counts(),
                "states": "".join("._#~"[s] for s in self.states),   # free, owned, shared, cached
                "owners": {b: o for b, o in enumerate(self.owners) if o},
                "sequences": self.sequences}


@dataclass(slots=True)
class TokenAddress:
    request_id: str
    sample_index: int
    seq_id: int
    token_index: int
    logical_block: int         # token_index // B
    offset: int                # token_index % B
    physical_block: int        # block_table[logical_block]
    slot: int                  # physical_block * B + offset
    token_bytes: int           # bytes of one token's K (or V) in one layer: H_kv x D x dtype bytes
    layer_offsets: list[tuple[int, int, int]]   # (layer, K byte offset, V byte offset)
    # 8-bit pools: (layer, K scales byte offset, V scales byte offset) in kv_scales[L, 2, N, H_kv]
    # float32 (the token's block's H_kv scales, head h at + 4h); None for unquantized pools.
    scale_offsets: list[tuple[int, int, int]] | None = None


def recorded_tables(report: dict[str, Any], step: int | None = None) -> dict[str, Any]:
    """The peak tables, or those of a recorded step; ValueError lists the recorded steps."""
    peak = report.get("peak_block_tables")
    if peak is None:
        raise ValueError("the report has no block tables (no step was recorded)")
    candidates = [peak, *report.get("block_table_snapshots", [])]
    if step is None:
        return peak
    for tables in candidates:
        if tables["step"] == step:
            return tables
    steps = sorted(t["step"] for t in candidates)
    raise ValueError(f"step {step} has no recorded block tables; recorded steps: {steps}")


def build_pool_map(report: dict[str, Any], step: int | None = None) -> PoolMap:
    tables = recorded_tables(report, step)
    num_blocks = report["pool"]["num_blocks"]
    owners: list[list[str]] = [[] for _ in range(num_blocks)]
    refs: dict[int, int] = {}
    for seq in tables["sequences"]:
        owner = seq["request_id"] if seq["request_id"] is not None else f"seq {seq['seq_id']}"
        for block, ref in zip(seq["block_table"], seq["ref_counts"]):
            if block < 0:  # a sliding window released it: the entry holds no block
                continue
            owners[block].append(owner)
            refs[block] = ref
    cached = tables["cached_free_blocks"]
    states = [_state(refs.get(b, 0)) for b in range(num_blocks)]
    for block in cached or []:
        states[block] = BlockState.CACHED_FREE
    cached_count = len(cached) if cached is not None else tables["sample"]["blocks_cached_free"]
    return PoolMap(tables["step"], report["pool"]["block_size"], states, owners, refs,
                   cached is not None, cached_count, tables["sequences"])


def _state(ref: int) -> BlockState:
    if ref == 0:
        return BlockState.FREE
    return BlockState.OWNED if ref == 1 else BlockState.SHARED


def find_sequence(tables: dict[str, Any], request_id: str, sample_index: int = 0) -> dict[str, Any]:
    for seq in tables["sequences"]:
        if seq["request_id"] == request_id and seq["sample_index"] == sample_index:
            return seq
    live = sorted({str(s["request_id"]) for s in tables["sequences"]})
    raise ValueError(f"request {request_id!r} sample {sample_index} holds no blocks at step "
                     f"{tables['step']}; requests live then: {', '.join(live) or 'none'}")


def kv_layout(report: dict[str, Any]) -> dict[str, int]:
    layout = report["pool"].get("layout")
    if not layout:
        raise ValueError("the report has no KV layout (num_layers, num_kv_heads, head_dim); "
                         "it was written by a tracker that was not given the model shape")
    return layout


def token_address(report: dict[str, Any], request_id: str, token_index: int,
                  sample_index: int = 0, step: int | None = None) -> TokenAddress:
    """Where token `token_index` of a request sits: [L, 2, N, B, H_kv, D] (contracts §1); in a
    hybrid pool, in the first (full-attention) group's page: [G, 2, N, B, H_kv, D]."""
    tables = recorded_tables(report, step)
    seq = find_sequence(tables, request_id, sample_index)
    pool, layout = report["pool"], kv_layout(report)
    block_size, num_blocks = pool["block_size"], pool["num_blocks"]
    covered = seq["num_tokens"] if seq["num_tokens"] is not None else len(seq["block_table"]) * block_size
    if not 0 <= token_index < covered:
        raise ValueError(f"token index {token_index} is outside request {request_id!r}'s "
                         f"{covered} cached tokens at step {tables['step']}")
    logical, offset = divmod(token_index, block_size)
    physical = seq["block_table"][logical]
    if physical < 0:
        raise ValueError(f"token {token_index} of request {request_id!r} left its sliding window "
                         f"before step {tables['step']}: its block was given back to the pool")
    token_bytes = layout["num_kv_heads"] * layout["head_dim"] * layout["dtype_bytes"]

    def byte_offset(layer: int, k_or_v: int) -> int:
        return (((layer * 2 + k_or_v) * num_blocks + physical) * block_size + offset) * token_bytes

    layers = [(layer, byte_offset(layer, 0), byte_offset(layer, 1)) for layer in range(layout["num_layers"])]
    return TokenAddress(request_id, sample_index, seq["seq_id"], token_index, logical, offset,
                        physical, physical * block_size + offset, token_bytes, layers,
                        _scale_offsets(layout, num_blocks, physical))


def _scale_offsets(layout: dict[str, Any], num_blocks: int,
                   physical: int) -> list[tuple[int, int, int]] | None:
    """Byte offsets of a block's scales in kv_scales [L, 2, N, H_kv] (8-bit pools only)."""
    scale_bytes = layout.get("scale_bytes")
    if not scale_bytes:
        return None
    row = layout["num_kv_heads"] * scale_bytes

    def byte_offset(layer: int, k_or_v: int) -> int:
        return ((layer * 2 + k_or_v) * num_blocks + physical) * row

    return [(layer, byte_offset(layer, 0), byte_offset(layer, 1))
            for layer in range(layout["num_layers"])]
