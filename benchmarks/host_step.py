"""Host time of an engine step: the model's forward replaced by constant logits, so only the host's work is left.

    python benchmarks/host_step.py --requests 1 16                        # LLMEngine.step, decode, per batch size
    python benchmarks/host_step.py --requests 16 --overlap                # ... with the device worker, as on CUDA
    python benchmarks/host_step.py --requests 16 --overlap --serve --client raw   # behind the real HTTP server
    python benchmarks/host_step.py --requests 16 --device-ms 8 --serve    # a forward of 8 ms without the Python lock
    python benchmarks/host_step.py --requests 16 --device-ms 4 --serve --client raw --engine-process  # as served

The engine part runs decode steps of ``--requests`` greedy requests on the tiny checkpoint (CPU) and reports the
median ms per ``step()`` and the process's CPU ms per step: scheduling, batch preparation, sampling, token
bookkeeping and detokenization, the work a GPU step's host side does besides the forward. ``--serve`` starts
``dsinfer serve``'s app on loopback around such an engine and streams ``--requests`` chat completions; over the
decode steps it reports the median ``engine.step`` time, the period from one step to the next, and the CPU ms
per step of each server thread (``dsinfer-engine``, ``dsinfer-device_0``, ``http``: uvicorn's event loop). The
threads share one Python lock, so when the step is host-bound their sum is what a step costs; the ``http``
thread's share is what serving adds. ``--client bench`` (the default) streams with ``dsinfer bench serve`` and
adds its ITL and TPOT; ``--client raw`` reads the streams as bytes, which leaves the server the CPU on a small
machine (``--client-cpus`` pins the client). Profile with ``py-spy record --threads -- python
benchmarks/host_step.py ...`` (a thread waiting for the lock shows up in py-spy's samples; the CPU clocks do not).

``--engine-process`` runs the engine in a process of its own, as ``dsinfer serve`` does by default (without it,
in the server's process, as ``--engine-in-process``): the constant forward reaches it through this script, which
multiprocessing imports in the engine process (:func:`patch_engine_process`). The period is then from one
delivery of a step's outputs to the streams to the next (the event loop reads the engine's pipe itself; older
code: its engine thread), beside the engine process's own median step and step period and its CPU ms per step.
See also benchmarks/serve_host_cost.py (each side's host cost per step, ITL against the offline step).

``--device-ms D`` stands in for a GPU: the forward sleeps D ms (a thread waiting on the device holds no Python
lock) and the engine overlaps steps as on CUDA (implies ``--overlap``), so the engine's step is the offline decode
step and the served period shows what the HTTP side adds to it. With ``--device-queue`` the forward returns at
once and queues its D ms on a stand-in stream instead, and reading the sampled tokens back waits for it
(:class:`QueuedDevice`): the device worker can launch the next step while this one runs, as on CUDA, so the step
exceeds D only by host work that does not fit under it.

    python benchmarks/host_step.py --requests 1 16 --device-ms 1.16 --device-queue   # does the host keep up?

With ``--block-tokens`` the engine's cache blocks are that small, so a short prompt gets a block table as long as a
long context's, which the host reads every step (3,000 tokens at 8 a block, the tiny V4.1's least: 376 entries;
131,072 at 128: 1,025):

    python benchmarks/host_step.py --requests 256 --input-len 3000 --arch v41 --block-tokens 8 --steps 40 \
        --device-ms 10 --device-queue
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.deepseek_v4 import DeepseekV4
from dsinfer.models.loader import load_model
from dsinfer.models.tiny import make_tiny_checkpoint
from dsinfer.sampling.host_copies import HostCopies
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer


def constant_forward(model_class: type, device_ms: float = 0.0, queued: bool = False) -> None:
    """Replace a model class's forward by one that returns fixed logits (token 300 wins), after ``device_ms`` of
    sleep (the device's time: no Python lock held). ``queued``: the forward returns at once and queues its
    ``device_ms`` on a stand-in device instead (:class:`QueuedDevice`), as a CUDA launch does."""
    logits_of: dict[int, torch.Tensor] = {}  # by vocabulary size
    device = QueuedDevice.install() if queued and device_ms else None

    def forward(self, batch, *args, logits_for=None, **kwargs):
        if device is not None:
            device.queue(device_ms)
        elif device_ms:
            time.sleep(device_ms / 1e3)
        vocab = self.config.vocab_size
        if vocab not in logits_of:
            logits_of[vocab] = torch.full((vocab,), -5.0)
            logits_of[vocab][300] = 5.0
        rows = logits_for.shape[0] if logits_for is not None else len(batch.spans)
        return logits_of[vocab].expand(rows, vocab).clone()

    model_class.forward = forward


class QueuedDevice:
    """A stand-in for a GPU's stream: work queued on it runs in order, each piece for its time, while the host
    goes on; a read-back of results (:class:`~dsinfer.sampling.host_copies.HostCopies`) waits, without the Python
    lock, until the work queued before it has run. So a step's launch costs the host only its own work, and
    the next step can launch while this one runs, as the engine's overlap does on CUDA."""

    def __init__(self) -> None:
        self.free_at = 0.0  # perf_counter time at which the queued work ends
        self.lock = threading.Lock()

    def queue(self, ms: float) -> None:
        with self.lock:
            self.free_at = max(time.perf_counter(), self.free_at) + ms / 1e3

    @classmethod
    def install(cls) -> QueuedDevice:
        """A device whose queued work every ``HostCopies`` made afterwards waits for."""
        device = cls()
        start, wait = HostCopies.__init__, HostCopies.wait

        def start_copies(self, tensors):
            start(self, tensors)
            self.ready_at = device.free_at  # the copies queue behind everything launched so far

        def wait_for_device(self):
            delay = getattr(self, "ready_at", 0.0) - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            return wait(self)

        HostCopies.__init__, HostCopies.wait = start_copies, wait_for_device
        return device


def engine_config(requests: int, overlap: bool, **sizes) -> EngineConfig:
    """``overlap``: overlap scheduling (the engine's device worker thread), as on CUDA."""
    return EngineConfig(max_num_seqs=max(requests, 1), async_scheduling=overlap, **sizes)


def engine_host_ms(model, tokenizer, requests: int, steps: int, input_len: int, overlap: bool,
                   block_tokens: int | None = None) -> dict:  # fmt: skip
    """Median and mean ``step()`` ms and CPU ms a step over ``steps`` decode steps (every prompt prefilled in one
    step first), and the garbage collector's ms a step among them."""
    sizes = dict(max_model_len=input_len + steps + 64, block_tokens=block_tokens,
                 max_num_batched_tokens=max(8192, requests * input_len))  # fmt: skip
    engine = LLMEngine(model, tokenizer, engine_config(requests, overlap, **sizes))
    for i in range(requests):
        engine.add_request(
            [5 + (i + j) % 200 for j in range(input_len)],
            SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True),
        )
    for _ in range(4):  # the prefills (one step), then a few decode steps
        engine.step()
    collections: list[float] = []

    def timed_collection(phase: str, info: dict) -> None:
        if phase == "start":
            timed_collection.started = time.perf_counter()
        else:
            collections.append(time.perf_counter() - timed_collection.started)

    gc.callbacks.append(timed_collection)
    times, cpu = [], time.process_time()
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    cpu_ms = (time.process_time() - cpu) / steps * 1e3
    gc.callbacks.remove(timed_collection)
    engine.close()
    return {"engine_step_ms": statistics.median(times) * 1e3, "mean_step_ms": statistics.mean(times) * 1e3,
            "cpu_ms_per_step": cpu_ms, "gc_ms_per_step": sum(collections) / steps * 1e3}  # fmt: skip


