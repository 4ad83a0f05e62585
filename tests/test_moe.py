"""Mixture-of-experts models (Qwen3-MoE) against transformers, token for token, on the CPU."""
from __future__ import annotations

import shutil

import pytest
import torch
from conftest import build_tiny_model
from reference import PROMPTS, greedy_params, hf_greedy
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoserve import LLM
from nanoserve.layers.moe import SparseMoeBlock

NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["qwen3-moe", "qwen3-moe-every-layer"])
def moe_model(request, tmp_path_factory, tokenizer_dir):
    return build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), tokenizer_dir)


@pytest.fixture(scope="module")
def expected(moe_model):
    model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32)
    ids = [AutoTokenizer.from_pretrained(moe_model).encode(p) for p in PROMPTS]
    return ids, hf_greedy(model, ids, NEW_TOKENS)


def generate(path, ids, **engine_args) -> list[list[int]]:
    llm = LLM(str(path), device="cpu", dtype="float32", **engine_args)
    try:
        outs = llm.generate(ids, greedy_params(NEW_TOKENS), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.close()


def test_greedy_outputs_match_transformers(moe_model, expected):
    ids, want = expected
    llm = LLM(str(moe_model), device="cpu", dtype="float32")
    layers = llm.engine.executor.model.model.layers
    kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in layers]
    llm.close()
    assert kinds == ([True, False] if "every" not in moe_model.name else [True, True])
    assert generate(moe_model, ids) == want


def test_chunked_prefill_and_preemption_keep_outputs_exact(moe_model, expected):
    ids, want = expected
    assert generate(moe_model, ids, max_num_batched_tokens=7, num_kv_blocks=12,
                    block_size=8) == want


def test_fused_expert_checkpoint_loads_the_same(moe_model, expected, tmp_path):
    """transformers 5 holds each layer's experts in two stacked tensors; a checkpoint saved in
    that layout (gate_up_proj [E, 2I, H], down_proj [E, H, I]) gives the same model."""
    tensors = load_file(str(moe_model / "model.safetensors"))
    fused, experts = {}, {}
    for name, t in tensors.items():
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            index, proj, _ = rest.split(".")
            experts.setdefault(prefix, {}).setdefault(proj, {})[int(index)] = t
        else:
            fused[name] = t
    for prefix, projs in experts.items():
        stack = {proj: torch.stack([parts[e] for e in sorted(parts)])
                 for proj, parts in projs.items()}
        fused[f"{prefix}.mlp.experts.gate_up_proj"] = torch.cat(
            [stack["gate_proj"], stack["up_proj"]], dim=1)
        fused[f"{prefix}.mlp.experts.down_proj"] = stack["down_proj"]
    folder = tmp_path / "fused"
    shutil.copytree(moe_model, folder)
    save_file(fused, str(folder / "model.safetensors"))
    ids, want = expected
    assert generate(folder, ids[:3]) == want[:3]


def test_missing_or_extra_experts_are_named(moe_model, tmp_path):
    folder = tmp_path / "edited"
    shutil.copytree(moe_model, folder)
    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    dropped = {k: v for k, v in tensors.items() if ".experts.1.up_proj." not in k}
    save_file(dropped, str(weights))
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj \(\(1, 'up'\)\)"):
        LLM(str(folder), device="cpu", dtype="float32")
    extra = dict(tensors)
    extra["model.layers.0.mlp.experts.99.down_proj.weight"] = \
        tensors["model.layers.0.mlp.experts.0.down_proj.weight"].clone()
    save_file(extra, str(weights))
    with pytest.raises(ValueError, match="expert 99"):
        LLM(str(folder), device="cpu", dtype="float32")


def test_experts_must_split_evenly_across_ranks():
    from nanoserve.layers.moe import Experts
    from nanoserve.layers.parallel_state import tensor_parallel_group

    with tensor_parallel_group(0, 3), torch.device("meta"):
        with pytest.raises(ValueError, match=r"moe_intermediate_size \(32\) is not divisible"):
            Experts(num_experts=4, hidden_size=8, intermediate_size=32)
        assert Experts(num_experts=4, hidden_size=8, intermediate_size=48).per_rank == 16
