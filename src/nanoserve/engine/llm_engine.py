"""LLMEngine: validates and tokenizes requests, runs scheduler steps, turns tokens into outputs."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from nanoserve.attention.cache_spec import CacheGroups
from nanoserve.config import EngineConfig, ModelConfig, max_model_len
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.fault_hunt import FaultHunt
from nanoserve.gc_tuning import freeze_startup_heap
from nanoserve.startup_log import phase
from nanoserve.engine.output_processor import OutputProcessor
from nanoserve.engine.request import FinishReason, Request, sample_request_ids
from nanoserve.engine.scheduler import ScheduledChunk, Scheduler
from nanoserve.engine.spec_decode import SpecDecoder, SpecStats, draft_model_assets
from nanoserve.engine.spec_draft import DraftProposer
from nanoserve.outputs import RequestOutput
from nanoserve.pooling import Pooler, resolve_pooler
from nanoserve.prompts import check_context_length, truncate_prompt
from nanoserve.runner.inputs import (FAILED_ROW, PENDING_TOKEN, DeferredSample, InFlightStep,
                                     SequenceChunk, StepInput)
from nanoserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanoserve.engine.structured_output import StructuredOutputs

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (``max_waiting_requests``): try again later."""


class Executor(Protocol):
    """Runs model steps on some device(s); the engine only sees this."""

    num_kv_blocks: int
    cache_groups: CacheGroups  # the layers sharing each block table (one table per group)
    stopped: bool  # True once it can run no more steps (closed, or broken for good)
    # Takes PENDING_TOKEN inputs, reading them from the previous step's samples on the device.
    feeds_pending_tokens: bool

    def launch(self, step: StepInput) -> InFlightStep:
        """Queue the step's work and return without waiting for it."""

    def close(self) -> None: ...


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_partial_prefills: int  # prefill chunks that stopped short of the prompt's end
    prompt_tokens: int
    generation_tokens: int
    spec: SpecStats | None = None  # speculative decoding's counters, when it is on


