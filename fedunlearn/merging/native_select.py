"""The counting pass of a top-k selection as one small C function: read once, write nothing.

:func:`~fedunlearn.merging.kernels.bracket_counts` needs, over a Fisher pooled from several
clients (or a lone one), the maximum, the number of keys above a bracket ``[lo, hi]`` and the
keys inside it (a few per cent of the entries).  An inductor kernel cannot collect a variable
number of entries, so the compiled path writes an int32 offset for *every* entry and numpy
scans them again: about 2.4 read passes of the input.  :func:`pooled_bracket_counts` does the
same work in one pass that writes only the candidates: a C function (:data:`C_SOURCE`) that
widens each slice of the parts to float32, pools them with the same float32 operations in the
same order as :func:`~fedunlearn.merging.kernels.mean_of` (``((p₁ + p₂) + …) / n``, IEEE
arithmetic, no contraction), so the keys are bit-identical to the compiled pass's.

The function is built once per machine with the C compiler inductor uses (``$CC`` or ``cc``,
``-O3 -march=native``) into ``$FEDUNLEARN_CACHE_DIR/kernels`` (default
``~/.cache/fedunlearn/kernels``), under a name hashed from the source, the compiler, the flags
and the CPU, written to a temporary name and moved into place (two processes building at once
both succeed).  It runs through ``ctypes`` (which releases the GIL) on slices spread over the
intra-op threads.  Where no compiler is found, the build fails, or an input is not bfloat16 or
float32 on the CPU, :func:`pooled_bracket_counts` returns ``None`` and the caller counts with
the inductor kernel instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..files import default_cache_dir, temp_path
from ._chunks import map_spans

log = logging.getLogger(__name__)

#: Entries per call of the C function (spread over the intra-op threads).
SLICE = 1 << 20
#: Kinds of input the C function reads, by dtype (their numbers in :data:`C_SOURCE`).
_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_FLAGS = ("-O3", "-march=native", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off")

C_SOURCE = r"""
#include <stdint.h>
#include <string.h>

#define BLOCK 256 /* entries pooled at a time (stays in L1) */
#define SUB 16    /* entries checked for a candidate at a time */

static void widen(const void *part, int32_t kind, int64_t at, int len, float *out) {
    if (kind == 0) {
        memcpy(out, (const float *)part + at, (size_t)len * sizeof(float));
        return;
    }
    const uint16_t *p = (const uint16_t *)part + at; /* bfloat16: the top half of a float32 */
    uint32_t bits[BLOCK];
    for (int i = 0; i < len; i++) bits[i] = (uint32_t)p[i] << 16;
    memcpy(out, bits, (size_t)len * sizeof(float));
}

/* Over the entries [start, stop) of the float32 mean v of the parts (or, with magnitude, of
   |part 0|): keys = bit patterns of v, -0.0 read as 0.0 (or of |part 0|).  Writes the keys in
   [lo, hi] to cand (at most cap), the number of keys > hi to *above and the largest key to
   *max_key; returns the number of candidates, or -1 if more than cap. */
