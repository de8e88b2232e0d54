/* Attention whose result for a query does not depend on anything but that query and the keys
 * and values it sees, in their logical order: the batch-invariant forward's attention for models
 * on the kernel (kq). Each query is computed by one thread from start to end, with one fixed
 * sequence of float operations (dot products in 16 partial sums reduced in a fixed tree, a max,
 * expf, a sum and a weighted sum of the values in logical order), so its bits do not depend on
 * how many queries, rows or threads share the call. Compiled without ISA flags and with
 * -ffp-contract=off: the same bits on every x86 CPU (the vertical loops vectorize with SSE2).
 *
 * Layouts (strides in floats, the head dimension contiguous):
 *   q       [B, T, H, D]          strides qb, qt (head stride D)
 *   keys    [B, Hkv, slots, D]    strides kb, kh, ks
 *   values  [chunks, B, Hkv, 64, D] (chunk-major: slot s is chunk s / 64, row s % 64)
 *           strides vc, vb, vh (row stride D)
 *   idx     [B, T, N] int32: the slots each query sees in logical order (the first n[b, t])
 *   out     [B, T, H, D] contiguous float32
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 64
#define LANES 16

static float dot(const float *a, const float *b, int d) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    for (int j = 0; i + j < d; j++) acc[j] += a[i + j] * b[i + j];
    for (int s = LANES / 2; s > 0; s /= 2)
        for (int j = 0; j < s; j++) acc[j] += acc[j + s];
    return acc[0];
}

/* one (row b, token t, kv head h) task: its G query heads. w: scratch of G * n floats */
static void attend_task(const float *q, long qb, long qt, const float *keys, long kb, long kh, long ks,
                        const float *values, long vc, long vb, long vh, const int32_t *idx, int n, int b, int t,
                        int h, int G, int H, int D, int T, float scale, float *out, float *w) {
    const float *kbase = keys + b * kb + h * kh;
    const float *vbase = values + b * vb + h * vh;
    for (int g = 0; g < G; g++) {
        const float *qg = q + b * qb + t * qt + (long)(h * G + g) * D;
        float *wg = w + (long)g * n;
        float m = -INFINITY;
        for (int p = 0; p < n; p++) {
            float s = dot(qg, kbase + (long)idx[p] * ks, D) * scale;
            wg[p] = s;
            m = s > m ? s : m;
        }
        float sum = 0.0f;
        for (int p = 0; p < n; p++) {
            wg[p] = expf(wg[p] - m);
            sum += wg[p];
        }
        float *o = out + (((long)b * T + t) * H + h * G + g) * D;
        for (int d = 0; d < D; d++) o[d] = 0.0f;
        for (int p = 0; p < n; p++) {
            int s = idx[p];
            const float *v = vbase + (long)(s / CHUNK) * vc + (long)(s % CHUNK) * D;
            float wp = wg[p];
            for (int d = 0; d < D; d++) o[d] += wp * v[d];
        }
        float inv = 1.0f / sum;
        for (int d = 0; d < D; d++) o[d] *= inv;
    }
}

/* Returns 0, or -1 (bad arguments), -3 (out of memory). A query that sees no slot gets zeros. */
int sdk_attention(const float *q, long qb, long qt, const float *keys, long kb, long kh, long ks,
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
#pragma omp for schedule(static)
        for (int task = 0; task < tasks; task++) {
            if (!w) continue;
            int h = task % Hkv, bt = task / Hkv, b = bt / T, t = bt % T, cnt = n[bt];
            if (cnt <= 0) {
                memset(out + ((long)bt * H + h * G) * D, 0, sizeof(float) * (size_t)G * D);
                continue;
            }
            attend_task(q, qb, qt, keys, kb, kh, ks, values, vc, vb, vh, idx + (long)bt * N, cnt < N ? cnt : N,
                        b, t, h, G, H, D, T, scale, out, w);
        }
        free(w);
    }
    return failed ? -3 : 0;
}
