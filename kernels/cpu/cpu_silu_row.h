/* One row of SwiGLU, y = bf(bf(silu(gate)) * up) (kernels/reference/activation_ref.py), as
 * float32 values already rounded to the dtype: shared by cpu_layer_ops.c's silu_and_mul and the
 * int8 product that quantizes the row as it is made (cpu_quant_i8gemm.c), so the two agree to
 * the bit. "bf(.)" rounds to bfloat16 (nearest even) for bf16 rows and is nothing for float32. */
#ifndef ASYNCENGINE_CPU_SILU_ROW_H
#define ASYNCENGINE_CPU_SILU_ROW_H

#include "cpu_simd.h"

static inline float silu_value_at(const void *x, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static inline float silu_rounded(float v, int bf16) {
    return bf16 ? bf16_to_float(float_to_bf16(v)) : v;
}

/* y[0 .. inter - 1] from row `row` of x [n, 2 inter] = gate | up (bfloat16 or float32): in x's
 * dtype where `as_x`, else float32 (the same values) */
static inline void silu_mul_row(const void *x, int64_t row, int64_t inter, int bf16, void *y,
                                int as_x) {
    const int64_t g0 = row * 2 * inter, u0 = g0 + inter;
    const int bf16_out = bf16 && as_x;
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= inter; i += 16) {
        const __m512 g = bf16 ? load_bf16x16((const uint16_t *)x + g0 + i)
                              : _mm512_loadu_ps((const float *)x + g0 + i);
        const __m512 u = bf16 ? load_bf16x16((const uint16_t *)x + u0 + i)
                              : _mm512_loadu_ps((const float *)x + u0 + i);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
        if (bf16) silu = round_bf16x16(silu);
        const __m512 p = _mm512_mul_ps(silu, u);
        if (bf16_out) _mm256_storeu_si256((__m256i *)((uint16_t *)y + i), to_bf16x16(p));
        else _mm512_storeu_ps((float *)y + i, bf16 ? round_bf16x16(p) : p);
    }
#endif
    for (; i < inter; i++) {
        const float g = silu_value_at(x, g0 + i, bf16);
        const float silu = silu_rounded(g / (1.0f + expf(-g)), bf16);
        const float p = silu * silu_value_at(x, u0 + i, bf16);
        if (bf16_out) ((uint16_t *)y)[i] = float_to_bf16(p);
        else ((float *)y)[i] = silu_rounded(p, bf16);
    }
}

#endif
