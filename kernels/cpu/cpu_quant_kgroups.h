/* The K formats (Q4_K, Q5_K, Q6_K) in interleaved groups of XR rows (the layout at the
 * interleaved-groups section of cpu_quant_blocks.h, which includes this file) against one
 * activation row: the batch-1 products of a Q4_K_M / Q5_K_M / Q6_K model.
 *
 * A super-block of a group is 8 rows' 256 values. Each 32-byte piece of values holds 4 values of
 * each row (lane r: row r), so every 4 activation bytes are broadcast once and meet all 8 rows in
 * one u8 x s8 product (vpdpbusd; AVX2: vpmaddubsw + vpmaddwd), and the 8 rows' scales are 8
 * lanes of one vector: no horizontal sums, no scalar scale decoding per row. Per activation
 * block of 32 (its own float scale, as every format here meets it) the 8 integer sums are
 * scaled once in float:
 *
 *   Q4_K / Q5_K  sum_j d sc_j xd_j S_j  -  sum_j dmin m_j xsd_j     (S_j = sum q x over sub-block j)
 *   Q6_K         sum_b d xd_b (sc_2b' (S' - 32 X') + sc_2b'+1 (S'' - 32 X''))  (halves of 16)
 *
 * Q6_K's values are stored unsigned (q, 0..63, standing for q - 32), so they are the unsigned
 * side of the product as they stand, and 32 X (X: the activation half's sum, one more product
 * against a constant 32) takes the offset off. The scalar build unpacks each super-block of the group and runs the
 * row kernels on it (the reference the SIMD kernels are tested against). */
#ifndef ASYNCENGINE_CPU_QUANT_KGROUPS_H
#define ASYNCENGINE_CPU_QUANT_KGROUPS_H

static inline void row_dot(int fmt, const uint8_t *w, int64_t k, const act_row *a, int nr,
                           float *out);

/* the group's rows one super-block at a time, unpacked and taken by the row kernels */
static inline void group_scalar_k(int fmt, const uint8_t *w, int64_t k, const act_row *a,
                                  float *out) {
    const int64_t bb = xr_header_bytes(fmt) + xr_value_bytes(fmt), nsb = k / QK_K;
    uint8_t rows[XR * 210];
    for (int r = 0; r < XR; r++) out[r] = 0.0f;
    for (int64_t s = 0; s < nsb; s++) {
        interleave_group(fmt, rows, bb, QK_K, (uint8_t *)w + s * XR * bb, 1);
        const act_row part = {a->q + s * QK_K, a->d + s * (QK_K / QK), a->sd + s * (QK_K / QK),
                              NULL};
        for (int r = 0; r < XR; r++) {
            float v;
            row_dot(fmt, rows + r * bb, QK_K, &part, 1, &v);
            out[r] += v;
        }
    }
}

#if defined(Q_ISA_SIMD)
/* u8 x s8 products of 4-byte pieces added into int32 lanes */
static inline __m256i kq_acc(__m256i s, __m256i u, __m256i x) {
#if defined(Q_ISA_VNNI)
    return _mm256_dpbusd_epi32(s, u, x);
#else
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}

/* byte j (0..3) of each 32-bit lane, unsigned, as float */
static inline __m256 lane_byte(__m256i v, int j) {
    const __m256i m = _mm256_set1_epi32(0xFF);
    switch (j) {
    case 0: return _mm256_cvtepi32_ps(_mm256_and_si256(v, m));
    case 1: return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8), m));
    case 2: return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 16), m));
    default: return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 24));
    }
}

/* byte j (0..3) of each 32-bit lane, signed, as int32 */
static inline __m256i lane_sbyte(__m256i v, int j) {
    switch (j) {
    case 0: return _mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24);
    case 1: return _mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24);
    case 2: return _mm256_srai_epi32(_mm256_slli_epi32(v, 8), 24);
    default: return _mm256_srai_epi32(v, 24);
    }
}

