/* AMX-int8 path (Intel Xeon from Sapphire Rapids): one tile multiply (tdpbsud: signed activation
 * codes x unsigned weight values, int32 sums) takes up to 16 rows x 16 columns x 64 inputs, in
 * about the time of 8 AVX-512 dot products. A weight record is decoded once into a scratch buffer
 * in the tile layout (4 inputs x 16 columns a 64-byte row: the layout the VNNI path keeps in its
 * registers) and multiplied into every row of the call, 16 rows a tile; the sums of each sub-block
 * (or block) leave the tile as int32 and take the VNNI path's integer epilogue (sub-block scales,
 * minimums, offsets) and its float epilogue, in the same order. The integer sums are exact, so the
 * bits are the reference's whatever the row count.
 *
 * From more rows Q4_K folds its sub-block scales into the weights instead (q4k_fold), and Q6_K
 * always does on the tiles (q6k_fold).
 *
 * A tile multiply costs the same for 1..8 rows and about 1.7x that for 16 (measured on the AMX
 * Xeon); calls of fewer than sdk_amx_min_rows rows take the AVX-512 VNNI path (the same bits;
 * kernels.amx_rows times where AMX and the fold start to pay). The tiles' shape is set once per
 * thread and product (ldtilecfg, ~130 cycles) and released at the product's end
 * (sdk_amx_release). */
#include <immintrin.h>
#include <string.h>

#include "sdk.h"

/* the thresholds: [0] Q4_K and the blocks of 32, [1] Q6_K (folded: its split costs more than
 * Q4_K's decode, so the tiles pay from a count of their own), [2] Q4_K with its scales folded into
 * the weights (q4k_fold). Set from a timing (kernels.amx_rows), read back by the tests that force
 * them */
static int sdk_amx_min_rows[3] = {8, 16, 24};

static int clamp_rows(int rows) { return rows < 1 ? 1 : rows > SDK_ROWS + 1 ? SDK_ROWS + 1 : rows; }
void sdk_set_amx_rows(int rows, int rows_q6k, int rows_fold) {
    sdk_amx_min_rows[0] = clamp_rows(rows);
    sdk_amx_min_rows[1] = clamp_rows(rows_q6k);
    sdk_amx_min_rows[2] = clamp_rows(rows_fold);
}
int sdk_get_amx_rows(int which) { return which >= 0 && which < 3 ? sdk_amx_min_rows[which] : 0; }

#define PF(p) SDK_PREFETCH(p, _MM_HINT_T0)
#define PF2(p) SDK_PREFETCH(p, _MM_HINT_T1)

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

static __thread int t_cfg; /* the shape this thread's tiles hold (0: none) */

/* two sets of (A, B, C) tiles, tmm0-2 and tmm3-5: rows x kb activation bytes, kb / 4 rows of 64
 * weight bytes, rows x 16 int32 sums */
static void configure(int kb, int rows) {
    const int key = kb * 64 + rows;
    if (t_cfg == key) return;
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int s = 0; s < 2; s++) {
        c.rows[3 * s] = (uint8_t)rows;
        c.colsb[3 * s] = (uint16_t)kb;
        c.rows[3 * s + 1] = (uint8_t)(kb / 4);
        c.colsb[3 * s + 1] = 64;
        c.rows[3 * s + 2] = (uint8_t)rows;
        c.colsb[3 * s + 2] = 64;
    }
    _tile_loadconfig(&c);
    t_cfg = key;
}

/* the end of a product on this thread: the tile state goes (the OS then saves none of it) */
void sdk_amx_release(void) {
    if (t_cfg) {
        _tile_release();
        t_cfg = 0;
    }
}

/* n units: unit u multiplies the activation bytes at a + u * astep (lda apart, rows of the
 * configured shape) by the weight rows at b + u * bstep; its int32 sums go to c + u * 256 (16 per
 * row). Units alternate between the two tile sets so one's store overlaps the next's multiply. */
