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


def timed_step_ms(unit: str, label: str, value: float | None) -> float | None:
    """The unprofiled step a profile is set against: decode's ms/step, or a prefill's whole one-step run."""
    if value is None:
        return None
    if unit == "ms/step":
        return value
    return 1e3 * int(label.split()[-1]) / value


def profile_summary_line(engine: str, profile: dict[str, Any] | None, timed_ms: float | None) -> str:
    """One engine's profiled window in a sentence: steps, ms per step, GPU busy, and busy against the timed step."""
    name = NAMES[engine]
    if not profile:
        return f"- {name}: not profiled"
    if "top" not in profile:
        return f"- {name}: {profile.get('skipped') or profile.get('error') or 'no profile'}"
    if not profile["top"]:
        return f"- {name}: {profile.get('note', 'nothing recorded')}"
    line = (
        f"- {name}: {profile['steps']} steps, {profile['step_ms']:.3f} ms/step in the profiled window, "
        f"{profile['source']} busy {profile['busy_ms_per_step']:.3f} ms ({100 * profile['busy_share']:.0f}%, idle "
        f"{100 * (1 - profile['busy_share']):.0f}%), {profile['calls_per_step']:.0f} device calls/step"
    )
    if timed_ms:
        line += f"; busy is {100 * profile['busy_ms_per_step'] / timed_ms:.0f}% of the timed {timed_ms:.3f} ms step"
    return line + (f"; {profile['note']}" if profile.get("note") else "") + f" (trace {profile.get('trace')})"


def _kernel_cells(profile: dict[str, Any] | None, rank: int) -> str:
    from slice_trace import short_kernel_name

    kernels = (profile or {}).get("top") or []
    if rank >= len(kernels):
        return " | | | "
    kernel = kernels[rank]
    return (
        f"{short_kernel_name(kernel['name'])} | {kernel['calls_per_step']:.1f} | {kernel['ms_per_step']:.3f} | "
        f"{100 * kernel['share']:.1f}%"
    )


def render_profiles(results: dict[str, Any], top: int) -> str:
    """Markdown: per row, where each engine's step went (its profiled window) and its ``top`` kernels side by
    side, vLLM's then dsinfer's."""
    by_key = {(r["engine"], r["mtp"], r.get("set")): r for r in results.get("records", [])}
    lines = ["top kernels per step (profiled after timing; share: of the profiled step; see slice_trace.py)"]
    for row in table_rows(results):
        profiles = {}
        for engine in NAMES:
            for (name, mtp, _), record in by_key.items():
                if name == engine and mtp == row["mtp"] and row["point"] in record.get("rows", {}):
                    profiles[engine] = record["rows"][row["point"]].get("profile")
        if not any(profiles.values()):
            continue
        ratio_text = f", dsinfer / vLLM {row['ratio']:.2f}x" if row["ratio"] is not None else ""
        lines += ["", f"### MTP {row['mtp']}, {row['point']}{ratio_text}", ""]
        for engine in NAMES:
            timed = timed_step_ms(row["unit"], row["point"], row[engine])
            lines.append(profile_summary_line(engine, profiles.get(engine), timed))
        lines += [
            "",
            "| # | vLLM kernel | calls/step | ms/step | share | dsinfer kernel | calls/step | ms/step | share |",
            "| ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
        ]
        depth = max(len((profiles.get(engine) or {}).get("top") or []) for engine in NAMES)
        for rank in range(min(top, depth)):
            lines.append(
                f"| {rank + 1} | {_kernel_cells(profiles.get('vllm'), rank)} | "
                f"{_kernel_cells(profiles.get('dsinfer'), rank)} |"
            )
        if depth:
            lines.append(f"| + | {_rest_cells(profiles.get('vllm'))} | {_rest_cells(profiles.get('dsinfer'))} |")
    return "\n".join(lines)


def _rest_cells(profile: dict[str, Any] | None) -> str:
    """The time of the kernels below the top ones, so a row shows how much of the step its top list covers."""
    if not (profile or {}).get("top"):
        return " | | | "
    rest = profile["rest_ms_per_step"]
    return f"(the others) | | {rest:.3f} | {100 * rest / profile['step_ms']:.1f}%"
