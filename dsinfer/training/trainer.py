"""Train the embedded default: a small DeepSeek-V4.1 model, through dsinfer's own model code.

One run, deterministic from its seed:

1. **Tokenizer.** A byte-level BPE in DeepSeek-V4's layout (:func:`build_tiny_tokenizer`) learned from
   rendered training chats, one token per digit (column arithmetic reads digits one at a time).
2. **Model.** :class:`~dsinfer.models.deepseek_v41.DeepseekV41` with every V4.1 layer role (window-only, ratio-2
   CSA2 sources and reusers, the ratio-1 candidate source, a keyless index source), staggered mHC, Engram on two
   layers with the real hashing, MoE, and DSpark draft stages. The ops are the torch references (the
   differentiable ones).
3. **Steps.** Batches of whole chats packed as the engine packs sequences (:class:`PackedBatch`); the loss is
   next-token cross-entropy on the assistant turns only, plus the DSpark draft loss on anchors inside them
   (:mod:`dsinfer.training.draft_loss`). AdamW, linear warm-up then cosine decay. For the last
   ``rounding_phase`` of the steps every FP8 / FP4 weight and the trained-in activation rounding are on,
   straight-through (:mod:`dsinfer.training.rounding`), so the shipped weights keep their quality.
4. **Export** in the release formats (FP8 32x32 blocks with ue8m0 scales, packed FP4 experts, FP8 Engram rows)
   with the tokenizer, loadable by :func:`dsinfer.models.loader.load_model` like any checkpoint.

The lightning indexers get no gradient (top-k selection is not differentiable and the indexer distillation
loss is not implemented): past the 128-token window, which 64 compressed entries a query sees (out of 16
candidate blocks of 8) is decided by their initial weights.
"""

from __future__ import annotations

import json
import math
import random
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from dsinfer.chat.format import ChatFormat
from dsinfer.config import ModelConfigV41
from dsinfer.engram.hashing import EngramHasher
from dsinfer.engram.vocabulary import build_compressed_vocabulary
from dsinfer.kv.batch import PackedBatch
from dsinfer.models.deepseek_v41 import DeepseekV41
from dsinfer.models.tiny import (
    quantize_like_checkpoint_v41,
    randomize_v41_,
    storage_format_v41,
    tiny_config_v41,
    write_checkpoint,
)
from dsinfer.models.tiny_tokenizer import build_tiny_tokenizer
from dsinfer.ops.registry import reference_table
from dsinfer.tokenizer import DEEPSEEK_V4_SPECIAL_TOKENS, DSPARK_NOISE_TOKEN, Tokenizer
from dsinfer.training.chat_stream import ChatStream
from dsinfer.training.corpus import training_samples
from dsinfer.training.draft_loss import draft_loss
from dsinfer.training.initial_weights import copy_tokenizer, load_initial_weights
from dsinfer.training.render import SampleRenderer
from dsinfer.training.rounding import StraightThroughQuantizer, remove_weight_rounding, round_weights_straight_through

__all__ = ["PRESETS", "TrainSettings", "train"]

#: The shipped default's widths (about 16 MB in release storage).
DEFAULT_WIDTHS = dict(hidden_size=256, num_attention_heads=8, head_dim=64, qk_rope_head_dim=32, q_lora_rank=128,
                      o_groups=2, o_lora_rank=128, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                      moe_intermediate_size=256, sliding_window=128, max_position_embeddings=8192,
                      index_n_heads=8, index_head_dim=32, index_topk=64, candidate_topk_blocks=16,
                      candidate_block_size=8, engram_vocab_size=2000, engram_n_heads=2, engram_head_dim=32,
                      dspark_block_size=5, dspark_markov_rank=32, dspark_n_routed_experts=4,
                      dspark_num_experts_per_tok=2)  # fmt: skip
#: A model a CPU trains in seconds (tests).
TOY_WIDTHS = dict(hidden_size=32, num_attention_heads=2, head_dim=32, qk_rope_head_dim=16, q_lora_rank=16,
                  o_groups=2, o_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  sliding_window=16, index_n_heads=4, index_head_dim=32, index_topk=64, candidate_topk_blocks=16,
                  candidate_block_size=4, engram_vocab_size=200, engram_head_dim=32, dspark_block_size=3,
                  dspark_markov_rank=8, dspark_n_routed_experts=2, dspark_num_experts_per_tok=1)  # fmt: skip


