"""Host time of the prefix cache's bookkeeping for one 16384-token prefill step: allocating
and registering its 1024 blocks (16-token blocks, 64 prompts of 256 ids), then looking the
64 prompts up again (all hits). Best of 5; prints one JSON line. No GPU needed.

    python benchmarks/prefix_hashing.py
"""
from __future__ import annotations

import random
import time

from common import emit

from nanoserve.engine.block_manager import BlockManager

BLOCK_SIZE, PROMPTS, PROMPT_LEN, REPEATS = 16, 64, 256, 5


def main() -> None:
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]
    blocks_per_prompt = PROMPT_LEN // BLOCK_SIZE
    register = lookup = float("inf")
    for _ in range(REPEATS):
        bm = BlockManager(PROMPTS * blocks_per_prompt, BLOCK_SIZE)
        start = time.perf_counter()
        for prompt in prompts:
            table = bm.allocate(blocks_per_prompt)
            bm.register_full_blocks(table, prompt, PROMPT_LEN, 0)
        register = min(register, time.perf_counter() - start)
        start = time.perf_counter()
        for prompt in prompts:
            assert len(bm.match_prefix(prompt + [1])) == blocks_per_prompt
        lookup = min(lookup, time.perf_counter() - start)
    emit({"bench": "prefix_hashing", "blocks": PROMPTS * blocks_per_prompt,
          "allocate_register_ms": round(register * 1e3, 3), "lookup_ms": round(lookup * 1e3, 3),
          "date": time.strftime("%Y-%m-%d")})


if __name__ == "__main__":
    main()
