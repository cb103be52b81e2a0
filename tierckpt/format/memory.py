"""Which tensors hold their value as bytes in their storage's memory: the only ones the packer may read.

The packer copies a tensor's bytes from ``data_ptr()`` (``memmove``, or the C loop), and an in-place
restore writes them there. That is sound only where the tensor's elements all lie in memory its storage
owns, and where those bytes *are* its value. Neither holds for a tensor subclass whose operations are
redefined by its own ``__torch_dispatch__`` (a ``DTensor``, a ``FakeTensor``, a ``FunctionalTensor``,
any wrapper subclass: their ``data_ptr()`` is 0 or describes some other tensor), for functorch's and
functionalization's wrapper tensors (no storage at all), nor for a plain tensor whose storage was freed
or shrunk after the tensor was made (FSDP frees unsharded parameters that way:
``t.untyped_storage().resize_(0)``). So the test here is not a list of names: it checks the memory
itself: the storage has an address, the tensor starts where its storage offset says, and its farthest
element ends within the storage's size; and it refuses any tensor that carries a Python dispatch key,
whatever its storage looks like (its value is what its ``__torch_dispatch__`` says, which the packer
cannot know). Plain tensors, ``nn.Parameter`` and Python subclasses that do not redefine dispatch (a
``__torch_function__`` of their own is fine) pass.

The names (DTensor, FakeTensor ...) only choose the words of the error.
"""

from __future__ import annotations

import functools
import sys

import torch

__all__ = ["as_plain", "copies", "dtensor_type", "in_storage", "unreadable"]

_PYTHON_KEY = torch._C.DispatchKey.Python
_STORAGE_ERRORS = (RuntimeError, NotImplementedError, TypeError)


def dtensor_type() -> type | None:
    """DTensor's class, if torch.distributed.tensor is imported (else no DTensor can exist)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def in_storage(t: torch.Tensor, start: int, nbytes: int) -> bool:
    """Whether every byte of strided, non-meta ``t`` (which starts at ``start = t.data_ptr()`` and holds
    ``nbytes = t.nbytes``) lies in the memory its storage holds; a zero-size tensor has none. Calls only
    torch's own methods: for a subclass with a ``__torch_function__``, the caller disables it first."""
    if not nbytes:
        return True
    try:
        st = t.untyped_storage()
        base = st.data_ptr()
        end = base + st.nbytes()
    except _STORAGE_ERRORS:  # no storage (functorch / functional wrappers, storage-less backends)
        return False
    if not base or start < base:
        return False
    if t.is_contiguous():
        return start + nbytes <= end
    reach = 1  # elements from the first to the farthest one, inclusive
    for d, s in zip(t.shape, t.stride()):
        if s < 0:
            return False
        reach += (d - 1) * s
    return start + reach * t.element_size() <= end


@functools.cache
def copies(dtype: torch.dtype) -> bool:
    """Whether torch can copy elements of ``dtype`` between strided tensors (it has no copy kernel for
    some: ``torch.int1`` ... ``torch.uint7``, the ``bits`` types)."""
    try:
        torch.empty(2, dtype=dtype)[::2].copy_(torch.empty(1, dtype=dtype))
    except (RuntimeError, TypeError):  # NotImplementedError is a RuntimeError
        return False
    return True


def unreadable(t: torch.Tensor) -> str | None:
    """None when the packer may read (and an in-place restore write) ``t``'s bytes at its address, else
    what ``t`` is, worded to follow "cannot save" or "cannot restore into". Runs no ``__torch_function__``
    of a subclass."""
    with torch._C.DisableTorchFunctionSubclass():
        return _problem(t)


def as_plain(t: torch.Tensor) -> torch.Tensor | str:
    """``t`` as a plain ``torch.Tensor`` sharing its memory (so that no code of a subclass runs when the
    packer reads it), or why it cannot be read (:func:`unreadable`'s words)."""
    with torch._C.DisableTorchFunctionSubclass():
        why = _problem(t)
        return t.as_subclass(torch.Tensor) if why is None else why


def _problem(t: torch.Tensor) -> str | None:
    cls = type(t)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if t.is_nested:  # jagged ones are a dispatch subclass too: say what they are
        return "a nested tensor (store its components, e.g. list(t.unbind()))"
    if torch._C._dispatch_keys(t).has(_PYTHON_KEY):  # before the rest: they may be its own
        return _dispatch_subclass(t, name)
    if t.layout is not torch.strided:
        kind = "sparse" if "sparse" in str(t.layout) else "non-strided"
        return f"a {kind} tensor (layout {t.layout}; store t.to_dense())"
    if t.is_quantized:
        return f"a quantized tensor ({t.dtype}; store t.dequantize() or its int_repr())"
    if t.is_meta:
        return "a meta tensor (it holds no data)"
    if torch._C._functorch.is_functorch_wrapped_tensor(t):
        return (
            "a tensor wrapped by a torch.func transform (grad, vmap, jvp ...: it has no storage of its own); "
            "use the tensors outside the transform"
        )
    if torch._is_functional_tensor(t):
        return "a functionalized tensor (torch.func.functionalize: it has no storage of its own)"
    try:
        if in_storage(t, t.data_ptr(), t.nbytes):
            return None
    except _STORAGE_ERRORS:  # data_ptr() of a tensor without storage
        pass
    return _storage_problem(t, "a tensor" if cls is torch.Tensor else f"a tensor of type {name}")


def _dispatch_subclass(t: torch.Tensor, name: str) -> str:
    """The words for a tensor whose operations a Python ``__torch_dispatch__`` defines."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is not None and isinstance(t, dtensor):
        placements = ", ".join(str(p) for p in t.placements)
        return (
            f"a {type(t).__name__} (placements [{placements}] on a mesh of {t.device_mesh.size()} ranks): "
            "tierckpt saves and restores DTensor itself, not its subclasses: pass the DTensor, or "
            "t.to_local() (this rank's shard)"
        )
    fake = getattr(sys.modules.get("torch._subclasses.fake_tensor"), "FakeTensor", None)
    if fake is not None and isinstance(t, fake):
        return "a FakeTensor (made under FakeTensorMode: it has shape and dtype but no data)"
    return (
        f"a tensor subclass {name} with its own __torch_dispatch__ (its value is what that code computes, not the "
        "bytes at its address); convert it to a plain torch.Tensor first"
    )


def _storage_problem(t: torch.Tensor, what: str) -> str:
    """The words for a tensor of no dispatch subclass whose bytes are not all in its storage."""
    try:
        st = t.untyped_storage()
        capacity, base = st.nbytes(), st.data_ptr()
    except _STORAGE_ERRORS as e:
        return f"{what} on {t.device} without a storage the packer can read ({e}); move it to the CPU first"
    if not base:
        return (
            f"{what} whose storage holds no memory (freed, or resized to 0 bytes, as FSDP does to "
            "parameters it has resharded)"
        )
    return (
        f"{what} ({t.dtype}, shape {tuple(t.shape)}, stride {t.stride()}, storage offset {t.storage_offset()}) "
        f"whose elements are not all within the {capacity} bytes its storage holds (the storage was resized)"
    )
