/* The 256-bit paths (included by sdk_avx2.c and sdk_avxvnni.c, which define SDK_TILE_FN and,
 * for AVX-VNNI, SDK_VNNI256): a tile's 16 columns are two ymm halves of 8. Without VNNI, 4-input
 * dot products are vpmaddubsw (pairs into int16) then vpmaddwd by ones (into int32); weight
 * bytes are at most 63 there (4- and 6-bit values), so no int16 pair saturates (63 x 127 x 2 <
 * 32767). Q8_0's bytes take the sign trick instead (|q| <= 128 against sign-moved codes). */
#include <immintrin.h>
#include <string.h>

#include "sdk.h"

static inline __m256i bcast4(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }

#if defined(SDK_VNNI256) && defined(SDK_EMULATE_VNNI256)
/* tests only (tests/test_kernels.py, the AddressSanitizer build): vpdpbusd's exact sums in AVX2,
 * so a CPU without AVX-VNNI checks this path's code against the reference (unsigned bytes of w,
 * signed bytes of x, products summed in int32 without saturation, as vpdpbusd does) */
static inline __m256i sdk_dpbusd(__m256i acc, __m256i w, __m256i x) {
    const __m256i even = _mm256_set1_epi16(0x00ff);
    __m256i we = _mm256_and_si256(w, even), wo = _mm256_srli_epi16(w, 8);
    __m256i xe = _mm256_srai_epi16(_mm256_slli_epi16(x, 8), 8), xo = _mm256_srai_epi16(x, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(we, xe), _mm256_madd_epi16(wo, xo)));
}
#define _mm256_dpbusd_avx_epi32 sdk_dpbusd
#endif

#ifdef SDK_VNNI256
static inline __m256i dot4(__m256i acc, __m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
#else
static inline __m256i dot4(__m256i acc, __m256i w, __m256i x) {
    const __m256i ones = _mm256_set1_epi16(1);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
}
#endif

/* The Q4_K and Q6_K row loops below are one code for both builds. A sub-block's partial sums:
 * AVX2 sums vpmaddubsw's int16 pairs as int16 (bounds at each use) and applies the scale with
 * vpmaddwd against (sc, sc) int16 pairs; AVX-VNNI sums with vpdpbusd into int32 and multiplies
 * by the int32 scale (vpmulld). Either way the reference's integers, exactly. */
#ifdef SDK_VNNI256
#define FIRST(w, x) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (w), (x))
#define ACC(s, w, x) _mm256_dpbusd_avx_epi32((s), (w), (x))
#define SCALE(s, sc) _mm256_mullo_epi32((s), (sc))
#define SCPAIR(v) (v)
#else
#define FIRST(w, x) _mm256_maddubs_epi16((w), (x))
#define ACC(s, w, x) _mm256_add_epi16((s), _mm256_maddubs_epi16((w), (x)))
#define SCALE(s, sc) _mm256_madd_epi16((s), (sc))
#define SCPAIR(v) _mm256_or_si256(_mm256_and_si256((v), _mm256_set1_epi32(0xffff)), _mm256_slli_epi32((v), 16))
#endif

#ifdef SDK_VNNI256
#define HI(i, h) u[i][h]
#else
#define HI(i, h) s[i][h]
#endif

/* pins a value to a register at this point. Without it GCC re-associates the int16 sums into a
 * tree (every product first, spilled to the stack) and loads a weight vector again for each row;
 * with it the pair loop runs 1.5x faster at 8 rows (benchmarks/NOTES.md) */
#define KEEP(v) __asm__("" : "+x"(v))

static inline __m256i fault_lane(void) { return _mm256_set_epi32(0, 0, 0, 0, 1, 0, 0, 0); }

#define LD(p) _mm256_loadu_si256((const __m256i *)(p))
/* software prefetch about one block ahead in the read stream (see sdk_avx512vnni.c) */
#define PF(p) SDK_PREFETCH(p, _MM_HINT_T0)
#define PF2(p) SDK_PREFETCH(p, _MM_HINT_T1)
/* Q6_K's lines: to L2, or to L1 where that was timed faster (sdk_pf_q6_l1; a Zen 5 EPYC, forced
 * AVX2: the 1.5B's Q6_K head and down 6-11% faster at one row, 5-7% at five) */
#define PF6(p)                      \
    do {                            \
        if (sdk_pf_q6_l1)           \
            PF(p);                  \
        else                        \
            PF2(p);                 \
    } while (0)

/* up to this many rows a call, Q4_K and Q6_K decode each load in registers for every row pair
 * (q4k_direct, q6k_direct); above it, once a block into the scratch for all rows. AVX-VNNI: 4
 * and 2 (measured on Zen 4 forced onto AVX2, where four rows in registers timed level with the
 * scratch); AVX2: 8 and 4, measured on an AVX2-only Zen 3 EPYC (a target-shaped mix of Q4_K and
 * Q6_K, interleaved: 5 rows 10-20% faster, 3-4 rows 5-10%, 12 rows slower at 16 / 4;
 * benchmarks/NOTES.md, issue 53, eighteenth session) */
#ifdef SDK_VNNI256
#define SDK_DIRECT_Q4K 4
#define SDK_DIRECT_Q6K 2
#else
#define SDK_DIRECT_Q4K 8
#define SDK_DIRECT_Q6K 4
#endif

/* Rows go in pairs against both halves of the decoded block: each weight vector is
 * loaded once for two rows and each broadcast activation once for both halves (one row at a
 * time needs two loads a vpmaddubsw, a pair one). A row's integer sums are the same operations
 * whichever its partner, so its bits do not depend on the pairing. */
static inline __attribute__((always_inline)) void q4k_rows(const __m256i *w, const __m256i *sc, const __m256i *mn,
                                                           const __m256 *d, const __m256 *dmin, const sdk_act *a,
                                                           int b, int m0, int r, int nr, float *acc) {
    const int kp = a->kp, nsb = kp / SDK_QK;
    const int8_t *x[2];
    __m256i isum[2][2];
    for (int i = 0; i < nr; i++) {
        x[i] = a->xq + (size_t)(m0 + r + i) * kp + b * 256;
        isum[i][0] = isum[i][1] = _mm256_setzero_si256();
    }
    for (int j = 0; j < 8; j++) {
        /* the sub-block's int16 pairs summed as int16 (8 x 2 x 15 x 127 = 30480: no overflow),
         * then one vpmaddwd applies the scale */
        __m256i s[2][2];
        for (int i = 0; i < nr; i++) s[i][0] = s[i][1] = _mm256_setzero_si256();
        for (int g = 0; g < 8; g++) {
            __m256i w0 = w[(j * 8 + g) * 2], w1 = w[(j * 8 + g) * 2 + 1];
            KEEP(w0);
            KEEP(w1);
            for (int i = 0; i < nr; i++) {
                __m256i xb = bcast4(x[i] + j * 32 + g * 4);
                s[i][0] = ACC(s[i][0], w0, xb);
                s[i][1] = ACC(s[i][1], w1, xb);
                KEEP(s[i][0]);
                KEEP(s[i][1]);
            }
        }
        for (int i = 0; i < nr; i++)
            for (int h = 0; h < 2; h++) isum[i][h] = _mm256_add_epi32(isum[i][h], SCALE(s[i][h], sc[j * 2 + h]));
    }
    for (int i = 0; i < nr; i++) {
        const int32_t *xp = a->xp + (size_t)(m0 + r + i) * (kp / 64) + b * 4;
        __m256 av = _mm256_set1_ps(a->xa[(size_t)(m0 + r + i) * nsb + b]);
        for (int h = 0; h < 2; h++) {
            __m256i imin = _mm256_setzero_si256();
            for (int q = 0; q < 4; q++) imin = _mm256_add_epi32(imin, _mm256_madd_epi16(mn[q * 2 + h], _mm256_set1_epi32(xp[q])));
            if (sdk_fault && b == 0 && r + i == 0 && h == 0) isum[i][h] = _mm256_add_epi32(isum[i][h], fault_lane());
            float *o = acc + (r + i) * 16 + h * 8;
            __m256 y = _mm256_loadu_ps(o);
            y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][h]), _mm256_mul_ps(d[h], av), y);
            y = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(dmin[h], av), y);
            _mm256_storeu_ps(o, y);
        }
    }
}

