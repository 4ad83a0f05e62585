"""The KV cache's control plane and the scheduler, driven without a model."""
from __future__ import annotations

import random
from array import array
from collections.abc import Callable

import pytest

from nanoserve.engine import block_manager as bm_module
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.request import FinishReason, Request, RequestStatus
from nanoserve.engine.scheduler import Scheduler
from nanoserve.sampling_params import SamplingParams

BS = 4  # block size used throughout


def _computed(bm: BlockManager, token_ids: list[int]) -> list[int]:
    """Allocate blocks for ``token_ids``, mark them all computed and registered; return them."""
    table = bm.allocate(bm.blocks_needed(len(token_ids)))
    assert bm.register_full_blocks(table, token_ids, len(token_ids), 0) == len(token_ids) // BS
    return table


def _assert_consistent(bm: BlockManager, tables: list[list[int]]) -> None:
    """Ref counts equal the number of tables holding each block; idle blocks are on the free list."""
    refs = [0] * bm.num_blocks
    for table in tables:
        for b in table:
            refs[b] += 1
    assert [blk.ref_count for blk in bm.blocks] == refs
    assert set(bm.free) == {i for i, r in enumerate(refs) if r == 0}
    for h, b in bm.cached.items():
        assert bm.blocks[b].hash == h


# ---- block manager ----------------------------------------------------------------------------

def test_allocate_and_free():
    bm = BlockManager(8, BS)
    assert bm.num_free_blocks == 8 and bm.usage() == 0.0
    a = bm.allocate(3)
    b = bm.allocate(2)
    assert len(set(a + b)) == 5
    assert all(bm.blocks[i].ref_count == 1 for i in a + b)
    assert bm.num_free_blocks == 3 and bm.usage() == pytest.approx(5 / 8)
    assert bm.can_allocate(3) and not bm.can_allocate(4)
    with pytest.raises(RuntimeError, match="asked for 4 blocks, 3 free"):
        bm.allocate(4)
    assert bm.num_free_blocks == 3  # a failed allocation takes nothing
    bm.free_blocks(a)
    assert bm.num_free_blocks == 6
    _assert_consistent(bm, [b])
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free_blocks([a[0]])
    bm.free_blocks(b)
    assert bm.num_free_blocks == 8


def test_blocks_needed_and_bad_size():
    bm = BlockManager(2, BS)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, BS)


def test_shared_prefix_blocks_are_ref_counted():
    bm = BlockManager(10, BS)
    seq = list(range(100, 111))  # 2 full blocks + 3 tokens
    table = _computed(bm, seq)
    other = seq[:8] + [7, 7, 7, 7, 7]
    hits = bm.match_prefix(other)
    assert hits == table[:2]
    assert bm.num_idle(hits) == 0  # still held by the first sequence
    bm.take_cached(hits)
    other_table = hits + bm.allocate(bm.blocks_needed(len(other)) - len(hits))
    assert [bm.blocks[b].ref_count for b in table] == [2, 2, 1]
    _assert_consistent(bm, [table, other_table])
    bm.free_blocks(table)
    assert [bm.blocks[b].ref_count for b in table] == [1, 1, 0]
    assert table[0] not in bm.free and table[1] not in bm.free and table[2] in bm.free
    _assert_consistent(bm, [other_table])
    bm.free_blocks(other_table)
    assert bm.num_free_blocks == 10
    _assert_consistent(bm, [])


def test_idle_cached_blocks_come_back_off_the_free_list():
    bm = BlockManager(6, BS)
    seq = list(range(12))
    table = _computed(bm, seq)
    bm.free_blocks(table)
    assert bm.num_free_blocks == 6
    hits = bm.match_prefix(seq + [99])
    assert hits == table
    assert bm.num_idle(hits) == 3
    bm.take_cached(hits)
    assert bm.num_free_blocks == 3
    # the taken blocks are not handed out again while held
    assert not set(bm.allocate(3)) & set(hits)


