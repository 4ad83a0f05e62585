"""On an sm_90 GPU: the batch-1 layer kernel (nanoserve.kernels.layer_chain) in the engine.

One decode step through the kernel against the same step through the Triton layers and the
LM head, at contexts from none to the kernel's last key, over shuffled cache blocks: the final
hidden state, the logits and the K/V it stores. Then whole generations of one sequence at a
time against transformers (vLLM's logprobs-close rule), through the decode graphs and eagerly,
with prompts short enough for the kernel and long enough to cross into the Triton graphs.
Skipped elsewhere.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_gpu_parity import assert_greedy_close_to_transformers, random_model_dir  # noqa: E402

from cuda_layer_chain import relative_error  # noqa: E402  (benchmarks/, on the path from there)


@pytest.fixture(scope="module")
def two_layer_llm(tmp_path_factory):
    from nanoserve import LLM

    llm = LLM(str(random_model_dir("qwen3-0.6b-2layers", tmp_path_factory)), dtype="bfloat16",
              max_num_seqs=1, gpu_memory_utilization=0.3, enforce_eager=True)
    yield llm
    llm.close()


@pytest.mark.parametrize("context", [0, 1, 15, 16, 17, 100, 383, 511])
def test_a_decode_step_matches_the_triton_layers(two_layer_llm, context):
    from nanoserve.attention.metadata import attention_metadata
    from nanoserve.runner.inputs import SequenceChunk

    runner = two_layer_llm.engine.executor
    model = runner.model.model
    chain = model.layer_chain
    assert chain is not None, "the kernel was not attached to a Qwen3-0.6B-shaped model"
    gen = torch.Generator(device="cuda").manual_seed(context)
    layers = runner._attention_layers()
    for attn in layers:
        for cache in (attn.k_cache, attn.v_cache):
            cache.copy_(torch.randn(cache.shape, generator=gen, device="cuda"))
    block_size = runner.block_size
    table = torch.randperm(runner.num_kv_blocks, generator=gen, device="cuda")
    table = table[:context // block_size + 1].tolist()
    token = int(torch.randint(0, 10000, (1,), generator=gen, device="cuda"))
    chunk = SequenceChunk("r", [token], context, table, True, None, [], [], [])
    slot = table[context // block_size], context % block_size
    outputs = {}
    with torch.inference_mode():
        for name, kernel in (("chain", chain), ("triton", None)):
            ids, positions, meta, _ = runner._prepare([chunk])
            model.layer_chain = kernel
            try:
                with attention_metadata(meta):
                    hidden = runner.model(ids, positions)
                    logits = runner.model.compute_logits(hidden)
            finally:
                model.layer_chain = chain
            outputs[name] = (hidden.float(), logits.float(),
                             torch.stack([a.k_cache[slot] for a in layers]),
                             torch.stack([a.v_cache[slot] for a in layers]))
    torch.cuda.synchronize()
    assert not chain.has_failed()
    errors = [relative_error(got, want) for got, want in zip(outputs["chain"], outputs["triton"])]
    print(f"context {context}: hidden, logits, new keys, new values off by {errors}")
    # Both round to bf16 at the same points; two layers of differently ordered sums stay
    # within a few bf16 ulps (2^-8 relative).
    assert max(errors) < 1.5e-2, errors
    logits, want_logits = outputs["chain"][1], outputs["triton"][1]
    assert logits.shape == want_logits.shape == (1, runner.model_config.vocab_size)
    assert int(logits.argmax()) in want_logits[0].topk(5).indices.tolist()


def _maxima(logits: torch.Tensor) -> list[int]:
    """The indices of the largest logit, ascending (torch.argmax picks the first), NaN left
    out (as the samplers read it)."""
    values = logits.float().nan_to_num(nan=float("-inf"))
    return (values == values.max()).nonzero()[:, 0].tolist()


def _first_argmax(logits: torch.Tensor) -> int:
    return _maxima(logits)[0]


def test_the_kernel_picks_the_greedy_token(two_layer_llm):
    """With ``greedy`` the kernel writes the argmax of the logits it stored, on the device and
    into pinned host memory where an address is given: over steps in a row (its counters
    reset themselves), with the largest logit tied across rows that different blocks score
    (the lowest index wins), and with a NaN logit (never picked)."""
    from nanoserve.attention.metadata import attention_metadata
    from nanoserve.kernels.layer_chain import GreedyPick
    from nanoserve.runner.inputs import SequenceChunk

    runner = two_layer_llm.engine.executor
    chain = runner.model.model.layer_chain
    head = runner.model.lm_head.weight
    kept = head.clone()
    out = torch.full((1,), -1, dtype=torch.int64, device="cuda")
    host = torch.full((1,), -1, dtype=torch.int64, pin_memory=True)
    host_address = torch.tensor([host.data_ptr()], device="cuda")

    def step(token: int, context: int) -> tuple[int, torch.Tensor, int]:
        """The token picked on the device, the logits, the token the host memory holds."""
        table = list(range(context // runner.block_size + 1))
        chunk = SequenceChunk("r", [token], context, table, True, None, [], [], [])
        ids, positions, meta, _ = runner._prepare([chunk])
        host.fill_(-1)
        with torch.inference_mode(), attention_metadata(meta):
            hidden = runner.model(ids, positions, greedy=GreedyPick(out, host_address))
        logits = runner.model.compute_logits(hidden)
        torch.cuda.synchronize()
        return int(out.item()), logits[0], int(host)

    try:
        for i, context in enumerate((0, 5, 200, 511)):
            picked, logits, on_host = step(1000 + i, context)
            assert picked == on_host == _first_argmax(logits), context
        host_address.zero_()  # no address: the host's memory is left alone
        picked, logits, on_host = step(1000 + 3, 511)
        assert picked == _first_argmax(logits) and on_host == -1
        host_address.fill_(host.data_ptr())
        best = picked
        # The best row copied to a row scored earlier and one scored later: equal logits.
        with torch.no_grad():
            head[7].copy_(head[best])
            head[150000].copy_(head[best])
            head[3].fill_(float("nan"))
        picked, logits, on_host = step(1000 + 3, 511)
        assert torch.isnan(logits[3])
        assert len(_maxima(logits)) >= 2, "the copied rows did not tie"
        assert picked == on_host == _first_argmax(logits) == 7
    finally:
        with torch.no_grad():
            head.copy_(kept)
    assert not chain.has_failed()


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_one_sequence_at_a_time_through_the_kernel_close_to_transformers(
        enforce_eager, tmp_path_factory, monkeypatch):
    """Qwen3-0.6B's full shape, ``max_num_seqs=1``: prompts of 1-300 tokens decode in the
    kernel; 490 and 500 cross 512 keys during their 32 tokens and go on in the Triton graph
    (eagerly: the Triton layers)."""
    from nanoserve.kernels.layer_chain import LayerChain

    chains: list[LayerChain] = []
    launches = 0
    call = LayerChain.__call__

    def counted(self, *args):
        nonlocal launches
        launches += 1
        if self not in chains:
            chains.append(self)
        return call(self, *args)

    monkeypatch.setattr(LayerChain, "__call__", counted)
    assert_greedy_close_to_transformers(
        random_model_dir("qwen3-0.6b", tmp_path_factory),
        f"qwen3-0.6b through layer_chain, eager={enforce_eager}",
        prompt_lens=[1, 2, 16, 17, 120, 300, 490, 500], max_num_seqs=1,
        enforce_eager=enforce_eager)
    assert chains and launches > 0
    assert not any(chain.has_failed() for chain in chains)
