/* Paged decode attention on the CPU: one query token per request, keys and values read in
 * place from the paged KV pool (no gathered copy), scores and softmax in float32.
 *
 * Layouts (all contiguous):
 *   q             [B, H, D]          (bfloat16 or float32, the pool's dtype); rows q_stride
 *                                    elements apart, heads contiguous within a row
 *   out           [B, H, D]          contiguous
 *   k_cache, v    [S, Hkv, D]        one layer of the pool; token slot s holds K/V of all heads
 *   block_table   [B, table_stride]  int32 page ids; slot of position p of request b is
 *                                    block_table[b, p / page_size] * page_size + p % page_size
 *   seq_lens      [B]                int32 keys per request (the new token included)
 *
 * The work of a (request, kv head) pair: its G = H / Hkv query heads share each key and value
 * read. Keys are taken in blocks with an online softmax (running max and sum per query head,
 * the accumulator rescaled when the max grows), so no buffer grows with the context. With
 * enough requests a thread takes whole requests (all their heads, streaming its next
 * request's rows into L2 meanwhile: see the fast item), else one pair at a time. Items run in
 * parallel under OpenMP; loaded after torch, this library shares torch's OpenMP runtime (same
 * soname), so the two thread pools are one.
 *
 * Built by kernels/cpu/cpu_native.py with gcc -O3 -march=native; the AVX-512 paths are
 * used where the compiler targets them (AVX512F for float32, AVX512BF16 for bfloat16 dot
 * products), a portable loop otherwise.
 *
 * Built with -DKV_F16 (cpu_kv.h), the pool is float16 and q / out float32 (is_bf16 must be 0):
 * the per-item loop below reads it through F16C; the register-resident AVX-512 items are not
 * built for it (AVX-512 CPUs take the per-item loop, whose dots are AVX-512 too). Built with
 * -DKV_I8 the pool is int8 with a scale per head row (cpu_kv.h): the same per-item loop, each
 * dot product and value row taking its row's scale once; there q / out may be bfloat16 too
 * (is_bf16: a bfloat16 model's queries, widened to float32 on the way in, the output rounded on
 * the way out).
 *
 * On AVX-512, float32 queries over a pool the register-resident items do not take (float16,
 * int8, or a group / head dim they lack) go through the fused step's streamed range
 * (attend_range: cpu_group_attention.h, cpu_stream_attention.h), soft-capped or not: each key
 * row widened once for all the group's heads, 16 scores from one reduction.
 */
#include <omp.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "cpu_group_attention.h"
#include "cpu_kv.h"
#include "cpu_paged.h"
#include "cpu_simd.h"
#include "cpu_split_k.h"

#define BLOCK 32
/* how many keys ahead the first head of an item prefetches every head's rows (into L2) */
#define PREFETCH_KEYS 32
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
/* AVX2 + FMA without AVX-512: the float32 loops below in 8-lane vectors (D is a multiple of 32;
 * on such a CPU the scalar loops ran ~10x slower, a third of a decode step at 16-48 requests) */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define AVX2_F32 1
#endif

/* exp of n floats in place (n <= BLOCK) */
static inline void exp_block(float *s, int n) {
#ifdef __AVX512F__
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = (n - i >= 16) ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        __m512 x = _mm512_maskz_loadu_ps(m, s + i);
        _mm512_mask_storeu_ps(s + i, m, exp512(x));
    }
#elif defined(AVX2_F32)
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, exp256(_mm256_loadu_ps(s + i)));
    for (; i < n; i++) s[i] = expf(s[i]);
#else
    for (int i = 0; i < n; i++) s[i] = expf(s[i]);
#endif
}

/* dot products of G query heads (float32 copies in qf, bf16 in qb) with one key row */
static inline float dot_bf16(const uint16_t *qb, const float *qf, const uint16_t *k, int d) {
#if defined(__AVX512BF16__)
    (void)qf;
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 32) {
        __m512bh a = (__m512bh)_mm512_loadu_si512((const void *)(qb + i));
        __m512bh b = (__m512bh)_mm512_loadu_si512((const void *)(k + i));
        acc = _mm512_dpbf16_ps(acc, a, b);
    }
    return _mm512_reduce_add_ps(acc);
#elif defined(AVX2_F32)
    (void)qb;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(qf + i), load_bf16x8(k + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(qf + i + 8), load_bf16x8(k + i + 8), acc1);
    }
    return hsum256(_mm256_add_ps(acc0, acc1));
#else
    (void)qb;
    float acc = 0.0f;
    for (int i = 0; i < d; i++) acc += qf[i] * bf16_to_float(k[i]);
    return acc;
#endif
}

/* q (float32) . k (a pool row: float32, float16 in a KV_F16 build, int8 and its scale in a
 * KV_I8 build) */
