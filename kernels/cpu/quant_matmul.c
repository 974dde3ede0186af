/* pagemesh's weight-quantized matmul for the CPU: y = x W^T (+ b) with W in blocks of 32 codes.
 *
 * Built at first use by kernels/cpu/build.py like the pagemesh_cpu library, and called through ctypes by
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
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)
#include <immintrin.h>
#define PM_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2 without VNNI (most x86 CPUs before AVX-512): a block's dot product is _mm256_maddubs_epi16
 * (u8 x s8, adjacent pairs summed to int16) then _mm256_madd_epi16 by ones (pairs of those to
 * int32), the int32 sums of 4 products that one dpbusd lane gives. maddubs saturates its int16
 * sums, so it only ever sees codes 0..15 (2 * 15 * 127 = 3810; 8 groups of those summed, 30480,
 * still fit int16): 8-bit codes are split into nibbles, q = 16 hi + lo, each nibble's sums
 * widened apart and hi's multiplied by 16 in the int16 -> int32 madd. Exact, as VNNI's. */
#include <immintrin.h>
#define PM_AVX2 1
#endif

enum { DT_F32 = 0, DT_BF16 = 1 };
enum { BLOCK = 32, GROUP = 4, ROWS = 4, PREFETCH = 4 }; /* GROUP: blocks per vector step; ROWS: x rows per weight decode */

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

/* Activations, quantized once per call: row r holds kpad = K rounded up to GROUP blocks int8
 * values (zero past K), and per block dx (scale) and dxt (scale times the sum of the block's
 * values), zero past K, so that a group reaching past K adds nothing. With VNNI, a 4-bit
 * weight's group of 4 blocks is 64 bytes whose low nibbles are codes 0..15 of each block and
 * high nibbles codes 16..31; the activations of a group are laid out to match: the 4 blocks'
 * values 0..15, then their values 16..31. 8-bit weights keep the natural order, and so does
 * every weight with AVX2 (a 4-bit block's 16 bytes widen to its 32 codes in order). */
static inline int64_t act_index(int64_t b, int j, int bits) {
#if defined(PM_VNNI)
    if (bits == 4) return (b / GROUP) * GROUP * BLOCK + (j < 16 ? 0 : 64) + (b % GROUP) * 16 + (j & 15);
#else
    (void)bits;
#endif
    return b * BLOCK + j;
}

#if defined(PM_AVX2)
/* quantize_row below in the natural order, 32 values at a time: the same fp32 operations (max of
 * |v|, v * inv rounded to nearest even as lrintf), so the same int8 values and scales */
static void quantize_row_avx2(const void *x, int dt, int64_t k, int8_t *qx, float *dx, float *dxt) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    /* packs_epi32 then packs_epi16 interleave the 128-bit lanes: this puts the 32 values in order */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < k / BLOCK; b++) {
        __m256 v[4];
        for (int h = 0; h < 4; h++) {
            const int64_t i = b * BLOCK + 8 * h;
            v[h] = dt == DT_BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                                       _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const bf16 *)x + i))), 16))
                                 : _mm256_loadu_ps((const float *)x + i);
        }
        const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                       _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m256 vinv = _mm256_set1_ps(inv);
        __m256i q[4];
        for (int h = 0; h < 4; h++) q[h] = _mm256_cvtps_epi32(_mm256_mul_ps(v[h], vinv)); /* nearest even */
        /* |q| <= 127: the saturating packs keep every value */
        const __m256i q16 = _mm256_packs_epi32(q[0], q[1]);
        const __m256i q16b = _mm256_packs_epi32(q[2], q[3]);
        _mm256_storeu_si256((__m256i *)(qx + b * BLOCK), _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16, q16b), order));
        const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        dx[b] = d;
        dxt[b] = d * (float)_mm_cvtsi128_si32(s4);
    }
}
#endif

static void quantize_row(const void *x, int dt, int64_t k, int bits, int8_t *qx, float *dx, float *dxt) {
#if defined(PM_AVX2)
    (void)bits;
    quantize_row_avx2(x, dt, k, qx, dx, dxt);
#else
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
            qx[act_index(b, j, bits)] = (int8_t)q;
            sum += q;
        }
        dx[b] = d;
        dxt[b] = d * (float)sum;
    }
