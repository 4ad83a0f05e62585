"""On a CUDA device: the engine in bf16 against transformers in bf16 on the same random weights.

Greedy, 32 tokens, 8 prompts; outputs must be equal, or at the first divergence each side's
token must be in the other's top-5 (vLLM's logprobs-close rule). Skipped without CUDA.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NEW_TOKENS = 32


def _hf_greedy_with_top5(model, prompt: list[int], **generate_args
                         ) -> tuple[list[int], list[set[int]]]:
    out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **generate_args)
    tokens = out.sequences[0, len(prompt):].tolist()
    top5 = [set(step[0].float().topk(5).indices.tolist()) for step in out.logits]
    return tokens, top5


def assert_logprobs_close(ours: list[int], our_top5: list[set[int]], theirs: list[int],
                          their_top5: list[set[int]]) -> None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            assert a in their_top5[i] and b in our_top5[i], (
                f"diverged at token {i}: ours {a} (not in their top-5 {their_top5[i]}) "
                f"or theirs {b} (not in our top-5 {our_top5[i]})")
            return


def engine_greedy_with_top5(model_dir: Path, prompts: list[list[int]], **engine_args
                            ) -> tuple[list[list[int]], list[list[set[int]]]]:
    """nanoserve's greedy tokens and, per token, its top-5 ids (bf16, engine freed after)."""
    from nanoserve import LLM, SamplingParams

    llm = LLM(str(model_dir), **{"dtype": "bfloat16", "max_num_seqs": 16,
                                 "gpu_memory_utilization": 0.5, **engine_args})
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                            logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.close()
    del llm
    torch.cuda.empty_cache()
    tokens = [o.outputs[0].token_ids for o in outs]
    # Each step's dict holds the top-5 plus the sampled token when that is not among them.
    top5 = [[set(sorted(d, key=d.get, reverse=True)[:5]) for d in o.outputs[0].logprobs]
            for o in outs]
    return tokens, top5


def random_model_dir(shape: str, tmp_path_factory) -> Path:
    """A random bf16 model of ``shape`` saved with transformers, once per session."""
    from random_models import save_random_hf_model

    model_dir = tmp_path_factory.getbasetemp() / f"hf-{shape}"
    if not (model_dir / "config.json").exists() or not list(model_dir.glob("*.safetensors")):
        save_random_hf_model(shape, model_dir)
    return model_dir


def assert_greedy_close_to_transformers(model_dir: Path, label: str, hf_cache=None,
                                        prompt_lens: list[int] | None = None,
                                        **engine_args) -> None:
    """8 random prompts (of ``prompt_lens`` ids, default 5-300), greedy, against transformers
    by the logprobs-close rule; ``hf_cache(config)``: a fresh cache for each of transformers'
    generations."""
    from transformers import AutoModelForCausalLM

    random.seed(1)
    prompt_lens = prompt_lens or [random.randint(5, 300) for _ in range(8)]
    prompts = [[random.randint(0, 10000) for _ in range(n)] for n in prompt_lens]
    all_ours, all_our_top5 = engine_greedy_with_top5(model_dir, prompts, **engine_args)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    exact = 0
    for prompt, ours, our_top5 in zip(prompts, all_ours, all_our_top5):
        cache = {} if hf_cache is None else {"past_key_values": hf_cache(model.config)}
        theirs, their_top5 = _hf_greedy_with_top5(model, prompt, **cache)
        exact += ours == theirs
        assert_logprobs_close(ours, our_top5, theirs, their_top5)
    print(f"{label}: {exact}/{len(prompts)} identical")


@pytest.mark.parametrize("shape,enforce_eager", [
    ("qwen3-0.6b", False), ("qwen3-0.6b", True), ("llama-1b", False), ("llama-1b", True),
    ("qwen2.5-0.5b", False), ("qwen3-8b", False), ("qwen3-moe-small", False),
    ("qwen3-moe-small", True)])
def test_bf16_greedy_close_to_transformers(shape, enforce_eager, tmp_path_factory):
    assert_greedy_close_to_transformers(random_model_dir(shape, tmp_path_factory),
                                        f"{shape} eager={enforce_eager}",
                                        enforce_eager=enforce_eager)


# Prompts longer than the shortened windows (256, Gemma 3's 512) as well as shorter ones.
LONG_PROMPTS = [5, 40, 200, 300, 520, 700, 1000, 1500]


