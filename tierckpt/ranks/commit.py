"""The global commit of a step on a tier: the one keyed gather that ties every rank's copy together.

After a rank's copy of a step is durable on a tier (its ``TierWriter.commit``), the rank executor
(:class:`~tierckpt.background.executor.RankExecutor`) publishes it:

* one rank alone: the rank writes the step's record itself;
* several ranks: the rank sends its manifest's tag (:func:`~tierckpt.format.record.manifest_tag`; None
  when its copy failed) to ``coordinator.gather("commit/<tier>/<step>/<n>", ...)``, one small message
  (:meth:`Commits.gather`); rank 0, once every rank's tag is in, decides
  (:func:`~tierckpt.policies.protocol.decide_commit`) and, on a shared tier, writes the record there
  before any rank learns the outcome (so that the step is listed on every rank once ``wait()`` returns);
  on a node-local tier every rank writes the record it received (the same bytes: the ranks of one node
  share the directory, and the write is an atomic replace).

What a failure leaves, and who removes it, is the protocol's rule
(:func:`~tierckpt.policies.protocol.failed_commit_actions`): a known failure (a rank's copy failed, a
rank did not answer within the coordinator's timeout) removes the step's record and every rank's copy,
so the step is never listed and nothing of it stays behind; an unknown outcome (rank 0 took the decision
up but published nothing in time: it died or hung while deciding, perhaps after writing the record)
keeps the copies, since the step may be committed. The save's ``durable[tier]`` future carries the
error (naming the ranks), the training goes on and the next save commits normally.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from tierckpt.ranks.coordinator import Coordinator

__all__ = ["Commits", "DecisionKeys"]


class DecisionKeys:
    """Names for keyed decisions (``Coordinator.gather`` / ``decide``), unique in the job: the n-th
    decision of one kind about one thing (``commit/ssd/100/2``: the second commit of step 100 on tier
    ``ssd``, the step having been saved again). Every rank makes the same decisions, so every rank
    counts the same n."""

    def __init__(self) -> None:
        self._count: Counter[str] = Counter()
        self._lock = threading.Lock()

    def count(self, *parts: object) -> int:
        """How many decisions about ``parts`` were named so far."""
        with self._lock:
            return self._count["/".join(str(p) for p in parts)]

    def next(self, *parts: object) -> str:
        """The name of the next decision about ``parts``."""
        base = "/".join(str(p) for p in parts)
        with self._lock:
            self._count[base] += 1
            return f"{base}/{self._count[base]}"


class Commits:
    """The commits' gathers of one rank (see the module docstring).

    Args:
        coordinator: how the ranks agree (its ``gather``).
        keys: the hierarchy's decision names.
    """

    def __init__(self, coordinator: Coordinator, keys: DecisionKeys) -> None:
        self.coordinator = coordinator
        self.keys = keys

    def gather(
        self, tier: str, step: int, tag: int | None, decide: Callable[[list[int | None]], dict[str, Any]]
    ) -> dict[str, Any]:
        """Send this rank's report of its copy of ``step`` on ``tier`` (``tag``: its manifest's tag, None
        when it failed) in the commit's one gather; rank 0 runs ``decide`` on every rank's report (it
        raises for a failed commit), and every rank returns its result.

        Raises:
            CoordinationError: a rank did not answer in time (``undecided`` when rank 0 took the
                decision up and published nothing), or rank 0's decision failed (carrying its message).
        """
        return self.coordinator.gather(self.keys.next("commit", tier, step), tag, decide)
