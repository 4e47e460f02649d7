"""Imported once by the process that forks the ranks (multiprocessing's fork server), so each rank starts with
torch, the model code and torch's lazily imported meta-device kernels already loaded (seconds per rank)."""

import torch

import dsinfer.parallel.rank_main  # noqa: F401  (the model, loader, engine and ops)

with torch.device("meta"):
    torch.nn.Embedding(2, 2)  # building a model on the meta device imports torch._refs and friends
