/* LoRA inside the fused decode step (cpu_decode_step.c): after a projection, each row that runs
 * under an adapter gets ``y += B (A x)`` (shrink to the adapter's rank, then expand, the scaling
 * folded into B), on the float32 activations the projection read, so the base weights stay as
 * stored. A [R, in] as cpu_lora.c takes it; B as tiles (``b_tiles``): per slice (out_start,
 * out_end, rank_start, rank_end: a fused q/k/v or gate/up expands each part from its own rank
 * block), in order, ceil((out_end - out_start) / 16) tiles of [rank_end - rank_start][16]
 * (B's 16 outputs by the slice's ranks, zero past out_end), so that a share of outputs reads one
 * contiguous run and sums 16 outputs per load; float32 or bfloat16, float32 sums.
 *
 * A thread expands the outputs of its own share of the projection (the rows its gemv wrote), so
 * no barrier is added: it shrinks the rank blocks of the slices its share meets, itself. */
#ifndef ASYNCENGINE_CPU_STEP_LORA_H
#define ASYNCENGINE_CPU_STEP_LORA_H

#include <stdint.h>

#include "cpu_simd.h"

/* one projection's update under one adapter (a NULL: the adapter leaves it as it is) */
typedef struct {
    const void *a;       /* [rank, in] */
    const void *b_tiles; /* per slice, its tiles of B: [tiles][slice rank][LORA_TILE] */
    const int32_t *slices;
    int64_t n_slices, in, out, rank;
} lora_proj;

#define LORA_TILE 16 /* outputs of one tile of B */
#define LORA_TARGETS 4 /* qkv, o_proj, gate_up, down */
enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN };

typedef struct {
    const lora_proj *const *adapters; /* adapters[k][layer * LORA_TARGETS + target] */
    const int32_t *row_adapter;       /* [n]: index into adapters, -1: the base alone */
    int64_t max_rank;                 /* the largest rank of any projection */
    int32_t w_bf16;                   /* A and Bt in bfloat16 (else float32) */
} lora_desc;

#if defined(__AVX512F__) && !defined(Q_FORCE_AVX2)
#define LORA_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define LORA_AVX2 1
#endif

static inline float lora_w1(const void *w, int bf16, int64_t i) {
    return bf16 ? bf16_to_float(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* x . w over n: x float32, w float32 or bfloat16 */
static inline float lora_dot(const float *x, const void *w, int bf16, int64_t n) {
    int64_t i = 0;
    float sum = 0.0f;
#if defined(LORA_AVX512)
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    if (bf16) {
        const uint16_t *wh = (const uint16_t *)w;
        for (; i + 32 <= n; i += 32) {
            acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), load_bf16x16(wh + i), acc0);
            acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), load_bf16x16(wh + i + 16), acc1);
        }
        for (; i + 16 <= n; i += 16)
            acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), load_bf16x16(wh + i), acc0);
    } else {
        const float *wf = (const float *)w;
        for (; i + 32 <= n; i += 32) {
            acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(wf + i), acc0);
            acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(wf + i + 16), acc1);
        }
        for (; i + 16 <= n; i += 16)
            acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(wf + i), acc0);
    }
    sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#elif defined(LORA_AVX2)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    if (bf16) {
        const uint16_t *wh = (const uint16_t *)w;
        for (; i + 16 <= n; i += 16) {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), load_bf16x8(wh + i), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), load_bf16x8(wh + i + 8), acc1);
        }
        for (; i + 8 <= n; i += 8)
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), load_bf16x8(wh + i), acc0);
    } else {
        const float *wf = (const float *)w;
        for (; i + 16 <= n; i += 16) {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(wf + i), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(wf + i + 8), acc1);
        }
        for (; i + 8 <= n; i += 8)
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(wf + i), acc0);
    }
    sum = hsum256(_mm256_add_ps(acc0, acc1));
#endif
    for (; i < n; i++) sum += x[i] * lora_w1(w, bf16, i);
    return sum;
}

