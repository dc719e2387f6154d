/* One work item of the paged extend attention for bfloat16 queries over a bfloat16 pool, or an
 * int8 one (the -DKV_I8 build), on AVX512-BF16 CPUs (cpu_extend_attention.c includes it
 * there): (request, kv head, block of
 * queries), the item's rows being its queries x the kv head's group of query heads, row
 * r = i * G + g (position first, so that a vector of 16 rows spans few positions).
 *
 * Rows sit in lanes: the queries are held transposed in bf16 pairs (qt[d/2][r]) once per item,
 * so that both products are bf16 dot products (vdpbf16ps: two multiply-adds a lane) with no
 * horizontal sums and no transposed keys:
 * - scores s[k][r]: a key's pair of elements broadcast against 16 rows' query pairs;
 * - the online softmax runs down the columns (a row's running max and sum in a lane);
 * - values: the output is held transposed (o[d][r]), the probabilities of two keys rounded to
 *   a bf16 pair per row, and a value pair (the same element of two keys, interleaved once per
 *   block) broadcast against them.
 * Up to 4 row vectors share each key and value load (register tiles of 16 accumulators).
 * The probabilities are rounded to bf16 for the value product only; the row's sum takes them
 * unrounded (float32), as the float32 reference does.
 *
 * The pool is read through xb_row32 only, as each key block is gathered: a plain load of a
 * bfloat16 row, or an int8 row times its scale rounded once to bfloat16 (so the int8 pool's
 * keys and values enter the same dot products, dequantized once per block, not per row).
 *
 * Each row's arithmetic is the same whatever its lane, item or neighbours, and its key blocks
 * are visited in absolute order from a multiple of XB_KB, skipped or masked keys adding exact
 * zeros: a row's output depends on its query and keys alone (deterministic mode relies on it).
 */
#ifndef ASYNCENGINE_CPU_EXTEND_BF16_H
#define ASYNCENGINE_CPU_EXTEND_BF16_H

#include <stdint.h>
#include <string.h>

#include "cpu_kv.h"
#include "cpu_paged.h"
#include "cpu_simd.h"

/* keys per block (one softmax step): 32 measured no faster
 * (scripts/micro/bench_extend_attention.py --shapes 1x1024+4096 --dtypes bf16) */
#define XB_KB 16
#define XB_MAX_ROWS 64
#define XB_VECS (XB_MAX_ROWS / 16)
#define XB_MAX_DIM 256

/* queries per item for a group of G query heads: rows up to 64 (4 vectors), at most 32 */
static inline int64_t xb_queries_per_item(int64_t G) {
    const int64_t q = XB_MAX_ROWS / G;
    return q > 32 ? 32 : (q < 1 ? 1 : q);
}

typedef struct {
    uint32_t qt[XB_MAX_DIM / 2][XB_MAX_ROWS];  /* query pairs, transposed */
    float o[XB_MAX_DIM][XB_MAX_ROWS];          /* output, transposed, unnormalized */
    uint32_t kb[XB_KB][XB_MAX_DIM / 2];        /* the block's keys (bf16 pairs) */
    uint32_t vp[XB_KB / 2][XB_MAX_DIM];        /* value pairs: (v[2j][d], v[2j+1][d]) */
    float s[XB_KB][XB_MAX_ROWS];               /* scores, then probabilities */
    uint32_t pp[XB_KB / 2][XB_MAX_ROWS];       /* probability pairs (p[2j][r], p[2j+1][r]) */
    float corr[XB_MAX_ROWS];
    int32_t qpos[XB_MAX_ROWS], qlo[XB_MAX_ROWS]; /* a row's last and first visible key */
} xb_item;

/* The pool's element and its rows as bfloat16: xb_row32(row, c, s) is elements c .. c + 31 of
 * a head's row as 16 bf16 pairs, s = xb_row_scale(row, D) the row's scale taken once. */
#if KV_IS_I8
typedef int8_t xb_pool_t;

