"""The pages of float32 weights that a packed copy replaced, given back to the operating system.

The model's weights are views of its safetensors file, mapped into memory. Packing them for our int8 kernel reads
every page of them, and the pages stay resident: the embedded model's engine held 513 MB of that file beside the
110 MiB of packed weights that its products read, 40% of its RSS. Only the embedding (looked up by the lean
forward) and the norms are read again.

madvise(MADV_DONTNEED) drops such pages from this process. A later read (a transformers forward on the same
model, as the tests run beside an int8 engine) brings them back from the file, the same bytes: that holds for pages
of a file mapping that were never written, so only mappings of a file with no page written (no `Anonymous` page in
/proc/self/smaps) are touched, and only whole pages inside a weight. MADV_PAGEOUT, which only suggests, left every
page resident here (a 6.18 kernel without swap).
"""
from __future__ import annotations

import ctypes
import re
import sys

import torch

MADV_DONTNEED = 4
PAGE = 4096
# A mapping's first line in /proc/self/smaps: its range, then (group 3) the file's path where it maps a file.
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(/\S.*)?$")


def release(weights: list[torch.Tensor]) -> int:
    """Drop the resident pages of `weights` where they lie in a clean file mapping; the bytes dropped."""
    if not sys.platform.startswith("linux") or not weights:
        return 0
    try:
        clean = clean_file_mappings()
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    released = 0
    for weight in weights:
        start = weight.data_ptr()
        end = start + weight.numel() * weight.element_size()
        start, end = -(-start // PAGE) * PAGE, end // PAGE * PAGE  # whole pages inside the weight
        for low, high in clean:
            low, high = max(low, start), min(high, end)
            if low < high and libc.madvise(low, high - low, MADV_DONTNEED) == 0:
                released += high - low
    return released


def clean_file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of files in which no page was ever written (copied on write)."""
    ranges: list[tuple[int, int]] = []
    current: tuple[int, int] | None = None  # the mapping being read, if it is of a file
    anonymous = 0
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            header = _HEADER.match(line)
            if header:
                if current is not None and anonymous == 0:
                    ranges.append(current)
                current = (int(header.group(1), 16), int(header.group(2), 16)) if header.group(3) else None
                anonymous = 0
            elif line.startswith("Anonymous:"):
                anonymous = int(line.split()[1])
    if current is not None and anonymous == 0:
        ranges.append(current)
    return ranges
