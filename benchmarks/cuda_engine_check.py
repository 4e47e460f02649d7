"""The engine on CUDA gives the CPU's greedy tokens (tiny V4 and V4.1 checkpoints, fp32).

    python benchmarks/cuda_engine_check.py

The tiny V4 must match for every prompt. The tiny V4.1 is checked twice: with its trained-in rounding off (the
continuous math: every prompt must match) and on, where a value within float32 noise of an FP8 / FP4 rounding
boundary can land on either side. There the fast path's tokens are compared with the reference path's twice:
the CPU's, and the same engine on CUDA with every op forced to its torch reference (``DSINFER_OPS``). Each
count of differing prompts is set beside the count that reference shows against itself on its own device
between two chunkings of the same prompts (prefill chunks of 256 and of 32 tokens). ``--prompts N`` sets the
number of random prompts (24), ``--seed`` their seed (0: every run checks the same prompts); ``--rounding-only``
runs only the rounding-on comparison on CUDA (no CPU engines, so many more prompts fit). The fast path's own flips
between the two chunkings are printed too, and so is, for each flip against the reference on CUDA and each of that
reference's own flips, the reference's margin at the first token where the two part (its logprob of its own token
minus that of the other run's): a near-tie that float32 noise decides shows a margin near zero. Where the tiny V4,
or the tiny V4.1 with its rounding off, differs from the CPU, the CPU's margin at each flip is printed the same
way.
    python benchmarks/cuda_engine_check.py --slice-layers 4    # also: fast path vs reference path on the slice

``--slice-layers N``: the V4-Flash-width slice (``dsinfer make-slice``, random weights from one seed) in fp32 on
CUDA, once with every op's chosen backend (Triton kernels, decode graphs) and once with every op forced to its
torch reference (``DSINFER_OPS``): the greedy tokens of both engines.

``--speculative K``: on CUDA, the tiny V4 with MTP drafts and the tiny V4.1 with DSpark drafts (K of them),
verify and draft steps replayed from CUDA graphs and with ``enforce_eager``, against plain decoding's greedy
tokens; and how many verify steps the graphs served.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time

import torch

import dsinfer.llm as llm_module
from dsinfer.bench.shapes import write_slice_directory
from dsinfer.llm import LLM
from dsinfer.models.tiny import make_tiny_checkpoint
from dsinfer.ops.registry import reference_table
from dsinfer.sampling_params import SamplingParams

TINY_OPTIONS = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "max_model_len": 400}
# A fixed cache for the tiny models: sized from free memory, it would depend on what earlier checks left allocated.
TINY_CACHE_BYTES = 1 << 30


def slice_check(layers: int, prompts: list[list[int]], params: SamplingParams) -> None:
    """Greedy tokens of the slice with the fast path and with every op's reference, fp32 on CUDA."""
    outputs = {}
    with tempfile.TemporaryDirectory() as directory:
        path = write_slice_directory(directory, layers)
        for path_name, forced in (("fast", ""), ("reference", every_reference())):
            os.environ["DSINFER_OPS"] = forced
            options = {"max_num_seqs": 8, "max_num_batched_tokens": 1024, "max_model_len": 512, "dtype": "float32"}
            with LLM(str(path), device="cuda", load_format="dummy", **options) as llm:
                outputs[path_name] = llm.generate(prompts, params, use_tqdm=False)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    os.environ.pop("DSINFER_OPS", None)
    fast, reference = outputs["fast"], outputs["reference"]
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(fast, reference, strict=True))
    print(f"slice ({layers} layers, fp32): fast-path greedy tokens equal the reference path's for {same} of "
          f"{len(prompts)} prompts")  # fmt: skip


