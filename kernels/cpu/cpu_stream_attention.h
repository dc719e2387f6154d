/* Decode attention over a range of a row's keys, streamed at memory speed on AVX-512 (the fused
 * step's attend_range takes it for head dims that are a multiple of 16: cpu_group_attention.h).
 *
 * A block of 16 keys is read once for all the query heads of its kv head: each key row is
 * loaded and widened once (bfloat16, float16, int8 or float32 pool: KV_LOAD16), then every
 * head's partial dot product is one vector, and one transposing reduction (reduce16) turns a
 * head's 16 vectors into its 16 scores. The online softmax works on those 16 lanes at once:
 * one max and one vector exp per head a block, the running sum kept per lane (summed once at
 * the end) so that no horizontal add sits on the chain between blocks. The values are summed
 * with each value row widened once for all heads, the accumulators in registers across the
 * block. An int8 pool's row scales multiply the 16 scores (K) and the 16 weights (V) as vectors.
 * (vdpbf16ps dot products on the bfloat16 rows as they are, the float32 query split in a
 * bfloat16 hi + lo to stay exact, were ~10% slower here than widening each row once for all
 * heads: twice the instructions.)
 */
#ifndef ASYNCENGINE_CPU_STREAM_ATTENTION_H
#define ASYNCENGINE_CPU_STREAM_ATTENTION_H

#include <math.h>
#include <stdint.h>

#include "cpu_kv.h"
#include "cpu_simd.h"

#if defined(__AVX512F__) && defined(KV_LOAD16)
#define ATTN_STREAM 1
#define STREAM_KEYS 16
#define STREAM_MAX_GROUP 8

/* One head's online softmax over a block: where the block's max exceeds the running max, what
 * was summed so far (lsum and the head's nchunks 16-float chunks of acc) is rescaled; returns
 * exp(s - max), 0 past the valid keys, already added into lsum. */
static inline __attribute__((always_inline)) __m512 stream_softmax_block(const __m512 sc,
                                                                         const __mmask16 valid,
                                                                         float *acc,
                                                                         const int nchunks,
                                                                         float *mx, __m512 *lsum) {
    const float block_max = _mm512_reduce_max_ps(sc);
    if (block_max > *mx) {
        if (*mx > -INFINITY) {
            const __m512 rv = _mm512_set1_ps(expf(*mx - block_max));
            *lsum = _mm512_mul_ps(*lsum, rv);
            for (int j = 0; j < nchunks; j++)
                _mm512_storeu_ps(acc + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * j), rv));
        }
        *mx = block_max;
    }
    const __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(*mx))));
    *lsum = _mm512_add_ps(*lsum, e);
    return e;
}

/* The g heads' (G of them, head dim 16 NV) state after the block's n <= 16 keys, given their
 * scaled scores sc[g] (16 lanes, -inf past n) and value rows v[i]: the online softmax's max and
 * per-lane sums, then acc += exp(s - mx) v (an int8 pool's value scales taken into the weights,
 * once a key). */
static inline __attribute__((always_inline)) void stream_values(const int G, const int NV,
                                                                const __m512 *sc,
                                                                const kv_t *const *v, int n,
                                                                float *acc, float *mx,
                                                                __m512 *lsum) {
    const int64_t d = 16 * NV;
    const __mmask16 valid = n >= STREAM_KEYS ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
#if KV_IS_I8
    float vs[STREAM_KEYS] = {0};
    for (int i = 0; i < n; i++) vs[i] = kv_row_scale(v[i], d);
    const __m512 vscale = _mm512_loadu_ps(vs);
#endif
    float p[STREAM_MAX_GROUP][STREAM_KEYS] __attribute__((aligned(64)));
    for (int g = 0; g < G; g++) {
        __m512 e = stream_softmax_block(sc[g], valid, acc + g * d, NV, &mx[g], &lsum[g]);
#if KV_IS_I8
        e = _mm512_mul_ps(e, vscale);
#endif
        _mm512_store_ps(p[g], e);
    }
    if (G * NV <= 16) { /* every accumulator in registers across the block's keys */
        __m512 a[16];
        for (int g = 0; g < G; g++)
            for (int j = 0; j < NV; j++) a[g * NV + j] = _mm512_loadu_ps(acc + g * d + 16 * j);
        for (int i = 0; i < n; i++) {
            __m512 vr[16];
            for (int j = 0; j < NV; j++) vr[j] = KV_LOAD16(v[i] + 16 * j);
            for (int g = 0; g < G; g++) {
                const __m512 pv = _mm512_set1_ps(p[g][i]);
                for (int j = 0; j < NV; j++) a[g * NV + j] = _mm512_fmadd_ps(pv, vr[j], a[g * NV + j]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int j = 0; j < NV; j++) _mm512_storeu_ps(acc + g * d + 16 * j, a[g * NV + j]);
        return;
    }
    for (int j = 0; j < NV; j++) { /* a 16-float chunk of every head's accumulator at a time */
        __m512 a[STREAM_MAX_GROUP];
        for (int g = 0; g < G; g++) a[g] = _mm512_loadu_ps(acc + g * d + 16 * j);
        for (int i = 0; i < n; i++) {
            const __m512 vr = KV_LOAD16(v[i] + 16 * j);
            for (int g = 0; g < G; g++) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g][i]), vr, a[g]);
        }
        for (int g = 0; g < G; g++) _mm512_storeu_ps(acc + g * d + 16 * j, a[g]);
    }
}