/* Q4_K for one or two rows straight from the record: each 32-byte load splits into its low and
 * high nibbles in registers and goes into the rows at once, with no pass through the scratch
 * (stores and loads that a one-row step cannot pay back). The int16 sums take the same terms in
 * another order: every partial sum is at most 8 x 3810 = 30480, so they are the same integers. */
static inline __attribute__((always_inline)) void q4k_direct(const uint8_t *rec, const sdk_act *a, int b, int m0,
                                                             int r, int nr, float *acc, long pf) {
    const int kp = a->kp, nsb = kp / SDK_QK;
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const int8_t *x[2];
    __m256i isum[2][2];
    for (int i = 0; i < nr; i++) {
        x[i] = a->xq + (size_t)(m0 + r + i) * kp + b * 256;
        isum[i][0] = isum[i][1] = _mm256_setzero_si256();
    }
    for (int j = 0; j < 8; j++) {
        __m256i s[2][2], u[2][2]; /* u: VNNI's high nibbles, a second chain (vpdpbusd's latency) */
        for (int i = 0; i < nr; i++) s[i][0] = s[i][1] = u[i][0] = u[i][1] = _mm256_setzero_si256();
        for (int g = 0; g < 4; g++) {
            const uint8_t *p = rec + (j * 4 + g) * 64;
            PF(p + pf + (j == 7 ? 256 : 0));
            __m256i v0 = LD(p), v1 = LD(p + 32);
            __m256i lo0 = _mm256_and_si256(v0, low4), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
            __m256i lo1 = _mm256_and_si256(v1, low4), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
            for (int i = 0; i < nr; i++) {
                __m256i xl = bcast4(x[i] + j * 32 + g * 4), xh = bcast4(x[i] + j * 32 + (g + 4) * 4);
                s[i][0] = ACC(s[i][0], lo0, xl);
                s[i][1] = ACC(s[i][1], lo1, xl);
                KEEP(s[i][0]);
                KEEP(s[i][1]);
                HI(i, 0) = ACC(HI(i, 0), hi0, xh);
                HI(i, 1) = ACC(HI(i, 1), hi1, xh);
                KEEP(HI(i, 0));
                KEEP(HI(i, 1));
            }
        }
#ifdef SDK_VNNI256
        for (int i = 0; i < nr; i++)
            for (int h = 0; h < 2; h++) s[i][h] = _mm256_add_epi32(s[i][h], u[i][h]);
#else
        (void)u;
#endif
        for (int h = 0; h < 2; h++) {
            __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(rec + 2048 + j * 16 + h * 8)));
            sc = SCPAIR(sc); /* AVX2: (sc, sc) int16 pairs */
            for (int i = 0; i < nr; i++) isum[i][h] = _mm256_add_epi32(isum[i][h], SCALE(s[i][h], sc));
        }
    }
    for (int i = 0; i < nr; i++) {
        const int32_t *xp = a->xp + (size_t)(m0 + r + i) * (kp / 64) + b * 4;
        __m256 av = _mm256_set1_ps(a->xa[(size_t)(m0 + r + i) * nsb + b]);
        for (int h = 0; h < 2; h++) {
            __m256i imin = _mm256_setzero_si256();
            for (int q = 0; q < 4; q++) {
                __m256i mn = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(rec + 2176 + q * 32 + h * 16)));
                imin = _mm256_add_epi32(imin, _mm256_madd_epi16(mn, _mm256_set1_epi32(xp[q])));
            }
            if (sdk_fault && b == 0 && r + i == 0 && h == 0) isum[i][h] = _mm256_add_epi32(isum[i][h], fault_lane());
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 2304 + h * 16)));
            __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 2336 + h * 16)));
            float *o = acc + (r + i) * 16 + h * 8;
            __m256 y = _mm256_loadu_ps(o);
            y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][h]), _mm256_mul_ps(d, av), y);
            y = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(dmin, av), y);
            _mm256_storeu_ps(o, y);
        }
    }
}

