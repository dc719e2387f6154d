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

/* the AVX-512 forms (below) where the library is built for AVX-512 VNNI / BW */
#if defined(Q_ISA_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__)
#define KQ_512 1
#endif

/* Activation rows a K-format tile takes at once: 8 with the AVX-512 forms (their 32 registers
 * hold 8 rows' integer sums beside the weights), NR with the 32-byte ones (16 registers). 5-8
 * rows then unpack and read each weight piece once, not twice: 1B Q4_K_M steps of 5 / 6 / 8 rows
 * 0.87 / 0.88 / 0.93 of the 4-row tiles' time in the fused step, 0.84 / 0.84 / 0.99 on the torch
 * path (Xeon, alternating builds); Q4_K, Q5_K, Q6_K projections at 5-6 rows 0.79-0.85. -DKR=4
 * builds the 4-row tiles (to measure what 8 give). */
#if !defined(KR)
#if defined(KQ_512)
#define KR 8
#else
#define KR NR
#endif
#endif
#if KR != 8 && KR != 4
#error "KR: 8 or 4 activation rows a K-format tile"
#endif

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
            float v = 0.0f;
            if (fmt == FMT_Q6_K) row_q6_k(rows + r * bb, 1, &part, 1, &v);
            else row_qk45(rows + r * bb, 1, &part, 1, &v, fmt == FMT_Q5_K);
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

/* How far ahead of the bytes being multiplied the K-format group kernels ask for their weight
 * bytes, spread over the super-block (a burst of a whole super-block's lines at once kept one
 * thread's stream at ~80% of the Q4_0 kernel's on the same bytes). 8 KiB rather than 2: Q4_K
 * and Q6_K at batch 1 from memory 1.07-1.12x faster on a Zen 5 VM (6-16 KiB alike), a 1B
 * Q4_K_M model's fused layers 1.04-1.09x (scripts/micro/bench_decode_step.py
 * --baseline-library); on a Zen 4 VM (into L1) batch 1 alike, 2 rows 0.94x. Tunable with
 * -DQ_K_PREFETCH_BYTES. */
#ifndef Q_K_PREFETCH_BYTES
#define Q_K_PREFETCH_BYTES 8192
#endif
/* Into L2 rather than L1: on a Zen 4 VM a 1B Q4_K_M model's batch-1 and 2-row steps 1.10-1.23x
 * faster (docs/KERNELS.md), on a Zen 5 VM batch 1 alike; Q8_0's block kernels keep T0 (T2 made
 * their batch-1 step 0.93x on Zen 4). */
#ifndef Q_K_PREFETCH_HINT
#define Q_K_PREFETCH_HINT _MM_HINT_T2
#endif

static inline Q_ALWAYS_INLINE void kq_prefetch(const uint8_t *w, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64)
        _mm_prefetch((const char *)w + Q_K_PREFETCH_BYTES + o, Q_K_PREFETCH_HINT);
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

#if defined(KQ_512)
/* The AVX-512 forms: one 64-byte load is two pieces (lanes 0..7: rows' piece i, 8..15: piece
 * i + 1), the activation's two 4-byte pieces put beside them by one permute of the block, and
 * the two halves of the int32 sums added once per sub-block: half the instructions per weight
 * byte of the 32-byte form, which a batch-1 product needs to keep up with memory (at 32 bytes
 * per step one thread computed a Q4_K stream from DRAM at ~80% of the Q4_0 kernel's rate). */

static inline __m256i kq_fold(__m512i s) {
    return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
}

/* lanes 0..7: 32-bit piece i of v, lanes 8..15: piece i + 1 */
static inline __m512i kq_pair_index(int i) {
    return _mm512_set_epi32(i + 1, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1, i, i, i, i, i,
                            i, i, i);
}

/* The many-row forms put the weights' lanes in pairs instead of moving each activation row's
 * pieces beside them: lane 2r holds row r's piece i, lane 2r + 1 its piece i + 1, so the 8
 * activation bytes of pieces i, i + 1 broadcast as one 64-bit value (a load, no shuffle) meet
 * them. One permute per weight vector instead of one per activation row and vector: 4-row decode
 * steps of 1B / 3B Q4_K_M and Q5_K_M models 1.08-1.12x faster on Zen 4 (the same integer sums,
 * so the same results). */
