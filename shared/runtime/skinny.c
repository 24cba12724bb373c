/* Skinny GEMM for CPU steps: y[M][N] = x[M][K] @ W^T, W in fp32 or bfloat16, x, y and the sums in fp32.
 *
 * A decode step multiplies a handful of rows by every weight of the model, so it should cost one
 * read of the weights. BLAS kernels are tuned for big M: at 8 rows MKL and oneDNN read the weights
 * at 16-26 GB/s on our 2-core hosts, where one row streams at 36-46. This kernel keeps a 32-column
 * block of every row of x in registers while it streams that block's weights once, and computes up
 * to 12 rows per pass (2 with AVX2 only); the rows past the first pass find the block in L2.
 *
 * W is packed by skinny.py as [N / 16][K][16]: for each 16 output columns, their K weights
 * interleaved, so a column pair's weights are two sequential streams. N must be a multiple of 32.
 * Each output is a plain fp32 sum over k in order (one fused multiply-add per step), so a row's
 * result does not depend on the other rows, the thread count or M: the kernel is batch-invariant.
 * bf16 weights are widened exactly to fp32 as they stream: half the bytes of fp32, the same sums.
 * Rows are swept in chunks of ROW_CHUNK, so a prefill chunk's inputs stay in L2 across blocks.
 *
 * Built by shared/runtime/skinny.py with `cc -O3 -march=native -fopenmp`; GCC's vector extension
 * gives one AVX-512 register per v16 (two AVX2 registers where that is all the CPU has). The
 * OpenMP runtime is torch's own libgomp (the same SONAME, already loaded), so the threads are
 * the ones torch's operators use. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define PREFETCH_AHEAD 64 /* k steps ahead of the loads */
#define ROW_CHUNK 96 /* rows per sweep over the column blocks: their x stays in L2 while the blocks stream */

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));
typedef uint16_t v16h __attribute__((vector_size(32), aligned(2)));
typedef void (*tile_fn)(const float *x, const void *w, float *y, int K, int N);

static inline v16 load_f32(const float *p) { return *(const v16 *)p; }

/* 16 bfloat16 weights as fp32: the bf16 bits are the top half of the fp32 bits, so this is exact. */
static inline v16 load_bf16(const uint16_t *p) {
    v16h h = *(const v16h *)p;
    v16i w = __builtin_convertvector(h, v16i) << 16;
    return (v16)w;
}

/* Rows [0, MR) of x times one 32-column block w (two [K][16] streams) into y (row stride N). */
#define TILE(NAME, T, LOAD, MR)                                                                    \
    static void NAME##MR(const float *x, const void *wv, float *y, int K, int N) {                 \
        const T *w0 = wv, *w1 = w0 + (size_t)K * 16;                                               \
        v16 acc0[MR], acc1[MR];                                                                    \
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) acc0[r] = acc1[r] = (v16){0};       \
        for (int k = 0; k < K; k++) {                                                              \
            __builtin_prefetch(w0 + (size_t)(k + PREFETCH_AHEAD) * 16);                            \
            __builtin_prefetch(w1 + (size_t)(k + PREFETCH_AHEAD) * 16);                            \
            v16 a = LOAD(w0 + (size_t)k * 16), b = LOAD(w1 + (size_t)k * 16);                      \
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
#define TILES(NAME, T, LOAD)                                                                       \
    TILE(NAME, T, LOAD, 1) TILE(NAME, T, LOAD, 2) TILE(NAME, T, LOAD, 3) TILE(NAME, T, LOAD, 4)    \
    TILE(NAME, T, LOAD, 5) TILE(NAME, T, LOAD, 6) TILE(NAME, T, LOAD, 7) TILE(NAME, T, LOAD, 8)    \
    TILE(NAME, T, LOAD, 12)                                                                        \
    static const tile_fn NAME[13] = {0, NAME##1, NAME##2, NAME##3, NAME##4, NAME##5, NAME##6,      \
                                     NAME##7, NAME##8, 0, 0, 0, NAME##12};

TILES(f32_tile, float, load_f32)
TILES(bf16_tile, uint16_t, load_bf16)

#if defined(__AVX512F__)
#define PASS_ROWS 12 /* 24 accumulators and 2 weight registers of AVX-512's 32; 9-11 go as 8 + rest */
#else
#define PASS_ROWS 2 /* a v16 is two AVX2 registers: 8 accumulators and 4 weight registers of 16 */
#endif

int skinny_abi(void) { return 2; }

static void run(const tile_fn *tiles, size_t item, const float *x, const char *w, float *y, int M, int K, int N,
                int threads) {
    int blocks = N / 32;
#pragma omp parallel num_threads(threads)
    {
        extern int omp_get_thread_num(void), omp_get_num_threads(void);
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int r0 = 0; r0 < M; r0 += ROW_CHUNK) {
            int r1 = M - r0 > ROW_CHUNK ? r0 + ROW_CHUNK : M;
            for (int b = blocks * t / nt; b < blocks * (t + 1) / nt; b++) {
                const char *wb = w + (size_t)b * 32 * K * item;
                for (int r = r0; r < r1;) {
                    int m = r1 - r >= PASS_ROWS ? PASS_ROWS : r1 - r > 8 ? 8 : r1 - r;
                    tiles[m](x + (size_t)r * K, wb, y + (size_t)r * N + (size_t)b * 32, K, N);
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
