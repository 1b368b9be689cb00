/*
 * e^x for x <= 0, scalar and (with AVX-512) 16 lanes at a time, shared by the kernels.
 *
 * Range reduction: e^x = 2^n * e^r with n = round(x / ln2), |r| <= ln2 / 2, and a 7th-order
 * Taylor polynomial for e^r (relative error < 1e-7, about an fp32 ulp). Inputs below -87 are
 * clamped (e^-87 is already below fp32's smallest normal number).
 */
#ifndef KVMESH_EXP_MATH_H
#define KVMESH_EXP_MATH_H

#include <stdint.h>

static inline float exp_neg(float x) {
    if (x < -87.0f) x = -87.0f;
    const float t = x * 1.44269504088896341f;
    const int n = (int)(t - 0.5f);      /* t <= 0: truncation rounds toward 0, so this is round() */
    const float r = (t - (float)n) * 0.69314718055994531f;   /* |r| <= ln2 / 2 */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = (n + 127) << 23;
    return p * scale.f;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* e^x for x <= 0, 16 lanes: 2^n * e^r with the same polynomial as exp_neg. */
static inline __m512 exp512_neg(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* One row's softmax numerators e^(s - max), written over its n scores s, and 1 / their sum (lane-wise
 * in 16-key steps from s[0], then reduced): the one order paged_decode.c and prefill_attention.c
 * both use, so a prefill row's weights are bitwise a decode's. */
static inline float softmax_row_f32(float *s, int64_t n, float max) {
    const __m512 m = _mm512_set1_ps(max);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 live = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1u);
        const __m512 e = exp512_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), m));
        _mm512_mask_storeu_ps(s + t, live, e);
        sum = _mm512_mask_add_ps(sum, live, sum, e);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* silu(x) * u, 16 lanes: x sigmoid(x) u, sigmoid(x) = num / (1 + e^-|x|) with num = 1 for x > 0,
 * e^-|x| otherwise (nothing overflows). The one definition of SwiGLU's vector arithmetic, so the
 * fused GEMM epilogue (gemm_bf16.c) and the SwiGLU pass (layer_ops.c) give the same bits. */
static inline __m512 silu_mul512(__m512 x, __m512 u) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 e = exp512_neg(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));  /* e^-|x| */
    const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ), e, one);
    const __m512 sig = _mm512_div_ps(num, _mm512_add_ps(one, e));
    return _mm512_mul_ps(_mm512_mul_ps(x, sig), u);
}
#endif

#endif
