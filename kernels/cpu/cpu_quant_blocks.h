/* The quantized block formats' dot products (one weight row against up to NR int8 activation
 * rows), shared by kernels/cpu/cpu_quant_matmul.c (the per-projection products) and
 * kernels/cpu/cpu_decode_step.c (the fused decode step). The formats and the scheme are described
 * at the top of cpu_quant_matmul.c. */
#ifndef ASYNCENGINE_CPU_QUANT_BLOCKS_H
#define ASYNCENGINE_CPU_QUANT_BLOCKS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

#if !defined(Q_FORCE_SCALAR) && (defined(__AVX2__) || defined(__AVX512F__))
#include <immintrin.h>
#endif

#if defined(Q_FORCE_SCALAR)
#define Q_ISA_SCALAR 1
#elif !defined(Q_FORCE_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q_ISA_VNNI 1
#define Q_ISA_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q_ISA_AVX2 1
#define Q_ISA_SIMD 1
#else
#define Q_ISA_SCALAR 1
#endif

#if defined(__GNUC__)
#define Q_ALWAYS_INLINE __attribute__((always_inline))
#define Q_NOINLINE __attribute__((noinline))
#else
#define Q_ALWAYS_INLINE
#define Q_NOINLINE
#endif

enum { FMT_Q8_0 = 0, FMT_Q4_0 = 1, FMT_Q4_1 = 2, FMT_Q4_K = 3, FMT_Q5_K = 4, FMT_Q6_K = 5, FMT_I8 = 6,
       FMT_F32 = 7, FMT_BF16 = 8, FMT_Q5_0 = 9, FMT_Q5_1 = 10 };

/* whether fmt holds plain floating-point rows (F32, BF16): they meet the float32 activation rows
 * (act_row.f), not their q8 form */
static inline int float_rows(int fmt) { return fmt == FMT_F32 || fmt == FMT_BF16; }

/* The 4- and 5-bit formats of 32 values a block share their kernels: has_min (Q4_1, Q5_1: an
 * fp16 min m after d, value d q + m; else d (q - 8) or d (q - 16)) and has_high (Q5_0, Q5_1: 4
 * bytes qh before the nibbles, bit j the fifth bit of value j) */
static inline int q4_family(int fmt) {
    return fmt == FMT_Q4_0 || fmt == FMT_Q4_1 || fmt == FMT_Q5_0 || fmt == FMT_Q5_1;
}
static inline int has_min_of(int fmt) { return fmt == FMT_Q4_1 || fmt == FMT_Q5_1; }
static inline int has_high_of(int fmt) { return fmt == FMT_Q5_0 || fmt == FMT_Q5_1; }
/* a block's bytes, where its nibbles start, and the offset (times d) without a min */
static inline int64_t q4_block_bytes(int has_min, int has_high) {
    return 18 + 2 * has_min + 4 * has_high;
}
static inline int64_t q4_qs_at(int has_min, int has_high) { return 2 + 2 * has_min + 4 * has_high; }
static inline float q4_mid(int has_high) { return has_high ? 16.0f : 8.0f; }

#define QK 32        /* activation block */
#define QK_K 256     /* K-format super-block */
#define ROW_TILE 16  /* weight rows a thread takes at a time */
#define NR 4         /* activation rows sharing a weight block */

static inline float fp16_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(Q_ISA_SIMD)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        exp = 113;
        while (!(mant & 0x400u)) {
            mant <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* 32 float32 values -> int8 q (d = max|v| / 127, q = round(v / d)), d and d * sum(q) */
static inline void quantize_block_q8(const float *v, int8_t *q, float *d, float *sd) {
#if defined(Q_ISA_SIMD)
    /* the scalar loop below, 8 values at a time: the same products and roundings (to nearest
     * even), so the same bytes; a batch-1 step quantizes ~100k values per thread */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 x[4], mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        x[j] = _mm256_loadu_ps(v + 8 * j);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, x[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i qi[4];
    for (int j = 0; j < 4; j++)
        qi[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(x[j], inv),
                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i total = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    /* int32 -> int8 keeping the order: packs work per 128-bit lane, the permute undoes that */
    const __m256i w01 = _mm256_packs_epi32(qi[0], qi[1]), w23 = _mm256_packs_epi32(qi[2], qi[3]);
    const __m256i b = _mm256_packs_epi16(w01, w23);
    _mm256_storeu_si256((__m256i *)q,
                        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *d = amax / 127.0f;
    *sd = *d * (float)_mm_cvtsi128_si32(t4);
#else
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(v[j]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK; j++) {
        const int qv = (int)nearbyintf(v[j] * inv);
        q[j] = (int8_t)qv;
        sum += qv;
    }
    *d = amax / 127.0f;
    *sd = *d * (float)sum;
#endif
}

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes */
static inline void k_scale_min(int j, const uint8_t *s, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* SIMD helpers                                                                              */

#if defined(Q_ISA_SIMD)
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(Q_ISA_VNNI)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* signed w times signed x: |w| (u8) times x with w's sign */
static inline __m256i dot_s8s8(__m256i w, __m256i x) {
    return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* 16 bytes of nibbles -> 32 bytes: low nibbles (elements 0..15), then high (16..31) */
static inline __m256i unpack_nibbles16(const uint8_t *p) {
    const __m128i t = _mm_loadu_si128((const __m128i *)p);
    const __m256i v = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

/* a Q5 block's 32 fifth bits (bit j: element j) -> 32 bytes, 16 where the bit is set: with
 * AVX-512 BW the bits are a byte mask as they stand; else each byte takes its bit's byte of qh
 * (shuffle), every other bit forced to 1 (or), all ones then means the bit was set (cmpeq) */
static inline __m256i high_bits16(const uint8_t *qh) {
    int32_t h;
    memcpy(&h, qh, 4);
#if defined(Q_ISA_VNNI) && defined(__AVX512BW__)
    return _mm256_maskz_mov_epi8((__mmask32)(uint32_t)h, _mm256_set1_epi8(16));
#else
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(h), _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                0x0101010101010101, 0x0000000000000000));
    const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
#endif
}

/* a | (b & 16 in every byte): a 4-bit value joined by its fifth bit (at bit 4 of b) */
static inline __m256i or_bit4(__m256i a, __m256i b) {
#if defined(Q_ISA_VNNI)
    return _mm256_ternarylogic_epi32(a, b, _mm256_set1_epi8(16), 0xF8);
#else
    return _mm256_or_si256(a, _mm256_and_si256(b, _mm256_set1_epi8(16)));
#endif
}
#endif

/* ------------------------------------------------------------------------------------------ */
/* one weight row against nr (<= NR) activation rows                                          */

typedef struct {
    const int8_t *q;  /* row i's int8 values */
    const float *d;   /* its block scales */
    const float *sd;  /* its block sums times scale */
    const float *f;   /* its float32 values (F32 / BF16 weights read these, not the q8 form) */
} act_row;

static inline void row_q8_0(const uint8_t *w, int64_t nb, const act_row *a, int nr, float *out) {
#if defined(Q_ISA_SIMD)
    __m256 acc[NR];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 34) {
        const float dw = fp16_to_float(w);
        const __m256i wq = _mm256_loadu_si256((const __m256i *)(w + 2));
        const __m256i wabs = _mm256_sign_epi8(wq, wq);
        for (int r = 0; r < nr; r++) {
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(a[r].q + b * QK));
            const __m256i p = dot_u8s8(wabs, _mm256_sign_epi8(xq, wq));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * a[r].d[b]), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) out[r] = hsum(acc[r]);
#else
    for (int r = 0; r < nr; r++) out[r] = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 34) {
        const float dw = fp16_to_float(w);
        const int8_t *wq = (const int8_t *)(w + 2);
        for (int r = 0; r < nr; r++) {
            const int8_t *xq = a[r].q + b * QK;
            int s = 0;
            for (int j = 0; j < QK; j++) s += wq[j] * xq[j];
            out[r] += dw * a[r].d[b] * (float)s;
        }
    }
#endif
}

/* Q4_0 (has_min = 0: offset -8 d) and Q4_1 (has_min = 1: offset m); with has_high Q5_0
 * (offset -16 d) and Q5_1 */
static inline void row_q4(const uint8_t *w, int64_t nb, const act_row *a, int nr, float *out,
                          int has_min, int has_high) {
    const int64_t bytes = q4_block_bytes(has_min, has_high);
    float off_acc[NR];
    for (int r = 0; r < nr; r++) off_acc[r] = 0.0f;
#if defined(Q_ISA_SIMD)
    __m256 acc[NR];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
#else
    for (int r = 0; r < nr; r++) out[r] = 0.0f;
#endif
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        const float dw = fp16_to_float(w);
        const float offset = has_min ? fp16_to_float(w + 2) : -q4_mid(has_high) * dw;
        const uint8_t *qh = w + 2 + 2 * has_min, *qs = w + q4_qs_at(has_min, has_high);
#if defined(Q_ISA_SIMD)
        __m256i wq = unpack_nibbles16(qs);
        if (has_high) wq = _mm256_or_si256(wq, high_bits16(qh));
        for (int r = 0; r < nr; r++) {
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(a[r].q + b * QK));
            const __m256i p = dot_u8s8(wq, xq);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * a[r].d[b]), acc[r]);
            off_acc[r] += offset * a[r].sd[b];
        }
