/* The paged KV pool as the native attention kernels read it: position p of a request lives in
 * pool slot block_table_row[p / page_size] * page_size + p % page_size. */
#ifndef ASYNCENGINE_CPU_PAGED_H
#define ASYNCENGINE_CPU_PAGED_H

#include <stdint.h>

static inline int64_t pool_slot(const int32_t *table_row, int64_t pos, int64_t page_size) {
    return (int64_t)table_row[pos / page_size] * page_size + pos % page_size;
}

#endif
