"""On a CUDA device: decode graphs that run the LM head and the fused sampler.

Every decode step's graph outputs are recorded and checked against the sampler run eagerly on
the graph's own logits (the eager engine's logits differ from the graph's in the last bf16 bit,
which can flip a draw, so the two engines are not compared token for token). Skipped without
CUDA.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, str(Path(__file__).resolve().parent))

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from test_gpu_parity import random_model_dir

    return random_model_dir("qwen3-0.6b", tmp_path_factory)


def _prompts(n: int) -> list[list[int]]:
    random.seed(4)
    return [[random.randint(0, 10000) for _ in range(random.randint(5, 200))] for _ in range(n)]


def _generate_recording(model_dir: Path, params) -> tuple[list, list[tuple], list[tuple]]:
    """Outputs of the graph engine; per replay with the graph's samples, (logits, tokens,
    temperatures, seed) cloned; and the shape of the logits each general-sampler call
    received."""
    from nanoserve import LLM
    from nanoserve.runner.cuda_graph import graph_key

    llm = LLM(str(model_dir), dtype="bfloat16", max_num_seqs=16, gpu_memory_utilization=0.5)
    runner = llm.engine.executor
    graphs, replays, sampler_inputs = runner.graphs, [], []
    run, sample = graphs.run, runner.sampler.forward
    # the graphs' static inputs, and what picks a step's graph
    regions, sizes, max_len = graphs.arena.regions, graphs.sizes, graphs.max_seq_len

    def recording_run(*args):
        out = run(*args)
        if out.token_ids is not None:
            n = out.token_ids.shape[0]
            # one region per batch size, any context
            region = regions[graph_key(sizes, max_len, n, 1)[0]]
            replays.append((out.logits.clone(), out.token_ids.clone(),
                            region.temperature[:n].clone(), region.noise_seed.clone()))
        return out

    def recording_sample(logits, tensors):
        sampler_inputs.append(tuple(logits.shape))
        return sample(logits, tensors)

    graphs.run, runner.sampler.forward = recording_run, recording_sample
    prompts = _prompts(len(params))
    outs = llm.generate(prompts, params, use_tqdm=False)
    # The wrappers refer to their objects: left in place, the cycles would keep the engine's
    # memory from the next test.
    del graphs.run, runner.sampler.forward
    llm.close()
    del llm, runner, graphs
    torch.cuda.empty_cache()
    return [o.outputs[0] for o in outs], replays, sampler_inputs


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_graph_samples_are_the_fused_sampler_on_its_logits(model_dir, temperature):
    from nanoserve import SamplingParams
    from nanoserve.kernels.sampling import sample_tokens

    params = [SamplingParams(temperature=temperature, max_tokens=NEW_TOKENS, ignore_eos=True,
                             logprobs=3)] * 8
    outs, replays, sampler_inputs = _generate_recording(model_dir, params)
    # Every decode step sampled in its graph; only the step that prefills used the sampler.
    assert len(replays) == NEW_TOKENS - 1 and len(sampler_inputs) == 1
    for logits, tokens, temperatures, seed in replays:
        assert logits.shape == (8, 151936) and (temperatures == temperature).all()
        assert torch.equal(tokens, sample_tokens(logits, temperatures, seed))
        if temperature == 0.0:
            assert seed.item() == 0 and torch.equal(tokens, logits.argmax(-1))
        else:
            assert seed.item() > 0
    if temperature:
        assert len({t for o in outs for t in o.token_ids}) > 8 * NEW_TOKENS // 2  # draws
        assert len({seed.item() for *_, seed in replays}) == len(replays)
    # The tokens the engine reports are the graph's, with logprobs from its logits.
    for row, out in enumerate(outs):
        for step, (logits, tokens, _, _) in enumerate(replays):
            token = out.token_ids[step + 1]
            assert token == tokens[row].item()
            raw = logits[row].float().log_softmax(-1)
            assert abs(out.logprobs[step + 1][token] - raw[token].item()) < 1e-4
            assert set(out.logprobs[step + 1]) >= set(raw.topk(3).indices.tolist())


def test_graph_logits_feed_the_general_sampler(model_dir):
    """A batch with top-p, penalties and seeds samples eagerly from the graph's logits, and
    seeded requests come out the same in a second engine."""
    from nanoserve import SamplingParams

    params = [SamplingParams(temperature=0.9, top_p=0.8, seed=i, max_tokens=16,
                             ignore_eos=True) for i in range(3)]
    params += [SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=16,
                              ignore_eos=True)]
    first, replays, sampler_inputs = _generate_recording(model_dir, params)
    assert not replays and len(sampler_inputs) == 16
    assert set(sampler_inputs) == {(4, 151936)}
    again, _, _ = _generate_recording(model_dir, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
