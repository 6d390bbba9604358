/* A library linked against the CUDA driver that allocates through its own
 * reference to cuMemAlloc_v2: loaded with RTLD_DEEPBIND, that reference would
 * bind to the driver before any preloaded library (tests/native/test_escape.py). */
#include <stddef.h>

#include "gs_cuda.h"

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
int deepbind_alloc(size_t bytes);

__attribute__((visibility("default"))) int deepbind_alloc(size_t bytes) {
    CUdeviceptr ptr = 0;
    return (int)cuMemAlloc_v2(&ptr, bytes);
}
