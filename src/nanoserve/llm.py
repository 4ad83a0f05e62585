"""The offline API: `LLM(...).generate(prompts, params)`, shaped like vLLM's."""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from nanoserve.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from nanoserve.config import EngineConfig
from nanoserve.engine.chat import render_chat
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.request import sample_request_ids
from nanoserve.outputs import RequestOutput
from nanoserve.prompts import as_prompt_list
from nanoserve.sampling_params import SamplingParams
from nanoserve.startup_log import configure_logging

Message = dict[str, str]

# Offline batches want throughput: twice the server's per-step token budget (EngineConfig's,
# which bounds how long a prefill holds up streams) halves the prefill steps.
OFFLINE_MAX_NUM_BATCHED_TOKENS = 16384


class LLM:
    """Batch generation over a local model; ``model=None`` loads the packaged SmolLM2-135M."""

    def __init__(self, model: str | None = None, **engine_args: object):
        configure_logging()
        engine_args.setdefault("max_num_batched_tokens", OFFLINE_MAX_NUM_BATCHED_TOKENS)
        self.engine = LLMEngine.from_config(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt, in order; a prompt whose params ask for ``n`` samples comes
        back as one output holding ``n``."""
        if self.engine.config.task == "embed":
            raise ValueError("this model makes embeddings (task='embed'): use LLM.embed")
        prompts = as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        for p in params:  # grammars compile side by side, before the first add waits
            if isinstance(p, SamplingParams) and p.structured_outputs is not None:
                self.engine.structured_outputs().compiler.submit(p.structured_outputs)
        ids: list[list[str]] = []  # each prompt's samples' engine ids
        try:
            for prompt, p in zip(prompts, params):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p, stream=False)
                ids.append(sample_request_ids(rid, p.n))
        except Exception:  # leave no part of the batch queued
            self.engine.abort_request([rid for group in ids for rid in group])
            self._drain()
            raise
        done = self._run([rid for group in ids for rid in group], use_tqdm)
        return [_samples_as_one([done[rid] for rid in group]) for group in ids]

    def embed(self, prompts: str | Sequence[str] | Sequence[list[int]], *,
              dimensions: int | None = None, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[RequestOutput]:
        """Each prompt's embedding (``out.embedding``), in order, batched through the
        scheduler; needs an embedding model (``task="embed"``, or a sentence-transformers
        folder). ``dimensions``: a Matryoshka truncation the model declares."""
        pooler = self.engine.pooler
        if pooler is None:
            raise ValueError("embed needs an embedding model: LLM(model, task='embed')")
        pooler.check_dimensions(dimensions)
        params = SamplingParams(max_tokens=1, truncate_prompt_tokens=truncate_prompt_tokens)
        ids = []
        try:
            for prompt in as_prompt_list(prompts):
                ids.append(str(next(self._ids)))
                self.engine.add_request(ids[-1], prompt, params, stream=False)
        except Exception:
            self.engine.abort_request(ids)
            self._drain()
            raise
        done = self._run(ids, use_tqdm)
        outputs = [done[rid] for rid in ids]
        for out in outputs:
            out.embedding = pooler.finish(out.embedding, dimensions)
        return outputs

    def beam_search(self, prompts: str | Sequence[str] | Sequence[list[int]],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Each prompt's ``params.beam_width`` best continuations, in the order of the prompts."""
        return beam_search(self, prompts, params)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, add_generation_prompt: bool = True,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Render each conversation with the chat template (and ``tools``,
        ``chat_template_kwargs``, as vLLM's), then generate; answers come back as text."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.render_chat(c, add_generation_prompt, tools, chat_template_kwargs)
                   for c in conversations]
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        for out in outputs:  # the rendered conversation, as vLLM's
            out.prompt = self.tokenizer.decode(out.prompt_token_ids)
        return outputs

    def render_chat(self, conversation: list[Message], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return render_chat(self.tokenizer, conversation, add_generation_prompt, tools,
                           chat_template_kwargs)

    def stream_chat(self, conversation: list[Message],
                    sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the reply's text as it is generated."""
        rid = str(next(self._ids))
        self.engine.add_request(rid, self.render_chat(conversation), sampling_params)
        sent = 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id == rid:
                        text = out.outputs[0].text
                        if len(text) > sent:
                            yield text[sent:]
                            sent = len(text)
        finally:
            self.engine.abort_request(rid)
            self._drain()

    def _run(self, ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm)
        engine, start = self.engine, time.perf_counter()
        tokens_before = engine.prompt_tokens, engine.generation_tokens
        while len(done) < len(ids):
            for out in engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    bar.update(1)
            if use_tqdm:  # vLLM's live rates: prompts' tokens (at their first token), answers'
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(
                    f"prefill {(engine.prompt_tokens - tokens_before[0]) / elapsed:.1f} tok/s, "
                    f"decode {(engine.generation_tokens - tokens_before[1]) / elapsed:.1f} tok/s",
                    refresh=False)
        bar.close()
        return done

    def _drain(self) -> None:
        while self.engine.aborted:
            self.engine.step()

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes (all requests must be finished); returns whether it did."""
        return self.engine.reset_prefix_cache()

    def close(self) -> None:
        self.engine.close()


def _samples_as_one(samples: list[RequestOutput]) -> RequestOutput:
    """The ``n`` finished samples of one prompt as the first's output holding every completion."""
    completions = [dataclasses.replace(s.outputs[0], index=k) for k, s in enumerate(samples)]
    return dataclasses.replace(samples[0], outputs=completions)
