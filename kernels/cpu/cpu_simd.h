/* Helpers shared by the native CPU kernels: bfloat16 <-> float32, a vector exp and tanh. */
#ifndef ASYNCENGINE_CPU_SIMD_H
#define ASYNCENGINE_CPU_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* round to nearest even; NaN stays NaN */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    uint32_t nan = (bits >> 16) | 0x40u;
    return (uint16_t)(((bits & 0x7fffffffu) > 0x7f800000u) ? nan : rounded);
}

/* sum of x[i]^2 over a row of h floats, as every RMSNorm of the native kernels takes it (the
 * fused decode step's and cpu_layer_ops.c's, so that the two paths norm a row alike): on
 * AVX-512, 16 lanes of fused multiply-adds over the whole chunks, their sum, then the tail in
 * order; elsewhere all in order. */
static inline float sum_squares(const float *x, int64_t h) {
    float ss = 0.0f;
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= h; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    ss = _mm512_reduce_add_ps(acc);
#endif
    for (; i < h; i++) ss += x[i] * x[i];
    return ss;
}

#ifdef __AVX512F__
/* 16 bf16 -> 16 floats */
static inline __m512 load_bf16x16(const uint16_t *p) {
    __m512i raw = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
}

/* 16 floats -> 16 bf16, round to nearest even, NaN kept */
static inline __m256i to_bf16x16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    rounded = _mm512_mask_mov_epi32(rounded, nan, quiet);
    return _mm512_cvtepi32_epi16(rounded);
}

static inline __m512 round_bf16x16(__m512 v) {
    __m512i r = _mm512_cvtepu16_epi32(to_bf16x16(v));
    return _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
}

/* t[0:16] (16 rows of 16 dwords) transposed in place: t[j] lane i = row i's dword j */
static inline __attribute__((always_inline)) void transpose16_epi32(__m512i *t) {
    __m512i u[16];
    for (int k = 0; k < 8; k++) { /* per 128-bit lane: rows 2k, 2k + 1 interleaved */
        u[2 * k] = _mm512_unpacklo_epi32(t[2 * k], t[2 * k + 1]);
        u[2 * k + 1] = _mm512_unpackhi_epi32(t[2 * k], t[2 * k + 1]);
    }
    for (int r = 0; r < 4; r++) { /* t[4 r + e] lane L: rows 4r .. 4r + 3 of dword 4 L + e */
        t[4 * r] = _mm512_unpacklo_epi64(u[4 * r], u[4 * r + 2]);
        t[4 * r + 1] = _mm512_unpackhi_epi64(u[4 * r], u[4 * r + 2]);
        t[4 * r + 2] = _mm512_unpacklo_epi64(u[4 * r + 1], u[4 * r + 3]);
        t[4 * r + 3] = _mm512_unpackhi_epi64(u[4 * r + 1], u[4 * r + 3]);
    }
    for (int e = 0; e < 4; e++) { /* the 4 x 4 128-bit lanes of t[e], t[4 + e], ... transposed */
        const __m512i v0 = _mm512_shuffle_i32x4(t[e], t[4 + e], 0x88);
        const __m512i v1 = _mm512_shuffle_i32x4(t[e], t[4 + e], 0xdd);
        const __m512i v2 = _mm512_shuffle_i32x4(t[8 + e], t[12 + e], 0x88);
        const __m512i v3 = _mm512_shuffle_i32x4(t[8 + e], t[12 + e], 0xdd);
        u[e] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        u[8 + e] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
        u[4 + e] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        u[12 + e] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
    }
    for (int j = 0; j < 16; j++) t[j] = u[j];
}

/* r[i] = sum of the 16 lanes of v[i], for 16 vectors at once (lane order 0..15): a tree of
 * in-lane unpacks and shuffles, ~3 instructions per vector instead of a reduction each. */
static inline __m512 reduce16(const __m512 *v) {
    __m512 c[8], w[4], u[2];
    for (int k = 0; k < 8; k++)
        c[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++)
        w[k] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int k = 0; k < 2; k++)
        u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* e^x for 16 lanes: x = n ln2 + r, |r| <= ln2/2, e^r by a degree-6 polynomial (rel. error
 * ~2e-7), 2^n by the exponent field. Inputs below -87 give 0, above 88 give e^88. */