static inline float dot_f32(const float *q, const kv_t *k, int d) {
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), KV_LOAD16(k + i), acc);
    return _mm512_reduce_add_ps(acc) * kv_row_scale(k, d);
#elif defined(AVX2_F32)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), KV_LOAD8(k + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), KV_LOAD8(k + i + 8), acc1);
    }
    return hsum256(_mm256_add_ps(acc0, acc1)) * kv_row_scale(k, d);
#else
    float acc = 0.0f;
    for (int i = 0; i < d; i++) acc += q[i] * kv_to_float(k[i]);
    return acc * kv_row_scale(k, d);
#endif
}

/* acc[0:d] += p * v[0:d] */
static inline void axpy_bf16(float *acc, float p, const uint16_t *v, int d) {
#ifdef __AVX512F__
    __m512 pv = _mm512_set1_ps(p);
    for (int i = 0; i < d; i += 16) {
        __m512i raw = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + i)));
        __m512 vf = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pv, vf, _mm512_loadu_ps(acc + i)));
    }
#elif defined(AVX2_F32)
    const __m256 pv = _mm256_set1_ps(p);
    for (int i = 0; i < d; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, load_bf16x8(v + i), _mm256_loadu_ps(acc + i)));
#else
    for (int i = 0; i < d; i++) acc[i] += p * bf16_to_float(v[i]);
#endif
}

static inline void axpy_f32(float *acc, float p, const kv_t *v, int d) {
    p *= kv_row_scale(v, d);
#ifdef __AVX512F__
    __m512 pv = _mm512_set1_ps(p);
    for (int i = 0; i < d; i += 16)
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pv, KV_LOAD16(v + i), _mm512_loadu_ps(acc + i)));
#elif defined(AVX2_F32)
    const __m256 pv = _mm256_set1_ps(p);
    for (int i = 0; i < d; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, KV_LOAD8(v + i), _mm256_loadu_ps(acc + i)));
#else
    for (int i = 0; i < d; i++) acc[i] += p * kv_to_float(v[i]);
#endif
}

static inline void scale_f32(float *acc, float c, int d) {
    for (int i = 0; i < d; i++) acc[i] *= c;
}

/* One (request, kv head) item over keys first .. len - 1. is_bf16 selects the element type of q
 * and out, and of the caches where the build has no element of its own (KV_OWN_ELEMENT). part != NULL (a split-K range): its state (cpu_split_k.h) goes there instead
 * of the output. */
