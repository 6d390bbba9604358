/*
 * Compute limiting. Without a limit a launch costs two atomic loads and the call.
 *
 * With one, a launch first waits while the container is ahead of its share, then
 * runs inside a measuring window: a timing event before the window's first kernel
 * and one after each launch. A window closes after GS_WINDOW_NS of launching, after
 * GS_WINDOW_LAUNCHES launches (so the queue stays short), or when launches pause
 * for GS_GAP_NS; closing waits for its last event and reads the GPU time the
 * window took. That busy time is charged to the device's shared virtual clock
 * (tat_ns in the region, a generic cell rate algorithm): busy / share of wall time.
 * A launch may start once now >= tat - GS_TAU_NS. Every process of the container
 * charges the same clock, so the container as a whole gets its share.
 *
 * When the limit applies: `force` always; `default` unless a live node agent says
 * the GPU is not shared right now; `disable` never. A low-priority process
 * (CUDA_TASK_PRIORITY >= 1) also pauses while a live agent sets GS_DEV_YIELD.
 */
#include <pthread.h>
#include <time.h>

#include "gs.h"

#define GS_WINDOW_NS 4000000ULL
#define GS_WINDOW_LAUNCHES 64
#define GS_GAP_NS 1000000ULL
#define GS_TAU_NS 2000000ULL
/* No window charges more than this: a clock further ahead is stale (a region
 * file kept across a reboot, where CLOCK_MONOTONIC restarted) and is reset. */
#define GS_MAX_AHEAD_NS 120000000000ULL

static atomic_bool limiter_on;

typedef struct {
    pthread_mutex_t mu;
    CUcontext ctx;
    CUevent start, end;
    bool open;
    unsigned launches;
    uint64_t cpu_start, last_launch;
} window_t;

static window_t windows[GS_MAX_DEVICES];

void gs_limiter_setup(void) {
    bool on = gs_cfg.priority >= 1;
    if (gs_cfg.policy != GS_POLICY_DISABLE)
        for (int d = 0; d < GS_MAX_DEVICES; d++) on |= gs_cfg.sm_limit[d] > 0;
    for (int d = 0; d < GS_MAX_DEVICES; d++) pthread_mutex_init(&windows[d].mu, NULL);
    atomic_store(&limiter_on, on);
}

static void sleep_ns(uint64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000ULL), (long)(ns % 1000000000ULL)};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

static bool agent_live(uint64_t now) {
    uint64_t hb = __atomic_load_n(&gs_region->agent_heartbeat_ns, __ATOMIC_ACQUIRE);
    return hb && now >= hb && now - hb < GS_AGENT_FRESH_NS;
}

static uint32_t active_limit(int d, uint64_t now) {
    uint32_t limit = gs_cfg.sm_limit[d];
    if (!limit || gs_cfg.policy == GS_POLICY_DISABLE) return 0;
    if (gs_cfg.policy == GS_POLICY_FORCE) return limit;
    uint32_t flags = __atomic_load_n(&gs_region->devices[d].flags, __ATOMIC_ACQUIRE);
    if (agent_live(now) && !(flags & GS_DEV_SHARED)) return 0;
    return limit;
}

static void charge(int d, uint64_t busy, uint32_t limit, uint64_t start) {
    gs_device_t *dev = &gs_region->devices[d];
    uint64_t cost = busy * 100 / limit;
    uint64_t tat = __atomic_load_n(&dev->tat_ns, __ATOMIC_ACQUIRE);
    uint64_t next;
    do {
        next = (tat > start ? tat : start) + cost;
    } while (!__atomic_compare_exchange_n(&dev->tat_ns, &tat, next, true, __ATOMIC_ACQ_REL,
                                          __ATOMIC_ACQUIRE));
    __atomic_add_fetch(&dev->busy_ns, busy, __ATOMIC_RELAXED);
}

static void close_window(window_t *w, int d, uint32_t limit) {
    gs_real.cuEventSynchronize(w->end);
    uint64_t done = gs_now_ns();
    float ms = 0;
    uint64_t busy;
    if (gs_real.cuEventElapsedTime && gs_real.cuEventElapsedTime(&ms, w->start, w->end) == CUDA_SUCCESS &&
        ms >= 0)
        busy = (uint64_t)((double)ms * 1e6);
    else
        busy = done - w->cpu_start;
    charge(d, busy, limit, w->cpu_start);
    w->open = false;
}

