/* A whole decode step of a llama-family model with quantized (or float32 / bfloat16, formats F32
 * and BF16) weights,
 * in one native call.
 *
 * At batch 1 the quantized projections of a small model take a few milliseconds per step, and
 * the ~15 torch ops and 4 ctypes calls per layer around them (allocations, dispatch, OpenMP
 * fork/join, the activations quantized once per projection) take as long again. Here every
 * layer runs inside one OpenMP parallel region, its phases separated by barriers:
 *
 *   x = rms_norm(r) -> q8            each thread, into its own buffers (no barrier needed)
 *   qkv = W_qkv x                    rows split over threads                       | barrier
 *   k rotated, k and v stored        (request, kv head) items                      | barrier
 *                                    (one request: no phase of its own, see below)
 *   attention                        (request, kv group) items claimed longest row
 *                                    first, keys read from the paged pool in place
 *                                    (cpu_group_attention.h)                       | barrier
 *   a -> q8                          each thread
 *   r += W_o a                       rows split over threads                       | barrier
 *   x = rms_norm(r) -> q8            each thread
 *   h = act(W_gate x) * (W_up x)     pairs of rows (gate j, up j) over threads     | barrier
 *   h -> q8; r += W_down h           rows split over threads                       | barrier
 *
 * then out = rms_norm(r, final_norm). Each thread takes one contiguous share of each phase's
 * rows (share()), so the two threads stream disjoint weight bytes, and before it waits at a
 * barrier it asks for the first bytes of its share of the next projection (prefetch_*_share), so
 * that each phase starts on weights already on their way rather than on a cold stream.
 *
 * A layer with per-head q/k norms (Qwen3, Gemma 3: layer_desc's q_norm, k_norm) has each q and
 * k head RMS-normed just before it is rotated, by whichever item rotates it (norm_rotate): no
 * phase of its own, since a head's values may come from both threads' shares of the qkv rows.
 * Gemma 3's layers differ from the llama layer in flags and pointers of the same path (NULL or
 * 0: the llama layer's): sandwich norms (attn_out_norm, mlp_out_norm: o_proj's and down's
 * output RMS-normed before the residual add, written apart, then after a barrier added in row
 * shares, add_normed_rows), a GELU gate (model_desc's gelu), a sliding window (window: a row's
 * attention items cover its last `window` keys) and a RoPE table of the layer's own (cos_sin);
 * Gemma 2's in an attention soft-cap (softcap: each scaled score s becomes
 * softcap * tanh(s / softcap) before the softmax, split-K ranges included, as the block's
 * scores are made; 0 skips it, one branch a block).
 *
 * One request (batch 1, the single-stream case): the only key written this step is the row's
 * own, so each head takes the new key and value from the qkv row (the rotated key in registers)
 * instead of the pool, and the first item of each kv group stores them: no store phase and one
 * barrier less per layer. With more rows (a verify laid out as decode rows attends to keys that
 * other rows write this step) every K/V is stored before any row attends.
 *
 * The block products are those of cpu_quant_blocks.h, the activations quantized as
 * asyncengine_quantize_q8 does (not at all for a projection of F32 / BF16 parts, which reads them
 * as float32), the norms and rotary as cpu_layer_ops.c computes them in float32 (same operations in
 * the same order); attention is an online softmax over blocks of keys in float32. float32
 * activations; a float32 KV pool, or a float16 one in the -DKV_F16 build (cpu_kv.h: the new
 * K/V rounded to half as they are stored, and the row's own key read back as stored).
 *
 *   hidden      [n, hidden] float32       the embedded input tokens
 *   positions   [n] int64, slots [n] int64 (where each new K/V goes; -1: nowhere, a padding row)
 *   block_table [n, table_stride] int32, seq_lens [n] int32 (keys incl. the new one)
 *   out         [n, hidden] float32       the final-normed hidden states
 *
 * Built by kernels/cpu/cpu_native.py.
 */
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_group_attention.h"
#include "cpu_paged.h"
#include "cpu_quant_blocks.h"
#include "cpu_step_lora.h"

#define MAX_PARTS 4
#define MAX_HEAD_DIM 256 /* MAX_HEAD_DIM in decode_step_native.py */
#define PAIR_TILE XR /* gate/up row pairs a thread takes at a time: one group of each */

typedef struct {
    const uint8_t *data;
    const float *bias; /* NULL: none */
    int64_t row_bytes;
    int64_t rows;
    int32_t fmt;
    int32_t interleaved; /* rows below rows / XR * XR in interleaved groups (cpu_quant_blocks.h) */
} qpart;

/* one projection: the rows of its parts, in order (a fused q/k/v of mixed formats is several) */
typedef struct {
    qpart parts[MAX_PARTS];
    int64_t num_parts;
} qlinear;

typedef struct {
    const float *input_norm;
    const float *post_norm;
    /* [head_dim]: each q / k head RMS-normed by them before RoPE (Qwen3); NULL: no such norm */
    const float *q_norm, *k_norm;
    /* [hidden]: the attention / MLP output RMS-normed by them before its residual add (Gemma 3's
     * sandwich norms); NULL: added as it is */
    const float *attn_out_norm, *mlp_out_norm;
    const float *cos_sin; /* [rope_rows, head_dim]: this layer's RoPE table; NULL: the model's */
    int64_t window;       /* keys a row sees, its own included (a sliding layer); 0: all */
    float softcap;        /* scaled scores s -> softcap * tanh(s / softcap) (Gemma 2); 0: none */
    kv_t *k_cache; /* [S, kv_heads, head_dim] */
    kv_t *v_cache;
    qlinear qkv, o_proj, gate_up, down;
} layer_desc;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, rope_rows;
    float eps, scale;
    const float *cos_sin; /* [rope_rows, head_dim]: cos | sin halves */
    const float *final_norm;
    const layer_desc *layers;
    const lora_desc *lora; /* the step's adapter rows (cpu_step_lora.h); NULL: none */
    int64_t gelu;          /* the MLP's gate activation: 1 GELU (tanh form, Gemma), 0 SiLU */
} model_desc;

/* a thread's activations: n rows of k values, in q8 form (q, d, sd) and as float32 (f: the rows
 * they were made from, which F32 / BF16 weights read instead) */
typedef struct {
    int8_t *q;
    float *d, *sd;
    const float *f;
    int64_t k;
} act_buf;

/* ------------------------------------------------------------------------------------------ */

/* x [n, k] as the next projection reads it: the float rows always, their q8 form where some
 * part of it is quantized (q8: 0 for a projection of F32 / BF16 parts only) */
static void quantize_rows(const float *x, int64_t n, int64_t k, act_buf *a, int q8) {
    const int64_t nb = k / QK;
    a->k = k;
    a->f = x;
    if (!q8) return;
    for (int64_t i = 0; i < n; i++)
        for (int64_t b = 0; b < nb; b++)
            quantize_block_q8(x + i * k + b * QK, a->q + i * k + b * QK, a->d + i * nb + b,
                              a->sd + i * nb + b);
}

/* y = w * (x * rsqrt(mean(x^2) + eps)), as cpu_layer_ops.c's norm_row in float32 (its sum of
 * squares, sum_squares: on AVX-512 the two summed in a different order, and a row normed a
 * float ulp apart can quantize one activation to the next int8 step) */
static void rms_norm_row(const float *x, const float *w, int64_t h, float eps, float *y) {
    const float inv = 1.0f / sqrtf(sum_squares(x, h) / (float)h + eps);
    for (int64_t i = 0; i < h; i++) y[i] = x[i] * inv * w[i];
}

/* whether a part of lin reads the q8 activations (any format but F32 and BF16) */
static inline int needs_q8(const qlinear *lin) {
    for (int64_t p = 0; p < lin->num_parts; p++)
        if (!float_rows(lin->parts[p].fmt)) return 1;
    return 0;
}

/* the part of lin holding global row `row`, and the row's index within it */
static inline const qpart *find_part(const qlinear *lin, int64_t *row) {
    for (int64_t p = 0; p < lin->num_parts; p++) {
        if (*row < lin->parts[p].rows) return &lin->parts[p];
        *row -= lin->parts[p].rows;
    }
    return NULL;
}

