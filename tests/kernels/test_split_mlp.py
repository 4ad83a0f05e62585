"""The split MLP (gate/up and down in one launch, atomics into float32; an experiment in
benchmarks/split_mlp.py) against float64, on the CPU interpreter."""
import os
import sys
from pathlib import Path

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from split_mlp import split_mlp  # noqa: E402

EPS = 1e-6


def reference(h, delta, w_gate_up, w_down_t, start):
    """``start + down(silu(gate) * up)`` of ``rmsnorm(h + delta)`` in float64, with gate, up,
    silu and the activation rounded to the weights' dtype where the kernel rounds them."""
    x = h.double() + (delta.double() if delta is not None else 0)
    x = x / torch.sqrt(x.pow(2).mean() + EPS)
    gate, up = (x @ w_gate_up.double().T).chunk(2)
    dtype = w_gate_up.dtype
    act = F.silu(gate.to(dtype).double()).to(dtype).double() * up.to(dtype).double()
    return start.double() + act.to(dtype).double() @ w_down_t.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden,inter,block_f", [(64, 32, 8), (48, 20, 8), (32, 24, 16)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_matches_float64(dtype, hidden, inter, block_f, with_delta):
    gen = torch.Generator().manual_seed(hidden * 100 + inter + block_f)
    h = torch.randn(hidden, generator=gen).to(dtype)
    delta = torch.randn(hidden, generator=gen) if with_delta else None
    w_gate_up = torch.randn(2 * inter, hidden, generator=gen).div(hidden ** 0.5).to(dtype)
    w_down_t = torch.randn(inter, hidden, generator=gen).div(inter ** 0.5).to(dtype)
    start = torch.randn(hidden, generator=gen)
    out = split_mlp(h, delta, w_gate_up, w_down_t, start.clone(), EPS, block_f=block_f)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), reference(h, delta, w_gate_up, w_down_t, start),
                               **tol)


def test_partials_per_program_sum_to_the_atomic_result():
    gen = torch.Generator().manual_seed(7)
    hidden, inter, block_f = 64, 40, 8
    h = torch.randn(hidden, generator=gen)
    w_gate_up = torch.randn(2 * inter, hidden, generator=gen) / 8
    w_down_t = torch.randn(inter, hidden, generator=gen) / 8
    summed = split_mlp(h, None, w_gate_up, w_down_t, torch.zeros(hidden), EPS, block_f=block_f)
    parts = split_mlp(h, None, w_gate_up, w_down_t, torch.zeros(5, hidden), EPS,
                      block_f=block_f, atomic=False)
    torch.testing.assert_close(parts.sum(0), summed, atol=1e-5, rtol=1e-5)


def test_bad_shapes_say_what_they_need():
    h = torch.zeros(16)
    with pytest.raises(ValueError, match="w_down_t"):
        split_mlp(h, None, torch.zeros(16, 16), torch.zeros(4, 16), torch.zeros(16), EPS)
    with pytest.raises(ValueError, match="float32"):
        split_mlp(h, None, torch.zeros(8, 16), torch.zeros(4, 16), torch.zeros(16,
                  dtype=torch.bfloat16), EPS)
