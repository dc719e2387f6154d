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
 * One work item is (request, kv head): its G = H / Hkv query heads share each key and value
 * read. Keys are taken in blocks of BLOCK tokens with an online softmax (running max and sum
 * per query head, the accumulator rescaled when the max grows), so no buffer grows with the
 * context. Items run in parallel under OpenMP; loaded after torch, this library shares torch's
 * OpenMP runtime (same soname), so the two thread pools are one.
 *
 * Built by asyncengine/kernels/cpu_native.py with gcc -O3 -march=native; the AVX-512 paths are
 * used where the compiler targets them (AVX512F for float32, AVX512BF16 for bfloat16 dot
 * products), a portable loop otherwise.
 */
#include <omp.h>

#include "cpu_simd.h"

#define BLOCK 32
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

int asyncengine_cpu_attention_features(void) {
    int flags = 0;
#ifdef __AVX512F__
    flags |= 1;
#endif
#ifdef __AVX512BF16__
    flags |= 2;
#endif
    return flags;
}

/* exp of n floats in place (n <= BLOCK) */
static inline void exp_block(float *s, int n) {
#ifdef __AVX512F__
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = (n - i >= 16) ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        __m512 x = _mm512_maskz_loadu_ps(m, s + i);
        _mm512_mask_storeu_ps(s + i, m, exp512(x));
    }
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
#else
    (void)qb;
    float acc = 0.0f;
    for (int i = 0; i < d; i++) acc += qf[i] * bf16_to_float(k[i]);
    return acc;
#endif
}

static inline float dot_f32(const float *q, const float *k, int d) {
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), acc);
    return _mm512_reduce_add_ps(acc);
#else
    float acc = 0.0f;
    for (int i = 0; i < d; i++) acc += q[i] * k[i];
    return acc;
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
#else
    for (int i = 0; i < d; i++) acc[i] += p * bf16_to_float(v[i]);
#endif
}

static inline void axpy_f32(float *acc, float p, const float *v, int d) {
#ifdef __AVX512F__
    __m512 pv = _mm512_set1_ps(p);
    for (int i = 0; i < d; i += 16)
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + i), _mm512_loadu_ps(acc + i)));
#else
    for (int i = 0; i < d; i++) acc[i] += p * v[i];
#endif
}

static inline void scale_f32(float *acc, float c, int d) {
    for (int i = 0; i < d; i++) acc[i] *= c;
}

/* One (request, kv head) item. is_bf16 selects the element type of q, caches and out. */
static void decode_item(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                        const int32_t *table_row, int len, int64_t b, int64_t kvh, int64_t H,
                        int64_t Hkv, int64_t D, int64_t page_size, float scale, void *out,
                        int is_bf16) {
    const int64_t G = H / Hkv;
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
    for (int t0 = 0; t0 < len; t0 += BLOCK) {
        const int n = (len - t0 < BLOCK) ? (len - t0) : BLOCK;
        for (int i = 0; i < n; i++) {
            const int64_t pos = t0 + i;
            slots[i] = (int64_t)table_row[pos / page_size] * page_size + pos % page_size;
        }
        for (int i = 0; i < n; i++) {
            const int64_t row = (slots[i] * Hkv + kvh) * D;
            for (int64_t g = 0; g < G; g++) {
                float dot = is_bf16 ? dot_bf16(qb[g], qf[g], (const uint16_t *)k_cache + row, (int)D)
                                    : dot_f32(qf[g], (const float *)k_cache + row, (int)D);
                s[g][i] = dot * scale;
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
            const int64_t row = (slots[i] * Hkv + kvh) * D;
            for (int64_t g = 0; g < G; g++) {
                if (is_bf16)
                    axpy_bf16(acc[g], s[g][i], (const uint16_t *)v_cache + row, (int)D);
                else
                    axpy_f32(acc[g], s[g][i], (const float *)v_cache + row, (int)D);
            }
        }
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

/* Returns 0, or -1 when the shapes are outside what this kernel handles (the caller then uses
 * the torch path): H a multiple of Hkv, H / Hkv <= MAX_GROUP, D a multiple of 32, <= 256. */
int asyncengine_paged_decode_attention(const void *q, int64_t q_stride, const void *k_cache,
                                       const void *v_cache,
                                       const int32_t *block_table, int64_t table_stride,
                                       const int32_t *seq_lens, int64_t B, int64_t H, int64_t Hkv,
                                       int64_t D, int64_t page_size, float scale, void *out,
                                       int is_bf16, int num_threads) {
    if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAX_GROUP || D % 32 != 0 || D > MAX_HEAD_DIM)
        return -1;
    const int64_t items = B * Hkv;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < items; item++) {
        const int64_t b = item / Hkv, kvh = item % Hkv;
        decode_item(q, q_stride, k_cache, v_cache, block_table + b * table_stride, seq_lens[b], b, kvh, H,
                    Hkv, D, page_size, scale, out, is_bf16);
    }
    return 0;
}
