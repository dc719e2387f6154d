/* One work item of the paged extend attention on AVX2 + FMA CPUs without AVX-512
 * (cpu_extend_attention.c includes it there): (request, kv head, block of queries), the item's
 * rows being its queries x the kv head's group of query heads, row r = i * G + g (position
 * first, so that a vector of 8 rows spans few positions and the causal skip bites).
 *
 * The rows are held transposed (qt[d][r]) once per item, so that per block of 16 keys the
 * scores come out as s[k][r]: a key element broadcast against 8 rows' query elements, two
 * keys at a time, no horizontal sums. The online softmax then runs down the columns (a row's
 * running max and sum in a lane), and the values are accumulated three rows x 32 dims at a
 * time, each value vector loaded once for the three rows. Keys and values are read once per
 * item for the whole group (float32 from the pool in place; bfloat16, or float16 in a
 * -DKV_F16 build (cpu_kv.h), widened into a block buffer). Row vectors past the block (causal) or below it (sliding window) are skipped.
 *
 * Each row's arithmetic is the same whatever its lane, item or neighbours, and its key blocks
 * are visited in absolute order from a multiple of 16, skipped blocks changing nothing: a row's
 * output depends on its query and keys alone (deterministic mode relies on it).
 */
#ifndef ASYNCENGINE_CPU_EXTEND_AVX2_H
#define ASYNCENGINE_CPU_EXTEND_AVX2_H

#include <stdint.h>
#include <string.h>

#include "cpu_kv.h"
#include "cpu_paged.h"
#include "cpu_simd.h"

#define X2_KB 16             /* keys per block */
#define X2_MAX_ROWS 64       /* rows of an item at most (queries x group) */
#define X2_MAX_DIM 256
#define X2_ROW_VECS (X2_MAX_ROWS / 8)

/* queries per item for a group of G query heads: 16, fewer for large groups (<= 64 rows) */
static inline int64_t x2_queries_per_item(int64_t G) {
    const int64_t q = X2_MAX_ROWS / G;
    return q > 16 ? 16 : (q < 1 ? 1 : q);
}

typedef struct {
    int64_t rows;        /* real rows; padded to a multiple of 8 */
    int64_t vecs;        /* row vectors */
    int32_t qpos[X2_MAX_ROWS], qlo[X2_MAX_ROWS]; /* last and first visible key of each row */
    int64_t vec_last[X2_ROW_VECS], vec_first[X2_ROW_VECS];
} x2_rows;

/* s[k][v] = sum_d keys[k][d] * qt[d][v] for keys k, k+1 and row vectors 0 .. V-1 */
static inline __attribute__((always_inline)) void x2_scores_pair(
    const float *k0, const float *k1, const float *qt, int64_t D, int V, __m256 *s0, __m256 *s1) {
    __m256 a0[4], a1[4];
    for (int v = 0; v < V; v++) a0[v] = a1[v] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m256 b0 = _mm256_broadcast_ss(k0 + d), b1 = _mm256_broadcast_ss(k1 + d);
        const float *row = qt + d * X2_MAX_ROWS;
        for (int v = 0; v < V; v++) {
            const __m256 q = _mm256_load_ps(row + 8 * v);
            a0[v] = _mm256_fmadd_ps(b0, q, a0[v]);
            a1[v] = _mm256_fmadd_ps(b1, q, a1[v]);
        }
    }
    for (int v = 0; v < V; v++) {
        s0[v] = a0[v];
        s1[v] = a1[v];
    }
}

/* the block's scores of row vectors v0 .. v0 + V - 1 (V <= 4) into s[k][row] */
static inline __attribute__((always_inline)) void x2_scores(
    const float *const *keys, int64_t nk, const float *qt, int64_t D, int64_t v0, int V,
    float s[X2_KB][X2_MAX_ROWS]) {
    __m256 s0[4], s1[4];
    for (int64_t k = 0; k < nk; k += 2) {
        const float *k1 = keys[k + 1 < nk ? k + 1 : k];
        x2_scores_pair(keys[k], k1, qt + 8 * v0, D, V, s0, s1);
        for (int v = 0; v < V; v++) {
            _mm256_store_ps(&s[k][8 * (v0 + v)], s0[v]);
            if (k + 1 < nk) _mm256_store_ps(&s[k + 1][8 * (v0 + v)], s1[v]);
        }
    }
}

