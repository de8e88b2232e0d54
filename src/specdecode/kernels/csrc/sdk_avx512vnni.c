/* AVX-512 VNNI path: one zmm holds the 16 columns of a tile; vpdpbusd multiplies 4 inputs per
 * column (unsigned weight values x signed activation codes) into int32 lanes. Rows go in
 * groups of up to ROWS: a sub-block's weights are decoded once into registers and applied to
 * every row of the group (the block's bytes come from memory once per call and from L1 for
 * later groups), with two independent dot-product chains per row. The integer sums are exact,
 * so neither the grouping nor the split into chains moves a bit. */
#include <immintrin.h>
#include <string.h>

#include "sdk.h"

#define ROWS 6 /* the largest row group (registers: 8 weight vectors, 2 chains and a sum a row) */

/* software prefetch ahead in the read stream: the hardware prefetcher alone left a 5-row product
 * waiting on memory. Q6_K's lines go to L2 (T1), the others' to L1: each the faster of the two in
 * A/B runs on an AMD EPYC (benchmarks/NOTES.md, issue 53). Q4_K and Q6_K look sdk_pf_one records ahead
 * for one row and sdk_pf_blocks records ahead for more: the distance that pays depends on the CPU (1
 * on a Zen 4 EPYC, 3 on a Zen 5 EPYC, whose 5-row step it made 26% faster), so it is timed
 * (kernels.prefetch_blocks) */
#define SDK_PF_Q4K pf
#define SDK_PF_Q6K pf
/* The blocks of 32 (Q8_0, Q5_0, Q4_0, Q3_0) have small records (160-544 bytes): sdk_pf_small of them
 * ahead at every row count, timed apart from Q4_K's distance (SDK_PF_SMALL; on the Zen 5 EPYC 32
 * records made the 0.5B's one-row step 7% and its 5-row step 17% faster than 4, on a Zen 4 EPYC
 * the kq4 draft's step 17% faster, where Q4_K's timed distance is one record). Their
 * tile is read as two streams (the integers, then the scales at its end), so the prefetch walks
 * the tile's bytes as one stream instead: block b asks for its share, bytes [b, b + 1) x REC, the
 * distance ahead. Prefetching each block's own integers and scales had left ~9% of every tile's
 * lines (its first ones, and its scales) to the hardware, and a one-row product read 77% of Q4_K's
 * GB/s; walking the tile made one row ~18% and two to five rows 10-27% faster (NOTES, issue 53) */
#define PF(p) SDK_PREFETCH(p, _MM_HINT_T0)
#define PF2(p) SDK_PREFETCH(p, _MM_HINT_T1)
/* Q6_K's lines: to L2, or for one or two rows to L1 where that was timed faster (sdk_pf_q6_l1: a Zen 5
 * EPYC, the 1.5B's Q6_K head and down 5-7% faster at one row, 2-7% at two; at five rows L1 was 0-3%
 * slower; on a Zen 4 EPYC L1 was 28% slower at one row) */
#define PF6(p)                                  \
    do {                                        \
        if (R <= 2 && sdk_pf_q6_l1)             \
            PF(p);                              \
        else                                    \
            PF2(p);                             \
    } while (0)
#define UNROLL(n) _Pragma("GCC unroll 8")

/* acc += w (16 x 4 unsigned bytes) . the 4 signed codes at p, broadcast by the instruction itself
 * (an embedded {1to16} broadcast: one fused load-and-multiply, no separate vpbroadcastd) */
static inline __m512i dpb(__m512i acc, __m512i w, const int8_t *p) {
    __asm__("vpdpbusd %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "m"(*(const int32_t *)p));
    return acc;
}

/* acc += the int16 pairs of w times the int16 pair at p (broadcast by the instruction) */
static inline __m512i dpw(__m512i acc, __m512i w, const int32_t *p) {
    __asm__("vpdpwssd %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "m"(*p));
    return acc;
}

static inline __m512i fault_lane(void) { return _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0); }

static inline __m512i u8x16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline __m512 h2f16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* the epilogue of one row and block: y = fma(isum, d * a, y), then y = fma(-imin, dmin * a, y) */
static inline void store_row(float *acc, __m512i isum, __m512 d, const __m512i *imin, __m512 dmin, float a) {
    __m512 av = _mm512_set1_ps(a), y = _mm512_loadu_ps(acc);
    y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, av), y);
    if (imin) y = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(*imin), _mm512_mul_ps(dmin, av), y);
    _mm512_storeu_ps(acc, y);
}

