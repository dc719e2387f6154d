/* The GGUF block formats' (Q4_K, Q5_K, Q6_K; Q8_0, Q4_0, Q4_1) products for many activation rows
 * at once, with AMX.
 *
 *   y[i, r] = sum_k x[i, k] * W[r, k]      W: interleaved groups of 8 rows (cpu_quant_blocks.h)
 *
 * At 8+ rows the q8 group kernels (cpu_quant_kgroups.h) are compute-bound: every row costs its
 * own integer products and per-sub-block float scaling. Here each weight is unpacked once per
 * call: 16 rows (two groups) of 32 values at a time become a bfloat16 tile in the layout AMX's
 * TDPBF16PS takes as its second operand (pairs of k side by side, one column per weight row),
 * with each row's scale and min applied in float (d sc q - dmin m, or a 32-value block's q d - m,
 * rounded once to bfloat16: the values of the dense product's bfloat16 copy). The activation
 * rows, in bfloat16, are the first operand as they lie in memory (16 rows x 32 values a tile, k in
 * natural order: each group's piece holds 4 consecutive values of each row, so the pieces of a
 * sub-block in order are its 32 values in order). Sums are float32. Up to 32 activation rows (one
 * pass, amx_blocks_once) each quarter super-block (64 values) is unpacked just before its
 * products and met once, from L1; past 32 a
 * panel of unpacked tiles (up to 1 MiB) stays in L2 while every activation tile meets it
 * (amx_blocks_panels).
 *
 * Nothing else here keeps an unpacked weight: the bytes read per step are the quantized ones,
 * a third to a quarter of a bfloat16 copy's, which is what bounds a 32-row decode step.
 *
 * AMX needs the kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM, asked once per process by
 * asyncengine_k_amx_available); without it, on CPUs without AMX, and in the narrower builds
 * (-DQ_FORCE_AVX2 / -DQ_FORCE_SCALAR) the functions say so and the caller keeps the other paths.
 */
#define _GNU_SOURCE /* syscall(), for arch_prctl */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_quant_blocks.h"

#if defined(Q_ISA_VNNI) && defined(__AMX_TILE__) && defined(__AMX_BF16__) &&                      \
    defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VBMI__) &&           \
    defined(__linux__)
#define K_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define K_TILE_BYTES 1024 /* one 16 x 64-byte tile */

/* bytes between the bfloat16 activation rows: one line more than the row, so that a tile's 16
 * rows do not all fall in one L1 set (k a multiple of 256: rows 4 KiB apart for k = 2048) */
static inline int64_t x_stride(int64_t k) { return 2 * k + 64; }

#if defined(K_AMX)
#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_permitted(void) {
    static int state = -1; /* -1 unknown, 0 no, 1 yes */
    if (state < 0) {
        unsigned long bits = 0;
        if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bits) == 0 &&
            (bits & (1ul << XFEATURE_XTILEDATA)))
            state = 1;
        else
            state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return state;
}

/* every tile 16 rows of 64 bytes: C (float32 16 x 16) in tmm0..3, A (activations) in tmm4..5,
 * B (weights) in tmm6..7 */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* lane j: row 8h + j / 2 of v16's 16 (each of group h's rows in two lanes) */
static inline __m512 half_rows(__m512 v16, int h) {
    const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    return _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(8 * h), pairs), v16);
}

static inline void halves(__m512 v16, __m512 *out) {
    out[0] = half_rows(v16, 0);
    out[1] = half_rows(v16, 1);
}

/* the two groups' 8-lane vectors as one of 16 rows */
static inline __m512 rows16(__m256 a, __m256 b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
}

/* byte indices into [group a's piece | group b's piece] putting value 2p + e of row n of group h
 * (byte 32 h + 4 n + 2 p + e) in dword lane 2n + e */
static inline __m512i pick_index(int h, int p) {
    const __m512i at = _mm512_set_epi32(29, 28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0);
    return _mm512_add_epi32(_mm512_set1_epi32(32 * h + 2 * p), at);
}

