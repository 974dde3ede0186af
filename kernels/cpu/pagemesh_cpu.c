/* pagemesh's CPU kernels: the ops around a Llama layer, on fp32 or bf16 rows, with OpenMP.
 *
 * Built at first use by kernels/cpu/build.py (cc -O3 -march=native -ffast-math -fopenmp) and
 * called through ctypes by kernels/cpu/__init__.py, which checks shapes, dtypes and strides; the
 * functions here trust their arguments.
 *
 * Numerics follow Hugging Face Llama in the model dtype: fp32 statistics, and for bf16 each
 * step that torch would round (x + residual, the normed row, weight * normed, x * cos, ...)
 * rounds here too, to nearest even.
 *
 * KV pool of one layer: kv[page][2][slot][kv_head][head_dim] (DESIGN.md section 3): the K of
 * the token in slot o of page p starts at ((p * 2 + 0) * page_size + o) * kv_heads * head_dim,
 * its V page_size rows further.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__)
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

static inline __attribute__((always_inline)) void add_rms_norm_row(const void *x, void *residual, void *out,
                                                                   const void *weight, int64_t cols, float eps,
                                                                   const int dt) {
    float sum[cols], w[cols];
    load_row(sum, x, cols, dt);
    if (residual != NULL) {
        float res[cols];
        load_row(res, residual, cols, dt);
        for (int64_t i = 0; i < cols; i++) sum[i] = round_dt(sum[i] + res[i], dt);
        store_row(residual, sum, cols, dt);
    }
    float ss = 0.0f;
    for (int64_t i = 0; i < cols; i++) ss += sum[i] * sum[i];
    const float inv = 1.0f / __builtin_sqrtf(ss / (float)cols + eps);
    load_row(w, weight, cols, dt);
    for (int64_t i = 0; i < cols; i++) sum[i] = round_dt(w[i] * round_dt(sum[i] * inv, dt), dt);
    store_row(out, sum, cols, dt);
}

/* out = weight * norm(x + residual); residual <- x + residual (in place). residual NULL: the
 * sum is x itself. rows of `cols` values, contiguous. */
void pm_add_rms_norm(const void *x, void *residual, void *out, const void *weight, int64_t rows,
                     int64_t cols, float eps, int dt) {
    const int64_t es = elem_size(dt);
#pragma omp parallel for schedule(static) if (rows * cols > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t at = r * cols * es;
#define ROW(DT) add_rms_norm_row((const char *)x + at, residual ? (char *)residual + at : NULL, (char *)out + at, \
                                 weight, cols, eps, DT)
        FOR_DTYPE(dt, ROW);
#undef ROW
    }
}

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

/* the value of each lane after a round trip through bf16 (nearest even) */
static inline __m512 round_bf16x16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
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

/* Attention of every query token over its sequence's pages, causal, GQA.
 *
 * Sequence s owns query rows query_start_loc[s] .. query_start_loc[s+1]-1 of q (rows `q_stride`
 * values apart, heads contiguous in a row) and has seq_lens[s] tokens in the pool after this
 * step; its last query row is the last token, so query row i of a chunk of n sees the first
 * seq_len - n + i + 1 tokens. One work item = one query row, all heads: every K/V row (all KV
 * heads, contiguous) is read once and serves each KV head's group of query heads. Two passes over the context (scores, then the
 * softmax-weighted V sum); the scores of an item live in a per-thread buffer. */
/* Ask for the next page's K or V block (page_size rows) while this one is read: pages of one
 * sequence are not adjacent in the pool, so the hardware prefetchers lose the stream at each. */
static inline void prefetch_block(const char *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

#if defined(__AVX512BF16__)
/* r[i] = the sum of v[i]'s 16 lanes: a transpose-and-add tree, ~3 ops per sum where a
 * horizontal reduction of each vector takes ~9 */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++) /* 128-bit lanes 0,1 hold v[2i]'s halves' sums, lanes 2,3 v[2i+1]'s */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* lane k: four partial sums of v[4i+k] */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* in each lane k: [x[2i]'s two sums, x[2i+1]'s two sums] */
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    /* element 4k+j = the sum of x[j]'s lane k = the sum of v[4j+k]; put it at 4j+k */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, r);
}
#endif

/* scores[h][j] <- softmax over j < n of scores[h][j], each of `rows` rows */
static inline void softmax_rows(float *scores, int rows, int n) {
    for (int h = 0; h < rows; h++) {
        float *sc = scores + (int64_t)h * n, mx = sc[0], sum = 0.0f;
        for (int j = 1; j < n; j++) mx = sc[j] > mx ? sc[j] : mx;
        for (int j = 0; j < n; j++) {
            sc[j] = exp_approx(sc[j] - mx);
            sum += sc[j];
        }
        const float inv = 1.0f / sum;
        for (int j = 0; j < n; j++) sc[j] *= inv;
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PM_BF16_LOOPS 1
/* fp8 bytes -> bf16, 32 at a time (exact: every e4m3 and e5m2 value is a bf16 value), through a
 * 128-entry table of magnitudes held in 4 registers. lut: the bf16 bits of fp8 codes 0..127 (times
 * 256 for e4m3: see the fp8 section below), as pm_paged_attention_fp8 builds it. */
static inline __m512i fp8x32_to_bf16(const uint8_t *src, const __m512i lut[4]) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)src));
    /* vpermt2w reads an index's low 6 bits: codes 0..63 from lut[0..1], 64..127 from lut[2..3] */
    const __m512i lo = _mm512_permutex2var_epi16(lut[0], w, lut[1]), hi = _mm512_permutex2var_epi16(lut[2], w, lut[3]);
    const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40)), lo, hi);
    return _mm512_or_si512(mag, _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
}

