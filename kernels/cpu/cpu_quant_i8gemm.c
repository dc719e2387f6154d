/* The K formats' (Q4_K, Q5_K, Q6_K) and the 32-value block formats' (Q8_0, Q4_0, Q4_1, Q5_0,
 * Q5_1) products
 * for many activation rows at once, in int8.
 *
 *   y[i, c] = sum_k x[i, k] * W[c, k]
 *
 * From ~8 rows the batch-1 group kernels are compute-bound, and a dense bfloat16 copy of the
 * weight multiplies at the bfloat16 rate. Here the weight keeps its exact integers: each value
 * (4, 5 or 6 bits) is one byte, repacked once at load into panels of 16 output columns whose
 * 64-byte vectors hold 4 consecutive k of each column (the operand vpdpbusd takes), beside
 * each sub-block's integer scale and min and each super-block's float d and dmin. The activation
 * rows are quantized once per product to int8 per 256 values (one float scale per row and super-
 * block, as llama.cpp's q8_K) with their sums per 16 and per 32 values. A sub-block's products
 * (u8 x s8, 64 multiply-adds an instruction: twice the bfloat16 rate) are summed in int32, scaled
 * by the sub-block's integer scale, and each super-block meets its float scales once:
 *
 *   y[i, c] = sum_s xd[i, s] (d[c, s] sum_j sc[c, s, j] S[i, c, s, j]
 *                              - dm[c, s] sum_j m[c, s, j] B[i, s, j])
 *
 *   Q4_K / Q5_K  j: 8 sub-blocks of 32, sc / m: the 6-bit scale / min, dm = dmin
 *   Q6_K         j: 16 sub-blocks of 16, values q (0..63, for q - 32), m = sc, dm = 32 d: kept
 *                as q - 32 (s8) against x + 128 (u8), its min term a constant per column:
 *                y[i, c] = sum_s xd[i, s] d[c, s] (sum_j sc_j S'[i, c, s, j] - 128 off[c, s])
 *   Q8_0         j: 8 blocks of 32, values q (s8) against x + 128 (u8), a float scale d each,
 *                the activations' scale per 32 too (as llama.cpp's q8_0: per 256 a 1B model's
 *                mean logit error was 1.65x its group kernels', per 32 the same;
 *                scripts/quant_accuracy.py --variants gguf,gguf_i8), met with d:
 *                y[i, c] = sum_s sum_j xd[i, s, j] d[c, s, j] (S'[i, c, s, j] - 128 off[c, s, j])
 *                (off: the block's sum of q; the int32 sums start at -128 off)
 *   Q4_0, Q4_1,  as Q8_0, their values widened to bytes (Q4_0's q - 8, Q5_0's q - 16); Q4_1's
 *   Q5_0, Q5_1   and Q5_1's min m per block adds m[c, s, j] B[i, s, j] inside the super-block's
 *                sum
 *
 * (S: the sub-block's sum of value x activation, B: its activations' sum). Exact but for the
 * activation rounding and the float sums' order. Rows of the 32-value block formats need whole
 * blocks only: a partial last super-block is padded with zero blocks (d = 0, values 0) in the
 * panels and zero activations (they add exact zeros), so that every kernel keeps its loop over
 * whole super-blocks. A micro-kernel holds MR activation rows x NV panels of int32 sums in
 * registers (the float sums in memory, met once a super-block), each loaded weight vector
 * meeting all MR rows; threads take units of NV panels (each a contiguous stream) as they come
 * free. The AVX-512 VNNI build has a fast kernel for every format, the
 * AVX2 build (-DQ_FORCE_AVX2, CPUs without VNNI) one for the K formats (asyncengine_i8_fast);
 * the others run a scalar kernel on the same layout, the reference the tests hold them to.
 * Built by kernels/cpu/cpu_native.py. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_quant_blocks.h"
#include "cpu_silu_row.h"

#if defined(Q_ISA_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__)
#define I8_512 1
#elif defined(Q_ISA_AVX2)
#define I8_256 1 /* the K formats' AVX2 kernel; the 32-value block formats run the scalar one */
#endif

#define NP 16 /* columns per panel */
#define MR 4 /* activation rows per micro-kernel (I8_ROWS lists 1..MR) */
#define NV 2 /* panels per micro-kernel (I8_SHAPES lists 1..NV): MR x NV chains of vpdpbusd and
              * as many int32 sums fill the registers; 6 x 2, 4 x 3, 4 x 4 and 8 x 2 (spilling
              * their sums, or keeping them in memory) ran no faster */

/* Q4_K's values are nibbles: each 64-byte vector holds two steps of 4 k (the even step in the
 * low nibbles), so a panel streams about the bytes of the quantized weight; unpacking them
 * (and, shift) cost no measurable time beside the products. Q5_K's and Q6_K's are bytes. */
static inline int nibbles(int fmt) { return fmt == FMT_Q4_K; }
static inline int64_t value_bytes(int fmt) { return nibbles(fmt) ? QK_K * NP / 2 : QK_K * NP; }

/* byte of value v (0..255) of column c in a super-block's values, and its shift */
static inline int64_t value_at(int fmt, int v, int c) {
    return nibbles(fmt) ? (v / 8) * 64 + 4 * c + v % 4 : (v / 4) * 64 + 4 * c + v % 4;
}
static inline int value_shift(int fmt, int v) { return nibbles(fmt) ? 4 * ((v / 4) % 2) : 0; }

/* Q6_K's values are kept centred (q - 32, int8) and meet the activations shifted to unsigned
 * bytes (x + 128): sum (x + 128)(q - 32) = sum x (q - 32) + 128 sum (q - 32), so its offset is
 * one int32 per column and super-block (sum_j sc_j sum (q - 32), "off"), not a min term per
 * activation row */
static inline int centred(int fmt) { return fmt == FMT_Q6_K; }
/* the formats whose values are signed bytes, meeting the activations as x + 128 */
/* the 32-value block formats, kept in Q8_0's panel layout */
static inline int q8_layout(int fmt) { return fmt == FMT_Q8_0 || q4_family(fmt); }
static inline int shifted_input(int fmt) { return fmt == FMT_Q6_K || q8_layout(fmt); }

/* Q8_0's panel super-block: its values (as Q5_K's bytes), then per block of 32 and column the
 * int32 sums' start (-128 times the block's sum of values) and the float scale d; Q4_1's and
 * Q5_1's also the float min m */
#define Q8_OFF_AT (QK_K * NP)
#define Q8_D_AT (Q8_OFF_AT + 8 * NP * 4)
#define Q8_M_AT (Q8_D_AT + 8 * NP * 4)
static inline int64_t q8_bytes(int fmt) { return Q8_M_AT + (has_min_of(fmt) ? 8 * NP * 4 : 0); }

/* one panel's super-block: where its parts lie and its size */
typedef struct {
    int nsub, sub;                         /* sub-blocks and their values */
    int64_t sc, mins, d, dm, bytes;        /* offsets; values at 0 */
} sb_layout;

static sb_layout layout_of(int fmt) {
    sb_layout l;
    if (q8_layout(fmt)) {
        l.nsub = 8;
        l.sub = 32;
        l.sc = Q8_OFF_AT;
        l.d = Q8_D_AT;
        l.mins = l.dm = Q8_M_AT;
        l.bytes = q8_bytes(fmt);
        return l;
    }
    l.nsub = fmt == FMT_Q6_K ? 16 : 8;
    l.sub = QK_K / l.nsub;
    l.sc = value_bytes(fmt);               /* int8 [nsub][NP] */
    l.mins = l.sc + l.nsub * NP;           /* int16 [nsub / 2][NP][2]: pairs per column, or */
    l.d = l.mins + (centred(fmt) ? NP * 4 : l.nsub * NP * 2); /* int32 off [NP]; float [NP] */
    l.dm = l.d + NP * 4;                   /* float [NP] (not centred) */
    l.bytes = l.dm + (centred(fmt) ? 0 : NP * 4);
    return l;
}

