/* The streamed decode attention (cpu_stream_attention.h) over an int8 pool with the query in
 * int8 too, on AVX-512 VNNI CPUs: Q.K as integer dot products (vpdpbusd), as llama.cpp takes
 * them for a q8_0 K cache.
 *
 * Widening each key row to float32 and multiplying it by every head's query was most of an
 * int8 step's attention work: at 7.7k keys it ran below the bytes' bound that bfloat16 rows
 * reach. Here a head dim of 64 is one 64-byte load per key and one vpdpbusd per query head.
 * Each query head is rounded to int8 once per range with a scale of its own (amax / 127,
 * round-half-even, the torch twin: kv_int8_ref.quantize_query); vpdpbusd multiplies unsigned
 * by signed bytes, so the query is stored + 128 and 128 * sum(k) (one more vpdpbusd a key,
 * shared by the heads) taken off. The integer sums are exact (|q.k| <= 256 * 127 * 127 < 2^24,
 * so their float32 reduction is exact too); score = dot * k scale * q scale * softmax scale.
 * The values are summed in float32 as before (stream_values).
 */
#ifndef ASYNCENGINE_CPU_STREAM_I8_DOTS_H
#define ASYNCENGINE_CPU_STREAM_I8_DOTS_H

#include <math.h>
#include <stdint.h>

#include "cpu_kv.h"
#include "cpu_simd.h"
#include "cpu_stream_attention.h"

#if defined(ATTN_STREAM) && KV_IS_I8 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define STREAM_I8_DOTS 1

/* Whether the query of heads of dim d takes the integer dot products (stream_fits first) */
static inline int stream_i8_dots(int64_t d) { return d % 64 == 0; }

/* q [heads, d] -> qu [heads, d] = round(q / qs) + 128 and qs [heads] = amax / 127 per head
 * (a head of zeros: qs 0, every byte 128) */
static inline void quantize_query_i8(const float *q, int64_t heads, int64_t d, uint8_t *qu,
                                     float *qs) {
    for (int64_t h = 0; h < heads; h++) {
        const float *x = q + h * d;
        float amax = 0.0f;
        for (int64_t j = 0; j < d; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
        const float s = amax / 127.0f;
        qs[h] = s;
        for (int64_t j = 0; j < d; j++) {
            float r = s > 0.0f ? nearbyintf(x[j] / s) : 0.0f;
            r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
            qu[h * d + j] = (uint8_t)((int)r + 128);
        }
    }
}

/* stream_keys with integer Q.K: qu / qs the G heads' quantized query (quantize_query_i8), d =
 * 64 NB */
static inline __attribute__((always_inline)) void stream_keys_i8(const uint8_t *qu,
                                                                 const float *qs, const int G,
                                                                 const int NB,
                                                                 const kv_t *const *k,
                                                                 const kv_t *const *v, int n,
                                                                 float scale, float *acc,
                                                                 float *mx, __m512 *lsum) {
    const int64_t d = 64 * NB;
    const __m512i zero = _mm512_setzero_si512(), bias = _mm512_set1_epi8((char)0x80);
    __m512 part[STREAM_MAX_GROUP][STREAM_KEYS];
    for (int i = 0; i < STREAM_KEYS; i++) {
        if (i >= n) {
            for (int g = 0; g < G; g++) part[g][i] = _mm512_setzero_ps();
            continue;
        }
        __m512i kr[4], corr = zero;
        for (int j = 0; j < NB; j++) {
            kr[j] = _mm512_loadu_si512((const void *)(k[i] + 64 * j));
            corr = _mm512_dpbusd_epi32(corr, bias, kr[j]);
        }
        const __m512i start = _mm512_sub_epi32(zero, corr);
        for (int g = 0; g < G; g++) {
            __m512i a = start;
            for (int j = 0; j < NB; j++)
                a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512((const void *)(qu + g * d + 64 * j)),
                                        kr[j]);
            part[g][i] = _mm512_cvtepi32_ps(a);
        }
    }
    const __mmask16 valid = n >= STREAM_KEYS ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    float ks[STREAM_KEYS] = {0};
    for (int i = 0; i < n; i++) ks[i] = kv_row_scale(k[i], d);
    const __m512 kscale = _mm512_mul_ps(_mm512_loadu_ps(ks), _mm512_set1_ps(scale));
    __m512 sc[STREAM_MAX_GROUP];
    for (int g = 0; g < G; g++)
        sc[g] = _mm512_mask_mov_ps(
            _mm512_set1_ps(-INFINITY), valid,
            _mm512_mul_ps(_mm512_mul_ps(reduce16(part[g]), kscale), _mm512_set1_ps(qs[g])));
    stream_values(G, 4 * NB, sc, v, n, acc, mx, lsum);
}

