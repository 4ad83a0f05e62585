"""Draft-model proposals: a smaller model with its own paged KV cache runs k greedy steps."""
from __future__ import annotations

from typing import Any

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.request import Request
from nanoserve.runner.inputs import PENDING_TOKEN, SequenceChunk, StepInput
from nanoserve.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)


class DraftState:
    """A request's place in the draft model's cache: its blocks and how many of its tokens
    have K/V there (all of them correct: rejected proposals are rolled back)."""

    def __init__(self) -> None:
        self.block_table: list[int] = []
        self.num_computed = 0


class DraftProposer:
    """Proposes by running a draft model (an executor like the target's, with its own cache
    and BlockManager) for k steps over the sequences of a batch at once: the first step
    catches up on the tokens its cache lacks and samples, the next ones feed back each
    previous sample on the device, so the host waits once for all k.

    The draft decodes greedily: its proposal is a point mass, which the verify's rejection
    sampling (accept with probability p(d)) keeps exact for every sampling option.
    """

    def __init__(self, executor: Any, block_size: int, max_model_len: int,
                 max_num_batched_tokens: int):
        self.executor = executor
        self.max_num_batched_tokens = max_num_batched_tokens  # per draft step
        self.bm = BlockManager(executor.num_kv_blocks, block_size, enable_prefix_caching=False)
        self.max_model_len = max_model_len  # the draft's own positions may end sooner
        self.finished_ids: list[str] = []

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Up to ``k`` proposals after each ``(request, k)``'s last known token; a request
        whose proposals would not fit the draft's cache or positions gets none."""
        rows: list[tuple[Request, int, DraftState]] = []
        num_tokens = 0  # in the first step, which catches up
        for req, k in wanted:
            state = req.spec_state.draft
            if state is None:
                state = req.spec_state.draft = DraftState()
            # Its K/V holds the right tokens below the last one at least (proposals past
            # what was accepted, or not verified at all, are recomputed).
            state.num_computed = min(state.num_computed, req.num_tokens - 1)
            k = min(k, self.max_model_len - req.num_tokens + 1)
            # The draft computes through its k-1-th proposal.
            need = self.bm.blocks_needed(req.num_tokens + k - 1) - len(state.block_table)
            catch_up = req.num_tokens - state.num_computed
            if k < 1 or not self.bm.can_allocate(need) or (
                    rows and num_tokens + catch_up > self.max_num_batched_tokens):
                continue  # no proposals this step (a long catch-up: in a later one)
            num_tokens += catch_up
            if need > 0:
                state.block_table += self.bm.allocate(need)
            rows.append((req, k, state))
        if not rows:
            return {}
        launched = []
        for j in range(max(k for _, k, _ in rows)):
            chunks = []
            for req, k, state in rows:
                if j >= k:
                    continue
                if j == 0:
                    tokens, start = req.token_ids[state.num_computed:], state.num_computed
                else:
                    tokens, start = [PENDING_TOKEN], req.num_tokens + j - 1
                chunks.append(SequenceChunk(req.request_id, tokens, start, state.block_table,
                                            True, _GREEDY, [], [], []))
            finished, self.finished_ids = self.finished_ids, []
            launched.append((chunks, self.executor.launch(StepInput(chunks, finished))))
        proposals: dict[str, list[int]] = {req.request_id: [] for req, _, _ in rows}
        for chunks, step in launched:
            for chunk, token in zip(chunks, step.result().token_ids):
                proposals[chunk.request_id].append(token)
        for rid, tokens in proposals.items():  # a FAILED_ROW sample ends the proposals
            proposals[rid] = tokens[:next((i for i, t in enumerate(tokens) if t < 0),
                                          len(tokens))]
        for req, k, state in rows:
            state.num_computed = req.num_tokens + k - 1
        return proposals

    def rollback(self, req: Request, num_valid: int) -> None:
        """Only the first ``num_valid`` tokens of ``req`` stand: the draft's K/V past them
        (of rejected proposals) no longer counts, and blocks only they used are freed."""
        state = req.spec_state.draft if req.spec_state is not None else None
        if state is None:
            return
        state.num_computed = min(state.num_computed, num_valid)
        keep = self.bm.blocks_needed(state.num_computed + 1)
        if len(state.block_table) > keep:
            self.bm.free_blocks(state.block_table[keep:])
            del state.block_table[keep:]

    def release(self, req: Request) -> None:
        """A finished request's draft blocks go back; its runner state goes with the next step."""
        state = req.spec_state.draft if req.spec_state is not None else None
        if state is not None:  # the draft runner has seen it
            self.bm.free_blocks(state.block_table)
            req.spec_state.draft = None
            self.finished_ids.append(req.request_id)
