/* The float code around the products, compiled once per instruction set (sdk_attn.c: no ISA
 * flags; sdk_attn_avx2.c, sdk_attn_avx512.c) under the name ATTN(x): the attention, and the row
 * operations a layer feeds its projections (RMSNorm, SwiGLU) and its attention (RoPE, the cache
 * write). Only vertical (lane by lane) float operations and explicit reduction trees: every
 * build gives the same bits. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef CHUNK
#define CHUNK 64
#define LANES 16
#endif

#ifndef SDK_VF
#define SDK_VF
/* 16 floats as one GCC vector: each build lowers its operations to its own registers (4 SSE, 2
 * AVX2 or 1 AVX-512 per vector), lane by lane, so every build computes the same IEEE operations */
typedef float sdk_vf __attribute__((vector_size(64)));
typedef int32_t sdk_vi __attribute__((vector_size(64)));
static inline sdk_vf sdk_ld(const float *p) { sdk_vf v; memcpy(&v, p, sizeof v); return v; }
static inline void sdk_st(float *p, sdk_vf v) { memcpy(p, &v, sizeof v); }
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
/* The AVX2 build: without AVX-512, GCC keeps the 64-byte vector type on the stack, so the hot
 * loops below are written in intrinsics, 16 lanes as two registers (lanes 0-7, 8-15): the same
 * IEEE operations lane by lane and the same reduction tree (lane j + lane j + 8 is the sum of
 * the two registers, then j + 4 the sum of its halves, then j + 2, j + 1; a + b == b + a exactly,
 * so the order of two operands never matters). */
#include <immintrin.h>
#define SDK_AVX2_BLOCKS 1

static inline __attribute__((always_inline)) float ATTN(lanes_sum2)(__m256 lo, __m256 hi) {
    const __m256 b = _mm256_add_ps(lo, hi);
    const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    const __m128 d = _mm_add_ps(c, _mm_shuffle_ps(c, c, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, _MM_SHUFFLE(2, 3, 0, 1))));
}

