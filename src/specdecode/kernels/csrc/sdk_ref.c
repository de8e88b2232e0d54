/* The scalar reference: the one definition of every result (each SIMD path must equal it bit
 * for bit), and the activation quantizer every path shares. Compiled with no ISA flags and
 * -ffp-contract=off: each float operation below is the IEEE operation written. */
#include <math.h>
#include <string.h>

#include "sdk.h"

int sdk_fault = 0;
int sdk_pf_blocks = 1;
int sdk_pf_small = 4;
int sdk_pf_q6_l1 = 0;
int sdk_pf_one = 1;
int sdk_pf_nta = 0;

static uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* 4-bit value of column c, input k (0..255) in a Q4_K (or Q6_K low nibble) record's nibbles */
static int nib(const uint8_t *qs, int c, int k) {
    int j = k / 32, g = (k % 32) / 4, kk = k % 4;
    uint8_t byte = qs[(j * 4 + g % 4) * 64 + c * 4 + kk];
    return g < 4 ? byte & 15 : byte >> 4;
}

/* Q6_K's integers, 384 bytes per 32 inputs: 4 vectors of low nibbles (as Q4_K's), then 2 of
 * high bit pairs (one read stream per block) */
static int q6(const uint8_t *rec, int c, int k) {
    int j = k / 32, g = (k % 32) / 4, kk = k % 4;
    const uint8_t *chunk = rec + j * 384;
    uint8_t lo = chunk[(g % 4) * 64 + c * 4 + kk], h = chunk[256 + (g / 4) * 64 + c * 4 + kk];
    return (g < 4 ? lo & 15 : lo >> 4) | (((h >> (2 * (g % 4))) & 3) << 4);
}

/* Q5_0's value 0..31 (q + 16) of column c, input k (0..31) in a block's 320 bytes */
static int q5(const uint8_t *p, int c, int k) {
    int g = k / 4, kk = k % 4;
    uint8_t lo = p[(g % 4) * 64 + c * 4 + kk], h = p[256 + c * 4 + kk];
    return (g < 4 ? lo & 15 : lo >> 4) | (((h >> g) & 1) << 4);
}

/* Q3_0's value 0..7 (q + 4) of column c, input k (0..31) in a block's 192 bytes */
static int q3(const uint8_t *p, int c, int k) {
    int g = k / 4, kk = k % 4;
    uint8_t lo = p[(g / 4) * 64 + c * 4 + kk], h = p[128 + c * 4 + kk];
    return ((lo >> (2 * (g % 4))) & 3) | (((h >> g) & 1) << 2);
}

/* the signed value q of column c, input k of a block of 32 (Q8_0: stored q + 128; Q4_0: Q5_0's
 * nibbles, no fifth bit, q + 8) */
static int q32(int type, const uint8_t *p, int c, int k) {
    if (type == SDK_Q8_0) return (int)p[(k / 4) * 64 + c * 4 + k % 4] - 128;
    if (type == SDK_Q5_0) return q5(p, c, k) - 16;
    if (type == SDK_Q3_0) return q3(p, c, k) - 4;
    uint8_t lo = p[((k / 4) % 4) * 64 + c * 4 + k % 4];
    return (k < 16 ? lo & 15 : lo >> 4) - 8;
}

