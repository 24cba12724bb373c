/* Batch-invariant CPU kernels: attention over the paged KV pool, and RMSNorm.
 *
 * "Batch-invariant": a row's result is a fixed sequence of float operations on that row's own
 * inputs. It does not depend on which other rows share the call, on how many threads run it, or
 * on whether the row is a decode step or one position of a prefill chunk or extend. So a
 * sequence decoded step by step, recomputed in one extend on another instance, or batched with
 * fifteen others, gets the same bits, and greedy decoding gives the same text on every route.
 *
 * Attention, per query row t and query head (a row sees keys [0, lens[t]) of its sequence):
 *   s_j = hsum(q * k_j) * scale          j in order; hsum adds the 16 lanes in one fixed tree
 *   m   = max_j s_j;  p_j = exp(s_j - m)   vexp below: the same polynomial on every lane
 *   l   = lane sums of p over j (lane = j mod 16), then hsum
 *   o   = (sum_j p_j v_j, j in order) / l
 * K and V are read in place from the pool ([slots][kv_heads][head_dim], fp32 or bf16) through
 * each row's block table, 16 keys at a time widened to fp32 (and asked for a few blocks ahead):
 * nothing is gathered per step. Consecutive rows of one sequence (a prefill chunk or an extend)
 * form a tile that shares every K and V load; a tile's rows are computed with the same
 * operations as a row alone. Work is split over (tile, KV head) pairs, each done by one thread
 * from start to end; a thread takes a tile's heads together when there are tiles enough.
 *
 * Built by shared/runtime/skinny.py's `build` like skinny.c; simd.h has the vector types (one
 * register each, as wide as the CPU's) and the one fused multiply-add. The sums are 16 lanes wide
 * on every CPU, so AVX2 and AVX-512 builds give the same bits. The OpenMP runtime is torch's own
 * libgomp. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#if VW == 16
#define PV_ROWS 4 /* P x V: query vectors whose sums stay in registers, PV_VECS vectors each */
#define PV_VECS 4
#else
#define PV_ROWS 3 /* 12 sums of AVX2's 16 registers (timed on an AMD EPYC: 4 x 2 ran 1.5x slower) */
#define PV_VECS 4
#endif
#define PER16 (16 / VW) /* vectors per 16 lanes: every reduction below is 16 lanes wide on every CPU */

#define TILE_ROWS 32 /* rows of one sequence sharing K/V loads */
#define PREFETCH_BLOCKS 3 /* blocks of 16 keys asked for ahead of the one computed (2-6 timed: 3) */

int rows_abi(void) { return 1; }

static inline vf loadv(const void *base, int bf16, size_t at) {
    return bf16 ? widen_bf16((const uint16_t *)base + at) : load_f32((const float *)base + at);
}

/* The 16 lanes of a[0..PER16) summed in one fixed tree: halves, quarters, then (0+2) + (1+3). */
static inline float hsum(const vf *a) {
#if VW == 16
    v8 b = __builtin_shufflevector(a[0], a[0], 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(a[0], a[0], 8, 9, 10, 11, 12, 13, 14, 15);
#else
    v8 b = a[0] + a[1];
#endif
    v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
    float d0 = c[0] + c[2], d1 = c[1] + c[3];
    return d0 + d1;
}

/* e^x for x <= 0 (Cephes' expf polynomial, ~1 ulp); 0 below -87.3. */
static inline vf vexp(vf x) {
    const vf lo = (vf){0} - 87.3365f;
    vi under = x < lo;
    vi keep = ~under;
    x = (vf)(((vi)x & keep) | ((vi)lo & under));
    vf t = x * 1.44269504088896341f;
    vf n = (t + 12582912.0f) - 12582912.0f; /* round to nearest */
    vf r = fmav(n, (vf){0} - 0.693359375f, x);
    r = fmav(n, (vf){0} + 2.12194440e-4f, r);
    vf z = r * r;
    vf y = fmav((vf){0} + 1.9875691500E-4f, r, (vf){0} + 1.3981999507E-3f);
    y = fmav(y, r, (vf){0} + 8.3334519073E-3f);
    y = fmav(y, r, (vf){0} + 4.1665795894E-2f);
    y = fmav(y, r, (vf){0} + 1.6666665459E-1f);
    y = fmav(y, r, (vf){0} + 5.0000001201E-1f);
    y = fmav(y, z, r) + 1.0f;
    vi scale = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(y * (vf)scale) & keep);
}

