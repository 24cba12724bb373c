/* A Llama-family model's decoder layers in one call, batch-invariant (fused.py's layer loop in C).
 *
 * Why: at a decode step each layer is ~25 small tensor ops around the kernels (the norms, the
 * projections, attention): RoPE, the K/V store, silu(gate) * up, two residual adds, views and
 * copies. Each costs torch's dispatch and Python's interpreter more than its arithmetic, ~250 us per
 * layer on our 2-core hosts, a third of a batch-1 bf16 step. Here a step's T rows go through every
 * layer with one ctypes call; the kernels are skinny.c's and rows.c's own (included below).
 *
 * Per layer, for h [T][hidden] in place (the same math as fused.py's `_layer`):
 *   x = rms_norm(h, ln1); qkv = x W_qkv^T; RoPE on q and k; K/V stored in the pool at `slots`;
 *   a = attention of q over the pool (rows.c); h += a W_o^T;
 *   x = rms_norm(h, ln2); gu = x W_gate_up^T; act = silu(gate) * up; h += act W_down^T.
 * Every element's operations are fixed and its own: a row's bits do not depend on the rows beside
 * it or the thread count, as in the kernels. RoPE is `x * cos + swap_halves(x) * sin_signed` (two
 * products and a sum, each rounded, as torch's ops round them); the K/V store rounds fp32 to a
 * bf16 pool to nearest-even, as torch's conversion does. silu is x * sigmoid(x) with rows.c's
 * exponential: its own bits, not torch's; every batch-invariant forward takes this path, so a
 * decode step, an extend and a prefill chunk still agree bit for bit.
 *
 * Built like the kernels it includes (shared/runtime/skinny.py's `build`). */
#include "rows.c"
#include "skinny.c"

int layers_abi(void) { return 1; }

struct model {
    int layers, hidden, H, KVH, D, inter, weights_bf16;
    float eps, scale;
    const void *const *qkv, *const *o, *const *gate_up, *const *down; /* [layers], packed by skinny.py */
    const float *const *ln1, *const *ln2; /* [layers] RMSNorm weights, fp32 */
};

struct step {
    float *h; /* [T][hidden], in place */
    int T;
    const float *cos, *sin; /* [T][D]: each row's position's; sin with its first half negated */
    const int64_t *slots; /* [T] where each row's K/V goes */
    void *pool; /* [layers][2][S][KVH][D], fp32 or bf16 */
    int pool_bf16;
    int64_t pool_slots; /* S */
    const int32_t *tables; /* rows.c's plan (rows.py `plan`) */
    const int64_t *table_at;
    const int32_t *lens;
    int block, threads;
};

static void linear(const struct model *m, const void *w, const float *x, float *y, int T, int K, int N, int threads) {
    if (m->weights_bf16)
        skinny_linear_bf16(x, w, y, T, K, N, threads);
    else
        skinny_linear(x, w, y, T, K, N, threads);
}

/* x[0, n) = x * cos + swap_halves(x) * sin, for one head of one row (n = head_dim). */
static inline void rope(float *x, const float *cos, const float *sin, int n) {
    float swapped[256];
    const int half = n / 2;
    memcpy(swapped, x + half, sizeof(float) * half);
    memcpy(swapped + half, x, sizeof(float) * half);
    for (int i = 0; i < n; i += VW) {
        vf a = load_f32(x + i) * load_f32(cos + i);
        vf b = load_f32(swapped + i) * load_f32(sin + i);
        store_f32(x + i, a + b);
    }
}

/* fp32 to bf16, rounded to nearest-even, NaN to the quiet NaN: torch's conversion. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static void store_kv(const struct step *s, int layer, int which, const float *src, int width, int stride) {
    const size_t per_slot = (size_t)width, base = ((size_t)layer * 2 + which) * (size_t)s->pool_slots * per_slot;
    for (int t = 0; t < s->T; t++) {
        const float *x = src + (size_t)t * stride;
        const size_t at = base + (size_t)s->slots[t] * per_slot;
        if (s->pool_bf16) {
            uint16_t *out = (uint16_t *)s->pool + at;
            for (int i = 0; i < width; i++) out[i] = to_bf16(x[i]);
        } else {
            memcpy((float *)s->pool + at, x, sizeof(float) * per_slot);
        }
    }
}

/* h += x, [T][n] each (the residual). */
static void add_rows(float *h, const float *x, int T, int n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T > 16)
    for (int t = 0; t < T; t++)
        for (size_t i = (size_t)t * n; i < (size_t)(t + 1) * n; i += VW) store_f32(h + i, load_f32(h + i) + load_f32(x + i));
}

