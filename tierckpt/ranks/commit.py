"""The global commit of a step on a tier: its commit record, published once every rank's copy is in.

After a rank's copy of a step is durable on a tier (its ``TierWriter.commit``), the tier's worker calls
:meth:`Commits.publish`:

* one rank alone: the rank writes the step's record itself;
* several ranks: the rank sends its manifest's tag (:func:`~tierckpt.format.record.manifest_tag`; None
  when its copy failed) to ``coordinator.gather("commit/<tier>/<step>/<n>", ...)``, one small message;
  rank 0, once every rank's tag is in, builds the record and, on a shared tier, writes it there before
  any rank learns the outcome (so that the step is listed on every rank once ``wait()`` returns); on a
  node-local tier every rank writes the record it received (the same bytes: the ranks of one node
  share the directory, and the write is an atomic replace).

Failure (a rank's copy failed, a rank did not answer within the coordinator's timeout): every rank
raises, evicts its own copy of the step from that tier and removes the step's record there, so the
step is never listed and nothing of it stays behind; the save's ``durable[tier]`` future carries the
error (naming the ranks), the training goes on and the next save commits normally.

An unknown outcome (rank 0 took the decision up but published nothing in time: it died or hung while
deciding, perhaps after writing the record): the other ranks raise, naming rank 0, but keep their
copies, since the step may be committed (a record naming evicted copies would list a step some ranks
cannot read). A copy whose record never comes is an orphan: retention removes it
(``Catalog.orphans``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from tierckpt.errors import CoordinationError, TierckptError
from tierckpt.format.record import CommitRecord, encode_record, manifest_tag
from tierckpt.ranks.coordinator import Coordinator
from tierckpt.tiers.base import CheckpointKey, Tier

__all__ = ["Commits", "DecisionKeys"]

log = logging.getLogger(__name__)


class DecisionKeys:
    """Names for keyed decisions (``Coordinator.gather`` / ``decide``), unique in the job: the n-th
    decision of one kind about one thing (``commit/ssd/100/2``: the second commit of step 100 on tier
    ``ssd``, the step having been saved again). Every rank makes the same decisions, so every rank
    counts the same n."""

    def __init__(self) -> None:
        self._count: Counter[str] = Counter()
        self._lock = threading.Lock()

    def next(self, *parts: object) -> str:
        """The name of the next decision about ``parts``."""
        base = "/".join(str(p) for p in parts)
        with self._lock:
            self._count[base] += 1
            return f"{base}/{self._count[base]}"


class Commits:
    """Publishes the commit records of one rank's copies (see the module docstring).

    Args:
        coordinator: how the ranks agree (its ``gather``).
        keys: the hierarchy's decision names.
    """

    def __init__(self, coordinator: Coordinator, keys: DecisionKeys) -> None:
        self.coordinator = coordinator
        self.keys = keys

    def publish(
        self, tier: Tier, key: CheckpointKey, manifest: bytes, then: Callable[[], list[tuple[str, int]]]
    ) -> list[tuple[str, int]] | None:
        """Publish ``key``'s copy, committed on ``tier``, once every rank's copy is (see the module
        docstring); on failure, remove this rank's copy and the step's record there, then raise.

        In a job of several ranks, rank 0 also runs ``then()`` once the record is written (its decision
        of what to evict from shared tiers) and every rank returns its result: the commit's one gather
        carries it; None for a rank alone (it decides alone)."""
        if self.coordinator.world_size == 1:
            tier.write_record(key.step, encode_record(CommitRecord(key.step, 1, (manifest_tag(manifest),))))
            return None
        try:
            return self._gather(tier, key.step, manifest_tag(manifest), then)
        except CoordinationError as e:
            if not e.undecided:
                self._undo(tier, key)
            else:  # rank 0 may have written the record: the copy stays (an orphan if no record comes)
                log.warning("step %d on tier %r: the commit's outcome is unknown (%s); this rank's copy stays, "
                            "and is removed by retention unless the step's record is there", key.step, tier.name, e)  # fmt: skip
            raise
        except BaseException:
            self._undo(tier, key)
            raise

    def abandon(self, tier: Tier, key: CheckpointKey) -> None:
        """This rank's copy of ``key`` on ``tier`` failed: tell the other ranks at once (they fail the
        step without waiting for a timeout). Never raises."""
        if self.coordinator.world_size == 1:
            return
        try:
            self._gather(tier, key.step, None, list)
        except BaseException as e:
            log.debug("step %d on tier %r: the other ranks learned of the failure (%s)", key.step, tier.name, e)
        else:  # pragma: no cover - rank 0 refuses a commit with a failed copy
            log.error("step %d on tier %r: committed although this rank's copy failed", key.step, tier.name)

    def _gather(
        self, tier: Tier, step: int, tag: int | None, then: Callable[[], list[tuple[str, int]]]
    ) -> list[tuple[str, int]]:
        shared = tier.capabilities.shared

        def decide(tags: list[int | None]) -> dict[str, Any]:  # on rank 0, once every rank's tag is in
            failed = [r for r, t in enumerate(tags) if t is None]
            if failed:
                if shared:
                    tier.remove_record(step)  # a step saved again: the old record names replaced copies
                raise TierckptError(
                    f"step {step} is not committed on tier {tier.name!r}: the copies of ranks {failed} failed"
                )
            data = encode_record(CommitRecord(step, len(tags), tuple(t for t in tags if t is not None)))
            if shared:
                tier.write_record(step, data)
            evict: list[tuple[str, int]] = []
            try:
                evict = then()
            except Exception as e:  # retention problems are logged, never fail a commit
                log.warning("retention decided with step %d on tier %r failed: %s", step, tier.name, e)
            return {"record": data, "evict": [[n, s] for n, s in evict]}

        out = self.coordinator.gather(self.keys.next("commit", tier.name, step), tag, decide)
        if not shared:
            tier.write_record(step, out["record"])
        return [(str(n), int(s)) for n, s in out["evict"]]

    def _undo(self, tier: Tier, key: CheckpointKey) -> None:
        """The commit failed: this rank's copy and the step's record go (a record names every rank's copy)."""
        for what, fn in (("record", lambda: tier.remove_record(key.step)), ("copy", lambda: tier.evict(key))):
            if what == "record" and tier.capabilities.shared and self.coordinator.rank != 0:
                continue  # rank 0 removes a shared tier's record (one metadata operation, not one a rank)
            try:
                fn()
            except Exception as e:
                log.warning("step %d on tier %r: cannot remove this rank's %s of the failed commit: %s",
                            key.step, tier.name, what, e)  # fmt: skip
