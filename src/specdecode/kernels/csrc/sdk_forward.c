/* A run of decoder layers in one call: for each layer, the five steps of the fused layer
 * (models/llama.py _fused_attention_block) with no return to Python between them. The steps are
 * the library's own calls in the same order with the same arguments (sdk_quantize + sdk_product
 * per part, or sdk_float_linear; sdk_rope_attention), so the bits are those of the five calls
 * made one by one; what goes is ~20 us of Python a call and the idle memory between them.
 *
 * A projection is SDK_PROJ int64 words: [0] the number of parts (1-3, outputs side by side),
 * then per part [type (SDK_Q4K.. or 0: float weights), weight, n, nblk, bias or 0], then
 * [16] the float weight type (0 float32, 1 bfloat16) and [17] its row stride. A layer is four
 * projections (q|k|v, o, gate|up, down) and two pointers: the input norm's and the MLP norm's
 * weights. kv: [layer][2] the layer's key and value cache. x [m, hidden] is the residual stream
 * in and out; x2 [m, hidden], qkv [m, (H + 2 Hkv) D], qbuf [m, H D], attn [m, H D] and gu
 * [m, gu_width] (every layer's gate|up outputs) are scratch. The rest are sdk_rope_attention's.
 * Returns 0, or -1 (a layer's widths disagree with these), or the first failing call's code. */
#include <stddef.h>
#include <stdint.h>

#include "sdk.h"

#define SDK_PROJ 18
#define SDK_LAYER (4 * SDK_PROJ + 2)

int sdk_quantize(const float *x, long ldx, int m, int k, int pre, const float *pre_w, float eps, int isa,
                 int nthreads);
int sdk_product(int type, const uint8_t *w, int n, int nblk, int k, int m, float *y, long ldy, const float *bias,
                const float *res, long ldr, int isa, int nthreads);
int sdk_float_linear(const float *x, long ldx, int m, int pre, const float *pre_w, float eps, const void *w, int wt,
                     long ldw, int n, int k, const float *bias, const float *res, long ldr, float *y, long ldy,
                     int isa, int nthreads);
int sdk_rope_attention(const float *qkv, long ldq, const float *cos, const float *sin, long cb, long ct,
                       float *keys, long kb, long kh, long ks, float *values, long vc, long vb, long vh,
                       const int32_t *slots, int cap, const int32_t *idx, const int32_t *n, int B, int T, int H,
                       int Hkv, int D, int N, float scale, float *qbuf, float *out, int nthreads, int isa);

/* the outputs of projection p (the sum of its parts'), or -1 */
static long proj_outputs(const int64_t *p) {
    if (p[0] < 1 || p[0] > 3) return -1;
    long n = 0;
    for (int i = 0; i < p[0]; i++) n += p[1 + 5 * i + 2];
    return n;
}

/* y [m, n] = pre(x) [m, k] W^T (+ biases) (+ res [m, n]): kernels.linear_parts or float_linear */
static int proj(const int64_t *p, const float *x, long ldx, int m, int k, int pre, const float *pre_w, float eps,
                const float *res, float *y, int isa, int nthreads) {
    const long n = proj_outputs(p);
    if (n <= 0) return -1;
    if (p[1] == 0) { /* float weights: one part */
        if (p[0] != 1) return -1;
        return sdk_float_linear(x, ldx, m, pre, pre_w, eps, (const void *)(intptr_t)p[2], (int)p[16], (long)p[17],
                                (int)n, k, (const float *)(intptr_t)p[5], res, n, y, n, isa, nthreads);
    }
    int rc = sdk_quantize(x, ldx, m, k, pre, pre_w, eps, isa, nthreads);
    long col = 0;
    for (int i = 0; !rc && i < p[0]; i++) {
        const int64_t *q = p + 1 + 5 * i;
        rc = sdk_product((int)q[0], (const uint8_t *)(intptr_t)q[1], (int)q[2], (int)q[3], k, m, y + col, n,
                         (const float *)(intptr_t)q[4], res ? res + col : 0, n, isa, nthreads);
        col += q[2];
    }
    return rc;
}

int sdk_layers(const int64_t *desc, int nlayers, const int64_t *kv, float eps, float *x, float *x2, int m,
               int hidden, float *qkv, float *qbuf, float *attn, float *gu, int gu_width, const float *cos,
               const float *sin, long cb, long ct, long kb, long kh, long ks, long vc, long vb, long vh,
               const int32_t *slots, int cap, const int32_t *idx, const int32_t *n, int B, int T, int H, int Hkv,
               int D, int N, float scale, int isa, int nthreads) {
    if (nlayers < 0 || m != B * T || hidden <= 0) return -1;
    const long nq = (long)(H + 2 * Hkv) * D, na = (long)H * D;
    for (int l = 0; l < nlayers; l++) {
        const int64_t *L = desc + (long)l * SDK_LAYER;
        const float *attn_norm = (const float *)(intptr_t)L[4 * SDK_PROJ];
        const float *mlp_norm = (const float *)(intptr_t)L[4 * SDK_PROJ + 1];
        const long ngu = proj_outputs(L + 2 * SDK_PROJ);
        if (proj_outputs(L) != nq || proj_outputs(L + SDK_PROJ) != hidden || ngu != gu_width || ngu % 2 ||
            proj_outputs(L + 3 * SDK_PROJ) != hidden)
            return -1;
        int rc = proj(L, x, hidden, m, hidden, 1, attn_norm, eps, 0, qkv, isa, nthreads);
        if (!rc)
            rc = sdk_rope_attention(qkv, nq, cos, sin, cb, ct, (float *)(intptr_t)kv[2 * l], kb, kh, ks,
                                    (float *)(intptr_t)kv[2 * l + 1], vc, vb, vh, slots, cap, idx, n, B, T, H, Hkv,
                                    D, N, scale, qbuf, attn, nthreads, isa);
        if (!rc) rc = proj(L + SDK_PROJ, attn, na, m, (int)na, 0, 0, 0.0f, x, x2, isa, nthreads);
        if (!rc) rc = proj(L + 2 * SDK_PROJ, x2, hidden, m, hidden, 1, mlp_norm, eps, 0, gu, isa, nthreads);
        if (!rc) rc = proj(L + 3 * SDK_PROJ, gu, ngu, m, (int)(ngu / 2), 2, 0, 0.0f, x2, x, isa, nthreads);
        if (rc) return rc;
    }
    return 0;
}
