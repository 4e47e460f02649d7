"""The ``dsinfer`` command line: ``serve``, ``generate``, ``bench``, ``eval``, ``make-tiny`` and ``make-slice``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from dsinfer.arg_types import non_negative_number, positive_int
from dsinfer.chat.image_reader import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES, ImageLimits
from dsinfer.chat.limits import DEFAULT_MAX_N
from dsinfer.config import ConfigError, EngineConfig
from dsinfer.config.engine import KV_CACHE_DTYPES, V41_PREFILL_MODES
from dsinfer.cpu_threads import apply_cpu_threads
from dsinfer.engram.fetch import PLACEMENTS
from dsinfer.engram.store import EngramStoreError
from dsinfer.llm import DTYPES, LLM
from dsinfer.models.dummy import LOAD_FORMATS
from dsinfer.models.loader import CheckpointError
from dsinfer.models.tiny import make_tiny_checkpoint
from dsinfer.parallel.config import ParallelConfig
from dsinfer.plan_cli import add_expert_offload, add_plan_parser, run_plan
from dsinfer.sampling_params import SamplingParams
from dsinfer.server import DEFAULT_SERVED_MODEL_NAME
from dsinfer.server.request_guard import DEFAULT_MAX_REQUEST_BYTES
from dsinfer.tokenizer import TokenizerLoadError


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, unless there is none or the help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is argparse.SUPPRESS or "default" in text:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsinfer", description="DeepSeek-V4 inference engine")
    commands = parser.add_subparsers(dest="command", required=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    add_generate_command(commands, device)
    add_chat_command(commands, device)
    add_serve_command(commands, device)
    add_tool_commands(commands)
    return parser


def add_generate_command(commands, device: str) -> None:
    generate = commands.add_parser("generate", help="complete prompts offline through the engine", **WITH_DEFAULTS)
    generate.add_argument("model", nargs="?", help=MODEL_HELP)
    generate.add_argument("--prompt", action="append", help="prompt text; repeat for several prompts")
    generate.add_argument("--max-tokens", type=positive_int, default=32, help="new tokens per prompt")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this probability mass")
    generate.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens; 0 = off")
    generate.add_argument("--seed", type=int, default=None, help="per-request seed (default: a fresh random one)")
    generate.add_argument(
        "--chat",
        action="store_true",
        help="treat each prompt as a user message: the chat prompt, the answer without reasoning",
    )
    add_engine_basics(generate, device)
    add_engine_features(generate)


def add_chat_command(commands, device: str) -> None:
    chat = commands.add_parser("chat", help="chat with a model in the terminal (streamed answers)", **WITH_DEFAULTS)
    chat.add_argument("model", nargs="?", help=MODEL_HELP)
    chat.add_argument("--max-tokens", type=positive_int, default=512, help="new tokens per answer")
    chat.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    chat.add_argument("--thinking", action="store_true", help="thinking mode: reasoning shown dimmed, then the answer")
    chat.add_argument("--system", default=None, help="a system message opening the conversation")
    add_engine_basics(chat, device)


def add_serve_command(commands, device: str) -> None:
    serve = commands.add_parser("serve", help="run the OpenAI-compatible server", **WITH_DEFAULTS)
    serve.add_argument("model", nargs="?", help=MODEL_HELP)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: the checkpoint "
        f"directory's name; {DEFAULT_SERVED_MODEL_NAME!r} for the embedded default model)",
    )  # fmt: skip
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') "
                       "on every route but /health (default: no key needed)")  # fmt: skip
    serve.add_argument("--max-request-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help="largest request body accepted; a larger one is a 413 before it is read")  # fmt: skip
    serve.add_argument("--allow-missing-model", action="store_true",
                       help="serve generation requests that name no model (as vLLM does) instead of a 400 (as "
                       "OpenAI and Anthropic answer)")  # fmt: skip
    add_engine_basics(serve, device)
    serve.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                       help="tokens per engine step (default: 8192 on CUDA, 512 on the CPU)")  # fmt: skip
    add_parallel_layout(serve)
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="seconds before a request is ended (408; default: no limit)")  # fmt: skip
    serve.add_argument("--max-queue", type=positive_int, default=None,
                       help="waiting requests before 429 (default: no limit)")  # fmt: skip
    serve.add_argument("--max-n", type=positive_int, default=DEFAULT_MAX_N,
                       help="completions one request may ask for (n, times the prompts of a batch); "
                       "more is a 400")  # fmt: skip
    serve.add_argument("--drain-timeout", type=non_negative_float, default=30.0,
                       help="seconds in-flight requests get to finish after SIGTERM; then streams end with an "
                       "error event and [DONE]")  # fmt: skip
    add_image_limits(serve)
    add_engine_features(serve)
    add_expert_offload(serve)
    serve.add_argument("--engine-in-process", action="store_true",
                       help="one rank: step the engine in the server's process (a thread there) instead of an "
                       "engine process of its own; the server's HTTP work then shares the Python lock with the "
                       "engine's step")  # fmt: skip


def add_parallel_layout(parser: argparse.ArgumentParser) -> None:
    """The ranks (DP x CP = EP) and the hosts they run on (see :class:`~dsinfer.parallel.config.ParallelConfig`)."""
    parser.add_argument("--data-parallel-size", type=int, default=1, help="attention data-parallel ranks")
    parser.add_argument("--expert-parallel-size", type=int, default=1, help="MoE expert-parallel ranks (= DP x CP)")
    parser.add_argument("--context-parallel-size", type=int, default=1, help="context-parallel ranks")
    parser.add_argument("--expert-placement", default=None, metavar="FILE",
                        help='JSON {"ranks": [[experts of rank 0], ...]}: redundant experts (EPLB)')  # fmt: skip
    parser.add_argument("--nnodes", type=positive_int, default=1, help="hosts that share the ranks")
    parser.add_argument("--node-rank", type=int, default=0, help="this host's index; host 0 runs the HTTP server")
    parser.add_argument("--master-addr", default="127.0.0.1", help="host 0's address (the ranks' rendezvous)")
    parser.add_argument("--master-port", type=int, default=None,
                        help="rendezvous port (needed with --nnodes > 1; ranks reach the API on port + 1)")  # fmt: skip


def parallel_layout(args: argparse.Namespace) -> ParallelConfig:
    """The layout of :func:`add_parallel_layout`'s flags, each named for its field (checked as it is made)."""
    return ParallelConfig(**{field.name: getattr(args, field.name) for field in dataclasses.fields(ParallelConfig)})