static CUresult record(CUevent event, CUstream stream, bool ptds) {
    if (ptds && gs_real.cuEventRecord_ptsz) return gs_real.cuEventRecord_ptsz(event, stream);
    return gs_real.cuEventRecord(event, stream);
}

/* Work launched into a stream being captured only joins a graph: it is
 * measured when the graph is launched, and events must not touch the capture. */
static bool capturing(CUstream stream, bool ptds) {
    int status = 0;
    CUresult (*query)(CUstream, int *) =
        ptds && gs_real.cuStreamIsCapturing_ptsz ? gs_real.cuStreamIsCapturing_ptsz
                                                 : gs_real.cuStreamIsCapturing;
    return query && query(stream, &status) == CUDA_SUCCESS && status != 0;
}

/* A context is gone, and its events with it: windows on it start afresh. */
void gs_limiter_forget_ctx(CUcontext ctx) {
    for (int d = 0; d < GS_MAX_DEVICES; d++) {
        window_t *w = &windows[d];
        pthread_mutex_lock(&w->mu);
        if (w->start && w->ctx == ctx) {
            w->start = w->end = NULL; /* destroyed with the context */
            w->ctx = NULL;
            w->open = false;
        }
        pthread_mutex_unlock(&w->mu);
    }
}

static bool window_events(window_t *w) {
    CUcontext ctx = NULL;
    gs_real.cuCtxGetCurrent(&ctx);
    if (w->start && w->ctx == ctx) return true;
    if (w->start) {
        gs_real.cuEventDestroy_v2(w->start);
        gs_real.cuEventDestroy_v2(w->end);
        w->start = w->end = NULL;
    }
    if (gs_real.cuEventCreate(&w->start, 0) != CUDA_SUCCESS) return false;
    if (gs_real.cuEventCreate(&w->end, 0) != CUDA_SUCCESS) {
        gs_real.cuEventDestroy_v2(w->start);
        w->start = NULL;
        return false;
    }
    w->ctx = ctx;
    return true;
}

static bool limiter_usable(void) {
    return gs_real.cuEventCreate && gs_real.cuEventRecord && gs_real.cuEventSynchronize &&
           gs_real.cuEventDestroy_v2 && gs_real.cuCtxGetCurrent;
}

/* Waits as the share and the agent require; returns the device whose window the
 * launch joins, or -1 when no limit applies. */