struct attn {
    const float *q; /* [T][H][D] */
    const void *k, *v; /* the layer's pool: [S][KVH][D] */
    int bf16;
    const int32_t *tables; /* block tables, concatenated */
    const int64_t *table_at; /* [T] where row t's table starts in `tables` */
    const int32_t *lens; /* [T] keys row t sees */
    float *out; /* [T][H][D] */
    int H, KVH, D, block;
    float scale;
};

static inline size_t slot_of(const struct attn *a, const int32_t *table, int j) {
    return (size_t)table[j / a->block] * a->block + j % a->block;
}

/* The slot of key j0 + j, j < 16, for j0 a multiple of 16: one division per block of 16 keys,
 * which lie in one pool block when its size is a multiple of 16 (the shipped 16 is). */
static inline size_t slot_in_block(const struct attn *a, const int32_t *table, int j0, size_t first, int j) {
    return a->block % 16 == 0 ? first + j : slot_of(a, table, j0 + j);
}

/* The workspace of one thread: a tile's queries and P x V sums, one block of K or V in fp32, scores. */
struct work {
    vf *q, *acc; /* [nq][C]: C = head_dim / VW vectors per query vector */
    vf *block; /* [16][C]: 16 keys (or values) of one KV head, widened */
    float *scores; /* [nq][lpad] */
    int lpad;
};

/* out[j] = hsum(a[j]) * scale for 16 keys j, stored as vectors, bit for bit (the same pairs in the
 * same tree: halves, quarters, then (0+2) + (1+3)), in a quarter of the work: the keys' lanes are
 * reduced together. */
