/* A library linked against the CUDA driver that looks its allocator up itself:
 * dlsym(RTLD_NEXT, ...) from here skips every library loaded before this one,
 * the preloaded interposer included, and would find the driver's own function
 * (tests/native/test_escape.py). */
#include <dlfcn.h>
#include <stddef.h>
#include <string.h>

#include "gs_cuda.h"

typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
int next_alloc(size_t bytes, int use_default);

/* -2 when the lookup finds nothing. */
__attribute__((visibility("default"))) int next_alloc(size_t bytes, int use_default) {
    void *sym = dlsym(use_default ? RTLD_DEFAULT : RTLD_NEXT, "cuMemAlloc_v2");
    alloc_fn fn;
    memcpy(&fn, &sym, sizeof fn);
    if (!fn) return -2;
    CUdeviceptr ptr = 0;
    return (int)fn(&ptr, bytes);
}