int64_t fedunlearn_bracket(const void *const *parts, const int32_t *kinds, int32_t n_parts,
                           int32_t magnitude, int64_t start, int64_t stop, int32_t lo,
                           int32_t hi, int32_t *cand, int64_t cap, int64_t *above,
                           int32_t *max_key) {
    float v[BLOCK], t[BLOCK];
    int32_t key[BLOCK];
    const float n = (float)n_parts;
    const uint32_t width = (uint32_t)hi - (uint32_t)lo;
    int64_t count = 0, nc = 0;
    int32_t top = 0;
    for (int64_t b = start; b < stop; b += BLOCK) {
        const int len = (int)(stop - b < BLOCK ? stop - b : BLOCK);
        widen(parts[0], kinds[0], b, len, v);
        for (int32_t j = 1; j < n_parts; j++) {
            widen(parts[j], kinds[j], b, len, t);
            for (int i = 0; i < len; i++) v[i] = v[i] + t[i];
        }
        if (n_parts > 1)
            for (int i = 0; i < len; i++) v[i] = v[i] / n;
        memcpy(key, v, (size_t)len * sizeof(float));
        for (int i = 0; i < len; i++) {
            const int32_t k = magnitude ? (key[i] & 0x7FFFFFFF) : (key[i] < 0 ? 0 : key[i]);
            key[i] = k;
            top = k > top ? k : top;
            count += k > hi;
        }
        for (int s = 0; s < len; s += SUB) {
            const int e = s + SUB < len ? s + SUB : len;
            int any = 0;
            for (int i = s; i < e; i++) any |= (uint32_t)key[i] - (uint32_t)lo <= width;
            if (!any) continue;
            if (nc + SUB > cap) return -1;
            for (int i = s; i < e; i++) {
                cand[nc] = key[i];
                nc += (uint32_t)key[i] - (uint32_t)lo <= width;
            }
        }
    }
    *above = count;
    *max_key = top;
    return nc;
}
"""


def _cpu_signature() -> str:
    """The CPU's model and feature flags (``-march=native`` code is only valid on such a CPU)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))]
    return platform.machine() + "".join(dict.fromkeys(wanted))


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _build(compiler: str) -> Path:
    """Compile :data:`C_SOURCE` into the kernel cache (once per source, compiler, flags, CPU)."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    digest = hashlib.sha256(
        "\0".join([C_SOURCE, compiler, version, *_FLAGS, _cpu_signature()]).encode()
    ).hexdigest()[:16]
    folder = default_cache_dir() / "kernels"
    library = folder / f"bracket-{digest}.so"
    if library.exists():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    source = temp_path(folder / f"bracket-{digest}.c")
    built = temp_path(library)
    try:
        source.write_text(C_SOURCE)
        subprocess.run(
            [compiler, *_FLAGS, "-x", "c", str(source), "-o", str(built)],
            capture_output=True,
            text=True,
            check=True,
        )
        os.replace(built, library)
    finally:
        source.unlink(missing_ok=True)
        built.unlink(missing_ok=True)
    return library


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built C function (loaded once per process), or ``None`` where it cannot be built."""
    compiler = _compiler()
    if compiler is None:
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        log.warning("native selection pass unavailable (inductor kernel used): %s", detail)
        return None
    fn = lib.fedunlearn_bracket
    fn.restype = ctypes.c_int64
    fn.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_int32),
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_int32),
    ]
    return lib


def supported(parts: Sequence[torch.Tensor], magnitude: bool) -> bool:
    """Whether :func:`pooled_bracket_counts` takes these flat parts (before building anything)."""
    if not parts or (magnitude and (len(parts) != 1 or parts[0].dtype != torch.float32)):
        return False
    d = parts[0].numel()
    return all(
        p.dtype in _KINDS and p.device.type == "cpu" and p.dim() == 1 and p.numel() == d
        for p in parts
    )


def pooled_bracket_counts(
    parts: Sequence[torch.Tensor], magnitude: bool, bounds: tuple[int, int]
) -> tuple[torch.Tensor, int, np.ndarray] | None:
    """``(max v, #{key > hi}, the keys in [lo, hi])`` as ``bracket_counts`` returns them.

    ``None`` where the C function is not available, the parts are not supported (see
    :func:`supported`), or the bracket holds more than a sixteenth of some slice (a sample that
    misrepresents the tensor: the caller's general path handles it).
    """
    if not supported(parts, magnitude):
        return None
    lib = library()
    if lib is None:
        return None
    flats = [p.contiguous() for p in parts]
    pointers = (ctypes.c_void_p * len(flats))(*[p.data_ptr() for p in flats])
    kinds = (ctypes.c_int32 * len(flats))(*[_KINDS[p.dtype] for p in flats])
    lo, hi = bounds

    def count(span: slice) -> tuple[int, int, np.ndarray] | None:
        cap = (span.stop - span.start) // 16 + 64
        out = np.empty(cap, dtype=np.int32)
        above, top = ctypes.c_int64(0), ctypes.c_int32(0)
        n = lib.fedunlearn_bracket(
            pointers, kinds, len(flats), int(magnitude), span.start, span.stop, lo, hi,
            out.ctypes.data, cap, ctypes.byref(above), ctypes.byref(top),
        )  # fmt: skip
        return None if n < 0 else (above.value, top.value, out[:n])

    counted = map_spans(count, flats[0].numel(), flats[0].device, chunk=SLICE)
    if any(c is None for c in counted):
        return None
    done = [c for c in counted if c is not None]
    top_key = max(c[1] for c in done)
    top = torch.tensor([top_key], dtype=torch.int32).view(torch.float32)[0]
    if magnitude:
        top = torch.zeros((), dtype=torch.float32)
    keys = np.concatenate([c[2] for c in done]).astype(np.int64)
    return top, sum(c[0] for c in done), keys