static inline float ATTN(dot)(const float *a, const float *b, int d) {
    __m256 l = _mm256_setzero_ps(), h = l, l2 = l, h2 = l;
    int i = 0;
    for (; i + 2 * LANES <= d; i += 2 * LANES) {
        l = _mm256_add_ps(l, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
        h = _mm256_add_ps(h, _mm256_mul_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8)));
        l2 = _mm256_add_ps(l2, _mm256_mul_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16)));
        h2 = _mm256_add_ps(h2, _mm256_mul_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24)));
    }
    if (i < d) { /* the tail, element by element into lane j % 16, as the generic build */
        float t[LANES];
        _mm256_storeu_ps(t, l);
        _mm256_storeu_ps(t + 8, h);
        for (int j = 0; i + j < d; j++) t[j % LANES] += a[i + j] * b[i + j];
        l = _mm256_loadu_ps(t);
        h = _mm256_loadu_ps(t + 8);
    }
    return ATTN(lanes_sum2)(_mm256_add_ps(l, l2), _mm256_add_ps(h, h2));
}
#else
static inline float ATTN(dot)(const float *a, const float *b, int d) {
    /* two sets of 16 partial sums (blocks of 16 alternate between them: two dependency chains),
     * added lane by lane, then reduced in a fixed tree (lane j += lane j + s for s = 8, 4, 2, 1) */
    sdk_vf acc = {0}, acc2 = {0};
    int i = 0;
    for (; i + 2 * LANES <= d; i += 2 * LANES) {
        acc += sdk_ld(a + i) * sdk_ld(b + i);
        acc2 += sdk_ld(a + i + LANES) * sdk_ld(b + i + LANES);
    }
    for (int j = 0; i + j < d; j++) acc[j % LANES] += a[i + j] * b[i + j];
    acc += acc2;
    acc += __builtin_shuffle(acc, (sdk_vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    acc += __builtin_shuffle(acc, (sdk_vi){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
    acc += __builtin_shuffle(acc, (sdk_vi){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
    acc += __builtin_shuffle(acc, (sdk_vi){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
    return acc[0];
}

#endif

#if defined(__AVX512F__) && !defined(SDK_ATTN_AVX512)
#define SDK_ATTN_AVX512
#include <immintrin.h>
/* The AVX-512 build's prefill helpers: the same IEEE operations on the same operands as the
 * one-key, one-head loops of ATTN(task) (so the same bits), arranged so a key or value row is
 * loaded once for several query heads and a score's reduction tree is shared by 8 keys. A
 * 657-token prefill of the 1.5B's attention shape (12 heads, 2 KV heads, D 128): 21.0 -> 15.5 ms a
 * layer on the AMX Xeon (benchmarks/NOTES.md, issue 53, thirteenth session).
 *
 * ATTN(dot) of one query with 8 keys at once (d a multiple of 32), times scale, to out[0..7]: the
 * same partial sums (blocks of 16 alternating between two sets) and the same tree, each key's
 * lanes j and j + 8, then j and j + 4, j and j + 2, j and j + 1, added for 8 keys at a time by
 * permutes across registers instead of within each */
static inline __attribute__((always_inline)) void sdk_dot8(const float *q, const float *const *k, int d,
                                                          float scale, float *out) {
    /* every loop over the 8 keys unrolled, so the 16 sums stay in registers (left as loops, GCC
     * kept them on the stack and cleared them with rep stos on every call: a quarter of the
     * function's time) */
    __m512 a[8], b[8];
#pragma GCC unroll 8
    for (int u = 0; u < 8; u++) a[u] = b[u] = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 32) {
        const __m512 q0 = _mm512_loadu_ps(q + i), q1 = _mm512_loadu_ps(q + i + 16);
#pragma GCC unroll 8
        for (int u = 0; u < 8; u++) {
            a[u] = _mm512_add_ps(a[u], _mm512_mul_ps(q0, _mm512_loadu_ps(k[u] + i)));
            b[u] = _mm512_add_ps(b[u], _mm512_mul_ps(q1, _mm512_loadu_ps(k[u] + i + 16)));
        }
    }
    const __m512i s1a = _mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i s1b = _mm512_set_epi32(31, 30, 29, 28, 27, 26, 25, 24, 15, 14, 13, 12, 11, 10, 9, 8);
    const __m512i s2a = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
    const __m512i s2b = _mm512_set_epi32(31, 30, 29, 28, 23, 22, 21, 20, 15, 14, 13, 12, 7, 6, 5, 4);
    const __m512i s3a = _mm512_set_epi32(29, 28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0);
    const __m512i s3b = _mm512_set_epi32(31, 30, 27, 26, 23, 22, 19, 18, 15, 14, 11, 10, 7, 6, 3, 2);
    const __m512i s4a = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i s4b = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    __m512 v[8], t[4], w[2];
#pragma GCC unroll 8
    for (int u = 0; u < 8; u++) v[u] = _mm512_add_ps(a[u], b[u]);
    /* lanes j + j + 8: two keys a register, 8 lanes each */
#pragma GCC unroll 4
    for (int u = 0; u < 4; u++)
        t[u] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * u], s1a, v[2 * u + 1]),
                             _mm512_permutex2var_ps(v[2 * u], s1b, v[2 * u + 1]));
    /* j + j + 4: four keys a register, 4 lanes each */
#pragma GCC unroll 2
    for (int u = 0; u < 2; u++)
        w[u] = _mm512_add_ps(_mm512_permutex2var_ps(t[2 * u], s2a, t[2 * u + 1]),
                             _mm512_permutex2var_ps(t[2 * u], s2b, t[2 * u + 1]));
    /* j + j + 2: eight keys, 2 lanes each; then j + j + 1: key u in lane u */
    const __m512 x = _mm512_add_ps(_mm512_permutex2var_ps(w[0], s3a, w[1]), _mm512_permutex2var_ps(w[0], s3b, w[1]));
    const __m512 r = _mm512_add_ps(_mm512_permutex2var_ps(x, s4a, x), _mm512_permutex2var_ps(x, s4b, x));
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm512_castps512_ps256(r), _mm256_set1_ps(scale)));
}
#endif

#ifdef SDK_ATTN_AVX512
/* the outputs of GS query heads (weights w + g n, outputs o + g D) over the same n value rows, 64
 * lanes at a time: each lane 0 + w_0 v_0 + w_1 v_1 + ... in logical order, as ATTN(task)'s loop
 * for one head (d a multiple of 64) */
#define SDK_PV(GS)                                                                                         \
    static inline void sdk_pv##GS(const float *w, int n, const int32_t *idx, const float *vbase, long vc, \
                                  int d, float *o) {                                                      \
        for (int d0 = 0; d0 < d; d0 += 64) {                                                               \
            __m512 acc[GS][4];                                                                             \
            for (int g = 0; g < GS; g++)                                                                   \
                for (int u = 0; u < 4; u++) acc[g][u] = _mm512_setzero_ps();                               \
            for (int p = 0; p < n; p++) {                                                                  \
                const int s = idx[p];                                                                      \
                const float *v = vbase + (long)(s / CHUNK) * vc + (long)(s % CHUNK) * d + d0;              \
                __m512 vv[4];                                                                              \
                for (int u = 0; u < 4; u++) vv[u] = _mm512_loadu_ps(v + 16 * u);                           \
                for (int g = 0; g < GS; g++) {                                                             \
                    const __m512 wp = _mm512_set1_ps(w[(long)g * n + p]);                                  \
                    for (int u = 0; u < 4; u++) acc[g][u] = _mm512_add_ps(acc[g][u], _mm512_mul_ps(wp, vv[u])); \
                }                                                                                          \
            }                                                                                              \
            for (int g = 0; g < GS; g++)                                                                   \
                for (int u = 0; u < 4; u++) _mm512_storeu_ps(o + (long)g * d + d0 + 16 * u, acc[g][u]);    \
        }                                                                                                  \
    }
SDK_PV(3)
SDK_PV(6)
#endif

/* x[p] = exp(x[p]) for x <= 0 (a softmax's x - max), in place: 2^r * e^(f ln 2) with r the
 * nearest integer (the 1.5 * 2^23 trick) and a degree-7 Taylor polynomial (relative error below
 * 1e-8 on |f ln 2| <= 0.35); x below -87 gives 2^-126. Lane by lane float and integer
 * operations only, so it vectorizes and every build gives the same bits (libm's expf did
 * neither: a scalar call per score). */
static inline void ATTN(exp_inplace)(float *restrict x, int n) {
    for (int p = 0; p < n; p++) {
        float t = x[p] * 1.44269504088896341f;
        t = t < -126.0f ? -126.0f : t;
        float r = (t + 12582912.0f) - 12582912.0f;
        float g = (t - r) * 0.693147180559945309f;
        float y = 1.0f / 5040.0f;
        y = y * g + 1.0f / 720.0f;
        y = y * g + 1.0f / 120.0f;
        y = y * g + 1.0f / 24.0f;
        y = y * g + 1.0f / 6.0f;
        y = y * g + 0.5f;
        y = y * g + 1.0f;
        y = y * g + 1.0f;
        int32_t bits;
        memcpy(&bits, &y, 4);
        bits += (int32_t)r * (1 << 23);
        memcpy(&x[p], &bits, 4);
    }
}

/* A projection's input row from its layer's stream (sdk_core.c's `pre`):
 * RMSNorm: h = (x * w) * (1 / sqrt(sum x^2 + eps)), the sum of squares in dot's fixed order (w:
 * the norm's weight times sqrt(k), eps: k * the model's eps, as the runtime folds them);
 * SwiGLU: h = silu(g) * u over a row of 2k values (gate, then up), silu(g) = g / (1 + e^-g)
 * written with e = exp(-|g|) <= 1 (g * e / (1 + e) for g < 0: nothing overflows). */
static void ATTN(rms_norm_row)(const float *x, const float *w, int k, float eps, float *restrict h) {
    const float r = 1.0f / sqrtf(ATTN(dot)(x, x, k) + eps);
    for (int i = 0; i < k; i++) h[i] = (x[i] * w[i]) * r;
}

static void ATTN(swiglu_row)(const float *gu, int k, float *restrict h) {
    const float *g = gu, *u = gu + k;
    for (int i = 0; i < k; i++) h[i] = -fabsf(g[i]);
    ATTN(exp_inplace)(h, k);
    for (int i = 0; i < k; i++) {
        const float e = h[i], s = (g[i] >= 0.0f ? g[i] : g[i] * e) / (1.0f + e);
        h[i] = s * u[i];
    }
}

/* pre 1: RMSNorm, 2: SwiGLU (x holds 2k values); anything else copies the row */
void ATTN(pre_row)(int pre, const float *x, int k, const float *w, float eps, float *restrict h) {
    if (pre == 1)
        ATTN(rms_norm_row)(x, w, k, eps, h);
    else if (pre == 2)
        ATTN(swiglu_row)(x, k, h);
    else
        memcpy(h, x, sizeof(float) * (size_t)k);
}

/* RoPE on one token's query and key heads and the cache write of its key and value: qkv is the
 * token's q|k|v projection ([H + 2 Hkv] heads of D), cs/sn its position's tables (sn carries
 * the sign: x * cos + roll(x, D / 2) * sin); the rotated queries go to q (H heads of D), the
 * rotated keys to keys at `slot`, the values to the chunk-major values at `slot`. */
static void ATTN(rope_write_token)(const float *qkv, const float *cs, const float *sn, int H, int Hkv, int D,
                                   float *restrict q, float *keys, long kh, long ks, float *values, long vc,
                                   long vh, int slot) {
    const int half = D / 2;
    for (int hd = 0; hd < H + Hkv; hd++) {
        const float *x = qkv + (long)hd * D;
        float *restrict o = hd < H ? q + (long)hd * D : keys + (long)(hd - H) * kh + (long)slot * ks;
        for (int j = 0; j < half; j++) o[j] = x[j] * cs[j] + x[j + half] * sn[j];
        for (int j = half; j < D; j++) o[j] = x[j] * cs[j] + x[j - half] * sn[j];
    }
    float *vrow = values + (long)(slot / CHUNK) * vc + (long)(slot % CHUNK) * D;
    for (int hd = 0; hd < Hkv; hd++)
        memcpy(vrow + (long)hd * vh, qkv + (long)(H + Hkv + hd) * D, sizeof(float) * (size_t)D);
}

/* one (row b, token t, kv head h) task: its G query heads (contiguous in q). w: G * n floats.
 * Per query head the order of operations is fixed: its scores key by key, its max, its
 * exponentials and their sum in logical order, then its output lane by lane over the keys in
 * logical order; the heads are only interleaved (independent chains for the CPU to overlap). */
static void ATTN(task)(const float *q, long qb, long qt, const float *keys, long kb, long kh, long ks,
                       const float *values, long vc, long vb, long vh, const int32_t *idx, int n, int b, int t,
                       int h, int G, int H, int D, int T, float scale, float *restrict out, float *restrict w) {
    const float *kbase = keys + b * kb + h * kh;
    const float *vbase = values + b * vb + h * vh;
    const float *qh = q + b * qb + t * qt + (long)h * G * D;
    float sums[G];
    int p0 = 0;
#ifdef SDK_ATTN_AVX512
    /* 8 keys at a time, each batch scored against every query head of the group while in L1 */
    for (; D % 32 == 0 && p0 + 8 <= n; p0 += 8) {
        const float *k8[8];
        for (int u = 0; u < 8; u++) k8[u] = kbase + (long)idx[p0 + u] * ks;
        for (int g = 0; g < G; g++) sdk_dot8(qh + (long)g * D, k8, D, scale, w + (long)g * n + p0);
    }
#endif
    for (int g = 0; g < G; g++)
        for (int p = p0; p < n; p++) w[(long)g * n + p] = ATTN(dot)(qh + (long)g * D, kbase + (long)idx[p] * ks, D) * scale;
    /* each head's max and sum run over its scores in logical order, one chain per head; the
     * heads' chains interleaved (key by key across the heads), so the CPU overlaps them instead of
     * waiting out each add's latency in turn */
    float mx[G];
    for (int g = 0; g < G; g++) mx[g] = -INFINITY, sums[g] = 0.0f;
    for (int p = 0; p < n; p++)
        for (int g = 0; g < G; g++) {
            const float x = w[(long)g * n + p];
            mx[g] = x > mx[g] ? x : mx[g];
        }
    for (int g = 0; g < G; g++) {
        float *wg = w + (long)g * n;
        for (int p = 0; p < n; p++) wg[p] -= mx[g];
        ATTN(exp_inplace)(wg, n);
    }
    for (int p = 0; p < n; p++)
        for (int g = 0; g < G; g++) sums[g] += w[(long)g * n + p];
    /* each output lane: 0 + w_0 v_0 + w_1 v_1 + ... in logical order; 64 lanes at a time held
     * in registers over all the keys (the same sums as adding key by key into memory) */
    float *restrict o = out + (((long)b * T + t) * H + (long)h * G) * D;
    int g0 = 0;
#ifdef SDK_ATTN_AVX512
    /* six heads at a time (24 registers of sums), then three: each value row loaded once for them */
    for (; D % 64 == 0 && g0 + 6 <= G; g0 += 6)
        sdk_pv6(w + (long)g0 * n, n, idx, vbase, vc, D, o + (long)g0 * D);
    for (; D % 64 == 0 && g0 + 3 <= G; g0 += 3)
        sdk_pv3(w + (long)g0 * n, n, idx, vbase, vc, D, o + (long)g0 * D);
#endif
    for (int g = g0; g < G; g++) {
        const float *wg = w + (long)g * n;
        float *og = o + (long)g * D;
        int d0 = 0;
#ifdef SDK_AVX2_BLOCKS
        for (; d0 + 4 * LANES <= D; d0 += 4 * LANES) { /* 64 lanes as 8 registers */
            __m256 acc[8];
            for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
            for (int p = 0; p < n; p++) {
                const int s = idx[p];
                const float *v = vbase + (long)(s / CHUNK) * vc + (long)(s % CHUNK) * D + d0;
                const __m256 wp = _mm256_set1_ps(wg[p]);
                for (int u = 0; u < 8; u++) acc[u] = _mm256_add_ps(acc[u], _mm256_mul_ps(wp, _mm256_loadu_ps(v + 8 * u)));
            }
            for (int u = 0; u < 8; u++) _mm256_storeu_ps(og + d0 + 8 * u, acc[u]);
        }
#endif
        for (; d0 + 4 * LANES <= D; d0 += 4 * LANES) {
            sdk_vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int p = 0; p < n; p++) {
                const int s = idx[p];
                const float *v = vbase + (long)(s / CHUNK) * vc + (long)(s % CHUNK) * D + d0, wp = wg[p];
                a0 += wp * sdk_ld(v);
                a1 += wp * sdk_ld(v + LANES);
                a2 += wp * sdk_ld(v + 2 * LANES);
                a3 += wp * sdk_ld(v + 3 * LANES);
            }
            sdk_st(og + d0, a0);
            sdk_st(og + d0 + LANES, a1);
            sdk_st(og + d0 + 2 * LANES, a2);
            sdk_st(og + d0 + 3 * LANES, a3);
        }
        for (; d0 + LANES <= D; d0 += LANES) {
            sdk_vf a0 = {0};
            for (int p = 0; p < n; p++) {
                const int s = idx[p];
                a0 += wg[p] * sdk_ld(vbase + (long)(s / CHUNK) * vc + (long)(s % CHUNK) * D + d0);
            }
            sdk_st(og + d0, a0);
        }
        for (; d0 < D; d0++) {
            float a = 0.0f;
            for (int p = 0; p < n; p++) {
                const int s = idx[p];
                a += wg[p] * vbase[(long)(s / CHUNK) * vc + (long)(s % CHUNK) * D + d0];
            }
            og[d0] = a;
        }
    }
    for (int g = 0; g < G; g++) {
        const float inv = 1.0f / sums[g];
        for (int d = 0; d < D; d++) o[(long)g * D + d] *= inv;
    }
}

