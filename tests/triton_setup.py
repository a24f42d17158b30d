"""Where the tests run enginecore.paged_triton's kernels: compiled, on a CUDA GPU where there is one; else on the
CPU through Triton's interpreter. The interpreter must be chosen before triton is first imported (its standard
library, tl.max and the like, is decorated then), so conftest imports this module first.

Triton 3.6's interpreter gets two things wrong, one worked around and one avoided:
- a loop bound computed in the kernel (`range(lo, hi, step)` over tensors) goes through int() on a one-element
  array, which numpy 2.4 refuses: patched to read the element;
- bfloat16 arithmetic is wrong there (tl.dot gives garbage, sums NaN; a plain bfloat16 copy is right): the CPU
  tests run float32 and float16. The start-up checks (enginecore.attention_plan) check bfloat16 on the GPU itself.
"""
from __future__ import annotations

import importlib.util
import os

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HAVE_TRITON = importlib.util.find_spec("triton") is not None

if DEVICE.type == "cpu" and HAVE_TRITON:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton.runtime.interpreter as _interpreter

    _patch_tensor = _interpreter._patch_lang_tensor

    def _patched(tensor, scope):
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patched
