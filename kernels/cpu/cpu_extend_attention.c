/* Paged extend (prefill) attention on the CPU: queries ragged by cu_seqlens_q [B+1] (q
 * [N, H, D], rows q_stride elements apart); query i of request b sits at position
 * seq_lens[b] - q_len_b + i and attends keys 0 .. that position (its cached prefix and the
 * new tokens, all in the pool already). out [N, H, D] contiguous.
 *
 * One work item is (request, kv head, block of QB queries): its G * QB query rows share every
 * key block. Per block of 16 keys the keys are transposed once into (pairs of) columns, so a
 * row's 16 scores are D/2 AVX512-BF16 dot products (D fused multiply-adds in float32) with no
 * horizontal sums; values are converted to float32 once per block, and each row accumulates
 * 16 values into its output held in registers. Online softmax (running max and sum per row). Head dims 64 and
 * 128, and 256 (Gemma 2/3; its outputs spill registers) (others: -1, the torch path).
 *
 * Sliding window (window > 0): a query at position p sees keys p - window + 1 .. p only; key
 * blocks below every row's window are skipped. Soft-capping (softcap > 0): scaled scores s
 * become softcap * tanh(s / softcap) before the softmax (Gemma 2). Either keeps each row's
 * reduction in absolute key-block order, so a row's output still depends on its query and keys
 * alone (deterministic mode relies on it).
 *
 * Built by kernels/cpu/cpu_native.py with gcc -O3 -march=native: AVX512-BF16 dot
 * products where the CPU has them, bfloat16 queries over a bfloat16 or int8 pool then taking the
 * items of cpu_extend_bf16.h (rows in lanes, both products bf16 dot products); on AVX2 + FMA CPUs
 * without AVX-512, the items of cpu_extend_avx2.h (float32 arithmetic, scores transposed);
 * elsewhere -1 (the torch path).
 * Built with -DKV_F16 (cpu_kv.h): a float16 pool, q / out float32 (is_bf16 must be 0), its keys
 * and values widened to float32 once per block as they are gathered; -DKV_I8 likewise for an
 * int8 pool (each row times its scale as it is widened), beside float32 or bfloat16 q / out:
 * with bfloat16 queries and AVX512-BF16, the bf16 items over key and value rows dequantized to
 * bfloat16 once per block; without AVX512-BF16 each dequantized key row is rounded to bfloat16
 * pairs for the scores' pair dots (the values stay float32).
 */
#include <omp.h>
#include <stdlib.h>

#include "cpu_kv.h"
#include "cpu_paged.h"
#include "cpu_simd.h"
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define EXTEND_AVX2 1
#include "cpu_extend_avx2.h"
#endif
#if defined(__AVX512BF16__) && !KV_IS_F16
#define EXTEND_BF16 1
#include "cpu_extend_bf16.h"
#endif

#define MAX_GROUP 16

int asyncengine_extend_attention_features(void) {
    int flags = 0;
#ifdef __AVX512F__
    flags |= 1;
#endif
#ifdef __AVX512BF16__
    flags |= 2;
#endif
#ifdef EXTEND_AVX2
    flags |= 4;
#endif
    return flags;
}

#define QB 16
#define KB 16

typedef struct {
    int64_t b, kvh, q0;
} extend_item;

#ifdef __AVX512F__

#define TILE 4
#define MAX_ROWS (MAX_GROUP * QB)

/* One item with head dim D = 16 * NV. Query rows are taken TILE at a time: a key column (or
 * column pair) loaded once serves the TILE rows' scores, a value row loaded once serves their
 * outputs, which stay in registers across the block's keys. */