static inline __m512i kq_pair_lanes(__m512i v) {
    return _mm512_permutexvar_epi32(
        _mm512_set_epi32(15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0), v);
}

/* 8 activation bytes (two 4-byte pieces) in every 64-bit lane */
static inline __m512i kq_pair_bcast(const int8_t *x) {
    int64_t v;
    memcpy(&v, x, 8);
    return _mm512_set1_epi64(v);
}

/* kq_fold of sums in paired lanes (kq_pair_lanes): lane r = lanes 2r + 2r + 1 */
static inline __m256i kq_fold_pairs(__m512i s) {
    return _mm512_cvtepi64_epi32(_mm512_add_epi64(s, _mm512_srli_epi64(s, 32)));
}

/* 32 times the sum of each run of 16 activation values of one super-block: sums[4 h] for half h
 * (0..15; the other lanes hold partial sums): Q6_K's offset term, from the activation alone */
static inline Q_ALWAYS_INLINE void half_sums32(const int8_t *x, int32_t *sums) {
    const __m512i k32 = _mm512_set1_epi8(32);
    for (int v = 0; v < 4; v++) {
        __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k32,
                                        _mm512_loadu_si512((const void *)(x + 64 * v)));
        t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_CDAB));
        t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC));
        _mm512_storeu_si512((void *)(sums + 16 * v), t);
    }
}

static inline __m512i bit_to_16_512(__m512i h, int bit) {
    __m512i v;
    switch (bit) {
    case 0: v = _mm512_slli_epi16(h, 4); break;
    case 1: v = _mm512_slli_epi16(h, 3); break;
    case 2: v = _mm512_slli_epi16(h, 2); break;
    case 3: v = _mm512_slli_epi16(h, 1); break;
    case 4: v = h; break;
    case 5: v = _mm512_srli_epi16(h, 1); break;
    case 6: v = _mm512_srli_epi16(h, 2); break;
    default: v = _mm512_srli_epi16(h, 3); break;
    }
    return _mm512_and_si512(v, _mm512_set1_epi8(16));
}

/* The kernels below take a tile of mr (1..KR) activation rows: each weight piece is unpacked
 * once for all of them (the batched products of 2-KR rows; a batch-1 step takes mr = 1), and each
 * row's sums are those it has alone, in the same order: results are batch invariant. */

/* chunk c (sub-blocks 2c, 2c + 1) of a Q4_K / Q5_K super-block: the 8 rows' integer sums
 * against activation rows x[0..mr-1] (each at its super-block) */
static inline Q_ALWAYS_INLINE void qk45_chunk_512(const uint8_t *qs, const uint8_t *qh,
                                                  const int8_t *const *x, const int mr, int c,
                                                  const int has_high, __m256i *sum_lo,
                                                  __m256i *sum_hi) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i s_lo[KR], s_hi[KR];
    for (int r = 0; r < mr; r++) s_lo[r] = s_hi[r] = _mm512_setzero_si512();
    for (int p = 0; p < 4; p++) {
        const __m512i v = kq_pair_lanes(_mm512_loadu_si512((const void *)(qs + 256 * c + 64 * p)));
        __m512i lo = _mm512_and_si512(v, m4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        if (has_high) {
            const __m512i h = kq_pair_lanes(_mm512_loadu_si512((const void *)(qh + 64 * p)));
            lo = _mm512_or_si512(lo, bit_to_16_512(h, 2 * c));
            hi = _mm512_or_si512(hi, bit_to_16_512(h, 2 * c + 1));
        }
        for (int r = 0; r < mr; r++) {
            s_lo[r] = _mm512_dpbusd_epi32(s_lo[r], lo, kq_pair_bcast(x[r] + 64 * c + 8 * p));
            s_hi[r] = _mm512_dpbusd_epi32(s_hi[r], hi, kq_pair_bcast(x[r] + 64 * c + 32 + 8 * p));
        }
    }
    for (int r = 0; r < mr; r++) {
        sum_lo[r] = kq_fold_pairs(s_lo[r]);
        sum_hi[r] = kq_fold_pairs(s_hi[r]);
    }
}

