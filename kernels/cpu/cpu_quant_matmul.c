/* Matrix products with weights kept in their GGUF block formats, on the CPU.
 *
 *   y[i, r] = sum_k x[i, k] * W[r, k]      W: [rows, k] in one of the formats below, row-major
 *                                          (each row is k / block_size blocks, as GGUF stores them)
 *
 * The activation rows are first quantized to blocks of 32 int8 values with one float scale
 * (d = max|x| / 127, q = round(x / d)) and the block's d * sum(q) kept beside it
 * (asyncengine_quantize_q8); every weight block then meets its activation block in an integer
 * dot product (u8 x s8 -> s32), scaled once per block in float. This is the scheme of
 * llama.cpp's ggml-cpu (q8 activations against q4/q8 weights), written for our layout:
 *
 *   format  block  bytes  value of element j
 *   Q8_0     32     34    d * q[j]                            (fp16 d, int8 q)
 *   Q4_0     32     18    d * (q[j] - 8)                      (fp16 d, nibbles)
 *   Q4_1     32     20    d * q[j] + m                        (fp16 d, fp16 m, nibbles)
 *   Q5_0     32     22    d * (q[j] - 16)                     (fp16 d, 4 bytes of fifth bits
 *                                                              (bit j: q[j]'s), nibbles)
 *   Q5_1     32     24    d * q[j] + m                        (fp16 d, fp16 m, fifth bits,
 *                                                              nibbles)
 *   Q4_K    256    144    d * sc_s * q[j] - dmin * m_s        (8 sub-blocks of 32, 6-bit sc/m)
 *   Q5_K    256    176    as Q4_K with a fifth bit per value  (qh)
 *   Q6_K    256    210    d * sc_s * (q[j] - 32)              (16 sub-blocks of 16, int8 sc)
 *   I8      row   4 + k   s * q[j]                            (our int8: one float32 scale per
 *                                                              row, then the row's int8 values)
 *   F32     1      4      w[j]                                (a dense float32 weight as it is:
 *                                                              it meets the float32 activations,
 *                                                              not their q8 form; see row_f32)
 *   BF16    1      2      w[j]                                (a dense bfloat16 weight as it is,
 *                                                              widened to float32 as it is read:
 *                                                              as F32, see row_bf16)
 *
 * Offsets (Q4_0's -8, Q5_0's -16, Q4_1's and Q5_1's m, the K formats' mins) multiply the
 * activation block's sum, so the integer products take the unsigned values as stored. Q8_0 and
 * Q6_K (signed values) use the sign trick: |w| (u8) times x carrying w's sign (s8).
 *
 * ISA, chosen when the library is compiled for this CPU (cc -march=native, at first use):
 *   AVX512_VNNI (+VL)  vpdpbusd: u8 x s8 summed into s32 in one instruction
 *   AVX2               vpmaddubsw + vpmaddwd (the same sums, no overflow for these ranges)
 *   scalar             everything else (and the reference the SIMD paths are tested against)
 * -DQ_FORCE_AVX2 / -DQ_FORCE_SCALAR pick a narrower path on a wider CPU (kernel tests run them).
 *
 * Parallel over tiles of weight rows (each thread streams its own rows once); within a tile,
 * up to four activation rows share each unpacked weight block (small-batch GEMM).
 * Built by kernels/cpu/cpu_native.py.
 */
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cpu_quant_blocks.h"