#define DEFINE_EXTEND_ITEM(NV)                                                                   \
    static void extend_item_##NV(const void *q, int64_t q_stride, const void *kc, const void *vc, \
                                 const int32_t *table_row, int64_t q_start, int64_t q_len,        \
                                 int64_t kv_len, extend_item it, int64_t H, int64_t Hkv,          \
                                 int64_t page_size, float scale, int64_t window, float softcap,   \
                                 void *out, int bf16) {                                           \
        const int64_t D = 16 * (NV), G = H / Hkv;                                                \
        const int64_t nq = (q_len - it.q0 < QB) ? (q_len - it.q0) : QB;                          \
        const int64_t rows = G * nq, padded = (rows + TILE - 1) / TILE * TILE;                   \
        const int64_t pos0 = kv_len - q_len + it.q0;                                             \
        static __thread uint32_t qp_[MAX_ROWS][8 * (NV)] __attribute__((aligned(64)));           \
        static __thread float qf_[MAX_ROWS][16 * (NV)] __attribute__((aligned(64)));             \
        static __thread float o_[MAX_ROWS][16 * (NV)] __attribute__((aligned(64)));              \
        static __thread uint32_t kt2_[8 * (NV)][KB] __attribute__((aligned(64)));                \
        static __thread float kt_[16 * (NV)][KB] __attribute__((aligned(64)));                   \
        static __thread float vf_[KB][16 * (NV)] __attribute__((aligned(64)));                   \
        /* the thread-locals' addresses once, made opaque: re-derived at each use they cost a    \
         * TLS look-up call in a shared library */                                              \
        uint32_t(*qp)[8 * (NV)] = qp_, (*kt2)[KB] = kt2_;                                       \
        float(*qf)[16 * (NV)] = qf_, (*o)[16 * (NV)] = o_, (*kt)[KB] = kt_, (*vf)[16 * (NV)] = vf_; \
        __asm__("" : "+r"(qp), "+r"(kt2), "+r"(qf), "+r"(o), "+r"(kt), "+r"(vf));             \
        float m[MAX_ROWS], l[MAX_ROWS];                                                          \
        int64_t qpos[MAX_ROWS], qlo[MAX_ROWS]; /* a row's first and last visible key */         \
        for (int64_t r = 0; r < padded; r++) {                                                   \
            const int64_t g = r / nq, i = r % nq;                                                \
            m[r] = -INFINITY;                                                                    \
            l[r] = 0.0f;                                                                         \
            memset(o[r], 0, sizeof o[r]);                                                        \
            if (r >= rows) { /* padding rows: zero queries, never stored */                      \
                memset(qp[r], 0, sizeof qp[r]);                                                  \
                memset(qf[r], 0, sizeof qf[r]);                                                  \
                qpos[r] = -1;                                                                    \
                qlo[r] = INT64_MAX;                                                              \
                continue;                                                                        \
            }                                                                                    \
            qpos[r] = pos0 + i;                                                                  \
            qlo[r] = (window > 0 && qpos[r] - window + 1 > 0) ? qpos[r] - window + 1 : 0;        \
            const int64_t off = (q_start + it.q0 + i) * q_stride + (it.kvh * G + g) * D;          \
            if (bf16)                                                                            \
                memcpy(qp[r], (const uint16_t *)q + off, (size_t)D * 2);                         \
            else                                                                                 \
                memcpy(qf[r], (const float *)q + off, (size_t)D * 4);                            \
        }                                                                                        \
        /* a tile's rows can mix query heads (r = g * nq + i), so its last position is not      \
         * that of its last row: take the max over the tile */                                 \
        int64_t tile_last[MAX_ROWS / TILE + 1], tile_first[MAX_ROWS / TILE + 1];                 \
        for (int64_t r0 = 0; r0 < padded; r0 += TILE) {                                          \
            int64_t last = qpos[r0], first = qlo[r0];                                            \
            for (int t = 1; t < TILE; t++) {                                                     \
                if (qpos[r0 + t] > last) last = qpos[r0 + t];                                    \
                if (qlo[r0 + t] < first) first = qlo[r0 + t];                                    \
            }                                                                                    \
            tile_last[r0 / TILE] = last;                                                         \
            tile_first[r0 / TILE] = first;                                                       \
        }                                                                                        \
        const int64_t last_key = pos0 + nq - 1;                                                  \
        const int64_t first_block = (window > 0 && pos0 - window + 1 > 0) ? (pos0 - window + 1) / KB * KB : 0; \
        const __m512 cap = _mm512_set1_ps(softcap), inv_cap = _mm512_set1_ps(softcap > 0.0f ? 1.0f / softcap : 0.0f); \
        int64_t slot_rows[KB];                                                                   \
        for (int64_t k0 = first_block; k0 <= last_key; k0 += KB) {                               \
            const int64_t nk = (last_key + 1 - k0 < KB) ? (last_key + 1 - k0) : KB;              \
            for (int64_t k = 0; k < nk; k++)                                                     \
                slot_rows[k] = (pool_slot(table_row, k0 + k, page_size) * Hkv + it.kvh) * KV_ROW(D); \
            for (int64_t k = 0; k < KB; k++) {                                                   \
                if (k >= nk) {                                                                   \
                    for (int64_t d = 0; d < 8 * (NV); d++) kt2[d][k] = 0;                        \
                    for (int64_t d = 0; d < D; d++) kt[d][k] = 0.0f;                             \
                    memset(vf[k], 0, sizeof vf[k]);                                              \
                } else if (bf16 && KV_IS_I8) {                                                   \
                    i8_key_pairs((const kv_t *)kc + slot_rows[k], NV, kt2, k);                   \
                    kv_load_row(vf[k], (const kv_t *)vc + slot_rows[k], D);                      \
                } else if (bf16) {                                                               \
                    const uint32_t *kr = (const uint32_t *)((const uint16_t *)kc + slot_rows[k]); \
                    for (int64_t d = 0; d < 8 * (NV); d++) kt2[d][k] = kr[d];                    \
                    for (int64_t j = 0; j < (NV); j++)                                           \
                        _mm512_store_ps(vf[k] + 16 * j,                                          \
                                        load_bf16x16((const uint16_t *)vc + slot_rows[k] + 16 * j)); \
                } else {                                                                         \
                    const kv_t *kr = (const kv_t *)kc + slot_rows[k];                            \
                    const float ks = kv_row_scale(kr, D);                                        \
                    for (int64_t d = 0; d < D; d++) kt[d][k] = kv_to_float(kr[d]) * ks;          \
                    kv_load_row(vf[k], (const kv_t *)vc + slot_rows[k], D);                      \
                }                                                                                \
            }                                                                                    \
            for (int64_t r0 = 0; r0 < padded; r0 += TILE) {                                      \
                if (k0 > tile_last[r0 / TILE]) continue; /* the block is past every row */      \
                if (k0 + nk <= tile_first[r0 / TILE]) continue; /* before every row's window */  \
                __m512 sc[TILE];                                                                 \
                for (int t = 0; t < TILE; t++) sc[t] = _mm512_setzero_ps();                      \
                if (bf16) {                                                                      \
                    for (int64_t d2 = 0; d2 < 8 * (NV); d2++) {                                  \
                        const __m512i w = _mm512_load_si512((const void *)kt2[d2]);              \
                        for (int t = 0; t < TILE; t++)                                           \
                            sc[t] = PAIR_DOT(sc[t], qp[r0 + t][d2], w);                          \
                    }                                                                            \
                } else {                                                                         \
                    for (int64_t d = 0; d < D; d++) {                                            \
                        const __m512 w = _mm512_load_ps(kt[d]);                                  \
                        for (int t = 0; t < TILE; t++)                                           \
                            sc[t] = _mm512_fmadd_ps(_mm512_set1_ps(qf[r0 + t][d]), w, sc[t]);     \
                    }                                                                            \
                }                                                                                \
                float pk[TILE][KB] __attribute__((aligned(64)));                                 \
                float corr[TILE];                                                                \
                int64_t visible_max = 0;                                                         \
                for (int t = 0; t < TILE; t++) {                                                 \
                    const int64_t r = r0 + t;                                                    \
                    int64_t visible = qpos[r] - k0 + 1;                                          \
                    visible = visible < 0 ? 0 : (visible > nk ? nk : visible);                   \
                    if (visible > visible_max) visible_max = visible;                            \
                    int64_t hidden = qlo[r] - k0; /* keys of the block below the row's window */ \
                    hidden = hidden < 0 ? 0 : (hidden > KB ? KB : hidden);                       \
                    const __mmask16 mask = (__mmask16)(((visible >= 16) ? 0xffffu : ((1u << visible) - 1u)) \
                                                       & ~((hidden >= 16) ? 0xffffu : ((1u << hidden) - 1u))); \
                    __m512 scaled = _mm512_mul_ps(sc[t], _mm512_set1_ps(scale));                 \
                    if (softcap > 0.0f)                                                          \
                        scaled = _mm512_mul_ps(cap, tanh512(_mm512_mul_ps(scaled, inv_cap)));    \
                    __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mask, scaled);      \
                    const float block_max = mask ? _mm512_reduce_max_ps(s) : -INFINITY;          \
                    const float new_max = block_max > m[r] ? block_max : m[r];                   \
                    if (new_max == -INFINITY) { /* nothing visible yet */                        \
                        corr[t] = 1.0f;                                                          \
                        _mm512_store_ps(pk[t], _mm512_setzero_ps());                             \
                        continue;                                                                \
                    }                                                                            \
                    corr[t] = expf(m[r] - new_max);                                              \
                    const __m512 e = _mm512_maskz_mov_ps(                                        \
                        mask, exp512(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));                \
                    l[r] = l[r] * corr[t] + _mm512_reduce_add_ps(e);                             \
                    m[r] = new_max;                                                              \
                    _mm512_store_ps(pk[t], e);                                                   \
                }                                                                                \
                __m512 acc[TILE][NV];                                                            \
                for (int t = 0; t < TILE; t++) {                                                 \
                    const __m512 cv = _mm512_set1_ps(corr[t]);                                   \
                    for (int j = 0; j < (NV); j++)                                               \
                        acc[t][j] = _mm512_mul_ps(_mm512_load_ps(o[r0 + t] + 16 * j), cv);       \
                }                                                                                \
                for (int64_t k = 0; k < visible_max; k++) {                                      \
                    __m512 v[NV];                                                                \
                    for (int j = 0; j < (NV); j++) v[j] = _mm512_load_ps(vf[k] + 16 * j);        \
                    for (int t = 0; t < TILE; t++) {                                             \
                        const __m512 pv = _mm512_set1_ps(pk[t][k]);                              \
                        for (int j = 0; j < (NV); j++) acc[t][j] = _mm512_fmadd_ps(pv, v[j], acc[t][j]); \
                    }                                                                            \
                }                                                                                \
                for (int t = 0; t < TILE; t++)                                                   \
                    for (int j = 0; j < (NV); j++) _mm512_store_ps(o[r0 + t] + 16 * j, acc[t][j]); \
            }                                                                                    \
        }                                                                                        \
        for (int64_t r = 0; r < rows; r++) {                                                     \
            const int64_t g = r / nq, i = r % nq;                                                \
            const __m512 inv = _mm512_set1_ps(l[r] > 0.0f ? 1.0f / l[r] : 0.0f);                 \
            const int64_t off = ((q_start + it.q0 + i) * H + it.kvh * G + g) * D;                \
            for (int j = 0; j < (NV); j++) {                                                     \
                const __m512 v = _mm512_mul_ps(_mm512_load_ps(o[r] + 16 * j), inv);              \
                if (bf16)                                                                        \
                    _mm256_storeu_si256((__m256i *)((uint16_t *)out + off + 16 * j), to_bf16x16(v)); \
                else                                                                             \
                    _mm512_storeu_ps((float *)out + off + 16 * j, v);                            \
            }                                                                                    \
        }                                                                                        \
    }