class LLMEngine:
    """Tokenizes, validates, schedules and runs requests, one ``step()`` at a time; not
    thread-safe, so one caller (the offline LLM, or the async engine's thread) drives it.

    A step launches the next batch, then collects the previous one's (pending) tokens, so the
    host's work for one overlaps the device's for the other. It collects first instead when
    the executor cannot feed pending tokens or some request's penalties need its full history.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer: Any,
                 executor: Executor, model_name: str, draft_executor: Executor | None = None):
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.executor = executor
        self.model_name = model_name
        self.max_model_len = max_model_len(config, model_config)
        self.block_manager = BlockManager(executor.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching)
        # The runner's cache groups: a block table per group, as it laid the cache out.
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, executor.cache_groups.windows)
        self.requests: dict[str, Request] = {}
        self.output_processor = OutputProcessor(tokenizer, self.max_model_len)
        self.aborted: list[Request] = []
        self.finished_ids: list[str] = []
        self.in_flight: tuple[list[ScheduledChunk], InFlightStep] | None = None
        self.fault_hunt = FaultHunt()
        self.num_history_requests = 0  # unfinished requests whose sampling reads past tokens
        self._structured: StructuredOutputs | None = None
        self._structured_lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        spec = config.speculative_config
        draft = None
        if draft_executor is not None:
            draft = DraftProposer(draft_executor, config.block_size, draft_executor.max_model_len,
                                  config.max_num_batched_tokens)
        self.spec = None if spec is None else SpecDecoder(spec, self.max_model_len, draft)
        if self.spec is not None:
            self.scheduler.proposer = self.spec.propose
        self.pooler: Pooler | None = None  # set for an embedding model (task "embed")

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        from nanoserve.config import resolve_model_path
        from nanoserve.models.asset_cache import cached_model_assets
        from nanoserve.runner.executor import make_draft_executor, make_executor

        start = time.perf_counter()
        path = resolve_model_path(config.model)
        with phase("read the config and tokenizer", logger):
            hf_config, tokenizer, extra_eos = cached_model_assets(
                path, require_weights=config.load_format != "dummy")
            model_config = ModelConfig.from_hf(hf_config, extra_eos)
        pooler = resolve_pooler(path, config.task, config.pooling_type, hf_config)
        if pooler is not None:  # pooling reads every prompt position: no cached prefixes
            if config.speculative_config is not None:
                raise ValueError("speculative_config is not supported for an embedding model")
            config = dataclasses.replace(config, task="embed", enable_prefix_caching=False,
                                         pooling_type=pooler.pooling_type)
            logger.info("embedding model: %s pooling%s", pooler.pooling_type,
                        ", normalised" if pooler.normalize else "")
        else:
            config = dataclasses.replace(config, task="generate")
        draft_assets = draft_model_assets(config, model_config)
        executor = make_executor(config, model_config, path,
                                 draft_assets[1] if draft_assets is not None else None)
        draft = None
        if draft_assets is not None:
            with phase("load the draft model", logger):
                draft = make_draft_executor(config, executor, *draft_assets)
        engine = cls(config, model_config, tokenizer, executor, str(path), draft)
        engine.pooler = pooler
        freeze_startup_heap()
        logger.info("engine ready in %.2f s: %s (%s, %d layers), %d KV blocks of %d tokens, "
                    "max_model_len %d", time.perf_counter() - start, path,
                    model_config.architecture, model_config.num_layers, executor.num_kv_blocks,
                    config.block_size, engine.max_model_len)
        return engine

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None, stream: bool = True) -> None:
        """Queue a request as its ``params.n`` samples, all or none: sequences with the ids
        ``sample_request_ids`` gives, sample k seeded ``seed + k``, the first computing the
        prompt for the others to share. ``stream=False``: step() reports a sample only once,
        when finished."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if self.config.task == "embed":  # a prefill whose pooled state ends the request
            params = SamplingParams(max_tokens=1, temperature=0.0,
                                    truncate_prompt_tokens=params.truncate_prompt_tokens)
        for name, option in (("n", "max_n"), ("logprobs", "max_logprobs"),
                             ("prompt_logprobs", "max_logprobs")):
            value, limit = getattr(params, name), getattr(self.config, option)
            if value is not None and value > limit:
                raise ValueError(f"{name} must be <= {limit} (the engine's {option}), got {value}")
        request_ids = sample_request_ids(request_id, params.n)
        for rid in request_ids:
            if rid in self.requests:
                raise ValueError(f"request id {rid!r} is already in use")
        self._check_load()
        text, ids = self._tokenize(prompt)
        kept = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)
        if kept is not ids:  # the text no longer matches the ids: drop it
            text, ids = None, kept
        vocab = self.model_config.vocab_size
        for name in ("logit_bias", "allowed_token_ids"):
            outside = [t for t in getattr(params, name) or () if t >= vocab]
            if outside:
                raise ValueError(f"{name} token ids must be in [0, {vocab}), got {outside[:5]}")
        check_context_length(len(ids), params.max_tokens, self.max_model_len)
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        blocks = self.scheduler.max_blocks_held(len(ids) + max_tokens)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(
                f"request needs {blocks} KV cache blocks for {len(ids)} prompt + {max_tokens} "
                f"new tokens but the whole cache has {self.block_manager.num_blocks}; "
                "lower max_tokens or give the cache more memory")
        eos = frozenset() if params.ignore_eos else frozenset(self.model_config.eos_token_ids)
        # Samples admitted together would each compute the prompt: the others wait for the
        # first (a step, unless its prefill is chunked) and share its cached full blocks.
        shares = (self.config.enable_prefix_caching and params.prompt_logprobs is None
                  and len(ids) > self.config.block_size)
        spec = params.structured_outputs
        if spec is not None:
            self.structured_outputs().compiler.compile(spec)  # raises before anything is added
        leader = None
        for k, rid in enumerate(request_ids):
            if spec is not None:
                self._structured.add(rid, spec)
            req = Request(rid, text, ids, params.for_sample(k), max_tokens, eos,
                          arrival_time=arrival_time or time.time(), stream=stream,
                          prefix_leader=leader)
            if shares and leader is None:
                leader = req
            self.requests[rid] = req
            self.num_history_requests += params.needs_token_history
            self.output_processor.add(req)
            self.scheduler.add(req)

    def _check_load(self) -> None:
        """EngineOverloadedError while the requests waiting reach ``max_waiting_requests`` or
        their tokens ``max_waiting_tokens``. Those that the next step can seat do not count
        as waiting: a burst into an idle engine fills it."""
        sched, config = self.scheduler, self.config
        seats = max(0, sched.max_num_seqs - len(sched.running))
        bound = config.max_waiting_requests
        if bound is not None and len(sched.waiting) - seats >= bound:
            raise EngineOverloadedError(f"{bound} requests are already waiting "
                                        "(max_waiting_requests); try again later")
        bound = config.max_waiting_tokens
        if bound is not None and len(sched.waiting) > seats:
            queued = sum(req.num_tokens for req in itertools.islice(sched.waiting, seats, None))
            if queued >= bound:
                raise EngineOverloadedError(
                    f"{queued} prompt tokens are already waiting, the bound is {bound} "
                    "(max_waiting_tokens); try again later")

    def structured_outputs(self) -> StructuredOutputs:
        """The grammar compiler and matchers, made on first use (xgrammar loads then)."""
        with self._structured_lock:  # the server's event loop may get here first
            if self._structured is None:
                from nanoserve.engine.structured_output import GrammarCompiler, StructuredOutputs

                compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                           list(self.model_config.eos_token_ids))
                self._structured = StructuredOutputs(compiler)
            return self._structured

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        elif isinstance(prompt, (list, tuple)) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids, text = list(prompt), None
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {self.model_config.vocab_size})"
                                 f", got {bad[:5]}")
        else:
            raise ValueError("prompt must be a string or a list of token ids, "
                             f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt must not be empty")
        return text, ids

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            req = self.requests.get(rid)
            if req is None or req.finished:
                continue
            self.scheduler.finish(req)
            req.finish(FinishReason.ABORT)
            self.aborted.append(req)

    @property
    def executor_alive(self) -> bool:
        return not self.executor.stopped

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self.aborted)
                or self.in_flight is not None)

    def step(self) -> list[RequestOutput]:
        """One step: launch the next batch, collect the last. An exception in a batch's work
        fails only the requests at fault (FaultHunt), each with finish reason "error"; it
        propagates when the executor stopped for good or the engine's own bookkeeping broke."""
        outputs = [self._finalize(req) for req in self.aborted]
        self.aborted = []
        tokens_before = self.generation_tokens
        speculating = self.spec is not None and self.spec.begin_step(len(self.scheduler.running))
        # Proposals read the previous step's tokens: speculating steps are not overlapped.
        overlap = (self.executor.feeds_pending_tokens and not self.num_history_requests
                   and not self.fault_hunt.groups and not speculating)
        previous, self.in_flight = self.in_flight, None
        try:
            if not overlap:
                outputs += self._collect(previous)
                previous = None
            suspects = self.fault_hunt.suspects()
            if self.spec is not None:
                self.spec.prepare(self.scheduler.running)
            sched = self.scheduler.schedule(suspects)
            if not sched.chunks and suspects is not None:  # no suspect can run now: the rest
                sched = self.scheduler.schedule()
            step = None
            if sched.chunks:
                # Overlapped, a grammar's bitmask waits for the previous step's tokens.
                step = self._step_input(sched.chunks, with_bitmask=not overlap)
                if previous is not None and isinstance(previous[1], DeferredSample):
                    previous[1].flush()  # its tokens feed this step's forward
                try:
                    launched = self.executor.launch(step)
                except Exception as exc:  # the previous step is intact: it is still collected
                    return outputs + self._collect(previous) + self._blame(sched.chunks, exc)
                self.in_flight = (sched.chunks, launched)
                for chunk in sched.chunks:
                    self.scheduler.advance(chunk)
            # Overlapped, the grammar rows' bitmask is filled on a worker thread from the
            # moment their matchers took the previous step's tokens, while this thread makes
            # outputs and the next step; it is flushed just before the next launch.
            fill = None
            if step is not None and step.grammar_rows and step.token_bitmask is None:
                self.in_flight[1].bitmask_source = self._structured.wait_bitmask
                fill = (lambda: self._structured.start_bitmask(
                    self._grammar_requests(sched.chunks, step.grammar_rows)))
            outputs += self._collect(previous, fill)
            if not overlap:
                current, self.in_flight = self.in_flight, None
                outputs += self._collect(current)
        except BaseException:
            self._forget_pending()
            raise
        if self.spec is not None:
            self.spec.end_step(self.generation_tokens - tokens_before, any(
                c.num_tokens - len(c.draft_token_ids) > 1 for c in sched.chunks))
            if not self.has_unfinished_requests():
                self.spec.idle()
        return outputs

    def _blame(self, chunks: list[ScheduledChunk], exc: Exception) -> list[RequestOutput]:
        """A launch of ``chunks`` raised: hunt for the request at fault, fail it if found."""
        if self.executor.stopped:
            raise exc
        ids = list(dict.fromkeys(c.request.request_id for c in chunks if not c.request.finished))
        culprit = self.fault_hunt.failed(ids) if ids else None
        if culprit is None:
            logger.warning("a step of %d requests failed (%r); running them apart", len(ids), exc)
            return []
        logger.error("request %s failed", culprit, exc_info=exc)
        return [self._fail(self.requests[culprit], exc)]

    def _fail(self, req: Request, exc: Exception) -> RequestOutput:
        self.scheduler.finish(req)
        req.finish(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        return self._finalize(req)

    def _forget_pending(self) -> None:
        """After a failed step: drop every token still on the device (the runner no longer
        holds them); their requests recompute their last known token to sample again."""
        self.in_flight = None
        for req in self.requests.values():
            if req.num_pending_tokens:
                req.num_pending_tokens = 0
                req.num_computed_tokens = min(req.num_computed_tokens, len(req.token_ids) - 1)

    def _collect(self, batch: tuple[list[ScheduledChunk], InFlightStep] | None,
                 then: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Wait for a launched batch's tokens and turn them into outputs; ``then`` runs as soon
        as the grammars took the tokens. A request whose token cannot be taken (its logits
        were not finite, its detokenization raised) fails."""
        if batch is None:
            if then is not None:
                then()
            return []
        chunks, pending = batch
        step_out = pending.result()
        outputs = []
        now = time.time()
        for chunk in chunks if step_out.prompt_logprobs else ():
            entries = step_out.prompt_logprobs.get(chunk.request.request_id)
            if entries is not None and not chunk.request.finished:
                chunk.request.add_prompt_logprobs(chunk.start + 1, entries)
        sampling = [c for c in chunks if c.samples]
        logprobs = step_out.logprobs or [None] * len(sampling)
        accepted = step_out.accepted_token_ids or [[]] * len(sampling)
        accepted_logprobs = step_out.accepted_logprobs or [None] * len(sampling)
        grammar_ok = self._structured.accept({
            c.request.request_id: t for c, t in zip(sampling, step_out.token_ids)
            if c.request.params.structured_outputs is not None and not c.request.finished
            and t != FAILED_ROW}) if self._structured else {}
        if then is not None:
            then()
        for i, (chunk, token) in enumerate(zip(sampling, step_out.token_ids)):
            req = chunk.request
            if req.finished:  # ended (a stop, an abort) while this step ran: drop its token
                continue
            tokens, token_logprobs = [token], [logprobs[i]]
            if chunk.draft_token_ids:
                tokens, token_logprobs = self._verified(chunk, accepted[i], accepted_logprobs[i],
                                                        token, logprobs[i])
            try:
                for token, lp in zip(tokens, token_logprobs):
                    self._take_token(req, token, lp, now, grammar_ok.get(req.request_id))
                    if req.finished:  # a stop among the accepted tokens: drop the rest
                        break
            except Exception as exc:
                logger.error("request %s failed", req.request_id, exc_info=exc)
                outputs.append(self._fail(req, exc))
                continue
            if req.finished:
                self.scheduler.finish(req)
                outputs.append(self._finalize(req))
            elif req.stream:
                outputs.append(self.output_processor.output(req))
        for rid, pooled in step_out.embeddings.items():  # embed requests end here
            req = self.requests.get(rid)
            if req is not None and not req.finished:
                self.prompt_tokens += req.num_prompt_tokens
                req.finish(FinishReason.STOP)
                self.scheduler.finish(req)
                outputs.append(self._finalize(req))
                outputs[-1].embedding = pooled
        if self.fault_hunt.groups:  # these ran without failing: no longer suspects
            self.fault_hunt.discard([c.request.request_id for c in chunks])
        return outputs

    def _verified(self, chunk: ScheduledChunk, accepted: list[int],
                  accepted_logprobs: list[dict[int, float]] | None, token: int,
                  token_logprobs: dict[int, float] | None
                  ) -> tuple[list[int], list[dict[int, float] | None]]:
        """A verify step's tokens for ``chunk``'s request: the accepted proposals, then the
        token sampled after them; the K/V of the rejected ones is rolled back first, so that
        only accepted tokens are hashed into the prefix cache."""
        req = chunk.request
        num_proposed = len(chunk.draft_token_ids)
        # The chunk's known tokens (a prompt's last part, or the last token) and the accepted.
        num_valid = chunk.start + chunk.num_tokens - num_proposed + len(accepted)
        self.spec.record(req, num_proposed, len(accepted), num_valid)
        self.scheduler.rollback(req, num_valid)
        req.num_pending_tokens += len(accepted)  # each token taken counts one pending off
        lps = accepted_logprobs or [None] * len(accepted)
        return accepted + [token], lps + [token_logprobs]

    def _take_token(self, req: Request, token: int, token_logprobs: dict[int, float] | None,
                    now: float, grammar_ok: bool | None = None) -> None:
        """Add a sampled token to ``req``; ``grammar_ok``: whether its grammar (if it has
        one) accepted the token, the matcher having advanced."""
        if token == FAILED_ROW or grammar_ok is False:
            # Checked only here, where a row failed: scanning every mask for an empty one
            # would cost the host each step.
            if (req.params.structured_outputs is not None
                    and self._structured.allows_nothing(req.request_id)):
                raise ValueError(
                    f"structured_outputs: after {req.num_output_tokens} tokens the grammar "
                    "allows no token of this model's vocabulary (it needs bytes that no token "
                    "holds)")
            if token == FAILED_ROW:
                raise FloatingPointError("the model's logits for this request are not finite")
            raise ValueError(f"the grammar does not allow token {token}")
        req.num_pending_tokens -= 1
        if req.first_token_time is None:
            self.prompt_tokens += req.num_prompt_tokens
        if token_logprobs is not None:
            req.logprobs = req.logprobs if req.logprobs is not None else []
            req.logprobs.append(token_logprobs)
        self.generation_tokens += 1
        self.output_processor.append_token(req, token, now)
        if grammar_ok and req.request_id in self._structured.terminated and not req.finished:
            req.finish(FinishReason.STOP)  # the grammar ended on a stop token it ignores
        self.scheduler.register_known_blocks(req)

    def _grammar_requests(self, chunks: list[ScheduledChunk], rows: list[int]
                          ) -> list[str | None]:
        """The requests of a step's sampling ``rows`` under a grammar (None: ended)."""
        sampling = [c.request for c in chunks if c.samples]
        return [None if sampling[i].finished else sampling[i].request_id for i in rows]

    def _step_input(self, chunks: list[ScheduledChunk], with_bitmask: bool = True
                    ) -> StepInput:
        seqs = []
        for c in chunks:
            req, params = c.request, c.request.params
            banned = []
            if req.num_sampled_tokens < params.min_tokens:
                banned = list(req.eos_token_ids) + list(params.stop_token_ids)
            known = c.num_tokens - len(c.draft_token_ids)
            token_ids = req.token_ids[c.start:c.start + known]
            if len(token_ids) < known:  # a decode of a token still on the device
                token_ids.append(PENDING_TOKEN)
            token_ids += c.draft_token_ids
            seqs.append(SequenceChunk(
                request_id=req.request_id,
                token_ids=token_ids,
                start=c.start, block_table=req.block_table, sample=c.samples, params=params,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=req.output_token_ids if params.needs_token_history else [],
                banned_token_ids=banned,
                prompt_logprob_rows=0 if req.prompt_logprobs is None
                else req.prompt_logprob_rows(c.start, c.num_tokens),
                num_draft_tokens=len(c.draft_token_ids), more_tables=req.block_tables[1:]))
        finished, self.finished_ids = self.finished_ids, []
        grammar_rows = [i for i, c in enumerate(c for c in chunks if c.samples)
                        if c.request.params.structured_outputs is not None]
        bitmask = self._structured.bitmask(self._grammar_requests(chunks, grammar_rows)) \
            if grammar_rows and with_bitmask else None
        return StepInput(seqs, finished, grammar_rows, bitmask)

    def _finalize(self, req: Request) -> RequestOutput:
        del self.requests[req.request_id]
        if self.fault_hunt.groups:
            self.fault_hunt.discard([req.request_id])
        self.num_history_requests -= req.params.needs_token_history
        if self.spec is not None:
            self.spec.release(req)
        self.output_processor.remove(req)
        if self._structured is not None:
            self._structured.remove(req.request_id)
        self.finished_ids.append(req.request_id)
        return self.output_processor.output(req)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests hold blocks."""
        return self.block_manager.reset_prefix_cache()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage(), num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks, prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits, num_preemptions=self.scheduler.num_preemptions,
            num_partial_prefills=self.scheduler.num_partial_prefills,
            prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
            spec=None if self.spec is None else dataclasses.replace(
                self.spec.stats, accepted_per_pos=list(self.spec.stats.accepted_per_pos)))

    def close(self) -> None:
        if self._structured is not None:
            self._structured.close()
            self._structured.compiler.close()
        self.executor.close()
        if self.spec is not None and self.spec.draft is not None:
            self.spec.draft.executor.close()