/* activation block g of a Q6_K half: the 8 rows' sums over its two halves of 16 (s0, s1) for
 * activation blocks xb[0..mr-1] (the offset term 32 X comes from half_sums32) */
static inline Q_ALWAYS_INLINE void q6_block_512(const uint8_t *lp, const uint8_t *hp,
                                                const int8_t *const *xb, const int mr, int g,
                                                __m256i *s0, __m256i *s1) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    __m512i a0[KR], a1[KR];
    for (int r = 0; r < mr; r++) a0[r] = a1[r] = _mm512_setzero_si512();
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
        const __m512i q =
            kq_pair_lanes(_mm512_or_si512(_mm512_and_si512(l, m4), _mm512_and_si512(hs, m30)));
        for (int r = 0; r < mr; r++) {
            const __m512i xp = kq_pair_bcast(xb[r] + 8 * p);
            if (p < 2) a0[r] = _mm512_dpbusd_epi32(a0[r], q, xp);
            else a1[r] = _mm512_dpbusd_epi32(a1[r], q, xp);
        }
    }
    for (int r = 0; r < mr; r++) {
        s0[r] = kq_fold_pairs(a0[r]);
        s1[r] = kq_fold_pairs(a1[r]);
    }
}
#endif

/* qk45_chunk_512, 32 bytes at a time */
static inline Q_ALWAYS_INLINE void qk45_chunk_256(const uint8_t *qs, const uint8_t *qh,
                                                  const int8_t *const *x, const int mr, int c,
                                                  const int has_high, __m256i *sum_lo,
                                                  __m256i *sum_hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < mr; r++) sum_lo[r] = sum_hi[r] = _mm256_setzero_si256();
    for (int i = 0; i < 8; i++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 256 * c + 32 * i));
        __m256i lo = _mm256_and_si256(v, m4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (has_high) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(qh + 32 * i));
            lo = _mm256_or_si256(lo, bit_to_16(h, 2 * c));
            hi = _mm256_or_si256(hi, bit_to_16(h, 2 * c + 1));
        }
        for (int r = 0; r < mr; r++) {
            sum_lo[r] = kq_acc(sum_lo[r], lo, bcast4(x[r] + 64 * c + 4 * i));
            sum_hi[r] = kq_acc(sum_hi[r], hi, bcast4(x[r] + 64 * c + 32 + 4 * i));
        }
    }
}

/* q6_block_512, 32 bytes at a time */
static inline Q_ALWAYS_INLINE void q6_block_256(const uint8_t *lp, const uint8_t *hp,
                                                const int8_t *const *xb, const int mr, int g,
                                                __m256i *s0, __m256i *s1, __m256i *c0,
                                                __m256i *c1) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i k32 = _mm256_set1_epi8(32);
    for (int r = 0; r < mr; r++) s0[r] = s1[r] = c0[r] = c1[r] = _mm256_setzero_si256();
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
        const __m256i q = _mm256_or_si256(_mm256_and_si256(l, m4), _mm256_and_si256(hs, m30));
        for (int r = 0; r < mr; r++) {
            const __m256i xv = bcast4(xb[r] + 4 * i);
            if (i < 4) {
                s0[r] = kq_acc(s0[r], q, xv);
                c0[r] = kq_acc(c0[r], k32, xv);
            } else {
                s1[r] = kq_acc(s1[r], q, xv);
                c1[r] = kq_acc(c1[r], k32, xv);
            }
        }
    }
}

#if defined(KQ_512)
#define qk45_chunk qk45_chunk_512
#else
#define qk45_chunk qk45_chunk_256
#endif

/* Q4_K (has_high 0) / Q5_K (has_high 1) group against activation rows a[0..mr-1]:
 * out[r * XR + j] */
