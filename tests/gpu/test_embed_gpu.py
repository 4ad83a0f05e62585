"""On a CUDA device: embeddings (task="embed") in bf16 and fp32 against the CPU's fp32 on the
same tiny random Llama, for each pooling; prompts long enough to prefill in several chunks.
Skipped without CUDA."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TEXTS = ["The capital of France is Paris, a city on the Seine with many bridges. " * 3,
         "Hello!", "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)"]


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_gpu_embeddings_match_the_cpu(tiny_llama, kind):
    from nanoserve import LLM

    def embed(**device_args):
        llm = LLM(str(tiny_llama), task="embed", pooling_type=kind, num_kv_blocks=64,
                  max_num_batched_tokens=32, **device_args)
        try:
            return np.array([o.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
        finally:
            llm.close()

    cpu = embed(device="cpu", dtype="float32")
    fp32 = embed(device="cuda", dtype="float32")
    bf16 = embed(device="cuda", dtype="bfloat16")
    np.testing.assert_allclose(fp32, cpu, atol=1e-4)
    cosine = (bf16 * cpu).sum(1)  # both normalised
    assert (cosine > 0.99).all(), cosine