typedef void (*stream_i8_fn)(const uint8_t *, const float *, const kv_t *const *,
                             const kv_t *const *, int, float, float *, float *, __m512 *);

#define DEFINE_STREAM_I8(G, NB)                                                                  \
    static void stream_i8_##G##_##NB(const uint8_t *qu, const float *qs, const kv_t *const *k,   \
                                     const kv_t *const *v, int n, float scale, float *acc,       \
                                     float *mx, __m512 *lsum) {                                  \
        stream_keys_i8(qu, qs, G, NB, k, v, n, scale, acc, mx, lsum);                            \
    }
#define DEFINE_STREAM_I8_GROUPS(NB)                                                              \
    DEFINE_STREAM_I8(1, NB) DEFINE_STREAM_I8(2, NB) DEFINE_STREAM_I8(3, NB)                      \
    DEFINE_STREAM_I8(4, NB) DEFINE_STREAM_I8(5, NB) DEFINE_STREAM_I8(6, NB)                      \
    DEFINE_STREAM_I8(7, NB) DEFINE_STREAM_I8(8, NB)
DEFINE_STREAM_I8_GROUPS(1)
DEFINE_STREAM_I8_GROUPS(2)
#define STREAM_I8_TABLE(NB)                                                                      \
    {stream_i8_1_##NB, stream_i8_2_##NB, stream_i8_3_##NB, stream_i8_4_##NB,                     \
     stream_i8_5_##NB, stream_i8_6_##NB, stream_i8_7_##NB, stream_i8_8_##NB}
static const stream_i8_fn STREAM_I8_64[8] = STREAM_I8_TABLE(1);
static const stream_i8_fn STREAM_I8_128[8] = STREAM_I8_TABLE(2);

/* head dims 192 and 256: the same steps, not unrolled */
static void stream_i8_any(const uint8_t *qu, const float *qs, int G, int NB,
                          const kv_t *const *k, const kv_t *const *v, int n, float scale,
                          float *acc, float *mx, __m512 *lsum) {
    stream_keys_i8(qu, qs, G, NB, k, v, n, scale, acc, mx, lsum);
}

/* stream_keys_i8 of gc heads of dim d (stream_fits and stream_i8_dots) */
static inline void stream_block_i8(const uint8_t *qu, const float *qs, int64_t gc, int64_t d,
                                   const kv_t *const *k, const kv_t *const *v, int n,
                                   float scale, float *acc, float *mx, __m512 *lsum) {
    const stream_i8_fn *table = d == 64 ? STREAM_I8_64 : d == 128 ? STREAM_I8_128 : NULL;
    if (table != NULL)
        table[gc - 1](qu, qs, k, v, n, scale, acc, mx, lsum);
    else
        stream_i8_any(qu, qs, (int)gc, (int)(d / 64), k, v, n, scale, acc, mx, lsum);
}
#endif

/* 1 where this build's int8 decode attention takes the query in int8 for a head dim that
 * stream_i8_dots takes (the tests' reference quantizes it the same way there) */
int asyncengine_kv_i8_query_dots(void) {
#ifdef STREAM_I8_DOTS
    return 1;
#else
    return 0;
#endif
}

#endif