static inline int64_t grouped_rows(const qpart *part) {
    return part->interleaved && interleaves(part->fmt) ? part->rows / XR * XR : 0;
}

/* the part whose interleaved group rows row..row + XR - 1 of lin are, and the group's first row
 * within it; NULL when those rows are not one group */
static inline const qpart *group_at(const qlinear *lin, int64_t row, int64_t *local) {
    *local = row;
    const qpart *part = find_part(lin, local);
    return part && *local % XR == 0 && *local + XR <= grouped_rows(part) ? part : NULL;
}

/* out[r * XR + j] = the group's row j . activation row i + r of a (+ bias),
 * r < nr <= group_tile_rows(part->fmt) */
static inline void group_out(const qpart *part, int64_t local, const act_buf *a, int64_t i,
                             int nr, float *out) {
    const int64_t k = a->k, nb = k / QK;
    act_row rows[GR_MAX];
    for (int r = 0; r < nr; r++)
        rows[r] = (act_row){a->q + (i + r) * k, a->d + (i + r) * nb, a->sd + (i + r) * nb,
                            a->f + (i + r) * k};
    if (nr == 1) group_dot(part->fmt, part->data + local * part->row_bytes, k, rows, out);
    else group_dot_rows(part->fmt, part->data + local * part->row_bytes, k, rows, nr, out);
    if (part->bias)
        for (int r = 0; r < nr; r++)
            for (int j = 0; j < XR; j++) out[r * XR + j] += part->bias[local + j];
}

/* out[i] = row `row` of lin . activation row i (+ bias), for the n rows of a */
static inline void linear_row(const qlinear *lin, int64_t row, const act_buf *a, int64_t n,
                              float *out) {
    int64_t local = row;
    const qpart *part = find_part(lin, &local);
    if (local < grouped_rows(part)) { /* a lone row of a group (parts not split at groups) */
        const int64_t first = local / XR * XR;
        for (int64_t i = 0; i < n; i++) {
            float v[XR];
            group_out(part, first, a, i, 1, v);
            out[i] = v[local - first];
        }
        return;
    }
    const uint8_t *w = part->data + local * part->row_bytes;
    const float bias = part->bias ? part->bias[local] : 0.0f;
    const int64_t k = a->k, nb = k / QK;
    for (int64_t i0 = 0; i0 < n; i0 += NR) {
        const int nr = (int)(n - i0 < NR ? n - i0 : NR);
        act_row rows[NR];
        for (int r = 0; r < nr; r++) {
            rows[r].q = a->q + (i0 + r) * k;
            rows[r].d = a->d + (i0 + r) * nb;
            rows[r].sd = a->sd + (i0 + r) * nb;
            rows[r].f = a->f + (i0 + r) * k;
        }
        if (nr == 1) row_dot(part->fmt, w, k, rows, 1, out + i0);
        else row_dot(part->fmt, w, k, rows, nr, out + i0);
        for (int r = 0; r < nr; r++) out[i0 + r] += bias;
    }
}

/* rows r0 and r1 of lin against a single activation row, paired (row_pair_dot) where both
 * rows' format has the paired kernel; else one at a time. Same results either way. */
static inline void linear_rows2(const qlinear *lin, int64_t r0, int64_t r1, const act_buf *a,
                                float *out) {
    int64_t l0 = r0, l1 = r1;
    const qpart *p0 = find_part(lin, &l0), *p1 = find_part(lin, &l1);
    const act_row row = {a->q, a->d, a->sd, a->f};
    if (p0->fmt == p1->fmt && l0 >= grouped_rows(p0) && l1 >= grouped_rows(p1) &&
        row_pair_dot(p0->fmt, p0->data + l0 * p0->row_bytes, p1->data + l1 * p1->row_bytes, a->k,
                     &row, out)) {
        out[0] += p0->bias ? p0->bias[l0] : 0.0f;
        out[1] += p1->bias ? p1->bias[l1] : 0.0f;
        return;
    }
    linear_row(lin, r0, a, 1, out);
    linear_row(lin, r1, a, 1, out + 1);
}

/* rows r0 and r1 of lin against the n rows of a, into out0[i] and out1[i]: as a pair where both
 * are F32 (or both BF16) rows (row_pair_float: each activation vector loaded once for both; the
 * same sums as row by row), else one at a time */
static inline void linear_rows2_n(const qlinear *lin, int64_t r0, int64_t r1, const act_buf *a,
                                  int64_t n, float *out0, float *out1) {
    int64_t l0 = r0, l1 = r1;
    const qpart *p0 = find_part(lin, &l0), *p1 = find_part(lin, &l1);
    if (!float_rows(p0->fmt) || p1->fmt != p0->fmt) {
        linear_row(lin, r0, a, n, out0);
        linear_row(lin, r1, a, n, out1);
        return;
    }
    const uint8_t *w0 = p0->data + l0 * p0->row_bytes, *w1 = p1->data + l1 * p1->row_bytes;
    const float b0 = p0->bias ? p0->bias[l0] : 0.0f, b1 = p1->bias ? p1->bias[l1] : 0.0f;
    for (int64_t i0 = 0; i0 < n; i0 += NR) {
        const int nr = (int)(n - i0 < NR ? n - i0 : NR);
        act_row rows[NR];
        for (int r = 0; r < nr; r++) rows[r] = (act_row){NULL, NULL, NULL, a->f + (i0 + r) * a->k};
        float both[2 * NR];
        row_pair_float(p0->fmt, w0, w1, a->k, rows, nr, both);
        for (int r = 0; r < nr; r++) {
            out0[i0 + r] = both[r] + b0;
            out1[i0 + r] = both[NR + r] + b1;
        }
    }
}

/* The barrier between the phases of a layer: spin a while (on a quiet machine the other thread
 * arrives within microseconds), then yield the core at each look. OpenMP's barrier spins for
 * far longer before it sleeps: on a machine with more runnable threads than cores the thread
 * that spins keeps the core from the thread it waits for (two threads at load 8: a batch-1
 * step of ~12 ms of work took 150-240 ms). Sense-reversing: each thread flips its own sense
 * at every barrier; the last to arrive resets the count and publishes the new sense. */
#define BARRIER_SPINS 500

typedef struct {
    atomic_int arrived;
    atomic_int sense;
    int threads;
} team_barrier;

static void barrier_wait(team_barrier *b, int *my_sense) {
    const int sense = !*my_sense;
    *my_sense = sense;
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == b->threads - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->sense, sense, memory_order_release);
        return;
    }
    for (int spins = 0; atomic_load_explicit(&b->sense, memory_order_acquire) != sense; spins++) {
        if (spins < BARRIER_SPINS) {
#if defined(Q_ISA_SIMD)
            _mm_pause();
#endif
        } else {
            sched_yield();
        }
    }
}

/* share t of nt: [*first, *last) of count items (sizes differ by one at most) */
static inline void share_of(int64_t count, int64_t t, int64_t nt, int64_t *first, int64_t *last) {
    const int64_t q = count / nt, r = count % nt;
    *first = t * q + (t < r ? t : r);
    *last = *first + q + (t < r ? 1 : 0);
}

/* this thread's contiguous share [*first, *last) of count items */
static inline void share(int64_t count, int64_t *first, int64_t *last) {
    share_of(count, omp_get_thread_num(), omp_get_num_threads(), first, last);
}

/* residual[i] += rms_norm(out[i], w) for this thread's share of the n rows: a sublayer's output
 * added through its sandwich norm (Gemma 3), which needs the output's whole row (no barrier) */
static void add_normed_rows(const float *out, const float *w, int64_t n, int64_t h, float eps,
                            float *residual) {
    int64_t first, last;
    share(n, &first, &last);
    for (int64_t i = first; i < last; i++) {
        const float *o = out + i * h;
        const float inv = 1.0f / sqrtf(sum_squares(o, h) / (float)h + eps);
        for (int64_t j = 0; j < h; j++) residual[i * h + j] += o[j] * inv * w[j];
    }
}

