"""On a CUDA device: an engine stays within ``gpu_memory_utilization`` of the card, its decode
graphs (input arena, activation pool) included, which are captured after the KV cache is sized.
Skipped without CUDA.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Device memory outside PyTorch's allocator that an engine may add after sizing its cache:
# loaded kernel modules, CUDA graph objects.
SLACK_BYTES = 64 << 20


def test_engine_stays_within_its_share_of_the_card(tmp_path_factory):
    from test_gpu_parity import random_model_dir

    from nanoserve import LLM, SamplingParams

    model_dir = random_model_dir("qwen3-0.6b", tmp_path_factory)
    utilization = 0.3
    # 512 sequences at the model's 40,960-token context: an 83 MB graph input arena.
    llm = LLM(str(model_dir), dtype="bfloat16", max_num_seqs=512,
              gpu_memory_utilization=utilization)
    llm.generate([[1, 2, 3, 4]] * 8, SamplingParams(max_tokens=4), use_tqdm=False)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    used = total - free
    print(f"used {used / 2**20:.0f} MiB of {utilization * total / 2**20:.0f} MiB allowed; "
          f"KV blocks {llm.engine.stats().num_total_blocks}")
    llm.close()
    del llm
    torch.cuda.empty_cache()
    assert used <= utilization * total + SLACK_BYTES
