"""Freed tensor memory leaves the process (fedunlearn.allocator), measured in fresh processes."""

import subprocess
import sys

import pytest

SCRIPT = """
import sys
import torch
from fedunlearn.allocator import return_freed_memory
if sys.argv[1] == "fixed":
    assert return_freed_memory()
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
start = rss_mb()
big = torch.ones(4 * 2**20)  # a 16 MiB block: glibc raises its mmap threshold when it is freed
del big
blocks = [torch.ones(2**20 + 1024 * i) for i in range(40)]  # 40 blocks of about 4 MiB
blocks = blocks[1::2]  # every second one freed: holes in the heap
print(rss_mb() - start)
"""


def _growth(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, /proc")
def test_freed_blocks_are_returned_instead_of_kept_in_the_heap():
    alive = 20 * 4  # MiB still referenced at the end
    assert _growth("default") >= alive + 60  # glibc keeps the 20 freed blocks
    assert _growth("fixed") <= alive + 15
