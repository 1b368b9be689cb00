/*
 * The entry points of the native CPU kernels, for the C code that calls them (decode_stack.c);
 * Python binds the same functions with ctypes (__init__.py). Argument meanings: each definition.
 */
#ifndef KVMESH_KERNELS_H
#define KVMESH_KERNELS_H

#include <stdint.h>

int kvmesh_paged_decode_f32(
    const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache, int64_t block_stride,
    const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, const int32_t *rows, int64_t num_seqs,
    float *out, int64_t out_row_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_seq_len, float scale, int64_t window);
int kvmesh_prefill_attention_f32(
    const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache, int64_t block_stride,
    const int32_t *table, int64_t num_q, int64_t seq_len, float *out, int64_t out_row_stride, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window);
int kvmesh_paged_decode_bf16(
    const float *q, int64_t q_row_stride, const uint16_t *k_cache, const uint16_t *v_cache, int64_t block_stride,
    const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, const int32_t *rows, int64_t num_seqs,
    float *out, int64_t out_row_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_seq_len, float scale, int64_t window);
int kvmesh_prefill_attention_bf16(
    const float *q, int64_t q_row_stride, const uint16_t *k_cache, const uint16_t *v_cache, int64_t block_stride,
    const int32_t *table, int64_t num_q, int64_t seq_len, float *out, int64_t out_row_stride, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window);
/* The element-size forms the typed entry points wrap (esz 4: fp32 pool, 2: bf16 pool). */
int kvmesh_paged_decode_elem(
    const float *q, int64_t q_row_stride, const char *k_cache, const char *v_cache, int64_t block_stride,
    const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, const int32_t *rows, int64_t num_seqs,
    float *out, int64_t out_row_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_seq_len, float scale, int64_t window, int esz);
int kvmesh_prefill_attention_elem(
    const float *q, int64_t q_row_stride, const char *k_cache, const char *v_cache, int64_t block_stride,
    const int32_t *table, int64_t num_q, int64_t seq_len, float *out, int64_t out_row_stride, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window, int esz);
int64_t kvmesh_write_kv_elem(
    const float *key, int64_t key_row_stride, const float *value, int64_t value_row_stride, char *k_cache,
    char *v_cache, const int64_t *slots, int64_t num_tokens, int64_t kv_elems, int64_t num_slots, int esz);
int64_t kvmesh_write_kv_bf16(
    const float *key, int64_t key_row_stride, const float *value, int64_t value_row_stride, uint16_t *k_cache,
    uint16_t *v_cache, const int64_t *slots, int64_t num_tokens, int64_t kv_elems, int64_t num_slots);
int64_t kvmesh_write_kv_f32(
    const float *key, int64_t key_row_stride, const float *value, int64_t value_row_stride, float *k_cache,
    float *v_cache, const int64_t *slots, int64_t num_tokens, int64_t kv_elems, int64_t num_slots);
void kvmesh_add_rms_norm_f32(float *residual, const float *x, int64_t x_stride, const float *weight, float *out,
                             int64_t rows, int64_t hidden, float eps);
void kvmesh_rope_f32(const float *x, int64_t x_stride, const float *cos_t, const float *sin_t, int64_t cs_stride,
                     float *out, int64_t tokens, int64_t heads, int64_t dim);
void kvmesh_silu_mul_f32(const float *gate_up, int64_t stride, float *out, int64_t tokens, int64_t size);
void kvmesh_linear_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed, int64_t n,
                       const float *bias, float *out, int64_t out_stride);
int kvmesh_linear_f32_swiglu(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed,
                             int64_t inter, const float *bias, float *out, int64_t out_stride);
int kvmesh_linear_bf16(const float *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                       const float *bias, float *out, int64_t out_stride);
int kvmesh_linear_bf16_swiglu(const float *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed,
                              int64_t inter, const float *bias, float *out, int64_t out_stride);
int64_t kvmesh_linear_bf16_available(void);
int64_t kvmesh_linear_bf16_amx(void);
int64_t kvmesh_linear_bf16_fma(void);
void kvmesh_linear_f32_panel(const float *x, int64_t x_stride, int64_t rows, int64_t k, const float *panel,
                             const float *bias, float *out, int64_t out_stride, int64_t cols);
int kvmesh_linear_int8(const float *x, int64_t x_stride, int64_t m, int64_t k, const void *packed, int64_t n,
                       const float *bias, float *out, int64_t out_stride);
int64_t kvmesh_linear_int8_available(void);
/* gemm_q4_1.c: weight-only Q4_1 / Q8_0 groups, bitwise gemm.c over the dequantized weights */
int kvmesh_linear_q4_1(const float *x, int64_t x_stride, int64_t m, int64_t k, const void *packed, int64_t n,
                       const float *bias, float *out, int64_t out_stride);
int kvmesh_linear_q8_0(const float *x, int64_t x_stride, int64_t m, int64_t k, const void *packed, int64_t n,
                       const float *bias, float *out, int64_t out_stride);
int64_t kvmesh_linear_q_group(void);
/* 1 where kv_elem.h's kv_bf16_dots holds for a bf16 pool of this shape: the runner's log and
 * GetModelInfo say which arithmetic its attention runs from this, the one owner of the rule. */
int64_t kvmesh_bf16_dots_for(int64_t num_heads, int64_t head_dim, int64_t block_size);
/* 1 where kv_elem.h's kv_amx holds for a bf16 pool of this shape (attention on AMX tiles, attention_amx.c) */
int64_t kvmesh_kv_amx_for(int64_t num_heads, int64_t head_dim, int64_t block_size);
/* 1 where decode attention prefetches the next K/V block into L2 (KVMESH_KV_PREFETCH_L2), else 0 (L1) */
int64_t kvmesh_kv_prefetch_l2(void);
/* thread_team.c: the calling thread's OpenMP team size, and its members bound one to a CPU */
int64_t kvmesh_team_size(void);
int kvmesh_bind_team(const int64_t *cpus, int64_t n);

#endif
