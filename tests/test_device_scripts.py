"""The device script's steps: each name is handled by one case and listed in the usage.

A step name used twice runs only the first case that matches it, silently: that cost a device
call once (run 186, docs/benchmarks.md).
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "h200_run.sh"


def test_every_step_has_one_case_and_a_usage_entry():
    text = SCRIPT.read_text()
    cases = re.findall(r"^    ([a-z0-9]+)\)", text, flags=re.MULTILINE)
    usage = re.findall(r"\[([a-z0-9]+)\]", text.split("\nset -u", 1)[0])
    assert cases, "no step cases found: the script's layout changed"
    assert [name for name, n in Counter(cases).items() if n > 1] == []
    assert [name for name, n in Counter(usage).items() if n > 1] == []
    assert sorted(cases) == sorted(usage)
