"""The way out and the way in: a saved step exported as full tensors, safetensors or ``torch.save`` files
(:func:`tierckpt.export`, ``tierckpt export``: :mod:`~tierckpt.interop.exporting`), and a safetensors
model on disk loaded as a job's first state (:func:`tierckpt.load_safetensors`:
:mod:`~tierckpt.interop.loading`). See docs/integrations.md, "Export and import".

This package's ``__init__`` imports nothing, so that ``tierckpt export --help`` imports no torch; nothing
here imports ``safetensors`` until :func:`~tierckpt.interop.loading.load_safetensors` runs.
"""
