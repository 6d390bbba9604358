/*
 * Joining the container's region, and contexts: each costs device memory of its
 * own (GPUSLICE_CONTEXT_OVERHEAD per context), and destroying one frees whatever
 * was allocated in it.
 */
#include <pthread.h>
#include <string.h>

#include "gs.h"

atomic_int gs_attached; /* 0 not yet, 1 joined, -1 could not join (region full) */
static pthread_mutex_t attach_mu = PTHREAD_MUTEX_INITIALIZER;
static void primary_after_fork(void);

static void after_fork_child(void) {
    pthread_mutex_init(&attach_mu, NULL);
    atomic_store(&gs_attached, 0);
    gs_track_forget_all();
    gs_pools_after_fork();
    gs_graphs_after_fork();
    primary_after_fork();
    gs_region_after_fork();
    gs_telemetry_after_fork();
}

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as NVML prints it. */
static void format_uuid(const CUuuid *uuid, char out[GS_UUID_LEN]) {
    const unsigned char *b = (const unsigned char *)uuid->bytes;
    static const char hex[] = "0123456789abcdef";
    char *p = out;
    memcpy(p, "GPU-", 4);
    p += 4;
    for (int i = 0; i < 16; i++) {
        if (i == 4 || i == 6 || i == 8 || i == 10) *p++ = '-';
        *p++ = hex[b[i] >> 4];
        *p++ = hex[b[i] & 15];
    }
    *p = 0;
}

static int record_of[GS_MAX_DEVICES] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                         -1, -1, -1, -1, -1, -1, -1, -1};

/* The container lists its devices by UUID (grant, or NVIDIA_VISIBLE_DEVICES):
 * any other device, or one not named yet, is not the container's. */
static bool listed_only(void) { return gs_cfg.granted || gs_cfg.visible_count > 0; }

int gs_record_of(int ordinal) {
    if (ordinal < 0 || ordinal >= GS_MAX_DEVICES) return listed_only() ? GS_REC_DENIED : -1;
    int rec = __atomic_load_n(&record_of[ordinal], __ATOMIC_ACQUIRE);
    if (rec != -1) return rec;
    return listed_only() ? GS_REC_DENIED : ordinal; /* not named yet */
}

/* Places each device of this process in the region by UUID; needs an
 * initialised driver. */
void gs_name_devices(void) {
    int count = 0;
    if (!gs_real.cuDeviceGetCount || gs_real.cuDeviceGetCount(&count) != CUDA_SUCCESS) return;
    for (int i = 0; i < count && i < GS_MAX_DEVICES; i++) {
        CUdevice dev;
        CUuuid uuid;
        char text[GS_UUID_LEN];
        if (!gs_real.cuDeviceGet || gs_real.cuDeviceGet(&dev, i) != CUDA_SUCCESS) continue;
        if (!gs_real.cuDeviceGetUuid || gs_real.cuDeviceGetUuid(&uuid, dev) != CUDA_SUCCESS) continue;
        format_uuid(&uuid, text);
        int listed = -1;
        for (int v = 0; v < gs_cfg.visible_count; v++)
            if (!strcmp(gs_cfg.visible_uuid[v], text)) listed = v;
        int rec = listed < 0 && listed_only() ? GS_REC_DENIED : gs_region_place_uuid(text, listed, i);
        if (rec == GS_REC_DENIED)
            GS_LOG(GS_LOG_INFO, "CUDA device %d (%s) is not granted to this container: nothing may be "
                   "allocated on it", i, text);
        __atomic_store_n(&record_of[i], rec, __ATOMIC_RELEASE);
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

/* In a fork child: the parent's primary contexts are the parent's, as its
 * allocations are; the child's first retain pays the overhead again. */
static void primary_after_fork(void) {
    pthread_mutex_init(&primary_mu, NULL); /* the lock may have been held */
    memset(primary_refs, 0, sizeof primary_refs);
    memset(primary_ctx, 0, sizeof primary_ctx);
    memset(primary_live, 0, sizeof primary_live);
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    if (!gs_enter() || dev < 0 || dev >= GS_MAX_DEVICES)
        return GS_CALL(cuDevicePrimaryCtxRetain, (pctx, dev));
    pthread_mutex_lock(&primary_mu);
    uint64_t cost = primary_live[dev] ? 0 : gs_cfg.context_overhead;
    CUresult rc;
    int rec = gs_record_of(dev);
    if (!gs_reserve_trimming(rec, cost)) /* refused on a device not granted, whatever the cost */ {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        rc = GS_CALL(cuDevicePrimaryCtxRetain, (pctx, dev));
        if (rc == CUDA_SUCCESS) {
            primary_refs[dev]++;
            primary_live[dev] = true;
            if (pctx) primary_ctx[dev] = *pctx;
        } else {
            gs_unreserve(rec, cost);
        }
    }
    pthread_mutex_unlock(&primary_mu);
    return rc;
}

/* The primary context of `dev` is gone: its overhead and its allocations too. */
static void primary_gone_locked(CUdevice dev) {
    if (primary_live[dev]) gs_unreserve(gs_record_of(dev), gs_cfg.context_overhead);
    primary_live[dev] = false;
    primary_refs[dev] = 0;
    if (primary_ctx[dev]) {
        gs_track_drop_ctx(primary_ctx[dev]);
        gs_limiter_forget_ctx(primary_ctx[dev]);
    }
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
    /* Its allocations and events are gone; the retains stand, and the context
     * (with its overhead) comes back on next use. */
    if (rc == CUDA_SUCCESS && primary_ctx[dev]) {
        gs_track_drop_ctx(primary_ctx[dev]);
        gs_limiter_forget_ctx(primary_ctx[dev]);
    }
    pthread_mutex_unlock(&primary_mu);
    return rc;
}

/* ------------------------------------------------------------ created contexts */
/* A created context becomes the thread's current one. */
#define GS_CTX_CREATE(call)                                                                   \
    do {                                                                                      \
        if (!gs_enter() || !pctx || dev < 0 || dev >= GS_MAX_DEVICES) {                       \
            CUresult rc0_ = (call);                                                           \
            gs_limiter_ctx_switched();                                                        \
            return rc0_;                                                                      \
        }                                                                                     \
        uint64_t cost_ = gs_cfg.context_overhead;                                             \
        int rec_ = gs_record_of(dev);                                                         \
        if (!gs_reserve_trimming(rec_, cost_)) return CUDA_ERROR_OUT_OF_MEMORY;      \
        CUresult rc_ = (call);                                                                \
        gs_limiter_ctx_switched();                                                            \
        if (rc_ != CUDA_SUCCESS) gs_unreserve(rec_, cost_);                                   \
        else gs_track_add(GS_K_CTX, (uint64_t)(uintptr_t)*pctx, rec_, cost_, *pctx);          \
        return rc_;                                                                           \
    } while (0)

CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    GS_CTX_CREATE(GS_CALL(cuCtxCreate_v2, (pctx, flags, dev)));
}

CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    GS_CTX_CREATE(GS_CALL(cuCtxCreate, (pctx, flags, dev)));
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
        gs_limiter_forget_ctx(ctx);
    }
    return rc;
}