#endif
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        v.f = (float)man * 5.9604644775390625e-8f;
        v.u |= sign;
    } else if (exp == 31) {
        v.u = sign | 0x7f800000u | (man << 13);
    } else {
        v.u = sign | ((exp + 112) << 23) | (man << 13);
    }
    return v.f;
}

#if defined(PM_VNNI)
/* sums[r] = x_r . W_n for rows r < rows of a tile (see the header for the algebra). Always
 * inlined with constant rows and bits (dispatch below), so the accumulators live in registers */
static inline __attribute__((always_inline)) void row_dots(const uint8_t *codes, const uint16_t *d, const uint16_t *c, int bits, int64_t kb,
                            const int8_t *qx, const float *dx, const float *dxt, int64_t kpad, int64_t kbpad, int rows,
                            float *sums) {
    const __m512i low = _mm512_set1_epi8(0x0f), zero = _mm512_setzero_si512();
    /* a group's 4 scales, each widened to the lanes that hold its block's sums */
    const __m512i by4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i by8_lo = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i by8_hi = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
    __m512 acc[ROWS];
    __m128 cacc[ROWS];
    for (int r = 0; r < ROWS; r++) {
        acc[r] = _mm512_setzero_ps();
        cacc[r] = _mm_setzero_ps();
    }
    for (int64_t b = 0; b < kb; b += GROUP) {
        const int nt = kb - b < GROUP ? (int)(kb - b) : GROUP;
        const __mmask8 hm = (__mmask8)((1u << nt) - 1);
        const __m128 dw = _mm_cvtph_ps(_mm_maskz_loadu_epi16(hm, d + b));
        const __m128 cw = _mm_cvtph_ps(_mm_maskz_loadu_epi16(hm, c + b));
        if (bits == 4) {
            const __mmask64 cm = nt == GROUP ? ~0ULL : (1ULL << (16 * nt)) - 1;
            const __m512i packed = _mm512_maskz_loadu_epi8(cm, codes + b * 16);
            const __m512i lo = _mm512_and_si512(packed, low);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
            for (int r = 0; r < rows; r++) {
                const int8_t *xr = qx + r * kpad + b * BLOCK;
                __m512i dot = _mm512_dpbusd_epi32(zero, lo, _mm512_loadu_si512(xr));
                dot = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512(xr + 64));
                const __m128 s = _mm_mul_ps(dw, _mm_loadu_ps(dx + r * kbpad + b));
                const __m512 scale = _mm512_permutexvar_ps(by4, _mm512_castps128_ps512(s));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
                cacc[r] = _mm_fmadd_ps(cw, _mm_loadu_ps(dxt + r * kbpad + b), cacc[r]);
            }
        } else {
            const __mmask64 m1 = nt >= 2 ? ~0ULL : 0xffffffffULL, m2 = nt == 4 ? ~0ULL : (nt == 3 ? 0xffffffffULL : 0);
            const __m512i w1 = _mm512_maskz_loadu_epi8(m1, codes + b * BLOCK);
            const __m512i w2 = _mm512_maskz_loadu_epi8(m2, codes + b * BLOCK + 64);
            for (int r = 0; r < rows; r++) {
                const int8_t *xr = qx + r * kpad + b * BLOCK;
                const __m512i dot1 = _mm512_dpbusd_epi32(zero, w1, _mm512_loadu_si512(xr));
                const __m512i dot2 = _mm512_dpbusd_epi32(zero, w2, _mm512_loadu_si512(xr + 64));
                const __m512 s = _mm512_castps128_ps512(_mm_mul_ps(dw, _mm_loadu_ps(dx + r * kbpad + b)));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1), _mm512_permutexvar_ps(by8_lo, s), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot2), _mm512_permutexvar_ps(by8_hi, s), acc[r]);
                cacc[r] = _mm_fmadd_ps(cw, _mm_loadu_ps(dxt + r * kbpad + b), cacc[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        __m128 t = _mm_add_ps(cacc[r], _mm_movehl_ps(cacc[r], cacc[r]));
        t = _mm_add_ss(t, _mm_movehdup_ps(t));
        sums[r] = _mm512_reduce_add_ps(acc[r]) + _mm_cvtss_f32(t);
    }
}
#elif defined(PM_AVX2)
/* row_dots block by block, the activations in the natural order: a block's 32 codes are one
 * vector (4-bit: the 16 bytes' low nibbles, then their high ones), its 32 products 8 int32 sums
 * (see the header for the nibble split of 8-bit codes), scaled by d dx as the scalar path does;
 * inlined with constant rows and bits, as above */