#else
        for (int r = 0; r < nr; r++) {
            const int8_t *xq = a[r].q + b * QK;
            int s = 0;
            for (int j = 0; j < 16; j++) {
                int lo = qs[j] & 0xF, hi = qs[j] >> 4;
                if (has_high) {
                    lo |= ((qh[j / 8] >> (j % 8)) & 1) << 4;
                    hi |= ((qh[2 + j / 8] >> (j % 8)) & 1) << 4;
                }
                s += lo * xq[j] + hi * xq[j + 16];
            }
            out[r] += dw * a[r].d[b] * (float)s;
            off_acc[r] += offset * a[r].sd[b];
        }
#endif
    }
#if defined(Q_ISA_SIMD)
    for (int r = 0; r < nr; r++) out[r] = hsum(acc[r]) + off_acc[r];
#else
    for (int r = 0; r < nr; r++) out[r] += off_acc[r];
#endif
}

/* Q4_K (has_high = 0) and Q5_K (has_high = 1): per super-block of 256, 4 chunks of 64 whose
 * bytes hold sub-block 2c in the low nibbles and 2c + 1 in the high ones */
static inline void row_qk45(const uint8_t *w, int64_t nsb, const act_row *a, int nr, float *out,
                            int has_high) {
    const int64_t bytes = has_high ? 176 : 144;
    float off_acc[NR];
    for (int r = 0; r < nr; r++) off_acc[r] = 0.0f;
#if defined(Q_ISA_SIMD)
    __m256 acc[NR];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
#else
    for (int r = 0; r < nr; r++) out[r] = 0.0f;
#endif
    for (int64_t s = 0; s < nsb; s++, w += bytes) {
        const float d = fp16_to_float(w), dmin = fp16_to_float(w + 2);
        const uint8_t *scales = w + 4;
        const uint8_t *qh = has_high ? w + 16 : NULL;
        const uint8_t *qs = w + (has_high ? 48 : 16);
        for (int c = 0; c < 4; c++) {
            int sc_lo, m_lo, sc_hi, m_hi;
            k_scale_min(2 * c, scales, &sc_lo, &m_lo);
            k_scale_min(2 * c + 1, scales, &sc_hi, &m_hi);
            const int64_t b_lo = s * 8 + 2 * c, b_hi = b_lo + 1;
#if defined(Q_ISA_SIMD)
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            const __m256i mask = _mm256_set1_epi8(0x0F);
            __m256i lo = _mm256_and_si256(raw, mask);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
            if (has_high) {
                const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
                const __m256i bit_lo = _mm256_set1_epi8((char)(1 << (2 * c)));
                const __m256i bit_hi = _mm256_set1_epi8((char)(2 << (2 * c)));
                const __m256i sixteen = _mm256_set1_epi8(16);
                lo = _mm256_or_si256(lo, _mm256_and_si256(
                    _mm256_cmpeq_epi8(_mm256_and_si256(h, bit_lo), bit_lo), sixteen));
                hi = _mm256_or_si256(hi, _mm256_and_si256(
                    _mm256_cmpeq_epi8(_mm256_and_si256(h, bit_hi), bit_hi), sixteen));
            }
            for (int r = 0; r < nr; r++) {
                const __m256i x_lo = _mm256_loadu_si256((const __m256i *)(a[r].q + b_lo * QK));
                const __m256i x_hi = _mm256_loadu_si256((const __m256i *)(a[r].q + b_hi * QK));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(lo, x_lo)),
                                         _mm256_set1_ps(d * (float)sc_lo * a[r].d[b_lo]), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(hi, x_hi)),
                                         _mm256_set1_ps(d * (float)sc_hi * a[r].d[b_hi]), acc[r]);
                off_acc[r] -= dmin * ((float)m_lo * a[r].sd[b_lo] + (float)m_hi * a[r].sd[b_hi]);
            }
#else
            const uint8_t *q = qs + 32 * c;
            for (int r = 0; r < nr; r++) {
                const int8_t *x_lo = a[r].q + b_lo * QK, *x_hi = a[r].q + b_hi * QK;
                int s_lo = 0, s_hi = 0;
                for (int l = 0; l < 32; l++) {
                    int v_lo = q[l] & 0xF, v_hi = q[l] >> 4;
                    if (has_high) {
                        v_lo += (qh[l] & (1 << (2 * c))) ? 16 : 0;
                        v_hi += (qh[l] & (2 << (2 * c))) ? 16 : 0;
                    }
                    s_lo += v_lo * x_lo[l];
                    s_hi += v_hi * x_hi[l];
                }
                out[r] += d * (float)sc_lo * a[r].d[b_lo] * (float)s_lo +
                          d * (float)sc_hi * a[r].d[b_hi] * (float)s_hi;
                off_acc[r] -= dmin * ((float)m_lo * a[r].sd[b_lo] + (float)m_hi * a[r].sd[b_hi]);
            }
#endif
        }
    }
#if defined(Q_ISA_SIMD)
    for (int r = 0; r < nr; r++) out[r] = hsum(acc[r]) + off_acc[r];
#else
    for (int r = 0; r < nr; r++) out[r] += off_acc[r];
#endif
}

/* Q6_K: per super-block two halves of 128; in a half, group g (0..3) of 32 values takes its low
 * 4 bits from ql (bytes 0..31 or 32..63, low or high nibble) and 2 high bits from qh, and the
 * sub-scales sc[2g] (first 16) and sc[2g + 1] (last 16) */
