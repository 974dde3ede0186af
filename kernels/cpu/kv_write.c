/* This step's K and V rows into their slots of the paged KV pool (pm_write_kv). See common.h. */
#include "common.h"

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
