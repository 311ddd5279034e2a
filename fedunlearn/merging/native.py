"""One-pass loops of the merges as small C functions: read once, write only what is kept.

An inductor kernel cannot collect a variable number of entries, so a compiled selection writes
something for *every* entry and numpy scans it again.  Two loops here write only what they
keep:

* :func:`pooled_bracket_counts`, the counting pass of a top-k selection
  (:func:`~fedunlearn.merging.kernels.bracket_counts`): over a Fisher pooled from several
  clients (or a lone one) the maximum, the number of keys above a bracket ``[lo, hi]`` and the
  keys inside it (a few per cent of the entries).  The parts are widened to float32 and pooled
  with the same float32 operations in the same order as
  :func:`~fedunlearn.merging.kernels.mean_of` (``((p₁ + p₂) + …) / n``, IEEE arithmetic, no
  contraction), so the keys are bit-identical to the compiled pass's;
* :func:`gather_support`, the projection's solver coordinates (where some ``F̃_k > 0`` and
  ``Δ_base ≠ 0``) with ``Δ_base`` and every ``F̃_k`` gathered there, and the check that every
  ``F̃_k`` is finite and non-negative, in the same pass.

A third pair decodes a top-k Fisher upload (:mod:`fedunlearn.upload_codec`) in one pass:
:func:`unmask` counts the set bits of its packed mask per slice, then spreads the kept values
over them (16 entries per AVX-512 expand, or 8 per AVX2 table permutation, where the CPU has
them), zeros elsewhere. For a forget domain of several top-k Fishers, :func:`pool_kept` computes
their float32 mean at the union of their masks and :func:`pool_unmask_span` the mean's entries
over a span, both in one pass over the masks (no member decoded on its own).

The functions are built once per machine with the C compiler (``$CC`` or ``cc``, ``-O3
-march=native``) into ``$FEDUNLEARN_CACHE_DIR/kernels`` (default ``~/.cache/fedunlearn/kernels``),
under a name hashed from the source, the compiler, the flags and the CPU, written to a temporary
name and moved into place (two processes building at once both succeed).  A library runs with
the rights of the process that loads it, so before loading one the cache is checked
(:func:`check_private`): the folder (created ``0700``) and the library must belong to the
current user and be writable by nobody else, and the library must be a regular file (no link);
otherwise :class:`KernelCacheError` names the path and the problem and nothing is loaded or
built there.  They run through
``ctypes`` (which releases the GIL) on slices spread over the intra-op threads.  Where no
compiler is found, the build fails, or an input is not of the dtypes they read on the CPU, they
return ``None`` and the caller takes its general path (inductor kernels, numpy).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..files import default_cache_dir, temp_path
from ._chunks import CHUNK, map_spans
from .lazy import Flat, FlatSlices, KeptEntries

log = logging.getLogger(__name__)

#: Entries per call of the C function (spread over the intra-op threads).
SLICE = 1 << 20
#: Kinds of input the C function reads, by dtype (their numbers in :data:`C_SOURCE`).
_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_FLAGS = ("-O3", "-march=native", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off")

C_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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

/* The projection's solver coordinates among the entries [start, stop): positions j where some
   fs[k][j] > 0 and base[j] != 0, written to idx with base and every fs[k] there widened to
   float32 (outputs hold stop - start entries).  Bit k of *bad is set when fs[k] has an entry
   that is negative, infinite or NaN.  Returns the number of coordinates. */
static inline float at_index(const void *p, int32_t kind, int64_t j) {
    if (kind == 0) return ((const float *)p)[j];
    uint32_t bits = (uint32_t)((const uint16_t *)p)[j] << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

#define FLOAT_MAX 3.4028234663852886e38f
#define BAD_BIT(k) ((int64_t)1 << ((k) < 63 ? (k) : 63))

#ifdef __AVX512F__
static inline __m512 load16(const void *p, int32_t kind, int64_t j) {
    if (kind == 0) return _mm512_loadu_ps((const float *)p + j);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + j));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

int64_t fedunlearn_support(const void *base, int32_t base_kind, const void *const *fs,
                           const int32_t *f_kinds, int32_t m, int64_t start, int64_t stop,
                           int64_t *idx, float *base_out, float *const *f_out, int64_t *bad) {
    int64_t n = 0, flags = 0, at = start;
#ifdef __AVX512F__
    /* 16 entries at a time, compressed in registers and stored as whole vectors (a compressing
       store to memory is microcoded on some CPUs): the lanes past the kept ones are overwritten
       by the next store or lie past the returned count, and never past the outputs' end. */
    const __m512 zero = _mm512_setzero_ps(), top = _mm512_set1_ps(FLOAT_MAX);
    const __m512i lanes = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    for (; at + 16 <= stop; at += 16) {
        __mmask16 any = 0;
        for (int32_t k = 0; k < m; k++) {
            const __m512 f = load16(fs[k], f_kinds[k], at);
            any |= _mm512_cmp_ps_mask(f, zero, _CMP_GT_OQ);
            const __mmask16 ok = _mm512_cmp_ps_mask(f, zero, _CMP_GE_OQ) &
                                 _mm512_cmp_ps_mask(f, top, _CMP_LE_OQ);
            if (ok != 0xFFFF) flags |= BAD_BIT(k);
        }
        const __m512 b = load16(base, base_kind, at);
        const __mmask16 kept = any & _mm512_cmp_ps_mask(b, zero, _CMP_NEQ_UQ);
        if (!kept) continue;
        _mm512_storeu_ps(base_out + n, _mm512_maskz_compress_ps(kept, b));
        const __m512i low = _mm512_add_epi64(_mm512_set1_epi64(at), lanes);
        const __m512i high = _mm512_add_epi64(_mm512_set1_epi64(at + 8), lanes);
        const int n_low = __builtin_popcount((unsigned)kept & 0xFFu);
        _mm512_storeu_si512((void *)(idx + n), _mm512_maskz_compress_epi64(kept & 0xFF, low));
        _mm512_storeu_si512((void *)(idx + n + n_low),
                            _mm512_maskz_compress_epi64((__mmask8)(kept >> 8), high));
        for (int32_t k = 0; k < m; k++)
            _mm512_storeu_ps(f_out[k] + n,
                             _mm512_maskz_compress_ps(kept, load16(fs[k], f_kinds[k], at)));
        n += __builtin_popcount((unsigned)kept);
    }
#endif
    for (; at < stop; at++) {
        int any = 0;
        for (int32_t k = 0; k < m; k++) {
            const float f = at_index(fs[k], f_kinds[k], at);
            any |= f > 0.0f;
            if (!(f >= 0.0f && f <= FLOAT_MAX)) flags |= BAD_BIT(k);
        }
        const float b = at_index(base, base_kind, at);
        if (!any || !(b != 0.0f)) continue;
        idx[n] = at;
        base_out[n] = b;
        for (int32_t k = 0; k < m; k++) f_out[k][n] = at_index(fs[k], f_kinds[k], at);
        n++;
    }
    *bad = flags;
    return n;
}

/* The set bits of a packed mask (entry j -> bit j % 8 of byte j / 8) among the entries
   [start, stop), start a multiple of 8. */
int64_t fedunlearn_mask_count(const uint8_t *packed, int64_t start, int64_t stop) {
    int64_t n = 0, byte = start / 8;
    const int64_t full = stop / 8;
    for (; byte + 8 <= full; byte += 8) {
        uint64_t word;
        memcpy(&word, packed + byte, sizeof word);
        n += __builtin_popcountll(word);
    }
    for (; byte < full; byte++) n += __builtin_popcount(packed[byte]);
    if (stop % 8) n += __builtin_popcount(packed[full] & ((1u << (stop % 8)) - 1u));
    return n;
}

/* The entries start, start + step, ... (below stop) of a top-k Fisher whose entry 0 is bit 0 of
   packed[0] and takes values[0] when set: the value where the bit is set, 0 elsewhere (the set
   bits before each picked entry counted a word at a time).  Returns the entries written. */
int64_t fedunlearn_unmask_at(const uint8_t *packed, const float *values, int64_t start,
                             int64_t stop, int64_t step, float *out) {
    int64_t c = 0, byte = 0, n = 0; /* c: the set bits of the bytes before byte */
    for (int64_t p = start; p < stop; p += step) {
        const int64_t at = p / 8;
        for (; byte + 8 <= at; byte += 8) {
            uint64_t word;
            memcpy(&word, packed + byte, sizeof word);
            c += __builtin_popcountll(word);
        }
        for (; byte < at; byte++) c += __builtin_popcount(packed[byte]);
        const unsigned bits = packed[at], bit = (unsigned)(p % 8);
        const int before = __builtin_popcount(bits & ((1u << bit) - 1u));
        out[n++] = (bits >> bit) & 1u ? values[c + before] : 0.0f;
    }
    return n;
}

#ifdef __AVX2__
/* EXPAND_LANES[b][i]: the value lane i of mask byte b takes (set bits below i); FIRST_LANES[n]:
   the first n lanes on (a load mask); COMPRESS_LANES[b][j]: the lane of the j-th set bit of b */
static int32_t EXPAND_LANES[256][8], FIRST_LANES[9][8], COMPRESS_LANES[256][8];
__attribute__((constructor)) static void fedunlearn_lane_tables(void) {
    for (int b = 0; b < 256; b++)
        for (int i = 0, c = 0; i < 8; i++) {
            EXPAND_LANES[b][i] = c;
            COMPRESS_LANES[b][i] = 0;
            if ((b >> i) & 1) COMPRESS_LANES[b][c++] = i;
        }
    for (int n = 0; n <= 8; n++)
        for (int i = 0; i < 8; i++) FIRST_LANES[n][i] = i < n ? -1 : 0;
}

/* The 8 entries of mask byte `byte` spread from values (the next popcount of them, loaded
   masked: never past the last), zeros where the bit is unset. */
static inline __m256 expand8(unsigned byte, const float *values) {
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const int taken = __builtin_popcount(byte);
    const __m256i first = _mm256_loadu_si256((const __m256i *)FIRST_LANES[taken]);
    const __m256 v = _mm256_maskload_ps(values, first);
    const __m256i where = _mm256_loadu_si256((const __m256i *)EXPAND_LANES[byte]);
    const __m256i bit = _mm256_and_si256(_mm256_set1_epi32((int)byte), lane_bit);
    const __m256 set = _mm256_castsi256_ps(_mm256_cmpeq_epi32(bit, lane_bit));
    return _mm256_and_ps(_mm256_permutevar8x32_ps(v, where), set);
}
#endif

/* The bits of mask byte `byte` that stand for entries below stop. */
static inline unsigned within(int64_t byte, int64_t stop) {
    const int64_t left = stop - byte * 8;
    return left >= 8 ? 0xFFu : (1u << left) - 1u;
}

/* Byte `byte` of the union of n packed masks. */
static inline unsigned union_byte(const uint8_t *const *packed, int32_t n, int64_t byte) {
    unsigned u = 0;
    for (int32_t i = 0; i < n; i++) u |= packed[i][byte];
    return u;
}

/* The union of n packed masks among the entries [start, stop) (start a multiple of 8): the
   entries whose bit is set in some mask. */
int64_t fedunlearn_union_count(const uint8_t *const *packed, int32_t n, int64_t start,
                               int64_t stop) {
    int64_t count = 0;
    for (int64_t byte = start / 8; byte * 8 < stop; byte++)
        count += __builtin_popcount(union_byte(packed, n, byte) & within(byte, stop));
    return count;
}

/* Over the entries [start, stop) (start a multiple of 8) of n top-k Fishers (packed masks
   from entry 0, values[i] the i-th Fisher's values from entry start on): at every entry of
   the union of the masks (cap of them, counted by fedunlearn_union_count), in entry order,
   the float32 mean ((v_1 + v_2) + ... + v_n) / n (v_1 alone for n = 1) with v_i the i-th
   Fisher's next value where its bit is set, else 0 -- the same operations as the merges'
   mean of the decoded Fishers.  Returns the entries written. */
int64_t fedunlearn_pool_kept(const uint8_t *const *packed, const float *const *values,
                             int32_t n, int64_t start, int64_t stop, int64_t cap, float *out) {
    int64_t m = 0, taken[64] = {0}, byte = start / 8;
    const float count = (float)n;
#ifdef __AVX2__
    /* whole bytes: each Fisher's 8 entries spread into lanes and pooled there, the union's
       lanes moved to the front and stored 8 wide (while 8 more fit within cap: the spans'
       outputs are written side by side) */
    const __m256 divisor = _mm256_set1_ps(count);
    for (; byte * 8 + 8 <= stop && m + 8 <= cap; byte++) {
        unsigned u = packed[0][byte];
        __m256 acc = expand8(u, values[0] + taken[0]);
        taken[0] += __builtin_popcount(u);
        for (int32_t i = 1; i < n; i++) {
            const unsigned b = packed[i][byte];
            acc = _mm256_add_ps(acc, expand8(b, values[i] + taken[i]));
            taken[i] += __builtin_popcount(b);
            u |= b;
        }
        if (n > 1) acc = _mm256_div_ps(acc, divisor);
        const __m256i front = _mm256_loadu_si256((const __m256i *)COMPRESS_LANES[u]);
        _mm256_storeu_ps(out + m, _mm256_permutevar8x32_ps(acc, front));
        m += __builtin_popcount(u);
    }
#endif
    for (; byte * 8 < stop; byte++) {
        for (unsigned u = union_byte(packed, n, byte) & within(byte, stop); u; u &= u - 1) {
            const unsigned bit = 1u << __builtin_ctz(u);
            float acc = 0.0f;
            for (int32_t i = 0; i < n; i++) {
                const float v = packed[i][byte] & bit ? values[i][taken[i]++] : 0.0f;
                acc = i == 0 ? v : acc + v;
            }
            out[m++] = n > 1 ? acc / count : acc;
        }
    }
    return m;
}

/* out[j - start] for the entries j in [start, stop) (start a multiple of 8) of the float32
   mean of n top-k Fishers (packed masks from entry 0, values[i] the i-th Fisher's values from
   entry start on): ((v_1 + v_2) + ... + v_n) / n (v_1 alone for n = 1), v_i the i-th Fisher's
   next value where its bit is set, else 0 -- the merges' mean of the decoded Fishers, written
   in one pass instead of n decoded Fishers.  Returns the entries written. */
int64_t fedunlearn_pool_unmask(const uint8_t *const *packed, const float *const *values,
                               int32_t n, int64_t start, int64_t stop, float *out) {
    int64_t taken[64] = {0}, byte = start / 8;
    const float count = (float)n;
#ifdef __AVX2__
    const __m256 divisor = _mm256_set1_ps(count);
    for (; byte * 8 + 8 <= stop; byte++) {
        __m256 acc = _mm256_setzero_ps();
        for (int32_t i = 0; i < n; i++) {
            const unsigned b = packed[i][byte];
            const __m256 v = expand8(b, values[i] + taken[i]);
            acc = i == 0 ? v : _mm256_add_ps(acc, v);
            taken[i] += __builtin_popcount(b);
        }
        if (n > 1) acc = _mm256_div_ps(acc, divisor);
        _mm256_storeu_ps(out + (byte * 8 - start), acc);
    }
#endif
    for (; byte * 8 < stop; byte++)
        for (int64_t j = byte * 8; j < byte * 8 + 8 && j < stop; j++) {
            float acc = 0.0f;
            for (int32_t i = 0; i < n; i++) {
                const float v = (packed[i][byte] >> (j % 8)) & 1u ? values[i][taken[i]++] : 0.0f;
                acc = i == 0 ? v : acc + v;
            }
            out[j - start] = n > 1 ? acc / count : acc;
        }
    return stop - start;
}

/* out[j] for the entries j in [start, stop) (start a multiple of 8): the next of values
   (values[0] first) where the mask's bit j is set, 0 elsewhere.  Returns the values taken. */
int64_t fedunlearn_unmask(const uint8_t *packed, const float *values, int64_t start,
                          int64_t stop, float *out) {
    int64_t j = start, c = 0;
#ifdef __AVX512F__
    /* 16 entries at a time: the next popcount values loaded (masked: never past the last)
       and spread over the set lanes */
    for (; j + 16 <= stop; j += 16) {
        uint16_t bits;
        memcpy(&bits, packed + j / 8, sizeof bits);
        const int taken = __builtin_popcount(bits);
        const __m512 v = _mm512_maskz_loadu_ps((__mmask16)((1u << taken) - 1u), values + c);
        _mm512_storeu_ps(out + j, _mm512_maskz_expand_ps((__mmask16)bits, v));
        c += taken;
    }
#elif defined(__AVX2__)
    /* 8 entries (one mask byte) at a time, moved to their lanes by a permutation from a table
       indexed by the byte (lane i takes value number popcount(byte & (2^i - 1))) */
    for (; j + 8 <= stop; j += 8) {
        const unsigned byte = packed[j / 8];
        _mm256_storeu_ps(out + j, expand8(byte, values + c));
        c += __builtin_popcount(byte);
    }
#endif
    for (; j < stop; j++) {
        const int bit = (packed[j / 8] >> (j % 8)) & 1;
        out[j] = bit ? values[c] : 0.0f;
        c += bit;
    }
    return c;
}
"""