/* The bf16-query kernel's two passes, shared by a bf16 pool (FP8 = 0) and an fp8 one (FP8 = 1:
 * the pool's bytes widened to bf16 as they are read, `lut` from fp8_lut_registers; kv_scales
 * [2][num_kv_heads]: the K scale multiplies the scores, the V scale the output). FP8, HD and G
 * are compile-time constants at every call, so each copy keeps only its own branch. Query row t
 * (all heads) over the first n tokens of the sequence's pages; scores: [num_heads][n].
 *
 * bf16_scores (HD % 32 == 0): each K row (all KV heads, contiguous) serves every query head; 16
 * keys a pass with vdpbf16ps and one transpose-add reduction (sum16); an fp8 page's 16 keys are
 * widened once into kbuf, shared by all heads. Prefetches of the next page's K and this page's V
 * are spread between the heads (a burst per page was slower with the pool streaming from memory). */
static inline __attribute__((always_inline)) void bf16_scores(const bf16 *q, int64_t q_stride, const void *kv_layer,
                                                              const int32_t *pages, int64_t t, int n, int num_kv_heads,
                                                              const int HD, const int G, int page_size, float scale,
                                                              const int FP8, const float *kv_scales,
                                                              const __m512i lut[4], float *scores) {
    const int num_heads = num_kv_heads * G;
    const int64_t kv_row = (int64_t)num_kv_heads * HD, es = FP8 ? 1 : 2;
    const char *pool = (const char *)kv_layer;
    const bf16 *qb = q + t * q_stride;
    bf16 kbuf[FP8 ? 16 * kv_row : 1]; /* an fp8 page's 16 keys' K rows, widened */
    for (int j0 = 0, pi = 0; j0 < n; j0 += page_size, pi++) {
        const int len = n - j0 < page_size ? n - j0 : page_size;
        const char *k = pool + ((int64_t)pages[pi] * 2) * page_size * kv_row * es;
        const char *next_k = j0 + page_size < n ? pool + ((int64_t)pages[pi + 1] * 2) * page_size * kv_row * es : NULL;
        const char *this_v = k + page_size * kv_row * es;
        const int64_t block = (int64_t)len * kv_row * es;
        for (int o0 = 0; o0 < len; o0 += 16) { /* 16 keys at a time: one vector of scores per head */
            const int m = len - o0 < 16 ? len - o0 : 16;
            const bf16 *kb = (const bf16 *)k + o0 * kv_row;
            if (FP8) {
                for (int o = 0; o < m; o++)
                    for (int64_t i = 0; i < kv_row; i += 32)
                        _mm512_storeu_si512((void *)(kbuf + o * kv_row + i),
                                            fp8x32_to_bf16((const uint8_t *)k + (o0 + o) * kv_row + i, lut));
                kb = kbuf;
            }
            for (int h = 0; h < num_heads; h++) {
                if (o0 == 0) { /* a slice of the next page's K and of this page's V per head, between the math */
                    const int64_t lo = block * h / num_heads & ~(int64_t)63, hi = block * (h + 1) / num_heads;
                    for (int64_t i = lo; i < hi; i += 64) {
                        if (next_k != NULL) __builtin_prefetch(next_k + i, 0, 3);
                        __builtin_prefetch(this_v + i, 0, 2);
                    }
                }
                __m512 acc[16];
                const bf16 *kh = kb + (h / G) * HD;
#pragma GCC unroll 16
                for (int o = 0; o < 16; o++) { /* keys past the page's last (o >= m) reread its row; masked off below */
                    const bf16 *kr = kh + (o < m ? o : m - 1) * kv_row;
                    acc[o] = _mm512_setzero_ps();
#pragma GCC unroll 4
                    for (int d = 0; d < HD; d += 32)
                        acc[o] = _mm512_dpbf16_ps(acc[o], (__m512bh)_mm512_loadu_si512(qb + h * HD + d),
                                                  (__m512bh)_mm512_loadu_si512(kr + d));
                }
                const float s = FP8 ? scale * kv_scales[h / G] : scale;
                _mm512_mask_storeu_ps(scores + h * n + j0 + o0, (__mmask16)((1u << m) - 1u),
                                      _mm512_mul_ps(sum16(acc), _mm512_set1_ps(s)));
            }
        }
    }
}

