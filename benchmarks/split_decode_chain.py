"""Small-batch decode forward inside the chain of kernels, per split-decode variant and context.

One engine per shape (random bf16 weights); for each variant a decode graph of the forward
alone is captured for ``--batch`` sequences (1: ``latency.py``'s ``forward_graph_ms``) and
replayed back to back with every sequence at each context length. A variant is ``default``,
``none`` (attention returns q as it came, so o_proj follows the qkv projection at once: a
profile of attention's share, whose tokens mean nothing) or ``FIELD=VALUE,...`` where
``splits`` fixes the split count,
``unsplit=1`` runs the kernel that finishes the new tokens unsplit (one launch, no reduce),
``caps=C1/C2`` replaces the graphs' short-context caps (``caps=0``: none), ``merge=S`` merges
batch-1 splits in o_proj up to S splits (``merge=0``: never; the reduce kernel does),
``merge_tiles=N/H/W`` merges in o_proj at every shape with these features per program, heads
per chunk and warps, ``epilogue=0`` keeps the norm launches after o_proj and down_proj at
every batch and ``epilogue_min=N`` adds their output into the residual from N rows
(``linear.EPILOGUE_MIN_ROWS``), ``few_rows=0`` keeps batches of 2-4 off the skinny GEMVs
(``skinny_gemm.TUNED_FEW_ROWS``), ``tileR=N:K:BN:BK[:defer][:wW]`` (R of 2-4) sends R rows of
one shape through them with these tiles (repeatable), ``w_load=CACHE/EVICT`` sets how the
batch-1 GEMVs load W (``skinny_gemm.W_LOAD``; ``w_load=/``: Triton's default caching),
``tile=N:K:BN:BK[:defer][:wW]`` replaces the batch-1 GEMV tiles of one (N, K) shape
(``skinny_gemm.TUNED_ONE_ROW``; ``wW``: W warps, 4 unless given; repeatable), and the other
fields replace split decode's ``DecodeTuning``s (booleans as 0/1). The build before context caps is
``caps=0,num_stages=3``. One JSON line per variant and context:

    python benchmarks/split_decode_chain.py --shape qwen3-0.6b --contexts 384 2048 \\
        --variants default splits=8 splits=8,num_stages=1 none
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from common import SHAPES, emit, environment, make_model_dir, replay_ms

from nanoserve import LLM
from nanoserve.attention import triton_backend
from nanoserve.kernels import merged_o_proj, skinny_gemm
from nanoserve.kernels.decode_attention import DecodeTuning, NewTokens, decode_attention
from nanoserve.layers import linear
from nanoserve.layers.linear import RowParallelLinear
from nanoserve.runner import cuda_graph
from nanoserve.runner.cuda_graph import DecodeGraphs
from nanoserve.runner.graph_inputs import DecodeRows


def finish_in_one_launch(self, positions, q, k, v, k_cache, v_cache, meta, rotary, scale,
                         q_norm=None, k_norm=None, partials_ok=False):
    """Batch-1 decode as one launch of the kernel that finishes the new tokens, unsplit: no
    separate store before it and no reduce after it (an experiment)."""
    new = NewTokens(k, v, positions, meta.slot_mapping, rotary.cos_sin,
                    *triton_backend._norm_args(q_norm, k_norm))
    return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                            meta.query_start_loc, meta.max_seq_len, scale, num_splits=1,
                            seq_order=meta.seq_order, new_tokens=new,
                            tuning=triton_backend.SPLIT_DECODE_TUNING)


class EveryShape(dict):
    """A tiles table (``merged_o_proj.TUNED``) that holds every shape, all with one config."""

    def __init__(self, config: merged_o_proj.MergedConfig):
        super().__init__()
        self.config = config

    def __contains__(self, shape: object) -> bool:
        return True

    def get(self, shape: object, default: object = None) -> merged_o_proj.MergedConfig:
        return self.config


TUNINGS = ("SPLIT_DECODE_TUNING", "ONE_TILE_SPLIT_TUNING")


def parse_tile(spec: str) -> tuple[tuple[int, int], skinny_gemm.SkinnyConfig]:
    """``N:K:BN:BK[:defer][:wW]`` as ((N, K), its batch-1 GEMV config)."""
    n, k, block_n, block_k, *options = spec.split(":")
    warps = next((int(o[1:]) for o in options if o.startswith("w")), 4)
    return (int(n), int(k)), skinny_gemm.SkinnyConfig(int(block_n), int(block_k), warps, 4,
                                                      defer_sum="defer" in options)


def apply_variant(spec: str, model: torch.nn.Module | None = None) -> dict:
    """Patch the backend (and the graphs' context caps, ``model``'s projections) for ``spec``;
    returns what to restore. Tuning fields replace those of both split-decode tunings."""
    saved = {(triton_backend, name): getattr(triton_backend, name)
             for name in (*TUNINGS, "num_decode_splits", "MERGE_IN_O_PROJ_MAX_SPLITS")}
    saved[merged_o_proj, "TUNED"] = merged_o_proj.TUNED
    saved[skinny_gemm, "W_LOAD"] = skinny_gemm.W_LOAD
    saved[skinny_gemm, "TUNED_ONE_ROW"] = skinny_gemm.TUNED_ONE_ROW
    saved[skinny_gemm, "TUNED_FEW_ROWS"] = skinny_gemm.TUNED_FEW_ROWS
    saved[cuda_graph, "SHORT_CONTEXT_CAPS"] = cuda_graph.SHORT_CONTEXT_CAPS
    saved[triton_backend.TritonAttentionBackend, "attention"] = \
        triton_backend.TritonAttentionBackend.attention
    if spec == "none":
        triton_backend.TritonAttentionBackend.attention = \
            lambda self, positions, q, *args, **kwargs: q
        return saved
    fields: dict = {}
    for item in filter(None, spec.replace("default", "").split(",")):
        name, value = item.split("=")
        if name == "unsplit":
            triton_backend.TritonAttentionBackend.attention = finish_in_one_launch
        elif name == "splits":
            triton_backend.num_decode_splits = lambda *args, n=int(value), **kwargs: n
        elif name == "merge":
            triton_backend.MERGE_IN_O_PROJ_MAX_SPLITS = int(value)
        elif name == "merge_tiles":
            merged_o_proj.TUNED = EveryShape(
                merged_o_proj.MergedConfig(*(int(v) for v in value.split("/"))))
        elif name == "w_load":  # the batch-1 GEMVs' W loads: CACHE/EVICT, e.g. .cg/evict_first
            skinny_gemm.W_LOAD = tuple(value.split("/"))
        elif name == "tile":  # a new table, so that restore() puts the engine's back
            shape, config = parse_tile(value)
            skinny_gemm.TUNED_ONE_ROW = {**skinny_gemm.TUNED_ONE_ROW, shape: config}
        elif name == "epilogue" and value == "0":
            assert model is not None, "epilogue=0 changes a built model's projections"
            for module in model.modules():
                if isinstance(module, RowParallelLinear) and module.adds_into_residual:
                    saved[module, "adds_into_residual"] = True
                    module.adds_into_residual = False
        elif name == "epilogue_min":
            saved[linear, "EPILOGUE_MIN_ROWS"] = linear.EPILOGUE_MIN_ROWS
            linear.EPILOGUE_MIN_ROWS = int(value)
        elif name == "few_rows" and value == "0":
            skinny_gemm.TUNED_FEW_ROWS = {}
        elif name[:4] == "tile" and name[4:].isdigit():  # tile2=..., tile4=...: R rows
            rows, (shape, config) = int(name[4:]), parse_tile(value)
            tiles = skinny_gemm.TUNED_FEW_ROWS
            skinny_gemm.TUNED_FEW_ROWS = {**tiles, rows: {**tiles.get(rows, {}), shape: config}}
        elif name == "caps":  # the graphs' short-context caps, "/"-separated; 0: none
            cuda_graph.SHORT_CONTEXT_CAPS = tuple(int(c) for c in value.split("/") if c != "0")
        else:
            kind = type(getattr(DecodeTuning(), name))
            fields[name] = bool(int(value)) if kind is bool else kind(value)
    for name in TUNINGS:
        setattr(triton_backend, name, getattr(triton_backend, name)._replace(**fields))
    return saved


def restore(saved: dict) -> None:
    for (owner, name), value in saved.items():
        setattr(owner, name, value)


def decode_batch(num_seqs: int, context: int, block_size: int) -> DecodeRows:
    """Decode rows of ``num_seqs`` sequences of ``context`` keys each, in blocks of their own
    (the first sequence's 0, 1, 2, ..., the next one's after them)."""
    width = -(-context // block_size)
    tables = np.arange(num_seqs * width, dtype=np.int32).reshape(num_seqs, width)
    last = context - 1
    return DecodeRows(
        token_ids=np.full(num_seqs, 42), sample_rows=np.full(num_seqs, -1),
        positions=np.full(num_seqs, last),
        slots=(tables[:, last // block_size] * block_size + last % block_size).astype(np.int64),
        seq_lens=np.full(num_seqs, context, dtype=np.int32),
        order=np.arange(num_seqs, dtype=np.int32), tables=tables)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--contexts", type=int, nargs="+", default=[384])
    parser.add_argument("--variants", nargs="+", default=["default", "none"])
    parser.add_argument("--replays", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(args.shape, Path(tmp) / args.shape)
        llm = LLM(str(model_dir), load_format="dummy", max_num_seqs=args.batch,
                  enable_prefix_caching=False)
        runner = llm.engine.executor
        block_size = llm.engine.block_manager.block_size
        engine_graphs = runner.graphs
        for spec in args.variants:
            saved = apply_variant(spec, runner.model)
            graphs = DecodeGraphs(runner.model, args.batch, engine_graphs.max_blocks,
                                  engine_graphs.max_seq_len, runner.device)
            for context in args.contexts:
                key = graphs.key_for(args.batch, context)
                graphs.arena.stage(key[0], decode_batch(args.batch, context, block_size), None,
                                   -1)
                emit({"bench": "split_decode_chain", "shape": args.shape, "batch": args.batch,
                      "variant": spec, "context": context, "graph": key,
                      "forward_graph_ms": round(replay_ms(graphs.graphs[key], args.replays), 4),
                      **environment()})
            graphs.release()
            restore(saved)
        llm.close()


if __name__ == "__main__":
    main()
