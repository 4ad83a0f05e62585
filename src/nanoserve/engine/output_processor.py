"""Turns sampled tokens into request progress: stop checks, detokenization, outputs."""
from __future__ import annotations

from typing import Any

from nanoserve.engine.detokenizer import IncrementalDetokenizer, find_stop
from nanoserve.engine.request import FinishReason, Request
from nanoserve.outputs import CompletionOutput, RequestOutput


class OutputProcessor:
    """Owns each live request's detokenizer. Appends sampled tokens, finishes a request when a
    token ends it (EOS, a stop id or string, its length) and builds its RequestOutput."""

    def __init__(self, tokenizer: Any, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add(self, req: Request) -> None:
        self.detokenizers[req.request_id] = IncrementalDetokenizer(
            self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens)

    def remove(self, req: Request) -> None:
        del self.detokenizers[req.request_id]

    def append_token(self, req: Request, token: int, now: float) -> None:
        """Add a sampled token to the request; finish it if the token ends it."""
        req.token_ids.append(token)
        req.first_token_time = req.first_token_time or now
        req.last_token_time = now
        params = req.params
        detok = self.detokenizers[req.request_id]
        each_token = req.detokenizes_each_token
        past_min = req.num_output_tokens > params.min_tokens
        if past_min and token in req.eos_token_ids:
            req.finish(FinishReason.STOP)
        elif past_min and token in params.stop_token_ids:
            if params.include_stop_str_in_output and each_token:
                req.output_text += detok.push(token)
            req.finish(FinishReason.STOP, token)
        elif each_token:
            delta = detok.push(token)
            req.output_text += delta
            if past_min and params.stop_strings and delta:
                self._check_stop_strings(req, len(delta))
        if not req.finished and (req.num_output_tokens >= req.max_tokens
                                 or len(req.token_ids) >= self.max_model_len):
            req.finish(FinishReason.LENGTH)
        if req.finished and not isinstance(req.stop_reason, str):
            if not each_token:
                req.output_text = detok.decode_all(self._text_token_ids(req))
                return
            # Text held back for an incomplete character comes out now; it may hold a stop.
            tail = detok.flush()
            req.output_text += tail
            if past_min and params.stop_strings and tail:
                self._check_stop_strings(req, len(tail))

    @staticmethod
    def _text_token_ids(req: Request) -> list[int]:
        """Output tokens that carry text: not a final EOS, nor a stop id kept out of the text."""
        ids = req.output_token_ids
        ended_by_token = req.finish_reason is FinishReason.STOP and (
            req.stop_reason is None or not req.params.include_stop_str_in_output)
        return ids[:-1] if ended_by_token else ids

    def _check_stop_strings(self, req: Request, num_new_chars: int) -> None:
        hit = find_stop(req.output_text, num_new_chars, req.params.stop_strings)
        if hit is None:
            return
        idx, stop = hit
        end = idx + len(stop) if req.params.include_stop_str_in_output else idx
        req.output_text = req.output_text[:end]
        req.finish(FinishReason.STOP, stop)

    def _visible_text(self, req: Request) -> str:
        """Running text minus a tail that might still become a stop string."""
        stops = req.params.stop_strings
        if req.finished or not stops or req.params.include_stop_str_in_output:
            return req.output_text
        hold = max(len(s) for s in stops) - 1
        return req.output_text[:len(req.output_text) - hold] if hold else req.output_text

    def output(self, req: Request) -> RequestOutput:
        """The request's progress (or final result) as the API reports it."""
        completion = CompletionOutput(
            index=0, text=self._visible_text(req), token_ids=req.output_token_ids,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if req.logprobs is not None else None)
        metrics = {k: v for k, v in (
            ("arrival_time", req.arrival_time), ("first_scheduled_time", req.first_scheduled_time),
            ("first_token_time", req.first_token_time), ("last_token_time", req.last_token_time),
            ("finished_time", req.finished_time)) if v is not None}
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion],
                             req.finished, req.num_cached_tokens, metrics,
                             None if req.prompt_logprobs is None else list(req.prompt_logprobs))