/* Q4_K: per 32 inputs, two dot-product chains per row of 16 products each (|sum| <= 16 x 15 x
 * 127 = 30480: an int16), packed as a pair and multiplied by the sub-block's scale with one
 * vpdpwssd; the minimums' term is 4 vpdpwssd per row and super-block (scale pairs against the
 * row's sums of 32 codes in pairs, xp). Every sum is the reference's exact integer. */
static inline __attribute__((always_inline)) void q4k_block(const int R, const uint8_t *tile, int nblk,
                                                            const sdk_act *a, int m, int b, float *acc) {
    const uint8_t *rec = tile + (size_t)b * SDK_Q4K_REC;
    const long pf = R == 1 ? (long)sdk_pf_one * SDK_Q4K_REC : (long)sdk_pf_blocks * SDK_Q4K_REC;
    (void)nblk;
    const int kp = a->kp;
    const __m512i low4 = _mm512_set1_epi8(0x0f), lo16 = _mm512_set1_epi32(0xffff);
    const int8_t *x[ROWS];
    __m512i isum[ROWS], imin[ROWS];
    UNROLL(8) for (int r = 0; r < R; r++) {
        x[r] = a->xq + (size_t)(m + r) * kp + b * 256;
        isum[r] = imin[r] = _mm512_setzero_si512();
    }
    for (int j = 0; j < 8; j++) {
        __m512i w[8], s[ROWS][2];
        UNROLL(4) for (int i = 0; i < 4; i++) {
            __m512i v = _mm512_loadu_si512(rec + (j * 4 + i) * 64);
            PF(rec + SDK_PF_Q4K + (j * 4 + i) * 64 + (j == 7 ? 256 : 0)); /* + the scales' 5 lines */
            w[i] = _mm512_and_si512(v, low4);
            w[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        UNROLL(8) for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm512_setzero_si512();
        UNROLL(8) for (int g = 0; g < 8; g++)
            UNROLL(8) for (int r = 0; r < R; r++)
                s[r][g & 1] = dpb(s[r][g & 1], w[g], x[r] + j * 32 + g * 4);
        __m512i sc = u8x16(rec + 2048 + j * 16);
        sc = _mm512_or_si512(sc, _mm512_slli_epi32(sc, 16)); /* (sc, sc) int16 pairs */
        UNROLL(8) for (int r = 0; r < R; r++) {
            /* the pair (s0 low, s1 high): lo16 ? s0 : s1 << 16, bit by bit (0xCA) */
            __m512i pair = _mm512_ternarylogic_epi32(lo16, s[r][0], _mm512_slli_epi32(s[r][1], 16), 0xCA);
            isum[r] = _mm512_dpwssd_epi32(isum[r], pair, sc);
        }
    }
    UNROLL(4) for (int q = 0; q < 4; q++) {
        __m512i mn = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(rec + 2176 + q * 32)));
        UNROLL(8) for (int r = 0; r < R; r++) imin[r] = dpw(imin[r], mn, a->xp + (size_t)(m + r) * (kp / 64) + b * 4 + q);
    }
    __m512 d = h2f16(rec + 2304), dmin = h2f16(rec + 2336);
    UNROLL(8) for (int r = 0; r < R; r++) {
        if (sdk_fault && b == 0 && m + r == 0) isum[r] = _mm512_add_epi32(isum[r], fault_lane());
        store_row(acc + r * 16, isum[r], d, &imin[r], dmin, a->xa[(size_t)(m + r) * (kp / SDK_QK) + b]);
    }
}