static void decode_item(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                        const int32_t *table_row, int first, int len, int64_t b, int64_t kvh,
                        int64_t H, int64_t Hkv, int64_t D, int64_t page_size, float scale,
                        float softcap, void *out, int is_bf16, float *part) {
    const int64_t G = H / Hkv;
    const int pool_bf16 = is_bf16 && !KV_OWN_ELEMENT;
    float qf[MAX_GROUP][MAX_HEAD_DIM];
    uint16_t qb[MAX_GROUP][MAX_HEAD_DIM];
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float s[MAX_GROUP][BLOCK];
    float m[MAX_GROUP], l[MAX_GROUP];
    const int64_t head0 = kvh * G;
    for (int64_t g = 0; g < G; g++) {
        const int64_t off = b * q_stride + (head0 + g) * D;
        for (int64_t i = 0; i < D; i++) {
            if (is_bf16) {
                qb[g][i] = ((const uint16_t *)q)[off + i];
                qf[g][i] = bf16_to_float(qb[g][i]);
            } else {
                qf[g][i] = ((const float *)q)[off + i];
            }
            acc[g][i] = 0.0f;
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    int64_t slots[BLOCK];
    for (int t0 = first; t0 < len; t0 += BLOCK) {
        const int n = (len - t0 < BLOCK) ? (len - t0) : BLOCK;
        for (int i = 0; i < n; i++) slots[i] = pool_slot(table_row, t0 + i, page_size);
        for (int i = 0; i < n; i++) {
            const int64_t row = (slots[i] * Hkv + kvh) * KV_ROW(D);
            for (int64_t g = 0; g < G; g++) {
                float dot = pool_bf16 ? dot_bf16(qb[g], qf[g], (const uint16_t *)k_cache + row, (int)D)
                                    : dot_f32(qf[g], (const kv_t *)k_cache + row, (int)D);
                s[g][i] = softcap > 0.0f ? softcap * tanhf(dot * scale / softcap) : dot * scale;
            }
        }
        for (int64_t g = 0; g < G; g++) {
            float block_max = s[g][0];
            for (int i = 1; i < n; i++) block_max = s[g][i] > block_max ? s[g][i] : block_max;
            const float new_max = block_max > m[g] ? block_max : m[g];
            if (new_max > m[g] && l[g] > 0.0f) {
                const float c = expf(m[g] - new_max);
                l[g] *= c;
                scale_f32(acc[g], c, (int)D);
            }
            m[g] = new_max;
            for (int i = 0; i < n; i++) s[g][i] -= new_max;
            exp_block(s[g], n);
            float sum = 0.0f;
            for (int i = 0; i < n; i++) sum += s[g][i];
            l[g] += sum;
        }
        for (int i = 0; i < n; i++) {
            const int64_t row = (slots[i] * Hkv + kvh) * KV_ROW(D);
            for (int64_t g = 0; g < G; g++) {
                if (pool_bf16)
                    axpy_bf16(acc[g], s[g][i], (const uint16_t *)v_cache + row, (int)D);
                else
                    axpy_f32(acc[g], s[g][i], (const kv_t *)v_cache + row, (int)D);
            }
        }
    }
    if (part != NULL) {
        for (int64_t g = 0; g < G; g++) {
            for (int64_t i = 0; i < D; i++) part[g * D + i] = acc[g][i];
            part[G * D + g] = m[g];
            part[G * D + G + g] = l[g];
        }
        return;
    }
    for (int64_t g = 0; g < G; g++) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        const int64_t off = (b * H + head0 + g) * D;
        for (int64_t i = 0; i < D; i++) {
            const float value = acc[g][i] * inv;
            if (is_bf16)
                ((uint16_t *)out)[off + i] = float_to_bf16(value);
            else
                ((float *)out)[off + i] = value;
        }
    }
}

#ifdef __AVX512F__
/* 16 fp32 of row r, chunk j (16 values), of a bf16 or fp32 cache */
#define LOAD_ROW_BF16(base, r, j) load_bf16x16((const uint16_t *)(base) + (r) + 16 * (j))
#define LOAD_ROW_F32(base, r, j) _mm512_loadu_ps((const float *)(base) + (r) + 16 * (j))

/* acc[g] += p[g][i] * v_i over the block's keys: float32 fused multiply-adds per key */
#define V_ACC_FMA(KIND, G, NV)                                                                   \
    for (int i = 0; i < n; i++) {                                                                \
        __m512 v[NV];                                                                            \
        for (int j = 0; j < (NV); j++) v[j] = LOAD_ROW_##KIND(vc, rows[i], j);                   \
        for (int g = 0; g < (G); g++) {                                                          \
            const __m512 pv = _mm512_set1_ps(p[g][i]);                                           \
            for (int j = 0; j < (NV); j++) acc[g][j] = _mm512_fmadd_ps(pv, v[j], acc[g][j]);     \
        }                                                                                        \
    }
#define V_ACC_F32(G, NV) V_ACC_FMA(F32, G, NV)
#define UNPAIR_F32(first, second)
#ifdef __AVX512BF16__
/* bfloat16 pools: p rounded to bfloat16 (as the model's own p @ v in bfloat16), two keys per
 * dot-product instruction on value rows interleaved in pairs (unpacklo/hi_epi16). The pairs
 * leave each accumulator's lanes in a fixed order of dims, put back by UNPAIR at the end. */
static const uint16_t ZERO_ROW[MAX_HEAD_DIM] __attribute__((aligned(64)));
#define V_ACC_BF16(G, NV)                                                                        \
    uint32_t pb[G][8] __attribute__((aligned(64)));                                              \
    for (int g = 0; g < (G); g++)                                                                \
        _mm256_store_si256((__m256i *)pb[g], (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p[g]))); \
    for (int i = 0; i < n; i += 2) {                                                             \
        const uint16_t *ra = (const uint16_t *)vc + rows[i];                                     \
        const uint16_t *rb = i + 1 < n ? (const uint16_t *)vc + rows[i + 1] : ZERO_ROW;          \
        for (int c = 0; c < (NV) / 2; c++) {                                                     \
            const __m512i x = _mm512_loadu_si512((const void *)(ra + 32 * c));                   \
            const __m512i y = _mm512_loadu_si512((const void *)(rb + 32 * c));                   \
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y);                            \
            const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(x, y);                            \
            for (int g = 0; g < (G); g++) {                                                      \
                const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pb[g][i / 2]);              \
                acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], pp, lo);                         \
                acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], pp, hi);                 \
            }                                                                                    \
        }                                                                                        \
    }
#define UNPAIR_BF16(first, second)                                                               \
    {                                                                                            \
        const __m512 lo = first, hi = second;                                                    \
        first = _mm512_permutex2var_ps(lo, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, \
                                                             20, 21, 22, 23), hi);               \
        second = _mm512_permutex2var_ps(lo, _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, \
                                                              13, 14, 15, 28, 29, 30, 31), hi);  \
    }