/* silu(g) * u = g * sigmoid(g) * u; sigmoid from e = exp(-|g|) (rows.c's vexp takes x <= 0). */
static inline vf silu_mul(vf g, vf u) {
    vi neg = g < 0;
    vf e = vexp((vf)((vi)g | (vi)splat(-0.0f))); /* -|g| */
    vf one = splat(1.0f), num = (vf)(((vi)e & neg) | ((vi)one & ~neg));
    return g * (num / (one + e)) * u;
}

/* Every layer of the model over the step's rows. 0, or -1 when a buffer cannot be had. */
int run_layers(const struct model *m, const struct step *s) {
    const int T = s->T, hidden = m->hidden, D = m->D, qkv_n = (m->H + 2 * m->KVH) * D, th = s->threads;
    const size_t kv_width = (size_t)m->KVH * D;
    float *x = malloc(sizeof(float) * (size_t)T * hidden), *qkv = malloc(sizeof(float) * (size_t)T * qkv_n);
    float *q = malloc(sizeof(float) * (size_t)T * m->H * D), *att = malloc(sizeof(float) * (size_t)T * m->H * D);
    float *gu = malloc(sizeof(float) * (size_t)T * 2 * m->inter), *act = malloc(sizeof(float) * (size_t)T * m->inter);
    int failed = !(x && qkv && q && att && gu && act) || D > 256 || D % VW || hidden % VW || m->inter % VW;
    for (int l = 0; l < m->layers && !failed; l++) {
        rms_norm_rows(s->h, m->ln1[l], x, T, hidden, m->eps, th);
        linear(m, m->qkv[l], x, qkv, T, hidden, qkv_n, th);
#pragma omp parallel for num_threads(th) schedule(static) if (T > 16)
        for (int t = 0; t < T; t++) {
            float *row = qkv + (size_t)t * qkv_n;
            for (int head = 0; head < m->H + m->KVH; head++)
                rope(row + (size_t)head * D, s->cos + (size_t)t * D, s->sin + (size_t)t * D, D);
            memcpy(q + (size_t)t * m->H * D, row, sizeof(float) * (size_t)m->H * D);
        }
        store_kv(s, l, 0, qkv + (size_t)m->H * D, (int)kv_width, qkv_n);
        store_kv(s, l, 1, qkv + (size_t)(m->H + m->KVH) * D, (int)kv_width, qkv_n);
        const size_t item = s->pool_bf16 ? 2 : 4, layer_k = (size_t)l * 2 * s->pool_slots * kv_width;
        const char *k = (const char *)s->pool + layer_k * item, *v = k + (size_t)s->pool_slots * kv_width * item;
        if (attend_rows(q, k, v, s->pool_bf16, s->tables, s->table_at, s->lens, att, T, m->H, m->KVH, D, s->block,
                        m->scale, th)) {
            failed = 1;
            break;
        }
        linear(m, m->o[l], att, x, T, m->H * D, hidden, th);
        add_rows(s->h, x, T, hidden, th);
        rms_norm_rows(s->h, m->ln2[l], x, T, hidden, m->eps, th);
        linear(m, m->gate_up[l], x, gu, T, hidden, 2 * m->inter, th);
#pragma omp parallel for num_threads(th) schedule(static) if (T > 16)
        for (int t = 0; t < T; t++) {
            const float *g = gu + (size_t)t * 2 * m->inter, *u = g + m->inter;
            for (int i = 0; i < m->inter; i += VW)
                store_f32(act + (size_t)t * m->inter + i, silu_mul(load_f32(g + i), load_f32(u + i)));
        }
        linear(m, m->down[l], act, x, T, m->inter, hidden, th);
        add_rows(s->h, x, T, hidden, th);
    }
    free(x), free(qkv), free(q), free(att), free(gu), free(act);
    return failed ? -1 : 0;
}