_PTR, _I32, _I64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
#: Argument types of the C functions (all return an int64 count).
_SIGNATURES = {
    "fedunlearn_bracket": [
        *(ctypes.POINTER(_PTR), ctypes.POINTER(_I32), _I32, _I32, _I64, _I64, _I32, _I32),
        *(_PTR, _I64, ctypes.POINTER(_I64), ctypes.POINTER(_I32)),
    ],
    "fedunlearn_support": [
        *(_PTR, _I32, ctypes.POINTER(_PTR), ctypes.POINTER(_I32), _I32, _I64, _I64),
        *(_PTR, _PTR, ctypes.POINTER(_PTR), ctypes.POINTER(_I64)),
    ],
    "fedunlearn_mask_count": [_PTR, _I64, _I64],
    "fedunlearn_unmask": [_PTR, _PTR, _I64, _I64, _PTR],
    "fedunlearn_unmask_at": [_PTR, _PTR, _I64, _I64, _I64, _PTR],
    "fedunlearn_union_count": [ctypes.POINTER(_PTR), _I32, _I64, _I64],
    "fedunlearn_pool_kept": [
        *(ctypes.POINTER(_PTR), ctypes.POINTER(_PTR), _I32, _I64, _I64, _I64, _PTR)
    ],
    "fedunlearn_pool_unmask": [ctypes.POINTER(_PTR), ctypes.POINTER(_PTR), _I32, _I64, _I64, _PTR],
}