static inline Q_ALWAYS_INLINE void group_qk45(const uint8_t *w, int64_t nsb, const act_row *a,
                                              const int mr, float *out, const int has_high) {
    const int64_t bb = XR * (has_high ? 176 : 144);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m63 = _mm256_set1_epi8(63),
                  m30 = _mm256_set1_epi8(0x30);
    __m256 acc[KR], off[KR];
    for (int r = 0; r < mr; r++) acc[r] = off[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++, w += bb) {
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
        const int8_t *x[KR];
        for (int r = 0; r < mr; r++) x[r] = a[r].q + s * QK_K;
        for (int c = 0; c < 4; c++) {
            kq_prefetch(w + c * (bb / 4), bb / 4);
            __m256i s_lo[KR], s_hi[KR];
            qk45_chunk(qs, qh, x, mr, c, has_high, s_lo, s_hi);
            const int j = 2 * c; /* sub-blocks j and j + 1: bytes j % 4, j % 4 + 1 of vector j / 4 */
            const __m256 dsc_lo = _mm256_mul_ps(d, lane_byte(sc[j / 4], j % 4));
            const __m256 dsc_hi = _mm256_mul_ps(d, lane_byte(sc[j / 4], j % 4 + 1));
            const __m256 dm_lo = _mm256_mul_ps(dmin, lane_byte(mn[j / 4], j % 4));
            const __m256 dm_hi = _mm256_mul_ps(dmin, lane_byte(mn[j / 4], j % 4 + 1));
            const int64_t b = s * 8 + j;
            for (int r = 0; r < mr; r++) {
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_lo[r]),
                                         _mm256_mul_ps(dsc_lo, _mm256_set1_ps(a[r].d[b])), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_hi[r]),
                                         _mm256_mul_ps(dsc_hi, _mm256_set1_ps(a[r].d[b + 1])),
                                         acc[r]);
                off[r] = _mm256_fmadd_ps(dm_lo, _mm256_set1_ps(a[r].sd[b]), off[r]);
                off[r] = _mm256_fmadd_ps(dm_hi, _mm256_set1_ps(a[r].sd[b + 1]), off[r]);
            }
        }
    }
    for (int r = 0; r < mr; r++) _mm256_storeu_ps(out + r * XR, _mm256_sub_ps(acc[r], off[r]));
}

/* Q6_K group against activation rows a[0..mr-1]: out[r * XR + j] */
static inline Q_ALWAYS_INLINE void group_q6(const uint8_t *w, int64_t nsb, const act_row *a,
                                            const int mr, float *out) {
    const int64_t bb = XR * 210;
    __m256 acc[KR];
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++, w += bb) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        const uint8_t *ql = w + 16, *qh = ql + 32 * 32, *scp = qh + 16 * 32;
#if defined(KQ_512)
        int32_t sums[KR][64];
        for (int r = 0; r < mr; r++) half_sums32(a[r].q + s * QK_K, sums[r]);
#endif
        for (int half = 0; half < 2; half++) {
            for (int g = 0; g < 4; g++) {
                kq_prefetch(w + (4 * half + g) * (bb / 8), bb / 8);
                const int hb = 4 * half + g; /* the activation block within the super-block */
                const int64_t b = s * 8 + hb;
                const int8_t *xb[KR];
                for (int r = 0; r < mr; r++) xb[r] = a[r].q + b * QK;
                const uint8_t *lp = ql + 32 * (16 * half + 8 * (g & 1)), *hp = qh + 32 * 8 * half;
                __m256i s0[KR], s1[KR], c0[KR], c1[KR];
#if defined(KQ_512)
                q6_block_512(lp, hp, xb, mr, g, s0, s1);
                for (int r = 0; r < mr; r++) {
                    c0[r] = _mm256_set1_epi32(sums[r][4 * (2 * hb)]);
                    c1[r] = _mm256_set1_epi32(sums[r][4 * (2 * hb + 1)]);
                }
#else
                q6_block_256(lp, hp, xb, mr, g, s0, s1, c0, c1);
#endif
                /* sub-block scales 8 half + 2g, + 1: bytes of vector (8 half + 2g) / 4 */
                const int j = 8 * half + 2 * g;
                const __m256i scv = _mm256_loadu_si256((const __m256i *)(scp + 32 * (j / 4)));
                const __m256i sc0 = lane_sbyte(scv, j % 4), sc1 = lane_sbyte(scv, j % 4 + 1);
                for (int r = 0; r < mr; r++) {
                    const __m256i t =
                        _mm256_add_epi32(_mm256_mullo_epi32(_mm256_sub_epi32(s0[r], c0[r]), sc0),
                                         _mm256_mullo_epi32(_mm256_sub_epi32(s1[r], c1[r]), sc1));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t),
                                             _mm256_mul_ps(d, _mm256_set1_ps(a[r].d[b])), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < mr; r++) _mm256_storeu_ps(out + r * XR, acc[r]);
}

