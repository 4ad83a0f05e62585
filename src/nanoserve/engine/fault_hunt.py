"""Finding which requests of a failed step are at fault, so only those fail."""
from __future__ import annotations

from collections import deque


class FaultHunt:
    """Bisects failed steps. A step's exception names no culprit, so its requests become
    suspects, run in groups that have a step to themselves: a group whose step succeeds is
    cleared, one whose step fails is halved again, and a request whose step fails alone is at
    fault. One culprit among N costs about 2 log2 N steps in which the others wait; a failure
    that does not depend on the batch (its requests run fine apart) fails nobody."""

    def __init__(self) -> None:
        self.groups: deque[list[str]] = deque()  # request ids; the first group runs next

    def suspects(self) -> set[str] | None:
        """The ids the next step may run, or None when no hunt is on."""
        return set(self.groups[0]) if self.groups else None

    def failed(self, request_ids: list[str]) -> str | None:
        """A step of these requests failed: the culprit if it ran alone, else None (its
        requests are split into two groups to run next)."""
        self.discard(request_ids)
        if len(request_ids) == 1:
            return request_ids[0]
        half = len(request_ids) // 2
        self.groups.extendleft([request_ids[half:], request_ids[:half]])
        return None

    def discard(self, request_ids: list[str]) -> None:
        """These requests are cleared (their step succeeded) or finished."""
        gone = set(request_ids)
        self.groups = deque(kept for group in self.groups
                            if (kept := [rid for rid in group if rid not in gone]))
