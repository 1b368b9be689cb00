/*
 * A whole decoder-layer stack for one step, in one call from Python: decode rows and prefill chunks
 * (a mixed step, a prompt's chunk) alike.
 *
 * Why: at decode batch sizes the kernels of one layer take a few milliseconds together, and the
 * Python between them (module calls, checks, tensor allocations, a ctypes call per kernel with
 * up to 18 arguments) cost a noticeable share of a batch-32 step (docs/model_runner.md), run by
 * one thread while the other waits; a mixed step paid it too, with a chunk's kernels on top. Here
 * the same kernels run in the same order on the same arguments as the per-layer Python path does
 * with the native kernels on (but for the gate_up + SwiGLU, fused from FUSED_SWIGLU_ROWS rows in bf16
 * mode and FUSED_SWIGLU_ROWS_F32 in fp32: bitwise the two steps), so the result is bitwise that path's
 * (tests/unit/model_runner/test_native_stack.py); only the interpreter is gone.
 *
 * Per layer (Llama/Mistral/Qwen2 pre-norm block, SwiGLU MLP):
 *   h = norm(residual += x)          (layer 0: residual = x, h = norm(x))
 *   qkv = h Wqkv^T + b;  q|k rotated; k, v stored at the step's slots
 *   attn = paged decode attention of the decode rows, causal prefill attention of each chunk
 *          (prefill_attention.c), both over the layer's cache
 *   h = norm(residual += attn Wo^T + b)
 *   x = down(silu(gate) * up)
 * The caller adds the last x to the residual with the final norm, and computes the logits.
 *
 * The last layer past its K/V writes runs only for the rows whose output is read (out_rows: the
 * rows the step samples from), as llama.cpp's graph does with its output ids: the other rows' K/V
 * are all later steps need of them, and a row's result depends on that row alone (every kernel
 * here is batch invariant), so the rows kept are bitwise what the whole step gives them. A prompt
 * chunk that does not end its prompt then skips the last layer's attention, o projection and MLP
 * (for SmolLM2 about 2.8% of a prompt's layer FLOPs); the kept rows come out at the front of x and
 * residual.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

/* One layer's parameters: norms dense, projections packed for gemm.c (fp32), gemm_bf16.c (bf16),
 * gemm_int8.c (int8 weights) or gemm_q4_1.c (Q4_1 weights; KvmStackShape.gemm; biases fp32, may be NULL), and the layer's K and V halves of the pool.
 * Mirrored by ctypes in model/native_stack.py. */
typedef struct {
    const float *input_norm, *post_norm;
    const void *qkv;
    const float *qkv_bias;
    const void *o;
    const float *o_bias;
    const void *gate_up;
    const float *gate_up_bias;
    const void *down;
    const float *down_bias;
    void *k_cache, *v_cache;  /* fp32 or bf16 (KvmStackShape.kv_bf16) */
} KvmLayer;

typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t block_size, block_stride, num_slots;  /* block_stride: elements from one block to the next */
    int64_t gemm;  /* every projection packed for: 0 gemm.c, 1 gemm_bf16.c (bf16 mode), 2 gemm_int8.c, 3 gemm_q4_1.c */
    int64_t window;  /* every layer's sliding window (one KV cache group), 0 = full attention */
    int64_t kv_bf16;  /* the pool's elements: 0 fp32, 1 bf16 */
    float eps, scale;
} KvmStackShape;

/* The projection's GEMM, fp32, bf16, int8 or Q4_1 as the stack was packed (output rows n apart): 0,
 * or the packed GEMM's failure status. */
static int linear(const KvmStackShape *shape, const float *x, int64_t x_stride, int64_t m, int64_t k,
                  const void *packed, int64_t n, const float *bias, float *out)
{
    if (shape->gemm == 1) return kvmesh_linear_bf16(x, x_stride, m, k, (const uint16_t *)packed, n, bias, out, n);
    if (shape->gemm == 2) return kvmesh_linear_int8(x, x_stride, m, k, packed, n, bias, out, n);
    if (shape->gemm == 3) return kvmesh_linear_q4_1(x, x_stride, m, k, packed, n, bias, out, n);
    kvmesh_linear_f32(x, x_stride, m, k, (const float *)packed, n, bias, out, n);
    return 0;
}

