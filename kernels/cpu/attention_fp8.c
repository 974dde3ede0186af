/* Paged attention over an fp8 KV pool (--kv-cache-dtype fp8_e4m3 | fp8_e5m2): pm_paged_attention_fp8.
 *
 * The pool holds one byte per value; byte b of (K or V, kv head h) stands for
 * fp8(b) * kv_scales[0 or 1][h] (kv_scales: 2 x num_kv_heads floats, workers/engine/kv_quant.py).
 * fp8 -> fp32 goes through fp16 bits: e5m2 is the top byte of an fp16; e4m3's 4 exponent and
 * 3 mantissa bits (bias 7) put into fp16's exponent and mantissa (bias 15) read as 2^-8 times
 * the value, normals and subnormals alike, so that 256 is folded into the scales. The stored
 * bytes are finite (writes saturate), so fp8's NaN codes are not decoded. */
#include "attention.h"

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

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h> /* common.h includes it only under AVX-512 */
#define PM_FP8_AVX2 1
/* 8 fp8 bytes -> their fp16 readings (see above) as fp32: e5m2 moved up 8 bits; e4m3 moved up 7,
 * b + (b >> 7 << 7) first carrying the sign from bit 7 to bit 8 (bit 15 after the shift; shifts
 * only, so that no constant holds a register in the V loop) */
static inline __m256 fp8x8_to_f32(const uint8_t *src, int fmt) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)src));
    return _mm256_cvtph_ps(fmt == FP8_E5M2 ? _mm_slli_epi16(b, 8)
                                           : _mm_slli_epi16(_mm_add_epi16(b, _mm_slli_epi16(_mm_srli_epi16(b, 7), 7)), 7));
}

/* fp8x8_to_f32 of 16 bytes into dst[0..15], the bit moves on all 16 at once */
static inline void fp8x16_to_f32(float *dst, const uint8_t *src, int fmt) {
    __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)src));
    b = fmt == FP8_E5M2 ? _mm256_slli_epi16(b, 8)
                        : _mm256_slli_epi16(_mm256_add_epi16(b, _mm256_slli_epi16(_mm256_srli_epi16(b, 7), 7)), 7);
    _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm256_castsi256_si128(b)));
    _mm256_storeu_ps(dst + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(b, 1)));
}
#endif

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
#elif defined(PM_FP8_AVX2)
    for (; i + 16 <= n; i += 16) fp8x16_to_f32(dst + i, src + i, fmt);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, fp8x8_to_f32(src + i, fmt));
#endif
    for (; i < n; i++) dst[i] = half_bits_to_f32(fp8_half_bits(src[i], fmt));
}

/* The query row's heads (num_heads x HD values of `q`, in dt) as fp32, each head times
 * `scale` and its KV head's K scale (the K scale folded into the query) */
static inline void load_scaled_query(float *qf, const void *q, int num_heads, int HD, int G, float scale,
                                     const float *kv_scales, int dt) {
    load_row(qf, q, (int64_t)num_heads * HD, dt);
    for (int h = 0; h < num_heads; h++) {
        const float s = scale * kv_scales[h / G];
        for (int d = 0; d < HD; d++) qf[h * HD + d] *= s;
    }
}

/* Page pi of the keys (from key j0, `len` of them): prefetch the next page's K and this page's V,
 * for the second pass (fp8 bytes: a row is kv_row bytes) */
static inline void prefetch_page(const uint8_t *kv_layer, const int32_t *pages, int pi, int j0, int n, int len,
                                 int page_size, int64_t kv_row) {
    if (j0 + page_size < n) prefetch_block((const char *)kv_layer + ((int64_t)pages[pi + 1] * 2) * page_size * kv_row, page_size * kv_row);
    prefetch_block((const char *)kv_layer + ((int64_t)pages[pi] * 2 + 1) * page_size * kv_row, len * kv_row);
}

/* One work item of pm_paged_attention_fp8: query row t (all heads) over the first n tokens of
 * the sequence's pages, as attend_item's generic path (attention.c), each K/V row decoded once into fp32.
 * The K scale of each head is folded into its query, the V scale into its output; window and
 * softcap as pm_paged_attention's (attention.c). */
