/* A bounds check of the kernel (tests/test_kernels.py builds it with -fsanitize=address): reads
 * cases written by the test (weight tiles and rows in buffers of their exact size), runs every
 * path this CPU runs and compares each to the scalar reference bit for bit, with the fused
 * layers' pre-pass (none, RMSNorm, SwiGLU), bias and residual; then RoPE + cache write +
 * attention, and the float products, on buffers of their exact size. AddressSanitizer aborts on any read or write past a
 * buffer; a mismatch exits 1. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int sdk_linear_ex(int type, const uint8_t *w, int n, int nblk, int k, const float *x, long ldx, int m, float *y,
                  long ldy, int pre, const float *pre_w, float eps, const float *bias, const float *res, long ldr,
                  int isa, int nthreads);
int sdk_rope_attention(const float *qkv, long ldq, const float *cos, const float *sin, long cb, long ct,
                       float *keys, long kb, long kh, long ks, float *values, long vc, long vb, long vh,
                       const int32_t *slots, int cap, const int32_t *idx, const int32_t *n, int B, int T, int H,
                       int Hkv, int D, int N, float scale, float *qbuf, float *out, int nthreads, int isa);
int sdk_float_linear(const float *x, long ldx, int m, int pre, const float *pre_w, float eps, const void *w, int wt,
                     long ldw, int n, int k, const float *bias, const float *res, long ldr, float *y, long ldy,
                     int isa, int nthreads);
int sdk_isa_runs(int isa);
/* sdk.h's SDK_NISA; the AMX path's tiles at every row count, Q4_K's folded scales from 33 rows (both ways run) */
#define NISA 5
extern void sdk_set_amx_rows(int, int, int) __attribute__((weak));

static float *filled(size_t count, unsigned seed) {
    float *p = malloc(sizeof(float) * count);
    for (size_t i = 0; i < count; i++) {
        seed = seed * 1103515245u + 12345u;
        p[i] = (float)((int)(seed >> 16) % 2001 - 1000) / 250.0f;
    }
    return p;
}

/* one attention shape: H query heads over Hkv key heads of D (18: a tail past 16 lanes; 12 over 2
 * of 64: the AVX-512 build's 8 keys at a time and 6 heads' sums; 9 over 1 of 128: 6 heads' sums,
 * then 3) */
static int rope_case(int H, int Hkv, int D) {
    const int B = 2, T = 3, cap = 128, N = 100;
    size_t nq = (size_t)B * T * (H + 2 * Hkv) * D, nk = (size_t)B * Hkv * cap * D, nv = (size_t)2 * B * Hkv * 64 * D;
    float *qkv = filled(nq, 1), *cs = filled((size_t)B * T * D, 2), *sn = filled((size_t)B * T * D, 3);
    float *k0 = filled(nk, 4), *v0 = filled(nv, 5);
    int32_t slots[6] = {0, 64, 127, 5, 6, 120}, *idx = malloc(sizeof(int32_t) * B * T * N), cnt[6] = {1, 50, 100, 7, 99, 100};
    for (int i = 0; i < B * T * N; i++) idx[i] = (i * 37) % cap;
    float *want = 0, *wk = 0, *wv = 0;
    int runs = 0;
    for (int isa = 0; isa < NISA; isa++) {
        if (!sdk_isa_runs(isa)) continue;
        float *k = malloc(sizeof(float) * nk), *v = malloc(sizeof(float) * nv);
        float *q = malloc(sizeof(float) * B * T * H * D), *out = malloc(sizeof(float) * B * T * H * D);
        memcpy(k, k0, sizeof(float) * nk);
        memcpy(v, v0, sizeof(float) * nv);
        if (sdk_rope_attention(qkv, (H + 2 * Hkv) * D, cs, sn, (long)T * D, D, k, (long)Hkv * cap * D, (long)cap * D, D,
                               v, (long)B * Hkv * 64 * D, (long)Hkv * 64 * D, 64L * D, slots, cap, idx, cnt, B, T, H,
                               Hkv, D, N, 0.25f, q, out, 2, isa) != 0)
            return -1;
        if (!want) {
            want = out; wk = k; wv = v;
        } else {
            if (memcmp(out, want, sizeof(float) * B * T * H * D) || memcmp(k, wk, sizeof(float) * nk) ||
                memcmp(v, wv, sizeof(float) * nv)) {
                fprintf(stderr, "rope_attention: path %d differs from the reference\n", isa);
                return -1;
            }
            free(out); free(k); free(v);
        }
        free(q);
        runs++;
    }
    free(want); free(wk); free(wv); free(qkv); free(cs); free(sn); free(k0); free(v0); free(idx);
    return runs;
}

static int rope_cases(void) {
    static const int shapes[][3] = {{4, 2, 18}, {12, 2, 64}, {9, 1, 128}};
    int runs = 0;
    for (int i = 0; i < 3; i++) {
        const int r = rope_case(shapes[i][0], shapes[i][1], shapes[i][2]);
        if (r < 0) return -1;
        runs += r;
    }
    return runs;
}

