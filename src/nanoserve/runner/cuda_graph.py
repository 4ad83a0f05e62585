"""CUDA graphs for decode steps, replayed with padded inputs."""
from __future__ import annotations

import bisect
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from nanoserve.attention.metadata import AttentionMetadata, attention_metadata
from nanoserve.runner.graph_inputs import DecodeRows, GraphArena
from nanoserve.runner.inputs import FAILED_ROW, SequenceChunk


# A graph's attention launch (splits, tiling) is fixed by the max_seq_len it is captured with:
# small batches get a graph per context cap (x4 steps), so splits suit a context within 4x.
SHORTEST_CONTEXT_CAP = 512
SHORT_CONTEXT_MAX_BATCH = 8
GraphKey = tuple[int, int]  # batch size, context cap


def capture_sizes(max_batch: int) -> list[int]:
    """The batch-size ladder: 1, 2, 4, 8, then steps of 16 up to ``max_batch``."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


def context_caps(bs: int, max_seq_len: int) -> list[int]:
    """The longest contexts that graphs of batch size ``bs`` are captured for, ascending."""
    caps, cap = [], SHORTEST_CONTEXT_CAP
    while cap < max_seq_len and bs <= SHORT_CONTEXT_MAX_BATCH:
        caps.append(cap)
        cap *= 4
    return caps + [max_seq_len]


def graph_key(sizes: list[int], max_seq_len: int, num_seqs: int, longest_context: int) -> GraphKey:
    """(batch size, context cap) of the graph that runs a batch of ``num_seqs`` whose longest
    context, new token included, is ``longest_context``: the smallest that fit it."""
    bs = sizes[bisect.bisect_left(sizes, num_seqs)]
    caps = context_caps(bs, max_seq_len)
    return bs, caps[min(bisect.bisect_left(caps, longest_context), len(caps) - 1)]


class DecodeOutput(NamedTuple):
    """A replayed decode graph's outputs, one row per sequence of the step."""

    hidden: torch.Tensor
    logits: torch.Tensor | None  # None where the graph stops at the hidden states
    token_ids: torch.Tensor | None  # None where the batch needs more than the fused sampler
    # token_ids with FAILED_ROW where the row's logits are not usable (see mark_failed_rows);
    # token_ids, not these, feed the next step.
    checked_ids: torch.Tensor | None = None


class DecodeGraphs:
    """Decode forwards as CUDA graphs per batch size (and context cap, for small batches); a step
    stages its inputs in the arena and replays the smallest that fits. With ``sample`` they also
    run the LM head and fused sampler; a batch needing more stages seed -1: no draw. With
    ``rows_share_sequences`` a row may be a later token of the sequence of the rows before it
    (a verify step's rows, see graph_inputs.verify_rows)."""

    def __init__(self, model: nn.Module, max_batch: int, max_blocks: int, max_seq_len: int,
                 device: torch.device, sample: bool = False, max_samples: int = 0,
                 rows_share_sequences: bool = False, num_groups: int = 1):
        self.model = model
        self.sample = sample
        self.rows_share_sequences = rows_share_sequences
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.arena = GraphArena(self.sizes, max_blocks, max_samples, device, num_groups)
        self.samples = self.arena.samples
        self.query_start = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device)
        if sample:  # one buffer for every size's logits (a pool keeps live outputs)
            self.logits = torch.empty(self.max_batch, model.lm_head.vocab_size,
                                      dtype=model.lm_head.weight.dtype, device=device)
            self.checked = torch.empty(self.max_batch, dtype=torch.int64, device=device)
        self.max_seq_len = max_seq_len
        # Graphs of one batch size share its arena region.
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, DecodeOutput] = {}
        self._capture()

    @staticmethod
    def arena_bytes(max_batch: int, max_blocks: int, max_samples: int, num_groups: int = 1
                    ) -> int:
        """Bytes of the input arena that graphs for batches up to ``max_batch`` keep."""
        return GraphArena.layout(capture_sizes(max_batch), max_blocks, max_samples,
                                 num_groups)[1]

    def _forward(self, bs: int, cap: int) -> DecodeOutput:
        region = self.arena.regions[bs]
        meta = AttentionMetadata(self.query_start[:bs + 1], region.seq_lens, region.slots,
                                 region.tables, max_query_len=1, max_seq_len=cap,
                                 seq_order=region.order,
                                 rows_share_sequences=self.rows_share_sequences)
        if region.num_groups > 1:
            meta = meta.with_groups(region.group_tables, region.group_slots)
        with attention_metadata(meta):
            hidden = self.model(region.sources, region.positions, self.arena.int64)
        if not self.sample:
            return DecodeOutput(hidden, None, None)
        from nanoserve.kernels.sampling import sample_tokens

        logits = self.model.compute_logits(hidden, out=self.logits[:bs])
        # The sampler also marks the rows whose logits are unusable, in the same pass.
        token_ids = sample_tokens(logits, region.temperature, region.noise_seed,
                                  out=self.samples[:bs], checked_out=self.checked[:bs],
                                  void_id=FAILED_ROW)
        return DecodeOutput(hidden, logits, token_ids, self.checked[:bs])

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        # Largest first (more splits need more scratch): later graphs reuse the earlier memory.
        keys = [(bs, cap) for bs in self.sizes for cap in context_caps(bs, self.max_seq_len)]
        for key in sorted(keys, reverse=True):
            self._forward(*key)  # compiles kernels and settles allocations outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.outputs[key] = self._forward(*key)
            pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()

    def accepts(self, chunks: list[SequenceChunk]) -> bool:
        """Whether the graphs run this step: one sampled token per sequence (not a prompt's)."""
        return 0 < len(chunks) <= self.max_batch and all(
            len(c.token_ids) == 1 and c.sample for c in chunks)

    def run(self, rows: DecodeRows, temperature: np.ndarray | None = None,
            noise_seed: int = -1) -> DecodeOutput:
        """Replay the step; with ``temperature`` (float32 per row, 0: greedy) and ``noise_seed``
        a sampling graph samples every row. ``samples`` must hold ``rows.sample_rows``."""
        n = len(rows.positions)
        sampled = self.sample and temperature is not None
        key = graph_key(self.sizes, self.max_seq_len, n, int(rows.seq_lens.max()))
        self.arena.stage(key[0], rows, temperature if sampled else None,
                         noise_seed if sampled else -1)
        self.graphs[key].replay()
        hidden, logits, token_ids, checked = self.outputs[key]
        return DecodeOutput(hidden[:n], None if logits is None else logits[:n],
                            token_ids[:n] if sampled else None,
                            checked[:n] if sampled else None)

    def release(self) -> None:
        """Destroy the graphs. Graphs that captured NCCL collectives hold their communicator:
        it cannot be destroyed, nor its process group left, while they live."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