static inline __attribute__((always_inline)) void attend_item_fp8(
    const void *q, int64_t q_stride, void *out, const uint8_t *kv_layer, const int32_t *pages, int64_t t, int n,
    int num_kv_heads, const int HD, int G, int page_size, float scale, int window, float softcap,
    const float *kv_scales, int fmt, int dt, float *scores) {
    int first_page, skip;
    window_keys(n, window, page_size, &first_page, &skip, &n);
    pages += first_page;
    const int64_t es = elem_size(dt);
    const int num_heads = num_kv_heads * G;
    const int64_t kv_row = (int64_t)num_kv_heads * HD;
    const float unit = fmt == FP8_E4M3 ? 256.0f : 1.0f;
    float qf[num_heads * HD], row[kv_row];
    load_scaled_query(qf, (const char *)q + t * q_stride * es, num_heads, HD, G, scale * unit, kv_scales, dt);
    for (int j0 = 0, pi = 0; j0 < n; j0 += page_size, pi++) {
        const int len = n - j0 < page_size ? n - j0 : page_size;
        const uint8_t *k = kv_layer + ((int64_t)pages[pi] * 2) * page_size * kv_row;
        prefetch_page(kv_layer, pages, pi, j0, n, len, page_size, kv_row);
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
    softmax_rows(scores, num_heads, n, skip, softcap);
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

#if defined(PM_FP8_AVX2)
/* r[i] = the sum of v[i]'s 8 lanes (a transpose-and-add tree: 8 sums in 9 ops) */
static inline __m256 sum8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* a: v0..v3's low-half sums, then their high-half sums; b: v4..v7's */
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* attend_item_fp8_avx2's scores: every query head (qf, scaled) against the first n keys; 8 keys'
 * K rows decoded at a time into kbuf and shared by all heads, each head's 8 dots reduced together.
 * Not inlined into the items: it does not depend on the group size, so the compiler makes one
 * copy a head_dim (constant at both calls) instead of one per (head_dim, group) item */
static __attribute__((noinline)) void fp8_scores_avx2(float *scores, const float *qf, const uint8_t *kv_layer,
                                                      const int32_t *pages, int n, int num_heads, int page_size,
                                                      int64_t kv_row, const int HD, int G, float *kbuf, int fmt) {
    for (int j0 = 0, pi = 0; j0 < n; j0 += page_size, pi++) {
        const int len = n - j0 < page_size ? n - j0 : page_size;
        const uint8_t *k = kv_layer + ((int64_t)pages[pi] * 2) * page_size * kv_row;
        prefetch_page(kv_layer, pages, pi, j0, n, len, page_size, kv_row);
        for (int o0 = 0; o0 < len; o0 += 8) {
            const int m = len - o0 < 8 ? len - o0 : 8;
            for (int o = 0; o < m; o++)
                for (int64_t i = 0; i < kv_row; i += 16) /* kv_row: a multiple of HD (64 or 128) */
                    fp8x16_to_f32(kbuf + o * kv_row + i, k + (o0 + o) * kv_row + i, fmt);
            for (int h = 0; h < num_heads; h++) {
                const float *kh = kbuf + (h / G) * HD, *qh = qf + h * HD;
                __m256 acc[8];
#pragma GCC unroll 8
                for (int o = 0; o < 8; o++) acc[o] = _mm256_setzero_ps();
#pragma GCC unroll 16
                for (int d = 0; d < HD; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(qh + d);
#pragma GCC unroll 8
                    for (int o = 0; o < 8; o++) /* keys past the page's last (o >= m) reread its row; dropped below */
                        acc[o] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kh + (o < m ? o : m - 1) * kv_row + d), acc[o]);
                }
                float *dst = scores + h * n + j0 + o0;
                if (m == 8) {
                    _mm256_storeu_ps(dst, sum8(acc));
                } else {
                    float tmp[8];
                    _mm256_storeu_ps(tmp, sum8(acc));
                    for (int o = 0; o < m; o++) dst[o] = tmp[o];
                }
            }
        }
    }
}

/* One pass of attend_item_fp8_avx2's weighted V sum: columns c0 * 8 .. (c0 + CWC) * 8 - 1 of one KV
 * head (v_head: its V values at key 0 of page 0's row) for its G query heads, into dst (G rows of
 * HD), times the V scale vs; p: the heads' softmax weights, n per head */
