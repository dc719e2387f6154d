/* Weights packed at load: the rows of a projection gathered from where they lie (a GGUF file's
 * memory map, q/k rows in another order, q/k/v or gate/up side by side) and written once into
 * their final place, in the interleaved groups the batch-1 kernels read
 * (cpu_quant_blocks.h: interleave_group, the one definition of that layout).
 *
 *   rows[i]  the address of output row i's bytes (row_bytes of them, as GGUF stores a row)
 *   dst      n * row_bytes bytes: the first n / XR * XR rows in groups of XR when `interleave`
 *            and the format has groups, the rest row by row as stored
 *
 * One pass over the source bytes: a group whose 8 rows lie one after another in the source (a
 * plain tensor) is interleaved straight from it; a gathered group's rows are first put side by
 * side in a small buffer of this thread's (8 rows: a few KiB, in L1/L2), then interleaved.
 * Parallel over chunks of groups, handed out as threads come free (a loaded machine's
 * descheduled thread then delays no one); each thread's first touches fault in its own pages,
 * of the source map and of the destination. Built by kernels/cpu/cpu_native.py. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cpu_quant_blocks.h"

/* groups per chunk a thread takes at once: ~0.3-1 MB of a 1B model's rows */
#define PACK_CHUNK_GROUPS 32

static int contiguous(const uint8_t *const *rows, int64_t row_bytes) {
    for (int r = 1; r < XR; r++)
        if (rows[r] != rows[0] + r * row_bytes) return 0;
    return 1;
}

void asyncengine_pack_rows(int fmt, const uint8_t *const *rows, int64_t n, int64_t row_bytes,
                           int64_t k, int interleave, uint8_t *dst, int threads) {
    const int64_t grouped = interleave && interleaves(fmt) ? n / XR * XR : 0;
    const int64_t groups = grouped / XR;
    const int64_t chunks = (groups + PACK_CHUNK_GROUPS - 1) / PACK_CHUNK_GROUPS;
    const int64_t tail_rows = n - grouped;
    /* the tail rows (all rows when nothing is grouped) in chunks of 8 rows too */
    const int64_t tail_chunks = (tail_rows + XR * PACK_CHUNK_GROUPS - 1) / (XR * PACK_CHUNK_GROUPS);
#pragma omp parallel num_threads(threads) if (chunks + tail_chunks > 1)
    {
        uint8_t *staging = NULL;
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t c = 0; c < chunks + tail_chunks; c++) {
            if (c < chunks) {
                const int64_t g1 = (c + 1) * PACK_CHUNK_GROUPS < groups
                                       ? (c + 1) * PACK_CHUNK_GROUPS : groups;
                for (int64_t g = c * PACK_CHUNK_GROUPS; g < g1; g++) {
                    const uint8_t *const *src = rows + g * XR;
                    uint8_t *out = dst + g * XR * row_bytes;
                    if (contiguous(src, row_bytes)) {
                        interleave_group(fmt, src[0], row_bytes, k, out, 0);
                        continue;
                    }
                    if (staging == NULL) staging = malloc((size_t)(XR * row_bytes));
                    if (staging == NULL) abort();
                    for (int r = 0; r < XR; r++)
                        memcpy(staging + r * row_bytes, src[r], (size_t)row_bytes);
                    interleave_group(fmt, staging, row_bytes, k, out, 0);
                }
            } else {
                const int64_t t0 = grouped + (c - chunks) * XR * PACK_CHUNK_GROUPS;
                const int64_t t1 = t0 + XR * PACK_CHUNK_GROUPS < n ? t0 + XR * PACK_CHUNK_GROUPS : n;
                for (int64_t i = t0; i < t1; i++)
                    memcpy(dst + i * row_bytes, rows[i], (size_t)row_bytes);
            }
        }
        free(staging);
    }
}