@dataclass
class TrainSettings:
    steps: int = 3000
    batch_tokens: int = 32768  # tokens per step (whole chats, packed)
    sequence_tokens: int = 1024  # chats are packed into sequences of at most this many tokens (longer: skipped)
    data_workers: int = 8  # processes rendering chats (0: in this process)
    learning_rate: float = 2.5e-3
    min_learning_rate: float = 1e-4
    warmup_steps: int = 50
    weight_decay: float = 0.05
    rounding_phase: float = 0.15  # last share of the steps trained with straight-through FP8 / FP4 rounding
    draft_anchors: int = 24  # DSpark anchors per step
    draft_weight: float = 0.5
    seed: int = 0
    vocab_size: int = 2048
    tokenizer_chats: int = 6000  # rendered chats the BPE merges are learned from
    widths: dict = field(default_factory=lambda: dict(DEFAULT_WIDTHS))
    log_every: int = 25
    time_limit_s: float | None = None  # stop early (and still export) past this many seconds
    minutes: float | None = None  # if set: the step count is re-derived from the first steps' speed to fit
    calibration_steps: int = 12  # steps timed (after the first two) before ``minutes`` fixes the step count
    init_from: str | None = None  # a checkpoint directory whose weights and tokenizer the run starts from


PRESETS = {
    "default": TrainSettings(),
    "toy": TrainSettings(
        steps=4,
        batch_tokens=900,
        sequence_tokens=450,
        data_workers=0,
        learning_rate=3e-3,
        warmup_steps=1,
        rounding_phase=0.25,
        draft_anchors=2,
        vocab_size=700,
        tokenizer_chats=200,
        widths=dict(TOY_WIDTHS),
        log_every=1,
    ),  # fmt: skip
    # A fine-tune of a trained default (``init_from``) on the current data mix: a warm restart of the cosine
    # at a lower peak, the rounding phase again at the end.
    "finetune": TrainSettings(
        steps=300, learning_rate=1.5e-3, min_learning_rate=1e-4, warmup_steps=20, data_workers=12
    ),  # fmt: skip
}

_SPECIAL = re.compile("|".join(re.escape(token) for token in sorted(DEEPSEEK_V4_SPECIAL_TOKENS, key=len, reverse=True)))


# ---- tokenizer and config -----------------------------------------------------------------------------
def build_tokenizer(directory: Path, settings: TrainSettings) -> Tokenizer:
    """Learn the BPE merges from rendered training chats (control tokens removed) and write the tokenizer."""
    with tempfile.TemporaryDirectory() as scratch:
        build_tiny_tokenizer(Path(scratch), vocab_size=1024)  # any tokenizer renders the same text
        renderer = SampleRenderer(ChatFormat(Tokenizer.from_dir(scratch), "v41", "default"))
        lines = []
        for sample in training_samples(settings.seed + 1, settings.tokenizer_chats):
            text = renderer.chat_format.render(renderer.chat_format.prepare("chat", sample.body).request.conversation)
            lines.extend(_SPECIAL.sub("\n", text + renderer.completion_text(sample)).splitlines(keepends=True))
    build_tiny_tokenizer(directory, vocab_size=settings.vocab_size, corpus=lines, digit_group=1)
    return Tokenizer.from_dir(directory)


def model_config(tokenizer: Tokenizer, widths: dict) -> ModelConfigV41:
    """Tiny V4.1's layer roles at ``widths``, sized to the tokenizer (vocabulary, Engram compression, noise id)."""
    compressed = int(build_compressed_vocabulary(tokenizer).max()) + 1
    noise = tokenizer.token_to_id(DSPARK_NOISE_TOKEN)
    config = tiny_config_v41(
        vocab_size=tokenizer.vocab_size, engram_compressed_vocab_size=compressed, engram_num_embeddings=(), **widths
    )  # table rows re-derived from the widths
    return replace(config, dspark_noise_token_id=noise if noise is not None else tokenizer.vocab_size - 1)


# ---- batches ------------------------------------------------------------------------------------------
@dataclass
class Chat:
    offset: int  # first row of the chat in the packed batch
    prompt: int  # its prompt tokens
    length: int  # prompt + completion tokens


@dataclass
class Batch:
    """Chats packed end to end into sequences of at most ``sequence_tokens`` (as pretraining packs documents)."""

    sequences: list[list[int]]
    chats: list[Chat]

    def predicted_rows(self, device) -> torch.Tensor:
        """Packed row indices whose next token is an assistant-turn token (their logits are trained)."""
        rows = [row for c in self.chats for row in range(c.offset + c.prompt - 1, c.offset + c.length - 1)]
        return torch.tensor(rows, dtype=torch.long, device=device)

    def draft_anchors(self, rng: random.Random, count: int, block_size: int) -> list[tuple[int, int]]:
        """(chat start, anchor) pairs with the anchor's next token and its whole block inside the turn."""
        candidates = [(c.offset, anchor) for c in self.chats
                      for anchor in range(c.offset + c.prompt - 1, c.offset + c.length - 1 - block_size)]  # fmt: skip
        return rng.sample(candidates, min(count, len(candidates)))


