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

/* one destination: n rows of a weight in format fmt, k values each (see the top) */
typedef struct {
    int32_t fmt, interleave;
    int64_t n, row_bytes, k;
    const uint8_t *const *rows;
    uint8_t *dst;
} pack_job;

static int64_t job_groups(const pack_job *job) {
    return job->interleave && interleaves(job->fmt) ? job->n / XR : 0;
}

/* chunks of a job: its groups PACK_CHUNK_GROUPS at a time, then its other rows as many */
static int64_t job_chunks(const pack_job *job) {
    const int64_t groups = job_groups(job), tail = job->n - groups * XR;
    return (groups + PACK_CHUNK_GROUPS - 1) / PACK_CHUNK_GROUPS +
           (tail + XR * PACK_CHUNK_GROUPS - 1) / (XR * PACK_CHUNK_GROUPS);
}

static void pack_chunk(const pack_job *job, int64_t c, uint8_t **staging, int64_t *staging_bytes) {
    const int64_t groups = job_groups(job), row_bytes = job->row_bytes;
    const int64_t chunks = (groups + PACK_CHUNK_GROUPS - 1) / PACK_CHUNK_GROUPS;
    if (c < chunks) {
        const int64_t g1 = (c + 1) * PACK_CHUNK_GROUPS < groups ? (c + 1) * PACK_CHUNK_GROUPS
                                                                 : groups;
        for (int64_t g = c * PACK_CHUNK_GROUPS; g < g1; g++) {
            const uint8_t *const *src = job->rows + g * XR;
            uint8_t *out = job->dst + g * XR * row_bytes;
            if (contiguous(src, row_bytes)) {
                interleave_group(job->fmt, src[0], row_bytes, job->k, out, 0);
                continue;
            }
            if (*staging_bytes < XR * row_bytes) {
                free(*staging);
                *staging = malloc((size_t)(XR * row_bytes));
                if (*staging == NULL) abort();
                *staging_bytes = XR * row_bytes;
            }
            for (int r = 0; r < XR; r++)
                memcpy(*staging + r * row_bytes, src[r], (size_t)row_bytes);
            interleave_group(job->fmt, *staging, row_bytes, job->k, out, 0);
        }
        return;
    }
    const int64_t t0 = groups * XR + (c - chunks) * XR * PACK_CHUNK_GROUPS;
    const int64_t t1 = t0 + XR * PACK_CHUNK_GROUPS < job->n ? t0 + XR * PACK_CHUNK_GROUPS : job->n;
    for (int64_t i = t0; i < t1; i++)
        memcpy(job->dst + i * row_bytes, job->rows[i], (size_t)row_bytes);
}

/* Every job's rows into its destination, in one parallel region (one wait for the threads
 * however many projections a model has): the chunks of all jobs handed out in turn. */
void asyncengine_pack_jobs(const pack_job *jobs, int64_t n_jobs, int threads) {
    int64_t *first = malloc((size_t)(n_jobs + 1) * sizeof *first); /* a job's first chunk */
    if (first == NULL) abort();
    first[0] = 0;
    for (int64_t j = 0; j < n_jobs; j++) first[j + 1] = first[j] + job_chunks(&jobs[j]);
    const int64_t total = first[n_jobs];
#pragma omp parallel num_threads(threads) if (total > 1)
    {
        uint8_t *staging = NULL;
        int64_t staging_bytes = 0, j = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < total; c++) {
            if (c < first[j]) j = 0; /* chunks come in rising order per thread; be safe */
            while (c >= first[j + 1]) j++;
            pack_chunk(&jobs[j], c - first[j], &staging, &staging_bytes);
        }
        free(staging);
    }
    free(first);
}