static inline __attribute__((always_inline)) void q6k_block(const int R, const uint8_t *tile, int nblk,
                                                            const sdk_act *a, int m, int b, float *acc) {
    const uint8_t *rec = tile + (size_t)b * SDK_Q6K_REC;
    const uint8_t *scales = rec + SDK_Q6K_INTS;
    const long pf = R == 1 ? (long)sdk_pf_one * SDK_Q6K_REC : (long)sdk_pf_blocks * SDK_Q6K_REC;
    (void)nblk;
    const int kp = a->kp;
    const __m512i low4 = _mm512_set1_epi8(0x0f), bits45 = _mm512_set1_epi8(0x30);
    const int8_t *x[ROWS];
    const int32_t *xw[ROWS];
    __m512i isum[ROWS], off[ROWS];
    UNROLL(8) for (int r = 0; r < R; r++) {
        x[r] = a->xq + (size_t)(m + r) * kp + b * 256;
        xw[r] = a->xw + (size_t)(m + r) * (kp / 32) + b * 8;
        isum[r] = off[r] = _mm512_setzero_si512();
    }
    for (int j = 0; j < 8; j++) { /* 32 inputs: two sub-blocks of 16 with their own scales */
        __m512i w[8];
        const uint8_t *chunk = rec + j * 384; /* 4 vectors of low nibbles, 2 of high bit pairs */
        __m512i h0 = _mm512_loadu_si512(chunk + 256), h1 = _mm512_loadu_si512(chunk + 320);
        PF6(chunk + SDK_PF_Q6K + 256);
        PF6(chunk + SDK_PF_Q6K + 320);
        if (j < 5) PF6(scales + SDK_Q6K_REC + j * 64); /* the next block's scales */
        UNROLL(4) for (int i = 0; i < 4; i++) {
            __m512i v = _mm512_loadu_si512(chunk + i * 64);
            PF6(chunk + SDK_PF_Q6K + i * 64);
            /* value i's high bit pair (bits 2i, 2i + 1 of each byte) moved to bits 4 and 5: the
             * 16-bit shifts bring bits from within the same byte into them */
            __m512i b0 = i < 2 ? _mm512_slli_epi16(h0, 4 - 2 * i) : (i == 2 ? h0 : _mm512_srli_epi16(h0, 2));
            __m512i b1 = i < 2 ? _mm512_slli_epi16(h1, 4 - 2 * i) : (i == 2 ? h1 : _mm512_srli_epi16(h1, 2));
            /* (v & 0x0f) | (b & 0x30) in two instructions: and, then a ternary (A & C) | B (0xEC) */
            w[i] = _mm512_ternarylogic_epi32(v, _mm512_and_si512(b0, bits45), low4, 0xEC);
            w[i + 4] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), _mm512_and_si512(b1, bits45), low4, 0xEC);
        }
        /* the scales of sub-blocks 2j and 2j + 1 as int16 pairs: each half's scale (sign-extended),
         * and the offset's term sc x (sums of 16 codes) for both halves in one vpdpwssd a row */
        const __m512i pair = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(scales + j * 32)));
        const __m512i sch[2] = {_mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16), _mm512_srai_epi32(pair, 16)};
        UNROLL(8) for (int r = 0; r < R; r++) off[r] = dpw(off[r], pair, xw[r] + j);
        UNROLL(2) for (int half = 0; half < 2; half++) {
            /* one dot-product chain a row when three or more rows give independent chains */
            const int two = R < 3;
            __m512i t[ROWS][2];
            UNROLL(8) for (int r = 0; r < R; r++) t[r][0] = t[r][1] = _mm512_setzero_si512();
            UNROLL(4) for (int g = 0; g < 4; g++)
                UNROLL(8) for (int r = 0; r < R; r++)
                    t[r][two & g] = dpb(t[r][two & g], w[half * 4 + g], x[r] + j * 32 + half * 16 + g * 4);
            UNROLL(8) for (int r = 0; r < R; r++) {
                __m512i u = two ? _mm512_add_epi32(t[r][0], t[r][1]) : t[r][0];
                isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(u, sch[half]));
            }
        }
    }
    __m512 d = h2f16(scales + 256);
    UNROLL(8) for (int r = 0; r < R; r++) {
        /* sum over s of sc (t - 32 xs) = sum of sc t - 32 sum of sc xs: exact int32 either way */
        isum[r] = _mm512_sub_epi32(isum[r], _mm512_slli_epi32(off[r], 5));
        if (sdk_fault && b == 0 && m + r == 0) isum[r] = _mm512_add_epi32(isum[r], fault_lane());
        store_row(acc + r * 16, isum[r], d, 0, d, a->xa[(size_t)(m + r) * (kp / SDK_QK) + b]);
    }
}

