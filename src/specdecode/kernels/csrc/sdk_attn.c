/* Attention whose result for a query does not depend on anything but that query and the keys
 * and values it sees, in their logical order: the batch-invariant forward's attention for models
 * on the kernel (kq). Each query is computed by one thread from start to end, with one fixed
 * sequence of float operations (dot products in 16 partial sums reduced in a fixed tree, a max,
 * expf, a sum and a weighted sum of the values in logical order), so its bits do not depend on
 * how many queries, rows or threads share the call. Compiled without ISA flags and with
 * -ffp-contract=off; the same source is also built with AVX2 and AVX-512 flags (wider vectors,
 * the same lane-by-lane operations: the same bits, checked like the products' paths).
 *
 * Layouts (strides in floats, the head dimension contiguous):
 *   q       [B, T, H, D]          strides qb, qt (head stride D)
 *   keys    [B, Hkv, slots, D]    strides kb, kh, ks
 *   values  [chunks, B, Hkv, 64, D] (chunk-major: slot s is chunk s / 64, row s % 64)
 *           strides vc, vb, vh (row stride D)
 *   idx     [B, T, N] int32: the slots each query sees in logical order (the first n[b, t])
 *   out     [B, T, H, D] contiguous float32
 */
#include "sdk.h"

#define ATTN(x) attn_base_##x
#include "sdk_attn_body.h"
#define FGEMM_BASE 1 /* the reference build: no test fault */
#include "sdk_fgemm_body.h"

typedef int (*attn_fn)(const float *, long, long, const float *, long, long, long, const float *, long, long, long,
                       const int32_t *, const int32_t *, int, int, int, int, int, int, float, float *, int);
extern int attn_avx2_run(const float *, long, long, const float *, long, long, long, const float *, long, long, long,
                         const int32_t *, const int32_t *, int, int, int, int, int, int, float, float *, int)
    __attribute__((weak));
extern int attn_avx512_run(const float *, long, long, const float *, long, long, long, const float *, long, long,
                           long, const int32_t *, const int32_t *, int, int, int, int, int, int, float, float *, int)
    __attribute__((weak));
int sdk_isa_runs(int isa);

/* Returns 0, or -1 (bad arguments), -2 (path not runnable), -3 (out of memory). isa: sdk.h's
 * SDK_ISA_* (AVX-VNNI takes the AVX2 build). A query that sees no slot gets zeros. */
int sdk_attention(const float *q, long qb, long qt, const float *keys, long kb, long kh, long ks,
                  const float *values, long vc, long vb, long vh, const int32_t *idx, const int32_t *n, int B,
                  int T, int H, int Hkv, int D, int N, float scale, float *out, int nthreads, int isa) {
    attn_fn fn = attn_base_run;
    if (isa == SDK_ISA_AVX2 || isa == SDK_ISA_AVXVNNI) fn = attn_avx2_run;
    if (isa == SDK_ISA_AVX512VNNI || isa == SDK_ISA_AMX) fn = attn_avx512_run;
    if (!fn || !sdk_isa_runs(isa)) return -2;
    return fn(q, qb, qt, keys, kb, kh, ks, values, vc, vb, vh, idx, n, B, T, H, Hkv, D, N, scale, out, nthreads);
}

/* the row pre-pass of each build (sdk_attn_body.h ATTN(pre_row)): the same bits in all */
typedef void (*pre_fn)(int, const float *, int, const float *, float, float *);
extern void attn_avx2_pre_row(int, const float *, int, const float *, float, float *) __attribute__((weak));
extern void attn_avx512_pre_row(int, const float *, int, const float *, float, float *) __attribute__((weak));

pre_fn sdk_pre_row_for(int isa) {
    if ((isa == SDK_ISA_AVX2 || isa == SDK_ISA_AVXVNNI) && attn_avx2_pre_row) return attn_avx2_pre_row;
    if ((isa == SDK_ISA_AVX512VNNI || isa == SDK_ISA_AMX) && attn_avx512_pre_row) return attn_avx512_pre_row;
    return attn_base_pre_row;
}