def test_reset_prefix_cache_forgets_prefixes_only_when_no_block_is_held():
    bm = BlockManager(6, BS)
    seq = list(range(12))
    table = _computed(bm, seq)
    assert not bm.reset_prefix_cache()  # a request still holds the blocks
    assert bm.match_prefix(seq + [99]) == table[:3]
    bm.free_blocks(table)
    assert bm.reset_prefix_cache()
    assert bm.match_prefix(seq + [99]) == []
    assert all(b.hash is None for b in bm.blocks)
    _assert_consistent(bm, [])
    # the prefix registers again once computed
    assert bm.match_prefix(seq + [99]) == [] and _computed(bm, seq)


def test_match_prefix_follows_the_whole_chain():
    bm = BlockManager(10, BS)
    seq = list(range(16))
    table = _computed(bm, seq)
    assert bm.match_prefix(seq[:9]) == table[:2]
    # same second block after a different first block: no hit at all
    assert bm.match_prefix([50, 51, 52, 53] + seq[4:]) == []
    # a change in block 2 keeps blocks 0-1
    assert bm.match_prefix(seq[:8] + [0, 0, 0, 0, 1]) == table[:2]


@pytest.mark.parametrize("extra", [0, 1, 3, 4, 5])
def test_match_prefix_leaves_a_token_to_compute(extra):
    bm = BlockManager(10, BS)
    seq = list(range(3 * BS))
    table = _computed(bm, seq)
    query = seq[:2 * BS + extra]
    hits = bm.match_prefix(query)
    assert len(hits) * BS < len(query)
    assert len(hits) == (len(query) - 1) // BS  # all that may be used is used
    assert hits == table[:len(hits)]


def test_only_full_computed_blocks_are_registered():
    bm = BlockManager(10, BS)
    seq = list(range(10))
    table = bm.allocate(3)
    assert bm.register_full_blocks(table, seq, 3, 0) == 0  # block 0 not computed yet
    assert bm.cached == {}
    assert bm.register_full_blocks(table, seq, 6, 0) == 1
    assert bm.register_full_blocks(table, seq, 10, 1) == 2  # block 2 is partial
    assert len(bm.cached) == 2
    assert bm.match_prefix(seq + [1]) == table[:2]


def test_window_match_needs_only_the_blocks_in_the_window():
    bm = BlockManager(10, BS)
    seq = list(range(17))
    table = _computed(bm, seq)  # 4 full blocks and a partial one
    bm.free_blocks(table[:2])  # slid past, as a window frees them
    bm.allocate(7)  # the 5 never used, then the 2 freed: reused
    bm.free_blocks(table[2:])
    assert [b in bm.cached.values() for b in table[:4]] == [False, False, True, True]
    assert bm.match_prefix(seq) == []
    # A query at 16 with a 6-key window sees keys 11-16: blocks 2 and 3 (and the next).
    assert bm.match_window(seq, 6) == (2, table[2:4])
    assert bm.match_window(seq, 13) == (0, [])  # every cut's window reaches a lost block
    # Window 1: the last block before the cut must still be cached (its hash chains on).
    assert bm.match_window(seq, 1) == (3, table[3:4])
    assert bm.match_window(seq[:5], 6) == (0, [])  # its one block is gone


def test_hash_collision_with_other_tokens_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 42)
    bm = BlockManager(10, BS)
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    table = _computed(bm, seq)
    assert bm.match_prefix(seq) == table[:1]  # block 1 "hits" block 0's entry: tokens differ
    assert bm.match_prefix([9, 9, 9, 9, 9]) == []


def test_hash_collision_through_a_different_parent_is_not_a_hit(monkeypatch):
    # a hash that ignores the parent: same tokens after different prefixes collide
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: hash(tokens))
    bm = BlockManager(10, BS)
    tail = [5, 6, 7, 8]
    a = _computed(bm, [1, 1, 1, 1] + tail)
    b = _computed(bm, [2, 2, 2, 2, 0])
    # [2,2,2,2] is cached (b), [5,6,7,8] is cached as a's second block, computed after [1,1,1,1]
    assert bm.match_prefix([2, 2, 2, 2] + tail + [0]) == b[:1]
    assert bm.match_prefix([1, 1, 1, 1] + tail + [0]) == a[:2]