/* bf16 mode's gate_up GEMM with the SwiGLU in its epilogue (kvmesh_linear_bf16_swiglu, bitwise the two
 * steps) from this many rows, three row tiles: at 32 the [rows, 2 I] projection that is then never
 * written out and read back saves ~1% of the stack; at 1-16 rows, where the gate and up panels' two
 * prefetch streams share one or two tiles' k steps, it saved nothing (docs/model_runner.md, "The
 * decode stack's gate_up with SwiGLU fused"). */
#define FUSED_SWIGLU_ROWS 17
/* fp32 mode's (kvmesh_linear_f32_swiglu, bitwise the two steps) from more rows than a decode
 * batch's four row tiles: at 32 rows it saved nothing measurable, at a prefill chunk's 512 it does
 * (docs/model_runner.md, "fp32 gate_up with SwiGLU fused"). */
#define FUSED_SWIGLU_ROWS_F32 33

/* One step: `tokens` rows, each a decode row (the paged decode's arrays: query row, length and block
 * table of each) or a row of one of the prefill chunks. NOTE: the fields after `act` came later and
 * sit last, so a build from before them (bench/step_overhead.py --ab) still reads a decode-only
 * step, where num_decodes = tokens and num_chunks = 0, as it did. */
typedef struct {
    int64_t tokens;
    const float *cos, *sin;  /* [tokens, head_dim], sin signed (RotaryEmbedding) */
    const int64_t *slots;    /* [tokens] */
    const int32_t *tables, *seq_lens, *rows;  /* the decode rows' [num_decodes, table_stride], [num_decodes] x 2 */
    int64_t table_stride, max_seq_len;
    float *x;         /* [tokens, hidden]: in, the embeddings; out, the last layer's MLP output */
    float *residual;  /* [tokens, hidden]: out, the residual stream x has not been added to */
    /* scratch: [tokens, hidden], [tokens, (H + 2 KV) D], [tokens, (H + KV) D], [tokens, H D],
     * [tokens, 2 I], [tokens, I] */
    float *h, *qkv, *qk, *attn, *gate_up, *act;
    int64_t num_decodes, num_chunks;
    /* [num_chunks, 3]: each chunk's first row, its rows, and its sequence's length in keys counted
     * from the table's first block (the prefill kernel's seq_len); the chunk's rows are the last
     * positions of that length */
    const int64_t *chunk_spans;
    const int32_t *chunk_tables;  /* [num_chunks, chunk_table_stride]: each chunk's sequence's whole block table */
    int64_t chunk_table_stride;
    /* the rows whose last-layer output is read, ascending (NULL or num_out < 0: every row); the
     * last layer leaves those rows, in that order, in rows 0 .. num_out - 1 of x and residual */
    int64_t num_out;
    const int64_t *out_rows;
} KvmDecodeStep;

/* One layer's attention: the decode rows, then each prefill chunk, q rows from step->qk, out into
 * step->attn. Returns 0, the paged decode's status, or 200 - the prefill kernel's (negative) status. */