/* bit `bit` (0..7) of every byte moved to bit 4 (value 16), the rest cleared */
static inline __m256i bit_to_16(__m256i h, int bit) {
    __m256i v;
    switch (bit) {
    case 0: v = _mm256_slli_epi16(h, 4); break;
    case 1: v = _mm256_slli_epi16(h, 3); break;
    case 2: v = _mm256_slli_epi16(h, 2); break;
    case 3: v = _mm256_slli_epi16(h, 1); break;
    case 4: v = h; break;
    case 5: v = _mm256_srli_epi16(h, 1); break;
    case 6: v = _mm256_srli_epi16(h, 2); break;
    default: v = _mm256_srli_epi16(h, 3); break;
    }
    return _mm256_and_si256(v, _mm256_set1_epi8(16));
}

/* Q4_K (has_high 0) / Q5_K (has_high 1) group against one activation row: out[r], r < XR */
static inline Q_ALWAYS_INLINE void group_qk45(const uint8_t *w, int64_t nsb, const act_row *a,
                                              float *out, const int has_high) {
    const int64_t bb = XR * (has_high ? 176 : 144);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m63 = _mm256_set1_epi8(63),
                  m30 = _mm256_set1_epi8(0x30);
    __m256 acc = _mm256_setzero_ps(), off = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++, w += bb) {
        prefetch_ahead(w, bb);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 16)));
        /* lane r: row r's scales (mins) of sub-blocks 0..3 and 4..7, a byte each */
        const __m256i s0 = _mm256_loadu_si256((const __m256i *)(w + 32));
        const __m256i s1 = _mm256_loadu_si256((const __m256i *)(w + 64));
        const __m256i s2 = _mm256_loadu_si256((const __m256i *)(w + 96));
        const __m256i sc[2] = {
            _mm256_and_si256(s0, m63),
            _mm256_or_si256(_mm256_and_si256(s2, m4), _mm256_and_si256(_mm256_srli_epi16(s0, 2), m30))};
        const __m256i mn[2] = {
            _mm256_and_si256(s1, m63),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(s2, 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(s1, 2), m30))};
        const uint8_t *qh = w + 128, *qs = w + 128 + (has_high ? 8 * 32 : 0);
        const int8_t *x = a->q + s * QK_K;
        const float *xd = a->d + s * 8, *xsd = a->sd + s * 8;
        for (int c = 0; c < 4; c++) {
            __m256i s_lo = _mm256_setzero_si256(), s_hi = s_lo;
            for (int i = 0; i < 8; i++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 256 * c + 32 * i));
                __m256i lo = _mm256_and_si256(v, m4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                if (has_high) {
                    const __m256i h = _mm256_loadu_si256((const __m256i *)(qh + 32 * i));
                    lo = _mm256_or_si256(lo, bit_to_16(h, 2 * c));
                    hi = _mm256_or_si256(hi, bit_to_16(h, 2 * c + 1));
                }
                s_lo = kq_acc(s_lo, lo, bcast4(x + 64 * c + 4 * i));
                s_hi = kq_acc(s_hi, hi, bcast4(x + 64 * c + 32 + 4 * i));
            }
            const int j = 2 * c; /* sub-blocks j and j + 1: bytes j % 4, j % 4 + 1 of vector j / 4 */
            const __m256 sc_lo = lane_byte(sc[j / 4], j % 4), sc_hi = lane_byte(sc[j / 4], j % 4 + 1);
            const __m256 m_lo = lane_byte(mn[j / 4], j % 4), m_hi = lane_byte(mn[j / 4], j % 4 + 1);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_lo),
                                  _mm256_mul_ps(_mm256_mul_ps(d, sc_lo), _mm256_set1_ps(xd[j])), acc);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_hi),
                                  _mm256_mul_ps(_mm256_mul_ps(d, sc_hi), _mm256_set1_ps(xd[j + 1])),
                                  acc);
            off = _mm256_fmadd_ps(_mm256_mul_ps(dmin, m_lo), _mm256_set1_ps(xsd[j]), off);
            off = _mm256_fmadd_ps(_mm256_mul_ps(dmin, m_hi), _mm256_set1_ps(xsd[j + 1]), off);
        }
    }
    _mm256_storeu_ps(out, _mm256_sub_ps(acc, off));
}

