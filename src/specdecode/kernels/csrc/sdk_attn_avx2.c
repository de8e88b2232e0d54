/* sdk_attn_body.h built with AVX2 (the same bits as sdk_attn.c's build). */
#define ATTN(x) attn_avx2_##x
#include "sdk_attn_body.h"
#include "sdk_fgemm_body.h"
