"""Ops a speculative round dispatches, counted on the CPU: the verify forward and the draft against a plain decode.

    python benchmarks/verify_op_count.py                          # the embedded default, DSpark K = 3
    python benchmarks/verify_op_count.py --tiny v4 --method mtp   # the tiny V4 with MTP
    python benchmarks/verify_op_count.py --tiny v41               # the tiny V4.1 with DSpark
    python benchmarks/verify_op_count.py --admissions             # the steps that prefill a prompt instead
    TRITON_INTERPRET=1 python benchmarks/verify_op_count.py --prompts 1 --kernels --sites 30   # launches, by source

The engine runs the static-shape path (one graph bucket, run eagerly on the CPU) over a few greedy prompts, once
plain and once speculative, and every op inside the plain decode graph's forward, the verify graph's forward and
the draft graph's forward is counted with a ``TorchDispatchMode``. Two counts a forward:

* ``aten ops``: every aten op dispatched (views excluded), the CPU references' ops included;
* ``launch proxy``: the registry ops called (``ops.<name>``, one fused op on CUDA each) plus the aten ops outside
  them (views and other metadata-only ops excluded): roughly the kernels a CUDA graph of the forward replays.
  On CUDA some registry ops launch more than one kernel, and the CPU backs ops such as ``hc_site_input`` with
  references of many aten ops, which this count leaves inside the op.

``--kernels`` (under ``TRITON_INTERPRET=1``): the CUDA backends serve the CPU, and a third count estimates the
kernels a GPU launches: every Triton launch plus every aten op outside one that computes (metadata and allocations
excluded), the registry ops' own glue included. The launches are counted, not run (the interpreter would take
minutes a forward): each counted op's torch reference gives the result the model goes on with, uncounted, and the
work outside the counted forwards (the prompts' prefill) runs the references; a run takes seconds. ``--sites N``
lists the N largest sources of those launches a forward (a kernel by its registry op, an aten op outside one by the
model line that dispatched it). On the embedded default (one sequence) it counts 617 launches a DSpark K = 3 round
(verify 451, draft 166; plain 314), where a profile of an H100's replays counted 838 for an earlier tree's 742 (the
graphs hold more than these forwards).

``--admissions``: the engine steps that prefill a prompt instead (one prompt at a time, counted whole: the
forward, the drafter's seeding and what the step adds around them), plain (``admit``) and speculative
(``admit+drafter``), with the first drafts deferred as where graphs are captured (``defer_first_drafts``).

No timing: the counts show where a forward's work is, and whether a change adds or removes dispatches.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.loader import load_model
from dsinfer.models.tiny import default_model_dir, make_tiny_checkpoint
from dsinfer.ops import registry
from dsinfer.ops.mhc.site_parts import SiteParts
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer

# Metadata-only ops (no kernel on a GPU): left out of both counts.
VIEW_OPS = ("aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::detach", "aten::alias")
METADATA_OPS = (*VIEW_OPS, "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::t",
                "aten::transpose", "aten::permute", "aten::expand", "aten::reshape", "aten::flatten",
                "aten::unflatten", "aten::split", "aten::unbind", "aten::chunk", "aten::empty")  # fmt: skip
# Ops that only allocate or mark (no kernel on a GPU either): left out of the kernel estimate.
ALLOCATION_OPS = ("aten::new_empty", "aten::empty_like", "aten::empty_strided", "aten::lift_fresh", "aten::detach_",
                  "aten::resolve_conj", "aten::resolve_neg")  # fmt: skip


class OpCounter(TorchDispatchMode):
    """Counts aten ops (``aten``) and, for the launch proxy, registry ops plus the aten ops outside them; with
    Triton interpreted, the kernel estimate (``kernels``, and by source in ``sites`` where kept)."""

    def __init__(self, sites: bool = False) -> None:
        super().__init__()
        self.aten, self.proxy, self.kernels, self.depth, self.launching, self.launch_free = 0, 0, 0, 0, 0, 0
        self.open_ops: list[str] = []  # the registry ops being called, innermost last
        self.sites: collections.Counter | None = collections.Counter() if sites else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if self.launching:  # the interpreter's own work inside a Triton launch
            return func(*args, **(kwargs or {}))
        if not name.startswith(VIEW_OPS):
            self.aten += 1
        if self.depth == 0 and not name.startswith(METADATA_OPS):
            self.proxy += 1
        if not name.startswith(METADATA_OPS + ALLOCATION_OPS):
            self.kernel(name)
        return func(*args, **(kwargs or {}))

    def kernel(self, name: str) -> None:
        """One launch of ``name``, its source kept where sites are."""
        self.kernels += 1
        if self.sites is not None:
            self.sites[f"{name} in {self.open_ops[-1] if self.open_ops else model_line()}"] += 1


def model_line() -> str:
    """The innermost line of dsinfer outside its ops that is running: where a model dispatched an aten op."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace(os.sep, "/")
        if "/dsinfer/" in path and "/dsinfer/ops/" not in path:
            return f"{path.split('/dsinfer/')[-1]}:{frame.lineno} ({frame.name})"
    return "outside the model"