def test_lru_eviction_reuses_least_recently_freed_and_tails_first():
    bm = BlockManager(8, BS)
    a_seq, b_seq = list(range(12)), list(range(100, 112))
    a = _computed(bm, a_seq)
    b = _computed(bm, b_seq)
    never_used = list(bm.free)
    bm.free_blocks(a)
    bm.free_blocks(b)
    # never-used blocks first, then a (freed first) tail to head, then b tail to head
    assert list(bm.free) == never_used + a[::-1] + b[::-1]
    got = bm.allocate(len(never_used) + 1)
    assert got[-1] == a[2]  # a's tail is evicted first
    assert bm.match_prefix(a_seq + [0]) == a[:2]  # a's head survives
    assert bm.match_prefix(b_seq + [0]) == b
    got = bm.allocate(2)
    assert got == [a[1], a[0]]
    assert bm.match_prefix(a_seq + [0]) == []
    assert bm.match_prefix(b_seq + [0]) == b
    assert len(bm.cached) == 3  # evicted blocks left the cache index


def test_refreeing_a_block_moves_it_to_the_back():
    bm = BlockManager(4, BS)
    seq = list(range(8))
    table = _computed(bm, seq)
    bm.free_blocks(table)
    hits = bm.match_prefix(seq + [0])
    bm.take_cached(hits[:1])
    bm.free_blocks(hits[:1])  # used again just now: the most recently freed
    assert list(bm.free)[-1] == table[0]
    assert bm.allocate(3)[-1] == table[1]


def test_prefix_caching_disabled():
    bm = BlockManager(6, BS, enable_prefix_caching=False)
    seq = list(range(12))
    table = bm.allocate(3)
    assert bm.register_full_blocks(table, seq, 12, 0) == 0
    assert bm.cached == {} and bm.blocks[table[0]].hash is None
    assert bm.match_prefix(seq + [1]) == []


def test_duplicate_blocks_do_not_confuse_the_index():
    bm = BlockManager(6, BS)
    seq = list(range(8))
    first = _computed(bm, seq)
    second = _computed(bm, seq)  # same content computed twice (admitted in one step)
    assert bm.match_prefix(seq + [0]) == first
    bm.free_blocks(second)
    bm.free_blocks(first)
    # evicting the duplicates must not drop the entries of the indexed blocks
    assert bm.allocate(4)[2:] == second[::-1]
    assert bm.match_prefix(seq + [0]) == first
    bm.allocate(2)
    assert bm.cached == {}


def test_counters():
    eng = FakeEngine(num_blocks=8, budget=64)
    prompt = list(range(10))
    eng.add(_req("a", prompt))
    eng.step()
    assert (eng.bm.prefix_queries, eng.bm.prefix_hits) == (10, 0)
    b = eng.add(_req("b", prompt[:9] + [77]))
    out = eng.step()
    assert (eng.bm.prefix_queries, eng.bm.prefix_hits) == (20, 8)
    assert b.num_cached_tokens == 8
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [
        ("a", 10, 1), ("b", 8, 2)]
    assert eng.bm.usage() == pytest.approx(4 / 8)  # a: 3 blocks, b: 2 of a's + 1 own


# ---- scheduler with a fake request stream -----------------------------------------------------

def _req(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, None, list(prompt), SamplingParams(max_tokens=max_tokens), max_tokens,
                   frozenset())


