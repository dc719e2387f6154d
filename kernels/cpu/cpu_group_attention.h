/* Decode attention of a row's query heads (those of one or more kv heads) over its keys in the
 * paged pool (float32, or float16 in a -DKV_F16 build: cpu_kv.h), for the fused decode step (cpu_decode_step.c).
 *
 * The heads share each key and value row read: a block of up to ATTN_BLOCK keys is read from
 * the pool once, then each head takes its dot products and its share of the values from the
 * cache. The softmax is online (running max and sum per head, the accumulator
 * rescaled when the max grows), so nothing grows with the context, and its exp is a vector
 * polynomial (exp256, cpu_simd.h) on AVX2 + FMA CPUs, libm's expf elsewhere. While a block
 * computes, the next block's K/V rows are asked for into L2 (pages are scattered over the
 * pool, which the hardware prefetcher does not follow).
 *
 * On AVX2 + FMA the dot products take four keys at a time and the values the head dim in chunks
 * of 64, 32, 16 and 8 floats, each chunk's accumulator in registers across the block's keys;
 * on AVX-512 a head dim that is a multiple of 16 takes the same loops in 16-lane vectors (half
 * the multiply-adds, loads and pool conversions: at batch 1 and 443 keys the attention was a
 * fifth of a step's CPU time on an AVX-512 BF16 CPU with the 8-lane loops); other CPUs, or a
 * head dim that is not a multiple of 8, take the portable loops.
 */
#ifndef ASYNCENGINE_CPU_GROUP_ATTENTION_H
#define ASYNCENGINE_CPU_GROUP_ATTENTION_H

#include <math.h>
#include <stdint.h>

#include "cpu_kv.h"
#include "cpu_paged.h"
#include "cpu_simd.h"
#include "cpu_split_k.h"
#include "cpu_stream_attention.h"
#include "cpu_stream_i8_dots.h"

#define ATTN_BLOCK 32    /* keys per online-softmax block */
#define ATTN_MAX_GROUP 8 /* query heads of one kv head in an item at most (a larger group is split) */
#define ATTN_MAX_HEADS 32 /* query heads of one item at most */
#define ATTN_MAX_DIM 256
/* keys per block of the streamed path (stream_range): the block computed and the next one,
 * asked for meanwhile, stay within L1 (at 32 keys the two were 48 KB of SmolLM2's bfloat16
 * slots, L1's size, and the prefetched lines pushed out the ones in use) */
#define STREAM_BLOCK 16

#if defined(__AVX2__) && defined(__FMA__)
#define ATTN_AVX2 1

/* acc[off:off + 8 NV] += p[i] vals[i][off:off + 8 NV] over the block's n keys, that chunk of
 * the accumulator in registers */
#define DEFINE_ATTN_CHUNK(NV)                                                                    \
    static inline void chunk_values_##NV(float *acc, const kv_t *const *vals, const float *p,   \
                                         int n, int64_t off) {                                  \
        __m256 a[NV];                                                                            \
        for (int j = 0; j < (NV); j++) a[j] = _mm256_loadu_ps(acc + off + 8 * j);                \
        for (int i = 0; i < n; i++) {                                                            \
            const __m256 pv = _mm256_set1_ps(p[i]);                                              \
            const kv_t *v = vals[i] + off;                                                       \
            for (int j = 0; j < (NV); j++) a[j] = _mm256_fmadd_ps(pv, KV_LOAD8(v + 8 * j), a[j]);     \
        }                                                                                        \
        for (int j = 0; j < (NV); j++) _mm256_storeu_ps(acc + off + 8 * j, a[j]);                \
    }
DEFINE_ATTN_CHUNK(8)
DEFINE_ATTN_CHUNK(4)
DEFINE_ATTN_CHUNK(2)
DEFINE_ATTN_CHUNK(1)
#endif

#if defined(__AVX512F__) && defined(KV_LOAD16)
#define ATTN_AVX512 1