static inline __attribute__((always_inline)) void q8_block(const int R, const uint8_t *tile, int nblk,
                                                           const sdk_act *a, int m, int b, float *acc) {
    const uint8_t *rec = tile + (size_t)b * SDK_Q8_INTS;
    const long pf = SDK_PF_SMALL(SDK_Q8_REC);
    UNROLL(9) for (int i = 0; i < 9; i++) PF(tile + pf + (long)b * SDK_Q8_REC + i * 64);
    const int kp = a->kp, n16 = kp / 16;
    __m512i s[ROWS][2];
    UNROLL(8) for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm512_setzero_si512();
    UNROLL(8) for (int g = 0; g < 8; g++) {
        __m512i v = _mm512_loadu_si512(rec + g * 64);
        UNROLL(8) for (int r = 0; r < R; r++)
            s[r][g & 1] = dpb(s[r][g & 1], v, a->xq + (size_t)(m + r) * kp + b * 32 + g * 4);
    }
    const uint8_t *scales = tile + (size_t)nblk * SDK_Q8_INTS + (size_t)b * SDK_Q8_SCALES;
    __m512 d = h2f16(scales);
    UNROLL(8) for (int r = 0; r < R; r++) {
        const int32_t *xs = a->xs + (size_t)(m + r) * n16 + b * 2;
        __m512i u = _mm512_sub_epi32(_mm512_add_epi32(s[r][0], s[r][1]), _mm512_set1_epi32(128 * (xs[0] + xs[1])));
        if (sdk_fault && b == 0 && m + r == 0) u = _mm512_add_epi32(u, fault_lane());
        store_row(acc + r * 16, u, d, 0, d, a->xa[(size_t)(m + r) * (kp / SDK_QK) + b / 8]);
    }
}

/* a block of 32's 8 weight vectors (4 inputs x 16 columns each): Q8_0's as stored (q + 128),
 * Q5_0's nibbles with the fifth bit moved from bit g of the plane's byte to bit 4 (q + 16), Q4_0's
 * nibbles (q + 8), Q3_0's 2-bit values with the third bit from the plane (q + 4) */
static inline __attribute__((always_inline)) void decode32(const int type, const uint8_t *rec, __m512i *w) {
    if (type == SDK_Q8_0) {
        UNROLL(8) for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512(rec + g * 64);
        return;
    }
    if (type == SDK_Q3_0) {
        /* the 2-bit values, plus 4 where the plane's bit g is set: a byte mask by vptestmb and a
         * masked add, not a shift of the plane (shifts and vpdpbusd share one port on Intel) */
        const __m512i low2 = _mm512_set1_epi8(0x03), bit2 = _mm512_set1_epi8(0x04);
        const __m512i h = _mm512_loadu_si512(rec + 128);
        UNROLL(2) for (int j = 0; j < 2; j++) {
            const __m512i v = _mm512_loadu_si512(rec + j * 64);
            UNROLL(4) for (int i = 0; i < 4; i++) {
                const int g = 4 * j + i;
                __m512i lo = _mm512_and_si512(i == 0 ? v : _mm512_srli_epi16(v, 2 * i), low2);
                __mmask64 k = _mm512_test_epi8_mask(h, _mm512_set1_epi8((char)(1 << g)));
                w[g] = _mm512_mask_add_epi8(lo, k, lo, bit2);
            }
        }
        return;
    }
    const int five = type == SDK_Q5_0;
    const __m512i low4 = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
    const __m512i h = five ? _mm512_loadu_si512(rec + 256) : _mm512_setzero_si512();
    UNROLL(4) for (int i = 0; i < 4; i++) {
        __m512i v = _mm512_loadu_si512(rec + i * 64);
        if (five) {
            /* bit i (bit i + 4) of each plane byte to bit 4: 16-bit shifts that stay inside the byte */
            __m512i hi = _mm512_slli_epi16(h, 4 - i);
            __m512i hj = i == 0 ? h : _mm512_srli_epi16(h, i);
            w[i] = _mm512_ternarylogic_epi32(v, _mm512_and_si512(hi, bit4), low4, 0xEC);
            w[i + 4] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), _mm512_and_si512(hj, bit4), low4, 0xEC);
        } else {
            w[i] = _mm512_and_si512(v, low4);
            w[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
    }
}