/* the weight bytes of rows 0..row-1 of lin */
static inline int64_t bytes_before(const qlinear *lin, int64_t row) {
    int64_t bytes = 0;
    for (int64_t p = 0; p < lin->num_parts; p++) {
        const qpart *part = &lin->parts[p];
        if (row <= part->rows) return bytes + row * part->row_bytes;
        bytes += part->rows * part->row_bytes;
        row -= part->rows;
    }
    return bytes;
}

/* this thread's contiguous share [*first, *last) of lin's tiles of ROW_TILE rows (rows in all),
 * each thread streaming about the same weight bytes: a tile goes to the thread whose equal part
 * of the bytes holds the tile's middle byte. A fused q/k/v of a Q4_K_M model is Q4_K rows (144
 * bytes per 256 values) and Q6_K ones (210): split by rows, the thread with v read ~15% more. */
static inline void share_bytes_of(const qlinear *lin, int64_t rows, int64_t t, int64_t nt,
                                  int64_t *first, int64_t *last) {
    const int64_t tiles = (rows + ROW_TILE - 1) / ROW_TILE;
    if (lin->num_parts == 1) {
        share_of(tiles, t, nt, first, last);
        return;
    }
    const double total = (double)bytes_before(lin, rows);
    *first = *last = 0;
    int found = 0;
    for (int64_t i = 0; i < tiles; i++) {
        const int64_t r1 = (i + 1) * ROW_TILE < rows ? (i + 1) * ROW_TILE : rows;
        const double middle = 0.5 * (double)(bytes_before(lin, i * ROW_TILE) + bytes_before(lin, r1));
        int64_t owner = total > 0.0 ? (int64_t)((double)nt * middle / total) : 0;
        owner = owner < nt ? owner : nt - 1;
        if (owner > t) break;
        if (owner == t) {
            if (!found) *first = i;
            found = 1;
            *last = i + 1;
        }
    }
}

static inline void share_bytes(const qlinear *lin, int64_t rows, int64_t *first, int64_t *last) {
    share_bytes_of(lin, rows, omp_get_thread_num(), omp_get_num_threads(), first, last);
}

/* bytes the first weight row `row` of lin on (within its part) asked for ahead of its phase */
#define PHASE_PREFETCH_BYTES 4096

static inline void prefetch_rows_from(const qlinear *lin, int64_t row, int64_t bytes) {
#if defined(Q_ISA_SIMD)
    int64_t local = row;
    const qpart *part = find_part(lin, &local);
    if (!part) return;
    const int64_t left = (part->rows - local) * part->row_bytes;
    const uint8_t *w = part->data + local * part->row_bytes;
    for (int64_t o = 0; o < (bytes < left ? bytes : left); o += 64)
        _mm_prefetch((const char *)w + o, _MM_HINT_T0);
#else
    (void)lin, (void)row, (void)bytes;
#endif
}

/* the first bytes of this thread's share of gemv(lin, rows) */
static inline void prefetch_gemv_share(const qlinear *lin, int64_t rows) {
    int64_t t0, t1;
    share_bytes(lin, rows, &t0, &t1);
    if (t0 < t1) prefetch_rows_from(lin, t0 * ROW_TILE, PHASE_PREFETCH_BYTES);
}

/* y[i, 0:rows] = (or +=, accumulate) lin x_i, rows split over the team (this thread's share;
 * no barrier) */
static void gemv(const qlinear *lin, int64_t rows, const act_buf *a, int64_t n, float *y,
                 int64_t ldy, int accumulate) {
    int64_t t_first, t_last;
    share_bytes(lin, rows, &t_first, &t_last);
    for (int64_t t = t_first; t < t_last; t++) {
        const int64_t r1 = (t + 1) * ROW_TILE < rows ? (t + 1) * ROW_TILE : rows;
        int64_t first = t * ROW_TILE;
        for (; first + XR <= r1; first += XR) { /* interleaved groups of rows */
            int64_t local;
            const qpart *part = group_at(lin, first, &local);
            if (!part) break;
            const int tile = group_tile_rows(part->fmt);
            for (int64_t i = 0; i < n; i += tile) {
                const int nr = (int)(n - i < tile ? n - i : tile);
                float v[GR_MAX * XR];
                group_out(part, local, a, i, nr, v);
                for (int r = 0; r < nr; r++) {
                    float *dst = y + (i + r) * ldy + first;
                    for (int j = 0; j < XR; j++)
                        dst[j] = accumulate ? dst[j] + v[r * XR + j] : v[r * XR + j];
                }
            }
        }
        if (n == 1) { /* one activation row: weight rows in pairs */
            for (; first + 1 < r1; first += 2) {
                float v[2];
                linear_rows2(lin, first, first + 1, a, v);
                y[first] = accumulate ? y[first] + v[0] : v[0];
                y[first + 1] = accumulate ? y[first + 1] + v[1] : v[1];
            }
        }
        for (; n > 1 && first + 1 < r1; first += 2) { /* weight rows in pairs (F32, BF16) */
            for (int64_t i0 = 0; i0 < n; i0 += 256) {
                const int64_t m = n - i0 < 256 ? n - i0 : 256;
                act_buf sub = {a->q + i0 * a->k, a->d + i0 * (a->k / QK), a->sd + i0 * (a->k / QK),
                               a->f + i0 * a->k, a->k};
                float v0[256], v1[256];
                linear_rows2_n(lin, first, first + 1, &sub, m, v0, v1);
                for (int64_t i = 0; i < m; i++) {
                    float *dst = y + (i0 + i) * ldy + first;
                    dst[0] = accumulate ? dst[0] + v0[i] : v0[i];
                    dst[1] = accumulate ? dst[1] + v1[i] : v1[i];
                }
            }
        }
        for (int64_t row = first; row < r1; row++) {
            float v[256];
            for (int64_t i0 = 0; i0 < n; i0 += 256) {
                const int64_t m = n - i0 < 256 ? n - i0 : 256;
                act_buf sub = {a->q + i0 * a->k, a->d + i0 * (a->k / QK), a->sd + i0 * (a->k / QK),
                               a->f + i0 * a->k, a->k};
                linear_row(lin, row, &sub, m, v);
                for (int64_t i = 0; i < m; i++) {
                    float *dst = y + (i0 + i) * ldy + row;
                    *dst = accumulate ? *dst + v[i] : v[i];
                }
            }
        }
    }
}

/* the first bytes of this thread's share of gate_up_act(lin, inter): its gate and up rows */
static inline void prefetch_gate_up_share(const qlinear *lin, int64_t inter) {
    int64_t t0, t1;
    share((inter + PAIR_TILE - 1) / PAIR_TILE, &t0, &t1);
    if (t0 >= t1) return;
    prefetch_rows_from(lin, t0 * PAIR_TILE, PHASE_PREFETCH_BYTES / 2);
    prefetch_rows_from(lin, inter + t0 * PAIR_TILE, PHASE_PREFETCH_BYTES / 2);
}

/* the gate's activation: SiLU, or GELU in its tanh form (gelu: Gemma's gelu_pytorch_tanh) */
static inline float gate_act(float g, int gelu) {
    if (!gelu) return g / (1.0f + expf(-g));
    return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

#if defined(Q_ISA_SIMD)
static inline __m256 gate_act256(__m256 g, int gelu) {
    if (!gelu) return silu256(g);
    const __m256 inner = _mm256_mul_ps(
        _mm256_set1_ps(0.7978845608028654f),
        _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), _mm256_mul_ps(g, g), g));
    const __m256 half_g = _mm256_mul_ps(_mm256_set1_ps(0.5f), g);
    return _mm256_fmadd_ps(half_g, tanh256(inner), half_g);
}
#endif

/* h[i, j] = act(gate_j . x_i) * (up_j . x_i) (gate_act): gate rows 0..inter-1, up rows
 * inter..2 inter-1 (this thread's share of the pairs; no barrier); delta [n, 2 inter] (NULL:
 * none) is added to gate and up before the product (the LoRA updates of this thread's share,
 * lora_expand_share) */