def speculative_check(k: int, prompts: list[list[int]], params: SamplingParams) -> None:
    """Greedy tokens of speculative decoding on CUDA, graphed and eager, against plain decoding (fp32, tiny)."""
    for arch, method in (("v4", "mtp"), ("v41", "dspark")):
        spec = {"method": method, "num_speculative_tokens": k}
        with tempfile.TemporaryDirectory() as directory:
            make_tiny_checkpoint(directory, arch=arch)
            options = {**TINY_OPTIONS, "cache_memory_bytes": TINY_CACHE_BYTES}
            outputs, served = {}, (0, 0)
            for name, extra in (("plain", {}), ("graphed", {"speculative_config": spec}),
                                ("eager", {"speculative_config": spec, "enforce_eager": True})):  # fmt: skip
                with LLM(directory, device="cuda", **options, **extra) as llm:
                    outputs[name] = llm.generate(prompts, params, use_tqdm=False)
                    executor = llm.engine.worker.speculative
                    if name == "graphed":
                        served = (executor.graphed_steps, executor.steps)
                del llm
                gc.collect()
                torch.cuda.empty_cache()
        for name in ("graphed", "eager"):
            same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids
                       for a, b in zip(outputs[name], outputs["plain"], strict=True))  # fmt: skip
            note = f" ({served[0]} of {served[1]} verify steps graphed)" if name == "graphed" else ""
            print(f"{arch} {method} K={k} {name}: greedy tokens equal plain decoding's for {same} of "
                  f"{len(prompts)} prompts{note}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slice-layers", type=int, default=0, help="also check the V4-Flash-width slice")
    parser.add_argument("--skip-tiny", action="store_true")
    parser.add_argument("--speculative", type=int, default=0, metavar="K", help="also check speculative decoding")
    parser.add_argument("--prompts", type=int, default=24, help="random prompts of the tiny checks")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--rounding-only", action="store_true",
                        help="only V4.1's rounding-on check, on CUDA")  # fmt: skip
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(args.seed)  # the lengths too: every run checks the same prompts
    lengths = torch.randint(2, 300, (args.prompts,), generator=generator).tolist()
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in lengths]
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)  # logprobs: flip margins
    if args.slice_layers:
        slice_check(args.slice_layers, prompts[:8], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    if args.speculative:
        speculative_check(args.speculative, prompts, plain)
    if args.rounding_only:
        with tempfile.TemporaryDirectory() as directory:
            make_tiny_checkpoint(directory, arch="v41")
            rounding_on_checks(directory, prompts, params, with_cpu=False)
    elif not args.skip_tiny:
        tiny_checks(prompts, params)


def tiny_tokens(directory: str, device: str, prompts, params, rounding: bool = True, chunk: int = 256,
                forced: str = ""):  # fmt: skip
    """Greedy completions (``CompletionOutput``) of the tiny checkpoint in ``directory`` (fp32); ``rounding`` False
    turns V4.1's trained-in rounding off before the engine builds its cache (plain storage then); ``chunk``: prefill
    tokens a step; ``forced``: a ``DSINFER_OPS`` value for this engine (every op's reference:
    :func:`every_reference`). Each engine's time is printed."""
    start = time.perf_counter()
    options = {**TINY_OPTIONS, "max_num_batched_tokens": chunk}
    if device == "cuda":
        options["cache_memory_bytes"] = TINY_CACHE_BYTES
    loader = llm_module.load_engine_model
    if not rounding:  # the engine loads the model itself: turn the rounding off as it does
        llm_module.load_engine_model = lambda *args, **kwargs: loader(*args, **kwargs).set_fake_quantization(False)
    os.environ["DSINFER_OPS"] = forced
    try:
        with LLM(directory, device=device, **options) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm_module.load_engine_model = loader
        os.environ.pop("DSINFER_OPS", None)
    del llm
    gc.collect()
    torch.cuda.empty_cache()  # the next engine sizes its cache from free GPU memory
    path = "every op's reference" if forced else "chosen ops"
    print(f"  ({device} {path}, prefill chunks of {chunk}, rounding {'on' if rounding else 'off'}: "
          f"{time.perf_counter() - start:.1f} s)", flush=True)  # fmt: skip
    return [output.outputs[0] for output in outputs]


def every_reference() -> str:
    """``DSINFER_OPS`` forcing every op to its torch reference."""
    return ",".join(f"{op}=reference" for op in sorted(reference_table("cpu", torch.float32).chosen))


def differing(first: list, second: list) -> int:
    """Prompts whose greedy tokens differ between two lists of completions."""
    return sum(a.token_ids != b.token_ids for a, b in zip(first, second, strict=True))


def flip_margins(first: list, second: list) -> list[float]:
    """For each prompt whose greedy tokens differ: at the first token where they part, how much more likely
    ``first``'s run found its own token than ``second``'s (a difference of logprobs, inf where ``second``'s token is
    not among ``first``'s top logprobs), smallest first. A flip at a margin near zero is a near-tie that float32
    noise decides; a large one is a real divergence."""
    margins = []
    for a, b in zip(first, second, strict=True):
        if a.token_ids == b.token_ids or not a.top_logprobs:
            continue
        position = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y)
        top = dict(a.top_logprobs[position])
        margins.append(top[a.token_ids[position]] - top.get(b.token_ids[position], float("-inf")))
    return sorted(margins)


