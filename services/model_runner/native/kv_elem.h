/*
 * The KV pool's element types: fp32, or bf16 (the top 16 bits of an fp32), for the kernels that
 * read and write the pool (paged_decode.c, prefill_attention.c, decode_stack.c).
 *
 * Why bf16: bf16 mode computes in fp32 but its decode step streams the KV pool as much as the
 * weights; a bf16 pool halves those bytes (docs/kv_quantization.md, "bf16 KV"). Reading widens
 * exactly (a 16-bit shift), so a kernel that widens computes bitwise what it computes over an fp32
 * pool holding the same rounded values (the attention kernels instead run bf16 dot products where
 * kv_bf16_dots below says so); the write rounds (to nearest even, as torch's
 * fp32 -> bf16 conversion does, NaN -> 0x7FC0, subnormals kept: not the AVX512-BF16 instruction,
 * which flushes them).
 */
#ifndef KVMESH_KV_ELEM_H
#define KVMESH_KV_ELEM_H

#include <stdint.h>
#include <string.h>

#include "exp_math.h"
#include "kernels.h"

static inline uint16_t kv_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)0x7FC0;  /* NaN */
    u += 0x7FFFu + ((u >> 16) & 1u);  /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

static inline float kv_bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The first key a query at position len - 1 attends to: 0, or with a window len - window
 * (transformers' rule; every attention kernel's). */
static inline int64_t first_key(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* Element i of a pool row as fp32 (esz: the element's bytes, 4 or 2). */
static inline float kv_load1(const char *base, int64_t i, int esz) {
    if (esz == 2) return kv_bf16_to_f32(((const uint16_t *)base)[i]);
    return ((const float *)base)[i];
}

/*
 * bf16 dot products in attention over a bf16 pool (bf16 mode's default pool, docs/model_runner.md,
 * "bf16 attention"): where the build has AVX512-BF16, the decode and prefill kernels both attend a
 * bf16 pool with vdpbf16ps instead of fp32 FMAs on widened values. The scaled query and the
 * softmax numerators are rounded to bf16 (kv_round_bf16 / vcvtneps2bf16), K and V are the pool's
 * own bf16 values, every sum is fp32: scores over dimension pairs, the weighted V sum over key
 * pairs (keys 2u, 2u+1 by absolute position; a key outside the row's range counts as p = 0, v = 0),
 * the normalising sum over the rounded numerators. Twice the FMA rate on the FLOPs that dominate a
 * long prefill. Both kernels decide with this one predicate and run the same instructions on the
 * same operands in the same order, so a prefill row stays bitwise the decode of its position.
 * Elsewhere (no AVX512-BF16, a head_dim that is not a multiple of 32, an odd block size, more
 * heads than the decode kernel takes) a bf16 pool is read widened into fp32 arithmetic as before.
 */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define KV_BF16_DOTS_BUILT 1
#else
#define KV_BF16_DOTS_BUILT 0
#endif
/* The most query heads the decode kernel's AVX-512 path takes (its per-head arrays): bf16 dot
 * products live on that path, so a prefill kernel taking more heads would not match its decode. */
#define KV_MAX_HEADS 128

/* Not where bf16 mode runs its arithmetic as fp32 FMAs (gemm_bf16.c's kvmesh_linear_bf16_fma: a CPU
 * whose vdpbf16ps is half its FMA rate): there a bf16 pool is attended widened, in fp32. */
static inline int kv_bf16_dots(int esz, int64_t num_heads, int64_t head_dim, int64_t block_size) {
    return KV_BF16_DOTS_BUILT && esz == 2 && head_dim % 32 == 0 && head_dim <= 256 && block_size % 2 == 0
           && num_heads <= KV_MAX_HEADS && !kvmesh_linear_bf16_fma();
}

/*
 * AMX tiles in attention over a bf16 pool (attention_amx.c): where the process runs its bf16 GEMMs
 * on AMX (gemm_amx.c's choice when the object loads, KVMESH_NATIVE_AMX), a shape kv_bf16_dots takes
 * is attended with TDPBF16PS instead, by the decode and the prefill kernel alike, in the order
 * attention_amx.c states: on an Intel core vdpbf16ps issues at half its fp32 FMA rate, a tile
 * product does 16 x 16 x 32 of them per instruction. One predicate, so the two kernels never
 * disagree about which arithmetic a row gets.
 */
#if KV_BF16_DOTS_BUILT && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KV_AMX_BUILT 1
#else
#define KV_AMX_BUILT 0
#endif

static inline int kv_amx(int esz, int64_t num_heads, int64_t head_dim, int64_t block_size) {
    return KV_AMX_BUILT && kv_bf16_dots(esz, num_heads, head_dim, block_size) && kvmesh_linear_bf16_amx();
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 bf16 values as fp32 (exact: each the top half of its fp32). */
static inline __m512 kv_widen16(__m256i b) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* 16 elements from p as fp32 (esz 4: fp32, 2: bf16 widened). */
static inline __attribute__((always_inline)) __m512 kv_load16(const char *p, const int esz) {
    if (esz == 2) return kv_widen16(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_loadu_ps((const float *)p);
}
#endif

#if KVM_AVX2
/* 8 elements from p as fp32 (esz 4: fp32, 2: bf16 widened exactly). */
static inline __attribute__((always_inline)) __m256 kv_load8(const char *p, const int esz) {
    if (esz == 2)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_loadu_ps((const float *)p);
}
#endif

#if KV_BF16_DOTS_BUILT
/* dst[i] = bf16(src[i] * scale), n a multiple of 32 (a query row: the one rounding both kernels use). */
static inline void kv_round_bf16(const float *src, float scale, uint16_t *dst, int64_t n) {
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 32) {
        const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(src + i), s);
        const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(src + i + 16), s);
        _mm512_storeu_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* The 32-bit pair at p (two bf16 values, the even-indexed one in the low half), broadcast. */
static inline __m512bh kv_pair_bcast(const uint16_t *p) {
    int32_t w;
    memcpy(&w, p, sizeof w);
    return (__m512bh)_mm512_set1_epi32(w);
}

/* softmax_row_f32 (exp_math.h) in bf16 dot products' terms, the one order both kernels use: one
 * row's n scores s (keys first .. first + n - 1), numerators e^(s - max) rounded to bf16 into p
 * (p[i] is key first + i), and 1 / the sum of the rounded numerators (lane-wise in 16-key steps,
 * then reduced). The other half of the row's first and last key pair (p[-1] when first is odd,
 * p[n] when first + n is), outside the row, is set to zero. */
static inline float kv_softmax_bf16(const float *s, int64_t n, float max, uint16_t *p, int64_t first) {
    const __m512 m = _mm512_set1_ps(max);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 live = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1u);
        const __m256i b = (__m256i)_mm512_cvtneps_pbh(exp512_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), m)));
        _mm256_mask_storeu_epi16(p + t, live, b);
        sum = _mm512_mask_add_ps(sum, live, sum, kv_widen16(b));
    }
    if (first & 1) p[-1] = 0;
    if ((first + n) & 1) p[n] = 0;
    return 1.0f / _mm512_reduce_add_ps(sum);
}
#endif

#endif