/* one piece of each group (lane r: 4 values of row r, u8) -> rows 2i, 2i + 1 of a B tile at
 * dst: values q D - M of the 16 rows (D, M: `halves` of the 16 rows' vectors). Each row's
 * values 2p, 2p + 1 land in the lanes that the bfloat16 conversion puts in dword n of B row
 * 2i + p: no shuffles after it. */
static inline Q_ALWAYS_INLINE void put_piece(__m256i qa, __m256i qb, const __m512 *d,
                                             const __m512 *m, uint8_t *dst) {
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1);
    const __mmask64 low_bytes = 0x1111111111111111ull;
    for (int p = 0; p < 2; p++) {
        __m512 f[2];
        for (int h = 0; h < 2; h++)
            f[h] = _mm512_fmsub_ps(
                _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(low_bytes, pick_index(h, p), v)),
                d[h], m[h]);
        _mm512_store_si512((void *)(dst + 64 * p), (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]));
    }
}

/* Q4_K / Q5_K: super-blocks of groups a and b (rows 0..7, 8..15), chunks c_first..c_last - 1
 * (sub-blocks 2c, 2c + 1) -> tiles 2 (c - c_first), + 1 at dst */
static inline Q_ALWAYS_INLINE void unpack_qk45(const uint8_t *a, const uint8_t *b, int has_high,
                                               int c_first, int c_last, uint8_t *dst) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m63 = _mm256_set1_epi8(63),
                  m30 = _mm256_set1_epi8(0x30);
    const uint8_t *g[2] = {a, b};
    __m256 d[2], dmin[2];
    __m256i sc[2][2], mn[2][2];
    for (int h = 0; h < 2; h++) {
        const uint8_t *w = g[h];
        d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        dmin[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 16)));
        const __m256i s0 = _mm256_loadu_si256((const __m256i *)(w + 32));
        const __m256i s1 = _mm256_loadu_si256((const __m256i *)(w + 64));
        const __m256i s2 = _mm256_loadu_si256((const __m256i *)(w + 96));
        sc[h][0] = _mm256_and_si256(s0, m63);
        sc[h][1] = _mm256_or_si256(_mm256_and_si256(s2, m4),
                                   _mm256_and_si256(_mm256_srli_epi16(s0, 2), m30));
        mn[h][0] = _mm256_and_si256(s1, m63);
        mn[h][1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(s2, 4), m4),
                                   _mm256_and_si256(_mm256_srli_epi16(s1, 2), m30));
    }
    const int64_t qs_at = 128 + (has_high ? 8 * 32 : 0);
    for (int c = c_first; c < c_last; c++) {
        __m512 dq[2][2], mq[2][2]; /* [lo / hi sub-block][group] */
        for (int half = 0; half < 2; half++) {
            const int j = 2 * c + half;
            halves(rows16(_mm256_mul_ps(d[0], lane_byte(sc[0][j / 4], j % 4)),
                            _mm256_mul_ps(d[1], lane_byte(sc[1][j / 4], j % 4))),
                     dq[half]);
            halves(rows16(_mm256_mul_ps(dmin[0], lane_byte(mn[0][j / 4], j % 4)),
                            _mm256_mul_ps(dmin[1], lane_byte(mn[1][j / 4], j % 4))),
                     mq[half]);
        }
        uint8_t *lo_tile = dst + 2 * (c - c_first) * K_TILE_BYTES;
        uint8_t *hi_tile = lo_tile + K_TILE_BYTES;
        for (int i = 0; i < 8; i++) {
            const __m256i va = _mm256_loadu_si256((const __m256i *)(a + qs_at + 256 * c + 32 * i));
            const __m256i vb = _mm256_loadu_si256((const __m256i *)(b + qs_at + 256 * c + 32 * i));
            __m256i la = _mm256_and_si256(va, m4), lb = _mm256_and_si256(vb, m4);
            __m256i ha = _mm256_and_si256(_mm256_srli_epi16(va, 4), m4);
            __m256i hb = _mm256_and_si256(_mm256_srli_epi16(vb, 4), m4);
            if (has_high) {
                const __m256i xa = _mm256_loadu_si256((const __m256i *)(a + 128 + 32 * i));
                const __m256i xb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * i));
                la = _mm256_or_si256(la, bit_to_16(xa, 2 * c));
                lb = _mm256_or_si256(lb, bit_to_16(xb, 2 * c));
                ha = _mm256_or_si256(ha, bit_to_16(xa, 2 * c + 1));
                hb = _mm256_or_si256(hb, bit_to_16(xb, 2 * c + 1));
            }
            put_piece(la, lb, dq[0], mq[0], lo_tile + 128 * i);
            put_piece(ha, hb, dq[1], mq[1], hi_tile + 128 * i);
        }
    }
}

