/* The kernel's entry points: which instruction sets this CPU and OS run (cpuid + xgetbv), the
 * activation quantizer, and the product split over output tiles on OpenMP threads (torch's own
 * runtime when the build links it: one pool, no oversubscription). */
#include <cpuid.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <omp.h>

#include "sdk.h"

void sdk_quantize_row(const float *x, int k, int kp, int8_t *xq, float *xa, int32_t *xs, int32_t *xp);

/* paths not compiled (the compiler lacked the flags) are null */
extern void sdk_quantize_row_avx2(const float *x, int k, int kp, int8_t *xq, float *xa, int32_t *xs, int32_t *xp)
    __attribute__((weak));
extern void sdk_tile_avx2(int, const uint8_t *, int, const sdk_act *, int, int, float *, uint8_t *)
    __attribute__((weak));
extern void sdk_tile_avxvnni(int, const uint8_t *, int, const sdk_act *, int, int, float *, uint8_t *)
    __attribute__((weak));
extern void sdk_tile_avx512vnni(int, const uint8_t *, int, const sdk_act *, int, int, float *, uint8_t *)
    __attribute__((weak));
extern void sdk_tile_amx(int, const uint8_t *, int, const sdk_act *, int, int, float *, uint8_t *)
    __attribute__((weak));
extern void sdk_amx_release(void) __attribute__((weak));
extern int sdk_get_amx_rows(int) __attribute__((weak));

int sdk_abi_version(void) { return 11; }

void sdk_set_fault(int on) { sdk_fault = on; }

void sdk_set_prefetch(int blocks) { sdk_pf_blocks = blocks < 1 ? 1 : blocks > 8 ? 8 : blocks; }

void sdk_set_prefetch_small(int records) { sdk_pf_small = records < 1 ? 1 : records > 128 ? 128 : records; }

void sdk_set_prefetch_one(int n) { sdk_pf_one = n < 1 ? 1 : n > 8 ? 8 : n; }

void sdk_set_prefetch_q6(int l1) { sdk_pf_q6_l1 = l1 != 0; }

void sdk_set_prefetch_hint(int nta) { sdk_pf_nta = nta != 0; }

/* write back and drop every cache line of [p, p + bytes) (the timings' weights: a CPU whose last
 * level cache holds them would otherwise time products that never wait on memory) */
void sdk_evict(const void *p, long bytes) {
    for (long i = 0; i < bytes; i += 64) __builtin_ia32_clflush((const char *)p + i);
    __builtin_ia32_mfence();
}

static unsigned long long xgetbv0(void) {
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

/* whether the CPU has the instructions and the OS saves their registers */
static int cpu_runs(int isa) {
    unsigned int a, b, c, d;
    if (isa == SDK_ISA_REF) return 1;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    int osxsave = (c >> 27) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !fma || !f16c) return 0;
    unsigned long long xcr0 = xgetbv0();
    if ((xcr0 & 6) != 6) return 0; /* SSE and AVX state */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1, avx512bw = (b >> 30) & 1, avx512vl = (b >> 31) & 1;
    int avx512vnni = (c >> 11) & 1;
    if (!avx2) return 0;
    if (isa == SDK_ISA_AVX2) return 1;
    if (isa == SDK_ISA_AVXVNNI) {
#ifdef SDK_EMULATE_VNNI256
        return 1; /* tests only: sdk_avxvnni.c built with vpdpbusd emulated in AVX2 (sdk_avx2_body.h) */
#endif
        unsigned int a1, b1, c1, d1;
        if (!__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) return 0;
        return (a1 >> 4) & 1;
    }
    int avx512 = avx512f && avx512bw && avx512vl && avx512vnni && (xcr0 & 0xe0) == 0xe0;
    if (isa == SDK_ISA_AVX512VNNI) return avx512;
    if (isa == SDK_ISA_AMX) {
        /* AMX-TILE and AMX-INT8 (cpuid 7.0 edx bits 24, 25), the OS's consent to the tile data
         * state (Linux asks a process to request it: arch_prctl ARCH_REQ_XCOMP_PERM, feature 18),
         * and XCR0's tile bits (17, 18) */
        int amx = ((d >> 24) & 1) && ((d >> 25) & 1);
        if (!avx512 || !amx) return 0;
#ifdef SYS_arch_prctl
        if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return 0;
#else
        return 0;
#endif
        return (xgetbv0() & 0x60000) == 0x60000;
    }
    return 0;
}