/* bf16_weighted_v (HD % 16 == 0, and % 32 for fp8; G * HD <= 384): out = the softmaxed scores
 * times V, one KV head at a time, its group's G x HD sums in G x HD/16 registers over the whole
 * context (the rows come back from L2 for the other KV heads), rounded to bf16 once at the end. */
static inline __attribute__((always_inline)) void bf16_weighted_v(bf16 *out, const void *kv_layer,
                                                                  const int32_t *pages, int64_t t, int n,
                                                                  int num_kv_heads, const int HD, const int G,
                                                                  int page_size, const int FP8, const float *kv_scales,
                                                                  const __m512i lut[4], const float *scores) {
    const int num_heads = num_kv_heads * G;
    const int64_t kv_row = (int64_t)num_kv_heads * HD, es = FP8 ? 1 : 2;
    const char *pool = (const char *)kv_layer;
    for (int kvh = 0; kvh < num_kv_heads; kvh++) {
        __m512 acc[24]; /* fixed sizes (not G * HD / 16): the compiler keeps a fixed array in registers, a VLA in memory */
        const float *p = scores + (int64_t)kvh * G * n;
#pragma GCC unroll 24
        for (int i = 0; i < G * HD / 16; i++) acc[i] = _mm512_setzero_ps();
        for (int j0 = 0, pi = 0; j0 < n; j0 += page_size, pi++) {
            const int len = n - j0 < page_size ? n - j0 : page_size;
            const char *v = pool + (((int64_t)pages[pi] * 2 + 1) * page_size * kv_row + kvh * HD) * es;
            for (int o = 0; o < len; o++) {
                __m512 vv[8];
                if (FP8) {
#pragma GCC unroll 4
                    for (int c = 0; c < HD / 32; c++) { /* 32 values -> bf16 -> two fp32 vectors (bits moved up 16) */
                        const __m512i b = fp8x32_to_bf16((const uint8_t *)v + o * kv_row + c * 32, lut);
                        vv[2 * c] =
                            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(b)), 16));
                        vv[2 * c + 1] = _mm512_castsi512_ps(
                            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(b, 1)), 16));
                    }
                } else {
                    const bf16 *vb = (const bf16 *)v + o * kv_row;
#pragma GCC unroll 8
                    for (int c = 0; c < HD / 16; c++) /* bf16 -> fp32: the bits moved up 16 */
                        vv[c] = _mm512_castsi512_ps(
                            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vb + c * 16))), 16));
                }
#pragma GCC unroll 8
                for (int g = 0; g < G; g++) {
                    const __m512 w = _mm512_set1_ps(p[g * n + j0 + o]);
#pragma GCC unroll 8
                    for (int c = 0; c < HD / 16; c++) acc[g * HD / 16 + c] = _mm512_fmadd_ps(w, vv[c], acc[g * HD / 16 + c]);
                }
            }
        }
        bf16 *dst = out + (t * num_heads + (int64_t)kvh * G) * HD;
        const __m512 vs = _mm512_set1_ps(FP8 ? kv_scales[num_kv_heads + kvh] : 1.0f);
#pragma GCC unroll 24
        for (int i = 0; i < G * HD / 16; i++) /* to nearest even, as f32_to_bf16 */
            _mm256_storeu_si256((__m256i *)(dst + i * 16),
                                (__m256i)_mm512_cvtneps_pbh(FP8 ? _mm512_mul_ps(acc[i], vs) : acc[i]));
    }
}
#endif

/* One work item of pm_paged_attention: query row t (all heads) over the first n tokens of the
 * sequence's pages. Scores: each K row (all KV heads, contiguous) is read once and serves every
 * query head. Weighted V sum: one KV head at a time, so that its group's accumulators (G x HD
 * floats) stay in registers over the whole context; the rows come back from L2 for the other
 * KV heads. HD and G are compile-time constants in the specialised copies below.
 * scores: [num_heads][n]. */