static void gate_up_act(const qlinear *lin, int64_t inter, const act_buf *a, int64_t n, float *h,
                        const float *delta, int gelu) {
    int64_t t_first, t_last;
    share((inter + PAIR_TILE - 1) / PAIR_TILE, &t_first, &t_last);
    for (int64_t t = t_first; t < t_last; t++) {
        const int64_t j0 = t * PAIR_TILE, j1 = (t + 1) * PAIR_TILE < inter ? (t + 1) * PAIR_TILE : inter;
        int64_t gate_local, up_local;
        const qpart *gate = j1 - j0 == XR ? group_at(lin, j0, &gate_local) : NULL;
        const qpart *up = gate ? group_at(lin, inter + j0, &up_local) : NULL;
        if (up) { /* gate rows j0.. and up rows inter + j0.. as two interleaved groups */
            /* gate and up may differ in format: the smaller tile */
            const int tg = group_tile_rows(gate->fmt), tu = group_tile_rows(up->fmt);
            const int tile = tg < tu ? tg : tu;
            for (int64_t i = 0; i < n; i += tile) {
                const int nr = (int)(n - i < tile ? n - i : tile);
                float g[GR_MAX * XR], u[GR_MAX * XR];
                group_out(gate, gate_local, a, i, nr, g);
                group_out(up, up_local, a, i, nr, u);
                for (int r = 0; delta && r < nr; r++)
                    for (int j = 0; j < XR; j++) {
                        g[r * XR + j] += delta[(i + r) * 2 * inter + j0 + j];
                        u[r * XR + j] += delta[(i + r) * 2 * inter + inter + j0 + j];
                    }
                for (int r = 0; r < nr; r++) {
#if defined(Q_ISA_SIMD)
                    _Static_assert(XR == 8, "a group's row of gate/up is one 8-lane vector");
                    _mm256_storeu_ps(h + (i + r) * inter + j0,
                                     _mm256_mul_ps(gate_act256(_mm256_loadu_ps(g + r * XR), gelu),
                                                   _mm256_loadu_ps(u + r * XR)));
#else
                    for (int j = 0; j < XR; j++) {
                        const float gv = g[r * XR + j];
                        h[(i + r) * inter + j0 + j] = gate_act(gv, gelu) * u[r * XR + j];
                    }
#endif
                }
            }
            continue;
        }
        for (int64_t j = j0; j < j1; j++) {
            if (n == 1) { /* gate row j and up row j as a pair */
                float gu[2];
                linear_rows2(lin, j, inter + j, a, gu);
                if (delta) gu[0] += delta[j], gu[1] += delta[inter + j];
                h[j] = gate_act(gu[0], gelu) * gu[1];
                continue;
            }
            for (int64_t i0 = 0; i0 < n; i0 += 256) {
                const int64_t m = n - i0 < 256 ? n - i0 : 256;
                act_buf sub = {a->q + i0 * a->k, a->d + i0 * (a->k / QK), a->sd + i0 * (a->k / QK),
                               a->f + i0 * a->k, a->k};
                float g[256], u[256];
                linear_rows2_n(lin, j, inter + j, &sub, m, g, u);
                for (int64_t i = 0; delta && i < m; i++) {
                    g[i] += delta[(i0 + i) * 2 * inter + j];
                    u[i] += delta[(i0 + i) * 2 * inter + inter + j];
                }
                for (int64_t i = 0; i < m; i++) {
                    h[(i0 + i) * inter + j] = gate_act(g[i], gelu) * u[i];
                }
            }
        }
    }
}

/* neox rotation of one head: (x1 c - x2 s, x2 c + x1 s) */
static inline void rotate(const float *x, const float *cs, int64_t half, float *out) {
    const float *c = cs, *s = cs + half;
    for (int64_t i = 0; i < half; i++) {
        const float t1 = x[i] * c[i], t2 = x[half + i] * s[i];
        const float t3 = x[half + i] * c[i], t4 = x[i] * s[i];
        out[i] = t1 - t2;
        out[half + i] = t3 + t4;
    }
}

/* one q or k head as attention reads it: RMS-normed over its D values by w first where the
 * layer has per-head norms (Qwen3; w NULL: none), in float32 as rms_norm_row, then rotated */
static inline void norm_rotate(const float *x, const float *w, float eps, const float *cs,
                               int64_t D, float *out) {
    if (!w) {
        rotate(x, cs, D / 2, out);
        return;
    }
    float normed[MAX_HEAD_DIM];
    rms_norm_row(x, w, D, eps, normed);
    rotate(normed, cs, D / 2, out);
}

/* The attention phase's items, claimed one at a time from a counter of the layer's own, rows
 * longest first, so that the threads finish together however the rows' lengths differ (a
 * static split of requests left one thread with the long contexts). An item is, by how many
 * there are to go round:
 *   >= ROW_ITEMS_FROM rows a thread: a row's kv heads together (up to ATTN_MAX_HEADS query
 *      heads), each block of keys read as whole pool slots (every kv head's lines of a slot are
 *      adjacent: the hardware prefetcher's neighbouring lines are used, not thrown away);
 *   else, >= 4 (row, kv head) items a thread: one kv head and its query heads;
 *   else (a request or two alone) with at least 2 * SPLIT_MIN_KEYS keys (cpu_split_k.h): a
 *      row's kv heads together (as above; else one kv head) and all their query heads over a
 *      range of its keys (split-K), the ranges' softmax states merged by whichever range
 *      finishes last (merge_ranges): each range streams whole pool slots, and every key and
 *      value row is read once per step however few the kv heads, where one item a query head
 *      read each row once per query head (3 times over for SmolLM2's 9 / 3 heads: at 8k keys
 *      a kv head's rows outgrow L2, and the reads went to memory each time);
 *   else (short rows): one query head, so that 2 threads share 3 kv heads evenly.
 * A group of more than ATTN_MAX_GROUP query heads is split in chunks in each case. */
#define ROW_ITEMS_FROM 4

typedef struct {
    const int64_t *order; /* rows by seq_len, longest first */
    int64_t kv_per_item;  /* kv heads of an item (a divisor of kv_heads) */
    int64_t chunks;       /* chunks of a kv group (1 where kv_per_item > 1) */
    int64_t chunk_heads;  /* query heads of a chunk (the last may have fewer) */
    int64_t splits;       /* key ranges of a (row, kv chunk): 1, or split-K */
    int64_t count;
} attn_items;

/* order[0:n] = the rows, longest seq_len first (ties in row order) */
static void sort_rows(int64_t *order, int64_t n, const int32_t *seq_lens) {
    for (int64_t i = 0; i < n; i++) { /* insertion sort: n <= a few hundred, once per step */
        int64_t j = i;
        for (; j > 0 && seq_lens[order[j - 1]] < seq_lens[i]; j--) order[j] = order[j - 1];
        order[j] = i;
    }
}

static attn_items plan_items(const int64_t *order, int64_t n, int64_t kv_heads, int64_t group,
                             int threads, const int32_t *seq_lens) {
    const int64_t min_chunks = (group + ATTN_MAX_GROUP - 1) / ATTN_MAX_GROUP;
    int64_t kv_per_item = 1, chunks = min_chunks, splits = 1;
    if (n >= ROW_ITEMS_FROM * threads && min_chunks == 1) {
        for (int64_t c = kv_heads; c > 1 && kv_per_item == 1; c--)
            if (kv_heads % c == 0 && c * group <= ATTN_MAX_HEADS) kv_per_item = c;
    } else if (n * kv_heads * min_chunks < 4 * threads) {
        const int64_t longest = n > 0 ? seq_lens[order[0]] : 0;
        const int64_t whole = min_chunks == 1 && kv_heads * group <= ATTN_MAX_HEADS
                                  ? split_count(n, longest, threads)
                                  : 1;
        if (whole > 1) { /* a row's kv heads together over each range: whole slots streamed */
            kv_per_item = kv_heads;
            splits = whole;
        } else {
            splits = split_count(n * kv_heads * min_chunks, longest, threads);
            if (splits == 1) chunks = group;
        }
    }
    const int64_t chunk_heads = (group + chunks - 1) / chunks;
    chunks = (group + chunk_heads - 1) / chunk_heads;
    return (attn_items){order, kv_per_item, chunks, chunk_heads, splits,
                        n * (kv_heads / kv_per_item) * chunks * splits};
}