int ATTN(run)(const float *q, long qb, long qt, const float *keys, long kb, long kh, long ks,
                  const float *values, long vc, long vb, long vh, const int32_t *idx, const int32_t *n, int B,
                  int T, int H, int Hkv, int D, int N, float scale, float *out, int nthreads) {
    if (B <= 0 || T <= 0 || Hkv <= 0 || H % Hkv || D <= 0 || N <= 0) return -1;
    const int G = H / Hkv, tasks = B * T * Hkv;
    int failed = 0;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > tasks) nthreads = tasks;
#pragma omp parallel num_threads(nthreads)
    {
        float *w = malloc(sizeof(float) * (size_t)G * (size_t)N);
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
        /* one task at a time to each thread in turn: a prefill's tasks attend to more keys the
         * later their token (causal), so halves of the list would give one thread ~3x the work */
#pragma omp for schedule(static, 1)
        for (int task = 0; task < tasks; task++) {
            if (!w) continue;
            int h = task % Hkv, bt = task / Hkv, b = bt / T, t = bt % T, cnt = n[bt];
            if (cnt <= 0) {
                memset(out + ((long)bt * H + h * G) * D, 0, sizeof(float) * (size_t)G * D);
                continue;
            }
            ATTN(task)(q, qb, qt, keys, kb, kh, ks, values, vc, vb, vh, idx + (long)bt * N, cnt < N ? cnt : N,
                        b, t, h, G, H, D, T, scale, out, w);
        }
        free(w);
    }
    return failed ? -3 : 0;
}

