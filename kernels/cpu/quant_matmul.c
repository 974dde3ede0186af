/* pagemesh's weight-quantized matmul for the CPU: y = x W^T (+ b) with W in blocks of 32 codes.
 *
 * Built at first use by kernels/cpu/build.py like pagemesh_cpu.c, and called through ctypes by
 * kernels/cpu/quant.py, which checks shapes and dtypes; the functions here trust their arguments.
 *
 * One layout serves every format (kernels/quantized.py makes it, from GGUF blocks or any dense
 * weight): row n of W is K unsigned 8-bit codes q (two per byte for 4-bit formats: byte j of a
 * block holds code j in its low nibble and code j + 16 in its high one, GGUF's order), and each
 * block b of 32 codes has an fp16 scale d and an fp16 offset c:
 *
 *     W[n, 32 b + j] = d[n, b] * q[n, 32 b + j] + c[n, b]
 *
 * (Q4_0: c = -8 d; Q4_1: c = m; Q8_0 and our int8: q = w + 128, c = -128 d.)
 *
 * Activations are quantized here per row and block of 32 to int8 (scale dx = max|x| / 127, as
 * llama.cpp's Q8 activations), so a block's dot product is integer work, one VNNI instruction
 * (u8 codes x s8 activations, 32 products) where the CPU has AVX512-VNNI:
 *
 *     sum_j W x = d dx sum_j q qx  +  c dx sum_j qx
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PM_VNNI 1
#endif

enum { DT_F32 = 0, DT_BF16 = 1 };
enum { BLOCK = 32, ROWS = 4 }; /* ROWS: activation rows sharing one decode of a weight block */

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

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    union { uint32_t u; float f; } c;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        c.f = (float)man * 5.9604644775390625e-8f;
        c.u |= sign;
    } else if (exp == 31) {
        c.u = sign | 0x7f800000u | (man << 13);
    } else {
        c.u = sign | ((exp + 112) << 23) | (man << 13);
    }
    return c.f;
}

/* x [K] -> qx [K] int8, dx [K/32] scales, tx [K/32] sums of qx */
static void quantize_row(const void *x, int dt, int64_t k, int8_t *qx, float *dx, float *tx) {
    float v[BLOCK];
    for (int64_t b = 0; b < k / BLOCK; b++) {
        float amax = 0.0f;
        for (int j = 0; j < BLOCK; j++) {
            v[j] = dt == DT_BF16 ? bf16_to_f32(((const bf16 *)x)[b * BLOCK + j]) : ((const float *)x)[b * BLOCK + j];
            float a = fabsf(v[j]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < BLOCK; j++) {
            int q = (int)lrintf(v[j] * inv);
            qx[b * BLOCK + j] = (int8_t)q;
            sum += q;
        }
        dx[b] = d;
        tx[b] = (float)sum;
    }
}

/* sum_j q[j] * qx[j] over one block of 32, q the block's 32 codes */
#if defined(PM_VNNI)
static inline __m256i block_codes(const uint8_t *codes, int bits) {
    if (bits == 8) return _mm256_loadu_si256((const __m256i *)codes);
    const __m128i packed = _mm_loadu_si128((const __m128i *)codes), low = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(packed, low), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
    return _mm256_set_m128i(hi, lo);
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
static inline int block_dot(const uint8_t *codes, int bits, const int8_t *qx) {
    int sum = 0;
    for (int j = 0; j < BLOCK; j++) {
        int q = bits == 8 ? codes[j] : (j < 16 ? codes[j] & 15 : codes[j - 16] >> 4);
        sum += q * qx[j];
    }
    return sum;
}
#endif

/* out[r, n] for the rows r < rows of one tile, weight row n */
static inline void tile_dot(const uint8_t *wrow, const float *dw, const float *cw, int bits, int64_t kb,
                            const int8_t *qx, const float *dx, const float *tx, int64_t k, int rows, float *sums) {
    const int64_t block_bytes = bits == 8 ? BLOCK : BLOCK / 2;
    for (int r = 0; r < rows; r++) {
        float corr = 0.0f;
        for (int64_t b = 0; b < kb; b++) corr += cw[b] * dx[r * kb + b] * tx[r * kb + b];
        sums[r] = corr;
    }
#if defined(PM_VNNI)
    __m256 acc[ROWS] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < kb; b++) {
        const __m256i q = block_codes(wrow + b * block_bytes, bits);
        for (int r = 0; r < rows; r++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(qx + r * k + b * BLOCK));
            const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, a);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw[b] * dx[r * kb + b]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) sums[r] += hsum256(acc[r]);
#else
    for (int r = 0; r < rows; r++)
        for (int64_t b = 0; b < kb; b++)
            sums[r] += (float)block_dot(wrow + b * block_bytes, bits, qx + r * k + b * BLOCK) * dw[b] * dx[r * kb + b];
#endif
}

/* x [M, K] (row stride x_stride elements, dtype x_dt) times W^T as described above, plus bias
 * (fp32 [N] or NULL), into out [M, N] (contiguous, out_dt). K is a multiple of 32. */
void pm_quant_matmul(const void *x, int64_t x_stride, int x_dt, const uint8_t *codes, const uint16_t *d,
                     const uint16_t *c, int bits, const float *bias, void *out, int out_dt, int64_t m, int64_t n,
                     int64_t k) {
    const int64_t kb = k / BLOCK, row_bytes = bits == 8 ? k : k / 2, xsize = x_dt == DT_BF16 ? 2 : 4;
    int8_t *qx = (int8_t *)aligned_alloc(64, (size_t)((m * k + 63) / 64 * 64));
    float *dx = (float *)malloc((size_t)(m * kb) * sizeof(float)), *tx = (float *)malloc((size_t)(m * kb) * sizeof(float));
#pragma omp parallel for schedule(static) if (m * k > 65536)
    for (int64_t r = 0; r < m; r++)
        quantize_row((const char *)x + r * x_stride * xsize, x_dt, k, qx + r * k, dx + r * kb, tx + r * kb);
#pragma omp parallel if (n * m * k > 262144)
    {
        float *dw = (float *)malloc((size_t)(2 * kb) * sizeof(float)), *cw = dw + kb;
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            for (int64_t b = 0; b < kb; b++) {
                dw[b] = f16_to_f32(d[j * kb + b]);
                cw[b] = f16_to_f32(c[j * kb + b]);
            }
            for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
                const int rows = m - r0 < ROWS ? (int)(m - r0) : ROWS;
                float sums[ROWS];
                tile_dot(codes + j * row_bytes, dw, cw, bits, kb, qx + r0 * k, dx + r0 * kb, tx + r0 * kb, k, rows,
                         sums);
                for (int r = 0; r < rows; r++) {
                    const float y = sums[r] + (bias ? bias[j] : 0.0f);
                    if (out_dt == DT_BF16)
                        ((bf16 *)out)[(r0 + r) * n + j] = f32_to_bf16(y);
                    else
                        ((float *)out)[(r0 + r) * n + j] = y;
                }
            }
        }
        free(dw);
    }
    free(qx);
    free(dx);
    free(tx);
}