/* An int8 key row (its scale after its 16 NV values) -> column k of kt2 [8 NV][KB]: the
 * dequantized values rounded to bfloat16, two dims a pair (as a bfloat16 pool's row reads) */
static inline void i8_key_pairs(const kv_t *row, int nv, uint32_t (*kt2)[KB], int64_t k) {
    const __m512 ks = _mm512_set1_ps(kv_row_scale(row, 16 * nv));
    uint32_t pairs[8 * 16] __attribute__((aligned(64)));
    for (int j = 0; j < nv; j++)
        _mm256_store_si256((__m256i *)(pairs + 8 * j), to_bf16x16(_mm512_mul_ps(KV_LOAD16(row + 16 * j), ks)));
    for (int d2 = 0; d2 < 8 * nv; d2++) kt2[d2][k] = pairs[d2];
}

/* acc + (q pair as bf16) . (16 key pairs); without AVX512-BF16 the pairs are widened */
#ifdef __AVX512BF16__
#define PAIR_DOT(acc, pair, w) \
    _mm512_dpbf16_ps((acc), (__m512bh)_mm512_set1_epi32((int)(pair)), (__m512bh)(w))
#else
static inline __m512 pair_dot(__m512 acc, uint32_t pair, __m512i w) {
    const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)));
    acc = _mm512_fmadd_ps(_mm512_set1_ps(bf16_to_float((uint16_t)(pair & 0xffffu))), even, acc);
    return _mm512_fmadd_ps(_mm512_set1_ps(bf16_to_float((uint16_t)(pair >> 16))), odd, acc);
}
#define PAIR_DOT(acc, pair, w) pair_dot((acc), (pair), (w))
#endif