static inline void row_q6_k(const uint8_t *w, int64_t nsb, const act_row *a, int nr, float *out) {
#if defined(Q_ISA_SIMD)
    __m256 acc[NR];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
#else
    for (int r = 0; r < nr; r++) out[r] = 0.0f;
#endif
    for (int64_t s = 0; s < nsb; s++, w += 210) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        const float d = fp16_to_float(w + 208);
        for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8) {
#if defined(Q_ISA_SIMD)
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
            const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
            const __m256i k32 = _mm256_set1_epi8(32);
            __m256i g[4];
            g[0] = _mm256_or_si256(_mm256_and_si256(l0, m4),
                                   _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
            g[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                   _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
            g[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                   _mm256_and_si256(h, m30));
            g[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
            for (int gi = 0; gi < 4; gi++) {
                const __m256i wq = _mm256_sub_epi8(g[gi], k32);
                const __m256i wabs = _mm256_sign_epi8(wq, wq);
                const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(sc[2 * gi + 1]),
                                                     _mm_set1_epi16(sc[2 * gi]));
                const int64_t b = s * 8 + half * 4 + gi;
                for (int r = 0; r < nr; r++) {
                    const __m256i xq = _mm256_loadu_si256((const __m256i *)(a[r].q + b * QK));
                    const __m256i p16 = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xq, wq));
                    const __m256i p = _mm256_madd_epi16(p16, scv);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * a[r].d[b]),
                                             acc[r]);
                }
            }
#else
            for (int gi = 0; gi < 4; gi++) {
                const int64_t b = s * 8 + half * 4 + gi;
                const uint8_t *lq = ql + (gi & 1) * 32;
                const int shift_l = (gi >> 1) * 4, shift_h = gi * 2;
                for (int r = 0; r < nr; r++) {
                    const int8_t *xq = a[r].q + b * QK;
                    int s0 = 0, s1 = 0;
                    for (int l = 0; l < 32; l++) {
                        const int v = (((lq[l] >> shift_l) & 0xF) | (((qh[l] >> shift_h) & 3) << 4)) - 32;
                        if (l < 16) s0 += v * xq[l];
                        else s1 += v * xq[l];
                    }
                    out[r] += d * a[r].d[b] * (float)(sc[2 * gi] * s0 + sc[2 * gi + 1] * s1);
                }
            }
#endif
        }
    }
#if defined(Q_ISA_SIMD)
    for (int r = 0; r < nr; r++) out[r] = hsum(acc[r]);
#endif
}

/* I8: a float32 scale, then k int8 values; the scale multiplies once at the end */
static inline void row_i8(const uint8_t *w, int64_t nb, const act_row *a, int nr, float *out) {
    float scale;
    memcpy(&scale, w, 4);
    const int8_t *wq = (const int8_t *)(w + 4);
#if defined(Q_ISA_SIMD)
    __m256 acc[NR];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(wq + b * QK));
        const __m256i vabs = _mm256_sign_epi8(v, v);
        for (int r = 0; r < nr; r++) {
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(a[r].q + b * QK));
            const __m256i p = dot_u8s8(vabs, _mm256_sign_epi8(xq, v));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(a[r].d[b]), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) out[r] = scale * hsum(acc[r]);
#else
    for (int r = 0; r < nr; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            int s = 0;
            for (int j = 0; j < QK; j++) s += wq[b * QK + j] * a[r].q[b * QK + j];
            total += a[r].d[b] * (float)s;
        }
        out[r] = scale * total;
    }
#endif
}

#if defined(Q_ISA_SIMD)
/* Two weight rows against one activation row (Q4_0, Q4_1, Q5_0, Q5_1): the activation block is
 * loaded once for both and the two rows' accumulation chains interleave, which hides the
 * multiply-add latency a lone row waits on. Each row's sums are those of row_q4 with nr = 1, in the
 * same order: the results are identical. Measured (one thread's CPU time, the 49152x576 LM head at
 * batch 1): Q4_1 2.9 ms paired vs 3.6 row by row; the same pairing of Q8_0 rows took 6.8 ms against
 * 3.3, so Q8_0 (and the K formats) stay row by row. */
static inline void row_pair_q4(const uint8_t *w0, const uint8_t *w1, int64_t nb, const act_row *a,
                               float *out, int has_min, int has_high) {
    const int64_t bytes = q4_block_bytes(has_min, has_high), qs = q4_qs_at(has_min, has_high);
    const float mid = q4_mid(has_high);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float off0 = 0.0f, off1 = 0.0f;
    for (int64_t b = 0; b < nb; b++, w0 += bytes, w1 += bytes) {
        const float d0 = fp16_to_float(w0), d1 = fp16_to_float(w1);
        const float m0 = has_min ? fp16_to_float(w0 + 2) : -mid * d0;
        const float m1 = has_min ? fp16_to_float(w1 + 2) : -mid * d1;
        const __m256i xq = _mm256_loadu_si256((const __m256i *)(a->q + b * QK));
        const float xd = a->d[b], xsd = a->sd[b];
        __m256i v0 = unpack_nibbles16(w0 + qs), v1 = unpack_nibbles16(w1 + qs);
        if (has_high) {
            v0 = _mm256_or_si256(v0, high_bits16(w0 + 2 + 2 * has_min));
            v1 = _mm256_or_si256(v1, high_bits16(w1 + 2 + 2 * has_min));
        }
        const __m256i p0 = dot_u8s8(v0, xq), p1 = dot_u8s8(v1, xq);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d0 * xd), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(d1 * xd), acc1);
        off0 += m0 * xsd;
        off1 += m1 * xsd;
    }
    out[0] = hsum(acc0) + off0;
    out[1] = hsum(acc1) + off1;
}

#endif

static inline void row_pair_float(int fmt, const uint8_t *w0, const uint8_t *w1, int64_t k,
                                  const act_row *a, int nr, float *out);

/* rows w0 and w1 (row_bytes apart or not) against one activation row: 1 when this format has
 * the paired kernel here (out[0..1] written), 0 when the caller takes row_dot row by row */
