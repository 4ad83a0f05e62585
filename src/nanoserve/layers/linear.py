"""Linear layers that shard themselves across tensor-parallel ranks: column-parallel ones split
output features (fused QKV and gate/up stack checkpoint tensors), row-parallel ones input
features. Loading is ``checkpoint_slice`` (the part this rank reads), then ``weight_loader``.
How a layer holds its weight (dense, or quantized and packed) is its ``method``'s business
(``layers/quantization``), chosen when the model is built; quantized layers multiply through
their packed matrix (not the skinny GEMV) and leave their pre-norm unfolded."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.activation import silu_and_mul
from nanoserve.layers.norm import RMSNorm, rms_norm
from nanoserve.layers.parallel_state import Narrow, divide, get_tp_group
from nanoserve.layers.quantization.methods import RawNarrow, make_linear_method

ShardId = str | int | None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           norm_eps: float | None = None, activate: bool = False,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with fusions. ``norm_eps``: the product of ``x / rms(x)``,
    the norm's weight folded into ``weight`` (``ColumnParallelLinear.fold_norm``); ``activate``:
    ``weight`` is ``[gate; up]``, the result ``silu(gate) * up``; ``residual``: the result is
    ``residual + product`` (on CUDA written into ``residual``). On CUDA in 16 bits, decode-sized
    batches go to the skinny GEMV where its ``select`` says so."""
    if x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16):
        from nanoserve.kernels import skinny_gemm
        config = skinny_gemm.select(x.shape[0], *weight.shape, x.device)
        if config is not None and (residual is None or residual.dtype == x.dtype):
            return skinny_gemm.skinny_linear(x, weight, bias, config, norm_eps=norm_eps,
                                             activate=activate, residual=residual)
    return unfused_linear(x, weight, bias, norm_eps=norm_eps, activate=activate,
                          residual=residual)