/* Q6_K: super-blocks of groups a and b -> tiles 2 part, 2 part + 1 at dst (tile 4 half + g:
 * values 128 half + 32 g..+31; a part's two tiles are groups g0 = 2 (part % 2) and g0 + 1 of half
 * part / 2). The two tiles share their high bits and their scales' bytes, read once for both
 * (each tile reading them for itself took 1.03-1.08x the time). */
static inline Q_ALWAYS_INLINE void unpack_q6(const uint8_t *a, const uint8_t *b, int part,
                                             uint8_t *dst) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m512 d16 = rows16(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)a)),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b)));
    const __m512 k32 = _mm512_set1_ps(32.0f);
    const int64_t ql_at = 16, qh_at = 16 + 32 * 32, sc_at = qh_at + 16 * 32;
    const int half = part / 2, g0 = 2 * (part % 2);
    /* sub-blocks 8 half + 2 g + s (s: values 0..15 or 16..31 of group g's 32) of both tiles: the
     * bytes j % 4 = 2 (g - g0) + s of one 32-byte piece of scales */
    const __m256i sa = _mm256_loadu_si256((const __m256i *)(a + sc_at + 32 * (2 * half + g0 / 2)));
    const __m256i sb = _mm256_loadu_si256((const __m256i *)(b + sc_at + 32 * (2 * half + g0 / 2)));
    __m512 dq[4][2], mq[4][2];
    for (int u = 0; u < 4; u++) {
        const __m512 dsc = _mm512_mul_ps(d16, rows16(_mm256_cvtepi32_ps(lane_sbyte(sa, u)),
                                                     _mm256_cvtepi32_ps(lane_sbyte(sb, u))));
        halves(dsc, dq[u]);
        for (int h = 0; h < 2; h++) mq[u][h] = _mm512_mul_ps(dq[u][h], k32);
    }
    const int64_t lp = ql_at + 32 * 16 * half, hp = qh_at + 32 * 8 * half;
    for (int i = 0; i < 8; i++) {
        __m256i q[2][2]; /* [tile][group] */
        for (int h = 0; h < 2; h++) {
            const uint8_t *w = h ? b : a;
            /* group g's low 4 bits: 32-byte pieces 8 (g & 1).. of the half's ql, in their high
             * nibbles for g >= 2 */
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(w + lp + 32 * i));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(w + lp + 32 * (8 + i)));
            const __m256i hi = _mm256_loadu_si256((const __m256i *)(w + hp + 32 * i));
            __m256i h0, h1; /* bits 2g, 2g + 1 to bits 4, 5 */
            if (g0) {
                l0 = _mm256_srli_epi16(l0, 4);
                l1 = _mm256_srli_epi16(l1, 4);
                h0 = hi;
                h1 = _mm256_srli_epi16(hi, 2);
            } else {
                h0 = _mm256_slli_epi16(hi, 4);
                h1 = _mm256_slli_epi16(hi, 2);
            }
            q[0][h] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(h0, m30));
            q[1][h] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(h1, m30));
        }
        for (int t = 0; t < 2; t++)
            put_piece(q[t][0], q[t][1], dq[2 * t + i / 4], mq[2 * t + i / 4],
                      dst + t * K_TILE_BYTES + 128 * i);
    }
}

