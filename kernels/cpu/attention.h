/* What the two paged attention kernels share (attention.c over a pool in the model dtype,
 * attention_fp8.c over an fp8 pool): page prefetches, the softmax, and where the CPU has
 * AVX512-BF16 (PM_BF16_LOOPS) the bf16-query loops over K and V that both specialise. */
#ifndef PAGEMESH_CPU_ATTENTION_H
#define PAGEMESH_CPU_ATTENTION_H

#include <math.h>

#include "common.h"

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

/* scores[h][j] <- softmax over skip <= j < n of scores[h][j], each of `rows` rows; the first `skip`
 * (keys before a sliding window, on the window's first page) get weight 0. softcap > 0: each
 * score s becomes softcap * tanh(s / softcap) first (Gemma 2). */
static inline void softmax_rows(float *scores, int rows, int n, int skip, float softcap) {
    for (int h = 0; h < rows; h++) {
        float *sc = scores + (int64_t)h * n, sum = 0.0f;
        for (int j = 0; j < skip; j++) sc[j] = 0.0f;
        if (softcap > 0.0f)
            for (int j = skip; j < n; j++) sc[j] = softcap * tanhf(sc[j] / softcap);
        float mx = sc[skip];
        for (int j = skip + 1; j < n; j++) mx = sc[j] > mx ? sc[j] : mx;
        for (int j = skip; j < n; j++) {
            sc[j] = exp_approx(sc[j] - mx);
            sum += sc[j];
        }
        const float inv = 1.0f / sum;
        for (int j = skip; j < n; j++) sc[j] *= inv;
    }
}

/* The keys a query row reads under a sliding window: a row that sees positions 0..n-1 sees only
 * n - window.. of them. Its pages are read from the window's first page on (`*first_page`); the
 * keys on that page before the window are masked (`*skip` of them); it reads `*count` keys
 * (n - first_page * page_size). window <= 0: every key. */
static inline void window_keys(int n, int window, int page_size, int *first_page, int *skip, int *count) {
    const int lo = window > 0 && n > window ? n - window : 0;
    *first_page = lo / page_size;
    *skip = lo - *first_page * page_size;
    *count = n - *first_page * page_size;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PM_BF16_LOOPS 1
/* fp8 bytes -> bf16, 32 at a time (exact: every e4m3 and e5m2 value is a bf16 value), through a
 * 128-entry table of magnitudes held in 4 registers. lut: the bf16 bits of fp8 codes 0..127 (times
 * 256 for e4m3: see attention_fp8.c), as pm_paged_attention_fp8 builds it. */
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

#endif /* PAGEMESH_CPU_ATTENTION_H */
