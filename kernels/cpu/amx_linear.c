/* bf16 linear layers on AMX, for the few rows of a decode step: pm_amx_init, pm_amx_pack, pm_amx_linear.
 *
 * y[M, N] = x[M, K] W^T (+ bias), W packed once by pm_amx_pack: for each block of 16 output
 * columns, K/32 tiles of 16 rows x 64 bytes, row r holding the pairs (W[n][32kb + 2r],
 * W[n][32kb + 2r + 1]) for the block's 16 n (the VNNI layout tdpbf16ps reads). A block's tiles are
 * contiguous, so a thread streams each weight once, front to back. Rows of x go 32 at a time
 * (two A tiles, zero-padded); each work item is two column blocks (four C tiles), handed out
 * dynamically so that a thread the OS preempts does not hold the others at a barrier. Sums are
 * fp32, rounded to bf16 once at the end, as oneDNN does. */
#include "common.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
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