#else
#define V_ACC_BF16(G, NV) V_ACC_FMA(BF16, G, NV)
#define UNPAIR_BF16(first, second)
#endif

/* Rows of another request to bring into L2 while this item computes, a few per key block */
typedef struct {
    const int32_t *table_row; /* its pages, or NULL: none */
    int64_t len, next, per_block;
} l2_stream;

/* the K and V rows (every head, ``row_bytes`` each) of one pool slot, into L2 */
static inline void prefetch_slot_l2(const void *kc, const void *vc, int64_t slot,
                                    int64_t row_bytes) {
    const char *kr = (const char *)kc + slot * row_bytes, *vr = (const char *)vc + slot * row_bytes;
    for (int64_t o = 0; o < row_bytes; o += 64) {
        _mm_prefetch(kr + o, _MM_HINT_T1);
        _mm_prefetch(vr + o, _MM_HINT_T1);
    }
}

static inline void stream_rows(l2_stream *st, const void *kc, const void *vc, int64_t row_bytes,
                               int64_t page_size) {
    for (int64_t k = 0; k < st->per_block && st->next < st->len; k++, st->next++)
        prefetch_slot_l2(kc, vc, pool_slot(st->table_row, st->next, page_size), row_bytes);
}

/* A (request, kv head) item with G query heads of D = 16 * NV values, everything in registers:
 * per block of 16 keys, each head's 16 scores come from one reduce16, and the values are
 * accumulated into G x NV register accumulators. KIND is BF16 or F32.
 *
 * The pool is far larger than the caches, and the item would wait on memory most of the time.
 * It asks for the next block's keys and this block's values ahead of use (into L1); memory is
 * kept busy further ahead by ``st``, the rows (every head: adjacent in a slot) of the request
 * its thread runs next, streamed into L2 a few per block over all of this request's items. A
 * thread's first request has nobody streaming for it (``cold``): its first head's item asks
 * for every head's rows PREFETCH_KEYS ahead, which its other heads' items then find in L2. */
