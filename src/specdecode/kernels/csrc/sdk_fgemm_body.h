/* Products of float rows with float weights (float32 or bfloat16), compiled with the attention
 * (sdk_attn.c, sdk_attn_avx2.c, sdk_attn_avx512.c) under the same ATTN(x) names. For models kept
 * in float: the batch-invariant forward's projections without row padding or library GEMMs.
 *
 * y[r, c] = dot(x row r, W row c) (+ bias[c]) (+ res[r, c]), the dot in one fixed sequence of IEEE
 * operations: 16 lane sums, lane j += x[i] * w[i] (a product, then a sum: never fused) for i = j,
 * j + 16, ... in K order, then the lanes reduced in ATTN(dot)'s tree (lane j += lane j + s for s =
 * 8, 4, 2, 1). Every (row, column) pair runs that sequence whatever else shares the call: the
 * blocks of rows and columns only interleave independent sums. So a row's bits depend on nothing
 * but that row, and every build (16 lanes as 4 SSE, 2 AVX2 or 1 AVX-512 register) gives the same
 * bits. A tail of K (not a multiple of 16) is one more step over zero-padded lanes: the padding's
 * products are +0, and a lane sum that starts at +0 is never -0, so adding them changes nothing.
 *
 * Weights stationary: a thread owns a contiguous range of output columns, and each block of
 * FB_N weight rows is read once per call and multiplied into every row, FB_M rows at a time. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sdk.h"

#ifndef SDK_FGEMM_TYPES
#define SDK_FGEMM_TYPES
#define FB_N 2 /* weight rows (output columns) a block */
#if defined(__AVX512F__)
#define FB_M 8 /* input rows a block: 16 sums in 32 registers */
#else
#define FB_M 2 /* AVX2 (explicit intrinsics below): 4 sums of two registers */
#endif
#define FB_PANEL 16 /* blocks a panel */
#ifndef FB_AHEAD
#define FB_AHEAD 4096
#endif
typedef uint16_t sdk_vh __attribute__((vector_size(32)));
typedef uint32_t sdk_vu __attribute__((vector_size(64)));
#endif

