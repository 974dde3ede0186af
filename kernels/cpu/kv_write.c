/* This step's K and V rows into their slots of the paged KV pool (pm_write_kv). See common.h. */
#include "common.h"

#include <math.h>

/* Write each token's k and v rows (kv_row = kv_heads * head_dim values each, rows k_stride /
 * v_stride apart) into its slot of the paged KV layer; slot = page * page_size + offset. */
void pm_write_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, int64_t tokens,
                 int64_t kv_row, void *kv_layer, const int64_t *slot_mapping, int page_size, int dt) {
    const int64_t es = elem_size(dt);
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t page = slot_mapping[t] / page_size, offset = slot_mapping[t] % page_size;
        char *k_dst = (char *)kv_layer + ((page * 2) * page_size + offset) * kv_row * es;
        memcpy(k_dst, (const char *)k + t * k_stride * es, (size_t)(kv_row * es));
        memcpy(k_dst + (int64_t)page_size * kv_row * es, (const char *)v + t * v_stride * es, (size_t)(kv_row * es));
    }
}

/* IEEE arithmetic here, whatever the library's flags: the division and the rounding must give
 * torch's bytes (-ffast-math would multiply by the reciprocal). no-trapping-math changes no result:
 * it lets the clamp's compares become vector selects. */
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "no-trapping-math")

/* x (finite, |x| <= the format's largest) to fp8, rounded to nearest even as torch's conversion
 * rounds (fmt 0: e4m3fn, bias 7, 3 mantissa bits; 1: e5m2, bias 15, 2 bits); subnormals below
 * the smallest normal exponent. Bit moves only (no libm call), so that the loop vectorizes:
 * - |x| >= the smallest normal 2^(1 - bias): the fp32 bits rounded to nearest even at the
 *   mantissa's top mbits (add half an fp8 ulp less one, plus the kept lowest bit, then shift;
 *   a carry out of the mantissa moves into the exponent, as it should), the exponent rebased;
 * - below it: |x| + 2^(24 - bias - mbits), a float whose ulp is fp8's subnormal step 2^(1 - bias
 *   - mbits), so that IEEE addition (this file's arithmetic, see above) rounds |x| to that step,
 *   to nearest even; its low bits are then the fp8 mantissa, 1 << mbits when it rounds up to the
 *   smallest normal, which is also that normal's encoding. */
static inline uint8_t f32_to_fp8(float x, int fmt) {
    const int mbits = fmt == 0 ? 3 : 2, bias = fmt == 0 ? 7 : 15, shift = 23 - mbits;
    union { float f; uint32_t u; } c = {x}, m;
    const uint32_t sign = (c.u >> 24) & 0x80u, a = c.u & 0x7FFFFFFFu;
    const uint32_t normal = ((a + (1u << (shift - 1)) - 1u + ((a >> shift) & 1u)) >> shift) - ((uint32_t)(127 - bias) << mbits);
    c.u = a;
    m.u = (uint32_t)(127 + 24 - bias - mbits) << 23; /* 2^(24 - bias - mbits) */
    const float sum = c.f + m.f;
    union { float f; uint32_t u; } r = {sum};
    const uint32_t sub = r.u - m.u;
    return (uint8_t)(sign | (a < (uint32_t)(128 - bias) << 23 ? sub : normal));
}

/* One row's KV heads (kv_row values of `row`, each head over its scale) into fp8 bytes: FMT a
 * compile-time constant at both calls, so that the loop vectorizes */
static inline __attribute__((always_inline)) void row_to_fp8(uint8_t *dst, const float *row, int num_kv_heads,
                                                            int head_dim, const float *scales, const int FMT) {
    const float largest = FMT == 0 ? 448.0f : 57344.0f;
    for (int h = 0; h < num_kv_heads; h++) {
        const float scale = scales[h];
        for (int d = 0; d < head_dim; d++) {
            float x = row[h * head_dim + d] / scale;
            x = x > largest ? largest : (x < -largest ? -largest : x);
            dst[h * head_dim + d] = f32_to_fp8(x, FMT);
        }
    }
}

/* pm_write_kv into an fp8 layer (pool bytes as workers/engine/kv_quant.py makes them): each value
 * over its KV head's scale (kv_scales [2][kv_heads]: K's, then V's), clamped to the format's
 * largest finite value, rounded to fp8 (f32_to_fp8): the bytes torch's
 * `(x.float() / scale).clamp(-max, max).to(fp8)` gives. */
void pm_write_kv_fp8(const void *k, int64_t k_stride, const void *v, int64_t v_stride, int64_t tokens,
                     int num_kv_heads, int head_dim, void *kv_layer, const int64_t *slot_mapping, int page_size,
                     const float *kv_scales, int fmt, int dt) {
    const int64_t es = elem_size(dt), kv_row = (int64_t)num_kv_heads * head_dim;
    float row[kv_row];
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t page = slot_mapping[t] / page_size, offset = slot_mapping[t] % page_size;
        uint8_t *k_dst = (uint8_t *)kv_layer + ((page * 2) * page_size + offset) * kv_row;
        for (int half = 0; half < 2; half++) {
            const char *src = half == 0 ? (const char *)k + t * k_stride * es : (const char *)v + t * v_stride * es;
            uint8_t *dst = k_dst + (int64_t)half * page_size * kv_row;
            const float *scales = kv_scales + half * num_kv_heads;
            load_row(row, src, kv_row, dt);
            if (fmt == 0)
                row_to_fp8(dst, row, num_kv_heads, head_dim, scales, 0);
            else
                row_to_fp8(dst, row, num_kv_heads, head_dim, scales, 1);
        }
    }
}

#pragma GCC pop_options