/* ------------------------------------------------------------ context limits
 * Raising a context's stack size, printf FIFO or device malloc heap makes the
 * driver set aside device memory outside any allocation call. The increase over
 * the driver's defaults (covered by the context overhead) is charged to the
 * context, refused when it does not fit, and given back with the context:
 *   stack: per thread, for every thread the device can hold resident at once;
 *   printf FIFO and malloc heap: their size. */
enum { GS_LIMIT_STACK = 0, GS_LIMIT_PRINTF_FIFO = 1, GS_LIMIT_MALLOC_HEAP = 2 };
enum { GS_ATTR_MAX_THREADS_PER_SM = 39 };
#define GS_DEFAULT_STACK 1024ULL
#define GS_DEFAULT_FIFO (1ULL << 20)
#define GS_DEFAULT_HEAP (8ULL << 20)

static uint64_t resident_threads(CUdevice dev) {
    int sms = 0, per_sm = 0;
    if (gs_real.cuDeviceGetAttribute) {
        gs_real.cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
        gs_real.cuDeviceGetAttribute(&per_sm, GS_ATTR_MAX_THREADS_PER_SM, dev);
    }
    if (sms <= 0) sms = 1;
    if (per_sm <= 0) per_sm = 2048; /* the most any GPU holds per SM */
    return (uint64_t)sms * (uint64_t)per_sm;
}

static uint64_t limit_cost(int limit, uint64_t value, CUdevice dev) {
    uint64_t cost = 0;
    switch (limit) {
    case GS_LIMIT_STACK:
        if (value > GS_DEFAULT_STACK &&
            __builtin_mul_overflow(value - GS_DEFAULT_STACK, resident_threads(dev), &cost))
            cost = UINT64_MAX;
        return cost;
    case GS_LIMIT_PRINTF_FIFO: return value > GS_DEFAULT_FIFO ? value - GS_DEFAULT_FIFO : 0;
    default: return value > GS_DEFAULT_HEAP ? value - GS_DEFAULT_HEAP : 0;
    }
}

CUresult cuCtxSetLimit(int limit, size_t value) {
    CUdevice ordinal;
    CUcontext ctx = NULL;
    if (!gs_enter() || limit < GS_LIMIT_STACK || limit > GS_LIMIT_MALLOC_HEAP ||
        !gs_real.cuCtxGetDevice || gs_real.cuCtxGetDevice(&ordinal) != CUDA_SUCCESS ||
        !gs_real.cuCtxGetCurrent || gs_real.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx)
        return GS_CALL(cuCtxSetLimit, (limit, value));
    int rec = gs_record_of(ordinal);
    uint64_t key = (uint64_t)(uintptr_t)ctx + (uint64_t)limit; /* contexts are aligned */
    uint64_t cost = limit_cost(limit, value, ordinal), old = 0;
    int old_dev;
    bool had = gs_track_take(GS_K_LIMIT, key, &old_dev, &old);
    if (cost > old && !gs_reserve_trimming(rec, cost - old)) {
        if (had) gs_track_add(GS_K_LIMIT, key, old_dev, old, ctx);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult rc = GS_CALL(cuCtxSetLimit, (limit, value));
    if (rc != CUDA_SUCCESS) {
        if (cost > old) gs_unreserve(rec, cost - old);
        if (had) gs_track_add(GS_K_LIMIT, key, old_dev, old, ctx);
        return rc;
    }
    if (cost < old) gs_unreserve(rec, old - cost);
    if (cost) gs_track_add(GS_K_LIMIT, key, rec, cost, ctx);
    return rc;
}

/* ------------------------------------------------------------ the current context */
CUresult cuCtxSetCurrent(CUcontext ctx) {
    gs_init();
    CUresult rc = GS_CALL(cuCtxSetCurrent, (ctx));
    gs_limiter_ctx_switched();
    return rc;
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    gs_init();
    CUresult rc = GS_CALL(cuCtxPushCurrent_v2, (ctx));
    gs_limiter_ctx_switched();
    return rc;
}

CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
    gs_init();
    CUresult rc = GS_CALL(cuCtxPopCurrent_v2, (pctx));
    gs_limiter_ctx_switched();
    return rc;
}