/* acc[off:off + 16 NV] += p[i] vals[i][off:off + 16 NV], as DEFINE_ATTN_CHUNK in 16 lanes */
#define DEFINE_ATTN_CHUNK16(NV)                                                                  \
    static inline void chunk_values16_##NV(float *acc, const kv_t *const *vals, const float *p, \
                                           int n, int64_t off) {                                \
        __m512 a[NV];                                                                            \
        for (int j = 0; j < (NV); j++) a[j] = _mm512_loadu_ps(acc + off + 16 * j);               \
        for (int i = 0; i < n; i++) {                                                            \
            const __m512 pv = _mm512_set1_ps(p[i]);                                              \
            const kv_t *v = vals[i] + off;                                                       \
            for (int j = 0; j < (NV); j++) a[j] = _mm512_fmadd_ps(pv, KV_LOAD16(v + 16 * j), a[j]); \
        }                                                                                        \
        for (int j = 0; j < (NV); j++) _mm512_storeu_ps(acc + off + 16 * j, a[j]);               \
    }
DEFINE_ATTN_CHUNK16(4)
DEFINE_ATTN_CHUNK16(2)
DEFINE_ATTN_CHUNK16(1)
#endif

/* s[i] = q . keys[i] (d dims) for the n keys of a block. Four keys at a time, each one chain
 * of fused multiply-adds over the dims in order and the horizontal sum of hsum256: the same
 * float sums as one key alone, the four chains hiding each other's latency. */
static inline void block_dots(const float *q, const kv_t *const *keys, int n, int64_t d,
                              float *s) {
    int i = 0;
#ifdef ATTN_AVX512
    if (d % 16 == 0) { /* as the 8-lane loop below, 16 lanes at a time */
        for (; i + 4 <= n; i += 4) {
            const kv_t *k0 = keys[i], *k1 = keys[i + 1], *k2 = keys[i + 2], *k3 = keys[i + 3];
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t j = 0; j < d; j += 16) {
                const __m512 qv = _mm512_loadu_ps(q + j);
                a0 = _mm512_fmadd_ps(qv, KV_LOAD16(k0 + j), a0);
                a1 = _mm512_fmadd_ps(qv, KV_LOAD16(k1 + j), a1);
                a2 = _mm512_fmadd_ps(qv, KV_LOAD16(k2 + j), a2);
                a3 = _mm512_fmadd_ps(qv, KV_LOAD16(k3 + j), a3);
            }
            s[i] = _mm512_reduce_add_ps(a0), s[i + 1] = _mm512_reduce_add_ps(a1);
            s[i + 2] = _mm512_reduce_add_ps(a2), s[i + 3] = _mm512_reduce_add_ps(a3);
        }
        for (; i < n; i++) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t j = 0; j < d; j += 16)
                a = _mm512_fmadd_ps(_mm512_loadu_ps(q + j), KV_LOAD16(keys[i] + j), a);
            s[i] = _mm512_reduce_add_ps(a);
        }
        return;
    }
#endif
#ifdef ATTN_AVX2
    if (d % 8 == 0) {
        for (; i + 4 <= n; i += 4) {
            const kv_t *k0 = keys[i], *k1 = keys[i + 1], *k2 = keys[i + 2], *k3 = keys[i + 3];
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t j = 0; j < d; j += 8) {
                const __m256 qv = _mm256_loadu_ps(q + j);
                a0 = _mm256_fmadd_ps(qv, KV_LOAD8(k0 + j), a0);
                a1 = _mm256_fmadd_ps(qv, KV_LOAD8(k1 + j), a1);
                a2 = _mm256_fmadd_ps(qv, KV_LOAD8(k2 + j), a2);
                a3 = _mm256_fmadd_ps(qv, KV_LOAD8(k3 + j), a3);
            }
            s[i] = hsum256(a0), s[i + 1] = hsum256(a1), s[i + 2] = hsum256(a2);
            s[i + 3] = hsum256(a3);
        }
        for (; i < n; i++) {
            __m256 a = _mm256_setzero_ps();
            for (int64_t j = 0; j < d; j += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), KV_LOAD8(keys[i] + j), a);
            s[i] = hsum256(a);
        }
        return;
    }
