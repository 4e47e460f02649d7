"""The DSpark draft loss runs all anchors of a step as one batch; it must equal the blocks run one at a time."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from dsinfer.models.tiny_tokenizer import build_tiny_tokenizer
from dsinfer.tokenizer import Tokenizer
from dsinfer.training.draft_loss import draft_block_logits, draft_blocks_logits
from dsinfer.training.trainer import PRESETS, trainable_model


@pytest.mark.parametrize("rounding", [False, True])
def test_batched_draft_blocks_equal_the_blocks_run_one_by_one(tmp_path, rounding):
    build_tiny_tokenizer(tmp_path, vocab_size=512)
    settings = replace(PRESETS["toy"], seed=3)
    model = trainable_model(Tokenizer.from_dir(tmp_path), settings, "cpu")
    model.set_fake_quantization(rounding)
    window = model.config.sliding_window
    length = 3 * window
    ids = torch.randint(0, 500, (2 * length,), generator=torch.Generator().manual_seed(0))
    targets = torch.randn(2 * length, model.config.hidden_size * len(model.config.dspark_target_layer_ids))
    size = model.config.dspark_block_size
    # anchors at a sequence start, inside the first window, past it, and in the second packed sequence
    anchors = [(0, 0), (0, 3), (0, window - 1), (0, window + 7), (0, length - size - 2), (length, length),
               (length, length + 2 * window)]  # fmt: skip
    random.Random(0).shuffle(anchors)
    logits, features = draft_blocks_logits(model, targets, ids, anchors)
    assert logits.shape[:2] == (len(anchors), size)
    for row, (start, anchor) in enumerate(anchors):
        one_logits, one_features = draft_block_logits(model, targets, ids, start, anchor)
        torch.testing.assert_close(logits[row], one_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(features[row], one_features, rtol=1e-4, atol=1e-4)