def bench_serve(port: int, requests: int, input_len: int, output_len: int, client_cpus: list[int] | None) -> dict:
    """``dsinfer bench serve``'s results for ``requests`` concurrent chat streams."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "serve.json"
        subprocess.run(
            [sys.executable, "-m", "dsinfer.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
             "--model", "tiny", "--dataset", "random", "--input-len", str(input_len), "--output-len",
             str(output_len), "--num-prompts", str(requests), "--max-concurrency", str(requests), "--seed", "0",
             "--disable-tqdm", "--out", str(out)],
            check=True, capture_output=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, client_cpus)) if client_cpus else None,
        )  # fmt: skip
        return json.loads(out.read_text())


def drain_streams(port: int, requests: int, input_len: int, output_len: int, client_cpus: list[int] | None) -> None:
    """``requests`` concurrent chat streams read as raw bytes, unparsed: a client that takes little of the CPU
    the server's threads need (``dsinfer bench serve`` parses every chunk)."""
    if client_cpus:
        os.sched_setaffinity(0, client_cpus)

    async def one(index: int) -> None:
        body = json.dumps({
            "model": "tiny", "messages": [{"role": "user", "content": f"{index}" + " the" * input_len}],
            "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
        }).encode()  # fmt: skip
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"stream {index}: {status.decode().strip()} {(await reader.read(1 << 16)).decode()}")
        while await reader.read(1 << 16):
            pass
        writer.close()

    async def all_streams() -> None:
        await asyncio.gather(*(one(i) for i in range(requests)))

    asyncio.run(all_streams())


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds each live thread of this process has used, by thread name."""
    return {thread.name: time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            for thread in threading.enumerate() if thread.ident is not None}  # fmt: skip


def serve_host_ms(directory: str, requests: int, output_len: int, input_len: int, port: int, device_ms: float,
                  overlap: bool, client_cpus: list[int] | None = None, client: str = "bench",
                  engine_process: bool = False, threads: int = 1, queued: bool = False) -> dict:  # fmt: skip
    import uvicorn

    if client_cpus:  # the client's parsing of every chunk would otherwise take CPU time from the server's threads
        os.sched_setaffinity(0, os.sched_getaffinity(0) - set(client_cpus))

    from dsinfer.server.launch import ServeOptions, build_server

    records = tempfile.mkdtemp(prefix="host-step-")
    if engine_process:  # read by the engine process when it imports this script (see patch_engine_process)
        os.environ[ENGINE_PROCESS_ENV] = json.dumps({"device_ms": device_ms, "queued": queued, "threads": threads,
                                                    "out": records})  # fmt: skip
    options = ServeOptions(model=directory, port=port, served_model_name="tiny", log_level="warning",
                           engine_process=engine_process)  # fmt: skip
    config = engine_config(requests, overlap, max_model_len=input_len + output_len + 128)
    app, engine = build_server(options, config)
    if not engine_process:
        constant_forward(type(engine.engine.model), device_ms, queued)
    # The decode steps measured: past the prefills, before the first stream ends.
    first, last = requests + 8, requests + 8 + max(output_len - 2 * requests - 24, 8)
    steps, starts, cpu, step = [], [], {}, engine.engine.step

    def timed_step():
        """In-process: one engine step. With an engine process: the outputs it reported since the last call,
        timed when they reach the engine thread (a call that waited in vain counts for nothing)."""
        seen = len(starts)  # CPU clocks every 8 deliveries from the first measured (with an engine process, a
        if first <= seen <= last and (seen - first) % 8 == 0 and seen not in cpu:  # delivery can hold two steps)
            cpu[seen] = (time.perf_counter(), time.process_time(), thread_cpu_s(), engine_process_cpu_s(engine.engine))
        start = time.perf_counter()
        out = step()
        if engine_process and not out:
            return out
        steps.append(time.perf_counter() - start)
        starts.append(time.perf_counter() if engine_process else start)
        return out

    if getattr(engine, "loop_driven", False):  # the event loop reads the engine process's reports itself
        deliver = engine._on_outputs

        def timed_delivery(outputs):
            """One wake-up's outputs from the engine process, timed when the event loop has handed them over."""
            seen = len(starts)
            if first <= seen <= last and (seen - first) % 8 == 0 and seen not in cpu:
                cpu[seen] = (time.perf_counter(), time.process_time(), thread_cpu_s(),
                             engine_process_cpu_s(engine.engine))  # fmt: skip
            start = time.perf_counter()
            deliver(outputs)
            if outputs:
                steps.append(time.perf_counter() - start)
                starts.append(time.perf_counter())

        engine._on_outputs = timed_delivery
    else:
        engine.engine.step = timed_step
    engine.start()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True, name="http").start()
    while not server.started:
        time.sleep(0.05)
    if client == "raw":
        process = multiprocessing.get_context("spawn").Process(
            target=drain_streams, args=(port, requests, input_len, output_len, client_cpus)
        )
        process.start()
        process.join()
        result = {}
    else:
        result = bench_serve(port, requests, input_len, output_len, client_cpus)
    server.should_exit = True
    engine.stop()
    # Server side, over the measured decode steps: one step's start to the next (with an engine process: one
    # delivery of a step's outputs to the next), and the CPU time the server's threads spent per step (in one
    # process they take turns holding the Python lock).
    begin, end = min(cpu), max(cpu)  # the measured deliveries (fewer than planned when some held two steps)
    periods = [b - a for a, b in zip(starts[begin:end], starts[begin + 1 : end + 1], strict=False)]
    at_begin, process_before, threads_before, engine_before = cpu[begin]
    at_end, process_after, threads_after, engine_after = cpu[end]
    engine_steps = {}
    if engine_process:  # the engine process's own steps between the same two moments
        engine_steps = engine_process_steps(records, engine.engine.pids[0], at_begin, at_end)
    count = engine_steps.pop("steps", end - begin)
    per_thread = {name: round((threads_after[name] - before) / count * 1e3, 3)
                  for name, before in threads_before.items() if name in threads_after}  # fmt: skip
    out = {"requests": requests, "device_ms": device_ms, "overlap": overlap, "engine_process": engine_process,
           "step_period_ms": statistics.median(periods) * 1e3, "mean_step_period_ms": (at_end - at_begin) / count * 1e3,
           "cpu_ms_per_step": (process_after - process_before) / count * 1e3, **engine_steps,
           "thread_cpu_ms_per_step": {name: ms for name, ms in per_thread.items() if ms > 0}}  # fmt: skip
    if engine_process:
        out["engine_process_cpu_ms_per_step"] = (engine_after - engine_before) / count * 1e3
    else:
        out["engine_step_ms"] = statistics.median(steps[begin:end]) * 1e3
    if result:
        out.update({"wall_ms_per_step": result["duration"] / max(len(steps), 1) * 1e3,
                    "median_itl_ms": result["median_itl_ms"], "mean_tpot_ms": result["mean_tpot_ms"],
                    "output_tokens_per_s": result["output_throughput"]})  # fmt: skip
    return out


