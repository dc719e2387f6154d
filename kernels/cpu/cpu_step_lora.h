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
 * no barrier is added. The shrinks of down and of the next layer's gate/up and q/k/v are split
 * over the team by input (cpu_decode_step.c, lora_shrink_share: each thread over the share of
 * the input it wrote, summed after the barrier the step has anyway; a team smaller than the
 * step's plan shrinks the plan's shares after that barrier, so the sum is the same bits);
 * o_proj's and the first layer's q/k/v's are done whole by each thread for the rank blocks its
 * share meets. */
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
    const int32_t *order;             /* the adapter rows, grouped by adapter (n_order of them) */
    int64_t n_order;
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

/* vectors of LV floats: the weights float32 or bfloat16, widened on load */
#if defined(LORA_AVX512)
typedef __m512 lora_v;
#define LV 16
#define LV_ZERO() _mm512_setzero_ps()
#define LV_LOADX(p) _mm512_loadu_ps(p)
#define LV_LOADW(w, bf16, i) \
    ((bf16) ? load_bf16x16((const uint16_t *)(w) + (i)) : _mm512_loadu_ps((const float *)(w) + (i)))
#define LV_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define LV_SET1(v) _mm512_set1_ps(v)
#define LV_SUM(v) _mm512_reduce_add_ps(v)
#define LV_ADDTO(p, v) _mm512_storeu_ps(p, _mm512_add_ps(_mm512_loadu_ps(p), v))
#define LV_STORE(p, v) _mm512_storeu_ps(p, v)
#elif defined(LORA_AVX2)
typedef __m256 lora_v;
#define LV 8
#define LV_ZERO() _mm256_setzero_ps()
#define LV_LOADX(p) _mm256_loadu_ps(p)
#define LV_LOADW(w, bf16, i) \
    ((bf16) ? load_bf16x8((const uint16_t *)(w) + (i)) : _mm256_loadu_ps((const float *)(w) + (i)))
#define LV_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define LV_SET1(v) _mm256_set1_ps(v)
#define LV_SUM(v) hsum256(v)
#define LV_ADDTO(p, v) _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), v))
#define LV_STORE(p, v) _mm256_storeu_ps(p, v)
#else
typedef float lora_v;
#define LV 1
#define LV_ZERO() 0.0f
#define LV_LOADX(p) (*(p))
#define LV_LOADW(w, bf16, i) lora_w1(w, bf16, i)
#define LV_FMA(a, b, c) ((a) * (b) + (c))
#define LV_SET1(v) (v)
#define LV_SUM(v) (v)
#define LV_ADDTO(p, v) (*(p) += (v))
#define LV_STORE(p, v) (*(p) = (v))
#endif
#define LORA_ROWS 4 /* rows of one adapter that one pass over its weights serves */
/* how far ahead of the weights being multiplied the passes ask for theirs (a table holds an
 * adapter's weights in the order they are read: past a matrix's end lies the next one): after
 * each projection's product the LoRA weights come cold, in short runs the hardware prefetcher
 * alone ramps up on too late (1 KiB ahead left the passes waiting on their prefetches; 2-8 KiB
 * measured alike) */
#ifndef LORA_PREFETCH_BYTES
#define LORA_PREFETCH_BYTES 4096
#endif
#if (defined(LORA_AVX512) || defined(LORA_AVX2)) && LORA_PREFETCH_BYTES > 0
#define LORA_PREFETCH(p) _mm_prefetch((const char *)(p) + LORA_PREFETCH_BYTES, _MM_HINT_T0)
#else
#define LORA_PREFETCH(p) ((void)(p))
#endif
#define LORA_TV (LORA_TILE / LV) /* vectors of one tile row */

/* independent sums one pass keeps going at once: a sum over one row's weights is a chain of FMAs,
 * each waiting on the last (4 cycles), so a single row and rank alone would run at a quarter of
 * the load rate; few rows take several rank rows (shrink) or tiles (expand) at a time. Each sum
 * keeps its own order, so the result is the same bit for bit. */
#define LORA_CHAINS 4
#define LORA_BLOCK(m) ((m) >= LORA_CHAINS ? 1 : LORA_CHAINS / (m))

