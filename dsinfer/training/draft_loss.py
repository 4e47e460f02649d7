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

__all__ = ["draft_block_logits", "draft_loss"]


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


def draft_loss(
    model, targets: torch.Tensor, ids: torch.Tensor, anchors: list[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean draft cross-entropy (+ confidence BCE) over ``anchors`` (sequence start, anchor index p), and
    the mean number of leading greedy-correct drafts per block (a device scalar).

    ``targets`` [T, targets * hidden] are the captured target hiddens of the packed batch (positions
    restart at each sequence start), ``ids`` [T] its tokens; every anchor has ``block_size + 1`` tokens
    after it inside its sequence.
    """
    size = model.config.dspark_block_size
    losses, confidence_losses, accepted = [], [], []
    for start, anchor in anchors:
        logits, features = draft_block_logits(model, targets, ids, start, anchor)
        labels = ids[anchor + 2 : anchor + 2 + size]
        losses.append(F.cross_entropy(logits, labels, reduction="sum"))
        right = (logits.argmax(dim=-1) == labels).long().cumprod(dim=0).float()
        confidence_weight = model.mtp[-1].confidence_head.proj.weight.float()
        confidence = F.linear(features, confidence_weight)[:, 0]
        confidence_losses.append(F.binary_cross_entropy_with_logits(confidence, right, reduction="sum"))
        accepted.append(right.sum())
    counted = size * len(anchors)
    loss = (torch.stack(losses).sum() + 0.1 * torch.stack(confidence_losses).sum()) / counted
    return loss, torch.stack(accepted).mean()