/* The g heads' (G of them, q [G, 16 NV]) state after n <= 16 more keys, rows k[i] / v[i]: acc
 * [G, 16 NV] the unnormalized sum of exp(s - mx) v, mx per head, lsum per head and lane. The
 * scaled scores s become softcap * tanh(s / softcap) where softcap > 0 (Gemma 2). */
static inline __attribute__((always_inline)) void stream_keys(const float *q, const int G,
                                                              const int NV,
                                                              const kv_t *const *k,
                                                              const kv_t *const *v, int n,
                                                              float scale, float softcap,
                                                              float *acc, float *mx,
                                                              __m512 *lsum) {
    const int64_t d = 16 * NV;
    __m512 part[STREAM_MAX_GROUP][STREAM_KEYS];
    for (int i = 0; i < STREAM_KEYS; i++) {
        if (i >= n) {
            for (int g = 0; g < G; g++) part[g][i] = _mm512_setzero_ps();
            continue;
        }
        __m512 kr[16];
        for (int j = 0; j < NV; j++) kr[j] = KV_LOAD16(k[i] + 16 * j);
        for (int g = 0; g < G; g++) {
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q + g * d), kr[0]);
            for (int j = 1; j < NV; j++) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * d + 16 * j), kr[j], a);
            part[g][i] = a;
        }
    }
    const __mmask16 valid = n >= STREAM_KEYS ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    __m512 kscale = _mm512_set1_ps(scale);
#if KV_IS_I8
    float ks[STREAM_KEYS] = {0};
    for (int i = 0; i < n; i++) ks[i] = kv_row_scale(k[i], d);
    kscale = _mm512_mul_ps(_mm512_loadu_ps(ks), kscale);
#endif
    __m512 sc[STREAM_MAX_GROUP];
    for (int g = 0; g < G; g++) {
        __m512 s = _mm512_mul_ps(reduce16(part[g]), kscale);
        if (softcap > 0.0f) s = soft_cap512(s, softcap);
        sc[g] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s);
    }
    stream_values(G, NV, sc, v, n, acc, mx, lsum);
}

typedef void (*stream_fn)(const float *, const kv_t *const *, const kv_t *const *, int, float,
                          float, float *, float *, __m512 *);

/* stream_keys for constant (G, NV): the loops unrolled, the accumulators in registers */
#define DEFINE_STREAM(G, NV)                                                                     \
    static void stream_##G##_##NV(const float *q, const kv_t *const *k, const kv_t *const *v,   \
                                  int n, float scale, float softcap, float *acc, float *mx,     \
                                  __m512 *lsum) {                                                \
        stream_keys(q, G, NV, k, v, n, scale, softcap, acc, mx, lsum);                           \
    }
#define DEFINE_STREAM_GROUPS(NV)                                                                 \
    DEFINE_STREAM(1, NV) DEFINE_STREAM(2, NV) DEFINE_STREAM(3, NV) DEFINE_STREAM(4, NV)          \
    DEFINE_STREAM(5, NV) DEFINE_STREAM(6, NV) DEFINE_STREAM(7, NV) DEFINE_STREAM(8, NV)
DEFINE_STREAM_GROUPS(2)
DEFINE_STREAM_GROUPS(4)
DEFINE_STREAM_GROUPS(8)
#define STREAM_TABLE(NV)                                                                         \
    {stream_1_##NV, stream_2_##NV, stream_3_##NV, stream_4_##NV,                                 \
     stream_5_##NV, stream_6_##NV, stream_7_##NV, stream_8_##NV}
static const stream_fn STREAM_32[8] = STREAM_TABLE(2);
static const stream_fn STREAM_64[8] = STREAM_TABLE(4);
static const stream_fn STREAM_128[8] = STREAM_TABLE(8);

/* any other head dim (a multiple of 16, up to 256): the same steps, not unrolled */
static void stream_any(const float *q, int G, int NV, const kv_t *const *k, const kv_t *const *v,
                       int n, float scale, float softcap, float *acc, float *mx, __m512 *lsum) {
    stream_keys(q, G, NV, k, v, n, scale, softcap, acc, mx, lsum);
}

/* Whether stream_range takes gc heads of dim d */
static inline int stream_fits(int64_t gc, int64_t d) {
    return gc >= 1 && gc <= STREAM_MAX_GROUP && d % 16 == 0 && d >= 16 && d <= 256;
}

/* stream_keys of gc heads of dim d (stream_fits), through the unrolled copy where there is one */
static inline void stream_block(const float *q, int64_t gc, int64_t d, const kv_t *const *k,
                                const kv_t *const *v, int n, float scale, float softcap,
                                float *acc, float *mx, __m512 *lsum) {
    const stream_fn *table = d == 64 ? STREAM_64 : d == 128 ? STREAM_128 : d == 32 ? STREAM_32 : NULL;
    if (table != NULL)
        table[gc - 1](q, k, v, n, scale, softcap, acc, mx, lsum);
    else
        stream_any(q, (int)gc, (int)(d / 16), k, v, n, scale, softcap, acc, mx, lsum);
}
#endif

#endif
