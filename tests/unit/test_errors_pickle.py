"""Every tierckpt error survives pickling with its type, message and fields: DCP hands a rank's exception
to the other ranks pickled, and an error that cannot be rebuilt there hides the real one behind a
``TypeError`` from ``__init__``."""

from __future__ import annotations

import errno
import importlib
import pickle
import pkgutil

import pytest

import tierckpt
from tierckpt import errors
from tierckpt.datapath.manifests import UnnamedCopyError
from tierckpt.dcp import StepExistsError
from tierckpt.interop.output import OutputExistsError
from tierckpt.tiers._s3client import S3Error, S3FullError

#: one instance of every error class, each field set (a class missing here fails the coverage test)
EXAMPLES: list[errors.TierckptError] = [
    errors.TierckptError("something failed"),
    errors.ConfigError("tiers[0].capacity: not a size"),
    errors.StateError("state['optim']: cannot be saved"),
    errors.CheckpointNotFoundError("no committed checkpoint"),
    errors.CheckpointEvictedError("step 3 was evicted while being opened"),
    errors.CorruptCheckpointError("checksum mismatch", tier="pfs", step=3, blob="blob-00000.bin", key="w", rank=1),
    errors.UnsupportedFormatError("format version 9 is newer than this reader"),
    errors.TierIOError(errno.EIO, "tier 'pfs': cannot read", "/pfs/step-3"),
    errors.TierFullError("tier 'host': no room for step 3"),
    errors.DeviceFullError(errno.EDQUOT, "tier 'ssd': the device of /ssd is full", "/ssd/step-3/manifest"),
    errors.TierBusyError(
        "leased by j1", tier="pfs", lease_file="/pfs/.lease", job="j1", host="n1", pid=4, started_at=1.5
    ),
    errors.CoordinationError("rank 0 published no outcome", (0, 2), undecided=True),
    UnnamedCopyError("pfs", 3, 1, 2),
    OutputExistsError("export: /out is not empty (force=True replaces it)"),
    StepExistsError("step 3 is already committed and overwrite=False: nothing was written"),
    S3Error(
        "S3 UploadPart of s3://b/k at http://h failed after 3 tries: SlowDown (HTTP 503)", "UploadPart", 503, "SlowDown"
    ),
    S3FullError(
        "S3 PutObject of s3://b/k at http://h failed: QuotaExceeded (HTTP 403)", "PutObject", 403, "QuotaExceeded"
    ),
]


def _library_errors() -> set[type[BaseException]]:
    """Every subclass of TierckptError the library defines (its modules imported first)."""
    for mod in pkgutil.walk_packages(tierckpt.__path__, "tierckpt."):
        importlib.import_module(mod.name)
    found: set[type[BaseException]] = set()
    todo: list[type[BaseException]] = [errors.TierckptError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("tierckpt.") and sub not in found:
                found.add(sub)
                todo.append(sub)
    return found | {errors.TierckptError}


def test_every_error_class_has_an_example() -> None:
    public = {getattr(errors, name) for name in errors.__all__}
    assert public | _library_errors() <= {type(e) for e in EXAMPLES}


def _fields(e: BaseException) -> dict[str, object]:
    out: dict[str, object] = dict(vars(e))
    if isinstance(e, OSError):
        out.update(errno=e.errno, strerror=e.strerror, filename=e.filename)
    return out


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda e: type(e).__name__)
def test_an_error_is_rebuilt_whole_from_its_pickle(error: errors.TierckptError) -> None:
    got = pickle.loads(pickle.dumps(error))
    assert type(got) is type(error)
    assert str(got) == str(error)
    assert _fields(got) == _fields(error)
