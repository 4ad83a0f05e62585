"""AWQ (AutoAWQ's GEMM layout) and GPTQ (AutoGPTQ's, with or without act order) 4-bit weights:
their int32-packed codes and zero points unpacked, repacked at load for the int4 kernels.

- AWQ: ``qweight`` ``[K, N/8]`` and ``qzeros`` ``[K/g, N/8]`` pack 8 output features an int32 in
  the interleaved order ``AWQ_ORDER``; ``W = (q - z) * s``.
- GPTQ: ``qweight`` ``[K/8, N]`` packs 8 input features an int32 (low nibble first), ``qzeros``
  ``[K/g, N/8]`` 8 output features; input feature ``k`` belongs to group ``g_idx[k]``;
  ``W = (q - (z + zero_offset)) * s`` (v1 checkpoints store zero points minus one)."""
from __future__ import annotations

import torch

from nanoserve.layers.quantization.methods import LinearMethod, _param
from nanoserve.layers.quantization.packed import GroupedInts

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an int32 holds feature 8c + AWQ_ORDER[i]
GPTQ_ORDER = tuple(range(8))
PACK = 8  # 4-bit values per int32


def unpack_int32(packed: torch.Tensor, order: tuple[int, ...], dim: int) -> torch.Tensor:
    """int32 words, 8 nibbles each, spread along ``dim`` (8x longer) as int8 values 0..15:
    nibble ``i`` of word ``c`` becomes entry ``8c + order[i]``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., 8]: nibble i
    inverse = torch.tensor([order.index(j) for j in range(PACK)], device=packed.device)
    values = nibbles.index_select(-1, inverse)  # [..., 8]: feature 8c + j
    if dim == 0:
        values = values.movedim(-1, 1)  # [R, 8, C]
        return values.reshape(-1, packed.shape[1]).to(torch.int8)
    return values.reshape(packed.shape[0], -1).to(torch.int8)


def awq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group_size: int) -> GroupedInts:
    q = unpack_int32(qweight, AWQ_ORDER, 1)  # [K, N]
    z = unpack_int32(qzeros, AWQ_ORDER, 1).float()  # [K/g, N]
    s = scales.float()
    return GroupedInts(q.t().contiguous(), s.t().contiguous(), (-(z * s)).t().contiguous(),
                       group_size, True)


def gptq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor | None, group_size: int, zero_offset: int) -> GroupedInts:
    q = unpack_int32(qweight, GPTQ_ORDER, 0)  # [K, N]
    z = unpack_int32(qzeros, GPTQ_ORDER, 1).float() + zero_offset  # [G, N]
    s = scales.float()
    perm = None
    if g_idx is not None:
        g_idx = g_idx.long()
        perm = torch.argsort(g_idx, stable=True)
        if torch.equal(perm, torch.arange(len(perm), device=perm.device)):
            perm = None  # groups already adjacent
        else:  # act order: the input features sorted by group, each group's then adjacent
            q = q.index_select(0, perm)
        groups, counts = torch.unique(g_idx, return_counts=True)
        if not bool((counts == group_size).all()):
            raise ValueError(f"GPTQ g_idx must give each group {group_size} input features "
                             "(act-order groups split across tensor-parallel ranks are not "
                             "supported)")
        if s.shape[0] != len(groups):  # every group's scales, of which these features use some
            s, z = s.index_select(0, groups), z.index_select(0, groups)
    return GroupedInts(q.t().contiguous(), s.t().contiguous(), (-(z * s)).t().contiguous(),
                       group_size, True, perm)


class Int4CheckpointMethod(LinearMethod):
    """AWQ or GPTQ checkpoints: the format's parameters, repacked once loaded (or dequantized,
    with ``quantization='none'``)."""

    quantized = True

    def create_weights(self, layer, in_features, in_per_rank, out_per_rank, row_parallel):
        g, awq = self.spec.group_size, self.spec.method == "awq"
        if in_per_rank % g or out_per_rank % PACK:
            raise ValueError(f"{self.spec.method} weights of {in_per_rank} input features a "
                             f"rank and {out_per_rank} output features need multiples of the "
                             f"group size {g} and of {PACK}")
        # Act order with split input features: every rank reads every group's scales.
        whole_groups = row_parallel and self.spec.desc_act
        groups = (in_features if whole_groups else in_per_rank) // g
        group_dim = None if whole_groups else 0
        i32 = torch.int32
        if awq:
            _param(layer, "qweight", (in_per_rank, out_per_rank // PACK), i32, 1, 0, PACK)
        else:
            _param(layer, "qweight", (in_per_rank // PACK, out_per_rank), i32, 1, 0)
            _param(layer, "g_idx", (in_per_rank,), i32, None, 0)
        _param(layer, "qzeros", (groups, out_per_rank // PACK), i32, 1, group_dim, PACK)
        _param(layer, "scales", (groups, out_per_rank), torch.float32, 1, group_dim)

    def names(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales") + (() if self.spec.method == "awq" else ("g_idx",))

    def finish(self, layer):
        if self.spec.method == "awq":
            w = awq_weight(layer.qweight, layer.qzeros, layer.scales, self.spec.group_size)
        else:
            w = gptq_weight(layer.qweight, layer.qzeros, layer.scales, layer.g_idx,
                            self.spec.group_size, self.spec.zero_offset)
        if self.spec.dequantize:
            return self.become_dense(layer, w.dequantize(), self.names())
        self.become_packed(layer, w, self.names())

    def init_dummy(self, layer, gen):
        """Random codes, zero points 8 and scales of a 0.02-wide weight."""
        for name in ("qweight", "qzeros"):
            p = getattr(layer, name)
            p.copy_(torch.randint(-2**31, 2**31 - 1, p.shape, generator=gen, dtype=torch.int64,
                                  device=p.device).to(torch.int32))
        layer.qzeros.fill_(0x77777777 if self.spec.zero_offset else -0x77777778)
        layer.scales.fill_(0.005)
        if self.spec.method == "gptq":
            layer.g_idx.copy_(torch.arange(layer.g_idx.numel()) // self.spec.group_size)
        self.finish(layer)