/* Q6_K for one or two rows straight from the record (see q4k_direct): chunk j's 32-byte loads
 * become sub-blocks 2j and 2j + 1 in registers; the same integer terms as q6k_rows, summed two
 * products at a time into int16 (at most 32004), each such sum times its scale by vpmaddwd. */
static inline __attribute__((always_inline)) void q6k_direct(const uint8_t *rec, const sdk_act *a, int b, int m0,
                                                             int r, int nr, float *acc, long pf) {
    const int kp = a->kp, nsb = kp / SDK_QK;
    const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
    const uint8_t *scales = rec + SDK_Q6K_INTS;
    const int8_t *x[2];
    __m256i isum[2][2];
    for (int i = 0; i < nr; i++) {
        x[i] = a->xq + (size_t)(m0 + r + i) * kp + b * 256;
        isum[i][0] = isum[i][1] = _mm256_setzero_si256();
    }
    for (int j = 0; j < 8; j++) {
        const uint8_t *chunk = rec + j * 384;
        for (int l = 0; l < 6; l++) PF6(chunk + pf + l * 64);
        if (j < 5) PF6(scales + pf + j * 64);
        /* the scales of sub-blocks 2j (even) and 2j + 1 (odd) per column, as (sc, sc) int16 pairs */
        __m256i sce[2], sco[2];
        for (int h = 0; h < 2; h++) {
            __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(scales + j * 32 + h * 16)));
            __m256i e = _mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16), o = _mm256_srai_epi32(v, 16);
            sce[h] = SCPAIR(e);
            sco[h] = SCPAIR(o);
        }
        for (int g = 0; g < 4; g += 2) {
            __m256i te[2][2], to[2][2]; /* [row][half]: sub-block 2j, 2j + 1 */
            for (int gg = g; gg < g + 2; gg++) {
                __m256i we[2], wo[2];
                for (int h = 0; h < 2; h++) {
                    __m256i v = LD(chunk + gg * 64 + h * 32);
                    __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(LD(chunk + 256 + h * 32), 2 * gg), low2);
                    __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(LD(chunk + 320 + h * 32), 2 * gg), low2);
                    we[h] = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_slli_epi16(b0, 4));
                    wo[h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), _mm256_slli_epi16(b1, 4));
                }
                for (int i = 0; i < nr; i++) {
                    __m256i xe = bcast4(x[i] + j * 32 + gg * 4), xo = bcast4(x[i] + j * 32 + 16 + gg * 4);
                    for (int h = 0; h < 2; h++) {
                        te[i][h] = gg == g ? FIRST(we[h], xe) : ACC(te[i][h], we[h], xe);
                        to[i][h] = gg == g ? FIRST(wo[h], xo) : ACC(to[i][h], wo[h], xo);
                    }
                }
            }
            for (int i = 0; i < nr; i++)
                for (int h = 0; h < 2; h++) {
                    isum[i][h] = _mm256_add_epi32(isum[i][h], SCALE(te[i][h], sce[h]));
                    isum[i][h] = _mm256_add_epi32(isum[i][h], SCALE(to[i][h], sco[h]));
                }
        }
    }
    for (int i = 0; i < nr; i++) {
        const int32_t *xw = a->xw + (size_t)(m0 + r + i) * (kp / 32) + b * 8;
        __m256 av = _mm256_set1_ps(a->xa[(size_t)(m0 + r + i) * nsb + b]);
        for (int h = 0; h < 2; h++) {
            __m256i off = _mm256_setzero_si256();
            for (int p = 0; p < 8; p++) {
                __m256i pr = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(scales + p * 32 + h * 16)));
                off = _mm256_add_epi32(off, _mm256_madd_epi16(pr, _mm256_set1_epi32(xw[p])));
            }
            __m256i v = _mm256_sub_epi32(isum[i][h], _mm256_slli_epi32(off, 5));
            if (sdk_fault && b == 0 && r + i == 0 && h == 0) v = _mm256_add_epi32(v, fault_lane());
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 256 + h * 16)));
            float *o = acc + (r + i) * 16 + h * 8;
            __m256 y = _mm256_loadu_ps(o);
            y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(d, av), y);
            _mm256_storeu_ps(o, y);
        }
    }
}

