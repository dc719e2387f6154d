/* The elementwise work of a transformer layer, fused, on the CPU (bfloat16 or float32).
 *
 * Each function does in one pass what the torch references (kernels/reference/<op>_ref.py) do
 * in several ops, rounding to the tensor dtype after the same operations, so it follows them
 * closely: the sum inside an RMS and the exp inside SiLU are computed differently (float32
 * rounding level).
 *
 *   rms_norm            y = w * bf(x * rsqrt(mean(x^2) + eps))           (kernels/reference/norm_ref.py)
 *   add_rms_norm        s = bf(x + r) written over r; y = rms_norm(s)
 *   rotary_store        q, k rotated (neox halves, cos/sin rounded to the dtype first), q to
 *                       q_out, k and v to their cache slots        (rotary_ref + kv_store_ref)
 *   silu_and_mul        y = bf(bf(silu(gate)) * up)                 (kernels/reference/activation_ref.py)
 *
 * "bf(.)" is rounding to bfloat16 (nearest even) for bf16 tensors and nothing for float32.
 * Built with -DKV_F16 (cpu_kv.h), rotary_store writes k and v to a float16 pool (rounded to
 * nearest even) from float32 rows (bf16 must be 0 there); with -DKV_I8 to an int8 pool, each
 * row quantized as rotated and rounded to the dtype (bfloat16 or float32).
 * Built by kernels/cpu/cpu_native.py (cc -O3 -march=native -fopenmp).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "cpu_kv.h"
#include "cpu_silu_row.h"
#include "cpu_simd.h"

#define PARALLEL_MIN_ELEMENTS 65536
#define MAX_ROW 16384

/* a row of any dtype to float32 / back, rounding to the dtype when storing */
static inline void row_load(const void *p, int64_t off, int64_t n, int bf16, float *out) {
    if (!bf16) {
        memcpy(out, (const float *)p + off, (size_t)n * 4);
        return;
    }
    const uint16_t *src = (const uint16_t *)p + off;
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, load_bf16x16(src + i));
#endif
    for (; i < n; i++) out[i] = bf16_to_float(src[i]);
}

static inline void row_store(void *p, int64_t off, int64_t n, int bf16, const float *in) {
    if (!bf16) {
        memcpy((float *)p + off, in, (size_t)n * 4);
        return;
    }
    uint16_t *dst = (uint16_t *)p + off;
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) _mm256_storeu_si256((__m256i *)(dst + i), to_bf16x16(_mm512_loadu_ps(in + i)));
#endif
    for (; i < n; i++) dst[i] = float_to_bf16(in[i]);
}

/* values rounded to bfloat16 in place (float32: nothing) */
static inline void row_round(float *v, int64_t n, int bf16) {
    if (!bf16) return;
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(v + i, round_bf16x16(_mm512_loadu_ps(v + i)));
#endif
    for (; i < n; i++) v[i] = bf16_to_float(float_to_bf16(v[i]));
}

/* y = w * bf(x * inv_rms), x in float32 (already the dtype's values), y to row `row` of out */
static void norm_row(float *x, int64_t h, const float *w, float eps, void *out, int64_t row,
                     int bf16) {
    const float inv = 1.0f / sqrtf(sum_squares(x, h) / (float)h + eps);
    for (int64_t i = 0; i < h; i++) x[i] *= inv;
    row_round(x, h, bf16);
    for (int64_t i = 0; i < h; i++) x[i] *= w[i];
    row_store(out, row * h, h, bf16, x);
}

#ifdef __AVX512F__
/* 16 values of a row as float32 / stored back rounded to the dtype */
static inline __m512 vload(const void *p, int64_t off, int bf16) {
    return bf16 ? load_bf16x16((const uint16_t *)p + off) : _mm512_loadu_ps((const float *)p + off);
}

static inline void vstore(void *p, int64_t off, __m512 v, int bf16) {
    if (bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + off), to_bf16x16(v));
    else
        _mm512_storeu_ps((float *)p + off, v);
}

static inline __m512 vround(__m512 v, int bf16) { return bf16 ? round_bf16x16(v) : v; }

/* single-pass rows (h a multiple of 16): sum of squares, then normalize and store */
static void norm_row_vec(const void *src, int64_t off, int64_t h, const float *w, float eps,
                         void *out, int bf16) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < h; i += 16) {
        const __m512 v = vload(src, off + i, bf16);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)h + eps));
    for (int64_t i = 0; i < h; i += 16) {
        const __m512 normed = vround(_mm512_mul_ps(vload(src, off + i, bf16), inv), bf16);
        vstore(out, off + i, _mm512_mul_ps(normed, _mm512_loadu_ps(w + i)), bf16);
    }
}
#endif

/* y[n, h] = rms_norm(x[n, h]) with weight w[h] (given as float32 values of the dtype) */
void asyncengine_rms_norm(const void *x, const float *w, float eps, void *y, int64_t n, int64_t h,
                          int bf16, int threads) {
#pragma omp parallel for num_threads(threads) if (n * h >= PARALLEL_MIN_ELEMENTS)
    for (int64_t row = 0; row < n; row++) {
#ifdef __AVX512F__
        if (h % 16 == 0) {
            norm_row_vec(x, row * h, h, w, eps, y, bf16);
            continue;
        }
#endif
        float buf[MAX_ROW];
        row_load(x, row * h, h, bf16, buf);
        norm_row(buf, h, w, eps, y, row, bf16);
    }
}

