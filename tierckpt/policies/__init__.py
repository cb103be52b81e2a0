"""Policies: small pure objects deciding what is kept where (more arrive with the background mover)."""

from tierckpt.policies.retention import KeepAll, KeepLatest, RetentionPolicy

__all__ = ["KeepAll", "KeepLatest", "RetentionPolicy"]
