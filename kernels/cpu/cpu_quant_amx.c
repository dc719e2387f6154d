/* The K formats' (Q4_K, Q5_K, Q6_K) products for many activation rows at once, with AMX.
 *
 *   y[i, r] = sum_k x[i, k] * W[r, k]      W: interleaved groups of 8 rows (cpu_quant_blocks.h)
 *
 * At 8+ rows the q8 group kernels (cpu_quant_kgroups.h) are compute-bound: every row costs its
 * own integer products and per-sub-block float scaling. Here each weight is unpacked once per
 * call: 16 rows (two groups) of 32 values at a time become a bfloat16 tile in the layout AMX's
 * TDPBF16PS takes as its second operand (pairs of k side by side, one column per weight row),
 * with each row's scale and min applied in float (d sc q - dmin m, rounded once to bfloat16: the
 * values of the dense product's bfloat16 copy). The activation rows, in bfloat16, are the first
 * operand as they lie in memory (16 rows x 32 values a tile, k in natural order: each group's
 * piece holds 4 consecutive values of each row, so the pieces of a sub-block in order are its 32
 * values in order). Sums are float32. Past 32 activation rows, all of a thread's unpacked tiles
 * for a pair of 16-row blocks (k * 64 bytes: 512 KiB at k = 8192) stay in L2 while every
 * activation tile meets them; up to 32 (one pass, amx_blocks_once) each quarter super-block is
 * unpacked just before its products and met once, from L1.
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

/* Q6_K: super-blocks of groups a and b -> tiles t_first..t_last - 1 (tile 4 half + g: values
 * 128 half + 32 g..+31) at dst, t_first first */
static inline Q_ALWAYS_INLINE void unpack_q6(const uint8_t *a, const uint8_t *b, int t_first,
                                             int t_last, uint8_t *dst) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m512 d16 = rows16(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)a)),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b)));
    const __m512 k32 = _mm512_set1_ps(32.0f);
    const int64_t ql_at = 16, qh_at = 16 + 32 * 32, sc_at = qh_at + 16 * 32;
    for (int tt = t_first; tt < t_last; tt++) {
        const int half = tt / 4, g = tt % 4;
        {
            /* sub-blocks 8 half + 2g (values 0..15 of the 32) and + 1 (16..31) */
            __m512 dq[2][2], mq[2][2];
            for (int s = 0; s < 2; s++) {
                const int j = 8 * half + 2 * g + s;
                const __m256i sa = _mm256_loadu_si256((const __m256i *)(a + sc_at + 32 * (j / 4)));
                const __m256i sb = _mm256_loadu_si256((const __m256i *)(b + sc_at + 32 * (j / 4)));
                const __m512 dsc = _mm512_mul_ps(
                    d16, rows16(_mm256_cvtepi32_ps(lane_sbyte(sa, j % 4)),
                                _mm256_cvtepi32_ps(lane_sbyte(sb, j % 4))));
                halves(dsc, dq[s]);
                for (int h = 0; h < 2; h++) mq[s][h] = _mm512_mul_ps(dq[s][h], k32);
            }
            const int64_t lp = ql_at + 32 * (16 * half + 8 * (g & 1)), hp = qh_at + 32 * 8 * half;
            uint8_t *tile = dst + (tt - t_first) * K_TILE_BYTES;
            for (int i = 0; i < 8; i++) {
                __m256i q2[2];
                for (int h = 0; h < 2; h++) {
                    const uint8_t *w = h ? b : a;
                    __m256i l = _mm256_loadu_si256((const __m256i *)(w + lp + 32 * i));
                    if (g >> 1) l = _mm256_srli_epi16(l, 4);
                    const __m256i hi = _mm256_loadu_si256((const __m256i *)(w + hp + 32 * i));
                    __m256i hs;
                    switch (g) { /* bits 2g, 2g + 1 to bits 4, 5 */
                    case 0: hs = _mm256_slli_epi16(hi, 4); break;
                    case 1: hs = _mm256_slli_epi16(hi, 2); break;
                    case 2: hs = hi; break;
                    default: hs = _mm256_srli_epi16(hi, 2); break;
                    }
                    q2[h] = _mm256_or_si256(_mm256_and_si256(l, m4), _mm256_and_si256(hs, m30));
                }
                put_piece(q2[0], q2[1], dq[i / 4], mq[i / 4], tile + 128 * i);
            }
        }
    }
}

/* tiles 2 part, 2 part + 1 (of 8) of super-block s of rows 16 blk..16 blk + 15 of W (groups
 * 2 blk and 2 blk + 1; `single`: only the first exists) -> the two tiles at dst */
