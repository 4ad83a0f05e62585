"""CUDA graphs for decode steps: captured once per batch size, replayed with padded inputs."""
from __future__ import annotations

import bisect

import torch
from torch import nn

from nanoserve.attention.metadata import AttentionMetadata, attention_metadata


def capture_sizes(max_batch: int) -> list[int]:
    """The batch-size ladder: 1, 2, 4, 8, then steps of 16 up to ``max_batch``."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    """Decode forwards (one token per sequence) captured as CUDA graphs, one per batch size.

    Inputs live in static buffers that every graph reads; a step copies its tensors into them,
    replays the smallest graph that fits, and returns the first rows of its static output. Rows
    past the batch hold padding (slot -1: nothing stored; length 1 over block 0: harmless
    reads); they are re-padded only when the batch shrinks, so a steady batch copies its
    inputs and nothing else.
    """

    def __init__(self, model: nn.Module, max_batch: int, max_blocks: int, max_seq_len: int,
                 device: torch.device):
        self.model = model
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        n = self.max_batch
        self.ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.order = torch.arange(n, dtype=torch.int32, device=device)
        self.batch_order = self.order.clone()  # padding rows keep their own place
        self.rows_in_use = n  # rows from here on hold padding (after capture: unknown, pad all)
        self.max_seq_len = max_seq_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture()

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(self.query_start[:bs + 1], self.seq_lens[:bs], self.slots[:bs],
                                 self.tables[:bs], max_query_len=1, max_seq_len=self.max_seq_len,
                                 seq_order=self.order[:bs])

    def _forward(self, bs: int) -> torch.Tensor:
        with attention_metadata(self._meta(bs)):
            return self.model(self.ids[:bs], self.positions[:bs])

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            self._forward(bs)  # compiles kernels and settles allocations outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.outputs[bs] = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (meta.decode_only and meta.num_seqs <= self.max_batch
                and meta.block_tables.shape[1] <= self.tables.shape[1])

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
            ) -> torch.Tensor:
        n = ids.shape[0]
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.order[:n].copy_(self.batch_order[:n] if meta.seq_order is None else meta.seq_order)
        width = meta.block_tables.shape[1]
        self.tables[:n, :width].copy_(meta.block_tables)
        if self.rows_in_use > n:  # a larger batch ran before: pad the rows it leaves behind
            self._pad(n, self.rows_in_use)
        self.rows_in_use = n
        self.graphs[bs].replay()
        return self.outputs[bs][:n]

    def _pad(self, start: int, end: int) -> None:
        """Padding rows: no slot (nothing stored), length 1 over block 0 (harmless reads)."""
        self.slots[start:end].fill_(-1)
        self.seq_lens[start:end].fill_(1)
        self.order[start:end].copy_(self.batch_order[start:end])
        self.tables[start:end, 0].zero_()

    def release(self) -> None:
        """Destroy the graphs. Graphs that captured NCCL collectives hold their communicator:
        it cannot be destroyed, nor its process group left, while they live."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
