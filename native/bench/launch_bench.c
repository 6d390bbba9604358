/*
 * Cost of the hooked hot paths on the fake driver: `launch N` times N kernel
 * launches, `alloc N` times N cuMemAlloc_v2 + cuMemFree_v2 pairs of 1 MiB. Run it
 * with and without the interposer preloaded; the difference is what the
 * interposer adds. The loops are separate functions so callgrind can count them
 * alone (--toggle-collect=run_launches / run_allocs).
 *
 * `paced N` launches in bursts of 64, each followed by a pause four times as
 * long as the burst took and at least 8 ms, and times the bursts only. The
 * limiter charges a window of launches the time it spans less its pauses (a
 * tight loop of even empty kernels keeps a GPU busy), so a GPU below a 30 %
 * share is one that pauses: this way it stays at 20 % however slow the
 * launches are (under valgrind too). The pause watcher may see a pause begin
 * a millisecond or two late on a loaded machine, and that late part is charged
 * as busy; 8 ms covers it at a 30 % share.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gs_cuda.h"

#define BURST 64

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

static void pause_ns(double ns) {
    struct timespec ts = {(time_t)(ns / 1e9), (long)((long long)ns % 1000000000LL)};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

/* Kernels of 0 us on the fake; synchronised every 1024 so its queue stays short.
 * Paced: after each burst of BURST launches, a pause of four times the burst
 * and at least 8 ms.
 * `*launching` gets the time spent outside the pauses. */
__attribute__((noinline)) int run_launches(long n, bool paced, double *launching);
__attribute__((noinline)) int run_launches(long n, bool paced, double *launching) {
    double t0 = now_ns(), burst = t0, paused = 0;
    for (long i = 0; i < n; i++) {
        if (cuLaunchKernel((CUfunction)0, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS)
            return 1;
        if ((i & 1023) == 1023) cuCtxSynchronize();
        if (paced && i % BURST == BURST - 1) {
            double t = now_ns();
            pause_ns(4 * (t - burst) > 8e6 ? 4 * (t - burst) : 8e6);
            burst = now_ns();
            paused += burst - t;
        }
    }
    int failed = cuCtxSynchronize() != CUDA_SUCCESS;
    *launching = now_ns() - t0 - paused;
    return failed;
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
    if (argc != 3 || (strcmp(argv[1], "launch") && strcmp(argv[1], "paced") &&
                      strcmp(argv[1], "alloc"))) {
        fprintf(stderr, "usage: launch_bench launch|paced|alloc N\n");
        return 2;
    }
    long n = atol(argv[2]);
    CUdevice dev;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx)) {
        fprintf(stderr, "launch_bench: no CUDA context\n");
        return 1;
    }
    bool alloc = !strcmp(argv[1], "alloc"), paced = !strcmp(argv[1], "paced");
    double ns = 0;
    /* warm up: first calls resolve symbols and join the region; the very first
     * launch also starts the fake's engine thread (milliseconds under valgrind,
     * which a limiter charges as GPU time: the pause lets its clock catch up) */
    if (!alloc) {
        if (cuLaunchKernel((CUfunction)0, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) || cuCtxSynchronize())
            return 1;
        pause_ns(100e6);
    }
    if (alloc ? run_allocs(64) : run_launches(1024, paced, &ns)) return 1;
    int failed;
    if (alloc) {
        double t0 = now_ns();
        failed = run_allocs(n);
        ns = now_ns() - t0;
    } else {
        failed = run_launches(n, paced, &ns);
    }
    if (failed) {
        fprintf(stderr, "launch_bench: a call failed\n");
        return 1;
    }
    printf("{\"op\":\"%s\",\"n\":%ld,\"ns_per_call\":%.2f}\n", argv[1], n, ns / (double)n);
    return 0;
}