/* what item `item` covers: row `row`, kv heads kv0 .. kv0 + kvc - 1 and, of each, gc query
 * heads from h0 (kvc > 1: all of them); keys begin .. end - 1 of the row's len, range `split`
 * of the (row, kv chunk) `unit` (split-K; else all of them) of the keys the row sees (its last
 * `window` in a sliding layer; window 0: all) */
typedef struct {
    int64_t row, kv0, kvc, h0, gc, unit, split, begin, end;
} attn_item;

static inline attn_item item_at(const attn_items *items, int64_t item, int64_t kv_heads,
                                int64_t group, const int32_t *seq_lens, int64_t window) {
    const int64_t unit = item / items->splits, split = item % items->splits;
    const int64_t per_row = kv_heads / items->kv_per_item * items->chunks;
    const int64_t sub = unit % per_row, kv0 = sub / items->chunks * items->kv_per_item;
    const int64_t first = sub % items->chunks * items->chunk_heads;
    const int64_t gc = first + items->chunk_heads <= group ? items->chunk_heads : group - first;
    const int64_t row = items->order[unit / per_row], len = seq_lens[row];
    const int64_t seen0 = window > 0 && len > window ? len - window : 0, seen = len - seen0;
    return (attn_item){row,   kv0,  items->kv_per_item, kv0 * group + first,
                       gc,    unit, split,              seen0 + seen * split / items->splits,
                       seen0 + seen * (split + 1) / items->splits};
}

/* One item's attention: q [heads of the item, D] (rotated) -> out (may be q), or for a split-K
 * range its state into parts (ATTN_PART floats a range, a unit's ranges adjacent) and, from
 * the range of its unit that finishes last (done: a counter per unit), the merged output. */
static void attention_item(const attn_items *items, const attn_item *it, const float *q,
                           const kv_t *k_cache, const kv_t *v_cache, const int32_t *table_row,
                           int64_t len, int64_t page_size, int64_t kv_heads, int64_t D,
                           float scale, float softcap, const kv_t *k_new, const kv_t *v_new,
                           float *out, float *parts, atomic_int *done) {
    if (items->splits == 1) {
        attend_group(q, it->kvc, it->gc, k_cache, v_cache, table_row, it->begin, len, page_size,
                     it->kv0, kv_heads, D, scale, softcap, k_new, v_new, out);
        return;
    }
    const int64_t heads = it->kvc * it->gc, stride = ATTN_PART(heads, D);
    float *part = parts + (it->unit * items->splits + it->split) * stride;
    attend_range(q, it->kvc, it->gc, k_cache, v_cache, table_row, it->begin, it->end, len,
                 page_size, it->kv0, kv_heads, D, scale, softcap, k_new, v_new, part,
                 part + heads * D, part + heads * D + heads);
    /* release: this range's state is written; acquire: the others' are seen by the last */
    if (atomic_fetch_add_explicit(&done[it->unit], 1, memory_order_acq_rel) + 1 == items->splits)
        merge_ranges(parts + it->unit * items->splits * stride, items->splits, heads, D, out);
}

/* floats of the split-K states of a step of n rows (0: no split-K at any thread count) */
static int64_t split_floats(int64_t n, int64_t kv_heads, int64_t group, int64_t D) {
    const int64_t min_chunks = (group + ATTN_MAX_GROUP - 1) / ATTN_MAX_GROUP;
    const int64_t heads = (group + min_chunks - 1) / min_chunks;
    return n * kv_heads * min_chunks * MAX_SPLITS * ATTN_PART(heads, D);
}

/* LoRA: y[i, o] += the update of target `which` for each adapter row i, over the outputs of
 * this thread's share of gemv(lin, rows) (the rows its gemv wrote: no barrier added); x [n, ldx]
 * the float32 activations the projection read; rows of one adapter LORA_ROWS at a time (one pass
 * over its weights). t: the thread's scratch (LORA_ROWS * max_rank floats). */
static void lora_gemv_share(const model_desc *m, int64_t l, int which, const qlinear *lin,
                            int64_t rows, const float *x, int64_t ldx, float *y, int64_t ldy,
                            float *t) {
    int64_t t0, t1;
    share_bytes(lin, rows, &t0, &t1);
    const int64_t o0 = t0 * ROW_TILE, o1 = t1 * ROW_TILE < rows ? t1 * ROW_TILE : rows;
    for (int64_t g = 0, count; o0 < o1 && g < m->lora->n_order; g += count) {
        count = lora_group(m->lora, g);
        const lora_proj *p = lora_of(m->lora, l, which, m->lora->order[g]);
        if (!p) continue;
        const float *xs[LORA_ROWS];
        float *ys[LORA_ROWS];
        for (int64_t j = 0; j < count; j++) {
            xs[j] = x + m->lora->order[g + j] * ldx;
            ys[j] = y + m->lora->order[g + j] * ldy;
        }
        lora_add_rows(p, m->lora->w_bf16, xs, ys, (int)count, o0, o1, t);
    }
}

/* LoRA shrinks split over the team by input: the input of down (mlp) and of the next gate/up
 * or q/k/v (the normed residual) is written in shares, each thread's before the barrier the step
 * has anyway; each thread shrinks over the inputs of its own share (A's columns c0 <= c < c1),
 * and after the barrier every thread sums the team's parts, so no thread reads all of A (o_proj,
 * whose input attention writes in claimed items, and the first layer's q/k/v shrink whole).
 * part[g * max_rank + r]: adapter row order[g]'s sum of rank r over the share (0 where none);
 * w: the next RMS norm's weights (the residual's share times them; the sum takes the 1 / rms
 * after the barrier) or NULL; xw: LORA_ROWS * (c1 - c0) floats of scratch, t: the thread's. */
static void lora_shrink_share(const model_desc *m, int64_t l, int which, const float *x,
                              int64_t ldx, const float *w, int64_t c0, int64_t c1, float *part,
                              float *xw, float *t) {
    const lora_desc *lora = m->lora;
    memset(part, 0, (size_t)(lora->n_order * lora->max_rank) * sizeof(float));
    for (int64_t g = 0, count; c0 < c1 && g < lora->n_order; g += count) {
        count = lora_group(lora, g);
        const lora_proj *p = lora_of(lora, l, which, lora->order[g]);
        if (!p) continue;
        const float *xs[LORA_ROWS];
        for (int64_t j = 0; j < count; j++) {
            const float *row = x + lora->order[g + j] * ldx + c0;
            if (!w) {
                xs[j] = row;
                continue;
            }
            float *scaled = xw + j * (c1 - c0);
            for (int64_t c = 0; c < c1 - c0; c++) scaled[c] = row[c] * w[c0 + c];
            xs[j] = scaled;
        }
        lora_shrink_cols(p, lora->w_bf16, xs, (int)count, c0, c1, t);
        for (int64_t j = 0; j < count; j++)
            memcpy(part + (g + j) * lora->max_rank, t + j * p->rank,
                   (size_t)p->rank * sizeof(float));
    }
}

/* the outputs o0 <= o < o1 of target `which` in layer l, y[i, o] += B t_i for each adapter row
 * i, t_i the sum of the team's parts (parts + k * part_stride, lora_shrink_share) times 1 / rms
 * of norm_of's row i (the residual the input was normed from: eps) or 1 (norm_of NULL);
 * t: the thread's scratch (2 * LORA_ROWS * max_rank floats) */