static inline __attribute__((always_inline)) void attend_item(
    const void *q, int64_t q_stride, void *out, const void *kv_layer, const int32_t *pages, int64_t t, int n,
    int num_kv_heads, const int HD, const int G, int page_size, float scale, int dt, float *scores) {
    const int64_t es = elem_size(dt);
    const int num_heads = num_kv_heads * G;
    const int64_t kv_row = (int64_t)num_kv_heads * HD;
    float qf[num_heads * HD], row[kv_row];
    load_row(qf, (const char *)q + t * q_stride * es, (int64_t)num_heads * HD, dt);
    for (int i = 0; i < num_heads * HD; i++) qf[i] *= scale;
#if defined(PM_BF16_LOOPS)
    const int fast_scores = dt == DT_BF16 && HD % 32 == 0;
    if (fast_scores) bf16_scores((const bf16 *)q, q_stride, kv_layer, pages, t, n, num_kv_heads, HD, G, page_size, scale, 0, NULL, NULL, scores);
#else
    const int fast_scores = 0;
#endif
    for (int j0 = 0, pi = 0; j0 < n && !fast_scores; j0 += page_size, pi++) {
        const int64_t page = pages[pi];
        const int len = n - j0 < page_size ? n - j0 : page_size;
        const char *k = (const char *)kv_layer + (page * 2) * page_size * kv_row * es;
        const char *next_k = j0 + page_size < n
                                 ? (const char *)kv_layer + ((int64_t)pages[pi + 1] * 2) * page_size * kv_row * es
                                 : NULL;
        const char *this_v = k + page_size * kv_row * es;
        const int64_t block = (int64_t)len * kv_row * es;
        if (next_k != NULL) prefetch_block(next_k, page_size * kv_row * es);
        prefetch_block(this_v, block); /* for the second pass */
        for (int o = 0; o < len; o++) {
            load_row(row, k + o * kv_row * es, kv_row, dt);
            for (int h = 0; h < num_heads; h++) {
                const float *kh = row + (h / G) * HD, *qh = qf + h * HD;
                float dot = 0.0f;
                for (int d = 0; d < HD; d++) dot += qh[d] * kh[d];
                scores[h * n + j0 + o] = dot;
            }
        }
    }
    softmax_rows(scores, num_heads, n);
#if defined(PM_BF16_LOOPS)
    if (dt == DT_BF16 && HD % 16 == 0 && G * HD <= 384) { /* the group's sums in G x HD/16 registers */
        bf16_weighted_v((bf16 *)out, kv_layer, pages, t, n, num_kv_heads, HD, G, page_size, 0, NULL, NULL, scores);
        return;
    }
#endif
    for (int kvh = 0; kvh < num_kv_heads; kvh++) {
        float acc[G * HD], vrow[HD];
        const float *p = scores + (int64_t)kvh * G * n;
        for (int i = 0; i < G * HD; i++) acc[i] = 0.0f;
        for (int j0 = 0, pi = 0; j0 < n; j0 += page_size, pi++) {
            const int len = n - j0 < page_size ? n - j0 : page_size;
            const char *v = (const char *)kv_layer + (((int64_t)pages[pi] * 2 + 1) * page_size * kv_row + kvh * HD) * es;
            for (int o = 0; o < len; o++) {
                load_row(vrow, v + o * kv_row * es, HD, dt);
                for (int g = 0; g < G; g++) {
                    const float w = p[g * n + j0 + o];
                    for (int d = 0; d < HD; d++) acc[g * HD + d] += w * vrow[d];
                }
            }
        }
        store_row((char *)out + (t * num_heads + (int64_t)kvh * G) * HD * es, acc, (int64_t)G * HD, dt);
    }
}

#define ATTEND_ITEM(HD_, G_, DT_) \
    attend_item(q, q_stride, out, kv_layer, pages, t, n, num_kv_heads, HD_, G_, page_size, scale, DT_, scores)

/* the common shapes (head_dim 64 or 128, 1-8 query heads per KV head, bf16) get their own
 * compiled copies; anything else takes the generic one */
#define ATTEND_G(HD_)                                    \
    switch (group) {                                     \
        case 1: ATTEND_ITEM(HD_, 1, DT_BF16); break;      \
        case 2: ATTEND_ITEM(HD_, 2, DT_BF16); break;      \
        case 3: ATTEND_ITEM(HD_, 3, DT_BF16); break;      \
        case 4: ATTEND_ITEM(HD_, 4, DT_BF16); break;      \
        case 6: ATTEND_ITEM(HD_, 6, DT_BF16); break;      \
        case 7: ATTEND_ITEM(HD_, 7, DT_BF16); break;      \
        case 8: ATTEND_ITEM(HD_, 8, DT_BF16); break;      \
        default: ATTEND_ITEM(HD_, group, DT_BF16); break; \
    }

void pm_paged_attention(const void *q, int64_t q_stride, void *out, const void *kv_layer,
                        const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                        const int32_t *query_start_loc, int num_seqs, int num_heads, int num_kv_heads,
                        int head_dim, int page_size, float scale, int dt) {
    const int group = num_heads / num_kv_heads;
    const int64_t tokens = query_start_loc[num_seqs];
    int max_len = 0;
    int32_t *seq_of_token = (int32_t *)malloc(sizeof(int32_t) * (size_t)(tokens > 0 ? tokens : 1));
    for (int s = 0; s < num_seqs; s++) {
        if (seq_lens[s] > max_len) max_len = seq_lens[s];
        for (int32_t t = query_start_loc[s]; t < query_start_loc[s + 1]; t++) seq_of_token[t] = s;
    }
#pragma omp parallel if (tokens * max_len > 1024)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)num_heads * (size_t)(max_len > 0 ? max_len : 1));
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tokens; t++) {
            const int s = seq_of_token[t];
            const int q_len = query_start_loc[s + 1] - query_start_loc[s];
            const int n = seq_lens[s] - q_len + (int)(t - query_start_loc[s]) + 1;
            const int32_t *pages = block_tables + (int64_t)s * bt_stride;
            if (head_dim == 64 && dt == DT_BF16) {
                ATTEND_G(64)
            } else if (head_dim == 128 && dt == DT_BF16) {
                ATTEND_G(128)
            } else {
                ATTEND_ITEM(head_dim, group, dt);
            }
        }
        free(scores);
    }
    free(seq_of_token);
}

