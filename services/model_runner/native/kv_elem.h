/*
 * The KV pool's element types: fp32, or bf16 (the top 16 bits of an fp32), for the kernels that
 * read and write the pool (paged_decode.c, prefill_attention.c, decode_stack.c).
 *
 * Why bf16: bf16 mode computes in fp32 but its decode step streams the KV pool as much as the
 * weights; a bf16 pool halves those bytes (docs/kv_quantization.md, "bf16 KV"). Reading widens
 * exactly (a 16-bit shift), so a kernel over a bf16 pool computes bitwise what it computes over an
 * fp32 pool holding the same rounded values; only the write rounds (to nearest even, as torch's
 * fp32 -> bf16 conversion does, NaN -> 0x7FC0, subnormals kept: not the AVX512-BF16 instruction,
 * which flushes them).
 */
#ifndef KVMESH_KV_ELEM_H
#define KVMESH_KV_ELEM_H

#include <stdint.h>
#include <string.h>

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

/* Element i of a pool row as fp32 (esz: the element's bytes, 4 or 2). */
static inline float kv_load1(const char *base, int64_t i, int esz) {
    if (esz == 2) return kv_bf16_to_f32(((const uint16_t *)base)[i]);
    return ((const float *)base)[i];
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 elements from p as fp32 (esz 4: fp32, 2: bf16 widened). */
static inline __attribute__((always_inline)) __m512 kv_load16(const char *p, const int esz) {
    if (esz == 2)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}
#endif

#endif