def add_image_limits(parser: argparse.ArgumentParser) -> None:
    """What one request may send of V4.1's image input."""
    parser.add_argument("--max-images-per-request", type=positive_int, default=DEFAULT_MAX_IMAGES,
                        help="V4.1 image input: images one request may carry")  # fmt: skip
    parser.add_argument("--max-image-bytes", type=positive_int, default=DEFAULT_MAX_IMAGE_BYTES,
                        help="V4.1 image input: encoded bytes per image")  # fmt: skip
    parser.add_argument("--max-image-pixels", type=positive_int, default=DEFAULT_MAX_IMAGE_PIXELS,
                        help="V4.1 image input: source pixels (width x height) per image")  # fmt: skip


def add_tool_commands(commands) -> None:
    """The commands that hand over to a tool of their own (bench, eval) or write a checkpoint directory."""
    bench = commands.add_parser("bench", help="benchmarks: 'sweep' (engine steady state), 'serve' (any OpenAI server)")
    bench.add_argument("mode", choices=["sweep", "serve"])
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options of the chosen benchmark (see --help there)")
    evaluate = commands.add_parser("eval", help="evals: 'run' generates answers, 'grade' judges them")
    evaluate.add_argument("mode", choices=["run", "grade"])
    evaluate.add_argument("rest", nargs=argparse.REMAINDER, help="options of the chosen step (see --help there)")

    tiny = commands.add_parser("make-tiny", help="write a tiny random V4 or V4.1 checkpoint directory", **WITH_DEFAULTS)
    tiny.add_argument("directory", type=Path)
    tiny.add_argument("--arch", choices=["v4", "v41"], default="v4", help="v41: DeepSeek-V4.1 with Engram and DSpark")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    tiny.add_argument("--shards", type=positive_int, default=3, help="safetensors files to split the weights into")
    tiny.add_argument("--no-quant", action="store_true", help="store bf16 weights instead of FP8 / FP4")
    tiny.add_argument("--vision", action="store_true", help="V4.1 only: add a tiny vision tower (image input)")

    sliced = commands.add_parser(
        "make-slice", help="write a V4-Flash-width config and tokenizer, no weights (for --load-format dummy)",
        **WITH_DEFAULTS,
    )  # fmt: skip
    sliced.add_argument("directory", type=Path)
    sliced.add_argument("--flash-layers", type=positive_int, default=4, help="layers, cycling window / CSA / HCA")
    sliced.add_argument("--nextn", type=int, choices=[0, 1], default=0,
                        help="MTP layers (1: serve it with --speculative-config method mtp)")  # fmt: skip
    add_plan_parser(commands)


WITH_DEFAULTS = {"formatter_class": DefaultsHelpFormatter}


MODEL_HELP = (
    "checkpoint directory or Hugging Face repository id (ORG/NAME, fetched into the hub's cache; "
    "HF_HUB_OFFLINE=1 uses the cache only) (default: the embedded default model)"
)