static int takes_format(int fmt) {
    return fmt == FMT_Q4_K || fmt == FMT_Q5_K || fmt == FMT_Q6_K || q8_layout(fmt);
}

/* k rounded up to whole super-blocks: the values a panel row and an activation row hold (the
 * 32-value block formats' rows padded with zeros) */
static inline int64_t padded(int64_t k) { return (k + QK_K - 1) / QK_K * QK_K; }

/* the bytes of a panel of rows of k values; -1 where fmt or k is not taken (the K formats
 * whole super-blocks, the 32-value block formats whole blocks) */
int64_t asyncengine_i8_panel_bytes(int fmt, int64_t k) {
    const int64_t whole = q8_layout(fmt) ? QK : QK_K;
    return takes_format(fmt) && k > 0 && k % whole == 0 ? layout_of(fmt).bytes * (padded(k) / QK_K)
                                                        : -1;
}

/* the fast kernels' vector width in bits: 512 (AVX-512 VNNI), 256 (AVX2), 0 (none) */
int asyncengine_i8_width(void) {
#if defined(I8_512)
    return 512;
#elif defined(I8_256)
    return 256;
#else
    return 0;
#endif
}

/* 1 where this build has a fast kernel for format fmt: AVX-512 VNNI every format, AVX2 the K
 * formats (their products' pairs of u8 x s8 stay within 16 bits; Q8_0's against x + 128 do not) */
int asyncengine_i8_fast(int fmt) {
#if defined(I8_512)
    return takes_format(fmt);
#elif defined(I8_256)
    return fmt == FMT_Q4_K || fmt == FMT_Q5_K || fmt == FMT_Q6_K;
#else
    (void)fmt;
    return 0;
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* packing                                                                                    */

/* one row's super-block as GGUF stores it -> values (u8), scales, mins, d, dm */
static void decode_super_block(int fmt, const uint8_t *w, uint8_t *q, int *sc, int *m, float *d,
                               float *dm) {
    if (fmt == FMT_Q6_K) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *s = (const int8_t *)(w + 192);
        *d = fp16_to_float(w + 208);
        *dm = 32.0f * *d;
        for (int j = 0; j < 16; j++) sc[j] = m[j] = s[j];
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, q += 128)
            for (int l = 0; l < 32; l++) {
                q[l] = (uint8_t)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4));
                q[l + 32] = (uint8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
                q[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                q[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
        return;
    }
    const int high = fmt == FMT_Q5_K;
    const uint8_t *qh = w + 16, *qs = w + (high ? 48 : 16);
    *d = fp16_to_float(w);
    *dm = fp16_to_float(w + 2);
    for (int j = 0; j < 8; j++) k_scale_min(j, w + 4, &sc[j], &m[j]);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            int lo = qs[32 * c + l] & 0xF, hi = qs[32 * c + l] >> 4;
            if (high) {
                lo += (qh[l] & (1 << (2 * c))) ? 16 : 0;
                hi += (qh[l] & (2 << (2 * c))) ? 16 : 0;
            }
            q[64 * c + l] = (uint8_t)lo;
            q[64 * c + 32 + l] = (uint8_t)hi;
        }
}

/* one block of 32 as GGUF stores it -> values (s8), d and m: Q8_0 (fp16 d, 32 int8), Q4_0
 * (fp16 d, 16 bytes of nibbles: q - 8), Q4_1 (fp16 d, fp16 m, nibbles: q), Q5_0 / Q5_1 (as
 * Q4_0 / Q4_1 with 4 bytes of fifth bits before the nibbles: q - 16 / q) */
static void decode_block32(int fmt, const uint8_t *w, int8_t *q, float *d, float *m) {
    const int has_min = has_min_of(fmt), has_high = has_high_of(fmt);
    *d = fp16_to_float(w);
    *m = has_min ? fp16_to_float(w + 2) : 0.0f;
    if (fmt == FMT_Q8_0) {
        memcpy(q, w + 2, 32);
        return;
    }
    const uint8_t *qh = w + 2 + 2 * has_min, *qs = w + q4_qs_at(has_min, has_high);
    const int mid = has_min ? 0 : (int)q4_mid(has_high);
    for (int t = 0; t < 16; t++) {
        int lo = qs[t] & 0xF, hi = qs[t] >> 4;
        if (has_high) {
            lo |= ((qh[t / 8] >> (t % 8)) & 1) << 4;
            hi |= ((qh[2 + t / 8] >> (t % 8)) & 1) << 4;
        }
        q[t] = (int8_t)(lo - mid);
        q[t + 16] = (int8_t)(hi - mid);
    }
}

/* 32-value block rows' (at most NP) blocks into one panel (zeroed: the blocks past k stay
 * zero, d and m 0, their sums' start 0) */
static void pack_panel_q8(int fmt, const uint8_t *const *rows, int nrows, int64_t k,
                          uint8_t *dst) {
    const int64_t bytes = q8_bytes(fmt);
    const int64_t block = fmt == FMT_Q8_0 ? 34 : q4_block_bytes(has_min_of(fmt), has_high_of(fmt));
    int8_t q[32];
    for (int64_t s = 0; s < padded(k) / QK_K; s++) {
        uint8_t *out = dst + s * bytes;
        for (int c = 0; c < nrows; c++)
            for (int j = 0; j < 8 && (8 * s + j) * QK < k; j++) {
                float d, m;
                decode_block32(fmt, rows[c] + (8 * s + j) * block, q, &d, &m);
                int32_t start = 0;
                for (int t = 0; t < 32; t++) {
                    out[value_at(FMT_Q8_0, 32 * j + t, c)] = (uint8_t)q[t];
                    start -= 128 * q[t];
                }
                memcpy(out + Q8_OFF_AT + 4 * (j * NP + c), &start, 4);
                memcpy(out + Q8_D_AT + 4 * (j * NP + c), &d, 4);
                if (has_min_of(fmt)) memcpy(out + Q8_M_AT + 4 * (j * NP + c), &m, 4);
            }
    }
}

/* rows' (at most NP, the rest of the panel zero) super-blocks into one panel */
static void pack_panel(int fmt, const uint8_t *const *rows, int nrows, int64_t k, uint8_t *dst) {
    const sb_layout l = layout_of(fmt);
    const int64_t nsb = padded(k) / QK_K;
    const int64_t block = fmt == FMT_Q6_K ? 210 : fmt == FMT_Q5_K ? 176 : 144;
    memset(dst, 0, (size_t)(l.bytes * nsb));
    if (q8_layout(fmt)) {
        pack_panel_q8(fmt, rows, nrows, k, dst);
        return;
    }
    uint8_t q[QK_K];
    int sc[16], m[16];
    for (int64_t s = 0; s < nsb; s++) {
        uint8_t *out = dst + s * l.bytes;
        for (int c = 0; c < nrows; c++) {
            float d, dm;
            decode_super_block(fmt, rows[c] + s * block, q, sc, m, &d, &dm);
            const int mid = centred(fmt) ? 32 : 0;
            int32_t off = 0;
            for (int v = 0; v < QK_K; v++) {
                out[value_at(fmt, v, c)] |= (uint8_t)((q[v] - mid) << value_shift(fmt, v));
                off += sc[v / l.sub] * (q[v] - mid);
            }
            for (int j = 0; j < l.nsub; j++) {
                ((int8_t *)(out + l.sc))[j * NP + c] = (int8_t)sc[j];
                if (!centred(fmt))
                    ((int16_t *)(out + l.mins))[(j / 2) * 2 * NP + 2 * c + j % 2] = (int16_t)m[j];
            }
            if (centred(fmt)) memcpy(out + l.mins + 4 * c, &off, 4);
            memcpy(out + l.d + 4 * c, &d, 4);
            if (!centred(fmt)) memcpy(out + l.dm + 4 * c, &dm, 4);
        }
    }
}

