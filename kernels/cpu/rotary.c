/* Rotate-half RoPE in place on q and k (pm_rotary). See common.h. */
#include "common.h"

/* Rotate-half RoPE of one head in place: x[i], x[i+half] with the token's cos/sin. */
static inline __attribute__((always_inline)) void rope_head(float *x, const float *cos, const float *sin, int half, int dt) {
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = round_dt(round_dt(a * cos[i], dt) + round_dt(-b * sin[i], dt), dt);
        x[i + half] = round_dt(round_dt(b * cos[i], dt) + round_dt(a * sin[i], dt), dt);
    }
}

/* RoPE in place on q [tokens][num_heads][head_dim] and k [tokens][num_kv_heads][head_dim], rows
 * q_stride / k_stride values apart (views into the fused qkv projection), at `positions`
 * (int64) from cos_sin_cache [max_pos][head_dim] (cos | sin, fp32). */
static inline __attribute__((always_inline)) void rotary_token(void *q, void *k, int num_heads, int num_kv_heads,
                                                               int head_dim, const float *cs, const int dt) {
    const int64_t es = elem_size(dt);
    const int half = head_dim / 2;
    float cos[half], sin[half], head[head_dim];
    for (int i = 0; i < half; i++) {
        cos[i] = round_dt(cs[i], dt);
        sin[i] = round_dt(cs[half + i], dt);
    }
    for (int h = 0; h < num_heads + num_kv_heads; h++) {
        char *p = h < num_heads ? (char *)q + (int64_t)h * head_dim * es : (char *)k + (int64_t)(h - num_heads) * head_dim * es;
        load_row(head, p, head_dim, dt);
        rope_head(head, cos, sin, half, dt);
        store_row(p, head, head_dim, dt);
    }
}

void pm_rotary(void *q, int64_t q_stride, void *k, int64_t k_stride, int64_t tokens, int num_heads,
               int num_kv_heads, int head_dim, const int64_t *positions, const float *cos_sin_cache, int dt) {
    const int64_t es = elem_size(dt);
#pragma omp parallel for schedule(static) if (tokens > 64)
    for (int64_t t = 0; t < tokens; t++) {
#define TOKEN(DT) rotary_token((char *)q + t * q_stride * es, (char *)k + t * k_stride * es, num_heads, num_kv_heads, \
                               head_dim, cos_sin_cache + positions[t] * head_dim, DT)
        FOR_DTYPE(dt, TOKEN);
#undef TOKEN
    }
}
