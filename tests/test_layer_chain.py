"""Which models and steps the batch-1 layer kernel (nanoserve.kernels.layer_chain) takes, off
the device: Qwen3-0.6B's layer shape in bf16 on one GPU, one-token steps of one sequence up to
MAX_KEYS keys; everything else keeps the Triton path. The kernel's build is tested in
test_cuda_layer_chain.py, its results on the H200 in tests/gpu/test_layer_chain_gpu.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from nanoserve.attention.metadata import AttentionMetadata
from nanoserve.config import EngineConfig, ModelConfig
from nanoserve.kernels.layer_chain import (MAX_KEYS, device_unsupported_reason,
                                           model_unsupported_reason, runs_step)

QWEN3_0_6B = ModelConfig(
    architecture="Qwen3ForCausalLM", hidden_size=1024, intermediate_size=3072, num_layers=28,
    num_heads=16, num_kv_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
    rope_theta=1e6, rope_scaling=None, max_position_embeddings=40960, tie_word_embeddings=True,
    attention_bias=False, qk_norm=True, torch_dtype="bfloat16")
BF16 = torch.bfloat16


def test_qwen3_0_6b_in_bf16_on_one_gpu_is_supported_at_any_depth():
    assert model_unsupported_reason(QWEN3_0_6B, BF16, BF16, 1) is None
    two_layers = dataclasses.replace(QWEN3_0_6B, num_layers=2)
    assert model_unsupported_reason(two_layers, BF16, BF16, 1) is None


@pytest.mark.parametrize("change, dtype, kv_dtype, tp, reason", [
    ({}, BF16, BF16, 2, "tensor parallelism"),
    ({}, torch.float16, torch.float16, 1, "bf16"),
    ({}, BF16, torch.float8_e4m3fn, 1, "bf16"),
    ({"hidden_size": 4096, "intermediate_size": 12288, "num_heads": 32}, BF16, BF16, 1,
     "Qwen3-0.6B's layers"),
    ({"head_dim": 64}, BF16, BF16, 1, "Qwen3-0.6B's layers"),
    ({"qk_norm": False}, BF16, BF16, 1, "q/k norms"),
    ({"attention_bias": True}, BF16, BF16, 1, "no biases"),
    ({"moe_layers": (0, 1)}, BF16, BF16, 1, "dense MLP"),
])
def test_other_models_and_settings_keep_the_triton_path(change, dtype, kv_dtype, tp, reason):
    cfg = dataclasses.replace(QWEN3_0_6B, **change)
    assert reason in model_unsupported_reason(cfg, dtype, kv_dtype, tp)


def test_a_cpu_device_is_refused():
    assert device_unsupported_reason(torch.device("cpu")) == "not a CUDA device"


def _meta(num_seqs: int, max_query_len: int, max_seq_len: int) -> AttentionMetadata:
    empty = torch.zeros(num_seqs, dtype=torch.int32)
    return AttentionMetadata(torch.zeros(num_seqs + 1, dtype=torch.int32), empty,
                             torch.zeros(num_seqs * max_query_len, dtype=torch.int64),
                             torch.zeros(num_seqs, 1, dtype=torch.int32), max_query_len,
                             max_seq_len)


@pytest.mark.parametrize("tokens, max_query_len, max_seq_len, runs", [
    (1, 1, 1, True),  # a one-token prompt
    (1, 1, 384, True),
    (1, 1, MAX_KEYS, True),  # the 512-key decode graph of batch 1
    (1, 1, MAX_KEYS + 1, False),  # longer contexts: the Triton split-K attention
    (2, 1, 100, False),  # two sequences
    (5, 5, 100, False),  # a prefill chunk
])
def test_one_token_of_one_sequence_within_the_kernels_keys_runs(tokens, max_query_len,
                                                                  max_seq_len, runs):
    ids = torch.zeros(tokens, dtype=torch.int64)
    num_seqs = tokens // max_query_len
    assert runs_step(ids, _meta(num_seqs, max_query_len, max_seq_len)) is runs


def test_persistent_decode_is_on_by_default_and_must_be_a_bool():
    assert EngineConfig().persistent_decode is True
    assert EngineConfig(persistent_decode=False).persistent_decode is False
    with pytest.raises(ValueError, match="persistent_decode must be a bool"):
        EngineConfig(persistent_decode="no")