static int attend(const KvmStackShape *shape, const KvmLayer *w, const KvmDecodeStep *step, int64_t q_size,
                  int64_t qk_size, int esz)
{
    const int64_t d = shape->head_dim;
    if (step->num_decodes > 0) {
        const int status = kvmesh_paged_decode_elem(
            step->qk, qk_size, (const char *)w->k_cache, (const char *)w->v_cache, shape->block_stride, step->tables,
            step->table_stride, step->seq_lens, step->rows, step->num_decodes, step->attn, q_size, shape->num_heads,
            shape->num_kv_heads, d, shape->block_size, step->max_seq_len, shape->scale, shape->window, esz);
        if (status != 0) return status;
    }
    for (int64_t c = 0; c < step->num_chunks; c++) {
        const int64_t *span = step->chunk_spans + 3 * c;
        const int status = kvmesh_prefill_attention_elem(
            step->qk + span[0] * qk_size, qk_size, (const char *)w->k_cache, (const char *)w->v_cache,
            shape->block_stride, step->chunk_tables + c * step->chunk_table_stride, span[1], span[2],
            step->attn + span[0] * q_size, q_size, shape->num_heads, shape->num_kv_heads, d, shape->block_size,
            shape->scale, shape->window, esz);
        if (status != 0) return 200 - status;
    }
    return 0;
}

/* Whether the last layer runs for step->out_rows alone (1: fewer rows than the step's), every row
 * (0: no rows given, or all of them, in order), or the rows are not ascending rows of the step (-1:
 * nothing runs). The one check of the rows: the caller passes them as given. */
static int out_rows_only(const KvmDecodeStep *step)
{
    const int64_t n = step->num_out, *r = step->out_rows;
    if (r == NULL || n < 0) return 0;
    if (n > step->tokens) return -1;
    for (int64_t i = 0; i < n; i++)
        if (r[i] < 0 || r[i] >= step->tokens || (i > 0 && r[i] <= r[i - 1])) return -1;
    return n < step->tokens;
}