/* Q6_K the same way. pr: the scales as stored, (sc[2p], sc[2p + 1]) int16 pairs per column, so
 * the offset 32 x sum(sc x xs) takes one vpmaddwd per 32 inputs against xw's pairs. */
static inline __attribute__((always_inline)) void q6k_rows(const __m256i *w, const __m256i *sc, const __m256i *pr,
                                                           const __m256 *d, const sdk_act *a, int b, int m0, int r,
                                                           int nr, float *acc) {
    const int kp = a->kp, nsb = kp / SDK_QK;
    const int8_t *x[2];
    __m256i isum[2][2];
    for (int i = 0; i < nr; i++) {
        x[i] = a->xq + (size_t)(m0 + r + i) * kp + b * 256;
        isum[i][0] = isum[i][1] = _mm256_setzero_si256();
    }
    for (int s = 0; s < 16; s++)
        for (int g = 0; g < 4; g += 2) {
            /* two int16 pairs summed as int16 (2 x 2 x 63 x 127 = 32004: no overflow), the sum
             * times the scale by vpmaddwd */
            const __m256i *ws = w + (s * 4 + g) * 2;
            __m256i w00 = ws[0], w01 = ws[1], w10 = ws[2], w11 = ws[3];
            KEEP(w00);
            KEEP(w01);
            KEEP(w10);
            KEEP(w11);
            for (int i = 0; i < nr; i++) {
                __m256i x0 = bcast4(x[i] + s * 16 + g * 4), x1 = bcast4(x[i] + s * 16 + g * 4 + 4);
                __m256i t0 = ACC(FIRST(w00, x0), w10, x1);
                __m256i t1 = ACC(FIRST(w01, x0), w11, x1);
                isum[i][0] = _mm256_add_epi32(isum[i][0], SCALE(t0, sc[s * 2]));
                isum[i][1] = _mm256_add_epi32(isum[i][1], SCALE(t1, sc[s * 2 + 1]));
                KEEP(isum[i][0]);
                KEEP(isum[i][1]);
            }
        }
    for (int i = 0; i < nr; i++) {
        const int32_t *xw = a->xw + (size_t)(m0 + r + i) * (kp / 32) + b * 8;
        __m256 av = _mm256_set1_ps(a->xa[(size_t)(m0 + r + i) * nsb + b]);
        for (int h = 0; h < 2; h++) {
            __m256i off = _mm256_setzero_si256();
            for (int p = 0; p < 8; p++) off = _mm256_add_epi32(off, _mm256_madd_epi16(pr[p * 2 + h], _mm256_set1_epi32(xw[p])));
            __m256i v = _mm256_sub_epi32(isum[i][h], _mm256_slli_epi32(off, 5));
            if (sdk_fault && b == 0 && r + i == 0 && h == 0) v = _mm256_add_epi32(v, fault_lane());
            float *o = acc + (r + i) * 16 + h * 8;
            __m256 y = _mm256_loadu_ps(o);
            y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(d[h], av), y);
            _mm256_storeu_ps(o, y);
        }
    }
}

/* up to this many rows a call, the blocks of 32 (Q8_0, Q5_0, Q4_0, Q3_0) run b32_direct: on an
 * AVX2-only Zen 3 EPYC the one-row loop below it (16 decoded vectors held across the rows:
 * spilled, as AVX2 has 16 registers, with every format's decode in one runtime-branched body) ran
 * ~85 cycles a block of 16 columns, compute-bound at 20 GB/s with the weights in L3 as in memory */
#define SDK_DIRECT_B32 4

/* A tile of blocks of 32 for rows r, r + 1 (nr of them) straight from the records, type a
 * constant where it is inlined: each 32-byte load decodes in registers and goes into both rows
 * at once, and the rows' sums stay in registers across the tile's blocks (one load and one store
 * of acc a tile, not a block). The same integer terms as the loop in SDK_TILE_FN, grouped the same
 * way (AVX2: the four products of each half-block summed as int16, then by ones into int32), and
 * the same float operations in the same block order: the same bits. */
