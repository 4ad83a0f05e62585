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

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

NEW_TOKENS = 32


def _run(model_dir: Path, prompts: list[list[int]], tp: int):
    from nanoserve import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="bfloat16", tensor_parallel_size=tp, max_num_seqs=16,
              gpu_memory_utilization=0.5)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                            logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.close()
    del llm
    torch.cuda.empty_cache()
    tokens = [o.outputs[0].token_ids for o in outs]
    top5 = [[set(sorted(d, key=d.get, reverse=True)[:5]) for d in o.outputs[0].logprobs]
            for o in outs]
    return tokens, top5


def test_tp2_greedy_close_to_tp1(tmp_path_factory):
    from common import save_random_hf_model
    from test_gpu_parity import assert_logprobs_close

    model_dir = save_random_hf_model("qwen3-0.6b", tmp_path_factory.mktemp("tp") / "qwen3")
    random.seed(2)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(5, 300))]
               for _ in range(8)]
    one, one_top5 = _run(model_dir, prompts, 1)
    two, two_top5 = _run(model_dir, prompts, 2)
    for i in range(len(prompts)):
        assert_logprobs_close(two[i], two_top5[i], one[i], one_top5[i])
    print(f"TP=2 vs TP=1: {sum(a == b for a, b in zip(one, two))}/8 identical")