/* ---- bf16 linear layers on AMX, for the few rows of a decode step --------------------------
 *
 * y[M, N] = x[M, K] W^T (+ bias), W packed once by pm_amx_pack: for each block of 16 output
 * columns, K/32 tiles of 16 rows x 64 bytes, row r holding the pairs (W[n][32kb + 2r],
 * W[n][32kb + 2r + 1]) for the block's 16 n (the VNNI layout tdpbf16ps reads). A block's tiles are
 * contiguous, so a thread streams each weight once, front to back. Rows of x go 32 at a time
 * (two A tiles, zero-padded); each work item is two column blocks (four C tiles), handed out
 * dynamically so that a thread the OS preempts does not hold the others at a barrier. Sums are
 * fp32, rounded to bf16 once at the end, as oneDNN does. */
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands out the AMX register state only to processes that ask (arch_prctl). */
int pm_amx_init(void) {
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : 0;
}

void pm_amx_pack(const bf16 *w, bf16 *packed, int64_t n, int64_t k) {
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < n / 16; nb++)
        for (int64_t kb = 0; kb < k / 32; kb++) {
            bf16 *tile = packed + (nb * (k / 32) + kb) * 512;
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++) {
                    const bf16 *src = w + (nb * 16 + c) * k + kb * 32 + 2 * r;
                    tile[r * 32 + 2 * c] = src[0];
                    tile[r * 32 + 2 * c + 1] = src[1];
                }
        }
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void amx_configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) { /* 0-3: C (16 x 16 fp32), 4-5: A (16 x 32 bf16), 6-7: B (16 x 16 pairs) */
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

enum { AMX_AHEAD = 4 }; /* tiles (1 KB each) prefetched ahead of the one multiplied */

/* xp: x zero-padded to 32 rows; out rows m < rows valid. */
static inline void amx_item(const bf16 *xp, const bf16 *packed, const bf16 *bias, void *out, int out_f32,
                            int64_t rows, int64_t n, int64_t k, int64_t nb, int nblocks, float *cbuf) {
    const int64_t kbs = k / 32, block = kbs * 512;
    const bf16 *b0 = packed + nb * block, *b1 = b0 + block;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int two_a = rows > 16;
    for (int64_t kb = 0; kb < kbs; kb++) {
        if (kb + AMX_AHEAD < kbs) /* the tiles AMX_AHEAD steps on, both streams */
            for (int l = 0; l < 1024; l += 64) {
                __builtin_prefetch((const char *)(b0 + (kb + AMX_AHEAD) * 512) + l, 0, 3);
                if (nblocks > 1) __builtin_prefetch((const char *)(b1 + (kb + AMX_AHEAD) * 512) + l, 0, 3);
            }
        _tile_loadd(4, xp + kb * 32, k * 2);
        _tile_loadd(6, b0 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_a) {
            _tile_loadd(5, xp + 16 * k + kb * 32, k * 2);
            _tile_dpbf16ps(2, 5, 6);
        }
        if (nblocks > 1) {
            _tile_loadd(7, b1 + kb * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            if (two_a) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, cbuf, 128); /* cbuf [32][32]: rows of x by the item's 32 columns */
    if (two_a) _tile_stored(2, cbuf + 16 * 32, 128);
    if (nblocks > 1) {
        _tile_stored(1, cbuf + 16, 128);
        if (two_a) _tile_stored(3, cbuf + 16 * 32 + 16, 128);
    }
    for (int b = 0; b < nblocks; b++) {
        const __m512 bv = bias != NULL ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                             _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + (nb + b) * 16))), 16))
                                       : _mm512_setzero_ps();
        for (int64_t m = 0; m < rows; m++) { /* + bias in fp32, then to bf16 by nearest even */
            const __m512 v = _mm512_add_ps(_mm512_load_ps(cbuf + m * 32 + b * 16), bv);
            if (out_f32) /* the bf16 value, widened: what .float() of the bf16 result would hold */
                _mm512_storeu_ps((float *)out + m * n + (nb + b) * 16, round_bf16x16(v));
            else
                _mm256_storeu_si256((__m256i *)((bf16 *)out + m * n + (nb + b) * 16), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

void pm_amx_linear(const bf16 *x, const bf16 *packed, const bf16 *bias, void *out, int out_f32, int64_t m, int64_t n,
                   int64_t k) {
    const int64_t mpad = (m + 31) / 32 * 32, items = (n / 16 + 1) / 2;
    bf16 *xp = (bf16 *)aligned_alloc(64, (size_t)(mpad * k * 2));
    memcpy(xp, x, (size_t)(m * k * 2));
    memset(xp + m * k, 0, (size_t)((mpad - m) * k * 2));
#pragma omp parallel if (items > 1)
    {
        float cbuf[32 * 32] __attribute__((aligned(64)));
        amx_configure();
#pragma omp for schedule(dynamic, 2)
        for (int64_t it = 0; it < items; it++) {
            const int64_t nb = 2 * it;
            /* 32 rows at a time; after the first, the item's weights come from L2 */
            for (int64_t m0 = 0; m0 < m; m0 += 32)
                amx_item(xp + m0 * k, packed, bias, (char *)out + m0 * n * (out_f32 ? 4 : 2), out_f32,
                         m - m0 < 32 ? m - m0 : 32, n, k, nb,
                         nb + 1 < n / 16 ? 2 : 1, cbuf);
        }
        _tile_release();
    }
    free(xp);
}
#else
int pm_amx_init(void) { return 0; }
void pm_amx_pack(const bf16 *w, bf16 *packed, int64_t n, int64_t k) { (void)w; (void)packed; (void)n; (void)k; }
void pm_amx_linear(const bf16 *x, const bf16 *packed, const bf16 *bias, void *out, int out_f32, int64_t m, int64_t n,
                   int64_t k) {
    (void)x; (void)packed; (void)bias; (void)out; (void)out_f32; (void)m; (void)n; (void)k;
}
#endif

/* ---- greedy sampling -------------------------------------------------------------------------
 * out[r] = the index of the first maximum of row r of x (fp32, rows row_stride apart); a row
 * holding NaN gives its first NaN, as torch.max does. NaN is tested on the bits: -ffast-math lets
 * the compiler assume that x != x never holds. */
static inline int is_nan(float f) {
    union { float f; uint32_t u; } c = {f};
    return (c.u & 0x7fffffffu) > 0x7f800000u;
}

static int64_t argmax_row(const float *x, int64_t cols) {
    int64_t best = 0, j = 0;
    float best_v = x[0];
#if defined(__AVX512F__)
    if (cols >= 16) {
        __m512 vmax = _mm512_loadu_ps(x);
        __m512i vidx = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512i step = _mm512_set1_epi32(16);
        __m512i idx = vidx;
        const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf_bits = _mm512_set1_epi32(0x7f800000);
#define NAN_LANES(V) _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(V), abs_mask), inf_bits)
        __mmask16 nan = NAN_LANES(vmax);
        for (j = 16; j + 16 <= cols; j += 16) {
            idx = _mm512_add_epi32(idx, step);
            const __m512 v = _mm512_loadu_ps(x + j);
            nan |= NAN_LANES(v);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ); /* strictly greater: a lane keeps its first */
            vmax = _mm512_mask_blend_ps(gt, vmax, v);
            vidx = _mm512_mask_blend_epi32(gt, vidx, idx);
        }
#undef NAN_LANES
        if (nan) {
            for (int64_t i = 0; i < cols; i++)
                if (is_nan(x[i])) return i;
        }
        float vals[16];
        int32_t idxs[16];
        _mm512_storeu_ps(vals, vmax);
        _mm512_storeu_si512(idxs, vidx);
        best_v = vals[0];
        best = idxs[0];
        for (int l = 1; l < 16; l++) /* the largest value; among equals, the lowest index */
            if (vals[l] > best_v || (vals[l] == best_v && idxs[l] < best)) {
                best_v = vals[l];
                best = idxs[l];
            }
    }
#endif
    for (; j < cols; j++) { /* the tail past the 16-lane part, or the whole row */
        if (is_nan(x[j])) return j;
        if (x[j] > best_v) {
            best_v = x[j];
            best = j;
        }
    }
    return best;
}

void pm_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t row_stride, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows * cols > 65536)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * row_stride, cols);
}