def add_engine_basics(parser: argparse.ArgumentParser, device: str) -> None:
    """What every engine command takes: the batch and context sizes, where the model comes from, dtype and device."""
    parser.add_argument("--max-num-seqs", type=positive_int, default=16, help="sequences in the running batch")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="context length: prompt plus completion (default: the model's)")  # fmt: skip
    parser.add_argument("--revision", default=None, help="repository id only: the branch, tag or commit to fetch")
    parser.add_argument("--download-dir", default=None,
                        help="repository id only: the hub cache directory to use (default: HF_HUB_CACHE)")  # fmt: skip
    parser.add_argument("--cpu-threads", type=positive_int, default=None,
                        help="CPU engines: torch threads (default: the cores this process may use, by affinity and "
                        "cgroup quota, less one for the HTTP server when serving)")  # fmt: skip
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights and activations")
    parser.add_argument("--device", default=device, help="torch device")


def add_engine_features(parser: argparse.ArgumentParser) -> None:
    """The engine features ``generate`` and ``serve`` switch (read back by :func:`engine_config`)."""
    parser.add_argument(
        "--engram-placement",
        choices=PLACEMENTS,
        default=None,
        help="where DeepSeek-V4.1's Engram tables live: on the device, once per host in shared memory read over "
        "PCIe, or split over the ranks (default: $DSINFER_ENGRAM_PLACEMENT, else 'host' when they exceed the "
        "GPU's budget, else 'device'); ignored for checkpoints without Engram layers",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="cache storage (vLLM's spelling): 'fp8' keeps V4's lightning-indexer keys as the release does, e4m3 "
        "codes with a ue8m0 scale per 128 channels (half of bf16: more blocks fit; the top-k choice may differ "
        "where scores nearly tie), and V4.1's rows as FP8 / FP4 codes; 'bf16' keeps both in the model dtype; "
        "'auto': V4 bf16, V4.1 codes under its trained-in rounding",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule the next step while the device runs the current one (default: on for CUDA, off on CPU)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run decode steps eagerly instead of replaying CUDA graphs (default: graphs on CUDA)",
    )
    parser.add_argument(
        "--kernel-warmup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="at start-up, compile every prefill kernel shape a prompt up to --max-model-len can reach, so the "
        "first long prompt runs at the speed of the next (default: on for CUDA, off on CPU)",
    )
    parser.add_argument(
        "--cuda-graph-sizes",
        type=positive_int,
        nargs="+",
        default=None,
        help="batch sizes to capture decode CUDA graphs for (default: powers of two up to --max-num-seqs)",
    )
    parser.add_argument(
        "--v41-prefill",
        choices=V41_PREFILL_MODES,
        default=None,
        help="V4.1 prompts: 'bounded' runs the CED decoder layers over only the last --v41-replay-tokens of each "
        "prompt (DeepInfer's default), 'exact' runs every layer over every token (default: bounded where the "
        "checkpoint has a CED decoder and speculative decoding is off, else exact)",
    )
    parser.add_argument(
        "--v41-replay-tokens",
        type=positive_int,
        default=140,
        help="tokens of each prompt the V4.1 decoder layers run over in bounded prefill (default: 140)",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, as JSON: \'{"method": "mtp" or "dspark", "num_speculative_tokens": K}\' (K from '
        "1 to 5; V4's MTP layer or V4.1's DSpark stages draft K tokens per step, the model verifies them in one "
        'forward; dspark also takes "confidence_threshold" from 0 to 1, mtp "draft_token_map", a JSON file of the '
        "token ids it may draft: scripts/make_token_map.py) (default: off)",
    )
    parser.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default="auto",
        help="'dummy': read only the model directory's config and tokenizer and draw random weights in the release "
        "formats on the device (one rank; for measuring a shape without its checkpoint)",
    )


def engine_config(args: argparse.Namespace, **command_fields) -> EngineConfig:
    """The engine's config from :func:`add_engine_basics`' flags and, where the command has them,
    :func:`add_engine_features`'; ``command_fields``: the fields only one command sets."""
    fields = {"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len, "dtype": args.dtype,
              "device": args.device}  # fmt: skip
    if "speculative_config" in args:
        fields.update(
            engram_placement=args.engram_placement,
            kv_cache_dtype=args.kv_cache_dtype,
            async_scheduling=args.async_scheduling,
            enforce_eager=args.enforce_eager,
            kernel_warmup=args.kernel_warmup,
            cuda_graph_sizes=tuple(args.cuda_graph_sizes) if args.cuda_graph_sizes else None,
            speculative_config=args.speculative_config,
            v41_prefill=args.v41_prefill,
            v41_replay_tokens=args.v41_replay_tokens,
        )
    return EngineConfig(**fields, **command_fields)


