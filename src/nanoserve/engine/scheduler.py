"""Continuous batching: which requests run this step, with how many tokens each."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    """``num_tokens`` tokens of ``request`` starting at position ``start`` go into this step;
    the last ``len(draft_token_ids)`` of them are proposals for the step to verify."""

    request: Request
    start: int
    num_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)
    samples: bool = field(init=False)  # the chunk reaches the request's last token: sample

    def __post_init__(self) -> None:
        known_end = self.start + self.num_tokens - len(self.draft_token_ids)
        self.samples = known_end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Mixes decodes and (chunked) prefills under a per-step token budget.

    Running requests go first, oldest first; when blocks run out the newest is preempted (to
    be recomputed later). Waiting requests are admitted in FIFO order while blocks and the
    budget last, reusing cached prefix blocks. A request has a block table per cache group
    (``windows``, one per group: its layers' sliding window, 0 for full attention); all grow
    alike, and in a sliding group the blocks all of whose keys every later query is past go
    back to the free list; their ids stay in the table as placeholders, which no kernel reads.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, windows: tuple[int, ...] = (0,)):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        if len(set(self.windows) - {0}) > 1:
            raise ValueError(f"cache groups slide by one window at most, got {self.windows}")
        self.sliding_window = max(self.windows)  # the sliding groups' (0: none slides)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_partial_prefills = 0
        # Speculative decoding: proposals for a request whose chunk reaches its last token.
        self.proposer: Callable[[Request], list[int]] | None = None

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, only: Container[str] | None = None) -> SchedulerOutput:
        """This step's chunks; with ``only``, of those request ids alone (a fault hunt)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_sampled_tokens >= req.max_tokens:
                i += 1  # its last token is still on the device; it finishes when that lands
                continue
            if only is not None and req.request_id not in only:
                i += 1  # not a suspect of the fault hunt: it sits this step out
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            self._slide(req)
            need = self.bm.blocks_needed(req.num_computed_tokens + n) - len(req.block_tables[0])
            if need > 0:  # most decode steps fit in the last block: skip the allocator
                while not self.bm.can_allocate(need * self.num_groups) \
                        and self.running[-1] is not req:
                    out.preempted.append(self._preempt(self.running.pop()))
                if not self.bm.can_allocate(need * self.num_groups):
                    out.preempted.append(self._preempt(self.running.pop()))
                    break
                self._grow(req, need)
            drafts = self._drafts(req, n, budget - n)
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n + len(drafts),
                                             drafts))
            budget -= n + len(drafts)
            i += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0] if only is None else next(
                (r for r in self.waiting if r.request_id in only), None)
            # None: no suspect waits; pending: preempted while its last token was on the device
            if req is None or req.num_pending_tokens:
                break
            leader = req.prefix_leader
            if leader is not None:  # never admitted yet, so its leader is running or ahead
                if not leader.finished and leader.num_computed_tokens < leader.num_prompt_tokens:
                    break
                req.prefix_leader = None
            num_cached, matches = self._match(req)
            computed = num_cached * self.bm.block_size
            n = min(req.num_tokens - computed, budget)
            need = self.bm.blocks_needed(computed + n) - num_cached
            hits = [block for _, found in matches for block in found]
            if not self.bm.can_allocate(need * self.num_groups + self.bm.num_idle(hits)):
                break
            self.waiting.remove(req)  # the first, unless a fault hunt skipped some
            if req.prompt_logprobs is None:
                self.bm.count_prefix_lookup(req.num_tokens, computed)
            self.bm.take_cached(hits)
            req.block_tables = [[0] * skipped + found + self.bm.allocate(need)
                                for skipped, found in matches]
            req.num_slid_blocks = max(skipped for skipped, _ in matches)
            req.num_computed_tokens = computed
            req.num_registered_blocks = num_cached
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
                req.num_cached_tokens = computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            drafts = self._drafts(req, n, budget - n)
            out.chunks.append(ScheduledChunk(req, computed, n + len(drafts), drafts))
            budget -= n + len(drafts)
        return out

    def _match(self, req: Request) -> tuple[int, list[tuple[int, list[int]]]]:
        """The cached blocks to start ``req`` from, and per group (blocks before its cached
        ones that its window is past, its cached ones)."""
        if req.prompt_logprobs is not None:  # they need every prompt position's hidden state
            return 0, [(0, []) for _ in self.windows]
        return self.bm.match_groups(req.token_ids, self.windows)

    def max_blocks_held(self, num_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once: per group all of
        them, or with a window, its window's, a step's tokens' and the last registered block."""
        blocks = self.bm.blocks_needed(num_tokens)
        held = min(blocks, self.bm.blocks_needed(self.sliding_window
                                                 + self.max_num_batched_tokens) + 2)
        return sum(held if window else blocks for window in self.windows)

    def held_blocks(self, req: Request) -> list[list[int]]:
        """Per group, the blocks of its table that the request holds (not slid past)."""
        return [table[req.num_slid_blocks if window else 0:]
                for window, table in zip(self.windows, req.block_tables)]

    def _grow(self, req: Request, need: int) -> None:
        for table in req.block_tables:
            table += self.bm.allocate(need)

    def _slide(self, req: Request) -> None:
        """Free the sliding groups' blocks wholly before the window of the next query."""
        if not self.sliding_window:
            return
        end = (req.num_computed_tokens - self.sliding_window + 1) // self.bm.block_size
        if self.bm.enable_prefix_caching:  # the next block's hash chains on the last one's
            end = min(end, req.num_registered_blocks - 1)
        if end > req.num_slid_blocks:
            for window, table in zip(self.windows, req.block_tables):
                if window:
                    self.bm.free_blocks(table[req.num_slid_blocks:end])
            req.num_slid_blocks = end

    def _drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """Proposals to verify after a chunk of ``n`` tokens that reaches the request's last
        known token, as many as fit the step's ``budget`` and the free blocks (taking those):
        proposals never preempt anyone."""
        end = req.num_computed_tokens + n
        if (self.proposer is None or budget <= 0 or req.num_pending_tokens
                or end != req.num_tokens):
            return []
        length = len(req.block_tables[0])
        room = (length + self.bm.num_free_blocks // self.num_groups) * self.bm.block_size - end
        drafts = self.proposer(req)[:max(0, min(budget, room))]
        need = self.bm.blocks_needed(end + len(drafts)) - length
        if need > 0:
            self._grow(req, need)
        return drafts

    def rollback(self, req: Request, num_computed: int) -> None:
        """After a verify: only ``num_computed`` tokens' K/V stand (the rejected proposals'
        do not); blocks that only rejected proposals used go back to the free list."""
        req.num_computed_tokens = num_computed
        keep = self.bm.blocks_needed(num_computed + 1)  # room for the next token's K/V
        for table in req.block_tables:
            if len(table) > keep:
                self.bm.free_blocks(table[keep:])
                del table[keep:]

    def advance(self, chunk: ScheduledChunk) -> None:
        """Count the chunk's K/V as computed (once its step runs) and its sampled token as
        pending until the step's result arrives."""
        req = chunk.request
        if not chunk.samples:
            self.num_partial_prefills += 1
        req.num_computed_tokens = chunk.start + chunk.num_tokens
        self.register_known_blocks(req)
        if chunk.samples:
            req.num_pending_tokens += 1

    def register_known_blocks(self, req: Request) -> None:
        """Hash the request's newly full, computed blocks whose token ids are all known."""
        known = min(req.num_computed_tokens, len(req.token_ids))
        if known // self.bm.block_size > req.num_registered_blocks:
            registered = req.num_registered_blocks
            for group, table in enumerate(req.block_tables):
                registered = self.bm.register_full_blocks(
                    table, req.token_ids, known, req.num_registered_blocks, group)
            req.num_registered_blocks = registered

    def finish(self, req: Request) -> None:
        """Release a finished or aborted request's blocks, wherever it is queued."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)

    def _preempt(self, req: Request) -> Request:
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        return req

    def _release(self, req: Request) -> None:
        for held in self.held_blocks(req):
            self.bm.free_blocks(held)
        req.block_tables = []
        req.num_slid_blocks = 0
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0