/* ---- attention over an fp8 KV pool (--kv-cache-dtype fp8_e4m3 | fp8_e5m2) -----------------
 *
 * The pool holds one byte per value; byte b of (K or V, kv head h) stands for
 * fp8(b) * kv_scales[0 or 1][h] (kv_scales: 2 x num_kv_heads floats, workers/engine/kv_quant.py).
 * fp8 -> fp32 goes through fp16 bits: e5m2 is the top byte of an fp16; e4m3's 4 exponent and
 * 3 mantissa bits (bias 7) put into fp16's exponent and mantissa (bias 15) read as 2^-8 times
 * the value, normals and subnormals alike, so that 256 is folded into the scales. The stored
 * bytes are finite (writes saturate), so fp8's NaN codes are not decoded. */
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { FP8_E4M3 = 0, FP8_E5M2 = 1 };

static inline uint16_t fp8_half_bits(uint8_t b, int fmt) {
    return fmt == FP8_E5M2 ? (uint16_t)(b << 8) : (uint16_t)(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7));
}

static inline float half_bits_to_f32(uint16_t h) {
    const int exp = (h >> 10) & 31, mant = h & 1023;
    float v = exp == 0 ? (float)mant * (1.0f / 16777216.0f) /* subnormal: mant * 2^-24 */
                       : (float)(1024 + mant) * (exp >= 25 ? (float)(1 << (exp - 25)) : 1.0f / (float)(1 << (25 - exp)));
    return (h & 0x8000u) ? -v : v;
}