@pytest.mark.parametrize("shape,prompt_lens,enforce_eager", [
    ("gemma-2-2b", None, False), ("gemma-2-2b-window256", LONG_PROMPTS, False),
    ("gemma-2-2b-window256", LONG_PROMPTS, True), ("gemma-3-1b", LONG_PROMPTS, False),
    ("phi-3-mini-4k-window256", LONG_PROMPTS, False), ("phi-4-mini-8l", None, False),
    ("deepseek-v2-lite-4l", LONG_PROMPTS, False), ("deepseek-v2-lite-4l", None, True)])
def test_bf16_newer_families_close_to_transformers(shape, prompt_lens, enforce_eager,
                                                   tmp_path_factory):
    """Gemma 2/3 (soft caps, sandwich norms folded where they are pre-norms, windows), Phi-3
    (fused checkpoints, windows freed as they slide; Phi-4-mini's partial rotary and
    longrope), DeepSeek-V2 (the latent cache, absorbed decode in the decode kernel, shared
    experts)."""
    assert_greedy_close_to_transformers(random_model_dir(shape, tmp_path_factory),
                                        f"{shape} eager={enforce_eager}",
                                        prompt_lens=prompt_lens, enforce_eager=enforce_eager)


def _teacher_forced_logprobs(model_dir: Path, dtype: torch.dtype, sequences: list[list[int]]
                             ) -> list[torch.Tensor]:
    """transformers' log-probabilities at every position of each sequence, in ``dtype``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda()
    with torch.no_grad():
        out = [model(torch.tensor([s], device="cuda")).logits[0].float().log_softmax(-1).cpu()
               for s in sequences]
    del model
    torch.cuda.empty_cache()
    return out


def _errors_from_exact(prompts: list[list[int]], steps: list[list[dict[int, float]]],
                       exact: list[torch.Tensor]) -> tuple[int, float]:
    """(how many sequences fail the top-5 rule at their first token unlike the exact model's
    choice, the mean over steps of the largest logprob error among the side's top 20) for
    ``steps[k][i]``, a side's ``{token: logprob}`` at decode step i of prompt k."""
    fails, errors = 0, []
    for prompt, side, ref in zip(prompts, steps, exact):
        failed = None
        for i, dist in enumerate(side):
            row = ref[len(prompt) + i - 1]
            ranked = sorted(dist, key=dist.get, reverse=True)
            errors.append(max(abs(dist[t] - row[t].item()) for t in ranked[:20]))
            mine, best = ranked[0], int(row.argmax())
            if failed is None and mine != best:
                failed = not (mine in set(row.topk(5).indices.tolist())
                              and best in set(ranked[:5]))
        fails += bool(failed)
    return fails, sum(errors) / len(errors)


@pytest.mark.parametrize("shape,prompt_lens,enforce_eager", [
    ("mixtral-small", None, False), ("gpt-oss-small", LONG_PROMPTS, False),
    ("gpt-oss-small", LONG_PROMPTS, True)])
def test_bf16_routed_experts_no_further_from_exact_than_transformers(
        shape, prompt_lens, enforce_eager, tmp_path_factory):
    """Mixtral and GPT-OSS (sinks in the kernels, biases and the clamped SwiGLU in the fused
    MoE): their random routers pick among near-tied experts, so any bf16 rounding flips some
    picks and greedy paths part (transformers' bf16 fails the top-5 rule against its own fp32
    on 3-5 of 8 prompts). So both bf16 models are measured against transformers in fp32,
    teacher-forced on our greedy tokens: ours may fail the rule no more often, and err by no
    more than 1.5x as much on average, as transformers' bf16."""
    from nanoserve import LLM, SamplingParams

    model_dir = random_model_dir(shape, tmp_path_factory)
    random.seed(1)
    prompt_lens = prompt_lens or [random.randint(5, 300) for _ in range(8)]
    prompts = [[random.randint(0, 10000) for _ in range(n)] for n in prompt_lens]
    llm = LLM(str(model_dir), dtype="bfloat16", max_num_seqs=16, gpu_memory_utilization=0.5,
              enforce_eager=enforce_eager)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                min_tokens=NEW_TOKENS, logprobs=20),
                        use_tqdm=False)
    llm.close()
    del llm
    torch.cuda.empty_cache()
    sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    ours = [o.outputs[0].logprobs for o in outs]
    exact = _teacher_forced_logprobs(model_dir, torch.float32, sequences)
    bf16 = _teacher_forced_logprobs(model_dir, torch.bfloat16, sequences)
    theirs = [[{t: row[t].item() for t in row.topk(20).indices.tolist()}
               for row in logprobs[len(p) - 1:len(p) - 1 + NEW_TOKENS]]
              for p, logprobs in zip(prompts, bf16)]
    our_fails, our_error = _errors_from_exact(prompts, ours, exact)
    their_fails, their_error = _errors_from_exact(prompts, theirs, exact)
    print(f"{shape} eager={enforce_eager}: top-5 rule failures ours {our_fails} / "
          f"transformers bf16 {their_fails}; mean error {our_error:.3f} / {their_error:.3f}")
    assert our_fails <= their_fails
    assert our_error <= 1.5 * their_error


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "llama-1b", "qwen2.5-0.5b"])
def test_bf16_greedy_one_sequence_at_a_time(shape, tmp_path_factory):
    """``max_num_seqs=1``: every decode step is batch 1, latency.py's path (split decode that
    reads its first K/V tile before the programmatic wait for the qkv projection). Some
    generations cross the decode graphs' context caps (512, 2048, ...) and change graphs."""
    assert_greedy_close_to_transformers(random_model_dir(shape, tmp_path_factory),
                                        f"{shape} one sequence at a time",
                                        prompt_lens=[5, 120, 300, 490, 500, 1000, 2030, 2040],
                                        max_num_seqs=1)