void sdk_tile_ref(int type, const uint8_t *rec, int nblk, const sdk_act *a, int m0, int m1, float *acc,
                  uint8_t *scratch) {
    (void)scratch;
    const int kp = a->kp, nsb = kp / SDK_QK;
    for (int r = 0; r < m1 - m0; r++) {
        const int8_t *x = a->xq + (size_t)(m0 + r) * kp;
        const float *xa = a->xa + (size_t)(m0 + r) * nsb;
        const int32_t *xs = a->xs + (size_t)(m0 + r) * (kp / 16);
        for (int c = 0; c < SDK_TILE; c++) {
            float y = 0.0f;
            for (int b = 0; b < nblk; b++) {
                if (type == SDK_Q4K) {
                    const uint8_t *p = rec + (size_t)b * SDK_Q4K_REC;
                    int32_t isum = 0, imin = 0;
                    for (int j = 0; j < 8; j++) {
                        int32_t s = 0;
                        for (int k = j * 32; k < j * 32 + 32; k++) s += nib(p, c, k) * x[b * 256 + k];
                        isum += p[2048 + j * 16 + c] * s;
                        imin += p[2176 + (j / 2) * 32 + c * 2 + j % 2] * (xs[b * 16 + 2 * j] + xs[b * 16 + 2 * j + 1]);
                    }
                    float d = sdk_h2f(rd16(p + 2304 + 2 * c)), dmin = sdk_h2f(rd16(p + 2336 + 2 * c));
                    y = fmaf((float)isum, d * xa[b], y);
                    y = fmaf(-(float)imin, dmin * xa[b], y);
                } else if (type == SDK_Q6K) {
                    const uint8_t *p = rec + (size_t)b * SDK_Q6K_REC;
                    const uint8_t *ps = p + SDK_Q6K_INTS;
                    int32_t isum = 0;
                    for (int s16 = 0; s16 < 16; s16++) {
                        int32_t s = 0;
                        for (int k = s16 * 16; k < s16 * 16 + 16; k++) s += q6(p, c, k) * x[b * 256 + k];
                        s -= 32 * xs[b * 16 + s16];
                        isum += (int8_t)ps[(s16 / 2) * 32 + c * 2 + s16 % 2] * s;
                    }
                    float d = sdk_h2f(rd16(ps + 256 + 2 * c));
                    y = fmaf((float)isum, d * xa[b], y);
                } else { /* Q8_0, Q5_0, Q4_0, Q3_0: nblk blocks of 32, a tile's integers then its scales */
                    const long ints = type == SDK_Q8_0   ? SDK_Q8_INTS
                                      : type == SDK_Q5_0 ? SDK_Q5_INTS
                                      : type == SDK_Q4_0 ? SDK_Q4_INTS
                                                         : SDK_Q3_INTS;
                    const uint8_t *p = rec + (size_t)b * ints;
                    const uint8_t *ps = rec + (size_t)nblk * ints + (size_t)b * SDK_Q8_SCALES; /* 32 each */
                    int32_t s = 0;
                    for (int k = 0; k < 32; k++) s += q32(type, p, c, k) * x[b * 32 + k];
                    float d = sdk_h2f(rd16(ps + 2 * c));
                    y = fmaf((float)s, d * xa[b / 8], y);
                }
            }
            acc[r * SDK_TILE + c] = y;
        }
    }
}

/* One row's activations: per block of 256 inputs, scale = max|x| / 127 and codes
 * lrintf(x * (127 / max|x|)) in [-127, 127] (zero past k); integer sums per 16 codes. The
 * row alone decides its codes. Also the sums of 32 codes as int16 pairs (xp, see sdk.h). */
void sdk_quantize_row(const float *x, int k, int kp, int8_t *xq, float *xa, int32_t *xs, int32_t *xp) {
    for (int b = 0; b < kp / SDK_QK; b++) {
        int lo = b * SDK_QK, hi = lo + SDK_QK < k ? lo + SDK_QK : k;
        float amax = 0.0f;
        for (int i = lo; i < hi; i++) {
            float v = fabsf(x[i]);
            amax = v > amax ? v : amax;
        }
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        xa[b] = amax / 127.0f;
        for (int i = lo; i < lo + SDK_QK; i++) {
            int q = 0;
            if (i < hi) {
                long r = __builtin_lrintf(x[i] * id);
                q = r > 127 ? 127 : (r < -127 ? -127 : (int)r);
            }
            xq[i] = (int8_t)q;
        }
        for (int s = 0; s < SDK_QK / 16; s++) {
            int32_t t = 0;
            for (int i = 0; i < 16; i++) t += xq[lo + s * 16 + i];
            xs[lo / 16 + s] = t;
        }
        for (int q = 0; q < SDK_QK / 64; q++) {
            const int32_t *s16 = xs + lo / 16 + q * 4;
            uint32_t a0 = (uint16_t)(int16_t)(s16[0] + s16[1]), a1 = (uint16_t)(int16_t)(s16[2] + s16[3]);
            xp[lo / 64 + q] = (int32_t)(a0 | (a1 << 16));
        }
    }
}
