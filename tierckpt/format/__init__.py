"""On-disk format, pure and free of I/O: state tree, aggregation layout and manifest."""

from tierckpt.format.layout import Extent, Layout, plan, round_up
from tierckpt.format.manifest import (
    FORMAT_VERSION,
    BlobEntry,
    Manifest,
    TensorEntry,
    TensorTable,
    decode_manifest,
    dtype_from_name,
    dtype_name,
    encode_manifest,
)
from tierckpt.format.tree import FlatState, TensorRef, flatten, format_path, unflatten

__all__ = [
    "FORMAT_VERSION",
    "BlobEntry",
    "Extent",
    "FlatState",
    "Layout",
    "Manifest",
    "TensorEntry",
    "TensorRef",
    "TensorTable",
    "decode_manifest",
    "dtype_from_name",
    "dtype_name",
    "encode_manifest",
    "flatten",
    "format_path",
    "plan",
    "round_up",
    "unflatten",
]
