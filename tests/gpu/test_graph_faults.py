"""On a CUDA device: a NaN in one sequence's decode, inside the CUDA graphs, fails that request
alone. After its prefill the target's K/V blocks are overwritten with NaN, so its later decode
steps (graph replays that also sample) give NaN logits; the check inside the graph marks its
row, and the other requests keep exactly the tokens of a run without the fault. Skipped without
CUDA."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, str(Path(__file__).resolve().parent))

NUM_REQUESTS, TARGET, NEW_TOKENS = 8, 3, 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from test_gpu_parity import random_model_dir

    return random_model_dir("qwen3-0.6b", tmp_path_factory)


def _run(llm, poison: bool) -> dict[str, tuple[str, list[int]]]:
    """(finish reason, tokens) per request; with ``poison``, TARGET's K/V turn NaN after its
    first token."""
    from nanoserve import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i in range(NUM_REQUESTS):
        engine.add_request(f"r{i}", [100 + i] + list(range(200, 200 + 20 * (i + 1))), params)
    done: dict[str, tuple[str, list[int]]] = {}
    poisoned = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.finish_reason, list(c.token_ids))
        target = next((r for r in engine.scheduler.running if r.request_id == f"r{TARGET}"),
                      None)
        if poison and not poisoned and target is not None and target.num_output_tokens >= 1:
            blocks = torch.tensor(target.block_table, device="cuda")
            for layer in engine.executor.attention:
                layer.k_cache[blocks] = float("nan")
            poisoned = True
    assert poisoned or not poison
    return done


def test_nan_in_a_graph_decode_fails_that_request_alone(model_dir):
    from nanoserve import LLM

    llm = LLM(str(model_dir), dtype="bfloat16", max_num_seqs=16, gpu_memory_utilization=0.3,
              enable_prefix_caching=False)
    assert llm.engine.executor.graphs is not None and llm.engine.executor.graphs.sample
    clean = _run(llm, poison=False)
    faulty = _run(llm, poison=True)
    llm.close()
    assert faulty[f"r{TARGET}"][0] == "error"
    assert len(faulty[f"r{TARGET}"][1]) < NEW_TOKENS
    for i in range(NUM_REQUESTS):
        if i != TARGET:
            assert faulty[f"r{i}"] == clean[f"r{i}"], i