_active: list[OpCounter] = []


@contextlib.contextmanager
def uncounted(counter: OpCounter):
    """While open, what runs counts nowhere (as inside a Triton launch)."""
    counter.launching += 1
    try:
        yield
    finally:
        counter.launching -= 1


@contextlib.contextmanager
def inside_op(counter: OpCounter, name: str, launch_free: bool):
    """While open, what runs counts as registry op ``name``'s (its Triton launches counted, not run, where
    ``launch_free``)."""
    counter.depth += 1
    counter.open_ops.append(name)
    counter.launch_free += launch_free
    try:
        yield
    finally:
        counter.depth -= 1
        counter.open_ops.pop()
        counter.launch_free -= launch_free


def paired_parts(counter: OpCounter, name: str, launched: SiteParts, expected: SiteParts) -> SiteParts:
    """``hc_site_input``'s halves run later, outside the op: each counts as the backend's half (launches not run,
    under the op's name) and returns the reference's."""

    def half(launched_half, expected_half):
        def run():
            with inside_op(counter, name, launch_free=True):
                launched_half()
            with uncounted(counter):
                return expected_half()

        return run

    return SiteParts(half(launched.collapse, expected.collapse), half(launched.weights, expected.weights))


@contextlib.contextmanager
def registry_ops_counted(launch_free: bool = False):
    """While open, every registry op called under an active counter counts once in its proxy (what it dispatches
    does not); the op table is as it was afterwards.

    ``launch_free`` (with :func:`interpreted_kernels`): the interpreter would take minutes over a forward's kernels,
    so an outermost op under a counter runs its backend with every Triton launch counted but not run (its glue
    runs and counts), then its torch reference, uncounted, for the result the model goes on with; ops called
    with no counter active (the prompts' prefill, the host's work between forwards) run their references."""
    table_getattr = registry.OpTable.__getattr__
    references: dict[tuple, registry.OpTable] = {}

    def reference(table, name):
        key = (table.device, table.dtype)
        if key not in references:
            references[key] = registry.reference_table(*key)
        return table_getattr(references[key], name)

    def counted_getattr(table, name):
        fn = table_getattr(table, name)

        def call(*args, **kwargs):
            counter = _active[-1] if _active else None
            if counter is None:
                return reference(table, name)(*args, **kwargs) if launch_free else fn(*args, **kwargs)
            outermost = counter.depth == 0
            if outermost:
                counter.proxy += 1
            with inside_op(counter, name, launch_free):
                result = fn(*args, **kwargs)
            if not (launch_free and outermost):
                return result
            with uncounted(counter):  # the reference stands in for the launches not run
                expected = reference(table, name)(*args, **kwargs)
            return paired_parts(counter, name, result, expected) if isinstance(result, SiteParts) else expected

        return call

    registry.OpTable.__getattr__ = counted_getattr
    try:
        yield
    finally:
        registry.OpTable.__getattr__ = table_getattr


