"""The DSpark draft stages' training loss, through the stages' own inference modules.

At an anchor ``p`` the target has run positions ``<= p`` (their captured hiddens fill the rings) and has just
produced token ``x[p + 1]``. The draft block is ``[x[p + 1], noise, ...]`` at positions ``p + 1 ..``; column
``i`` must predict ``x[p + 2 + i]``. As in :func:`dsinfer.models.dspark.draft_block`, column ``i`` adds the
Markov head's bias of the previous token; in training that is the true previous token (teacher forcing).
The confidence head learns whether the draft is still right at column ``i`` (every column up to ``i``
greedy-correct), which is what decides how many drafts are worth verifying.

The captured target hiddens are detached: the draft learns to read the target, never the other way round.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.layers.mhc import collapse_streams

__all__ = ["draft_block_logits", "draft_blocks_logits", "draft_loss"]


def draft_block_logits(
    model, targets: torch.Tensor, ids: torch.Tensor, start: int, anchor: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft block's logits [block, vocab] at ``anchor`` (Markov bias of the true previous tokens) and the
    confidence head's input features [block, hidden + markov rank], in float32.

    Column ``i`` predicts ``ids[anchor + 2 + i]``; while every earlier column is right, the true previous
    token is the one an inference draft would have fed, so leading greedy-correct columns count exactly the
    drafts a greedy verifier accepts."""
    cfg = model.config
    size, window = cfg.dspark_block_size, cfg.sliding_window
    first_stage, last_stage = model.mtp[0], model.mtp[-1]
    device = ids.device
    seen = torch.arange(max(start, anchor - window + 1), anchor + 1, device=device)
    main = first_stage.main_norm(first_stage.main_proj(targets[seen].detach()))
    block_ids = torch.cat([ids[anchor + 1 : anchor + 2], ids.new_full((size - 1,), cfg.dspark_noise_token_id)])
    positions = torch.arange(anchor + 1 - start, anchor + 1 - start + size, device=device)
    streams, pre_mix = model.embed_streams(block_ids)
    for stage in model.mtp:
        ring = stage.attn.keys(main, seen - start, model.rope.window, model.quantizer)
        streams, pre_mix = stage(streams, pre_mix, positions, ring, model.rope.window, model.quantizer)
    hidden = collapse_streams(streams, pre_mix)
    markov = last_stage.markov_head.embed(ids[anchor + 1 : anchor + 1 + size])
    logits = model.head(last_stage.norm(hidden)).float() + last_stage.markov_head.head(markov).float()
    return logits, torch.cat([hidden.float(), markov.float()], dim=-1)


def draft_blocks_logits(
    model, targets: torch.Tensor, ids: torch.Tensor, anchors: list[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`draft_block_logits` of every anchor in one pass: logits [A, block, vocab] and features
    [A, block, hidden + markov rank]. Each block sees its own ring (the window of target positions up to its
    anchor, padded to the window and masked) through the stages' batched attention."""
    cfg = model.config
    size, window = cfg.dspark_block_size, cfg.sliding_window
    first_stage, last_stage = model.mtp[0], model.mtp[-1]
    device = ids.device
    starts = torch.tensor([start for start, _ in anchors], device=device)
    ends = torch.tensor([anchor for _, anchor in anchors], device=device)
    slots = ends[:, None] - window + 1 + torch.arange(window, device=device)  # [A, window], last = the anchor
    visible = slots >= torch.maximum(starts, ends - window + 1)[:, None]
    seen = torch.where(visible, slots, ends[:, None])  # hidden slots read the anchor's row (masked out)
    main = first_stage.main_norm(first_stage.main_proj(targets[seen.flatten()].detach()))
    next_ids = ids[ends + 1]
    block_ids = torch.cat([next_ids[:, None], next_ids.new_full((len(anchors), size - 1), cfg.dspark_noise_token_id)],
                          dim=1)  # fmt: skip
    positions = (ends + 1 - starts)[:, None] + torch.arange(size, device=device)
    streams, pre_mix = model.embed_streams(block_ids.flatten())
    ring_positions = (seen - starts[:, None]).flatten()
    for stage in model.mtp:
        ring = stage.attn.keys(main, ring_positions, model.rope.window, model.quantizer).view(len(anchors), window, -1)
        streams, pre_mix = stage(streams, pre_mix, positions.flatten(), ring, model.rope.window, model.quantizer,
                                 ring_visible=visible)  # fmt: skip
    hidden = collapse_streams(streams, pre_mix)
    markov = last_stage.markov_head.embed(ids[(ends + 1)[:, None] + torch.arange(size, device=device)].flatten())
    logits = model.head(last_stage.norm(hidden)).float() + last_stage.markov_head.head(markov).float()
    features = torch.cat([hidden.float(), markov.float()], dim=-1)
    return logits.view(len(anchors), size, -1), features.view(len(anchors), size, -1)


def draft_loss(
    model, targets: torch.Tensor, ids: torch.Tensor, anchors: list[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean draft cross-entropy (+ confidence BCE) over ``anchors`` (sequence start, anchor index p), and
    the mean number of leading greedy-correct drafts per block (a device scalar).

    ``targets`` [T, targets * hidden] are the captured target hiddens of the packed batch (positions
    restart at each sequence start), ``ids`` [T] its tokens; every anchor has ``block_size + 1`` tokens
    after it inside its sequence. All anchors run as one batch (:func:`draft_blocks_logits`).
    """
    size = model.config.dspark_block_size
    logits, features = draft_blocks_logits(model, targets, ids, anchors)
    columns = torch.arange(size, device=ids.device)
    labels = ids[torch.tensor([anchor + 2 for _, anchor in anchors], device=ids.device)[:, None] + columns]
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    right = (logits.argmax(dim=-1) == labels).long().cumprod(dim=1).float()
    confidence_weight = model.mtp[-1].confidence_head.proj.weight.float()
    confidence = F.linear(features, confidence_weight)[..., 0]
    confidence_losses = F.binary_cross_entropy_with_logits(confidence, right, reduction="sum")
    loss = (losses + 0.1 * confidence_losses) / (size * len(anchors))
    return loss, right.sum(dim=1).mean()