/* out[r][c .. c + 32) = out[r][..] * corr[r] + sum_k p[k][r] vals[k][c ..] for R rows */
static inline __attribute__((always_inline)) void x2_values(
    float *o, const float *corr, const float p[X2_KB][X2_MAX_ROWS], const float *const *vals,
    int64_t nk, int64_t r0, int R, int64_t c, int64_t D) {
    __m256 acc[3][4];
    for (int t = 0; t < R; t++) {
        const __m256 cv = _mm256_broadcast_ss(corr + r0 + t);
        for (int j = 0; j < 4; j++)
            acc[t][j] = _mm256_mul_ps(_mm256_load_ps(o + (r0 + t) * D + c + 8 * j), cv);
    }
    for (int64_t k = 0; k < nk; k++) {
        __m256 v[4];
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(vals[k] + c + 8 * j);
        for (int t = 0; t < R; t++) {
            const __m256 pv = _mm256_broadcast_ss(&p[k][r0 + t]);
            for (int j = 0; j < 4; j++) acc[t][j] = _mm256_fmadd_ps(pv, v[j], acc[t][j]);
        }
    }
    for (int t = 0; t < R; t++)
        for (int j = 0; j < 4; j++) _mm256_store_ps(o + (r0 + t) * D + c + 8 * j, acc[t][j]);
}

/* One item: q rows at q (row i of the item at q + i * q_stride, its G heads D apart), keys at
 * positions 0 .. kv_len - 1 of the request's table row; the item's first query sits at pos0.
 * Writes out rows the same way (out_stride apart). */