static void unpack_part(int fmt, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t blk,
                        int single, int64_t s, int part, uint8_t *dst) {
    const int64_t sb_bytes = row_bytes / (k / QK_K) * XR; /* a group's super-block */
    const uint8_t *a = w + 16 * blk * row_bytes + s * sb_bytes;
    const uint8_t *b = single ? a : a + XR * row_bytes;
    /* a quarter of the super-block of both groups, 2 blocks (one pair, about one pair's
     * products) ahead: the hardware's prefetch alone kept one thread's stream at 3-3.5 GB/s, a
     * third of the dense product's */
    const int64_t ahead = 2 * 16 * row_bytes, quarter = sb_bytes / 4;
    for (int64_t o = part * quarter; o < (part + 1) * quarter + 64; o += 64) {
        _mm_prefetch((const char *)a + ahead + o, _MM_HINT_T0);
        _mm_prefetch((const char *)b + ahead + o, _MM_HINT_T0);
    }
    if (fmt == FMT_Q6_K) unpack_q6(a, b, 2 * part, 2 * part + 2, dst);
    else unpack_qk45(a, b, fmt == FMT_Q5_K, part, part + 1, dst);
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

/* activation tiles at, at + 1 (where NA is 2) against the unpacked blocks at bt0 (and bt1,
 * NB 2): C(a, b) in tmm(2a + b). After every second k step, NEXT(t) unpacks two tiles' worth of
 * the next blocks: the vector units unpack while the tile unit multiplies. */
#define K_AMX_PASS(NA, NB, NEXT)                                                                 \
    do {                                                                                         \
        _tile_zero(0);                                                                           \
        if (NB > 1) _tile_zero(1);                                                               \
        if (NA > 1) _tile_zero(2);                                                               \
        if (NA > 1 && NB > 1) _tile_zero(3);                                                     \
        for (int64_t t = 0; t < k / 32; t++) {                                                   \
            _tile_loadd(6, bt0 + t * K_TILE_BYTES, 64);                                          \
            _tile_loadd(4, xa + t * 64, stride);                                                 \
            _tile_dpbf16ps(0, 4, 6);                                                             \
            if (NB > 1) {                                                                        \
                _tile_loadd(7, bt1 + t * K_TILE_BYTES, 64);                                      \
                _tile_dpbf16ps(1, 4, 7);                                                         \
            }                                                                                    \
            if (NA > 1) {                                                                        \
                _tile_loadd(5, xa + 16 * stride + t * 64, stride);                               \
                _tile_dpbf16ps(2, 5, 6);                                                         \
                if (NB > 1) _tile_dpbf16ps(3, 5, 7);                                             \
            }                                                                                    \
            if (t & 1) NEXT(t);                                                      \
        }                                                                                        \
        _tile_stored(0, cbuf[0], 64);                                                            \
        if (NB > 1) _tile_stored(1, cbuf[1], 64);                                                \
        if (NA > 1) _tile_stored(2, cbuf[2], 64);                                                \
        if (NA > 1 && NB > 1) _tile_stored(3, cbuf[3], 64);                                      \
    } while (0)

/* the blocks of the next pair: their tiles t - 1 and t */
#define K_UNPACK_NEXT(t)                                                                        \
    do {                                                                                         \
        for (int j = 0; j < next_nb; j++)                                                        \
            unpack_part(fmt, w, row_bytes, k, blk + 2 + j, 2 * (blk + 2 + j) + 1 >= groups,      \
                        (t) >> 3, ((t) >> 1) & 3,                                                \
                        next + j * tiles_bytes + ((t) - 1) * K_TILE_BYTES);                      \
    } while (0)
#define K_NOTHING(t) ((void)(t))

/* up to 32 activation rows (one pass: each unpacked tile meets every activation tile once):
 * one thread's blocks b_first..b_last - 1 in pairs, as a stream of quarter super-blocks of a
 * pair (4 tiles), each unpacked while the one before it is multiplied, into the other half of
 * an 8-tile ring in bufs. The tiles stay in L1, where amx_blocks' pair of whole unpacked rows
 * (k * 64 bytes) went to L2 and back: 8-30% less time at 32 rows (Q4_K / Q6_K, 1B and 1.5B
 * shapes; scripts/micro/bench_amx_ab.py). The same products in the same order as amx_blocks
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
            unpack_part(fmt, w, row_bytes, k, j, 2 * j + 1 >= groups, uq >> 2, uq & 3,          \
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
        for (int u = 0; u < 2; u++) {
            const uint8_t *xa = xb + (t + u) * 64;
            _tile_loadd(6, bt + u * K_TILE_BYTES, 64);
            _tile_loadd(4, xa, stride);
            _tile_dpbf16ps(0, 4, 6);
            if (nb > 1) {
                _tile_loadd(7, bt + (2 + u) * K_TILE_BYTES, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (na > 1) {
                _tile_loadd(5, xa + 16 * stride, stride);
                _tile_dpbf16ps(2, 5, 6);
                if (nb > 1) _tile_dpbf16ps(3, 5, 7);
            }
        }
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

/* one thread's blocks b_first..b_last - 1, in pairs; bufs: two pairs' tiles (the pair being
 * multiplied and the next, unpacked meanwhile) */
static void amx_blocks(int fmt, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t k,
                       const uint8_t *xb, int64_t n, int64_t n_tiles, const float *bias, void *y,
                       int64_t ldy, int out_bf16, int64_t b_first, int64_t b_last,
                       uint8_t *bufs) {
    const int64_t stride = x_stride(k), tiles_bytes = k / 32 * K_TILE_BYTES, groups = rows / XR;
    float cbuf[4][256] __attribute__((aligned(64)));
    configure_tiles();
    uint8_t *now = bufs, *next = bufs + 2 * tiles_bytes;
    for (int j = 0; j < 2 && b_first + j < b_last; j++)
        for (int64_t t = 1; t < k / 32; t += 2)
            unpack_part(fmt, w, row_bytes, k, b_first + j, 2 * (b_first + j) + 1 >= groups, t >> 3,
                        (t >> 1) & 3, now + j * tiles_bytes + (t - 1) * K_TILE_BYTES);
    for (int64_t blk = b_first; blk < b_last; blk += 2) {
        const int nb = blk + 1 < b_last ? 2 : 1;
        const int next_nb = blk + 2 >= b_last ? 0 : blk + 3 < b_last ? 2 : 1;
        const uint8_t *bt0 = now, *bt1 = now + tiles_bytes;
        int cols[2];
        for (int j = 0; j < nb; j++) cols[j] = 2 * (blk + j) + 1 >= groups ? 8 : 16;
        for (int64_t at = 0; at < n_tiles; at += 2) {
            const uint8_t *xa = xb + at * 16 * stride;
            const int na = at + 1 < n_tiles ? 2 : 1;
            if (at == 0) { /* the first pass unpacks the next pair */
                if (na == 2 && nb == 2) K_AMX_PASS(2, 2, K_UNPACK_NEXT);
                else if (na == 2) K_AMX_PASS(2, 1, K_UNPACK_NEXT);
                else if (nb == 2) K_AMX_PASS(1, 2, K_UNPACK_NEXT);
                else K_AMX_PASS(1, 1, K_UNPACK_NEXT);
            } else {
                if (na == 2 && nb == 2) K_AMX_PASS(2, 2, K_NOTHING);
                else if (na == 2) K_AMX_PASS(2, 1, K_NOTHING);
                else if (nb == 2) K_AMX_PASS(1, 2, K_NOTHING);
                else K_AMX_PASS(1, 1, K_NOTHING);
            }
            for (int a2 = 0; a2 < na; a2++)
                for (int j = 0; j < nb; j++)
                    store_tile(cbuf[2 * a2 + j], (at + a2) * 16, n, (blk + j) * 16, bias, y, ldy,
                               out_bf16, cols[j]);
        }
        uint8_t *done = now;
        now = next;
        next = done;
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
 * and W a K format (Q4_K / Q5_K / Q6_K) in interleaved groups, rows % 8 == 0, k % 256 == 0.
 * Returns 0 when done, -1 when it cannot run here (no AMX, other formats or shapes, no memory):
 * y is then untouched. Parallel over pairs of 16-row blocks, each thread a contiguous share. */
int asyncengine_k_amx_linear(int fmt, const uint8_t *w, int64_t row_bytes, int64_t rows,
                             int64_t k, const void *x, int64_t n, int x_bf16, const float *bias,
                             void *y, int64_t ldy, int out_bf16, int threads) {
#if defined(K_AMX)
    if ((fmt != FMT_Q4_K && fmt != FMT_Q5_K && fmt != FMT_Q6_K) || rows % XR || k % QK_K ||
        n < 1 || !amx_permitted())
        return -1;
    const int64_t n_tiles = (n + 15) / 16, blocks = (rows + 15) / 16;
    /* the activations as bfloat16 rows x_stride(k) apart, zero rows up to a whole tile */
    const int64_t stride = x_stride(k);
    uint8_t *xb = (uint8_t *)aligned_alloc(64, (size_t)(n_tiles * 16 * stride));
    if (!xb) return -1;
    memset(xb, 0, (size_t)(n_tiles * 16 * stride));
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
        uint8_t *bufs = (uint8_t *)aligned_alloc(64, (size_t)(4 * k / 32 * K_TILE_BYTES));
        if (!bufs) failed = 1;
        else if (first < blocks && n_tiles <= 2)
            amx_blocks_once(fmt, w, row_bytes, rows, k, xb, n, n_tiles, bias, y, ldy, out_bf16,
                            first, last < blocks ? last : blocks, bufs);
        else if (first < blocks)
            amx_blocks(fmt, w, row_bytes, rows, k, xb, n, n_tiles, bias, y, ldy,
                       out_bf16, first, last < blocks ? last : blocks, bufs);
        free(bufs);
    }
    free(xb);
    return failed ? -1 : 0;
#else
    (void)fmt, (void)w, (void)row_bytes, (void)rows, (void)k, (void)x, (void)n, (void)x_bf16;
    (void)bias, (void)y, (void)ldy, (void)out_bf16, (void)threads;
    return -1;
#endif
}
