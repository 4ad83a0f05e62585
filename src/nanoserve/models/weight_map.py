"""How checkpoint tensors map onto the decoder's parameters: the names each architecture's
checkpoints use, the parts of a packed parameter (q/k/v, gate/up, stacked experts) each fills,
and the fused or differently laid out tensors (Phi-3's qkv, GPT-OSS's experts) split or
rearranged into the layout the others use, each still read on demand."""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from nanoserve.config import ModelConfig
from nanoserve.layers.linear import ShardId
from nanoserve.layers.moe import ExpertShard
from nanoserve.layers.quantization.mxfp4 import dequantize_mxfp4, mxfp4_half
from nanoserve.models.loader import CheckpointTensor


# One expert's tensor in a Qwen3-MoE checkpoint (here all experts share stacked parameters),
# or in a Mixtral one (``block_sparse_moe``; w1 the gate, w3 the up and w2 the down projection).
EXPERT_TENSOR = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)"
                           r"\.weight")
EXPERT_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",
               "w1": "gate", "w3": "up", "w2": "down"}

# Checkpoint names of the tensors that live packed in one parameter here: (part, our name, slot).
PACKED = (("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"),
          ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))

# Which part of a parameter one checkpoint tensor fills (None: all of it).
Part = ShardId | ExpertShard


def parts_of(param_name: str, param: torch.Tensor) -> list[Part]:
    """The checkpoint parts a parameter is packed from: every one must be loaded."""
    if param_name.endswith(".experts.gate_up_proj"):
        return [(e, part) for e in range(param.shape[0]) for part in ("gate", "up")]
    if param_name.endswith(".experts.down_proj"):
        return [(e, "down") for e in range(param.shape[0])]
    slots = [slot for _, packed, slot in PACKED if f".{packed}." in param_name]
    return slots or [None]


def target_of(name: str) -> tuple[str, Part]:
    """The parameter a checkpoint tensor goes into, and which part of it (None: all)."""
    name = name.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.router.", ".mlp.gate.")
    expert = EXPERT_TENSOR.fullmatch(name)
    if expert:
        prefix, index, part = expert.groups()
        part = EXPERT_PART[part]
        return f"{prefix}.{'down_proj' if part == 'down' else 'gate_up_proj'}", (int(index), part)
    for part, packed, slot in PACKED:
        if f".{part}." in name:
            return name.replace(part, packed), slot
    return name, None


def mxfp4_tensors(weights: Iterable[tuple[str, CheckpointTensor]]
                  ) -> Iterator[tuple[str, CheckpointTensor]]:
    """Each pair of MXFP4 halves (``<name>_blocks``, ``<name>_scales``: GPT-OSS's published
    experts) as one ``<name>`` in a 16-bit checkpoint's layout ([..., in, out]), dequantized
    when read. A half waits, read, for the other (which may lie in another file)."""
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if (parts := mxfp4_half(name)) is None:
            yield name, tensor
            continue
        base, half = parts
        other = f"{base}_{'scales' if half == 'blocks' else 'blocks'}"
        if other not in pending:
            pending[name] = tensor.read()
            continue
        blocks, scales = (tensor.read(), pending.pop(other)) if half == "blocks" else \
            (pending.pop(other), tensor.read())
        shape = (*blocks.shape[:-3], blocks.shape[-2] * 32, blocks.shape[-3])
        yield base, CheckpointTensor(base, shape, torch.float32, lambda index, b=blocks, s=scales:
                                     dequantize_mxfp4(b, s).transpose(-1, -2)[index])
    if pending:
        raise ValueError(f"MXFP4 checkpoint tensors without their other half: {sorted(pending)}")


def gpt_oss_experts(weights: Iterable[tuple[str, CheckpointTensor]]
                    ) -> Iterator[tuple[str, CheckpointTensor]]:
    """GPT-OSS's experts ([E, H, 2I] gate_up with gate and up interleaved, [E, I, H] down, and
    their biases; MXFP4 ones dequantized) in the stacked layout of the others: [E, 2I, H] as
    [gate | up], [E, H, I]."""
    def halves(t: torch.Tensor) -> torch.Tensor:  # interleaved along dim 1 -> [gate | up]
        return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)

    convert = {".experts.gate_up_proj": lambda t: halves(t.transpose(1, 2)),
               ".experts.gate_up_proj_bias": halves,
               ".experts.down_proj": lambda t: t.transpose(1, 2)}
    for name, tensor in mxfp4_tensors(weights):
        fn = next((f for suffix, f in convert.items() if name.endswith(suffix)), None)
        if fn is None:
            yield name, tensor
            continue
        shape = tuple(fn(torch.empty(tensor.shape, device="meta")).shape)
        yield name, CheckpointTensor(name, shape, tensor.dtype,
                                     lambda index, t=tensor, f=fn: f(t.read())[index])


def split_fused(weights: Iterable[tuple[str, CheckpointTensor]], cfg: ModelConfig
                ) -> Iterator[tuple[str, CheckpointTensor]]:
    """Checkpoint tensors with fused ones (Phi-3's ``qkv_proj`` and ``gate_up_proj``) split
    into the q/k/v and gate/up tensors other checkpoints hold, each read on demand."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fused = {".self_attn.qkv_proj.weight": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
             ".mlp.gate_up_proj.weight": (("gate_proj", cfg.intermediate_size),
                                          ("up_proj", cfg.intermediate_size))}
    for name, tensor in weights:
        suffix = next((f for f in fused if name.endswith(f)), None)
        if suffix is None:
            yield name, tensor
            continue
        if tensor.shape[0] != sum(size for _, size in fused[suffix]):
            raise ValueError(f"checkpoint tensor {name!r} of shape {list(tensor.shape)} does "
                             f"not split into {fused[suffix]}")
        prefix, start = name[:-len(suffix)], 0
        for part, size in fused[suffix]:
            part_name = f"{prefix}{suffix.replace(suffix.split('.')[2], part)}"
            yield part_name, tensor.rows(part_name, start, size)
            start += size