static inline __attribute__((always_inline)) void units_of(const int sw, int n, const int8_t *a, int astep, long lda,
                                                            const uint8_t *b, int bstep, int32_t *c) {
    int u = 0;
    for (; u + 1 < n; u += 2) {
        _tile_loadd(0, a + (long)u * astep, lda);
        _tile_loadd(1, b + (long)u * bstep, 64);
        _tile_zero(2);
        _tile_loadd(3, a + (long)(u + 1) * astep, lda);
        _tile_loadd(4, b + (long)(u + 1) * bstep, 64);
        _tile_zero(5);
        if (sw) {
            _tile_dpbssd(2, 0, 1);
            _tile_dpbssd(5, 3, 4);
        } else {
            _tile_dpbsud(2, 0, 1);
            _tile_dpbsud(5, 3, 4);
        }
        _tile_stored(2, c + u * 256, 64);
        _tile_stored(5, c + (u + 1) * 256, 64);
    }
    if (u < n) {
        _tile_loadd(0, a + (long)u * astep, lda);
        _tile_loadd(1, b + (long)u * bstep, 64);
        _tile_zero(2);
        if (sw)
            _tile_dpbssd(2, 0, 1);
        else
            _tile_dpbsud(2, 0, 1);
        _tile_stored(2, c + u * 256, 64);
    }
}

/* units of unsigned weight bytes (units_of with sw 1: signed ones, tdpbssd) */
static inline void units(int n, const int8_t *a, int astep, long lda, const uint8_t *b, int bstep, int32_t *c) {
    units_of(0, n, a, astep, lda, b, bstep, c);
}

/* rows c0.. of super-block b in the tiles' copy of the quantized rows (256 bytes apart) */
static inline const int8_t *xrows(const sdk_act *a, int c0, int b) { return a->xt + ((size_t)b * a->mp + c0) * SDK_QK; }

static inline __m512i fault_lane(void) { return _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0); }
static inline __m512i u8x16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline __m512 h2f16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline __m512i dpw(__m512i acc, __m512i w, const int32_t *p) {
    return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(*p));
}

/* sdk_avx512vnni.c's store_row: y = fma(isum, d * a, y), then y = fma(-imin, dmin * a, y) */
static inline void store_row(float *acc, __m512i isum, __m512 d, const __m512i *imin, __m512 dmin, float a) {
    __m512 av = _mm512_set1_ps(a), y = _mm512_loadu_ps(acc);
    y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, av), y);
    if (imin) y = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(*imin), _mm512_mul_ps(dmin, av), y);
    _mm512_storeu_ps(acc, y);
}

/* Q4_K: 8 units of 32 inputs a super-block (A: 32 bytes a row, B: 8 rows) */
static void q4k(const uint8_t *tile, int nblk, const sdk_act *a, int m0, int m1, int ch, float *acc,
                uint8_t *wb, int32_t *cb) {
    const int kp = a->kp;
    const long pf = (long)sdk_pf_blocks * SDK_Q4K_REC;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int b = 0; b < nblk; b++) {
        const uint8_t *rec = tile + (size_t)b * SDK_Q4K_REC;
        for (int j = 0; j < 8; j++) {
            for (int i = 0; i < 4; i++) {
                __m512i v = _mm512_loadu_si512(rec + (j * 4 + i) * 64);
                PF(rec + pf + (j * 4 + i) * 64 + (j == 7 ? 256 : 0));
                _mm512_store_si512(wb + j * 512 + i * 64, _mm512_and_si512(v, low4));
                _mm512_store_si512(wb + j * 512 + (i + 4) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
            }
        }
        __m512i sc[8], mn[4];
        for (int j = 0; j < 8; j++) sc[j] = u8x16(rec + 2048 + j * 16);
        for (int q = 0; q < 4; q++)
            mn[q] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(rec + 2176 + q * 32)));
        const __m512 d = h2f16(rec + 2304), dmin = h2f16(rec + 2336);
        for (int c0 = m0; c0 < m1; c0 += ch) {
            const int rows = m1 - c0 < ch ? m1 - c0 : ch;
            units(8, xrows(a, c0, b), 32, SDK_QK, wb, 512, cb);
            for (int r = 0; r < rows; r++) {
                const int m = c0 + r;
                __m512i isum = _mm512_setzero_si512(), imin = _mm512_setzero_si512();
                for (int j = 0; j < 8; j++)
                    isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(_mm512_load_si512(cb + j * 256 + r * 16), sc[j]));
                for (int q = 0; q < 4; q++) imin = dpw(imin, mn[q], a->xp + (size_t)m * (kp / 64) + b * 4 + q);
                if (sdk_fault && b == 0 && m == 0) isum = _mm512_add_epi32(isum, fault_lane());
                store_row(acc + (m - m0) * 16, isum, d, &imin, dmin, a->xa[(size_t)m * (kp / SDK_QK) + b]);
            }
        }
    }
}

