/* Batched LoRA on the activations: for each segment of rows that share an adapter,
 * ``y[row] += B (A x[row])`` (shrink to the adapter's rank, then expand), so the base weights
 * stay as stored (quantized or not). A is [R, in] and B is given transposed, Bt [R, out] (the
 * scaling folded in), so the expand streams whole rows of Bt; B is zero outside ``slices``
 * (out_start, out_end, rank_start, rank_end): a fused q/k/v or gate/up projection expands each
 * part from its own rank block only. x and y are float32 or bfloat16 rows (strided), A and Bt
 * float32 or bfloat16 (a bfloat16 model keeps its adapters in bfloat16: half the bytes a decode
 * step streams); the sums are float32 and y is rounded once.
 *
 * The torch twin is kernels/reference/lora_ref.py; the binding is kernels/cpu/lora_native.py.
 * Built by kernels/cpu/cpu_native.py (cc -O3 -march=native -fopenmp).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cpu_simd.h"
#include "cpu_step_lora.h"

/* rows x rank x (in + out) multiply-adds below which one thread does the whole call */
#define PARALLEL_MIN_WORK 262144

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8(const void *p, int bf16, int64_t i) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + i);
    const __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

static inline float load1(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* sum of w[i] * x[i]: x float32, w float32 or bfloat16 */
static inline float dot(const float *x, const void *w, int w_bf16, int64_t n) {
    int64_t i = 0;
    float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), load8(w, w_bf16, i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), load8(w, w_bf16, i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8)
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), load8(w, w_bf16, i), acc0);
    __m256 acc = _mm256_add_ps(acc0, acc1);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    sum = _mm_cvtss_f32(s);
#endif
    for (; i < n; i++) sum += x[i] * load1(w, w_bf16, i);
    return sum;
}

/* acc[i] += t * w[i] over n: w float32 or bfloat16 */
static inline void axpy(float *acc, float t, const void *w, int w_bf16, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 tv = _mm256_set1_ps(t);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(acc + i,
                         _mm256_fmadd_ps(tv, load8(w, w_bf16, i), _mm256_loadu_ps(acc + i)));
#endif
    for (; i < n; i++) acc[i] += t * load1(w, w_bf16, i);
}

static void one_row(void *y, const void *x, int bf16, const void *a, const void *bt, int w_bf16,
                    int64_t in, int64_t out, int64_t rank, const int32_t *slices, int n_slices,
                    float *xf, float *t, float *acc) {
    const size_t wsize = w_bf16 ? 2 : 4;
    const float *xr = (const float *)x;
    if (bf16) {
        const uint16_t *xh = (const uint16_t *)x;
        for (int64_t i = 0; i < in; i++) xf[i] = bf16_to_float(xh[i]);
        xr = xf;
    }
    for (int64_t r = 0; r < rank; r++) t[r] = dot(xr, (const char *)a + r * in * wsize, w_bf16, in);
    for (int s = 0; s < n_slices; s++) {
        const int32_t o0 = slices[4 * s], o1 = slices[4 * s + 1];
        const int32_t r0 = slices[4 * s + 2], r1 = slices[4 * s + 3];
        for (int32_t o = o0; o < o1; o++) acc[o - o0] = 0.0f;
        for (int32_t r = r0; r < r1; r++)
            axpy(acc, t[r], (const char *)bt + ((int64_t)r * out + o0) * wsize, w_bf16, o1 - o0);
        if (bf16) {
            uint16_t *yh = (uint16_t *)y;
            for (int32_t o = o0; o < o1; o++)
                yh[o] = float_to_bf16(bf16_to_float(yh[o]) + acc[o - o0]);
        } else {
            float *yf = (float *)y;
            for (int32_t o = o0; o < o1; o++) yf[o] += acc[o - o0];
        }
    }
}

/* segments: n_segments (start, end) pairs of row indices; rows of one call share one adapter.
 * Returns 0, or -1 when its scratch memory could not be allocated (nothing written then). */
int asyncengine_lora_apply(void *y, int64_t y_stride, const void *x, int64_t x_stride, int bf16,
                           const void *a, const void *bt, int w_bf16, int64_t in, int64_t out,
                           int64_t rank, const int64_t *segments, int64_t n_segments,
                           const int32_t *slices, int n_slices, int threads) {
    int64_t n_rows = 0;
    for (int64_t s = 0; s < n_segments; s++) n_rows += segments[2 * s + 1] - segments[2 * s];
    if (n_rows == 0) return 0;
    const int parallel =
        threads > 1 && n_rows > 1 && n_rows * rank * (in + out) >= PARALLEL_MIN_WORK;
    const int team = parallel ? threads : 1;
    const int64_t per_thread = in + rank + out;
    int64_t *rows = (int64_t *)malloc((size_t)n_rows * sizeof(int64_t));
    float *scratch = (float *)malloc((size_t)team * (size_t)per_thread * sizeof(float));
    if (rows == NULL || scratch == NULL) {
        free(rows);
        free(scratch);
        return -1;
    }
    int64_t k = 0;
    for (int64_t s = 0; s < n_segments; s++)
        for (int64_t row = segments[2 * s]; row < segments[2 * s + 1]; row++) rows[k++] = row;
    const size_t esize = bf16 ? 2 : 4;
#pragma omp parallel num_threads(team) if (team > 1)
    {
        float *xf = scratch + (size_t)omp_get_thread_num() * (size_t)per_thread;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_rows; i++) {
            const int64_t row = rows[i];
            one_row((char *)y + row * y_stride * esize, (const char *)x + row * x_stride * esize,
                    bf16, a, bt, w_bf16, in, out, rank, slices, n_slices, xf, xf + in,
                    xf + in + rank);
        }
    }
    free(rows);
    free(scratch);
    return 0;
}

