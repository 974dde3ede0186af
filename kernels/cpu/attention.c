/* pm_paged_attention: attention of every query token over its sequence's pages (a KV pool in the
 * model dtype), causal, GQA; with a sliding window (window > 0: a query at position p sees keys
 * p - window < j <= p, and pages wholly before that are never read) and Gemma 2's soft-capping
 * (softcap > 0: scores become softcap * tanh(score / softcap)); 0 turns either off.
 *
 * Sequence s owns query rows query_start_loc[s] .. query_start_loc[s+1]-1 of q (rows `q_stride`
 * values apart, heads contiguous in a row) and has seq_lens[s] tokens in the pool after this
 * step; its last query row is the last token, so query row i of a chunk of n sees the first
 * seq_len - n + i + 1 tokens. One work item = one query row, all heads: every K/V row (all KV
 * heads, contiguous) is read once and serves each KV head's group of query heads. Two passes over the context (scores, then the
 * softmax-weighted V sum); the scores of an item live in a per-thread buffer. */
#include "attention.h"

/* One work item of pm_paged_attention: query row t (all heads) over the first n tokens of the
 * sequence's pages. Scores: each K row (all KV heads, contiguous) is read once and serves every
 * query head. Weighted V sum: one KV head at a time, so that its group's accumulators (G x HD
 * floats) stay in registers over the whole context; the rows come back from L2 for the other
 * KV heads. HD and G are compile-time constants in the specialised copies below. A window
 * moves the start to its first page (window_keys). scores: [num_heads][n]. */
static inline __attribute__((always_inline)) void attend_item(
    const void *q, int64_t q_stride, void *out, const void *kv_layer, const int32_t *pages, int64_t t, int n,
    int num_kv_heads, const int HD, const int G, int page_size, float scale, int window, float softcap, int dt,
    float *scores) {
    int first_page, skip;
    window_keys(n, window, page_size, &first_page, &skip, &n);
    pages += first_page;
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
    softmax_rows(scores, num_heads, n, skip, softcap);
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
    attend_item(q, q_stride, out, kv_layer, pages, t, n, num_kv_heads, HD_, G_, page_size, scale, window, softcap, DT_, \
                scores)

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
                        int head_dim, int page_size, float scale, int window, float softcap, int dt) {
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
