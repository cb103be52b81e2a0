"""Adapters that put the checkpoints of training frameworks through a :class:`tierckpt.Hierarchy`.

Each adapter is a module of its own that imports its framework (``tierckpt.integrations.lightning``:
PyTorch Lightning, installed with ``pip install 'tierckpt[lightning]'``); this package imports none of
them, and ``import tierckpt`` never imports this package. See docs/integrations.md.
"""

from __future__ import annotations