static inline __m512 xb_row_scale(const xb_pool_t *row, int64_t D) {
    return _mm512_set1_ps(kv_row_scale(row, D));
}

/* int8 x scale is exact in float32 (7 + 8 significant bits), so this rounds once */
static inline __m512i xb_row32(const xb_pool_t *row, int64_t c, __m512 row_scale) {
    const __m512 lo = _mm512_mul_ps(KV_LOAD16(row + c), row_scale);
    const __m512 hi = _mm512_mul_ps(KV_LOAD16(row + c + 16), row_scale);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}
#else
typedef uint16_t xb_pool_t;

static inline __m512 xb_row_scale(const xb_pool_t *row, int64_t D) {
    (void)row;
    (void)D;
    return _mm512_setzero_ps();
}

static inline __m512i xb_row32(const xb_pool_t *row, int64_t c, __m512 row_scale) {
    (void)row_scale;
    return _mm512_loadu_si512(row + c);
}
#endif

/* the pool offsets (elements) of the rows of keys k0 .. k0 + n - 1, row_len elements a head's
 * row (one division, not one a key) */
static inline void xb_block_rows(const int32_t *table_row, int64_t k0, int64_t n, int64_t page_size,
                                 int64_t Hkv, int64_t kvh, int64_t row_len, int64_t *rows) {
    int64_t page = k0 / page_size, offset = k0 - page * page_size;
    for (int64_t k = 0; k < n; k++) {
        rows[k] = (((int64_t)table_row[page] * page_size + offset) * Hkv + kvh) * row_len;
        if (++offset == page_size) page++, offset = 0;
    }
}

/* 2^x for 16 lanes, x <= 0 or -inf (a softmax's exponents): x = n + f, |f| <= 1/2, 2^f by a
 * degree-5 polynomial 1 + f q(f) (q fitted at Chebyshev nodes; rel. error ~3e-7), 2^n by
 * vscalefps. Below -200 (-inf included) it is 0; 2^0 is exactly 1, so that a block that does
 * not raise a row's max leaves the bits of its sums alone. */
