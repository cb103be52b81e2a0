"""What :class:`tierckpt.Hierarchy` runs in the caller's thread, and its helpers.

* :mod:`~tierckpt.facade.restorejob` — a restore's job: choose the step and the copy, agree, read,
  fall back (:mod:`~tierckpt.facade.choose`: its rules, pure functions);
* :mod:`~tierckpt.facade.verify` — every rank's copies re-read and checked;
* :mod:`~tierckpt.facade.opening` — a hierarchy's parts built from its configuration;
  :mod:`~tierckpt.facade.engines` — the I/O engines its file tiers share;
* :mod:`~tierckpt.facade.checks` — argument checks; :mod:`~tierckpt.facade.describe` — a manifest
  described for humans (``tierckpt inspect``).

Imports only go down: the background machinery, the data path, the ranks, then everything below.
"""
