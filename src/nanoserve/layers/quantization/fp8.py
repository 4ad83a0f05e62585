"""FP8 W8A8: e4m3 weights with a scale a block, channel or tensor, and activations quantized
to e4m3 per token (per token and block of input features, for block-scaled weights) as they
arrive. On CUDA (compute capability 8.9+) per-channel products run in ``torch._scaled_mm``,
block-scaled ones in a Triton kernel (``kernels/fp8_block_gemm.py``); on the CPU, the
reference: both sides dequantized, then a matmul. A decode step's few rows of 16-bit
activations stream per-channel weights through the skinny GEMV instead, unquantized (W8A16:
the weight's bytes are the step, and quantizing x would cost launches of its own)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.layers.quantization.methods import LinearMethod, _param

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
CHUNK_ELEMENTS = 1 << 20


def quantize_rows(x: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` as e4m3 with a float32 scale a row (``group``: a row and ``group``
    features): ``x ~ q * scale``."""
    m, k = x.shape
    parts = x.float().view(m, k // group, group) if group else x.float().view(m, 1, k)
    scale = parts.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    q = (parts / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, k)
    return q, scale.squeeze(-1)  # scale [M, K / group] or [M, 1]


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense weight ``[N, K]`` as e4m3 with a float32 scale an output row ``[N, 1]``."""
    return quantize_rows(w)


class Fp8Matrix:
    """An e4m3 weight ``[N, K]`` and its scales: ``[N, 1]`` a channel, or ``[N / bn, K / bk]``
    a block; multiplies activations quantized per token as they come."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None):
        self.weight, self.scale, self.block = weight, scale.float(), block
        self.out_features, self.in_features = weight.shape
        self.channel_scale = self.scale.reshape(-1).contiguous() if block is None else None

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the codes and scales stand for."""
        return self._rows(0, self.out_features)

    def _rows(self, start: int, end: int) -> torch.Tensor:
        w = self.weight[start:end].float()
        if self.block is None:
            return w * self.scale[start:end]
        bn, bk = self.block
        s = self.scale.repeat_interleave(bn, 0)[start:end].repeat_interleave(bk, 1)
        return w * s[:, :self.in_features]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.block is None and x.dtype in (torch.bfloat16, torch.float16):
            from nanoserve.kernels import skinny_gemm
            if 0 < x.shape[0] <= skinny_gemm.MAX_ROWS:
                return skinny_gemm.skinny_linear(x, self.weight, weight_scale=self.channel_scale)
        group = self.block[1] if self.block is not None else 0
        q, sx = quantize_rows(x, group)
        if x.is_cuda and self.block is None:
            return _scaled_mm(q, sx, self.weight, self.scale, x.dtype)
        if x.is_cuda:
            from nanoserve.kernels.fp8_block_gemm import fp8_block_linear
            return fp8_block_linear(q, sx, self.weight, self.scale, self.block, x.dtype)
        xd = (q.float().view(x.shape[0], -1, group or self.in_features) * sx[..., None])
        xd = xd.view_as(x).to(x.dtype)
        step = max(1, CHUNK_ELEMENTS // self.in_features)
        return torch.cat([F.linear(xd, self._rows(s, s + step).to(x.dtype))
                          for s in range(0, self.out_features, step)], dim=-1)


def _scaled_mm(q: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """``(q * sx) @ (w * sw)^T`` in ``torch._scaled_mm`` (row-wise scales; rows padded to 16)."""
    m = q.shape[0]
    pad = -m % 16
    if pad:
        q = F.pad(q.view(torch.uint8), (0, 0, 0, pad)).view(FP8)
        sx = F.pad(sx, (0, 0, 0, pad), value=1.0)
    out = torch._scaled_mm(q, w.t(), scale_a=sx.contiguous(), scale_b=sw.t().contiguous(),
                           out_dtype=dtype)
    return out[:m]


class Fp8Method(LinearMethod):
    """FP8 checkpoints (the ``fp8`` method's block or tensor scales, compressed-tensors'
    channel or tensor scales) and ``quantization="fp8"`` (a dense weight quantized at load)."""

    quantized = True

    def create_weights(self, layer, in_features, in_per_rank, out_per_rank, row_parallel):
        kind = self.spec.fp8_scales
        if self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise ValueError("fp8 weights need a GPU of compute capability 8.9 or newer")
        if kind == "online":
            return super().create_weights(layer, in_features, in_per_rank, out_per_rank,
                                          row_parallel)
        _param(layer, "weight", (out_per_rank, in_per_rank), FP8, 0, 1)
        if kind == "block":
            bn, bk = self.spec.weight_block
            if out_per_rank % bn or in_per_rank % bk:
                raise ValueError(f"fp8 weights of {out_per_rank} x {in_per_rank} features a "
                                 f"rank need whole blocks of {bn} x {bk}")
            _param(layer, "weight_scale_inv", (out_per_rank // bn, in_per_rank // bk),
                   torch.float32, 0, 1, out_pack=bn)
        else:  # a scale a channel [N, 1], or a tensor's one scale broadcast over its rows
            scale = _param(layer, "weight_scale", (out_per_rank, 1), torch.float32, 0, None)
            scale.broadcast = kind == "tensor"

    def names(self) -> tuple[str, ...]:
        kind = self.spec.fp8_scales
        return ("weight",) + {"online": (), "block": ("weight_scale_inv",)}.get(
            kind, ("weight_scale",))

    def finish(self, layer):
        kind = self.spec.fp8_scales
        if kind == "online":
            weight, scale = quantize_weight_per_channel(layer.weight)
            matrix = Fp8Matrix(weight, scale, None)
        elif kind == "block":
            matrix = Fp8Matrix(layer.weight.data, layer.weight_scale_inv.data,
                               self.spec.weight_block)
        else:
            matrix = Fp8Matrix(layer.weight.data, layer.weight_scale.data, None)
        if self.spec.dequantize:
            return self.become_dense(layer, matrix.dequantize(), self.names())
        for name in self.names():
            delattr(layer, name)
        layer.packed = matrix

    def init_dummy(self, layer, gen):
        if self.spec.fp8_scales == "online":
            layer.weight.normal_(0.0, 0.02, generator=gen)
        else:
            w = torch.empty(layer.weight.shape, device=layer.weight.device).normal_(
                0.0, 1.0, generator=gen)
            layer.weight.copy_(w.to(FP8))
            scale = layer.weight_scale_inv if self.spec.fp8_scales == "block" \
                else layer.weight_scale
            scale.fill_(0.02)
        self.finish(layer)
