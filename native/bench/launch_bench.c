/*
 * Cost of the hooked hot paths on the fake driver: `launch N` times N kernel
 * launches, `alloc N` times N cuMemAlloc_v2 + cuMemFree_v2 pairs of 1 MiB. Run it
 * with and without the interposer preloaded; the difference is what the
 * interposer adds. The loops are separate functions so callgrind can count them
 * alone (--toggle-collect=run_launches / run_allocs).
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gs_cuda.h"

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxSynchronize(void);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, CUstream, void **, void **);

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* Kernels of 0 us on the fake; synchronised every 1024 so its queue stays short. */
__attribute__((noinline)) int run_launches(long n);
__attribute__((noinline)) int run_launches(long n) {
    for (long i = 0; i < n; i++) {
        if (cuLaunchKernel((CUfunction)0, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS)
            return 1;
        if ((i & 1023) == 1023) cuCtxSynchronize();
    }
    return cuCtxSynchronize() != CUDA_SUCCESS;
}

__attribute__((noinline)) int run_allocs(long n);
__attribute__((noinline)) int run_allocs(long n) {
    for (long i = 0; i < n; i++) {
        CUdeviceptr p;
        if (cuMemAlloc_v2(&p, 1 << 20) != CUDA_SUCCESS || cuMemFree_v2(p) != CUDA_SUCCESS) return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 3 || (strcmp(argv[1], "launch") && strcmp(argv[1], "alloc"))) {
        fprintf(stderr, "usage: launch_bench launch|alloc N\n");
        return 2;
    }
    long n = atol(argv[2]);
    CUdevice dev;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx)) {
        fprintf(stderr, "launch_bench: no CUDA context\n");
        return 1;
    }
    bool launch = !strcmp(argv[1], "launch");
    /* warm up: first calls resolve symbols and join the region */
    if (launch ? run_launches(1024) : run_allocs(64)) return 1;
    double t0 = now_ns();
    int failed = launch ? run_launches(n) : run_allocs(n);
    double t1 = now_ns();
    if (failed) {
        fprintf(stderr, "launch_bench: a call failed\n");
        return 1;
    }
    printf("{\"op\":\"%s\",\"n\":%ld,\"ns_per_call\":%.2f}\n", argv[1], n, (t1 - t0) / (double)n);
    return 0;
}