#define DEFINE_FAST_ITEM(KIND, G, NV)                                                            \
    static void fast_##KIND##_##G##_##NV(const void *q, int64_t q_stride, const void *kc,        \
                                         const void *vc, const int32_t *table_row, int first,     \
                                         int len,                                                 \
                                         int64_t b, int64_t kvh, int64_t H, int64_t Hkv,          \
                                         int64_t page_size, float scale, float softcap,           \
                                         void *out, int cold,                                     \
                                         l2_stream *st, float *part) {                            \
        const int64_t D = 16 * (NV);                                                             \
        __m512 qv[G][NV] __attribute__((unused)), acc[G][NV];                                    \
        QBF16_DECL(KIND, G, NV)                                                                  \
        float m[G], l[G], p[G][16];                                                              \
        const int64_t head0 = kvh * (G);                                                         \
        for (int g = 0; g < (G); g++) {                                                          \
            for (int j = 0; j < (NV); j++) {                                                     \
                qv[g][j] = LOAD_ROW_##KIND(q, b * q_stride + (head0 + g) * D, j);                \
                QBF16_SET(KIND, g, j, q, b * q_stride + (head0 + g) * D)                         \
                acc[g][j] = _mm512_setzero_ps();                                                 \
            }                                                                                    \
            m[g] = -INFINITY;                                                                    \
            l[g] = 0.0f;                                                                         \
        }                                                                                        \
        int64_t rows[16];                                                                        \
        for (int t0 = first; t0 < len; t0 += 16) {                                               \
            const int n = (len - t0 < 16) ? (len - t0) : 16;                                     \
            const __mmask16 valid = (__mmask16)((n == 16) ? 0xffffu : ((1u << n) - 1u));         \
            for (int i = 0; i < n; i++) {                                                        \
                rows[i] = (pool_slot(table_row, t0 + i, page_size) * Hkv + kvh) * D;             \
                PREFETCH_ROW(vc, rows[i], KIND##_BYTES * D); /* read after the scores */         \
            }                                                                                    \
            for (int i = 0; i < 16 && t0 + 16 + i < len; i++) /* the next block's keys */        \
                PREFETCH_ROW(kc, (pool_slot(table_row, t0 + 16 + i, page_size) * Hkv + kvh) * D, \
                             KIND##_BYTES * D);                                                  \
            if (st->table_row != NULL) stream_rows(st, kc, vc, Hkv * D * KIND##_BYTES, page_size); \
            if (cold && kvh == 0) /* every head's rows (adjacent in a slot), later in this item */ \
                for (int i = 0; i < 16 && t0 + PREFETCH_KEYS + i < len; i++)                     \
                    prefetch_slot_l2(kc, vc, pool_slot(table_row, t0 + PREFETCH_KEYS + i, page_size), \
                                     Hkv * D * KIND##_BYTES);                                    \
            for (int g = 0; g < (G); g++) {                                                      \
                __m512 part[16];                                                                 \
                for (int i = 0; i < 16; i++) {                                                   \
                    __m512 a = _mm512_setzero_ps();                                              \
                    if (i < n) a = DOT_##KIND(g, kc, rows[i], NV);                               \
                    part[i] = a;                                                                 \
                }                                                                                \
                __m512 sc = _mm512_mul_ps(reduce16(part), _mm512_set1_ps(scale));                \
                if (softcap > 0.0f)                                                              \
                    sc = _mm512_mul_ps(_mm512_set1_ps(softcap),                                  \
                                       tanh512(_mm512_mul_ps(sc, _mm512_set1_ps(1.0f / softcap)))); \
                sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, sc);                   \
                const float block_max = _mm512_reduce_max_ps(sc);                               \
                const float new_max = block_max > m[g] ? block_max : m[g];                       \
                const __m512 e = _mm512_maskz_mov_ps(                                            \
                    valid, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(new_max))));                  \
                if (new_max > m[g]) { /* the max grew: rescale what was summed so far */         \
                    const float corr = expf(m[g] - new_max);                                     \
                    l[g] *= corr;                                                                \
                    const __m512 cv = _mm512_set1_ps(corr);                                      \
                    for (int j = 0; j < (NV); j++) acc[g][j] = _mm512_mul_ps(acc[g][j], cv);     \
                    m[g] = new_max;                                                              \
                }                                                                                \
                l[g] += _mm512_reduce_add_ps(e);                                                 \
                _mm512_storeu_ps(p[g], e);                                                       \
            }                                                                                    \
            V_ACC_##KIND(G, NV)                                                                  \
        }                                                                                        \
        for (int g = 0; g < (G); g++) {                                                          \
            /* a split-K range keeps its sum unnormalized, with its max and sum beside it */     \
            const float norm = part != NULL ? 1.0f : (l[g] > 0.0f ? 1.0f / l[g] : 0.0f);         \
            const __m512 inv = _mm512_set1_ps(norm);                                             \
            const int64_t off = (b * H + head0 + g) * D;                                         \
            for (int j = 0; j < (NV); j += 2) {                                                  \
                __m512 first = _mm512_mul_ps(acc[g][j], inv);                                    \
                __m512 second = _mm512_mul_ps(acc[g][j + 1], inv);                               \
                UNPAIR_##KIND(first, second)                                                     \
                if (part != NULL) {                                                              \
                    _mm512_storeu_ps(part + g * D + 16 * j, first);                              \
                    _mm512_storeu_ps(part + g * D + 16 * (j + 1), second);                       \
                } else {                                                                         \
                    STORE_OUT_##KIND(out, off + 16 * j, first);                                  \
                    STORE_OUT_##KIND(out, off + 16 * (j + 1), second);                           \
                }                                                                                \
            }                                                                                    \
            if (part != NULL) part[(G) * D + g] = m[g], part[(G) * D + (G) + g] = l[g];          \
        }                                                                                        \
    }

/* q . key row for head g: bf16 pairs with AVX512-BF16 dot products (exact products, float32
 * sums), else float32 fused multiply-adds */
#ifdef __AVX512BF16__
#define QBF16_DECL(KIND, G, NV) __m512bh qb[G][(NV) / 2] __attribute__((unused));
#define QBF16_SET(KIND, g, j, base, off)                                                         \
    if ((KIND##_IS_BF16) && (j) % 2 == 0)                                                        \
        qb[g][(j) / 2] = (__m512bh)_mm512_loadu_si512((const uint16_t *)(base) + (off) + 16 * (j));
#define DOT_BF16(g, base, row, NV) dot_pairs(qb[g], (const uint16_t *)(base) + (row), (NV) / 2)
static inline __m512 dot_pairs(const __m512bh *q, const uint16_t *k, int pairs) {
    __m512 a = _mm512_setzero_ps();
    for (int j = 0; j < pairs; j++)
        a = _mm512_dpbf16_ps(a, q[j], (__m512bh)_mm512_loadu_si512((const void *)(k + 32 * j)));
    return a;
}
#else
#define QBF16_DECL(KIND, G, NV)
#define QBF16_SET(KIND, g, j, base, off)
#define DOT_BF16(g, base, row, NV) dot_rows(qv[g], (base), (row), (NV), 1)
#endif
#define BF16_BYTES 2
#define F32_BYTES 4
/* the cache lines of one row (``bytes`` long) of a cache, into L1 */
#define PREFETCH_ROW(base, row, bytes)                                                           \
    for (int64_t _b = 0; _b < (bytes); _b += 64)                                                 \
        _mm_prefetch((const char *)(base) + (row) * (bytes) / D + _b, _MM_HINT_T0);
#define BF16_IS_BF16 1
#define F32_IS_BF16 0
#define DOT_F32(g, base, row, NV) dot_rows(qv[g], (base), (row), (NV), 0)
static inline __m512 dot_rows(const __m512 *q, const void *base, int64_t row, int nv, int bf16) {
    __m512 a = _mm512_setzero_ps();
    for (int j = 0; j < nv; j++)
        a = _mm512_fmadd_ps(q[j], bf16 ? LOAD_ROW_BF16(base, row, j) : LOAD_ROW_F32(base, row, j), a);
    return a;
}

#define STORE_OUT_BF16(out, off, o) _mm256_storeu_si256((__m256i *)((uint16_t *)(out) + (off)), to_bf16x16(o))
#define STORE_OUT_F32(out, off, o) _mm512_storeu_ps((float *)(out) + (off), o)

#define DEFINE_FOR_GROUPS(KIND, NV) \
    DEFINE_FAST_ITEM(KIND, 1, NV) DEFINE_FAST_ITEM(KIND, 2, NV) DEFINE_FAST_ITEM(KIND, 3, NV) \
    DEFINE_FAST_ITEM(KIND, 4, NV) DEFINE_FAST_ITEM(KIND, 5, NV) DEFINE_FAST_ITEM(KIND, 6, NV) \
    DEFINE_FAST_ITEM(KIND, 7, NV) DEFINE_FAST_ITEM(KIND, 8, NV)
DEFINE_FOR_GROUPS(BF16, 4)
DEFINE_FOR_GROUPS(BF16, 8)
DEFINE_FOR_GROUPS(F32, 4)
DEFINE_FOR_GROUPS(F32, 8)
DEFINE_FOR_GROUPS(BF16, 16)
DEFINE_FOR_GROUPS(F32, 16)

typedef void (*fast_item_fn)(const void *, int64_t, const void *, const void *, const int32_t *,
                             int, int, int64_t, int64_t, int64_t, int64_t, int64_t, float, float,
                             void *, int, l2_stream *, float *);

#define GROUP_TABLE(KIND, NV)                                                                   \
    {fast_##KIND##_1_##NV, fast_##KIND##_2_##NV, fast_##KIND##_3_##NV, fast_##KIND##_4_##NV,   \
     fast_##KIND##_5_##NV, fast_##KIND##_6_##NV, fast_##KIND##_7_##NV, fast_##KIND##_8_##NV}
static const fast_item_fn FAST_BF16_64[8] = GROUP_TABLE(BF16, 4);
static const fast_item_fn FAST_BF16_128[8] = GROUP_TABLE(BF16, 8);
static const fast_item_fn FAST_F32_64[8] = GROUP_TABLE(F32, 4);
static const fast_item_fn FAST_F32_128[8] = GROUP_TABLE(F32, 8);
static const fast_item_fn FAST_BF16_256[8] = GROUP_TABLE(BF16, 16);
static const fast_item_fn FAST_F32_256[8] = GROUP_TABLE(F32, 16);

/* the register-resident item for (dtype, G, D), or NULL */
static fast_item_fn fast_item(int is_bf16, int64_t G, int64_t D) {
    if (G < 1 || G > 8 || KV_IS_F16 || KV_IS_I8) return NULL;
    switch (D) {
    case 64: return (is_bf16 ? FAST_BF16_64 : FAST_F32_64)[G - 1];
    case 128: return (is_bf16 ? FAST_BF16_128 : FAST_F32_128)[G - 1];
    case 256: return (is_bf16 ? FAST_BF16_256 : FAST_F32_256)[G - 1];
    default: return NULL;
    }
}
#else
typedef void (*fast_item_fn)(void);
static fast_item_fn fast_item(int is_bf16, int64_t G, int64_t D) { (void)is_bf16; (void)G; (void)D; return NULL; }
#endif

#ifdef ATTN_STREAM
/* out[off .. off + d) = row * inv, as bfloat16 (round to nearest even, NaN kept) or float32; d a
 * multiple of 16. In vectors, as the query's widening: at ~100 keys a request, element by
 * element they were a tenth of a 32-request step's attention over an int8 pool
 * (scripts/micro/bench_cpu_attention.py --dtypes int8-bf16 --baseline-rev). */
static inline void store_row(void *out, int64_t off, const float *row, float inv, int64_t d,
                             int is_bf16) {
    const __m512 s = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < d; i += 16) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(row + i), s);
        if (is_bf16)
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + off + i), to_bf16x16(v));
        else
            _mm512_storeu_ps((float *)out + off + i, v);
    }
}
#endif

