/* The vector types and the one fused multiply-add of the runtime's C kernels (skinny.c, rows.c).
 *
 * One GCC vector is one register, as wide as the CPU's: 16 floats with AVX-512, 8 with AVX2 (a
 * 64-byte GCC vector on an AVX2 CPU is lowered through the stack, 5-20x slower). The kernels are
 * built with -ffp-contract=off, so no multiply and add is fused behind the source's back: every
 * fused multiply-add is a `fmav` below, and a build gives the bits its source says on any width.
 * `-DVW=16` on an AVX2 CPU builds the AVX-512 code path from AVX2 halves (tests compare it with
 * the 8-wide one: the same bits). */
#ifndef PDD_SIMD_H
#define PDD_SIMD_H

#include <stdint.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifndef VW
#if defined(__AVX512F__)
#define VW 16 /* floats per vector: one AVX-512 register */
#else
#define VW 8 /* one AVX2 register */
#endif
#endif

typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2), aligned(2)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

/* a * b + c, rounded once (where the CPU has no FMA: rounded twice, the same on every row). */
static inline vf fmav(vf a, vf b, vf c) {
#if VW == 16 && defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif VW == 8 && defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif VW == 16 && defined(__FMA__)
    v8 lo = (v8)_mm256_fmadd_ps((__m256)__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7),
                                (__m256)__builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
                                (__m256)__builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
    v8 hi = (v8)_mm256_fmadd_ps((__m256)__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
                                (__m256)__builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
                                (__m256)__builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    return a * b + c;
#endif
}

/* x in every lane (x + (vf){0} would be an add, and -0.0 + 0.0 is +0.0). */
static inline vf splat(float x) {
#if VW == 16 && defined(__AVX512F__)
    return (vf)_mm512_set1_ps(x);
#elif VW == 8 && defined(__AVX__)
    return (vf)_mm256_set1_ps(x);
#else
    return x - (vf){0}; /* x - 0.0 is x, -0.0 included */
#endif
}

/* Loads and stores at any float's alignment (vf is aligned(4)). A memcpy of a vector is copied
 * through the stack in 16-byte pieces and read back whole, a stalled store-to-load forward. */
static inline vf load_f32(const float *p) { return *(const vf *)p; }
static inline void store_f32(float *p, vf x) { *(vf *)p = x; }

/* VW bfloat16 values as fp32: the bf16 bits are the top half of the fp32 bits, so this is exact.
 * One zero-extension per vector: GCC's own lowering of the generic conversion (the fallback) took
 * three more shuffles per vector, a tenth of a bf16 decode step's projections. */
static inline vf widen_bf16(const uint16_t *p) {
#if VW == 16 && defined(__AVX512F__)
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif VW == 8 && defined(__AVX2__)
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    vi w = __builtin_convertvector(*(const vh *)p, vi) << 16;
    return (vf)w;
#endif
}

#endif
