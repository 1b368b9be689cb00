/*
 * e^x for x <= 0, scalar and (with AVX-512) 16 or (with AVX2) 8 lanes at a time, shared by the kernels.
 *
 * Range reduction: e^x = 2^n * e^r with n = round(x / ln2), |r| <= ln2 / 2, and a 7th-order
 * Taylor polynomial for e^r (relative error < 1e-7, about an fp32 ulp). Inputs below -87 are
 * clamped (e^-87 is already below fp32's smallest normal number).
 */
#ifndef KVMESH_EXP_MATH_H
#define KVMESH_EXP_MATH_H

#include <math.h>
#include <stdint.h>

/* p = e^r's 7th-order Taylor polynomial in Horner form, in any width: FMA(a, b, c) = a * b + c and
 * SET1(c) a constant in that width. The one polynomial every exp below evaluates (a macro, not a
 * loop over an array: the same instructions as the steps written out). */
#define EXP_TAYLOR_HORNER(p, r, FMA, SET1) do { \
    p = SET1(1.0f / 5040.0f); \
    p = FMA(p, r, SET1(1.0f / 720.0f)); \
    p = FMA(p, r, SET1(1.0f / 120.0f)); \
    p = FMA(p, r, SET1(1.0f / 24.0f)); \
    p = FMA(p, r, SET1(1.0f / 6.0f)); \
    p = FMA(p, r, SET1(0.5f)); \
    p = FMA(p, r, SET1(1.0f)); \
    p = FMA(p, r, SET1(1.0f)); \
} while (0)
#define EXP_SCALAR_FMA(a, b, c) ((a) * (b) + (c))
#define EXP_SCALAR_SET1(c) (c)

static inline float exp_neg(float x) {
    if (x < -87.0f) x = -87.0f;
    const float t = x * 1.44269504088896341f;
    const int n = (int)(t - 0.5f);      /* t <= 0: truncation rounds toward 0, so this is round() */
    const float r = (t - (float)n) * 0.69314718055994531f;   /* |r| <= ln2 / 2 */
    float p;
    EXP_TAYLOR_HORNER(p, r, EXP_SCALAR_FMA, EXP_SCALAR_SET1);
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
    __m512 p;
    EXP_TAYLOR_HORNER(p, r, _mm512_fmadd_ps, _mm512_set1_ps);
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

/* The 8-lane paths: a build without AVX-512 on a CPU with AVX2 + FMA (AMD Zen 1-3, Intel Haswell
 * to Alder Lake client), where the AVX-512 paths would run 16 lanes. Before them such a CPU ran the
 * portable C loops: scalar exps and a horizontal reduction per key and head (docs/model_runner.md,
 * "AVX2"). */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define KVM_AVX2 1
#include <immintrin.h>

/* e^x for x <= 0, 8 lanes: 2^n * e^r with exp_neg's polynomial; 2^n built in the exponent field
 * (n >= -126 after the clamp, so it is a normal number and the product is exact scaling). */
static inline __m256 exp256_neg(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_setzero_ps());
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.69314718055994531f));
    __m256 p;
    EXP_TAYLOR_HORNER(p, r, _mm256_fmadd_ps, _mm256_set1_ps);
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* All-ones in lanes 0 .. n - 1 (n <= 8): the live lanes of a tail. */
static inline __m256i lanes_below(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The sum of 8 lanes, always in this order: halves, then pairs, then the last two. */
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* softmax_row_f32 (above) in 8-key steps: the one order paged_decode.c's AVX2 path uses for
 * decodes and for prefill rows alike (those run as decodes of their positions). */
static inline float softmax_row_f32(float *s, int64_t n, float max) {
    const __m256 m = _mm256_set1_ps(max);
    __m256 sum = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {  /* whole groups unmasked (a vmaskmovps store is slow on AMD) */
        const __m256 e = exp256_neg(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (t < n) {
        const __m256i live = lanes_below(n - t);
        const __m256 e = exp256_neg(_mm256_sub_ps(_mm256_maskload_ps(s + t, live), m));
        _mm256_maskstore_ps(s + t, live, e);
        sum = _mm256_add_ps(sum, _mm256_and_ps(e, _mm256_castsi256_ps(live)));
    }
    return 1.0f / hsum256(sum);
}

/* silu_mul512 (above), 8 lanes: x sigmoid(x) u with e^-|x|. */
static inline __m256 silu_mul256(__m256 x, __m256 u) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const __m256 e = exp256_neg(_mm256_sub_ps(zero, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x)));  /* e^-|x| */
    const __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(x, zero, _CMP_GT_OQ));
    return _mm256_mul_ps(_mm256_mul_ps(x, _mm256_div_ps(num, _mm256_add_ps(one, e))), u);
}
#else
#define KVM_AVX2 0
#endif

/* out[i] = silu(g[i]) * u[i] for i < size, in the widest lanes the build has, then one at a time:
 * the one SwiGLU row, so the SwiGLU pass (layer_ops.c) and the GEMMs that fuse it into their
 * epilogue (gemm.c, gemm_bf16.c) give the same bits. silu(g) = g * sigmoid(g) with e^-|g|, so
 * nothing overflows. */
static inline void silu_mul_row(const float *g, const float *u, float *o, int64_t size)
{
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= size; i += 16) _mm512_storeu_ps(o + i, silu_mul512(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
#elif KVM_AVX2
    for (; i + 8 <= size; i += 8) _mm256_storeu_ps(o + i, silu_mul256(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
#endif
    for (; i < size; i++) {
        const float x = g[i];
        const float e = exp_neg(-fabsf(x));
        const float num = x > 0.0f ? 1.0f : e;
        o[i] = x * (num / (1.0f + e)) * u[i];
    }
}

#endif
