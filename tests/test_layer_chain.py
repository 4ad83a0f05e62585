"""Which models and steps the batch-1 layer kernel (nanoserve.kernels.layer_chain) takes, off
the device: Qwen3-0.6B's layer shape in bf16 on one GPU, one-token steps of one sequence up to
MAX_KEYS keys; everything else keeps the Triton path. The kernel's build is tested in
test_cuda_layer_chain.py, its results on the H200 in tests/gpu/test_layer_chain_gpu.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from nanoserve.attention.metadata import AttentionMetadata
from nanoserve.config import EngineConfig, ModelConfig
from nanoserve.kernels.layer_chain import (MAX_KEYS, GreedyPick, device_unsupported_reason,
                                           model_unsupported_reason, runs_step)

QWEN3_0_6B = ModelConfig(
    architecture="Qwen3ForCausalLM", hidden_size=1024, intermediate_size=3072, num_layers=28,
    num_heads=16, num_kv_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
    rope_theta=1e6, rope_scaling=None, max_position_embeddings=40960, tie_word_embeddings=True,
    attention_bias=False, qk_norm=True, torch_dtype="bfloat16")
BF16 = torch.bfloat16


def test_qwen3_0_6b_in_bf16_on_one_gpu_is_supported_at_any_depth():
    assert model_unsupported_reason(QWEN3_0_6B, BF16, BF16, 1) is None
    two_layers = dataclasses.replace(QWEN3_0_6B, num_layers=2)
    assert model_unsupported_reason(two_layers, BF16, BF16, 1) is None


@pytest.mark.parametrize("change, dtype, kv_dtype, tp, reason", [
    ({}, BF16, BF16, 2, "tensor parallelism"),
    ({}, torch.float16, torch.float16, 1, "bf16"),
    ({}, BF16, torch.float8_e4m3fn, 1, "bf16"),
    ({"hidden_size": 4096, "intermediate_size": 12288, "num_heads": 32}, BF16, BF16, 1,
     "Qwen3-0.6B's layers"),
    ({"head_dim": 64}, BF16, BF16, 1, "Qwen3-0.6B's layers"),
    ({"qk_norm": False}, BF16, BF16, 1, "q/k norms"),
    ({"attention_bias": True}, BF16, BF16, 1, "no biases"),
    ({"moe_layers": (0, 1)}, BF16, BF16, 1, "dense MLP"),
])
def test_other_models_and_settings_keep_the_triton_path(change, dtype, kv_dtype, tp, reason):
    cfg = dataclasses.replace(QWEN3_0_6B, **change)
    assert reason in model_unsupported_reason(cfg, dtype, kv_dtype, tp)


def test_a_cpu_device_is_refused():
    assert device_unsupported_reason(torch.device("cpu")) == "not a CUDA device"


@pytest.mark.parametrize("capability, sms, mps, compiler, reason", [
    ((9, 0), 132, None, "nvcc", None),  # an H100 / H200
    ((9, 0), 132, "100", "nvrtc", None),
    ((8, 0), 108, None, "nvcc", "sm_90"),  # an A100
    ((10, 0), 148, None, "nvcc", "sm_90"),  # a B200: no tuned build
    ((9, 0), 114, None, "nvcc", "at least 128 SMs"),  # an H100 PCIe
    ((9, 0), 132, "50", "nvcc", "MPS"),
    ((9, 0), 132, None, None, "no CUDA compiler"),
])
def test_the_device_needs_sm90_every_sm_and_a_compiler(monkeypatch, capability, sms, mps,
                                                        compiler, reason):
    import types

    import nanoserve.kernels.layer_chain as layer_chain
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(multi_processor_count=sms))
    monkeypatch.setattr(layer_chain, "available_compiler", lambda: compiler)
    if mps is None:
        monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    else:
        monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", mps)
    got = device_unsupported_reason(torch.device("cuda"))
    assert got is None if reason is None else reason in got


def _meta(num_seqs: int, max_query_len: int, max_seq_len: int) -> AttentionMetadata:
    empty = torch.zeros(num_seqs, dtype=torch.int32)
    return AttentionMetadata(torch.zeros(num_seqs + 1, dtype=torch.int32), empty,
                             torch.zeros(num_seqs * max_query_len, dtype=torch.int64),
                             torch.zeros(num_seqs, 1, dtype=torch.int32), max_query_len,
                             max_seq_len)


@pytest.mark.parametrize("tokens, max_query_len, max_seq_len, runs", [
    (1, 1, 1, True),  # a one-token prompt
    (1, 1, 384, True),
    (1, 1, MAX_KEYS, True),  # the 512-key decode graph of batch 1
    (1, 1, MAX_KEYS + 1, False),  # longer contexts: the Triton split-K attention
    (2, 1, 100, False),  # two sequences
    (5, 5, 100, False),  # a prefill chunk
])
def test_one_token_of_one_sequence_within_the_kernels_keys_runs(tokens, max_query_len,
                                                                  max_seq_len, runs):
    ids = torch.zeros(tokens, dtype=torch.int64)
    num_seqs = tokens // max_query_len
    assert runs_step(ids, _meta(num_seqs, max_query_len, max_seq_len)) is runs


def test_persistent_decode_is_on_by_default_and_must_be_a_bool():
    assert EngineConfig().persistent_decode is True
    assert EngineConfig(persistent_decode=False).persistent_decode is False
    with pytest.raises(ValueError, match="persistent_decode must be a bool"):
        EngineConfig(persistent_decode="no")


class TorchLayerChain:
    """The kernel's contract in PyTorch: from the token id, the final hidden state after the
    last norm, with its logits scored alongside and, where asked, their argmax; it records
    the steps it is handed."""

    def __init__(self, causal_lm: torch.nn.Module):
        self.causal_lm, self.steps = causal_lm, []
        self.normed = self.logits = None

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 token_table: torch.Tensor | None = None,
                 greedy: GreedyPick | None = None) -> torch.Tensor:
        model = self.causal_lm.model
        self.steps.append((ids.shape[0], int(positions[0]), meta.max_seq_len))
        x, residual = model.embed_tokens(ids if token_table is None else token_table[ids]), None
        for layer in model.layers:
            x, residual = layer(positions, x, residual)
        self.normed, _ = model.norm(x, residual)
        self.logits = self.causal_lm.lm_head(self.normed)
        if greedy is not None:
            greedy.out.copy_(self.logits.argmax(-1))
        return self.normed

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.logits if hidden is self.normed else None


def _greedy(llm, prompts: list[list[int]]) -> list[list[int]]:
    from nanoserve import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_an_attached_chain_takes_exactly_the_single_sequence_decode_steps(tiny_qwen3):
    """The model hands one-token steps of one sequence to the attached chain, and its output
    through the final norm gives the tokens the layer loop gives (fp32, CPU)."""
    from nanoserve import LLM

    llm = LLM(str(tiny_qwen3), device="cpu", dtype="float32", max_num_seqs=2)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    want = _greedy(llm, prompts) + [_greedy(llm, [p])[0] for p in prompts]
    causal_lm = llm.engine.executor.model
    model = causal_lm.model
    chain = TorchLayerChain(causal_lm)
    model.layer_chain = chain
    try:
        together = _greedy(llm, prompts)
        assert chain.steps == []  # two sequences: every step has two rows
        one_at_a_time = [_greedy(llm, [p])[0] for p in prompts]
    finally:
        model.layer_chain = None
    assert together + one_at_a_time == want
    # Each sequence's 5 decode steps (its prefill samples the first of 6 tokens).
    assert chain.steps == [(1, p, p + 1) for p in range(3, 8)] + [(1, p, p + 1)
                                                                   for p in range(5, 10)]


def test_a_forward_the_chain_runs_can_take_the_greedy_token(tiny_qwen3):
    """``greedy_in_forward`` says which decode steps the chain runs; their forward writes the
    logits' argmax where ``greedy`` says. A step it does not run refuses the request rather than
    leave the token unwritten."""
    from nanoserve import LLM
    from nanoserve.attention.metadata import attention_metadata
    from nanoserve.runner.inputs import SequenceChunk

    llm = LLM(str(tiny_qwen3), device="cpu", dtype="float32", max_num_seqs=2)
    runner = llm.engine.executor
    causal_lm = runner.model
    assert not causal_lm.greedy_in_forward(1, 100)  # no chain attached
    causal_lm.model.layer_chain = TorchLayerChain(causal_lm)
    try:
        assert causal_lm.greedy_in_forward(1, MAX_KEYS)
        assert not causal_lm.greedy_in_forward(1, MAX_KEYS + 1)
        assert not causal_lm.greedy_in_forward(2, 100)
        out = torch.full((1,), -1, dtype=torch.int64)
        chunk = SequenceChunk("r", [17], 3, [0], True, None, [], [], [])
        ids, positions, meta, _ = runner._prepare([chunk])
        with torch.inference_mode(), attention_metadata(meta):
            hidden = causal_lm(ids, positions, greedy=GreedyPick(out))
        assert int(out) == int(causal_lm.compute_logits(hidden).argmax())
        two = [chunk, SequenceChunk("s", [18], 3, [1], True, None, [], [], [])]
        ids, positions, meta, _ = runner._prepare(two)
        with (pytest.raises(ValueError, match="greedy token"), torch.inference_mode(),
              attention_metadata(meta)):
            causal_lm(ids, positions, greedy=GreedyPick(out))
    finally:
        causal_lm.model.layer_chain = None


@pytest.mark.parametrize("error", ["build", "driver", None])
def test_a_kernel_that_does_not_build_or_load_leaves_the_triton_path(monkeypatch, caplog,
                                                                     error):
    import logging
    import types

    import nanoserve.kernels.layer_chain as layer_chain
    from nanoserve.kernels.cuda_build import CudaBuildError, CudaDriverError

    class Chain:
        resources = ["Used 168 registers"]

        def __init__(self, model, eps):
            if error == "build":
                raise CudaBuildError("nvcc could not compile layer_chain.cu")
            if error == "driver":
                raise CudaDriverError("cuModuleLoadData failed with CUresult 209")

    monkeypatch.setattr(layer_chain, "device_unsupported_reason", lambda device: None)
    monkeypatch.setattr(layer_chain, "LayerChain", Chain)
    model = types.SimpleNamespace(model=types.SimpleNamespace(layer_chain=None))
    with caplog.at_level(logging.INFO, logger=layer_chain.__name__):
        layer_chain.attach_layer_chain(model, QWEN3_0_6B, BF16, BF16, torch.device("cuda"), 1)
    if error is None:
        assert isinstance(model.model.layer_chain, Chain)
        assert "run layer_chain.cu" in caplog.text
    else:
        assert model.model.layer_chain is None
        assert "keeps the Triton kernels" in caplog.text and "did not build or load" in caplog.text