/* The first of step->out_rows at or after row `from` (num_out when none). */
static int64_t first_out_at(const KvmDecodeStep *step, int64_t from)
{
    int64_t lo = 0, hi = step->num_out;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (step->out_rows[mid] < from) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* The last layer's attention for the out rows: every decode row, and of each chunk the rows from its
 * first out row to its end (the prefill kernel's rows are the last positions of the chunk's
 * length, so a suffix of them is a chunk of its own); a chunk with no out row is skipped. Then the
 * out rows' attention and residual moved to the front (ascending rows: each moves down, in place). */
static int attend_out_rows(const KvmStackShape *shape, const KvmLayer *w, const KvmDecodeStep *step, int64_t q_size,
                           int64_t qk_size, int esz)
{
    KvmDecodeStep part = *step;
    part.num_chunks = 0;
    int status = attend(shape, w, &part, q_size, qk_size, esz);  /* the decode rows */
    if (status != 0) return status;
    for (int64_t c = 0; c < step->num_chunks; c++) {
        const int64_t *span = step->chunk_spans + 3 * c, end = span[0] + span[1];
        const int64_t i = first_out_at(step, span[0]);
        if (i == step->num_out || step->out_rows[i] >= end) continue;
        const int64_t from = step->out_rows[i];
        const int64_t sub[3] = {from, end - from, span[2]};
        part.num_decodes = 0;
        part.num_chunks = 1;
        part.chunk_spans = sub;
        part.chunk_tables = step->chunk_tables + c * step->chunk_table_stride;
        status = attend(shape, w, &part, q_size, qk_size, esz);
        if (status != 0) return status;
    }
    const int64_t hidden = shape->hidden;
    for (int64_t i = 0; i < step->num_out; i++) {
        const int64_t r = step->out_rows[i];
        if (r == i) continue;
        memcpy(step->attn + i * q_size, step->attn + r * q_size, sizeof(float) * (size_t)q_size);
        memcpy(step->residual + i * hidden, step->residual + r * hidden, sizeof(float) * (size_t)hidden);
    }
    return 0;
}

/* A layer past its attention, for the first m rows: x = attn Wo^T + b, h = norm(residual += x),
 * x = down(silu(gate) * up). Returns 0 or 100 - the failing packed GEMM's (negative) status. */
static int after_attention(const KvmStackShape *shape, const KvmLayer *w, const KvmDecodeStep *step, int64_t m,
                           int64_t q_size)
{
    if (m == 0) return 0;
    const int64_t hidden = shape->hidden, inter = shape->intermediate;
    int failed = linear(shape, step->attn, q_size, m, q_size, w->o, hidden, w->o_bias, step->x);
    if (failed) return 100 - failed;
    kvmesh_add_rms_norm_f32(step->residual, step->x, hidden, w->post_norm, step->h, m, hidden, shape->eps);
    failed = -3;  /* the fused kernels' "an intermediate size of part panels" */
    if (shape->gemm == 1 && m >= FUSED_SWIGLU_ROWS)
        failed = kvmesh_linear_bf16_swiglu(step->h, hidden, m, hidden, (const uint16_t *)w->gate_up, inter,
                                           w->gate_up_bias, step->act, inter);
    else if (shape->gemm == 0 && m >= FUSED_SWIGLU_ROWS_F32)
        failed = kvmesh_linear_f32_swiglu(step->h, hidden, m, hidden, (const float *)w->gate_up, inter,
                                          w->gate_up_bias, step->act, inter);
    if (failed == -3) {  /* not fused: the GEMM, then the SwiGLU */
        failed = linear(shape, step->h, hidden, m, hidden, w->gate_up, 2 * inter, w->gate_up_bias, step->gate_up);
        if (failed) return 100 - failed;
        kvmesh_silu_mul_f32(step->gate_up, 2 * inter, step->act, m, inter);
    } else if (failed) {
        return 100 - failed;
    }
    failed = linear(shape, step->act, inter, m, inter, w->down, hidden, w->down_bias, step->x);
    return failed ? 100 - failed : 0;
}

/* Returns 0, the failing paged-decode status (see kvmesh_paged_decode_f32), 200 - the failing prefill
 * attention's (negative) status, 100 - the failing packed GEMM's (negative) status, or 300 for out
 * rows that are not ascending rows of the step. */
int kvmesh_decode_stack_f32(const KvmLayer *layers, int64_t num_layers, const KvmStackShape *shape,
                            const KvmDecodeStep *step)
{
    const int64_t t = step->tokens, hidden = shape->hidden, d = shape->head_dim;
    const int64_t q_size = shape->num_heads * d, kv_size = shape->num_kv_heads * d;
    const int64_t qkv_size = q_size + 2 * kv_size, qk_size = q_size + kv_size;
    const int only_out = out_rows_only(step);
    if (only_out < 0) return 300;
    for (int64_t l = 0; l < num_layers; l++) {
        const KvmLayer *w = &layers[l];
        if (l == 0) {
            memcpy(step->residual, step->x, sizeof(float) * (size_t)(t * hidden));
            kvmesh_add_rms_norm_f32(NULL, step->x, hidden, w->input_norm, step->h, t, hidden, shape->eps);
        } else {
            kvmesh_add_rms_norm_f32(step->residual, step->x, hidden, w->input_norm, step->h, t, hidden, shape->eps);
        }
        int failed = linear(shape, step->h, hidden, t, hidden, w->qkv, qkv_size, w->qkv_bias, step->qkv);
        if (failed) return 100 - failed;
        kvmesh_rope_f32(step->qkv, qkv_size, step->cos, step->sin, d, step->qk, t,
                        shape->num_heads + shape->num_kv_heads, d);
        const int esz = shape->kv_bf16 ? 2 : 4;
        kvmesh_write_kv_elem(step->qk + q_size, qk_size, step->qkv + qk_size, qkv_size, (char *)w->k_cache,
                             (char *)w->v_cache, step->slots, t, kv_size, shape->num_slots, esz);
        if (l == num_layers - 1 && only_out) {
            const int status = attend_out_rows(shape, w, step, q_size, qk_size, esz);
            if (status != 0) return status;
            return after_attention(shape, w, step, step->num_out, q_size);
        }
        const int status = attend(shape, w, step, q_size, qk_size, esz);
        if (status != 0) return status;
        failed = after_attention(shape, w, step, t, q_size);
        if (failed) return failed;
    }
    return 0;
}