#endif
    for (; i < n; i++) {
        float a = 0.0f;
        for (int64_t j = 0; j < d; j++) a += q[j] * kv_to_float(keys[i][j]);
        s[i] = a;
    }
}

/* acc[0:d] += sum_i p[i] vals[i] over the n keys of a block */
static inline void block_values(float *acc, const kv_t *const *vals, const float *p, int n,
                                int64_t d) {
#ifdef ATTN_AVX512
    if (d % 16 == 0) {
        int64_t off = 0;
        for (; off + 64 <= d; off += 64) chunk_values16_4(acc, vals, p, n, off);
        if (off + 32 <= d) chunk_values16_2(acc, vals, p, n, off), off += 32;
        if (off + 16 <= d) chunk_values16_1(acc, vals, p, n, off);
        return;
    }
#endif
#ifdef ATTN_AVX2
    if (d % 8 == 0) {
        int64_t off = 0;
        for (; off + 64 <= d; off += 64) chunk_values_8(acc, vals, p, n, off);
        if (off + 32 <= d) chunk_values_4(acc, vals, p, n, off), off += 32;
        if (off + 16 <= d) chunk_values_2(acc, vals, p, n, off), off += 16;
        if (off + 8 <= d) chunk_values_1(acc, vals, p, n, off);
        return;
    }
#endif
    for (int i = 0; i < n; i++)
        for (int64_t j = 0; j < d; j++) acc[j] += p[i] * kv_to_float(vals[i][j]);
}

/* the largest of s[0:n], n >= 1 (8 lanes, then the rest: max takes the same value whatever
 * the order) */
static inline float max_of(const float *s, int n) {
    int i = 0;
    float m = s[0];
#ifdef ATTN_AVX2
    if (n >= 8) {
        __m256 v = _mm256_loadu_ps(s);
        for (i = 8; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(s + i));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        m = _mm_cvtss_f32(h);
    }
#endif
    for (; i < n; i++) m = s[i] > m ? s[i] : m;
    return m;
}

/* s[0:n] = exp(s - mx), returning their sum; s has room for ATTN_BLOCK values */
static inline float block_exp(float *s, int n, float mx) {
#ifdef ATTN_AVX2
    for (int i = n; i < (n + 7) / 8 * 8; i++) s[i] = -INFINITY; /* exp256 gives 0 there */
    const __m256 m = _mm256_set1_ps(mx);
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(s + i, exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), m)));
    float sum = 0.0f; /* in key order, as cpu_decode_attention.c sums */
    for (int i = 0; i < n; i++) sum += s[i];
    return sum;
#else
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        s[i] = expf(s[i] - mx);
        sum += s[i];
    }
    return sum;
#endif
}

/* s[0:n] = softcap * tanh(s / softcap): a block's scaled scores soft-capped (Gemma 2) */
static inline void cap_scores(float *s, int n, float softcap) {
    int i = 0;
#ifdef ATTN_AVX2
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(s + i, soft_cap256(_mm256_loadu_ps(s + i), softcap));
#endif
    for (; i < n; i++) s[i] = softcap * tanhf(s[i] / softcap);
}

/* the K and V rows (w elements each) of the block's keys, into L2 ahead of it (a block of
 * whole float32 slots is 48 KB at SmolLM2's shape: more than L1) */
static inline void prefetch_rows(const kv_t *const *k, const kv_t *const *v, int n, int64_t w) {
    for (int i = 0; i < n; i++)
        for (int64_t b = 0; b < w; b += 64 / (int64_t)sizeof(kv_t)) { /* a cache line */
            __builtin_prefetch(k[i] + b, 0, 2);
            __builtin_prefetch(v[i] + b, 0, 2);
        }
}

