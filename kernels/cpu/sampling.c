/* Greedy sampling: pm_argmax_rows.
 *
 * out[r] = the index of the first maximum of row r of x (fp32, rows row_stride apart); a row
 * holding NaN gives its first NaN, as torch.max does. NaN is tested on the bits: -ffast-math lets
 * the compiler assume that x != x never holds. */
#include "common.h"

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