/* Q4_K with the sub-block scales folded into the weights: each value times its scale (at most 15
 * x 63 = 945) is split into two bytes, p = 256 hi + lo, so a whole super-block takes 4 multiplies
 * of 64 inputs into one tile of low sums and 4 into one of high sums, and a row's integer sum is
 * lo + 256 hi: the same integer as the sub-block sums times their scales. The split costs ~20
 * vector operations per 64 weight bytes, shared by every row of the call; the rows then skip the
 * per-sub-block stores and multiplies. Tiles: A in tmm0 / tmm3, low and high weights in tmm1, tmm4
 * / tmm6, tmm7, the sums in tmm2 (low) and tmm5 (high). */
static void configure_fold(int rows, int pair) {
    const int key = (128 + pair) * 64 + rows;
    if (t_cfg == key) return;
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    /* one chunk of rows: A in tmm0 / tmm3, low and high weights in tmm1, tmm4 / tmm6, tmm7 (two
     * sets, so one set loads while the other multiplies), the sums in tmm2 (low), tmm5 (high);
     * a pair of chunks: A in tmm0 (first) and tmm3 (second), the weights in tmm1 (low) and tmm4
     * (high), each loaded once for both, the sums in tmm2, tmm5 (first) and tmm6, tmm7 */
    const int a[2] = {0, 3};
    const int w1[4] = {1, 4, 6, 7}, s1[2] = {2, 5};
    const int w2[2] = {1, 4}, s2[4] = {2, 5, 6, 7};
    for (int i = 0; i < 2; i++) {
        c.rows[a[i]] = (uint8_t)rows;
        c.colsb[a[i]] = 64;
    }
    for (int i = 0; i < (pair ? 2 : 4); i++) {
        c.rows[pair ? w2[i] : w1[i]] = 16;
        c.colsb[pair ? w2[i] : w1[i]] = 64;
    }
    for (int i = 0; i < (pair ? 4 : 2); i++) {
        c.rows[pair ? s2[i] : s1[i]] = (uint8_t)rows;
        c.colsb[pair ? s2[i] : s1[i]] = 64;
    }
    _tile_loadconfig(&c);
    t_cfg = key;
}

/* the products pe (even bytes) and po (odd bytes), one per 16-bit word, as their low bytes at l
 * and their high bytes at h: (pe & 0xff) | po << 8 ((A & C) | B: 0xEC) and pe >> 8 | (po & 0xff00)
 * (A | (B & C): 0xF8); for a negative product the high byte is its floor over 256, signed */
static inline void split_store(__m512i pe, __m512i po, uint8_t *l, uint8_t *h) {
    const __m512i mlo = _mm512_set1_epi16(0x00ff), mhi = _mm512_set1_epi16((short)0xff00);
    _mm512_store_si512(l, _mm512_ternarylogic_epi32(pe, _mm512_slli_epi16(po, 8), mlo, 0xEC));
    _mm512_store_si512(h, _mm512_ternarylogic_epi32(_mm512_srli_epi16(pe, 8), po, mhi, 0xF8));
}

/* a super-block's 4 x 64 inputs of rows x (lda apart; configure_fold's shape) against the folded weights: the
 * low bytes (unsigned) into tmm2, the high bytes into tmm5 (HI_DP: tdpbsud for Q4_K's unsigned
 * high bytes, tdpbssd for Q6_K's signed ones), both stored to cb and cb + 256 */
