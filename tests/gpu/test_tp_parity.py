"""On two or more CUDA devices: greedy outputs at TP=2 against TP=1 on the same random weights.

Equal, or at the first divergence each side's token is in the other's top-5. Skipped with
fewer than two GPUs.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen3-8b", "qwen3-moe-small"])
def test_tp2_greedy_close_to_tp1(shape, tmp_path_factory):
    from random_models import save_random_hf_model
    from test_gpu_parity import assert_logprobs_close, engine_greedy_with_top5

    model_dir = save_random_hf_model(shape, tmp_path_factory.mktemp("tp") / shape)
    random.seed(2)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(5, 300))]
               for _ in range(8)]
    one, one_top5 = engine_greedy_with_top5(model_dir, prompts, tensor_parallel_size=1)
    two, two_top5 = engine_greedy_with_top5(model_dir, prompts, tensor_parallel_size=2)
    for i in range(len(prompts)):
        assert_logprobs_close(two[i], two_top5[i], one[i], one_top5[i])
    print(f"{shape} TP=2 vs TP=1: {sum(a == b for a, b in zip(one, two))}/8 identical")
