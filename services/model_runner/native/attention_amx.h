/*
 * Attention over a bf16 pool on AMX tiles (attention_amx.c): the decode and the prefill entry
 * points that paged_decode.c and prefill_attention.c hand a chunk to where kv_elem.h's kv_amx
 * holds. Their arguments are those of kvmesh_paged_decode_elem and kvmesh_prefill_attention_bf16;
 * each returns 0, or -2 when a buffer could not be allocated.
 */
#ifndef KVMESH_ATTENTION_AMX_H
#define KVMESH_ATTENTION_AMX_H

#include <stdint.h>

int kvm_decode_amx(const float *q, int64_t q_row_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                   int64_t block_stride, const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                   const int32_t *rows, int64_t num_seqs, float *out, int64_t out_row_stride, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_seq_len, float scale,
                   int64_t window);

int kvm_prefill_amx(const float *q, int64_t q_row_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                    int64_t block_stride, const int32_t *table, int64_t num_q, int64_t seq_len, float *out,
                    int64_t out_row_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t block_size, float scale, int64_t window);

#endif
