/* The value sum of the streamed int8 decode attention (cpu_stream_i8_dots.h) in integer dot
 * products (vpdpbusd), as its Q.K is: widening each int8 value row to float32 and a
 * multiply-add per head and 16 dims was most of an int8 step's attention work once Q.K was
 * integer.
 *
 * Per block of up to 16 keys and head, the weights w = exp(s - max) * the row's value scale
 * are rounded to 16 bits against the block's largest (u = round(w * 65535 / max w), the
 * largest exact) and split in a high and a low byte. Four keys' value rows are interleaved
 * byte by byte (v_quad: 2 unpacks a key), so one vpdpbusd adds 4 keys' products for 16 dims;
 * the high and low bytes' sums (exact int32) are joined, widened and scaled by max w / 65535
 * once a block. A weight moves by at most 1 / 131070 of the block's largest, so the output by
 * ~1e-6 of the values' magnitude: float32 rounding's order, far below the int8 rows' own.
 *
 * The interleaving leaves the 16 dims of one vpdpbusd as 4 dims of each 128-bit lane:
 * accumulator dim 16 m + 4 L + e holds dim 16 L + 4 m + e of each 64 (I8V_SLOT); a range's
 * float32 accumulator is kept in that order and put back once at its end (i8_unpermute).
 */
#ifndef ASYNCENGINE_CPU_STREAM_I8_VALUES_H
#define ASYNCENGINE_CPU_STREAM_I8_VALUES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kv.h"
#include "cpu_simd.h"
#include "cpu_stream_attention.h"

#if defined(ATTN_STREAM) && KV_IS_I8 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define STREAM_I8_VALUES 1

/* the accumulator's place of dim j (of a head of a multiple of 64 dims) */
#define I8V_SLOT(j) (((j) & ~63) + (((j) >> 2) & 3) * 16 + (((j) >> 4) & 3) * 4 + ((j) & 3))

/* the rows a block lacks (keys past n) read as zeros, their scale too: their weight is 0 */
static const int8_t I8V_ZERO_ROW[256 + KV_ROW_EXTRA] __attribute__((aligned(64)));

/* the scales of a block's 16 rows of d values (i8_row_scales), as 16 lanes: the 16 bits of
 * each in a scalar load, widened together (a float a row took 4 instructions) */
static inline __attribute__((always_inline)) __m512 i8_row_scales(const kv_t *const *rows,
                                                                  int64_t d) {
    uint16_t bits[STREAM_KEYS];
    for (int i = 0; i < STREAM_KEYS; i++) memcpy(&bits[i], rows[i] + d, sizeof bits[i]);
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bits));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* 4 keys' 64 bytes each -> x[m]: per 128-bit lane L, dword e = the 4 keys' bytes of dim
 * 16 L + 4 m + e */
static inline __attribute__((always_inline)) void v_quad(const kv_t *r0, const kv_t *r1,
                                                         const kv_t *r2, const kv_t *r3,
                                                         __m512i *x) {
    const __m512i a = _mm512_loadu_si512((const void *)r0), b = _mm512_loadu_si512((const void *)r1);
    const __m512i c = _mm512_loadu_si512((const void *)r2), e = _mm512_loadu_si512((const void *)r3);
    const __m512i ab_lo = _mm512_unpacklo_epi8(a, b), ab_hi = _mm512_unpackhi_epi8(a, b);
    const __m512i ce_lo = _mm512_unpacklo_epi8(c, e), ce_hi = _mm512_unpackhi_epi8(c, e);
    x[0] = _mm512_unpacklo_epi16(ab_lo, ce_lo);
    x[1] = _mm512_unpackhi_epi16(ab_lo, ce_lo);
    x[2] = _mm512_unpacklo_epi16(ab_hi, ce_hi);
    x[3] = _mm512_unpackhi_epi16(ab_hi, ce_hi);
}

/* stream_values over int8 rows with the value sum in integers: the G heads (dim 64 NB) after
 * the block's n <= 16 keys, acc in I8V_SLOT order */