#define FOLD_TILES(HI_DP, x, lda, lo, hi, cb)                    \
    do {                                                          \
        _tile_zero(2);                                            \
        _tile_zero(5);                                            \
        for (int t = 0; t < 4; t += 2) {                          \
            _tile_loadd(0, (x) + t * 64, lda);                    \
            _tile_loadd(1, (lo) + t * 1024, 64);                  \
            _tile_loadd(4, (hi) + t * 1024, 64);                  \
            _tile_loadd(3, (x) + (t + 1) * 64, lda);              \
            _tile_loadd(6, (lo) + (t + 1) * 1024, 64);            \
            _tile_loadd(7, (hi) + (t + 1) * 1024, 64);            \
            _tile_dpbsud(2, 0, 1);                                \
            HI_DP(5, 0, 4);                                       \
            _tile_dpbsud(2, 3, 6);                                \
            HI_DP(5, 3, 7);                                       \
        }                                                         \
        _tile_stored(2, (cb), 64);                                \
        _tile_stored(5, (cb) + 256, 64);                          \
    } while (0)

/* FOLD_TILES for a pair of chunks (configure_fold's pair shape): rows x0.. and x1.. (each lda
 * apart) against the same weight tiles, each loaded once; the first chunk's sums to cb and
 * cb + 256, the second's to cb + 512 and cb + 768 */
#define FOLD_TILES2(HI_DP, x0, x1, lda, lo, hi, cb)              \
    do {                                                          \
        _tile_zero(2);                                            \
        _tile_zero(5);                                            \
        _tile_zero(6);                                            \
        _tile_zero(7);                                            \
        for (int t = 0; t < 4; t++) {                             \
            _tile_loadd(1, (lo) + t * 1024, 64);                  \
            _tile_loadd(4, (hi) + t * 1024, 64);                  \
            _tile_loadd(0, (x0) + t * 64, lda);                   \
            _tile_loadd(3, (x1) + t * 64, lda);                   \
            _tile_dpbsud(2, 0, 1);                                \
            HI_DP(5, 0, 4);                                       \
            _tile_dpbsud(6, 3, 1);                                \
            HI_DP(7, 3, 4);                                       \
        }                                                         \
        _tile_stored(2, (cb), 64);                                \
        _tile_stored(5, (cb) + 256, 64);                          \
        _tile_stored(6, (cb) + 512, 64);                          \
        _tile_stored(7, (cb) + 768, 64);                          \
    } while (0)

/* the chunk of rows from c0 (a pair of chunks when paired) through the folded tiles of one
 * super-block (q4k_fold's and q6k_fold's names: a, b, ch, paired, lo, hi, cb) */
#define FOLD_CHUNK(HI_DP, c0)                                              \
    do {                                                                   \
        const int8_t *x_ = xrows(a, (c0), b);                              \
        if (paired)                                                        \
            FOLD_TILES2(HI_DP, x_, x_ + ch * SDK_QK, SDK_QK, lo, hi, cb);  \
        else                                                               \
            FOLD_TILES(HI_DP, x_, SDK_QK, lo, hi, cb);                     \
    } while (0)

/* row r's integer sum from FOLD_CHUNK's sums: low + 256 x high (the second chunk's at cb + 512) */
static inline __m512i folded_sum(const int32_t *cb, int r, int ch) {
    const int32_t *s = cb + (r >= ch) * 512 + (r - (r >= ch) * ch) * 16;
    return _mm512_add_epi32(_mm512_load_si512(s), _mm512_slli_epi32(_mm512_load_si512(s + 256), 8));
}

