/* Batched LoRA on the activations: for each segment of rows that share an adapter,
 * ``y[row] += B (A x[row])`` (shrink to the adapter's rank, then expand), so the base weights
 * stay as stored (quantized or not). A is [R, in] and B [out, R] in float32 (the scaling folded
 * into B); B is zero outside ``slices`` (out_start, out_end, rank_start, rank_end): a fused
 * q/k/v or gate/up projection expands each part from its own rank block only. x and y are
 * float32 or bfloat16 rows (strided); the sums are float32 and y is rounded once.
 *
 * The torch twin is kernels/reference/lora_ref.py; the binding is kernels/cpu/lora_native.py.
 * Built by asyncengine/kernels/cpu_native.py (cc -O3 -march=native -fopenmp).
 */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#include "cpu_simd.h"

/* rows x (in + out) multiply-adds below which one thread does the whole call */
#define PARALLEL_MIN_WORK 262144

static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8)
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    __m256 acc = _mm256_add_ps(acc0, acc1);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    sum = _mm_cvtss_f32(s);
#endif
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static void one_row(void *y, const void *x, int bf16, const float *a, const float *b, int64_t in,
                    int64_t rank, const int32_t *slices, int n_slices, float *xf, float *t) {
    const float *xr = (const float *)x;
    if (bf16) {
        const uint16_t *xh = (const uint16_t *)x;
        for (int64_t i = 0; i < in; i++) xf[i] = bf16_to_float(xh[i]);
        xr = xf;
    }
    for (int64_t r = 0; r < rank; r++) t[r] = dot(xr, a + r * in, in);
    for (int s = 0; s < n_slices; s++) {
        const int32_t o0 = slices[4 * s], o1 = slices[4 * s + 1];
        const int32_t r0 = slices[4 * s + 2], r1 = slices[4 * s + 3];
        for (int32_t o = o0; o < o1; o++) {
            const float delta = dot(b + (int64_t)o * rank + r0, t + r0, r1 - r0);
            if (bf16) {
                uint16_t *yh = (uint16_t *)y;
                yh[o] = float_to_bf16(bf16_to_float(yh[o]) + delta);
            } else {
                ((float *)y)[o] += delta;
            }
        }
    }
}

/* segments: n_segments (start, end) pairs of row indices; rows of one call share one adapter.
 * Returns 0, or -1 when its scratch memory could not be allocated (nothing written then). */
int asyncengine_lora_apply(void *y, int64_t y_stride, const void *x, int64_t x_stride, int bf16,
                           const float *a, const float *b, int64_t in, int64_t out, int64_t rank,
                           const int64_t *segments, int64_t n_segments, const int32_t *slices,
                           int n_slices, int threads) {
    int64_t n_rows = 0;
    for (int64_t s = 0; s < n_segments; s++) n_rows += segments[2 * s + 1] - segments[2 * s];
    if (n_rows == 0) return 0;
    const int parallel =
        threads > 1 && n_rows > 1 && n_rows * rank * (in + out) >= PARALLEL_MIN_WORK;
    const int team = parallel ? threads : 1;
    int64_t *rows = (int64_t *)malloc((size_t)n_rows * sizeof(int64_t));
    float *scratch = (float *)malloc((size_t)team * (size_t)(in + rank) * sizeof(float));
    if (rows == NULL || scratch == NULL) {
        free(rows);
        free(scratch);
        return -1;
    }
    int64_t k = 0;
    for (int64_t s = 0; s < n_segments; s++)
        for (int64_t row = segments[2 * s]; row < segments[2 * s + 1]; row++) rows[k++] = row;
    const size_t esize = bf16 ? 2 : 4;
#pragma omp parallel num_threads(team)
    {
        float *xf = scratch + (size_t)omp_get_thread_num() * (size_t)(in + rank);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_rows; i++) {
            const int64_t row = rows[i];
            one_row((char *)y + row * y_stride * esize, (const char *)x + row * x_stride * esize,
                    bf16, a, b, in, rank, slices, n_slices, xf, xf + in);
        }
    }
    free(rows);
    free(scratch);
    return 0;
}