/* W (rows x k in fmt; the first rows / XR * XR in interleaved groups where `interleaved`) ->
 * ceil(rows / NP) panels at dst (asyncengine_i8_panel_bytes each) */
void asyncengine_i8_pack(int fmt, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t k,
                         int interleaved, uint8_t *dst, int threads) {
    const int64_t panels = (rows + NP - 1) / NP, pb = asyncengine_i8_panel_bytes(fmt, k);
    const int64_t grouped = interleaved && interleaves(fmt) ? rows / XR * XR : 0;
#pragma omp parallel num_threads(threads) if (panels > 1)
    {
        uint8_t *staging = (uint8_t *)malloc((size_t)(NP * row_bytes));
        if (staging == NULL) abort();
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const uint8_t *src[NP];
            const int64_t r0 = p * NP;
            const int nrows = (int)(rows - r0 < NP ? rows - r0 : NP);
            for (int64_t g = r0; g < r0 + nrows; g += XR) {
                if (g + XR <= grouped) { /* a whole group: taken out of its interleaving */
                    interleave_group(fmt, staging + (g - r0) * row_bytes, row_bytes, k,
                                     (uint8_t *)w + g * row_bytes, 1);
                    for (int r = 0; r < XR; r++)
                        src[g - r0 + r] = staging + (g - r0 + r) * row_bytes;
                } else {
                    for (int64_t r = g; r < r0 + nrows && r < g + XR; r++)
                        src[r - r0] = w + r * row_bytes;
                }
            }
            pack_panel(fmt, src, nrows, k, dst + p * pb);
        }
        free(staging);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* activations                                                                                */

/* x [n, k] (float32 or bf16) -> q int8 [n, kp] (or q + 128 as unsigned bytes where `shifted`: what
 * the centred values meet), xd [n, kp / qb] (max|x| / 127 of each qb values: 256, or 32 for the
 * 32-value block formats, whose scales meet each block's sums anyway), b16 int16 [n, kp / 16] and
 * b32 int16 [n, kp / 32] (sums of q); kp = padded(k), the values past k zero (k a multiple of
 * 32) */
void asyncengine_i8_quantize(const void *x, int64_t n, int64_t k, int bf16, int shifted, int qb,
                             int8_t *q, float *xd, int16_t *b16, int16_t *b32, int threads) {
    const int64_t kp = padded(k), nsb = kp / QK_K;
#pragma omp parallel for schedule(static) num_threads(threads) if (n * k >= 65536)
    for (int64_t i = 0; i < n; i++) {
        float v[QK_K];
        for (int64_t s = 0; s < nsb; s++) {
            const int64_t in = i * k + s * QK_K, off = i * kp + s * QK_K;
            const int valid = (int)(k - s * QK_K < QK_K ? k - s * QK_K : QK_K);
            if (valid < QK_K) memset(v + valid, 0, (size_t)(QK_K - valid) * sizeof(float));
            if (bf16) {
                int j = 0;
#if defined(I8_512)
                for (; j + 16 <= valid; j += 16)
                    _mm512_storeu_ps(v + j, load_bf16x16((const uint16_t *)x + in + j));
#endif
                for (; j < valid; j++) v[j] = bf16_to_float(((const uint16_t *)x)[in + j]);
            } else
                memcpy(v, (const float *)x + in, (size_t)valid * sizeof(float));
            int8_t *qs = q + off;
            int16_t *sums = b16 + i * (kp / 16) + s * 16;
#if defined(I8_512)
            /* the loop below, 16 values at a time: the same roundings; the sums come from the
             * stored bytes (biased to unsigned, summed 8 at a time by vpsadbw) */
            for (int g = 0; g < QK_K; g += qb) {
                __m512 amax16 = _mm512_setzero_ps();
                for (int j = g; j < g + qb; j += 16)
                    amax16 = _mm512_max_ps(amax16, _mm512_abs_ps(_mm512_loadu_ps(v + j)));
                const float amax = _mm512_reduce_max_ps(amax16);
                const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
                for (int j = g; j < g + qb; j += 16) {
                    const __m512i qi = _mm512_cvt_roundps_epi32(
                        _mm512_mul_ps(_mm512_loadu_ps(v + j), inv),
                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    const __m512i qu =
                        shifted ? _mm512_add_epi32(qi, _mm512_set1_epi32(128)) : qi;
                    _mm_storeu_si128((__m128i *)(qs + j), _mm512_cvtepi32_epi8(qu));
                }
                xd[(off + g) / qb] = amax / 127.0f;
            }
            const __m512i bias = _mm512_set1_epi8(shifted ? 0 : (char)0x80);
            __m128i s8[4]; /* sums of 8 bytes, biased by 8 * 128 */
            for (int c = 0; c < 4; c++)
                s8[c] = _mm512_cvtepi64_epi16(_mm512_sad_epu8(
                    _mm512_xor_si512(_mm512_loadu_si512((const void *)(qs + 64 * c)), bias),
                    _mm512_setzero_si512()));
            const __m128i base = _mm_set1_epi16(16 * 128);
            const __m128i lo = _mm_sub_epi16(_mm_hadd_epi16(s8[0], s8[1]), base),
                          hi = _mm_sub_epi16(_mm_hadd_epi16(s8[2], s8[3]), base);
            _mm_storeu_si128((__m128i *)sums, lo);
            _mm_storeu_si128((__m128i *)(sums + 8), hi);
            _mm_storeu_si128((__m128i *)(b32 + i * (kp / 32) + s * 8), _mm_hadd_epi16(lo, hi));
#else
            for (int g = 0; g < QK_K; g += qb) {
#if defined(I8_256)
                /* the scalar loop's roundings 8 values at a time (vcvtps2dq rounds to nearest
                 * even, as nearbyintf; max ignores a NaN as fmaxf does): 5.6x faster */
                __m256 amax8 = _mm256_setzero_ps();
                for (int j = g; j < g + qb; j += 8)
                    amax8 = _mm256_max_ps(
                        _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(v + j)), amax8);
                __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8),
                                       _mm256_extractf128_ps(amax8, 1));
                m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
                m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
                const float amax = _mm_cvtss_f32(m4);
                const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
                for (int j = g; j < g + qb; j += 32) {
                    __m256i qi[4];
                    for (int u = 0; u < 4; u++)
                        qi[u] = _mm256_cvtps_epi32(
                            _mm256_mul_ps(_mm256_loadu_ps(v + j + 8 * u), inv));
                    /* packs interleave the 128-bit lanes: put the four 8-value runs in order */
                    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                                              _mm256_packs_epi32(qi[2], qi[3]));
                    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
                    _mm256_storeu_si256((__m256i *)(qs + j),
                                        _mm256_permutevar8x32_epi32(packed, order));
                }
#else
                float amax = 0.0f;
                for (int j = g; j < g + qb; j++) amax = fmaxf(amax, fabsf(v[j]));
                const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
                for (int j = g; j < g + qb; j++) qs[j] = (int8_t)nearbyintf(v[j] * inv);
#endif
                for (int b = g / 16; b < (g + qb) / 16; b++) {
                    int sum = 0;
                    for (int j = 0; j < 16; j++) sum += qs[16 * b + j];
                    sums[b] = (int16_t)sum;
                }
                if (shifted)
                    for (int j = g; j < g + qb; j++) qs[j] = (int8_t)(uint8_t)(qs[j] + 128);
                xd[(off + g) / qb] = amax / 127.0f;
            }
            for (int b = 0; b < QK_K / 32; b++)
                b32[i * (kp / 32) + s * 8 + b] = (int16_t)(sums[2 * b] + sums[2 * b + 1]);
#endif
        }
    }
}

