"""ModelRunner: owns the model, its KV cache and the sampler; turns a StepInput into tokens."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from nanoserve.attention.backend import select_backend
from nanoserve.attention.cache_spec import cache_groups
from nanoserve.attention.metadata import AttentionMetadata, attention_metadata
from nanoserve.config import EngineConfig, ModelConfig, max_model_len
from nanoserve.layers.parallel_state import get_tp_group
from nanoserve.layers.quantization.methods import quantized_linears
from nanoserve.models.loader import init_dummy_weights, iter_weights, quant_spec_of
from nanoserve.models.registry import build_model
from nanoserve.models.weight_cache import weight_cache_entry
from nanoserve.runner.cpu_threads import per_rank_threads
from nanoserve.runner.cuda_graph import DecodeGraphs, DecodeOutput
from nanoserve.runner.device import resolve_device, resolve_dtype, resolve_kv_cache_dtype
from nanoserve.runner.graph_inputs import decode_rows, verify_rows
from nanoserve.runner.host_memory import default_cpu_kv_bytes, keep_freed_memory
from nanoserve.runner.inputs import (FAILED_ROW, PENDING_TOKEN, CompletedStep, DeferredSample,
                                     InFlightStep, SequenceChunk, StepInput, StepOutput)
from nanoserve.runner.packed_copy import packed_to_device
from nanoserve.runner.pooling import HiddenStatePooler
from nanoserve.runner.prompt_logprobs import prompt_logprobs
from nanoserve.runner.sampled_step import SampledStep
from nanoserve.runner.sampler import Sampler, SamplerOutput, mark_failed_rows, with_fused_logprobs
from nanoserve.runner.sampling_tensors import (SamplingTensors, draw_noise_seed, max_logprobs,
                                               temperatures_only)
from nanoserve.runner.spec_verify import VerifiedStep, verify
from nanoserve.runner.step_inputs import prepare_inputs
from nanoserve.startup_log import phase

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs one tensor-parallel rank's share of each step on one device, without waiting for
    it; keeps the step's samples on the device for the next to feed back (PENDING_TOKEN)."""

    feeds_pending_tokens = True

    def __init__(self, config: EngineConfig, model_config: ModelConfig, path: Path,
                 device: torch.device | None = None,
                 draft_model_config: ModelConfig | None = None):
        self.config = config
        self.model_config = model_config
        self.device = device or resolve_device(config.device)
        if self.device.type == "cpu" and config.cpu_threads is not None:
            # The ranks share the host's cores: each takes its part of the count.
            torch.set_num_threads(per_rank_threads(config.cpu_threads, get_tp_group().size))
        self.dtype = resolve_dtype(config.dtype, model_config.torch_dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype,
                                                     self.device)
        self.block_size = config.block_size
        self.max_model_len = max_model_len(config, model_config)
        self.blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.cache_groups = cache_groups(model_config.layer_windows,
                                         not config.disable_hybrid_kv_cache_manager)
        self.num_groups = self.cache_groups.num_groups
        spec = config.speculative_config
        # The largest decode graph's batch; a verify step has a row per proposal too.
        rows_per_seq = 1 if spec is None else 1 + spec.num_speculative_tokens
        self.graph_batch = min(config.max_num_seqs * rows_per_seq, 512)
        torch.manual_seed(config.seed)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.backend = select_backend(self.device)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        quant_spec = quant_spec_of(path, config.quantization)
        try:
            with torch.device(self.device), quantized_linears(quant_spec):
                self.model = build_model(model_config, self.backend)
        finally:
            torch.set_default_dtype(previous)
        with phase("loaded the weights" if config.load_format == "auto"
                   else "made random weights (load_format=dummy)", logger):
            if config.load_format == "dummy":
                init_dummy_weights(self.model)
            else:
                cache = weight_cache_entry(path, quant_spec, self.device, self.dtype,
                                           get_tp_group().size)
                if cache is None or not cache.restore(self.model):
                    self.model.load_weights(tqdm(iter_weights(path, self.dtype),
                                                 unit=" tensors", desc="Loading weights",
                                                 leave=False, disable=get_tp_group().rank != 0))
                    if cache is not None:
                        cache.save(self.model)
        if self.device.type == "cuda":  # the skinny GEMVs then apply the pre-norms themselves
            self.model.fold_norm_weights()
        self.model.eval()
        self.sampler = Sampler()
        tp = get_tp_group()
        self.sampling_rank = tp.rank == 0  # rank 0 gathers the logits and samples
        self.stopped = False
        self.generators: dict[str, torch.Generator] = {}
        self.last_samples: torch.Tensor | None = None  # the previous step's sampled ids
        self.last_sample_rows: dict[str, int] = {}  # request id -> row in last_samples
        # Set once a step's last collective (the logits' gather) is past: what fails after
        # it is rank 0's own sampling work, and tensor-parallel peers are still in step.
        self.collectives_done = False
        self.attention = [layer.self_attn for layer in self.model.model.layers]
        if self.num_groups > 1 and len({layer.cache_spec for layer in self.attention}) > 1:
            raise ValueError("cache groups share block tensors, so their layers must cache "
                             "alike; these differ: pass disable_hybrid_kv_cache_manager=True")
        attn = self.attention[0]
        self.prefill_tile = self.backend.prefill_tile(attn.num_heads, attn.num_kv_heads,
                                                      attn.head_dim, self.device)
        self.draft_model_config = draft_model_config
        with phase("sized the KV cache", logger):
            self.num_kv_blocks = self._decide_num_blocks()
            self._allocate_kv_cache()
        groups = self.cache_groups
        logger.info("KV cache: %d blocks of %d tokens, %.1f MiB (%s)%s", self.num_kv_blocks,
                    self.block_size, self.num_kv_blocks * self._bytes_per_block() / 2**20,
                    str(self.kv_cache_dtype).replace("torch.", ""),
                    f", {groups.num_groups} tables of {groups.num_slots} layers (windows "
                    f"{list(groups.windows)})" if groups.num_groups > 1 else "")
        # An embedding model pools its prompts' hidden states and never samples.
        self.pooler = HiddenStatePooler(config.pooling_type or "last") \
            if config.task == "embed" else None
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager and self.pooler is None:
            # On one GPU the LM head and sampler join the graphs (TP gathers logits outside).
            with phase(f"captured the decode CUDA graphs (batches up to {self.graph_batch})",
                       logger):
                self.graphs = DecodeGraphs(self.model, self.graph_batch, self.blocks_per_seq,
                                           self.max_model_len, self.device, sample=tp.size == 1,
                                           max_samples=config.max_num_seqs,
                                           num_groups=self.num_groups)
        self.verify_graphs: DecodeGraphs | None = None
        if self.graphs is not None and spec is not None:
            from nanoserve.kernels.decode_attention import LATENCY_MAX_SEQS

            # Up to LATENCY_MAX_SEQS rows the decode graphs' kernel stores each row's new K/V
            # itself, unseen by the other rows: a verify that small has graphs of its own.
            self.verify_graphs = DecodeGraphs(
                self.model, min(LATENCY_MAX_SEQS, self.graph_batch), self.blocks_per_seq,
                self.max_model_len, self.device, sample=tp.size == 1,
                rows_share_sequences=True, num_groups=self.num_groups)
        if self.device.type == "cuda":
            self._warm_up()

    def _warm_up(self) -> None:
        """cuBLAS loads a kernel at a GEMM shape's first use: meet the shapes here, not mid-run;
        compile the sampling kernels for every batch size."""
        config = self.config
        with phase("warmed up the GPU kernels", logger):
            if config.max_num_batched_tokens > 1:
                self.profile_run(num_tokens=config.max_num_batched_tokens - 1)
            self.model.lm_head.warm_row_counts(config.max_num_seqs)
            if self.sampling_rank:
                from nanoserve.kernels.sampling import compile_for_batches
                compile_for_batches(config.max_num_seqs, self.model_config.vocab_size,
                                    self.dtype, self.device)

    def _bytes_per_block(self) -> int:
        """A block id's bytes: a block of each slot (cache group 0's layers fill every one)."""
        itemsize = self.kv_cache_dtype.itemsize
        return sum(self.attention[i].cache_spec.bytes_per_block(self.block_size, itemsize)
                   for i in self.cache_groups.layers[0])

    def _decide_num_blocks(self) -> int:
        if self.config.num_kv_blocks:
            return self.config.num_kv_blocks
        budget = self.config.kv_cache_memory or self._default_kv_budget()
        block_bytes = self._bytes_per_block()
        draft = self.draft_model_config
        if draft is not None:  # a draft model's cache, as many blocks, shares the budget
            block_bytes += (2 * self.block_size * draft.num_kv_heads * draft.head_dim
                            * draft.num_layers * self.kv_cache_dtype.itemsize)
        # Never more than every admitted sequence could fill at full length.
        num = min(budget // block_bytes,
                  self.config.max_num_seqs * self.blocks_per_seq * self.num_groups)
        if num < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of "
                             f"{block_bytes} bytes")
        # Tensor-parallel ranks must agree: the engine addresses one block table for them all.
        return get_tp_group().min_over_ranks(int(num), self.device)

    def _default_kv_budget(self) -> int:
        if self.device.type != "cuda":
            return default_cpu_kv_bytes()
        free, total = torch.cuda.mem_get_info(self.device)
        # What this process's allocator caches but no tensor holds, the KV cache may take.
        in_use_by_others = total - free - torch.cuda.memory_reserved(self.device)
        self._allocate_kv_cache(num_blocks=1)  # the profile pass reads through block 0
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run()
        peak = torch.cuda.max_memory_allocated(self.device)
        graphs_bytes = self._decode_graphs_bytes()
        self._allocate_kv_cache(num_blocks=0)
        torch.cuda.empty_cache()
        # On top of the forward's peak: the sampler's float32 copies of the logits, the graphs'.
        logits_bytes = self.config.max_num_seqs * self.model_config.vocab_size
        spec = self.config.speculative_config
        if spec is not None:  # a verify samples at every proposal too
            logits_bytes *= 1 + spec.num_speculative_tokens
        sampler_bytes = logits_bytes * (4 * 4 + self.dtype.itemsize)
        return int(total * self.config.gpu_memory_utilization - peak - sampler_bytes
                   - graphs_bytes - max(in_use_by_others, 0))

    def _decode_graphs_bytes(self) -> int:
        """What the decode graphs, captured after the KV cache, will keep beside it: their input
        arena and their shared pool (one decode forward's activations at the largest batch)."""
        if self.config.enforce_eager:
            return 0
        arena = DecodeGraphs.arena_bytes(self.graph_batch, self.blocks_per_seq,
                                         self.config.max_num_seqs, self.num_groups)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run(decode=True)
        return arena + torch.cuda.max_memory_allocated(self.device) - before

    def _allocate_kv_cache(self, num_blocks: int | None = None) -> None:
        num_blocks = self.num_kv_blocks if num_blocks is None else num_blocks
        groups = self.cache_groups.layers
        for slot, first in enumerate(groups[0]):  # the slot's layers all store as its first
            spec = self.attention[first].cache_spec
            k_cache = self._zeros(spec.shape(num_blocks, self.block_size))
            v_cache = self._zeros(k_cache.shape) if spec.separate_values else k_cache
            for group, layers in enumerate(groups):
                if slot < len(layers):
                    layer = self.attention[layers[slot]]
                    layer.k_cache, layer.v_cache, layer.cache_group = k_cache, v_cache, group

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
        # calloc'd: the OS maps zero pages as they are first written, not all up front.
        nbytes = int(np.prod(shape)) * self.kv_cache_dtype.itemsize
        return torch.from_numpy(np.zeros(nbytes, np.uint8)).view(self.kv_cache_dtype).view(shape)

    @torch.inference_mode()
    def profile_run(self, decode: bool = False, num_tokens: int | None = None) -> None:
        """A forward over the largest batch the scheduler may build (or ``num_tokens``) to
        measure peak memory; with ``decode``, the largest graph's, without logits."""
        if num_tokens is None:
            num_tokens = self.graph_batch if decode else self.config.max_num_batched_tokens
        num_seqs = min(self.config.max_num_seqs, num_tokens)
        q_lens = [num_tokens // num_seqs] * num_seqs
        q_lens[-1] += num_tokens - sum(q_lens)
        chunks = [SequenceChunk(str(i), [0] * n, 0, [], True, None, [], [], [])
                  for i, n in enumerate(q_lens)]
        ids, positions, meta, last = self._prepare(chunks, dummy=True)
        with attention_metadata(meta):
            hidden = self.model(ids, positions)
        if not decode:
            self.model.compute_logits(hidden if last is None else hidden[last])
        torch.cuda.synchronize(self.device)

    def _prepare(self, chunks: list[SequenceChunk], dummy: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None]:
        return prepare_inputs(chunks, self.block_size, self.device, self.last_samples,
                              self.last_sample_rows, dummy, self.prefill_tile,
                              self.cache_groups.windows)

    def _generator(self, chunk: SequenceChunk) -> torch.Generator | None:
        if chunk.params.seed is None:
            return None
        if chunk.request_id not in self.generators:
            self.generators[chunk.request_id] = torch.Generator(device=self.device).manual_seed(
                chunk.params.seed)
        return self.generators[chunk.request_id]

    @torch.inference_mode()
    def launch(self, step: StepInput) -> InFlightStep:
        """Queue the step's forward and sampling on the device; return without waiting."""
        self.collectives_done = False
        for rid in step.finished_request_ids:
            self.generators.pop(rid, None)
        if self.pooler is not None:
            self.pooler.forget(step.finished_request_ids)
            ids, positions, meta, _ = self._prepare(step.chunks)
            with attention_metadata(meta):
                hidden = self.model(ids, positions)
            embeddings = self.pooler(step.chunks, hidden) if self.sampling_rank else {}
            return CompletedStep(StepOutput([], embeddings=embeddings))
        sampling = [c for c in step.chunks if c.sample]
        params = [c.params for c in sampling]
        if any(c.num_draft_tokens for c in sampling):
            return self._verify(step, sampling)
        tensors = logits = token_ids = checked_ids = last = temperature = None
        if self.graphs is not None and self.graphs.accepts(step.chunks):
            (hidden, logits, token_ids, checked_ids), tensors, temperature = self._replay(
                step.chunks, bool(step.grammar_rows))
        else:
            ids, positions, meta, last = self._prepare(step.chunks)
            if self.sampling_rank and sampling:
                tensors = self._sampling_tensors(sampling)
            with attention_metadata(meta):
                hidden = self.model(ids, positions)
        self.last_samples, self.last_sample_rows = None, {}
        prompt = prompt_logprobs(self.model, step.chunks, hidden)
        if not sampling:
            return CompletedStep(StepOutput([], prompt_logprobs=prompt))
        if logits is None:
            logits = self.model.compute_logits(hidden if last is None else hidden[last])
        self.collectives_done = True
        if not self.sampling_rank:  # a tensor-parallel worker: rank 0 gathers and samples
            return CompletedStep(StepOutput([]))
        if token_ids is not None:
            out = with_fused_logprobs(logits, token_ids, max_logprobs(params))
            return self._sampled(out, sampling, prompt, logits, checked_ids)

        @torch.inference_mode()
        def sample(bitmask: np.ndarray | None) -> SampledStep:
            if temperature is not None:  # grammar rows after a graph: one fused pass
                return self._masked_sample(logits, temperature, step.grammar_rows, bitmask,
                                           sampling, prompt)
            if step.grammar_rows:
                rows, bits = packed_to_device([(step.grammar_rows, np.int64),
                                               (bitmask.ravel(), np.int32)], self.device)
                tensors.token_bitmask = (rows, bits.view(len(step.grammar_rows), -1))
            return self._sampled(self.sampler(logits, tensors), sampling, prompt, logits)

        if step.grammar_rows and step.token_bitmask is None:
            return DeferredSample(sample)
        return sample(step.token_bitmask)

    def _verify(self, step: StepInput, sampling: list[SequenceChunk]) -> InFlightStep:
        """A step that verifies proposals (spec_verify.py): logits at every proposal and the
        token before it, rejection-sampled; its tokens not fed to the next step (speculation
        runs unoverlapped steps). Through the decode graphs where they take it, else eagerly."""
        graphs = self._verify_graphs(step.chunks)
        logits = last = None
        if graphs is not None:
            hidden, logits, _, _ = graphs.run(verify_rows(step.chunks, self.block_size,
                                                           self.cache_groups.windows))
        else:
            ids, positions, meta, last = self._prepare(step.chunks)
            with attention_metadata(meta):
                hidden = self.model(ids, positions)
        self.last_samples, self.last_sample_rows = None, {}
        prompt = prompt_logprobs(self.model, step.chunks, hidden)
        if logits is None:
            logits = self.model.compute_logits(hidden if last is None else hidden[last])
        self.collectives_done = True
        if not self.sampling_rank:
            return CompletedStep(StepOutput([]))
        # One row per proposal and one after them: each chunk's parameters, repeated.
        repeats = [c.num_draft_tokens + 1 for c in sampling]
        rows = [c for c, n in zip(sampling, repeats) for _ in range(n)]
        tensors = self._sampling_tensors(rows)
        if step.grammar_rows:  # grammar rows propose nothing: each is its chunk's one row
            first_rows = np.cumsum([0] + repeats[:-1])
            grammar = first_rows[step.grammar_rows]
            rows_t, bits = packed_to_device([(grammar, np.int64),
                                             (step.token_bitmask.ravel(), np.int32)], self.device)
            tensors.token_bitmask = (rows_t, bits.view(len(grammar), -1))
        drafts = [t for c in sampling for t in c.token_ids[len(c.token_ids) - c.num_draft_tokens:]
                  + [-1]]
        (drafts_t,) = packed_to_device([(drafts, np.int64)], self.device)
        out, accept = verify(logits, tensors, drafts_t, [i for i, t in enumerate(drafts) if t >= 0])
        return VerifiedStep(out, accept, [n - 1 for n in repeats],
                            [c.params.logprobs for c in rows], prompt)

    def _verify_graphs(self, chunks: list[SequenceChunk]) -> DecodeGraphs | None:
        """The graphs that run a verify of ``chunks`` as rows of one token (verify_rows): where
        each chunk is a sequence's last known token and its proposals, all known, and the rows
        fit; larger batches than the verify graphs' the decode graphs take, whose kernel then
        stores every row's K/V before attention."""
        if self.verify_graphs is None or not all(
                c.sample and len(c.token_ids) == c.num_draft_tokens + 1
                and PENDING_TOKEN not in c.token_ids for c in chunks):
            return None
        rows = sum(len(c.token_ids) for c in chunks)
        if rows <= self.verify_graphs.max_batch:
            return self.verify_graphs
        return self.graphs if rows <= self.graphs.max_batch else None

    def _sampled(self, out: SamplerOutput, sampling: list[SequenceChunk],
                 prompt: dict[str, list[dict[int, float]]], logits: torch.Tensor,
                 checked_ids: torch.Tensor | None = None) -> SampledStep:
        """``checked_ids``: ``out.token_ids`` already marked by mark_failed_rows (a graph's)."""
        self.last_samples = out.token_ids  # the next step may feed them, even a failed row's
        self.last_sample_rows = {c.request_id: i for i, c in enumerate(sampling)}
        if checked_ids is None:
            checked_ids = mark_failed_rows(logits, out.token_ids)
        out = dataclasses.replace(out, token_ids=checked_ids)
        return SampledStep(out, [c.params.logprobs for c in sampling], prompt)

    def _masked_sample(self, logits: torch.Tensor, temperature: np.ndarray,
                       grammar_rows: list[int], bitmask: np.ndarray,
                       sampling: list[SequenceChunk],
                       prompt: dict[str, list[dict[int, float]]]) -> SampledStep:
        """A graph step's rows drawn by the fused sampler under their grammars' ``bitmask``:
        one upload and two kernels, the tokens written where the next graph reads them (the
        general sampler's tensors and its separate failure check cost the host more than the
        forward takes at small batches)."""
        n = len(temperature)
        mask_rows = np.full(n, -1, dtype=np.int32)
        mask_rows[grammar_rows] = np.arange(len(grammar_rows), dtype=np.int32)
        temperature_t, seed, mask_rows_t, bits = packed_to_device([
            (temperature, np.float32), ([draw_noise_seed(bool(temperature.any()))], np.int64),
            (mask_rows, np.int32), (bitmask.ravel(), np.int32)], self.device)
        from nanoserve.kernels.sampling import sample_tokens

        checked = self.graphs.checked[:n]
        token_ids = sample_tokens(logits, temperature_t, seed, out=self.graphs.samples[:n],
                                  checked_out=checked, void_id=FAILED_ROW,
                                  bitmask=(None, bits.view(len(grammar_rows), -1)),
                                  mask_rows=mask_rows_t)
        out = with_fused_logprobs(logits, token_ids, max_logprobs([c.params for c in sampling]))
        return self._sampled(out, sampling, prompt, logits, checked)

    def _sampling_tensors(self, chunks: list[SequenceChunk]) -> SamplingTensors:
        return SamplingTensors.build(
            [c.params for c in chunks], [c.prompt_token_ids for c in chunks],
            [c.output_token_ids for c in chunks], [c.banned_token_ids for c in chunks],
            [self._generator(c) for c in chunks], self.model_config.vocab_size, self.device)

    def _replay(self, chunks: list[SequenceChunk], grammar: bool = False
                ) -> tuple[DecodeOutput, SamplingTensors | None, np.ndarray | None]:
        """A decode step through the CUDA graphs: the hidden states, the graph's logits and
        samples where it ran them, and the sampling tensors where it needs the general sampler.
        With ``grammar`` no row is sampled in the graph (the bitmask comes later); the rows'
        temperatures come back instead where the fused sampler serves them."""
        rows = decode_rows(chunks, self.block_size, self.last_sample_rows,
                           self.cache_groups.windows)
        fed = (rows.sample_rows >= 0).any()
        if fed and self.last_samples.data_ptr() != self.graphs.samples.data_ptr():
            # The previous step sampled outside the graphs: its tokens join the arena.
            self.graphs.samples[:len(self.last_samples)].copy_(self.last_samples)
        temperature = tensors = None
        if self.sampling_rank:
            params = [c.params for c in chunks]
            generators = [self._generator(c) for c in chunks]
            if self.graphs.sample:
                temperature = temperatures_only(params, [c.banned_token_ids for c in chunks],
                                                generators, self.model_config.vocab_size)
            if temperature is None:
                tensors = self._sampling_tensors(chunks)
        if grammar:
            return self.graphs.run(rows), tensors, temperature
        noise_seed = -1 if temperature is None else draw_noise_seed(bool(temperature.any()))
        return self.graphs.run(rows, temperature, noise_seed), tensors, None

    def close(self) -> None:
        self.generators.clear()
        self.last_samples = None
        if self.graphs is not None:
            torch.cuda.synchronize(self.device)  # a last step may still be replaying a graph
            self.graphs.release()
            self.graphs = None
        self.stopped = True