/* Q8_0 / Q4_0 / Q4_1: blocks j0, j0 + 1 (32 values each) of groups a and b -> tiles 0, 1 at
 * dst. A group's block: the 8 rows' fp16 d (Q4_1: then their fp16 m), then its value pieces
 * (cpu_quant_blocks.h): Q8_0 8 pieces of int8 (made unsigned by +128, taken back in the min),
 * Q4_x 4 pieces whose low nibbles are values 4c..4c+3, high ones 16 + 4c.. (Q4_0: q - 8). */
static inline Q_ALWAYS_INLINE void unpack_q32(int fmt, const uint8_t *a, const uint8_t *b,
                                              int64_t j0, uint8_t *dst) {
    const int64_t hb = fmt == FMT_Q4_1 ? 4 : 2, vb = fmt == FMT_Q8_0 ? 32 : 16;
    const int64_t gb = XR * (hb + vb);
    const __m256i m4 = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80);
    for (int64_t j = j0; j < j0 + 2; j++) {
        const uint8_t *ga = a + j * gb, *gbk = b + j * gb;
        const __m512 d16 = rows16(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)ga)),
                                  _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)gbk)));
        __m512 m16;
        if (fmt == FMT_Q4_1) /* q d + m = q d - (-m) */
            m16 = _mm512_sub_ps(
                _mm512_setzero_ps(),
                rows16(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ga + 2 * XR))),
                       _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gbk + 2 * XR)))));
        else m16 = _mm512_mul_ps(d16, _mm512_set1_ps(fmt == FMT_Q8_0 ? 128.0f : 8.0f));
        __m512 d[2], m[2];
        halves(d16, d);
        halves(m16, m);
        const uint8_t *qa = ga + XR * hb, *qb = gbk + XR * hb;
        uint8_t *tile = dst + (j - j0) * K_TILE_BYTES;
        for (int c = 0; c < vb / 4; c++) {
            const __m256i va = _mm256_loadu_si256((const __m256i *)(qa + 32 * c));
            const __m256i vbv = _mm256_loadu_si256((const __m256i *)(qb + 32 * c));
            if (fmt == FMT_Q8_0) {
                put_piece(_mm256_xor_si256(va, flip), _mm256_xor_si256(vbv, flip), d, m,
                          tile + 128 * c);
            } else {
                put_piece(_mm256_and_si256(va, m4), _mm256_and_si256(vbv, m4), d, m,
                          tile + 128 * c);
                put_piece(_mm256_and_si256(_mm256_srli_epi16(va, 4), m4),
                          _mm256_and_si256(_mm256_srli_epi16(vbv, 4), m4), d, m,
                          tile + 128 * (4 + c));
            }
        }
    }
}

/* tiles 2 quarter, 2 quarter + 1 of rows 16 blk..16 blk + 15 of W (groups 2 blk and 2 blk + 1;
 * `single`: only the first exists): values 64 quarter..+63 -> the two tiles at dst */