/* float products (float32 and bfloat16 weights) on buffers of their exact size: odd widths,
 * 1-17 rows, each pre-pass, bias and residual; every SIMD path against the reference. Returns
 * the number of path runs compared, or -1. */
static int float_cases(void) {
    static const int shapes[][2] = {{1, 1}, {3, 7}, {17, 33}, {5, 300}};
    static const int rows[] = {1, 3, 9, 17};
    int runs = 0;
    for (int s = 0; s < 4; s++)
        for (int ri = 0; ri < 4; ri++)
            for (int wt = 0; wt < 2; wt++)
                for (int pre = 0; pre < 3; pre++) {
                    const int n = shapes[s][0], k = shapes[s][1], m = rows[ri], width = pre == 2 ? 2 * k : k;
                    float *wf = filled((size_t)n * k, 11), *x = filled((size_t)m * width, 12);
                    float *nw = filled((size_t)k, 13), *bias = filled((size_t)n, 14), *res = filled((size_t)m * n, 15);
                    float *want = malloc(sizeof(float) * (size_t)m * n), *got = malloc(sizeof(float) * (size_t)m * n);
                    void *w = wf;
                    if (wt == 1) { /* the same values' upper halves, in a buffer of n * k bfloat16 */
                        uint16_t *h = malloc(sizeof(uint16_t) * (size_t)n * k);
                        for (size_t i = 0; i < (size_t)n * k; i++) {
                            uint32_t u;
                            memcpy(&u, &wf[i], 4);
                            h[i] = (uint16_t)(u >> 16);
                        }
                        w = h;
                    }
                    const float *b = pre ? bias : 0, *r = pre ? res : 0;
                    if (sdk_float_linear(x, width, m, pre, nw, 0.5f, w, wt, k, n, k, b, r, n, want, n, 0, 1) != 0)
                        return -1;
                    for (int isa = 1; isa < NISA; isa++) {
                        if (!sdk_isa_runs(isa)) continue;
                        for (int threads = 1; threads <= 2; threads++) {
                            if (sdk_float_linear(x, width, m, pre, nw, 0.5f, w, wt, k, n, k, b, r, n, got, n, isa,
                                                 threads) != 0 ||
                                memcmp(got, want, sizeof(float) * (size_t)m * n) != 0) {
                                fprintf(stderr, "float product: path %d differs (%d x %d, %d rows, wt %d, pre %d)\n",
                                        isa, n, k, m, wt, pre);
                                return -1;
                            }
                            runs++;
                        }
                    }
                    if (w != wf) free(w);
                    free(wf); free(x); free(nw); free(bias); free(res); free(want); free(got);
                }
    return runs;
}

int main(int argc, char **argv) {
    FILE *f = fopen(argv[1], "rb");
    if (!f) return 2;
    if (sdk_set_amx_rows) sdk_set_amx_rows(1, 1, 33);
    int head[7], cases = 0, paths = 0;
    while (fread(head, sizeof(int), 7, f) == 7) {
        int type = head[0], n = head[1], nblk = head[2], k = head[3], m = head[4], wbytes = head[5], pre = head[6];
        int width = pre == 2 ? 2 * k : k;
        uint8_t *w = malloc(wbytes);
        float *x = malloc(sizeof(float) * (size_t)m * width);
        float *want = malloc(sizeof(float) * (size_t)m * n), *got = malloc(sizeof(float) * (size_t)m * n);
        float *nw = filled((size_t)k, 7), *bias = filled((size_t)n, 8), *res = filled((size_t)m * n, 9);
        if (fread(w, 1, wbytes, f) != (size_t)wbytes ||
            fread(x, sizeof(float), (size_t)m * width, f) != (size_t)m * width)
            return 2;
        const float *b = pre ? bias : 0, *r = pre ? res : 0;
        if (sdk_linear_ex(type, w, n, nblk, k, x, width, m, want, n, pre, nw, 0.5f, b, r, n, 0, 1) != 0) return 3;
        for (int isa = 1; isa < NISA; isa++) {
            if (!sdk_isa_runs(isa)) continue;
            for (int threads = 1; threads <= 2; threads++) {
                if (sdk_linear_ex(type, w, n, nblk, k, x, width, m, got, n, pre, nw, 0.5f, b, r, n, isa, threads) != 0)
                    return 3;
                if (memcmp(got, want, sizeof(float) * (size_t)m * n) != 0) {
                    fprintf(stderr, "path %d differs from the reference (type %d, %d x %d, %d rows, pre %d)\n", isa,
                            type, n, k, m, pre);
                    return 1;
                }
                paths++;
            }
        }
        free(w); free(x); free(want); free(got); free(nw); free(bias); free(res);
        cases++;
    }
    int rope = rope_cases(), floats = float_cases();
    if (rope < 0 || floats < 0) return 1;
    printf("%d cases, %d path runs, %d rope_attention runs, %d float product runs\n", cases, paths, rope, floats);
    return 0;
}
