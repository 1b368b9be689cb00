/*
 * The fp32 GEMM's arithmetic, one output at a time, for tests/kernels/test_native_gemm.py:
 *
 *     acc = +0; for kk in 0 .. k-1: acc = fma(x[r, kk], w[c, kk], acc); out[r, c] = acc + (bias or +0)
 *
 * fmaf rounds once per step, as one lane of a vector FMA does, so a kernel that keeps this
 * sequence per output, whatever its blocking over rows, columns or panels, its loop order,
 * unrolling, prefetch or thread split, gives these bits; a kernel that reorders the k sum does not.
 * The weight is read from native/gemm.c's packed layout ([ceil(n / panel)][k][panel]).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

void reference_linear_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed, int64_t n,
                          int64_t panel, const float *bias, float *out, int64_t out_stride)
{
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < n; c++) {
            const float *w = packed + (c / panel) * k * panel + c % panel;
            float acc = 0.0f;
            for (int64_t kk = 0; kk < k; kk++) acc = fmaf(x[r * x_stride + kk], w[kk * panel], acc);
            out[r * out_stride + c] = acc + (bias != NULL ? bias[c] : 0.0f);
        }
}
