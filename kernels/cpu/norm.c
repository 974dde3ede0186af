/* RMSNorm with the residual add folded in (pm_add_rms_norm). See common.h. */
#include "common.h"

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