static inline void hsum16(const vf (*a)[PER16], float *out, float scale) {
#if VW == 16
    vf x[8], y[4], z[2];
    for (int m = 0; m < 8; m++)
        x[m] = __builtin_shufflevector(a[2 * m][0], a[2 * m + 1][0], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(a[2 * m][0], a[2 * m + 1][0], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int m = 0; m < 4; m++)
        y[m] = __builtin_shufflevector(x[2 * m], x[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(x[2 * m], x[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int m = 0; m < 2; m++)
        z[m] = __builtin_shufflevector(y[2 * m], y[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(y[2 * m], y[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    vf r = __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    store_f32(out, r * scale);
#else
    for (int half = 0; half < 16; half += 8) { /* halves of 8 keys: each step is one above */
        v8 x[8], y[4], z[2];
        for (int m = 0; m < 8; m++) x[m] = a[half + m][0] + a[half + m][1];
        for (int m = 0; m < 4; m++)
            y[m] = __builtin_shufflevector(x[2 * m], x[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(x[2 * m], x[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15);
        for (int m = 0; m < 2; m++)
            z[m] = __builtin_shufflevector(y[2 * m], y[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
                   __builtin_shufflevector(y[2 * m], y[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15);
        v8 r = __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14) +
               __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15);
        store_f32(out + half, r * scale);
    }
#endif
}

/* Keys (or values) [j0, j0 + 16) of KV head h into w->block as fp32; rows past `end` are zero. */
static void widen_block(const struct attn *a, const void *pool, const int32_t *table, int h, int j0, int end,
                        vf *out) {
    const int C = a->D / VW;
    const size_t first = j0 < end ? slot_of(a, table, j0) : 0;
    for (int j = 0; j < 16; j++) {
        if (j0 + j >= end) {
            memset(out + (size_t)j * C, 0, sizeof(vf) * (size_t)C);
            continue;
        }
        size_t at = (slot_in_block(a, table, j0, first, j) * a->KVH + h) * a->D;
        for (int c = 0; c < C; c++) out[(size_t)j * C + c] = loadv(pool, a->bf16, at + VW * c);
    }
}

/* Ask for keys (or values) [j0, j0 + 16) of KV head h while the block before them is computed:
 * a decode step's KV is read once, from memory, in 128-256 byte pieces that the hardware
 * prefetcher does not follow across blocks (without this, batch 8 read it at ~5 GB/s). */
static inline void prefetch_block(const struct attn *a, const void *pool, const int32_t *table, int h, int j0,
                                  int end) {
    const size_t item = a->bf16 ? 2 : 4, bytes = (size_t)a->D * item;
    if (j0 >= end) return;
    const size_t first = slot_of(a, table, j0);
    for (int j = 0; j < 16 && j0 + j < end; j++) {
        const char *row = (const char *)pool + (slot_in_block(a, table, j0, first, j) * a->KVH + h) * a->D * item;
        for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b);
    }
}

/* Rows [r0, r1) (one sequence, one table), KV head h. Query vector i is row r0 + i / G, head
 * h * G + i % G; it sees len[i] keys. Every query vector's operations are those it would get alone:
 * a longer row beside it only adds blocks where its p is 0 (acc + 0 * v == acc). C = head_dim / VW
 * is a constant in each instance (always_inline), so the inner loops unroll. Lane l of the 16-lane
 * sums is element l of vector l / VW, so AVX2 and AVX-512 builds do the same operations. */
static inline __attribute__((always_inline)) void tile_body(const struct attn *a, int r0, int r1, int h,
                                                            const struct work *w, const int C) {
    const int G = a->H / a->KVH, nq = (r1 - r0) * G, lpad = w->lpad, C16 = C / PER16;
    const int32_t *table = a->tables + a->table_at[r0];
    float *buf = w->scores;
    int L = 0;
    for (int r = r0; r < r1; r++) L = a->lens[r] > L ? a->lens[r] : L;
    const int Lpad = (L + 15) & ~15;
    int len[TILE_ROWS * 8];
    for (int i = 0; i < nq; i++) {
        int r = r0 + i / G, head = h * G + i % G;
        len[i] = a->lens[r];
        memcpy(w->q + (size_t)i * C, a->q + ((size_t)r * a->H + head) * a->D, (size_t)a->D * sizeof(float));
    }
    /* scores, 16 keys at a time: s_j = hsum(sum_c q_c * k_jc), c over 16-lane pieces, * scale */
    for (int j = 0; j < PREFETCH_BLOCKS * 16; j += 16) prefetch_block(a, a->k, table, h, j, L);
    for (int j0 = 0; j0 < L; j0 += 16) {
        int ahead = j0 + PREFETCH_BLOCKS * 16; /* past the keys: the first values */
        prefetch_block(a, ahead < Lpad ? a->k : a->v, table, h, ahead < Lpad ? ahead : ahead - Lpad, L);
        widen_block(a, a->k, table, h, j0, L, w->block);
        for (int i = 0; i < nq; i++) {
            if (j0 >= len[i]) continue;
            const vf *qi = w->q + (size_t)i * C;
            vf dot[16][PER16];
            for (int j = 0; j < 16; j++) {
                const vf *kj = w->block + (size_t)j * C;
                for (int p = 0; p < PER16; p++) {
                    vf acc = qi[p] * kj[p];
                    for (int c = 1; c < C16; c++) acc = fmav(qi[c * PER16 + p], kj[c * PER16 + p], acc);
                    dot[j][p] = acc;
                }
            }
            hsum16(dot, buf + (size_t)i * lpad + j0, a->scale);
        }
    }
    /* softmax: p in place (0 past a query's keys, up to the tile's), 1 / l per query */
    float inv[TILE_ROWS * 8];
    for (int i = 0; i < nq; i++) {
        float *s = buf + (size_t)i * lpad;
        int n = len[i], padded = (n + 15) & ~15;
        for (int j = n; j < padded; j++) s[j] = -INFINITY;
        vf mv[PER16], sum[PER16];
        for (int p = 0; p < PER16; p++) mv[p] = (vf){0} - INFINITY, sum[p] = (vf){0};
        for (int j = 0; j < padded; j += 16)
            for (int p = 0; p < PER16; p++) {
                vf x = load_f32(s + j + p * VW);
                mv[p] = (vf)(((vi)mv[p] & (vi)(mv[p] >= x)) | ((vi)x & (vi)(mv[p] < x)));
            }
        float m = mv[0][0];
        for (int l = 1; l < 16; l++) m = mv[l / VW][l % VW] > m ? mv[l / VW][l % VW] : m;
        for (int j = 0; j < padded; j += 16)
            for (int p = 0; p < PER16; p++) {
                vf e = vexp(load_f32(s + j + p * VW) - m);
                store_f32(s + j + p * VW, e);
                sum[p] += e;
            }
        memset(s + padded, 0, sizeof(float) * (size_t)(Lpad - padded));
        inv[i] = 1.0f / hsum(sum);
    }
    /* P x V: o_i = sum_j p_ij v_j, j in order, PV_ROWS query vectors' sums in registers at a time */
    vf *acc = w->acc;
    memset(acc, 0, sizeof(vf) * (size_t)nq * C);
    for (int j0 = 0; j0 < L; j0 += 16) {
        prefetch_block(a, a->v, table, h, j0 + PREFETCH_BLOCKS * 16, L);
        widen_block(a, a->v, table, h, j0, L, w->block);
        for (int c0 = 0; c0 < C; c0 += PV_VECS) {
            const int nc = C - c0 < PV_VECS ? C - c0 : PV_VECS;
            for (int i0 = 0; i0 < nq; i0 += PV_ROWS) {
                const int ni = nq - i0 < PV_ROWS ? nq - i0 : PV_ROWS;
                vf o[PV_ROWS][PV_VECS];
                for (int i = 0; i < ni; i++)
                    for (int c = 0; c < nc; c++) o[i][c] = acc[(size_t)(i0 + i) * C + c0 + c];
                const float *p = buf + (size_t)i0 * lpad + j0;
                for (int j = 0; j < 16; j++) {
                    const vf *vj = w->block + (size_t)j * C + c0;
                    for (int i = 0; i < ni; i++) {
                        float pij = p[(size_t)i * lpad + j];
                        for (int c = 0; c < nc; c++) o[i][c] = fmav(vj[c], splat(pij), o[i][c]);
                    }
                }
                for (int i = 0; i < ni; i++)
                    for (int c = 0; c < nc; c++) acc[(size_t)(i0 + i) * C + c0 + c] = o[i][c];
            }
        }
    }
    for (int i = 0; i < nq; i++) {
        int r = r0 + i / G, head = h * G + i % G;
        float *o = a->out + ((size_t)r * a->H + head) * a->D;
        for (int c = 0; c < C; c++) {
            store_f32(o + VW * c, acc[(size_t)i * C + c] * inv[i]);
        }
    }
}

static void attend_tile(const struct attn *a, int r0, int r1, int h, const struct work *w) {
    switch (a->D) {
    case 64: tile_body(a, r0, r1, h, w, 64 / VW); break;
    case 128: tile_body(a, r0, r1, h, w, 128 / VW); break;
    default: tile_body(a, r0, r1, h, w, a->D / VW); break;
    }
}

/* Attention of T query rows (see the header). Returns 0, or -1 for a shape it does not take. */
int attend_rows(const float *q, const void *k, const void *v, int bf16, const int32_t *tables,
                const int64_t *table_at, const int32_t *lens, float *out, int T, int H, int KVH, int D,
                int block, float scale, int threads) {
    if (D % 16 || D > 256 || H % KVH || H / KVH > 8 || T <= 0) return -1;
    struct attn a = {q, k, v, bf16, tables, table_at, lens, out, H, KVH, D, block, scale};
    int *starts = malloc(sizeof(int) * (size_t)(T + 1)), tiles = 0, lmax = 0;
    if (!starts) return -1;
    for (int r = 0; r < T; r++) {
        if (r == 0 || table_at[r] != table_at[r - 1] || r - starts[tiles - 1] == TILE_ROWS) starts[tiles++] = r;
        lmax = lens[r] > lmax ? lens[r] : lmax;
    }
    starts[tiles] = T;
    int lpad = (lmax + 15) & ~15, failed = 0;
    size_t nq = (size_t)TILE_ROWS * (H / KVH), vecs = nq * D; /* floats */
    /* A thread takes a tile's KV heads one after another where there are tiles enough to go round
     * (a decode step of 8 rows read its KV ~10% faster so; which thread does a task changes no bit). */
    const int chunk = tiles >= 2 * threads ? KVH : 1;
#pragma omp parallel num_threads(threads)
    {
        struct work w = {aligned_alloc(64, vecs * sizeof(float)), aligned_alloc(64, vecs * sizeof(float)),
                         aligned_alloc(64, (size_t)D * 16 * sizeof(float)),
                         aligned_alloc(64, ((nq * lpad * sizeof(float)) + 63) & ~(size_t)63), lpad};
        int ok = w.q && w.acc && w.block && w.scores;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, chunk)
        for (int t = 0; t < tiles * KVH; t++)
            if (ok) attend_tile(&a, starts[t / KVH], starts[t / KVH + 1], t % KVH, &w);
        free(w.q);
        free(w.acc);
        free(w.block);
        free(w.scores);
    }
    free(starts);
    return failed ? -1 : 0;
}

/* out[t] = (x[t] * 1 / sqrt(mean(x[t]^2) + eps)) * w, n a multiple of 16; rows in parallel. */
int rms_norm_rows(const float *x, const float *w, float *out, int T, int n, float eps, int threads) {
    if (n % 16) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (T > 1)
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * n;
        float *orow = out + (size_t)t * n;
        vf ss[PER16] = {{0}};
        for (int i = 0; i < n; i += 16)
            for (int p = 0; p < PER16; p++) {
                vf xi = load_f32(xr + i + p * VW);
                ss[p] = fmav(xi, xi, ss[p]);
            }
        float r = 1.0f / sqrtf(hsum(ss) / (float)n + eps);
        for (int i = 0; i < n; i += VW) {
            store_f32(orow + i, (load_f32(xr + i) * r) * load_f32(w + i));
        }
    }
    return 0;
}