/* the first key a decode at length len sees: window 0 means all */
static inline int first_key(int len, int64_t window) {
    return (window > 0 && len > window) ? (int)(len - window) : 0;
}

/* Returns 0, or -1 when the shapes are outside what this kernel handles (the caller then uses
 * the torch path): H a multiple of Hkv, H / Hkv <= MAX_GROUP, D a multiple of 32, <= 256.
 * ``window`` > 0: the query (at position len - 1) sees its last ``window`` keys only;
 * ``softcap`` > 0: scaled scores s become softcap * tanh(s / softcap) before the softmax. */
int asyncengine_paged_decode_attention_planned(
    const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
    const int32_t *block_table, int64_t table_stride, const int32_t *seq_lens, int64_t B,
    int64_t H, int64_t Hkv, int64_t D, int64_t page_size, float scale, int64_t window,
    float softcap, void *out, int is_bf16, int num_threads, int plan_threads);

int asyncengine_paged_decode_attention(const void *q, int64_t q_stride, const void *k_cache,
                                       const void *v_cache,
                                       const int32_t *block_table, int64_t table_stride,
                                       const int32_t *seq_lens, int64_t B, int64_t H, int64_t Hkv,
                                       int64_t D, int64_t page_size, float scale, int64_t window,
                                       float softcap, void *out, int is_bf16, int num_threads) {
    return asyncengine_paged_decode_attention_planned(
        q, q_stride, k_cache, v_cache, block_table, table_stride, seq_lens, B, H, Hkv, D,
        page_size, scale, window, softcap, out, is_bf16, num_threads, num_threads);
}

