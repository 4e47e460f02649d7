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
from dsinfer.ops.engram_gate import EngramGateInputs
from dsinfer.ops.registry import OpTable, reference_table

# The float dtypes that hold every value of a table's stored dtype exactly (its rows convert without rounding).
_HOLDS_EXACTLY = {
    torch.float8_e4m3fn: (torch.bfloat16, torch.float16, torch.float32),
    torch.float8_e5m2: (torch.bfloat16, torch.float16, torch.float32),
    torch.bfloat16: (torch.bfloat16, torch.float32),
    torch.float16: (torch.float16, torch.float32),
    torch.float32: (torch.float32,),
}


class EngramTable(nn.Module):
    """One layer's n-gram table: ``weight`` [rows, dim] (FP8 or float) and ``scale`` [rows, dim / 32]."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.zeros(rows, dim))
        self.register_buffer("scale", torch.ones(rows, dim // FP8_SCALE_BLOCK, dtype=torch.float32))

    def forward(self, row_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantised rows [..., dim] in ``dtype``: each product ``value * scale`` in float32, rounded once to
        ``dtype``. Where ``dtype`` holds every stored value exactly (FP8 in bf16, say), the gathered values are
        converted straight to it and scaled in place; otherwise the rows are scaled in float32 and converted
        after. Either way the numbers are those of the float32 rows converted to ``dtype``."""
        values = self.weight[row_ids]
        work = dtype if dtype in _HOLDS_EXACTLY.get(values.dtype, ()) else torch.float32
        if values.dtype != work:
            values = values.to(work)
        scales = self.scale[row_ids]
        if scales.dtype != torch.float32:
            scales = scales.float()
        values.unflatten(-1, (-1, FP8_SCALE_BLOCK)).mul_(scales.unsqueeze(-1))  # computed in float32 (the scales')
        return values if work == dtype else values.to(dtype)


class EngramTableFetcher:
    """The fetcher interface (``start`` / ``wait`` / ``fetch``) over tables that the model's own layers hold.

    What a model without an external fetcher reads through, so that its forward has one path whatever
    the placement. The lookups are device-local, so :meth:`start` only records the ids and :meth:`wait`
    looks the rows up: nothing is gained by computing them early, and memory is held only for the layer
    about to run. Rows come back in ``out_dtype`` (the model gives its Engram GEMM's dtype, so the layer converts
    nothing), exactly as :meth:`EngramTable.forward` dequantises them.
    """

    placement = "device"

    def __init__(self, tables: Mapping[int, EngramTable], out_dtype: torch.dtype = torch.float32) -> None:
        if not tables:
            raise ValueError("an Engram table fetcher needs at least one table")
        self.tables = dict(tables)
        self.out_dtype = out_dtype
        self._pending: dict[int, torch.Tensor] = {}

    @property
    def layer_ids(self) -> list[int]:
        return sorted(self.tables)

    def rows(self, layer_id: int) -> int:
        """Rows of ``layer_id``'s table."""
        return self._table(layer_id).weight.shape[0]

    def fetch(self, row_ids: torch.Tensor, layer_id: int) -> torch.Tensor:
        """``[*row_ids.shape, dim]`` rows (``out_dtype``) of ``layer_id``'s table, looked up now."""
        return self._table(layer_id)(row_ids, self.out_dtype)

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
    """One Engram layer: ``wkv`` and the gate weights, plus its table (``embed``) unless the table lives outside.

    The gate reads only the product ``q_weight * k_weight`` (float32). Inference computes it once
    (:meth:`join_projections`, which the loaders call) instead of at every step; see :meth:`gate_weight`.
    """

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
        self.ops: OpTable = reference_table("cpu", torch.float32)  # the model binds its table when it is built
        # Inference: (what the product was computed from, the product) -- see gate_weight.
        self._gate_weight: tuple[tuple, torch.Tensor] | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of ``wkv``'s GEMM, which the rows are converted to (an FP8 linear kept as stored names it:
        reading its ``weight`` would dequantise the whole matrix)."""
        dtype = getattr(self.wkv, "compute_dtype", None)
        return dtype if dtype is not None else self.wkv.weight.dtype

    def join_projections(self) -> None:
        """Inference: compute the gate's weight product now, with the weights (see :meth:`gate_weight`)."""
        self._gate_weight = None
        self.gate_weight()

    def gate_weight(self) -> torch.Tensor:
        """``q_weight * k_weight`` in float32 [hc, hidden] (the checkpoint keeps both; only the product matters).

        Under autograd with either weight trainable it is computed afresh, so gradients reach both. Otherwise the
        product that :meth:`join_projections` kept is reused while both weights are the tensors it was computed
        from (same memory, dtype and in-place version); weights that changed give a new product, kept in turn
        (except while a CUDA graph is being captured, whose outputs only exist at replay). Weights made under
        inference mode count no versions: their product is computed at every call.
        """
        q, k = self.q_weight, self.k_weight
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            return q.float() * k.float()
        key = None if q.is_inference() or k.is_inference() else tuple(_identity(w) for w in (q, k))
        kept = self._gate_weight
        if key is not None and kept is not None and kept[0] == key:
            return kept[1]
        with torch.no_grad():
            product = q.float() * k.float()
        if key is not None and not _capturing(q.device):
            self._gate_weight = (key, product)
        return product

    def forward(self, streams: torch.Tensor, rows: torch.Tensor, gate_mask: torch.Tensor | None) -> torch.Tensor:
        """streams [T, hc, hidden]; ``rows`` [T, columns, dim] dequantised table rows (from a fetcher; converted
        to :attr:`compute_dtype` unless already in it); ``gate_mask`` [T] False shuts the gate (image tokens)."""
        rows = rows.flatten(-2)
        dtype = self.compute_dtype
        if rows.dtype != dtype:
            rows = rows.to(dtype)
        key, value = self.wkv(rows).split([self.hc_mult * self.hidden_size, self.hidden_size], dim=-1)
        key = key.unflatten(-1, (self.hc_mult, self.hidden_size))
        return self.ops.engram_gate(EngramGateInputs(streams, key, value, self.gate_weight(), gate_mask, self.eps))


def _identity(weight: torch.Tensor) -> tuple:
    """What tells a weight's values apart without reading them: its memory, layout and in-place version."""
    return (weight.device, weight.dtype, weight.data_ptr(), tuple(weight.shape), weight._version)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
