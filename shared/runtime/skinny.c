/* Skinny fp32 GEMM for CPU decode steps: y[M][N] = x[M][K] @ W^T, for the few rows of a decode step.
 *
 * A decode step multiplies a handful of rows by every weight of the model, so it should cost one
 * read of the weights. BLAS kernels are tuned for big M: at 8 rows MKL and oneDNN read the weights
 * at 16-26 GB/s on our 2-core hosts, where one row streams at 36-46. This kernel keeps a 32-column
 * block of every row of x in registers while it streams that block's weights once, and computes up
 * to 12 rows per pass (2 with AVX2 only); the rows past the first pass find the block in L2.
 *
 * W is packed by skinny.py as [N / 16][K][16]: for each 16 output columns, their K weights
 * interleaved, so a column pair's weights are two sequential streams. N must be a multiple of 32.
 * Each output is a plain fp32 sum over k in order (one fused multiply-add per step).
 *
 * Built by shared/runtime/skinny.py with `cc -O3 -march=native -fopenmp`; GCC's vector extension
 * gives one AVX-512 register per v16 (two AVX2 registers where that is all the CPU has). The
 * OpenMP runtime is torch's own libgomp (the same SONAME, already loaded), so the threads are
 * the ones torch's operators use. */
#include <stddef.h>
#include <string.h>

#define PREFETCH_AHEAD 64 /* k steps (one 64-byte line each) ahead of the loads */

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef void (*tile_fn)(const float *x, const float *w, float *y, int K, int N);

/* Rows [0, MR) of x times one 32-column block w (two [K][16] streams) into y (row stride N). */
#define TILE(MR)                                                                                   \
    static void tile##MR(const float *x, const float *w0, float *y, int K, int N) {                \
        v16 acc0[MR], acc1[MR];                                                                    \
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) acc0[r] = acc1[r] = (v16){0};       \
        const float *w1 = w0 + (size_t)K * 16;                                                     \
        for (int k = 0; k < K; k++) {                                                              \
            __builtin_prefetch(w0 + (size_t)(k + PREFETCH_AHEAD) * 16);                            \
            __builtin_prefetch(w1 + (size_t)(k + PREFETCH_AHEAD) * 16);                            \
            v16 a = *(const v16 *)(w0 + (size_t)k * 16), b = *(const v16 *)(w1 + (size_t)k * 16);  \
            _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) {                                \
                float xs = x[(size_t)r * K + k];                                                   \
                acc0[r] += a * xs;                                                                 \
                acc1[r] += b * xs;                                                                 \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) {                                    \
            memcpy(y + (size_t)r * N, &acc0[r], 64);                                               \
            memcpy(y + (size_t)r * N + 16, &acc1[r], 64);                                          \
        }                                                                                          \
    }

TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8) TILE(12)

static const tile_fn TILES[13] = {0, tile1, tile2, tile3, tile4, tile5, tile6, tile7, tile8, 0, 0, 0, tile12};
#if defined(__AVX512F__)
#define PASS_ROWS 12 /* 24 accumulators and 2 weight registers of AVX-512's 32; 9-11 go as 8 + rest */
#else
#define PASS_ROWS 2 /* a v16 is two AVX2 registers: 8 accumulators and 4 weight registers of 16 */
#endif

int skinny_abi(void) { return 1; }

void skinny_linear(const float *x, const float *w, float *y, int M, int K, int N, int threads) {
    int blocks = N / 32;
#pragma omp parallel num_threads(threads)
    {
        extern int omp_get_thread_num(void), omp_get_num_threads(void);
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int b = blocks * t / nt; b < blocks * (t + 1) / nt; b++) {
            const float *wb = w + (size_t)b * 32 * K;
            for (int r = 0; r < M;) {
                int m = M - r >= PASS_ROWS ? PASS_ROWS : M - r > 8 ? 8 : M - r;
                TILES[m](x + (size_t)r * K, wb, y + (size_t)r * N + (size_t)b * 32, K, N);
                r += m;
            }
        }
    }
}