static inline __attribute__((always_inline)) void row_dots(const uint8_t *codes, const uint16_t *d, const uint16_t *c, int bits, int64_t kb,
                            const int8_t *qx, const float *dx, const float *dxt, int64_t kpad, int64_t kbpad, int rows,
                            float *sums) {
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
    __m256 acc[ROWS];
    float cacc[ROWS];
    for (int r = 0; r < ROWS; r++) {
        acc[r] = _mm256_setzero_ps();
        cacc[r] = 0.0f;
    }
    for (int64_t b = 0; b < kb; b++) {
        const float dw = _cvtsh_ss(d[b]), cw = _cvtsh_ss(c[b]);
        __m256i lo, hi;
        if (bits == 4) {
            const __m128i packed = _mm_loadu_si128((const __m128i *)(codes + b * 16));
            lo = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
            hi = lo;
        } else {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(codes + b * BLOCK));
            lo = _mm256_and_si256(w, low);
            hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
        }
        for (int r = 0; r < rows; r++) {
            const __m256i xr = _mm256_loadu_si256((const __m256i *)(qx + r * kpad + b * BLOCK));
            __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xr), ones);
            if (bits == 8) dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xr), sixteen));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * dx[r * kbpad + b]), acc[r]);
            cacc[r] += cw * dxt[r * kbpad + b];
        }
    }
    for (int r = 0; r < rows; r++) {
        __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        t = _mm_add_ps(t, _mm_movehl_ps(t, t));
        t = _mm_add_ss(t, _mm_movehdup_ps(t));
        sums[r] = _mm_cvtss_f32(t) + cacc[r];
    }
}
#else
static inline void row_dots(const uint8_t *codes, const uint16_t *d, const uint16_t *c, int bits, int64_t kb,
                            const int8_t *qx, const float *dx, const float *dxt, int64_t kpad, int64_t kbpad, int rows,
                            float *sums) {
    for (int r = 0; r < rows; r++) {
        float sum = 0.0f;
        for (int64_t b = 0; b < kb; b++) {
            const uint8_t *q = codes + b * (bits == 8 ? BLOCK : BLOCK / 2);
            int dot = 0;
            for (int j = 0; j < BLOCK; j++)
                dot += (bits == 8 ? q[j] : (j < 16 ? q[j] & 15 : q[j - 16] >> 4)) * qx[r * kpad + b * BLOCK + j];
            sum += f16_to_f32(d[b]) * dx[r * kbpad + b] * (float)dot + f16_to_f32(c[b]) * dxt[r * kbpad + b];
        }
        sums[r] = sum;
    }
}
#endif

/* row_dots with rows and bits as compile-time constants */
static void tile_dots(const uint8_t *codes, const uint16_t *d, const uint16_t *c, int bits, int64_t kb,
                      const int8_t *qx, const float *dx, const float *dxt, int64_t kpad, int64_t kbpad, int rows,
                      float *sums) {
#define PM_ROWS(B, R) row_dots(codes, d, c, B, kb, qx, dx, dxt, kpad, kbpad, R, sums)
    if (bits == 4) {
        switch (rows) {
        case 1: PM_ROWS(4, 1); break;
        case 2: PM_ROWS(4, 2); break;
        case 3: PM_ROWS(4, 3); break;
        default: PM_ROWS(4, 4);
        }
    } else {
        switch (rows) {
        case 1: PM_ROWS(8, 1); break;
        case 2: PM_ROWS(8, 2); break;
        case 3: PM_ROWS(8, 3); break;
        default: PM_ROWS(8, 4);
        }
    }
#undef PM_ROWS
}

/* x [M, K] (row stride x_stride elements, dtype x_dt) times W^T as described above, plus bias
 * (fp32 [N] or NULL), into out [M, N] (contiguous, out_dt). K is a multiple of 32. */
