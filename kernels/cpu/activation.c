/* SiLU-and-mul, the MLP's activation (pm_silu_and_mul). See common.h. */
#include "common.h"

static inline __attribute__((always_inline)) void silu_and_mul_row(const void *x, void *out, int64_t cols,
                                                                   const int dt) {
    float g[cols], u[cols];
    load_row(g, x, cols, dt);
    load_row(u, (const char *)x + cols * elem_size(dt), cols, dt);
    for (int64_t i = 0; i < cols; i++) g[i] = round_dt(round_dt(g[i] / (1.0f + exp_approx(-g[i])), dt) * u[i], dt);
    store_row(out, g, cols, dt);
}

#if defined(__AVX512BF16__)
static inline __m512 load_bf16x16(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* exp_approx, 16 lanes at a time (the same steps) */
static inline __m512 exp_approx16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* silu_and_mul_row for bf16, cols % 16 == 0: the division as a reciprocal estimate refined by
 * one Newton step (~1 ulp of fp32), 16 lanes at a time; a divide per lane was most of the op */
static void silu_and_mul_row_bf16(const bf16 *x, bf16 *out, int64_t cols) {
    for (int64_t i = 0; i < cols; i += 16) {
        const __m512 g = load_bf16x16(x + i), u = load_bf16x16(x + cols + i);
        const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), exp_approx16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
        __m512 inv = _mm512_rcp14_ps(den);
        inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.0f)));
        const __m512 silu = round_bf16x16(_mm512_mul_ps(g, inv));
        _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu, u)));
    }
}
#endif

/* out[t] = silu(x[t, :cols]) * x[t, cols:] */
void pm_silu_and_mul(const void *x, void *out, int64_t rows, int64_t cols, int dt) {
    const int64_t es = elem_size(dt);
#if defined(__AVX512BF16__)
    if (dt == DT_BF16 && cols % 16 == 0) {
#pragma omp parallel for schedule(static) if (rows * cols > 32768)
        for (int64_t r = 0; r < rows; r++) silu_and_mul_row_bf16((const bf16 *)x + r * 2 * cols, (bf16 *)out + r * cols, cols);
        return;
    }
#endif
#pragma omp parallel for schedule(static) if (rows * cols > 32768)
    for (int64_t r = 0; r < rows; r++) {
#define ROW(DT) silu_and_mul_row((const char *)x + r * 2 * cols * es, (char *)out + r * cols * es, cols, DT)
        FOR_DTYPE(dt, ROW);
#undef ROW
    }
}