static inline int row_pair_dot(int fmt, const uint8_t *w0, const uint8_t *w1, int64_t k,
                               const act_row *a, float *out) {
    if (float_rows(fmt)) {
        float both[2 * NR];
        row_pair_float(fmt, w0, w1, k, a, 1, both);
        out[0] = both[0];
        out[1] = both[NR];
        return 1;
    }
#if defined(Q_ISA_SIMD)
    switch (fmt) {
    case FMT_Q4_0: row_pair_q4(w0, w1, k / QK, a, out, 0, 0); return 1;
    case FMT_Q4_1: row_pair_q4(w0, w1, k / QK, a, out, 1, 0); return 1;
    case FMT_Q5_0: row_pair_q4(w0, w1, k / QK, a, out, 0, 1); return 1;
    case FMT_Q5_1: row_pair_q4(w0, w1, k / QK, a, out, 1, 1); return 1;
    default: return 0;
    }
#else
    (void)fmt, (void)w0, (void)w1, (void)k, (void)a, (void)out;
    return 0;
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* Interleaved groups of XR rows (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; the K formats Q4_K, Q5_K, Q6_K),
 * packed once at load (asyncengine_interleave_rows). A batch-1 product row by row spends most of
 * its time per block on work that does not depend on the row: broadcasting the activation block's
 * scale, the horizontal sums at the end, converting one fp16 scale at a time. With XR rows' blocks
 * side by side, one 32-byte load holds 4 values of each of the 8 rows, so each 4-value piece of the
 * activation block is broadcast once and feeds all 8 rows (u8 x s8 products whose lane r is row r's
 * partial sum: no horizontal sums), and the 8 rows' fp16 scales (and mins) convert in one
 * instruction into the vector that scales the 8 sums. The layout of one block (a K format's
 * super-block of 256) of a group:
 *
 *   header  the 8 rows' fp16 fields side by side: d (16 bytes); Q4_1 / Q5_1 then m, Q4_K / Q5_K
 *           then dmin (16 bytes more). Q6_K's d, the last field of its block, comes first here.
 *   values  every other byte of the rows' blocks, in their order, in pieces of 32 bytes: piece
 *           c holds bytes 4c..4c+3 of each row's rest-of-block (row r at 4r). Q4_x: 4 pieces
 *           (the low nibbles are elements 4c..4c+3, the high ones 16+4c..16+4c+3), Q8_0: 8;
 *           Q5_x: its qh piece, then Q4_x's 4; the qh's bits reordered (q5_high_to_group) so
 *           that byte i of row r holds the fifth bits of both nibbles of byte i of each nibble
 *           piece c: of element 4c+i at bit c, of element 16+4c+i at bit 4+c (a shift and a
 *           mask put them at bit 4 beside the nibbles);
 *           Q4_K: 3 pieces of 6-bit scales and mins (lane r: row r's 4 packed bytes), 32 of
 *           nibbles; Q5_K: as Q4_K with 8 pieces of fifth bits between; Q6_K: 32 pieces of low
 *           nibbles, 16 of high bit pairs, 4 of int8 sub-block scales
 *
 * so a group of 8 rows takes exactly the bytes of its 8 rows, in the same place: a weight of
 * `rows` rows keeps its size, the first rows / XR * XR rows are grouped, the rest stay as
 * stored. Each row's result is its blocks' sums in block order (the same sums as the row kernels
 * above up to float rounding order); scripts/micro/bench_quant_matmul.py measures it. */
#define XR 8

static inline int interleaves(int fmt) {
    return fmt == FMT_Q8_0 || q4_family(fmt) || fmt == FMT_Q4_K || fmt == FMT_Q5_K ||
           fmt == FMT_Q6_K;
}
/* values per block of a grouped format */
static inline int64_t xr_block_values(int fmt) {
    return fmt == FMT_Q4_K || fmt == FMT_Q5_K || fmt == FMT_Q6_K ? QK_K : QK;
}
/* a row block's header bytes (its fp16 fields) and value bytes (the rest), as GGUF stores it */
static inline int64_t xr_header_bytes(int fmt) {
    return has_min_of(fmt) || fmt == FMT_Q4_K || fmt == FMT_Q5_K ? 4 : 2;
}
static inline int64_t xr_value_bytes(int fmt) {
    switch (fmt) {
    case FMT_Q8_0: return 32;
    case FMT_Q5_0:
    case FMT_Q5_1: return 20;
    case FMT_Q4_K: return 140;
    case FMT_Q5_K: return 172;
    case FMT_Q6_K: return 208;
    default: return 16;
    }
}
/* where the header lies in a row block as GGUF stores it (Q6_K: d last) */
static inline int64_t xr_header_at(int fmt) { return fmt == FMT_Q6_K ? 208 : 0; }

/* a Q5 block's qh (bit j: element j) as a group holds it, and back: byte i, bit c <- bit
 * 4c + i; bit 4 + c <- bit 16 + 4c + i */
static inline uint32_t q5_high_to_group(uint32_t h) {
    uint32_t g = 0;
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 4; c++) {
            g |= ((h >> (4 * c + i)) & 1u) << (8 * i + c);
            g |= ((h >> (16 + 4 * c + i)) & 1u) << (8 * i + 4 + c);
        }
    return g;
}
static inline uint32_t q5_high_from_group(uint32_t g) {
    uint32_t h = 0;
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 4; c++) {
            h |= ((g >> (8 * i + c)) & 1u) << (4 * c + i);
            h |= ((g >> (8 * i + 4 + c)) & 1u) << (16 + 4 * c + i);
        }
    return h;
}
/* the 4 bytes at p (a qh) reordered by one of the two above */
static inline void q5_high_reorder(uint8_t *p, int unpack) {
    uint32_t h;
    memcpy(&h, p, 4);
    h = unpack ? q5_high_from_group(h) : q5_high_to_group(h);
    memcpy(p, &h, 4);
}

/* XR rows (row_bytes apart, the blocks of k values each) -> one interleaved group at dst; and
 * back */
static inline void interleave_group(int fmt, const uint8_t *src, int64_t row_bytes, int64_t k,
                                    uint8_t *dst, int unpack) {
    const int64_t hb = xr_header_bytes(fmt), vb = xr_value_bytes(fmt), bb = hb + vb;
    const int64_t at = xr_header_at(fmt), values_at = at ? 0 : hb, nb = k / xr_block_values(fmt);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *g = dst + b * XR * bb;
        for (int r = 0; r < XR; r++) {
            uint8_t *blk = (uint8_t *)src + r * row_bytes + b * bb;
            for (int64_t h = 0; h < hb / 2; h++) {
                uint8_t *packed = g + h * 2 * XR + 2 * r;
                if (unpack) memcpy(blk + at + 2 * h, packed, 2);
                else memcpy(packed, blk + at + 2 * h, 2);
            }
            for (int64_t c = 0; c < vb / 4; c++) {
                uint8_t *packed = g + XR * hb + c * 4 * XR + 4 * r;
                if (unpack) memcpy(blk + values_at + 4 * c, packed, 4);
                else memcpy(packed, blk + values_at + 4 * c, 4);
            }
            if (has_high_of(fmt)) /* piece 0: the qh */
                q5_high_reorder(unpack ? blk + values_at : g + XR * hb + 4 * r, unpack);
        }
    }
}

/* How far ahead of the block being multiplied a batch-1 group kernel asks for its weight bytes.
 * A batch-1 product spends ~1/4 of its time computing and the rest waiting on memory; the
 * hardware prefetcher alone kept one thread's stream at ~60% of a plain read loop's rate on the
 * 2-core EPYC (it stops at each 4 KiB page). 8 KiB ahead covers a Zen 5 VM's memory latency at
 * 40-80 GB/s: Q8_0 at batch 1 from memory 1.07-1.3x faster than 1 KiB ahead, the fused step of
 * the embedded model 0.99-1.11x in its Q4_1 file, 1.18x in bfloat16 (scripts/micro/
 * bench_decode_step.py --baseline-library, steps alternating). Tunable with -DQ_PREFETCH_BYTES
 * (0: none). */
#ifndef Q_PREFETCH_BYTES
#define Q_PREFETCH_BYTES 8192
#endif

#if defined(Q_ISA_SIMD)
/* the cache lines of the `bytes` bytes Q_PREFETCH_BYTES past w */
static inline void prefetch_ahead(const uint8_t *w, int64_t bytes) {
#if Q_PREFETCH_BYTES > 0
    for (int64_t o = 0; o < bytes; o += 64)
        _mm_prefetch((const char *)w + Q_PREFETCH_BYTES + o, _MM_HINT_T0);
#else
    (void)w, (void)bytes;
#endif
}

/* 4 activation bytes broadcast to every 32-bit lane */
static inline __m256i bcast4(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}

/* The integer sums as they stand, as far as the compiler knows: it may no longer regroup the
 * additions before this point. Without it GCC turned each row's chain of multiply-adds into all
 * the products first, then their sum, and spilled the products to the stack (a tile kernel ran
 * at ~2/3 of its speed). */