/* a K-format group against nr (1..KR) activation rows: one function per format and row count
 * (a constant in each, so that the tiles' sums stay in registers; one function holding every
 * variant ran Q6_K's one-row tile at 2/3 of its speed) */
#define K_TILE_FN(name, mr, call)                                                                \
    static Q_NOINLINE void name##_##mr(const uint8_t *w, int64_t nsb, const act_row *a,         \
                                       float *out) {                                             \
        call;                                                                                    \
    }
#if KR == 8
#define K_TILES(name, ...)                                                                       \
    K_TILE_FN(name, 1, __VA_ARGS__(1)) K_TILE_FN(name, 2, __VA_ARGS__(2))                        \
    K_TILE_FN(name, 3, __VA_ARGS__(3)) K_TILE_FN(name, 4, __VA_ARGS__(4))                        \
    K_TILE_FN(name, 5, __VA_ARGS__(5)) K_TILE_FN(name, 6, __VA_ARGS__(6))                        \
    K_TILE_FN(name, 7, __VA_ARGS__(7)) K_TILE_FN(name, 8, __VA_ARGS__(8))
#define K_TILE_TABLE(name)                                                                       \
    {name##_1, name##_2, name##_3, name##_4, name##_5, name##_6, name##_7, name##_8}
#else
#define K_TILES(name, ...)                                                                       \
    K_TILE_FN(name, 1, __VA_ARGS__(1)) K_TILE_FN(name, 2, __VA_ARGS__(2))                        \
    K_TILE_FN(name, 3, __VA_ARGS__(3)) K_TILE_FN(name, 4, __VA_ARGS__(4))
#define K_TILE_TABLE(name) {name##_1, name##_2, name##_3, name##_4}
#endif
#define Q4_K_CALL(mr) group_qk45(w, nsb, a, mr, out, 0)
#define Q5_K_CALL(mr) group_qk45(w, nsb, a, mr, out, 1)
#define Q6_K_CALL(mr) group_q6(w, nsb, a, mr, out)
K_TILES(group_q4_k, Q4_K_CALL)
K_TILES(group_q5_k, Q5_K_CALL)
K_TILES(group_q6_k, Q6_K_CALL)
#undef K_TILE_FN
#undef K_TILES
#undef Q4_K_CALL
#undef Q5_K_CALL
#undef Q6_K_CALL

typedef void (*k_tile_fn)(const uint8_t *, int64_t, const act_row *, float *);

static inline void group_k_rows(int fmt, const uint8_t *w, int64_t nsb, const act_row *a, int nr,
                                float *out) {
    static const k_tile_fn tiles[3][KR] = {
        K_TILE_TABLE(group_q4_k), K_TILE_TABLE(group_q5_k), K_TILE_TABLE(group_q6_k)};
    tiles[fmt - FMT_Q4_K][(nr < KR ? nr : KR) - 1](w, nsb, a, out);
}
#undef K_TILE_TABLE
#endif


/* a K-format group (Q4_K, Q5_K, Q6_K) against nr (1..KR) activation rows: out[r * XR + j] */
static inline void group_dot_k(int fmt, const uint8_t *w, int64_t k, const act_row *a, int nr,
                               float *out) {
#if defined(Q_ISA_SIMD)
    group_k_rows(fmt, w, k / QK_K, a, nr, out);
#else
    for (int r = 0; r < nr; r++) group_scalar_k(fmt, w, k, a + r, out + r * XR);
#endif
}

#endif
