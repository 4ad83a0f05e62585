"""The CPU KV cache's default budget: a quarter of the memory available at start-up, capped."""
from __future__ import annotations

from nanoserve import LLM
from nanoserve.runner import host_memory


def test_the_default_cpu_kv_cache_follows_available_memory(tiny_llama, monkeypatch):
    blocks = {}
    for available in (1 << 30, 64 << 30):
        monkeypatch.setattr(host_memory, "available_memory_bytes", lambda a=available: a)
        llm = LLM(str(tiny_llama), device="cpu", dtype="float32", max_num_seqs=65536,
                  max_model_len=1024)
        blocks[available] = llm.engine.executor.num_kv_blocks
        llm.close()
    # A quarter of 1 GiB, then the 4 GiB cap: 16 times the blocks.
    assert blocks[64 << 30] == 16 * blocks[1 << 30] > 0
    assert host_memory.default_cpu_kv_bytes() == host_memory.MAX_DEFAULT_KV_BYTES