static inline void in_register(__m256i *v) {
#if defined(__GNUC__)
    __asm__("" : "+x"(*v));
#else
    (void)v;
#endif
}

/* Q4 sums: AVX2 adds the u8 x s8 pair products in int16 (8 of them per block stay within
 * 8 * 2 * 15 * 127 = 30480) and widens once per block; VNNI accumulates in int32 directly */
static inline __m256i q4_acc(__m256i s, __m256i u, __m256i x) {
#if defined(Q_ISA_VNNI)
    return _mm256_dpbusd_epi32(s, u, x);
#else
    return _mm256_add_epi16(s, _mm256_maddubs_epi16(u, x));
#endif
}

static inline __m256 q4_sums(__m256i s) {
#if defined(Q_ISA_VNNI)
    return _mm256_cvtepi32_ps(s);
#else
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(s, _mm256_set1_epi16(1)));
#endif
}

/* s + lo . xlo + hi . xhi, in q4_acc's sums; with has_high (values to 31: 8 pair products of a
 * block would pass an int16) AVX2 widens each chunk's pairs to int32 as it adds them */
static inline __m256i q4_chunk(__m256i s, __m256i lo, __m256i xlo, __m256i hi, __m256i xhi,
                               int has_high) {
#if defined(Q_ISA_VNNI)
    (void)has_high;
    return q4_acc(q4_acc(s, lo, xlo), hi, xhi);
#else
    if (!has_high) return q4_acc(q4_acc(s, lo, xlo), hi, xhi);
    const __m256i p =
        _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
    return _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}

/* a block's sums of q4_chunk as float32 */
static inline __m256 q4_block_sums(__m256i s, int has_high) {
    return has_high ? _mm256_cvtepi32_ps(s) : q4_sums(s);
}

/* chunk c's low and high nibbles of the value piece v, with their fifth bits from the group's
 * reordered qh piece h where has_high (the layout above) */
static inline Q_ALWAYS_INLINE void q4_values(__m256i v, __m256i h, int c, int has_high,
                                             __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    *lo = _mm256_and_si256(v, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (!has_high) return;
    switch (c) { /* bit c -> bit 4 (low nibbles), bit 4 + c -> bit 4 (high) */
    case 0: *lo = or_bit4(*lo, _mm256_slli_epi16(h, 4)); *hi = or_bit4(*hi, h); break;
    case 1:
        *lo = or_bit4(*lo, _mm256_slli_epi16(h, 3));
        *hi = or_bit4(*hi, _mm256_srli_epi16(h, 1));
        break;
    case 2:
        *lo = or_bit4(*lo, _mm256_slli_epi16(h, 2));
        *hi = or_bit4(*hi, _mm256_srli_epi16(h, 2));
        break;
    default:
        *lo = or_bit4(*lo, _mm256_slli_epi16(h, 1));
        *hi = or_bit4(*hi, _mm256_srli_epi16(h, 3));
        break;
    }
}

/* Q4_0 / Q4_1 / Q5_0 / Q5_1 groups (has_min, has_high as row_q4) against one activation row */
static inline void group_q4(const uint8_t *w, int64_t nb, const act_row *a, float *out,
                            int has_min, int has_high) {
    const int64_t bb = XR * q4_block_bytes(has_min, has_high), hb = XR * (has_min ? 4 : 2);
    const __m256 neg_mid = _mm256_set1_ps(-q4_mid(has_high));
    __m256 acc = _mm256_setzero_ps(), off = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bb) {
        prefetch_ahead(w, bb);
        const int8_t *x = a->q + b * QK;
        const uint8_t *qs = w + hb + (has_high ? 32 : 0);
        const __m256i h = has_high ? _mm256_loadu_si256((const __m256i *)(w + hb))
                                   : _mm256_setzero_si256();
        __m256i s = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i lo, hi;
            q4_values(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)), h, c, has_high, &lo, &hi);
            s = q4_chunk(s, lo, bcast4(x + 4 * c), hi, bcast4(x + 16 + 4 * c), has_high);
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        acc = _mm256_fmadd_ps(q4_block_sums(s, has_high), _mm256_mul_ps(d, _mm256_set1_ps(a->d[b])),
                              acc);
        const __m256 m = has_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 16)))
                                 : _mm256_mul_ps(d, neg_mid);
        off = _mm256_fmadd_ps(m, _mm256_set1_ps(a->sd[b]), off);
    }
    _mm256_storeu_ps(out, _mm256_add_ps(acc, off));
}

/* group_q4 for nr (2..NR) activation rows at once, a register tile of XR weight rows x nr
 * activation rows: each chunk's nibbles are unpacked once for all of them, and each row keeps
 * only its int16 sums and its float accumulator in registers (2 nr + 5 of the 16 ymm registers;
 * the offset terms, which would take nr more, run in a second pass over the block headers).
 * The same float operations in the same order per row as group_q4 (integer sums are exact), so
 * the same results bit for bit; out[r * XR + j]. ~2x the multiply rate of one activation row at
 * a time at 16-1024 rows (scripts/micro/bench_quant_matmul.py). group_q4_rows picks the tile
 * height (2-4). */
static inline Q_ALWAYS_INLINE void group_q4_tile(const uint8_t *w, int64_t nb, const act_row *a,
                                                  const int mr, float *out, int has_min,
                                                  int has_high) {
    const int64_t bb = XR * q4_block_bytes(has_min, has_high), hb = XR * (has_min ? 4 : 2);
    /* every register named (mr, a constant, drops the unused ones): arrays of them the compiler
     * spilled to the stack */
    const int8_t *x0 = a[0].q, *x1 = a[mr > 1].q, *x2 = a[mr > 2 ? 2 : 0].q,
                 *x3 = a[mr > 3 ? 3 : 0].q;
    const float *d0 = a[0].d, *d1 = a[mr > 1].d, *d2 = a[mr > 2 ? 2 : 0].d,
                *d3 = a[mr > 3 ? 3 : 0].d;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    const uint8_t *g = w;
    for (int64_t b = 0; b < nb; b++, g += bb, x0 += QK, x1 += QK, x2 += QK, x3 += QK) {
        prefetch_ahead(g, bb); /* a group's first tile reads it from memory */
        const uint8_t *qs = g + hb + (has_high ? 32 : 0);
        const __m256i h = has_high ? _mm256_loadu_si256((const __m256i *)(g + hb))
                                   : _mm256_setzero_si256();
        __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
        for (int c = 0; c < 4; c++) {
            __m256i lo, hi;
            q4_values(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)), h, c, has_high, &lo, &hi);
#define Q4_ROW(s, x)                                                                            \
    do {                                                                                        \
        s = q4_chunk(s, lo, bcast4(x + 4 * c), hi, bcast4(x + 16 + 4 * c), has_high);          \
        in_register(&s);                                                                        \
    } while (0)
            Q4_ROW(s0, x0);
            if (mr > 1) Q4_ROW(s1, x1);
            if (mr > 2) Q4_ROW(s2, x2);
            if (mr > 3) Q4_ROW(s3, x3);
#undef Q4_ROW
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
        acc0 = _mm256_fmadd_ps(q4_block_sums(s0, has_high), _mm256_mul_ps(d, _mm256_set1_ps(d0[b])),
                               acc0);
        if (mr > 1)
            acc1 = _mm256_fmadd_ps(q4_block_sums(s1, has_high),
                                   _mm256_mul_ps(d, _mm256_set1_ps(d1[b])), acc1);
        if (mr > 2)
            acc2 = _mm256_fmadd_ps(q4_block_sums(s2, has_high),
                                   _mm256_mul_ps(d, _mm256_set1_ps(d2[b])), acc2);
        if (mr > 3)
            acc3 = _mm256_fmadd_ps(q4_block_sums(s3, has_high),
                                   _mm256_mul_ps(d, _mm256_set1_ps(d3[b])), acc3);
    }
    const float *sd0 = a[0].sd, *sd1 = a[mr > 1].sd, *sd2 = a[mr > 2 ? 2 : 0].sd,
                *sd3 = a[mr > 3 ? 3 : 0].sd;
    __m256 off0 = _mm256_setzero_ps(), off1 = off0, off2 = off0, off3 = off0;
    g = w;
    for (int64_t b = 0; b < nb; b++, g += bb) {
        const __m256 m = has_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)))
                                 : _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g)),
                                                 _mm256_set1_ps(-q4_mid(has_high)));
        off0 = _mm256_fmadd_ps(m, _mm256_set1_ps(sd0[b]), off0);
        if (mr > 1) off1 = _mm256_fmadd_ps(m, _mm256_set1_ps(sd1[b]), off1);
        if (mr > 2) off2 = _mm256_fmadd_ps(m, _mm256_set1_ps(sd2[b]), off2);
        if (mr > 3) off3 = _mm256_fmadd_ps(m, _mm256_set1_ps(sd3[b]), off3);
    }
    _mm256_storeu_ps(out, _mm256_add_ps(acc0, off0));
    if (mr > 1) _mm256_storeu_ps(out + XR, _mm256_add_ps(acc1, off1));
    if (mr > 2) _mm256_storeu_ps(out + 2 * XR, _mm256_add_ps(acc2, off2));
    if (mr > 3) _mm256_storeu_ps(out + 3 * XR, _mm256_add_ps(acc3, off3));
}

