/*
 * The elementwise parts of a decoder layer for fp32 activations on the CPU: fused residual-add +
 * RMSNorm, rotary embedding, SwiGLU.
 *
 * Why: at decode batch sizes a norm is 32 x 576 floats, and torch's rms_norm runs it as five
 * elementwise ops with an OpenMP fork each; one pass here is several times faster
 * (docs/model_runner.md), and the residual add rides along. Sixty norms per SmolLM2 step; SwiGLU is three ops (silu, mul and
 * the copy that makes the gate half contiguous for the next GEMM) become one.
 *
 * Numerics: the sum of squares is accumulated in a different order than torch's, and silu's exp
 * is not torch's (not bitwise, equal within fp32 rounding); rotary is bitwise torch's
 * x * cos + roll(x) * sin: products and sum rounded separately (no contraction to FMA).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "exp_math.h"
#include "kernels.h"

/* Rows of at least this many elements in total are split across threads. */
#define PARALLEL_ELEMS (1 << 16)

/* residual (may be NULL) += x, then out = residual / rms(residual) * weight, row by row; without
 * a residual, out = x / rms(x) * weight. Rows of x are x_stride apart; residual and out are dense. */
void kvmesh_add_rms_norm_f32(float *residual, const float *x, int64_t x_stride, const float *weight,
                             float *out, int64_t rows, int64_t hidden, float eps)
{
    #pragma omp parallel for if (rows * hidden >= PARALLEL_ELEMS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        const float *src = xr;
        if (residual != NULL) {
            float *res = residual + r * hidden;
            #pragma omp simd
            for (int64_t i = 0; i < hidden; i++) res[i] += xr[i];
            src = res;
        }
        float sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int64_t i = 0; i < hidden; i++) sum += src[i] * src[i];
        const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        float *o = out + r * hidden;
        #pragma omp simd
        for (int64_t i = 0; i < hidden; i++) o[i] = weight[i] * (src[i] * inv);
    }
}

/* out[t, h, :] = x[t, h, :] * cos[t, :] + roll(x[t, h, :], dim / 2) * sin[t, :] for every head;
 * sin carries the sign of rotate_half. x rows are x_stride apart (heads contiguous), out is dense. */
__attribute__((optimize("fp-contract=off")))
void kvmesh_rope_f32(const float *x, int64_t x_stride, const float *cos_t, const float *sin_t,
                     int64_t cs_stride, float *out, int64_t tokens, int64_t heads, int64_t dim)
{
    const int64_t half = dim / 2;
    #pragma omp parallel for if (tokens * heads * dim >= PARALLEL_ELEMS) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_t + t * cs_stride, *s = sin_t + t * cs_stride;
        for (int64_t h = 0; h < heads; h++) {
            const float *xi = x + t * x_stride + h * dim;
            float *o = out + (t * heads + h) * dim;
            #pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                const float a = xi[d] * c[d], b = xi[d + half] * s[d];
                o[d] = a + b;
            }
            #pragma omp simd
            for (int64_t d = half; d < dim; d++) {
                const float a = xi[d] * c[d], b = xi[d - half] * s[d];
                o[d] = a + b;
            }
        }
    }
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, size + i]: the merged projection's two halves in,
 * a dense [tokens, size] out (exp_math.h's silu_mul_row). */
void kvmesh_silu_mul_f32(const float *gate_up, int64_t stride, float *out, int64_t tokens, int64_t size)
{
    #pragma omp parallel for if (tokens * size >= PARALLEL_ELEMS) schedule(static)
    for (int64_t t = 0; t < tokens; t++)
        silu_mul_row(gate_up + t * stride, gate_up + t * stride + size, out + t * size, size);
}
