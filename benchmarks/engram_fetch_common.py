"""Plumbing of benchmarks/engram_fetch.py: the report, timers, token ids, the system's memory setup."""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

from dsinfer.engram.hashing import EngramHasher
from dsinfer.engram.store.memory import hugetlbfs_mount, meminfo

GIB = 2**30


# ------------------------------------------------------------------------------------------ plumbing
class Report:
    """Rows of results, written to JSON and Markdown after every section."""

    def __init__(self, out: Path, name: str = "engram_fetch"):
        self.out, self.name = out, name
        self.out.mkdir(parents=True, exist_ok=True)
        self.sections: dict[str, list[dict]] = {}
        self.notes: list[str] = []

    def add(self, section: str, **row) -> None:
        self.sections.setdefault(section, []).append(row)
        print(f"[{section}] " + " ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
        self.write()  # a run stopped at its time limit keeps everything measured so far

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"[note] {text}", flush=True)

    def write(self) -> None:
        (self.out / f"{self.name}.json").write_text(json.dumps({"notes": self.notes, **self.sections}, indent=1))
        (self.out / f"{self.name}.md").write_text(self.markdown())

    def markdown(self) -> str:
        lines = []
        for name, rows in self.sections.items():
            keys = list(dict.fromkeys(k for row in rows for k in row))
            lines += [f"### {name}", "", "| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
            lines += ["| " + " | ".join(_fmt(row.get(k, "")) for k in keys) + " |" for row in rows]
            lines.append("")
        lines += ["### notes", ""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


@contextmanager
def section(report: Report, name: str):
    started = time.monotonic()
    print(f"==== {name}", flush=True)
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - one broken section must not cost the rest of the run
        report.note(f"section {name!r} failed: {type(exc).__name__}: {exc}")
        traceback.print_exc()
    finally:
        try:
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001
            report.note(f"after section {name!r}: {type(exc).__name__}: {exc}")
        report.write()
        print(f"==== {name} took {time.monotonic() - started:.1f} s", flush=True)


@contextmanager
def fenced(report: Report, what: str):
    """Run one configuration; a failure is noted and the run goes on with the next one."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - one broken configuration must not cost the others
        report.note(f"{what} failed: {type(exc).__name__}: {exc}")
        traceback.print_exc()


def time_ms(fn, *, budget_s: float = 0.15, min_reps: int = 3, max_reps: int = 25, warmup: int = 2) -> float:
    """Median milliseconds of ``fn(rep)`` timed with CUDA events (``rep`` lets callers rotate inputs)."""
    for rep in range(warmup):
        fn(rep)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(warmup)
    end.record()
    end.synchronize()
    estimate = max(start.elapsed_time(end), 1e-3)
    reps = max(min_reps, min(max_reps, int(budget_s * 1e3 / estimate)))
    times = []
    for rep in range(reps):
        start.record()
        fn(warmup + 1 + rep)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def shell(command: str) -> str:
    try:
        return subprocess.run(command, shell=True, capture_output=True, text=True, timeout=30).stdout.strip()
    except (subprocess.SubprocessError, OSError) as exc:
        return f"({exc})"


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)


# ------------------------------------------------------------------------------------------ ids
class TextIds:
    """Engram row ids of a token stream, hashed as V4.1 does, then folded into the benchmark table.

    With a DeepSeek ``tokenizer.json`` the stream is real text (the Python reference documentation
    shipped in the standard library, ``pydoc_data/topics.py``) and the compressed vocabulary is the
    real one; without one, or with ``zipf=True``, tokens are drawn independently from a Zipf law,
    which repeats n-grams far less than text does (a pessimistic case for de-duplication).
    """

    def __init__(self, device: torch.device, tokenizer_path: Path | None = None, seed: int = 0):
        vocab, compressed = 129_280, 99_092
        table = torch.arange(vocab) % compressed
        self.stream = None
        self.source = "iid zipf tokens"
        if tokenizer_path is not None:
            import sysconfig

            import tokenizers

            from dsinfer.engram.vocabulary import build_compressed_vocabulary

            tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_path))
            table = build_compressed_vocabulary(tokenizer, expected_size=compressed)
            docs = Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"
            self.stream = torch.tensor(tokenizer.encode(docs.read_text(errors="replace")).ids, device=device)
            self.source = f"{docs.name} ({self.stream.numel():,} tokens)"
        self.hasher = EngramHasher(
            table,
            engram_layer_ids=[1, 14],
            engram_vocab_size=16_000_000,
            engram_max_ngram_size=4,
            engram_n_heads=8,
            engram_pad_id=2,
            engram_compressed_vocab_size=compressed,
            image_token_id=None,
        ).to(device)
        ranks = torch.arange(vocab, dtype=torch.float64)
        self.weights = (1.0 / (ranks + 2.7)).float().to(device)  # Zipf-Mandelbrot, exponent 1
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.device = device

    def ids(self, tokens: int, rows: int, zipf: bool = False) -> dict[int, torch.Tensor]:
        """``{layer: [tokens, 24]}`` row ids of one ``tokens``-long sequence, modulo ``rows``."""
        if self.stream is None or zipf:
            token_ids = torch.multinomial(self.weights, tokens, replacement=True, generator=self.generator)
        else:
            length = self.stream.numel()
            offset = int(torch.randint(0, length, (1,), generator=self.generator, device=self.device))
            token_ids = self.stream.repeat(-(-tokens // length) + 1)[offset : offset + tokens]
        hashed = self.hasher.all_row_ids(token_ids)  # [T, 2, 24]
        return {layer: hashed[:, i].remainder(rows).contiguous() for i, layer in enumerate((1, 14))}


def random_ids(count: int, high: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randint(0, high, (count,), generator=generator, device=device, dtype=torch.int64)


# ------------------------------------------------------------------------------------------ system
def system_report(report: Report) -> None:
    props = torch.cuda.get_device_properties(0)
    info = meminfo()
    report.add(
        "system",
        gpu=props.name,
        sms=props.multi_processor_count,
        torch=torch.__version__,
        triton=__import__("triton").__version__,
        mem_total_gib=info.get("MemTotal", 0) / GIB,
        mem_available_gib=info.get("MemAvailable", 0) / GIB,
        cpus=os.cpu_count(),
    )
    for command in (
        "nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.gen.max,"
        "pcie.link.width.current,pcie.link.width.max --format=csv,noheader",
        "nvidia-smi -q | grep -i -E 'addressing mode|bar1|ats' | head -5",
        "cat /proc/cmdline",
        "ls /sys/class/iommu 2>&1 | head -3; ls /sys/kernel/iommu_groups 2>/dev/null | wc -l",
        "cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/shmem_enabled",
        "df -h /dev/shm | tail -1; grep -i huge /proc/meminfo | tr '\\n' ' '",
        "uname -r; lscpu | grep -E 'Model name|NUMA node\\(s\\)'",
    ):
        report.note(f"`{command.split('|')[0].strip()[:60]}`: {shell(command)}")


def configure_huge_pages(pages: int, report: Report) -> None:
    """Reserve ``pages`` 2 MiB pages (root; for this throwaway machine) and mount hugetlbfs if needed."""
    if hugetlbfs_mount() is None:
        os.makedirs("/dev/hugepages", exist_ok=True)
        report.note(f"mount hugetlbfs: {shell('mount -t hugetlbfs -o pagesize=2M none /dev/hugepages 2>&1') or 'ok'}")
    shell("sync; echo 3 > /proc/sys/vm/drop_caches; echo 1 > /proc/sys/vm/compact_memory")
    started = time.monotonic()
    Path("/proc/sys/vm/nr_hugepages").write_text(str(pages))
    info = meminfo()
    report.note(
        f"nr_hugepages <- {pages}: got {info.get('HugePages_Total', 0)} total, {info.get('HugePages_Free', 0)} free "
        f"in {time.monotonic() - started:.1f} s"
    )


def release_huge_pages() -> None:
    try:
        Path("/proc/sys/vm/nr_hugepages").write_text("0")
    except OSError:
        pass