/* one activation row as the kernels take it */
typedef struct {
    const int8_t *q;
    const float *xd;
    const int16_t *b; /* sums per sub-block: b16 (Q6_K) or b32 */
} i8_row;

/* ------------------------------------------------------------------------------------------ */
/* the products                                                                               */

#if !defined(I8_512)
/* the scalar kernel: nr rows x np panels over super-blocks s0..s1 - 1, added into
 * out[r * NV * NP + v * NP + c] */
static void tile_scalar_q8(int fmt, const uint8_t *const *w, int np, int64_t s0, int64_t s1,
                           const i8_row *a, int nr, float *out) {
    const int64_t bytes = q8_bytes(fmt);
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < np; v++)
            for (int c = 0; c < NP; c++) {
                float acc = out[r * NV * NP + v * NP + c];
                for (int64_t s = s0; s < s1; s++) {
                    const uint8_t *blk = w[v] + s * bytes;
                    float t = 0.0f;
                    for (int j = 0; j < 8; j++) {
                        int32_t isum;
                        float d;
                        memcpy(&isum, blk + Q8_OFF_AT + 4 * (j * NP + c), 4);
                        memcpy(&d, blk + Q8_D_AT + 4 * (j * NP + c), 4);
                        for (int u = 0; u < 32; u++) {
                            const int kk = 32 * j + u;
                            isum += (int8_t)blk[value_at(FMT_Q8_0, kk, c)] *
                                    (uint8_t)a[r].q[s * QK_K + kk];
                        }
                        const float xd = a[r].xd[s * 8 + j];
                        t = fmaf((float)isum, d * xd, t);
                        if (has_min_of(fmt)) {
                            float m;
                            memcpy(&m, blk + Q8_M_AT + 4 * (j * NP + c), 4);
                            t = fmaf(m, (float)a[r].b[s * 8 + j] * xd, t);
                        }
                    }
                    acc += t;
                }
                out[r * NV * NP + v * NP + c] = acc;
            }
}

static void tile_scalar(int fmt, const uint8_t *const *w, int np, int64_t s0, int64_t s1,
                        const i8_row *a, int nr, float *out) {
    const sb_layout l = layout_of(fmt);
    if (q8_layout(fmt)) {
        tile_scalar_q8(fmt, w, np, s0, s1, a, nr, out);
        return;
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < np; v++)
            for (int c = 0; c < NP; c++) {
                float acc = out[r * NV * NP + v * NP + c];
                for (int64_t s = s0; s < s1; s++) {
                    const uint8_t *blk = w[v] + s * l.bytes;
                    int32_t isum = 0, imin = 0;
                    for (int j = 0; j < l.nsub; j++) {
                        int32_t part = 0;
                        for (int t = 0; t < l.sub; t++) {
                            const int kk = j * l.sub + t;
                            const uint8_t byte = blk[value_at(fmt, kk, c)];
                            const int x = centred(fmt) ? (uint8_t)a[r].q[s * QK_K + kk]
                                                       : a[r].q[s * QK_K + kk];
                            if (centred(fmt)) part += (int8_t)byte * x;
                            else part += ((byte >> value_shift(fmt, kk)) &
                                          (nibbles(fmt) ? 0xF : 0xFF)) * x;
                        }
                        isum += part * ((const int8_t *)(blk + l.sc))[j * NP + c];
                        if (!centred(fmt)) {
                            const int16_t *mins = (const int16_t *)(blk + l.mins);
                            imin += mins[(j / 2) * 2 * NP + 2 * c + j % 2] * a[r].b[s * l.nsub + j];
                        }
                    }
                    float d, dm = 0.0f;
                    memcpy(&d, blk + l.d + 4 * c, 4);
                    if (centred(fmt)) {
                        int32_t off;
                        memcpy(&off, blk + l.mins + 4 * c, 4);
                        isum -= 128 * off;
                    } else
                        memcpy(&dm, blk + l.dm + 4 * c, 4);
                    acc = fmaf(d * (float)isum - dm * (float)imin, a[r].xd[s], acc);
                }
                out[r * NV * NP + v * NP + c] = acc;
            }
}
#endif

/* lines [from, to) of panels pf[0..n-1], asked for while a tile runs, a part before each of its
 * steps over a sub-block (the whole range at once before a tile kept a thread's panel stream at
 * ~16 GB/s at 8 rows, the products waiting on memory) */
typedef struct {
    const uint8_t *const *pf;
    int n;
    int64_t from, to;
} i8_prefetch;

static inline Q_ALWAYS_INLINE void prefetch_part(const i8_prefetch *p, int64_t step,
                                                 int64_t steps) {
    const int64_t span = p->to - p->from;
    const int64_t a = p->from + span * step / steps, b = p->from + span * (step + 1) / steps;
    for (int v = 0; v < p->n; v++)
        for (int64_t line = a; line < b; line++) __builtin_prefetch(p->pf[v] + 64 * line, 0, 3);
}

#if defined(I8_512)
/* each byte's high nibble: one GFNI bit-matrix instruction (row i of the matrix picks bit i + 4)
 * where the CPU has it, for the shift and mask */
static inline __m512i high_nibbles(__m512i w) {
#if defined(__GFNI__)
    return _mm512_gf2p8affine_epi64_epi8(w, _mm512_set1_epi64(0x1020408000000000ll), 0);
#else
    return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F));
#endif
}

/* one step of 4 k: the loaded weight vectors wv[0..nv-1] meet rows xq[0..mr-1] (the weights
 * the unsigned operand, or the shifted activations where the values are centred) */
static inline Q_ALWAYS_INLINE void k4_step(__m512i (*iacc)[NV], const __m512i *wv,
                                           const int8_t *const *xq, int kk, const int mr,
                                           const int nv, const int cen) {
    for (int r = 0; r < mr; r++) {
        int32_t x4;
        memcpy(&x4, xq[r] + 4 * kk, 4);
        const __m512i xb = _mm512_set1_epi32(x4);
        for (int v = 0; v < nv; v++)
            iacc[r][v] = cen ? _mm512_dpbusd_epi32(iacc[r][v], xb, wv[v])
                             : _mm512_dpbusd_epi32(iacc[r][v], wv[v], xb);
    }
}

/* the AVX-512 VNNI micro-kernel: mr rows x nv panels over super-blocks s0..s1 - 1 of nsub
 * sub-blocks, the values nibbles (nib) or bytes, added into out (the float sums stay there, so
 * that the registers hold the MR x NV product chains and as many int32 sums) */
