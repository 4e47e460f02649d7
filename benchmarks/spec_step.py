"""Host time and host reads of one speculative verify step, split into forward / judge / rollback / draft.

    python benchmarks/spec_step.py                                  # tiny V4 (MTP) and tiny V4.1 (DSpark)
    python benchmarks/spec_step.py --arch v4 --sequences 1,32 --k 1,3,5 --steps 10 --out spec_step.json
    python benchmarks/spec_step.py --device cuda --temperature 0.8  # on a GPU: phases include the device wait
    python benchmarks/spec_step.py --graphs buckets --temperature 0.8 --top-p 0.9  # sampled, judged on the device
    python benchmarks/spec_step.py --device cuda --graphs eager     # the eager verify path, for comparison

On a GPU the verify and draft steps replay CUDA graphs (``dsinfer.speculative.graphs``) unless ``--graphs
eager``; ``--graphs buckets`` runs their static-shape path on the CPU. ``forward`` and ``draft`` are then the
replays (and, for ``forward``, picking the judged rows), each line says ``graphed=True``.

A speculative engine over a tiny checkpoint (written to a temporary directory in the real file format) runs
``--sequences`` requests to steady decoding (every running sequence carries drafts), then ``--steps`` verify
steps are timed. The executor's phases are timed by wrapping its parts: ``snapshot`` (saving what the verify
forward may overwrite), ``forward`` (the target forward), ``judge`` (accepting drafts, emitting tokens, their
logprobs), ``rollback`` (undoing rejected positions' cache writes), ``draft`` (the drafter's next drafts) and
``other`` (the rest of the executor's step: building the drafter's inputs). A second pass counts host reads
per step and phase: every op that needs a device value on the host (``item``, ``nonzero``, ``is_nonzero``,
boolean-mask indexing) and every ``Tensor.tolist``; on a GPU each one is a synchronisation. It also counts the
tensors built from host lists (``torch.tensor(list)``): each is a copy to the device, a synchronisation too
unless it goes through pinned memory (``dsinfer.kv.batch.host_to_device``). ``ops outside graphs`` counts the
torch ops a step dispatches outside what the CUDA graphs replay (each one a kernel launch on a GPU, paid on the
host): with ``--graphs buckets`` on the CPU, the host work a graphed GPU step keeps.

On the CPU every phase is host time; the numbers say how much per-sequence work a step does, which on a GPU is
what a verify step pays beyond its forward. Medians over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.loader import load_model
from dsinfer.models.tiny import make_tiny_checkpoint
from dsinfer.sampling_params import SamplingParams
from dsinfer.speculative import graphs as graphs_module
from dsinfer.tokenizer import Tokenizer

PHASES = ("snapshot", "forward", "judge", "rollback", "draft", "other")
aten = torch.ops.aten
HOST_READS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.is_nonzero.default,
    aten.repeat_interleave.Tensor,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.bincount.default,
}
MASK_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class HostReadCounter(TorchDispatchMode):
    """Counts the ops that read a device value on the host, and ``Tensor.tolist`` calls, by current phase."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.host_tensors: Counter[str] = Counter()  # tensors built from host lists (a copy to the device each)
        self.launches: Counter[str] = Counter()  # ops outside the graphed region (each a kernel launch on a GPU)
        self.captured = False  # inside what a CUDA graph replays (the static path's forwards)
        self.phase = "outside"
        self._tolist = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.captured:
            self.launches[self.phase] += 1
        if func is aten.lift_fresh.default:
            self.host_tensors[self.phase] += 1
        if func in HOST_READS or (
            func in MASK_INDEXED
            and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else []))
        ):
            self.counts[self.phase] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        counter, original = self, torch.Tensor.tolist
        self._tolist = original

        def tolist(tensor):
            counter.counts[counter.phase] += 1
            return original(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


class PhaseClock:
    """Wraps the executor's parts so each call's time (and host reads, when counting) lands in its phase; a call
    inside another wrapped call counts in its own phase only (nested time is taken out of the outer phase)."""

    def __init__(self, executor) -> None:
        self.times: Counter[str] = Counter()
        self.counter: HostReadCounter | None = None
        self._stack: list[str] = []
        self.replayed = 0.0  # seconds inside what a CUDA graph replays (the static path's forwards)
        drafter, rollback = executor.drafter, executor.rollback
        self._wrap(executor.model, "forward_for_drafter", "forward")
        self._wrap(drafter, "draft", "draft")
        self._wrap(executor, "_judge", "judge")
        graphs = executor.graphs  # verify and draft steps in buckets (CUDA graphs, or their static path on the CPU)
        if graphs is not None:
            # The graphs' parts, as the CPU runs them eagerly (on a GPU the replays are one call each).
            self._wrap(graphs, "verify", "forward")
            self._wrap(graphs, "finish", "draft")
            self._wrap(graphs, "prepare", "other")
            self._wrap(graphs.fixed_rollback, "snapshot", "snapshot")
            self._wrap(graphs.fixed_rollback, "rollback", "rollback")
            self._wrap(graphs_module, "judge_greedy_fixed", "judge")
            self._wrap(graphs, "_judge_forward", "judge")  # sampled and min_tokens requests, on the device
            for name in ("_verify_forward", "_judge_forward", "_draft_forward"):  # what a CUDA graph replays
                self._mark_captured(graphs, name)
        for name in ("snapshot", "snapshot_spans"):
            self._wrap(rollback, name, "snapshot")
        for name in ("rollback", "rollback_spans"):
            self._wrap(rollback, name, "rollback")
        self._wrap(executor, "run", "other")

    def _mark_captured(self, owner, name: str) -> None:
        """Ops inside ``owner.name`` are what a CUDA graph replays: not counted as launches."""
        method, clock = getattr(owner, name), self

        def captured(*args, **kwargs):
            counter, start = clock.counter, time.perf_counter()
            if counter is not None:
                outer, counter.captured = counter.captured, True
            try:
                return method(*args, **kwargs)
            finally:
                clock.replayed += time.perf_counter() - start  # apart from the phases: they count it too
                if counter is not None:
                    counter.captured = outer

        setattr(owner, name, captured)

    def _wrap(self, owner, name: str, phase: str) -> None:
        method = getattr(owner, name, None)
        if method is None:
            return
        clock = self

        def timed(*args, **kwargs):
            counter, stack = clock.counter, clock._stack
            outer = counter.phase if counter is not None else None
            if counter is not None:
                counter.phase = phase
            stack.append(phase)
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                stack.pop()
                clock.times[phase] += elapsed
                if stack:
                    clock.times[stack[-1]] -= elapsed  # nested: counted once, in its own phase
                if counter is not None:
                    counter.phase = outer

        setattr(owner, name, timed)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(served: tuple, method: str, sequences: int, k: int, steps: int, sampling: dict, device: str,
            graphs: str = "default"):  # fmt: skip
    """One point: median host ms per phase and host reads per phase, per verify step (``served``: the model and
    its tokenizer).

    ``sampling``: every request's temperature, top_k and top_p (seeded, each its own seed).

    ``graphs``: ``default`` (CUDA graphs on a GPU, eager on the CPU), ``eager`` (``enforce_eager``) or
    ``buckets`` (buckets up to ``sequences``: on the CPU, the graphs' static path run eagerly)."""
    model, tokenizer = served
    prompt_len, torch_device = 24, torch.device(device)
    max_model_len = prompt_len + (steps * 2 + 8) * (k + 1) + 16
    config = EngineConfig(
        max_num_seqs=sequences,
        max_num_batched_tokens=max(sequences * (k + 1), sequences * prompt_len),
        max_model_len=max_model_len,
        device=device,
        async_scheduling=False,
        speculative_config={"method": method, "num_speculative_tokens": k},
        enforce_eager=graphs == "eager",
        cuda_graph_sizes=(sequences,) if graphs == "buckets" else None,
    )
    engine = LLMEngine(model, tokenizer, config)
    generator = torch.Generator().manual_seed(sequences * 10 + k)
    for index in range(sequences):
        prompt = torch.randint(3, 500, (prompt_len,), generator=generator).tolist()
        params = SamplingParams(**sampling, seed=index, max_tokens=max_model_len, ignore_eos=True)
        engine.add_request(prompt, params)
    for _ in range(4):  # prefill, then steps until every sequence drafts
        engine.step()
    executor = engine.worker.speculative
    clock = PhaseClock(executor)
    per_step = []
    for _ in range(steps):
        _sync(torch_device)
        clock.times.clear()
        clock.replayed = 0.0
        engine.step()
        _sync(torch_device)
        per_step.append({**clock.times, "replayed": clock.replayed})
    counter = HostReadCounter()
    clock.counter = counter
    with counter:
        counter.phase = "outside"
        engine.step()
    clock.counter = None
    times = {phase: 1e3 * statistics.median(step.get(phase, 0.0) for step in per_step) for phase in PHASES}
    times["total"] = 1e3 * statistics.median(sum(step.get(phase, 0.0) for phase in PHASES) for step in per_step)
    # Host time outside the graphed region (on the CPU the static path runs eagerly inside it).
    times["outside_graphs"] = 1e3 * statistics.median(sum(step.get(phase, 0.0) for phase in PHASES)
                                                      - step["replayed"] for step in per_step)  # fmt: skip
    reads = {phase: counter.counts.get(phase, 0) for phase in PHASES}
    reads["total"] = sum(reads.values())
    built = {phase: counter.host_tensors.get(phase, 0) for phase in PHASES}
    built["total"] = sum(built.values())
    launches = {phase: counter.launches.get(phase, 0) for phase in PHASES}
    launches["total"] = sum(launches.values())
    drafted = sum(len(seq.draft_token_ids) for seq in engine.scheduler.running)
    graphed = executor.graphs is not None
    return {"method": method, "sequences": sequences, "k": k, **sampling, "steps": steps,
            "graphs": graphs, "graphed": graphed,
            "ms": {name: round(value, 3) for name, value in times.items()}, "host_reads": reads,
            "host_tensors": built, "launches": launches,
            "running": len(engine.scheduler.running), "drafts_next_step": drafted}  # fmt: skip


def _line(point: dict) -> str:
    def row(values: dict, digits: int) -> str:
        return " ".join(f"{phase}={values[phase]:.{digits}f}" for phase in (*PHASES, "total"))

    head = f"{point['method']:6} seqs={point['sequences']:3} K={point['k']} graphed={point['graphed']!s:5}"
    outside = f"  (host ms outside graphs: {point['ms']['outside_graphs']:.2f})" if point["graphed"] else ""
    return (f"{head}  ms: {row(point['ms'], 2)}\n{head}  host reads: {row(point['host_reads'], 0)}"
            f"  | host-built tensors: {row(point['host_tensors'], 0)}\n"
            f"{head}  ops outside graphs: {row(point['launches'], 0)}{outside}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="v4,v41", help="comma list: v4 (MTP), v41 (DSpark)")
    parser.add_argument("--sequences", default="1,32")
    parser.add_argument("--k", default="1,3,5", help="num_speculative_tokens values")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0, help="every request's top_k (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (1: off)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny matmuls: 1 is fastest)")
    parser.add_argument(
        "--graphs",
        choices=("default", "eager", "buckets"),
        default="default",
        help="verify / draft steps: CUDA graphs on a GPU (default), enforce_eager, or buckets (the graphs' static "
        "path, eager on the CPU)",
    )
    parser.add_argument("--out", default=None, help="write the points as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory() as root:
        for arch in args.arch.split(","):
            block = {"dspark_block_size": 5} if arch == "v41" else {}
            directory = make_tiny_checkpoint(f"{root}/{arch}", seed=0, arch=arch, **block)
            model = load_model(directory, progress=False, device=args.device)
            if arch == "v41":
                model.set_fake_quantization(False)
            tokenizer = Tokenizer.from_dir(directory)
            method = "dspark" if arch == "v41" else "mtp"
            for sequences in (int(s) for s in args.sequences.split(",")):
                for k in (int(v) for v in args.k.split(",")):
                    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
                    point = measure((model, tokenizer), method, sequences, k, args.steps, sampling, args.device,
                                    args.graphs)  # fmt: skip
                    results.append(point)
                    print(_line(point), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
