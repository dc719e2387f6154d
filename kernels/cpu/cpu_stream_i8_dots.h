/* The streamed decode attention (cpu_stream_attention.h) over an int8 pool with the query in
 * int8 too, on AVX-512 VNNI CPUs: Q.K as integer dot products (vpdpbusd), as llama.cpp takes
 * them for a q8_0 K cache.
 *
 * Widening each key row to float32 and multiplying it by every head's query was most of an
 * int8 step's attention work: at 7.7k keys it ran below the bytes' bound that bfloat16 rows
 * reach. Here a head dim of 64 is one 64-byte load per key and one vpdpbusd per query head
 * and 4 bytes of 16 keys. Each query head is rounded to int8 once per range with a scale of its own (amax / 127,
 * round-half-even, the torch twin: kv_int8_ref.quantize_query); vpdpbusd multiplies unsigned
 * by signed bytes, so each key byte is read + 128 (a xor) and 128 * sum(q), once a range and
 * head, taken off. The integer sums are exact (|q.k| <= 256 * 127 * 127 < 2^24, so their
 * float32 widening is exact too); score = dot * k scale * q scale * softmax scale. A block's 16
 * key rows are transposed as dwords once for all the heads (transpose16_epi32), so that each
 * head's 16 scores come out of its vpdpbusd as one vector, widened once. The values are summed
 * in integers too (cpu_stream_i8_values.h).
 */
#ifndef ASYNCENGINE_CPU_STREAM_I8_DOTS_H
#define ASYNCENGINE_CPU_STREAM_I8_DOTS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kv.h"
#include "cpu_simd.h"
#include "cpu_stream_attention.h"
#include "cpu_stream_i8_values.h"

#if defined(ATTN_STREAM) && KV_IS_I8 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define STREAM_I8_DOTS 1

/* Whether the query of heads of dim d takes the integer dot products (stream_fits first) */
static inline int stream_i8_dots(int64_t d) { return d % 64 == 0; }

/* q [heads, d] -> qi [heads, d] = round(q / qs), qs [heads] = amax / 127 and qb [heads] = 128
 * sum(qi) per head (a head of zeros: qs 0, qi 0). 16 lanes at a time (d is a multiple of 64):
 * it runs once a range, and at ~100 keys a range is short enough for it to show. The same bits
 * as the torch twin: an IEEE division and a round-half-even each. */
static inline void quantize_query_i8(const float *q, int64_t heads, int64_t d, int8_t *qi,
                                     float *qs, int32_t *qb) {
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (int64_t h = 0; h < heads; h++) {
        const float *x = q + h * d;
        __m512 m = _mm512_setzero_ps();
        for (int64_t j = 0; j < d; j += 16) /* a NaN lane ignored, as fabsf(x) > amax was */
            m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + j)), m);
        const float s = _mm512_reduce_max_ps(m) / 127.0f;
        qs[h] = s;
        if (!(s > 0.0f)) {
            memset(qi + h * d, 0, (size_t)d);
            qb[h] = 0;
            continue;
        }
        const __m512 sv = _mm512_set1_ps(s);
        __m512i sum = _mm512_setzero_si512();
        for (int64_t j = 0; j < d; j += 16) {
            __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + j), sv),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512i r32 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
            sum = _mm512_add_epi32(sum, r32);
            _mm_storeu_si128((__m128i *)(qi + h * d + j), _mm512_cvtepi32_epi8(r32));
        }
        qb[h] = 128 * _mm512_reduce_add_epi32(sum);
    }
}

/* stream_keys with integer Q.K and P.V: qi / qs / qb the G heads' quantized query
 * (quantize_query_i8), d = 64 NB; acc in I8V_SLOT order (stream_values_i8). Each 64 bytes of
 * the block's 16 key rows are read and flipped once for all the heads and transposed as
 * dwords (t[j] lane i: key i's dims 4 j .. 4 j + 3), so that a head's 16 scores are 16
 * vpdpbusd against its query's dwords broadcast, in 4 chains, and no reduction after them
 * (a reduction of 16 vectors a head, the rows flipped once per head, was ~1.15x slower over
 * 8,000 keys: the attention alone at SmolLM2's 9 / 3 heads). */