static Q_NOINLINE void group_q4_rows(const uint8_t *w, int64_t nb, const act_row *a, int nr,
                                    float *out, int has_min) {
    switch (nr) {
    case 2: group_q4_tile(w, nb, a, 2, out, has_min, 0); break;
    case 3: group_q4_tile(w, nb, a, 3, out, has_min, 0); break;
    default: group_q4_tile(w, nb, a, 4, out, has_min, 0); break;
    }
}

static Q_NOINLINE void group_q5_rows(const uint8_t *w, int64_t nb, const act_row *a, int nr,
                                    float *out, int has_min) {
    switch (nr) {
    case 2: group_q4_tile(w, nb, a, 2, out, has_min, 1); break;
    case 3: group_q4_tile(w, nb, a, 3, out, has_min, 1); break;
    default: group_q4_tile(w, nb, a, 4, out, has_min, 1); break;
    }
}

/* group_q4 for Q5_x, one function per format (group_q4 inlined into each caller otherwise) */
static Q_NOINLINE void group_q5(const uint8_t *w, int64_t nb, const act_row *a, float *out,
                                int has_min) {
    if (has_min) group_q4(w, nb, a, out, 1, 1);
    else group_q4(w, nb, a, out, 0, 1);
}

static inline void group_q8_0(const uint8_t *w, int64_t nb, const act_row *a, float *out) {
    const int64_t bb = XR * 34;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bb) {
        prefetch_ahead(w, bb);
        const int8_t *x = a->q + b * QK;
        const uint8_t *qs = w + 2 * XR;
        __m256i s = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            s = _mm256_add_epi32(s, dot_s8s8(v, bcast4(x + 4 * c)));
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(a->d[b])), acc);
    }
    _mm256_storeu_ps(out, acc);
}
/* group_q8_0 for nr (2..NR) activation rows at once (the layout of group_q4_rows): each chunk's
 * |w| taken once for all of them; the same sums per row as group_q8_0. A product pair of
 * |w| (<= 128) and x (<= 127) fills most of an int16, so each chunk's pairs are widened to int32
 * before they are added. */
static inline Q_ALWAYS_INLINE void group_q8_0_tile(const uint8_t *w, int64_t nb,
                                                    const act_row *a, const int mr, float *out) {
    const int64_t bb = XR * 34;
    const int8_t *x0 = a[0].q, *x1 = a[mr > 1].q, *x2 = a[mr > 2 ? 2 : 0].q,
                 *x3 = a[mr > 3 ? 3 : 0].q;
    const float *d0 = a[0].d, *d1 = a[mr > 1].d, *d2 = a[mr > 2 ? 2 : 0].d,
                *d3 = a[mr > 3 ? 3 : 0].d;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (int64_t b = 0; b < nb; b++, w += bb, x0 += QK, x1 += QK, x2 += QK, x3 += QK) {
        prefetch_ahead(w, bb);
        const uint8_t *qs = w + 2 * XR;
        __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
        for (int c = 0; c < 8; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            const __m256i u = _mm256_sign_epi8(v, v);
#define Q8_ROW(s, x)                                                                            \
    do {                                                                                        \
        s = _mm256_add_epi32(s, dot_u8s8(u, _mm256_sign_epi8(bcast4(x + 4 * c), v)));          \
        in_register(&s);                                                                        \
    } while (0)
            Q8_ROW(s0, x0);
            if (mr > 1) Q8_ROW(s1, x1);
            if (mr > 2) Q8_ROW(s2, x2);
            if (mr > 3) Q8_ROW(s3, x3);
#undef Q8_ROW
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d, _mm256_set1_ps(d0[b])), acc0);
        if (mr > 1)
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d, _mm256_set1_ps(d1[b])),
                                   acc1);
        if (mr > 2)
            acc2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s2), _mm256_mul_ps(d, _mm256_set1_ps(d2[b])),
                                   acc2);
        if (mr > 3)
            acc3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s3), _mm256_mul_ps(d, _mm256_set1_ps(d3[b])),
                                   acc3);
    }
    _mm256_storeu_ps(out, acc0);
    if (mr > 1) _mm256_storeu_ps(out + XR, acc1);
    if (mr > 2) _mm256_storeu_ps(out + 2 * XR, acc2);
    if (mr > 3) _mm256_storeu_ps(out + 3 * XR, acc3);
}

static Q_NOINLINE void group_q8_0_rows(const uint8_t *w, int64_t nb, const act_row *a, int nr,
                                      float *out) {
    switch (nr) {
    case 2: group_q8_0_tile(w, nb, a, 2, out); break;
    case 3: group_q8_0_tile(w, nb, a, 3, out); break;
    default: group_q8_0_tile(w, nb, a, 4, out); break;
    }
}
#endif


