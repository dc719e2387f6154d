/* Whole KV pages copied between two paged areas of the same row layout (the pool and the host
 * buffer of asyncengine/executor/host_kv_buffer.py), every layer, in one pass: for each layer
 * and each run (first source page, first destination page, pages), one memcpy of the run's
 * bytes. torch's indexed copy gathers into a temporary and scatters it again; its slice copy per
 * run opens a parallel region for each small run. One thread: a copy is bound by memory, and a
 * second thread saved less than a loaded machine's parallel regions cost
 * (scripts/micro/bench_host_copy.py).
 *
 * Built by kernels/cpu/cpu_native.py (cc -O3 -march=native -fopenmp).
 */
#include <stdint.h>
#include <string.h>

void asyncengine_copy_page_runs(char *dst, const char *src, int64_t layers,
                                int64_t dst_layer_bytes, int64_t src_layer_bytes,
                                int64_t page_bytes, const int64_t *runs, int64_t num_runs) {
    for (int64_t layer = 0; layer < layers; layer++) {
        char *d = dst + layer * dst_layer_bytes;
        const char *s = src + layer * src_layer_bytes;
        for (int64_t r = 0; r < num_runs; r++) {
            const int64_t *run = runs + 3 * r;
            memcpy(d + run[1] * page_bytes, s + run[0] * page_bytes, run[2] * page_bytes);
        }
    }
}