/* The same on a team of `num_threads`, the items (whole requests or split-K ranges: what is
 * summed in which order) chosen for `plan_threads` whatever the team's size, so that any team
 * gives the same bits. */
int asyncengine_paged_decode_attention_planned(
    const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
    const int32_t *block_table, int64_t table_stride, const int32_t *seq_lens, int64_t B,
    int64_t H, int64_t Hkv, int64_t D, int64_t page_size, float scale, int64_t window,
    float softcap, void *out, int is_bf16, int num_threads, int plan_threads) {
    if (plan_threads < 1) plan_threads = 1;
    if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAX_GROUP || D % 32 != 0 || D > MAX_HEAD_DIM ||
        (KV_IS_F16 && is_bf16))
        return -1;
    const fast_item_fn fast = fast_item(is_bf16, H / Hkv, D);
#ifdef __AVX512F__
    if (fast != NULL && B >= 4 * plan_threads) {
        /* Whole requests, thread t taking t, t + T, ...: while one request computes (its heads
         * in turn), the thread streams the rows of its next request into L2, spread over the
         * key blocks; its first request is cold and prefetches its own rows ahead instead. */
#pragma omp parallel num_threads(num_threads)
        {
            const int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
            for (int64_t b = t; b < B; b += T) {
                const int first = first_key(seq_lens[b], window);
                const int64_t nb = b + T, blocks = (seq_lens[b] - first + 15) / 16;
                l2_stream st = {NULL, 0, 0, 0};
                if (nb < B) {
                    st.table_row = block_table + nb * table_stride;
                    st.len = seq_lens[nb];
                    st.next = first_key(seq_lens[nb], window);
                    st.per_block = (st.len - st.next + Hkv * blocks - 1) / (Hkv * blocks);
                }
                for (int64_t kvh = 0; kvh < Hkv; kvh++)
                    fast(q, q_stride, k_cache, v_cache, block_table + b * table_stride, first,
                         seq_lens[b], b, kvh, H, Hkv, page_size, scale, softcap, out, b == t, &st,
                         NULL);
            }
        }
        return 0;
    }
#endif
#ifdef ATTN_STREAM
    if (fast == NULL && (!is_bf16 || KV_IS_I8) && stream_fits(H / Hkv, D) &&
        H <= ATTN_MAX_HEADS && B >= 4 * plan_threads) {
        /* Whole requests, all their kv heads in one streamed range: a slot's rows of every kv
         * head are read in the pool's order, and the query's rounding and the range's set-up
         * are paid once a request, not once a kv head. The same keys in the same blocks per
         * head, so the same bits as the (request, kv head) items below. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
        for (int64_t b = 0; b < B; b++) {
            float state[ATTN_PART(ATTN_MAX_HEADS, MAX_HEAD_DIM)];
            float widened[ATTN_MAX_HEADS * MAX_HEAD_DIM];
            const float *qh = (const float *)q + b * q_stride;
            if (is_bf16) { /* an int8 pool beside bfloat16 queries: widened once per request */
                const uint16_t *qb = (const uint16_t *)q + b * q_stride;
                for (int64_t i = 0; i < H * D; i += 16)
                    _mm512_storeu_ps(widened + i, load_bf16x16(qb + i));
                qh = widened;
            }
            const int len = seq_lens[b];
            attend_range(qh, Hkv, H / Hkv, (const kv_t *)k_cache, (const kv_t *)v_cache,
                         block_table + b * table_stride, first_key(len, window), len, len,
                         page_size, 0, Hkv, D, scale, softcap, NULL, NULL, state,
                         state + H * D, state + H * D + H);
            for (int64_t h = 0; h < H; h++) {
                const float l = state[H * D + H + h], inv = l > 0.0f ? 1.0f / l : 0.0f;
                store_row(out, (b * H + h) * D, state + h * D, inv, D, is_bf16);
            }
        }
        return 0;
    }
