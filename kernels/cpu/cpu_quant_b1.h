/* Batch-1 (one activation row) AVX-512 forms of the Q8_0, Q5_K and Q6_K interleaved-group kernels
 * (cpu_quant_blocks.h, cpu_quant_kgroups.h: the layouts), for the decode of one stream, where a
 * product must keep up with memory: the 32-byte forms spent more instructions per weight byte
 * than one core retires at the rate DRAM delivers (one thread: Q8_0 ~11 GB/s, Q5_K and Q6_K
 * ~11.5-14 where Q4_K reaches ~13-24).
 *
 *   Q8_0  64 bytes (two 4-value pieces of the 8 rows) per step: |w| against x with w's sign
 *         (vpabsb, a byte mask, one masked subtract) in one vpdpbusd; the 32-byte form took
 *         two vpsignb and a broadcast per 32 bytes.
 *   Q6_K  the offset term 32 X of each activation half of 16 (the same for all 8 rows) taken
 *         once per super-block from the activation alone, not by a second vpdpbusd against a
 *         constant 32 beside every weight product.
 *   Q5_K  (and Q6_K) the high bits put beside the low ones with one vpternlogd (a | b & mask)
 *         where an and and an or took two.
 *
 * The integer sums are the same as the kernels they stand for, and the float operations on them
 * the same in the same order: results are identical bit for bit (a row's result does not depend
 * on which kernel a batch took). Included by cpu_quant_blocks.h after cpu_quant_kgroups.h. */
#ifndef ASYNCENGINE_CPU_QUANT_B1_H
#define ASYNCENGINE_CPU_QUANT_B1_H

#if defined(Q_ISA_SIMD) && defined(KQ_512)
#define Q_B1_512 1

/* group_q8_0 (one activation row) 64 bytes at a time */
static Q_NOINLINE void group_q8_0_b1(const uint8_t *w, int64_t nb, const act_row *a, float *out) {
    const int64_t bb = XR * 34;
    const __m512i zero = _mm512_setzero_si512();
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bb) {
        prefetch_ahead(w, bb);
        const __m512i xv = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(a->q + b * QK)));
        const uint8_t *qs = w + 2 * XR;
        __m512i s = zero;
        for (int p = 0; p < 4; p++) {
            const __m512i v = _mm512_loadu_si512((const void *)(qs + 64 * p));
            const __m512i xp = _mm512_permutexvar_epi32(kq_pair_index(2 * p), xv);
            const __m512i xs = _mm512_mask_sub_epi8(xp, _mm512_movepi8_mask(v), zero, xp);
            s = _mm512_dpbusd_epi32(s, _mm512_abs_epi8(v), xs);
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(kq_fold(s)), _mm256_mul_ps(d, _mm256_set1_ps(a->d[b])),
                              acc);
    }
    _mm256_storeu_ps(out, acc);
}

/* a | (b & mask) in one instruction (vpternlogd) where an and and an or took two */
static inline __m512i or_masked(__m512i a, __m512i b, __m512i mask) {
    return _mm512_ternarylogic_epi32(a, b, mask, 0xF8);
}

/* bit `bit` (0..7) of every byte of h moved to bit 4, the other bits left as they fall
 * (bit_to_16_512 before its mask) */
static inline __m512i bit_at_4(__m512i h, int bit) {
    switch (bit) {
    case 0: return _mm512_slli_epi16(h, 4);
    case 1: return _mm512_slli_epi16(h, 3);
    case 2: return _mm512_slli_epi16(h, 2);
    case 3: return _mm512_slli_epi16(h, 1);
    case 4: return h;
    case 5: return _mm512_srli_epi16(h, 1);
    case 6: return _mm512_srli_epi16(h, 2);
    default: return _mm512_srli_epi16(h, 3);
    }
}