DEFINE_EXTEND_ITEM(4)
DEFINE_EXTEND_ITEM(8)
DEFINE_EXTEND_ITEM(16)
#endif

/* Returns 0, or -1 when this build or these shapes are not handled (the caller then takes the
 * torch path): AVX-512 needed, H a multiple of Hkv, H / Hkv <= MAX_GROUP, D a multiple of 32
 * up to MAX_HEAD_DIM. */
int asyncengine_paged_extend_attention(const void *q, int64_t q_stride, const void *k_cache,
                                       const void *v_cache, const int32_t *block_table,
                                       int64_t table_stride, const int32_t *cu_seqlens_q,
                                       const int32_t *seq_lens, int64_t B, int64_t H,
                                       int64_t Hkv, int64_t D, int64_t page_size, float scale,
                                       int64_t window, float softcap, void *out, int is_bf16,
                                       int num_threads) {
#ifdef __AVX512F__
    if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAX_GROUP || (D != 64 && D != 128 && D != 256) ||
        (KV_IS_F16 && is_bf16))
        return -1;
#ifdef EXTEND_BF16
    const int bf16_items = is_bf16 != 0;
    const int64_t per_item = bf16_items ? xb_queries_per_item(H / Hkv) : QB;
#else
    const int bf16_items = 0;
    const int64_t per_item = QB;
