"""PNG plots of the benchmarks' JSON (matplotlib, Agg): every figure as median with min-max.

Reads what the benches wrote in ``DIR`` and draws what it finds:

- ``throughput_vs_window.png``: ``flow-*.json``, records/s against the credit window per
  case and transport, raw pyzmq anchors as dashed lines.
- ``latency_cdf.png``: ``latency.json``, CDF of producer -> foreachBatch latency next to
  the rate-source anchor, with the targets.
- ``rss_over_time.png``: ``rss.json``, RSS of each process group over the run, zio and
  the rate-source anchor.
- ``source.png``, ``sink.png``, ``queue.png``, ``spool.png``: throughput bars (median,
  min-max error bars) beside their anchors.

Run: ``.venv/bin/python bench/plots.py --out DIR``; prints the files made, one a line.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _bars(
    ax: Any, labels: list[str], spreads: list[dict[str, float]], anchors: set[int], unit: str
) -> None:
    meds = [s["median"] for s in spreads]
    err = [
        [m - s["min"] for m, s in zip(meds, spreads, strict=True)],
        [s["max"] - m for m, s in zip(meds, spreads, strict=True)],
    ]
    colors = ["#999999" if i in anchors else "#1f77b4" for i in range(len(labels))]
    y = range(len(labels))
    ax.barh(y, meds, xerr=err, color=colors, capsize=4)
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    ax.set_xlabel(f"{unit} (median, min-max; grey = anchor)")
    ax.grid(axis="x", alpha=0.3)


def _save(fig: Any, out: Path, name: str, made: list[Path]) -> None:
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=100)
    plt.close(fig)
    made.append(path)


Plot = Callable[[Path, list[Path]], None]
"""A plot: reads the benches' JSON in ``out``, appends the PNGs it made to ``made``."""


def _plot(name: str, png: str) -> Callable[[Callable[[dict[str, Any]], Any]], Plot]:
    """A plot of ``DIR/name`` (a JSON object) by ``draw(data) -> figure`` into ``DIR/png``.

    Nothing is drawn when the JSON is missing or not an object, nor when ``draw`` returns
    None (not the data it expects).
    """

    def wrap(draw: Callable[[dict[str, Any]], Any]) -> Plot:
        def plot(out: Path, made: list[Path]) -> None:
            data = _load(out / name)
            fig = draw(data) if isinstance(data, dict) else None
            if fig is not None:
                _save(fig, out, png, made)

        return plot

    return wrap


def throughput_vs_window(out: Path, made: list[Path]) -> None:
    entries: list[tuple[str, dict[str, Any]]] = []
    for path in sorted(out.glob("flow*.json")):
        data = _load(path)
        if isinstance(data, list):
            mode = path.stem.partition("-")[2] or "default"
            entries += [(mode, d) for d in data if isinstance(d, dict)]
    if not entries:
        return
    fig, ax = plt.subplots(figsize=(9, 5.5))
    series: dict[str, list[tuple[float, list[float]]]] = {}
    n_anchor = 0
    for mode, d in entries:
        rps = d.get("records_per_s")
        if not isinstance(rps, list) or len(rps) != 3:
            continue
        label = f"{d.get('case')} [{d.get('transport')}, {mode}]"
        if d.get("window") is None:
            ax.axhspan(rps[1], rps[2], color=f"C{n_anchor + 5}", alpha=0.15)
            ax.axhline(
                rps[0],
                color=f"C{n_anchor + 5}",
                linestyle="--",
                linewidth=1,
                label=f"anchor: {label}",
            )
            n_anchor += 1
        else:
            series.setdefault(label, []).append((float(d["window"]), rps))
    for label, pts in series.items():
        pts.sort()
        xs = [p[0] for p in pts]
        med = [p[1][0] for p in pts]
        lo = [p[1][0] - p[1][1] for p in pts]
        hi = [p[1][2] - p[1][0] for p in pts]
        ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("credit window (DATs)")
    ax.set_ylabel("records/s (median, min-max)")
    ax.set_title("Flow throughput vs credit window, raw pyzmq anchors dashed")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6, loc="best")
    _save(fig, out, "throughput_vs_window.png", made)