/* the scalar form of the group kernels (and the reference the SIMD ones are tested against) */
static inline void group_scalar(int fmt, const uint8_t *w, int64_t nb, const act_row *a,
                                float *out) {
    const int64_t hb = XR * xr_header_bytes(fmt), bb = hb + XR * xr_value_bytes(fmt);
    for (int r = 0; r < XR; r++) {
        float total = 0.0f, off = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *g = w + b * bb, *qs = g + hb;
            const int8_t *x = a->q + b * QK;
            const float dw = fp16_to_float(g + 2 * r);
            int s = 0;
            if (fmt == FMT_Q8_0) {
                for (int c = 0; c < 8; c++)
                    for (int i = 0; i < 4; i++) s += (int8_t)qs[32 * c + 4 * r + i] * x[4 * c + i];
            } else {
                const int high = has_high_of(fmt);
                const uint8_t *qh = qs + 4 * r, *nib = qs + (high ? 32 : 0);
                for (int c = 0; c < 4; c++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t v = nib[32 * c + 4 * r + i];
                        int lo = v & 0xF, hi = v >> 4;
                        if (high) {
                            lo |= ((qh[i] >> c) & 1) << 4;
                            hi |= ((qh[i] >> (4 + c)) & 1) << 4;
                        }
                        s += lo * x[4 * c + i] + hi * x[16 + 4 * c + i];
                    }
                off += (has_min_of(fmt) ? fp16_to_float(g + 2 * XR + 2 * r)
                                        : -q4_mid(high) * dw) *
                       a->sd[b];
            }
            total += dw * a->d[b] * (float)s;
        }
        out[r] = total + off;
    }
}

/* the XR rows of an interleaved group against nr (<= group_tile_rows(fmt)) activation rows:
 * out[r * XR + j]; the same results as group_dot row by row */
static inline void group_dot_rows(int fmt, const uint8_t *w, int64_t k, const act_row *a, int nr,
                                  float *out);

#include "cpu_quant_kgroups.h"
#include "cpu_quant_b1.h"

/* the XR rows of an interleaved group (fmt: interleaves(fmt)) against one activation row */
static inline void group_dot(int fmt, const uint8_t *w, int64_t k, const act_row *a, float *out) {
    if (group_dot_b1(fmt, w, k, a, out)) return;
    if (xr_block_values(fmt) == QK_K) {
        group_dot_k(fmt, w, k, a, 1, out);
        return;
    }
#if defined(Q_ISA_SIMD)
    switch (fmt) {
    case FMT_Q8_0: group_q8_0(w, k / QK, a, out); return;
    case FMT_Q4_0: group_q4(w, k / QK, a, out, 0, 0); return;
    case FMT_Q4_1: group_q4(w, k / QK, a, out, 1, 0); return;
    case FMT_Q5_0: group_q5(w, k / QK, a, out, 0); return;
    case FMT_Q5_1: group_q5(w, k / QK, a, out, 1); return;
    default: break;
    }
#endif
    group_scalar(fmt, w, k / QK, a, out);
}

/* the most activation rows group_dot_rows takes at once (callers' buffers: GR_MAX) */
#define GR_MAX (KR > NR ? KR : NR)
static inline int group_tile_rows(int fmt) { return xr_block_values(fmt) == QK_K ? KR : NR; }

static inline void group_dot_rows(int fmt, const uint8_t *w, int64_t k, const act_row *a, int nr,
                                  float *out) {
    if (nr == 1 && group_dot_b1(fmt, w, k, a, out)) return;
    if (xr_block_values(fmt) == QK_K) {
        group_dot_k(fmt, w, k, a, nr, out);
        return;
    }
#if defined(Q_ISA_SIMD)
    if (nr > 1 && fmt == FMT_Q8_0) {
        group_q8_0_rows(w, k / QK, a, nr, out);
        return;
    }
    if (nr > 1 && q4_family(fmt)) {
        if (has_high_of(fmt)) group_q5_rows(w, k / QK, a, nr, out, has_min_of(fmt));
        else group_q4_rows(w, k / QK, a, nr, out, has_min_of(fmt));
        return;
    }
#endif
    for (int r = 0; r < nr; r++) group_dot(fmt, w, k, a + r, out + r * XR);
}

/* ------------------------------------------------------------------------------------------ */
/* F32: float32 weight rows as they are, against the float32 activation rows (act_row.f; no q8
 * form). A dense float32 model's projections take this path so that the fused decode step and
 * the per-projection products run them like any stored format (kernels/quant_formats.py's F32).
 * A product is bound by the weight stream (4 bytes per multiply-add) up to a dozen activation
 * rows: two weight rows at a time (row_pair_f32) against nr activation rows, each activation
 * vector loaded once for both and each weight vector once for all nr, 2 nr accumulation chains;
 * the rows' bytes Q_PREFETCH_BYTES ahead are asked for as they go. Every (weight row,
 * activation row) sum runs in one order whatever is paired or batched with it: one chain of
 * 8-lane vectors, their horizontal sum, then the scalar tail (any k), so results are batch
 * invariant and the same alone (row_f32) or paired. */
#if defined(Q_ISA_SIMD)
/* rows w0 and w1 against nr (1..NR) activation rows over the whole vectors of k: out[r] (w0) and
 * out[NR + r] (w1); returns the first value not summed (the caller adds the tail). w1 NULL: w0
 * alone. */
static inline int64_t f32_vectors(const float *w0, const float *w1, int64_t k, const act_row *a,
                                  int nr, float *out) {
    __m256 acc0[NR], acc1[NR];
    for (int r = 0; r < nr; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    int64_t j = 0;
    if (w1) {
        for (; j + 8 <= k; j += 8) {
            if (j % 32 == 0) {
                prefetch_ahead((const uint8_t *)(w0 + j), 128);
                prefetch_ahead((const uint8_t *)(w1 + j), 128);
            }
            const __m256 v0 = _mm256_loadu_ps(w0 + j), v1 = _mm256_loadu_ps(w1 + j);
            for (int r = 0; r < nr; r++) {
                const __m256 x = _mm256_loadu_ps(a[r].f + j);
                acc0[r] = _mm256_fmadd_ps(v0, x, acc0[r]);
                acc1[r] = _mm256_fmadd_ps(v1, x, acc1[r]);
            }
        }
    } else {
        for (; j + 8 <= k; j += 8) {
            if (j % 32 == 0) prefetch_ahead((const uint8_t *)(w0 + j), 128);
            const __m256 v0 = _mm256_loadu_ps(w0 + j);
            for (int r = 0; r < nr; r++)
                acc0[r] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(a[r].f + j), acc0[r]);
        }
    }
    for (int r = 0; r < nr; r++) {
        out[r] = hsum(acc0[r]);
        if (w1) out[NR + r] = hsum(acc1[r]);
    }
    return j;
}
#endif

/* row_pair_f32 / row_f32: (w1 NULL: w0 alone) */
static inline void f32_rows(const float *w0, const float *w1, int64_t k, const act_row *a, int nr,
                            float *out) {
    int64_t j = 0;
#if defined(Q_ISA_SIMD)
    /* constant row counts, so that the sums stay in registers */
    switch (nr) {
    case 1: j = f32_vectors(w0, w1, k, a, 1, out); break;
    case 2: j = f32_vectors(w0, w1, k, a, 2, out); break;
    case 3: j = f32_vectors(w0, w1, k, a, 3, out); break;
    default: j = f32_vectors(w0, w1, k, a, 4, out); break;
    }
#else
    for (int r = 0; r < nr; r++) out[r] = out[NR + r] = 0.0f;
#endif
    for (int r = 0; r < nr; r++) {
        float t0 = 0.0f, t1 = 0.0f;
        for (int64_t t = j; t < k; t++) {
            t0 += w0[t] * a[r].f[t];
            if (w1) t1 += w1[t] * a[r].f[t];
        }
        out[r] += t0;
        if (w1) out[NR + r] += t1;
    }
}

/* weight rows w0 and w1 against nr (<= NR) activation rows: out[r] (w0), out[NR + r] (w1) */
static inline void row_pair_f32(const uint8_t *w0, const uint8_t *w1, int64_t k,
                                const act_row *a, int nr, float *out) {
    f32_rows((const float *)w0, (const float *)w1, k, a, nr, out);
}