static void lora_expand_share(const model_desc *m, int64_t l, int which, const float *parts,
                              int64_t part_stride, int team, const float *norm_of, int64_t h,
                              float eps, float *y, int64_t ldy, int64_t o0, int64_t o1,
                              int64_t shift, float *t) {
    const lora_desc *lora = m->lora;
    const int64_t R = lora->max_rank;
    float *sums = t + LORA_ROWS * R;
    for (int64_t g = 0, count; o0 < o1 && g < lora->n_order; g += count) {
        count = lora_group(lora, g);
        const lora_proj *p = lora_of(lora, l, which, lora->order[g]);
        if (!p) continue;
        float *ys[LORA_ROWS];
        for (int64_t j = 0; j < count; j++) {
            const int64_t i = lora->order[g + j];
            ys[j] = y + i * ldy + shift;
            const float scale =
                norm_of ? 1.0f / sqrtf(sum_squares(norm_of + i * h, h) / (float)h + eps) : 1.0f;
            for (int64_t r = 0; r < p->rank; r++) {
                float sum = 0.0f;
                for (int k = 0; k < team; k++) sum += parts[k * part_stride + (g + j) * R + r];
                sums[j * R + r] = sum * scale;
            }
        }
        lora_expand_rows(p, lora->w_bf16, sums, R, ys, (int)count, o0, o1, t);
    }
}

/* share t of nt of the outputs of gemv(lin, rows): o0 <= o < o1 */
static inline void gemv_share_outputs_of(const qlinear *lin, int64_t rows, int64_t t, int64_t nt,
                                         int64_t *o0, int64_t *o1) {
    int64_t t0, t1;
    share_bytes_of(lin, rows, t, nt, &t0, &t1);
    *o0 = t0 * ROW_TILE;
    *o1 = t1 * ROW_TILE < rows ? t1 * ROW_TILE : rows;
    if (*o0 > *o1) *o0 = *o1;
}

/* this thread's share of the outputs of gemv(lin, rows) */
static inline void gemv_share_outputs(const qlinear *lin, int64_t rows, int64_t *o0, int64_t *o1) {
    gemv_share_outputs_of(lin, rows, omp_get_thread_num(), omp_get_num_threads(), o0, o1);
}

/* share t of nt of gate_up_act's pairs: j0 <= j < j1 */
static inline void gate_up_share_pairs_of(int64_t inter, int64_t t, int64_t nt, int64_t *j0,
                                          int64_t *j1) {
    int64_t t0, t1;
    share_of((inter + PAIR_TILE - 1) / PAIR_TILE, t, nt, &t0, &t1);
    *j0 = t0 * PAIR_TILE;
    *j1 = t1 * PAIR_TILE < inter ? t1 * PAIR_TILE : inter;
    if (*j0 > *j1) *j0 = *j1;
}

/* this thread's share of gate_up_act's pairs */
static inline void gate_up_share_pairs(int64_t inter, int64_t *j0, int64_t *j1) {
    gate_up_share_pairs_of(inter, omp_get_thread_num(), omp_get_num_threads(), j0, j1);
}

/* The LoRA shrinks of a team other than the plan's (cpu_decode_step_planned): after the barrier
 * that makes the input final, the team's threads take the plan's shares in turn, each share's
 * part in its own slot, so that the sum after the next barrier adds the parts a team of
 * plan_threads would, in its order. which: the shrink after o_proj (gate/up's, into norm_parts),
 * after gate_up_act (down's, into down_parts) or after down (the next layer's q/k/v's). */
enum { LATE_GATE_UP, LATE_DOWN, LATE_NEXT_QKV };
static void lora_shrink_late(const model_desc *m, int64_t l, int which, const float *residual,
                             const float *mlp, int64_t plan, float *norm_parts, float *down_parts,
                             int64_t part_stride, float *xw, float *t) {
    const layer_desc *L = &m->layers[l];
    const int64_t H = m->hidden, inter = m->inter;
    for (int64_t p = omp_get_thread_num(); p < plan; p += omp_get_num_threads()) {
        int64_t c0, c1;
        if (which == LATE_GATE_UP) {
            gemv_share_outputs_of(&L->o_proj, H, p, plan, &c0, &c1);
            lora_shrink_share(m, l, LORA_GATE_UP, residual, H, L->post_norm, c0, c1,
                              norm_parts + p * part_stride, xw, t);
        } else if (which == LATE_DOWN) {
            gate_up_share_pairs_of(inter, p, plan, &c0, &c1);
            lora_shrink_share(m, l, LORA_DOWN, mlp, inter, NULL, c0, c1,
                              down_parts + p * part_stride, xw, t);
        } else {
            gemv_share_outputs_of(&L->down, H, p, plan, &c0, &c1);
            lora_shrink_share(m, l + 1, LORA_QKV, residual, H, m->layers[l + 1].input_norm, c0,
                              c1, norm_parts + p * part_stride, xw, t);
        }
    }
}

/* ------------------------------------------------------------------------------------------ */

int asyncengine_decode_step_planned(const model_desc *m, const float *hidden, int64_t n,
                                    const int64_t *positions, const int64_t *slots,
                                    const int32_t *block_table, int64_t table_stride,
                                    const int32_t *seq_lens, int64_t page_size, float *out,
                                    int threads, int plan_threads);

/* 0 on success, -1 when a buffer could not be allocated (out untouched) */
int asyncengine_decode_step(const model_desc *m, const float *hidden, int64_t n,
                             const int64_t *positions, const int64_t *slots,
                             const int32_t *block_table, int64_t table_stride,
                             const int32_t *seq_lens, int64_t page_size, float *out, int threads) {
    return asyncengine_decode_step_planned(m, hidden, n, positions, slots, block_table,
                                           table_stride, seq_lens, page_size, out, threads,
                                           threads);
}

/* asyncengine_decode_step on a team of `threads`, what it sums in pieces planned for
 * `plan_threads` whatever the team's size (the attention items: split-K ranges; the LoRA
 * shrinks' shares, lora_shrink_late), so that a step gives the same bits on any team (the
 * products split outputs, never a sum) */
