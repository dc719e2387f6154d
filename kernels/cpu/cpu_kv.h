/* The element of the K/V pool as the native kernels that read or write it see it: float32, or
 * IEEE float16 when the library is built with -DKV_F16 (kernels/cpu/cpu_native.py builds each such
 * kernel twice, ``kv_flags``), or bfloat16 in the fused decode step's -DKV_BF16 build (the pool
 * of a model run in bfloat16: decode_step_native.py; the other kernels read a bfloat16 pool
 * through a flag of their own). A float16 pool halves the bytes a decode streams per key (the
 * attention of a long-context decode batch is bound by them) and the pool's memory; it is
 * read through F16C (8 halves -> 8 floats in one instruction) where the CPU has it, a portable
 * conversion elsewhere. All arithmetic stays float32: only the stored K/V are rounded to half
 * (nearest even), as llama.cpp's default f16 K/V cache does.
 *
 *   kv_t                 the pool's element
 *   kv_from_float(x)     one value, rounded to the element
 *   kv_to_float(x)       one element, widened
 *   kv_store_row(d, s, n)  n floats -> n elements
 *   kv_load_row(d, s, n)   n elements -> n floats
 *   KV_LOAD8(p)          8 elements -> __m256 (AVX2 + FMA builds)
 *   KV_LOAD16(p)         16 elements -> __m512 (AVX-512 builds)
 */
#ifndef ASYNCENGINE_CPU_KV_H
#define ASYNCENGINE_CPU_KV_H

#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#ifdef KV_F16
typedef uint16_t kv_t;
#define KV_IS_F16 1

#ifdef __F16C__
static inline float kv_to_float(kv_t x) { return _cvtsh_ss(x); }
static inline kv_t kv_from_float(float x) {
    return (kv_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#else
/* IEEE binary16 <-> binary32 without F16C: subnormals, infinities and NaN kept */
static inline float kv_to_float(kv_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        exp = 113u;
        while (!(man & 0x400u)) man <<= 1, exp--;
        bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline kv_t kv_from_float(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    const uint32_t abs = bits & 0x7fffffffu;
    if (abs > 0x7f800000u) return (kv_t)(sign | 0x7e00u | ((abs >> 13) & 0x3ffu)); /* NaN */
    if (abs >= 0x477ff000u) return (kv_t)(sign | 0x7c00u); /* rounds past 65504: inf */
    if (abs < 0x38800000u) { /* below the smallest normal half: subnormal or zero */
        if (abs < 0x33000000u) return sign;
        const uint32_t man = (abs & 0x7fffffu) | 0x800000u;
        const int shift = 126 - (int)(abs >> 23); /* 14 .. 24 */
        uint32_t h = man >> shift;
        const uint32_t rest = man & ((1u << shift) - 1u), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (h & 1u))) h++;
        return (kv_t)(sign | h);
    }
    const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u); /* nearest even */
    return (kv_t)(sign | ((rounded - 0x38000000u) >> 13));
}
#endif

static inline void kv_store_row(kv_t *dst, const float *src, int64_t n) {
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; i++) dst[i] = kv_from_float(src[i]);
}

static inline void kv_load_row(float *dst, const kv_t *src, int64_t n) {
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = kv_to_float(src[i]);
}

#if defined(__AVX2__) && defined(__F16C__)
#define KV_LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#elif defined(__AVX2__)
static inline __m256 kv_load8_portable(const kv_t *p) {
    float t[8];
    kv_load_row(t, p, 8);
    return _mm256_loadu_ps(t);
}
#define KV_LOAD8(p) kv_load8_portable(p)
#endif
#ifdef __AVX512F__
#define KV_LOAD16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#endif

#elif defined(KV_BF16)
/* bfloat16: the upper half of a float32, so widening is a shift; stores round to nearest even
 * (NaN kept quiet), as torch's float32 -> bfloat16 conversion does */
typedef uint16_t kv_t;
#define KV_IS_F16 0

static inline float kv_to_float(kv_t x) { return bf16_to_float(x); }

static inline kv_t kv_from_float(float f) { return float_to_bf16(f); }

static inline void kv_store_row(kv_t *dst, const float *src, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(src + i);
        const __m512i bits = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        r = _mm512_mask_mov_epi32(
            r, nan, _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40)));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtepi32_epi16(r));
    }
#endif
    for (; i < n; i++) dst[i] = kv_from_float(src[i]);
}

static inline void kv_load_row(float *dst, const kv_t *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = kv_to_float(src[i]);
}

