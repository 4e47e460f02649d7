"""Pareto charts of a sweep, drawn like DeepInfer's published ones (matplotlib, Agg backend, headless).

* decode: x = tokens/s/user (interactivity), y = tokens/s/GPU (output throughput); a point per
  requests-per-DP-rank, labelled with that number. With ``nextn > 0`` a second, dashed series shows the
  same steps under the *assumed* (official) speculative accounting, so the two are never confused.
* prefill: x = ms/step, y = uncached input tokens/s/GPU; a point per batch size (tokens per step).
* encoder: x = ms/step, y = images/s/GPU; a point per batch size (images per step).

``compare_published=True`` adds the points read off DeepInfer's README charts (B200, 131,072-token context;
approximate: the charts print no values; :mod:`dsinfer.bench.published`). They are another machine, model size
and parallel layout, so they only make sense beside a sweep at that context, and the published decode chart
uses the assumed accounting (nextn=3, tau=3.25). Records with a ``full_depth`` field add a dash-dotted series:
the slice's step scaled to the released model's depth, under that same accounting (the same module).

    python -m dsinfer.bench.pareto sweeps/TAG/results.jsonl [--out pareto.png] [--compare-published]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dsinfer.bench.published import PUBLISHED_B200, PUBLISHED_LABEL

__all__ = ["PUBLISHED_B200", "draw_pareto", "load_results", "main"]


def load_results(path: str | Path) -> list[dict[str, Any]]:
    """The point records of a results.jsonl, in file order; a bad line is an error naming the line."""
    path = Path(path)
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not a JSON object ({exc})") from None
    return records


def _series(records: list[dict[str, Any]], x_key: str, y_key: str, group: str | None = None) -> list[tuple]:
    """(point, x, y) sorted by point; ``group`` reads x and y from a nested accounting object."""
    rows = []
    for record in records:
        source = record[group] if group else record
        rows.append((record["point"], source[x_key], source[y_key]))
    return sorted(rows)


def _plot_series(axes, rows: list[tuple], label: str, style: str) -> None:
    axes.plot([r[1] for r in rows], [r[2] for r in rows], style, label=label)
    for point, x, y in rows:
        axes.annotate(f"{point:,}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)


def _plot_full_depth(axes, records: list[dict[str, Any]], mode: str) -> None:
    """The full-depth estimate of every record that has one (:mod:`dsinfer.bench.published`)."""
    estimated = [record for record in records if record.get("full_depth")]
    if not estimated or mode == "encoder":
        return
    x_key = "tokens_per_s_per_user" if mode == "decode" else "ms_per_step"
    layers = estimated[0]["full_depth"]["release_layers"]
    _plot_series(axes, _series(estimated, x_key, "tokens_per_s_per_gpu", "full_depth"),
                 f"full-depth estimate: per-layer cost x {layers} layers + head", "D-.")  # fmt: skip


def draw_pareto(records: list[dict[str, Any]], out: str | Path, compare_published: bool = False) -> Path:
    """Draw the chart for one sweep's records (all of one mode) into ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not records:
        raise ValueError("no sweep points to plot")
    modes = {r["mode"] for r in records}
    if len(modes) != 1:
        raise ValueError(f"one chart per mode; the records mix {sorted(modes)}")
    mode = modes.pop()
    first = records[0]
    figure, axes = plt.subplots(figsize=(8, 6), dpi=110)
    if mode == "decode":
        tau = first.get("measured", {}).get("tau")
        measured_label = (
            "measured (1 token/step: no drafts run)" if tau is None
            else f"measured (drafts verified by the engine, tau = {tau:.2f} at the first point)"
        )  # fmt: skip
        _plot_series(axes, _series(records, "tokens_per_s_per_user", "tokens_per_s_per_gpu"), measured_label, "o-")
        if first.get("nextn", 0) > 0:
            assumed = first["assumed"]
            label = (f"assumed (official accounting): tau = 1 + {first['nextn']} x {first['accept']:g} = "
                     f"{assumed['tokens_per_step_per_user']:g} tokens/step on the measured step time")  # fmt: skip
            _plot_series(axes, _series(records, "tokens_per_s_per_user", "tokens_per_s_per_gpu", "assumed"),
                         label, "^--")  # fmt: skip
        axes.set_xlabel("tokens/s/user")
        axes.set_ylabel("output tokens/s/GPU")
        point_name = "requests per DP rank"
    elif mode == "encoder":
        _plot_series(axes, _series(records, "ms_per_step", "images_per_s_per_gpu"),
                     f"measured ({first['tokens_per_image']} span tokens per image)", "o-")  # fmt: skip
        axes.set_xlabel("ms/step")
        axes.set_ylabel("images/s/GPU")
        point_name = f"images per batch, {first['image_size']} px"
    else:
        _plot_series(axes, _series(records, "ms_per_step", "tokens_per_s_per_gpu"), "measured", "o-")
        axes.set_xlabel("ms/step")
        axes.set_ylabel("uncached input tokens/s/GPU")
        point_name = "batch tokens per step"
    _plot_full_depth(axes, records, mode)
    if compare_published and mode in PUBLISHED_B200:
        _plot_series(axes, [tuple(row) for row in PUBLISHED_B200[mode]], PUBLISHED_LABEL, "s:")
    axes.set_title(
        f"{mode} sweep '{first.get('tag', '')}': {first.get('model', '')} ({first.get('weights', '?')} weights)\n"
        f"{first.get('gpu_name', '')}, {first.get('dtype', '')}, "
        f"{'images' if mode == 'encoder' else 'context'} {first['context']:,}{' px' if mode == 'encoder' else ''}; "
        f"labels = {point_name}",
        fontsize=9,
    )
    axes.set_xlim(left=0)
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png")
    plt.close(figure)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsinfer.bench.pareto", description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, help="a sweep's results.jsonl")
    parser.add_argument("--out", type=Path, help="PNG to write (default: pareto.png beside the results)")
    parser.add_argument("--compare-published", action="store_true", help="add DeepInfer's published B200 points")
    args = parser.parse_args(argv)
    if not args.results.is_file():
        print(f"pareto: error: {args.results}: file not found", file=sys.stderr)
        return 2
    try:
        out = draw_pareto(load_results(args.results), args.out or args.results.with_name("pareto.png"),
                          args.compare_published)  # fmt: skip
    except ValueError as exc:
        print(f"pareto: error: {args.results}: {exc}", file=sys.stderr)
        return 2
    except KeyError as exc:
        print(f"pareto: error: {args.results}: a record lacks the field {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
