/*
 * What the tiled prefill attention kernels share: prefill_attention.c's (AVX-512, 16-key tiles) and
 * prefill_attention_avx2.c's (AVX2 + FMA, 8-key tiles). Both gather one KV head's keys and values
 * from the paged cache once per call and then attend work items of RT (query token, head) rows;
 * the gather and a work item's rows are the same code at either width.
 */
#ifndef KVMESH_PREFILL_TILES_H
#define KVMESH_PREFILL_TILES_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_elem.h"

#define RT 8             /* rows (query token, head) per work item */
#define PF_MAX_DIM 256

/* A work item's RT rows (query token, head) of one KV head: each row's keys are local lo .. len - 1
 * (local index = key - kbase, the first gathered key); padding rows repeat the last real row. */
typedef struct {
    int64_t len[RT], lo[RT], tok[RT], head[RT];
    int64_t max_len, min_len, min_lo, max_lo;
} TileRows;

static inline void tile_rows(TileRows *t, int64_t group, int64_t kvh, int64_t ctx0, int64_t kbase, int64_t window,
                             int64_t row0, int64_t rows_total)
{
    t->max_len = 0, t->min_len = INT64_MAX, t->min_lo = INT64_MAX, t->max_lo = 0;
    for (int r = 0; r < RT; r++) {
        const int64_t row = row0 + r < rows_total ? row0 + r : rows_total - 1;
        t->tok[r] = row / group;
        t->head[r] = kvh * group + row % group;
        const int64_t pos = ctx0 + t->tok[r];
        t->len[r] = pos + 1 - kbase;
        t->lo[r] = first_key(pos + 1, window) - kbase;
        if (t->len[r] > t->max_len) t->max_len = t->len[r];
        if (t->len[r] < t->min_len) t->min_len = t->len[r];
        if (t->lo[r] < t->min_lo) t->min_lo = t->lo[r];
        if (t->lo[r] > t->max_lo) t->max_lo = t->lo[r];
    }
}

/* Keys kstart .. seq_len - 1 of every KV head gathered from the paged cache as fp32 (a bf16 cache
 * widened exactly, kv_elem.h), at local index u = key - kstart: *kt_out K transposed in width-key
 * tiles ([num_kv_heads][padded / width][head_dim][width], zero past the last key), *vc_out V
 * contiguous ([num_kv_heads][padded][head_dim]). padded: a multiple of width >= the key count.
 * Returns 0, or -2 when a buffer could not be allocated (nothing left allocated). */
static inline int prefill_gather(const char *k_cache, const char *v_cache, int64_t block_stride,
                                 const int32_t *table, int64_t kstart, int64_t seq_len, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t block_size, int esz, int64_t width, int64_t padded,
                                 float **kt_out, float **vc_out)
{
    const int64_t token_stride = num_kv_heads * head_dim;
    float *kt = (float *)calloc((size_t)(num_kv_heads * padded * head_dim), sizeof(float));
    float *vc = (float *)malloc(sizeof(float) * (size_t)(num_kv_heads * padded * head_dim));
    if (kt == NULL || vc == NULL) {
        free(kt);
        free(vc);
        return -2;
    }
    for (int64_t t = kstart; t < seq_len; t++) {
        const int64_t off = (int64_t)table[t / block_size] * block_stride + (t % block_size) * token_stride;
        const int64_t u = t - kstart;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t e = off + h * head_dim;  /* the row's first element */
            float *kd = kt + h * padded * head_dim + (u / width) * head_dim * width + (u % width);
            float *vd = vc + (h * padded + u) * head_dim;
            if (esz == 4) {
                const float *ks = (const float *)k_cache + e;
                for (int64_t d = 0; d < head_dim; d++) kd[d * width] = ks[d];
                memcpy(vd, (const float *)v_cache + e, sizeof(float) * (size_t)head_dim);
            } else {
                for (int64_t d = 0; d < head_dim; d++) kd[d * width] = kv_load1(k_cache, e + d, esz);
                for (int64_t d = 0; d < head_dim; d++) vd[d] = kv_load1(v_cache, e + d, esz);
            }
        }
    }
    *kt_out = kt;
    *vc_out = vc;
    return 0;
}

/* prefill_attention_avx2.c: the chunk on AVX2 + FMA in 8-key tiles, bitwise paged_decode.c's AVX2
 * decode of each row (its arguments as prefill_attention's; head_dim a multiple of 16 <= PF_MAX_DIM,
 * num_heads <= KV_MAX_HEADS, the group <= 16). Returns 0, or -2 when a buffer could not be allocated. */
int kvm_prefill_tiled_avx2(const float *q, int64_t q_row_stride, const char *k_cache, const char *v_cache,
                           int64_t block_stride, const int32_t *table, int64_t num_q, int64_t seq_len, float *out,
                           int64_t out_row_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, int64_t window, int esz);

#endif