static void unpack_part(int fmt, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t blk,
                        int single, int64_t quarter, uint8_t *dst) {
    const int k_format = fmt == FMT_Q4_K || fmt == FMT_Q5_K || fmt == FMT_Q6_K;
    /* a group's bytes for these 64 values (a K format's: a quarter of its super-block's) */
    const int64_t sb_bytes = k_format ? row_bytes / (k / QK_K) * XR : 0;
    const int64_t span = k_format ? sb_bytes / 4 : row_bytes / (k / 64) * XR;
    const int64_t s = quarter / 4, part = quarter % 4;
    const uint8_t *a = w + 16 * blk * row_bytes + (k_format ? s * sb_bytes : 0);
    const uint8_t *b = single ? a : a + XR * row_bytes;
    /* these 64 values of both groups, 2 blocks (one pair, about one pair's products) ahead: the
     * hardware's prefetch alone kept one thread's stream at 3-3.5 GB/s, a third of the dense
     * product's */
    const int64_t ahead = 2 * 16 * row_bytes, at = k_format ? part * span : quarter * span;
    for (int64_t o = at; o < at + span + 64; o += 64) {
        _mm_prefetch((const char *)a + ahead + o, _MM_HINT_T0);
        _mm_prefetch((const char *)b + ahead + o, _MM_HINT_T0);
    }
    if (fmt == FMT_Q6_K) unpack_q6(a, b, (int)part, dst);
    else if (k_format) unpack_qk45(a, b, fmt == FMT_Q5_K, part, part + 1, dst);
    else unpack_q32(fmt, a, b, 2 * quarter, dst);
    if (single) /* the second group's columns (8..15: each 64-byte row's second half) are zeros */
        for (int r = 0; r < 32; r++) memset(dst + 64 * r + 32, 0, 32);
}

/* C tile (16 activation rows x 16 weight rows, float32) -> y rows i0.., columns c0.. (cols: 16
 * or 8) */
static void store_tile(const float *c, int64_t i0, int64_t n, int64_t c0, const float *bias,
                       void *y, int64_t ldy, int out_bf16, int cols) {
    const __mmask16 keep = cols == 16 ? 0xFFFF : 0x00FF;
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + c0) : _mm512_setzero_ps();
    for (int64_t i = 0; i < 16 && i0 + i < n; i++) {
        const __m512 v = _mm512_add_ps(_mm512_load_ps(c + 16 * i), b);
        const int64_t at = (i0 + i) * ldy + c0;
        if (out_bf16)
            _mm256_mask_storeu_epi16((uint16_t *)y + at, keep, (__m256i)_mm512_cvtneps_pbh(v));
        else _mm512_mask_storeu_ps((float *)y + at, keep, v);
    }
}

/* one step of k (32 values) of the products: activation tiles a (rows 0..15) and a + 16 stride
 * (16..31, where na > 1) against weight tiles b0 and b1 (where nb > 1), added into C tiles 0..3 */
static inline Q_ALWAYS_INLINE void tile_step(const uint8_t *a, int64_t stride, const uint8_t *b0,
                                             const uint8_t *b1, int na, int nb) {
    _tile_loadd(6, b0, 64);
    _tile_loadd(4, a, stride);
    _tile_dpbf16ps(0, 4, 6);
    if (nb > 1) {
        _tile_loadd(7, b1, 64);
        _tile_dpbf16ps(1, 4, 7);
    }
    if (na > 1) {
        _tile_loadd(5, a + 16 * stride, stride);
        _tile_dpbf16ps(2, 5, 6);
        if (nb > 1) _tile_dpbf16ps(3, 5, 7);
    }
}

/* up to 32 activation rows (one pass: each unpacked tile meets every activation tile once):
 * one thread's blocks b_first..b_last - 1 in pairs, as a stream of quarter super-blocks of a
 * pair (4 tiles), each unpacked while the one before it is multiplied, into the other half of
 * an 8-tile ring in bufs. The tiles stay in L1, where a pair of whole unpacked rows (k * 64
 * bytes) went to L2 and back: 8-30% less time at 32 rows (Q4_K / Q6_K, 1B and 1.5B shapes;
 * scripts/micro/bench_amx_ab.py). The same products in the same order as amx_blocks_panels
 * (unpacking two quarters ahead instead of one changed nothing). */
