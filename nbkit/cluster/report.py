"""What a warmup and a build did: :class:`WarmupReport` (``warmup()``) and :class:`BuildReport`
(:func:`nbkit.cluster.run`, a warmup report with what its parts did).

Example:
    >>> print(WarmupReport(computed=90, skipped=10, total=100, seconds=2.0, stopped=False))
    warmup done: 90 computed, 10 already cached, 100 in all, 2.0s (45 samples/s)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

__all__ = ["WarmupReport", "BuildReport"]


@dataclass(frozen=True)
class WarmupReport:
    """What one ``warmup()`` call did.

    Attributes:
        computed: samples computed and stored by this call.
        skipped: samples already stored when it started (in its shard).
        total: samples in its shard.
        seconds: wall time.
        stopped: ``True`` if it stopped early because the callback asked it to.
    """

    computed: int
    skipped: int
    total: int
    seconds: float
    stopped: bool
    what: ClassVar[str] = "warmup"  # what __str__ calls the operation

    @property
    def rate(self) -> float:
        """Samples computed a second."""
        return self.computed / self.seconds if self.seconds > 0 else 0.0

    def counts(self) -> str:
        """What was done, in words (the middle of :meth:`__str__`)."""
        return f"{self.computed} computed, {self.skipped} already cached, {self.total} in all"

    def __str__(self) -> str:
        state = "stopped" if self.stopped else "done"
        return f"{self.what} {state}: {self.counts()}, {self.seconds:.1f}s ({self.rate:,.0f} samples/s)"


@dataclass(frozen=True)
class BuildReport(WarmupReport):
    """What one :func:`run` did: a :class:`~nbkit.cluster.report.WarmupReport` (``computed``,
    ``skipped``, ``total``, ``seconds``, ``stopped``, ``rate``) and what the parts did.

    Attributes:
        reused: samples merged from parts an earlier run left (not computed again).
        parts: parts merged (built now or left before).
        refused: parts refused (damaged, another schema…) and planned again.
        retried: part builds submitted again after a lost worker.
    """

    reused: int = 0
    parts: int = 0
    refused: int = 0
    retried: int = 0
    what: ClassVar[str] = "build"

    def counts(self) -> str:
        return (f"{self.computed} computed, {self.reused} merged from earlier parts, {self.skipped} already cached, "
                f"{self.total} in all; {self.parts} parts merged, {self.refused} refused, {self.retried} retried")
