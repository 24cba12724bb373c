/* Skinny GEMM for CPU steps: y[M][N] = x[M][K] @ W^T, W in fp32 or bfloat16, x, y and the sums in fp32.
 *
 * A decode step multiplies a handful of rows by every weight of the model, so it should cost one
 * read of the weights. BLAS kernels are tuned for big M: at 8 rows MKL and oneDNN read the weights
 * at 16-26 GB/s on our 2-core hosts, where one row streams at 36-46. This kernel keeps a block of
 * two vectors' columns (32 with AVX-512, 16 with AVX2) of every row of x in registers while it
 * streams that block's weights once, and computes up to PASS_ROWS rows per pass (12 with AVX-512,
 * 6 with AVX2); the rows past the first pass find the block in L2.
 *
 * W is packed by skinny.py as [N / 16][K][16]: for each 16 output columns, their K weights
 * interleaved, so a block's weights are one or two sequential streams. N must be a multiple of 32.
 * Each output is a plain fp32 sum over k in order (one fused multiply-add per step), so a row's
 * result does not depend on the other rows, the thread count, M or the vector width: the kernel
 * is batch-invariant, and AVX2 and AVX-512 builds give the same bits.
 * bf16 weights are widened exactly to fp32 as they stream: half the bytes of fp32, the same sums.
 * Rows are swept in chunks of ROW_CHUNK, so a prefill chunk's inputs stay in L2 across blocks.
 *
 * Built by shared/runtime/skinny.py with `cc -O3 -march=native -ffp-contract=off -fopenmp`; simd.h
 * has the vector types (one register each, as wide as the CPU's) and the fused multiply-add. The
 * OpenMP runtime is torch's own libgomp (the same SONAME, already loaded), so the threads are
 * the ones torch's operators use. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define PREFETCH_AHEAD 64 /* k steps ahead of the loads */
#define ROW_CHUNK 96 /* rows per sweep over the column blocks: their x stays in L2 while the blocks stream */
#define COLS (2 * VW) /* columns per block: two vectors of each row */
#if VW == 16
#define PASS_ROWS 12 /* 24 accumulators and 2 weight registers of AVX-512's 32; 9-11 go as 8 + rest */
#else
#define PASS_ROWS 6 /* 12 accumulators, 2 weights and a broadcast of AVX2's 16 (2 rows x 32 columns
                     * ran prefills at 0.5x MKL on an AMD EPYC) */
#endif

typedef void (*tile_fn)(const float *x, const void *w, float *y, int K, int N);

static inline vf load_bf16(const uint16_t *p) { return widen_bf16(p); }

/* Rows [0, MR) of x times one block of COLS columns, w (COLS / 16 [K][16] streams), into y (row
 * stride N). Vector j of a row holds columns [j * VW, (j + 1) * VW): stream j * VW / 16. */
#define TILE(NAME, T, LOAD, MR)                                                                    \
    static void NAME##MR(const float *x, const void *wv, float *y, int K, int N) {                 \
        const T *w = wv;                                                                           \
        vf acc[MR][2];                                                                             \
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = (vf){0};     \
        for (int k = 0; k < K; k++) {                                                              \
            _Pragma("GCC unroll 2") for (int s = 0; s < COLS / 16; s++)                            \
                __builtin_prefetch(w + ((size_t)s * K + k + PREFETCH_AHEAD) * 16);                 \
            vf a[2];                                                                               \
            _Pragma("GCC unroll 2") for (int j = 0; j < 2; j++)                                    \
                a[j] = LOAD(w + ((size_t)(j * VW / 16) * K + k) * 16 + j * VW % 16);               \
            _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) {                                \
                vf xs = splat(x[(size_t)r * K + k]);                                               \
                acc[r][0] = fmav(a[0], xs, acc[r][0]);                                             \
                acc[r][1] = fmav(a[1], xs, acc[r][1]);                                             \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) {                                    \
            store_f32(y + (size_t)r * N, acc[r][0]);                                               \
            store_f32(y + (size_t)r * N + VW, acc[r][1]);                                          \
        }                                                                                          \
    }
#define TILES(NAME, T, LOAD)                                                                       \
    TILE(NAME, T, LOAD, 1) TILE(NAME, T, LOAD, 2) TILE(NAME, T, LOAD, 3) TILE(NAME, T, LOAD, 4)    \
    TILE(NAME, T, LOAD, 5) TILE(NAME, T, LOAD, 6) TILE(NAME, T, LOAD, 7) TILE(NAME, T, LOAD, 8)    \
    TILE(NAME, T, LOAD, 12)                                                                        \
    static const tile_fn NAME[13] = {0, NAME##1, NAME##2, NAME##3, NAME##4, NAME##5, NAME##6,      \
                                     NAME##7, NAME##8, 0, 0, 0, NAME##12};

TILES(f32_tile, float, load_f32)
TILES(bf16_tile, uint16_t, load_bf16)

int skinny_abi(void) { return 2; }

static void run(const tile_fn *tiles, size_t item, const float *x, const char *w, float *y, int M, int K, int N,
                int threads) {
    int blocks = N / COLS;
#pragma omp parallel num_threads(threads)
    {
        extern int omp_get_thread_num(void), omp_get_num_threads(void);
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int r0 = 0; r0 < M; r0 += ROW_CHUNK) {
            int r1 = M - r0 > ROW_CHUNK ? r0 + ROW_CHUNK : M;
            for (int b = blocks * t / nt; b < blocks * (t + 1) / nt; b++) {
                const char *wb = w + (size_t)b * COLS * K * item;
                for (int r = r0; r < r1;) {
                    int m = r1 - r >= PASS_ROWS ? PASS_ROWS : r1 - r > 8 ? 8 : r1 - r;
                    tiles[m](x + (size_t)r * K, wb, y + (size_t)r * N + (size_t)b * COLS, K, N);
                    r += m;
                }
            }
        }
    }
}

/* fp32 weights packed [N/16][K][16]. */
void skinny_linear(const float *x, const float *w, float *y, int M, int K, int N, int threads) {
    run(f32_tile, sizeof(float), x, (const char *)w, y, M, K, N, threads);
}

/* bfloat16 weights packed [N/16][K][16]; x and y fp32, each weight widened exactly to fp32. */
void skinny_linear_bf16(const float *x, const uint16_t *w, float *y, int M, int K, int N, int threads) {
    run(bf16_tile, sizeof(uint16_t), x, (const char *)w, y, M, K, N, threads);
}