@_plot("latency.json", "latency_cdf.png")
def latency_cdf(data: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, f in data["figures"].items():
        qs = f["cdf_quantiles_s"]
        ps = [i / (len(qs) - 1) for i in range(len(qs))]
        p50, p99 = f["p50"], f["p99"]
        ax.plot(
            qs,
            ps,
            label=f"{f['label']}: p50 {p50['median']:.3f} s "
            f"({p50['min']:.3f}-{p50['max']:.3f}), p99 {p99['median']:.3f} s "
            f"({p99['min']:.3f}-{p99['max']:.3f})",
            linestyle="--" if key == "rate" else "-",
        )
    for name, t in data.get("targets", {}).items():
        ax.axvline(t, color="red", alpha=0.4, linewidth=1)
        ax.text(t, 0.02, f" {name} target", color="red", fontsize=7)
    ax.set_xlabel("latency, send -> rows in foreachBatch (s)")
    ax.set_ylabel("fraction of records")
    ax.set_title(
        f"Latency CDF at trigger 0, {data['rate']:,.0f} rec/s, {data['runs']} run(s) pooled"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return fig


@_plot("rss.json", "rss_over_time.png")
def rss_over_time(data: dict[str, Any]) -> Any:
    cases = list(data["figures"].items())
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4.5), sharey=True)
    if len(cases) == 1:
        axes = [axes]
    for ax, (_, f) in zip(axes, cases, strict=True):
        for i, samples in enumerate(f["samples"]):
            if not samples:
                continue
            for j, g in enumerate(k for k in samples[0] if k not in ("t", "workers_n")):
                ys = [s[g] / 1e6 for s in samples]
                if not any(ys):
                    continue
                ax.plot(
                    [s["t"] for s in samples],
                    ys,
                    color=f"C{j}",
                    alpha=1.0 if i == 0 else 0.4,
                    label=g if i == 0 else None,
                )
        ax.set_title(f"{f['label']} ({len(f['samples'])} run(s))")
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("RSS (MB)")
    fig.suptitle(f"RSS over a streaming run at {data['rate']:,.0f} rec/s")
    return fig


def _bar_chart(
    name: str,
    size: tuple[float, float],
    value: str,
    unit: str,
    is_anchor: Callable[[str], bool],
    title: Callable[[dict[str, Any]], str],
    *,
    log: bool = True,
    label: Callable[[str, dict[str, Any]], str] = lambda key, f: f["label"],
    keep: Callable[[dict[str, Any]], bool] = lambda f: True,
) -> Plot:
    """``NAME.json``'s figures (``value`` of each, a spread) as bars beside their anchors
    (``is_anchor(key)``) -> ``NAME.png``."""

    @_plot(f"{name}.json", f"{name}.png")
    def draw(data: dict[str, Any]) -> Any:
        if "figures" not in data:
            return None
        figs = [(k, f) for k, f in data["figures"].items() if keep(f)]
        fig, ax = plt.subplots(figsize=size)
        _bars(
            ax,
            [label(k, f) for k, f in figs],
            [f[value] for _, f in figs],
            {i for i, (k, _) in enumerate(figs) if is_anchor(k)},
            unit,
        )
        if log:
            ax.set_xscale("log")
        ax.set_title(title(data))
        return fig

    return draw


def _sink_title(data: dict[str, Any]) -> str:
    r = data["ratios"]["zio_vs_noop"]
    return (
        f"Sink throughput, {data['rounds']} round(s): {r['median']:.2f}x "
        f"({r['min']:.2f}-{r['max']:.2f}) of the anchor"
    )


source = _bar_chart(
    "source",
    (9, 4),
    "rows_per_s_wall",
    "rows/s, wall clock",
    lambda k: k in ("rate", "synthetic"),
    lambda d: f"Source throughput, {d['runs']} round(s)",
)
sink = _bar_chart(
    "sink", (8, 2.8), "rows_per_s", "rows/s", lambda k: k == "noop", _sink_title, log=False
)
queue = _bar_chart(
    "queue",
    (9, 4),
    "msgs_per_s",
    "msgs/s",
    lambda k: k.startswith("anchor"),
    lambda d: f"Queue, durable acked, {d['size']} B messages, {d['runs']} run(s)",
    label=lambda k, f: k,
)
spool = _bar_chart(
    "spool",
    (9, 3.5),
    "value",
    "records/s",
    lambda k: k == "anchor_rps",
    lambda d: f"Spool, {d['size']} B records, {d['runs']} run(s)",
    keep=lambda f: f["unit"] == "rec/s",
)


PLOTS = (throughput_vs_window, latency_cdf, rss_over_time, source, sink, queue, spool)


def make_plots(out: Path) -> list[Path]:
    made: list[Path] = []
    for plot in PLOTS:
        plot(out, made)
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    for path in make_plots(Path(a.out)):
        print(path.name)


if __name__ == "__main__":
    main()
