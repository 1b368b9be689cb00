/*
 * INT4 KV cache for the CPU: the slot writes (quantize + pack) and paged attention reading the packed
 * rows in place.
 *
 * Format (attention/int4.py owns it; this file reproduces it byte for byte): one (token, KV head)
 * row of head_dim values is head_dim / 2 bytes of nibbles (low nibble = even channel) followed by
 * one float16 scale per group of G channels (G = 32, or head_dim when smaller):
 *     scale = half(min(amax / 7, 65504)),  q = rint(clamp(x / scale, -7, 7)),  nibble = q + 8
 * with IEEE fp32 division and round-half-even (rintf in the default rounding mode, torch.round),
 * so the bytes equal the torch reference's (tests/kernels/test_native_int4.py).
 *
 * Attention: each query row (a decode, or a prefill row treated as the decode of its own position)
 * and KV head is one work item: scores of the group's query heads against every key (each K row
 * dequantized once, into registers-sized scratch, for all heads of the group), a softmax with the
 * decode kernel's exp, then the weighted V sum in key order. A row's numbers depend only on its
 * query, its keys and its length, so chunked prefill and prefix-cache hits give a cold run's bits.
 * Portable C (the compiler vectorizes the inner loops): written for correctness and for reading
 * the cache in place (4x fewer bytes than fp16), not tuned like paged_decode.c's AVX-512 paths.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "exp_math.h"
#include "kv_elem.h"

#define INT4_GROUP 32
#define INT4_MAX_GROUP 16      /* query heads per KV head */
#define INT4_MAX_HEAD_DIM 256

static inline int64_t group_size(int64_t head_dim) { return head_dim < INT4_GROUP ? head_dim : INT4_GROUP; }

/* Bytes of one packed row (shared/kv_layout.py int4_row_bytes). */
int64_t kvmesh_int4_row_bytes(int64_t head_dim) { return head_dim / 2 + 2 * (head_dim / group_size(head_dim)); }

static void quantize_row(const float *x, uint8_t *dst, int64_t head_dim) {
    const int64_t g = group_size(head_dim), groups = head_dim / g;
    uint8_t *scales = dst + head_dim / 2;
    for (int64_t j = 0; j < groups; j++) {
        const float *xg = x + j * g;
        float amax = 0.0f;
        for (int64_t d = 0; d < g; d++) amax = fmaxf(amax, fabsf(xg[d]));
        float s32 = amax / 7.0f;
        if (s32 > 65504.0f) s32 = 65504.0f;
        const _Float16 half = (_Float16)s32;
        memcpy(scales + 2 * j, &half, 2);
        const float s = (float)half;
        for (int64_t d = 0; d < g; d += 2) {
            float a = s > 0.0f ? xg[d] / s : 0.0f, b = s > 0.0f ? xg[d + 1] / s : 0.0f;
            a = rintf(fminf(fmaxf(a, -7.0f), 7.0f));
            b = rintf(fminf(fmaxf(b, -7.0f), 7.0f));
            dst[(j * g + d) / 2] = (uint8_t)((int)a + 8) | (uint8_t)(((int)b + 8) << 4);
        }
    }
}

static inline void dequantize_row(const uint8_t *src, float *x, int64_t head_dim) {
    const int64_t g = group_size(head_dim), groups = head_dim / g;
    const uint8_t *scales = src + head_dim / 2;
    for (int64_t j = 0; j < groups; j++) {
        _Float16 half;
        memcpy(&half, scales + 2 * j, 2);
        const float s = (float)half;
        for (int64_t d = j * g; d < (j + 1) * g; d += 2) {
            const uint8_t byte = src[d / 2];
            x[d] = (float)((int)(byte & 15) - 8) * s;
            x[d + 1] = (float)((int)(byte >> 4) - 8) * s;
        }
    }
}

/* Stores T tokens' K and V (rows of num_kv_heads * head_dim floats, row_stride apart) quantized at
 * their slots; slot -1 (padding) or out of range is skipped. Returns the rows written. */
int64_t kvmesh_write_kv_int4(
    const float *key, int64_t key_row_stride, const float *value, int64_t value_row_stride,
    uint8_t *k_cache, uint8_t *v_cache, const int64_t *slots, int64_t num_tokens, int64_t num_kv_heads,
    int64_t head_dim, int64_t num_slots)
{
    const int64_t row = kvmesh_int4_row_bytes(head_dim);
    int64_t written = 0;
    for (int64_t i = 0; i < num_tokens; i++) {
        const int64_t slot = slots[i];
        if (slot < 0 || slot >= num_slots) continue;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            quantize_row(key + i * key_row_stride + h * head_dim, k_cache + (slot * num_kv_heads + h) * row, head_dim);
            quantize_row(value + i * value_row_stride + h * head_dim, v_cache + (slot * num_kv_heads + h) * row,
                         head_dim);
        }
        written++;
    }
    return written;
}