void pm_quant_matmul(const void *x, int64_t x_stride, int x_dt, const uint8_t *codes, const uint16_t *d,
                     const uint16_t *c, int bits, const float *bias, void *out, int out_dt, int64_t m, int64_t n,
                     int64_t k) {
    const int64_t kb = k / BLOCK, kbpad = (kb + GROUP - 1) / GROUP * GROUP, kpad = kbpad * BLOCK;
    const int64_t row_bytes = bits == 8 ? k : k / 2, xsize = x_dt == DT_BF16 ? 2 : 4;
    int8_t *qx = (int8_t *)aligned_alloc(64, (size_t)(m * kpad));
    float *dx = (float *)calloc((size_t)(2 * m * kbpad), sizeof(float)), *dxt = dx + m * kbpad;
    memset(qx, 0, (size_t)(m * kpad));
#pragma omp parallel for schedule(static) if (m * k > 65536)
    for (int64_t r = 0; r < m; r++)
        quantize_row((const char *)x + r * x_stride * xsize, x_dt, k, bits, qx + r * kpad, dx + r * kbpad,
                     dxt + r * kbpad);
/* dynamic: a thread that is descheduled (other processes want the core) holds up the region by
 * one chunk, not by its whole static share */
#pragma omp parallel for schedule(dynamic, 16) if (n * m * k > 262144)
    for (int64_t j = 0; j < n; j++) {
        /* the weights stream from memory once per call: ask for row j + PREFETCH's now */
        if (j + PREFETCH < n) {
            for (int64_t i = 0; i < row_bytes; i += 64) __builtin_prefetch(codes + (j + PREFETCH) * row_bytes + i, 0, 0);
            __builtin_prefetch(d + (j + PREFETCH) * kb, 0, 0);
            __builtin_prefetch(c + (j + PREFETCH) * kb, 0, 0);
        }
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            const int rows = m - r0 < ROWS ? (int)(m - r0) : ROWS;
            float sums[ROWS];
            tile_dots(codes + j * row_bytes, d + j * kb, c + j * kb, bits, kb, qx + r0 * kpad, dx + r0 * kbpad,
                      dxt + r0 * kbpad, kpad, kbpad, rows, sums);
            for (int r = 0; r < rows; r++) {
                const float y = sums[r] + (bias ? bias[j] : 0.0f);
                if (out_dt == DT_BF16)
                    ((bf16 *)out)[(r0 + r) * n + j] = f32_to_bf16(y);
                else
                    ((float *)out)[(r0 + r) * n + j] = y;
            }
        }
    }
    free(qx);
    free(dx);
}

/* Rows n0..n1 of W widened to bf16, into out [n1 - n0, K] (contiguous): the prefill path, where
 * a bf16 GEMM over many activation rows outruns the integer dot products above
 * (workers/model/layers.py picks by row count). d * q is exact in fp32 (an fp16 scale times a
 * code below 256 needs 19 bits), so d * q + c is rounded once, fused or not, and the result
 * equals kernels.quantized.dequantize rounded to bf16 (nearest even), bit for bit. */
void pm_quant_dequantize_bf16(const uint8_t *codes, const uint16_t *d, const uint16_t *c, int bits, bf16 *out,
                              int64_t n0, int64_t n1, int64_t k) {
    const int64_t kb = k / BLOCK, row_bytes = bits == 8 ? k : k / 2;
#pragma omp parallel for schedule(dynamic, 16) if ((n1 - n0) * k > 262144)
    for (int64_t j = n0; j < n1; j++) {
        const uint8_t *q = codes + j * row_bytes;
        bf16 *o = out + (j - n0) * k;
        for (int64_t b = 0; b < kb; b++) {
#if defined(PM_VNNI) && defined(__AVX512BF16__)
            const __m512 dv = _mm512_set1_ps(_cvtsh_ss(d[j * kb + b])), cv = _mm512_set1_ps(_cvtsh_ss(c[j * kb + b]));
            __m512i lo, hi;
            if (bits == 4) {
                const __m128i packed = _mm_loadu_si128((const __m128i *)(q + b * 16));
                lo = _mm512_cvtepu8_epi32(_mm_and_si128(packed, _mm_set1_epi8(0x0f)));
                hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0f)));
            } else {
                lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + b * BLOCK)));
                hi = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + b * BLOCK + 16)));
            }
            const __m512 wlo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), dv, cv);
            const __m512 whi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), dv, cv);
            _mm512_storeu_si512((void *)(o + b * BLOCK), (__m512i)_mm512_cvtne2ps_pbh(whi, wlo));
#else
            const float dw = f16_to_f32(d[j * kb + b]), cw = f16_to_f32(c[j * kb + b]);
            for (int i = 0; i < BLOCK; i++) {
                const int code = bits == 8 ? q[b * BLOCK + i] : (i < 16 ? q[b * 16 + i] & 15 : q[b * 16 + i - 16] >> 4);
                o[b * BLOCK + i] = f32_to_bf16(dw * (float)code + cw);
            }