def non_negative_float(text: str) -> float:
    """A finite number of seconds >= 0; anything else is an argparse error naming the value."""
    return non_negative_number(text, "seconds")


def run_generate(args: argparse.Namespace) -> int:
    """Generate completions for the prompts through the engine (continuous batching, paged caches)."""
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    prompts = args.prompt or (["Hello!"] if args.chat else ["The quick brown fox"])
    apply_cpu_threads(args.cpu_threads, args.device, reserved=0)
    with LLM(args.model, engine_config(args), load_format=args.load_format, revision=args.revision,
             download_dir=args.download_dir) as llm:  # fmt: skip
        start = time.perf_counter()
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        spec = llm.engine.spec_stats
    for prompt, output in zip(prompts, outputs, strict=True):
        print(f"{prompt!r} -> {output.outputs[0].text!r} ({output.outputs[0].finish_reason})")
    total = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s)")
    if spec is not None:
        rate = spec.acceptance_rate
        print(
            f"speculative decoding: {spec.num_accepted_tokens} of {spec.num_draft_tokens} drafts accepted "
            f"({0.0 if rate is None else 100 * rate:.1f}%), {spec.mean_acceptance_length or 1.0:.2f} tokens per "
            f"verify step over {spec.num_drafts} steps"
        )
    return 0


def run_chat_command(args: argparse.Namespace) -> int:
    """``dsinfer chat``: the interactive loop of :mod:`dsinfer.chat_cli`."""
    from dsinfer.chat_cli import run_chat

    apply_cpu_threads(args.cpu_threads, args.device, reserved=0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    with LLM(args.model, engine_config(args), revision=args.revision, download_dir=args.download_dir) as llm:
        return run_chat(llm, params, thinking=args.thinking, system=args.system)


def run_serve(args: argparse.Namespace) -> int:
    from dsinfer.server.launch import ServeOptions, serve

    options = ServeOptions(
        model=args.model, host=args.host, port=args.port, served_model_name=args.served_model_name,
        load_format=args.load_format,
        api_key=args.api_key, parallel=parallel_layout(args),
        request_timeout=args.request_timeout, max_queue=args.max_queue, max_n=args.max_n,
        drain_timeout=args.drain_timeout,
        image_limits=ImageLimits(args.max_images_per_request, args.max_image_bytes, args.max_image_pixels),
        engine_process=not args.engine_in_process,
        max_request_bytes=args.max_request_bytes, require_model=not args.allow_missing_model,
        cpu_threads=args.cpu_threads, revision=args.revision, download_dir=args.download_dir,
    )  # fmt: skip
    if args.engine_in_process and max(args.data_parallel_size, args.expert_parallel_size) > 1:
        raise ConfigError("--engine-in-process runs one rank; several ranks always run in processes of their own")
    engine = engine_config(
        args,
        max_num_batched_tokens=args.max_num_batched_tokens,
        expert_offload=args.expert_offload,
        expert_stats=args.expert_stats,
    )
    return serve(options, engine)


def run_bench(args: argparse.Namespace) -> int:
    if args.mode == "sweep":
        from dsinfer.bench.sweep import main as sweep_main

        return sweep_main(args.rest)
    from dsinfer.bench.serving import main as serving_main

    return serving_main(args.rest)


def run_eval(args: argparse.Namespace) -> int:
    from dsinfer.eval.cli import main as eval_main

    return eval_main([args.mode, *args.rest])


def run_make_tiny(args: argparse.Namespace) -> int:
    path = make_tiny_checkpoint(
        args.directory,
        seed=args.seed,
        num_shards=args.shards,
        quantized=not args.no_quant,
        arch=args.arch,
        vision=args.vision,
    )
    print(f"wrote a tiny DeepSeek-{'V4.1' if args.arch == 'v41' else 'V4'} checkpoint to {path}")
    return 0


def run_make_slice(args: argparse.Namespace) -> int:
    from dsinfer.bench.shapes import write_slice_directory

    path = write_slice_directory(args.directory, args.flash_layers, args.nextn)
    mtp = f" and {args.nextn} MTP layer" if args.nextn else ""
    print(f"wrote a {args.flash_layers}-layer V4-Flash-width config{mtp} and tokenizer to {path} "
          "(serve it with --load-format dummy)")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {
        "generate": run_generate,
        "chat": run_chat_command,
        "serve": run_serve,
        "bench": run_bench,
        "eval": run_eval,
        "make-tiny": run_make_tiny,
        "make-slice": run_make_slice,
        "plan": run_plan,
    }
    try:
        return handlers[args.command](args)
    except (CheckpointError, ConfigError, TokenizerLoadError, EngramStoreError, ValueError) as exc:
        print(f"dsinfer {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
