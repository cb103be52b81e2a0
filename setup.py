"""Build hook for the optional C extension; everything else is in pyproject.toml.

``tierckpt.format._native`` runs the per-tensor loops of the data path without the GIL. It needs only a C
compiler and Python's headers; where it cannot be built, the install goes on and tierckpt uses its
pure-Python loops (same results, slower on many small tensors; see tierckpt/format/native.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tierckpt.format._native",
            ["tierckpt/format/_native.c"],
            extra_compile_args=["-O2", "-std=c99", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