@contextlib.contextmanager
def interpreted_kernels():
    """While open, the CUDA backends serve the CPU through Triton's interpreter (``TRITON_INTERPRET=1``) and each
    kernel launch counts in the active counter's kernel estimate; the registry is as it was afterwards."""
    from triton.runtime.interpreter import InterpretedFunction

    serves, run = registry.Backend.serves, InterpretedFunction.run

    def serves_interpreted(backend, device, dtype):
        device = torch.device(device)
        if device.type == "cpu" and "cuda" in backend.devices and backend.name != registry.REFERENCE:
            return (backend.dtypes is None or dtype in backend.dtypes) and bool(backend.available())
        return serves(backend, device, dtype)

    def run_counted(function, *args, **kwargs):
        counter = _active[-1] if _active else None
        if counter is None:
            return run(function, *args, **kwargs)
        counter.kernel(f"triton {function.fn.__name__}")
        if counter.launch_free:
            return None
        counter.launching += 1
        try:
            return run(function, *args, **kwargs)
        finally:
            counter.launching -= 1

    registry.Backend.serves, InterpretedFunction.run = serves_interpreted, run_counted
    registry.forget_choices()
    try:
        yield
    finally:
        registry.Backend.serves, InterpretedFunction.run = serves, run
        registry.forget_choices()


def _counted(totals: dict, label: str, forward, sites: bool = False):
    """``forward`` with its ops added to ``totals[label]`` (forwards, aten ops, launch proxy, kernels, sites)."""

    def wrapped(*args):
        counter = OpCounter(sites)
        _active.append(counter)
        try:
            with counter:
                result = forward(*args)
        finally:
            _active.pop()
        total = totals.setdefault(label, [0, 0, 0, 0, collections.Counter()])
        total[0], total[1], total[2] = total[0] + 1, total[1] + counter.aten, total[2] + counter.proxy
        total[3] += counter.kernels
        total[4].update(counter.sites or {})
        return result

    return wrapped


def per_forward(totals: dict) -> dict[str, dict]:
    """``totals`` (:func:`_counted`'s) as counts a forward: ``forwards``, ``aten_ops``, ``launch_proxy``,
    ``kernels`` and ``sites`` (launches a forward by source, largest first)."""
    rows = {}
    for kind, (n, aten, proxy, kernels, sites) in totals.items():
        rows[kind] = {"forwards": n, "aten_ops": aten / n, "launch_proxy": proxy / n, "kernels": kernels / n,
                      "sites": {site: count / n for site, count in sites.most_common()}}  # fmt: skip
    return rows


def greedy_prompt(model, generator: torch.Generator, index: int) -> list[int]:
    """Prompt ``index`` of a run: 40 + ``index`` random ids clear of the special tokens."""
    return torch.randint(10, int(model.config.vocab_size) - 10, (40 + index,), generator=generator).tolist()


def count(checkpoint: str, speculative: dict | None, prompts: int, max_tokens: int, sites: bool = False) -> dict:
    """Ops a forward of each graphed kind while ``prompts`` greedy prompts decode (plain when ``speculative`` is
    None): ``{kind: {"forwards", "aten_ops", "launch_proxy", "kernels", "sites"}}`` (:func:`per_forward`; the
    kernels only where :func:`interpreted_kernels` is open, their sources where ``sites``)."""
    model = load_model(checkpoint, progress=False)
    config = EngineConfig(max_num_seqs=prompts, max_num_batched_tokens=64, max_model_len=256,
                          cuda_graph_sizes=[prompts], speculative_config=speculative)  # fmt: skip
    engine = LLMEngine(model, Tokenizer.from_dir(checkpoint), config)
    totals: dict = {}
    if speculative is None:
        graphs = engine.runner.decode_graphs
        graphs._forward = _counted(totals, "plain", graphs._forward, sites)
    else:
        graphs = engine.worker.speculative.graphs
        graphs._verify_forward = _counted(totals, "verify", graphs._verify_forward, sites)
        graphs._draft_forward = _counted(totals, "draft", graphs._draft_forward, sites)
    generator = torch.Generator().manual_seed(5)
    for index in range(prompts):
        ids = greedy_prompt(model, generator, index)
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return per_forward(totals)


