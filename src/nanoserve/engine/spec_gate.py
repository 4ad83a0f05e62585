"""Whether speculating pays at this batch size, judged by the output rate each way.

A verify step costs more than a plain decode (k + 1 rows a sequence, and the host's work
cannot overlap the device's), so speculation loses where acceptance is low or the batch is
large. By how much depends on the model, the device and the host, so the gate measures: per
batch-size bucket it keeps the output tokens per second of steps run with and without
proposals, runs the faster way, and now and then tries the other for a few steps (more
rarely while the answer holds). Steps that compute prompt tokens are not measured.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

# Steps in a trial of the other way; its first is not measured (a change of way starts or
# drains the overlap of steps, so that step's tokens and time mix the two ways).
TRIAL_STEPS = 4
FIRST_TRIAL_AFTER = 8  # measured steps of the preferred way before a trial
MAX_TRIAL_INTERVAL = 256
SMOOTHING = 0.25  # weight of a new step in a rate's running average


@dataclass
class _Bucket:
    """One batch-size bucket's measured rates and its schedule of trials."""

    rate: dict[bool, float] = field(default_factory=dict)  # speculating -> tokens/s
    preferred: bool = True  # speculate, until measured otherwise
    in_trial: bool = False
    trial_left: int = 0  # steps of the other way still to run in this trial
    steps: int = 0  # measured steps of the preferred way since the last trial
    interval: int = FIRST_TRIAL_AFTER

    def record(self, speculating: bool, rate: float) -> None:
        old = self.rate.get(speculating)
        self.rate[speculating] = rate if old is None else old + SMOOTHING * (rate - old)
        if speculating == self.preferred and not self.in_trial:
            self.steps += 1

    def next_way(self) -> bool:
        if self.trial_left:
            self.trial_left -= 1
            return not self.preferred
        if self.in_trial:  # the trial's steps are recorded: judge it
            self.in_trial = False
            self._judge()
        if self.steps >= self.interval:
            self.steps, self.in_trial, self.trial_left = 0, True, TRIAL_STEPS - 1
            self.rate.pop(not self.preferred, None)  # this trial's steps alone count
            return not self.preferred
        return self.preferred

    def _judge(self) -> None:
        """Keep the faster way; try the other again later, sooner if the answer changed."""
        spec, plain = self.rate.get(True), self.rate.get(False)
        if spec is None or plain is None:
            return
        faster = spec >= plain
        self.interval = (min(MAX_TRIAL_INTERVAL, 2 * self.interval)
                         if faster == self.preferred else FIRST_TRIAL_AFTER)
        self.preferred = faster


@dataclass
class _Step:
    bucket: _Bucket
    speculating: bool
    start: float
    measured: bool
    tokens: int | None = None  # set by end(): a step that raised before it is not measured


class SpecGate:
    """Says before each step whether it speculates (:meth:`begin`) and learns from each
    step's output tokens (:meth:`end`) and time (until the next :meth:`begin`)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.buckets: dict[int, _Bucket] = {}
        self._step: _Step | None = None
        self.num_plain_steps = 0  # steps the gate ran without proposals

    @staticmethod
    def bucket_of(num_seqs: int) -> int:
        """Batch sizes up to the next power of two share a bucket."""
        return 1 << max(0, num_seqs - 1).bit_length()

    def begin(self, num_seqs: int) -> bool:
        now = self.clock()
        last = self._step
        if last is not None and last.measured and last.tokens is not None and now > last.start:
            last.bucket.record(last.speculating, last.tokens / (now - last.start))
        bucket = self.buckets.setdefault(self.bucket_of(num_seqs), _Bucket())
        speculating = bucket.next_way()
        measured = last is not None and last.speculating == speculating
        self._step = _Step(bucket, speculating, now, measured)
        self.num_plain_steps += not speculating
        return speculating

    def idle(self) -> None:
        """Nothing runs until the next :meth:`begin`: the last step's time is unknown."""
        self._step = None

    def end(self, tokens: int, computed_prompt: bool) -> None:
        """The step begun last yielded ``tokens`` output tokens."""
        if self._step is not None:
            self._step.tokens = tokens
            self._step.measured &= not computed_prompt
