/* Log-probabilities of a row of float32 logits without writing the row's log_softmax: the
 * largest logit, its first index and the row's log-sum-exp, from which any token's logprob is
 * ``logit - lse`` and the top one's ``max - lse`` (the same float for a token that is the top
 * one: what lm-evaluation-harness reads as "greedy"). torch's log_softmax + topk over a
 * [rows, vocab] chunk writes and re-reads the whole chunk (5.6 ms for 41 x 49152 on one core);
 * here each row is read twice, the second time from L2 (asyncengine/executor/prompt_logprobs.py).
 *
 * Built by kernels/cpu/cpu_native.py (cc -O3 -march=native -fopenmp).
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>

#include "cpu_simd.h"

#define PARALLEL_MIN_ELEMENTS 65536

static float row_max(const float *x, int64_t n) {
    int64_t i = 0;
    float best = -INFINITY;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    for (int j = 0; j < 8; j++) best = lanes[j] > best ? lanes[j] : best;
#endif
    for (; i < n; i++) best = x[i] > best ? x[i] : best;
    return best;
}

static int64_t first_index_of(const float *x, int64_t n, float value) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 v = _mm256_set1_ps(value);
    for (; i + 8 <= n; i += 8) {
        const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), v, _CMP_EQ_OQ));
        if (mask) return i + __builtin_ctz((unsigned)mask);
    }
#endif
    for (; i < n; i++)
        if (x[i] == value) return i;
    return -1; /* a row of NaN */
}

static float row_sum_exp(const float *x, int64_t n, float shift) {
    int64_t i = 0;
    float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 s = _mm256_set1_ps(shift);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_add_ps(acc0, exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
        acc1 = _mm256_add_ps(acc1, exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), s)));
    }
    sum = hsum256(_mm256_add_ps(acc0, acc1));
#endif
    for (; i < n; i++) sum += expf(x[i] - shift);
    return sum;
}

/* logits [n, vocab] (row stride ``stride`` floats) -> per row max_out, argmax_out (the first
 * index holding the max) and lse_out = max + log(sum(exp(logit - max))) */
void asyncengine_row_max_lse(const float *logits, int64_t n, int64_t vocab, int64_t stride,
                             float *max_out, int64_t *argmax_out, float *lse_out, int threads) {
#pragma omp parallel for num_threads(threads) if (n * vocab >= PARALLEL_MIN_ELEMENTS)
    for (int64_t row = 0; row < n; row++) {
        const float *x = logits + row * stride;
        const float best = row_max(x, vocab);
        max_out[row] = best;
        argmax_out[row] = first_index_of(x, vocab, best);
        lse_out[row] = best + logf(row_sum_exp(x, vocab, best));
    }
}