/* s = bf(x + r), written over r; y = rms_norm(s) */
void asyncengine_add_rms_norm(const void *x, void *r, const float *w, float eps, void *y, int64_t n,
                              int64_t h, int bf16, int threads) {
#pragma omp parallel for num_threads(threads) if (n * h >= PARALLEL_MIN_ELEMENTS)
    for (int64_t row = 0; row < n; row++) {
#ifdef __AVX512F__
        if (h % 16 == 0) {
            for (int64_t i = 0; i < h; i += 16) {
                const int64_t o = row * h + i;
                vstore(r, o, vround(_mm512_add_ps(vload(x, o, bf16), vload(r, o, bf16)), bf16), bf16);
            }
            norm_row_vec(r, row * h, h, w, eps, y, bf16);
            continue;
        }
#endif
        float a[MAX_ROW], b[MAX_ROW];
        row_load(x, row * h, h, bf16, a);
        row_load(r, row * h, h, bf16, b);
        for (int64_t i = 0; i < h; i++) a[i] += b[i];
        row_round(a, h, bf16);
        row_store(r, row * h, h, bf16, a);
        norm_row(a, h, w, eps, y, row, bf16);
    }
}

/* one head: x1 = first half, x2 = second; out = (bf(bf(x1 c) - bf(x2 s)), bf(bf(x2 c) + bf(x1 s))) */
static inline void rotate_head(const float *x, const float *c, const float *s, int64_t half,
                               float *out, int bf16) {
    float t1[256], t2[256], t3[256], t4[256];
    for (int64_t i = 0; i < half; i++) {
        t1[i] = x[i] * c[i];
        t2[i] = x[half + i] * s[i];
        t3[i] = x[half + i] * c[i];
        t4[i] = x[i] * s[i];
    }
    row_round(t1, half, bf16);
    row_round(t2, half, bf16);
    row_round(t3, half, bf16);
    row_round(t4, half, bf16);
    for (int64_t i = 0; i < half; i++) {
        out[i] = t1[i] - t2[i];
        out[half + i] = t3[i] + t4[i];
    }
    row_round(out, 2 * half, bf16);
}

/* qkv [n, row_stride]: num_heads q heads from column 0, then num_kv_heads k heads, then as many
 * v heads (d each). positions [n] int64; cos_sin [max_pos, d] float32 (cos | sin halves);
 * slots [n] int64. q_out [n, num_heads, d]; k_cache / v_cache [S, num_kv_heads, d]. */
void asyncengine_rotary_store(const void *qkv, int64_t row_stride, const int64_t *positions,
                              const float *cos_sin, int64_t num_heads, int64_t num_kv_heads,
                              int64_t d, const int64_t *slots, void *q_out, void *k_cache,
                              void *v_cache, int64_t n, int bf16, int threads) {
    const int64_t half = d / 2, width = (num_heads + 2 * num_kv_heads) * d;
#pragma omp parallel for num_threads(threads) if (n * width >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < n; t++) {
        float c[256], s[256], x[MAX_ROW], out[512];
        memcpy(c, cos_sin + positions[t] * d, (size_t)half * 4);
        memcpy(s, cos_sin + positions[t] * d + half, (size_t)half * 4);
        row_round(c, half, bf16);
        row_round(s, half, bf16);
        row_load(qkv, t * row_stride, width, bf16, x);
        for (int64_t h = 0; h < num_heads; h++) {
            rotate_head(x + h * d, c, s, half, out, bf16);
            row_store(q_out, (t * num_heads + h) * d, d, bf16, out);
        }
        const int64_t slot = slots[t];
        for (int64_t h = 0; h < num_kv_heads; h++) {
            rotate_head(x + (num_heads + h) * d, c, s, half, out, bf16);
#if defined(KV_F16) || defined(KV_I8)
            kv_store_row((kv_t *)k_cache + (slot * num_kv_heads + h) * KV_ROW(d), out, d);
            kv_store_row((kv_t *)v_cache + (slot * num_kv_heads + h) * KV_ROW(d),
                         x + (num_heads + num_kv_heads + h) * d, d);
#else
            row_store(k_cache, (slot * num_kv_heads + h) * d, d, bf16, out);
            row_store(v_cache, (slot * num_kv_heads + h) * d, d, bf16,
                      x + (num_heads + num_kv_heads + h) * d);
#endif
        }
    }
}

/* x [n, 2 inter] = gate | up -> y [n, inter] = bf(bf(silu(gate)) * up) (cpu_silu_row.h) */
void asyncengine_silu_and_mul(const void *x, void *y, int64_t n, int64_t inter, int bf16,
                              int threads) {
#pragma omp parallel for num_threads(threads) if (n * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t row = 0; row < n; row++)
        silu_mul_row(x, row, inter, bf16,
                     bf16 ? (void *)((uint16_t *)y + row * inter) : (void *)((float *)y + row * inter),
                     1);
}
