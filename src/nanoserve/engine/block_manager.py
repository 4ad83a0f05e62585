"""The KV cache's control plane: which fixed-size blocks hold which tokens, shared or not."""
from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash


def hash_block(parent_hash: int | None, tokens: bytes) -> int:
    """Chain hash of a full block's packed token ids, seeded with the previous block's hash."""
    return xxhash.xxh64_intdigest(tokens, seed=parent_hash or 0)


def packed_blocks(token_ids: list[int], first: int, end: int, block_size: int) -> list[bytes]:
    """Blocks ``first`` to ``end`` (exclusive) of ``token_ids``, each as packed uint32 ids."""
    data = array("I", token_ids[first * block_size:end * block_size]).tobytes()
    step = block_size * array("I").itemsize
    return [data[i:i + step] for i in range(0, len(data), step)]


@dataclass
class Block:
    """One cache block: its reference count and, once full and computed, its prefix hash;
    ``tokens`` (packed) and ``parent_hash`` let a lookup tell a hit from a hash collision."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: bytes = b""
    parent_hash: int | None = None


class BlockManager:
    """Hands out cache blocks, shares full computed blocks (by chain hash) between requests
    with the same prefix. Freed blocks keep their hash at the back of an LRU free list, so a
    later request can take them back until they are reused."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # chain hash -> block id
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached blocks holding a prefix of ``token_ids``, leaving at least one to compute."""
        return self.match_groups(token_ids, (0,))[1][0][1]

    def match_window(self, token_ids: list[int], window: int) -> tuple[int, list[int]]:
        """For a model whose every layer sees the last ``window`` positions: the longest
        prefix whose blocks inside the next query's window, and at least its last block
        (whose hash the next block's chains on), are cached, as (blocks before them, which
        need not be, and the cached blocks)."""
        return self.match_groups(token_ids, (window,))[1][0]

    def match_groups(self, token_ids: list[int], windows: tuple[int, ...]
                     ) -> tuple[int, list[tuple[int, list[int]]]]:
        """The longest prefix of ``token_ids`` (in blocks, leaving at least one token to
        compute) that every cache group has cached where it reads: a full group (window 0) all
        its blocks, a sliding group those inside the next query's window and the last one;
        with, per group, (blocks before its cached ones, which need not be, its cached ones)."""
        chains = [self._cached_chain(token_ids, group) for group in range(len(windows))]
        found: list[list[int | None]] = [[] for _ in windows]
        runs = [0] * len(windows)  # per group: cached blocks in a row, ending at block end - 1
        best = 0
        for end, ids in enumerate(zip(*chains), 1):
            fits = True
            for group, (window, block_id) in enumerate(zip(windows, ids)):
                found[group].append(block_id)
                runs[group] = runs[group] + 1 if block_id is not None else 0
                fits = fits and runs[group] >= end - self.first_read(end, window)
            if fits:
                best = end
            elif any(not window and run < end for window, run in zip(windows, runs)):
                break  # a full group missed a block: no longer prefix can fit
        firsts = [self.first_read(best, w) if best else 0 for w in windows]
        return best, [(first, blocks[first:best]) for first, blocks in zip(firsts, found)]

    def first_read(self, num_blocks: int, window: int) -> int:
        """The first of a prefix's ``num_blocks`` blocks that its next query's ``window`` (0:
        all) reads, or, past all, its last block."""
        if not window:
            return 0
        return min(num_blocks - 1, max(0, num_blocks * self.block_size - window + 1)
                   // self.block_size)

    def _cached_chain(self, token_ids: list[int], group: int = 0) -> Iterator[int | None]:
        """Per full block of ``token_ids`` but the last token's, its cached block's id in cache
        group ``group`` (None where not cached: an unknown hash or a collision)."""
        if not self.enable_prefix_caching:
            return
        parent: int | None = group or None  # each group's chain has a seed of its own
        usable = (len(token_ids) - 1) // self.block_size
        for tokens in packed_blocks(token_ids, 0, usable, self.block_size):
            h = hash_block(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is not None:
                block = self.blocks[block_id]
                if block.tokens != tokens or block.parent_hash != parent:
                    block_id = None  # a hash collision, not the same prefix
            yield block_id
            parent = h

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``); only when no block is in
        use, since a running request's blocks must stay findable. Returns whether it reset."""
        if len(self.free) != len(self.blocks):
            return False
        self.cached.clear()
        for block in self.blocks:
            block.hash, block.tokens, block.parent_hash = None, b"", None
        return True

    def count_prefix_lookup(self, num_queried: int, num_hit: int) -> None:
        self.prefix_queries += num_queried
        self.prefix_hits += num_hit

    def num_idle(self, block_ids: list[int]) -> int:
        """How many of these blocks sit on the free list (taking them shrinks it)."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    def take_cached(self, block_ids: list[int]) -> None:
        """Add a reference to each matched block, pulling it off the free list if idle."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1

    def can_allocate(self, num_new_blocks: int) -> bool:
        return num_new_blocks <= len(self.free)

    def allocate(self, num_new_blocks: int) -> list[int]:
        """Fresh blocks from the LRU end of the free list; their old cache entries are dropped."""
        if num_new_blocks > len(self.free):
            raise RuntimeError(f"asked for {num_new_blocks} blocks, {len(self.free)} free")
        out = []
        for _ in range(num_new_blocks):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None and self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.tokens, block.parent_hash = None, b"", None
            block.ref_count = 1
            out.append(block_id)
        return out

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference from each; tail blocks first so they are evicted before heads."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None

    def register_full_blocks(self, block_table: list[int], token_ids: list[int],
                             num_computed: int, num_registered: int, group: int = 0) -> int:
        """Hash every newly full, computed block of a sequence's table of cache group
        ``group``; returns how many are registered."""
        if not self.enable_prefix_caching:
            return num_registered
        num_full = num_computed // self.block_size
        parent = self.blocks[block_table[num_registered - 1]].hash if num_registered \
            else group or None
        for i, tokens in enumerate(packed_blocks(token_ids, num_registered, num_full,
                                                 self.block_size), num_registered):
            h = hash_block(parent, tokens)
            block = self.blocks[block_table[i]]
            if block.hash is None:
                block.hash, block.tokens, block.parent_hash = h, tokens, parent
                self.cached.setdefault(h, block.block_id)
            parent = h
        return max(num_full, num_registered)