static inline const uint8_t *int4_token_row(const uint8_t *cache, const int32_t *table, int64_t t, int64_t block_size,
                                            int64_t block_stride, int64_t token_stride, int64_t kv_offset)
{
    return cache + (int64_t)table[t / block_size] * block_stride + (t % block_size) * token_stride + kv_offset;
}

/* One (query row, KV head): the group's heads attend to keys first .. len - 1 of the row. */
static void attend_int4(const float *qs, float *os, const uint8_t *k_cache, const uint8_t *v_cache,
                        int64_t block_stride, const int32_t *table, int64_t first, int64_t len, int64_t group,
                        int64_t head_dim, int64_t token_stride, int64_t block_size, int64_t kv_offset, float scale,
                        float *scores)
{
    float qv[INT4_MAX_GROUP][INT4_MAX_HEAD_DIM], row[INT4_MAX_HEAD_DIM];
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < head_dim; d++) qv[g][d] = qs[g * head_dim + d] * scale;
    float maxv[INT4_MAX_GROUP];
    for (int64_t g = 0; g < group; g++) maxv[g] = -3.0e38f;
    for (int64_t t = first; t < len; t++) {
        dequantize_row(int4_token_row(k_cache, table, t, block_size, block_stride, token_stride, kv_offset), row,
                       head_dim);
        for (int64_t g = 0; g < group; g++) {
            float acc = 0.0f;
            #pragma omp simd reduction(+:acc)
            for (int64_t d = 0; d < head_dim; d++) acc += qv[g][d] * row[d];
            scores[g * len + t] = acc;
            if (acc > maxv[g]) maxv[g] = acc;
        }
    }
    float inv_sum[INT4_MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * len;
        const float m = maxv[g];
        float sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int64_t t = first; t < len; t++) {
            const float e = exp_neg(sg[t] - m);
            sg[t] = e;
            sum += e;
        }
        inv_sum[g] = 1.0f / sum;
    }
    float acc[INT4_MAX_GROUP][INT4_MAX_HEAD_DIM];
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < head_dim; d++) acc[g][d] = 0.0f;
    for (int64_t t = first; t < len; t++) {
        dequantize_row(int4_token_row(v_cache, table, t, block_size, block_stride, token_stride, kv_offset), row,
                       head_dim);
        for (int64_t g = 0; g < group; g++) {
            const float p = scores[g * len + t];
            #pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) acc[g][d] += p * row[d];
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < head_dim; d++) os[g * head_dim + d] = acc[g][d] * inv_sum[g];
}

/* Paged attention over an INT4 cache. Row i (query row rows[i], block table tables[i]) sees its
 * first seq_lens[i] keys; a prefill chunk passes one row per position with its causal length.
 * window > 0 (a sliding-window layer): only the last `window` of them (keys p - window < j <= p of
 * the row at position p = seq_lens[i] - 1; blocks before that are never read).
 * block_stride is in bytes (one block: block_size * num_kv_heads * row bytes).
 * Returns 0, -1 for an unsupported shape, -2 when a score buffer could not be allocated. */
int kvmesh_paged_attention_int4(
    const float *q, int64_t q_row_stride, const uint8_t *k_cache, const uint8_t *v_cache, int64_t block_stride,
    const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, const int32_t *rows, int64_t num_rows,
    float *out, int64_t out_row_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_seq_len, float scale, int64_t window)
{
    if (window < 0 || num_kv_heads <= 0 || num_heads % num_kv_heads || head_dim % 2 || head_dim % group_size(head_dim)) return -1;
    const int64_t group = num_heads / num_kv_heads;
    if (group > INT4_MAX_GROUP || head_dim > INT4_MAX_HEAD_DIM) return -1;
    const int64_t row_bytes = kvmesh_int4_row_bytes(head_dim), token_stride = num_kv_heads * row_bytes;
    const int64_t items = num_rows * num_kv_heads;
    int failed = 0;
    #pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(group * (max_seq_len > 0 ? max_seq_len : 1)));
        if (scores == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (scores == NULL) continue;
            const int64_t s = item / num_kv_heads, kvh = item % num_kv_heads;
            const int64_t len = seq_lens[s];
            const float *qs = q + (int64_t)rows[s] * q_row_stride + kvh * group * head_dim;
            float *os = out + (int64_t)rows[s] * out_row_stride + kvh * group * head_dim;
            if (len <= 0) {
                for (int64_t i = 0; i < group * head_dim; i++) os[i] = 0.0f;
                continue;
            }
            const int64_t first = first_key(len, window);
            attend_int4(qs, os, k_cache, v_cache, block_stride, tables + s * table_stride, first, len, group,
                        head_dim, token_stride, block_size, kvh * row_bytes, scale, scores);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
