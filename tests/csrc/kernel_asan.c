/* A bounds check of the kernel (tests/test_kernels.py builds it with -fsanitize=address): reads
 * cases written by the test (weight tiles and rows in buffers of their exact size), runs every
 * path this CPU runs and compares each to the scalar reference bit for bit. AddressSanitizer
 * aborts on any read or write past a buffer; a mismatch exits 1. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int sdk_linear(int type, const uint8_t *w, int n, int nblk, int k, const float *x, int m, float *y, int isa,
               int nthreads);
int sdk_isa_runs(int isa);

int main(int argc, char **argv) {
    FILE *f = fopen(argv[1], "rb");
    if (!f) return 2;
    int head[6], cases = 0, paths = 0;
    while (fread(head, sizeof(int), 6, f) == 6) {
        int type = head[0], n = head[1], nblk = head[2], k = head[3], m = head[4], wbytes = head[5];
        uint8_t *w = malloc(wbytes);
        float *x = malloc(sizeof(float) * (size_t)m * k);
        float *want = malloc(sizeof(float) * (size_t)m * n), *got = malloc(sizeof(float) * (size_t)m * n);
        if (fread(w, 1, wbytes, f) != (size_t)wbytes || fread(x, sizeof(float), (size_t)m * k, f) != (size_t)m * k)
            return 2;
        if (sdk_linear(type, w, n, nblk, k, x, m, want, 0, 1) != 0) return 3;
        for (int isa = 1; isa < 4; isa++) {
            if (!sdk_isa_runs(isa)) continue;
            for (int threads = 1; threads <= 2; threads++) {
                if (sdk_linear(type, w, n, nblk, k, x, m, got, isa, threads) != 0) return 3;
                if (memcmp(got, want, sizeof(float) * (size_t)m * n) != 0) {
                    fprintf(stderr, "path %d differs from the reference (type %d, %d x %d, %d rows)\n", isa, type, n, k, m);
                    return 1;
                }
                paths++;
            }
        }
        free(w); free(x); free(want); free(got);
        cases++;
    }
    printf("%d cases, %d path runs\n", cases, paths);
    return 0;
}