#define K_ONCE_AHEAD 1
#define K_ONCE_RING 2
static void amx_blocks_once(int fmt, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t k,
                            const uint8_t *xb, int64_t n, int64_t n_tiles, const float *bias,
                            void *y, int64_t ldy, int out_bf16, int64_t b_first, int64_t b_last,
                            uint8_t *bufs) {
    const int64_t stride = x_stride(k), groups = rows / XR, quarters = k / 64;
    const int64_t total = (b_last - b_first + 1) / 2 * quarters;
    const int na = n_tiles > 1 ? 2 : 1;
    float cbuf[4][256] __attribute__((aligned(64)));
    configure_tiles();
    /* quarter q: of the pair at b_first + 2 (q / quarters), k tiles 2 (q % quarters), + 1 */
#define K_ONCE_UNPACK(q)                                                                         \
    do {                                                                                         \
        const int64_t ublk = b_first + 2 * ((q) / quarters), uq = (q) % quarters;                \
        uint8_t *dst = bufs + ((q) % K_ONCE_RING) * 4 * K_TILE_BYTES;                            \
        for (int64_t j = ublk; j < ublk + 2 && j < b_last; j++)                                  \
            unpack_part(fmt, w, row_bytes, k, j, 2 * j + 1 >= groups, uq,                       \
                        dst + 2 * (j - ublk) * K_TILE_BYTES);                                    \
    } while (0)
    for (int64_t q = 0; q < K_ONCE_AHEAD && q < total; q++) K_ONCE_UNPACK(q);
    for (int64_t q = 0; q < total; q++) {
        const int64_t blk = b_first + 2 * (q / quarters), t = 2 * (q % quarters);
        const int nb = blk + 1 < b_last ? 2 : 1;
        if (t == 0) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
        }
        const uint8_t *bt = bufs + (q % K_ONCE_RING) * 4 * K_TILE_BYTES;
        for (int u = 0; u < 2; u++)
            tile_step(xb + (t + u) * 64, stride, bt + u * K_TILE_BYTES,
                      bt + (2 + u) * K_TILE_BYTES, na, nb);
        if (q + K_ONCE_AHEAD < total) K_ONCE_UNPACK(q + K_ONCE_AHEAD);
        if (t + 2 == 2 * quarters) {
            _tile_stored(0, cbuf[0], 64);
            _tile_stored(1, cbuf[1], 64);
            _tile_stored(2, cbuf[2], 64);
            _tile_stored(3, cbuf[3], 64);
            for (int a2 = 0; a2 < na; a2++)
                for (int j = 0; j < nb; j++)
                    store_tile(cbuf[2 * a2 + j], a2 * 16, n, (blk + j) * 16, bias, y, ldy,
                               out_bf16, 2 * (blk + j) + 1 >= groups ? 8 : 16);
        }
    }
#undef K_ONCE_UNPACK
    _tile_release();
}

/* Many activation rows: the weights unpacked a panel at a time (up to K_PANEL_BLOCKS 16-row
 * blocks x up to K_PANEL_K values, K_PANEL_BYTES of bfloat16 tiles, in L2) and every activation
 * tile pair meets the panel's blocks in turn before the next panel is unpacked: each weight is
 * still unpacked once per call, and an activation strip (32 rows x the panel's k) comes from
 * memory once per panel, not once per pair of blocks (which past L2, 256 rows at k = 2048, left
 * the tile unit waiting: 1.1-1.3 TFLOPS at 1024-2048 rows on two Sapphire Rapids cores where
 * panels reach 1.7-2.0, the dense product's 1.5-1.9; scripts/micro/bench_amx_ab.py). Where k
 * is longer than a panel, the sums wait between its chunks in cacc (float32: the same values in
 * the same order, so the same bits as one chunk). The next panel's unpacking spread between this
 * one's tile steps (a second buffer) took 1.1-1.3x the time: the vector unpacking and the tile
 * unit took turns on Sapphire Rapids rather than overlapping. */