def _cpu_signature() -> str:
    """The CPU's model and feature flags (``-march=native`` code is only valid on such a CPU)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))]
    return platform.machine() + "".join(dict.fromkeys(wanted))


class KernelCacheError(RuntimeError):
    """The kernel cache holds a folder or library that another user could have written."""


def check_private(path: Path, kind: str) -> None:
    """Refuse ``path`` (``kind``: "folder" or "library") unless the current user owns it and
    neither its group nor others may write to it; a library must be a regular file, not a link.

    Raises :class:`KernelCacheError` naming the path and what is wrong with it.
    """
    info = path.lstat() if kind == "library" else path.stat()
    problems = []
    if kind == "library" and not stat.S_ISREG(info.st_mode):
        problems.append("is not a regular file (a link or a special file)")
    if kind == "folder" and not stat.S_ISDIR(info.st_mode):
        problems.append("is not a folder")
    if info.st_uid != os.getuid():
        problems.append(f"belongs to user id {info.st_uid}, not to this user ({os.getuid()})")
    writable = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable:
        who = " and ".join(
            w
            for bit, w in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "others"))
            if writable & bit
        )
        problems.append(f"is writable by {who} (mode {stat.S_IMODE(info.st_mode):04o})")
    if problems:
        raise KernelCacheError(
            f"refusing the native merge-loop {kind} {path}: it {'; it '.join(problems)}. "
            "Whoever can write it can run code in this process; remove it (or `chmod go-w` "
            "what you own) or point $FEDUNLEARN_CACHE_DIR at a private folder"
        )


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
    library = folder / f"merge-loops-{digest}.so"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(folder, "folder")  # an existing folder keeps its mode: checked, not trusted
    if library.is_symlink() or library.exists():
        check_private(library, "library")
        return library
    source = temp_path(folder / f"merge-loops-{digest}.c")
    built = temp_path(library)
    try:
        source.write_text(C_SOURCE)
        subprocess.run(
            [compiler, *_FLAGS, "-x", "c", str(source), "-o", str(built)],
            capture_output=True,
            text=True,
            check=True,
        )
        os.chmod(built, 0o700)  # whatever the umask: the load check refuses group write
        os.replace(built, library)
    finally:
        source.unlink(missing_ok=True)
        built.unlink(missing_ok=True)
    return library


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built C functions (loaded once per process), or ``None`` where they cannot be built.

    Raises :class:`KernelCacheError` when the cache folder or the library is not private to
    this user (see :func:`check_private`): such a library is never loaded.
    """
    compiler = _compiler()
    if compiler is None:
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        log.warning("native merge loops unavailable (inductor kernels used): %s", detail)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int64, argtypes
    return lib


