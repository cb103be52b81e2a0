"""What the integrations share around a hierarchy's saves: which step a framework's save takes, when the
name that finds it may be published, and the deletion of steps that no name holds any more.

A framework names a checkpoint by a path (Lightning's ``last.ckpt``, the Hugging Face Trainer's
``checkpoint-500/``); the integrations save each as a step of the hierarchy and write a pointer there
(tierckpt/integrations/_pointers.py). These helpers take the hierarchy and the save's handle; the
files are the pointers module's business.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tierckpt.errors import CheckpointNotFoundError

if TYPE_CHECKING:
    from tierckpt.hierarchy import Hierarchy, SaveHandle

__all__ = ["Background", "delete_steps", "newest_step", "next_step", "when_durable"]

log = logging.getLogger(__name__)


def newest_step(h: Hierarchy) -> int:
    """The newest step ``h`` lists in any state (-1 where it lists none)."""
    return max((c.step for c in h.checkpoints()), default=-1)


def next_step(newest: int, global_step: object) -> int:
    """The step a save of the framework's ``global_step`` takes: that step, or the one after ``newest``
    where it is not newer (a save at a global step that an earlier save or run took already)."""
    gs = global_step if type(global_step) is int and global_step >= 0 else 0
    return max(gs, newest + 1)


def when_durable(h: Hierarchy, handle: SaveHandle, publish: Callable[[], object]) -> None:
    """Call ``publish()`` once the first persistent tier of those the save goes to commits it (where it
    goes to none, once any tier does), from the thread that finished the copy: ``publish`` should hand
    the work to an executor of its own. A tier that fails calls nothing; ``publish`` may be called once
    per such tier that commits, and must do its work once."""
    persistent = [n for n in handle.durable if h.tier(n).capabilities.persistent] or list(handle.durable)
    for name in persistent:
        handle.durable[name].add_done_callback(lambda f: None if f.exception() is not None else publish())


def delete_steps(h: Hierarchy, steps: Iterable[int]) -> None:
    """``h.delete`` each of ``steps``, oldest first; one that is gone already is skipped."""
    for step in sorted(steps):
        with contextlib.suppress(CheckpointNotFoundError):
            h.delete(step)


class Background:
    """What an integration does after a save returns: the saves in flight, one thread that publishes their
    names (pointers, folders) once they are durable, and the first failure of either, raised by the next
    :meth:`settle` (or :meth:`raise_error`).

    Args:
        name: the publishing thread's name prefix.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._handles: list[SaveHandle] = []
        self._executor: ThreadPoolExecutor | None = None
        self._error: BaseException | None = None

    def publish_when_durable(self, h: Hierarchy, handle: SaveHandle, publish: Callable[[], None], what: str) -> None:
        """Track ``handle``; call ``publish()`` on the publishing thread once the save is durable
        (:func:`when_durable`). A failure of ``publish`` is logged (naming ``what``) and kept."""
        with self._lock:
            self._handles.append(handle)
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix=self.name)
            executor = self._executor
        when_durable(h, handle, lambda: executor.submit(self._run, publish, what))

    def _run(self, publish: Callable[[], None], what: str) -> None:
        try:
            publish()
        except BaseException as e:
            log.error("%s failed: %s", what, e)
            self._error = self._error or e

    def settle(self) -> None:
        """Raise what failed since the last call; wait on the saves that are done (raising their failures)."""
        self.raise_error()
        with self._lock:
            done = [hd for hd in self._handles if hd.done()]
            self._handles = [hd for hd in self._handles if not hd.done()]
        for hd in done:
            hd.wait()

    def raise_error(self) -> None:
        """Raise the first failure of a publication since the last call, if any."""
        err, self._error = self._error, None
        if err is not None:
            raise err

    def drain(self) -> None:
        """Wait until every publication handed over so far has run (a later one starts a new thread)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def forget(self) -> None:
        """Drop the saves tracked (the hierarchy they belong to is closed)."""
        with self._lock:
            self._handles = []