#endif
    int64_t count = 0;
    for (int64_t b = 0; b < B; b++)
        count += Hkv * ((cu_seqlens_q[b + 1] - cu_seqlens_q[b] + per_item - 1) / per_item);
    extend_item *items = (extend_item *)malloc((size_t)(count > 0 ? count : 1) * sizeof(extend_item));
    if (items == NULL) return -1;
    int64_t n = 0;
    /* the blocks with the most keys first (the end of each prompt), so the dynamic schedule
     * does not finish on one long item */
    for (int64_t b = 0; b < B; b++) {
        const int64_t q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
        for (int64_t q0 = ((q_len - 1) / per_item) * per_item; q0 >= 0; q0 -= per_item)
            for (int64_t h = 0; h < Hkv; h++) items[n++] = (extend_item){b, h, q0};
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t i = 0; i < count; i++) {
        const extend_item it = items[i];
        const int64_t q_len = cu_seqlens_q[it.b + 1] - cu_seqlens_q[it.b];
#ifdef EXTEND_BF16
        if (bf16_items) {
            const int64_t q_start = cu_seqlens_q[it.b];
            const int64_t nq = (q_len - it.q0 < per_item) ? (q_len - it.q0) : per_item;
            const int64_t row = q_start + it.q0;
            static __thread xb_item scratch __attribute__((aligned(64)));
            xb_item *x = &scratch;
            __asm__("" : "+r"(x)); /* opaque: no clone of the item may re-derive the TLS address */
            extend_item_bf16(x, (const uint16_t *)q + row * q_stride, q_stride,
                             (const xb_pool_t *)k_cache, (const xb_pool_t *)v_cache,
                             block_table + it.b * table_stride, nq, seq_lens[it.b] - q_len + it.q0,
                             it.kvh, H / Hkv, Hkv, D, page_size, scale, window, softcap,
                             (uint16_t *)out + row * H * D, H * D);
            continue;
        }
#endif
        (void)bf16_items;
        if (D == 64)
            extend_item_4(q, q_stride, k_cache, v_cache, block_table + it.b * table_stride,
                          cu_seqlens_q[it.b], q_len, seq_lens[it.b], it, H, Hkv, page_size, scale,
                          window, softcap, out, is_bf16);
        else if (D == 128)
            extend_item_8(q, q_stride, k_cache, v_cache, block_table + it.b * table_stride,
                          cu_seqlens_q[it.b], q_len, seq_lens[it.b], it, H, Hkv, page_size, scale,
                          window, softcap, out, is_bf16);
        else
            extend_item_16(q, q_stride, k_cache, v_cache, block_table + it.b * table_stride,
                           cu_seqlens_q[it.b], q_len, seq_lens[it.b], it, H, Hkv, page_size, scale,
                           window, softcap, out, is_bf16);
    }
    free(items);
    return 0;
