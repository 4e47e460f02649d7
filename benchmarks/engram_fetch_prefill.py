"""Part 4 of benchmarks/engram_fetch.py: a V4.1 slice's prefill with its Engram tables in host memory."""

from __future__ import annotations

import statistics
import time

import torch
from engram_fetch_common import (  # the plumbing (same folder)
    fenced,
    section,
    time_ms,
)

from dsinfer.engram.fetch import EngramFetcher

ROW_BYTES, SCALE_BYTES = 256, 8


# ------------------------------------------------------------------------------------------ 4. prefill
class V41Slice:
    """A V4.1-width slice in bf16: the matrix work of each layer, dense-equivalent MoE, Engram at 1 and 14."""

    HIDDEN, HEADS_DIM, Q_RANK, GROUPS, GROUP_RANK, EXPERT_WIDTH, ACTIVE_EXPERTS = 5120, 64 * 512, 1280, 8, 1024, 2304, 7

    def __init__(self, tokens: int, layers: int, device: torch.device):
        h, g = self.HIDDEN, torch.Generator(device=device).manual_seed(0)
        moe = self.EXPERT_WIDTH * self.ACTIVE_EXPERTS

        def weight(*shape):
            return (torch.randn(*shape, device=device, generator=g) * shape[-2] ** -0.5).to(torch.bfloat16)

        self.tokens, self.layers, self.moe = tokens, layers, moe
        self.w = {
            "wq_a": weight(h, self.Q_RANK),
            "wq_b": weight(self.Q_RANK, self.HEADS_DIM),
            "wkv": weight(h, 512),
            "wo_a": weight(self.GROUPS, self.HEADS_DIM // self.GROUPS, self.GROUP_RANK),
            "wo_b": weight(self.GROUPS * self.GROUP_RANK, h),
            "w13": weight(h, 2 * moe),
            "w2": weight(moe, h),
            "engram_wkv": weight(24 * ROW_BYTES, 5 * h),
        }
        self.x0 = torch.randn(tokens, h, device=device, generator=g).to(torch.bfloat16)

    def flops(self) -> float:
        w = self.w
        per_token = sum(t.numel() for k, t in w.items() if k != "engram_wkv")
        return 2.0 * self.tokens * (per_token * self.layers + 2 * w["engram_wkv"].numel())

    def layer(self, x: torch.Tensor) -> torch.Tensor:
        w, t = self.w, self.tokens
        normed = torch.nn.functional.rms_norm(x, (self.HIDDEN,))
        q = (normed @ w["wq_a"]) @ w["wq_b"]
        kv = normed @ w["wkv"]
        grouped = torch.bmm(q.view(t, self.GROUPS, -1).transpose(0, 1), w["wo_a"]).transpose(0, 1).reshape(t, -1)
        x = x + grouped @ w["wo_b"] + kv.sum(-1, keepdim=True) * 1e-3
        up = torch.nn.functional.rms_norm(x, (self.HIDDEN,)) @ w["w13"]
        return x + (torch.nn.functional.silu(up[:, : self.moe]) * up[:, self.moe :]) @ w["w2"]

    def engram(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        kv = rows.view(self.tokens, -1) @ self.w["engram_wkv"]
        key, value = kv[:, : 4 * self.HIDDEN], kv[:, 4 * self.HIDDEN :]
        gate = torch.sigmoid((x.float() * key[:, : self.HIDDEN].float()).mean(-1, keepdim=True))
        return x + (gate * value.float()).to(x.dtype)

    def step(self, get_rows, before=None) -> torch.Tensor:
        x = self.x0
        if before is not None:
            before()
        for layer in range(self.layers):
            if layer in (1, 14):
                x = self.engram(x, get_rows(layer))
            x = self.layer(x)
        return x


def run_prefill(report, args, device, store, methods, text_ids, label) -> None:
    """A prefill step with Engram rows fetched synchronously or prefetched by each host method."""
    with section(report, f"prefill step ({label})"):
        rows = store.tables[1].rows
        fetcher = methods["zero_copy"]
        for f in methods.values():
            f.tables[14] = f.tables[1]  # both Engram layers read this one table here
            if f.host_tables:
                f.host_tables[14] = f.host_tables[1]
        ids = text_ids.ids(args.prefill_tokens, rows)
        zipf = text_ids.ids(args.prefill_tokens, rows, zipf=True)
        for source, step_ids in ((text_ids.source, ids), ("iid zipf tokens", zipf)):
            for layer in (1, 14):
                unique = int(torch.unique(step_ids[layer]).numel())
                report.add(
                    "prefill_ids",
                    tokens=source,
                    layer=layer,
                    ids=step_ids[layer].numel(),
                    unique=unique,
                    unique_fraction=unique / step_ids[layer].numel(),
                )
        model = V41Slice(args.prefill_tokens, args.prefill_layers, device)
        ready = {layer: fetcher.fetch(ids[layer], layer) for layer in (1, 14)}
        start_ms: dict[str, list[float]] = {}

        def prefetch(name, f, step_ids, **settings):
            """A step whose Engram rows ``f`` prefetches at its start; the host time of ``start`` is kept."""

            def before():
                for key, value in settings.items():
                    setattr(f, key, value)
                started = time.perf_counter()
                f.start({1: step_ids[1], 14: step_ids[14]})
                start_ms.setdefault(name, []).append((time.perf_counter() - started) * 1e3)

            return name, lambda: model.step(f.wait, before=before)

        variants = {"rows already on GPU (no fetch)": lambda: model.step(lambda layer: ready[layer])}
        for name, f in methods.items():
            variants[f"sync fetch, dedup+sort, {name}"] = lambda f=f: model.step(lambda i: f.fetch(ids[i], i))
        variants.update(
            [
                prefetch("prefetch, zero_copy, programs=32", fetcher, ids, prefetch_programs=32),
                prefetch("prefetch, staged", methods["staged"], ids),
                prefetch("prefetch, split", methods["split"], ids),
            ]
        )
        fetch_only = {
            f"fetch only, sync, dedup+sort, {name} (both layers)": lambda f=f: [f.fetch(ids[i], i) for i in (1, 14)]
            for name, f in methods.items()
        }
        if args.suite == "full":
            plain = EngramFetcher(fetcher.tables, device=device, dedup=False, sort=False)
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            variants["sync fetch, no dedup, request order"] = lambda: model.step(lambda i: plain.fetch(ids[i], i))
            variants.update(
                [
                    prefetch("prefetch, zero_copy, programs=all", fetcher, ids, prefetch_programs=None),
                    prefetch("prefetch, zero_copy, programs=4xSM", fetcher, ids, prefetch_programs=4 * sms),
                    ("sync fetch, dedup+sort, zipf ids", lambda: model.step(lambda i: fetcher.fetch(zipf[i], i))),
                    prefetch("prefetch, zero_copy, programs=32, zipf ids", fetcher, zipf, prefetch_programs=32),
                    prefetch("prefetch, staged, zipf ids", methods["staged"], zipf),
                    prefetch("prefetch, split, zipf ids", methods["split"], zipf),
                ]
            )
            fetch_only["fetch only, sync, no dedup (both layers)"] = lambda: [plain.fetch(ids[i], i) for i in (1, 14)]
        for name, fn in fetch_only.items():
            with fenced(report, f"prefill {name}"):
                report.add("prefill_step", variant=name, ms=time_ms(lambda rep, fn=fn: fn(), min_reps=3, max_reps=8))
        times = {name: [] for name in variants}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for rep in range(args.prefill_reps + 1):  # round robin, first round is warm-up
            for name, fn in variants.items():
                with fenced(report, f"prefill {name}"):
                    torch.cuda.synchronize()
                    start.record()
                    fn()
                    end.record()
                    end.synchronize()
                    if rep:
                        times[name].append(start.elapsed_time(end))
        base = statistics.median(times["rows already on GPU (no fetch)"])
        full_model = base * 40 / args.prefill_layers
        for name, samples in times.items():
            if not samples:
                continue
            ms = statistics.median(samples)
            starts = start_ms.get(name, [])
            report.add(
                "prefill_step",
                variant=name,
                ms=ms,
                spread_ms=max(samples) - min(samples),
                added_ms=ms - base,
                added_pct_of_slice=100 * (ms - base) / base,
                added_pct_of_40_layers=100 * (ms - base) / full_model,
                start_host_ms=statistics.median(starts[1:] or starts) if starts else "",
            )
        report.note(
            f"prefill slice: {args.prefill_layers} layers x {args.prefill_tokens} tokens, "
            f"{model.flops() / 1e12:.0f} TFLOP bf16, {model.flops() / base / 1e9:.0f} TFLOP/s; "
            f"'added_pct_of_40_layers' scales the no-fetch step to 40 layers; "
            f"'start_host_ms' is the caller's time in start() (the staged gathers run on a worker thread)"
        )
        for f in methods.values():
            del f.tables[14]
            f.host_tables.pop(14, None)
