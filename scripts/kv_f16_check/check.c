/* The float16 builds (-DKV_F16) of the decode and extend attention against their float32 builds
 * over the same pool values (each exactly a half), without Python: for a CPU where the tests
 * cannot run, e.g. an AVX-512 host (whose float16 decode takes the per-item loop and float32
 * the register-resident items). Run by scripts/kv_f16_check/run.sh; prints OK or FAIL per shape. */
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#define KV_F16 1
#include "cpu_kv.h" /* -I kernels */

typedef int (*dec_fn)(const void *, int64_t, const void *, const void *, const int32_t *, int64_t,
                      const int32_t *, int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t,
                      float, void *, int, int);
typedef int (*ext_fn)(const void *, int64_t, const void *, const void *, const int32_t *, int64_t,
                      const int32_t *, const int32_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                      float, int64_t, float, void *, int, int);
static void *sym(const char *lib, const char *name) {
    void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (!h) { printf("dlopen %s: %s\n", lib, dlerror()); exit(2); }
    return dlsym(h, name);
}
static float rnd(void) { return (float)rand() / RAND_MAX * 2.0f - 1.0f; }

static int run(int64_t H, int64_t Hkv, int64_t D, int64_t ps, int64_t window, float softcap) {
    const int B = 8;
    int32_t lens[8] = {1, 31, 32, 33, 70, 5, 129, 64}, qlens[8] = {1, 20, 32, 1, 70, 3, 100, 17};
    int64_t maxp = 0, pages = 0;
    for (int b = 0; b < B; b++) { int64_t p = (lens[b] + ps - 1) / ps; pages += p; if (p > maxp) maxp = p; }
    int32_t *table = calloc(B * maxp, 4);
    int64_t *perm = malloc(pages * 8);
    for (int64_t i = 0; i < pages; i++) perm[i] = i;
    for (int64_t i = pages - 1; i > 0; i--) { int64_t j = rand() % (i + 1), t = perm[i]; perm[i] = perm[j]; perm[j] = t; }
    int64_t u = 0;
    for (int b = 0; b < B; b++) for (int64_t p = 0; p < (lens[b] + ps - 1) / ps; p++) table[b * maxp + p] = (int32_t)perm[u++];
    int64_t S = pages * ps, n = S * Hkv * D;
    float *k32 = malloc(n * 4), *v32 = malloc(n * 4);
    uint16_t *k16 = malloc(n * 2), *v16 = malloc(n * 2);
    for (int64_t i = 0; i < n; i++) {
        k16[i] = kv_from_float(rnd() * 2); v16[i] = kv_from_float(rnd());
        k32[i] = kv_to_float(k16[i]); v32[i] = kv_to_float(v16[i]);
    }
    int32_t cu[9] = {0};
    for (int b = 0; b < B; b++) cu[b + 1] = cu[b] + qlens[b];
    int64_t N = cu[B];
    float *q = malloc(N * H * D * 4), *o32 = calloc(N * H * D, 4), *o16 = calloc(N * H * D, 4);
    for (int64_t i = 0; i < N * H * D; i++) q[i] = rnd();
    float scale = 1.0f / sqrtf((float)D), worst_d = 0, worst_e = 0;
    dec_fn d32 = sym("./dec32.so", "asyncengine_paged_decode_attention"), d16 = sym("./dec16.so", "asyncengine_paged_decode_attention");
    ext_fn e32 = sym("./ext32.so", "asyncengine_paged_extend_attention"), e16 = sym("./ext16.so", "asyncengine_paged_extend_attention");
    int threads = 4, rc = 0;
    rc |= d32(q, H * D, k32, v32, table, maxp, lens, B, H, Hkv, D, ps, scale, window, softcap, o32, 0, threads);
    rc |= d16(q, H * D, k16, v16, table, maxp, lens, B, H, Hkv, D, ps, scale, window, softcap, o16, 0, threads);
    for (int64_t i = 0; i < B * H * D; i++) { float e = fabsf(o32[i] - o16[i]); if (!(e <= worst_d)) worst_d = e; }
    rc |= e32(q, H * D, k32, v32, table, maxp, cu, lens, B, H, Hkv, D, ps, scale, window, softcap, o32, 0, threads);
    rc |= e16(q, H * D, k16, v16, table, maxp, cu, lens, B, H, Hkv, D, ps, scale, window, softcap, o16, 0, threads);
    for (int64_t i = 0; i < N * H * D; i++) { float e = fabsf(o32[i] - o16[i]); if (!(e <= worst_e)) worst_e = e; }
    int ok = rc == 0 && worst_d < 1e-4f && worst_e < 1e-4f;
    printf("H=%ld Hkv=%ld D=%ld ps=%ld window=%ld softcap=%.1f: rc %d decode max diff %.3g extend %.3g %s\n",
           (long)H, (long)Hkv, (long)D, (long)ps, (long)window, softcap, rc, worst_d, worst_e, ok ? "OK" : "FAIL");
    return ok;
}

int main(void) {
    int (*feat)(void) = sym("./ext16.so", "asyncengine_extend_attention_features");
    int (*el)(void) = sym("./dec16.so", "asyncengine_kv_element");
    printf("extend features %d, f16 element %d\n", feat(), el());
    srand(1);
    int ok = 1;
    ok &= run(9, 3, 64, 16, 0, 0);
    ok &= run(8, 2, 128, 16, 0, 0);
    ok &= run(16, 1, 64, 7, 0, 0);
    ok &= run(4, 1, 256, 16, 0, 0);
    ok &= run(8, 2, 64, 5, 7, 1.5f);
    printf(ok ? "ALL OK\n" : "SOME FAILED\n");
    return !ok;
}
