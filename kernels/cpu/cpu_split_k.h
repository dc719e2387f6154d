/* Split-K decode attention (as flash-decoding does): when a step has too few (request, kv head)
 * items to keep every thread busy, each item's keys are cut into ranges that run as items of
 * their own; each range leaves its online-softmax state (the unnormalized sum of exp(s - max) v,
 * the max and the sum of exp(s - max) per query head), and the range that finishes last merges
 * them. Used by the fused decode step (cpu_group_attention.h) and the paged decode kernel
 * (cpu_decode_attention.c). */
#ifndef ASYNCENGINE_CPU_SPLIT_K_H
#define ASYNCENGINE_CPU_SPLIT_K_H

#include <math.h>
#include <stdint.h>

/* keys of a range at least (fewer: the merge costs more than the balance gives), ranges of an
 * item at most. Measured by scripts/micro/bench_decode_step.py --batches 1 --context 8192 (and
 * 1024) and scripts/micro/bench_cpu_attention.py --shapes 1x8192,1x1024. */
#define SPLIT_MIN_KEYS 256
#define MAX_SPLITS 16

/* ranges for `units` items of up to `longest` keys on `threads` threads (the count the step is
 * planned for, not its team: the ranges set the merge's rounding, and a step's bits must not
 * depend on the team that runs it, plan_threads.py): enough for 4 items a
 * thread, each of SPLIT_MIN_KEYS keys at least; 1 (no split) where that leaves fewer than 2.
 * Where it can, the items' count is a multiple of the threads (3 units of 3 ranges on 2 threads
 * left one thread 5 ranges to the other's 4: a step ~10% longer than an even share). */
static inline int64_t split_count(int64_t units, int64_t longest, int64_t threads) {
    if (units <= 0 || units >= 4 * threads) return 1;
    int64_t splits = (4 * threads + units - 1) / units;
    while (threads > 1 && (units * splits) % threads != 0 && splits < MAX_SPLITS) splits++;
    if (splits > longest / SPLIT_MIN_KEYS) splits = longest / SPLIT_MIN_KEYS;
    if (splits > MAX_SPLITS) splits = MAX_SPLITS;
    return splits < 2 ? 1 : splits;
}

/* Split-K (flash-decoding): the states of `splits` key ranges of the same heads, each
 * ATTN_PART(heads, d) floats (acc [heads, d], then mx [heads], then sum [heads]), merged into
 * out [heads, d]: each range's sum and acc rescaled to the largest max. */
#define ATTN_PART(heads, d) ((heads) * ((d) + 2))
static void merge_ranges(const float *parts, int64_t splits, int64_t heads, int64_t d,
                         float *out) {
    const int64_t stride = ATTN_PART(heads, d);
    for (int64_t g = 0; g < heads; g++) {
        float top = -INFINITY, total = 0.0f;
        for (int64_t r = 0; r < splits; r++) {
            const float m = parts[r * stride + heads * d + g];
            top = m > top ? m : top;
        }
        float *o = out + g * d;
        for (int64_t j = 0; j < d; j++) o[j] = 0.0f;
        if (top == -INFINITY) continue;
        for (int64_t r = 0; r < splits; r++) {
            const float *part = parts + r * stride;
            const float m = part[heads * d + g];
            if (m == -INFINITY) continue;
            const float w = expf(m - top);
            total += part[heads * d + heads + g] * w;
            for (int64_t j = 0; j < d; j++) o[j] += part[g * d + j] * w;
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t j = 0; j < d; j++) o[j] *= inv;
    }
}

#endif