static sdk_tile_fn path(int isa) {
    switch (isa) {
    case SDK_ISA_REF: return sdk_tile_ref;
    case SDK_ISA_AVX2: return sdk_tile_avx2;
    case SDK_ISA_AVXVNNI: return sdk_tile_avxvnni;
    case SDK_ISA_AVX512VNNI: return sdk_tile_avx512vnni;
    case SDK_ISA_AMX: return sdk_tile_avx512vnni ? sdk_tile_amx : 0;
    default: return 0;
    }
}

/* 1 when this build has the path and this CPU runs it (cpuid is asked once per path: in a
 * virtual machine each cpuid traps to the hypervisor, tens of microseconds) */
int sdk_isa_runs(int isa) {
    static int known[SDK_NISA]; /* 0: not asked, 1: runs, 2: does not */
    if (isa < 0 || isa >= SDK_NISA || path(isa) == 0) return 0;
    if (!known[isa]) known[isa] = cpu_runs(isa) ? 1 : 2;
    return known[isa] == 1;
}

/* 1 when this build compiled the path (whatever the CPU) */
int sdk_isa_built(int isa) { return isa >= 0 && isa < SDK_NISA && path(isa) != 0; }

/* the calling thread's quantized rows (sdk_quantize writes them, sdk_product reads them; the
 * workers get the pointers) and each thread's pre-pass row */
static __thread int8_t *t_xq, *t_xt;
static __thread int t_xt_built; /* sdk_quantize made the tiles' copy of these rows (sdk_act.xt) */
static __thread float *t_xa;
static __thread int32_t *t_xs, *t_xp, *t_xw;
static __thread size_t t_rows_cap, t_kp_cap;
static __thread int t_m = -1, t_k = -1;
static __thread float *t_pre;
static __thread size_t t_pre_cap;

typedef void (*pre_fn)(int, const float *, int, const float *, float, float *);
pre_fn sdk_pre_row_for(int isa);

static size_t record_bytes(int type) {
    return type == SDK_Q4K    ? SDK_Q4K_REC
           : type == SDK_Q6K  ? SDK_Q6K_REC
           : type == SDK_Q8_0 ? SDK_Q8_REC
           : type == SDK_Q5_0 ? SDK_Q5_REC
           : type == SDK_Q4_0 ? SDK_Q4_REC
                              : SDK_Q3_REC;
}

/* Quantize rows x [m, k] (ldx floats apart) to int8 for the products that follow on this thread.
 * pre: 0 the rows as they are; 1 RMSNorm with weight pre_w [k] and eps; 2 SwiGLU of rows of 2k
 * values (gate, up) (sdk_attn_body.h ATTN(pre_row), the same bits for every isa). Returns 0, or
 * -1 (bad arguments), -2 (path not runnable), -3 (out of memory). */