/* A layer's attention from its q|k|v projection rows: RoPE and the cache write of every token
 * (rows b * T + t of qkv, ldq floats apart; tables cos/sin at b * cb + t * ct; slots [B, T]),
 * then ATTN(run) over the rotated queries (qbuf: B * T * H * D floats). The keys' and values'
 * batch strides kb, vb apply per row b. */
int ATTN(rope_attend)(const float *qkv, long ldq, const float *cos, const float *sin, long cb, long ct,
                      float *keys, long kb, long kh, long ks, float *values, long vc, long vb, long vh,
                      const int32_t *slots, int cap, const int32_t *idx, const int32_t *n, int B, int T, int H, int Hkv,
                      int D, int N, float scale, float *qbuf, float *out, int nthreads) {
    if (B <= 0 || T <= 0 || Hkv <= 0 || H % Hkv || D <= 0 || D % 2 || N <= 0) return -1;
    const int tokens = B * T;
    for (int bt = 0; bt < tokens; bt++)
        if (slots[bt] < 0 || slots[bt] >= cap) return -1;
    int wthreads = tokens >= 8 ? nthreads : 1;
    if (wthreads < 1) wthreads = 1;
#pragma omp parallel for num_threads(wthreads) schedule(static)
    for (int bt = 0; bt < tokens; bt++) {
        const int b = bt / T, t = bt % T;
        ATTN(rope_write_token)(qkv + (long)bt * ldq, cos + b * cb + t * ct, sin + b * cb + t * ct, H, Hkv, D,
                               qbuf + (long)bt * H * D, keys + b * kb, kh, ks, values + b * vb, vc, vh,
                               slots[bt]);
    }
    return ATTN(run)(qbuf, (long)T * H * D, (long)H * D, keys, kb, kh, ks, values, vc, vb, vh, idx, n, B, T, H,
                     Hkv, D, N, scale, out, nthreads);
}
