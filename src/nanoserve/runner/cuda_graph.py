"""CUDA graphs for decode steps: captured once per batch size, replayed with padded inputs."""
from __future__ import annotations

import bisect
from typing import NamedTuple

import torch
from torch import nn

from nanoserve.attention.metadata import AttentionMetadata, attention_metadata
from nanoserve.runner.sampling_tensors import SamplingTensors


def capture_sizes(max_batch: int) -> list[int]:
    """The batch-size ladder: 1, 2, 4, 8, then steps of 16 up to ``max_batch``."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeOutput(NamedTuple):
    """A replayed decode graph's outputs, one row per sequence of the step."""

    hidden: torch.Tensor
    logits: torch.Tensor | None  # None where the graph stops at the hidden states
    # Sampled by the fused sampler inside the graph; None where the step's batch needs more
    # than temperatures (penalties, filters, ...) and the caller samples from ``logits``.
    token_ids: torch.Tensor | None


class DecodeGraphs:
    """Decode forwards (one token per sequence) captured as CUDA graphs, one per batch size.

    Inputs live in static buffers that every graph reads; a step copies its tensors into them,
    replays the smallest graph that fits, and returns the first rows of its static output. Rows
    past the batch hold padding (slot -1: nothing stored; length 1 over block 0: harmless
    reads); they are re-padded only when the batch shrinks, so a steady batch copies its
    inputs and nothing else.

    With ``sample`` the graphs also run the LM head and the fused greedy / temperature sampler
    (nanoserve.kernels.sampling), reading each step's temperatures and noise seed from static
    buffers: a step then costs the host one graph launch instead of three launches, two of them
    through Triton's Python launcher. A batch that needs more than temperatures sets the seed
    to -1, and the graph's sampling pass exits at once.
    """

    def __init__(self, model: nn.Module, max_batch: int, max_blocks: int, max_seq_len: int,
                 device: torch.device, sample: bool = False):
        self.model = model
        self.sample = sample
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
        self.temperature = torch.zeros(n, dtype=torch.float32, device=device)
        self.noise_seed = torch.full((1,), -1, dtype=torch.int64, device=device)
        if sample:  # one buffer for every size's logits and samples (a pool keeps live outputs)
            head = model.lm_head.weight
            self.logits = torch.empty(n, model.lm_head.vocab_size, dtype=head.dtype, device=device)
            self.token_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.max_seq_len = max_seq_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, DecodeOutput] = {}
        self._capture()

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(self.query_start[:bs + 1], self.seq_lens[:bs], self.slots[:bs],
                                 self.tables[:bs], max_query_len=1, max_seq_len=self.max_seq_len,
                                 seq_order=self.order[:bs])

    def _forward(self, bs: int) -> DecodeOutput:
        with attention_metadata(self._meta(bs)):
            hidden = self.model(self.ids[:bs], self.positions[:bs])
        if not self.sample:
            return DecodeOutput(hidden, None, None)
        from nanoserve.kernels.sampling import gumbel_max_sample

        logits = self.model.compute_logits(hidden, out=self.logits[:bs])
        return DecodeOutput(hidden, logits, gumbel_max_sample(
            logits, self.temperature[:bs], self.noise_seed, out=self.token_ids[:bs]))

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

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            sampling: SamplingTensors | None = None) -> DecodeOutput:
        """Replay the step. ``sampling`` describes every row (sampling graphs only; None: no
        row is sampled in the graph)."""
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
        sampled = self.sample and sampling is not None and sampling.only_temperature
        if sampled:
            self.temperature[:n].copy_(sampling.temperature)
            self.noise_seed.copy_(sampling.noise_seed)
        elif self.sample:
            self.noise_seed.fill_(-1)
        self.graphs[bs].replay()
        hidden, logits, token_ids = self.outputs[bs]
        return DecodeOutput(hidden[:n], None if logits is None else logits[:n],
                            token_ids[:n] if sampled else None)

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
