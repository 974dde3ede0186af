/* LoRA deltas of one step, every row under its own adapter (pm_lora_add). See common.h.
 *
 * a and b hold every slot's adapter: rows s * width .. (s + 1) * width - 1 are slot s's
 * (workers/model/lora.py: a [slots * width, in], b [slots * width, out]). The step's adapter rows
 * come grouped by slot: segment g is rows order[starts[g] .. starts[g + 1]), all under slot
 * seg_slots[g] (rows of the base model are in no segment). For each row r of segment g, s its slot:
 *     h[k]    = sum_i a[s * width + k][i] * x[r][i]          (k < width, fp32)
 *     y[r][j] = y[r][j] + sum_k h[k] * b[s * width + k][j]   (fp32, rounded once to y's dtype)
 * The shrink reads each of a segment's A rows once for all its rows (Punica's SGMV: a grouped
 * GEMM per adapter in use, in one call); the expand goes row by row over the segment's B, which
 * stays in cache. Segments are spread over the threads. */
#include "common.h"

#define MAX_SEG_ROWS 8 /* rows of a segment computed together (a longer segment: in turns) */

static inline float weight_at(const void *w, int64_t i, const int dt_w) {
    return dt_w == DT_BF16 ? bf16_to_f32(((const bf16 *)w)[i]) : ((const float *)w)[i];
}

static inline __attribute__((always_inline)) void lora_rows(const void *x, void *y, const void *a, const void *b,
                                                           const int64_t *rows, int64_t n, int64_t in, int64_t out,
                                                           int64_t width, int64_t part_rank, const int64_t *part_cols,
                                                           int dt_x, const int dt_w) {
    const int64_t xs = elem_size(dt_x);
    float xr[MAX_SEG_ROWS][in], h[MAX_SEG_ROWS][width], wrow[in];
    for (int64_t r = 0; r < n; r++) load_row(xr[r], (const char *)x + rows[r] * in * xs, in, dt_x);
    for (int64_t k = 0; k < width; k++) {
        for (int64_t i = 0; i < in; i++) wrow[i] = weight_at(a, k * in + i, dt_w);
        for (int64_t r = 0; r < n; r++) {
            float sum = 0.0f;
            for (int64_t i = 0; i < in; i++) sum += wrow[i] * xr[r][i];
            h[r][k] = sum;
        }
    }
    /* the expand row by row: one row's accumulator stays in L1, the segment's b in L2 after its first row */
    float acc[out];
    for (int64_t r = 0; r < n; r++) {
        char *yr = (char *)y + rows[r] * out * xs;
        load_row(acc, yr, out, dt_x);
        for (int64_t k = 0; k < width; k++) {
            const float hk = h[r][k];
            if (hk == 0.0f) continue; /* a rank row the adapter does not use (padding to max rank) */
            /* a fused linear's part p (q/k/v, gate/up) has its B rows' non-zeros in its own columns */
            const int64_t p = k / part_rank, j1 = part_cols[p + 1];
            for (int64_t j = part_cols[p]; j < j1; j++) acc[j] += hk * weight_at(b, k * out + j, dt_w);
        }
        store_row(yr, acc, out, dt_x);
    }
}

/* x [rows, in] and y [rows, out] in dt_x (y updated in place); a, b in dt_w; order, starts
 * [segments + 1] and seg_slots [segments] as above; a slot's rows come in parts of part_rank rows
 * (a fused linear's q/k/v or gate/up), part p's B non-zero only in columns part_cols[p] ..
 * part_cols[p + 1] (one part: 0 .. out) */
void pm_lora_add(const void *x, void *y, const void *a, const void *b, const int64_t *order, const int64_t *starts,
                 const int64_t *seg_slots, int64_t segments, int64_t in, int64_t out, int64_t width, int64_t part_rank,
                 const int64_t *part_cols, int dt_x, int dt_w) {
    const int64_t ws = elem_size(dt_w);
#pragma omp parallel for schedule(dynamic, 1) if (segments > 1)
    for (int64_t g = 0; g < segments; g++) {
        const int64_t s = seg_slots[g];
        const char *as = (const char *)a + s * width * in * ws, *bs = (const char *)b + s * width * out * ws;
        for (int64_t first = starts[g]; first < starts[g + 1]; first += MAX_SEG_ROWS) {
            const int64_t n = starts[g + 1] - first < MAX_SEG_ROWS ? starts[g + 1] - first : MAX_SEG_ROWS;
#define LORA_ROWS(DT) lora_rows(x, y, as, bs, order + first, n, in, out, width, part_rank, part_cols, dt_x, DT)
            FOR_DTYPE(dt_w, LORA_ROWS);
#undef LORA_ROWS
        }
    }
}