static inline void row_f32(const uint8_t *w, int64_t k, const act_row *a, int nr, float *out) {
    float both[2 * NR];
    f32_rows((const float *)w, NULL, k, a, nr, both);
    for (int r = 0; r < nr; r++) out[r] = both[r];
}

/* ------------------------------------------------------------------------------------------ */
/* BF16: bfloat16 weight rows as they are (a bfloat16 checkpoint's projections: 2 bytes per
 * value, half of F32's stream), against the float32 activation rows (act_row.f) as F32 rows meet
 * them. Each weight vector is widened to float32 (a bfloat16 is the top half of a float32: zero
 * extend, shift left 16; exact) and multiplied-added in float32, so the product is the float32
 * one of the stored values. The shape of F32's kernel: two weight rows against nr activation
 * rows, each weight vector widened once for all nr, each activation vector loaded once for both;
 * one chain per (weight row, activation row), its horizontal sum, then the scalar tail (any k):
 * batch invariant, the same alone or paired. AVX-512 takes 16 values a vector (the VNNI build,
 * which has AVX-512 F/BW/VL), AVX2 8. (vdpbf16ps would take the activations rounded to bfloat16
 * as well; a batch-1 product is bound by the weight stream either way.) */
#if defined(Q_ISA_VNNI) && defined(__AVX512F__)
#define BF_LANES 16
typedef __m512 bf_vec;
static inline bf_vec bf_widen(const uint16_t *p) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
#define bf_load_x(p) _mm512_loadu_ps(p)
#define bf_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define bf_zero() _mm512_setzero_ps()
#define bf_hsum(v) _mm512_reduce_add_ps(v)
#elif defined(Q_ISA_SIMD)
#define BF_LANES 8
typedef __m256 bf_vec;
static inline bf_vec bf_widen(const uint16_t *p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
#define bf_load_x(p) _mm256_loadu_ps(p)
#define bf_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define bf_zero() _mm256_setzero_ps()
#define bf_hsum(v) hsum(v)
#endif

#if defined(BF_LANES)
/* as f32_vectors, over bfloat16 weight rows */
static inline int64_t bf16_vectors(const uint16_t *w0, const uint16_t *w1, int64_t k,
                                   const act_row *a, int nr, float *out) {
    bf_vec acc0[NR], acc1[NR];
    for (int r = 0; r < nr; r++) acc0[r] = acc1[r] = bf_zero();
    int64_t j = 0;
    if (w1) {
        /* adjacent rows (the usual pair) are one stream of 2 k values: ask for it one line at a
         * time, Q_PREFETCH_BYTES ahead of where the pair is read (one stream 2.4 KB long at k
         * 576 rather than two overlapping ones: ~1.5x the bytes per second from DRAM on the
         * 2-core EPYC, near a plain read loop's) */
        const int adjacent = w1 == w0 + k;
        for (; j + BF_LANES <= k; j += BF_LANES) {
            if (j % 16 == 0) {
                if (adjacent) {
                    prefetch_ahead((const uint8_t *)w0 + 4 * j, 64);
                } else if (j % 32 == 0) {
                    prefetch_ahead((const uint8_t *)(w0 + j), 64);
                    prefetch_ahead((const uint8_t *)(w1 + j), 64);
                }
            }
            const bf_vec v0 = bf_widen(w0 + j), v1 = bf_widen(w1 + j);
            for (int r = 0; r < nr; r++) {
                const bf_vec x = bf_load_x(a[r].f + j);
                acc0[r] = bf_fma(v0, x, acc0[r]);
                acc1[r] = bf_fma(v1, x, acc1[r]);
            }
        }
    } else {
        for (; j + BF_LANES <= k; j += BF_LANES) {
            if (j % 32 == 0) prefetch_ahead((const uint8_t *)(w0 + j), 64);
            const bf_vec v0 = bf_widen(w0 + j);
            for (int r = 0; r < nr; r++) acc0[r] = bf_fma(v0, bf_load_x(a[r].f + j), acc0[r]);
        }
    }
    for (int r = 0; r < nr; r++) {
        out[r] = bf_hsum(acc0[r]);
        if (w1) out[NR + r] = bf_hsum(acc1[r]);
    }
    return j;
}
#endif

/* row_pair_bf16 / row_bf16: (w1 NULL: w0 alone) */
static inline void bf16_rows(const uint16_t *w0, const uint16_t *w1, int64_t k, const act_row *a,
                             int nr, float *out) {
    int64_t j = 0;
#if defined(BF_LANES)
    switch (nr) {
    case 1: j = bf16_vectors(w0, w1, k, a, 1, out); break;
    case 2: j = bf16_vectors(w0, w1, k, a, 2, out); break;
    case 3: j = bf16_vectors(w0, w1, k, a, 3, out); break;
    default: j = bf16_vectors(w0, w1, k, a, 4, out); break;
    }
#else
    for (int r = 0; r < nr; r++) out[r] = out[NR + r] = 0.0f;
#endif
    for (int r = 0; r < nr; r++) {
        float t0 = 0.0f, t1 = 0.0f;
        for (int64_t t = j; t < k; t++) {
            t0 += bf16_to_float(w0[t]) * a[r].f[t];
            if (w1) t1 += bf16_to_float(w1[t]) * a[r].f[t];
        }
        out[r] += t0;
        if (w1) out[NR + r] += t1;
    }
}

static inline void row_bf16(const uint8_t *w, int64_t k, const act_row *a, int nr, float *out) {
    float both[2 * NR];
    bf16_rows((const uint16_t *)w, NULL, k, a, nr, both);
    for (int r = 0; r < nr; r++) out[r] = both[r];
}

/* weight rows w0 and w1 of a float-rows format (F32, BF16) against nr (<= NR) activation rows:
 * out[r] (w0), out[NR + r] (w1) */
static inline void row_pair_float(int fmt, const uint8_t *w0, const uint8_t *w1, int64_t k,
                                  const act_row *a, int nr, float *out) {
    if (fmt == FMT_BF16) bf16_rows((const uint16_t *)w0, (const uint16_t *)w1, k, a, nr, out);
    else row_pair_f32(w0, w1, k, a, nr, out);
}

static inline void row_dot(int fmt, const uint8_t *w, int64_t k, const act_row *a, int nr,
                           float *out) {
    switch (fmt) {
    case FMT_Q8_0: row_q8_0(w, k / QK, a, nr, out); break;
    case FMT_Q4_0: row_q4(w, k / QK, a, nr, out, 0, 0); break;
    case FMT_Q4_1: row_q4(w, k / QK, a, nr, out, 1, 0); break;
    case FMT_Q5_0: row_q4(w, k / QK, a, nr, out, 0, 1); break;
    case FMT_Q5_1: row_q4(w, k / QK, a, nr, out, 1, 1); break;
    case FMT_Q4_K: row_qk45(w, k / QK_K, a, nr, out, 0); break;
    case FMT_Q5_K: row_qk45(w, k / QK_K, a, nr, out, 1); break;
    case FMT_Q6_K: row_q6_k(w, k / QK_K, a, nr, out); break;
    case FMT_I8: row_i8(w, k / QK, a, nr, out); break;
    case FMT_F32: row_f32(w, k, a, nr, out); break;
    case FMT_BF16: row_bf16(w, k, a, nr, out); break;
    default: break;
    }
}

#endif
