"""What ``hc_site_input`` returns: a site's input in two halves that need not run in order.

A site turns its input streams into the block's input (the collapse, with ``pre`` or a carried mix) and into the
weights ``pre``, ``post`` and Sinkhorn's ``comb``. Only the expand after the block reads ``post`` and ``comb``, and
Sinkhorn's twenty serial rounds are most of a decode site's time, so the block should not wait for them. The op
does the work the collapse reads (the mixes, for the site's own ``pre``) when it is called and hands back
:class:`SiteParts`:
:meth:`~SiteParts.collapse` gives the block input, :meth:`~SiteParts.weights` gives ``(pre, post, comb)``. Either
may be called first, and from another stream once that stream has waited for the one the op ran on
(:func:`dsinfer.ops.side_stream.beside` runs the weights beside the collapse and the block). Each half runs its
work once; a second call returns the same tensors.

The object holds every tensor its halves read (the streams, the mixes or their partial sums) until it is dropped:
a caller that runs a half on another stream keeps it until the streams have joined.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class SiteParts:
    """A site's two halves: ``collapse_work()`` -> the block input [..., D]; ``weights`` -> ``(pre, post, comb)``
    ([..., n], [..., n], [..., n, n], float32), as work to run or as tensors already made.

    The collapse never runs the weights' work: that may run on another stream, and a collapse reading its ``pre``
    there would race it. A backend whose collapse needs the site's own ``pre`` from the weights computes them when
    the op is called (on the op's stream) and hands them over made; only a collapse that needs nothing of them
    (its own ``pre`` computed again, or a carried mix) leaves them as work."""

    def __init__(self, collapse_work: Callable[[], torch.Tensor], weights: Callable[[], Weights] | Weights):
        self._collapse_work = collapse_work
        self._weights_work = weights if callable(weights) else None
        self._weights: Weights | None = None if callable(weights) else weights
        self._collapsed: torch.Tensor | None = None

    def collapse(self) -> torch.Tensor:
        if self._collapsed is None:
            self._collapsed = self._collapse_work()
        return self._collapsed

    @property
    def weights_pending(self) -> bool:
        """Whether the weights are still work to run (not yet made)."""
        return self._weights is None

    def weights(self) -> Weights:
        if self._weights is None:
            self._weights = self._weights_work()
        return self._weights

    def all(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(block input, pre, post, comb)``: both halves on the current stream."""
        return (self.collapse(), *self.weights())


def composed_parts(
    streams: torch.Tensor,
    carried_mix: torch.Tensor | None,
    weights: Callable[[], Weights],
    collapse: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> SiteParts:
    """The halves of a site made of separate ops on mixes already made: ``weights()`` (the weights op) and
    ``collapse(streams, mix)`` (the collapse op). With a carried mix the weights stay work; without, the collapse
    reads their ``pre``, so they are made now, on the current stream."""
    if carried_mix is None:
        made = weights()
        return SiteParts(lambda: collapse(streams, made[0]), made)
    return SiteParts(lambda: collapse(streams, carried_mix), weights)