int asyncengine_decode_step_planned(const model_desc *m, const float *hidden, int64_t n,
                                    const int64_t *positions, const int64_t *slots,
                                    const int32_t *block_table, int64_t table_stride,
                                    const int32_t *seq_lens, int64_t page_size, float *out,
                                    int threads, int plan_threads) {
    if (plan_threads < 1) plan_threads = 1;
    const int64_t H = m->hidden, D = m->head_dim, heads = m->num_heads;
    const int64_t kv_heads = m->num_kv_heads, group = heads / kv_heads, inter = m->inter;
    const int64_t q_size = heads * D, qkv_size = (heads + 2 * kv_heads) * D;
    const int64_t widest = H > inter ? (H > q_size ? H : q_size) : (inter > q_size ? inter : q_size);

    /* shared: the residual stream, qkv, attention output, MLP hidden */
    float *residual = (float *)malloc((size_t)(n * H) * sizeof(float));
    float *qkv = (float *)malloc((size_t)(n * qkv_size) * sizeof(float));
    float *attn = (float *)malloc((size_t)(n * q_size) * sizeof(float));
    float *mlp = (float *)malloc((size_t)(n * inter) * sizeof(float));
    /* a sublayer's output before its sandwich norm (Gemma 3) */
    float *sub = (float *)malloc((size_t)(n * H) * sizeof(float));
    int64_t *order = (int64_t *)malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    atomic_llong *claimed = (atomic_llong *)malloc((size_t)m->num_layers * sizeof(atomic_llong));
    /* split-K (plan_items): the ranges' states, and a counter per (layer, unit) */
    const int64_t units = n * kv_heads * ((group + ATTN_MAX_GROUP - 1) / ATTN_MAX_GROUP);
    const int may_split = units < 4 * (int64_t)plan_threads;
    float *parts = may_split ? (float *)malloc((size_t)split_floats(n, kv_heads, group, D) *
                                               sizeof(float) + 1)
                             : NULL;
    atomic_int *done_ranges =
        may_split ? (atomic_int *)malloc((size_t)(m->num_layers * units + 1) * sizeof(atomic_int))
                  : NULL;
    const lora_desc *lora = m->lora;
    /* LoRA: gate/up updates [n, 2 inter]; each thread's rank scratch */
    float *lora_gu = lora ? (float *)malloc((size_t)(n * 2 * inter) * sizeof(float)) : NULL;
    const int64_t lora_scratch = lora ? 2 * LORA_ROWS * lora->max_rank + 1 : 0;
    /* the shrinks' parts (lora_shrink_share): q/k/v's and gate/up's, then down's, per thread */
    const int64_t part_stride = lora ? lora->n_order * lora->max_rank : 0;
    const int64_t part_slots = threads > plan_threads ? threads : plan_threads;
    float *lora_parts =
        lora ? (float *)malloc((size_t)(2 * part_slots * part_stride + 1) * sizeof(float)) : NULL;
    int failed = !residual || !qkv || !attn || !mlp || !sub || !order || !claimed ||
                 (may_split && (!parts || !done_ranges)) || (lora && (!lora_gu || !lora_parts));
    if (failed) goto done;
    sort_rows(order, n, seq_lens);
    for (int64_t l = 0; l < m->num_layers; l++) atomic_init(&claimed[l], 0);
    if (may_split)
        for (int64_t u = 0; u < m->num_layers * units; u++) atomic_init(&done_ranges[u], 0);
    memcpy(residual, hidden, (size_t)(n * H) * sizeof(float));
    team_barrier phase_barrier;
    atomic_init(&phase_barrier.arrived, 0);
    atomic_init(&phase_barrier.sense, 0);

#pragma omp parallel num_threads(threads)
    {
#pragma omp master
        phase_barrier.threads = omp_get_num_threads(); /* the team may be smaller than asked;
                                                          published by the barrier below */
        /* private: the normed rows, their q8 form */
        float *x = (float *)malloc((size_t)(n * H) * sizeof(float));
        act_buf a = {(int8_t *)malloc((size_t)(n * widest)),
                     (float *)malloc((size_t)(n * widest / QK) * sizeof(float)),
                     (float *)malloc((size_t)(n * widest / QK) * sizeof(float)), NULL, 0};
        float *lora_t = lora ? (float *)malloc((size_t)lora_scratch * sizeof(float)) : NULL;
        float *lora_xw =
            lora ? (float *)malloc((size_t)(LORA_ROWS * (inter > H ? inter : H)) * sizeof(float))
                 : NULL;
        if (!(x && a.q && a.d && a.sd) || (lora && !(lora_t && lora_xw))) {
#pragma omp atomic write
            failed = 1;
        }
        /* every thread takes the same path through the barriers below */
#pragma omp barrier
        int seen_failed;
#pragma omp atomic read
        seen_failed = failed;
        const int ok = !seen_failed;
        int my_sense = 0;
        const attn_items items = plan_items(order, n, kv_heads, group, plan_threads, seq_lens);
        /* LoRA shrinks: each thread its own share where the team is the plan's, else the plan's
         * shares after the barrier (lora_shrink_late); summed over the plan's parts either way */
        const int team = plan_threads, late = phase_barrier.threads != plan_threads;
        float *const norm_parts = lora_parts, *const down_parts = lora_parts + team * part_stride;
        float *const my_norm_part = norm_parts + omp_get_thread_num() * part_stride;
        float *const my_down_part = down_parts + omp_get_thread_num() * part_stride;
        if (ok) {
            for (int64_t l = 0; l < m->num_layers; l++) {
                const layer_desc *L = &m->layers[l];
                const float *rope = L->cos_sin ? L->cos_sin : m->cos_sin;
                for (int64_t i = 0; i < n; i++)
                    rms_norm_row(residual + i * H, L->input_norm, H, m->eps, x + i * H);
                quantize_rows(x, n, H, &a, needs_q8(&L->qkv));
                gemv(&L->qkv, qkv_size, &a, n, qkv, qkv_size, 0);
                if (lora && l == 0)
                    lora_gemv_share(m, l, LORA_QKV, &L->qkv, qkv_size, x, H, qkv, qkv_size, lora_t);
                if (lora && l > 0) { /* the parts the last layer's down phase left */
                    int64_t o0, o1;
                    gemv_share_outputs(&L->qkv, qkv_size, &o0, &o1);
                    lora_expand_share(m, l, LORA_QKV, norm_parts, part_stride, team, residual, H,
                                      m->eps, qkv, qkv_size, o0, o1, 0, lora_t);
                }
                prefetch_gemv_share(&L->o_proj, H);
                barrier_wait(&phase_barrier, &my_sense);

                const int one = n == 1; /* the new K/V in registers, no store phase */
                if (!one) {
                    int64_t first, last;
                    share(n * kv_heads, &first, &last);
                    for (int64_t item = first; item < last; item++) {
                        const int64_t i = item / kv_heads, h = item % kv_heads;
                        if (slots[i] < 0) continue; /* a padding row writes nothing */
                        const float *row = qkv + i * qkv_size;
                        const float *cs = rope + positions[i] * D;
                        float k_rot[MAX_HEAD_DIM];
                        norm_rotate(row + (heads + h) * D, L->k_norm, m->eps, cs, D, k_rot);
                        kv_store_row(L->k_cache + (slots[i] * kv_heads + h) * KV_ROW(D), k_rot, D);
                        kv_store_row(L->v_cache + (slots[i] * kv_heads + h) * KV_ROW(D),
                                     row + (heads + kv_heads + h) * D, D);
                    }
                barrier_wait(&phase_barrier, &my_sense);
                }

                for (int64_t item; (item = atomic_fetch_add_explicit(
                                        &claimed[l], 1, memory_order_relaxed)) < items.count;) {
                    const attn_item it =
                        item_at(&items, item, kv_heads, group, seq_lens, L->window);
                    const int64_t i = it.row, kvh = it.kv0;
                    const float *row = qkv + i * qkv_size, *cs = rope + positions[i] * D;
                    float *out_heads = attn + i * q_size + it.h0 * D;
                    /* rotated q, into its output's place; a split-K range's into its own (the
                     * unit's other ranges read theirs meanwhile, and the last one writes out) */
                    float q_own[ATTN_MAX_HEADS * MAX_HEAD_DIM];
                    float *q_heads = items.splits > 1 ? q_own : out_heads;
                    for (int64_t c = 0; c < it.kvc; c++)
                        for (int64_t g = 0; g < it.gc; g++) {
                            const int64_t h = (it.kv0 + c) * group + it.h0 - it.kv0 * group + g;
                            norm_rotate(row + h * D, L->q_norm, m->eps, cs, D,
                                        q_heads + (h - it.h0) * D);
                        }
                    /* one row: its new K/V as the pool holds them (float16 rounded), the item's
                     * kv heads' rows in a row (a split-K range may take them all) */
                    kv_t k_new[ATTN_MAX_HEADS * (MAX_HEAD_DIM + KV_ROW_EXTRA)];
                    kv_t v_new[ATTN_MAX_HEADS * (MAX_HEAD_DIM + KV_ROW_EXTRA)];
                    if (one) {
                        for (int64_t c = 0; c < it.kvc; c++) {
                            float k_rot[MAX_HEAD_DIM];
                            norm_rotate(row + (heads + kvh + c) * D, L->k_norm, m->eps, cs,
                                        D, k_rot);
                            kv_store_row(k_new + c * KV_ROW(D), k_rot, D);
                            kv_store_row(v_new + c * KV_ROW(D),
                                         row + (heads + kv_heads + kvh + c) * D, D);
                        }
                        /* the group's first chunk stores its K/V (a padding row: nothing); of
                         * split-K ranges, the last one (no other range reads that key) */
                        if (it.h0 == kvh * group && it.split == items.splits - 1 &&
                            slots[i] >= 0) {
                            memcpy(L->k_cache + (slots[i] * kv_heads + kvh) * KV_ROW(D), k_new,
                                   (size_t)(it.kvc * KV_ROW(D)) * sizeof(kv_t));
                            memcpy(L->v_cache + (slots[i] * kv_heads + kvh) * KV_ROW(D), v_new,
                                   (size_t)(it.kvc * KV_ROW(D)) * sizeof(kv_t));
                        }
                    }
                    attention_item(&items, &it, q_heads, L->k_cache, L->v_cache,
                                   block_table + i * table_stride, seq_lens[i], page_size,
                                   kv_heads, D, m->scale, L->softcap, one ? k_new : NULL,
                                   one ? v_new : NULL, out_heads, parts,
                                   done_ranges ? done_ranges + l * units : NULL);
                }
                barrier_wait(&phase_barrier, &my_sense);

                quantize_rows(attn, n, q_size, &a, needs_q8(&L->o_proj));
                if (L->attn_out_norm) { /* normed before it is added: a phase of its own */
                    gemv(&L->o_proj, H, &a, n, sub, H, 0);
                    barrier_wait(&phase_barrier, &my_sense);
                    add_normed_rows(sub, L->attn_out_norm, n, H, m->eps, residual);
                } else {
                    gemv(&L->o_proj, H, &a, n, residual, H, 1);
                }
                if (lora) {
                    lora_gemv_share(m, l, LORA_O, &L->o_proj, H, attn, q_size, residual, H, lora_t);
                    int64_t o0, o1; /* this thread's share of the residual is final: gate/up's */
                    gemv_share_outputs(&L->o_proj, H, &o0, &o1);
                    if (!late)
                        lora_shrink_share(m, l, LORA_GATE_UP, residual, H, L->post_norm, o0, o1,
                                          my_norm_part, lora_xw, lora_t);
                }
                prefetch_gate_up_share(&L->gate_up, inter);
                barrier_wait(&phase_barrier, &my_sense);
                if (lora && late) {
                    lora_shrink_late(m, l, LATE_GATE_UP, residual, mlp, plan_threads, norm_parts,
                                     down_parts, part_stride, lora_xw, lora_t);
                    barrier_wait(&phase_barrier, &my_sense);
                }

                for (int64_t i = 0; i < n; i++)
                    rms_norm_row(residual + i * H, L->post_norm, H, m->eps, x + i * H);
                quantize_rows(x, n, H, &a, needs_q8(&L->gate_up));
                if (lora) {
                    int64_t j0, j1;
                    gate_up_share_pairs(inter, &j0, &j1);
                    for (int64_t i = 0; i < n && j0 < j1; i++) {
                        memset(lora_gu + i * 2 * inter + j0, 0, (size_t)(j1 - j0) * sizeof(float));
                        memset(lora_gu + i * 2 * inter + inter + j0, 0,
                               (size_t)(j1 - j0) * sizeof(float));
                    }
                    lora_expand_share(m, l, LORA_GATE_UP, norm_parts, part_stride, team, residual,
                                      H, m->eps, lora_gu, 2 * inter, j0, j1, 0, lora_t);
                    lora_expand_share(m, l, LORA_GATE_UP, norm_parts, part_stride, team, residual,
                                      H, m->eps, lora_gu, 2 * inter, inter + j0, inter + j1, 0,
                                      lora_t);
                }
                gate_up_act(&L->gate_up, inter, &a, n, mlp, lora ? lora_gu : NULL, (int)m->gelu);
                if (lora && !late) { /* this thread's pairs of mlp are final: down's shrink */
                    int64_t j0, j1;
                    gate_up_share_pairs(inter, &j0, &j1);
                    lora_shrink_share(m, l, LORA_DOWN, mlp, inter, NULL, j0, j1, my_down_part,
                                      lora_xw, lora_t);
                }
                prefetch_gemv_share(&L->down, H);
                barrier_wait(&phase_barrier, &my_sense);
                if (lora && late) {
                    lora_shrink_late(m, l, LATE_DOWN, residual, mlp, plan_threads, norm_parts,
                                     down_parts, part_stride, lora_xw, lora_t);
                    barrier_wait(&phase_barrier, &my_sense);
                }

                quantize_rows(mlp, n, inter, &a, needs_q8(&L->down));
                if (L->mlp_out_norm) {
                    gemv(&L->down, H, &a, n, sub, H, 0);
                    barrier_wait(&phase_barrier, &my_sense);
                    add_normed_rows(sub, L->mlp_out_norm, n, H, m->eps, residual);
                } else {
                    gemv(&L->down, H, &a, n, residual, H, 1);
                }
                if (lora) {
                    int64_t o0, o1;
                    gemv_share_outputs(&L->down, H, &o0, &o1);
                    lora_expand_share(m, l, LORA_DOWN, down_parts, part_stride, team, NULL, H,
                                      m->eps, residual, H, o0, o1, 0, lora_t);
                    if (l + 1 < m->num_layers && !late) /* the next q/k/v's, over this share */
                        lora_shrink_share(m, l + 1, LORA_QKV, residual, H,
                                          m->layers[l + 1].input_norm, o0, o1, my_norm_part,
                                          lora_xw, lora_t);
                }
                if (l + 1 < m->num_layers) prefetch_gemv_share(&m->layers[l + 1].qkv, qkv_size);
                barrier_wait(&phase_barrier, &my_sense);
                if (lora && late && l + 1 < m->num_layers) {
                    lora_shrink_late(m, l, LATE_NEXT_QKV, residual, mlp, plan_threads, norm_parts,
                                     down_parts, part_stride, lora_xw, lora_t);
                    barrier_wait(&phase_barrier, &my_sense);
                }
            }
#pragma omp for schedule(static)
            for (int64_t i = 0; i < n; i++)
                rms_norm_row(residual + i * H, m->final_norm, H, m->eps, out + i * H);
        }
        free(x);
        free(a.q);
        free(a.d);
        free(a.sd);
        free(lora_t);
        free(lora_xw);
    }
done:
    free(parts);
    free((void *)done_ranges);
    free(residual);
    free(qkv);
    free(attn);
    free(mlp);
    free(sub);
    free(order);
    free((void *)claimed);
    free(lora_gu);
    free(lora_parts);
    return failed ? -1 : 0;
}