def batches(chats, settings: TrainSettings):
    """Endless batches of about ``batch_tokens`` tokens: whole chats, packed into sequences."""
    while True:
        sequences, placed, tokens, current = [], [], 0, []
        while tokens < settings.batch_tokens:
            prompt, completion = next(chats)
            length = len(prompt) + len(completion)
            if length > settings.sequence_tokens:
                continue
            if len(current) + length > settings.sequence_tokens:
                sequences.append(current)
                current = []
            placed.append(Chat(tokens, len(prompt), length))  # every sequence is packed after the last
            current = current + prompt + completion
            tokens += length
        sequences.append(current)
        yield Batch(sequences, placed)


def learning_rate(settings: TrainSettings, step: int) -> float:
    if step < settings.warmup_steps:
        return settings.learning_rate * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return settings.min_learning_rate + (settings.learning_rate - settings.min_learning_rate) * cosine


def _optimizer(model: DeepseekV41, settings: TrainSettings) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if p.requires_grad and not (p.dim() >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": other, "weight_decay": 0.0}]
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(groups, lr=settings.learning_rate, betas=(0.9, 0.95), fused=fused)


# ---- the run ------------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    directory: Path
    config: ModelConfigV41
    history: list[dict]  # one record per logged step
    seconds: float


def trainable_model(tokenizer: Tokenizer, settings: TrainSettings, device: str) -> DeepseekV41:
    """The run's initial model on ``device``: seeded weights, the real Engram hashing, the differentiable torch
    references, no trained-in rounding yet, and gradients on every weight but the selection-only biases."""
    config = model_config(tokenizer, settings.widths)
    model = randomize_v41_(DeepseekV41(config, ops=reference_table(device, torch.float32)), settings.seed).to(device)
    model.attach_engram_hasher(EngramHasher.from_tokenizer(tokenizer, **config.engram_hasher_options()))
    model.set_fake_quantization(False)
    model.train().requires_grad_(True)
    for name, parameter in model.named_parameters():
        if name.endswith(("gate.bias", "gate.bias_vl")):  # selection-only biases (no gradient reaches them)
            parameter.requires_grad_(False)
    return model


RESUME_FILE = "resume.pt"  # written when a run stops at its time limit: ``train(..., resume=True)`` continues it


def train(
    out_dir: str | Path,
    settings: TrainSettings,
    device: str = "cpu",
    log: Callable[[str], None] = print,
    resume: bool = False,
) -> TrainResult:
    """Train, export the checkpoint (with its tokenizer and ``training.json``) to ``out_dir``, and return.

    A run that stops at ``time_limit_s`` also writes ``out_dir/resume.pt`` (weights, optimizer, step, data
    position, random states); ``resume=True`` continues it from there with the same schedule and the same data
    the uninterrupted run would have seen (its own ``time_limit_s`` applies to the total time)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = torch.load(out_dir / RESUME_FILE, weights_only=False) if resume else None
    if state is not None:
        settings = replace(TrainSettings(**state["settings"]), time_limit_s=settings.time_limit_s)
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    model = _starting_model(out_dir, settings, device, log, resuming=state is not None)
    config = model.config
    optimizer = _optimizer(model, settings)
    rounding_from = int(settings.steps * (1 - settings.rounding_phase))
    step, history, spent, position = 0, [], 0.0, (0, 0)
    if state is not None:
        step, history, spent, position = state["step"], state["history"], state["seconds"], tuple(state["data"])
        if step > rounding_from:  # the saved weights are parametrized: round first, then load
            _start_rounding(model, config, step, log)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        log(f"resumed at step {step} of {settings.steps} after {spent:.0f} s")
    log(f"training {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {device} "
        f"for {settings.steps} steps of ~{settings.batch_tokens} tokens")  # fmt: skip
    chats = ChatStream(out_dir, settings.seed, settings.data_workers, position)
    data = batches(chats, settings)
    started = time.perf_counter() - spent
    while step < settings.steps:
        if step == rounding_from:
            _start_rounding(model, config, step, log)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(settings, step)
        record = _step(model, optimizer, next(data), settings, rng, device)
        elapsed = time.perf_counter() - started
        if step == 1:
            calibration_start = elapsed
        if settings.minutes is not None and step == settings.calibration_steps + 1:
            per_step = (elapsed - calibration_start) / settings.calibration_steps
            per_step *= 1 + 0.5 * settings.rounding_phase  # rounded steps cost more (about 1.5x)
            steps = max(step + 1, int((settings.minutes * 60 - elapsed) / per_step) + step + 1)
            settings = replace(settings, steps=steps)
            rounding_from = int(steps * (1 - settings.rounding_phase))
            log(f"{per_step:.3f} s per step: {steps} steps fit {settings.minutes} minutes")
        if step % settings.log_every == 0 or step == settings.steps - 1:
            record = {"step": step, "lr": learning_rate(settings, step), "seconds": round(elapsed, 1),
                      **{k: round(float(v), 4) for k, v in record.items()}}  # fmt: skip
            history.append(record)
            log(json.dumps(record))
        step += 1
        if step < settings.steps and settings.time_limit_s is not None and elapsed > settings.time_limit_s:
            torch.save({"settings": asdict(settings), "step": step, "history": history, "seconds": elapsed,
                        "data": chats.position, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "rng": rng.getstate(), "torch_rng": torch.get_rng_state()}, out_dir / RESUME_FILE)  # fmt: skip
            log(f"time limit reached before step {step}: exporting; {RESUME_FILE} continues the run")
            break
    chats.close()  # stops the rendering workers
    if step == settings.steps:
        (out_dir / RESUME_FILE).unlink(missing_ok=True)  # the run is complete: nothing to continue
    seconds = time.perf_counter() - started
    export(model, config, out_dir)
    (out_dir / "training.json").write_text(json.dumps(
        {"settings": asdict(settings), "device": device, "seconds": round(seconds, 1), "history": history},
        indent=1) + "\n")  # fmt: skip
    return TrainResult(out_dir, config, history, seconds)


def _starting_model(out_dir: Path, settings: TrainSettings, device: str, log, resuming: bool) -> DeepseekV41:
    """The run's model before its first step: from random weights with a new tokenizer, from ``init_from``'s
    weights and tokenizer, or (resuming) with the tokenizer already in ``out_dir``."""
    if not resuming and settings.init_from is not None:
        copy_tokenizer(Path(settings.init_from), out_dir)
    fresh = not resuming and settings.init_from is None
    tokenizer = build_tokenizer(out_dir, settings) if fresh else Tokenizer.from_dir(out_dir)
    model = trainable_model(tokenizer, settings, device)
    if not resuming and settings.init_from is not None:
        count = load_initial_weights(model, Path(settings.init_from))
        log(f"started from {settings.init_from} ({count} tensors)")
    return model


def _start_rounding(model: DeepseekV41, config: ModelConfigV41, step: int, log: Callable[[str], None]) -> None:
    model.quantizer = StraightThroughQuantizer()
    count = round_weights_straight_through(model, lambda name: storage_format_v41(name, config))
    log(f"step {step}: straight-through rounding on ({count} FP8 / FP4 weights, activations)")


def _step(model, optimizer, batch: Batch, settings: TrainSettings, rng: random.Random, device) -> dict:
    packed = PackedBatch.from_sequences(batch.sequences, device)
    draft = settings.draft_anchors > 0 and len(model.mtp) > 0
    streams, pre_mix, ctx = model.run_layers(packed, capture=draft)
    rows = batch.predicted_rows(device)
    hidden = model.final_hidden(streams, pre_mix)[rows]
    logits = model.head(hidden).float()
    loss = F.cross_entropy(logits, packed.input_ids[rows + 1])
    total, record = loss, {"loss": loss.detach()}
    if draft:
        targets = torch.cat([ctx.captured[i] for i in model.config.dspark_target_layer_ids], dim=-1)
        anchors = batch.draft_anchors(rng, settings.draft_anchors, model.config.dspark_block_size)
        if anchors:
            dloss, accepted = draft_loss(model, targets, packed.input_ids, anchors)
            total = total + settings.draft_weight * dloss
            record.update(draft_loss=dloss.detach(), draft_accepted=accepted)
    optimizer.zero_grad(set_to_none=True)
    total.backward()
    record["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return record


def export(model: DeepseekV41, config: ModelConfigV41, directory: Path) -> None:
    """The trained weights in release storage (the forward's own rounding rules), next to the tokenizer."""
    remove_weight_rounding(model)
    model.eval().requires_grad_(False)
    model.set_fake_quantization(True)
    model = model.to("cpu")
    write_checkpoint(quantize_like_checkpoint_v41(model), config, directory, num_shards=3)