def count_admissions(checkpoint: str, speculative: dict | None, prompts: int, sites: bool = False) -> dict:
    """Ops of the engine steps that prefill a prompt, one greedy prompt admitted at a time (plain when
    ``speculative`` is None; else its first drafts deferred, as where graphs are captured): :func:`count`'s
    counts per step (``forwards``: steps)."""
    model = load_model(checkpoint, progress=False)
    config = EngineConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256, cuda_graph_sizes=[1],
                          speculative_config=speculative)  # fmt: skip
    engine = LLMEngine(model, Tokenizer.from_dir(checkpoint), config)
    executor = engine.worker.speculative
    if executor is not None:
        executor.defer_first_drafts = executor.graphs is not None
    label = "admit" if speculative is None else "admit+drafter"
    totals: dict = {}
    counted_step = _counted(totals, label, engine.step, sites)
    scheduler, generator = engine.scheduler, torch.Generator().manual_seed(5)
    for index in range(prompts):
        ids = greedy_prompt(model, generator, index)
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            queued = [*scheduler.waiting, *scheduler.running]
            prefilling = any(seq.num_computed < len(seq.prompt_token_ids) for seq in queued)
            (counted_step if prefilling else engine.step)()
    return per_forward(totals)


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a checkpoint directory (default: the embedded default)")
    parser.add_argument("--tiny", choices=["v4", "v41"], default=None, help="a tiny random checkpoint instead")
    parser.add_argument("--method", choices=["mtp", "dspark"], default="dspark")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--prompts", type=int, default=4, help="sequences decoding at once (the graph bucket)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--admissions", action="store_true",
                        help="count the steps that prefill a prompt (plain and speculative) instead")  # fmt: skip
    parser.add_argument("--kernels", action="store_true",
                        help="estimate the GPU's launches: the CUDA backends in Triton's interpreter "
                             "(run with TRITON_INTERPRET=1)")  # fmt: skip
    parser.add_argument("--sites", type=int, default=0, metavar="N",
                        help="with --kernels: the N largest sources of launches a forward, per kind")  # fmt: skip
    args = parser.parse_args(argv)
    if args.kernels and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--kernels runs the CUDA backends in Triton's interpreter: set TRITON_INTERPRET=1 first")
    if args.sites < 0:
        parser.error(f"--sites: must not be negative, got {args.sites}")
    if args.sites and not args.kernels:
        parser.error("--sites lists the sources of the kernel estimate: add --kernels")
    torch.set_num_threads(1)
    counts = _count_all(args)
    unit = "steps" if args.admissions else "forwards"
    for kind, row in counts.items():
        kernels = f"  {row['kernels']:7.0f} kernels" if args.kernels else ""
        print(f"{kind:13}  {row['forwards']:3d} {unit:8}  {row['aten_ops']:9.0f} aten ops  "
              f"{row['launch_proxy']:7.0f} launch proxy{kernels}", flush=True)  # fmt: skip
        for site, launches in list(row["sites"].items())[: args.sites]:
            print(f"    {launches:7.2f}  {site}")
    return counts


def _count_all(args) -> dict:
    """The counts ``main`` prints: plain then speculative, forwards or admissions, the kernels where asked."""
    kernels = interpreted_kernels() if args.kernels else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as root, registry_ops_counted(launch_free=args.kernels), kernels:
        checkpoint = args.model or str(default_model_dir())
        if args.tiny is not None:
            checkpoint = str(make_tiny_checkpoint(Path(root) / args.tiny, seed=0, arch=args.tiny))
        speculative = {"method": args.method, "num_speculative_tokens": args.k}
        sites = args.sites > 0
        if args.admissions:
            return {**count_admissions(checkpoint, None, args.prompts, sites),
                    **count_admissions(checkpoint, speculative, args.prompts, sites)}  # fmt: skip
        return {**count(checkpoint, None, args.prompts, args.max_tokens, sites),
                **count(checkpoint, speculative, args.prompts, args.max_tokens, sites)}  # fmt: skip


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