/* Q5_0, Q4_0 and Q3_0 from 7 rows, in groups (decode32's values) */
static inline __attribute__((always_inline)) void q50_block(const int type, const int R, const uint8_t *tile,
                                                            int nblk, const sdk_act *a, int m, int b, float *acc) {
    const int five = type == SDK_Q5_0, three = type == SDK_Q3_0;
    const long ints = five ? SDK_Q5_INTS : three ? SDK_Q3_INTS : SDK_Q4_INTS;
    const long recb = five ? SDK_Q5_REC : three ? SDK_Q3_REC : SDK_Q4_REC;
    const uint8_t *rec = tile + (size_t)b * ints;
    const long pf = SDK_PF_SMALL(recb);
    UNROLL(6) for (int i = 0; i < (five ? 6 : three ? 4 : 5); i++) PF(tile + pf + (long)b * recb + i * 64);
    const int kp = a->kp, n16 = kp / 16;
    __m512i w[8], s[ROWS][2];
    decode32(type, rec, w);
    UNROLL(8) for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm512_setzero_si512();
    UNROLL(8) for (int g = 0; g < 8; g++)
        UNROLL(8) for (int r = 0; r < R; r++)
            s[r][g & 1] = dpb(s[r][g & 1], w[g], a->xq + (size_t)(m + r) * kp + b * 32 + g * 4);
    const uint8_t *scales = tile + (size_t)nblk * ints + (size_t)b * SDK_Q5_SCALES;
    __m512 d = h2f16(scales);
    const int off = five ? 16 : three ? 4 : 8;
    UNROLL(8) for (int r = 0; r < R; r++) {
        const int32_t *xs = a->xs + (size_t)(m + r) * n16 + b * 2;
        __m512i u = _mm512_sub_epi32(_mm512_add_epi32(s[r][0], s[r][1]), _mm512_set1_epi32(off * (xs[0] + xs[1])));
        if (sdk_fault && b == 0 && m + r == 0) u = _mm512_add_epi32(u, fault_lane());
        store_row(acc + r * 16, u, d, 0, d, a->xa[(size_t)(m + r) * (kp / SDK_QK) + b / 8]);
    }
}

static inline __attribute__((always_inline)) void q5_block(const int R, const uint8_t *tile, int nblk,
                                                           const sdk_act *a, int m, int b, float *acc) {
    q50_block(SDK_Q5_0, R, tile, nblk, a, m, b, acc);
}

static inline __attribute__((always_inline)) void q4_block(const int R, const uint8_t *tile, int nblk,
                                                           const sdk_act *a, int m, int b, float *acc) {
    q50_block(SDK_Q4_0, R, tile, nblk, a, m, b, acc);
}

static inline __attribute__((always_inline)) void q3_block(const int R, const uint8_t *tile, int nblk,
                                                           const sdk_act *a, int m, int b, float *acc) {
    q50_block(SDK_Q3_0, R, tile, nblk, a, m, b, acc);
}

/* Up to 6 rows through a tile's blocks of 32 (Q8_0, Q5_0, Q4_0, Q3_0: a draft model's decode steps and
 * verifications): each row's float sum stays in a register across the blocks (q50_block stores it
 * and loads it back every 32 inputs, a store-to-load wait per block and row), and a lone row's
 * products run as four chains of two. The same integers and the same float operations in the
 * same order: the same bits. */
static inline __attribute__((always_inline)) void blocks32_rows(const int type, const int R, const uint8_t *tile,
                                                                int nblk, const sdk_act *a, int m, float *acc) {
    const int five = type == SDK_Q5_0, eight = type == SDK_Q8_0, three = type == SDK_Q3_0;
    const long ints = eight ? SDK_Q8_INTS : five ? SDK_Q5_INTS : three ? SDK_Q3_INTS : SDK_Q4_INTS;
    const long recb = eight ? SDK_Q8_REC : five ? SDK_Q5_REC : three ? SDK_Q3_REC : SDK_Q4_REC;
    const int lines = eight ? 9 : five ? 6 : three ? 4 : 5, off = eight ? 128 : five ? 16 : three ? 4 : 8;
    const int chains = R == 1 ? 4 : R <= 4 ? 2 : 1; /* independent dot-product chains a row */
    const long pf = SDK_PF_SMALL(recb);
    const int kp = a->kp;
    const uint8_t *scales = tile + (size_t)nblk * ints;
    __m512 y[ROWS];
    UNROLL(8) for (int r = 0; r < R; r++) y[r] = _mm512_loadu_ps(acc + r * 16);
    for (int b = 0; b < nblk; b++) {
        const uint8_t *rec = tile + (size_t)b * ints;
        UNROLL(9) for (int i = 0; i < lines; i++) PF(tile + pf + (long)b * recb + i * 64);
        __m512i w[8];
        decode32(type, rec, w);
        __m512i s[ROWS][4];
        UNROLL(8) for (int r = 0; r < R; r++) UNROLL(4) for (int c = 0; c < chains; c++) s[r][c] = _mm512_setzero_si512();
        UNROLL(8) for (int g = 0; g < 8; g++)
            UNROLL(8) for (int r = 0; r < R; r++)
                s[r][g % chains] = dpb(s[r][g % chains], w[g], a->xq + (size_t)(m + r) * kp + b * 32 + g * 4);
        const __m512 d = h2f16(scales + (size_t)b * SDK_Q8_SCALES); /* every kind's: 32 bytes */
        UNROLL(8) for (int r = 0; r < R; r++) {
            const int32_t *xs = a->xs + (size_t)(m + r) * (kp / 16) + b * 2;
            __m512i t = s[r][0];
            if (chains == 4) t = _mm512_add_epi32(_mm512_add_epi32(s[r][0], s[r][1]), _mm512_add_epi32(s[r][2], s[r][3]));
            if (chains == 2) t = _mm512_add_epi32(s[r][0], s[r][1]);
            __m512i u = _mm512_sub_epi32(t, _mm512_set1_epi32(off * (xs[0] + xs[1])));
            if (sdk_fault && b == 0 && m + r == 0) u = _mm512_add_epi32(u, fault_lane());
            const __m512 av = _mm512_set1_ps(a->xa[(size_t)(m + r) * (kp / SDK_QK) + b / 8]);
            y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), _mm512_mul_ps(d, av), y[r]);
        }
    }
    UNROLL(8) for (int r = 0; r < R; r++) _mm512_storeu_ps(acc + r * 16, y[r]);
}

