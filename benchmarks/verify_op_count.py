"""Ops a speculative round dispatches, counted on the CPU: the verify forward and the draft against a plain decode.

    python benchmarks/verify_op_count.py                          # the embedded default, DSpark K = 3
    python benchmarks/verify_op_count.py --tiny v4 --method mtp   # the tiny V4 with MTP
    python benchmarks/verify_op_count.py --tiny v41               # the tiny V4.1 with DSpark
    python benchmarks/verify_op_count.py --admissions             # the steps that prefill a prompt instead

The engine runs the static-shape path (one graph bucket, run eagerly on the CPU) over a few greedy prompts, once
plain and once speculative, and every op inside the plain decode graph's forward, the verify graph's forward and
the draft graph's forward is counted with a ``TorchDispatchMode``. Two counts a forward:

* ``aten ops``: every aten op dispatched (views excluded), the CPU references' ops included;
* ``launch proxy``: the registry ops called (``ops.<name>``, one fused op on CUDA each) plus the aten ops outside
  them (views and other metadata-only ops excluded): roughly the kernels a CUDA graph of the forward replays.
  On CUDA some registry ops launch more than one kernel, and the CPU backs ops such as ``hc_site_input`` with
  references of many aten ops, which this count leaves inside the op.

``--admissions``: the engine steps that prefill a prompt instead (one prompt at a time, counted whole: the
forward, the drafter's seeding and what the step adds around them), plain (``admit``) and speculative
(``admit+drafter``), with the first drafts deferred as where graphs are captured (``defer_first_drafts``).

No timing: the counts show where a forward's work is, and whether a change adds or removes dispatches.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.loader import load_model
from dsinfer.models.tiny import default_model_dir, make_tiny_checkpoint
from dsinfer.ops import registry
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer

# Metadata-only ops (no kernel on a GPU): left out of both counts.
VIEW_OPS = ("aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::detach", "aten::alias")
METADATA_OPS = (*VIEW_OPS, "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::t",
                "aten::transpose", "aten::permute", "aten::expand", "aten::reshape", "aten::flatten",
                "aten::unflatten", "aten::split", "aten::unbind", "aten::chunk", "aten::empty")  # fmt: skip


class OpCounter(TorchDispatchMode):
    """Counts aten ops (``aten``) and, for the launch proxy, registry ops plus the aten ops outside them."""

    def __init__(self) -> None:
        super().__init__()
        self.aten, self.proxy, self.depth = 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if not name.startswith(VIEW_OPS):
            self.aten += 1
        if self.depth == 0 and not name.startswith(METADATA_OPS):
            self.proxy += 1
        return func(*args, **(kwargs or {}))


_active: list[OpCounter] = []


@contextlib.contextmanager
def registry_ops_counted():
    """While open, every registry op called under an active counter counts once in its proxy (what it dispatches
    does not); the op table is as it was afterwards."""
    table_getattr = registry.OpTable.__getattr__

    def counted_getattr(table, name):
        fn = table_getattr(table, name)

        def call(*args, **kwargs):
            counter = _active[-1] if _active else None
            if counter is None:
                return fn(*args, **kwargs)
            if counter.depth == 0:
                counter.proxy += 1
            counter.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter.depth -= 1

        return call

    registry.OpTable.__getattr__ = counted_getattr
    try:
        yield
    finally:
        registry.OpTable.__getattr__ = table_getattr


def _counted(totals: dict, label: str, forward):
    """``forward`` with its ops added to ``totals[label]`` (forwards, aten ops, launch proxy)."""

    def wrapped(*args):
        counter = OpCounter()
        _active.append(counter)
        try:
            with counter:
                result = forward(*args)
        finally:
            _active.pop()
        total = totals.setdefault(label, [0, 0, 0])
        total[0], total[1], total[2] = total[0] + 1, total[1] + counter.aten, total[2] + counter.proxy
        return result

    return wrapped


def greedy_prompt(model, generator: torch.Generator, index: int) -> list[int]:
    """Prompt ``index`` of a run: 40 + ``index`` random ids clear of the special tokens."""
    return torch.randint(10, int(model.config.vocab_size) - 10, (40 + index,), generator=generator).tolist()


def count(checkpoint: str, speculative: dict | None, prompts: int, max_tokens: int) -> dict[str, dict[str, float]]:
    """Ops a forward of each graphed kind while ``prompts`` greedy prompts decode (plain when ``speculative`` is
    None): ``{kind: {"forwards", "aten_ops", "launch_proxy"}}``."""
    model = load_model(checkpoint, progress=False)
    config = EngineConfig(max_num_seqs=prompts, max_num_batched_tokens=64, max_model_len=256,
                          cuda_graph_sizes=[prompts], speculative_config=speculative)  # fmt: skip
    engine = LLMEngine(model, Tokenizer.from_dir(checkpoint), config)
    totals: dict = {}
    if speculative is None:
        graphs = engine.runner.decode_graphs
        graphs._forward = _counted(totals, "plain", graphs._forward)
    else:
        graphs = engine.worker.speculative.graphs
        graphs._verify_forward = _counted(totals, "verify", graphs._verify_forward)
        graphs._draft_forward = _counted(totals, "draft", graphs._draft_forward)
    generator = torch.Generator().manual_seed(5)
    for index in range(prompts):
        ids = greedy_prompt(model, generator, index)
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return {kind: {"forwards": n, "aten_ops": aten / n, "launch_proxy": proxy / n}
            for kind, (n, aten, proxy) in totals.items()}  # fmt: skip


def count_admissions(checkpoint: str, speculative: dict | None, prompts: int) -> dict[str, dict[str, float]]:
    """Ops of the engine steps that prefill a prompt, one greedy prompt admitted at a time (plain when
    ``speculative`` is None; else its first drafts deferred, as where graphs are captured): ``{kind: {"forwards"
    (steps), "aten_ops", "launch_proxy"}}`` per step."""
    model = load_model(checkpoint, progress=False)
    config = EngineConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256, cuda_graph_sizes=[1],
                          speculative_config=speculative)  # fmt: skip
    engine = LLMEngine(model, Tokenizer.from_dir(checkpoint), config)
    executor = engine.worker.speculative
    if executor is not None:
        executor.defer_first_drafts = executor.graphs is not None
    label = "admit" if speculative is None else "admit+drafter"
    totals: dict = {}
    counted_step = _counted(totals, label, engine.step)
    scheduler, generator = engine.scheduler, torch.Generator().manual_seed(5)
    for index in range(prompts):
        ids = greedy_prompt(model, generator, index)
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            queued = [*scheduler.waiting, *scheduler.running]
            prefilling = any(seq.num_computed < len(seq.prompt_token_ids) for seq in queued)
            (counted_step if prefilling else engine.step)()
    return {kind: {"forwards": n, "aten_ops": aten / n, "launch_proxy": proxy / n}
            for kind, (n, aten, proxy) in totals.items()}  # fmt: skip


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
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root, registry_ops_counted():
        checkpoint = args.model or str(default_model_dir())
        if args.tiny is not None:
            checkpoint = str(make_tiny_checkpoint(Path(root) / args.tiny, seed=0, arch=args.tiny))
        speculative = {"method": args.method, "num_speculative_tokens": args.k}
        if args.admissions:
            counts = {**count_admissions(checkpoint, None, args.prompts),
                      **count_admissions(checkpoint, speculative, args.prompts)}  # fmt: skip
        else:
            counts = {**count(checkpoint, None, args.prompts, args.max_tokens),
                      **count(checkpoint, speculative, args.prompts, args.max_tokens)}  # fmt: skip
    for kind, row in counts.items():
        unit = "steps" if args.admissions else "forwards"
        print(f"{kind:13}  {row['forwards']:3d} {unit:8}  {row['aten_ops']:9.0f} aten ops  "
              f"{row['launch_proxy']:7.0f} launch proxy", flush=True)  # fmt: skip
    return counts


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