#endif
        }
    }
}

/* ---- The decode-batch GEMM: W repacked in tiles of 16 output rows (pm_quant_gemm_tiles) ----
 *
 * pm_quant_matmul above decodes a weight row once per 4 activation rows and pays its block
 * scales per (weight row, activation row, block). For decode steps (1-64 rows: workers/model/
 * layers.py) this GEMM reads W in a second layout (kernels/quantized.py, `with_tiles`) where one
 * 512-bit register holds 4 consecutive codes of each of 16 output rows:
 *
 *     tiles  [N16/16][KB][G][16][4] u8   G = 8 groups of 4 codes (8-bit), or 4 groups of 4 bytes
 *                                        (4-bit, the GGUF bytes as they are: low nibbles codes
 *                                        4g..4g+3, high nibbles codes 16+4g..16+4g+3)
 *     scales [N16/16][KB][2][16] fp16    d then c of the tile's 16 rows, one cache line a block
 *
 * (N16: N rounded up to 16, the padding rows all zero). A block's 8 code vectors are decoded
 * once for a chunk of up to TILE_ROWS activation rows (8: two accumulators a row, and the code
 * vector, fit the 32 registers; 10 or 12 spilled), each row's 4 activations broadcast against them
 * (8 VNNI instructions for 16 x 32 products), and the scale work (the fp16 d and c widened, the
 * sum scaled) is a vector over the 16 outputs. Activations are the same int8 blocks as above,
 * so the results equal pm_quant_matmul's up to the order of the fp32 sums. */
#if defined(PM_AVX2)
/* AVX2: 4 rows a chunk (16 registers; 8-bit codes hold two int16 sums a row: 8 rows spilled and
 * ran 1.2x slower, 4-bit ran the same at 4, 6 or 8) */
enum { TILE_N = 16, TILE_ROWS = 4, TILE_PREFETCH = 2 };
#else
enum { TILE_N = 16, TILE_ROWS = 8, TILE_PREFETCH = 2 };
#endif
typedef int32_t __attribute__((may_alias, aligned(1))) x4_t;

#if defined(PM_VNNI)
/* out[r][0:16] (fp32) = the 16 rows' sums for activation rows r < rows; inlined with constant
 * rows and bits (tile_gemm_rows), so that the accumulators stay in registers */
static inline __attribute__((always_inline)) void tile_sums(const uint8_t *tile, const uint16_t *scales, int bits,
                                                            int64_t kb, const int8_t *qx, const float *dx,
                                                            const float *dxt, int64_t k, int rows, float *out,
                                                            const uint8_t *ahead, const uint16_t *ahead_scales) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const int64_t block_bytes = bits == 8 ? TILE_N * BLOCK : TILE_N * BLOCK / 2;
    __m512 acc[TILE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *q = tile + b * block_bytes;
        if (ahead) { /* block b of a tile to come, paced with this one's work */
            for (int64_t i = 0; i < block_bytes; i += 64) __builtin_prefetch(ahead + b * block_bytes + i, 0, 0);
            __builtin_prefetch(ahead_scales + b * 2 * TILE_N, 0, 0);
        }
        __m512i packed[4]; /* 4-bit: the block's 4 vectors of nibble pairs, each decoded twice below */
        if (bits == 4)
            for (int g = 0; g < 4; g++) packed[g] = _mm512_loadu_si512(q + 64 * g);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + b * 2 * TILE_N)));
        const __m512 c = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + b * 2 * TILE_N + TILE_N)));
        /* group by group over the rows: the rows' dot products are independent chains, so the
         * VNNI unit is not left waiting on one row's 8 dependent instructions */
        __m512i dot[TILE_ROWS];
        for (int r = 0; r < rows; r++) dot[r] = _mm512_setzero_si512();
        for (int g = 0; g < 8; g++) {
            /* codes 4g..4g+3 of the block, for the 16 rows, decoded as they are needed (fewer
             * registers held than 8 decoded vectors: room for the rows' accumulators) */
            const __m512i w = bits == 8 ? _mm512_loadu_si512(q + 64 * g)
                              : g < 4   ? _mm512_and_si512(packed[g], low)
                                        : _mm512_and_si512(_mm512_srli_epi16(packed[g - 4], 4), low);
            for (int r = 0; r < rows; r++) /* 4 activations as one int32, broadcast from memory */
                dot[r] = _mm512_dpbusd_epi32(dot[r], w, _mm512_set1_epi32(((const x4_t *)(qx + r * k + b * BLOCK))[g]));
        }
        for (int r = 0; r < rows; r++) {
            const __m512 s = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * kb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), s, acc[r]);
            acc[r] = _mm512_fmadd_ps(c, _mm512_set1_ps(dxt[r * kb + b]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + r * TILE_N, acc[r]);
}
#elif defined(PM_AVX2)
/* tile_sums with 256-bit vectors: a 64-byte vector of the tile is two halves, rows 0-7 and 8-15
 * of the tile, done one after the other (each half's accumulators and the rows' dot products fit
 * the 16 registers, TILE_ROWS rows). Per half and block, each row's int16 pair sums (maddubs of
 * codes 0..15, see the header) add up over the block's 8 groups in one register, widened to
 * int32 once; the scale work is VNNI's, lane for lane. */
