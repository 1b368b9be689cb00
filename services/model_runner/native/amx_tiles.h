/*
 * The AMX tile configuration that LDTILECFG reads (palette 1: 8 tiles, each up to 16 rows of 64
 * bytes), for the kernels that run on tiles: gemm_amx.c and attention_amx.c.
 */
#ifndef KVMESH_AMX_TILES_H
#define KVMESH_AMX_TILES_H

#include <stdint.h>

typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxTileConfig;

#endif
