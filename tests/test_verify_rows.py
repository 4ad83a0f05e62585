"""A verify step's tokens as one-token decode rows (graph_inputs.verify_rows), as the CUDA graphs
run them: attention over those rows must equal causal attention over the same chunks.

The PyTorch backend on the CPU (fp32, to 1e-5); on a CUDA device also the Triton backend, at
row counts where the decode kernel would otherwise store each row's new K/V itself (bf16).
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from nanoserve.attention.backend import select_backend
from nanoserve.attention.metadata import AttentionMetadata
from nanoserve.layers.rotary import RotaryEmbedding
from nanoserve.runner.graph_inputs import verify_rows
from nanoserve.runner.inputs import SequenceChunk
from nanoserve.runner.step_inputs import prepare_inputs
from nanoserve.sampling_params import SamplingParams

BLOCK_SIZE = 16
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _chunks(contexts: list[int], drafts: list[int], seed: int) -> list[SequenceChunk]:
    """Each sequence's last known token at ``contexts[i]`` and ``drafts[i]`` proposals, its
    blocks drawn at random from a shared pool."""
    rng = random.Random(seed)
    pool = rng.sample(range(1, 64), 63)
    chunks = []
    for i, (start, d) in enumerate(zip(contexts, drafts)):
        n_blocks = -(-(start + 1 + d) // BLOCK_SIZE)
        table, pool = pool[:n_blocks], pool[n_blocks:]
        tokens = [rng.randrange(100) for _ in range(1 + d)]
        chunks.append(SequenceChunk(str(i), tokens, start, table, True, SamplingParams(),
                                    [], [], [], num_draft_tokens=d))
    return chunks


def _row_metadata(chunks: list[SequenceChunk], device: torch.device
                  ) -> tuple[torch.Tensor, AttentionMetadata]:
    rows = verify_rows(chunks, BLOCK_SIZE)
    n = len(rows.positions)

    def put(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    meta = AttentionMetadata(torch.arange(n + 1, dtype=torch.int32, device=device),
                             put(rows.seq_lens), put(rows.slots), put(rows.tables),
                             max_query_len=1, max_seq_len=int(rows.seq_lens.max()),
                             seq_order=put(rows.order), rows_share_sequences=True)
    return put(rows.positions), meta


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("contexts,drafts", [([37], [4]), ([5, 100], [2, 0]),
                                             ([16, 31, 600], [4, 1, 3])])
def test_verify_rows_attend_as_causal_chunks(device, contexts, drafts):
    device = torch.device(device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    heads, kv_heads, head_dim = 8, 2, 64
    chunks = _chunks(contexts, drafts, seed=len(contexts))
    backend = select_backend(device)
    rotary = RotaryEmbedding(head_dim, 1024, 10000.0, None).to(device)
    gen = torch.Generator().manual_seed(sum(contexts))
    cache = torch.randn(2, 64, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(device, dtype)
    num_tokens = sum(len(c.token_ids) for c in chunks)
    q, k, v = (torch.randn(num_tokens, h, head_dim, generator=gen).to(device, dtype)
               for h in (heads, kv_heads, kv_heads))
    scale = head_dim ** -0.5

    tile = backend.prefill_tile(heads, kv_heads, head_dim, device)
    _, positions, meta, _ = prepare_inputs(chunks, BLOCK_SIZE, device, None, {},
                                           prefill_tile=tile)
    want_cache = cache.clone()
    want = backend.attention(positions, q.clone(), k, v, want_cache[0], want_cache[1], meta,
                             rotary, scale)

    row_positions, row_meta = _row_metadata(chunks, device)
    assert torch.equal(row_positions, positions)
    assert torch.equal(row_meta.slot_mapping, meta.slot_mapping)
    got_cache = cache.clone()
    got = backend.attention(row_positions, q.clone(), k, v, got_cache[0], got_cache[1],
                            row_meta, rotary, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got_cache, want_cache, atol=tol, rtol=tol)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
