"""The CPU thread count: the default from the cores free to the process, and the option
reaching torch.set_num_threads in the engine's process (split between tensor-parallel ranks)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from nanoserve.config import EngineConfig
from nanoserve.entrypoints.cli import build_parser, engine_config_from_args
from nanoserve.runner.cpu_threads import (busy_cores, cgroup_quota, choose_cpu_threads,
                                          default_cpu_threads, parse_proc_stat,
                                          per_rank_threads)


def proc_stat(*cpus: tuple[int, int]) -> str:
    """A /proc/stat of one ``cpuN`` line per (busy, idle) jiffies, after the summary line."""
    lines = [f"cpu  {sum(b for b, _ in cpus)} 0 0 {sum(i for _, i in cpus)} 0 0 0 0 0 0"]
    lines += [f"cpu{n} {b // 2} 0 {b - b // 2} {i} 0 0 0 0 0 0" for n, (b, i) in enumerate(cpus)]
    return "\n".join(lines + ["intr 12 0 0", "ctxt 99"]) + "\n"


def test_proc_stat_lines_give_each_cpus_busy_and_total_jiffies():
    text = "cpu  9 9 9 9 9 9 9 9 0 0\ncpu0 10 1 5 80 4 0 0 0 0 0\ncpu3 1 0 1 2 0 0 0 0 0 0\n"
    assert parse_proc_stat(text) == {0: (16, 100), 3: (2, 4)}  # iowait counts as idle


def test_busy_cores_counts_only_the_cpus_given():
    before = proc_stat((100, 100), (100, 100), (100, 100))
    after = proc_stat((200, 100), (150, 150), (100, 200))  # cpu0 all busy, cpu1 half, cpu2 idle
    assert busy_cores(before, after, {0, 1, 2}) == pytest.approx(1.5)
    assert busy_cores(before, after, {1, 2}) == pytest.approx(0.5)
    assert busy_cores(before, after, {7}) == 0.0  # not on this host: nothing known


@pytest.mark.parametrize("cpus,busy,quota,ceiling,want", [
    (range(8), 0.0, None, None, 8),
    (range(8), 3.0, None, None, 5),
    (range(8), 2.6, None, None, 5),  # 5.4 free: the sixth core is mostly taken
    (range(8), 2.4, None, None, 6),  # 5.6 free: more than half of the sixth is there
    (range(2), 1.0, None, None, 1),  # another process on one of two cores
    (range(2), 2.0, None, None, 1),  # all busy: still one
    (range(16), 0.0, 2.5, None, 2),  # a cgroup quota of 2.5 cores
    (range(16), 0.0, 0.5, None, 1),
    (range(16), 0.0, None, 4, 4),  # OMP_NUM_THREADS=4 (or the application) said so
    ({3}, 0.0, None, None, 1),
])
def test_the_thread_count_is_the_free_cores(cpus, busy, quota, ceiling, want):
    assert choose_cpu_threads(set(cpus), busy, quota, ceiling) == want


def test_cgroup_quota():
    assert cgroup_quota("200000 100000\n") == 2.0
    assert cgroup_quota("max 100000\n") is None
    assert cgroup_quota(None) is None and cgroup_quota("") is None


def test_tensor_parallel_ranks_split_the_threads():
    assert [per_rank_threads(8, n) for n in (1, 2, 3, 4, 16)] == [8, 4, 2, 2, 1]


def test_the_default_on_this_host_is_logged_and_within_the_affinity(caplog):
    previous = torch.get_num_threads()
    torch.set_num_threads(64)
    try:
        with caplog.at_level(logging.INFO, logger="nanoserve.runner.cpu_threads"):
            threads = default_cpu_threads()
    finally:
        torch.set_num_threads(previous)
    assert 1 <= threads <= len(os.sched_getaffinity(0))
    assert f"CPU threads: {threads} ({len(os.sched_getaffinity(0))} cores allowed" in caplog.text
    torch.set_num_threads(1)
    try:  # never above what torch was told
        assert default_cpu_threads() == 1
    finally:
        torch.set_num_threads(previous)


def test_the_flag_fills_the_config():
    args = build_parser().parse_args(["generate", "--cpu-threads", "3"])
    assert engine_config_from_args(args).cpu_threads == 3
    assert build_parser().parse_args(["serve"]).cpu_threads is None
    with pytest.raises(ValueError, match="cpu_threads must be"):
        EngineConfig(cpu_threads=0)


ENGINE_THREADS = """
    import sys, torch
    from nanoserve import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM(model=sys.argv[1], device="cpu", dtype="float32", num_kv_blocks=32,
                  tensor_parallel_size=int(sys.argv[2]), cpu_threads=int(sys.argv[3]))
        out = llm.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0))[0]
        print("threads", torch.get_num_threads(), len(out.outputs[0].token_ids), flush=True)
        llm.close()
"""


@pytest.mark.parametrize("tp,flag,want", [(1, 3, 3), (2, 4, 2)])
def test_the_option_reaches_the_engine_process(tiny_llama, tmp_path, tp, flag, want):
    script = tmp_path / "engine_threads.py"  # a file: TP workers re-import __main__
    script.write_text(textwrap.dedent(ENGINE_THREADS))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the option wins over torch's default
    run = subprocess.run([sys.executable, str(script), str(tiny_llama), str(tp), str(flag)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"threads {want} 2" in run.stdout, run.stdout + run.stderr[-2000:]