def unfused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   norm_eps: float | None = None, activate: bool = False,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`linear` through ``F.linear``, each fusion a step of its own but the residual add,
    which the GEMM does (``beta = 1``) where it can."""
    if activate and residual is not None:
        raise ValueError("linear adds into a residual or activates, not both")
    if norm_eps is not None:
        x = rms_norm(x, None, norm_eps)
    if residual is None:
        out = F.linear(x, weight, bias)
        return silu_and_mul(out) if activate else out
    if x.is_cuda and bias is None and x.dim() == 2:
        return residual.addmm_(x, weight.t())
    return residual + F.linear(x, weight, bias)


def quantized_linear(x: torch.Tensor, packed, bias: torch.Tensor | None = None, *,
                     activate: bool = False, residual: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """:func:`unfused_linear` through a packed quantized matrix (``packed.matmul``)."""
    # A decode step's x is [tokens, K] already: reshapes cost more than a small product here.
    out = packed.matmul(x) if x.dim() == 2 else \
        packed.matmul(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
    if bias is not None:
        out = out + bias
    if activate:
        out = silu_and_mul(out)
    return out if residual is None else residual + out


class _Linear(nn.Module):
    """What the parallel linears share: the method's parameters and their loading; once every
    part of every one is in, the method finishes the layer (packs it, or makes it dense)."""

    shard_ids: tuple[ShardId, ...] = (None,)

    def _create(self, in_features: int, in_per_rank: int, out_per_rank: int,
                row_parallel: bool) -> None:
        self.method = make_linear_method()
        self.packed = None  # a quantized layer's matrix, once loaded
        before = set(self._parameters)
        self.method.create_weights(self, in_features, in_per_rank, out_per_rank, row_parallel)
        self._method_params = set(self._parameters) - before
        self._unloaded = {(n, s) for n in self._method_params for s in self.shard_ids}

    def _name_of(self, param: nn.Parameter) -> str:
        return next(n for n, p in self._parameters.items() if p is param)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard: ShardId,
              dim: int | None, offset: int = 0, size: int = 0) -> None:
        name = self._name_of(param)
        if name not in self._method_params:  # a bias
            (param.data if dim is None else param.data.narrow(dim, offset, size)).copy_(loaded)
            return
        self.method.load(self, param, loaded, dim, offset, size)
        self._unloaded.discard((name, shard))
        if not self._unloaded:
            self.method.finish(self)

    def restore_finished(self, packed, dense: torch.Tensor | None) -> None:
        """Take the finished form the weight cache kept (see ``GGUFMethod.restore``)."""
        self.method.restore(self, packed, dense)
        self._unloaded.clear()

    def _narrow(self, param: nn.Parameter, dim: int, start: int, length: int) -> Narrow:
        raw = self.method.reads_raw and self._name_of(param) in self._method_params
        return (RawNarrow if raw else Narrow)(dim, start, length)

    def init_dummy(self, gen: torch.Generator) -> None:
        """Random weights (``load_format="dummy"``), finished as loaded ones are."""
        self.method.init_dummy(self, gen)


class ColumnParallelLinear(_Linear):
    """y = x W^T + b with W's rows (output features) split across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.tp = get_tp_group()
        self.out_per_rank = divide(out_features, self.tp.size, "output features")
        self._create(in_features, in_features, self.out_per_rank, row_parallel=False)
        self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False) \
            if bias else None
        if self.bias is not None:
            self.bias.output_dim, self.bias.out_pack = 0, 1

    def _slot(self, shard_id: ShardId) -> tuple[int, int]:
        """(offset, size) of checkpoint tensor ``shard_id``'s shard in this rank's parameter."""
        return 0, self.out_per_rank

    def _shard_index(self, shard_id: ShardId) -> int:
        """Which of the checkpoint tensor's equal slices this rank holds."""
        return self.tp.rank

    def checkpoint_slice(self, param: nn.Parameter, shard_id: ShardId = None) -> Narrow | None:
        if param.output_dim is None or getattr(param, "broadcast", False):
            return None  # e.g. GPTQ's g_idx, a per-tensor scale: every rank reads all of it
        size = self._slot(shard_id)[1] // param.out_pack
        return self._narrow(param, param.output_dim, self._shard_index(shard_id) * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        offset, size = self._slot(shard_id)
        dim = param.output_dim
        pack = param.out_pack if dim is not None else 1
        self._load(param, loaded, shard_id, dim, offset // pack, size // pack)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None, activate: bool = False
                ) -> torch.Tensor:
        """``linear(norm(x))``, a folded norm applied by the op (``activate``: ``silu_and_mul``)."""
        if norm is not None and norm.folded:
            return linear(x, self.weight, self.bias, norm_eps=norm.eps, activate=activate)
        if norm is not None:
            x = norm(x)
        if self.packed is not None:
            return quantized_linear(x, self.packed, self.bias, activate=activate)
        return linear(x, self.weight, self.bias, activate=activate)

    @torch.no_grad()
    def fold_norm(self, norm: RMSNorm, *others: ColumnParallelLinear) -> None:
        """Carry ``norm``'s weight in this projection's columns (``W[:, k] * g[k]``, in
        float32), and in those of ``others`` that read the same norm, leaving the norm each
        row's 1 / rms, which the projection ops apply. A quantized weight's codes cannot
        carry it: the norm then stays as it is."""
        readers = (self, *others)
        if any(p.packed is not None for p in readers):
            return
        for proj in readers:
            folded = proj.weight.float() * norm.weight.float()[None, :]
            proj.weight.copy_(folded.to(proj.weight.dtype))
        norm.weight.fill_(1.0)
        norm.folded = True


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (e.g. gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        self.out_sizes = out_sizes
        self.shard_ids = tuple(range(len(out_sizes)))
        super().__init__(in_features, sum(out_sizes), bias)

    def _slot(self, shard_id: ShardId) -> tuple[int, int]:
        sizes = [divide(s, self.tp.size, "output features") for s in self.out_sizes]
        index = int(shard_id)
        return sum(sizes[:index]), sizes[index]


class QKVParallelLinear(MergedColumnParallelLinear):
    """Fused q/k/v projection split by heads; KV heads are replicated when ranks outnumber them
    (``tp / num_kv_heads`` consecutive ranks then hold a copy of the same head)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        tp_size = get_tp_group().size
        self.num_heads = divide(num_heads, tp_size, "attention heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads = divide(num_kv_heads, tp_size, "KV heads")
        elif tp_size % num_kv_heads:
            raise ValueError(f"tensor_parallel_size ({tp_size}) must be a multiple of the "
                             f"KV heads ({num_kv_heads}) when it exceeds them")
        else:
            self.num_kv_heads = 1
        self.total_kv_heads = num_kv_heads
        self.head_dim = head_dim
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size * tp_size, kv_size * tp_size, kv_size * tp_size],
                         bias)
        self.shard_ids = ("q", "k", "v")
        self._unloaded = {(n, s) for n in self._method_params for s in self.shard_ids}

    def _slot(self, shard_id: ShardId) -> tuple[int, int]:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[
            shard_id]

    def _shard_index(self, shard_id: ShardId) -> int:
        if shard_id != "q" and self.total_kv_heads < self.tp.size:
            return self.tp.rank * self.total_kv_heads // self.tp.size
        return self.tp.rank


class RowParallelLinear(_Linear):
    """y = x W^T with W's columns (input features) split; partial sums all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.tp = get_tp_group()
        self.in_per_rank = divide(in_features, self.tp.size, "input features")
        self._create(in_features, self.in_per_rank, out_features, row_parallel=True)
        # Replicated, added once after the reduce (GPT-OSS's o_proj).
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) \
            if bias else None

    def checkpoint_slice(self, param: nn.Parameter, shard_id: ShardId = None) -> Narrow | None:
        dim = None if param is self.bias else param.input_dim
        if dim is None:  # replicated on every rank
            return None
        size = getattr(param, "logical_shape", param.shape)[dim]
        return self._narrow(param, dim, self.tp.rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        self._load(param, loaded, shard_id, None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The all-reduced product; with ``residual``, ``residual`` plus it."""
        if self.packed is not None:
            if self.tp.size == 1:
                return quantized_linear(x, self.packed, self.bias, residual=residual)
            out = self.tp.all_reduce(quantized_linear(x, self.packed))
        elif self.tp.size == 1:
            return linear(x, self.weight, self.bias, residual=residual)
        else:
            out = self.tp.all_reduce(linear(x, self.weight))
        if self.bias is not None:
            out = out + self.bias
        return out if residual is None else residual + out