class FakeEngine:
    """Drives a Scheduler the way LLMEngine does, sampling a made-up token.

    ``overlap``: a step's tokens land only after the next step is scheduled, as when the
    engine overlaps steps (they are pending meanwhile).
    """

    def __init__(self, num_blocks: int, max_num_seqs: int = 8, budget: int = 32,
                 prefix_caching: bool = True, overlap: bool = False,
                 windows: tuple[int, ...] = (0,)):
        self.bm = BlockManager(num_blocks, BS, prefix_caching)
        self.sched = Scheduler(self.bm, max_num_seqs, budget, windows)
        self.overlap = overlap
        self.in_flight: list = []
        self.finished: list[Request] = []
        self.steps = 0

    def add(self, req: Request) -> Request:
        self.sched.add(req)
        return req

    def step(self):
        out = self.sched.schedule()
        self.steps += 1
        self.last = [(c.request.request_id, c.start, c.num_tokens, c.samples) for c in out.chunks]
        assert out.num_tokens <= self.sched.max_num_batched_tokens
        assert len(self.sched.running) <= self.sched.max_num_seqs
        for c in out.chunks:
            req = c.request
            assert req.status is RequestStatus.RUNNING
            assert c.start == req.num_computed_tokens and c.num_tokens >= 1
            assert len(req.block_table) >= self.bm.blocks_needed(c.start + c.num_tokens)
            # Only a decode's one input token may still be on the device.
            assert len(req.token_ids) >= c.start + c.num_tokens - (c.num_tokens == 1)
        for c in out.chunks:
            self.sched.advance(c)
            req = c.request
            for window, table in zip(self.sched.windows, req.block_tables):
                for i in range(req.num_slid_blocks if window else 0, req.num_registered_blocks):
                    block = self.bm.blocks[table[i]]  # hashed: the request's known tokens there
                    assert block.hash is None or block.tokens == array(
                        "I", req.token_ids[i * BS:(i + 1) * BS]).tobytes()
        previous, self.in_flight = self.in_flight, [c for c in out.chunks if c.samples]
        self._land(previous)
        if not self.overlap:
            self._land(self.in_flight)
            self.in_flight = []
        _assert_consistent(self.bm, [held for r in self.sched.running + list(self.sched.waiting)
                                     for held in self.sched.held_blocks(r)])
        return out

    def _land(self, chunks) -> None:
        for c in chunks:
            req = c.request
            if req.finished:
                continue
            req.num_pending_tokens -= 1
            req.token_ids.append(1000 + req.num_output_tokens)
            if req.num_output_tokens >= req.max_tokens:
                req.finish(FinishReason.LENGTH)
                self.sched.finish(req)
                self.finished.append(req)

    def run(self, max_steps: int = 1000):
        while self.sched.has_unfinished() or self.in_flight:
            self.step()
            assert self.steps < max_steps, "scheduler made no progress"


def test_token_budget_is_respected_and_prefills_are_chunked():
    eng = FakeEngine(num_blocks=64, budget=10)
    reqs = [eng.add(_req(str(i), list(range(i * 50, i * 50 + 7 + 5 * i)), max_tokens=3))
            for i in range(5)]
    out = eng.step()
    assert out.num_tokens == 10
    # the first request's whole prompt, then the start of the second's
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [
        ("0", 0, 7), ("1", 0, 3)]
    assert not out.chunks[1].samples
    eng.run()
    assert sorted(r.request_id for r in eng.finished) == [r.request_id for r in reqs]
    assert all(r.num_output_tokens == 3 for r in reqs)
    assert eng.sched.num_partial_prefills > 0


def test_decodes_and_prefill_chunks_mix_in_one_step():
    eng = FakeEngine(num_blocks=64, budget=8)
    a = eng.add(_req("a", [1, 2, 3], max_tokens=10))
    eng.step()  # a's prefill, samples its first token
    assert a.num_output_tokens == 1
    b = eng.add(_req("b", list(range(10, 30)), max_tokens=2))
    eng.step()
    assert eng.last == [("a", 3, 1, True), ("b", 0, 7, False)]
    eng.step()
    assert eng.last == [("a", 4, 1, True), ("b", 7, 7, False)]
    eng.step()
    assert eng.last == [("a", 5, 1, True), ("b", 14, 6, True)]
    assert b.num_output_tokens == 1


def test_fifo_admission():
    eng = FakeEngine(num_blocks=64, max_num_seqs=2, budget=64)
    reqs = [eng.add(_req(str(i), [i] * (3 + i), max_tokens=2 + (i % 2))) for i in range(6)]
    order: list[str] = []
    while eng.sched.has_unfinished():
        out = eng.step()
        order += [c.request.request_id for c in out.chunks
                  if c.start == 0 and c.request.request_id not in order]
    assert order == [r.request_id for r in reqs]