static inline __attribute__((always_inline)) void tile_sums(const uint8_t *tile, const uint16_t *scales, int bits,
                                                            int64_t kb, const int8_t *qx, const float *dx,
                                                            const float *dxt, int64_t k, int rows, float *out,
                                                            const uint8_t *ahead, const uint16_t *ahead_scales) {
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
    const int64_t block_bytes = bits == 8 ? TILE_N * BLOCK : TILE_N * BLOCK / 2;
    for (int h = 0; h < 2; h++) {
        __m256 acc[TILE_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < kb; b++) {
            const uint8_t *q = tile + b * block_bytes + 32 * h;
            if (ahead && h == 0) { /* block b of a tile to come, paced with this one's work */
                for (int64_t i = 0; i < block_bytes; i += 64) __builtin_prefetch(ahead + b * block_bytes + i, 0, 0);
                __builtin_prefetch(ahead_scales + b * 2 * TILE_N, 0, 0);
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + b * 2 * TILE_N + 8 * h)));
            const __m256 c = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + b * 2 * TILE_N + TILE_N + 8 * h)));
            __m256i dot[TILE_ROWS];
            if (bits == 4) {
                __m256i pairs[TILE_ROWS]; /* int16: at most 16 products of a code 0..15 by |x| <= 127 */
                for (int r = 0; r < rows; r++) pairs[r] = _mm256_setzero_si256();
                for (int g = 0; g < 4; g++) { /* codes 4g..4g+3 (low nibbles) and 16+4g.. (high) */
                    const __m256i packed = _mm256_loadu_si256((const __m256i *)(q + 64 * g));
                    const __m256i lo = _mm256_and_si256(packed, low);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
                    for (int r = 0; r < rows; r++) {
                        const x4_t *xr = (const x4_t *)(qx + r * k + b * BLOCK);
                        pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xr[g])));
                        pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xr[g + 4])));
                    }
                }
                for (int r = 0; r < rows; r++) dot[r] = _mm256_madd_epi16(pairs[r], ones);
            } else {
                __m256i plo[TILE_ROWS], phi[TILE_ROWS]; /* the low and high nibbles' int16 sums */
                for (int r = 0; r < rows; r++) plo[r] = phi[r] = _mm256_setzero_si256();
                for (int g = 0; g < 8; g++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(q + 64 * g));
                    const __m256i lo = _mm256_and_si256(w, low);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
                    for (int r = 0; r < rows; r++) {
                        const __m256i xg = _mm256_set1_epi32(((const x4_t *)(qx + r * k + b * BLOCK))[g]);
                        plo[r] = _mm256_add_epi16(plo[r], _mm256_maddubs_epi16(lo, xg));
                        phi[r] = _mm256_add_epi16(phi[r], _mm256_maddubs_epi16(hi, xg));
                    }
                }
                for (int r = 0; r < rows; r++)
                    dot[r] = _mm256_add_epi32(_mm256_madd_epi16(plo[r], ones), _mm256_madd_epi16(phi[r], sixteen));
            }
            for (int r = 0; r < rows; r++) {
                const __m256 s = _mm256_mul_ps(d, _mm256_set1_ps(dx[r * kb + b]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), s, acc[r]);
                acc[r] = _mm256_fmadd_ps(c, _mm256_set1_ps(dxt[r * kb + b]), acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) _mm256_storeu_ps(out + r * TILE_N + 8 * h, acc[r]);
    }
}
#else
static inline void tile_sums(const uint8_t *tile, const uint16_t *scales, int bits, int64_t kb, const int8_t *qx,
                             const float *dx, const float *dxt, int64_t k, int rows, float *out, const uint8_t *ahead,
                             const uint16_t *ahead_scales) {
    (void)ahead, (void)ahead_scales;
    const int64_t block_bytes = bits == 8 ? TILE_N * BLOCK : TILE_N * BLOCK / 2;
    for (int r = 0; r < rows; r++)
        for (int n = 0; n < TILE_N; n++) {
            float sum = 0.0f;
            for (int64_t b = 0; b < kb; b++) {
                const uint8_t *q = tile + b * block_bytes;
                int dot = 0;
                for (int j = 0; j < BLOCK; j++) {
                    const int g = j / 4, i = j % 4;
                    const int code = bits == 8 ? q[(g * TILE_N + n) * 4 + i]
                                               : (q[((g % 4) * TILE_N + n) * 4 + i] >> (g < 4 ? 0 : 4)) & 15;
                    dot += code * qx[r * k + b * BLOCK + j];
                }
                const uint16_t *sc = scales + b * 2 * TILE_N;
                sum += f16_to_f32(sc[n]) * dx[r * kb + b] * (float)dot + f16_to_f32(sc[TILE_N + n]) * dxt[r * kb + b];
            }
            out[r * TILE_N + n] = sum;
        }
}
#endif