int sdk_quantize(const float *x, long ldx, int m, int k, int pre, const float *pre_w, float eps, int isa,
                 int nthreads) {
    t_m = t_k = -1;
    if (k <= 0 || m < 0 || pre < 0 || pre > 2 || (pre == 1 && !pre_w)) return -1;
    if (ldx < (pre == 2 ? 2L * k : (long)k)) return -1;
    if (!sdk_isa_runs(isa)) return -2;
    int kp = ((k + SDK_QK - 1) / SDK_QK) * SDK_QK;
    /* 16 rows more than the call's (the AMX path's last tile reads up to 3 rows past them; their
     * sums are not used) */
    size_t want = (size_t)m + 16;
    if (want > t_rows_cap || (size_t)kp > t_kp_cap) {
        size_t rows = want > t_rows_cap ? want : t_rows_cap;
        size_t cols = (size_t)kp > t_kp_cap ? (size_t)kp : t_kp_cap;
        free(t_xq); free(t_xa); free(t_xs); free(t_xp); free(t_xw); free(t_xt);
        t_xq = calloc(rows, cols);
        t_xt = calloc(rows, cols);
        t_xa = malloc(rows * (cols / SDK_QK) * sizeof(float));
        t_xs = malloc(rows * (cols / 16) * sizeof(int32_t));
        t_xp = malloc(rows * (cols / 64) * sizeof(int32_t));
        t_xw = malloc(rows * (cols / 32) * sizeof(int32_t));
        if (!t_xq || !t_xa || !t_xs || !t_xp || !t_xw || !t_xt) {
            free(t_xq); free(t_xa); free(t_xs); free(t_xp); free(t_xw); free(t_xt);
            t_xq = 0; t_xa = 0; t_xs = 0; t_xp = 0; t_xw = 0; t_xt = 0; t_rows_cap = t_kp_cap = 0;
            return -3;
        }
        t_rows_cap = rows; t_kp_cap = cols;
    }
    /* every SIMD path runs on AVX2 CPUs: their rows are quantized by the AVX2 copy of the
     * reference's quantizer (the same bits; the self-check compares the paths with the reference) */
    void (*quantize)(const float *, int, int, int8_t *, float *, int32_t *, int32_t *) =
        isa != SDK_ISA_REF && sdk_quantize_row_avx2 ? sdk_quantize_row_avx2 : sdk_quantize_row;
    pre_fn prefn = pre ? sdk_pre_row_for(isa) : 0;
    if (nthreads < 1) nthreads = 1;
    int qthreads = m >= 16 ? nthreads : 1;
    int8_t *xq = t_xq;
    float *xa = t_xa;
    int32_t *xs = t_xs, *xp = t_xp, *xw = t_xw;
    int failed = 0;
#pragma omp parallel num_threads(qthreads)
    {
        float *h = 0;
        if (prefn) {
            if ((size_t)k > t_pre_cap) {
                free(t_pre);
                t_pre = malloc(sizeof(float) * (size_t)k);
                t_pre_cap = t_pre ? (size_t)k : 0;
            }
            h = t_pre;
            if (!h) {
#pragma omp atomic write
                failed = 1;
            }
        }
#pragma omp for schedule(static)
        for (int r = 0; r < m; r++) {
            const float *row = x + (size_t)r * ldx;
            if (prefn) {
                if (!h) continue;
                prefn(pre, row, k, pre_w, eps, h);
                row = h;
            }
            quantize(row, k, kp, xq + (size_t)r * kp, xa + (size_t)r * (kp / SDK_QK), xs + (size_t)r * (kp / 16),
                     xp + (size_t)r * (kp / 64));
            const int32_t *s16 = xs + (size_t)r * (kp / 16);
            for (int p = 0; p < kp / 32; p++) /* (xs[2p], xs[2p + 1]) as int16 pairs */
                xw[(size_t)r * (kp / 32) + p] =
                    (int32_t)((uint32_t)(uint16_t)(int16_t)s16[2 * p] | ((uint32_t)(uint16_t)(int16_t)s16[2 * p + 1] << 16));
        }
    }
    if (failed) return -3;
    /* the tiles' copy (sdk_act.xt), its padding rows zero: only where a chunk of these rows can
     * reach the tiles (fewer rows than every AMX threshold run on AVX-512 VNNI, and a decode
     * step would copy and clear 4 KiB a super-block for nothing); without it sdk_tile_amx takes
     * the VNNI path whatever the thresholds say by then */
    t_xt_built = isa == SDK_ISA_AMX && sdk_get_amx_rows &&
                 (m >= sdk_get_amx_rows(0) || m >= sdk_get_amx_rows(1));
    if (t_xt_built) {
        const int mp = m + 16;
        for (int b = 0; b < kp / SDK_QK; b++) {
            int8_t *dst = t_xt + (size_t)b * mp * SDK_QK;
            for (int r = 0; r < m; r++) memcpy(dst + (size_t)r * SDK_QK, xq + (size_t)r * kp + (size_t)b * SDK_QK, SDK_QK);
            memset(dst + (size_t)m * SDK_QK, 0, 16 * SDK_QK);
        }
    }
    t_m = m;
    t_k = k;
    return 0;
}