static int before_launch(CUstream stream, bool ptds, uint32_t *limit_out) {
    if (!gs_enter() || !limiter_usable() || capturing(stream, ptds)) return -1;
    int d = gs_current_device();
    if (d < 0) return -1;
    gs_device_t *dev = &gs_region->devices[d];
    uint64_t now = gs_now_ns();
    uint64_t waited = 0;
    while (gs_cfg.priority >= 1 && agent_live(now) &&
           (__atomic_load_n(&dev->flags, __ATOMIC_ACQUIRE) & GS_DEV_YIELD)) {
        sleep_ns(1000000);
        uint64_t later = gs_now_ns();
        waited += later - now;
        now = later;
    }
    uint32_t limit = active_limit(d, now);
    if (limit) {
        uint64_t tat = __atomic_load_n(&dev->tat_ns, __ATOMIC_ACQUIRE);
        if (tat > now + GS_MAX_AHEAD_NS &&
            __atomic_compare_exchange_n(&dev->tat_ns, &tat, now, false, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            GS_LOG(GS_LOG_WARN, "device %d: limiter clock was %llu s ahead; reset", d,
                   (unsigned long long)((tat - now) / 1000000000ULL));
            tat = now;
        }
        if (tat > now + GS_TAU_NS) {
            sleep_ns(tat - GS_TAU_NS - now);
            uint64_t later = gs_now_ns();
            waited += later - now;
            now = later;
        }
    }
    if (waited) __atomic_add_fetch(&dev->throttled_ns, waited, __ATOMIC_RELAXED);
    if (!limit) return -1;
    window_t *w = &windows[d];
    pthread_mutex_lock(&w->mu);
    now = gs_now_ns(); /* another thread may have launched while this one waited */
    if (w->open && now > w->last_launch && now - w->last_launch > GS_GAP_NS)
        close_window(w, d, limit);
    if (!w->open && window_events(w)) {
        CUresult rc = record(w->start, stream, ptds);
        if (rc != CUDA_SUCCESS) { /* events from a context since destroyed: once more */
            w->start = w->end = NULL;
            if (window_events(w)) rc = record(w->start, stream, ptds);
        }
        if (rc == CUDA_SUCCESS) {
            w->open = true;
            w->launches = 0;
            w->cpu_start = gs_now_ns();
        }
    }
    if (!w->open) {
        pthread_mutex_unlock(&w->mu);
        return -1;
    }
    *limit_out = limit;
    return d; /* the window's mutex stays held until after_launch */
}

static void after_launch(int d, CUstream stream, bool ptds, CUresult rc, uint32_t limit) {
    window_t *w = &windows[d];
    if (rc == CUDA_SUCCESS && record(w->end, stream, ptds) == CUDA_SUCCESS) {
        uint64_t now = gs_now_ns();
        w->last_launch = now;
        if (++w->launches >= GS_WINDOW_LAUNCHES || now - w->cpu_start >= GS_WINDOW_NS)
            close_window(w, d, limit);
    } else if (w->launches == 0) {
        w->open = false; /* nothing ran in it */
    }
    pthread_mutex_unlock(&w->mu);
}

/*
 * Each entry point is a fast path that only reads two flags and jumps to the
 * driver (a sibling call: no frame of its own), and a slow path, out of line,
 * that initialises and limits.
 */
#define GS_LAUNCH_ENTRY(fn, params, args, stream, ptds)                                       \
    static __attribute__((noinline)) CUresult fn##_limited params {                           \
        gs_init();                                                                            \
        if (!atomic_load_explicit(&limiter_on, memory_order_relaxed)) return GS_CALL(fn, args); \
        uint32_t limit_ = 0;                                                                  \
        int d_ = before_launch((stream), (ptds), &limit_);                                    \
        CUresult rc_ = GS_CALL(fn, args);                                                     \
        if (d_ >= 0) after_launch(d_, (stream), (ptds), rc_, limit_);                         \
        return rc_;                                                                           \
    }                                                                                         \
    CUresult fn params {                                                                      \
        if (GS_LIKELY(atomic_load_explicit(&gs_ready, memory_order_acquire) &&                \
                      !atomic_load_explicit(&limiter_on, memory_order_relaxed) &&             \
                      gs_real.fn != NULL))                                                    \
            return gs_real.fn args;                                                           \
        return fn##_limited args;                                                             \
    }

GS_LAUNCH_ENTRY(cuLaunchKernel, GS_LAUNCH_PARAMS, GS_LAUNCH_ARGS, hStream, false)
GS_LAUNCH_ENTRY(cuLaunchKernel_ptsz, GS_LAUNCH_PARAMS, GS_LAUNCH_ARGS, hStream, true)
GS_LAUNCH_ENTRY(cuLaunchKernelEx,
                (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra),
                (config, f, kernelParams, extra), config ? config->hStream : NULL, false)
GS_LAUNCH_ENTRY(cuLaunchKernelEx_ptsz,
                (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra),
                (config, f, kernelParams, extra), config ? config->hStream : NULL, true)
GS_LAUNCH_ENTRY(cuLaunchCooperativeKernel, GS_COOP_PARAMS, GS_COOP_ARGS, hStream, false)
GS_LAUNCH_ENTRY(cuLaunchCooperativeKernel_ptsz, GS_COOP_PARAMS, GS_COOP_ARGS, hStream, true)
GS_LAUNCH_ENTRY(cuGraphLaunch, (CUgraphExec hGraphExec, CUstream hStream), (hGraphExec, hStream),
                hStream, false)
GS_LAUNCH_ENTRY(cuGraphLaunch_ptsz, (CUgraphExec hGraphExec, CUstream hStream),
                (hGraphExec, hStream), hStream, true)