static void q4k_fold(const uint8_t *tile, int nblk, const sdk_act *a, int m0, int m1, int ch, int paired,
                     float *acc, uint8_t *wb, int32_t *cb) {
    const int kp = a->kp;
    const long pf = (long)sdk_pf_blocks * SDK_Q4K_REC;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    uint8_t *lo = wb, *hi = wb + 4096;
    for (int b = 0; b < nblk; b++) {
        const uint8_t *rec = tile + (size_t)b * SDK_Q4K_REC;
        for (int j = 0; j < 8; j++) {
            __m512i sw = u8x16(rec + 2048 + j * 16);
            sw = _mm512_or_si512(sw, _mm512_slli_epi32(sw, 16)); /* the column's scale in both words */
            const __m512i so = _mm512_slli_epi16(sw, 8);
            for (int i = 0; i < 4; i++) {
                __m512i v = _mm512_loadu_si512(rec + (j * 4 + i) * 64);
                PF(rec + pf + (j * 4 + i) * 64 + (j == 7 ? 256 : 0));
                /* the even and odd bytes' values of the low nibbles (inputs 4i..) and the high ones
                 * (inputs 16 + 4i..) times the scale, one product per 16-bit word: vpmaddubsw
                 * against the scale in the even (se) or the odd (so) byte of each word */
                const __m512i nl = _mm512_and_si512(v, low4), nh = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                const __m512i pe = _mm512_maddubs_epi16(nl, sw), po = _mm512_maddubs_epi16(nl, so);
                const __m512i qe = _mm512_maddubs_epi16(nh, sw), qo = _mm512_maddubs_epi16(nh, so);
                split_store(pe, po, lo + j * 512 + i * 64, hi + j * 512 + i * 64);
                split_store(qe, qo, lo + j * 512 + (i + 4) * 64, hi + j * 512 + (i + 4) * 64);
            }
        }
        __m512i mn[4];
        for (int q = 0; q < 4; q++)
            mn[q] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(rec + 2176 + q * 32)));
        const __m512 d = h2f16(rec + 2304), dmin = h2f16(rec + 2336);
        for (int c0 = m0, span = (paired + 1) * ch; c0 < m1; c0 += span) {
            const int rows = m1 - c0 < span ? m1 - c0 : span;
            FOLD_CHUNK(_tile_dpbsud, c0);
            for (int r = 0; r < rows; r++) {
                const int m = c0 + r;
                __m512i isum = folded_sum(cb, r, ch);
                __m512i imin = _mm512_setzero_si512();
                for (int q = 0; q < 4; q++) imin = dpw(imin, mn[q], a->xp + (size_t)m * (kp / 64) + b * 4 + q);
                if (sdk_fault && b == 0 && m == 0) isum = _mm512_add_epi32(isum, fault_lane());
                store_row(acc + (m - m0) * 16, isum, d, &imin, dmin, a->xa[(size_t)m * (kp / SDK_QK) + b]);
            }
        }
    }
}

/* Q6_K, always with its int8 sub-block scales folded into the weights as Q4_K's (q4k_fold): the
 * signed value (q - 32, from -32 to 31) times its scale (-128..127), -4064..4096, split into an
 * unsigned low byte and a signed high byte (tdpbssd). The offset is in the weights, so no row pays
 * the VNNI path's term of 32 x the scales x its sums of 16 codes (8 vpdpwssd a super-block and
 * row: a 657-token prefill of the 1.5B 0.97x the time). Unfolded, its 16 sub-blocks of 16 inputs
 * each took a multiply (a quarter of its K used) and a store: 0.79-0.97x of the VNNI code at 16-64
 * rows, folded 0.51-0.62x */
