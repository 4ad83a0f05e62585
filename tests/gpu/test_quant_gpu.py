"""On a CUDA device: the Triton int4 GEMM at real projection sizes against a float64 matmul, and
tiny AWQ / GPTQ checkpoints kept quantized (the int4 GEMM, CUDA graphs) against the same engine
on their dequantized weights, by the top-5 rule. Skipped without CUDA."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.mark.parametrize("m", [1, 4, 64, 300])
# Qwen3-8B: o_proj, gate_up, down
@pytest.mark.parametrize("n,k", [(4096, 4096), (24576, 4096), (4096, 12288)])
def test_int4_gemm_real_sizes(m, n, k):
    from nanoserve.kernels.int4_gemm import int4_linear

    gen = torch.Generator(device="cuda").manual_seed(m + n)
    g = 128
    codes = torch.randint(0, 16, (n, k), generator=gen, device="cuda", dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = torch.rand(k // g, n, generator=gen, device="cuda") * 0.004 + 0.001
    zeros = torch.randn(k // g, n, generator=gen, device="cuda") * 0.01
    sz = torch.stack([scales, zeros], -1).bfloat16()
    x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    s, z = (sz[..., i].double().repeat_interleave(g, 0).t() for i in (0, 1))
    want = x.double() @ ((codes.double() - 8) * s + z).t()
    got = int4_linear(x, packed, sz, g)
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max())


@pytest.mark.parametrize("method,act_order", [("awq", False), ("gptq", True)])
def test_int4_checkpoint_on_gpu_matches_dequantized(method, act_order, tmp_path, tokenizer_dir):
    from test_quantization import PROMPTS, _quantized_checkpoint, assert_close_greedy

    from nanoserve import LLM, SamplingParams

    path = _quantized_checkpoint("qwen3", method, act_order, tmp_path, tokenizer_dir)
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, logprobs=5)
    outs = []
    for quantization in ("none", "auto"):
        llm = LLM(str(path), dtype="bfloat16", quantization=quantization, max_num_seqs=8)
        outs.append(llm.generate(PROMPTS, params, use_tqdm=False))
        llm.close()
    assert_close_greedy(*outs, atol=0.3)  # bf16 activations on both sides


@pytest.mark.parametrize("m", [1, 5, 8, 9, 64])
@pytest.mark.parametrize("n,k", [(4096, 4096), (24576, 4096), (4096, 12288)])
def test_fp8_channel_matmul_matches_dequantized_product(m, n, k):
    """Up to 8 rows the skinny GEMV with x unquantized (W8A16), beyond ``torch._scaled_mm``
    with x quantized a token (W8A8)."""
    from nanoserve.layers.quantization.fp8 import Fp8Matrix, quantize_rows

    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    w = torch.randn(n, k, generator=gen, device="cuda") * 0.02
    q, scale = quantize_rows(w)
    matrix = Fp8Matrix(q, scale, None)
    x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    xq, sx = quantize_rows(x)
    xd = x.double() if m <= 8 else xq.double() * sx.double()
    want = xd @ matrix.dequantize().double().t()
    got = matrix.matmul(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max())


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen3-8b"])
def test_online_fp8_close_to_bf16_transformers(shape, tmp_path_factory):
    """quantization="fp8" (per-channel weights; activations per token in prefill's
    torch._scaled_mm, unquantized in the decode GEMV) against transformers' bf16 model on the
    same random weights, by the top-5 rule."""
    from test_gpu_parity import assert_greedy_close_to_transformers, random_model_dir

    assert_greedy_close_to_transformers(random_model_dir(shape, tmp_path_factory),
                                        f"{shape} fp8", quantization="fp8")


def test_block_scaled_fp8_checkpoint_on_gpu(tmp_path, tokenizer_dir):
    from test_fp8 import _fp8_checkpoint
    from test_quantization import PROMPTS, assert_close_greedy

    from nanoserve import LLM, SamplingParams

    path = _fp8_checkpoint("block", tmp_path, tokenizer_dir)
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, logprobs=5)
    outs = []
    for quantization in ("none", "auto"):
        llm = LLM(str(path), dtype="bfloat16", quantization=quantization, max_num_seqs=8)
        outs.append(llm.generate(PROMPTS, params, use_tqdm=False))
        llm.close()
    assert_close_greedy(*outs, atol=1.0)


@pytest.mark.parametrize("m", [1, 7, 256])
def test_fp8_block_gemm_real_sizes(m):
    """Qwen3-8B's gate/up in 128 x 128 blocks through the Triton kernel."""
    from nanoserve.layers.quantization.fp8 import Fp8Matrix, quantize_rows

    gen = torch.Generator(device="cuda").manual_seed(m)
    n, k = 24576, 4096
    w = torch.randn(n, k, generator=gen, device="cuda") * 0.02
    tiles = w.view(n // 128, 128, k // 128, 128)
    sw = tiles.abs().amax((1, 3)) / 448
    wq = (tiles / sw[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k)
    matrix = Fp8Matrix(wq, sw, (128, 128))
    x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    xq, sx = quantize_rows(x, 128)
    xd = (xq.double().view(m, -1, 128) * sx.double()[..., None]).view(m, k)
    want = xd @ matrix.dequantize().double().t()
    torch.testing.assert_close(matrix.matmul(x).double(), want, rtol=2e-2,
                               atol=2e-2 * want.abs().max())