static void extend_item_avx2(const void *q, int64_t q_stride, const void *kc, const void *vc,
                             const int32_t *table_row, int64_t nq, int64_t pos0, int64_t kvh,
                             int64_t G, int64_t Hkv, int64_t D, int64_t page_size, float scale,
                             int64_t window, float softcap, void *out, int64_t out_stride,
                             int bf16) {
    static __thread float qt_[X2_MAX_DIM * X2_MAX_ROWS] __attribute__((aligned(32)));
    static __thread float o_[X2_MAX_ROWS * X2_MAX_DIM] __attribute__((aligned(32)));
    static __thread float s_[X2_KB][X2_MAX_ROWS] __attribute__((aligned(32)));
    static __thread float kbuf_[X2_KB][X2_MAX_DIM] __attribute__((aligned(32)));
    static __thread float vbuf_[X2_KB][X2_MAX_DIM] __attribute__((aligned(32)));
    /* the thread-locals' addresses once, made opaque: re-derived at each use they cost a TLS
     * look-up call in a shared library */
    float *qt = qt_, *o = o_, (*s)[X2_MAX_ROWS] = s_, (*kbuf)[X2_MAX_DIM] = kbuf_;
    float(*vbuf)[X2_MAX_DIM] = vbuf_;
    __asm__("" : "+r"(qt), "+r"(o), "+r"(s), "+r"(kbuf), "+r"(vbuf));
    float corr[X2_MAX_ROWS] __attribute__((aligned(32)));
    __m256 m[X2_ROW_VECS], l[X2_ROW_VECS];
    x2_rows rw;
    rw.rows = nq * G;
    rw.vecs = (rw.rows + 7) / 8;
    const int64_t padded = rw.vecs * 8;
    for (int64_t r = 0; r < padded; r++) {
        const int64_t i = r / G, g = r % G;
        memset(o + r * D, 0, (size_t)D * 4);
        if (r >= rw.rows) { /* padding rows: zero queries, nothing visible, never stored */
            for (int64_t d = 0; d < D; d++) qt[d * X2_MAX_ROWS + r] = 0.0f;
            rw.qpos[r] = -1;
            rw.qlo[r] = INT32_MAX;
            continue;
        }
        const int64_t p = pos0 + i;
        rw.qpos[r] = (int32_t)p;
        rw.qlo[r] = (int32_t)((window > 0 && p - window + 1 > 0) ? p - window + 1 : 0);
        const int64_t off = i * q_stride + (kvh * G + g) * D;
        if (bf16) {
            const uint16_t *src = (const uint16_t *)q + off;
            for (int64_t d = 0; d < D; d++) qt[d * X2_MAX_ROWS + r] = bf16_to_float(src[d]);
        } else {
            const float *src = (const float *)q + off;
            for (int64_t d = 0; d < D; d++) qt[d * X2_MAX_ROWS + r] = src[d];
        }
    }
    for (int64_t v = 0; v < rw.vecs; v++) {
        int64_t last = -1, first = INT64_MAX;
        for (int64_t t = 0; t < 8; t++) {
            if (rw.qpos[8 * v + t] > last) last = rw.qpos[8 * v + t];
            if (rw.qlo[8 * v + t] < first) first = rw.qlo[8 * v + t];
        }
        rw.vec_last[v] = last;
        rw.vec_first[v] = first;
        m[v] = _mm256_set1_ps(-INFINITY);
        l[v] = _mm256_setzero_ps();
    }
    const int64_t last_key = pos0 + nq - 1;
    const int64_t lowest = rw.qlo[0]; /* the item's first row has the lowest window start */
    const int64_t first_block = lowest / X2_KB * X2_KB;
    const __m256 scale_v = _mm256_set1_ps(scale), cap = _mm256_set1_ps(softcap);
    const __m256 inv_cap = _mm256_set1_ps(softcap > 0.0f ? 1.0f / softcap : 0.0f);
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
    const float *keys[X2_KB], *vals[X2_KB];
    for (int64_t k0 = first_block; k0 <= last_key; k0 += X2_KB) {
        const int64_t nk = (last_key + 1 - k0 < X2_KB) ? (last_key + 1 - k0) : X2_KB;
        for (int64_t k = 0; k < nk; k++) {
            const int64_t row = (pool_slot(table_row, k0 + k, page_size) * Hkv + kvh) * KV_ROW(D);
            if (bf16 && !KV_OWN_ELEMENT) {
                const uint16_t *kr = (const uint16_t *)kc + row, *vr = (const uint16_t *)vc + row;
                for (int64_t d = 0; d < D; d += 8) {
                    _mm256_store_ps(kbuf[k] + d, load_bf16x8(kr + d));
                    _mm256_store_ps(vbuf[k] + d, load_bf16x8(vr + d));
                }
                keys[k] = kbuf[k];
                vals[k] = vbuf[k];
            } else if (KV_IS_F16 || KV_IS_I8) {
                kv_load_row(kbuf[k], (const kv_t *)kc + row, D);
                kv_load_row(vbuf[k], (const kv_t *)vc + row, D);
                keys[k] = kbuf[k];
                vals[k] = vbuf[k];
            } else {
                keys[k] = (const float *)kc + row;
                vals[k] = (const float *)vc + row;
            }
        }
        /* which row vectors see any key of this block: a run [v_lo, v_hi) (positions grow
         * with the row) */
        int64_t v_lo = 0, v_hi = rw.vecs;
        while (v_lo < v_hi && rw.vec_last[v_lo] < k0) v_lo++;
        while (v_hi > v_lo && rw.vec_first[v_hi - 1] >= k0 + nk) v_hi--;
        if (v_lo >= v_hi) continue;
        for (int64_t v = v_lo; v < v_hi; v += 4) {
            const int V = (int)((v_hi - v) < 4 ? (v_hi - v) : 4);
            switch (V) {
            case 4: x2_scores(keys, nk, qt, D, v, 4, s); break;
            case 3: x2_scores(keys, nk, qt, D, v, 3, s); break;
            case 2: x2_scores(keys, nk, qt, D, v, 2, s); break;
            default: x2_scores(keys, nk, qt, D, v, 1, s); break;
            }
        }
        /* online softmax down the columns: scale, cap, mask, max, exp, sum */
        for (int64_t v = v_lo; v < v_hi; v++) {
            const __m256i qpos = _mm256_loadu_si256((const __m256i *)&rw.qpos[8 * v]);
            const __m256i qlo = _mm256_loadu_si256((const __m256i *)&rw.qlo[8 * v]);
            __m256 blk_max = neg_inf;
            for (int64_t k = 0; k < nk; k++) {
                __m256 x = _mm256_mul_ps(_mm256_load_ps(&s[k][8 * v]), scale_v);
                if (softcap > 0.0f) x = _mm256_mul_ps(cap, tanh256(_mm256_mul_ps(x, inv_cap)));
                const __m256i kp = _mm256_set1_epi32((int32_t)(k0 + k));
                const __m256i hidden =
                    _mm256_or_si256(_mm256_cmpgt_epi32(kp, qpos), _mm256_cmpgt_epi32(qlo, kp));
                x = _mm256_blendv_ps(x, neg_inf, _mm256_castsi256_ps(hidden));
                _mm256_store_ps(&s[k][8 * v], x);
                blk_max = _mm256_max_ps(blk_max, x);
            }
            const __m256 new_max = _mm256_max_ps(m[v], blk_max);
            /* a row that sees nothing yet keeps max -inf: subtract 0 there (exp(-inf) = 0) */
            const __m256 base = _mm256_blendv_ps(new_max, _mm256_setzero_ps(),
                                                 _mm256_cmp_ps(new_max, neg_inf, _CMP_EQ_OQ));
            const __m256 c = exp256(_mm256_sub_ps(m[v], base));
            __m256 sum = _mm256_setzero_ps();
            for (int64_t k = 0; k < nk; k++) {
                const __m256 e = exp256(_mm256_sub_ps(_mm256_load_ps(&s[k][8 * v]), base));
                _mm256_store_ps(&s[k][8 * v], e);
                sum = _mm256_add_ps(sum, e);
            }
            l[v] = _mm256_fmadd_ps(l[v], c, sum);
            m[v] = new_max;
            _mm256_store_ps(corr + 8 * v, c);
        }
        /* values, three rows at a time, over the keys the rows can see */
        for (int64_t r0 = 8 * v_lo; r0 < 8 * v_hi; r0 += 3) {
            const int R = (int)((8 * v_hi - r0) < 3 ? (8 * v_hi - r0) : 3);
            int64_t last = rw.qpos[r0];
            for (int t = 1; t < R; t++)
                if (rw.qpos[r0 + t] > last) last = rw.qpos[r0 + t];
            const int64_t visible = last - k0 + 1 < nk ? last - k0 + 1 : nk;
            if (visible <= 0) {
                /* nothing visible to these rows (their corr is 1, or 0 with o still 0) */
                continue;
            }
            for (int64_t c = 0; c < D; c += 32) {
                switch (R) {
                case 3: x2_values(o, corr, s, vals, visible, r0, 3, c, D); break;
                case 2: x2_values(o, corr, s, vals, visible, r0, 2, c, D); break;
                default: x2_values(o, corr, s, vals, visible, r0, 1, c, D); break;
                }
            }
        }
    }
    float lf[X2_MAX_ROWS] __attribute__((aligned(32)));
    for (int64_t v = 0; v < rw.vecs; v++) _mm256_store_ps(lf + 8 * v, l[v]);
    for (int64_t r = 0; r < rw.rows; r++) {
        const int64_t i = r / G, g = r % G;
        const __m256 inv = _mm256_set1_ps(lf[r] > 0.0f ? 1.0f / lf[r] : 0.0f);
        const int64_t off = i * out_stride + (kvh * G + g) * D;
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 y = _mm256_mul_ps(_mm256_load_ps(o + r * D + d), inv);
            if (bf16) {
                float tmp[8];
                _mm256_storeu_ps(tmp, y);
                uint16_t *dst = (uint16_t *)out + off + d;
                for (int t = 0; t < 8; t++) dst[t] = float_to_bf16(tmp[t]);
            } else {
                _mm256_storeu_ps((float *)out + off + d, y);
            }
        }
    }
}

#endif