def test_fifo_head_that_does_not_fit_blocks_later_requests():
    eng = FakeEngine(num_blocks=6, budget=64)
    a = eng.add(_req("a", list(range(12)), max_tokens=2))  # 3 blocks, then 4
    big = eng.add(_req("big", list(range(100, 120)), max_tokens=1))  # 5 blocks: waits for a
    small = eng.add(_req("small", [7], max_tokens=1))  # would fit, but must not jump the queue
    out = eng.step()
    assert [c.request for c in out.chunks] == [a]
    assert list(eng.sched.waiting) == [big, small]
    eng.run()
    assert [r.request_id for r in eng.finished] == ["a", "big", "small"]


def test_preemption_is_newest_first_and_resets_progress():
    eng = FakeEngine(num_blocks=6, budget=64)
    reqs = [eng.add(_req(n, [i] * 8, max_tokens=8)) for i, n in enumerate("abc")]
    out = eng.step()  # each: 8 prompt tokens in 2 blocks
    assert [c.request for c in out.chunks] == reqs and eng.bm.num_free_blocks == 0
    a, b, c = reqs
    out = eng.step()  # a and b need a third block each: the newest, c, makes room
    assert out.preempted == [c]
    assert c.status is RequestStatus.WAITING and c.num_computed_tokens == 0
    assert c.block_table == [] and c.num_preemptions == 1
    assert c.num_output_tokens == 1  # the token it produced is kept
    assert list(eng.sched.waiting) == [c]
    assert [ch.request for ch in out.chunks] == [a, b]
    out = eng.step()
    while not out.preempted:  # a and b decode until a needs a fourth block
        assert [ch.request for ch in out.chunks] == [a, b]
        out = eng.step()
    assert out.preempted == [b] and b.num_computed_tokens == 0 and b.block_table == []
    assert a.num_preemptions == 0 and [ch.request for ch in out.chunks] == [a]
    assert list(eng.sched.waiting) == [b, c]  # re-queued at the front, oldest first
    assert eng.sched.num_preemptions == 2
    eng.run()
    assert all(r.num_output_tokens == 8 for r in reqs)
    assert eng.bm.num_free_blocks == eng.bm.num_blocks


def test_lone_request_never_preempts_itself_when_it_fits():
    eng = FakeEngine(num_blocks=4, budget=64)
    r = eng.add(_req("r", list(range(5)), max_tokens=11))  # 16 tokens: exactly the cache
    eng.run()
    assert r.num_output_tokens == 11 and r.num_preemptions == 0


def test_aborting_waiting_and_running_requests_frees_their_blocks():
    eng = FakeEngine(num_blocks=8, max_num_seqs=1, budget=64)
    running = eng.add(_req("r", list(range(9))))
    waiting = eng.add(_req("w", list(range(5))))
    eng.step()
    assert eng.bm.num_free_blocks == 5
    eng.sched.finish(waiting)
    eng.sched.finish(running)
    assert not eng.sched.has_unfinished()
    assert eng.bm.num_free_blocks == 8 and all(b.ref_count == 0 for b in eng.bm.blocks)