def flips_text(cpu: list, cuda: list) -> str:
    """Where the two differ: the CPU's top-logprob margin at each flip's first differing token (a near-tie that
    float32 noise decides shows a margin near zero)."""
    margins = flip_margins(cpu, cuda)
    return f" (the CPU's margins at the flips: {margins_text(margins)})" if margins else ""


def margins_text(margins: list[float]) -> str:
    return "[" + ", ".join(f"{margin:.2g}" for margin in margins) + "]"


def tiny_checks(prompts, params) -> None:
    n = len(prompts)
    with tempfile.TemporaryDirectory() as directory:
        make_tiny_checkpoint(directory, arch="v4")
        cpu, cuda = (tiny_tokens(directory, device, prompts, params) for device in ("cpu", "cuda"))
        print(f"v4: CUDA engine greedy tokens equal the CPU's for {n - differing(cpu, cuda)} of {n} prompts"
              f"{flips_text(cpu, cuda)}")  # fmt: skip
    with tempfile.TemporaryDirectory() as directory:
        make_tiny_checkpoint(directory, arch="v41")
        off = [tiny_tokens(directory, device, prompts, params, rounding=False) for device in ("cpu", "cuda")]
        print(f"v41, rounding off: CUDA engine greedy tokens equal the CPU's for {n - differing(*off)} of {n} prompts"
              f"{flips_text(*off)}")  # fmt: skip
        rounding_on_checks(directory, prompts, params)


def rounding_on_checks(directory: str, prompts, params, with_cpu: bool = True) -> None:
    """The tiny V4.1 with its rounding on: the fast path against the reference path on CUDA (and, ``with_cpu``,
    on the CPU), each set beside that reference's own flips between prefill chunks of 256 and 32 tokens on its
    device. Each line is printed as soon as its engines have run."""
    n, reference = len(prompts), every_reference()
    fast = tiny_tokens(directory, "cuda", prompts, params)
    cuda_reference = tiny_tokens(directory, "cuda", prompts, params, forced=reference)
    cuda_reference_32 = tiny_tokens(directory, "cuda", prompts, params, chunk=32, forced=reference)
    cuda_chunk_flips = differing(cuda_reference, cuda_reference_32)
    report_flips("the reference path on CUDA", differing(cuda_reference, fast), cuda_chunk_flips, n)
    if params.logprobs:
        own = flip_margins(cuda_reference, cuda_reference_32)
        against = flip_margins(cuda_reference, fast)
        beyond = sum(margin > max(own, default=0.0) for margin in against)
        print(f"v41, rounding on: the reference path's top-logprob margin at each flip's first differing token, "
              f"against the fast path {margins_text(against)}, against itself between chunkings "
              f"{margins_text(own)}: {beyond} of the fast path's flips lie beyond the reference's own largest",
              flush=True)  # fmt: skip
    fast_chunk_flips = differing(fast, tiny_tokens(directory, "cuda", prompts, params, chunk=32))
    print(f"v41, rounding on: between prefill chunks of 256 and 32 tokens the fast path differs from itself on "
          f"{fast_chunk_flips} of {n} prompts", flush=True)  # fmt: skip
    if with_cpu:
        cpu = tiny_tokens(directory, "cpu", prompts, params)
        cpu_chunk_flips = differing(cpu, tiny_tokens(directory, "cpu", prompts, params, chunk=32))
        report_flips("the CPU", differing(cpu, fast), cpu_chunk_flips, n)
        print(f"v41, rounding on: the reference path on CUDA differs from the CPU on {differing(cpu, cuda_reference)} "
              f"of {n}", flush=True)  # fmt: skip


def report_flips(name: str, flips: int, own: int, n: int) -> None:
    verdict = "within" if flips <= own else "MORE than"
    print(f"v41, rounding on: the CUDA fast path differs from {name} on {flips} of {n} prompts ({verdict} that "
          f"reference's own {own} between chunkings)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