static inline __m512 exp512(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f), hi = _mm512_set1_ps(88.0f);
    __m512 xc = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 result = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GT_OQ), result);
}

/* tanh for 16 lanes (abs. error ~1e-7): sign(x) (1 - e^{-2|x|}) / (1 + e^{-2|x|}), which never
 * overflows (exp512 gives 0 far below zero, so it saturates at +-1); below |x| = 1/4, where
 * 1 - e^{-2|x|} would cancel, its odd Taylor polynomial up to x^9. */
static inline __m512 tanh512(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 ax = _mm512_abs_ps(x);
    const __m512 t = exp512(_mm512_mul_ps(ax, _mm512_set1_ps(-2.0f)));
    const __m512 big = _mm512_div_ps(_mm512_sub_ps(one, t), _mm512_add_ps(one, t));
    const __m512 x2 = _mm512_mul_ps(ax, ax);
    __m512 p = _mm512_set1_ps(62.0f / 2835.0f);
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-17.0f / 315.0f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(2.0f / 15.0f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-1.0f / 3.0f));
    p = _mm512_fmadd_ps(p, x2, one);
    const __m512 small = _mm512_mul_ps(p, ax);
    const __m512 r = _mm512_mask_mov_ps(big, _mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.25f), _CMP_LT_OQ), small);
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r), sign));
}

/* cap * tanh(x / cap) for 16 lanes: attention scores soft-capped (Gemma 2), x / cap taken as
 * x * (1 / cap) */
static inline __m512 soft_cap512(__m512 x, float cap) {
    const __m512 inv = _mm512_set1_ps(1.0f / cap);
    return _mm512_mul_ps(_mm512_set1_ps(cap), tanh512(_mm512_mul_ps(x, inv)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* exp512 for 8 lanes (AVX2 + FMA CPUs): the same reduction and polynomial */
static inline __m256 exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f);
    __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_and_ps(result, _mm256_cmp_ps(x, lo, _CMP_GT_OQ));
}

/* silu(g) = g / (1 + exp(-g)) for 8 lanes, for the fused decode step's gate/up pairs: libm's
 * expf per element (a call, then a scalar division) was ~15% of a 64-row decode step
 * (scripts/micro/bench_decode_step.py). The silu_and_mul layer op (prefill and
 * mixed steps) keeps expf on AVX2: with exp256 there too, the embedded model's argmax agreement
 * with float32 over tests/executor/test_quantized_model.py's text fell to 0.945 (recorded: 0.973; a few
 * int8 activation roundings flipped), under that test's 0.95. */
static inline __m256 silu256(__m256 g) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

/* tanh for 8 lanes, as tanh512 above */
static inline __m256 tanh256(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    const __m256 ax = _mm256_andnot_ps(sign_bit, x);
    const __m256 t = exp256(_mm256_mul_ps(ax, _mm256_set1_ps(-2.0f)));
    const __m256 big = _mm256_div_ps(_mm256_sub_ps(one, t), _mm256_add_ps(one, t));
    const __m256 x2 = _mm256_mul_ps(ax, ax);
    __m256 p = _mm256_set1_ps(62.0f / 2835.0f);
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-17.0f / 315.0f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(2.0f / 15.0f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-1.0f / 3.0f));
    p = _mm256_fmadd_ps(p, x2, one);
    const __m256 small = _mm256_mul_ps(p, ax);
    const __m256 r = _mm256_blendv_ps(big, small, _mm256_cmp_ps(ax, _mm256_set1_ps(0.25f), _CMP_LT_OQ));
    return _mm256_or_ps(r, _mm256_and_ps(x, sign_bit));
}

/* soft_cap512 for 8 lanes */
static inline __m256 soft_cap256(__m256 x, float cap) {
    const __m256 inv = _mm256_set1_ps(1.0f / cap);
    return _mm256_mul_ps(_mm256_set1_ps(cap), tanh256(_mm256_mul_ps(x, inv)));
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 bf16 -> 8 floats */
static inline __m256 load_bf16x8(const uint16_t *p) {
    __m256i raw = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
}
#endif

#endif