/* The attention phase alone, over queries already rotated: q and out [n, heads, head_dim]
 * float32 (the pool: kv_t), the same items and claims as a step's layer (window: a sliding
 * layer's, 0: every key; softcap: a soft-capped layer's, 0: none). For the kernel tests against
 * the torch reference (tests/kernels/test_fused_attention.py). 0 on success, -1 when a buffer
 * could not be allocated or the shape is outside what the step takes. */
int asyncengine_group_attention(const float *q, const kv_t *k_cache, const kv_t *v_cache,
                                const int32_t *block_table, int64_t table_stride,
                                const int32_t *seq_lens, int64_t n, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, int64_t page_size, float scale,
                                int64_t window, float softcap, float *out, int threads) {
    if (kv_heads <= 0 || heads % kv_heads || head_dim > ATTN_MAX_DIM) return -1;
    const int64_t group = heads / kv_heads, D = head_dim;
    const int64_t units = n * kv_heads * ((group + ATTN_MAX_GROUP - 1) / ATTN_MAX_GROUP);
    int64_t *order = (int64_t *)malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    float *parts = (float *)malloc((size_t)split_floats(n, kv_heads, group, D) * sizeof(float) + 1);
    atomic_int *done = (atomic_int *)malloc((size_t)(units + 1) * sizeof(atomic_int));
    if (!order || !parts || !done) {
        free(order);
        free(parts);
        free((void *)done);
        return -1;
    }
    sort_rows(order, n, seq_lens);
    for (int64_t u = 0; u < units; u++) atomic_init(&done[u], 0);
    atomic_llong claimed;
    atomic_init(&claimed, 0);
#pragma omp parallel num_threads(threads)
    {
        const attn_items items =
            plan_items(order, n, kv_heads, group, omp_get_num_threads(), seq_lens);
        for (int64_t item; (item = atomic_fetch_add_explicit(&claimed, 1, memory_order_relaxed)) <
                           items.count;) {
            const attn_item it = item_at(&items, item, kv_heads, group, seq_lens, window);
            attention_item(&items, &it, q + (it.row * heads + it.h0) * D, k_cache, v_cache,
                           block_table + it.row * table_stride, seq_lens[it.row], page_size,
                           kv_heads, D, scale, softcap, NULL, NULL,
                           out + (it.row * heads + it.h0) * D, parts, done);
        }
    }
    free(order);
    free(parts);
    free((void *)done);
    return 0;
}