static void q6k_fold(const uint8_t *tile, int nblk, const sdk_act *a, int m0, int m1, int ch, int paired,
                     float *acc, uint8_t *wb, int32_t *cb) {
    const int kp = a->kp;
    const long pf = (long)sdk_pf_blocks * SDK_Q6K_REC;
    const __m512i low4 = _mm512_set1_epi8(0x0f), bits45 = _mm512_set1_epi8(0x30), m8 = _mm512_set1_epi16(0x00ff);
    const __m512i w0 = _mm512_set1_epi32(0xffff), w1 = _mm512_set1_epi32((int)0xffff0000u);
    uint8_t *lo = wb, *hi = wb + 4096;
    for (int b = 0; b < nblk; b++) {
        const uint8_t *rec = tile + (size_t)b * SDK_Q6K_REC, *scales = rec + SDK_Q6K_INTS;
        for (int j = 0; j < 8; j++) {
            const uint8_t *chunk = rec + j * 384;
            const __m512i pr = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(scales + j * 32)));
            /* sub-block 2j's scale (the pair's low word) and 2j + 1's (high word), in both words */
            const __m512i s0 = _mm512_or_si512(_mm512_and_si512(pr, w0), _mm512_slli_epi32(pr, 16));
            const __m512i s1 = _mm512_or_si512(_mm512_srli_epi32(pr, 16), _mm512_and_si512(pr, w1));
            /* the scales as vpmaddubsw's signed bytes: in the even (e) or odd (o) byte of each word */
            const __m512i e0 = _mm512_and_si512(s0, m8), o0 = _mm512_slli_epi16(e0, 8);
            const __m512i e1 = _mm512_and_si512(s1, m8), o1 = _mm512_slli_epi16(e1, 8);
            const __m512i t0 = _mm512_slli_epi16(s0, 5), t1 = _mm512_slli_epi16(s1, 5); /* 32 x the scale */
            __m512i h0 = _mm512_loadu_si512(chunk + 256), h1 = _mm512_loadu_si512(chunk + 320);
            PF2(chunk + pf + 256);
            PF2(chunk + pf + 320);
            if (j < 5) PF2(scales + SDK_Q6K_REC + j * 64);
            for (int i = 0; i < 4; i++) {
                __m512i v = _mm512_loadu_si512(chunk + i * 64);
                PF2(chunk + pf + i * 64);
                __m512i b0 = i < 2 ? _mm512_slli_epi16(h0, 4 - 2 * i) : (i == 2 ? h0 : _mm512_srli_epi16(h0, 2));
                __m512i b1 = i < 2 ? _mm512_slli_epi16(h1, 4 - 2 * i) : (i == 2 ? h1 : _mm512_srli_epi16(h1, 2));
                __m512i wa = _mm512_ternarylogic_epi32(v, _mm512_and_si512(b0, bits45), low4, 0xEC);
                __m512i wz = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), _mm512_and_si512(b1, bits45), low4, 0xEC);
                __m512i pa = _mm512_maddubs_epi16(wa, e0), qa = _mm512_maddubs_epi16(wa, o0);
                __m512i pz = _mm512_maddubs_epi16(wz, e1), qz = _mm512_maddubs_epi16(wz, o1);
                pa = _mm512_sub_epi16(pa, t0); /* (q - 32) x scale */
                qa = _mm512_sub_epi16(qa, t0);
                pz = _mm512_sub_epi16(pz, t1);
                qz = _mm512_sub_epi16(qz, t1);
                split_store(pa, qa, lo + j * 512 + i * 64, hi + j * 512 + i * 64);
                split_store(pz, qz, lo + j * 512 + (i + 4) * 64, hi + j * 512 + (i + 4) * 64);
            }
        }
        const __m512 d = h2f16(scales + 256);
        for (int c0 = m0, span = (paired + 1) * ch; c0 < m1; c0 += span) {
            const int rows = m1 - c0 < span ? m1 - c0 : span;
            FOLD_CHUNK(_tile_dpbssd, c0);
            for (int r = 0; r < rows; r++) {
                const int m = c0 + r;
                __m512i isum = folded_sum(cb, r, ch);
                if (sdk_fault && b == 0 && m == 0) isum = _mm512_add_epi32(isum, fault_lane());
                store_row(acc + (m - m0) * 16, isum, d, 0, d, a->xa[(size_t)m * (kp / SDK_QK) + b]);
            }
        }
    }
}

#define UNROLL8 _Pragma("GCC unroll 8")
/* blocks of 32 (Q8_0, Q5_0, Q4_0, Q3_0), 8 at a time (one activation block): Q8_0's integers are the
 * tile layout already (values q + 128, less 128 x the row's sum of codes afterwards), the others
 * are decoded to their signed values q (tdpbssd: the rows pay no offset term; the 0.5B's
 * 657-token prefill 0.91x the time), and the blocks' scales are converted once for every row
 * (0.93x) */
static void blocks32(int type, const uint8_t *tile, int nblk, const sdk_act *a, int m0, int m1, int ch,
                     float *acc, uint8_t *wb, int32_t *cb) {
    const int kp = a->kp, n16 = kp / 16;
    const int three = type == SDK_Q3_0;
    const long ints = type == SDK_Q8_0 ? SDK_Q8_INTS : type == SDK_Q5_0 ? SDK_Q5_INTS : three ? SDK_Q3_INTS : SDK_Q4_INTS;
    const long recb = type == SDK_Q8_0 ? SDK_Q8_REC : type == SDK_Q5_0 ? SDK_Q5_REC : three ? SDK_Q3_REC : SDK_Q4_REC;
    const int lines = type == SDK_Q8_0 ? 9 : type == SDK_Q5_0 ? 6 : three ? 4 : 5;
    const int off = type == SDK_Q8_0 ? 128 : type == SDK_Q5_0 ? 16 : three ? 4 : 8;
    const long pf = SDK_PF_SMALL(recb);
    const __m512i low4 = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10), offv = _mm512_set1_epi8((char)off);
    const int sw = type != SDK_Q8_0; /* Q8_0's bytes go to the tiles as stored: q + 128 */
    for (int g0 = 0; g0 < nblk; g0 += 8) {
        const int nb = nblk - g0 < 8 ? nblk - g0 : 8;
        for (int e = 0; e < nb; e++) {
            const int b = g0 + e;
            for (int i = 0; i < lines; i++) PF(tile + pf + (long)b * recb + i * 64);
            if (type == SDK_Q8_0) continue;
            const uint8_t *rec = tile + (size_t)b * ints;
            if (three) { /* 2-bit values and the plane's third bit: q + 4, stored as q */
                const __m512i low2 = _mm512_set1_epi8(0x03), bit2 = _mm512_set1_epi8(0x04);
                const __m512i h3 = _mm512_loadu_si512(rec + 128);
                for (int g = 0; g < 8; g++) {
                    __m512i v = _mm512_srli_epi16(_mm512_loadu_si512(rec + (g / 4) * 64), 2 * (g % 4));
                    __m512i hb = g < 2 ? _mm512_slli_epi16(h3, 2 - g) : _mm512_srli_epi16(h3, g - 2);
                    v = _mm512_ternarylogic_epi32(v, _mm512_and_si512(hb, bit2), low2, 0xEC);
                    _mm512_store_si512(wb + e * 512 + g * 64, _mm512_sub_epi8(v, offv));
                }
                continue;
            }
            const __m512i h = type == SDK_Q5_0 ? _mm512_loadu_si512(rec + 256) : _mm512_setzero_si512();
            for (int i = 0; i < 4; i++) {
                __m512i v = _mm512_loadu_si512(rec + i * 64), lo, hi;
                if (type == SDK_Q5_0) {
                    __m512i hb = _mm512_slli_epi16(h, 4 - i), hj = i == 0 ? h : _mm512_srli_epi16(h, i);
                    lo = _mm512_ternarylogic_epi32(v, _mm512_and_si512(hb, bit4), low4, 0xEC);
                    hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), _mm512_and_si512(hj, bit4), low4, 0xEC);
                } else {
                    lo = _mm512_and_si512(v, low4);
                    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                }
                if (sw) { /* the signed values q (tdpbssd): no offset term */
                    lo = _mm512_sub_epi8(lo, offv);
                    hi = _mm512_sub_epi8(hi, offv);
                }
                _mm512_store_si512(wb + e * 512 + i * 64, lo);
                _mm512_store_si512(wb + e * 512 + (i + 4) * 64, hi);
            }
        }
        const uint8_t *wts = type == SDK_Q8_0 ? tile + (size_t)g0 * SDK_Q8_INTS : wb;
        const uint8_t *scales = tile + (size_t)nblk * ints + (size_t)g0 * SDK_Q8_SCALES;
        __m512 d[8]; /* the blocks' scales, once for every row */
        UNROLL8 for (int e = 0; e < 8; e++) d[e] = h2f16(scales + (e < nb ? e : 0) * SDK_Q8_SCALES);
        for (int c0 = m0; c0 < m1; c0 += ch) {
            const int rows = m1 - c0 < ch ? m1 - c0 : ch;
            units_of(sw, nb, xrows(a, c0, g0 / 8), 32, SDK_QK, wts, 512, cb);
            for (int r = 0; r < rows; r++) {
                const int m = c0 + r;
                const __m512 av = _mm512_set1_ps(a->xa[(size_t)m * (kp / SDK_QK) + g0 / 8]);
                const int32_t *xs = a->xs + (size_t)m * n16 + g0 * 2;
                float *y = acc + (m - m0) * 16;
                __m512 yv = _mm512_loadu_ps(y);
                for (int e = 0; e < nb; e++) {
                    __m512i u = _mm512_load_si512(cb + e * 256 + r * 16);
                    if (!sw) u = _mm512_sub_epi32(u, _mm512_set1_epi32(off * (xs[2 * e] + xs[2 * e + 1])));
                    if (sdk_fault && g0 + e == 0 && m == 0) u = _mm512_add_epi32(u, fault_lane());
                    yv = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), _mm512_mul_ps(d[e], av), yv);
                }
                _mm512_storeu_ps(y, yv);
            }
        }
    }
}

void sdk_tile_amx(int type, const uint8_t *rec, int nblk, const sdk_act *a, int m0, int m1, float *acc,
                  uint8_t *scratch) {
    const int rows = m1 - m0, least = sdk_amx_min_rows[type == SDK_Q6K];
    if (rows < least || least > SDK_ROWS || !a->xt) { /* no tiles' copy: sdk_quantize judged none would run */
        sdk_tile_avx512vnni(type, rec, nblk, a, m0, m1, acc, scratch);
        return;
    }
    /* the decoded weights (one super-block, or 8 blocks of 32: 4 KiB; folded: 8 KiB) in scratch;
     * the tiles' sums (up to 8 units x 16 rows x 16 columns) here */
    int32_t cb[8 * 256] __attribute__((aligned(64)));
    /* more than 16 rows: the fewest tiles of equal height (20 rows: two of 10, not 16 + 4, since
     * a multiply of up to 8 rows costs the same), the last one reading up to 3 rows of the
     * quantized rows' padding (sdk_quantize keeps 16 more; what lands in those sums is not used) */
    const int chunks = (rows + 15) / 16, ch = (rows + chunks - 1) / chunks;
    if ((type == SDK_Q4K && rows >= sdk_amx_min_rows[2] && sdk_amx_min_rows[2] <= SDK_ROWS) || type == SDK_Q6K) {
        /* folded, an even number of chunks (17-32 rows, 49-64): in pairs that share each weight
         * tile load (32 rows 0.89-0.91x the time of two chunks apart, random Q4_K and Q6_K on the
         * AMX Xeon; 20 and 64 rows 0.95-1.0x). Not three chunks as two of 12 and two of 12: a
         * fourth multiply a super-block cost more than the loads saved (48 rows 1.06x) */
        const int pair = chunks % 2 == 0;
        configure_fold(ch, pair);
        for (int r = 0; r < rows; r++) _mm512_storeu_ps(acc + r * 16, _mm512_setzero_ps());
        if (type == SDK_Q4K)
            q4k_fold(rec, nblk, a, m0, m1, ch, pair, acc, scratch, cb);
        else
            q6k_fold(rec, nblk, a, m0, m1, ch, pair, acc, scratch, cb);
        return;
    }
    configure(32, ch);
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(acc + r * 16, _mm512_setzero_ps());
    if (type == SDK_Q4K)
        q4k(rec, nblk, a, m0, m1, ch, acc, scratch, cb);
    else
        blocks32(type, rec, nblk, a, m0, m1, ch, acc, scratch, cb);
}