#elif defined(EXTEND_AVX2)
    if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAX_GROUP || (D != 64 && D != 128 && D != 256) ||
        (KV_IS_F16 && is_bf16))
        return -1;
    const int64_t G = H / Hkv, per_item = x2_queries_per_item(G);
    int64_t count = 0;
    for (int64_t b = 0; b < B; b++)
        count += Hkv * ((cu_seqlens_q[b + 1] - cu_seqlens_q[b] + per_item - 1) / per_item);
    extend_item *items = (extend_item *)malloc((size_t)(count > 0 ? count : 1) * sizeof(extend_item));
    if (items == NULL) return -1;
    int64_t n = 0;
    for (int64_t b = 0; b < B; b++) { /* the blocks with the most keys first, as above */
        const int64_t q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
        for (int64_t q0 = ((q_len - 1) / per_item) * per_item; q0 >= 0; q0 -= per_item)
            for (int64_t h = 0; h < Hkv; h++) items[n++] = (extend_item){b, h, q0};
    }
    const int64_t elem = is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t i = 0; i < count; i++) {
        const extend_item it = items[i];
        const int64_t q_start = cu_seqlens_q[it.b], q_len = cu_seqlens_q[it.b + 1] - q_start;
        const int64_t nq = (q_len - it.q0 < per_item) ? (q_len - it.q0) : per_item;
        const int64_t row = q_start + it.q0;
        extend_item_avx2((const char *)q + row * q_stride * elem, q_stride, k_cache, v_cache,
                         block_table + it.b * table_stride, nq, seq_lens[it.b] - q_len + it.q0,
                         it.kvh, G, Hkv, D, page_size, scale, window, softcap,
                         (char *)out + row * H * D * elem, H * D, is_bf16);
    }
    free(items);
    return 0;
#else
    (void)q; (void)q_stride; (void)k_cache; (void)v_cache; (void)block_table; (void)table_stride;
    (void)cu_seqlens_q; (void)seq_lens; (void)B; (void)H; (void)Hkv; (void)D; (void)page_size;
    (void)scale; (void)window; (void)softcap; (void)out; (void)is_bf16; (void)num_threads;
    return -1;
#endif
}