static inline __attribute__((always_inline)) void b32_direct(const int type, const uint8_t *tile, int nblk,
                                                             const sdk_act *a, int m0, int r, int nr, float *acc,
                                                             long pf) {
    const int kp = a->kp, nsb = kp / SDK_QK, n16 = kp / 16;
    const int five = type == SDK_Q5_0, three = type == SDK_Q3_0, eight = type == SDK_Q8_0;
    const int off = five ? 16 : three ? 4 : 8;
    const long ints = eight ? SDK_Q8_INTS : five ? SDK_Q5_INTS : three ? SDK_Q3_INTS : SDK_Q4_INTS;
    const long recb = eight ? SDK_Q8_REC : five ? SDK_Q5_REC : three ? SDK_Q3_REC : SDK_Q4_REC;
    const int lines = eight ? 9 : five ? 6 : three ? 4 : 5;
    const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
    const __m256i bit4 = _mm256_set1_epi8(0x10), bit2 = _mm256_set1_epi8(0x04);
#ifndef SDK_VNNI256
    const __m256i ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi8((char)0x80);
#endif
    __m256 y[2][2];
    for (int i = 0; i < nr; i++)
        for (int h = 0; h < 2; h++) y[i][h] = _mm256_loadu_ps(acc + (r + i) * 16 + h * 8);
    const uint8_t *rec = tile;
    for (int b = 0; b < nblk; b++, rec += ints) {
        const uint8_t *scales = tile + (size_t)nblk * ints + (size_t)b * 32;
        if (r == 0)
            for (int l = 0; l < lines; l++) PF(tile + pf + (long)b * recb + l * 64); /* one stream a tile */
        const int8_t *x[2];
        for (int i = 0; i < nr; i++) x[i] = a->xq + (size_t)(m0 + r + i) * kp + b * 32;
        for (int h = 0; h < 2; h++) {
            __m256i t0[2], t1[2]; /* [row]: inputs 0..15 and 16..31 (VNNI: one int32 sum in t0) */
            for (int i = 0; i < nr; i++) t0[i] = t1[i] = _mm256_setzero_si256();
            if (eight) {
                for (int g = 0; g < 8; g++) {
                    __m256i u = LD(rec + g * 64 + h * 32);
#ifdef SDK_VNNI256
                    for (int i = 0; i < nr; i++) t0[i] = dot4(t0[i], u, bcast4(x[i] + g * 4));
#else
                    __m256i q = _mm256_xor_si256(u, bias), v = _mm256_abs_epi8(q);
                    for (int i = 0; i < nr; i++) t0[i] = dot4(t0[i], v, _mm256_sign_epi8(bcast4(x[i] + g * 4), q));
#endif
                }
            } else {
                __m256i pl = five || three ? LD(rec + (three ? 128 : 256) + h * 32) : _mm256_setzero_si256();
                for (int g = 0; g < 4; g++) {
                    __m256i lo, hi; /* the values of inputs 4g.. and 16 + 4g.. */
                    if (three) {
                        __m256i u0 = _mm256_srli_epi16(LD(rec + h * 32), 2 * g), u1 = _mm256_srli_epi16(LD(rec + 64 + h * 32), 2 * g);
                        __m256i b0 = g < 2 ? _mm256_slli_epi16(pl, 2 - g) : _mm256_srli_epi16(pl, g - 2);
                        __m256i b1 = _mm256_srli_epi16(pl, g + 2);
                        lo = _mm256_or_si256(_mm256_and_si256(u0, low2), _mm256_and_si256(b0, bit2));
                        hi = _mm256_or_si256(_mm256_and_si256(u1, low2), _mm256_and_si256(b1, bit2));
                    } else {
                        __m256i u = LD(rec + g * 64 + h * 32);
                        lo = _mm256_and_si256(u, low4);
                        hi = _mm256_and_si256(_mm256_srli_epi16(u, 4), low4);
                        if (five) {
                            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(pl, 4 - g), bit4));
                            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(pl, g), bit4));
                        }
                    }
                    for (int i = 0; i < nr; i++) {
#ifdef SDK_VNNI256
                        t0[i] = dot4(t0[i], lo, bcast4(x[i] + g * 4));
                        t1[i] = dot4(t1[i], hi, bcast4(x[i] + 16 + g * 4));
#else
                        /* four int16 pairs summed as int16 (4 x 2 x 31 x 127 = 31496: no overflow) */
                        t0[i] = _mm256_add_epi16(t0[i], _mm256_maddubs_epi16(lo, bcast4(x[i] + g * 4)));
                        t1[i] = _mm256_add_epi16(t1[i], _mm256_maddubs_epi16(hi, bcast4(x[i] + 16 + g * 4)));
#endif
                        KEEP(t0[i]);
                        KEEP(t1[i]);
                    }
                }
            }
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + h * 16)));
            for (int i = 0; i < nr; i++) {
                __m256i s;
#ifdef SDK_VNNI256
                s = eight ? t0[i] : _mm256_add_epi32(t0[i], t1[i]);
                const int32_t *xs = a->xs + (size_t)(m0 + r + i) * n16 + b * 2;
                s = _mm256_sub_epi32(s, _mm256_set1_epi32((eight ? 128 : off) * (xs[0] + xs[1])));
#else
                if (eight) {
                    s = t0[i];
                } else {
                    const int32_t *xs = a->xs + (size_t)(m0 + r + i) * n16 + b * 2;
                    s = _mm256_add_epi32(_mm256_madd_epi16(t0[i], ones), _mm256_madd_epi16(t1[i], ones));
                    s = _mm256_sub_epi32(s, _mm256_set1_epi32(off * (xs[0] + xs[1])));
                }
#endif
                if (sdk_fault && b == 0 && r + i == 0 && h == 0) s = _mm256_add_epi32(s, fault_lane());
                __m256 av = _mm256_set1_ps(a->xa[(size_t)(m0 + r + i) * nsb + b / 8]);
                y[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, av), y[i][h]);
            }
        }
    }
    for (int i = 0; i < nr; i++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(acc + (r + i) * 16 + h * 8, y[i][h]);
}