static inline __attribute__((always_inline)) void fp8_weighted_v_pass(float *dst, const float *p, const uint8_t *v_head,
                                                                     const int32_t *pages, int n, int page_size,
                                                                     int64_t kv_row, const int HD, const int G, int c0,
                                                                     const int CWC, __m256 vs, int fmt) {
    __m256 acc[12];
#pragma GCC unroll 12
    for (int i = 0; i < G * CWC; i++) acc[i] = _mm256_setzero_ps();
    for (int j0 = 0, pi = 0; j0 < n; j0 += page_size, pi++) {
        const int len = n - j0 < page_size ? n - j0 : page_size;
        const uint8_t *v = v_head + ((int64_t)pages[pi] * 2 + 1) * page_size * kv_row + c0 * 8;
        for (int o = 0; o < len; o++) {
            __m256 w[8];
#pragma GCC unroll 8
            for (int g = 0; g < G; g++) w[g] = _mm256_broadcast_ss(p + g * n + j0 + o);
#pragma GCC unroll 8
            for (int c = 0; c < CWC; c++) {
                const __m256 vv = fp8x8_to_f32(v + o * kv_row + c * 8, fmt);
#pragma GCC unroll 8
                for (int g = 0; g < G; g++) acc[g * CWC + c] = _mm256_fmadd_ps(w[g], vv, acc[g * CWC + c]);
            }
        }
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; g++)
#pragma GCC unroll 8
        for (int c = 0; c < CWC; c++) _mm256_storeu_ps(dst + g * HD + (c0 + c) * 8, _mm256_mul_ps(acc[g * CWC + c], vs));
}

/* attend_item_fp8 for a CPU with AVX2, FMA and F16C but no AVX-512 (HD % 8 == 0; HD and G
 * compile-time constants). Scores: 8 keys a pass, their K rows (all KV heads) decoded once into
 * kbuf and shared by every head, each head's 8 dots kept in 8 vectors and reduced together (sum8)
 * instead of one horizontal reduction per (key, head). Weighted V sum: one KV head at a time, its
 * group's sums in registers over the whole context, CW vectors (8 CW columns) of each query head
 * at a time so that they fit AVX2's 16 registers; each V byte is decoded once. */
static inline __attribute__((always_inline)) void attend_item_fp8_avx2(
    const void *q, int64_t q_stride, void *out, const uint8_t *kv_layer, const int32_t *pages, int64_t t, int n,
    int num_kv_heads, const int HD, const int G, int page_size, float scale, int window, float softcap,
    const float *kv_scales, int fmt, int dt, float *scores) {
    int first_page, skip;
    window_keys(n, window, page_size, &first_page, &skip, &n);
    pages += first_page;
    const int64_t es = elem_size(dt);
    const int num_heads = num_kv_heads * G;
    const int64_t kv_row = (int64_t)num_kv_heads * HD;
    const float unit = fmt == FP8_E4M3 ? 256.0f : 1.0f;
    float qf[num_heads * HD], kbuf[8 * kv_row];
    load_scaled_query(qf, (const char *)q + t * q_stride * es, num_heads, HD, G, scale * unit, kv_scales, dt);
    fp8_scores_avx2(scores, qf, kv_layer, pages, n, num_heads, page_size, kv_row, HD, G, kbuf, fmt);
    softmax_rows(scores, num_heads, n, skip, softcap);
    /* CW vectors of columns a pass (the last pass fewer): G x CW sums, G weights and the V vector
     * being decoded in 16 registers (a sum spilled to the stack made each key wait on a store).
     * CW and the last pass's width are compile-time constants (HD and G are), so each pass's
     * loops unroll with its sums in registers while the passes stay a loop (unrolling the passes
     * too made this file take 44 s to compile) */
    const int CW = (13 - G) / G < 1 ? 1 : ((13 - G) / G > 8 ? 8 : (13 - G) / G);
    const int full = (HD / 8) / CW, rest = (HD / 8) % CW;
    for (int kvh = 0; kvh < num_kv_heads; kvh++) {
        const float *p = scores + (int64_t)kvh * G * n;
        float *dst = qf + (int64_t)kvh * G * HD; /* qf is free now: the group's sums, then stored */
        const __m256 vs = _mm256_set1_ps(kv_scales[num_kv_heads + kvh] * unit);
        const uint8_t *v_head = kv_layer + kvh * HD;
        for (int pass = 0; pass < full; pass++)
            fp8_weighted_v_pass(dst, p, v_head, pages, n, page_size, kv_row, HD, G, pass * CW, CW, vs, fmt);
        if (rest) fp8_weighted_v_pass(dst, p, v_head, pages, n, page_size, kv_row, HD, G, full * CW, rest, vs, fmt);
        store_row((char *)out + (t * num_heads + (int64_t)kvh * G) * HD * es, dst, (int64_t)G * HD, dt);
    }
}
#endif

