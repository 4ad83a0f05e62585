"""The batch-1 MLP in one launch, against float64 and the two-GEMV path, on the CPU interpreter."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from nanoserve.kernels.fused_mlp import FusedMLPConfig, FusedMLPScratch, fused_mlp  # noqa: E402
from nanoserve.kernels.skinny_gemm import skinny_linear, skinny_rms_linear  # noqa: E402

EPS = 1e-6
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3)}


def mlp_inputs(hidden: int, inter: int, dtype: torch.dtype, seed: int):
    """A residual row, its sum of squares, gate/up weights [2I, H] and down's weight [H, I]
    stored transposed, as the model keeps them."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(1, hidden, generator=gen).to(dtype)
    w_gate_up = (torch.randn(2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w_down = (torch.randn(hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    w_down = w_down.t().contiguous().t()
    sum_squares = h.double().square().sum().reshape(1).float()
    return h, sum_squares, w_gate_up, w_down


def reference(h: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """``h + down(silu(gate) * up)(rmsnorm(h))`` in float64, rounded where the model rounds."""
    dtype = h.dtype
    x = h.double()
    normed = x * torch.rsqrt(x.square().mean() + EPS)
    gate, up = (normed @ w_gate_up.double().T).to(dtype).double().chunk(2, dim=-1)
    act = (F.silu(gate).to(dtype).double() * up).to(dtype).double()
    return ((act @ w_down.double().T).to(dtype).double() + x).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden,inter", [(64, 96), (40, 24), (128, 256)])
@pytest.mark.parametrize("config", [None, FusedMLPConfig(8, 16, 64, 2, False),
                                    FusedMLPConfig(2, 64, 16, 1, True)],
                         ids=["default", "8x16x64", "2x64x16"])
def test_adds_the_mlp_into_the_residual(dtype, hidden, inter, config):
    h, sum_squares, w_gate_up, w_down = mlp_inputs(hidden, inter, dtype, seed=hidden + inter)
    expected = reference(h, w_gate_up, w_down)
    sum_squares_out = torch.full((1,), 123.0)  # overwritten, not added to
    scratch = FusedMLPScratch(hidden, h.device)
    assert fused_mlp(h, sum_squares, EPS, w_gate_up, w_down, sum_squares_out, scratch,
                     config) is h
    torch.testing.assert_close(h, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(sum_squares_out, h.double().square().sum().reshape(1).float(),
                               rtol=1e-5, atol=1e-5)
    # The last program leaves the accumulator and counter zero for the next call.
    assert not scratch.acc.any() and scratch.count.item() == 0


def test_equals_the_two_gemv_path():
    """gate/up with the norm, then down of silu(gate) * up added into the residual: the same
    roundings, so the same row up to the float32 sums' order."""
    h, sum_squares, w_gate_up, w_down = mlp_inputs(96, 160, torch.float16, seed=7)
    two_launch = h.clone()
    gate_up = skinny_rms_linear(two_launch, sum_squares, EPS, w_gate_up)
    ss_two = torch.zeros(1)
    skinny_linear(gate_up, w_down.contiguous(), gated=True, residual=two_launch,
                  sum_squares=ss_two)
    ss_fused = torch.zeros(1)
    fused_mlp(h, sum_squares, EPS, w_gate_up, w_down, ss_fused, FusedMLPScratch(96, h.device))
    torch.testing.assert_close(h, two_launch, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(ss_fused, ss_two, rtol=1e-4, atol=1e-4)


def test_consecutive_calls_share_the_scratch():
    """Layer after layer with one scratch: each call starts from the zeros the last left."""
    scratch = FusedMLPScratch(64, torch.device("cpu"))
    h, sum_squares, w_gate_up, w_down = mlp_inputs(64, 96, torch.float32, seed=1)
    for _ in range(3):
        expected = reference(h, w_gate_up, w_down)
        sum_squares_out = torch.zeros(1)
        fused_mlp(h, sum_squares, EPS, w_gate_up, w_down, sum_squares_out, scratch)
        torch.testing.assert_close(h, expected, **TOLERANCE[torch.float32])
        sum_squares = sum_squares_out


def test_bad_inputs_are_refused():
    h, sum_squares, w_gate_up, w_down = mlp_inputs(32, 48, torch.float32, seed=2)
    scratch = FusedMLPScratch(32, h.device)
    out = torch.zeros(1)
    with pytest.raises(ValueError, match="stored transposed"):
        fused_mlp(h, sum_squares, EPS, w_gate_up, w_down.contiguous(), out, scratch)
    with pytest.raises(ValueError, match="one contiguous row"):
        fused_mlp(h.expand(2, 32), sum_squares, EPS, w_gate_up, w_down, out, scratch)
    with pytest.raises(ValueError, match="w_gate_up"):
        fused_mlp(h, sum_squares, EPS, w_gate_up[:-1], w_down, out, scratch)
    with pytest.raises(ValueError, match="scratch"):
        fused_mlp(h, sum_squares, EPS, w_gate_up, w_down, out, FusedMLPScratch(16, h.device))
    with pytest.raises(ValueError, match="float32"):
        fused_mlp(h, sum_squares.double(), EPS, w_gate_up, w_down, out, scratch)
