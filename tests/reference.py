"""transformers as the reference: greedy continuations computed by `generate`."""
from __future__ import annotations

import torch

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4,",
    "The meaning of life is",
    "Translate to French: good morning, how are you today? I hope you slept well.",
    "Q: What is 2+2?\nA:",
    "Hi",
]


def hf_model_and_prompts(path) -> tuple[torch.nn.Module, list[list[int]]]:
    """transformers' fp32 model at ``path`` and PROMPTS tokenized by its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    return model, [tok.encode(p) for p in PROMPTS]


def hf_greedy(model, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of exactly ``max_new_tokens`` (EOS suppressed, as min_tokens does)."""
    outs = []
    for ids in prompt_ids:
        seq = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False)
        outs.append(seq[0, len(ids):].tolist())
    return outs


def greedy_params(max_tokens: int = 32):
    from nanoserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)


def fp8_rounding_cache(config):
    """A transformers DynamicCache whose update rounds the new keys and values to fp8."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    update = cache.update

    def to_fp8(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float8_e4m3fn).to(t.dtype)

    def rounded_update(keys, values, layer_idx, *args, **kwargs):
        return update(to_fp8(keys), to_fp8(values), layer_idx, *args, **kwargs)

    cache.update = rounded_update
    return cache


def greedy_on_both_backends(path, prompts: list[list[int]], max_tokens: int, monkeypatch,
                            **engine_args) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of one engine configuration on the PyTorch attention backend, then on the
    Triton one (its kernels as the caller runs them: interpreted on the CPU)."""
    import nanoserve.runner.model_runner as model_runner
    from nanoserve import LLM, SamplingParams
    from nanoserve.attention.triton_backend import TritonAttentionBackend

    def greedy() -> list[list[int]]:
        llm = LLM(str(path), device="cpu", dtype="float32", **engine_args)
        try:
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                        ignore_eos=True), use_tqdm=False)
        finally:
            llm.close()
        return [o.outputs[0].token_ids for o in outs]

    torch_tokens = greedy()
    monkeypatch.setattr(model_runner, "select_backend", lambda device: TritonAttentionBackend())
    return torch_tokens, greedy()
