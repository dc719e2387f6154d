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
 * of the source map and of the destination.
 *
 * Also at load: IQ4_NL tensors rewritten as Q8_0 blocks of the same values
 * (asyncengine_widen_q8_0, at the end). Built by kernels/cpu/cpu_native.py. */
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

/* GGUF blocks whose values are small integers times the block's fp16 scale, rewritten as Q8_0
 * blocks of exactly those values (the same scale, each integer as an int8): ggml's type id */
enum { GGML_IQ4_NL = 20 };

/* ggml's kvalues_iq4nl */
static const int8_t iq4_nl_levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                         1,    13,   25,  38,  53,  69,  89,  113};

/* 18 bytes: fp16 d, 16 bytes of nibbles indexing iq4_nl_levels (value j in byte j % 16, low
 * half for j < 16) */
static void widen_iq4_nl(const uint8_t *src, int64_t n, uint8_t *dst) {
    for (int64_t b = 0; b < n; b++, src += 18, dst += 2 + QK) {
        const uint8_t *qs = src + 2;
        int8_t *q = (int8_t *)(dst + 2);
        dst[0] = src[0], dst[1] = src[1];
        for (int j = 0; j < QK / 2; j++) {
            q[j] = iq4_nl_levels[qs[j] & 0x0F];
            q[j + QK / 2] = iq4_nl_levels[qs[j] >> 4];
        }
    }
}

/* n_blocks blocks of ggml type `type`, block_bytes each, at src as n_blocks Q8_0 blocks (34
 * bytes) at dst. One thread: a 1B model's tensor takes ~1 ms, less than waking a parallel
 * region's threads on a busy machine (two threads on two loaded cores: 20x as long).
 * Returns 1, or 0 (nothing read or written) for a type it does not take or the wrong size. */
int asyncengine_widen_q8_0(int32_t type, const uint8_t *src, int64_t n_blocks,
                           int64_t block_bytes, uint8_t *dst) {
    if (type == GGML_IQ4_NL && block_bytes == 18)
        widen_iq4_nl(src, n_blocks, dst);
    else
        return 0;
    return 1;
}
