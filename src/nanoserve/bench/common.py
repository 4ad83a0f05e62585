"""Shared benchmark helpers: CUDA-graph timing, profiler kernel time, the environment, JSON output.

Model shapes and their folders are shapes.py's, floors and the device's ceilings floor.py's.
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch



class GCTimer:
    """Python's garbage collections while active: per generation, how many and how long."""

    def __init__(self) -> None:
        self.counts, self.ms, self._start = [0, 0, 0], [0.0, 0.0, 0.0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.ms[info["generation"]] += (time.perf_counter() - self._start) * 1e3

    def report(self) -> dict:
        return {"collections": self.counts, "ms": [round(t, 2) for t in self.ms]}


def copy_bandwidth_gbs(nbytes: int = 4 << 30, iters: int = 20) -> float:
    """Device memory bandwidth in GB/s, bytes read + written by a large copy (floor.py's)."""
    from nanoserve.bench.floor import copy_bandwidth

    return copy_bandwidth(nbytes, iters) / 1e9


def environment() -> dict[str, str]:
    """Device, driver, library versions and date, for every result line."""
    import transformers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = ""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = ""
    return {"device": gpu, "driver": driver, "torch": torch.__version__,
            "cuda": str(torch.version.cuda), "triton": triton_version,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d")}


def on_gpu(device: str = "auto") -> bool:
    """Whether an engine for ``device`` ("auto", "cpu", "cuda") runs on a GPU."""
    return device != "cpu" and torch.cuda.is_available()


def sync(device: str = "auto") -> None:
    if on_gpu(device):
        torch.cuda.synchronize()


def timed_generate(llm, prompts: list[list[int]], params, device: str = "auto"
                   ) -> tuple[float, int]:
    """One ``llm.generate`` over ``prompts`` (``params``: one or one a prompt): its seconds,
    the device synchronised at both ends, and the output tokens it produced."""
    sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def free_device_memory() -> None:
    """Give a closed engine's memory back (between shapes in one process)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def add_deadline_argument(parser) -> None:
    """``--deadline-s``, the ``deadline_s`` of ``run_shapes``."""
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start no shape after this many seconds, or when the last shape's "
                             "time would cross it (the rest get a skipped line)")


def run_shapes(bench: str, shapes: list[str], run_shape: Callable[[str, Path], None],
               deadline_s: float | None) -> None:
    """``run_shape(name, tmp)`` for each shape in turn, in one temporary folder: a shape that
    fails leaves the others an error line, and none starts that the last one's time says
    would cross ``deadline_s`` (a skipped line instead)."""
    import tempfile
    import traceback

    start, last = time.perf_counter(), 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for name in shapes:
            elapsed = time.perf_counter() - start
            if deadline_s is not None and elapsed + last > deadline_s:
                emit({"bench": bench, "shape": name, "skipped": "deadline",
                      "elapsed_s": round(elapsed, 1)})
                continue
            began = time.perf_counter()
            try:
                run_shape(name, Path(tmp))
            except Exception as exc:  # noqa: BLE001 (one shape's failure leaves the others)
                traceback.print_exc()
                emit({"bench": bench, "shape": name, "error": repr(exc)[:500]})
                free_device_memory()
            last = time.perf_counter() - began
            print(f"{bench}: {name} took {last:.1f} s", file=sys.stderr, flush=True)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def graph_us(calls: list[Callable[[], object]], replays: int = 20) -> float:
    """Microseconds per call, with ``calls`` captured back to back in one CUDA graph (the way
    the engine launches decode, so launch cost counts as it does there)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:3]:  # compiles and settles allocations outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return replay_ms(graph, replays) * 1e3 / len(calls)


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Milliseconds per replay of ``graph``, replayed back to back (after one untimed replay)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def kernel_us(events: list) -> float:
    """Device time of the CUDA kernels among torch.profiler ``events`` (``key_averages()``).

    Under programmatic dependent launch a kernel's time runs from its early start, waiting
    included, so kernel times overlap and their sum exceeds the device's busy time: this says
    so on stderr, with the way to get additive times.
    """
    from nanoserve.kernels.common import programmatic_launch

    if programmatic_launch(torch.device("cuda")):
        print("programmatic launch is on: kernel times include waiting and overlap; "
              "NANOSERVE_DISABLE_PDL=1 gives additive times", file=sys.stderr)
    return sum(e.self_device_time_total for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA)


def step_kernel_table(run: Callable[[], object], steps: int, on_cuda: bool,
                      rows: int = 30) -> dict:
    """Where a run's time goes, per step of ``steps``: launches and time of each kernel (on
    the CPU: each op's own time), the largest ``rows`` printed to stderr as a table. Returns
    the totals (``launches_per_step``, ``kernel_us_per_step``)."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        run()
    device = torch.autograd.DeviceType.CUDA if on_cuda else torch.autograd.DeviceType.CPU
    kernels = [(e.key, e.count / steps, (e.self_device_time_total if on_cuda
                                         else e.self_cpu_time_total) / steps)
               for e in prof.key_averages() if e.device_type == device]
    kernels.sort(key=lambda k: -k[2])
    print(f"{'us/step':>9} {'calls/step':>10}  kernel", file=sys.stderr)
    for name, calls, us in kernels[:rows]:
        print(f"{us:9.1f} {calls:10.1f}  {name[:100]}", file=sys.stderr)
    return {"launches_per_step": round(sum(k[1] for k in kernels), 1),
            "kernel_us_per_step": round(sum(k[2] for k in kernels), 1)}
