/* A tenant's own "driver": linked against the real one (every function but one
 * resolves there), with a cuCtxGetDevice that always fails, so an interposer that
 * loaded it would find no device to charge. Named by GPUSLICE_LIBCUDA in
 * tests/native/test_escape.py, which checks that a grant ignores it. */
#include "gs_cuda.h"

CUresult cuCtxGetDevice(CUdevice *device);

__attribute__((visibility("default"))) CUresult cuCtxGetDevice(CUdevice *device) {
    (void)device;
    return CUDA_ERROR_INVALID_CONTEXT;
}