#endif
    /* split-K where the (request, kv head) items are too few for the threads: each item's keys
     * in ranges (cpu_split_k.h), merged by the range that finishes last */
    int longest = 0;
    for (int64_t b = 0; b < B; b++) {
        const int keys = seq_lens[b] - first_key(seq_lens[b], window);
        longest = keys > longest ? keys : longest;
    }
    const int64_t splits = split_count(B * Hkv, longest, plan_threads);
    const int64_t G = H / Hkv, stride = ATTN_PART(G, D);
    float *parts = NULL;
    atomic_int *done = NULL;
    if (splits > 1) {
        parts = (float *)malloc((size_t)(B * Hkv * splits * stride) * sizeof(float));
        done = (atomic_int *)malloc((size_t)(B * Hkv) * sizeof(atomic_int));
        if (parts == NULL || done == NULL) {
            free(parts);
            free((void *)done);
            return -1;
        }
        for (int64_t u = 0; u < B * Hkv; u++) atomic_init(&done[u], 0);
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < B * Hkv * splits; item++) {
        const int64_t unit = item / splits, split = item % splits;
        const int64_t b = unit / Hkv, kvh = unit % Hkv;
        const int len = seq_lens[b], start = first_key(len, window);
        const int first = start + (int)((int64_t)(len - start) * split / splits);
        const int end = start + (int)((int64_t)(len - start) * (split + 1) / splits);
        float *part = splits > 1 ? parts + item * stride : NULL;
#ifdef __AVX512F__
        if (fast != NULL) {
            l2_stream none = {NULL, 0, 0, 0};
            fast(q, q_stride, k_cache, v_cache, block_table + b * table_stride, first, end, b, kvh,
                 H, Hkv, page_size, scale, softcap, out, 1, &none, part);
        } else
#endif
#ifdef ATTN_STREAM
        if ((!is_bf16 || KV_IS_I8) && stream_fits(G, D)) {
            float own[ATTN_PART(MAX_GROUP, MAX_HEAD_DIM)];
            float *state = part != NULL ? part : own;
            float widened[MAX_GROUP * MAX_HEAD_DIM];
            const float *qh = (const float *)q + b * q_stride + kvh * G * D;
            if (is_bf16) { /* an int8 pool beside bfloat16 queries: widened once per item */
                const uint16_t *qb = (const uint16_t *)q + b * q_stride + kvh * G * D;
                for (int64_t i = 0; i < G * D; i += 16)
                    _mm512_storeu_ps(widened + i, load_bf16x16(qb + i));
                qh = widened;
            }
            attend_range(qh, 1, G, (const kv_t *)k_cache, (const kv_t *)v_cache,
                         block_table + b * table_stride, first, end, len, page_size, kvh, Hkv, D,
                         scale, softcap, NULL, NULL, state, state + G * D, state + G * D + G);
            if (part == NULL)
                for (int64_t g = 0; g < G; g++) {
                    const float l = state[G * D + G + g], inv = l > 0.0f ? 1.0f / l : 0.0f;
                    const int64_t off = (b * H + kvh * G + g) * D;
                    store_row(out, off, state + g * D, inv, D, is_bf16);
                }
        } else
#endif
            decode_item(q, q_stride, k_cache, v_cache, block_table + b * table_stride, first, end,
                        b, kvh, H, Hkv, D, page_size, scale, softcap, out, is_bf16, part);
        /* release: this range's state is written; acquire: the last range sees the others' */
        if (part != NULL &&
            atomic_fetch_add_explicit(&done[unit], 1, memory_order_acq_rel) + 1 == splits) {
            float merged[MAX_GROUP * MAX_HEAD_DIM];
            merge_ranges(parts + unit * splits * stride, splits, G, D, merged);
            const int64_t off = (b * H + kvh * G) * D;
            for (int64_t i = 0; i < G * D; i++) {
                if (is_bf16)
                    ((uint16_t *)out)[off + i] = float_to_bf16(merged[i]);
                else
                    ((float *)out)[off + i] = merged[i];
            }
        }
    }
    free(parts);
    free((void *)done);
    return 0;
}
