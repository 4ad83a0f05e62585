"""The skinny GEMV's launch choice: tuning files per device, and the heuristic without one."""
import json

import pytest
import torch
import torch.nn.functional as F

from nanoserve.kernels import skinny_gemm, tuning
from nanoserve.kernels.skinny_gemm import CUBLAS, SkinnyConfig, from_table, heuristic_config

TABLE = {"1024x2048": {"1": SkinnyConfig(4, 2048, 4, 4, True)._asdict(), "2": CUBLAS,
                       "4": SkinnyConfig(2, 1024, 8, 3)._asdict()}}


def test_a_tuned_shape_takes_its_entry_per_row_bucket():
    assert from_table(TABLE, 1, 1024, 2048) == SkinnyConfig(4, 2048, 4, 4, True)
    assert from_table(TABLE, 2, 1024, 2048) is None  # the tuner found cuBLAS faster
    # 3 and 4 rows share the 4-row bucket (the decode graphs pad 3 to 4)
    assert from_table(TABLE, 3, 1024, 2048) == from_table(TABLE, 4, 1024, 2048) \
        == SkinnyConfig(2, 1024, 8, 3)


def test_an_untuned_shape_or_bucket_takes_the_heuristic():
    """No entry: one row runs the kernel on heuristic tiles, more rows go to cuBLAS (never
    slower than without the kernel)."""
    for n, k in [(896, 4864), (1536, 896), (151936, 896)]:
        assert from_table(TABLE, 1, n, k) == heuristic_config(1, n, k)
        assert from_table(TABLE, 2, n, k) is None and from_table(TABLE, 8, n, k) is None
    assert from_table(TABLE, 8, 1024, 2048) is None  # a tuned shape without that bucket


def test_heuristic_tiles_shrink_with_rows_and_cover_short_k():
    assert heuristic_config(1, 4096, 4096) == SkinnyConfig(2, 4096, 4, 4)
    assert heuristic_config(8, 4096, 4096) == SkinnyConfig(1, 1024, 4, 4)
    assert heuristic_config(1, 4096, 100).block_k == 128  # one chunk covers a short K


def test_select_serves_at_most_max_rows():
    cpu = torch.device("cpu")
    assert skinny_gemm.select(0, 64, 64, cpu) is None
    assert skinny_gemm.select(skinny_gemm.MAX_ROWS + 1, 64, 64, cpu) is None
    assert skinny_gemm.select(1, 64, 64, cpu) == skinny_gemm.INTERPRETER_CONFIG


def test_saved_entries_merge_with_other_models_tunings(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    tuning.save_entries("skinny_gemm", "Some_GPU", TABLE)
    tuning.save_entries("skinny_gemm", "Some_GPU", {"1024x2048": {"8": CUBLAS},
                                                    "4096x4096": {"1": CUBLAS}})
    saved = json.loads((tmp_path / "skinny_gemm" / "Some_GPU.json").read_text())
    assert saved["1024x2048"] == {**TABLE["1024x2048"], "8": CUBLAS}
    assert saved["4096x4096"] == {"1": CUBLAS}


@pytest.mark.parametrize("path", sorted((tuning.CONFIG_DIR / "skinny_gemm").glob("*.json")))
def test_shipped_tuning_files_hold_valid_entries(path):
    """Every entry of a shipped file is cuBLAS or tiles the kernel can launch."""
    table = json.loads(path.read_text())
    assert table
    for shape, buckets in table.items():
        n, k = map(int, shape.split("x"))
        for bucket, entry in buckets.items():
            assert int(bucket) in skinny_gemm.ROW_BUCKETS
            config = from_table(table, int(bucket), n, k)
            assert entry == CUBLAS and config is None or config == SkinnyConfig(**entry)


def _deepseek_v2_lite():
    """DeepSeek-V2-Lite's config (benchmarks' shape) as transformers reads it."""
    from transformers import AutoConfig

    from nanoserve.bench.shapes import config_of

    fields = config_of("deepseek-v2-lite")
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def test_tuner_times_every_projection_the_decoder_fuses():
    """The tuner's shapes are the ones the decoder's projections launch, with their fusions,
    at the rank's width."""
    from nanoserve.config import ModelConfig
    from nanoserve.kernels.tune import candidates, projection_shapes

    cfg = ModelConfig("Qwen3ForCausalLM", 1024, 3072, 28, 16, 8, 128, 151936, 1e-6, 1e6, None,
                      40960, True, False, True, "bfloat16")
    assert projection_shapes(cfg) == {
        "qkv_proj": (4096, 1024, {"norm_eps": 1e-6}), "o_proj": (1024, 2048, {"residual": True}),
        "gate_up_proj": (6144, 1024, {"norm_eps": 1e-6, "activate": True}),
        "down_proj": (1024, 3072, {"residual": True})}
    assert projection_shapes(cfg, tp=2)["qkv_proj"] == (2048, 1024, {"norm_eps": 1e-6})
    deepseek = ModelConfig.from_hf(_deepseek_v2_lite())
    assert projection_shapes(deepseek, tp=2) == {
        "q_proj": (8 * 192, 2048, {"norm_eps": 1e-6}),
        "kv_a_proj_with_mqa": (576, 2048, {"norm_eps": 1e-6}),
        "o_proj": (2048, 8 * 128, {"residual": True}),
        "gate_up_proj": (10944, 2048, {"norm_eps": 1e-6, "activate": True}),
        "down_proj": (2048, 5472, {"residual": True}), "router": (64, 2048, {}),
        "shared_experts.gate_up_proj": (2816, 2048, {"activate": True}),
        "shared_experts.down_proj": (2048, 1408, {"residual": True})}
    for rows in skinny_gemm.ROW_BUCKETS:
        tilings = candidates(rows, 3072)
        assert tilings and len(set(tilings)) == len(tilings)
        assert all(c.block_n * c.block_k * rows <= 16384 for c in tilings)


def test_projection_op_on_the_cpu_composes_its_fusions_as_the_reference():
    """Off CUDA, ``linear``'s fusions are the plain PyTorch steps, out of place: the norm, the
    product, SiLU-and-mul, the residual added after the product is rounded."""
    from nanoserve.layers.activation import silu_and_mul_torch
    from nanoserve.layers.linear import linear
    from nanoserve.layers.norm import rms_norm_torch

    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 16, generator=gen), torch.randn(10, 16, generator=gen)
    residual = torch.randn(3, 10, generator=gen)
    before = residual.clone()
    out = linear(x, w, residual=residual)
    assert torch.equal(out, before + F.linear(x, w)) and torch.equal(residual, before)
    assert torch.equal(linear(x, w, norm_eps=1e-6, activate=True),
                       silu_and_mul_torch(F.linear(rms_norm_torch(x, None, 1e-6), w)))
    with pytest.raises(ValueError, match="not both"):
        linear(x, w, activate=True, residual=residual)
