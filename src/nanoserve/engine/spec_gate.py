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

# Steps in a trial of the other way (by the way tried): its first is not measured (a change of
# way starts or drains the overlap of steps, so that step's tokens and time mix the two). A
# verify step's tokens vary, a plain step's do not: speculation gets the longer trial.
TRIAL_STEPS = {True: 6, False: 4}
FIRST_TRIAL_AFTER = 16  # measured steps of the preferred way before the first trial
AFTER_A_CHANGE = 32  # ... and before the next trial once a trial changed the way
MAX_TRIAL_INTERVAL = 256
CLEAR_MARGIN = 1.25  # a way this much faster waits 4x longer for its next trial, else 2x
# Each rate is output tokens over seconds of its recent steps, older steps fading by this
# factor a step: a ratio of sums, since the tokens of one step vary (1 to k + 1 a sequence).
DECAY = 0.95


@dataclass
class _Rate:
    tokens: float = 0.0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = DECAY * self.tokens + tokens
        self.seconds = DECAY * self.seconds + seconds

    @property
    def value(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


@dataclass
class _Bucket:
    """One batch-size bucket's measured rates and its schedule of trials."""

    rate: dict[bool, _Rate] = field(default_factory=lambda: {True: _Rate(), False: _Rate()})
    preferred: bool = True  # speculate, until measured otherwise
    in_trial: bool = False
    trial_left: int = 0  # steps of the other way still to run in this trial
    steps: int = 0  # measured steps of the preferred way since the last trial
    interval: int = FIRST_TRIAL_AFTER

    def record(self, speculating: bool, tokens: int, seconds: float) -> None:
        self.rate[speculating].add(tokens, seconds)
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
            self.steps, self.in_trial = 0, True
            self.trial_left = TRIAL_STEPS[not self.preferred] - 1
            self.rate[not self.preferred] = _Rate()  # this trial's steps alone count
            return not self.preferred
        return self.preferred

    def _judge(self) -> None:
        """Keep the faster way; try the other again later, sooner if the answer changed."""
        spec, plain = self.rate[True].value, self.rate[False].value
        if spec is None or plain is None:
            return
        faster = spec >= plain
        growth = 4 if max(spec, plain) >= CLEAR_MARGIN * min(spec, plain) else 2
        self.interval = (min(MAX_TRIAL_INTERVAL, growth * self.interval)
                         if faster == self.preferred else AFTER_A_CHANGE)
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
        """Batch sizes up to the next power of four share a bucket (1, 4, 16, 64, ...)."""
        bits = max(0, num_seqs - 1).bit_length()
        return 1 << (bits + bits % 2)

    def _bucket(self, num_seqs: int) -> _Bucket:
        """The bucket of ``num_seqs``; a new one starts the way its nearest neighbour runs
        (a batch's tail passes through smaller sizes, which rarely judge otherwise)."""
        key = self.bucket_of(num_seqs)
        bucket = self.buckets.get(key)
        if bucket is None:
            near = min(self.buckets, key=lambda k: abs(k.bit_length() - key.bit_length()),
                       default=None)
            bucket = self.buckets[key] = _Bucket(
                preferred=True if near is None else self.buckets[near].preferred)
        return bucket

    def begin(self, num_seqs: int) -> bool:
        now = self.clock()
        last = self._step
        if last is not None and last.measured and last.tokens is not None and now > last.start:
            last.bucket.record(last.speculating, last.tokens, now - last.start)
        bucket = self._bucket(num_seqs)
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
