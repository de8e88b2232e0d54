/* AVX2 + FMA + F16C (Haswell, Zen 1-3): vpmaddubsw / vpmaddwd dot products. */
#define SDK_TILE_FN sdk_tile_avx2
#include "sdk_avx2_body.h"

/* The activation quantizer of sdk_ref.c (sdk_quantize_row) in AVX2, the same bits: the maximum
 * is exact in any order (and skips NaN as the scalar comparison does), x * (127 / max) is one
 * IEEE multiply, vcvtps2dq rounds half to even as lrintf does, and out-of-range or NaN products
 * (0x80000000) clamp to -127 as the scalar LONG_MIN does. Partial blocks take the scalar code. */
void sdk_quantize_row(const float *x, int k, int kp, int8_t *xq, float *xa, int32_t *xs, int32_t *xp);

void sdk_quantize_row_avx2(const float *x, int k, int kp, int8_t *xq, float *xa, int32_t *xs, int32_t *xp) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
    for (int b = 0; b < kp / SDK_QK; b++) {
        int base = b * SDK_QK;
        if (base + SDK_QK > k) { /* the tail: the reference's own code for this block */
            float tmp[SDK_QK];
            int n = k > base ? k - base : 0;
            for (int i = 0; i < SDK_QK; i++) tmp[i] = i < n ? x[base + i] : 0.0f;
            sdk_quantize_row(tmp, n, SDK_QK, xq + base, xa + b, xs + base / 16, xp + base / 64);
            continue;
        }
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < SDK_QK; i += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + base + i)), m);
        float v[8], amax = 0.0f;
        _mm256_storeu_ps(v, m);
        for (int i = 0; i < 8; i++) amax = v[i] > amax ? v[i] : amax;
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        xa[b] = amax / 127.0f;
        __m256 idv = _mm256_set1_ps(id);
        for (int s = 0; s < SDK_QK / 16; s++) {
            const float *p = x + base + s * 16;
            __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p), idv));
            __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + 8), idv));
            q0 = _mm256_max_epi32(_mm256_min_epi32(q0, hi), lo);
            q1 = _mm256_max_epi32(_mm256_min_epi32(q1, hi), lo);
            __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8); /* 16 int16 in order */
            __m128i b8 = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
            _mm_storeu_si128((__m128i *)(xq + base + s * 16), b8);
            __m256i t = _mm256_add_epi32(q0, q1);
            __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
            u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
            xs[base / 16 + s] = _mm_cvtsi128_si32(u);
        }
        for (int q = 0; q < SDK_QK / 64; q++) {
            const int32_t *s16 = xs + base / 16 + q * 4;
            uint32_t a0 = (uint16_t)(int16_t)(s16[0] + s16[1]), a1 = (uint16_t)(int16_t)(s16[2] + s16[3]);
            xp[base / 64 + q] = (int32_t)(a0 | (a1 << 16));
        }
    }
}