/* the K and V rows at kv head kv0 of keys first..first + n - 1 of a row (n up to most,
 * none past end); k_new / v_new (NULL: none) stand for the last key, len - 1, not yet in the
 * pool */
static inline int block_rows(const kv_t *k_cache, const kv_t *v_cache, const int32_t *table_row,
                             int64_t first, int64_t end, int64_t len, int64_t page_size,
                             int64_t kv0, int64_t kv_heads, int64_t d, const kv_t *k_new,
                             const kv_t *v_new, const kv_t **k, const kv_t **v, int most) {
    const int n = (int)(end - first < most ? end - first : most);
    /* the page and the offset in it step along with the keys (pool_slot's two divisions per
     * key were a visible share of a block) */
    int64_t page = first / page_size, off = first % page_size;
    for (int i = 0; i < n; i++, off++) {
        if (off == page_size) off = 0, page++;
        const int64_t p = first + i;
        if (k_new && p == len - 1) {
            k[i] = k_new;
            v[i] = v_new;
            continue;
        }
        const int64_t slot = (int64_t)table_row[page] * page_size + off;
        const int64_t row = (slot * kv_heads + kv0) * KV_ROW(d);
        k[i] = k_cache + row;
        v[i] = v_cache + row;
    }
    return n;
}

#ifdef ATTN_STREAM
/* attend_range on AVX-512 (stream_fits): each block's rows through stream_block
 * (cpu_stream_attention.h) per 16 keys and kv head, the next block's rows asked for meanwhile
 * (at batch 1 a range's item takes whole slots: plan_items) */
static void stream_range(const float *q, int64_t kvc, int64_t gc, const kv_t *k_cache,
                         const kv_t *v_cache, const int32_t *table_row, int64_t begin, int64_t end,
                         int64_t len, int64_t page_size, int64_t kv0, int64_t kv_heads, int64_t d,
                         float scale, float softcap, const kv_t *k_new, const kv_t *v_new,
                         float *acc, float *mx, float *sum) {
    const int64_t heads = kvc * gc;
    __m512 lsum[ATTN_MAX_HEADS];
    const kv_t *k_rows[2][STREAM_BLOCK], *v_rows[2][STREAM_BLOCK];
    const kv_t *kh[STREAM_BLOCK], *vh[STREAM_BLOCK];
    for (int64_t j = 0; j < heads * d; j++) acc[j] = 0.0f;
    for (int64_t h = 0; h < heads; h++) mx[h] = -INFINITY, lsum[h] = _mm512_setzero_ps();
#ifdef STREAM_I8_DOTS
    int8_t qi[ATTN_MAX_HEADS * ATTN_MAX_DIM] __attribute__((aligned(64)));
    float qs[ATTN_MAX_HEADS];
    int32_t qb[ATTN_MAX_HEADS];
    const int i8_dots = stream_i8_dots(d) && end > begin;
    if (i8_dots) quantize_query_i8(q, heads, d, qi, qs, qb);
#endif
    int cur = 0;
    int n = end > begin ? block_rows(k_cache, v_cache, table_row, begin, end, len, page_size, kv0,
                                     kv_heads, d, k_new, v_new, k_rows[0], v_rows[0], STREAM_BLOCK)
                        : 0;
    for (int64_t first = begin; first < end; first += STREAM_BLOCK) {
        const int64_t next = first + STREAM_BLOCK;
        int n_next = 0;
        if (next < end) {
            n_next = block_rows(k_cache, v_cache, table_row, next, end, len, page_size, kv0,
                                kv_heads, d, k_new, v_new, k_rows[!cur], v_rows[!cur], STREAM_BLOCK);
        }
        /* 16 keys' slots whole (their kv heads in turn) before the next 16: the rows are read
         * in the pool's order, not a kv head's lines strided over the block */
        for (int h = 0; h < n; h += STREAM_KEYS) {
            const int m = n - h < STREAM_KEYS ? n - h : STREAM_KEYS;
            for (int64_t c = 0; c < kvc; c++) {
                const kv_t *const *kc = k_rows[cur], *const *vc = v_rows[cur];
                if (c) { /* kv head kv0 + c: the next row of each slot */
                    for (int i = h; i < h + m; i++)
                        kh[i] = k_rows[cur][i] + c * KV_ROW(d), vh[i] = v_rows[cur][i] + c * KV_ROW(d);
                    kc = kh, vc = vh;
                }
                /* the next block's rows of these keys and kv head, a few lines at a time
                 * between the blocks' work (a block's worth at once stalled on fill buffers) */
                for (int i = h; i < h + STREAM_KEYS && i < n_next; i++)
                    for (int64_t b = 0; b < KV_ROW(d); b += 64 / (int64_t)sizeof(kv_t)) {
                        __builtin_prefetch(k_rows[!cur][i] + c * KV_ROW(d) + b, 0, 3);
                        __builtin_prefetch(v_rows[!cur][i] + c * KV_ROW(d) + b, 0, 3);
                    }
#ifdef STREAM_I8_DOTS
                if (i8_dots) {
                    stream_block_i8(qi + c * gc * d, qs + c * gc, qb + c * gc, gc, d, kc + h,
                                    vc + h, m, scale, softcap, acc + c * gc * d, mx + c * gc,
                                    lsum + c * gc);
                    continue;
                }
#endif
                stream_block(q + c * gc * d, gc, d, kc + h, vc + h, m, scale, softcap,
                             acc + c * gc * d, mx + c * gc, lsum + c * gc);
            }
        }
        cur = !cur;
        n = n_next;
    }
#ifdef STREAM_I8_DOTS
    if (i8_dots) i8_unpermute(acc, heads, d); /* the integer value sums' order (I8V_SLOT) */
#endif
    for (int64_t h = 0; h < heads; h++) sum[h] = _mm512_reduce_add_ps(lsum[h]);
}
#endif