const char *asyncengine_quant_isa(void) {
#if defined(Q_ISA_VNNI)
    return "avx512vnni";
#elif defined(Q_ISA_AVX2)
    return "avx2";
#else
    return "scalar";
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* activations                                                                               */

/* x [n, k] (float32 or bf16) -> q [n, k] int8, d and d * sum(q) [n, k / 32] */
void asyncengine_quantize_q8(const void *x, int64_t n, int64_t k, int bf16, int8_t *q, float *d,
                             float *sd, int threads) {
    const int64_t nb = k / QK;
#pragma omp parallel for schedule(static) num_threads(threads) if (n * k >= 65536)
    for (int64_t i = 0; i < n; i++) {
        float v[QK];
        for (int64_t b = 0; b < nb; b++) {
            const int64_t off = i * k + b * QK;
            if (bf16) {
                const uint16_t *src = (const uint16_t *)x + off;
                for (int j = 0; j < QK; j++) v[j] = bf16_to_float(src[j]);
            } else {
                memcpy(v, (const float *)x + off, sizeof v);
            }
            quantize_block_q8(v, q + off, d + i * nb + b, sd + i * nb + b);
        }
    }
}

static inline void store_out(void *y, int64_t at, float v, int out_bf16) {
    if (out_bf16) ((uint16_t *)y)[at] = float_to_bf16(v);
    else ((float *)y)[at] = v;
}

/* W's rows 0..rows-1 in interleaved groups of XR (the rest as they were) into dst, the same size
 * as w (the layout: cpu_quant_blocks.h) */
void asyncengine_interleave_rows(int fmt, const uint8_t *w, int64_t row_bytes, int64_t rows,
                                 int64_t k, uint8_t *dst) {
    const int64_t grouped = interleaves(fmt) ? rows / XR * XR : 0;
    memcpy(dst + grouped * row_bytes, w + grouped * row_bytes,
           (size_t)((rows - grouped) * row_bytes));
    for (int64_t g = 0; g < grouped; g += XR)
        interleave_group(fmt, w + g * row_bytes, row_bytes, k, dst + g * row_bytes, 0);
}

/* activation rows i0..i0 + nr - 1 as the row kernels take them: their q8 form (xq: NULL for F32
 * weights, which read the float32 rows xf instead) */
static inline void act_rows(const int8_t *xq, const float *xd, const float *xsd, const float *xf,
                            int64_t k, int64_t i0, int nr, act_row *a) {
    const int64_t nb = k / QK;
    for (int r = 0; r < nr; r++) {
        const int64_t i = i0 + r;
        a[r] = (act_row){xq ? xq + i * k : NULL, xq ? xd + i * nb : NULL,
                         xq ? xsd + i * nb : NULL, xf ? xf + i * k : NULL};
    }
}

#define ACT_CHUNK 64 /* a multiple of NR and of KR */

/* asyncengine_quant_matmul's tiles t_first..t_last - 1 (one thread's share) */
static void matmul_tiles(int fmt, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t k,
                         int64_t grouped, const int8_t *xq, const float *xd, const float *xsd,
                         const float *xf, int64_t n, const float *bias, void *y, int64_t ldy,
                         int out_bf16, int64_t t_first, int64_t t_last) {
    /* the interleaved groups: the activation rows ACT_CHUNK at a time, each chunk meeting all
     * of this thread's groups while it stays in L1/L2 (group after group over all the rows
     * of a 1024-token prefill streamed them from L3 for each group) */
    const int64_t g_first = t_first * ROW_TILE, g_last = t_last * ROW_TILE < grouped
                                                             ? t_last * ROW_TILE : grouped;
    const int tile = group_tile_rows(fmt);
    for (int64_t c0 = 0; c0 < n && g_first < g_last; c0 += ACT_CHUNK) {
        const int64_t c1 = c0 + ACT_CHUNK < n ? c0 + ACT_CHUNK : n;
        for (int64_t g = g_first; g < g_last; g += XR) {
            for (int64_t i0 = c0; i0 < c1; i0 += tile) {
                const int nr = (int)(c1 - i0 < tile ? c1 - i0 : tile);
                act_row a[GR_MAX];
                act_rows(xq, xd, xsd, xf, k, i0, nr, a);
                float out[GR_MAX * XR];
                group_dot_rows(fmt, w + g * row_bytes, k, a, nr, out);
                for (int r = 0; r < nr; r++)
                    for (int j = 0; j < XR; j++)
                        store_out(y, (i0 + r) * ldy + g + j,
                                  out[r * XR + j] + (bias ? bias[g + j] : 0.0f), out_bf16);
            }
        }
    }
    /* the rows as stored (formats without groups, a weight's last rows / XR * XR.. rows) */
    for (int64_t t = t_first; t < t_last; t++) {
        const int64_t r0 = t * ROW_TILE, r1 = r0 + ROW_TILE < rows ? r0 + ROW_TILE : rows;
        /* ROW_TILE is a multiple of XR: a tile's rows below `grouped` are whole groups */
        const int64_t g1 = r1 < grouped ? r1 : grouped;
        if (g1 > r0 && g1 >= r1) continue;
        for (int64_t i0 = 0; i0 < n; i0 += NR) {
            const int nr = (int)(n - i0 < NR ? n - i0 : NR);
            act_row a[NR];
            act_rows(xq, xd, xsd, xf, k, i0, nr, a);
            int64_t row = g1 > r0 ? g1 : r0;
            if (nr == 1) { /* one activation row: weight rows in pairs where the format can */
                for (float out[2]; row + 1 < r1; row += 2) {
                    if (!row_pair_dot(fmt, w + row * row_bytes, w + (row + 1) * row_bytes, k, a,
                                      out))
                        break;
                    for (int r = 0; r < 2; r++) {
                        const float v = out[r] + (bias ? bias[row + r] : 0.0f);
                        if (out_bf16) ((uint16_t *)y)[i0 * ldy + row + r] = float_to_bf16(v);
                        else ((float *)y)[i0 * ldy + row + r] = v;
                    }
                }
            } else if (float_rows(fmt)) { /* several: F32 / BF16 weight rows in pairs too */
                for (float out[2 * NR]; row + 1 < r1; row += 2) {
                    row_pair_float(fmt, w + row * row_bytes, w + (row + 1) * row_bytes, k, a, nr,
                                   out);
                    for (int r = 0; r < nr; r++)
                        for (int p = 0; p < 2; p++)
                            store_out(y, (i0 + r) * ldy + row + p,
                                      out[p * NR + r] + (bias ? bias[row + p] : 0.0f), out_bf16);
                }
            }
            for (; row < r1; row++) {
                float out[NR];
                if (nr == NR) row_dot(fmt, w + row * row_bytes, k, a, NR, out);
                else if (nr == 1) row_dot(fmt, w + row * row_bytes, k, a, 1, out);
                else row_dot(fmt, w + row * row_bytes, k, a, nr, out);
                const float b = bias ? bias[row] : 0.0f;
                for (int r = 0; r < nr; r++) {
                    const float v = out[r] + b;
                    if (out_bf16) ((uint16_t *)y)[(i0 + r) * ldy + row] = float_to_bf16(v);
                    else ((float *)y)[(i0 + r) * ldy + row] = v;
                }
            }
        }
    }
}

/* y [n, ldy] (float32 or bf16) columns 0..rows-1 = x W^T (+ bias), from quantize_q8's output
 * (xq, xd, xsd) or, for F32 weights, from the float32 rows xf [n, k];
 * interleaved: W's first rows / XR * XR rows are interleaved groups (asyncengine_interleave_rows).
 * Parallel over tiles of ROW_TILE weight rows, each thread a contiguous share of them. */
void asyncengine_quant_matmul(int fmt, const uint8_t *w, int64_t row_bytes, int64_t rows,
                              int64_t k, int interleaved, const int8_t *xq, const float *xd,
                              const float *xsd, const float *xf, int64_t n, const float *bias,
                              void *y, int64_t ldy, int out_bf16, int threads) {
    const int64_t tiles = (rows + ROW_TILE - 1) / ROW_TILE;
    const int64_t grouped = interleaved && interleaves(fmt) ? rows / XR * XR : 0;
#pragma omp parallel num_threads(threads) if (tiles > 1)
    {
        const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
        matmul_tiles(fmt, w, row_bytes, rows, k, grouped, xq, xd, xsd, xf, n, bias, y, ldy,
                     out_bf16, tiles * me / nt, tiles * (me + 1) / nt);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* dequantization (embedding rows, the dense path for large batches, tests)                   */

static void dequantize_row(int fmt, const uint8_t *w, int64_t k, float *y) {
    switch (fmt) {
    case FMT_Q8_0:
        for (int64_t b = 0; b < k / QK; b++, w += 34) {
            const float d = fp16_to_float(w);
            for (int j = 0; j < QK; j++) y[b * QK + j] = d * (float)((const int8_t *)(w + 2))[j];
        }
        break;
    case FMT_Q4_0:
    case FMT_Q4_1:
    case FMT_Q5_0:
    case FMT_Q5_1: {
        const int has_min = has_min_of(fmt), has_high = has_high_of(fmt);
        for (int64_t b = 0; b < k / QK; b++, w += q4_block_bytes(has_min, has_high)) {
            const float d = fp16_to_float(w);
            const float m = has_min ? fp16_to_float(w + 2) : -q4_mid(has_high) * d;
            const uint8_t *qh = w + 2 + 2 * has_min, *qs = w + q4_qs_at(has_min, has_high);
            for (int j = 0; j < 16; j++) {
                int lo = qs[j] & 0xF, hi = qs[j] >> 4;
                if (has_high) {
                    lo |= ((qh[j / 8] >> (j % 8)) & 1) << 4;
                    hi |= ((qh[2 + j / 8] >> (j % 8)) & 1) << 4;
                }
                y[b * QK + j] = d * (float)lo + m;
                y[b * QK + j + 16] = d * (float)hi + m;
            }
        }
        break;
    }
    case FMT_Q4_K:
    case FMT_Q5_K: {
        const int has_high = fmt == FMT_Q5_K;
        for (int64_t s = 0; s < k / QK_K; s++, w += has_high ? 176 : 144) {
            const float d = fp16_to_float(w), dmin = fp16_to_float(w + 2);
            const uint8_t *qh = w + 16, *qs = w + (has_high ? 48 : 16);
            float *out = y + s * QK_K;
            for (int c = 0; c < 4; c++) {
                int sc_lo, m_lo, sc_hi, m_hi;
                k_scale_min(2 * c, w + 4, &sc_lo, &m_lo);
                k_scale_min(2 * c + 1, w + 4, &sc_hi, &m_hi);
                for (int l = 0; l < 32; l++) {
                    int v_lo = qs[32 * c + l] & 0xF, v_hi = qs[32 * c + l] >> 4;
                    if (has_high) {
                        v_lo += (qh[l] & (1 << (2 * c))) ? 16 : 0;
                        v_hi += (qh[l] & (2 << (2 * c))) ? 16 : 0;
                    }
                    out[64 * c + l] = d * (float)sc_lo * (float)v_lo - dmin * (float)m_lo;
                    out[64 * c + 32 + l] = d * (float)sc_hi * (float)v_hi - dmin * (float)m_hi;
                }
            }
        }
        break;
    }
    case FMT_Q6_K:
        for (int64_t s = 0; s < k / QK_K; s++, w += 210) {
            const uint8_t *ql = w, *qh = w + 128;
            const int8_t *sc = (const int8_t *)(w + 192);
            const float d = fp16_to_float(w + 208);
            float *out = y + s * QK_K;
            for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, out += 128) {
                for (int l = 0; l < 32; l++) {
                    const int is = l / 16;
                    const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    out[l] = d * (float)sc[is] * (float)q1;
                    out[l + 32] = d * (float)sc[is + 2] * (float)q2;
                    out[l + 64] = d * (float)sc[is + 4] * (float)q3;
                    out[l + 96] = d * (float)sc[is + 6] * (float)q4;
                }
            }
        }
        break;
    case FMT_I8: {
        float scale;
        memcpy(&scale, w, 4);
        for (int64_t j = 0; j < k; j++) y[j] = scale * (float)((const int8_t *)(w + 4))[j];
        break;
    }
    case FMT_F32: memcpy(y, w, (size_t)k * sizeof(float)); break;
    case FMT_BF16:
        for (int64_t j = 0; j < k; j++) y[j] = bf16_to_float(((const uint16_t *)w)[j]);
        break;
    default: break;
    }
}

/* out [count, k] (float32 or bf16) = rows row_ids (NULL: 0..count-1) of W, dequantized */
/* interleaved (rows as asyncengine_quant_matmul's): rows below rows / XR * XR of a weight of
 * `rows` rows are taken out of their groups first */
void asyncengine_dequantize_rows(int fmt, const uint8_t *w, int64_t row_bytes, int64_t k,
                                 int64_t rows, int interleaved, const int64_t *row_ids,
                                 int64_t count, void *out, int out_bf16, int threads) {
    const int64_t grouped = interleaved && interleaves(fmt) ? rows / XR * XR : 0;
#pragma omp parallel num_threads(threads) if (count * k >= 65536)
    {
        float *tmp = out_bf16 ? (float *)malloc((size_t)k * sizeof(float)) : NULL;
        uint8_t *group = grouped ? (uint8_t *)malloc((size_t)(XR * row_bytes)) : NULL;
        int64_t unpacked = -1; /* the group now in `group` */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++) {
            const int64_t row = row_ids ? row_ids[i] : i;
            const uint8_t *src = w + row * row_bytes;
            if (row < grouped) {
                const int64_t g = row / XR * XR;
                if (g != unpacked)
                    interleave_group(fmt, group, row_bytes, k, (uint8_t *)w + g * row_bytes, 1);
                unpacked = g;
                src = group + (row - g) * row_bytes;
            }
            if (!out_bf16) {
                dequantize_row(fmt, src, k, (float *)out + i * k);
                continue;
            }
            dequantize_row(fmt, src, k, tmp);
            uint16_t *dst = (uint16_t *)out + i * k;
            for (int64_t j = 0; j < k; j++) dst[j] = float_to_bf16(tmp[j]);
        }
        free(tmp);
        free(group);
    }
}

/* quantize_q8 then quant_matmul in one call (the activations in a scratch buffer): one call per
 * projection, which is what a batch-1 decode step is made of. F32 weights take x as it is
 * (float32 x only: the caller checks); BF16 weights take float32 x as it is and bf16 x widened
 * to float32 (exact) in a scratch buffer. */
void asyncengine_quant_linear(int fmt, const uint8_t *w, int64_t row_bytes, int64_t rows,
                              int64_t k, int interleaved, const void *x, int64_t n, int x_bf16,
                              const float *bias, void *y, int64_t ldy, int out_bf16, int threads) {
    if (fmt == FMT_F32 || (fmt == FMT_BF16 && !x_bf16)) {
        if (!x_bf16)
            asyncengine_quant_matmul(fmt, w, row_bytes, rows, k, interleaved, NULL, NULL, NULL,
                                     (const float *)x, n, bias, y, ldy, out_bf16, threads);
        return;
    }
    if (fmt == FMT_BF16) {
        float *xf = (float *)malloc((size_t)(n * k) * sizeof(float));
        if (xf) {
            for (int64_t i = 0; i < n * k; i++) xf[i] = bf16_to_float(((const uint16_t *)x)[i]);
            asyncengine_quant_matmul(fmt, w, row_bytes, rows, k, interleaved, NULL, NULL, NULL, xf,
                                     n, bias, y, ldy, out_bf16, threads);
        }
        free(xf);
        return;
    }
    const int64_t nb = k / QK;
    int8_t *q = (int8_t *)malloc((size_t)(n * k));
    float *d = (float *)malloc((size_t)(n * nb) * sizeof(float));
    float *sd = (float *)malloc((size_t)(n * nb) * sizeof(float));
    if (q && d && sd) {
        asyncengine_quantize_q8(x, n, k, x_bf16, q, d, sd, threads);
        asyncengine_quant_matmul(fmt, w, row_bytes, rows, k, interleaved, q, d, sd, NULL, n, bias,
                                 y, ldy, out_bf16, threads);
    }
    free(q);
    free(d);
    free(sd);
}