static inline Q_ALWAYS_INLINE void tile_512(const uint8_t *const *w, const int nv, int64_t s0,
                                            int64_t s1, const i8_row *a, const int mr,
                                            const int nsub, const int nib, float *out,
                                            const i8_prefetch *pf) {
    const int sub4 = QK_K / nsub / 4; /* steps of 4 k per sub-block */
    const int cen = nsub == 16;       /* Q6_K: centred values */
    const int64_t sc_at = QK_K * NP / (nib ? 2 : 1), mins_at = sc_at + nsub * NP,
                  d_at = mins_at + (cen ? NP * 4 : nsub * NP * 2);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const int64_t bytes = d_at + (cen ? NP * 4 : 2 * NP * 4);
    for (int64_t s = s0; s < s1; s++) {
        const uint8_t *blk[NV];
        for (int v = 0; v < nv; v++) blk[v] = w[v] + s * bytes;
        const int8_t *xq[MR];
        for (int r = 0; r < mr; r++) xq[r] = a[r].q + s * QK_K;
        __m512i isum[MR][NV]; /* nibbles: the int32 sums */
        __m512 fsum[MR][NV];  /* bytes: the float sums */
        for (int r = 0; r < mr; r++)
            for (int v = 0; v < nv; v++) {
                isum[r][v] = _mm512_setzero_si512();
                fsum[r][v] = _mm512_setzero_ps();
            }
        for (int j = 0; j < nsub; j++) {
            prefetch_part(pf, (s - s0) * nsub + j, (s1 - s0) * nsub);
            /* nibbles: the low ones' sums in iacc, the high ones' in ihi (16 values each) */
            __m512i iacc[MR][NV], ihi[MR][NV];
            for (int r = 0; r < mr; r++)
                for (int v = 0; v < nv; v++) iacc[r][v] = ihi[r][v] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int t = 0; t < sub4; t += 1 + nib) {
                const int kk = j * sub4 + t;
                __m512i wv[NV], hi[NV];
                for (int v = 0; v < nv; v++) {
                    wv[v] = _mm512_load_si512((const void *)(blk[v] + 64 * (nib ? kk / 2 : kk)));
                    /* once into a register: the compiler otherwise loads the bytes again for
                     * every row's vpdpbusd (Q5_K's product at 32 rows 1.3x slower, Q6_K's 10%) */
                    if (!nib) __asm__("" : "+v"(wv[v]));
                    if (nib) {
                        hi[v] = high_nibbles(wv[v]);
                        wv[v] = _mm512_and_si512(wv[v], m4);
                    }
                }
                k4_step(iacc, wv, xq, kk, mr, nv, cen);
                if (nib) k4_step(ihi, hi, xq, kk + 1, mr, nv, cen);
            }
            for (int v = 0; v < nv; v++) {
                const __m512i scv = _mm512_cvtepi8_epi32(
                    _mm_load_si128((const __m128i *)(blk[v] + sc_at + NP * j)));
                const __m512 scf = _mm512_cvtepi32_ps(scv);
                for (int r = 0; r < mr; r++)
                    if (nib) { /* a sum of 16 nibble products (|.| <= 16 * 127 * 15) fits its
                                * low 16 bits: vpdpwssd against the scale scales and adds it in
                                * one instruction (vpmulld is two, and an add) */
                        isum[r][v] = _mm512_dpwssd_epi32(isum[r][v], iacc[r][v], scv);
                        isum[r][v] = _mm512_dpwssd_epi32(isum[r][v], ihi[r][v], scv);
                    } else /* bytes: the sum (|.| <= 16 * 255 * 32) times the scale is exact
                            * in a float, and vcvtdq2ps + vfmadd are two instructions where
                            * vpmulld + vpaddd are three (Q6_K's products 1.1-1.25x faster) */
                        fsum[r][v] =
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r][v]), scf, fsum[r][v]);
            }
        }
        if (cen) {
            for (int v = 0; v < nv; v++) {
                const __m512i off = _mm512_slli_epi32(
                    _mm512_load_si512((const void *)(blk[v] + mins_at)), 7);
                const __m512 d = _mm512_load_ps((const float *)(blk[v] + d_at));
                for (int r = 0; r < mr; r++) {
                    float *o = out + r * NV * NP + v * NP;
                    /* out stays in memory between super-blocks: kept in 8 registers, it
                     * pushed the sums onto the stack (Q6_K's products ~1.15x slower) */
                    __asm__("" : "+r"(o));
                    const __m512 t =
                        _mm512_mul_ps(_mm512_sub_ps(fsum[r][v], _mm512_cvtepi32_ps(off)), d);
                    _mm512_storeu_ps(o, _mm512_fmadd_ps(t, _mm512_set1_ps(a[r].xd[s]),
                                                        _mm512_loadu_ps(o)));
                }
            }
            continue;
        }
        __m512i imin[MR][NV];
        for (int r = 0; r < mr; r++)
            for (int v = 0; v < nv; v++) imin[r][v] = _mm512_setzero_si512();
        for (int p = 0; p < nsub / 2; p++) {
            __m512i mv[NV];
            for (int v = 0; v < nv; v++)
                mv[v] = _mm512_load_si512((const void *)(blk[v] + mins_at + 64 * p));
            for (int r = 0; r < mr; r++) {
                int32_t b2;
                memcpy(&b2, a[r].b + s * nsub + 2 * p, 4);
                const __m512i bb = _mm512_set1_epi32(b2);
                for (int v = 0; v < nv; v++)
                    imin[r][v] = _mm512_dpwssd_epi32(imin[r][v], mv[v], bb);
            }
        }
        for (int v = 0; v < nv; v++) {
            const __m512 d = _mm512_load_ps((const float *)(blk[v] + d_at));
            const __m512 dm = _mm512_load_ps((const float *)(blk[v] + d_at + NP * 4));
            for (int r = 0; r < mr; r++) {
                float *o = out + r * NV * NP + v * NP;
                if (!nib) __asm__("" : "+r"(o)); /* as Q6_K's (Q4_K's 3% faster without) */
                const __m512 sum = nib ? _mm512_cvtepi32_ps(isum[r][v]) : fsum[r][v];
                const __m512 t = _mm512_fmsub_ps(sum, d,
                                                 _mm512_mul_ps(_mm512_cvtepi32_ps(imin[r][v]), dm));
                _mm512_storeu_ps(o, _mm512_fmadd_ps(t, _mm512_set1_ps(a[r].xd[s]),
                                                    _mm512_loadu_ps(o)));
            }
        }
    }
}

/* the 32-value block formats' micro-kernel: each block's int32 sums (started at -128 off) meet
 * its float scale as they end (and Q4_1's / Q5_1's min its activations' sum), into float sums per
 * super-block, which meet the activation scale once */
static inline Q_ALWAYS_INLINE void tile_512_q8(const uint8_t *const *w, const int nv, int64_t s0,
                                               int64_t s1, const i8_row *a, const int mr,
                                               const int has_min, float *out,
                                               const i8_prefetch *pf, const int tail) {
    const int64_t bytes = has_min ? Q8_M_AT + 8 * NP * 4 : Q8_M_AT;
    for (int64_t s = s0; s < s1; s++) {
        /* the padding's zero blocks add exact zeros: skipped (hidden 896: 1/8 of each product) */
        const int nb = s == s1 - 1 ? tail : 8;
        const uint8_t *blk[NV];
        for (int v = 0; v < nv; v++) blk[v] = w[v] + s * bytes;
        const int8_t *xq[MR];
        for (int r = 0; r < mr; r++) xq[r] = a[r].q + s * QK_K;
        __m512 facc[MR][NV];
        for (int r = 0; r < mr; r++)
            for (int v = 0; v < nv; v++) facc[r][v] = _mm512_setzero_ps();
        /* Q4_1, Q5_1: each row's blocks' activation sums times their scales (bx), 8 at once */
        float bx[MR][8] __attribute__((aligned(32)));
        if (has_min)
            for (int r = 0; r < mr; r++)
                _mm256_store_ps(bx[r], _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(
                                                         _mm_loadu_si128((const __m128i *)(
                                                             a[r].b + s * 8)))),
                                                     _mm256_loadu_ps(a[r].xd + s * 8)));
        for (int j = nb; j < 8; j++) prefetch_part(pf, (s - s0) * 8 + j, (s1 - s0) * 8);
        for (int j = 0; j < nb; j++) {
            prefetch_part(pf, (s - s0) * 8 + j, (s1 - s0) * 8);
            __m512i iacc[MR][NV];
            for (int v = 0; v < nv; v++) {
                const __m512i start =
                    _mm512_load_si512((const void *)(blk[v] + Q8_OFF_AT + 64 * j));
                for (int r = 0; r < mr; r++) iacc[r][v] = start;
            }
#pragma GCC unroll 8
            for (int t = 0; t < 8; t++) {
                const int kk = 8 * j + t;
                __m512i wv[NV];
                for (int v = 0; v < nv; v++) {
                    wv[v] = _mm512_load_si512((const void *)(blk[v] + 64 * kk));
                    __asm__("" : "+v"(wv[v])); /* once into a register, as Q6_K's */
                }
                k4_step(iacc, wv, xq, kk, mr, nv, 1);
            }
            __m512 xd[MR];
            for (int r = 0; r < mr; r++) xd[r] = _mm512_set1_ps(a[r].xd[s * 8 + j]);
            for (int v = 0; v < nv; v++) {
                const __m512 d = _mm512_load_ps((const float *)(blk[v] + Q8_D_AT + 64 * j));
                for (int r = 0; r < mr; r++)
                    facc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r][v]),
                                                 _mm512_mul_ps(d, xd[r]), facc[r][v]);
            }
        }
        if (has_min) { /* the min term after the blocks, their loop Q4_0's: 1-7% faster than
                        * beside each block's scale; its FMAs (one to each 8 vpdpbusd, on the
                        * same pipes) keep Q4_1's products ~1.1x Q4_0's */
#pragma GCC unroll 8
            for (int j = 0; j < nb; j++)
                for (int v = 0; v < nv; v++) {
                    const __m512 m = _mm512_load_ps((const float *)(blk[v] + Q8_M_AT + 64 * j));
                    for (int r = 0; r < mr; r++)
                        facc[r][v] = _mm512_fmadd_ps(m, _mm512_set1_ps(bx[r][j]), facc[r][v]);
                }
        }
        for (int v = 0; v < nv; v++)
            for (int r = 0; r < mr; r++) {
                float *o = out + r * NV * NP + v * NP;
                _mm512_storeu_ps(o, _mm512_add_ps(facc[r][v], _mm512_loadu_ps(o)));
            }
    }
}