/* b32_direct over the call's rows in pairs, with `type` a constant in each instance */
static inline __attribute__((always_inline)) void b32_rows(const int type, const uint8_t *tile, int nblk, const sdk_act *a, int m0, int rows, float *acc,
                     long pf) {
    int r = 0;
    for (; r + 2 <= rows; r += 2) b32_direct(type, tile, nblk, a, m0, r, 2, acc, pf);
    if (r < rows) b32_direct(type, tile, nblk, a, m0, r, 1, acc, pf);
}

void SDK_TILE_FN(int type, const uint8_t *rec, int nblk, const sdk_act *a, int m0, int m1, float *acc,
                 uint8_t *scratch) {
    const int kp = a->kp, nsb = kp / SDK_QK, n16 = kp / 16, rows = m1 - m0;
    __m256i *w = (__m256i *)scratch; /* [64 vectors][2 halves] */
    __m256i *sc = w + 128, *mn = w + 160, *pr = w + 168;
    const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
    /* how far ahead the reads prefetch (sdk_avx512vnni.c: one record for one row, else the timed
     * distance; Q5_0 and Q8_0 four records, or 8 x the distance when it is above one) */
    const long pf4 = rows == 1 ? (long)sdk_pf_one * SDK_Q4K_REC : (long)sdk_pf_blocks * SDK_Q4K_REC;
    const long pf6 = rows == 1 ? (long)sdk_pf_one * SDK_Q6K_REC : (long)sdk_pf_blocks * SDK_Q6K_REC;
    const long pf5 = SDK_PF_SMALL(SDK_Q5_REC);
    const long pf8 = SDK_PF_SMALL(SDK_Q8_REC);
    for (int r = 0; r < rows * 2; r++) _mm256_storeu_ps(acc + r * 8, _mm256_setzero_ps());
    if (type == SDK_Q4K) {
        if (rows <= SDK_DIRECT_Q4K) {
            for (int b = 0; b < nblk; b++, rec += SDK_Q4K_REC) {
                int r = 0;
                for (; r + 2 <= rows; r += 2) q4k_direct(rec, a, b, m0, r, 2, acc, pf4);
                if (r < rows) q4k_direct(rec, a, b, m0, r, 1, acc, pf4);
            }
            return;
        }
        for (int b = 0; b < nblk; b++, rec += SDK_Q4K_REC) {
            for (int j = 0; j < 8; j++) {
                for (int i = 0; i < 4; i++)
                    for (int h = 0; h < 2; h++) {
                        __m256i v = LD(rec + (j * 4 + i) * 64 + h * 32);
                        if (!h) PF(rec + pf4 + (j * 4 + i) * 64 + (j == 7 ? 256 : 0));
                        w[(j * 8 + i) * 2 + h] = _mm256_and_si256(v, low4);
                        w[(j * 8 + i + 4) * 2 + h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                    }
                for (int h = 0; h < 2; h++) {
                    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(rec + 2048 + j * 16 + h * 8)));
                    sc[j * 2 + h] = SCPAIR(v); /* AVX2: (sc, sc) int16 pairs */
                }
            }
            for (int q = 0; q < 4; q++) /* minimums as (2q, 2q + 1) int16 pairs per column */
                for (int h = 0; h < 2; h++)
                    mn[q * 2 + h] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(rec + 2176 + q * 32 + h * 16)));
            __m256 d[2], dmin[2];
            for (int h = 0; h < 2; h++) {
                d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 2304 + h * 16)));
                dmin[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 2336 + h * 16)));
            }
            int r = 0;
            for (; r + 2 <= rows; r += 2) q4k_rows(w, sc, mn, d, dmin, a, b, m0, r, 2, acc);
            if (r < rows) q4k_rows(w, sc, mn, d, dmin, a, b, m0, r, 1, acc);
        }
    } else if (type == SDK_Q6K) {
        if (rows <= SDK_DIRECT_Q6K) {
            for (int b = 0; b < nblk; b++, rec += SDK_Q6K_REC) {
                int r = 0;
                for (; r + 2 <= rows; r += 2) q6k_direct(rec, a, b, m0, r, 2, acc, pf6);
                if (r < rows) q6k_direct(rec, a, b, m0, r, 1, acc, pf6);
            }
            return;
        }
        for (int b = 0; b < nblk; b++, rec += SDK_Q6K_REC) {
            const uint8_t *scales = rec + SDK_Q6K_INTS;
            for (int j = 0; j < 8; j++)
                for (int h = 0; h < 2; h++) {
                    const uint8_t *chunk = rec + j * 384;
                    __m256i h0 = LD(chunk + 256 + h * 32);
                    __m256i h1 = LD(chunk + 320 + h * 32);
                    if (!h) {
                        for (int l = 0; l < 6; l++) PF6(chunk + pf6 + l * 64);
                        if (j < 5) PF6(scales + pf6 + j * 64);
                    }
                    for (int i = 0; i < 4; i++) {
                        __m256i v = LD(chunk + i * 64 + h * 32);
                        __m256i lo = _mm256_and_si256(v, low4);
                        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                        __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(h0, 2 * i), low2);
                        __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(h1, 2 * i), low2);
                        w[(j * 8 + i) * 2 + h] = _mm256_or_si256(lo, _mm256_slli_epi16(b0, 4));
                        w[(j * 8 + i + 4) * 2 + h] = _mm256_or_si256(hi, _mm256_slli_epi16(b1, 4));
                    }
                }
            for (int s = 0; s < 16; s++)
                for (int h = 0; h < 2; h++) {
                    /* columns h * 8.. of sub-block s: every second byte from the pairs */
                    __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(scales + (s / 2) * 32 + h * 16)));
                    if (!(s & 1)) pr[(s / 2) * 2 + h] = v;
                    v = (s & 1) ? _mm256_srai_epi32(v, 16) : _mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16);
                    sc[s * 2 + h] = SCPAIR(v); /* AVX2: (sc, sc) int16 pairs */
                }
            __m256 d[2];
            for (int h = 0; h < 2; h++) d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 256 + h * 16)));
            int r = 0;
            for (; r + 2 <= rows; r += 2) q6k_rows(w, sc, pr, d, a, b, m0, r, 2, acc);
            if (r < rows) q6k_rows(w, sc, pr, d, a, b, m0, r, 1, acc);
        }
    } else if (type == SDK_Q5_0 || type == SDK_Q4_0 || type == SDK_Q3_0) {
        /* Q4_0: Q5_0's nibbles without the plane, values 0..15 for q + 8; Q3_0: 2-bit values and
         * the plane's third bit, 0..7 for q + 4 */
        const int five = type == SDK_Q5_0, three = type == SDK_Q3_0, off = five ? 16 : three ? 4 : 8;
        const long ints = five ? SDK_Q5_INTS : three ? SDK_Q3_INTS : SDK_Q4_INTS;
        const long recb = five ? SDK_Q5_REC : three ? SDK_Q3_REC : SDK_Q4_REC;
        const long pf50 = five ? pf5 : SDK_PF_SMALL(recb);
        const __m256i bit4 = _mm256_set1_epi8(0x10), bit2 = _mm256_set1_epi8(0x04);
        const uint8_t *tile = rec;
        if (rows <= SDK_DIRECT_B32) {
            if (five)
                b32_rows(SDK_Q5_0, tile, nblk, a, m0, rows, acc, pf50);
            else if (three)
                b32_rows(SDK_Q3_0, tile, nblk, a, m0, rows, acc, pf50);
            else
                b32_rows(SDK_Q4_0, tile, nblk, a, m0, rows, acc, pf50);
            return;
        }
        for (int b = 0; b < nblk; b++, rec += ints) {
            const uint8_t *scales = tile + (size_t)nblk * ints + (size_t)b * SDK_Q5_SCALES;
            for (int i = 0; i < (five ? 6 : three ? 4 : 5); i++) PF(tile + pf50 + (long)b * recb + i * 64); /* sdk_avx512vnni.c */
            __m256i v[16]; /* values 0..31 (q + 16): the nibbles and the plane's fifth bit (Q4_0: 0..15, Q3_0: 0..7) */
            if (three) {
                for (int h = 0; h < 2; h++) {
                    __m256i pl = LD(rec + 128 + h * 32);
                    for (int g = 0; g < 8; g++) {
                        __m256i u = _mm256_srli_epi16(LD(rec + (g / 4) * 64 + h * 32), 2 * (g % 4));
                        __m256i hb = g < 2 ? _mm256_slli_epi16(pl, 2 - g) : _mm256_srli_epi16(pl, g - 2);
                        v[g * 2 + h] = _mm256_or_si256(_mm256_and_si256(u, low2), _mm256_and_si256(hb, bit2));
                    }
                }
            } else {
                for (int h = 0; h < 2; h++) {
                    __m256i pl = five ? LD(rec + 256 + h * 32) : _mm256_setzero_si256();
                    for (int i = 0; i < 4; i++) {
                        __m256i u = LD(rec + i * 64 + h * 32);
                        __m256i b0 = _mm256_and_si256(_mm256_slli_epi16(pl, 4 - i), bit4);
                        __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(pl, i), bit4);
                        v[i * 2 + h] = _mm256_or_si256(_mm256_and_si256(u, low4), b0);
                        v[(i + 4) * 2 + h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(u, 4), low4), b1);
                    }
                }
            }
            __m256 d[2];
            for (int h = 0; h < 2; h++) d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + h * 16)));
            for (int r = 0; r < rows; r++) {
                const int8_t *x = a->xq + (size_t)(m0 + r) * kp + b * 32;
                const int32_t *xs = a->xs + (size_t)(m0 + r) * n16 + b * 2;
                __m256 av = _mm256_set1_ps(a->xa[(size_t)(m0 + r) * nsb + b / 8]);
                for (int h = 0; h < 2; h++) {
#ifdef SDK_VNNI256
                    __m256i s = _mm256_setzero_si256();
                    for (int g = 0; g < 8; g++) s = dot4(s, v[g * 2 + h], bcast4(x + g * 4));
#else
                    /* four int16 pairs summed as int16 (4 x 2 x 31 x 127 = 31496: no overflow) */
                    const __m256i ones = _mm256_set1_epi16(1);
                    __m256i t0 = _mm256_setzero_si256(), t1 = _mm256_setzero_si256();
                    for (int g = 0; g < 4; g++) {
                        t0 = _mm256_add_epi16(t0, _mm256_maddubs_epi16(v[g * 2 + h], bcast4(x + g * 4)));
                        t1 = _mm256_add_epi16(t1, _mm256_maddubs_epi16(v[(g + 4) * 2 + h], bcast4(x + 16 + g * 4)));
                    }
                    __m256i s = _mm256_madd_epi16(t0, ones);
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(t1, ones));
#endif
                    s = _mm256_sub_epi32(s, _mm256_set1_epi32(off * (xs[0] + xs[1])));
                    if (sdk_fault && b == 0 && r == 0 && h == 0) s = _mm256_add_epi32(s, fault_lane());
                    __m256 y = _mm256_loadu_ps(acc + r * 16 + h * 8);
                    y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d[h], av), y);
                    _mm256_storeu_ps(acc + r * 16 + h * 8, y);
                }
            }
        }
    } else {
        const __m256i bias = _mm256_set1_epi8((char)0x80);
        const uint8_t *tile = rec;
        if (rows <= SDK_DIRECT_B32) {
            b32_rows(SDK_Q8_0, tile, nblk, a, m0, rows, acc, pf8);
            return;
        }
        for (int b = 0; b < nblk; b++, rec += SDK_Q8_INTS) {
            const uint8_t *scales = tile + (size_t)nblk * SDK_Q8_INTS + (size_t)b * SDK_Q8_SCALES;
            for (int i = 0; i < 9; i++) PF(tile + pf8 + (long)b * SDK_Q8_REC + i * 64);
            __m256i v[16]; /* VNNI: q + 128 as stored; else |q| here and q at v + 8 .. */
            __m256i sg[16];
            for (int g = 0; g < 8; g++)
                for (int h = 0; h < 2; h++) {
                    __m256i u = LD(rec + g * 64 + h * 32);
#ifdef SDK_VNNI256
                    v[g * 2 + h] = u;
                    sg[g * 2 + h] = u;
#else
                    __m256i q = _mm256_xor_si256(u, bias);
                    v[g * 2 + h] = _mm256_abs_epi8(q);
                    sg[g * 2 + h] = q;
#endif
                }
            __m256 d[2];
            for (int h = 0; h < 2; h++) d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + h * 16)));
            for (int r = 0; r < rows; r++) {
                const int8_t *x = a->xq + (size_t)(m0 + r) * kp + b * 32;
                const int32_t *xs = a->xs + (size_t)(m0 + r) * n16 + b * 2;
                __m256 av = _mm256_set1_ps(a->xa[(size_t)(m0 + r) * nsb + b / 8]);
                for (int h = 0; h < 2; h++) {
                    __m256i s = _mm256_setzero_si256();
                    for (int g = 0; g < 8; g++) {
#ifdef SDK_VNNI256
                        s = dot4(s, v[g * 2 + h], bcast4(x + g * 4));
#else
                        s = dot4(s, v[g * 2 + h], _mm256_sign_epi8(bcast4(x + g * 4), sg[g * 2 + h]));
#endif
                    }
#ifdef SDK_VNNI256
                    s = _mm256_sub_epi32(s, _mm256_set1_epi32(128 * (xs[0] + xs[1])));
#else
                    (void)xs;
#endif
                    if (sdk_fault && b == 0 && r == 0 && h == 0) s = _mm256_add_epi32(s, fault_lane());
                    __m256 y = _mm256_loadu_ps(acc + r * 16 + h * 8);
                    y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d[h], av), y);
                    _mm256_storeu_ps(acc + r * 16 + h * 8, y);
                }
            }
        }
    }
}