typedef int (*rope_attend_fn)(const float *, long, const float *, const float *, long, long, float *, long, long,
                              long, float *, long, long, long, const int32_t *, int, const int32_t *,
                              const int32_t *, int, int, int, int, int, int, float, float *, float *, int);
extern int attn_avx2_rope_attend(const float *, long, const float *, const float *, long, long, float *, long,
                                 long, long, float *, long, long, long, const int32_t *, int, const int32_t *,
                                 const int32_t *, int, int, int, int, int, int, float, float *, float *, int)
    __attribute__((weak));
extern int attn_avx512_rope_attend(const float *, long, const float *, const float *, long, long, float *, long,
                                   long, long, float *, long, long, long, const int32_t *, int, const int32_t *,
                                   const int32_t *, int, int, int, int, int, int, float, float *, float *, int)
    __attribute__((weak));

/* RoPE, the cache write and the attention of one layer in one call (sdk_attn_body.h
 * ATTN(rope_attend)); returns as sdk_attention. */
int sdk_rope_attention(const float *qkv, long ldq, const float *cos, const float *sin, long cb, long ct,
                       float *keys, long kb, long kh, long ks, float *values, long vc, long vb, long vh,
                       const int32_t *slots, int cap, const int32_t *idx, const int32_t *n, int B, int T, int H, int Hkv,
                       int D, int N, float scale, float *qbuf, float *out, int nthreads, int isa) {
    rope_attend_fn fn = attn_base_rope_attend;
    if (isa == SDK_ISA_AVX2 || isa == SDK_ISA_AVXVNNI) fn = attn_avx2_rope_attend;
    if (isa == SDK_ISA_AVX512VNNI || isa == SDK_ISA_AMX) fn = attn_avx512_rope_attend;
    if (!fn || !sdk_isa_runs(isa)) return -2;
    return fn(qkv, ldq, cos, sin, cb, ct, keys, kb, kh, ks, values, vc, vb, vh, slots, cap, idx, n, B, T, H, Hkv, D, N,
              scale, qbuf, out, nthreads);
}

typedef int (*flin_fn)(const float *, long, int, int, const float *, float, const void *, int, long, int, int,
                       const float *, const float *, long, float *, long, int);
extern int attn_avx2_float_linear(const float *, long, int, int, const float *, float, const void *, int, long, int,
                                  int, const float *, const float *, long, float *, long, int) __attribute__((weak));
extern int attn_avx512_float_linear(const float *, long, int, int, const float *, float, const void *, int, long,
                                    int, int, const float *, const float *, long, float *, long, int)
    __attribute__((weak));

/* y [m, n] = pre(x) [m, k] W^T (+ bias) (+ res) with W [n, k] float32 (wt 0) or bfloat16 (wt 1)
 * (sdk_fgemm_body.h: the same bits on every path). Returns 0, or -1 (bad arguments), -2 (path
 * not runnable), -3 (out of memory). */
int sdk_float_linear(const float *x, long ldx, int m, int pre, const float *pre_w, float eps, const void *w, int wt,
                     long ldw, int n, int k, const float *bias, const float *res, long ldr, float *y, long ldy,
                     int isa, int nthreads) {
    flin_fn fn = attn_base_float_linear;
    if (isa == SDK_ISA_AVX2 || isa == SDK_ISA_AVXVNNI) fn = attn_avx2_float_linear;
    if (isa == SDK_ISA_AVX512VNNI || isa == SDK_ISA_AMX) fn = attn_avx512_float_linear;
    if (!fn || !sdk_isa_runs(isa)) return -2;
    return fn(x, ldx, m, pre, pre_w, eps, w, wt, ldw, n, k, bias, res, ldr, y, ldy, nthreads);
}