/* one function per format, one inlined copy of the micro-kernel per (rows, panels): constants in
 * each keep the sums in registers */
#define I8_ROWS(X, nv) X(1, nv) X(2, nv) X(3, nv) X(4, nv)
#define I8_SHAPES(X) I8_ROWS(X, 1) I8_ROWS(X, 2)
#define I8_CASE(mr, nv)                                                                          \
    case (nv) * 16 + (mr):                                                                       \
        tile_512(w, nv, s0, s1, a, mr, NSUB, NIB, out, pf);                                      \
        (void)tail;                                                                              \
        return;
#define I8_FORMAT_FN(name, nsub, nib)                                                            \
    static Q_NOINLINE void name(const uint8_t *const *w, int np, int64_t s0, int64_t s1,         \
                                const i8_row *a, int nr, float *out, const i8_prefetch *pf,     \
                                int tail) {                                                    \
        enum { NSUB = nsub, NIB = nib };                                                         \
        switch (np * 16 + nr) { I8_SHAPES(I8_CASE) }                                             \
    }
I8_FORMAT_FN(tile_q4_k, 8, 1)
I8_FORMAT_FN(tile_q5_k, 8, 0)
I8_FORMAT_FN(tile_q6_k, 16, 0)
#undef I8_FORMAT_FN
#undef I8_CASE
#define I8_CASE(mr, nv)                                                                          \
    case (nv) * 16 + (mr):                                                                       \
        tile_512_q8(w, nv, s0, s1, a, mr, HAS_MIN, out, pf, tail);                               \
        return;
#define I8_BLOCK32_FN(name, has_min)                                                             \
    static Q_NOINLINE void name(const uint8_t *const *w, int np, int64_t s0, int64_t s1,         \
                                const i8_row *a, int nr, float *out, const i8_prefetch *pf,     \
                                int tail) {                                                    \
        enum { HAS_MIN = has_min };                                                              \
        switch (np * 16 + nr) { I8_SHAPES(I8_CASE) }                                             \
    }
I8_BLOCK32_FN(tile_q8, 0)
I8_BLOCK32_FN(tile_q4_1, 1)
#undef I8_BLOCK32_FN
#undef I8_CASE
#endif

#if defined(I8_256)
/* the AVX2 micro-kernel of the K formats: mr rows x one panel's 8 columns from c0 (a half), over
 * super-blocks s0..s1 - 1, added into out. Without vpdpbusd a step of 4 k is vpmaddubsw (the
 * pairs of u8 x s8 products in int16: at most 2 * 255 * 32, Q6_K's, within 16 bits) and vpmaddwd
 * against the sub-block's scale in both words of each column's lane: the scale is applied in
 * the instruction that widens the pairs to int32, so the sums need no step per sub-block (the
 * same integers as the VNNI kernel's) */
static inline Q_ALWAYS_INLINE void tile_256(const uint8_t *w, int c0, int64_t s0, int64_t s1,
                                            const i8_row *a, const int mr, const int nsub,
                                            const int nib, float *out, const i8_prefetch *pf) {
    const int sub4 = QK_K / nsub / 4; /* steps of 4 k per sub-block */
    const int cen = nsub == 16;       /* Q6_K: centred values */
    const sb_layout l = layout_of(nib ? FMT_Q4_K : cen ? FMT_Q6_K : FMT_Q5_K);
    const int64_t sc_at = l.sc, mins_at = l.mins, d_at = l.d, bytes = l.bytes;
    const __m256i m4 = _mm256_set1_epi8(0x0F), low_words = _mm256_set1_epi32(0xFFFF);
    for (int64_t s = s0; s < s1; s++) {
        const uint8_t *blk = w + s * bytes;
        const int8_t *xq[MR];
        for (int r = 0; r < mr; r++) xq[r] = a[r].q + s * QK_K;
        __m256i isum[MR];
        for (int r = 0; r < mr; r++) isum[r] = _mm256_setzero_si256();
        for (int j = 0; j < nsub; j++) {
            if (pf) prefetch_part(pf, (s - s0) * nsub + j, (s1 - s0) * nsub);
            const __m256i sc = _mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(blk + sc_at + NP * j + c0)));
            const __m256i scw = _mm256_or_si256(_mm256_and_si256(sc, low_words),
                                                _mm256_slli_epi32(sc, 16));
#pragma GCC unroll 8
            for (int t = 0; t < sub4; t += 1 + nib) {
                const int kk = j * sub4 + t;
                const __m256i wv = _mm256_load_si256(
                    (const __m256i *)(blk + 64 * (nib ? kk / 2 : kk) + 4 * c0));
                const __m256i lo = nib ? _mm256_and_si256(wv, m4) : wv;
                for (int r = 0; r < mr; r++) {
                    int32_t x4;
                    memcpy(&x4, xq[r] + 4 * kk, 4);
                    const __m256i xb = _mm256_set1_epi32(x4);
                    const __m256i p = cen ? _mm256_maddubs_epi16(xb, lo)
                                          : _mm256_maddubs_epi16(lo, xb);
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, scw));
                }
                if (nib) {
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), m4);
                    for (int r = 0; r < mr; r++) {
                        int32_t x4;
                        memcpy(&x4, xq[r] + 4 * (kk + 1), 4);
                        const __m256i p = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x4));
                        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, scw));
                    }
                }
            }
        }
        const __m256 d = _mm256_loadu_ps((const float *)(blk + d_at) + c0);
        if (cen) {
            const __m256i off = _mm256_slli_epi32(
                _mm256_loadu_si256((const __m256i *)(blk + mins_at + 4 * c0)), 7);
            for (int r = 0; r < mr; r++) {
                float *o = out + r * NV * NP + c0;
                const __m256 t =
                    _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[r], off)), d);
                _mm256_storeu_ps(o, _mm256_fmadd_ps(t, _mm256_set1_ps(a[r].xd[s]),
                                                    _mm256_loadu_ps(o)));
            }
            continue;
        }
        const __m256 dm = _mm256_loadu_ps((const float *)(blk + l.dm) + c0);
        for (int r = 0; r < mr; r++) {
            __m256i imin = _mm256_setzero_si256();
            for (int p = 0; p < nsub / 2; p++) {
                int32_t b2;
                memcpy(&b2, a[r].b + s * nsub + 2 * p, 4);
                const __m256i mv =
                    _mm256_loadu_si256((const __m256i *)(blk + mins_at + 64 * p + 4 * c0));
                imin = _mm256_add_epi32(imin, _mm256_madd_epi16(mv, _mm256_set1_epi32(b2)));
            }
            float *o = out + r * NV * NP + c0;
            const __m256 t = _mm256_fmsub_ps(_mm256_cvtepi32_ps(isum[r]), d,
                                             _mm256_mul_ps(_mm256_cvtepi32_ps(imin), dm));
            _mm256_storeu_ps(o,
                             _mm256_fmadd_ps(t, _mm256_set1_ps(a[r].xd[s]), _mm256_loadu_ps(o)));
        }
    }
}

