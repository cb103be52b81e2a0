"""Test helpers shipped with tierckpt: the tier conformance suite and fault-injecting wrappers.

``TierConformanceTests`` needs pytest; import it from :mod:`tierckpt.testing.conformance`.
"""

from tierckpt.testing.faulty import FaultyTier

__all__ = ["FaultyTier"]