#ifndef K_PANEL_BLOCKS
#define K_PANEL_BLOCKS 16
#endif
#ifndef K_PANEL_K
#define K_PANEL_K 2048
#endif
#ifndef K_PANEL_BYTES
#define K_PANEL_BYTES (1024 * 1024)
#endif
static int64_t panel_k(int64_t k) { return k < K_PANEL_K ? k : K_PANEL_K; }
static int64_t panel_blocks(int64_t k) {
    const int64_t fit = K_PANEL_BYTES / (32 * panel_k(k)) & ~(int64_t)1;
    return fit < 2 ? 2 : fit > K_PANEL_BLOCKS ? K_PANEL_BLOCKS : fit;
}
/* tiles of one panel, and floats of a thread's sums between chunks (none where k fits a panel) */
static int64_t panel_tiles(int64_t k) { return panel_blocks(k) * panel_k(k) / 32; }
static int64_t cacc_floats(int64_t k, int64_t n_tiles) {
    return k > panel_k(k) ? (n_tiles + 1) / 2 * panel_blocks(k) / 2 * 4 * 256 : 0;
}

static void amx_blocks_panels(int fmt, const uint8_t *w, int64_t row_bytes, int64_t rows,
                              int64_t k, const uint8_t *xb, int64_t n, int64_t n_tiles,
                              const float *bias, void *y, int64_t ldy, int out_bf16,
                              int64_t b_first, int64_t b_last, uint8_t *bufs, float *cacc) {
    const int64_t stride = x_stride(k), groups = rows / XR, pbm = panel_blocks(k);
    float cbuf[4][256] __attribute__((aligned(64)));
    configure_tiles();
    for (int64_t p0 = b_first; p0 < b_last; p0 += pbm) {
        const int64_t pb = b_last - p0 < pbm ? b_last - p0 : pbm;
        for (int64_t k0 = 0; k0 < k; k0 += panel_k(k)) {
            const int64_t kc = k - k0 < panel_k(k) ? k - k0 : panel_k(k), kt = kc / 32;
            for (int64_t j = 0; j < pb; j++)
                for (int64_t qq = 0; qq < kc / 64; qq++) {
                    const int64_t quarter = k0 / 64 + qq;
                    unpack_part(fmt, w, row_bytes, k, p0 + j, 2 * (p0 + j) + 1 >= groups,
                                quarter, bufs + (j * kt + 2 * qq) * K_TILE_BYTES);
                }
            const int first = k0 == 0, last = k0 + kc == k;
            for (int64_t at = 0; at < n_tiles; at += 2) {
                const int na = at + 1 < n_tiles ? 2 : 1;
                const uint8_t *xa = xb + at * 16 * stride + k0 * 2;
                for (int64_t jb = 0; jb < pb; jb += 2) {
                    const int nb = jb + 1 < pb ? 2 : 1;
                    float *c = cacc + ((at / 2) * (pbm / 2) + jb / 2) * 4 * 256;
                    if (first) {
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(2);
                        _tile_zero(3);
                    } else {
                        _tile_loadd(0, c, 64);
                        _tile_loadd(1, c + 256, 64);
                        _tile_loadd(2, c + 512, 64);
                        _tile_loadd(3, c + 768, 64);
                    }
                    const uint8_t *b0 = bufs + jb * kt * K_TILE_BYTES;
                    const uint8_t *b1 = b0 + kt * K_TILE_BYTES;
                    for (int64_t t = 0; t < kt; t++)
                        tile_step(xa + t * 64, stride, b0 + t * K_TILE_BYTES,
                                  b1 + t * K_TILE_BYTES, na, nb);
                    float *to = last ? cbuf[0] : c;
                    _tile_stored(0, to, 64);
                    _tile_stored(1, to + 256, 64);
                    _tile_stored(2, to + 512, 64);
                    _tile_stored(3, to + 768, 64);
                    if (last)
                        for (int a2 = 0; a2 < na; a2++)
                            for (int j = 0; j < nb; j++) {
                                const int64_t blk = p0 + jb + j;
                                store_tile(cbuf[2 * a2 + j], (at + a2) * 16, n, blk * 16, bias,
                                           y, ldy, out_bf16, 2 * blk + 1 >= groups ? 8 : 16);
                            }
                }
            }
        }
    }
    _tile_release();
}
#endif

/* 1 where this build and process can run asyncengine_k_amx_linear (asks for the AMX permission
 * the first time) */
int asyncengine_k_amx_available(void) {
#if defined(K_AMX)
    return amx_permitted();
#else
    return 0;
#endif
}

