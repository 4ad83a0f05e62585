"""``nanoserve tune`` end to end on Triton's interpreter: the sweeps of a model's shapes run
every candidate, the fastest (by an injected clock) goes into the op's table, and the op's
select reads it back."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.kernels import decode_attention, tuning  # noqa: E402
from nanoserve.kernels.tune import tune_model  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture
def qwen3_config(tmp_path):
    """A Qwen3 config (q/k norms: the finishing decode launch normalises) and no weights:
    the tuner reads shapes only."""
    from transformers import Qwen3Config

    folder = tmp_path / "model"
    Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                max_position_embeddings=4096,
                architectures=["Qwen3ForCausalLM"]).save_pretrained(folder)
    return folder


def later_is_faster():
    """A clock under which each timed candidate is faster than the ones before it."""
    timed = []

    def timer(call, copies):
        call(copies - 1)  # the timed call runs, on the last input copy too
        timed.append(call)
        return 1000.0 - len(timed)
    return timer


def test_tuning_decode_attention_writes_what_select_then_launches(qwen3_config, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path / "configs")
    # Three of each bucket's candidates (the interpreter is slow): the heuristic's and two more.
    every = decode_attention.candidates
    monkeypatch.setattr(decode_attention, "candidates", lambda *a: [*every(*a)[:1],
                                                                    *every(*a)[-2:]])
    logged = []
    # 200 keys: in the 512-key bucket, and up to 3 splits (no slice under 64 keys).
    paths = tune_model(qwen3_config, ops=["decode_attention"], device=CPU,
                       timer=later_is_faster(), batches=(1,), contexts=(200,), log=logged.append)
    assert paths == [tmp_path / "configs" / "decode_attention" / "CPU.json"]
    table = json.loads(paths[0].read_text())
    # Batch 1 is latency-bound: the plain launch and the one finishing new tokens.
    assert table.keys() == {"4x2x16", "4x2x16,new_tokens"}
    sms = 4  # the interpreter's nominal SMs
    for new_tokens in (False, True):
        assert table[decode_attention.shape_key(4, 2, 16, False, new_tokens)].keys() == {"1x512"}
        found = decode_attention.candidates(1, 2, 200, False, new_tokens, sms)
        chosen = decode_attention.from_table(table, 1, 4, 2, 16, 200, False, new_tokens, sms)
        assert chosen == found[-1] != found[0]  # every candidate matched; the last was fastest
    assert any(line.startswith("decode_attention 4x2x16 1x512") for line in logged)
    # Over an fp8 cache: entries of their own, beside the 16-bit cache's.
    tune_model(qwen3_config, ops=["decode_attention"], device=CPU, timer=later_is_faster(),
               batches=(1,), contexts=(200,), kv_cache_dtype="fp8", log=logged.append)
    table = json.loads(paths[0].read_text())
    assert table.keys() == {"4x2x16", "4x2x16,new_tokens", "4x2x16,fp8", "4x2x16,fp8,new_tokens"}
    assert decode_attention.from_table(table, 1, 4, 2, 16, 200, True, False, sms) == \
        decode_attention.candidates(1, 2, 200, True, False, sms)[-1]


def test_tuning_an_unknown_op_names_the_tunable_ones(qwen3_config, capsys):
    from nanoserve.entrypoints.cli import main

    with pytest.raises(ValueError, match="decode_attention"):
        tune_model(qwen3_config, ops=["flash_attention"], device=CPU)
    assert main(["tune", str(qwen3_config), "--ops", "rms_norm", "flash"]) == 2
    assert "unknown ops ['flash']; tunable: skinny_gemm, decode_attention" in \
        capsys.readouterr().err


@pytest.fixture
def small_sweeps(monkeypatch):
    """The sweeps' buckets and sizes cut to what the interpreter runs in seconds."""
    from nanoserve.kernels import attention_sweeps, fused_ops, sweeps

    monkeypatch.setattr(fused_ops, "ROW_BUCKETS", (1, 4))
    monkeypatch.setattr(sweeps, "BATCH_BUCKETS", (1, 4))
    monkeypatch.setattr(sweeps, "MOE_TOKENS", (2, 8))
    monkeypatch.setattr(attention_sweeps, "PREFILL_SEQS", 2)
    monkeypatch.setattr(attention_sweeps, "PREFILL_TOKENS", 48)