def test_bf16_greedy_in_small_batches(tmp_path_factory):
    """Decode batches of 1-4 rows (``max_num_seqs=4``): the skinny GEMVs where the tuning
    file or the heuristic gives them the row count (3 replays the 4-row graph), the split
    kernel finishing the new tokens at all of them."""
    assert_greedy_close_to_transformers(random_model_dir("qwen3-0.6b", tmp_path_factory),
                                        "qwen3-0.6b 4 at a time", max_num_seqs=4)


def test_bf16_greedy_of_a_larger_batch_close_to_transformers(tmp_path_factory):
    """24 sequences at once (a 32-row decode graph): split decode without the new tokens
    fused, split to even out ragged contexts (num_decode_splits' balance regime)."""
    random.seed(2)
    assert_greedy_close_to_transformers(random_model_dir("qwen3-0.6b", tmp_path_factory),
                                        "qwen3-0.6b 24 sequences",
                                        prompt_lens=[random.randint(5, 700) for _ in range(24)])


def test_fp8_kv_cache_close_to_transformers_rounding_its_cache(tmp_path_factory):
    """kv_cache_dtype="fp8" against transformers whose cache rounds keys and values to fp8."""
    from reference import fp8_rounding_cache

    assert_greedy_close_to_transformers(random_model_dir("qwen3-0.6b", tmp_path_factory),
                                        "qwen3-0.6b fp8 KV cache", fp8_rounding_cache,
                                        kv_cache_dtype="fp8")


def test_bf16_prompt_logprobs_close_to_transformers(tmp_path_factory):
    """Prompt logprobs run the prefill's every row through the LM head: on the GPU path (Triton
    prefill attention, fused ops) they stay within bf16 rounding of transformers'."""
    from transformers import AutoModelForCausalLM

    from nanoserve import LLM, SamplingParams

    model_dir = random_model_dir("qwen3-0.6b", tmp_path_factory)
    random.seed(3)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(5, 600))]
               for _ in range(4)]
    llm = LLM(str(model_dir), dtype="bfloat16", max_num_seqs=16, gpu_memory_utilization=0.5,
              max_num_batched_tokens=512)  # chunked: the longer prompts span several steps
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=5),
                        use_tqdm=False)
    llm.close()
    del llm
    torch.cuda.empty_cache()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            theirs = model(torch.tensor([prompt], device="cuda")).logits[0].float()
        theirs = theirs.log_softmax(-1).cpu()
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        diffs = torch.tensor([entries[p][prompt[p]] - theirs[p - 1, prompt[p]].item()
                              for p in range(1, len(prompt))]).abs()
        assert diffs.max() < 0.1 and diffs.mean() < 0.02, (diffs.max(), diffs.mean())
        # Our likeliest token at each position is, to bf16 rounding, one of theirs (near
        # ties among random weights' flat distributions may swap which one).
        for p, entry in enumerate(entries[1:], start=1):
            best = max(entry, key=entry.get)
            assert theirs[p - 1, best] > theirs[p - 1].max() - 0.1