static inline __attribute__((always_inline)) void stream_keys_i8(const int8_t *qi,
                                                                 const float *qs,
                                                                 const int32_t *qb, const int G,
                                                                 const int NB,
                                                                 const kv_t *const *k,
                                                                 const kv_t *const *v, int n,
                                                                 float scale, float softcap,
                                                                 float *acc, float *mx,
                                                                 __m512 *lsum) {
    const int64_t d = 64 * NB;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const kv_t *rows[STREAM_KEYS];
    for (int i = 0; i < STREAM_KEYS; i++) rows[i] = i < n ? k[i] : (const kv_t *)I8V_ZERO_ROW;
    const __mmask16 valid = n >= STREAM_KEYS ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    const __m512 kscale = _mm512_mul_ps(i8_row_scales(rows, d), _mm512_set1_ps(scale));
    __m512i dots[STREAM_MAX_GROUP];
    for (int g = 0; g < G; g++) dots[g] = _mm512_set1_epi32(-qb[g]);
    for (int c = 0; c < NB; c++) { /* a 64-dim chunk of every head at a time */
        __m512i t[STREAM_KEYS];
        for (int i = 0; i < STREAM_KEYS; i++)
            t[i] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(rows[i] + 64 * c)), flip);
        transpose16_epi32(t);
        for (int g = 0; g < G; g++) {
            const int8_t *qg = qi + g * d + 64 * c;
            __m512i a[4];
            for (int e = 0; e < 4; e++) a[e] = _mm512_setzero_si512();
            for (int j = 0; j < 16; j++) {
                int32_t w;
                memcpy(&w, qg + 4 * j, sizeof w);
                a[j & 3] = _mm512_dpbusd_epi32(a[j & 3], t[j], _mm512_set1_epi32(w));
            }
            dots[g] = _mm512_add_epi32(dots[g], _mm512_add_epi32(_mm512_add_epi32(a[0], a[1]),
                                                                 _mm512_add_epi32(a[2], a[3])));
        }
    }
    __m512 sc[STREAM_MAX_GROUP];
    for (int g = 0; g < G; g++) {
        __m512 s = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dots[g]), kscale),
                                 _mm512_set1_ps(qs[g]));
        if (softcap > 0.0f) s = soft_cap512(s, softcap); /* as stream_keys */
        sc[g] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s);
    }
    stream_values_i8(G, NB, sc, v, n, acc, mx, lsum);
}

typedef void (*stream_i8_fn)(const int8_t *, const float *, const int32_t *, const kv_t *const *,
                             const kv_t *const *, int, float, float, float *, float *, __m512 *);

#define DEFINE_STREAM_I8(G, NB)                                                                  \
    static void stream_i8_##G##_##NB(const int8_t *qi, const float *qs, const int32_t *qb,       \
                                     const kv_t *const *k, const kv_t *const *v, int n,          \
                                     float scale, float softcap, float *acc, float *mx,          \
                                     __m512 *lsum) {                                             \
        stream_keys_i8(qi, qs, qb, G, NB, k, v, n, scale, softcap, acc, mx, lsum);               \
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
static void stream_i8_any(const int8_t *qi, const float *qs, const int32_t *qb, int G, int NB,
                          const kv_t *const *k, const kv_t *const *v, int n, float scale,
                          float softcap, float *acc, float *mx, __m512 *lsum) {
    stream_keys_i8(qi, qs, qb, G, NB, k, v, n, scale, softcap, acc, mx, lsum);
}

/* stream_keys_i8 of gc heads of dim d (stream_fits and stream_i8_dots) */
static inline void stream_block_i8(const int8_t *qi, const float *qs, const int32_t *qb,
                                   int64_t gc, int64_t d, const kv_t *const *k,
                                   const kv_t *const *v, int n, float scale, float softcap,
                                   float *acc, float *mx, __m512 *lsum) {
    const stream_i8_fn *table = d == 64 ? STREAM_I8_64 : d == 128 ? STREAM_I8_128 : NULL;
    if (table != NULL)
        table[gc - 1](qi, qs, qb, k, v, n, scale, softcap, acc, mx, lsum);
    else
        stream_i8_any(qi, qs, qb, (int)gc, (int)(d / 64), k, v, n, scale, softcap, acc, mx, lsum);
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
