/* What the CPU kernels of this folder share: dtype codes, bf16 rounding, row loads and stores,
 * a vectorizable exp. Included by every .c file of the pagemesh_cpu library (build.py's SOURCES:
 * norm.c, activation.c, rotary.c, kv_write.c, attention.c, attention_fp8.c, amx_linear.c,
 * sampling.c), which kernels/cpu/build.py compiles into one shared library (cc -O3 -march=native
 * -ffast-math -fopenmp) and kernels/cpu/__init__.py calls through ctypes, checking shapes, dtypes
 * and strides first: the functions trust their arguments.
 *
 * Numerics follow Hugging Face Llama in the model dtype: fp32 statistics, and for bf16 each
 * step that torch would round (x + residual, the normed row, weight * normed, x * cos, ...)
 * rounds here too, to nearest even.
 *
 * KV pool of one layer: kv[page][2][slot][kv_head][head_dim] (DESIGN.md section 3): the K of
 * the token in slot o of page p starts at ((p * 2 + 0) * page_size + o) * kv_heads * head_dim,
 * its V page_size rows further.
 */
#ifndef PAGEMESH_CPU_COMMON_H
#define PAGEMESH_CPU_COMMON_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { DT_F32 = 0, DT_BF16 = 1 };

typedef uint16_t bf16;

static inline float bf16_to_f32(bf16 h) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)h << 16;
    return c.f;
}

static inline bf16 f32_to_bf16(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    uint32_t u = c.u;
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (bf16)(u >> 16);
}

/* the value a bf16 tensor would hold after this op */
static inline float round_dt(float f, int dt) { return dt == DT_BF16 ? bf16_to_f32(f32_to_bf16(f)) : f; }

static inline void load_row(float *dst, const void *src, int64_t n, int dt) {
    if (dt == DT_BF16) {
        const bf16 *s = (const bf16 *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

static inline void store_row(void *dst, const float *src, int64_t n, int dt) {
    if (dt == DT_BF16) {
        bf16 *d = (bf16 *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

static inline int64_t elem_size(int dt) { return dt == DT_BF16 ? 2 : 4; }

/* exp on [-87, 88] to ~2 ulp; plain float arithmetic so that loops over it vectorize */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * c.f;
}

/* Row bodies take dt as a compile-time constant (always inlined, called once per dtype), so each
 * dtype's loops vectorize without a branch per element. */
#define FOR_DTYPE(dt, CALL) \
    do {                    \
        if ((dt) == DT_BF16) \
            CALL(DT_BF16);   \
        else                 \
            CALL(DT_F32);    \
    } while (0)

#if defined(__AVX512BF16__)
/* the value of each lane after a round trip through bf16 (nearest even) */
static inline __m512 round_bf16x16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
#endif

#endif /* PAGEMESH_CPU_COMMON_H */