/* blocks32_rows for one kind and 1..6 rows */
#define SMALL_ROWS(T)                                                          \
    switch (rows) {                                                            \
    case 1: blocks32_rows(T, 1, rec, nblk, a, m0, acc); break;                 \
    case 2: blocks32_rows(T, 2, rec, nblk, a, m0, acc); break;                 \
    case 3: blocks32_rows(T, 3, rec, nblk, a, m0, acc); break;                 \
    case 4: blocks32_rows(T, 4, rec, nblk, a, m0, acc); break;                 \
    case 5: blocks32_rows(T, 5, rec, nblk, a, m0, acc); break;                 \
    default: blocks32_rows(T, 6, rec, nblk, a, m0, acc); break;                \
    }

/* rows in groups: of 4 while more than 6 are left, then the rest as one group (a verification
 * of 5 or 6 rows decodes each block once) */
#define GROUPS(fn)                                                                                   \
    for (int b = 0; b < nblk; b++) {                                                                         \
        int r = 0;                                                                                           \
        for (; rows - r > 6; r += 4) fn(4, rec, nblk, a, m0 + r, b, acc + r * 16);                                 \
        switch (rows - r) {                                                                                  \
        case 6: fn(6, rec, nblk, a, m0 + r, b, acc + r * 16); break;                                               \
        case 5: fn(5, rec, nblk, a, m0 + r, b, acc + r * 16); break;                                               \
        case 4: fn(4, rec, nblk, a, m0 + r, b, acc + r * 16); break;                                               \
        case 3: fn(3, rec, nblk, a, m0 + r, b, acc + r * 16); break;                                               \
        case 2: fn(2, rec, nblk, a, m0 + r, b, acc + r * 16); break;                                               \
        case 1: fn(1, rec, nblk, a, m0 + r, b, acc + r * 16); break;                                               \
        }                                                                                                    \
    }

void sdk_tile_avx512vnni(int type, const uint8_t *rec, int nblk, const sdk_act *a, int m0, int m1, float *acc,
                         uint8_t *scratch) {
    (void)scratch;
    const int rows = m1 - m0;
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(acc + r * 16, _mm512_setzero_ps());
    if (type == SDK_Q4K) {
        GROUPS(q4k_block)
    } else if (type == SDK_Q6K) {
        GROUPS(q6k_block)
    } else if (rows <= ROWS) { /* blocks of 32, 1-6 rows: each row's sum in a register */
        if (type == SDK_Q5_0) {
            SMALL_ROWS(SDK_Q5_0)
        } else if (type == SDK_Q4_0) {
            SMALL_ROWS(SDK_Q4_0)
        } else if (type == SDK_Q3_0) {
            SMALL_ROWS(SDK_Q3_0)
        } else {
            SMALL_ROWS(SDK_Q8_0)
        }
    } else if (type == SDK_Q5_0) {
        GROUPS(q5_block)
    } else if (type == SDK_Q4_0) {
        GROUPS(q4_block)
    } else if (type == SDK_Q3_0) {
        GROUPS(q3_block)
    } else {
        GROUPS(q8_block)
    }
}