#ifdef __AVX2__
#define KV_LOAD8(p)                                                                              \
    _mm256_castsi256_ps(                                                                         \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#endif
#ifdef __AVX512F__
#define KV_LOAD16(p)                                                                             \
    _mm512_castsi512_ps(                                                                         \
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#endif

#elif defined(KV_I8)
/* int8 with a scale per token and head: each head's row of D values is followed by its scale
 * (KV_ROW_EXTRA = 2 bytes, a bfloat16 rounded up so that |x| / scale never passes 127), and
 * value = int8 * scale (symmetric: a zero point would take 2 more bytes a row and a head of
 * 64 would then hold < 1.9x the tokens of bfloat16). KV_LOAD8/16 and kv_to_float give the
 * unscaled integers: a dot product or a value sum takes the row's scale once
 * (kv_row_scale); kv_store_row / kv_load_row move whole rows, their scale included. The
 * torch twin is kernels/reference/kv_int8_ref.py (the same rounding, bit for bit). */
typedef int8_t kv_t;
#define KV_IS_F16 0
#define KV_IS_I8 1
#define KV_ROW_EXTRA 2

static inline float kv_to_float(kv_t x) { return (float)x; }

static inline float kv_row_scale(const kv_t *row, int64_t d) {
    uint16_t bits;
    memcpy(&bits, row + d, sizeof bits);
    return bf16_to_float(bits);
}

/* n floats -> n int8 and their scale after them: scale = amax / 127 rounded up to bfloat16,
 * q = round-to-nearest-even(x / scale) */
static inline void kv_store_row(kv_t *dst, const float *src, int64_t n) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(src[i]);
        amax = a > amax ? a : amax;
    }
    const float want = amax / 127.0f;
    uint16_t bits = float_to_bf16(want);
    if (bf16_to_float(bits) < want) bits++;
    const float scale = bf16_to_float(bits);
    for (int64_t i = 0; i < n; i++) {
        float q = scale > 0.0f ? nearbyintf(src[i] / scale) : 0.0f;
        q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
        dst[i] = (kv_t)q;
    }
    memcpy(dst + n, &bits, sizeof bits);
}

static inline void kv_load_row(float *dst, const kv_t *src, int64_t n) {
    const float scale = kv_row_scale(src, n);
    for (int64_t i = 0; i < n; i++) dst[i] = (float)src[i] * scale;
}

#ifdef __AVX2__
#define KV_LOAD8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#endif
#ifdef __AVX512F__
#define KV_LOAD16(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#endif

#else /* float32 pool */
typedef float kv_t;
#define KV_IS_F16 0
static inline float kv_to_float(kv_t x) { return x; }
static inline kv_t kv_from_float(float x) { return x; }
static inline void kv_store_row(kv_t *dst, const float *src, int64_t n) {
    memcpy(dst, src, (size_t)n * sizeof(float));
}
static inline void kv_load_row(float *dst, const kv_t *src, int64_t n) {
    memcpy(dst, src, (size_t)n * sizeof(float));
}
#ifdef __AVX2__
#define KV_LOAD8(p) _mm256_loadu_ps(p)
#endif
#ifdef __AVX512F__
#define KV_LOAD16(p) _mm512_loadu_ps(p)
#endif
#endif

/* Every build but int8 keeps a head's row as D elements with no scale: kv_row_scale is 1 (a
 * product by it is exact, so those builds compute as before). KV_ROW(d): elements from one
 * head's row to the next. */
#ifndef KV_ROW_EXTRA
#define KV_IS_I8 0
#define KV_ROW_EXTRA 0
static inline float kv_row_scale(const kv_t *row, int64_t d) {
    (void)row;
    (void)d;
    return 1.0f;
}
#endif
#define KV_ROW(d) ((d) + KV_ROW_EXTRA)
/* The pool's element is the build's own (float16, int8), not the queries' dtype: there a
 * kernel's is_bf16 says only that q / out are bfloat16 (an int8 pool is read beside bfloat16
 * activations too; a float16 one beside float32 only). */
#define KV_OWN_ELEMENT (KV_IS_F16 || KV_IS_I8)

/* What a library that includes this header was built for (kernels/cpu/cpu_native.py checks it):
 * bytes of the pool's element, plus 16 where float16 is converted through F16C, plus 32 for
 * bfloat16, plus 64 for int8 rows with a scale each. */
int asyncengine_kv_element(void) {
#if defined(KV_I8)
    return (int)sizeof(kv_t) + 64;
#elif defined(KV_F16) && defined(__F16C__)
    return (int)sizeof(kv_t) + 16;
#elif defined(KV_BF16)
    return (int)sizeof(kv_t) + 32;
#else
    return (int)sizeof(kv_t);
#endif
}

#endif
