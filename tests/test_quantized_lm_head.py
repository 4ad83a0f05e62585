"""The CPU LM head of a GGUF file kept in its blocks: codes of up to 8 bits split into two int4
matrices against float64, the head's logits against the gguf package's dequantized weight
(padding rows dropped), types the kernel cannot take left dense, and the SmolLM2 file's tied
Q8_0 embedding packed only when its weights are kept quantized."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from nanoserve import LLM
from nanoserve.layers.embedding import ParallelLMHead
from nanoserve.layers.quantization.gguf_blocks import BLOCK_TYPES
from nanoserve.layers.quantization.methods import RawBlocks, quantized_linears
from nanoserve.layers.quantization.packed import (GroupedInts, Int4Matrix, SplitInt4Matrix,
                                                  pack_logits_matrix)
from nanoserve.layers.quantization.spec import QuantSpec

TOL = 2e-2  # the CPU int4 kernel computes in bfloat16 (scales, activations and its output)


@pytest.mark.parametrize("signed,offsets", [(True, False), (False, True)])
def test_split_matrix_matches_float64(signed, offsets):
    gen = torch.Generator().manual_seed(0)
    lo, hi = (-128, 128) if signed else (0, 64)  # Q8_0's signed bytes; 6-bit K-quant codes
    codes = torch.randint(lo, hi, (48, 128), generator=gen).to(torch.int8)
    scales = torch.rand(48, 4, generator=gen) * 0.02 + 0.001
    w = GroupedInts(codes, scales, torch.randn(48, 4, generator=gen) * 0.05 if offsets
                    else None, 32, False)
    matrix = pack_logits_matrix(w, torch.float32)
    assert isinstance(matrix, SplitInt4Matrix)
    x = torch.randn(3, 128, generator=gen)
    want = x.double() @ w.dequantize().double().t()
    got = matrix.matmul(x)
    assert got.dtype == torch.float32 and got.shape == (3, 48)
    torch.testing.assert_close(got.double(), want, rtol=TOL, atol=TOL * want.abs().max())


def test_logits_matrix_takes_only_the_kernels_groups():
    codes = torch.zeros(16, 64, dtype=torch.int8)
    assert isinstance(pack_logits_matrix(GroupedInts(codes, torch.ones(16, 2), None, 32, True),
                                         torch.float32), Int4Matrix)
    assert pack_logits_matrix(GroupedInts(codes, torch.ones(16, 4), None, 16, False),
                              torch.float32) is None  # Q6_K's groups of 16


def _random_blocks(type_name: str, rows: int, cols: int) -> np.ndarray:
    per_block, nbytes = BLOCK_TYPES[type_name][:2]
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (rows, cols // per_block, nbytes), dtype=np.uint8)
    for at in {"Q6_K": [208], "Q8_0": [0], "Q4_0": [0]}.get(type_name, [0, 2]):
        d = rng.uniform(-0.05, 0.05, (rows, cols // per_block, 1)).astype(np.float16)
        raw[..., at:at + 2] = d.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name,packed", [("Q8_0", SplitInt4Matrix), ("Q4_1", Int4Matrix),
                                              ("Q4_K", Int4Matrix), ("Q6_K", None)])
def test_head_logits_match_the_dequantized_weight(type_name, packed):
    vocab, hidden = 100, 256  # rows padded to the kernel's multiple of 16, then dropped
    with quantized_linears(QuantSpec("gguf")), torch.device("cpu"):
        head = ParallelLMHead(vocab, hidden)
    assert head.reads_blocks
    raw = _random_blocks(type_name, vocab, hidden)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]))
    head.weight_loader(head.weight, dense)
    head.load_blocks(RawBlocks(torch.from_numpy(raw), type_name, hidden))
    assert type(head.packed) is packed if packed else head.packed is None
    x = torch.randn(5, hidden)
    want = x.double() @ dense.double().t()
    got = head(x)
    assert got.shape == (5, vocab)
    torch.testing.assert_close(got.double(), want, rtol=TOL, atol=TOL * want.abs().max())


def test_head_reads_blocks_only_for_kept_gguf():
    with torch.device("cpu"):
        assert not ParallelLMHead(32, 64).reads_blocks
        with quantized_linears(QuantSpec("gguf", dequantize=True)):
            assert not ParallelLMHead(32, 64).reads_blocks


def test_smollm2_tied_embedding_is_packed_for_the_head(smollm2_path):
    kinds = {}
    for option in ("auto", "none"):
        llm = LLM(str(smollm2_path), device="cpu", num_kv_blocks=8, max_num_seqs=1,
                  quantization=option)
        try:
            model = llm.engine.executor.model
            kinds[option] = type(model.lm_head.packed)
            assert model.lm_head.weight is model.model.embed_tokens.weight  # lookups stay dense
        finally:
            llm.close()
    assert kinds == {"auto": SplitInt4Matrix, "none": type(None)}