/* The online-softmax state of the query heads of kv heads kv0 .. kv0 + kvc - 1, gc heads each
 * (kvc * gc <= ATTN_MAX_HEADS), over keys begin .. end - 1 of a row of len keys: acc [kvc * gc,
 * d] the unnormalized sum of exp(s - mx) v, mx and sum per head (mx -inf and sum 0 where the
 * range is empty). q [kvc * gc, d], heads in order. k_new / v_new: the last key's rows when
 * it is not in the pool yet (the kvc heads' rows one after another, KV_ROW(d) apart, as in a
 * pool slot). Each block's rows are read once for all the heads. softcap > 0: the scaled scores
 * s become softcap * tanh(s / softcap) before the softmax (Gemma 2; 0: as they are). */
static void attend_range(const float *q, int64_t kvc, int64_t gc, const kv_t *k_cache,
                         const kv_t *v_cache, const int32_t *table_row, int64_t begin,
                         int64_t end, int64_t len, int64_t page_size, int64_t kv0,
                         int64_t kv_heads, int64_t d, float scale, float softcap,
                         const kv_t *k_new, const kv_t *v_new, float *acc, float *mx,
                         float *sum) {
#ifdef ATTN_STREAM
    if (stream_fits(gc, d)) {
        stream_range(q, kvc, gc, k_cache, v_cache, table_row, begin, end, len, page_size, kv0,
                     kv_heads, d, scale, softcap, k_new, v_new, acc, mx, sum);
        return;
    }
#endif
    const int64_t heads = kvc * gc;
    float s[ATTN_BLOCK];
    const kv_t *k_rows[2][ATTN_BLOCK], *v_rows[2][ATTN_BLOCK];
    const kv_t *kh[ATTN_BLOCK], *vh[ATTN_BLOCK];
    for (int64_t j = 0; j < heads * d; j++) acc[j] = 0.0f;
    for (int64_t h = 0; h < heads; h++) mx[h] = -INFINITY, sum[h] = 0.0f;
    int cur = 0;
    int n = end > begin ? block_rows(k_cache, v_cache, table_row, begin, end, len, page_size, kv0,
                                     kv_heads, d, k_new, v_new, k_rows[0], v_rows[0], ATTN_BLOCK)
                        : 0;
    for (int64_t first = begin; first < end; first += ATTN_BLOCK) {
        const int64_t next = first + ATTN_BLOCK;
        int n_next = 0;
        if (next < end) {
            n_next = block_rows(k_cache, v_cache, table_row, next, end, len, page_size, kv0,
                                kv_heads, d, k_new, v_new, k_rows[!cur], v_rows[!cur], ATTN_BLOCK);
            prefetch_rows(k_rows[!cur], v_rows[!cur], n_next, kvc * KV_ROW(d));
        }
        for (int64_t c = 0; c < kvc; c++) {
            const kv_t *const *kc = k_rows[cur], *const *vc = v_rows[cur];
            if (c) { /* kv head kv0 + c: the next d floats of each slot's rows */
                for (int i = 0; i < n; i++)
                    kh[i] = k_rows[cur][i] + c * KV_ROW(d), vh[i] = v_rows[cur][i] + c * KV_ROW(d);
                kc = kh, vc = vh;
            }
#if KV_IS_I8
            float ks[ATTN_BLOCK], vs[ATTN_BLOCK], p[ATTN_BLOCK]; /* the rows' scales */
            for (int i = 0; i < n; i++) ks[i] = kv_row_scale(kc[i], d) * scale;
            for (int i = 0; i < n; i++) vs[i] = kv_row_scale(vc[i], d);
#endif
            for (int64_t g = c * gc; g < (c + 1) * gc; g++) {
                block_dots(q + g * d, kc, n, d, s);
#if KV_IS_I8
                for (int i = 0; i < n; i++) s[i] *= ks[i];
#else
                for (int i = 0; i < n; i++) s[i] *= scale;
#endif
                if (softcap > 0.0f) cap_scores(s, n, softcap);
                const float block_max = max_of(s, n);
                if (block_max > mx[g]) {
                    if (sum[g] > 0.0f) {
                        const float r = expf(mx[g] - block_max);
                        sum[g] *= r;
                        for (int64_t j = 0; j < d; j++) acc[g * d + j] *= r;
                    }
                    mx[g] = block_max;
                }
                sum[g] += block_exp(s, n, mx[g]);
#if KV_IS_I8
                for (int i = 0; i < n; i++) p[i] = s[i] * vs[i];
                block_values(acc + g * d, vc, p, n, d);
#else
                block_values(acc + g * d, vc, s, n, d);
#endif
            }
        }
        cur = !cur;
        n = n_next;
    }
}

/* softmax(q k^T scale) v over keys first .. len - 1 of a row's len (attend_range over them; first
 * 0: all, a sliding window's start else; softcap as there): out [kvc * gc, d] (out may be q: q
 * is read before out is written) */
static inline void attend_group(const float *q, int64_t kvc, int64_t gc, const kv_t *k_cache,
                         const kv_t *v_cache, const int32_t *table_row, int64_t first, int64_t len,
                         int64_t page_size, int64_t kv0, int64_t kv_heads, int64_t d, float scale,
                         float softcap, const kv_t *k_new, const kv_t *v_new, float *out) {
    float acc[ATTN_MAX_HEADS * ATTN_MAX_DIM];
    float mx[ATTN_MAX_HEADS], sum[ATTN_MAX_HEADS];
    attend_range(q, kvc, gc, k_cache, v_cache, table_row, first, len, len, page_size, kv0, kv_heads,
                 d, scale, softcap, k_new, v_new, acc, mx, sum);
    for (int64_t g = 0; g < kvc * gc; g++) {
        const float inv = sum[g] > 0.0f ? 1.0f / sum[g] : 0.0f;
        for (int64_t j = 0; j < d; j++) out[g * d + j] = acc[g * d + j] * inv;
    }
}

#endif
