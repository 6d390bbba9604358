/*
 * Joining the container's region, and contexts: each costs device memory of its
 * own (GPUSLICE_CONTEXT_OVERHEAD per context), and destroying one frees whatever
 * was allocated in it.
 */
#include <pthread.h>
#include <string.h>

#include "gs.h"

atomic_int gs_attached; /* 0 not yet, 1 joined, -1 refused (incompatible region) */
static pthread_mutex_t attach_mu = PTHREAD_MUTEX_INITIALIZER;

static void after_fork_child(void) {
    pthread_mutex_init(&attach_mu, NULL);
    atomic_store(&gs_attached, 0);
    gs_track_forget_all();
    gs_region_after_fork();
    gs_telemetry_after_fork();
}

/* Records each device's UUID in the region; needs an initialised driver. */
void gs_name_devices(void) {
    int count = 0;
    if (!gs_real.cuDeviceGetCount || gs_real.cuDeviceGetCount(&count) != CUDA_SUCCESS) return;
    for (int i = 0; i < count && i < GS_MAX_DEVICES; i++) {
        CUdevice dev;
        CUuuid uuid;
        char text[GS_UUID_LEN];
        if (!gs_real.cuDeviceGet || gs_real.cuDeviceGet(&dev, i) != CUDA_SUCCESS) continue;
        if (!gs_real.cuDeviceGetUuid || gs_real.cuDeviceGetUuid(&uuid, dev) != CUDA_SUCCESS) continue;
        gs_format_uuid(&uuid, text);
        gs_region_set_uuid(i, text);
    }
}

void gs_attach(void) {
    gs_init();
    if (gs_cfg.disabled || atomic_load(&gs_attached) != 0) return;
    pthread_mutex_lock(&attach_mu);
    if (atomic_load(&gs_attached) == 0) {
        static bool atfork_done;
        if (!atfork_done) {
            pthread_atfork(NULL, NULL, after_fork_child);
            atfork_done = true;
        }
        if (gs_region_attach()) {
            gs_name_devices();
            gs_limiter_setup();
            atomic_store_explicit(&gs_attached, 1, memory_order_release);
            gs_telemetry_start();
        } else {
            atomic_store_explicit(&gs_attached, -1, memory_order_release);
        }
    }
    pthread_mutex_unlock(&attach_mu);
}

__attribute__((destructor)) static void gs_exit(void) {
    if (atomic_load(&gs_attached) == 1) gs_region_detach();
}

/* ------------------------------------------------------------ primary contexts */
static pthread_mutex_t primary_mu = PTHREAD_MUTEX_INITIALIZER;
static int primary_refs[GS_MAX_DEVICES];
static CUcontext primary_ctx[GS_MAX_DEVICES];
static bool primary_live[GS_MAX_DEVICES]; /* its overhead is reserved */

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    if (!gs_enter() || dev < 0 || dev >= GS_MAX_DEVICES)
        return GS_CALL(cuDevicePrimaryCtxRetain, (pctx, dev));
    pthread_mutex_lock(&primary_mu);
    uint64_t cost = primary_live[dev] ? 0 : gs_cfg.context_overhead;
    CUresult rc;
    if (cost && !gs_reserve(dev, cost)) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        rc = GS_CALL(cuDevicePrimaryCtxRetain, (pctx, dev));
        if (rc == CUDA_SUCCESS) {
            primary_refs[dev]++;
            primary_live[dev] = true;
            if (pctx) primary_ctx[dev] = *pctx;
        } else {
            gs_unreserve(dev, cost);
        }
    }
    pthread_mutex_unlock(&primary_mu);
    return rc;
}

/* The primary context of `dev` is gone: its overhead and its allocations too. */
static void primary_gone_locked(CUdevice dev) {
    if (primary_live[dev]) gs_unreserve(dev, gs_cfg.context_overhead);
    primary_live[dev] = false;
    primary_refs[dev] = 0;
    if (primary_ctx[dev]) gs_track_drop_ctx(primary_ctx[dev]);
    primary_ctx[dev] = NULL;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    if (!gs_enter() || dev < 0 || dev >= GS_MAX_DEVICES)
        return GS_CALL(cuDevicePrimaryCtxRelease_v2, (dev));
    pthread_mutex_lock(&primary_mu);
    CUresult rc = GS_CALL(cuDevicePrimaryCtxRelease_v2, (dev));
    if (rc == CUDA_SUCCESS && primary_refs[dev] > 0 && --primary_refs[dev] == 0)
        primary_gone_locked(dev);
    pthread_mutex_unlock(&primary_mu);
    return rc;
}

CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    if (!gs_enter() || dev < 0 || dev >= GS_MAX_DEVICES)
        return GS_CALL(cuDevicePrimaryCtxReset_v2, (dev));
    pthread_mutex_lock(&primary_mu);
    CUresult rc = GS_CALL(cuDevicePrimaryCtxReset_v2, (dev));
    if (rc == CUDA_SUCCESS) primary_gone_locked(dev);
    pthread_mutex_unlock(&primary_mu);
    return rc;
}

/* ------------------------------------------------------------ created contexts */
#define GS_CTX_CREATE(call)                                                                   \
    do {                                                                                      \
        if (!gs_enter() || !pctx || dev < 0 || dev >= GS_MAX_DEVICES) return (call);          \
        uint64_t cost_ = gs_cfg.context_overhead;                                             \
        if (cost_ && !gs_reserve(dev, cost_)) return CUDA_ERROR_OUT_OF_MEMORY;                \
        CUresult rc_ = (call);                                                                \
        if (rc_ != CUDA_SUCCESS) gs_unreserve(dev, cost_);                                    \
        else gs_track_add(GS_K_CTX, (uint64_t)(uintptr_t)*pctx, dev, cost_, *pctx);           \
        return rc_;                                                                           \
    } while (0)

CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    GS_CTX_CREATE(GS_CALL(cuCtxCreate_v2, (pctx, flags, dev)));
}

CUresult cuCtxCreate_v3(CUcontext *pctx, void *paramsArray, int numParams, unsigned int flags,
                        CUdevice dev) {
    GS_CTX_CREATE(GS_CALL(cuCtxCreate_v3, (pctx, paramsArray, numParams, flags, dev)));
}

CUresult cuCtxCreate_v4(CUcontext *pctx, void *ctxCreateParams, unsigned int flags, CUdevice dev) {
    GS_CTX_CREATE(GS_CALL(cuCtxCreate_v4, (pctx, ctxCreateParams, flags, dev)));
}

CUresult cuCtxDestroy_v2(CUcontext ctx) {
    if (!gs_enter()) return GS_CALL(cuCtxDestroy_v2, (ctx));
    CUresult rc = GS_CALL(cuCtxDestroy_v2, (ctx));
    if (rc == CUDA_SUCCESS) {
        int dev;
        uint64_t bytes;
        if (gs_track_take(GS_K_CTX, (uint64_t)(uintptr_t)ctx, &dev, &bytes)) gs_unreserve(dev, bytes);
        gs_track_drop_ctx(ctx);
    }
    return rc;
}