/* ------------------------------------------------------------------------------------------ */

/* Every adapter's rows of one projection in one call (the layer-by-layer path's decode rows):
 * row i of n gets the update lora->adapters[row_adapter[i]][slot] (cpu_step_lora.h; -1 or a
 * NULL update: nothing), rows of one adapter LORA_ROWS at a time (one pass over its weights),
 * the groups split over the threads where the work is worth it. ``out``: the projection's output
 * features. Returns 0, -1 when scratch could not be allocated, -2 when an update's shape is not
 * in x out (nothing written then). */
int asyncengine_lora_apply_table(void *y, int64_t y_stride, const void *x, int64_t x_stride,
                                 int bf16, const lora_desc *lora, int64_t slot, int64_t n,
                                 int64_t in, int64_t out, int threads) {
    (void)n;
    int64_t work = 0, n_groups = 0;
    for (int64_t g = 0; g < lora->n_order; g++) {
        const lora_proj *p = &lora->adapters[lora->row_adapter[lora->order[g]]][slot];
        if (p->a == NULL) continue;
        if (p->in != in || p->out != out) return -2;
        work += p->rank * (in + out);
    }
    if (work == 0) return 0;
    int64_t *groups = (int64_t *)malloc((size_t)lora->n_order * sizeof(int64_t));
    if (groups == NULL) return -1;
    for (int64_t g = 0; g < lora->n_order; g += lora_group(lora, g)) groups[n_groups++] = g;
    const int team = threads > 1 && n_groups > 1 && work >= PARALLEL_MIN_WORK ? threads : 1;
    /* per thread: the rank sums, and for bfloat16 rows their float32 activations and updates */
    const int64_t per_thread = LORA_ROWS * (lora->max_rank + (bf16 ? in + out : 0));
    float *scratch = (float *)malloc((size_t)team * (size_t)per_thread * sizeof(float));
    if (scratch == NULL) {
        free(groups);
        return -1;
    }
    const size_t esize = bf16 ? 2 : 4;
#pragma omp parallel num_threads(team) if (team > 1)
    {
        float *t = scratch + (size_t)omp_get_thread_num() * (size_t)per_thread;
        float *xf = t + LORA_ROWS * lora->max_rank, *delta = xf + LORA_ROWS * in;
#pragma omp for schedule(static)
        for (int64_t gi = 0; gi < n_groups; gi++) {
            const int64_t g = groups[gi];
            const int m = lora_group(lora, g);
            const lora_proj *p = &lora->adapters[lora->row_adapter[lora->order[g]]][slot];
            if (p->a == NULL) continue;
            const float *xs[LORA_ROWS];
            float *ys[LORA_ROWS];
            for (int j = 0; j < m; j++) {
                const int64_t i = lora->order[g + j];
                const char *xr = (const char *)x + i * x_stride * esize;
                if (!bf16) {
                    xs[j] = (const float *)xr;
                    ys[j] = (float *)((char *)y + i * y_stride * esize);
                    continue;
                }
                float *xj = xf + j * in, *dj = delta + j * out;
                const uint16_t *xh = (const uint16_t *)xr;
                int64_t e = 0;
#if defined(LORA_AVX512)
                for (; e + 16 <= in; e += 16) _mm512_storeu_ps(xj + e, load_bf16x16(xh + e));
#endif
                for (; e < in; e++) xj[e] = bf16_to_float(xh[e]);
                memset(dj, 0, (size_t)out * sizeof(float));
                xs[j] = xj;
                ys[j] = dj;
            }
            lora_add_rows(p, lora->w_bf16, xs, ys, m, 0, out, t);
            for (int j = 0; bf16 && j < m; j++) { /* rounded once, as one_row */
                uint16_t *yh = (uint16_t *)((char *)y + lora->order[g + j] * y_stride * esize);
                for (int64_t s = 0; s < p->n_slices; s++) {
                    int64_t o = p->slices[4 * s];
                    const int64_t end = p->slices[4 * s + 1];
#if defined(LORA_AVX512)
                    for (; o + 16 <= end; o += 16)
                        _mm256_storeu_si256((__m256i *)(yh + o),
                                            to_bf16x16(_mm512_add_ps(load_bf16x16(yh + o),
                                                                     _mm512_loadu_ps(ys[j] + o))));
#endif
                    for (; o < end; o++) yh[o] = float_to_bf16(bf16_to_float(yh[o]) + ys[j][o]);
                }
            }
        }
    }
    free(scratch);
    free(groups);
    return 0;
}
