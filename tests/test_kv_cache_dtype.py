"""kv_cache_dtype="fp8": keys and values stored as fp8 e4m3 and read back as stored.

The reference is transformers with a cache that rounds every key and value it receives to fp8
before keeping and returning them: the same numbers the engine's attention reads. fp32 on the
CPU, so greedy outputs must be equal token for token.
"""
from __future__ import annotations

import pytest
import torch
from reference import fp8_rounding_cache, greedy_params, hf_model_and_prompts

from nanoserve import LLM

NEW_TOKENS = 24


def hf_greedy_fp8_cache(model, prompts: list[list[int]]) -> list[list[int]]:
    outs = []
    for ids in prompts:
        seq = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False,
                             past_key_values=fp8_rounding_cache(model.config))
        outs.append(seq[0, len(ids):].tolist())
    return outs


# transformers 5.2x renames generate's past_key_values to cache; 5.1x knows only the former.
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
def test_fp8_cache_matches_transformers_with_rounded_keys_and_values(arch, request):
    path = request.getfixturevalue(arch)
    model, prompts = hf_model_and_prompts(path)
    want = hf_greedy_fp8_cache(model, prompts)
    # Preemption and chunked prefill re-read what was stored, as stored.
    for extra in ({}, dict(num_kv_blocks=24, block_size=8, max_num_batched_tokens=7)):
        llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_dtype="fp8", **extra)
        outs = llm.generate(prompts, greedy_params(NEW_TOKENS), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, extra
    # Rounding is visible: the fp32 cache answers otherwise somewhere.
    llm = LLM(str(path), device="cpu", dtype="float32")
    outs = llm.generate(prompts, greedy_params(NEW_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] != want


def test_fp8_cache_holds_four_times_the_blocks_of_fp32(tiny_llama):
    blocks = [LLM(str(tiny_llama), device="cpu", dtype="float32", kv_cache_memory=1 << 22,
                  kv_cache_dtype=name).engine.stats().num_total_blocks
              for name in ("auto", "fp8_e4m3")]
    assert blocks[1] == 4 * blocks[0]


def test_unknown_kv_cache_dtype_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        LLM(str(tiny_llama), device="cpu", kv_cache_dtype="int4")


def test_fp8_cache_on_a_gpu_without_fp8_conversions_is_refused(monkeypatch):
    """Triton converts to and from fp8 e4m3 on compute capability 8.9 and newer only."""
    from nanoserve.runner.device import resolve_kv_cache_dtype

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability 8.9"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, cuda)
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, cuda) == torch.float8_e4m3fn
