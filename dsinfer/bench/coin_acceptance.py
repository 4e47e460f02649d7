"""A benchmark device, never a serving feature: drafts accepted by a seeded coin instead of by the target.

Random weights draft badly (tau about 1), so a speculative step on a Flash-width slice would time verify steps
that accept nothing and roll everything back. To time the steps the official accounting assumes (each draft
accepted with probability ``rate``, 0.75 in DeepSeek's figures: tau = 1 + K * rate), this module replaces the
engine's judging with a coin: each of a sequence's drafts is heads with probability ``rate`` (a CPU generator
seeded once), the sequence accepts as many drafts as it threw heads, and the token after them is the next draft
(or the last one). The verify forward, snapshot, rollback and drafting all still run; only the verdict is
made up, and the emitted text is meaningless.

Only benchmark code calls :func:`accept_by_coin` (``dsinfer bench sweep --coin-acceptance``,
``benchmarks/spec_verify_step.py``); no engine, ``LLM`` or ``dsinfer serve`` option reaches it
(``tests/test_coin_acceptance.py`` holds that).
"""

from __future__ import annotations

import torch


class CoinJudge:
    """The stand-in verdicts: ``(accepted drafts, token after them)`` per sequence, from a seeded coin."""

    def __init__(self, rate: float, seed: int = 0) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"coin acceptance rate: expected 0 to 1, got {rate}")
        self.rate = rate
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, drafts: list[list[int]]) -> list[tuple[int, int]]:
        widest = max((len(d) for d in drafts), default=0)
        lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long)
        thrown = torch.arange(widest)[None, :] < lengths[:, None]  # one coin per draft
        heads = (torch.rand(len(drafts), widest, generator=self.generator) < self.rate) & thrown
        verdicts = []
        for d, accepted in zip(drafts, heads.sum(dim=1).tolist(), strict=True):
            after = d[accepted] if accepted < len(d) else (d[-1] if d else 0)
            verdicts.append((accepted, after))
        return verdicts


def accept_by_coin(engine, rate: float, seed: int = 0) -> CoinJudge:
    """Make ``engine``'s speculative steps accept drafts by a seeded coin (see the module docstring); returns
    the judge. Raises ``ValueError`` when the engine does not speculate."""
    executor = engine.worker.speculative
    if executor is None:
        raise ValueError("coin acceptance: the engine runs no speculative decoding (give it a speculative config)")
    judge = CoinJudge(rate, seed)
    executor.judge_override = judge
    return judge