def test_every_op_is_tuned_at_the_models_shapes(qwen3_config, tmp_path, monkeypatch,
                                                small_sweeps):
    """Each op's sweep runs every candidate at the model's shapes and its table's entries are
    what its select reads back: the fastest (here the last) for that shape and bucket."""
    from transformers import Qwen3MoeConfig

    from nanoserve.kernels import fused_moe, fused_ops, prefill_attention, qk_norm_rope, sampling

    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path / "configs")
    ops = ["prefill_attention", "rms_norm", "silu_and_mul", "qk_norm_rope", "sampling"]
    tune_model(qwen3_config, ops=ops, device=CPU, timer=later_is_faster(), log=lambda _: None)
    moe = tmp_path / "moe"
    Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=300,
                   num_experts=4, num_experts_per_tok=2,
                   architectures=["Qwen3MoeForCausalLM"]).save_pretrained(moe)
    tune_model(moe, ops=["fused_moe"], device=CPU, timer=later_is_faster(), log=lambda _: None)

    def table(op):
        return json.loads((tmp_path / "configs" / op / "CPU.json").read_text())

    assert prefill_attention.from_table(table("prefill_attention"), 4, 2, 16) == \
        prefill_attention.candidates(4, 2, 16)[-1]
    for rows in (1, 4):
        assert fused_ops.rms_norm_from_table(table("rms_norm"), rows, 64) == \
            fused_ops.rms_norm_candidates(64)[-1]
        assert fused_ops.silu_and_mul_from_table(table("silu_and_mul"), rows, 128) == \
            fused_ops.silu_and_mul_candidates(128)[-1]
        assert qk_norm_rope.from_table(table("qk_norm_rope"), rows, 4, 2, 16) == \
            qk_norm_rope.candidates(4, 2, 16)[-1]
    for batch in (1, 4):
        assert sampling.from_table(table("sampling"), batch, 300) == \
            sampling.candidates(batch)[-1]
    for tokens in (2, 8):  # gate_up is [4, 32, 32], down [4, 32, 16]
        for n, k in ((32, 32), (32, 16)):
            assert fused_moe.from_table(table("fused_moe"), 2 * tokens, 4, n, k) == \
                fused_moe.candidates(2 * tokens, 4, n, k)[-1]


def test_latent_attention_block_fp8_and_int4_gemms_are_tuned(tmp_path, monkeypatch):
    """The sweeps of the kernels only some models run: latent attention (DeepSeek-V2), the
    block-fp8 GEMM (a checkpoint with fp8 scale blocks) and the int4 tensor-core GEMM
    (``tune --int4``)."""
    from transformers import DeepseekV2Config, Qwen3Config

    from nanoserve.config import ModelConfig
    from nanoserve.kernels import fp8_block_gemm, int4_gemm, mla_decode, sweeps
    from nanoserve.kernels.tune_int4 import gemm_sweeps

    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path / "configs")
    monkeypatch.setattr(fp8_block_gemm, "ROW_BUCKETS", (16,))
    deepseek = tmp_path / "deepseek"
    config = DeepseekV2Config(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                              num_key_value_heads=4, num_hidden_layers=1, vocab_size=64,
                              kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                              v_head_dim=12, q_lora_rank=None, n_routed_experts=4,
                              moe_intermediate_size=32, num_experts_per_tok=2,
                              n_shared_experts=1, first_k_dense_replace=1)
    config.architectures = ["DeepseekV2ForCausalLM"]
    config.save_pretrained(deepseek)
    tune_model(deepseek, ops=["mla_decode", "fp8_block_gemm"], device=CPU,
               timer=later_is_faster(), batches=(2,), contexts=(100,), log=lambda _: None)
    table = json.loads((tmp_path / "configs" / "mla_decode" / "CPU.json").read_text())
    assert mla_decode.from_table(table, 2, 4, 32, 8, 100, 4) == \
        mla_decode.candidates(2, 4, 100, 4)[-1]
    assert not (tmp_path / "configs" / "fp8_block_gemm").exists()  # no fp8 weights: no sweep

    fp8 = tmp_path / "fp8"
    Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64,
                architectures=["Qwen3ForCausalLM"],
                quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [16, 16]}).save_pretrained(fp8)
    tune_model(fp8, ops=["fp8_block_gemm"], device=CPU, timer=later_is_faster(),
               log=lambda _: None)
    table = json.loads((tmp_path / "configs" / "fp8_block_gemm" / "CPU.json").read_text())
    for n, k in ((128, 64), (64, 64), (256, 64), (64, 128)):  # qkv, o, gate/up, down
        assert fp8_block_gemm.from_table(table, 16, n, k, (16, 16)) == \
            fp8_block_gemm.candidates(16, n, (16, 16))[-1]

    cfg = ModelConfig.from_hf(Qwen3Config(hidden_size=128, intermediate_size=256,
                                          num_hidden_layers=1, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=32, vocab_size=64))
    monkeypatch.setattr(int4_gemm, "ROW_BUCKETS", (16,))
    found = list(gemm_sweeps(cfg, 1, CPU, torch.float16))
    assert {s.shape for s in found} == {  # qkv, o, gate/up, down
        "256x128,group=128", "128x128,group=128", "512x128,group=128", "128x256,group=128"}
    timer = later_is_faster()
    best, times = sweeps.best_launch(found[0], timer, atol=5e-2)
    assert best == found[0].candidates[-1] and len(times) == len(found[0].candidates)