/* group_qk45 (one activation row) for Q5_K, the fifth bit put in with vpternlogd */
static Q_NOINLINE void group_q5_b1(const uint8_t *w, int64_t nsb, const act_row *a, float *out) {
    const int64_t bb = XR * 176;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m63 = _mm256_set1_epi8(63),
                  m30 = _mm256_set1_epi8(0x30);
    const __m512i z4 = _mm512_set1_epi8(0x0F), z16 = _mm512_set1_epi8(16);
    __m256 acc = _mm256_setzero_ps(), off = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++, w += bb) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 16)));
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
        const uint8_t *qh = w + 128, *qs = w + 128 + 8 * 32;
        const int8_t *x = a->q + s * QK_K;
        for (int c = 0; c < 4; c++) {
            kq_prefetch(w + c * (bb / 4), bb / 4);
            const __m512i xv = _mm512_loadu_si512((const void *)(x + 64 * c));
            __m512i a_lo = _mm512_setzero_si512(), a_hi = a_lo;
            for (int p = 0; p < 4; p++) {
                const __m512i v = _mm512_loadu_si512((const void *)(qs + 256 * c + 64 * p));
                const __m512i h = _mm512_loadu_si512((const void *)(qh + 64 * p));
                const __m512i lo = or_masked(_mm512_and_si512(v, z4), bit_at_4(h, 2 * c), z16);
                const __m512i hi = or_masked(_mm512_and_si512(_mm512_srli_epi16(v, 4), z4),
                                             bit_at_4(h, 2 * c + 1), z16);
                a_lo = _mm512_dpbusd_epi32(a_lo, lo, _mm512_permutexvar_epi32(kq_pair_index(2 * p), xv));
                a_hi = _mm512_dpbusd_epi32(a_hi, hi,
                                           _mm512_permutexvar_epi32(kq_pair_index(8 + 2 * p), xv));
            }
            const __m256i s_lo = kq_fold(a_lo), s_hi = kq_fold(a_hi);
            const int j = 2 * c;
            const __m256 dsc_lo = _mm256_mul_ps(d, lane_byte(sc[j / 4], j % 4));
            const __m256 dsc_hi = _mm256_mul_ps(d, lane_byte(sc[j / 4], j % 4 + 1));
            const __m256 dm_lo = _mm256_mul_ps(dmin, lane_byte(mn[j / 4], j % 4));
            const __m256 dm_hi = _mm256_mul_ps(dmin, lane_byte(mn[j / 4], j % 4 + 1));
            const int64_t b = s * 8 + j;
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_lo), _mm256_mul_ps(dsc_lo, _mm256_set1_ps(a->d[b])),
                                  acc);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_hi),
                                  _mm256_mul_ps(dsc_hi, _mm256_set1_ps(a->d[b + 1])), acc);
            off = _mm256_fmadd_ps(dm_lo, _mm256_set1_ps(a->sd[b]), off);
            off = _mm256_fmadd_ps(dm_hi, _mm256_set1_ps(a->sd[b + 1]), off);
        }
    }
    _mm256_storeu_ps(out, _mm256_sub_ps(acc, off));
}

/* group_q6 (one activation row): q6_block_512's sums without its constant products */
static Q_NOINLINE void group_q6_b1(const uint8_t *w, int64_t nsb, const act_row *a, float *out) {
    const int64_t bb = XR * 210;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++, w += bb) {
        int32_t sums[64];
        half_sums32(a->q + s * QK_K, sums);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        const uint8_t *ql = w + 16, *qh = ql + 32 * 32, *scp = qh + 16 * 32;
        for (int half = 0; half < 2; half++) {
            for (int g = 0; g < 4; g++) {
                kq_prefetch(w + (4 * half + g) * (bb / 8), bb / 8);
                const int hb = 4 * half + g; /* the activation block within the super-block */
                const int64_t b = s * 8 + hb;
                const __m512i xv =
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(a->q + b * QK)));
                const uint8_t *lp = ql + 32 * (16 * half + 8 * (g & 1)), *hp = qh + 32 * 8 * half;
                __m512i a0 = _mm512_setzero_si512(), a1 = a0;
                for (int p = 0; p < 4; p++) {
                    __m512i l = _mm512_loadu_si512((const void *)(lp + 64 * p));
                    if (g >> 1) l = _mm512_srli_epi16(l, 4);
                    const __m512i h = _mm512_loadu_si512((const void *)(hp + 64 * p));
                    __m512i hs;
                    switch (g) {
                    case 0: hs = _mm512_slli_epi16(h, 4); break;
                    case 1: hs = _mm512_slli_epi16(h, 2); break;
                    case 2: hs = h; break;
                    default: hs = _mm512_srli_epi16(h, 2); break;
                    }
                    const __m512i q = or_masked(_mm512_and_si512(l, m4), hs, m30);
                    const __m512i xp = _mm512_permutexvar_epi32(kq_pair_index(2 * p), xv);
                    if (p < 2) a0 = _mm512_dpbusd_epi32(a0, q, xp);
                    else a1 = _mm512_dpbusd_epi32(a1, q, xp);
                }
                const int j = 8 * half + 2 * g;
                const __m256i scv = _mm256_loadu_si256((const __m256i *)(scp + 32 * (j / 4)));
                const __m256i sc0 = lane_sbyte(scv, j % 4), sc1 = lane_sbyte(scv, j % 4 + 1);
                const __m256i c0 = _mm256_set1_epi32(sums[4 * (2 * hb)]);
                const __m256i c1 = _mm256_set1_epi32(sums[4 * (2 * hb + 1)]);
                const __m256i t =
                    _mm256_add_epi32(_mm256_mullo_epi32(_mm256_sub_epi32(kq_fold(a0), c0), sc0),
                                     _mm256_mullo_epi32(_mm256_sub_epi32(kq_fold(a1), c1), sc1));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(d, _mm256_set1_ps(a->d[b])),
                                      acc);
            }
        }
    }
    _mm256_storeu_ps(out, acc);
}
#endif

/* the batch-1 kernel of this file for fmt's group, if it has one: 1 when it wrote out[0..XR-1] */
static inline int group_dot_b1(int fmt, const uint8_t *w, int64_t k, const act_row *a, float *out) {
#if defined(Q_B1_512)
    switch (fmt) {
    case FMT_Q8_0: group_q8_0_b1(w, k / QK, a, out); return 1;
    case FMT_Q5_K: group_q5_b1(w, k / QK_K, a, out); return 1;
    case FMT_Q6_K: group_q6_b1(w, k / QK_K, a, out); return 1;
    default: return 0;
    }
#else
    (void)fmt, (void)w, (void)k, (void)a, (void)out;
    return 0;
#endif
}

#endif