/* 16 weights from element `off` of a row: float32 (wt 0) or bfloat16 (wt 1, exact in float32) */
static inline __attribute__((always_inline)) sdk_vf ATTN(wload)(const void *w, int wt, long off) {
    if (wt == 0) return sdk_ld((const float *)w + off);
    sdk_vh h;
    memcpy(&h, (const uint16_t *)w + off, sizeof h);
    sdk_vu u = __builtin_convertvector(h, sdk_vu) << 16;
    sdk_vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline __attribute__((always_inline)) float ATTN(lanes_sum)(sdk_vf acc) {
    acc += __builtin_shuffle(acc, (sdk_vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    acc += __builtin_shuffle(acc, (sdk_vi){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
    acc += __builtin_shuffle(acc, (sdk_vi){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
    acc += __builtin_shuffle(acc, (sdk_vi){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
    return acc[0];
}

/* the last `rest` (< 16) weights of NB rows from element i, as float32 zero-padded to 16 lanes */
static inline void ATTN(wtail)(const void *w, int wt, long ldw, int i, int rest, int NB, float wt32[][LANES]) {
    for (int j = 0; j < NB; j++) {
        memset(wt32[j], 0, sizeof(float) * LANES);
        if (wt == 0) {
            memcpy(wt32[j], (const float *)w + (long)j * ldw + i, sizeof(float) * (size_t)rest);
        } else {
            const uint16_t *h = (const uint16_t *)w + (long)j * ldw + i;
            for (int l = 0; l < rest; l++) {
                uint32_t u = (uint32_t)h[l] << 16;
                memcpy(&wt32[j][l], &u, 4);
            }
        }
    }
}

/* out[r * FB_N + j] = dot(x row r, w row j) for r < MB, j < NB (MB <= FB_M, NB <= FB_N constants
 * at each call site, so the sums live in registers). */
static inline __attribute__((always_inline)) void ATTN(fblock)(const float *x, long ldx, const void *w, int wt,
                                                                 long ldw, int k, int MB, int NB, float *out) {
    sdk_vf acc[FB_M][FB_N];
    for (int r = 0; r < MB; r++)
        for (int j = 0; j < NB; j++) acc[r][j] = (sdk_vf){0};
    int i = 0;
    for (; i + LANES <= k; i += LANES) {
        sdk_vf wv[FB_N];
        for (int j = 0; j < NB; j++) {
            __builtin_prefetch((const char *)w + ((long)j * ldw + i) * (wt ? 2 : 4) + FB_AHEAD, 0, 3);
            wv[j] = ATTN(wload)(w, wt, (long)j * ldw + i);
        }
        for (int r = 0; r < MB; r++) {
            const sdk_vf xv = sdk_ld(x + (long)r * ldx + i);
            for (int j = 0; j < NB; j++) acc[r][j] += xv * wv[j];
        }
    }
    if (i < k) { /* the tail, zero-padded */
        const int rest = k - i;
        float wt32[FB_N][LANES], xt[LANES];
        ATTN(wtail)(w, wt, ldw, i, rest, NB, wt32);
        for (int r = 0; r < MB; r++) {
            memset(xt, 0, sizeof xt);
            memcpy(xt, x + (long)r * ldx + i, sizeof(float) * (size_t)rest);
            const sdk_vf xv = sdk_ld(xt);
            for (int j = 0; j < NB; j++) acc[r][j] += xv * sdk_ld(wt32[j]);
        }
    }
    for (int r = 0; r < MB; r++)
        for (int j = 0; j < NB; j++) out[r * FB_N + j] = ATTN(lanes_sum)(acc[r][j]);
}

#if defined(__AVX2__) && !defined(__AVX512F__)
/* The AVX2 build (see sdk_attn_body.h: 16 lanes as two registers in intrinsics, ATTN(lanes_sum2)
 * the same tree as ATTN(lanes_sum)). */

static inline __attribute__((always_inline)) void ATTN(wload2)(const void *w, int wt, long off, __m256 *lo,
                                                                 __m256 *hi) {
    if (wt == 0) {
        *lo = _mm256_loadu_ps((const float *)w + off);
        *hi = _mm256_loadu_ps((const float *)w + off + 8);
        return;
    }
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + off));
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16));
    *hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16));
}

static inline __attribute__((always_inline)) void ATTN(fblock2)(const float *x, long ldx, const void *w, int wt,
                                                                  long ldw, int k, int MB, int NB, float *out) {
    __m256 lo[FB_M][FB_N], hi[FB_M][FB_N];
    for (int r = 0; r < MB; r++)
        for (int j = 0; j < NB; j++) lo[r][j] = hi[r][j] = _mm256_setzero_ps();
    int i = 0;
    for (; i + LANES <= k; i += LANES) {
        __m256 wl[FB_N], wh[FB_N];
        for (int j = 0; j < NB; j++) {
            __builtin_prefetch((const char *)w + ((long)j * ldw + i) * (wt ? 2 : 4) + FB_AHEAD, 0, 3);
            ATTN(wload2)(w, wt, (long)j * ldw + i, &wl[j], &wh[j]);
        }
        for (int r = 0; r < MB; r++) {
            const __m256 xl = _mm256_loadu_ps(x + (long)r * ldx + i), xh = _mm256_loadu_ps(x + (long)r * ldx + i + 8);
            for (int j = 0; j < NB; j++) {
                lo[r][j] = _mm256_add_ps(lo[r][j], _mm256_mul_ps(xl, wl[j]));
                hi[r][j] = _mm256_add_ps(hi[r][j], _mm256_mul_ps(xh, wh[j]));
            }
        }
    }
    if (i < k) { /* the tail, zero-padded as in the generic block */
        const int rest = k - i;
        float wt32[FB_N][LANES], xt[LANES];
        ATTN(wtail)(w, wt, ldw, i, rest, NB, wt32);
        for (int r = 0; r < MB; r++) {
            memset(xt, 0, sizeof xt);
            memcpy(xt, x + (long)r * ldx + i, sizeof(float) * (size_t)rest);
            const __m256 xl = _mm256_loadu_ps(xt), xh = _mm256_loadu_ps(xt + 8);
            for (int j = 0; j < NB; j++) {
                lo[r][j] = _mm256_add_ps(lo[r][j], _mm256_mul_ps(xl, _mm256_loadu_ps(wt32[j])));
                hi[r][j] = _mm256_add_ps(hi[r][j], _mm256_mul_ps(xh, _mm256_loadu_ps(wt32[j] + 8)));
            }
        }
    }
    for (int r = 0; r < MB; r++)
        for (int j = 0; j < NB; j++) out[r * FB_N + j] = ATTN(lanes_sum2)(lo[r][j], hi[r][j]);
}

static void ATTN(fblock_any)(const float *x, long ldx, const void *w, int wt, long ldw, int k, int mb, int nb,
                             float *out) {
    if (nb == FB_N) {
        if (mb == 2)
            ATTN(fblock2)(x, ldx, w, wt, ldw, k, 2, FB_N, out);
        else
            ATTN(fblock2)(x, ldx, w, wt, ldw, k, 1, FB_N, out);
        return;
    }
    for (int r = 0; r < mb; r++)
        for (int j = 0; j < nb; j++)
            ATTN(fblock2)(x + (long)r * ldx, ldx, (const char *)w + (long)j * ldw * (wt ? 2 : 4), wt, ldw, k, 1, 1,
                          out + r * FB_N + j);
}
#else
/* the block for MB rows (1..FB_M) and NB columns (FB_N or fewer at a range's end) */
static void ATTN(fblock_any)(const float *x, long ldx, const void *w, int wt, long ldw, int k, int mb, int nb,
                             float *out) {
    if (nb == FB_N) {
        switch (mb) {
#if FB_M >= 8
        case 8: ATTN(fblock)(x, ldx, w, wt, ldw, k, 8, FB_N, out); return;
        case 7: ATTN(fblock)(x, ldx, w, wt, ldw, k, 7, FB_N, out); return;
        case 6: ATTN(fblock)(x, ldx, w, wt, ldw, k, 6, FB_N, out); return;
        case 5: ATTN(fblock)(x, ldx, w, wt, ldw, k, 5, FB_N, out); return;
#endif
        case 4: ATTN(fblock)(x, ldx, w, wt, ldw, k, 4, FB_N, out); return;
        case 3: ATTN(fblock)(x, ldx, w, wt, ldw, k, 3, FB_N, out); return;
        case 2: ATTN(fblock)(x, ldx, w, wt, ldw, k, 2, FB_N, out); return;
        default: ATTN(fblock)(x, ldx, w, wt, ldw, k, 1, FB_N, out); return;
        }
    }
    for (int r = 0; r < mb; r++)
        for (int j = 0; j < nb; j++)
            ATTN(fblock)(x + (long)r * ldx, ldx, (const char *)w + (long)j * ldw * (wt ? 2 : 4), wt, ldw, k, 1, 1,
                         out + r * FB_N + j);
}
#endif

/* y [m, n] (ldy apart) = x [m, k] (ldx apart) W^T, W [n, k] (ldw elements apart, type wt), then
 * + bias [n], + res [m, n] (ldr apart) when given, in that order. Columns split over nthreads
 * OpenMP threads in contiguous ranges; rows in blocks of FB_M. Returns 0 or -1 (bad arguments). */
int ATTN(float_product)(const float *x, long ldx, int m, const void *w, int wt, long ldw, int n, int k,
                        const float *bias, const float *res, long ldr, float *y, long ldy, int nthreads) {
    if (m < 0 || n <= 0 || k <= 0 || (wt != 0 && wt != 1) || ldx < k || ldw < k || ldy < n || (res && ldr < n))
        return -1;
    if (m == 0) return 0;
    const int blocks = (n + FB_N - 1) / FB_N;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > blocks) nthreads = blocks;
    /* panels of up to FB_PANEL blocks (a few dozen KB of weights, kept in L2 while every block of
     * rows passes over them), at least one a thread */
    int per = (blocks + nthreads - 1) / nthreads;
    per = per < FB_PANEL ? per : FB_PANEL;
    const int panels = (blocks + per - 1) / per;
    const size_t esz = wt ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int p = 0; p < panels; p++) {
        const int b1 = (p + 1) * per < blocks ? (p + 1) * per : blocks;
        float out[FB_M * FB_N];
        for (int r0 = 0; r0 < m; r0 += FB_M) {
            const int mb = m - r0 < FB_M ? m - r0 : FB_M;
            for (int bl = p * per; bl < b1; bl++) {
                const int c0 = bl * FB_N, nb = n - c0 < FB_N ? n - c0 : FB_N;
                const void *wb = (const char *)w + (size_t)c0 * (size_t)ldw * esz;
                ATTN(fblock_any)(x + (long)r0 * ldx, ldx, wb, wt, ldw, k, mb, nb, out);
                for (int r = 0; r < mb; r++) {
                    float *yr = y + (long)(r0 + r) * ldy + c0;
                    for (int j = 0; j < nb; j++) {
                        float v = out[r * FB_N + j];
#ifndef FGEMM_BASE
                        if (sdk_fault && r0 + r == 0 && c0 + j == 3) v = nextafterf(v, INFINITY); /* tests */
#endif
                        if (bias) v += bias[c0 + j];
                        if (res) v += res[(long)(r0 + r) * ldr + c0 + j];
                        yr[j] = v;
                    }
                }
            }
        }
    }
    return 0;
}

/* ATTN(float_product) of the rows after a pre-pass (ATTN(pre_row): 1 RMSNorm with pre_w and eps,
 * 2 SwiGLU of rows of 2k values), written to h [m, k] first. Returns 0, -1 or -3 (no memory). */
int ATTN(float_linear)(const float *x, long ldx, int m, int pre, const float *pre_w, float eps, const void *w,
                       int wt, long ldw, int n, int k, const float *bias, const float *res, long ldr, float *y,
                       long ldy, int nthreads) {
    if (pre < 0 || pre > 2 || (pre == 1 && !pre_w) || m < 0 || k <= 0) return -1;
    if (!pre) return ATTN(float_product)(x, ldx, m, w, wt, ldw, n, k, bias, res, ldr, y, ldy, nthreads);
    if (ldx < (pre == 2 ? 2L * k : (long)k)) return -1;
    float *h = malloc(sizeof(float) * (size_t)(m ? m : 1) * (size_t)k);
    if (!h) return -3;
    const int pthreads = m >= 16 ? (nthreads < 1 ? 1 : nthreads) : 1;
#pragma omp parallel for num_threads(pthreads) schedule(static)
    for (int r = 0; r < m; r++) ATTN(pre_row)(pre, x + (long)r * ldx, k, pre_w, eps, h + (long)r * k);
    int rc = ATTN(float_product)(h, k, m, w, wt, ldw, n, k, bias, res, ldr, y, ldy, nthreads);
    free(h);
    return rc;
}