/* one function per K format, one inlined copy per row count; each panel of the unit in turn,
 * its halves in turn (the first pass asks for the unit's next lines) */
#define I8_CASE(mr)                                                                              \
    case mr:                                                                                     \
        for (int v = 0; v < np; v++)                                                             \
            for (int h = 0; h < 2; h++)                                                          \
                tile_256(w[v], 8 * h, s0, s1, a, mr, NSUB, NIB, out + v * NP,                    \
                         v == 0 && h == 0 ? pf : NULL);                                          \
        return;
#define I8_FORMAT_FN(name, nsub, nib)                                                            \
    static Q_NOINLINE void name(const uint8_t *const *w, int np, int64_t s0, int64_t s1,         \
                                const i8_row *a, int nr, float *out, const i8_prefetch *pf,     \
                                int tail) {                                                    \
        enum { NSUB = nsub, NIB = nib };                                                         \
        (void)tail;                                                                              \
        switch (nr) { I8_CASE(1) I8_CASE(2) I8_CASE(3) I8_CASE(4) }                              \
    }
I8_FORMAT_FN(tile_q4_k, 8, 1)
I8_FORMAT_FN(tile_q5_k, 8, 0)
I8_FORMAT_FN(tile_q6_k, 16, 0)
#undef I8_FORMAT_FN
#undef I8_CASE
#endif

/* tail: the whole blocks of 32 in super-block s1 - 1 (8 but in a 32-value block format's row
 * whose length is no multiple of 256) */
static inline void tile(int fmt, const uint8_t *const *w, int np, int64_t s0, int64_t s1,
                        const i8_row *a, int nr, float *out, const i8_prefetch *pf, int tail) {
#if defined(I8_512)
    if (has_min_of(fmt)) tile_q4_1(w, np, s0, s1, a, nr, out, pf, tail);
    else if (q8_layout(fmt)) tile_q8(w, np, s0, s1, a, nr, out, pf, tail);
    else if (fmt == FMT_Q4_K) tile_q4_k(w, np, s0, s1, a, nr, out, pf, tail);
    else if (fmt == FMT_Q5_K) tile_q5_k(w, np, s0, s1, a, nr, out, pf, tail);
    else tile_q6_k(w, np, s0, s1, a, nr, out, pf, tail);
#elif defined(I8_256)
    if (fmt == FMT_Q4_K) tile_q4_k(w, np, s0, s1, a, nr, out, pf, tail);
    else if (fmt == FMT_Q5_K) tile_q5_k(w, np, s0, s1, a, nr, out, pf, tail);
    else if (fmt == FMT_Q6_K) tile_q6_k(w, np, s0, s1, a, nr, out, pf, tail);
    else tile_scalar(fmt, w, np, s0, s1, a, nr, out);
#else
    (void)pf;
    (void)tail;
    tile_scalar(fmt, w, np, s0, s1, a, nr, out);
#endif
}

/* y[at + c0 .. at + c0 + count - 1] = v[0 .. count - 1] + bias[c0 ..] */
static inline void store_row(const float *v, int64_t c0, int64_t count, const float *bias, void *y,
                             int64_t at, int out_bf16) {
    int64_t c = 0;
#if defined(I8_512)
    for (; c + 16 <= count; c += 16) {
        __m512 val = _mm512_loadu_ps(v + c);
        if (bias) val = _mm512_add_ps(val, _mm512_loadu_ps(bias + c0 + c));
        if (out_bf16)
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + at + c0 + c), to_bf16x16(val));
        else _mm512_storeu_ps((float *)y + at + c0 + c, val);
    }
#endif
    for (; c < count; c++) {
        const float val = v[c] + (bias ? bias[c0 + c] : 0.0f);
        if (out_bf16) ((uint16_t *)y)[at + c0 + c] = float_to_bf16(val);
        else ((float *)y)[at + c0 + c] = val;
    }
}

/* super-blocks a unit of panels takes at a time, every activation row meeting them while they
 * stay in L1 (the next ones asked for meanwhile, spread over the tiles): up to 32 rows one at a
 * time, more rows I8_CHUNK_SB. Measured by building this file with -DI8_CHUNK_SB=1, 2, 4, 8 and
 * timing asyncengine_i8_matmul on Qwen2.5-1.5B's projections, alternating builds (2 threads):
 * one super-block 2-8% ahead of two at 32 rows, two 10% ahead of one at 128, four 4-10% ahead
 * of two at 2048 rows */
#ifndef I8_CHUNK_SB
#define I8_CHUNK_SB 4
#endif
#define I8_ONE_SB_ROWS 32
/* 0: a tile's share of the next chunk's lines asked for all at once before it (prefetch_part:
 * 1.1-1.6x slower per projection at 4-16 rows, 1B / 3B decode steps of 6-8 rows 1.35-1.4x) */
#ifndef I8_SPREAD_PREFETCH
#define I8_SPREAD_PREFETCH 1
#endif

/* y [n, ldy] (float32 or bf16) columns 0..rows-1 = x W^T (+ bias), from asyncengine_i8_quantize's
 * output (rows of padded(k) values; xd per 32 values for the 32-value block formats, else per
 * 256) and W's panels;
 * parallel over units of NV panels, handed out as threads come free (a descheduled thread on a
 * loaded machine then delays no one). */