static Q_NOINLINE void group_q4_k(const uint8_t *w, int64_t nsb, const act_row *a, float *out) {
    group_qk45(w, nsb, a, out, 0);
}

static Q_NOINLINE void group_q5_k(const uint8_t *w, int64_t nsb, const act_row *a, float *out) {
    group_qk45(w, nsb, a, out, 1);
}

/* Q6_K group against one activation row: out[r], r < XR */
static Q_NOINLINE void group_q6_k(const uint8_t *w, int64_t nsb, const act_row *a, float *out) {
    const int64_t bb = XR * 210;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i k32 = _mm256_set1_epi8(32);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++, w += bb) {
        prefetch_ahead(w, bb);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        const uint8_t *ql = w + 16, *qh = ql + 32 * 32, *scp = qh + 16 * 32;
        const int8_t *x = a->q + s * QK_K;
        const float *xd = a->d + s * 8;
        for (int half = 0; half < 2; half++) {
            for (int g = 0; g < 4; g++) {
                const int8_t *xb = x + 128 * half + 32 * g;
                const uint8_t *lp = ql + 32 * (16 * half + 8 * (g & 1)), *hp = qh + 32 * 8 * half;
                __m256i s0 = _mm256_setzero_si256(), s1 = s0, c0 = s0, c1 = s0;
                for (int i = 0; i < 8; i++) {
                    __m256i l = _mm256_loadu_si256((const __m256i *)(lp + 32 * i));
                    if (g >> 1) l = _mm256_srli_epi16(l, 4);
                    const __m256i h = _mm256_loadu_si256((const __m256i *)(hp + 32 * i));
                    __m256i hs;
                    switch (g) { /* bits 2g, 2g + 1 to bits 4, 5 */
                    case 0: hs = _mm256_slli_epi16(h, 4); break;
                    case 1: hs = _mm256_slli_epi16(h, 2); break;
                    case 2: hs = h; break;
                    default: hs = _mm256_srli_epi16(h, 2); break;
                    }
                    const __m256i q = _mm256_or_si256(_mm256_and_si256(l, m4),
                                                      _mm256_and_si256(hs, m30));
                    const __m256i xv = bcast4(xb + 4 * i);
                    if (i < 4) {
                        s0 = kq_acc(s0, q, xv);
                        c0 = kq_acc(c0, k32, xv);
                    } else {
                        s1 = kq_acc(s1, q, xv);
                        c1 = kq_acc(c1, k32, xv);
                    }
                }
                /* sub-block scales 8 half + 2g, + 1: bytes of vector (8 half + 2g) / 4 */
                const int j = 8 * half + 2 * g;
                const __m256i scv = _mm256_loadu_si256((const __m256i *)(scp + 32 * (j / 4)));
                const __m256i t = _mm256_add_epi32(
                    _mm256_mullo_epi32(_mm256_sub_epi32(s0, c0), lane_sbyte(scv, j % 4)),
                    _mm256_mullo_epi32(_mm256_sub_epi32(s1, c1), lane_sbyte(scv, j % 4 + 1)));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t),
                                      _mm256_mul_ps(d, _mm256_set1_ps(xd[4 * half + g])), acc);
            }
        }
    }
    _mm256_storeu_ps(out, acc);
}
#endif

/* a K-format group (Q4_K, Q5_K, Q6_K) against one activation row: out[r], r < XR */
static inline void group_dot_k(int fmt, const uint8_t *w, int64_t k, const act_row *a,
                               float *out) {
#if defined(Q_ISA_SIMD)
    switch (fmt) {
    case FMT_Q4_K: group_q4_k(w, k / QK_K, a, out); return;
    case FMT_Q5_K: group_q5_k(w, k / QK_K, a, out); return;
    case FMT_Q6_K: group_q6_k(w, k / QK_K, a, out); return;
    default: break;
    }
#endif
    group_scalar_k(fmt, w, k, a, out);
}

#endif
