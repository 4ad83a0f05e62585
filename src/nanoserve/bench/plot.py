"""Pictures of the benchmarks' results (``--plot out.png``), drawn with matplotlib."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(records: Sequence[dict[str, Any]], out: str | Path) -> None:
    """Output tok/s of each shape (and budget) beside its floors, with the fraction reached."""
    plt = _pyplot()
    rows = [r for r in records if "output_tok_s" in r]
    labels = [f"{r['shape']}\n{r['max_num_batched_tokens']} tok/step" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 1.2 + 1.1 * len(rows)))
    y = range(len(rows))
    ax.barh([i + 0.27 for i in y], [r["bytes_floor_tok_s"] for r in rows], 0.27,
            label="floor: bytes only", color="#c9d6e8")
    ax.barh([i for i in y], [r["floor_tok_s"] for r in rows], 0.27,
            label="floor: bytes and FLOPs", color="#7fa3cf")
    ax.barh([i - 0.27 for i in y], [r["output_tok_s"] for r in rows], 0.27,
            label="nanoserve", color="#d9622b")
    for i, r in enumerate(rows):
        ax.annotate(f" {r['output_tok_s']:,.0f} tok/s ({r['fraction_of_floor']:.2f} of floor)",
                    (r["output_tok_s"], i - 0.27), va="center", fontsize=8)
    values = [r[k] for r in rows for k in ("output_tok_s", "floor_tok_s", "bytes_floor_tok_s")]
    if values and min(values) > 0 and max(values) / min(values) > 30:
        ax.set_xscale("log")  # a CPU run against a GPU's floors: both stay visible
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    ax.set_xlabel("output tokens / s")
    ax.set_title(f"Throughput: {rows[0]['num_seqs']} requests, {rows[0]['device']}"
                 if rows else "Throughput")
    ax.legend(loc="lower right", fontsize=8)
    _save(fig, out)


def plot_latency(records: Sequence[dict[str, Any]], out: str | Path) -> None:
    """Batch-1 ms per token against context, per shape, with each shape's floor dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    shapes = dict.fromkeys(r["shape"] for r in records if "ms_per_token" in r)
    for shape in shapes:
        rows = sorted((r for r in records if r.get("shape") == shape and "ms_per_token" in r),
                      key=lambda r: r["context"])
        contexts = [r["context"] for r in rows]
        line, = ax.plot(contexts, [r["ms_per_token"] for r in rows], "o-", label=shape)
        ax.plot(contexts, [r["floor_ms"] for r in rows], "--", color=line.get_color(),
                alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per output token (dashed: floor)")
    ax.set_title("Batch-1 decode latency")
    ax.legend(fontsize=8)
    _save(fig, out)


def plot_serve(series: dict[str, list[float]], timeline: list[tuple[float, float, list[float]]],
               summary: dict[str, Any], out: str | Path) -> None:
    """Left: the CDF of TTFT, TPOT, ITL and end-to-end latency. Right: each request's TTFT
    and its ITLs against when it was sent."""
    plt = _pyplot()
    fig, (cdf, over) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name, values in series.items():
        ms = sorted(v * 1e3 for v in values)
        if ms:
            cdf.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))], label=name.upper())
    cdf.set_xscale("log")
    cdf.set_xlabel("ms")
    cdf.set_ylabel("fraction of requests (ITL: of gaps)")
    cdf.set_title("Latency CDF")
    cdf.grid(alpha=0.3)
    cdf.legend()
    for sent, ttft, itl in timeline:
        over.scatter([sent] * len(itl), [g * 1e3 for g in itl], s=2, color="#7fa3cf", alpha=0.4)
        over.scatter([sent], [ttft * 1e3], s=10, color="#d9622b")
    over.scatter([], [], s=10, color="#d9622b", label="TTFT")
    over.scatter([], [], s=4, color="#7fa3cf", label="ITL")
    over.set_yscale("log")
    over.set_xlabel("request sent at (s into the run)")
    over.set_ylabel("ms")
    over.set_title(f"Over the run: {summary.get('completed', 0)} requests, "
                   f"{summary.get('output_throughput', 0):.1f} output tok/s")
    over.legend()
    _save(fig, out)


def _save(fig: Any, out: str | Path) -> None:
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