static inline __attribute__((always_inline)) void stream_values_i8(const int G, const int NB,
                                                                   const __m512 *sc,
                                                                   const kv_t *const *v, int n,
                                                                   float *acc, float *mx,
                                                                   __m512 *lsum) {
    const int64_t d = 64 * NB;
    const __mmask16 valid = n >= STREAM_KEYS ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    const kv_t *rows[STREAM_KEYS];
    for (int i = 0; i < STREAM_KEYS; i++) rows[i] = i < n ? v[i] : (const kv_t *)I8V_ZERO_ROW;
    const __m512 vscale = i8_row_scales(rows, d);
    /* each head's 16 weights as bytes, 4 keys a dword: hi[g][t] keys 4t .. 4t + 3 */
    uint32_t hi[STREAM_MAX_GROUP][4] __attribute__((aligned(16)));
    uint32_t lo[STREAM_MAX_GROUP][4] __attribute__((aligned(16)));
    float step[STREAM_MAX_GROUP];
    for (int g = 0; g < G; g++) {
        const __m512 e = stream_softmax_block(sc[g], valid, acc + g * d, 4 * NB, &mx[g], &lsum[g]);
        const __m512 w = _mm512_mul_ps(e, vscale);
        const float wmax = _mm512_reduce_max_ps(w);
        step[g] = wmax / 65535.0f;
        const __m512 up = _mm512_set1_ps(wmax > 0.0f ? 65535.0f / wmax : 0.0f);
        __m512i u = _mm512_cvtps_epu32(_mm512_mul_ps(w, up)); /* nearest even */
        u = _mm512_min_epu32(u, _mm512_set1_epi32(65535));
        _mm_store_si128((__m128i *)lo[g], _mm512_cvtepi32_epi8(_mm512_and_si512(u, _mm512_set1_epi32(255))));
        _mm_store_si128((__m128i *)hi[g], _mm512_cvtepi32_epi8(_mm512_srli_epi32(u, 8)));
    }
    for (int c = 0; c < NB; c++) { /* a 64-dim chunk of every head at a time */
        __m512i x[4][4]; /* the block's 4 quads, interleaved once for all the heads */
        for (int t = 0; t < 4; t++)
            v_quad(rows[4 * t] + 64 * c, rows[4 * t + 1] + 64 * c, rows[4 * t + 2] + 64 * c,
                   rows[4 * t + 3] + 64 * c, x[t]);
        for (int g = 0; g < G; g++) {
            /* the high bytes' sums, shifted, then the low bytes' added: (hi << 8) + lo in one
             * accumulator (< 2^31: 16 keys of 65535 * 127) */
            __m512i a[4];
            for (int m = 0; m < 4; m++) a[m] = _mm512_setzero_si512();
            for (int t = 0; t < 4; t++) {
                const __m512i bh = _mm512_set1_epi32((int)hi[g][t]);
                for (int m = 0; m < 4; m++) a[m] = _mm512_dpbusd_epi32(a[m], bh, x[t][m]);
            }
            for (int m = 0; m < 4; m++) a[m] = _mm512_slli_epi32(a[m], 8);
            for (int t = 0; t < 4; t++) {
                const __m512i bl = _mm512_set1_epi32((int)lo[g][t]);
                for (int m = 0; m < 4; m++) a[m] = _mm512_dpbusd_epi32(a[m], bl, x[t][m]);
            }
            const __m512 sv = _mm512_set1_ps(step[g]);
            for (int m = 0; m < 4; m++) {
                float *o = acc + g * d + 64 * c + 16 * m;
                _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m]), sv, _mm512_loadu_ps(o)));
            }
        }
    }
}

/* acc [heads, d] from I8V_SLOT order back to the dims' own */
static inline void i8_unpermute(float *acc, int64_t heads, int64_t d) {
    float t[64];
    for (int64_t off = 0; off < heads * d; off += 64) {
        memcpy(t, acc + off, sizeof t);
        for (int j = 0; j < 64; j++) acc[off + j] = t[I8V_SLOT(j)];
    }
}
#endif

#endif