def supported(parts: Sequence[Flat], magnitude: bool) -> bool:
    """Whether :func:`pooled_bracket_counts` takes these flat parts (before building anything)."""
    if not parts or (magnitude and (len(parts) != 1 or parts[0].dtype != torch.float32)):
        return False
    return _flat_supported(parts)


def pooled_bracket_counts(
    parts: Sequence[Flat], magnitude: bool, bounds: tuple[int, int]
) -> tuple[torch.Tensor, int, np.ndarray] | None:
    """``(max v, #{key > hi}, the keys in [lo, hi])`` as ``bracket_counts`` returns them.

    Parts decoded on demand (:class:`~fedunlearn.merging.lazy.FlatSlices`) are decoded slice by
    slice, each slice counted while it is in the cache.  ``None`` where the C function is not
    available, the parts are not supported (see :func:`supported`), or the bracket holds more
    than a sixteenth of some slice (a sample that misrepresents the tensor: the caller's general
    path handles it).
    """
    if not supported(parts, magnitude):
        return None
    lib = library()
    if lib is None:
        return None
    flats = [p if isinstance(p, FlatSlices) else p.contiguous() for p in parts]
    kinds = (ctypes.c_int32 * len(flats))(*[_KINDS[p.dtype] for p in flats])
    lo, hi = bounds

    def count(span: slice) -> tuple[int, int, np.ndarray] | None:
        # a decoded part from entry 0 of its slice, a tensor from the span's start
        start, stop = span.start, span.stop
        if any(isinstance(p, FlatSlices) for p in flats):
            start, stop = 0, stop - start
        pointers = (ctypes.c_void_p * len(flats))(
            *[(p[span] if isinstance(p, FlatSlices) else p).data_ptr() for p in flats]
        )
        cap = (stop - start) // 16 + 64
        out = np.empty(cap, dtype=np.int32)
        above, top = ctypes.c_int64(0), ctypes.c_int32(0)
        n = lib.fedunlearn_bracket(
            pointers, kinds, len(flats), int(magnitude), start, stop, lo, hi,
            out.ctypes.data, cap, ctypes.byref(above), ctypes.byref(top),
        )  # fmt: skip
        return None if n < 0 else (above.value, top.value, out[:n])

    counted = map_spans(count, flats[0].numel(), flats[0].device, chunk=SLICE)
    if any(c is None for c in counted):
        return None
    done = [c for c in counted if c is not None]
    top_key = 0 if magnitude else max(c[1] for c in done)  # magnitudes report no maximum
    top = torch.tensor([top_key], dtype=torch.int32).view(torch.float32)[0]
    keys = np.concatenate([c[2] for c in done]).astype(np.int64)
    return top, sum(c[0] for c in done), keys