/* dst[i] = the fp16 reading of src[i] (times 2^-8 for e4m3, see above) */
static inline void load_fp8_row(float *dst, const uint8_t *src, int64_t n, int fmt) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m256i low7 = _mm256_set1_epi16(0x7F), sign = _mm256_set1_epi16(0x80);
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + i)));
        h = fmt == FP8_E5M2 ? _mm256_slli_epi16(h, 8)
                            : _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, sign), 8),
                                              _mm256_slli_epi16(_mm256_and_si256(h, low7), 7));
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(h));
    }
#endif
    for (; i < n; i++) dst[i] = half_bits_to_f32(fp8_half_bits(src[i], fmt));
}

/* One work item of pm_paged_attention_fp8: query row t (all heads) over the first n tokens of
 * the sequence's pages, as attend_item's generic path, each K/V row decoded once into fp32.
 * The K scale of each head is folded into its query, the V scale into its output. */
static inline __attribute__((always_inline)) void attend_item_fp8(
    const void *q, int64_t q_stride, void *out, const uint8_t *kv_layer, const int32_t *pages, int64_t t, int n,
    int num_kv_heads, const int HD, int G, int page_size, float scale, const float *kv_scales, int fmt, int dt,
    float *scores) {
    const int64_t es = elem_size(dt);
    const int num_heads = num_kv_heads * G;
    const int64_t kv_row = (int64_t)num_kv_heads * HD;
    const float unit = fmt == FP8_E4M3 ? 256.0f : 1.0f;
    float qf[num_heads * HD], row[kv_row];
    load_row(qf, (const char *)q + t * q_stride * es, (int64_t)num_heads * HD, dt);
    for (int h = 0; h < num_heads; h++) {
        const float s = scale * kv_scales[h / G] * unit;
        for (int d = 0; d < HD; d++) qf[h * HD + d] *= s;
    }
    for (int j0 = 0, pi = 0; j0 < n; j0 += page_size, pi++) {
        const int len = n - j0 < page_size ? n - j0 : page_size;
        const uint8_t *k = kv_layer + ((int64_t)pages[pi] * 2) * page_size * kv_row;
        if (j0 + page_size < n) prefetch_block((const char *)kv_layer + ((int64_t)pages[pi + 1] * 2) * page_size * kv_row, page_size * kv_row);
        prefetch_block((const char *)k + page_size * kv_row, len * kv_row); /* this page's V, for the second pass */
        for (int o = 0; o < len; o++) {
            load_fp8_row(row, k + o * kv_row, kv_row, fmt);
            for (int h = 0; h < num_heads; h++) {
                const float *kh = row + (h / G) * HD, *qh = qf + h * HD;
                float dot = 0.0f;
                for (int d = 0; d < HD; d++) dot += qh[d] * kh[d];
                scores[h * n + j0 + o] = dot;
            }
        }
    }
    softmax_rows(scores, num_heads, n);
    for (int kvh = 0; kvh < num_kv_heads; kvh++) {
        float acc[G * HD], vrow[HD];
        const float *p = scores + (int64_t)kvh * G * n;
        for (int i = 0; i < G * HD; i++) acc[i] = 0.0f;
        for (int j0 = 0, pi = 0; j0 < n; j0 += page_size, pi++) {
            const int len = n - j0 < page_size ? n - j0 : page_size;
            const uint8_t *v = kv_layer + ((int64_t)pages[pi] * 2 + 1) * page_size * kv_row + kvh * HD;
            for (int o = 0; o < len; o++) {
                load_fp8_row(vrow, v + o * kv_row, HD, fmt);
                for (int g = 0; g < G; g++) {
                    const float w = p[g * n + j0 + o];
                    for (int d = 0; d < HD; d++) acc[g * HD + d] += w * vrow[d];
                }
            }
        }
        const float vs = kv_scales[num_kv_heads + kvh] * unit;
        for (int i = 0; i < G * HD; i++) acc[i] *= vs;
        store_row((char *)out + (t * num_heads + (int64_t)kvh * G) * HD * es, acc, (int64_t)G * HD, dt);
    }
}

#if defined(PM_BF16_LOOPS)
/* The bf16-query path (the served one). Why the generic path above is ~2.3x slower than the bf16
 * kernel (perf, SmolLM2's 9 heads of 64 over 3 KV heads): each (key, head) dot ends in a
 * horizontal reduction and a scalar store, and the V sums (G x HD floats, a run-time G) live in
 * memory, loaded and stored at every key. Here the fp8 bytes become bf16 as they are read
 * (fp8x32_to_bf16), and the rest is the bf16 kernel's own loops (bf16_scores, bf16_weighted_v
 * with FP8 = 1). lut_bits: the bf16 bits of fp8 codes 0..127 (times 256 for e4m3, see above). */
