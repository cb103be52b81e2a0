"""Importing tierckpt (its public names, and its integrations package) imports no framework."""

from __future__ import annotations

import json
import subprocess
import sys


def test_importing_tierckpt_imports_no_framework() -> None:
    code = """
import json, sys
import tierckpt, tierckpt.integrations
from tierckpt import Hierarchy, TrainState
frameworks = ("lightning", "pytorch_lightning", "transformers", "accelerate", "torchtitan", "torchdata")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in frameworks)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []
