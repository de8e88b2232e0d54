/* specdecode's quantized linear kernel: shared declarations.
 *
 * y[m, n] = sum_k W[n, k] * x[m, k] with W in a GGUF block format (Q4_K, Q6_K, Q8_0) repacked
 * into tiles of SDK_TILE output columns, and x quantized to int8 per row and per block of
 * SDK_QK inputs (one float scale per block, integer sums per 16 inputs).
 *
 * Exactness: every integer sum inside a super-block (Q4_K, Q6_K) or block (Q8_0) is exact, so
 * any instruction set gives the same integers; the float epilogue is one fixed sequence of
 * IEEE operations per (row, column, block) in K order (sdk_ref.c spells it out). A row's result
 * therefore does not depend on the number of rows in the call, its place among them, the
 * instruction set or the thread count.
 */
#ifndef SDK_H
#define SDK_H
#include <stddef.h>
#include <stdint.h>

#define SDK_TILE 16  /* output columns per tile */
#define SDK_QK 256   /* activation block (one scale) and k-quant super-block */
#define SDK_ROWS 64  /* rows per chunk (a prefill is tiled over rows by this) */
#define SDK_AMX_ROWS 256 /* the AMX path's rows per chunk (its tiles take 16 rows at a time; an AMX row
                          * threshold above SDK_ROWS means never) */

#define SDK_MAX_THREADS 64 /* a product's threads at most (their shares of the tiles) */

/* a thread's share of a product's tiles: front (low half) and back (high half), one cache line */
typedef struct {
    unsigned long long span;
    char pad[56];
} __attribute__((aligned(64))) sdk_share;
extern int sdk_steal; /* 1: threads done with their share take the others' last tiles (sdk_core.c) */

enum { SDK_Q4K = 1, SDK_Q6K = 2, SDK_Q8_0 = 3, SDK_Q5_0 = 4, SDK_Q4_0 = 5, SDK_Q3_0 = 6 };
enum { SDK_ISA_REF = 0, SDK_ISA_AVX2 = 1, SDK_ISA_AVXVNNI = 2, SDK_ISA_AVX512VNNI = 3, SDK_ISA_AMX = 4, SDK_NISA = 5 };

/* bytes of one tile per block (a super-block of 256 inputs; Q8_0, Q5_0, Q4_0, Q3_0: a block of 32). Q4_K's
 * record (37 cache lines) holds everything, and so does Q6_K's (53 lines: its integers, then its
 * scales, padded to a whole line: one read stream a thread; the 16 scales of a column as pairs,
 * byte p * 32 + c * 2 + i = column c's scale of sub-block 2p + i, the int16 pairs vpdpwssd reads
 * once widened). Q8_0 and Q5_0 keep a tile's integers first, every block's at a whole number of
 * cache lines (no 64-byte load straddles two), then its scales: block b's integers at
 * b * SDK_Q8_INTS (SDK_Q5_INTS), its scales at nblk * INTS + b * SCALES */
#define SDK_Q4K_REC (2048 + 128 + 128 + 32 + 32) /* nibbles, scales, mins (pairs), d, dmin (fp16) */
#define SDK_Q6K_INTS (2048 + 1024)               /* low nibbles, high 2 bits */
#define SDK_Q6K_SCALES (256 + 32)                /* int8 scales in pairs, d (fp16), at SDK_Q6K_INTS */
#define SDK_Q6K_REC (SDK_Q6K_INTS + SDK_Q6K_SCALES + 32) /* + 32 bytes of padding */
#define SDK_Q8_INTS 512  /* q + 128 (bytes) */
#define SDK_Q8_SCALES 32 /* d (fp16) */
#define SDK_Q8_REC (SDK_Q8_INTS + SDK_Q8_SCALES)
/* Q5_0 (32 inputs): Q8_0's order of inputs, 4 vectors of nibble pairs (vector i: inputs 4i..4i+3
 * low, 4i+16..4i+19 high, as Q4_K's per 32 inputs), then 64 bytes whose byte c * 4 + kk holds in
 * bit g the fifth bit of input 4g + kk of column c; values 0..31 stand for q + 16 */
#define SDK_Q5_INTS 320
#define SDK_Q5_SCALES 32 /* d (fp16) */
#define SDK_Q5_REC (SDK_Q5_INTS + SDK_Q5_SCALES)
/* Q4_0 (32 inputs): Q5_0's 4 vectors of nibble pairs without the plane; values 0..15 stand for
 * q + 8. The tile's integers first, then its scales, as Q5_0's */
#define SDK_Q4_INTS 256
#define SDK_Q4_SCALES 32 /* d (fp16) */
#define SDK_Q4_REC (SDK_Q4_INTS + SDK_Q4_SCALES)
/* Q3_0 (32 inputs; specdecode's own 3-bit block, no GGUF type: a draft's format): 2 vectors of
 * 2-bit values (vector j, byte c * 4 + kk: bits 2i..2i+1 hold the low two bits of input
 * 4 (4j + i) + kk of column c), then Q5_0's plane holding the third bit; values 0..7 stand for
 * q + 4. The tile's integers first, then its scales, as Q5_0's */
#define SDK_Q3_INTS 192
#define SDK_Q3_SCALES 32 /* d (fp16) */
#define SDK_Q3_REC (SDK_Q3_INTS + SDK_Q3_SCALES)

/* quantized activation rows: xq [rows][kp] int8, xa [rows][kp / 256] scale, xs [rows][kp / 16]
 * integer sums of 16 codes, xp [rows][kp / 64] the sums of 32 codes two by two as int16 pairs
 * (low half: inputs 64p..64p+31, high half: the next 32; |sum| <= 4064), xw [rows][kp / 32] the
 * sums of 16 codes two by two as int16 pairs (low half: xs[2p], high half: xs[2p + 1]; |sum| <=
 * 2032), both for vpdpwssd */
typedef struct {
    const int8_t *xq;
    const float *xa;
    const int32_t *xs;
    const int32_t *xp;
    const int32_t *xw;
    int kp;
    /* the AMX path's copy of xq (sdk_quantize for isa amx): per 256 inputs, that block of every
     * row and of 16 rows of padding, [kp / 256][mp][256], so the 16 rows of a tile's load are
     * 256 bytes apart and a super-block's rows one stream; NULL where the call has fewer rows
     * than every AMX threshold (the tiles do not run) */
    const int8_t *xt;
    int mp;
} sdk_act;

/* one tile (SDK_TILE columns) for rows [m0, m1) (m1 - m0 <= SDK_ROWS; AMX: SDK_AMX_ROWS): acc [m1 - m0][SDK_TILE]
 * receives the products (overwritten). rec: the tile's records, nblk of them. scratch: 16 KiB. */
typedef void (*sdk_tile_fn)(int type, const uint8_t *rec, int nblk, const sdk_act *a, int m0, int m1,
                            float *acc, uint8_t *scratch);

void sdk_tile_ref(int, const uint8_t *, int, const sdk_act *, int, int, float *, uint8_t *);
void sdk_tile_avx2(int, const uint8_t *, int, const sdk_act *, int, int, float *, uint8_t *);
void sdk_tile_avxvnni(int, const uint8_t *, int, const sdk_act *, int, int, float *, uint8_t *);
void sdk_tile_avx512vnni(int, const uint8_t *, int, const sdk_act *, int, int, float *, uint8_t *);
void sdk_tile_amx(int, const uint8_t *, int, const sdk_act *, int, int, float *, uint8_t *);

extern int sdk_pf_blocks; /* how many records ahead a product of two or more rows prefetches (the
                           * SIMD paths' Q4_K and Q6_K; one row: sdk_pf_one). Speed only, never
                           * bits: set by sdk_set_prefetch from a timing (kernels.prefetch_blocks) */
extern int sdk_pf_small; /* how many records ahead the blocks of 32 (Q8_0, Q5_0, Q4_0, Q3_0: a draft's
                          * formats) prefetch, at every row count: their records are small (160-544
                          * bytes), so the lead that pays is longer and the CPU's (a Zen 4 EPYC's
                          * 0.5B kq4 step 17% faster at 32 than at 4). Speed only, never bits: set by
                          * sdk_set_prefetch_small from a timing (kernels.prefetch_choice) */
#define SDK_PF_SMALL(rec) ((long)sdk_pf_small * (rec))
extern int sdk_pf_one; /* records ahead a one-row Q4_K / Q6_K product prefetches: on a Zen 4 EPYC 2 made the
                        * 1.5B's one-row step 8-10% faster than 1. Speed only, never bits: set by
                        * sdk_set_prefetch_one from a timing (kernels.prefetch_one) */
extern int sdk_pf_q6_l1; /* 1: Q6_K's prefetches go to L1 (T0) for one or two rows (AVX2: every row count)
                          * instead of L2 (T1): on a Zen 5 EPYC the 1.5B's Q6_K head and down 5-7%
                          * faster at one row, on a Zen 4 EPYC 28% slower. Speed only, never bits: set
                          * by sdk_set_prefetch_q6 from a timing (kernels.prefetch_q6k_l1) */
extern int sdk_pf_nta; /* 1: the SIMD paths' weight prefetches carry the non-temporal hint (NTA) instead
                        * of T0 / T1: on a Zen 5 EPYC the 1.5B's step 3-4% faster and the pair's
                        * rounds 4-5% (benchmarks/NOTES.md, issue 53); speed only, never bits: set by
                        * sdk_set_prefetch_hint from a timing (kernels.prefetch_choice) */
#define SDK_PREFETCH(p, hint) \
    (sdk_pf_nta ? _mm_prefetch((const char *)(p), _MM_HINT_NTA) : _mm_prefetch((const char *)(p), hint))
extern int sdk_fault; /* tests only: a path adds 1 to lane 3 of one integer sum, and one ulp to column 3
                       * of row 0 of a float product (negative control) */

static inline float sdk_h2f(uint16_t h) {
    /* IEEE half -> float, exact (F16C's vcvtph2ps gives the same bits) */
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0) {
        if (m == 0) {
            bits = s;
        } else { /* subnormal: normalise */
            e = 113;
            while (!(m & 0x400)) { m <<= 1; e--; }
            bits = s | (e << 23) | ((m & 0x3ff) << 13);
        }
    } else if (e == 31) {
        bits = s | 0x7f800000u | (m << 13);
    } else {
        bits = s | ((e + 112) << 23) | (m << 13);
    }
    union { uint32_t u; float f; } v = {bits};
    return v.f;
}
#endif
