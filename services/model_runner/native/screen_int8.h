/*
 * What head_screen.c takes from screen_int8.c: the int8 scores of the head screens (the layout
 * and the kernel are described there) and the group they are scaled in.
 */
#ifndef KVMESH_SCREEN_INT8_H
#define KVMESH_SCREEN_INT8_H

#include <stdint.h>

#define SCREEN_GROUP 32 /* weights along k per scale, on both sides (llama.cpp's Q8_0 group) */

int64_t kvmesh_screen_int8_group(void); /* SCREEN_GROUP, for the Python side's packing */
/* Built only for AVX512-VNNI (head_screen.c's int8 entry, its caller, is built under the same
 * condition). out[r][v] = sum over groups g of sx[r][g] (scale[v][g] D'[r][v][g] - offset[v][g]),
 * D' the group's dot product of the row's unsigned codes and the column's signed ones; kq a
 * multiple of SCREEN_GROUP. */
void kvmesh_screen_int8_scores(const uint8_t *qx, int64_t m, int64_t kq, const float *sx, const int8_t *codes,
                               const float *scale, const float *offset, int64_t n, float *out, int64_t out_stride);

#endif
