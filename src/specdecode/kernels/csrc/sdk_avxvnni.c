/* AVX-VNNI (Alder Lake, Sapphire Rapids, Zen 5): the 256-bit path with vpdpbusd. */
#define SDK_TILE_FN sdk_tile_avxvnni
#define SDK_VNNI256 1
#include "sdk_avx2_body.h"