def _flat_supported(tensors: Sequence[Flat]) -> bool:
    """Whether every tensor is a flat bfloat16 / float32 CPU tensor (or decoded slices) of the
    first's length."""
    d = tensors[0].numel()
    return all(
        t.dtype in _KINDS
        and t.device.type == "cpu"
        and (isinstance(t, FlatSlices) or t.dim() == 1)
        and t.numel() == d
        for t in tensors
    )


def gather_support(
    base: torch.Tensor, fishers: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[int]] | None:
    """``(idx, base[idx], [F̃_k[idx]…], bad)`` over the flat ``base`` and ``fishers``.

    ``idx`` (int64, ascending) are the positions where some ``F̃_k > 0`` and ``base ≠ 0``; the
    gathered values are float32 (exact: the inputs are bfloat16 or float32); ``bad`` lists the
    ``k`` whose ``F̃_k`` has an entry that is negative, infinite or NaN (then the rest is not
    meaningful).  ``None`` where the C function is not available or an input is not a flat
    bfloat16 / float32 CPU tensor of ``base``'s length.
    """
    rows = [base, *fishers]
    if not fishers or not _flat_supported(rows):
        return None
    lib = library()
    if lib is None:
        return None
    rows = [r.contiguous() for r in rows]
    m = len(fishers)
    pointers = (ctypes.c_void_p * m)(*[r.data_ptr() for r in rows[1:]])
    kinds = (ctypes.c_int32 * m)(*[_KINDS[r.dtype] for r in rows[1:]])

    def gather(span: slice) -> tuple[int, list[torch.Tensor]]:
        size = span.stop - span.start
        idx = torch.empty(size, dtype=torch.int64)
        cols = torch.empty((m + 1, size), dtype=torch.float32)
        outs = (ctypes.c_void_p * m)(*[cols[k + 1].data_ptr() for k in range(m)])
        bad = ctypes.c_int64(0)
        n = lib.fedunlearn_support(
            rows[0].data_ptr(), _KINDS[rows[0].dtype], pointers, kinds, m, span.start,
            span.stop, idx.data_ptr(), cols[0].data_ptr(), outs, ctypes.byref(bad),
        )  # fmt: skip
        return bad.value, [idx[:n], *cols[:, :n]]

    parts = map_spans(gather, base.numel(), base.device, chunk=SLICE)
    flags = 0
    for bad, _ in parts:
        flags |= bad
    joined = _joined([cols for _, cols in parts], base.device)
    bad_rows = [k for k in range(m) if flags >> min(k, 63) & 1]
    return joined[0], joined[1], joined[2:], bad_rows


