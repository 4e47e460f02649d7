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
    """A site's two halves: ``collapse_work()`` -> the block input [..., D]; ``weights_work()`` -> ``(pre, post,
    comb)`` ([..., n], [..., n], [..., n, n], float32). ``collapse_work`` may call :meth:`weights` (a collapse
    with the site's own ``pre``, where the backend does not compute it again)."""

    def __init__(self, collapse_work: Callable[[SiteParts], torch.Tensor], weights_work: Callable[[], Weights]):
        self._collapse_work, self._weights_work = collapse_work, weights_work
        self._collapsed: torch.Tensor | None = None
        self._weights: Weights | None = None

    def collapse(self) -> torch.Tensor:
        if self._collapsed is None:
            self._collapsed = self._collapse_work(self)
        return self._collapsed

    def weights(self) -> Weights:
        if self._weights is None:
            self._weights = self._weights_work()
        return self._weights

    def all(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(block input, pre, post, comb)``: both halves on the current stream."""
        return (self.collapse(), *self.weights())
