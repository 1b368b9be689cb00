/*
 * Paged decode attention for the CPU, reading K/V in place from the block pool; K/V slot writes.
 *
 * Why it exists: torch has no op that reads a paged cache, so the torch backend gathers every
 * sequence's blocks into a contiguous buffer before scaled_dot_product_attention, moving each K/V
 * byte two to three times. Here each sequence walks its block table once per pass: scores of all
 * heads for 16 keys at a time (each key block read from memory once, then from L1 for the other
 * query heads of its KV head), a softmax, then one pass over V.
 *
 * Layouts (elements; q and out fp32, the cache fp32 or bf16: the _f32 / _bf16 entry points):
 *   q, out       [num_rows, H, D]          rows of one query token each; head stride D
 *   k/v cache    [num_blocks, bs, KV, D]   one layer's half of the pool; token stride KV * D
 *   tables       [num_seqs, width] int32   block ids (0 = null block, never read past seq_len)
 *
 * Window: with window > 0 a sequence of len keys attends to keys len - window .. len - 1 only
 * (transformers' rule for the query at len - 1), and its blocks before that are never read: a
 * sliding-window KV cache group frees them, so they may hold another request's data.
 *
 * Memory: decode attention is memory-bound, and block tables are scattered, so the hardware
 * prefetcher (which stops at 4 KB pages) restarts at every block. The next block's lines are
 * prefetched in software, a few per unit of work, spread over the current block: issuing a whole
 * block's prefetches at once measured no better than none (they queue behind each other), spread
 * out they pay (docs/model_runner.md).
 *
 * Threads: sequences are split as pairs.h describes. The library is linked against the libgomp
 * that torch already loaded (same soname), so torch.set_num_threads governs it too: one thread
 * pool, not two.
 *
 * Paths: AVX-512 for head_dim a multiple of 16 (specialised for 64 and 128); on a CPU without
 * AVX-512 but with AVX2 + FMA the same structure in 8 lanes (attend_row_avx2); portable C loops
 * (per sequence and KV head) otherwise. prefill_attention.c's tiles (prefill_attention_avx2.c on
 * AVX2) compute a prefill row in the order of the path here that the same build takes, and where
 * they do not run it attends each row as a decode of its position through this kernel.
 *
 * Numerics: a bf16 cache is attended in bf16 dot products where kv_elem.h's kv_bf16_dots says so
 * (attend_seq_avx512 with dots; AVX512-BF16 builds); otherwise it is widened exactly to fp32 as it is
 * loaded, so the bf16 entry point's bits are the fp32 one's over a pool holding the same values. Scores and
 * the softmax in fp32, exp by range reduction (2^n * e^r, |r| <= ln2/2,
 * 7th-order Taylor, relative error < 1e-7): not bitwise equal to SDPA, equal within fp32 rounding.
 * Built without -ffast-math on purpose: a -ffast-math shared object sets flush-to-zero for the
 * whole process when it is loaded.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "exp_math.h"
#include "kernels.h"
#include "attention_amx.h"
#include "kv_elem.h"
#include "kv_prefetch.h"
#include "pairs.h"

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_HEADS KV_MAX_HEADS

#if defined(__AVX512F__) || KVM_AVX2
#include <immintrin.h>

/* The block walk both attention paths make over a sequence's keys first .. len - 1, in the
 * caller's names (table, block_stride, esz, first, len, block_size): block b's base in a pool half,
 * and its first key t0 with the offsets lo .. nblk - 1 of the keys in range. Macros, so each path
 * compiles to what the expressions written out compiled to. */
#define BLOCK_AT(cache, b) ((cache) + (int64_t)table[b] * block_stride * esz)
#define BLOCK_KEYS(b) \
    const int64_t t0 = (b) * block_size, lo = first > t0 ? first - t0 : 0; \
    const int64_t nblk = len - t0 < block_size ? len - t0 : block_size
#endif

#if defined(__AVX512F__)

