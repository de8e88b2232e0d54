/* AVX2 + FMA + F16C (Haswell, Zen 1-3): vpmaddubsw / vpmaddwd dot products. */
#define SDK_TILE_FN sdk_tile_avx2
#include "sdk_avx2_body.h"