def engine_process_cpu_s(engine) -> float:
    """CPU seconds the engine process has used (0 in-process): its /proc stat's user and system ticks."""
    pids = getattr(engine, "pids", None)
    if not pids:
        return 0.0
    fields = Path(f"/proc/{pids[0]}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_process_steps(records: str, pid: int, begin: float, end: float) -> dict:
    """The engine process's own steps that started between ``begin`` and ``end`` (``time.perf_counter`` is the
    system's monotonic clock, the same in both processes): how many, median ``step()`` time and period."""
    steps = json.loads(Path(records, f"{pid}.json").read_text())
    inside = [i for i, start in enumerate(steps["starts"]) if begin <= start <= end]
    starts = [steps["starts"][i] for i in inside]
    periods = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    return {"steps": len(inside), "engine_step_ms": statistics.median(steps["durations"][i] for i in inside) * 1e3,
            "engine_process_step_period_ms": statistics.median(periods) * 1e3}  # fmt: skip


ENGINE_PROCESS_ENV = "HOST_STEP_ENGINE_PROCESS"


def patch_engine_process() -> None:
    """In the engine process: the constant forward, torch's thread count, and a record of every ``step()``
    (written when the engine closes).

    multiprocessing imports the parent's main script in each child it starts by fork server or spawn (as
    ``__mp_main__``), before the child's target runs, so the benchmark reaches the engine process without a hook
    in dsinfer: the settings travel in ``$HOST_STEP_ENGINE_PROCESS``, set before the fork server starts."""
    settings = json.loads(os.environ[ENGINE_PROCESS_ENV])
    torch.set_num_threads(settings["threads"])
    constant_forward(DeepseekV4, settings["device_ms"], settings["queued"])
    starts, durations = [], []
    step, close = LLMEngine.step, LLMEngine.close

    def timed_step(self):
        start = time.perf_counter()
        out = step(self)
        durations.append(time.perf_counter() - start)
        starts.append(start)
        return out

    def close_and_record(self):
        close(self)
        Path(settings["out"], f"{os.getpid()}.json").write_text(json.dumps({"starts": starts, "durations": durations}))

    LLMEngine.step, LLMEngine.close = timed_step, close_and_record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=200, help="timed engine steps (engine mode)")
    parser.add_argument("--serve", action="store_true", help="behind the HTTP server instead")
    parser.add_argument("--output-len", type=int, default=256, help="tokens per request (--serve)")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--device-ms", type=float, default=0.0, help="the forward's stand-in device time")
    parser.add_argument("--overlap", action="store_true", help="overlap scheduling as on CUDA (implied by --device-ms)")
    parser.add_argument("--device-queue", action="store_true",
                        help="with --device-ms: the forward queues its time on a stand-in device and returns, and "
                        "reading the tokens back waits for it (as a CUDA launch does), instead of sleeping in the "
                        "forward")  # fmt: skip
    parser.add_argument("--client-cpus", type=int, nargs="+", default=None,
                        help="--serve: the benchmark client's CPUs (the server gets the others)")  # fmt: skip
    parser.add_argument("--client", choices=["bench", "raw"], default="bench",
                        help="--serve: 'dsinfer bench serve' (client ITL and TPOT too) or streams read as raw bytes "
                        "(little client CPU: steadier server numbers on a small machine)")  # fmt: skip
    parser.add_argument("--engine-process", action="store_true",
                        help="--serve: the engine in a process of its own, as 'dsinfer serve' runs it by default "
                        "(without it: in the server's process, as --engine-in-process)")  # fmt: skip
    parser.add_argument("--port", type=int, default=18555)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--arch", choices=["v4", "v41"], default="v4", help="the tiny checkpoint's architecture")
    parser.add_argument(
        "--block-tokens",
        type=int,
        default=None,
        help="engine mode: tokens a cache block (fewer: tables as long as a long context's)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    overlap = args.overlap or args.device_ms > 0
    with tempfile.TemporaryDirectory() as directory:
        make_tiny_checkpoint(directory, arch=args.arch)
        if args.serve:
            for requests in args.requests:
                result = serve_host_ms(directory, requests, args.output_len, args.input_len, args.port, args.device_ms,
                                       overlap, args.client_cpus, args.client, args.engine_process,
                                       args.threads, args.device_queue)  # fmt: skip
                print(json.dumps(result), flush=True)
            return
        model = load_model(directory, progress=False)
        constant_forward(type(model), args.device_ms, args.device_queue)
        tokenizer = Tokenizer.from_dir(directory)
        for requests in args.requests:
            result = engine_host_ms(model, tokenizer, requests, args.steps, args.input_len, overlap,
                                    args.block_tokens)  # fmt: skip
            print(json.dumps({"requests": requests, "device_ms": args.device_ms, "device_queue": args.device_queue,
                              "overlap": overlap, **result}),
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()


if __name__ == "__mp_main__" and ENGINE_PROCESS_ENV in os.environ:
    patch_engine_process()  # this script imported by the engine process (or the raw client, which never steps)