/* t[j * k + r] = x_j . A[r] for the m rows j (their float32 activations xs[j]) and the rank rows
 * r0 <= r < r0 + nb of the k rows of A from a (in weights each, rows ld apart), nb a pass: every weight
 * loaded once for the m rows, every activation once for the nb rank rows */
static inline __attribute__((always_inline)) void lora_shrink_block(
    const float *const *xs, int m, const void *a, int bf16, int64_t ld, int64_t in, int64_t k,
    int64_t r0, int nb, float *t) {
    const int64_t es = bf16 ? 2 : 4;
    const char *w[LORA_CHAINS];
    lora_v acc[LORA_ROWS][LORA_CHAINS];
    for (int b = 0; b < nb; b++) {
        w[b] = (const char *)a + (r0 + b) * ld * es;
        for (int j = 0; j < m; j++) acc[j][b] = LV_ZERO();
    }
    int64_t i = 0;
    for (; i + LV <= in; i += LV) {
        lora_v xv[LORA_ROWS];
        for (int j = 0; j < m; j++) xv[j] = LV_LOADX(xs[j] + i);
        for (int b = 0; b < nb; b++) {
            LORA_PREFETCH(w[b] + i * es);
            const lora_v wv = LV_LOADW(w[b], bf16, i);
            for (int j = 0; j < m; j++) acc[j][b] = LV_FMA(xv[j], wv, acc[j][b]);
        }
    }
    for (int b = 0; b < nb; b++)
        for (int j = 0; j < m; j++) {
            float sum = LV_SUM(acc[j][b]);
            for (int64_t e = i; e < in; e++) sum += xs[j][e] * lora_w1(w[b], bf16, e);
            t[j * k + r0 + b] = sum;
        }
}

/* t[j * k + r] = x_j . A[r] for the m rows j and the k rank rows of A from a (in weights each,
 * rows ld apart: a share of A's columns when in < ld) */
static inline __attribute__((always_inline)) void lora_shrink_strided(const float *const *xs,
                                                                      int m, const void *a,
                                                                      int bf16, int64_t ld,
                                                                      int64_t in, int64_t k,
                                                                      float *t) {
    const int nb = LORA_BLOCK(m);
    int64_t r = 0;
    if (nb > 1)
        for (; r + nb <= k; r += nb) lora_shrink_block(xs, m, a, bf16, ld, in, k, r, nb, t);
    for (; r < k; r++) lora_shrink_block(xs, m, a, bf16, ld, in, k, r, 1, t);
}

/* t[j * k + r] = x_j . A[r] for the m rows j and the k rank rows of A from a */
static inline __attribute__((always_inline)) void lora_shrink(const float *const *xs, int m,
                                                              const void *a, int bf16, int64_t in,
                                                              int64_t k, float *t) {
    lora_shrink_strided(xs, m, a, bf16, in, in, k, t);
}

/* ys[j][o] += (B t_j)[o] for the outputs of nb tiles from tile tj on, of one slice (its first
 * output first, its k ranks, its tiles from tiles), clipped to lo <= o < hi: each tile row loaded
 * once for the m rows */