def _joined(parts: list[list[torch.Tensor]], device: torch.device) -> list[torch.Tensor]:
    """``[torch.cat(column) for column in zip(*parts)]``, the parts copied in over the threads."""
    sizes = [p[0].numel() for p in parts]
    starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    joined = [torch.empty(starts[-1], dtype=col.dtype) for col in parts[0]]

    def place(span: slice) -> None:
        for i in range(span.start, span.stop):
            for out, col in zip(joined, parts[i], strict=True):
                out[starts[i] : starts[i + 1]] = col

    map_spans(place, len(parts), device, chunk=1)
    return joined


def unmask(packed: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> int | None:
    """Spread ``values`` over the set bits of the packed mask ``packed`` (entry j → bit j % 8
    of byte j / 8, as ``fedunlearn.upload_codec.pack_mask`` packs it) into the flat float32
    ``out``, zeros elsewhere: ``out[mask] = values`` for the first ``out.numel()`` bits.

    Returns the number of set bits, and writes ``out`` only when it equals ``values.numel()``
    (the caller reports a mismatch); ``None`` where the C functions are not available or an
    input is not a contiguous CPU tensor of its dtype (uint8, float32, float32).
    """
    numel = out.numel()
    if not (
        packed.dtype == torch.uint8
        and values.dtype == torch.float32
        and out.dtype == torch.float32
        and packed.numel() * 8 >= numel
        and all(t.device.type == "cpu" and t.is_contiguous() for t in (packed, values, out))
    ):
        return None
    lib = library()
    if lib is None:
        return None
    bits = packed.data_ptr()

    def count(span: slice) -> int:
        return int(lib.fedunlearn_mask_count(bits, span.start, span.stop))

    counts = map_spans(count, numel, out.device, chunk=SLICE)
    total = sum(counts)
    if total != values.numel():
        return total
    firsts = np.concatenate([[0], np.cumsum(counts)]).tolist()
    value_ptr, out_ptr = values.data_ptr(), out.data_ptr()

    def spread(span: slice) -> None:
        first = value_ptr + 4 * firsts[span.start // SLICE]
        lib.fedunlearn_unmask(bits, first, span.start, span.stop, out_ptr)

    map_spans(spread, numel, out.device, chunk=SLICE)
    return total


def mask_counts(packed: torch.Tensor, numel: int, chunk: int) -> list[int] | None:
    """The set bits of the packed mask among entries ``[i·chunk, (i+1)·chunk)`` for every
    chunk of ``range(numel)`` (the last one shorter); ``None`` where the C functions are not
    available or ``packed`` is not a contiguous CPU uint8 tensor."""
    if not (packed.dtype == torch.uint8 and packed.device.type == "cpu" and packed.is_contiguous()):
        return None
    lib = library()
    if lib is None:
        return None
    bits = packed.data_ptr()
    # one thread: counting reads an eighth of a byte per entry, less than a dispatch costs
    return [
        int(lib.fedunlearn_mask_count(bits, start, min(start + chunk, numel)))
        for start in range(0, numel, chunk)
    ]


def unmask_span(
    packed: torch.Tensor, values: torch.Tensor, first: int, start: int, out: torch.Tensor
) -> int | None:
    """:func:`unmask` of the entries ``[start, start + out.numel())`` alone (``start`` a
    multiple of 8): ``values[first:]`` spread over their set bits into ``out``. Returns the
    values taken; ``None`` where the C functions are not available or an input is not a
    contiguous CPU tensor of its dtype. The caller makes sure ``values`` holds them all."""
    if not (
        start % 8 == 0
        and packed.dtype == torch.uint8
        and values.dtype == torch.float32
        and out.dtype == torch.float32
        and all(t.device.type == "cpu" and t.is_contiguous() for t in (packed, values, out))
    ):
        return None
    lib = library()
    if lib is None:
        return None
    bits = packed.data_ptr() + start // 8
    return int(
        lib.fedunlearn_unmask(bits, values.data_ptr() + 4 * first, 0, out.numel(), out.data_ptr())
    )


def unmask_at(
    packed: torch.Tensor, values: torch.Tensor, first: int, start: int, picks: slice
) -> torch.Tensor | None:
    """The entries ``picks`` (a forward slice, counted from entry ``start``, a multiple of 8) of
    ``values[first:]`` spread over the set bits of ``packed`` from entry ``start`` on, as a new
    float32 tensor: what ``unmask_span`` would write there, without the entries between.
    ``None`` where the C functions are not available or an input is not a contiguous CPU
    tensor of its dtype."""
    if not (
        start % 8 == 0
        and packed.dtype == torch.uint8
        and values.dtype == torch.float32
        and all(t.device.type == "cpu" and t.is_contiguous() for t in (packed, values))
    ):
        return None
    lib = library()
    if lib is None:
        return None
    count = len(range(picks.start, picks.stop, picks.step))
    out = torch.empty(count, dtype=torch.float32)
    bits = packed.data_ptr() + start // 8
    lib.fedunlearn_unmask_at(
        bits, values.data_ptr() + 4 * first, picks.start, picks.stop, picks.step, out.data_ptr()
    )
    return out


#: Most Fishers :func:`pool_kept` pools at once (the C loop's per-Fisher counters).
MAX_POOLED = 64


def pool_kept(fishers: Sequence[KeptEntries], numel: int) -> torch.Tensor | None:
    """The values of the float32 mean of top-k Fishers at the union of their masks, in entry
    order: every entry outside the union is 0 in every Fisher, so the mean's non-zero entries
    are all among these (what a threshold of the pooled Fisher needs, without decoding it).

    ``fishers`` are the top-k Fishers' masks and values (:class:`KeptEntries`, of ``numel``
    entries each); the mean is taken with the merges' float32 operations, so the values are
    bit for bit those of the decoded Fishers' mean there.  ``None`` where the C functions are
    not available, more than :data:`MAX_POOLED` Fishers are pooled or an input is not a
    contiguous CPU tensor of its dtype.
    """
    lib = _pooling_library(fishers)
    if lib is None:
        return None
    n = len(fishers)
    packed = (ctypes.c_void_p * n)(*[f.packed.data_ptr() for f in fishers])

    def count(span: slice) -> int:
        return int(lib.fedunlearn_union_count(packed, n, span.start, span.stop))

    counts = map_spans(count, numel, torch.device("cpu"), chunk=SLICE)
    starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
    out = torch.empty(int(starts[-1]), dtype=torch.float32)

    def pool(span: slice) -> None:
        at = [f.values.data_ptr() + 4 * f.firsts[span.start // CHUNK] for f in fishers]
        values = (ctypes.c_void_p * n)(*at)
        index = span.start // SLICE
        target = out.data_ptr() + 4 * starts[index]
        lib.fedunlearn_pool_kept(packed, values, n, span.start, span.stop, counts[index], target)

    map_spans(pool, numel, torch.device("cpu"), chunk=SLICE)
    return out


def _pooling_library(fishers: Sequence[KeptEntries]) -> ctypes.CDLL | None:
    """The C functions, where they pool these top-k Fishers: at most :data:`MAX_POOLED`, each a
    contiguous CPU uint8 mask and float32 values; else None."""
    if not (
        0 < len(fishers) <= MAX_POOLED
        and all(
            f.packed.dtype == torch.uint8
            and f.values.dtype == torch.float32
            and all(t.device.type == "cpu" and t.is_contiguous() for t in (f.packed, f.values))
            for f in fishers
        )
    ):
        return None
    return library()


def pool_unmask_span(fishers: Sequence[KeptEntries], start: int, out: torch.Tensor) -> bool:
    """Write to the flat float32 ``out`` the entries ``[start, start + out.numel())`` (``start``
    a multiple of 8) of the float32 mean of top-k Fishers, decoded from their masks and values in
    one pass (bit for bit the merges' mean of the decoded Fishers, as :func:`pool_kept`).

    Returns False, writing nothing, where the C functions are not available, an input is not a
    contiguous CPU tensor of its dtype or more than :data:`MAX_POOLED` Fishers are pooled.
    """
    lib = _pooling_library(fishers)
    if lib is None or start % 8 or not (out.dtype == torch.float32 and out.is_contiguous()):
        return False
    n, chunk_start = len(fishers), start - start % CHUNK
    packed = (ctypes.c_void_p * n)(*[f.packed.data_ptr() for f in fishers])
    firsts = [
        f.firsts[chunk_start // CHUNK]
        + int(lib.fedunlearn_mask_count(f.packed.data_ptr(), chunk_start, start))
        for f in fishers
    ]
    values = (ctypes.c_void_p * n)(
        *[f.values.data_ptr() + 4 * first for f, first in zip(fishers, firsts, strict=True)]
    )
    lib.fedunlearn_pool_unmask(packed, values, n, start, start + out.numel(), out.data_ptr())
    return True
