/* A decode step's decoder layers in one C call: the CPU path of a Llama whose linears are held
 * quantized (`--quantization`), for steps whose every sequence decodes one token.
 *
 * Nothing here computes: each op is the very kernel the Python layers call (the pagemesh_cpu
 * library's norm, rotary, KV write, paged attention (their fp8 variants for an fp8 pool, with
 * the layer's scales, as workers/engine/fp8_attention.py calls them), SiLU-and-mul; quant_matmul.c's pm_quant_gemm_tiles for a
 * weight with tiles from `tiled_min_rows` rows, pm_quant_matmul otherwise, as layers.quantized_linear picks),
 * reached through the function pointers in `pm_decode_kernels` (filled by
 * kernels/cpu/decode_layers.py from the two loaded libraries), with the same arguments in
 * the same order. So the outputs are the Python path's, bit for bit; what goes is the Python
 * between the kernels: ~10 module calls, tensor allocations and ctypes calls per layer, which
 * cost about as much as the layers' arithmetic at one decode row of a small model.
 *
 * Per layer (T rows, H hidden, dt the activations' dtype; residual updated in place):
 *
 *     normed = norm(x + residual)            (layer 0: x is NULL, residual is the embedding)
 *     qkv    = normed Wqkv^T (+ b)           [T, q + 2 kv]
 *     rotary(q, k); write_kv(k, v)           in place, into the layer's pages
 *     attn   = paged_attention(q)            [T, heads * head_dim], within the layer's window
 *     o      = attn Wo^T
 *     normed = norm(o + residual)
 *     act    = silu(gate) * up,  [gate, up] = normed Wgu^T
 *     x      = act Wdown^T                   [T, H]: the next layer's input
 */
#include <stddef.h>
#include <stdint.h>

typedef void (*pm_norm_fn)(const void *x, void *residual, void *out, const void *weight, int64_t rows, int64_t cols,
                           float eps, int dt);
typedef void (*pm_rotary_fn)(void *q, int64_t q_stride, void *k, int64_t k_stride, int64_t tokens, int num_heads,
                             int num_kv_heads, int head_dim, const int64_t *positions, const float *cos_sin_cache,
                             int dt);
typedef void (*pm_write_kv_fn)(const void *k, int64_t k_stride, const void *v, int64_t v_stride, int64_t tokens,
                               int64_t kv_row, void *kv_layer, const int64_t *slot_mapping, int page_size, int dt);
typedef void (*pm_attention_fn)(const void *q, int64_t q_stride, void *out, const void *kv_layer,
                                const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                                const int32_t *query_start_loc, int num_seqs, int num_heads, int num_kv_heads,
                                int head_dim, int page_size, float scale, int window, float softcap, int dt);
typedef void (*pm_write_kv_fp8_fn)(const void *k, int64_t k_stride, const void *v, int64_t v_stride, int64_t tokens,
                                   int num_kv_heads, int head_dim, void *kv_layer, const int64_t *slot_mapping,
                                   int page_size, const float *kv_scales, int fmt, int dt);
typedef void (*pm_attention_fp8_fn)(const void *q, int64_t q_stride, void *out, const void *kv_layer,
                                    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                                    const int32_t *query_start_loc, int num_seqs, int num_heads, int num_kv_heads,
                                    int head_dim, int page_size, float scale, int window, float softcap,
                                    const float *kv_scales, int fmt, int dt);
typedef void (*pm_silu_fn)(const void *x, void *out, int64_t rows, int64_t cols, int dt);
typedef void (*pm_matmul_fn)(const void *x, int64_t x_stride, int x_dt, const uint8_t *codes, const uint16_t *d,
                             const uint16_t *c, int bits, const float *bias, void *out, int out_dt, int64_t m,
                             int64_t n, int64_t k);
typedef void (*pm_gemm_tiles_fn)(const void *x, int64_t x_stride, int x_dt, const uint8_t *tiles,
                                 const uint16_t *scales, int bits, const float *bias, void *out, int out_dt, int64_t m,
                                 int64_t n, int64_t k);

/* The kernels, from the two libraries (ctypes: the functions' addresses) */
typedef struct {
    pm_norm_fn norm;
    pm_rotary_fn rotary;
    pm_write_kv_fn write_kv;
    pm_attention_fn attention;
    pm_silu_fn silu_and_mul;
    pm_matmul_fn matmul;
    pm_gemm_tiles_fn gemm_tiles;
    int64_t tiled_min_rows; /* workers/model/layers.py TILED_MIN_ROWS */
    pm_write_kv_fp8_fn write_kv_fp8;
    pm_attention_fp8_fn attention_fp8;
} pm_decode_kernels;

/* One quantized W [n, k] (kernels/quantized.py's layout) and its fp32 bias or NULL */
typedef struct {
    const uint8_t *codes;
    const uint16_t *scale;
    const uint16_t *offset;
    const float *bias;
    const uint8_t *tiles;        /* the tiled copy (kernels/quantized.py with_tiles), or NULL */
    const uint16_t *tile_scales; /* its scales, or NULL */
    int64_t n, k;
    int32_t bits;
} pm_quant_weight;