def _random_arrivals(eng: FakeEngine, rng: random.Random,
                     arrival: Callable[[int], Request | None]) -> int:
    """Forty rounds, each adding ``arrival(i)`` half the time (None: none comes) and stepping
    while work is left, then the rest run out; returns how many were added."""
    total = 0
    for i in range(40):
        if rng.random() < 0.5:
            req = arrival(i)
            if req is not None:
                eng.add(req)
                total += 1
        if eng.sched.has_unfinished() or eng.in_flight:
            eng.step()
    eng.run()
    return total


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("overlap", [False, True])
def test_random_stream_leaks_no_blocks(seed, prefix_caching, overlap):
    rng = random.Random(seed)
    eng = FakeEngine(num_blocks=rng.randint(8, 20), max_num_seqs=rng.randint(1, 6),
                     budget=rng.randint(4, 40), prefix_caching=prefix_caching, overlap=overlap)
    shared = [rng.randrange(500) for _ in range(12)]

    def arrival(i: int) -> Request:
        plen = rng.randint(1, 20)
        prompt = (shared[:rng.randint(0, 12)] + [rng.randrange(500) for _ in range(plen)])
        prompt = prompt[:eng.bm.num_blocks * BS - 8] or [1]
        max_tokens = rng.randint(1, min(8, eng.bm.num_blocks * BS - len(prompt)))
        return _req(f"r{i}", prompt, max_tokens)

    total = _random_arrivals(eng, rng, arrival)
    assert len(eng.finished) == total
    assert all(r.num_output_tokens == r.max_tokens for r in eng.finished)
    assert eng.bm.num_free_blocks == eng.bm.num_blocks
    assert all(b.ref_count == 0 for b in eng.bm.blocks)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("windows", [(0, 5), (0, 9, 9), (6,)])
def test_cache_groups_hold_what_their_windows_read(seed, prefix_caching, windows):
    """A request has a table per cache group, all as long; a full group holds every block of
    the sequence, a sliding one at most its window's (with a step's and the last registered
    block), and nothing leaks, under preemption, prefix hits and overlapped steps."""
    rng = random.Random(seed)
    eng = FakeEngine(num_blocks=rng.randint(10, 20), max_num_seqs=rng.randint(2, 4),
                     budget=rng.randint(4, 12), prefix_caching=prefix_caching,
                     overlap=bool(seed % 2), windows=windows)
    shared = [rng.randrange(500) for _ in range(16)]
    schedule = eng.sched.schedule
    held_most = 0

    def watched():
        nonlocal held_most
        out = schedule()
        for c in out.chunks:
            req = c.request
            assert len(req.block_tables) == len(windows)
            assert len({len(t) for t in req.block_tables}) == 1
            for window, held in zip(windows, eng.sched.held_blocks(req)):
                if window:
                    held_most = max(held_most, len(held))
                else:
                    assert len(held) == len(req.block_tables[0])
        return out

    eng.sched.schedule = watched

    def arrival(i: int) -> Request | None:
        prompt = shared[:rng.randint(0, 16)] + [rng.randrange(500)
                                                 for _ in range(rng.randint(1, 20))]
        max_tokens = rng.randint(1, 12)
        fits = eng.sched.max_blocks_held(len(prompt) + max_tokens) <= eng.bm.num_blocks
        return _req(f"r{i}", prompt, max_tokens) if fits else None

    total = _random_arrivals(eng, rng, arrival)
    assert len(eng.finished) == total
    window = max(windows)
    assert held_most <= eng.bm.blocks_needed(window + eng.sched.max_num_batched_tokens) + 2
    assert eng.bm.num_free_blocks == eng.bm.num_blocks


def test_groups_match_prefixes_of_their_own():
    """A block cached for one group is no hit for another; a prefix counts as cached only as
    far as every group has it where its next query reads."""
    bm = BlockManager(32, BS)
    seq = list(range(21))  # 5 full blocks before the last token
    full, sliding = bm.allocate(5), bm.allocate(5)
    bm.register_full_blocks(full, seq, 20, 0, group=0)
    assert bm.match_groups(seq, (0, 6)) == (0, [(0, []), (0, [])])  # group 1 has nothing
    bm.register_full_blocks(sliding, seq, 20, 0, group=1)
    assert bm.match_groups(seq, (0, 6)) == (5, [(0, full), (3, sliding[3:])])
    assert bm.match_prefix(seq) == full
    bm.allocate(bm.num_free_blocks)
    bm.free_blocks(full[4:])
    bm.allocate(1)  # evicts the full group's last block: the prefix ends before it
    assert bm.match_groups(seq, (0, 6)) == (4, [(0, full[:4]), (2, sliding[2:4])])
    bm.free_blocks(sliding[3:4])
    bm.allocate(1)  # a block the sliding group reads at 4 blocks: the prefix ends sooner
    assert bm.match_groups(seq, (0, 6)) == (3, [(0, full[:3]), (1, sliding[1:3])])
