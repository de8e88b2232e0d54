/* The kernel's entry points: which instruction sets this CPU and OS run (cpuid + xgetbv), the
 * activation quantizer, and the product split over output tiles on OpenMP threads (torch's own
 * runtime when the build links it: one pool, no oversubscription). */
#include <cpuid.h>
#include <stdlib.h>
#include <string.h>

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

int sdk_abi_version(void) { return 2; }

void sdk_set_fault(int on) { sdk_fault = on; }

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
        unsigned int a1, b1, c1, d1;
        if (!__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) return 0;
        return (a1 >> 4) & 1;
    }
    if (isa == SDK_ISA_AVX512VNNI)
        return avx512f && avx512bw && avx512vl && avx512vnni && (xcr0 & 0xe0) == 0xe0;
    return 0;
}

static sdk_tile_fn path(int isa) {
    switch (isa) {
    case SDK_ISA_REF: return sdk_tile_ref;
    case SDK_ISA_AVX2: return sdk_tile_avx2;
    case SDK_ISA_AVXVNNI: return sdk_tile_avxvnni;
    case SDK_ISA_AVX512VNNI: return sdk_tile_avx512vnni;
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

static __thread int8_t *t_xq;
static __thread float *t_xa;
static __thread int32_t *t_xs, *t_xp;
static __thread size_t t_rows_cap, t_kp_cap;

/* y [m, n] = x [m, k] W^T, W packed as `type` with nblk blocks per tile (Q4_K, Q6_K: 256 inputs;
 * Q8_0, Q5_0: 32). Returns 0, or -1 (bad arguments), -2 (path not runnable), -3 (out of memory). */
int sdk_linear(int type, const uint8_t *w, int n, int nblk, int k, const float *x, int m, float *y, int isa,
               int nthreads) {
    if (type < SDK_Q4K || type > SDK_Q5_0 || n <= 0 || nblk <= 0 || k <= 0 || m < 0) return -1;
    int blk = type == SDK_Q8_0 || type == SDK_Q5_0 ? 32 : SDK_QK;
    if ((long)nblk * blk < k) return -1;
    if (!sdk_isa_runs(isa)) return -2;
    if (m == 0) return 0;
    int kp = ((nblk * blk + SDK_QK - 1) / SDK_QK) * SDK_QK;
    size_t rec = type == SDK_Q4K   ? SDK_Q4K_REC
                 : type == SDK_Q6K ? SDK_Q6K_REC
                 : type == SDK_Q8_0 ? SDK_Q8_REC
                                    : SDK_Q5_REC;
    if ((size_t)m > t_rows_cap || (size_t)kp > t_kp_cap) {
        size_t rows = (size_t)m > t_rows_cap ? (size_t)m : t_rows_cap;
        size_t cols = (size_t)kp > t_kp_cap ? (size_t)kp : t_kp_cap;
        free(t_xq); free(t_xa); free(t_xs); free(t_xp);
        t_xq = malloc(rows * cols);
        t_xa = malloc(rows * (cols / SDK_QK) * sizeof(float));
        t_xs = malloc(rows * (cols / 16) * sizeof(int32_t));
        t_xp = malloc(rows * (cols / 64) * sizeof(int32_t));
        if (!t_xq || !t_xa || !t_xs || !t_xp) {
            free(t_xq); free(t_xa); free(t_xs); free(t_xp);
            t_xq = 0; t_xa = 0; t_xs = 0; t_xp = 0; t_rows_cap = t_kp_cap = 0;
            return -3;
        }
        t_rows_cap = rows; t_kp_cap = cols;
    }
    /* every SIMD path runs on AVX2 CPUs: their rows are quantized by the AVX2 copy of the
     * reference's quantizer (the same bits; the self-check compares the paths with the reference) */
    void (*quantize)(const float *, int, int, int8_t *, float *, int32_t *, int32_t *) =
        isa != SDK_ISA_REF && sdk_quantize_row_avx2 ? sdk_quantize_row_avx2 : sdk_quantize_row;
    if (nthreads < 1) nthreads = 1;
    int qthreads = m >= 16 ? nthreads : 1;
    /* this thread's buffers (the workers have thread-local pointers of their own) */
    int8_t *xq = t_xq;
    float *xa = t_xa;
    int32_t *xs = t_xs, *xp = t_xp;
#pragma omp parallel for num_threads(qthreads) schedule(static)
    for (int r = 0; r < m; r++)
        quantize(x + (size_t)r * k, k, kp, xq + (size_t)r * kp, xa + (size_t)r * (kp / SDK_QK),
                 xs + (size_t)r * (kp / 16), xp + (size_t)r * (kp / 64));
    sdk_act act = {xq, xa, xs, xp, kp};
    sdk_tile_fn fn = path(isa);
    int tiles = (n + SDK_TILE - 1) / SDK_TILE;
    if (nthreads > tiles) nthreads = tiles;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < tiles; t++) {
        uint8_t scratch[16384] __attribute__((aligned(64)));
        float acc[SDK_ROWS * SDK_TILE] __attribute__((aligned(64)));
        const uint8_t *wt = w + (size_t)t * nblk * rec;
        int cols = n - t * SDK_TILE < SDK_TILE ? n - t * SDK_TILE : SDK_TILE;
        for (int m0 = 0; m0 < m; m0 += SDK_ROWS) {
            int m1 = m0 + SDK_ROWS < m ? m0 + SDK_ROWS : m;
            fn(type, wt, nblk, &act, m0, m1, acc, scratch);
            for (int r = m0; r < m1; r++)
                memcpy(y + (size_t)r * n + t * SDK_TILE, acc + (r - m0) * SDK_TILE, cols * sizeof(float));
        }
    }
    return 0;
}