/* quantize_row's values in the natural order (bits 8), 32 at a time: the same fp32 operations, so
 * the same int8 values and scales */
static void quantize_row_natural(const void *x, int dt, int64_t k, int8_t *qx, float *dx, float *dxt) {
#if defined(PM_VNNI)
    for (int64_t b = 0; b < k / BLOCK; b++) {
        __m512 v[2];
        for (int h = 0; h < 2; h++) {
            const int64_t i = b * BLOCK + 16 * h;
            v[h] = dt == DT_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                       _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const bf16 *)x + i))), 16))
                                 : _mm512_loadu_ps((const float *)x + i);
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512i sum = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) { /* round to nearest even, as lrintf */
            const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(inv)));
            _mm_storeu_si128((__m128i *)(qx + b * BLOCK + 16 * h), _mm512_cvtepi32_epi8(q));
            sum = _mm512_add_epi32(sum, q);
        }
        dx[b] = d;
        dxt[b] = d * (float)_mm512_reduce_add_epi32(sum);
    }
#elif defined(PM_AVX2)
    quantize_row_avx2(x, dt, k, qx, dx, dxt);
#else
    quantize_row(x, dt, k, 8, qx, dx, dxt);
#endif
}

/* tile_sums with rows (at most TILE_ROWS) and bits as compile-time constants */
static void tile_gemm_rows(const uint8_t *tile, const uint16_t *scales, int bits, int64_t kb, const int8_t *qx,
                           const float *dx, const float *dxt, int64_t k, int rows, float *out, const uint8_t *ahead,
                           const uint16_t *ahead_scales) {
#define PM_TILE(R) \
    case R: tile_sums(tile, scales, B, kb, qx, dx, dxt, k, R < TILE_ROWS ? R : TILE_ROWS, out, ahead, ahead_scales); break
#define PM_TILES \
    switch (rows) { \
        PM_TILE(1); PM_TILE(2); PM_TILE(3); PM_TILE(4); PM_TILE(5); PM_TILE(6); PM_TILE(7); PM_TILE(8); \
        PM_TILE(9); PM_TILE(10); PM_TILE(11); default: tile_sums(tile, scales, B, kb, qx, dx, dxt, k, TILE_ROWS, out, ahead, ahead_scales); \
    }
    if (bits == 4) {
        enum { B = 4 };
        PM_TILES
    } else {
        enum { B = 8 };
        PM_TILES
    }
#undef PM_TILES
#undef PM_TILE
}

/* out[r0 + r][n0 + j] = sums[r][j] + bias[j] for r < rows, j < width (bias NULL: none), rounded
 * to bf16 as f32_to_bf16 does where out_dt asks */
