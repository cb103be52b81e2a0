"""The shipped conformance suite against the s3 tier on the session's radosgw."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tierckpt.testing.conformance import TierConformanceTests
from tierckpt.tiers._s3client import S3Settings
from tierckpt.tiers.s3 import S3Tier

pytestmark = pytest.mark.remote


class TestS3Conformance(TierConformanceTests):
    @pytest.fixture
    def tier(self, s3_bucket: Any) -> Iterator[S3Tier]:
        settings = S3Settings(endpoint_url=s3_bucket.endpoint, addressing_style="path", attempts=3, deadline_s=20)
        t = S3Tier("obj", s3_bucket.name, "conf/", settings, part_size=5 << 20)
        yield t
        t.close()