static inline __attribute__((always_inline)) void attend_item_fp8_bf16(
    const bf16 *q, int64_t q_stride, bf16 *out, const uint8_t *kv_layer, const int32_t *pages, int64_t t, int n,
    int num_kv_heads, const int HD, const int G, int page_size, float scale, const float *kv_scales,
    const uint16_t *lut_bits, float *scores) {
    __m512i lut[4];
    for (int i = 0; i < 4; i++) lut[i] = _mm512_loadu_si512(lut_bits + 32 * i);
    bf16_scores(q, q_stride, kv_layer, pages, t, n, num_kv_heads, HD, G, page_size, scale, 1, kv_scales, lut, scores);
    softmax_rows(scores, num_kv_heads * G, n);
    bf16_weighted_v(out, kv_layer, pages, t, n, num_kv_heads, HD, G, page_size, 1, kv_scales, lut, scores);
}
#define PM_FP8_BF16 1
#endif

/* pm_paged_attention over an fp8 pool (kv_layer: bytes), q and out in `dt`; kv_scales: [2][num_kv_heads]
 * (K's, then V's); fmt: FP8_E4M3 or FP8_E5M2. */
void pm_paged_attention_fp8(const void *q, int64_t q_stride, void *out, const void *kv_layer,
                            const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                            const int32_t *query_start_loc, int num_seqs, int num_heads, int num_kv_heads,
                            int head_dim, int page_size, float scale, const float *kv_scales, int fmt, int dt) {
    const int group = num_heads / num_kv_heads;
    const int64_t tokens = query_start_loc[num_seqs];
    int max_len = 0;
    int32_t *seq_of_token = (int32_t *)malloc(sizeof(int32_t) * (size_t)(tokens > 0 ? tokens : 1));
    for (int s = 0; s < num_seqs; s++) {
        if (seq_lens[s] > max_len) max_len = seq_lens[s];
        for (int32_t t = query_start_loc[s]; t < query_start_loc[s + 1]; t++) seq_of_token[t] = s;
    }
    uint16_t lut[128]; /* bf16 bits of codes 0..127, the true fp8 values (e4m3: the fp16 reading times 256) */
    for (int b = 0; b < 128; b++)
        lut[b] = f32_to_bf16(half_bits_to_f32(fp8_half_bits((uint8_t)b, fmt)) * (fmt == FP8_E4M3 ? 256.0f : 1.0f));
#pragma omp parallel if (tokens * max_len > 1024)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)num_heads * (size_t)(max_len > 0 ? max_len : 1));
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tokens; t++) {
            const int s = seq_of_token[t];
            const int q_len = query_start_loc[s + 1] - query_start_loc[s];
            const int n = seq_lens[s] - q_len + (int)(t - query_start_loc[s]) + 1;
            const int32_t *pages = block_tables + (int64_t)s * bt_stride;
#if defined(PM_FP8_BF16)
#define FP8_ITEM(HD_, G_)                                                                                              \
    attend_item_fp8_bf16((const bf16 *)q, q_stride, (bf16 *)out, (const uint8_t *)kv_layer, pages, t, n, num_kv_heads, \
                         HD_, G_, page_size, scale, kv_scales, lut, scores)
            /* bf16 queries, head_dim 64 or 128 and the group's V sums in 24 registers: compiled copies */
            if (dt == DT_BF16 && head_dim == 64 && group <= 6) {
                switch (group) {
                    case 1: FP8_ITEM(64, 1); break;
                    case 2: FP8_ITEM(64, 2); break;
                    case 3: FP8_ITEM(64, 3); break;
                    case 4: FP8_ITEM(64, 4); break;
                    case 5: FP8_ITEM(64, 5); break;
                    default: FP8_ITEM(64, 6); break;
                }
                continue;
            }
            if (dt == DT_BF16 && head_dim == 128 && group <= 3) {
                switch (group) {
                    case 1: FP8_ITEM(128, 1); break;
                    case 2: FP8_ITEM(128, 2); break;
                    default: FP8_ITEM(128, 3); break;
                }
                continue;
            }
#undef FP8_ITEM
#endif
            /* head_dim 64 and 128 get compiled copies with a constant HD (unrolled, vectorized dots) */
            if (head_dim == 64)
                attend_item_fp8(q, q_stride, out, (const uint8_t *)kv_layer, pages, t, n, num_kv_heads, 64, group,
                                page_size, scale, kv_scales, fmt, dt, scores);
            else if (head_dim == 128)
                attend_item_fp8(q, q_stride, out, (const uint8_t *)kv_layer, pages, t, n, num_kv_heads, 128, group,
                                page_size, scale, kv_scales, fmt, dt, scores);
            else
                attend_item_fp8(q, q_stride, out, (const uint8_t *)kv_layer, pages, t, n, num_kv_heads, head_dim,
                                group, page_size, scale, kv_scales, fmt, dt, scores);
        }
        free(scores);
    }
    free(seq_of_token);
}