static void store_tile(const float *sums, int rows, int64_t width, const float *bias, void *out, int out_dt, int64_t n,
                       int64_t r0, int64_t n0) {
#if defined(PM_VNNI)
    const __mmask16 keep = (__mmask16)((1u << width) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const __m512 y = _mm512_add_ps(_mm512_loadu_ps(sums + r * TILE_N), b);
        if (out_dt == DT_BF16) { /* round to nearest even, as f32_to_bf16 */
            const __m512i u = _mm512_castps_si512(y);
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            const __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
            _mm256_mask_storeu_epi16((bf16 *)out + (r0 + r) * n + n0, keep, _mm512_cvtepi32_epi16(h));
        } else {
            _mm512_mask_storeu_ps((float *)out + (r0 + r) * n + n0, keep, y);
        }
    }
#else
    for (int r = 0; r < rows; r++)
        for (int64_t j = 0; j < width; j++) {
            const float y = sums[r * TILE_N + j] + (bias ? bias[j] : 0.0f);
            if (out_dt == DT_BF16)
                ((bf16 *)out)[(r0 + r) * n + n0 + j] = f32_to_bf16(y);
            else
                ((float *)out)[(r0 + r) * n + n0 + j] = y;
        }
#endif
}

/* x [M, K] (row stride x_stride elements, dtype x_dt) times W^T, W in the tiled layout above
 * (tiles, scales; N outputs of which the last tile's rows past N are padding), plus bias (fp32
 * [N] or NULL), into out [M, N] (contiguous, out_dt). K is a multiple of 32. */
void pm_quant_gemm_tiles(const void *x, int64_t x_stride, int x_dt, const uint8_t *tiles, const uint16_t *scales,
                         int bits, const float *bias, void *out, int out_dt, int64_t m, int64_t n, int64_t k) {
    const int64_t kb = k / BLOCK, ntiles = (n + TILE_N - 1) / TILE_N, xsize = x_dt == DT_BF16 ? 2 : 4;
    const int64_t tile_bytes = kb * (bits == 8 ? TILE_N * BLOCK : TILE_N * BLOCK / 2);
    /* row chunks of near-equal size, at most TILE_ROWS each: 20 rows as 7 + 7 + 6, not 8 + 8 + 4 */
    const int64_t chunks = (m + TILE_ROWS - 1) / TILE_ROWS, chunk = (m + chunks - 1) / chunks;
    int8_t *qx = (int8_t *)malloc((size_t)(m * k));
    float *dx = (float *)malloc((size_t)(2 * m * kb) * sizeof(float)), *dxt = dx + m * kb;
#pragma omp parallel for schedule(static) if (m * k > 65536)
    for (int64_t r = 0; r < m; r++)
        quantize_row_natural((const char *)x + r * x_stride * xsize, x_dt, k, qx + r * k, dx + r * kb, dxt + r * kb);
/* dynamic, as above; 4 tiles a chunk keep the prefetch of tile t + TILE_PREFETCH mostly useful */
#pragma omp parallel for schedule(dynamic, 4) if (n * m * k > 262144)
    for (int64_t t = 0; t < ntiles; t++) {
        const int64_t n0 = t * TILE_N, width = n - n0 < TILE_N ? n - n0 : TILE_N;
        float sums[TILE_ROWS * TILE_N];
        /* the weights stream from memory once per call: the first row chunk asks for tile t +
         * TILE_PREFETCH's blocks as it goes (the hardware prefetcher alone left it waiting on
         * every block) */
        const int ahead = t + TILE_PREFETCH < ntiles;
        const uint8_t *ahead_codes = ahead ? tiles + (t + TILE_PREFETCH) * tile_bytes : NULL;
        const uint16_t *ahead_scales = ahead ? scales + (t + TILE_PREFETCH) * kb * 2 * TILE_N : NULL;
        for (int64_t r0 = 0; r0 < m; r0 += chunk) {
            const int rows = m - r0 < chunk ? (int)(m - r0) : (int)chunk;
            tile_gemm_rows(tiles + t * tile_bytes, scales + t * kb * 2 * TILE_N, bits, kb, qx + r0 * k, dx + r0 * kb,
                           dxt + r0 * kb, k, rows, sums, r0 == 0 ? ahead_codes : NULL, ahead_scales);
            store_tile(sums, rows, width, bias ? bias + n0 : NULL, out, out_dt, n, r0, n0);
        }
    }
    free(qx);
    free(dx);
}