/* Two vectors of partial sums -> one holding, per 128-bit lane, [a0+a2, b0+b2, a1+a3, b1+b3]. */
static inline __m512 pair_sum(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

/* 16 vectors of 16 partial sums -> one vector whose lane t is the full sum of part[t]
 * (a transposing reduction: 15 combine steps instead of 16 horizontal reductions). */
static inline __m512 transpose_sum16(const __m512 part[16]) {
    __m512 l1[8], l2[4], l3[2];
    for (int i = 0; i < 8; i++) l1[i] = pair_sum(part[2 * i], part[2 * i + 1]);
    for (int i = 0; i < 4; i++)  /* per 128-bit lane: [t0, t1, t2, t3] of its quarter */
        l2[i] = _mm512_add_ps(_mm512_shuffle_ps(l1[2 * i], l1[2 * i + 1], 0x44),
                              _mm512_shuffle_ps(l1[2 * i], l1[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)  /* quarters 0+1 and 2+3 of two groups of 4 tokens */
        l3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(l2[2 * i], l2[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(l2[2 * i], l2[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(l3[0], l3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(l3[0], l3[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Step 1 of attend_seq_avx512 for one head and a chunk of up to 16 keys (k: the first key's row for
 * the head, kstep bytes to the next): part[t] = key t's 16 partial sums of q . k (t >= n: zero), over
 * nd / 2 chunks of 32 dimensions in bf16 dot products from zero. `whole` (n == 16, a compile-time
 * constant where it is inlined) drops the per-key test: a block's keys are whole chunks but for a
 * sequence's last block, and the tests had cost the pass a compare and branch per key. */
#if KV_BF16_DOTS_BUILT
static inline __attribute__((always_inline)) void key_partials_bf16(
    __m512 part[16], const __m512bh *qv, const char *k, int64_t kstep, const int nd, int n, const int whole)
{
    for (int t = 0; t < 16; t++, k += kstep) {
        __m512 a = _mm512_setzero_ps();
        if (whole || t < n)
            for (int j = 0; j < nd / 2; j++) a = _mm512_dpbf16_ps(a, qv[j], (__m512bh)_mm512_loadu_si512(k + j * 64));
        part[t] = a;
    }
}
#endif

/* The same in fp32 FMAs (an fp32 pool, or a bf16 one widened exactly): per key the product with the
 * first 16 dimensions, then an FMA per further 16. */
static inline __attribute__((always_inline)) void key_partials_f32(
    __m512 part[16], const __m512 *qv, const char *k, int64_t kstep, const int nd, int n, const int esz,
    const int whole)
{
    for (int t = 0; t < 16; t++, k += kstep) {
        if (whole || t < n) {
            __m512 a = _mm512_mul_ps(qv[0], kv_load16(k, esz));
            for (int j = 1; j < nd; j++) a = _mm512_fmadd_ps(qv[j], kv_load16(k + j * 16 * esz, esz), a);
            part[t] = a;
        } else {
            part[t] = _mm512_setzero_ps();
        }
    }
}

/* Step 3 of attend_seq_avx512 for one block and one KV head: the weighted V of G query heads (the
 * accumulators from a0, head_dim apart) over W 16-lane slices of the head dimension (v0: the
 * block's first token's V row at the first slice), keys lo .. nblk - 1 in order (dots: key pairs
 * from lo rounded down to even, the numerators pk[g * pb_stride + o - lo_e]; else the scores
 * sk[g * n_keys + o - lo]). G and W are compile-time constants where it is inlined, so the G x W
 * accumulators stay in registers over the block's keys; with the group a runtime count they were
 * kept on the stack, and each key's update of each one was a reload and a store in the dependency
 * chain (docs/model_runner.md, "Decode attention's weighted V in registers"). Every accumulator
 * takes the same operations in the same order whatever G and W: the bits do not depend on them. */
static inline __attribute__((always_inline)) void weighted_v_block(
    float *a0, int64_t head_dim, const char *v0, int64_t token_stride, const int esz, const int dots,
    const float *sk, int64_t n_keys, const uint16_t *pk, int64_t pb_stride, int64_t lo, int64_t nblk,
    Prefetcher *pf, const int G, const int W)
{
    __m512 a[4][4];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < W; j++) a[g][j] = _mm512_loadu_ps(a0 + g * head_dim + j * 16);
#if KV_BF16_DOTS_BUILT
    if (dots) {
        const __m512i zero = _mm512_setzero_si512();
        const int64_t lo_e = lo & ~(int64_t)1;
        for (int64_t o = lo_e; o < nblk; o += 2) {  /* keys o, o + 1 of the block (block_size is even) */
            if (pf != NULL) prefetch_step(pf);
            const char *ve = v0 + o * token_stride * esz;
            const int even_ok = o >= lo, odd_ok = o + 1 < nblk;  /* a key outside the range: zero in v */
            __m512bh vv[4];
            for (int j = 0; j < W; j++) {
                const __m512i ev = even_ok ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(ve + j * 32)))
                                           : zero;
                const __m512i od = odd_ok ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                                (const __m256i *)(ve + token_stride * esz + j * 32))), 16)
                                          : zero;
                vv[j] = (__m512bh)_mm512_or_si512(ev, od);
            }
            for (int g = 0; g < G; g++) {
                const __m512bh p = kv_pair_bcast(pk + g * pb_stride + (o - lo_e));
                for (int j = 0; j < W; j++) a[g][j] = _mm512_dpbf16_ps(a[g][j], p, vv[j]);
            }
        }
    }
#else
    (void)pk;
    (void)pb_stride;
#endif
    if (!dots) {
        for (int64_t o = lo; o < nblk; o++) {
            if (pf != NULL) prefetch_step(pf);
            const char *v = v0 + o * token_stride * esz;
            __m512 vv[4];
            for (int j = 0; j < W; j++) vv[j] = kv_load16(v + j * 16 * esz, esz);
            for (int g = 0; g < G; g++) {
                const __m512 p = _mm512_set1_ps(sk[g * n_keys + o - lo]);
                for (int j = 0; j < W; j++) a[g][j] = _mm512_fmadd_ps(p, vv[j], a[g][j]);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < W; j++) _mm512_storeu_ps(a0 + g * head_dim + j * 16, a[g][j]);
}

/* A whole sequence, every head: each block (all KV heads: block_size * token_stride elements,
 * contiguous) is read from memory once, the next one prefetched while this one is used.
 * Scratch: scores [num_heads][len - first], qbuf [num_heads * head_dim] (the scaled query: fp32, or
 * bf16 with dots), acc [num_heads][nd * 16], pb (dots only) bf16 [num_heads][pb_stride]. esz: the
 * cache element's bytes (4 fp32, 2 bf16); dots: bf16 dot products (kv_elem.h, kv_bf16_dots; a bf16
 * pool); both compile-time constants where it is inlined, as nd is.
 *
 * With dots, the order prefill_attention.c's bf16 path repeats for every row: score lane l of a
 * 32-dim chunk j is vdpbf16ps over the dimension pairs (32j + 2l, 32j + 2l + 1) from zero, chunk
 * after chunk, the 16 lanes combined by transpose_sum16; the softmax numerators rounded to bf16
 * (pb, from key fe = first rounded down to even, so a 32-bit word is the pair of keys 2u, 2u + 1)
 * and summed widened; the weighted V as vdpbf16ps over key pairs in order, each V pair word
 * (v[2u][d], v[2u+1][d]) built from the two token rows, a key outside first .. len - 1 zero in
 * both p and v. */
static inline __attribute__((always_inline)) void attend_seq_avx512(
    const float *q_row, float *o_row, const char *k_cache, const char *v_cache, int64_t block_stride,
    const int32_t *table, int64_t first, int64_t len, int64_t num_heads, int64_t group, const int nd,
    int64_t token_stride, int64_t block_size, float scale, float *scores, float *qbuf, float *acc, uint16_t *pb,
    const char *next_k, const int esz, const int dots)
{
    /* keys first .. len - 1; scores [num_heads][n_keys] from key first */
    const int64_t head_dim = (int64_t)nd * 16, num_kv = num_heads / group, n_keys = len - first;
    const int64_t block_bytes = block_size * token_stride * (int64_t)esz;
    const int64_t b0 = first / block_size, num_blocks = (len + block_size - 1) / block_size;
#if KV_BF16_DOTS_BUILT
    /* dots: pb rows from key fe (first rounded down to even), the rounded query in qbuf */
    const int64_t fe = first & ~(int64_t)1, pb_stride = (len - fe + 2) & ~(int64_t)1;
    uint16_t *qb = (uint16_t *)qbuf;
    if (dots) kv_round_bf16(q_row, scale, qb, num_heads * head_dim);
#else
    (void)pb;
    const int64_t pb_stride = 0;
#endif
    if (!dots) {
        const __m512 vscale = _mm512_set1_ps(scale);
        for (int64_t i = 0; i < num_heads * head_dim; i += 16)
            _mm512_storeu_ps(qbuf + i, _mm512_mul_ps(_mm512_loadu_ps(q_row + i), vscale));
    }
    /* each head's running max lane-wise, reduced once after the pass (a max is exact in any order) */
    __m512 vmax[MAX_HEADS];
    for (int64_t h = 0; h < num_heads; h++) vmax[h] = _mm512_set1_ps(-3.0e38f);
    const int64_t kstep = token_stride * esz;  /* one key to the next in a block */

    /* 1. scores. The blocks in the order they are read (K, then V, then the next sequence's first K)
     * are SEQ_BLOCK(0, 1, ...); block i's work prefetches block i + ahead. Where a block is small
     * (bf16 SmolLM2: 6 KB) two ahead, with block 1 prefetched whole at the start beside block 0:
     * more of the sequence's lines in flight (docs/model_runner.md, "Decode attention's prefetch
     * distance"). */
    const int64_t nk = num_blocks - b0, ahead = block_bytes <= KV_PREFETCH_SMALL_BLOCK ? 2 : 1;
#define SEQ_BLOCK(i) ((i) < nk ? BLOCK_AT(k_cache, b0 + (i)) : (i) < 2 * nk ? BLOCK_AT(v_cache, b0 + (i) - nk) \
                      : (i) == 2 * nk ? next_k : NULL)
    prefetch_block(BLOCK_AT(k_cache, b0), block_bytes);
    if (ahead > 1 && nk > 1) prefetch_block(BLOCK_AT(k_cache, b0 + 1), block_bytes);
    for (int64_t b = b0; b < num_blocks; b++) {
        BLOCK_KEYS(b);
        const char *kb = BLOCK_AT(k_cache, b);
        /* the last K blocks prefetch the first V blocks (docs/model_runner.md) */
        Prefetcher pf = prefetcher(SEQ_BLOCK(b - b0 + ahead), block_bytes, ((nblk - lo + 15) / 16) * num_heads);
        for (int64_t c0 = lo; c0 < nblk; c0 += 16) {
            const int n = (int)(nblk - c0 < 16 ? nblk - c0 : 16);
            const __mmask16 live = (__mmask16)((1u << n) - 1u);
            for (int64_t h = 0; h < num_heads; h++) {
                prefetch_step(&pf);
                const char *kh = kb + (c0 * token_stride + (h / group) * head_dim) * esz;
                __m512 part[16];
#if KV_BF16_DOTS_BUILT
                if (dots) {
                    __m512bh qv[MAX_HEAD_DIM / 32];
                    for (int j = 0; j < nd / 2; j++) qv[j] = (__m512bh)_mm512_loadu_si512(qb + h * head_dim + j * 32);
                    if (n == 16) key_partials_bf16(part, qv, kh, kstep, nd, n, 1);
                    else key_partials_bf16(part, qv, kh, kstep, nd, n, 0);
                }
#endif
                if (!KV_BF16_DOTS_BUILT || !dots) {  /* (dots is never set where the build lacks them) */
                    const float *qh = qbuf + h * head_dim;
                    __m512 qv[MAX_HEAD_DIM / 16];
                    for (int j = 0; j < nd; j++) qv[j] = _mm512_loadu_ps(qh + j * 16);
                    if (n == 16) key_partials_f32(part, qv, kh, kstep, nd, n, esz, 1);
                    else key_partials_f32(part, qv, kh, kstep, nd, n, esz, 0);
                }
                const __m512 sc = transpose_sum16(part);
                _mm512_mask_storeu_ps(scores + h * n_keys + t0 + c0 - first, live, sc);
                vmax[h] = _mm512_mask_max_ps(vmax[h], live, vmax[h], sc);
            }
        }
    }
    float maxv[MAX_HEADS];
    for (int64_t h = 0; h < num_heads; h++) maxv[h] = _mm512_reduce_max_ps(vmax[h]);
    /* 2. softmax numerators: in place, or (dots) rounded to bf16 into pb (key k at k - fe) */
    float inv_sum[MAX_HEADS];
    for (int64_t h = 0; h < num_heads; h++) {
#if KV_BF16_DOTS_BUILT
        if (dots) inv_sum[h] = kv_softmax_bf16(scores + h * n_keys, n_keys, maxv[h], pb + h * pb_stride + (first - fe),
                                               first);
#endif
        if (!dots) inv_sum[h] = softmax_row_f32(scores + h * n_keys, n_keys, maxv[h]);
    }
    /* 3. weighted V (keys in order; dots: key pairs): per block and KV head, that head group's
     * accumulators in registers, up to 4 heads x 4 16-lane slices a pass (weighted_v_block) */
    for (int64_t i = 0; i < num_heads * head_dim; i += 16) _mm512_storeu_ps(acc + i, _mm512_setzero_ps());
    for (int64_t b = b0; b < num_blocks; b++) {
        BLOCK_KEYS(b);
        const int64_t lo_e = dots ? lo & ~(int64_t)1 : lo, step = dots ? 2 : 1;
        const char *vb = BLOCK_AT(v_cache, b);
        /* the last V blocks prefetch the first K block of this thread's next sequence */
        Prefetcher pf = prefetcher(SEQ_BLOCK(nk + b - b0 + ahead),
                                   block_bytes, num_kv * ((nblk - lo_e + step - 1) / step));
        for (int64_t kvh = 0; kvh < num_kv; kvh++)
            for (int64_t g0 = 0; g0 < group; g0 += 4)
                for (int j0 = 0; j0 < nd; j0 += 4) {
                    const int64_t h0 = kvh * group + g0;
                    /* nd a multiple of 4 (64 and 128 are compile-time constants): every pass 4 wide, folded */
                    const int heads_in = (int)(group - g0 < 4 ? group - g0 : 4),
                              w = nd % 4 == 0 || nd - j0 >= 4 ? 4 : nd - j0;
                    float *a0 = acc + h0 * head_dim + j0 * 16;
                    const char *v0 = vb + (kvh * head_dim + j0 * 16) * esz;
#if KV_BF16_DOTS_BUILT
                    const uint16_t *pk = dots ? pb + h0 * pb_stride + (t0 + lo_e - fe) : NULL;
#else
                    const uint16_t *pk = NULL;
#endif
                    const float *sk = scores + h0 * n_keys + (t0 + lo - first);
                    Prefetcher *pp = g0 == 0 && j0 == 0 ? &pf : NULL;  /* one prefetch step per key (pair) */
#define WVB(G, W) weighted_v_block(a0, head_dim, v0, token_stride, esz, dots, sk, n_keys, pk, pb_stride, lo, nblk, \
                                   pp, G, W)
#define WV_HEADS(W) switch (heads_in) { \
                        case 1: WVB(1, W); break; case 2: WVB(2, W); break; case 3: WVB(3, W); break; \
                        default: WVB(4, W); break; }
                    switch (w) {
                        case 4: WV_HEADS(4) break;
                        case 3: WV_HEADS(3) break;
                        case 2: WV_HEADS(2) break;
                        default: WV_HEADS(1) break;
                    }
#undef WV_HEADS
#undef WVB
                }
    }
#undef SEQ_BLOCK
    for (int64_t h = 0; h < num_heads; h++) {
        const __m512 inv = _mm512_set1_ps(inv_sum[h]);
        for (int j = 0; j < nd; j++)
            _mm512_storeu_ps(o_row + h * head_dim + j * 16, _mm512_mul_ps(_mm512_loadu_ps(acc + h * head_dim + j * 16), inv));
    }
}
#endif

#if KVM_AVX2
/* Four vectors of 8 partial sums -> per 128-bit lane, the lane's sums of p0 .. p3. */
static inline __m256 quad_sum(__m256 p0, __m256 p1, __m256 p2, __m256 p3) {
    return _mm256_hadd_ps(_mm256_hadd_ps(p0, p1), _mm256_hadd_ps(p2, p3));
}

/* Two quad_sums (keys 0-3, 4-7) -> lane t the full sum of key t (a transposing reduction, as
 * transpose_sum16 above: 7 combine steps for 8 keys instead of 8 horizontal reductions). */
static inline __m256 octet_sum(__m256 u0, __m256 u1) {
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* One key's score partials: q (nd16 * 2 vectors, in qv) times the key's row at k. */
static inline __attribute__((always_inline)) __m256 key_partial(const __m256 *qv, const char *k, const int nd16,
                                                                const int esz) {
    __m256 a = _mm256_mul_ps(qv[0], kv_load8(k, esz));
    for (int j = 1; j < 2 * nd16; j++) a = _mm256_fmadd_ps(qv[j], kv_load8(k + j * 8 * esz, esz), a);
    return a;
}

/* One slice of W x 8 dimensions (W = 2 or 4) of the weighted V for G (<= 4) query heads of one KV
 * head over n keys of a block: acc[g][0 .. 8W) += p[g][o] * v[o][0 .. 8W), keys in order. G and W
 * compile-time constants once inlined keep the G x W accumulators in registers (with the group a
 * runtime count they lived on the stack, a load and a store per FMA: 40% of the kernel's time in a
 * perf profile); W = 4 where G <= 3 gives 12 independent FMA chains instead of 6 (latency-bound at
 * 4 cycles an FMA). a: head g0's slice (heads head_dim apart), p: its numerators (heads n_keys
 * apart), v: the first key's slice (keys token_stride elements apart). */
static inline __attribute__((always_inline)) void weighted_v_slice(
    float *a, const float *p, const char *v, int64_t n, const int G, const int W, int64_t head_dim,
    int64_t n_keys, int64_t token_stride, const int esz, Prefetcher *pf)
{
    __m256 c[4][4];
    for (int g = 0; g < G; g++)
        for (int w = 0; w < W; w++) c[g][w] = _mm256_loadu_ps(a + g * head_dim + w * 8);
    for (int64_t o = 0; o < n; o++) {
        prefetch_step(pf);
        const char *vo = v + o * token_stride * esz;
        __m256 vv[4];
        for (int w = 0; w < W; w++) vv[w] = kv_load8(vo + w * 8 * esz, esz);
        for (int g = 0; g < G; g++) {
            const __m256 pw = _mm256_broadcast_ss(p + g * n_keys + o);
            for (int w = 0; w < W; w++) c[g][w] = _mm256_fmadd_ps(pw, vv[w], c[g][w]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int w = 0; w < W; w++) _mm256_storeu_ps(a + g * head_dim + w * 8, c[g][w]);
}

/* One row (a query token of a sequence) as attend_row_avx2 walks it: the row's keys first .. len - 1
 * and its scratch (scores [num_heads][n_keys], qbuf the scaled query, acc [num_heads][head_dim]). */
typedef struct {
    const float *q;
    float *o, *scores, *qbuf, *acc;
    int64_t first, len, n_keys;
    int64_t b0, nb;  /* the row's blocks: b0 .. nb - 1 */
    float maxv[MAX_HEADS], inv_sum[MAX_HEADS];
} AttRow;

/* One row's scores for the keys of block b (kb: the block's K), 8 keys at a time per head. */
static inline __attribute__((always_inline)) void row_scores_block(
    AttRow *row, const char *kb, int64_t b, int64_t num_heads, int64_t group, const int nd16,
    int64_t token_stride, int64_t block_size, Prefetcher *pf, const int esz)
{
    const int64_t first = row->first, len = row->len, n_keys = row->n_keys, head_dim = (int64_t)nd16 * 16;
    const int64_t num_kv = num_heads / group;
    BLOCK_KEYS(b);
    for (int64_t c0 = lo; c0 < nblk; c0 += 8) {
        const int n = (int)(nblk - c0 < 8 ? nblk - c0 : 8);
        const __m256i live = lanes_below(n);
        /* heads in order, walked per KV head (h / group in the loop was a 64-bit division per
         * 8 keys and head) */
        for (int64_t kvh = 0, h = 0; kvh < num_kv; kvh++)
        for (int64_t g = 0; g < group; g++, h++) {
            prefetch_step(pf);
            const char *kh = kb + (c0 * token_stride + kvh * head_dim) * esz;
            const int64_t kstep = token_stride * esz;
            __m256 qv[MAX_HEAD_DIM / 8];
            for (int j = 0; j < 2 * nd16; j++) qv[j] = _mm256_loadu_ps(row->qbuf + h * head_dim + j * 8);
            const __m256 zero = _mm256_setzero_ps();
#define PART(t) (t < n ? key_partial(qv, kh + (t) * kstep, nd16, esz) : zero)
            const __m256 u0 = quad_sum(PART(0), PART(1), PART(2), PART(3));
            const __m256 u1 = quad_sum(PART(4), PART(5), PART(6), PART(7));
#undef PART
            const __m256 sc = octet_sum(u0, u1);
            /* a masked store only for a block's last keys (on AMD a vmaskmovps store costs ~10x a
             * plain one: 8% of a prefill's attention in a perf profile) */
            float *dst = row->scores + h * n_keys + t0 + c0 - first;
            if (n == 8) _mm256_storeu_ps(dst, sc);
            else _mm256_maskstore_ps(dst, live, sc);
            /* the max over the live lanes (the others -3e38, below any score) */
            __m256 mx = n == 8 ? sc : _mm256_blendv_ps(_mm256_set1_ps(-3.0e38f), sc, _mm256_castsi256_ps(live));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            const float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            if (m > row->maxv[h]) row->maxv[h] = m;
        }
    }
}

/* 32 dimensions a weighted-V slice where the group has <= 3 heads (12 chains), else 16. */
static inline int v_wide(int64_t group, int nd16) { return group <= 3 && nd16 % 2 == 0; }

/* One row's weighted V over the keys of block b (vb: the block's V), keys in order, per KV head and
 * 16-dimension slice, up to 4 heads at a time. */
static inline __attribute__((always_inline)) void row_values_block(
    AttRow *row, const char *vb, int64_t b, int64_t num_kv, int64_t group, const int nd16,
    int64_t token_stride, int64_t block_size, Prefetcher *pf, const int esz)
{
    const int64_t first = row->first, len = row->len, n_keys = row->n_keys, head_dim = (int64_t)nd16 * 16;
    BLOCK_KEYS(b);
    for (int64_t kvh = 0; kvh < num_kv; kvh++) {
        float *ah = row->acc + kvh * group * head_dim;
        const float *sk = row->scores + kvh * group * n_keys + (t0 + lo - first);  /* key t0 + lo */
        const int wide = v_wide(group, nd16);
        for (int d16 = 0; d16 < nd16; d16 += wide ? 2 : 1) {
            const char *v = vb + (lo * token_stride + kvh * head_dim + d16 * 16) * esz;
            for (int64_t g0 = 0; g0 < group; g0 += 4) {
                float *a = ah + g0 * head_dim + d16 * 16;
                const float *p = sk + g0 * n_keys;
#define WV(G, W) weighted_v_slice(a, p, v, nblk - lo, G, W, head_dim, n_keys, token_stride, esz, pf)
                if (wide) {
                    switch (group) {
                    case 1: WV(1, 4); break;
                    case 2: WV(2, 4); break;
                    default: WV(3, 4);
                    }
                } else {
                    switch (group - g0 < 4 ? group - g0 : 4) {
                    case 1: WV(1, 2); break;
                    case 2: WV(2, 2); break;
                    case 3: WV(3, 2); break;
                    default: WV(4, 2);
                    }
                }
#undef WV
            }
        }
    }
}

/* attend_seq_avx512's fp32 arithmetic in 8 lanes (an fp32 pool, or a bf16 one widened exactly) for
 * one row (a query token of a sequence), every head, each block read from memory once with the
 * next one prefetched: scores for 8 keys at a time per head (quad_sum / octet_sum; a key past the
 * block's end a zero partial), softmax_row_f32 (exp_math.h) per head, then the weighted V over keys
 * in order, in 16- or 32-dimension slices of up to 4 heads (weighted_v_slice, v_wide) so the
 * accumulators stay in registers. nd16 = head_dim / 16. prefill_attention_avx2.c computes a
 * prefill row in this very order, so a prefill row is bitwise its decode. */
static inline __attribute__((always_inline)) void attend_row_avx2(
    AttRow *row, const char *k_cache, const char *v_cache, int64_t block_stride, const int32_t *table,
    int64_t num_heads, int64_t group, const int nd16, int64_t token_stride, int64_t block_size, float scale,
    const char *next_k, const int esz)
{
    const int64_t head_dim = (int64_t)nd16 * 16, num_kv = num_heads / group;
    const int64_t block_bytes = block_size * token_stride * (int64_t)esz;
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < num_heads * head_dim; i += 8)
        _mm256_storeu_ps(row->qbuf + i, _mm256_mul_ps(_mm256_loadu_ps(row->q + i), vscale));
    for (int64_t h = 0; h < num_heads; h++) row->maxv[h] = -3.0e38f;
    row->n_keys = row->len - row->first;
    row->b0 = row->first / block_size;
    row->nb = (row->len + block_size - 1) / block_size;
    const int64_t b_lo = row->b0, b_hi = row->nb;
#define ROW_KEYS_IN(b) \
    (((b) + 1) * block_size < row->len ? ((b) + 1) * block_size : row->len) \
        - (row->first > (b) * block_size ? row->first : (b) * block_size)

    /* 1. scores */
    prefetch_block(BLOCK_AT(k_cache, b_lo), block_bytes);
    for (int64_t b = b_lo; b < b_hi; b++) {
        const int64_t steps = ((ROW_KEYS_IN(b) + 7) / 8) * num_heads;
        Prefetcher pf = prefetcher(b + 1 < b_hi ? BLOCK_AT(k_cache, b + 1) : BLOCK_AT(v_cache, b_lo), block_bytes, steps);
        row_scores_block(row, BLOCK_AT(k_cache, b), b, num_heads, group, nd16, token_stride, block_size, &pf, esz);
    }
    /* 2. softmax numerators, in place */
    for (int64_t h = 0; h < num_heads; h++)
        row->inv_sum[h] = softmax_row_f32(row->scores + h * row->n_keys, row->n_keys, row->maxv[h]);
    for (int64_t i = 0; i < num_heads * head_dim; i += 8) _mm256_storeu_ps(row->acc + i, _mm256_setzero_ps());
    /* 3. weighted V (keys in order), per block, KV head and 16- or 32-dimension slice */
    const int64_t v_slices = v_wide(group, nd16) ? nd16 / 2 : nd16;
    for (int64_t b = b_lo; b < b_hi; b++) {
        const int64_t steps = num_kv * v_slices * ROW_KEYS_IN(b);
        Prefetcher pf = prefetcher(b + 1 < b_hi ? BLOCK_AT(v_cache, b + 1) : next_k, block_bytes, steps);
        row_values_block(row, BLOCK_AT(v_cache, b), b, num_kv, group, nd16, token_stride, block_size, &pf, esz);
    }
#undef ROW_KEYS_IN
    for (int64_t h = 0; h < num_heads; h++) {
        const __m256 inv = _mm256_set1_ps(row->inv_sum[h]);
        for (int j = 0; j < 2 * nd16; j++)
            _mm256_storeu_ps(row->o + h * head_dim + j * 8,
                             _mm256_mul_ps(_mm256_loadu_ps(row->acc + h * head_dim + j * 8), inv));
    }
}
#endif

/* Token t's row for one KV head in a paged cache half, as fp32 (portable path: the block of every
 * token is looked up; the AVX-512 path walks block by block to prefetch): an fp32 cache's row in
 * place, a bf16 cache's widened into tmp (head_dim floats). */
static inline const float *token_row(const char *cache, const int32_t *table, int64_t t, int64_t block_size,
                                     int64_t block_stride, int64_t token_stride, int64_t kv_offset, int64_t head_dim,
                                     int esz, float *tmp)
{
    const int64_t i = (int64_t)table[t / block_size] * block_stride + (t % block_size) * token_stride + kv_offset;
    if (esz == 4) return (const float *)cache + i;
    for (int64_t d = 0; d < head_dim; d++) tmp[d] = kv_load1(cache, i + d, esz);
    return tmp;
}

/* One (sequence, KV head), portable C: the fallback without AVX-512 or for odd head sizes. */
static void attend_portable(
    const float *qs, float *os, const char *k_cache, const char *v_cache, int64_t block_stride,
    const int32_t *table, int64_t first, int64_t len, int64_t group, int64_t head_dim, int64_t token_stride,
    int64_t block_size, int64_t kv_offset, float scale, float *scores, int esz)
{
    float row[MAX_HEAD_DIM];  /* a bf16 row widened */
    /* keys first .. len - 1; scores [group][n] from key first */
    const int64_t n = len - first;
    float qv[MAX_GROUP][MAX_HEAD_DIM];
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < head_dim; d++) qv[g][d] = qs[g * head_dim + d] * scale;
    float maxv[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) maxv[g] = -3.0e38f;
    for (int64_t t = first; t < len; t++) {
        const float *k = token_row(k_cache, table, t, block_size, block_stride, token_stride, kv_offset, head_dim, esz,
                                   row);
        for (int64_t g = 0; g < group; g++) {
            float acc = 0.0f;
            #pragma omp simd reduction(+:acc)
            for (int64_t d = 0; d < head_dim; d++) acc += qv[g][d] * k[d];
            scores[g * n + t - first] = acc;
            if (acc > maxv[g]) maxv[g] = acc;
        }
    }
    float inv_sum[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * n;
        const float m = maxv[g];
        float sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < n; t++) {
            const float e = exp_neg(sg[t] - m);
            sg[t] = e;
            sum += e;
        }
        inv_sum[g] = 1.0f / sum;
    }
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < head_dim; d++) acc[g][d] = 0.0f;
    for (int64_t t = first; t < len; t++) {
        const float *v = token_row(v_cache, table, t, block_size, block_stride, token_stride, kv_offset, head_dim, esz,
                                   row);
        for (int64_t g = 0; g < group; g++) {
            const float p = scores[g * n + t - first];
            #pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) acc[g][d] += p * v[d];
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < head_dim; d++) os[g * head_dim + d] = acc[g][d] * inv_sum[g];
}

/* The K block holding sequence s's first attended key (NULL for s < 0 or an empty sequence): what a
 * thread prefetches for the sequence it takes next. */
static inline const char *first_k_block(const char *k_cache, const int32_t *tables, int64_t table_stride,
                                        const int32_t *seq_lens, int64_t s, int64_t window, int64_t block_size,
                                        int64_t block_stride, int esz) {
    if (s < 0 || seq_lens[s] <= 0) return NULL;
    return k_cache + (int64_t)tables[s * table_stride + first_key(seq_lens[s], window) / block_size] * block_stride * esz;
}

/* Returns 0, -1 for an unsupported shape (too many query heads per KV head, head_dim > 256),
 * -2 when a thread could not allocate its score buffer. window: 0 = full attention; block_stride
 * in elements; esz: the cache element's bytes (4 fp32, 2 bf16). */
/* The decode attention over a pool of esz-byte elements (4: fp32, 2: bf16, in bf16 dot products or
 * widened exactly on load as kv_elem.h's kv_bf16_dots says); the typed entry points below and decode_stack.c call it. */
#if KVM_AVX2
/* kvmesh_paged_decode_elem on the AVX2 path: work items are sequences (rows), split over threads
 * as pairs.h describes, each thread prefetching its next row's first K block. */
static int paged_decode_avx2(
    const float *q, int64_t q_row_stride, const char *k_cache, const char *v_cache, int64_t block_stride,
    const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, const int32_t *rows, int64_t num_seqs,
    float *out, int64_t out_row_stride, int64_t num_heads, int64_t group, int64_t head_dim, int64_t token_stride,
    int64_t block_size, int64_t max_seq_len, float scale, int64_t window, int esz)
{
    int64_t claimed[MAX_PAIRS] = {0};
    int failed = 0;
    #pragma omp parallel
    {
        const size_t heads = (size_t)num_heads, dim = (size_t)head_dim;
        /* scores (+16: masked stores never write past len, but keep a lane group spare), the scaled
         * query, the accumulators */
        const size_t score_floats = heads * (size_t)(max_seq_len > 0 ? max_seq_len : 1) + 16;
        float *buf = (float *)malloc(sizeof(float) * (score_floats + 2 * heads * dim));
        if (buf == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        AttRow row;
        PairedRun run;
        paired_run_init(&run, num_seqs, claimed);
        for (int64_t taken = 0;; taken++) {
            const int64_t s = paired_run_take(&run, taken);
            if (s < 0) break;
            if (buf == NULL) continue;
            const int64_t ns = paired_run_after(&run, s);
            const char *next_k = first_k_block(k_cache, tables, table_stride, seq_lens, ns, window, block_size,
                                               block_stride, esz);
            const int64_t len = seq_lens[s];
            float *os = out + (int64_t)rows[s] * out_row_stride;
            if (len <= 0) {
                for (int64_t i = 0; i < num_heads * head_dim; i++) os[i] = 0.0f;
                continue;
            }
            row.q = q + (int64_t)rows[s] * q_row_stride;
            row.o = os;
            row.scores = buf;
            row.qbuf = buf + score_floats;
            row.acc = buf + score_floats + heads * dim;
            row.first = first_key(len, window);
            row.len = len;
            const int32_t *table = tables + s * table_stride;
#define ATTEND(nd, esz) attend_row_avx2(&row, k_cache, v_cache, block_stride, table, num_heads, group, nd, \
                                        token_stride, block_size, scale, next_k, esz)
            if (esz == 4) {
                if (head_dim == 64) ATTEND(4, 4);
                else if (head_dim == 128) ATTEND(8, 4);
                else ATTEND((int)(head_dim / 16), 4);
            } else {
                if (head_dim == 64) ATTEND(4, 2);
                else if (head_dim == 128) ATTEND(8, 2);
                else ATTEND((int)(head_dim / 16), 2);
            }
#undef ATTEND
        }
        free(buf);
    }
    return failed ? -2 : 0;
}
#endif

int kvmesh_paged_decode_elem(
    const float *q, int64_t q_row_stride,
    const char *k_cache, const char *v_cache, int64_t block_stride,
    const int32_t *tables, int64_t table_stride,
    const int32_t *seq_lens, const int32_t *rows, int64_t num_seqs,
    float *out, int64_t out_row_stride,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t max_seq_len, float scale, int64_t window, int esz)
{
    if (num_kv_heads <= 0 || num_heads % num_kv_heads) return -1;
    const int64_t group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM) return -1;
    const int64_t token_stride = num_kv_heads * head_dim;
    int failed = 0;
#if KVM_AVX2
    if (head_dim % 16 == 0 && num_heads <= MAX_HEADS)
        return paged_decode_avx2(q, q_row_stride, k_cache, v_cache, block_stride, tables, table_stride, seq_lens, rows,
                                 num_seqs, out, out_row_stride, num_heads, group, head_dim, token_stride, block_size,
                                 max_seq_len, scale, window, esz);
#endif
#if KV_AMX_BUILT
    if (kv_amx(esz, num_heads, head_dim, block_size))  /* attention_amx.c: the prefill kernel's tiles too */
        return kvm_decode_amx(q, q_row_stride, (const uint16_t *)k_cache, (const uint16_t *)v_cache, block_stride,
                              tables, table_stride, seq_lens, rows, num_seqs, out, out_row_stride, num_heads,
                              num_kv_heads, head_dim, block_size, max_seq_len, scale, window);
#endif
#if defined(__AVX512F__)
    if (head_dim % 16 == 0 && num_heads <= MAX_HEADS) {
        const int dots = kv_bf16_dots(esz, num_heads, head_dim, block_size);
        int64_t claimed[MAX_PAIRS] = {0};
        #pragma omp parallel
        {
            const size_t heads = (size_t)num_heads, dim = (size_t)head_dim;
            /* +16: masked 16-lane stores never write past len, but keep the buffer a lane group longer */
            float *scores = (float *)malloc(sizeof(float) * (heads * (size_t)(max_seq_len > 0 ? max_seq_len : 1) + 16));
            float *qbuf = (float *)malloc(sizeof(float) * heads * dim);
            float *acc = (float *)malloc(sizeof(float) * heads * dim);
            /* bf16 dot products (kv_bf16_dots): qbuf holds the rounded query, pbuf the rounded numerators */
            uint16_t *pbuf = dots ? (uint16_t *)malloc(sizeof(uint16_t) * heads * (size_t)(max_seq_len + 4)) : NULL;
            if (scores == NULL || qbuf == NULL || acc == NULL || (dots && pbuf == NULL)) {
                #pragma omp atomic write
                failed = 1;
            }
            /* sequences split as pairs.h describes: each thread knows its next sequence (and
             * prefetches its first K block) */
            PairedRun run;
            paired_run_init(&run, num_seqs, claimed);
            for (int64_t taken = 0;; taken++) {
                const int64_t s = paired_run_take(&run, taken);
                if (s < 0) break;
                if (scores == NULL || qbuf == NULL || acc == NULL || (dots && pbuf == NULL)) continue;
                const int64_t ns = paired_run_after(&run, s);
                const char *next_k = first_k_block(k_cache, tables, table_stride, seq_lens, ns, window, block_size,
                                                   block_stride, esz);
                const int64_t len = seq_lens[s];
                const float *qs = q + (int64_t)rows[s] * q_row_stride;
                float *os = out + (int64_t)rows[s] * out_row_stride;
                if (len <= 0) {
                    for (int64_t i = 0; i < num_heads * head_dim; i++) os[i] = 0.0f;
                    continue;
                }
                const int32_t *table = tables + s * table_stride;
                const int64_t first = first_key(len, window);
#if defined(__AVX512F__)
#define ATTEND(nd, esz, dots) attend_seq_avx512(qs, os, k_cache, v_cache, block_stride, table, first, len, \
                                                num_heads, group, nd, token_stride, block_size, scale, scores, qbuf, \
                                                acc, pbuf, next_k, esz, dots)
                if (dots) {
                    if (head_dim == 64) ATTEND(4, 2, 1);
                    else if (head_dim == 128) ATTEND(8, 2, 1);
                    else ATTEND((int)(head_dim / 16), 2, 1);
                } else if (esz == 4) {
                    if (head_dim == 64) ATTEND(4, 4, 0);
                    else if (head_dim == 128) ATTEND(8, 4, 0);
                    else ATTEND((int)(head_dim / 16), 4, 0);
                } else {
                    if (head_dim == 64) ATTEND(4, 2, 0);
                    else if (head_dim == 128) ATTEND(8, 2, 0);
                    else ATTEND((int)(head_dim / 16), 2, 0);
                }
#undef ATTEND
#endif
            }
            free(scores);
            free(qbuf);
            free(acc);
            free(pbuf);
        }
        return failed ? -2 : 0;
    }
#endif
    const int64_t items = num_seqs * num_kv_heads;

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
            const int32_t *table = tables + s * table_stride;
            const int64_t kv_offset = kvh * head_dim;
            attend_portable(qs, os, k_cache, v_cache, block_stride, table, first_key(len, window), len, group,
                            head_dim, token_stride, block_size, kv_offset, scale, scores, esz);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}

/* kernels.h */
int64_t kvmesh_kv_prefetch_l2(void) {
#if defined(KVMESH_KV_PREFETCH_L2)
    return 1;
#else
    return 0;
#endif
}

int64_t kvmesh_bf16_dots_for(int64_t num_heads, int64_t head_dim, int64_t block_size) {
    return kv_bf16_dots(2, num_heads, head_dim, block_size);
}

int64_t kvmesh_kv_amx_for(int64_t num_heads, int64_t head_dim, int64_t block_size) {
    return kv_amx(2, num_heads, head_dim, block_size);
}

int kvmesh_paged_decode_f32(
    const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache, int64_t block_stride,
    const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, const int32_t *rows, int64_t num_seqs,
    float *out, int64_t out_row_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_seq_len, float scale, int64_t window)
{
    return kvmesh_paged_decode_elem(q, q_row_stride, (const char *)k_cache, (const char *)v_cache, block_stride,
                                    tables, table_stride, seq_lens, rows, num_seqs, out, out_row_stride, num_heads,
                                    num_kv_heads, head_dim, block_size, max_seq_len, scale, window, 4);
}

/* The same over a bf16 cache (block_stride in elements): bf16 dot products where kv_bf16_dots holds,
 * else bitwise the fp32 entry point over the widened values. */
int kvmesh_paged_decode_bf16(
    const float *q, int64_t q_row_stride, const uint16_t *k_cache, const uint16_t *v_cache, int64_t block_stride,
    const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, const int32_t *rows, int64_t num_seqs,
    float *out, int64_t out_row_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_seq_len, float scale, int64_t window)
{
    return kvmesh_paged_decode_elem(q, q_row_stride, (const char *)k_cache, (const char *)v_cache, block_stride,
                                    tables, table_stride, seq_lens, rows, num_seqs, out, out_row_stride, num_heads,
                                    num_kv_heads, head_dim, block_size, max_seq_len, scale, window, 2);
}

/* Stores T tokens' K and V rows (each kv_elems contiguous floats, rows row_stride apart) at their
 * pool slots of esz-byte elements (4: copied; 2: each value rounded to nearest even, kv_elem.h:
 * torch's fp32 -> bf16 conversion bit for bit); slot -1 (batch padding) is skipped.
 * Single-threaded on purpose: a decode step writes a few KB per layer, less than an OpenMP fork
 * costs. Returns the number of rows written. */
int64_t kvmesh_write_kv_elem(
    const float *key, int64_t key_row_stride, const float *value, int64_t value_row_stride,
    char *k_cache, char *v_cache, const int64_t *slots, int64_t num_tokens, int64_t kv_elems,
    int64_t num_slots, int esz)
{
    int64_t written = 0;
    for (int64_t i = 0; i < num_tokens; i++) {
        const int64_t slot = slots[i];
        if (slot < 0 || slot >= num_slots) continue;
        const float *ks = key + i * key_row_stride, *vs = value + i * value_row_stride;
        char *kd = k_cache + slot * kv_elems * esz, *vd = v_cache + slot * kv_elems * esz;
        if (esz == 2) {
            for (int64_t e = 0; e < kv_elems; e++) ((uint16_t *)kd)[e] = kv_f32_to_bf16(ks[e]);
            for (int64_t e = 0; e < kv_elems; e++) ((uint16_t *)vd)[e] = kv_f32_to_bf16(vs[e]);
        } else {
            memcpy(kd, ks, sizeof(float) * (size_t)kv_elems);
            memcpy(vd, vs, sizeof(float) * (size_t)kv_elems);
        }
        written++;
    }
    return written;
}

int64_t kvmesh_write_kv_f32(
    const float *key, int64_t key_row_stride, const float *value, int64_t value_row_stride,
    float *k_cache, float *v_cache, const int64_t *slots, int64_t num_tokens, int64_t kv_elems,
    int64_t num_slots)
{
    return kvmesh_write_kv_elem(key, key_row_stride, value, value_row_stride, (char *)k_cache, (char *)v_cache,
                                slots, num_tokens, kv_elems, num_slots, 4);
}

/* kvmesh_write_kv_f32 into a bf16 cache. */
int64_t kvmesh_write_kv_bf16(
    const float *key, int64_t key_row_stride, const float *value, int64_t value_row_stride,
    uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots, int64_t num_tokens, int64_t kv_elems,
    int64_t num_slots)
{
    return kvmesh_write_kv_elem(key, key_row_stride, value, value_row_stride, (char *)k_cache, (char *)v_cache,
                                slots, num_tokens, kv_elems, num_slots, 2);
}