/* out[0:16] = sum over r < k of t[r] * tile[r][0:16]: tile float32 or bfloat16 */
static inline void lora_tile(const float *t, const void *tile, int bf16, int64_t k, float *out) {
#if defined(LORA_AVX512)
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t r = 0;
    if (bf16) {
        const uint16_t *w = (const uint16_t *)tile;
        for (; r + 2 <= k; r += 2) {
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(t[r]), load_bf16x16(w + r * LORA_TILE), acc0);
            acc1 = _mm512_fmadd_ps(_mm512_set1_ps(t[r + 1]),
                                   load_bf16x16(w + (r + 1) * LORA_TILE), acc1);
        }
        if (r < k) acc0 = _mm512_fmadd_ps(_mm512_set1_ps(t[r]), load_bf16x16(w + r * LORA_TILE), acc0);
    } else {
        const float *w = (const float *)tile;
        for (; r + 2 <= k; r += 2) {
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(t[r]), _mm512_loadu_ps(w + r * LORA_TILE), acc0);
            acc1 = _mm512_fmadd_ps(_mm512_set1_ps(t[r + 1]),
                                   _mm512_loadu_ps(w + (r + 1) * LORA_TILE), acc1);
        }
        if (r < k)
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(t[r]), _mm512_loadu_ps(w + r * LORA_TILE), acc0);
    }
    _mm512_storeu_ps(out, _mm512_add_ps(acc0, acc1));
#elif defined(LORA_AVX2)
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t r = 0; r < k; r++) {
        const __m256 tv = _mm256_set1_ps(t[r]);
        if (bf16) {
            const uint16_t *w = (const uint16_t *)tile + r * LORA_TILE;
            lo = _mm256_fmadd_ps(tv, load_bf16x8(w), lo);
            hi = _mm256_fmadd_ps(tv, load_bf16x8(w + 8), hi);
        } else {
            const float *w = (const float *)tile + r * LORA_TILE;
            lo = _mm256_fmadd_ps(tv, _mm256_loadu_ps(w), lo);
            hi = _mm256_fmadd_ps(tv, _mm256_loadu_ps(w + 8), hi);
        }
    }
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
#else
    for (int c = 0; c < LORA_TILE; c++) out[c] = 0.0f;
    for (int64_t r = 0; r < k; r++)
        for (int c = 0; c < LORA_TILE; c++)
            out[c] += t[r] * lora_w1(tile, bf16, r * LORA_TILE + c);
#endif
}

/* y[o] += (B (A x))[o] for the outputs o0 <= o < o1 of p (y indexed by output); t: max_rank
 * floats of scratch. Each output's update is summed in float32 and added once, as cpu_lora.c
 * adds it to a projection's output. */
static inline void lora_add_range(const lora_proj *p, int bf16, const float *x, float *y,
                                  int64_t o0, int64_t o1, float *t) {
    const int64_t es = bf16 ? 2 : 4;
    const char *tiles = (const char *)p->b_tiles;
    for (int64_t s = 0; s < p->n_slices; s++) {
        const int32_t *sl = p->slices + 4 * s;
        const int64_t k = sl[3] - sl[2], tile_bytes = k * LORA_TILE * es;
        const char *slice_tiles = tiles;
        tiles += (sl[1] - sl[0] + LORA_TILE - 1) / LORA_TILE * tile_bytes;
        const int64_t lo = o0 > sl[0] ? o0 : sl[0], hi = o1 < sl[1] ? o1 : sl[1];
        if (lo >= hi) continue;
        for (int64_t r = 0; r < k; r++)
            t[r] = lora_dot(x, (const char *)p->a + (sl[2] + r) * p->in * es, bf16, p->in);
        for (int64_t j = (lo - sl[0]) / LORA_TILE; sl[0] + j * LORA_TILE < hi; j++) {
            const int64_t first = sl[0] + j * LORA_TILE;
            float sum[LORA_TILE];
            lora_tile(t, slice_tiles + j * tile_bytes, bf16, k, sum);
            const int64_t c0 = lo > first ? lo - first : 0;
            const int64_t c1 = hi - first < LORA_TILE ? hi - first : LORA_TILE;
            if (c0 == 0 && c1 == LORA_TILE) {
#if defined(LORA_AVX512)
                _mm512_storeu_ps(y + first,
                                 _mm512_add_ps(_mm512_loadu_ps(y + first), _mm512_loadu_ps(sum)));
                continue;
#endif
            }
            for (int64_t c = c0; c < c1; c++) y[first + c] += sum[c];
        }
    }
}

/* the update of target `which` in layer l for adapter row i, or NULL */
static inline const lora_proj *lora_of(const lora_desc *lora, int64_t l, int which, int64_t i) {
    const int32_t k = lora->row_adapter[i];
    if (k < 0) return NULL;
    const lora_proj *p = &lora->adapters[k][l * LORA_TARGETS + which];
    return p->a ? p : NULL;
}

#endif