static inline __attribute__((always_inline)) void lora_expand_block(
    const float *t, int m, int64_t k, const char *tiles, int bf16, int64_t first_out, int64_t lo,
    int64_t hi, int64_t tj, int nb, float *const *ys) {
    const int64_t es = bf16 ? 2 : 4, tile_bytes = k * LORA_TILE * es;
    lora_v acc[LORA_ROWS][LORA_CHAINS][LORA_TV];
    for (int j = 0; j < m; j++)
        for (int b = 0; b < nb; b++)
            for (int v = 0; v < LORA_TV; v++) acc[j][b][v] = LV_ZERO();
    for (int64_t r = 0; r < k; r++) {
        lora_v tv[LORA_ROWS];
        for (int j = 0; j < m; j++) tv[j] = LV_SET1(t[j * k + r]);
        for (int b = 0; b < nb; b++) {
            const char *tile = tiles + (tj + b) * tile_bytes;
            for (int v = 0; v < LORA_TV; v++) {
                LORA_PREFETCH(tile + (r * LORA_TILE + v * LV) * es);
                const lora_v wv = LV_LOADW(tile, bf16, r * LORA_TILE + v * LV);
                for (int j = 0; j < m; j++) acc[j][b][v] = LV_FMA(tv[j], wv, acc[j][b][v]);
            }
        }
    }
    for (int b = 0; b < nb; b++) {
        const int64_t o = first_out + (tj + b) * LORA_TILE;
        const int64_t c0 = lo > o ? lo - o : 0, c1 = hi - o < LORA_TILE ? hi - o : LORA_TILE;
        for (int j = 0; j < m; j++) {
            if (c0 == 0 && c1 == LORA_TILE) {
                for (int v = 0; v < LORA_TV; v++) LV_ADDTO(ys[j] + o + v * LV, acc[j][b][v]);
                continue;
            }
            float sum[LORA_TILE];
            for (int v = 0; v < LORA_TV; v++) LV_STORE(sum + v * LV, acc[j][b][v]);
            for (int64_t c = c0; c < c1; c++) ys[j][o + c] += sum[c];
        }
    }
}

/* ys[j][o] += (B t_j)[o] for the outputs lo <= o < hi of one slice (its first output first, its
 * k ranks, its tiles from tiles) */
static inline __attribute__((always_inline)) void lora_expand(const float *t, int m, int64_t k,
                                                              const char *tiles, int bf16,
                                                              int64_t first_out, int64_t lo,
                                                              int64_t hi, float *const *ys) {
    const int nb = LORA_BLOCK(m * LORA_TV);
    int64_t tj = (lo - first_out) / LORA_TILE;
    const int64_t end = (hi - first_out + LORA_TILE - 1) / LORA_TILE; /* past the last tile */
    if (nb > 1)
        for (; tj + nb <= end; tj += nb)
            lora_expand_block(t, m, k, tiles, bf16, first_out, lo, hi, tj, nb, ys);
    for (; tj < end; tj++) lora_expand_block(t, m, k, tiles, bf16, first_out, lo, hi, tj, 1, ys);
}

/* ys[j][o] += (B (A xs[j]))[o] for the outputs o0 <= o < o1 of p (each y indexed by output), for
 * m rows of one adapter; t: m * max_rank floats of scratch. Each output's update is summed in
 * float32 and added once, as cpu_lora.c adds it to a projection's output. */
static inline __attribute__((always_inline)) void lora_add_rows_m(
    const lora_proj *p, int bf16, const float *const *xs, float *const *ys, int m, int64_t o0,
    int64_t o1, float *t) {
    const int64_t es = bf16 ? 2 : 4;
    const char *tiles = (const char *)p->b_tiles;
    for (int64_t s = 0; s < p->n_slices; s++) {
        const int32_t *sl = p->slices + 4 * s;
        const int64_t k = sl[3] - sl[2];
        const char *slice_tiles = tiles;
        tiles += (sl[1] - sl[0] + LORA_TILE - 1) / LORA_TILE * k * LORA_TILE * es;
        const int64_t lo = o0 > sl[0] ? o0 : sl[0], hi = o1 < sl[1] ? o1 : sl[1];
        if (lo >= hi) continue;
        lora_shrink(xs, m, (const char *)p->a + sl[2] * p->in * es, bf16, p->in, k, t);
        lora_expand(t, m, k, slice_tiles, bf16, sl[0], lo, hi, ys);
    }
}

/* ys[j][o] += (B t_j)[o] for the outputs o0 <= o < o1 of p, t_j (t + j * ld) the whole shrink
 * of row j (its p->rank sums, worked out beforehand); ts: m * max_rank floats of scratch */