/* y [n, ldy] (float32 or bf16) columns 0..rows-1 = x W^T (+ bias) for x [n, k] (float32 or bf16)
 * and W in interleaved groups, rows % 8 == 0: a K format (Q4_K / Q5_K / Q6_K), k % 256 == 0, or
 * Q8_0 / Q4_0 / Q4_1, k % 64 == 0.
 * Returns 0 when done, -1 when it cannot run here (no AMX, other formats or shapes, no memory):
 * y is then untouched. Parallel over pairs of 16-row blocks, each thread a contiguous share. */
int asyncengine_k_amx_linear(int fmt, const uint8_t *w, int64_t row_bytes, int64_t rows,
                             int64_t k, const void *x, int64_t n, int x_bf16, const float *bias,
                             void *y, int64_t ldy, int out_bf16, int threads) {
#if defined(K_AMX)
    const int k_format = fmt == FMT_Q4_K || fmt == FMT_Q5_K || fmt == FMT_Q6_K;
    const int q32 = fmt == FMT_Q8_0 || fmt == FMT_Q4_0 || fmt == FMT_Q4_1;
    if (!(k_format || q32) || rows % XR || k % (k_format ? QK_K : 64) || n < 1 ||
        !amx_permitted())
        return -1;
    const int64_t n_tiles = (n + 15) / 16, blocks = (rows + 15) / 16;
    /* the activations as bfloat16 rows x_stride(k) apart, zero rows up to a whole tile */
    const int64_t stride = x_stride(k);
    uint8_t *xb = (uint8_t *)aligned_alloc(64, (size_t)(n_tiles * 16 * stride));
    if (!xb) return -1;
    /* only the rows past n need zeros (the line past each row is never read) */
    memset(xb + n * stride, 0, (size_t)((n_tiles * 16 - n) * stride));
#pragma omp parallel for num_threads(threads) if (n * k >= 65536) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        uint16_t *dst = (uint16_t *)(xb + i * stride);
        if (x_bf16) memcpy(dst, (const uint16_t *)x + i * k, (size_t)k * 2);
        else
            for (int64_t j = 0; j < k; j += 16)
                _mm256_store_si256(
                    (__m256i *)(dst + j),
                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps((const float *)x + i * k + j)));
    }
    int failed = 0;
    const int64_t pairs = (blocks + 1) / 2;
#pragma omp parallel num_threads(threads) if (pairs > 1) reduction(| : failed)
    {
        const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t first = 2 * (pairs * me / nt), last = 2 * (pairs * (me + 1) / nt);
        const int panels = n_tiles > 2;
        const int64_t buf_tiles = panels ? panel_tiles(k) : K_ONCE_RING * 4;
        const int64_t cfloats = panels ? cacc_floats(k, n_tiles) : 0;
        uint8_t *bufs = (uint8_t *)aligned_alloc(64, (size_t)(buf_tiles * K_TILE_BYTES));
        float *cacc = cfloats ? (float *)aligned_alloc(64, (size_t)cfloats * 4) : NULL;
        if (!bufs || (cfloats && !cacc)) failed = 1;
        else if (first < blocks && panels)
            amx_blocks_panels(fmt, w, row_bytes, rows, k, xb, n, n_tiles, bias, y, ldy,
                              out_bf16, first, last < blocks ? last : blocks, bufs, cacc);
        else if (first < blocks)
            amx_blocks_once(fmt, w, row_bytes, rows, k, xb, n, n_tiles, bias, y, ldy, out_bf16,
                            first, last < blocks ? last : blocks, bufs);
        free(bufs);
        free(cacc);
    }
    free(xb);
    return failed ? -1 : 0;
#else
    (void)fmt, (void)w, (void)row_bytes, (void)rows, (void)k, (void)x, (void)n, (void)x_bf16;
    (void)bias, (void)y, (void)ldy, (void)out_bf16, (void)threads;
    return -1;
#endif
}
