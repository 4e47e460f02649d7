"""How often each layer routed to each expert: counted on the device from the router's choices, kept in a small
JSON file across restarts, and read to choose which experts stay on the GPU.

The counts accumulate with one ``index_add_`` per layer and step, on the device that routed (no host read, so
a captured decode step can count too). They are read on the host only between steps, when the resident sets are
re-balanced and the file is written. A checkpoint's first run has no file: :meth:`ExpertStats.even_resident`
spreads each layer's resident experts evenly over the expert ids.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

STATS_FORMAT = "dsinfer expert routing counts"


class ExpertStatsError(ValueError):
    """An ``--expert-stats`` file that does not describe this model's experts; the message names the field."""


class ExpertStats:
    """Routing counts ``[layers, experts]`` of the offloaded layers (``layer_ids`` their model layer ids)."""

    def __init__(self, layer_ids: list[int], n_experts: int, device: torch.device | str) -> None:
        self.layer_ids, self.n_experts = list(layer_ids), n_experts
        self.counts = torch.zeros(len(self.layer_ids), n_experts, dtype=torch.int64, device=device)
        self.observed = False  # any counts at all (from a file or from traffic)
        self._host_counts: list[list[int]] | None = None  # the counts as of the last snapshot

    def record(self, row: int, expert_ids: torch.Tensor) -> None:
        """Count one step's choices of the layer at ``row`` (device-side)."""
        flat = expert_ids.reshape(-1)
        self.counting(row).index_add_(0, flat, torch.ones_like(flat))

    def counting(self, row: int) -> torch.Tensor:
        """The counts ``[experts]`` of the layer at ``row``, for an op that adds this step's choices to them."""
        self.observed = True
        return self.counts[row]

    def resident(self, row: int, count: int) -> list[int]:
        """The ``count`` most-routed experts of the layer at ``row`` (ties: lower ids), sorted; before any
        traffic, an even spread over the ids."""
        if not self.observed:
            return self.even_resident(count)
        return sorted(self.ranked(row)[:count])

    def ranked(self, row: int) -> list[int]:
        """Every expert of the layer at ``row``, most routed first (ties: lower ids), as of the last snapshot."""
        if self._host_counts is None:
            self.snapshot()
        return sorted(range(self.n_experts), key=lambda e: (-self._host_counts[row][e], e))

    def snapshot(self) -> None:
        """Read the counts to the host (between steps): what :meth:`resident` and :meth:`save` then use."""
        self._host_counts = self.counts.tolist()

    def even_resident(self, count: int) -> list[int]:
        return [index * self.n_experts // count for index in range(count)] if count else []

    def save(self, path: str | Path) -> None:
        """Write the counts (atomically: a crash leaves the previous file)."""
        self.snapshot()
        layers = {str(layer): row for layer, row in zip(self.layer_ids, self._host_counts, strict=True)}
        body = {"format": STATS_FORMAT, "n_routed_experts": self.n_experts, "layers": layers}
        path = Path(path)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(json.dumps(body))
        os.replace(temporary, path)

    def load(self, path: str | Path) -> bool:
        """Add the counts of ``path`` (False when there is no file yet: a first run)."""
        path = Path(path)
        if not path.exists():
            return False
        try:
            body = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ExpertStatsError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(body, dict) or body.get("format") != STATS_FORMAT:
            raise ExpertStatsError(f"{path}: field 'format': expected {STATS_FORMAT!r}")
        if body.get("n_routed_experts") != self.n_experts:
            raise ExpertStatsError(f"{path}: field 'n_routed_experts': {body.get('n_routed_experts')!r}, but the "
                                   f"model has {self.n_experts} routed experts per layer")  # fmt: skip
        layers = body.get("layers")
        if not isinstance(layers, dict) or sorted(layers) != sorted(str(i) for i in self.layer_ids):
            raise ExpertStatsError(f"{path}: field 'layers': expected counts of layers {self.layer_ids}")
        for row, layer in enumerate(self.layer_ids):
            counts = layers[str(layer)]
            if not isinstance(counts, list) or len(counts) != self.n_experts or not all(
                isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts
            ):  # fmt: skip
                raise ExpertStatsError(f"{path}: field 'layers.{layer}': expected {self.n_experts} counts >= 0")
            self.counts[row] += torch.tensor(counts, dtype=torch.int64, device=self.counts.device)
        self.observed = True
        self.snapshot()
        return True
