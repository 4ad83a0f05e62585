"""The same model loaded from its GGUF file and from a converted HF folder gives identical logits."""
from __future__ import annotations

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoserve import LLM, SamplingParams


def test_gguf_and_converted_folder_give_identical_logprobs(smollm2_path, tmp_path):
    folder = tmp_path / "smollm2-hf"
    model = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                 dtype=torch.float32)
    # transformers will not save_pretrained a GGUF-loaded model: write what it would write.
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    folder.mkdir()
    save_file(state, folder / "model.safetensors")
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    AutoTokenizer.from_pretrained(smollm2_path.parent,
                                  gguf_file=smollm2_path.name).save_pretrained(folder)
    del model
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=20)
    results = []
    for path in (smollm2_path, folder):  # the GGUF's blocks dequantized at load, as transformers
        llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64, quantization="none")
        results.append(llm.generate(prompts, params, use_tqdm=False))
        llm.close()
    from_gguf, from_folder = results
    for a, b in zip(from_gguf, from_folder, strict=True):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # Top-20 logprobs of every step, compared exactly: same weights, same arithmetic.
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
        assert len(a.outputs[0].logprobs) == 8 and len(a.outputs[0].logprobs[0]) >= 20
