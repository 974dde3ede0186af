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
 * torch's bytes (-ffast-math would multiply by the reciprocal) */
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

/* x (finite, |x| <= the format's largest) to fp8, rounded to nearest even as torch's conversion
 * rounds (fmt 0: e4m3fn, bias 7, 3 mantissa bits; 1: e5m2, bias 15, 2 bits); subnormals below
 * the smallest normal exponent. */
static inline uint8_t f32_to_fp8(float x, int fmt) {
    const int mbits = fmt == 0 ? 3 : 2, bias = fmt == 0 ? 7 : 15, min_exp = 1 - bias;
    const uint8_t sign = signbit(x) ? 0x80 : 0;
    const float a = fabsf(x);
    if (a == 0.0f) return sign;
    int e;
    frexpf(a, &e);
    int exp = e - 1 < min_exp ? min_exp : e - 1; /* a = 1.m * 2^exp, or a subnormal's 0.m * 2^min_exp */
    float r = nearbyintf(ldexpf(a, mbits - exp)); /* exact scaling by a power of two, then RNE */
    if (r >= (float)(2 << mbits)) { /* rounded up into the next binade */
        r *= 0.5f;
        exp += 1;
    }
    if (r < (float)(1 << mbits)) return sign | (uint8_t)r; /* subnormal: exponent field 0 */
    return sign | (uint8_t)(((exp + bias) << mbits) | ((int)r - (1 << mbits)));
}

/* pm_write_kv into an fp8 layer (pool bytes as workers/engine/kv_quant.py makes them): each value
 * over its KV head's scale (kv_scales [2][kv_heads]: K's, then V's), clamped to the format's
 * largest finite value, rounded to fp8 (f32_to_fp8): the bytes torch's
 * `(x.float() / scale).clamp(-max, max).to(fp8)` gives. */
void pm_write_kv_fp8(const void *k, int64_t k_stride, const void *v, int64_t v_stride, int64_t tokens,
                     int num_kv_heads, int head_dim, void *kv_layer, const int64_t *slot_mapping, int page_size,
                     const float *kv_scales, int fmt, int dt) {
    const int64_t es = elem_size(dt), kv_row = (int64_t)num_kv_heads * head_dim;
    const float largest = fmt == 0 ? 448.0f : 57344.0f;
    float row[kv_row];
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t page = slot_mapping[t] / page_size, offset = slot_mapping[t] % page_size;
        uint8_t *k_dst = (uint8_t *)kv_layer + ((page * 2) * page_size + offset) * kv_row;
        for (int half = 0; half < 2; half++) {
            const char *src = half == 0 ? (const char *)k + t * k_stride * es : (const char *)v + t * v_stride * es;
            uint8_t *dst = k_dst + (int64_t)half * page_size * kv_row;
            load_row(row, src, kv_row, dt);
            for (int h = 0; h < num_kv_heads; h++) {
                const float scale = kv_scales[half * num_kv_heads + h];
                for (int d = 0; d < head_dim; d++) {
                    float x = row[h * head_dim + d] / scale;
                    x = x > largest ? largest : (x < -largest ? -largest : x);
                    dst[h * head_dim + d] = f32_to_fp8(x, fmt);
                }
            }
        }
    }
}

#pragma GCC pop_options
