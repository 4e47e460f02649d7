"""The Engram layer of DeepSeek-V4.1: table rows in, a gated write into the residual streams out.

Row ids come from :class:`dsinfer.engram.hashing.EngramHasher` (computed once per forward for every
Engram layer). At each position the layer reads its ``(max_ngram_size - 1) * n_heads`` rows (24 x 256 in
the release), concatenates them and projects them with ``wkv`` into one key per residual stream plus one
value shared by the streams. Each stream gets the value scaled by a gate

    gate = sigmoid(signed_sqrt(sum(h * q_weight * k_weight * key) * rstd(h) * rstd(key) / sqrt(hidden)))

where ``rstd`` normalises each (token, stream) over the hidden axis separately and the signed square root
keeps the sign of the dot product with a magnitude floor of 1e-6 (Hugging Face ``DeepseekV41Engram``).
The layer runs before the block it belongs to, so that block's mHC weights already see its output.

The layer takes its rows already dequantised: the model reads them through a fetcher (``start`` with
every layer's ids at the beginning of a forward, ``wait`` right before each layer), so where the tables
live is the fetcher's business. Two homes exist:

* **in the model** (the ``device`` placement): :class:`EngramTable` holds the table as stored (FP8 e4m3
  rows with one ue8m0 scale per 32 channels, or plain floats with unit scales) and
  :class:`EngramTableFetcher` reads it with the fetcher interface, dequantising on lookup;
* **outside it** (``host``: one shared-memory segment per host; ``sharded``: a slice per rank): the
  layer has no table (``embed`` is ``None``) and the model reads through a
  :class:`dsinfer.engram.fetch.EngramFetcher` (:mod:`dsinfer.engram.placement` builds it at load time).

Dequantisation is exact (an e4m3 value times a power of two) in both, so the logits are bit-identical
whichever placement serves the rows.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from dsinfer.config import FP8_SCALE_BLOCK, ModelConfigV41
from dsinfer.ops.engram_gate import engram_gate_reference
from dsinfer.ops.registry import OpTable


class EngramTable(nn.Module):
    """One layer's n-gram table: ``weight`` [rows, dim] (FP8 or float) and ``scale`` [rows, dim / 32]."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.zeros(rows, dim))
        self.register_buffer("scale", torch.ones(rows, dim // FP8_SCALE_BLOCK, dtype=torch.float32))

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Dequantised rows [..., dim] in float32."""
        values = self.weight[row_ids].float()
        scales = self.scale[row_ids].float()
        return (values.unflatten(-1, (-1, FP8_SCALE_BLOCK)) * scales.unsqueeze(-1)).flatten(-2)


class EngramTableFetcher:
    """The fetcher interface (``start`` / ``wait`` / ``fetch``) over tables that the model's own layers hold.

    What a model without an external fetcher reads through, so that its forward has one path whatever
    the placement. The lookups are device-local, so :meth:`start` only records the ids and :meth:`wait`
    looks the rows up: nothing is gained by computing them early, and memory is held only for the layer
    about to run. Rows come back in float32, exactly as :meth:`EngramTable.forward` dequantises them.
    """

    placement = "device"

    def __init__(self, tables: Mapping[int, EngramTable]) -> None:
        if not tables:
            raise ValueError("an Engram table fetcher needs at least one table")
        self.tables = dict(tables)
        self._pending: dict[int, torch.Tensor] = {}

    @property
    def layer_ids(self) -> list[int]:
        return sorted(self.tables)

    def rows(self, layer_id: int) -> int:
        """Rows of ``layer_id``'s table."""
        return self._table(layer_id).weight.shape[0]

    def fetch(self, row_ids: torch.Tensor, layer_id: int) -> torch.Tensor:
        """``[*row_ids.shape, dim]`` float32 rows of ``layer_id``'s table, looked up now."""
        return self._table(layer_id)(row_ids)

    def start(self, row_ids_per_layer: Mapping[int, torch.Tensor]) -> None:
        """Remember each layer's ids for :meth:`wait`; a layer started again replaces its earlier ids."""
        for layer_id in row_ids_per_layer:
            self._table(layer_id)
        self._pending.update(row_ids_per_layer)

    def wait(self, layer_id: int) -> torch.Tensor:
        """The rows of the ids :meth:`start` recorded for ``layer_id``."""
        if layer_id not in self._pending:
            raise KeyError(f"no Engram rows requested for layer {layer_id}: call start() first")
        return self.fetch(self._pending.pop(layer_id), layer_id)

    def replays_in_graphs(self, max_ids: int) -> bool:
        """Always: the lookups are device-local tensor indexing."""
        return True

    def close(self) -> None:
        """Drop pending requests; the tables belong to the model and stay."""
        self._pending.clear()

    def _table(self, layer_id: int) -> EngramTable:
        if layer_id not in self.tables:
            raise KeyError(f"no Engram table for layer {layer_id} (tables: {self.layer_ids})")
        return self.tables[layer_id]


class Engram(nn.Module):
    """One Engram layer: ``wkv`` and the gate weights, plus its table (``embed``) unless the table lives outside."""

    def __init__(self, config: ModelConfigV41, layer_id: int) -> None:
        super().__init__()
        index = config.engram_layer_ids.index(layer_id)
        self.hidden_size, self.hc_mult, self.eps = config.hidden_size, config.hc_mult, config.rms_norm_eps
        self.embed: EngramTable | None = EngramTable(config.engram_num_embeddings[index], config.engram_head_dim)
        self.wkv = nn.Linear(
            config.engram_columns * config.engram_head_dim, config.hidden_size * (config.hc_mult + 1), bias=False
        )
        self.q_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size))
        self.k_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size))
        self.ops: OpTable | None = None  # bound by the model (bind_ops); None: the gate's torch reference

    def forward(self, streams: torch.Tensor, rows: torch.Tensor, gate_mask: torch.Tensor | None) -> torch.Tensor:
        """streams [T, hc, hidden]; ``rows`` [T, columns, dim] dequantised table rows (from a fetcher);
        ``gate_mask`` [T] False shuts the gate (image tokens)."""
        rows = rows.flatten(-2).to(self.wkv.weight.dtype)
        key, value = self.wkv(rows).split([self.hc_mult * self.hidden_size, self.hidden_size], dim=-1)
        key = key.unflatten(-1, (self.hc_mult, self.hidden_size))
        weight = self.q_weight.float() * self.k_weight.float()  # the checkpoint keeps both; only the product matters
        gate = self.ops.engram_gate if self.ops is not None else engram_gate_reference
        return gate(streams, key, value, weight, gate_mask, self.eps)