/* Which tiles a product's threads take. Each thread owns a contiguous share of the tiles (one
 * read stream, which its prefetches and the hardware's follow) and takes them from the front;
 * a thread whose share is done takes the other shares' tiles from their back, one at a time, so
 * no thread waits at the product's end while another still has tiles. The share is one 64-bit
 * word (front in the low half, back in the high half), changed by compare-and-swap, on a cache
 * line of its own. A tile's result does not depend on which thread computes it: speed only,
 * never bits. sdk_steal 0 keeps each thread to its share (the static split). */
int sdk_steal = 1;

void sdk_set_steal(int on) { sdk_steal = on != 0; }

static void share_init(sdk_share *s, int tiles, int nthreads, int i) {
    unsigned long long f = (unsigned long long)tiles * i / nthreads, b = (unsigned long long)tiles * (i + 1) / nthreads;
    __atomic_store_n(&s->span, f | (b << 32), __ATOMIC_RELAXED);
}

/* the front tile of share s, or -1 when it has none left */
static int take_front(sdk_share *s) {
    unsigned long long old = __atomic_load_n(&s->span, __ATOMIC_RELAXED);
    for (;;) {
        unsigned f = (unsigned)old, b = (unsigned)(old >> 32);
        if (f >= b) return -1;
        if (__atomic_compare_exchange_n(&s->span, &old, old + 1, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return (int)f;
    }
}

/* the back tile of share s, or -1 */
static int take_back(sdk_share *s) {
    unsigned long long old = __atomic_load_n(&s->span, __ATOMIC_RELAXED);
    for (;;) {
        unsigned f = (unsigned)old, b = (unsigned)(old >> 32);
        if (f >= b) return -1;
        unsigned long long nw = (old & 0xffffffffull) | ((unsigned long long)(b - 1) << 32);
        if (__atomic_compare_exchange_n(&s->span, &old, nw, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return (int)(b - 1);
    }
}

/* thread me's next tile: its own share's front, then (steal) the others' backs, or -1 */
static int next_tile(sdk_share *share, int me, int n, int steal) {
    int t = me < n ? take_front(&share[me]) : -1;
    if (t >= 0 || !steal) return t;
    for (int i = 1; i < n; i++)
        if ((t = take_back(&share[(me + i) % n])) >= 0) return t;
    return -1;
}

/* y [m, n] (ldy floats apart) = the rows sdk_quantize left on this thread times W^T, W packed as
 * `type` with nblk blocks per tile (Q4_K, Q6_K: 256 inputs; Q8_0, Q5_0, Q4_0, Q3_0: 32), then + bias [n] and
 * + res [m, n] (ldr floats apart) when given, in that order (one IEEE add each). Returns 0, or
 * -1 (bad arguments, or no rows of this m and k quantized), -2 (path not runnable). */
int sdk_product(int type, const uint8_t *w, int n, int nblk, int k, int m, float *y, long ldy, const float *bias,
                const float *res, long ldr, int isa, int nthreads) {
    if (type < SDK_Q4K || type > SDK_Q3_0 || n <= 0 || nblk <= 0 || k <= 0 || m < 0 || ldy < n) return -1;
    int blk = type == SDK_Q4K || type == SDK_Q6K ? SDK_QK : 32;
    if ((long)nblk * blk < k || (long)(nblk - 1) * blk >= k) return -1;
    if (res && ldr < n) return -1;
    if (!sdk_isa_runs(isa)) return -2;
    if (m == 0) return 0;
    if (m != t_m || k != t_k) return -1;
    int kp = ((k + SDK_QK - 1) / SDK_QK) * SDK_QK;
    size_t rec = record_bytes(type);
    sdk_act act = {t_xq, t_xa, t_xs, t_xp, t_xw, kp, t_xt_built ? t_xt : 0, m + 16};
    sdk_tile_fn fn = path(isa);
    int tiles = (n + SDK_TILE - 1) / SDK_TILE;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > tiles) nthreads = tiles;
    sdk_share share[SDK_MAX_THREADS];
    if (nthreads > SDK_MAX_THREADS) nthreads = SDK_MAX_THREADS;
    for (int i = 0; i < nthreads; i++) share_init(&share[i], tiles, nthreads, i);
    const int steal = sdk_steal;
#pragma omp parallel num_threads(nthreads)
    {
    /* a team smaller than asked (nested, or a limit): the missing threads' shares are stolen */
    const int me = omp_get_thread_num(), whole = omp_get_num_threads() == nthreads;
    for (int t; (t = next_tile(share, me, nthreads, steal || !whole)) >= 0;) {
        uint8_t scratch[16384] __attribute__((aligned(64)));
        /* the AMX path decodes a tile's records once per SDK_AMX_ROWS rows (a 657-token prefill of
         * the 1.5B 0.92x the time of chunks of SDK_ROWS; 512 rows: 0.91x) */
        float acc[SDK_AMX_ROWS * SDK_TILE] __attribute__((aligned(64)));
        const int chunk = isa == SDK_ISA_AMX ? SDK_AMX_ROWS : SDK_ROWS;
        const uint8_t *wt = w + (size_t)t * nblk * rec;
        const int c0 = t * SDK_TILE, cols = n - c0 < SDK_TILE ? n - c0 : SDK_TILE;
        for (int m0 = 0; m0 < m; m0 += chunk) {
            int m1 = m0 + chunk < m ? m0 + chunk : m;
            /* the output (and residual) lines of a chunk of many rows, fetched while it multiplies:
             * they lie one row of y apart, each a miss when written (a 657-token prefill of the
             * 1.5B 0.93x the time; a few rows' lines stay in cache anyway) */
            if (m1 - m0 >= 16)
                for (int r = m0; r < m1; r++) {
                    __builtin_prefetch(y + (size_t)r * ldy + c0, 1, 3);
                    if (res) __builtin_prefetch(res + (size_t)r * ldr + c0, 0, 3);
                }
            fn(type, wt, nblk, &act, m0, m1, acc, scratch);
            for (int r = m0; r < m1; r++) {
                float *yr = y + (size_t)r * ldy + c0;
                const float *a = acc + (r - m0) * SDK_TILE;
                if (!bias && !res) {
                    memcpy(yr, a, cols * sizeof(float));
                    continue;
                }
                for (int c = 0; c < cols; c++) {
                    float v = a[c];
                    if (bias) v += bias[c0 + c];
                    if (res) v += res[(size_t)r * ldr + c0 + c];
                    yr[c] = v;
                }
            }
        }
    }
    if (isa == SDK_ISA_AMX) sdk_amx_release(); /* this thread's tile state, set by its tiles */
    }
    return 0;
}

/* sdk_quantize then sdk_product: one projection in one call */
int sdk_linear_ex(int type, const uint8_t *w, int n, int nblk, int k, const float *x, long ldx, int m, float *y,
                  long ldy, int pre, const float *pre_w, float eps, const float *bias, const float *res, long ldr,
                  int isa, int nthreads) {
    if (type < SDK_Q4K || type > SDK_Q3_0) return -1;
    int rc = sdk_quantize(x, ldx, m, k, pre, pre_w, eps, isa, nthreads);
    return rc ? rc : sdk_product(type, w, n, nblk, k, m, y, ldy, bias, res, ldr, isa, nthreads);
}

/* y [m, n] = x [m, k] W^T (rows contiguous): sdk_linear_ex without pre-pass, bias or residual */
int sdk_linear(int type, const uint8_t *w, int n, int nblk, int k, const float *x, int m, float *y, int isa,
               int nthreads) {
    return sdk_linear_ex(type, w, n, nblk, k, x, k, m, y, n, 0, 0, 0.0f, 0, 0, 0, isa, nthreads);
}
