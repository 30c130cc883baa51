"""`tokenmill bench plot`: a PNG bar chart from the --output-json files of
`tokenmill bench throughput` and `tokenmill bench latency`.

One panel per file: output tok/s of every system the run measured (tokenmill,
HF generate, HF continuous batching), tokenmill's ratio over each baseline above
its bar, and tokenmill's roofline ratios under the panel when the run has them.
matplotlib is an optional dependency: `pip install 'tokenmill[bench]'`.
"""
from __future__ import annotations

import argparse
import json
import os

SYSTEMS = (("tokenmill", "tokenmill_tok_s"), ("HF generate", "hf_generate_tok_s"),
           ("HF continuous\nbatching", "hf_cb_tok_s"))
COLORS = {"tokenmill": "#2b6cb0", "HF generate": "#a0aec0",
          "HF continuous\nbatching": "#718096"}
MISSING_MATPLOTLIB = ("tokenmill bench plot needs matplotlib, an optional dependency: "
                      "pip install 'tokenmill[bench]' (or pip install matplotlib)")


def add_plot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--inputs", nargs="+", required=True, metavar="JSON",
                   help="--output-json files of bench throughput / bench latency, one panel each")
    p.add_argument("--output", required=True, metavar="PNG", help="where to write the PNG")
    p.add_argument("--title", default=None, help="a title over the panels")


def bench_kind(result: dict) -> str:
    kind = result.get("bench")
    if kind in ("throughput", "latency"):
        return kind
    return "throughput" if "num_prompts" in result.get("workload", {}) else "latency"


def panel_title(result: dict) -> str:
    w = result.get("workload", {})
    model = os.path.basename(str(w.get("model", "")).rstrip("/"))
    if bench_kind(result) == "latency":
        return (f"single stream: {w.get('input_len')}-token prompt, {w.get('output_len')} new "
                f"tokens\n{model}, {w.get('dtype')}")
    return (f"offline throughput: {w.get('num_prompts')} requests, in {w.get('input_len')}, "
            f"out {w.get('output_len')}\n{model}, {w.get('dtype')}")


def bars(result: dict) -> list[tuple[str, float]]:
    """(system, output tok/s) for every system the run measured."""
    return [(name, float(result[key])) for name, key in SYSTEMS if result.get(key)]


def roofline_note(result: dict) -> str | None:
    roof = result.get("roofline") or {}
    tm = (roof.get("systems") or {}).get("tokenmill")
    if not tm:
        return None
    parts = [f"{100 * tm[f'ratio_{dt}']:.1f}% of the {dt} peak" for dt in roof.get("peaks", {})
             if f"ratio_{dt}" in tm]
    return f"tokenmill {tm['achieved_gflops']:.1f} GFLOP/s = " + ", ".join(parts)


def load(paths: list[str]) -> list[dict]:
    results = []
    for path in paths:
        try:
            with open(path) as f:
                result = json.load(f)
        except OSError as e:
            raise ValueError(f"--inputs: cannot read {path!r}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--inputs: {path!r} is not JSON: {e}") from None
        if not isinstance(result, dict) or not result.get("tokenmill_tok_s"):
            raise ValueError(f"--inputs: {path!r} is not a bench throughput / latency "
                             f"--output-json file (no tokenmill_tok_s)")
        results.append(result)
    return results


def plot(results: list[dict], output: str, title: str | None = None) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ValueError(MISSING_MATPLOTLIB) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 4.6), squeeze=False)
    for ax, result in zip(axes[0], results):
        data = bars(result)
        names = [n for n, _ in data]
        values = [v for _, v in data]
        rects = ax.bar(range(len(data)), values, color=[COLORS[n] for n in names], width=0.6)
        ax.set_xticks(range(len(data)), names)
        ax.set_ylabel("output tok/s")
        ax.set_title(panel_title(result), fontsize=9)
        ax.set_ylim(0, max(values) * 1.22)
        tm = values[0]
        for name, value, rect in zip(names, values, rects):
            label = f"{value:.1f}"
            if name != "tokenmill":
                label += f"\n(tokenmill {tm / value:.2f}x)"
            ax.annotate(label, (rect.get_x() + rect.get_width() / 2, value), ha="center",
                        va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
        note = roofline_note(result)
        if note:
            ax.set_xlabel(note, fontsize=7)
        ax.spines[["top", "right"]].set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)


def run_plot(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401  (fail before reading anything)
    except ImportError:
        raise ValueError(MISSING_MATPLOTLIB) from None
    results = load(args.inputs)
    plot(results, args.output, args.title)
    print(f"wrote {args.output}")
    return 0