void asyncengine_i8_matmul(int fmt, const uint8_t *panels, int64_t rows, int64_t k,
                           const int8_t *xq, const float *xd, const int16_t *b16,
                           const int16_t *b32, int64_t n, const float *bias, void *y, int64_t ldy,
                           int out_bf16, int threads) {
    const sb_layout l = layout_of(fmt);
    const int64_t kp = padded(k), nsb = kp / QK_K, pb = l.bytes * nsb;
    const int64_t np_all = (rows + NP - 1) / NP;
    const int64_t units = (np_all + NV - 1) / NV, tiles = (n + MR - 1) / MR;
    const int tail = q8_layout(fmt) ? (int)((k + QK - 1) / QK - (nsb - 1) * 8) : 8;
    const int64_t chunk = n <= I8_ONE_SB_ROWS ? 1 : I8_CHUNK_SB;
    const int16_t *b = fmt == FMT_Q6_K ? b16 : b32;
    const int64_t bstride = fmt == FMT_Q6_K ? kp / 16 : kp / 32, qb = q8_layout(fmt) ? QK : QK_K;
    int64_t handed = 0; /* units handed out */
#pragma omp parallel num_threads(threads) if (units > 1)
    {
        float *acc = (float *)malloc((size_t)(tiles * MR * NV * NP) * sizeof(float));
        int64_t u = __atomic_fetch_add(&handed, 1, __ATOMIC_RELAXED);
        while (u < units) {
            int64_t next = -1; /* the unit this thread takes next */
            const int64_t p0 = u * NV;
            const int np = (int)(np_all - p0 < NV ? np_all - p0 : NV);
            const uint8_t *w[NV];
            for (int v = 0; v < np; v++) w[v] = panels + (p0 + v) * pb;
            if (acc) memset(acc, 0, (size_t)(tiles * MR * NV * NP) * sizeof(float));
            for (int64_t s0 = 0; s0 < nsb && acc; s0 += chunk) {
                const int64_t s1 = s0 + chunk < nsb ? s0 + chunk : nsb;
                /* the panels' next chunk, asked for over the tiles: this unit's, or as its
                 * last chunk starts the first of the unit this thread takes next (claimed now:
                 * else each unit began waiting on memory; 4-8% on 1536-deep projections) */
                const uint8_t *pf[NV];
                int npf = np;
                int64_t ahead = ((s1 + chunk < nsb ? s1 + chunk : nsb) - s1) * l.bytes / 64;
                if (s1 < nsb) {
                    for (int v = 0; v < np; v++) pf[v] = w[v] + s1 * l.bytes;
                } else {
                    next = __atomic_fetch_add(&handed, 1, __ATOMIC_RELAXED);
                    npf = next < units ? (int)(np_all - next * NV < NV ? np_all - next * NV : NV)
                                       : 0;
                    for (int v = 0; v < npf; v++) pf[v] = panels + (next * NV + v) * pb;
                    ahead = (chunk < nsb ? chunk : nsb) * l.bytes / 64;
                }
                for (int64_t t = 0; t < tiles; t++) {
                    i8_prefetch part = {pf, npf, ahead * t / tiles, ahead * (t + 1) / tiles};
#if !I8_SPREAD_PREFETCH
                    prefetch_part(&part, 0, 1); /* the tile's whole share, before it */
                    part.n = 0;
#endif
                    const int64_t i0 = t * MR;
                    const int nr = (int)(n - i0 < MR ? n - i0 : MR);
                    i8_row a[MR];
                    for (int r = 0; r < nr; r++)
                        a[r] = (i8_row){xq + (i0 + r) * kp, xd + (i0 + r) * (kp / qb),
                                        b + (i0 + r) * bstride};
                    tile(fmt, w, np, s0, s1, a, nr, acc + t * MR * NV * NP, &part,
                         s1 == nsb ? tail : 8);
                }
            }
            if (next < 0) next = __atomic_fetch_add(&handed, 1, __ATOMIC_RELAXED);
            if (acc)
                for (int64_t i = 0; i < n; i++)
                    store_row(acc + (i / MR) * MR * NV * NP + (i % MR) * NV * NP, p0 * NP,
                              np * NP < rows - p0 * NP ? np * NP : rows - p0 * NP, bias, y,
                              i * ldy, out_bf16);
            u = next;
        }
        free(acc);
    }
}

/* activation rows a product meets the panels in, one block after another: a long input's rows
 * (a 2048-row prompt chunk of an 8960-wide down projection: 18 MB in int8) would not stay in
 * cache while every unit of panels streamed them all */
#ifndef I8_ROW_BLOCK
#define I8_ROW_BLOCK 256
#endif

/* the quantized activations of n rows of k values (asyncengine_i8_quantize's outputs: rows of
 * padded(k)), in one allocation */
typedef struct {
    int8_t *q;
    float *xd;
    int16_t *b16, *b32;
} i8_acts;

static int acts_alloc(i8_acts *a, int fmt, int64_t n, int64_t k) {
    const int64_t qb = q8_layout(fmt) ? QK : QK_K, kp = padded(k);
    const size_t xd = (size_t)(n * (kp / qb)) * sizeof(float);
    const size_t b16 = (size_t)(n * (kp / 16)) * sizeof(int16_t);
    const size_t b32 = (size_t)(n * (kp / 32)) * sizeof(int16_t);
    char *base = (char *)malloc(xd + b16 + b32 + (size_t)(n * kp));
    a->xd = (float *)base;
    a->b16 = (int16_t *)(base + xd);
    a->b32 = (int16_t *)(base + xd + b16);
    a->q = (int8_t *)(base + xd + b16 + b32);
    return base != NULL;
}

static void acts_free(i8_acts *a) { free(a->xd); }

/* the product of every row of a, I8_ROW_BLOCK rows at a time */
static void multiply_rows(int fmt, const uint8_t *panels, int64_t rows, int64_t k,
                          const i8_acts *a, int64_t n, const float *bias, void *y, int64_t ldy,
                          int out_bf16, int threads) {
    const int64_t qb = q8_layout(fmt) ? QK : QK_K, kp = padded(k);
    for (int64_t r0 = 0; r0 < n; r0 += I8_ROW_BLOCK) {
        const int64_t m = n - r0 < I8_ROW_BLOCK ? n - r0 : I8_ROW_BLOCK;
        void *yr = out_bf16 ? (void *)((uint16_t *)y + r0 * ldy) : (void *)((float *)y + r0 * ldy);
        asyncengine_i8_matmul(fmt, panels, rows, k, a->q + r0 * kp, a->xd + r0 * (kp / qb),
                              a->b16 + r0 * (kp / 16), a->b32 + r0 * (kp / 32), m, bias, yr, ldy,
                              out_bf16, threads);
    }
}

/* quantize then multiply, in one call (the activations in scratch buffers); 0, or -1 where a
 * buffer could not be had */
int asyncengine_i8_linear(int fmt, const uint8_t *panels, int64_t rows, int64_t k, const void *x,
                          int64_t n, int x_bf16, const float *bias, void *y, int64_t ldy,
                          int out_bf16, int threads) {
    i8_acts a;
    if (!acts_alloc(&a, fmt, n, k)) return -1;
    asyncengine_i8_quantize(x, n, k, x_bf16, shifted_input(fmt), q8_layout(fmt) ? QK : QK_K, a.q,
                            a.xd, a.b16, a.b32, threads);
    multiply_rows(fmt, panels, rows, k, &a, n, bias, y, ldy, out_bf16, threads);
    acts_free(&a);
    return 0;
}

/* asyncengine_i8_linear of SwiGLU's rows (cpu_silu_row.h) from x [n, 2 k] = gate | up: each row
 * made in a buffer and quantized from there (the same values as from the bf16 / float32 rows
 * silu_and_mul would write), the [n, k] activations never written out and read back */
int asyncengine_i8_silu_linear(int fmt, const uint8_t *panels, int64_t rows, int64_t k,
                               const void *x, int64_t n, int x_bf16, const float *bias, void *y,
                               int64_t ldy, int out_bf16, int threads) {
    i8_acts a;
    if (!acts_alloc(&a, fmt, n, k)) return -1;
    const int qb = q8_layout(fmt) ? QK : QK_K, shifted = shifted_input(fmt);
    const int64_t kp = padded(k);
    int ok = 1;
#pragma omp parallel num_threads(threads) if (n * k >= 65536)
    {
        float *v = (float *)malloc((size_t)k * sizeof(float));
        if (v == NULL) {
#pragma omp atomic write
            ok = 0;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            if (v == NULL) continue;
            silu_mul_row(x, i, k, x_bf16, v, 0);
            asyncengine_i8_quantize(v, 1, k, 0, shifted, qb, a.q + i * kp, a.xd + i * (kp / qb),
                                    a.b16 + i * (kp / 16), a.b32 + i * (kp / 32), 1);
        }
        free(v);
    }
    if (ok) multiply_rows(fmt, panels, rows, k, &a, n, bias, y, ldy, out_bf16, threads);
    acts_free(&a);
    return ok ? 0 : -1;
}