static inline __m512 xb_exp2(__m512 x) {
    const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-200.0f));
    const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(xc, n);
    __m512 p = _mm512_set1_ps(1.338130212e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.666368365e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550381169e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402234972e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471825e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#define XB_DOT(acc, a, b) _mm512_dpbf16_ps((acc), (__m512bh)(a), (__m512bh)(b))

/* s[k0 + k][16 (v0 + v) ..] = (q . key) * mul for V row vectors and NK keys (16 accumulators
 * at most); their max over the keys into bmax[v0 + v] */
static inline __attribute__((always_inline)) void xb_scores(xb_item *x, int64_t D2, int64_t v0,
                                                            int V, int k0, int NK, __m512 mul,
                                                            __m512 *bmax) {
    __m512 acc[4][16];
    for (int v = 0; v < V; v++)
        for (int k = 0; k < NK; k++) acc[v][k] = _mm512_setzero_ps();
    for (int64_t d2 = 0; d2 < D2; d2++) {
        __m512i q[4];
        for (int v = 0; v < V; v++) q[v] = _mm512_load_si512((const void *)&x->qt[d2][16 * (v0 + v)]);
        for (int k = 0; k < NK; k++) {
            const __m512i kk = _mm512_set1_epi32((int)x->kb[k0 + k][d2]);
            for (int v = 0; v < V; v++) acc[v][k] = XB_DOT(acc[v][k], q[v], kk);
        }
    }
    for (int v = 0; v < V; v++)
        for (int k = 0; k < NK; k++) {
            const __m512 sv = _mm512_mul_ps(acc[v][k], mul);
            _mm512_store_ps(&x->s[k0 + k][16 * (v0 + v)], sv);
            bmax[v0 + v] = _mm512_max_ps(bmax[v0 + v], sv);
        }
}

/* o[d0 + j][16 (v0 + v) ..] = o[..] * corr + sum over key pairs of p pair . value pair, for V
 * row vectors and ND dims: 16 accumulators at most */
static inline __attribute__((always_inline)) void xb_values(xb_item *x, int64_t npairs, int64_t v0,
                                                            int V, int64_t d0, int ND, int rescale) {
    __m512 acc[4][16];
    for (int v = 0; v < V; v++) {
        const __m512 c = _mm512_load_ps(&x->corr[16 * (v0 + v)]);
        for (int j = 0; j < ND; j++) {
            acc[v][j] = _mm512_load_ps(&x->o[d0 + j][16 * (v0 + v)]);
            if (rescale) acc[v][j] = _mm512_mul_ps(acc[v][j], c);
        }
    }
    for (int64_t kp = 0; kp < npairs; kp++) {
        __m512i p[4];
        for (int v = 0; v < V; v++) p[v] = _mm512_load_si512((const void *)&x->pp[kp][16 * (v0 + v)]);
        for (int j = 0; j < ND; j++) {
            const __m512i vv = _mm512_set1_epi32((int)x->vp[kp][d0 + j]);
            for (int v = 0; v < V; v++) acc[v][j] = XB_DOT(acc[v][j], p[v], vv);
        }
    }
    for (int v = 0; v < V; v++)
        for (int j = 0; j < ND; j++) _mm512_store_ps(&x->o[d0 + j][16 * (v0 + v)], acc[v][j]);
}

/* the block's scores (times mul) for row vectors [v_lo, v_hi), their maxima into bmax */
static inline void xb_block_scores(xb_item *x, int64_t D2, int64_t v_lo, int64_t v_hi, __m512 mul,
                                   __m512 *bmax) {
    for (int64_t v = v_lo; v < v_hi; v++) bmax[v] = _mm512_set1_ps(-INFINITY);
    for (int64_t v = v_lo; v < v_hi; v += 4) {
        const int V = (int)((v_hi - v) < 4 ? (v_hi - v) : 4);
        switch (V) {
        case 4:
            for (int k = 0; k < XB_KB; k += 4) xb_scores(x, D2, v, 4, k, 4, mul, bmax);
            break;
        case 3:
            for (int k = 0; k < XB_KB; k += 4) xb_scores(x, D2, v, 3, k, 4, mul, bmax);
            break;
        case 2:
            for (int k = 0; k < XB_KB; k += 8) xb_scores(x, D2, v, 2, k, 8, mul, bmax);
            break;
        default:
            for (int k = 0; k < XB_KB; k += 16) xb_scores(x, D2, v, 1, k, 16, mul, bmax);
            break;
        }
    }
}

/* the block's values for row vectors [v_lo, v_hi) */
static inline void xb_block_values(xb_item *x, int64_t D, int64_t npairs, int64_t v_lo,
                                   int64_t v_hi, int rescale) {
    for (int64_t v = v_lo; v < v_hi; v += 4) {
        const int V = (int)((v_hi - v) < 4 ? (v_hi - v) : 4);
        switch (V) {
        case 4:
            for (int64_t d = 0; d < D; d += 4) xb_values(x, npairs, v, 4, d, 4, rescale);
            break;
        case 3:
            for (int64_t d = 0; d < D; d += 4) xb_values(x, npairs, v, 3, d, 4, rescale);
            break;
        case 2:
            for (int64_t d = 0; d < D; d += 8) xb_values(x, npairs, v, 2, d, 8, rescale);
            break;
        default:
            for (int64_t d = 0; d < D; d += 16) xb_values(x, npairs, v, 1, d, 16, rescale);
            break;
        }
    }
}

/* One item: q rows at q (row i of the item at q + i * q_stride elements, its G heads D apart),
 * keys at positions 0 .. pos0 + nq - 1 of the request's table row; the item's first query
 * sits at pos0. Writes out rows the same way (out_stride apart). x: the thread's scratch (a
 * parameter: a thread-local taken inside would cost a TLS look-up call at each use in a shared
 * library). */
static void extend_item_bf16(xb_item *x, const uint16_t *q, int64_t q_stride, const xb_pool_t *kc,
                             const xb_pool_t *vc, const int32_t *table_row, int64_t nq,
                             int64_t pos0, int64_t kvh, int64_t G, int64_t Hkv, int64_t D,
                             int64_t page_size, float scale, int64_t window, float softcap,
                             uint16_t *out, int64_t out_stride) {
    const int64_t D2 = D / 2, rows = nq * G, vecs = (rows + 15) / 16;
    int64_t vec_last[XB_VECS], vec_first[XB_VECS], vec_min_last[XB_VECS], vec_max_first[XB_VECS];
    __m512 m[XB_VECS], l[XB_VECS];
    /* the output zeroed and the queries transposed 16 rows at a time: element by element,
     * with the output's way back, they took about half of a 64-token prompt's items
     * (scripts/micro/bench_extend_attention.py --shapes 16x64) */
    for (int64_t d = 0; d < D; d++)
        for (int64_t v = 0; v < vecs; v++) _mm512_store_ps(&x->o[d][16 * v], _mm512_setzero_ps());
    for (int64_t v = 0; v < vecs; v++) {
        int32_t from[16] __attribute__((aligned(64))); /* each row's query, in 4-byte pairs */
        __mmask16 live = 0;
        for (int64_t t = 0; t < 16; t++) {
            const int64_t r = 16 * v + t, i = r / G, g = r % G;
            from[t] = 0;
            if (r >= rows) { /* padding rows: zero queries, nothing visible, never stored */
                x->qpos[r] = -1;
                x->qlo[r] = INT32_MAX;
                continue;
            }
            const int64_t p = pos0 + i;
            x->qpos[r] = (int32_t)p;
            x->qlo[r] = (int32_t)((window > 0 && p - window + 1 > 0) ? p - window + 1 : 0);
            from[t] = (int32_t)((i * q_stride + (kvh * G + g) * D) / 2);
            live |= (__mmask16)(1u << t);
        }
        const __m512i idx = _mm512_load_si512((const void *)from);
        for (int64_t d2 = 0; d2 < D2; d2++)
            _mm512_store_si512((void *)&x->qt[d2][16 * v],
                               _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, idx,
                                                           (const uint32_t *)q + d2, 4));
    }
    for (int64_t v = 0; v < vecs; v++) {
        int64_t last = -1, first = INT64_MAX, min_last = INT64_MAX, max_first = -1;
        for (int64_t t = 16 * v; t < 16 * v + 16 && t < rows; t++) {
            if (x->qpos[t] > last) last = x->qpos[t];
            if (x->qpos[t] < min_last) min_last = x->qpos[t];
            if (x->qlo[t] < first) first = x->qlo[t];
            if (x->qlo[t] > max_first) max_first = x->qlo[t];
        }
        vec_last[v] = last;
        vec_first[v] = first;
        vec_min_last[v] = min_last;
        vec_max_first[v] = max_first;
        m[v] = _mm512_set1_ps(-INFINITY);
        l[v] = _mm512_setzero_ps();
    }
    const int64_t last_key = pos0 + nq - 1;
    const int64_t first_block = x->qlo[0] / XB_KB * XB_KB; /* the first row's window starts lowest */
    /* scores in base 2: s * scale * log2(e), or softcap * tanh(s * scale / softcap) * log2(e) */
    const float log2e = 1.44269504088896341f;
    const __m512 scale_log2 = _mm512_set1_ps(scale * log2e);
    const __m512 cap_log2 = _mm512_set1_ps(softcap * log2e);
    const __m512 scale_over_cap = _mm512_set1_ps(softcap > 0.0f ? scale / softcap : 0.0f);
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY), one = _mm512_set1_ps(1.0f);
    /* (a, b) -> a pair per lane: elements i of a and b (16 lanes from the low or high half) */
    __m512i lo_idx, hi_idx, pair_idx;
    {
        uint16_t lo[32], hi[32], pr[32];
        for (int i = 0; i < 16; i++) {
            lo[2 * i] = (uint16_t)i, lo[2 * i + 1] = (uint16_t)(32 + i);
            hi[2 * i] = (uint16_t)(16 + i), hi[2 * i + 1] = (uint16_t)(48 + i);
            pr[2 * i] = (uint16_t)i, pr[2 * i + 1] = (uint16_t)(16 + i);
        }
        lo_idx = _mm512_loadu_si512(lo);
        hi_idx = _mm512_loadu_si512(hi);
        pair_idx = _mm512_loadu_si512(pr);
    }
    for (int64_t k0 = first_block; k0 <= last_key; k0 += XB_KB) {
        const int64_t nk = (last_key + 1 - k0 < XB_KB) ? (last_key + 1 - k0) : XB_KB;
        /* which row vectors see any key of this block: a run [v_lo, v_hi) (positions grow
         * with the row) */
        int64_t v_lo = 0, v_hi = vecs;
        while (v_lo < v_hi && vec_last[v_lo] < k0) v_lo++;
        while (v_hi > v_lo && vec_first[v_hi - 1] >= k0 + nk) v_hi--;
        if (v_lo >= v_hi) continue;
        /* this block's rows, then the next block's prefetched while this one computes (pages
         * are scattered in the pool) */
        int64_t rows_now[XB_KB], rows_next[XB_KB];
        xb_block_rows(table_row, k0, nk, page_size, Hkv, kvh, KV_ROW(D), rows_now);
        const int64_t next = k0 + XB_KB;
        const int64_t nk_next = last_key + 1 - next < XB_KB ? last_key + 1 - next : XB_KB;
        xb_block_rows(table_row, next, nk_next, page_size, Hkv, kvh, KV_ROW(D), rows_next);
        const int64_t row_bytes = KV_ROW(D) * (int64_t)sizeof(xb_pool_t);
        for (int64_t k = 0; k < nk_next; k++)
            for (int64_t c = 0; c < row_bytes; c += 64) {
                _mm_prefetch((const char *)(kc + rows_next[k]) + c, _MM_HINT_T0);
                _mm_prefetch((const char *)(vc + rows_next[k]) + c, _MM_HINT_T0);
            }
        for (int64_t k = 0; k < XB_KB; k += 2) {
            const xb_pool_t *a = k < nk ? vc + rows_now[k] : NULL;
            const xb_pool_t *b = k + 1 < nk ? vc + rows_now[k + 1] : NULL;
            const __m512 as = a ? xb_row_scale(a, D) : _mm512_setzero_ps();
            const __m512 bs = b ? xb_row_scale(b, D) : _mm512_setzero_ps();
            for (int64_t t = 0; t < 2; t++) {
                const xb_pool_t *kr = k + t < nk ? kc + rows_now[k + t] : NULL;
                const __m512 ks = kr ? xb_row_scale(kr, D) : _mm512_setzero_ps();
                for (int64_t c = 0; c < D; c += 32)
                    _mm512_store_si512(&x->kb[k + t][c / 2],
                                       kr ? xb_row32(kr, c, ks) : _mm512_setzero_si512());
            }
            for (int64_t c = 0; c < D; c += 32) {
                const __m512i va = a ? xb_row32(a, c, as) : _mm512_setzero_si512();
                const __m512i vb = b ? xb_row32(b, c, bs) : _mm512_setzero_si512();
                _mm512_store_si512(&x->vp[k / 2][c], _mm512_permutex2var_epi16(va, lo_idx, vb));
                _mm512_store_si512(&x->vp[k / 2][c + 16], _mm512_permutex2var_epi16(va, hi_idx, vb));
            }
        }
        __m512 bmax[XB_VECS];
        xb_block_scores(x, D2, v_lo, v_hi, softcap > 0.0f ? scale_over_cap : scale_log2, bmax);
        /* online softmax down the columns, in base 2: (cap,) mask, max, exp, sum */
        int rescale = 0;
        for (int64_t v = v_lo; v < v_hi; v++) {
            /* keys hidden from some row of the vector: past a row (causal), below its window,
             * or past the block's end */
            const int masked = nk < XB_KB || vec_min_last[v] < k0 + XB_KB - 1 || vec_max_first[v] > k0;
            __m512 blk_max = bmax[v];
            if (masked || softcap > 0.0f) {
                const __m512i qpos = _mm512_load_si512((const void *)&x->qpos[16 * v]);
                const __m512i qlo = _mm512_load_si512((const void *)&x->qlo[16 * v]);
                blk_max = neg_inf;
                for (int64_t k = 0; k < XB_KB; k++) {
                    __m512 s = _mm512_load_ps(&x->s[k][16 * v]);
                    if (softcap > 0.0f) s = _mm512_mul_ps(cap_log2, tanh512(s));
                    if (masked) {
                        const __m512i kp = _mm512_set1_epi32((int32_t)(k0 + k));
                        __mmask16 seen = _mm512_cmp_epi32_mask(kp, qpos, _MM_CMPINT_LE) &
                                         _mm512_cmp_epi32_mask(qlo, kp, _MM_CMPINT_LE);
                        if (k >= nk) seen = 0;
                        s = _mm512_mask_mov_ps(neg_inf, seen, s);
                    }
                    _mm512_store_ps(&x->s[k][16 * v], s);
                    blk_max = _mm512_max_ps(blk_max, s);
                }
            }
            const __m512 new_max = _mm512_max_ps(m[v], blk_max);
            /* a row that sees nothing yet keeps max -inf: subtract 0 there (2^-inf = 0) */
            const __m512 base = _mm512_mask_mov_ps(
                new_max, _mm512_cmp_ps_mask(new_max, neg_inf, _CMP_EQ_OQ), _mm512_setzero_ps());
            const __m512 c = xb_exp2(_mm512_sub_ps(m[v], base));
            __m512 sum = _mm512_setzero_ps();
            for (int64_t k = 0; k < XB_KB; k += 2) {
                const __m512 e0 = xb_exp2(_mm512_sub_ps(_mm512_load_ps(&x->s[k][16 * v]), base));
                const __m512 e1 = xb_exp2(_mm512_sub_ps(_mm512_load_ps(&x->s[k + 1][16 * v]), base));
                const __m512i pair = _mm512_permutexvar_epi16(pair_idx, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
                sum = _mm512_add_ps(_mm512_add_ps(sum, e0), e1);
                _mm512_store_si512(&x->pp[k / 2][16 * v], pair);
            }
            l[v] = _mm512_fmadd_ps(l[v], c, sum);
            m[v] = new_max;
            _mm512_store_ps(&x->corr[16 * v], c);
            rescale |= _mm512_cmp_ps_mask(c, one, _CMP_NEQ_UQ) != 0;
        }
        xb_block_values(x, D, (nk + 1) / 2, v_lo, v_hi, rescale);
    }
    float lf[XB_MAX_ROWS] __attribute__((aligned(64)));
    for (int64_t v = 0; v < vecs; v++) _mm512_store_ps(lf + 16 * v, l[v]);
    for (int64_t r = 0; r < vecs * 16; r++) lf[r] = lf[r] > 0.0f ? 1.0f / lf[r] : 0.0f;
    /* 16 rows x 16 dims at a time: scaled, transposed back to rows, rounded, stored */
    for (int64_t v = 0; v < vecs; v++) {
        const __m512 inv = _mm512_load_ps(lf + 16 * v);
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            __m512i t[16];
            for (int j = 0; j < 16; j++)
                t[j] = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(&x->o[d0 + j][16 * v]), inv));
            transpose16_epi32(t); /* t[j]: row 16 v + j's dims d0 .. d0 + 15 */
            for (int64_t j = 0; j < 16 && 16 * v + j < rows; j++) {
                const int64_t r = 16 * v + j, i = r / G, g = r % G;
                _mm256_storeu_si256((__m256i *)(out + i * out_stride + (kvh * G + g) * D + d0),
                                    to_bf16x16(_mm512_castsi512_ps(t[j])));
            }
        }
    }
}

#endif