#if defined(PM_BF16_LOOPS)
/* The bf16-query path (the served one). Why the generic path above is ~2.3x slower than the bf16
 * kernel (perf, SmolLM2's 9 heads of 64 over 3 KV heads): each (key, head) dot ends in a
 * horizontal reduction and a scalar store, and the V sums (G x HD floats, a run-time G) live in
 * memory, loaded and stored at every key. Here the fp8 bytes become bf16 as they are read
 * (fp8x32_to_bf16), and the rest is the bf16 kernel's own loops (bf16_scores, bf16_weighted_v
 * with FP8 = 1). lut_bits: the bf16 bits of fp8 codes 0..127 (times 256 for e4m3, see above). */
static inline __attribute__((always_inline)) void attend_item_fp8_bf16(
    const bf16 *q, int64_t q_stride, bf16 *out, const uint8_t *kv_layer, const int32_t *pages, int64_t t, int n,
    int num_kv_heads, const int HD, const int G, int page_size, float scale, int window, float softcap,
    const float *kv_scales, const uint16_t *lut_bits, float *scores) {
    int first_page, skip;
    window_keys(n, window, page_size, &first_page, &skip, &n);
    pages += first_page;
    __m512i lut[4];
    for (int i = 0; i < 4; i++) lut[i] = _mm512_loadu_si512(lut_bits + 32 * i);
    bf16_scores(q, q_stride, kv_layer, pages, t, n, num_kv_heads, HD, G, page_size, scale, 1, kv_scales, lut, scores);
    softmax_rows(scores, num_kv_heads * G, n, skip, softcap);
    bf16_weighted_v(out, kv_layer, pages, t, n, num_kv_heads, HD, G, page_size, 1, kv_scales, lut, scores);
}
#define PM_FP8_BF16 1
#endif

/* pm_paged_attention over an fp8 pool (kv_layer: bytes), q and out in `dt`; kv_scales: [2][num_kv_heads]
 * (K's, then V's); fmt: FP8_E4M3 or FP8_E5M2. */
void pm_paged_attention_fp8(const void *q, int64_t q_stride, void *out, const void *kv_layer,
                            const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                            const int32_t *query_start_loc, int num_seqs, int num_heads, int num_kv_heads,
                            int head_dim, int page_size, float scale, int window, float softcap,
                            const float *kv_scales, int fmt, int dt) {
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
                         HD_, G_, page_size, scale, window, softcap, kv_scales, lut, scores)
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
#if defined(PM_FP8_AVX2)
#define FP8_AVX2_ITEM(HD_, G_)                                                                                        \
    attend_item_fp8_avx2(q, q_stride, out, (const uint8_t *)kv_layer, pages, t, n, num_kv_heads, HD_, G_, page_size, \
                         scale, window, softcap, kv_scales, fmt, dt, scores)
#define FP8_AVX2_G(HD_)                                 \
    switch (group) {                                    \
        case 1: FP8_AVX2_ITEM(HD_, 1); break;           \
        case 2: FP8_AVX2_ITEM(HD_, 2); break;           \
        case 3: FP8_AVX2_ITEM(HD_, 3); break;           \
        case 4: FP8_AVX2_ITEM(HD_, 4); break;           \
        case 5: FP8_AVX2_ITEM(HD_, 5); break;           \
        case 6: FP8_AVX2_ITEM(HD_, 6); break;           \
        case 7: FP8_AVX2_ITEM(HD_, 7); break;           \
        default: FP8_AVX2_ITEM(HD_, 8); break;          \
    }
            /* AVX2 (no AVX-512): head_dim 64 or 128, 1-8 query heads per KV head, compiled copies */
            if (head_dim == 64 && group <= 8) {
                FP8_AVX2_G(64)
                continue;
            }
            if (head_dim == 128 && group <= 8) {
                FP8_AVX2_G(128)
                continue;
            }
#undef FP8_AVX2_G
#undef FP8_AVX2_ITEM
#endif
            /* head_dim 64 and 128 get compiled copies with a constant HD (unrolled, vectorized dots) */
            if (head_dim == 64)
                attend_item_fp8(q, q_stride, out, (const uint8_t *)kv_layer, pages, t, n, num_kv_heads, 64, group,
                                page_size, scale, window, softcap, kv_scales, fmt, dt, scores);
            else if (head_dim == 128)
                attend_item_fp8(q, q_stride, out, (const uint8_t *)kv_layer, pages, t, n, num_kv_heads, 128, group,
                                page_size, scale, window, softcap, kv_scales, fmt, dt, scores);
            else
                attend_item_fp8(q, q_stride, out, (const uint8_t *)kv_layer, pages, t, n, num_kv_heads, head_dim,
                                group, page_size, scale, window, softcap, kv_scales, fmt, dt, scores);
        }
        free(scores);
    }
    free(seq_of_token);
}
