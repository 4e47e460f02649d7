"""The side-by-side table of ``vllm_slice.py``: both engines' figures per point, the ratio, and what ran.

The ratio is always dsinfer's speed over vLLM's: prefill tokens/s over tokens/s, decode vLLM's ms/step over
dsinfer's. A row an engine could not run carries the reason instead of a figure.
"""

from __future__ import annotations

from typing import Any

TARGET_RATIO = 1.3
NAMES = {"vllm": "vLLM", "dsinfer": "dsinfer"}


def merge_record(results: dict[str, Any], record: dict[str, Any]) -> None:
    """Put one child's record into the results, replacing an earlier one of the same engine, MTP and point set."""
    key = (record["engine"], record["mtp"], record.get("set"))
    results["records"] = [r for r in results.get("records", []) if (r["engine"], r["mtp"], r.get("set")) != key]
    results["records"].append(record)


def ratio(unit: str, vllm: float, dsinfer: float) -> float:
    """dsinfer's speed over vLLM's."""
    return dsinfer / vllm if unit == "tokens/s" else vllm / dsinfer


def cell(record: dict[str, Any] | None, label: str) -> tuple[float | None, str | None]:
    """(figure, None) or (None, why there is none) for one engine's row."""
    if record is None:
        return None, "not run"
    row = record.get("rows", {}).get(label)
    if row is not None and row.get("value") is not None:
        return row["value"], None
    if row is not None:
        return None, row.get("error", "no figure")
    return None, record.get("error") or "not reached"


def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per (MTP, point), in the order the points were measured."""
    by_key = {(r["engine"], r["mtp"], r.get("set")): r for r in results.get("records", [])}
    order: list[tuple[int, str, str, str]] = []
    for record in results.get("records", []):
        for label, unit in zip(record.get("labels", []), record.get("units", []), strict=True):
            key = (record["mtp"], record.get("set"), label, unit)
            if key not in order:
                order.append(key)
    rows = []
    for mtp, set_name, label, unit in sorted(order, key=lambda k: (k[0], order.index(k))):
        row = {"mtp": mtp, "point": label, "unit": unit}
        for engine in NAMES:
            row[engine], row[f"{engine}_why"] = cell(by_key.get((engine, mtp, set_name)), label)
        both = row["vllm"] is not None and row["dsinfer"] is not None
        row["ratio"] = ratio(unit, row["vllm"], row["dsinfer"]) if both else None
        rows.append(row)
    return rows


def _figure(value: float | None, why: str | None, unit: str) -> str:
    if value is None:
        return f"- ({why})"
    return f"{value:,.0f}" if unit == "tokens/s" else f"{value:.3f}"


def render_table(results: dict[str, Any]) -> str:
    """Markdown: the table, how many rows reach the target ratio, the definitions, then what each child ran."""
    rows = table_rows(results)
    lines = ["| MTP K | point | unit | vLLM | dsinfer | dsinfer / vLLM |", "| ---: | --- | --- | ---: | ---: | ---: |"]
    for row in rows:
        shown = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
        lines.append(
            f"| {row['mtp']} | {row['point']} | {row['unit']} | "
            f"{_figure(row['vllm'], row['vllm_why'], row['unit'])} | "
            f"{_figure(row['dsinfer'], row['dsinfer_why'], row['unit'])} | {shown} |"
        )
    compared = [row for row in rows if row["ratio"] is not None]
    reached = sum(row["ratio"] >= TARGET_RATIO for row in compared)
    lines += [
        "",
        f"rows with both figures: {len(compared)} of {len(rows)}; dsinfer >= {TARGET_RATIO}x vLLM on {reached} of them",
    ]
    lines += ["", "definitions:"] + [f"- {k}: {v}" for k, v in results.get("definitions", {}).items()]
    lines += ["", f"slice: {results.get('slice')}"]
    for record in results.get("records", []):
        lines.append(
            f"- {NAMES[record['engine']]} MTP {record['mtp']} ({record.get('set')}): gpu {record.get('gpu')}; "
            f"versions {record.get('versions')}; model {record.get('model')}; start-up "
            f"{record.get('startup_s', float('nan')):.0f} s, child {record.get('wall_s', float('nan')):.0f} s, "
            f"exit {record.get('exit_code')}; config {record.get('config')}"
            + (f"; error: {record['error']}" if record.get("error") else "")
        )
    return "\n".join(lines)