static inline __attribute__((always_inline)) void lora_expand_rows_m(
    const lora_proj *p, int bf16, const float *t, int64_t ld, float *const *ys, int m, int64_t o0,
    int64_t o1, float *ts) {
    const int64_t es = bf16 ? 2 : 4;
    const char *tiles = (const char *)p->b_tiles;
    for (int64_t s = 0; s < p->n_slices; s++) {
        const int32_t *sl = p->slices + 4 * s;
        const int64_t k = sl[3] - sl[2];
        const char *slice_tiles = tiles;
        tiles += (sl[1] - sl[0] + LORA_TILE - 1) / LORA_TILE * k * LORA_TILE * es;
        const int64_t lo = o0 > sl[0] ? o0 : sl[0], hi = o1 < sl[1] ? o1 : sl[1];
        if (lo >= hi) continue;
        for (int j = 0; j < m; j++)
            for (int64_t r = 0; r < k; r++) ts[j * k + r] = t[j * ld + sl[2] + r];
        lora_expand(ts, m, k, slice_tiles, bf16, sl[0], lo, hi, ys);
    }
}

static inline void lora_expand_rows(const lora_proj *p, int bf16, const float *t, int64_t ld,
                                    float *const *ys, int m, int64_t o0, int64_t o1, float *ts) {
    switch (m) {
    case 1: lora_expand_rows_m(p, bf16, t, ld, ys, 1, o0, o1, ts); break;
    case 2: lora_expand_rows_m(p, bf16, t, ld, ys, 2, o0, o1, ts); break;
    case 3: lora_expand_rows_m(p, bf16, t, ld, ys, 3, o0, o1, ts); break;
    default: lora_expand_rows_m(p, bf16, t, ld, ys, 4, o0, o1, ts); break;
    }
}

/* t[j * k + r] for the m rows' share of A's columns c0 <= c < c1 (p->rank sums each) */
static inline void lora_shrink_cols(const lora_proj *p, int bf16, const float *const *xs, int m,
                                    int64_t c0, int64_t c1, float *t) {
    const char *a = (const char *)p->a + c0 * (bf16 ? 2 : 4);
    switch (m) {
    case 1: lora_shrink_strided(xs, 1, a, bf16, p->in, c1 - c0, p->rank, t); break;
    case 2: lora_shrink_strided(xs, 2, a, bf16, p->in, c1 - c0, p->rank, t); break;
    case 3: lora_shrink_strided(xs, 3, a, bf16, p->in, c1 - c0, p->rank, t); break;
    default: lora_shrink_strided(xs, 4, a, bf16, p->in, c1 - c0, p->rank, t); break;
    }
}

/* lora_add_rows_m for 1 <= m <= LORA_ROWS, each m its own unrolled build */
static inline void lora_add_rows(const lora_proj *p, int bf16, const float *const *xs,
                                 float *const *ys, int m, int64_t o0, int64_t o1, float *t) {
    switch (m) {
    case 1: lora_add_rows_m(p, bf16, xs, ys, 1, o0, o1, t); break;
    case 2: lora_add_rows_m(p, bf16, xs, ys, 2, o0, o1, t); break;
    case 3: lora_add_rows_m(p, bf16, xs, ys, 3, o0, o1, t); break;
    default: lora_add_rows_m(p, bf16, xs, ys, 4, o0, o1, t); break;
    }
}

/* one row: y[o] += (B (A x))[o] for o0 <= o < o1; t: max_rank floats */
static inline void lora_add_range(const lora_proj *p, int bf16, const float *x, float *y,
                                  int64_t o0, int64_t o1, float *t) {
    lora_add_rows(p, bf16, &x, &y, 1, o0, o1, t);
}

/* rows order[g], order[g + 1], ... of one adapter: how many (at most LORA_ROWS) from g on */
static inline int lora_group(const lora_desc *lora, int64_t g) {
    const int32_t k = lora->row_adapter[lora->order[g]];
    int m = 1;
    while (m < LORA_ROWS && g + m < lora->n_order && lora->row_adapter[lora->order[g + m]] == k)
        m++;
    return m;
}

/* the update of target `which` in layer l for adapter row i, or NULL */
static inline const lora_proj *lora_of(const lora_desc *lora, int64_t l, int which, int64_t i) {
    const int32_t k = lora->row_adapter[i];
    if (k < 0) return NULL;
    const lora_proj *p = &lora->adapters[k][l * LORA_TARGETS + which];
    return p->a ? p : NULL;
}

#endif