/* y = x W^T (+ b) through the kernel layers.quantized_linear takes for these rows */
static void linear(const pm_decode_kernels *kern, const pm_quant_weight *w, const void *x, int64_t x_stride, int dt,
                   void *out, int64_t rows) {
    if (w->tiles != NULL && rows >= kern->tiled_min_rows)
        kern->gemm_tiles(x, x_stride, dt, w->tiles, w->tile_scales, w->bits, w->bias, out, dt, rows, w->n, w->k);
    else
        kern->matmul(x, x_stride, dt, w->codes, w->scale, w->offset, w->bits, w->bias, out, dt, rows, w->n, w->k);
}

typedef struct {
    const void *input_norm;     /* [H] dt */
    const void *post_attn_norm; /* [H] dt */
    pm_quant_weight qkv, o, gate_up, down;
    void *kv_layer; /* [pages, 2, page_size, kv_heads, head_dim] dt, or fp8 bytes */
    int32_t window; /* sliding window (0: none), as pm_paged_attention takes it */
    float softcap;  /* attention logit soft-capping (0: none) */
    const float *kv_scales; /* an fp8 layer's [2, kv_heads] scales (K's, V's), or NULL: the model dtype */
} pm_decode_layer;

/* The model's shapes and constants */
typedef struct {
    int64_t hidden, intermediate;
    int32_t num_heads, num_kv_heads, head_dim, page_size, dt;
    float eps, scale;
    const float *cos_sin_cache; /* [max_pos, head_dim] fp32 */
    int32_t kv_fmt;             /* an fp8 pool's format (0 e4m3fn, 1 e5m2); unread where the layers have no scales */
} pm_decode_model;

/* Scratch activations for T rows, dt, contiguous: normed [T, H], qkv [T, (heads + 2 kv_heads) D],
 * attn [T, heads D], o [T, H], gate_up [T, 2 I], act [T, I] */
typedef struct {
    void *normed, *qkv, *attn, *o, *gate_up, *act;
} pm_decode_scratch;

/* Layers 0..num_layers of one decode step: `residual` [T, H] enters as the embedding and leaves
 * as the residual stream; `out` [T, H] gets the last layer's output (the model's final norm
 * adds the two). Sequence s's one query row is row s: query_start_loc = 0..T. */
void pm_decode_layers(const pm_decode_kernels *kern, const pm_decode_model *m, const pm_decode_layer *layers,
                      int num_layers, const pm_decode_scratch *s, void *residual, void *out, int64_t tokens,
                      const int64_t *positions, const int64_t *slot_mapping, const int32_t *block_tables,
                      int64_t bt_stride, const int32_t *seq_lens, const int32_t *query_start_loc) {
    const int64_t hd = m->head_dim, q_size = m->num_heads * hd, kv_size = m->num_kv_heads * hd;
    const int64_t qkv_row = q_size + 2 * kv_size, es = m->dt == 1 ? 2 : 4;
    char *qkv = (char *)s->qkv;
    for (int i = 0; i < num_layers; i++) {
        const pm_decode_layer *l = &layers[i];
        /* layer 0 normalizes the embedding alone; later ones add the previous layer's output */
        kern->norm(i == 0 ? residual : out, i == 0 ? NULL : residual, s->normed, l->input_norm, tokens, m->hidden,
                   m->eps, m->dt);
        linear(kern, &l->qkv, s->normed, m->hidden, m->dt, qkv, tokens);
        kern->rotary(qkv, qkv_row, qkv + q_size * es, qkv_row, tokens, m->num_heads, m->num_kv_heads, m->head_dim,
                     positions, m->cos_sin_cache, m->dt);
        if (l->kv_scales != NULL) {
            kern->write_kv_fp8(qkv + q_size * es, qkv_row, qkv + (q_size + kv_size) * es, qkv_row, tokens,
                               m->num_kv_heads, m->head_dim, l->kv_layer, slot_mapping, m->page_size, l->kv_scales,
                               m->kv_fmt, m->dt);
            kern->attention_fp8(qkv, qkv_row, s->attn, l->kv_layer, block_tables, bt_stride, seq_lens,
                                query_start_loc, (int)tokens, m->num_heads, m->num_kv_heads, m->head_dim, m->page_size,
                                m->scale, l->window, l->softcap, l->kv_scales, m->kv_fmt, m->dt);
        } else {
            kern->write_kv(qkv + q_size * es, qkv_row, qkv + (q_size + kv_size) * es, qkv_row, tokens, kv_size,
                           l->kv_layer, slot_mapping, m->page_size, m->dt);
            kern->attention(qkv, qkv_row, s->attn, l->kv_layer, block_tables, bt_stride, seq_lens, query_start_loc,
                            (int)tokens, m->num_heads, m->num_kv_heads, m->head_dim, m->page_size, m->scale,
                            l->window, l->softcap, m->dt);
        }
        linear(kern, &l->o, s->attn, q_size, m->dt, s->o, tokens);
        kern->norm(s->o, residual, s->normed, l->post_attn_norm, tokens, m->hidden, m->eps, m->dt);
        linear(kern, &l->gate_up, s->normed, m->hidden, m->dt, s->gate_up, tokens);
        kern->silu_and_mul(s->gate_up, s->act, tokens, m->intermediate, m->dt);
        linear(kern, &l->down, s->act, m->intermediate, m->dt, out, tokens);
    }
}
