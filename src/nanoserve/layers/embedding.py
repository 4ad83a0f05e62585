"""Vocabulary-parallel token embedding and LM head (vocab padded to divide across ranks)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.parallel_state import Narrow, get_tp_group
from nanoserve.layers.quantization.gguf_blocks import BLOCK_TYPES, unpack_blocks
from nanoserve.layers.quantization.methods import RawBlocks, RawNarrow, gguf_blocks_kept
from nanoserve.layers.quantization.packed import (GroupedInts, Int4Matrix, SplitInt4Matrix,
                                                  pack_logits_matrix)


class VocabParallelEmbedding(nn.Module):
    """Each rank holds ``ceil(vocab / tp)`` rows of the vocabulary (zero padding past its end);
    lookups are all-reduced."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp = get_tp_group()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // self.tp.size)
        self.start = self.tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False)

    def checkpoint_slice(self, param: nn.Parameter, shard_id: str | int | None = None
                         ) -> Narrow | None:
        start = min(self.start, self.vocab_size)
        return Narrow(0, start, min(self.start + self.per_rank, self.vocab_size) - start)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        rows = loaded.shape[0]
        param.data[:rows].copy_(loaded)
        param.data[rows:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * mine.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary: each rank scores its slice; rank 0, which samples, gathers
    them and the other ranks get None. On the CPU, a GGUF file's quantized head (or the
    embedding it is tied to) is kept in its blocks for the int4 kernel where they fit it
    (``reads_blocks``, then ``load_blocks``): the one matrix that every token reads whole."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        self.reads_blocks = gguf_blocks_kept() and torch.empty(0).device.type == "cpu"
        self.packed: Int4Matrix | SplitInt4Matrix | None = None

    def blocks_slice(self) -> RawNarrow:
        """This rank's rows of the checkpoint tensor, as blocks."""
        return RawNarrow(*self.checkpoint_slice(self.weight))

    def load_blocks(self, raw: RawBlocks) -> None:
        """Pack this rank's rows (float types and groups the kernel cannot take stay dense),
        zero rows padding them to the rank's share and the kernel's multiple of 16."""
        if raw.type_name not in BLOCK_TYPES:
            return
        w = unpack_blocks(raw.data.cpu(), raw.type_name, raw.cols)
        pad = -(-self.per_rank // 16) * 16 - w.codes.shape[0]
        w = GroupedInts(F.pad(w.codes, (0, 0, 0, pad)), F.pad(w.scales, (0, 0, 0, pad)),
                        None if w.offsets is None else F.pad(w.offsets, (0, 0, 0, pad)),
                        w.group_size, w.four_bit)
        self.packed = pack_logits_matrix(w, self.weight.dtype)

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None
                ) -> torch.Tensor | None:
        """``out`` ([rows, vocab], one rank only) receives the logits: the decode graphs' buffer."""
        if out is not None:
            assert self.tp.size == 1, "logits are written in place only without tensor parallelism"
            return torch.mm(hidden, self.weight.t(), out=out)
        if self.packed is not None:
            flat = self.packed.matmul(hidden.reshape(-1, hidden.shape[-1]))[:, :self.per_rank]
            local = flat.reshape(*hidden.shape[:-1], self.per_rank)
        else:
            local = F.linear(hidden, self.weight)
        logits = self.tp.gather_last_dim(local)
        return None if logits is None else logits[..., :self.vocab_size]  # drop the padding's

    @torch.inference_mode()
    def warm_row_counts(self, max_rows: int) -> None:
        """This rank's GEMM at each row count to ``max_rows``: cuBLAS loads a kernel per count."""
        x = torch.zeros(max_rows, self.weight.shape[1], dtype=self.weight.dtype,
                        device=self.weight.device)
        for rows in range(1, max_rows + 1):
            F.linear(x[:rows], self.weight)
