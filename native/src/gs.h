/* Internal interface of libgpuslice.so: shared state and the functions each module offers. */
#ifndef GS_H
#define GS_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gs_cuda.h"
#include "region_layout.h"

#define GS_EXPORT __attribute__((visibility("default")))
#define GS_LIKELY(x) __builtin_expect(!!(x), 1)
#define GS_UNLIKELY(x) __builtin_expect(!!(x), 0)

static inline uint64_t gs_min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }

/* ------------------------------------------------------------ settings (config.c) */
enum gs_policy { GS_POLICY_DEFAULT = 0, GS_POLICY_FORCE = 1, GS_POLICY_DISABLE = 2 };

/* Where the node agent mounts the container's grant and region (read-only
 * directory, the region file bind-mounted read-write over it). */
#define GS_GRANT_DIR "/run/gpuslice"
#define GS_GRANT_FILE "grant"
#define GS_REGION_FILE "region"
/* mem_limit of a device without a memory limit (only without a grant). */
#define GS_NO_LIMIT UINT64_MAX
/* Record of a device this container was not granted: nothing may be allocated. */
#define GS_REC_DENIED (-2)

typedef struct {
    bool disabled;                           /* CUDA_DISABLE_CONTROL, where allowed */
    /* Settings that bound the container could not be read or verified: every
     * allocation and context is refused (fail_reason says why, logged once). */
    bool fail_closed;
    char fail_reason[384];
    /* Limits come from the node agent's grant file, not the environment. */
    bool granted;
    int grant_dir_fd;                        /* the grant's directory (O_PATH), -1 without */
    int log_level;                           /* LIBCUDA_LOG_LEVEL, 0..4 */
    uint64_t mem_limit[GS_MAX_DEVICES];      /* bytes; GS_NO_LIMIT = none */
    uint32_t sm_limit[GS_MAX_DEVICES];       /* percent, 0 = none */
    enum gs_policy policy;                   /* GPU_CORE_UTILIZATION_POLICY */
    uint32_t priority;                       /* CUDA_TASK_PRIORITY */
    bool oom_killer;                         /* ACTIVE_OOM_KILLER */
    uint64_t context_overhead;               /* GPUSLICE_CONTEXT_OVERHEAD bytes per context */
    char region_path[512];                   /* CUDA_DEVICE_MEMORY_SHARED_CACHE ("" = private) */
    /* The container's devices by UUID, in the order of its limits and region
     * records: the grant's, or NVIDIA_VISIBLE_DEVICES when it lists UUIDs. A
     * device with another UUID is GS_REC_DENIED. */
    char visible_uuid[GS_MAX_DEVICES][GS_UUID_LEN];
    int visible_count;
    char libcuda_path[512];                  /* GPUSLICE_LIBCUDA ("" = libcuda.so.1) */
    char libnvml_path[512];                  /* GPUSLICE_LIBNVML ("" = libnvidia-ml.so.1) */
    /* telemetry */
    char nats_url[512];                      /* GPUSLICE_NATS_URL ("" = telemetry off) */
    char nats_user[128], nats_pass[256];
    char nats_token[1024];                   /* GPUSLICE_NATS_TOKEN (a telemetry token) */
    char subject_prefix[64];                 /* GPUSLICE_SUBJECT_PREFIX (gpuslice) */
    char node[254];                          /* the grant's node, else GPUSLICE_NODE_NAME */
    char pod_uid[129];                       /* the grant's pod, else GPUSLICE_POD_UID */
    char container[254];                     /* the grant's container, else GPUSLICE_CONTAINER_NAME */
    uint64_t telemetry_interval_ns;          /* GPUSLICE_TELEMETRY_INTERVAL (1s) */
    uint32_t telemetry_ring;                 /* GPUSLICE_TELEMETRY_RING samples (64) */
} gs_config_t;

extern gs_config_t gs_cfg;

/* Reads the grant, else the environment, once. Anything that bounds the
 * container and cannot be read or parsed sets fail_closed (logged with the
 * value's name); a bad telemetry or logging setting is logged and defaulted. */
void gs_config_load(void);
/* Marks the process fail-closed with a reason (logged once, at ERROR). */
void gs_fail_closed(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* ------------------------------------------------------------ logging (log.c) */
enum { GS_LOG_ERROR = 0, GS_LOG_WARN = 1, GS_LOG_INFO = 2, GS_LOG_DEBUG = 3, GS_LOG_TRACE = 4 };
void gs_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define GS_LOG(level, ...)                                                                    \
    do {                                                                                      \
        if (GS_UNLIKELY((level) <= gs_cfg.log_level)) gs_log((level), __VA_ARGS__);           \
    } while (0)
/* An errno's name for a log line: no strerror (its text may be translated, which can
 * load message catalogs and allocate). */
const char *gs_errname(int e);

/* ------------------------------------------------------------ text (text.c) */
/* Each appends to buf[*pos..cap) and advances *pos; false, with *pos unchanged, when
 * the text does not fit. */
bool gs_append(char *buf, size_t cap, size_t *pos, const char *s, size_t n);
#define GS_APPEND_LIT(buf, cap, pos, lit) gs_append((buf), (cap), (pos), "" lit, sizeof(lit) - 1)
bool gs_appendf(char *buf, size_t cap, size_t *pos, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* `s` as the body of a JSON string (no quotes). Control characters become \u00XX and
 * bytes that are not valid UTF-8 become U+FFFD, so the result is always valid JSON. */
bool gs_json_escape(char *buf, size_t cap, size_t *pos, const char *s);

/* ------------------------------------------------------------ files (files.c) */
#include <sys/types.h>
/* An absolute directory, every component opened without following a link:
 * an O_PATH descriptor, or -1 with errno (ELOOP/ENOTDIR for a link on the way). */
int gs_open_dir_nofollow(const char *path);
/* The directory of an absolute path, opened as gs_open_dir_nofollow does; *name
 * points at the last component in `path`. */
int gs_open_parent_nofollow(const char *path, const char **name);
/* open(2) of an absolute path with no symlink followed anywhere on it. */
int gs_open_nofollow(const char *path, int flags, mode_t mode);

/* ------------------------------------------------------------ loader (loader.c) */
typedef struct {
#define CUDA_HOOK(name, params, args) CUresult(*name) params;
#define CUDA_REAL(name, params, args) CUresult(*name) params;
#define NVML_HOOK(name, params, args) nvmlReturn_t(*name) params;
#define NVML_REAL(name, params, args) nvmlReturn_t(*name) params;
#include "hooks.def"
} gs_real_t;

extern gs_real_t gs_real;

/* Prototypes of every exported wrapper. */
#define CUDA_HOOK(name, params, args) GS_EXPORT CUresult name params;
#define NVML_HOOK(name, params, args) GS_EXPORT nvmlReturn_t name params;
#include "hooks.def"

/* Loads settings, the real driver and NVML, once; cheap after the first call. */
void gs_init_slow(void);
extern atomic_int gs_ready;
static inline void gs_init(void) {
    if (GS_UNLIKELY(!atomic_load_explicit(&gs_ready, memory_order_acquire))) gs_init_slow();
}
/* Joins the region (a process slot, the limits, the device UUIDs) and starts
 * telemetry: done after the real cuInit succeeds, and lazily by any hook. */
void gs_attach(void);
extern atomic_int gs_attached;
void gs_name_devices(void);
/* True when the hook should account: settings loaded and control on. The process
 * has joined its region then, or could not and is fail-closed (every reservation
 * refused): control, once on, never lapses into passing calls through. */
static inline bool gs_enter(void) {
    gs_init();
    if (GS_UNLIKELY(gs_cfg.disabled)) return false;
    if (GS_UNLIKELY(!atomic_load_explicit(&gs_attached, memory_order_acquire))) gs_attach();
    return true;
}
/* Real NVML pointers are resolved on the first NVML hook. */
void gs_nvml_init(void);

/* Error to return when a real function is missing. */
#define GS_CALL(name, args)                                                                   \
    (GS_LIKELY(gs_real.name != NULL) ? gs_real.name args : CUDA_ERROR_NOT_INITIALIZED)

/* ------------------------------------------------------------ region (region.c) */
extern gs_region_t *gs_region;   /* never NULL after gs_attach(): private if no file */
extern gs_proc_t *gs_self;       /* this process's slot */

/* Reserve `bytes` on device `dev` before the driver call: false (and counted as
 * denied) when the container would exceed the limit, after reclaiming dead processes. */
bool gs_reserve(int dev, uint64_t bytes);
/* Give back what gs_reserve took (driver failure, free). */
void gs_unreserve(int dev, uint64_t bytes);
/* Container-wide usage on a device. */
uint64_t gs_used(int dev);
uint64_t gs_limit(int dev);
/* Maps the region (file or private) without joining: enough to read it (NVML in
 * a process that never uses CUDA). False when the file is incompatible. */
bool gs_region_map(void);
/* Maps and joins: a process slot, the limits from the settings. */
bool gs_region_attach(void);
/* Reclaims dead processes at most once a second (for the read paths). */
void gs_reclaim_maybe(void);
/* Device index in the region with this UUID, or -1. */
int gs_region_find_uuid(const char *uuid);
void gs_region_detach(void);
/* The record for a device's UUID: `preferred` when it names one, else the
 * record holding that UUID, else the ordinal's own if free, else the first free. */
int gs_region_place_uuid(const char *uuid, int preferred, int ordinal);
void gs_region_after_fork(void);

/* ------------------------------------------------------------ allocations (track.c) */
enum gs_kind { GS_K_MEM = 1, GS_K_ARRAY, GS_K_MIPMAP, GS_K_VMM, GS_K_CTX, GS_K_LIMIT };
/* GS_K_MEM covers every pointer allocation (plain, pitch, managed, stream-ordered):
 * cuMemFree may free any of them. `ctx` is the context the memory dies with. */
void gs_track_add(enum gs_kind kind, uint64_t key, int dev, uint64_t bytes, CUcontext ctx);
/* Removes and returns the entry; false when unknown. */
bool gs_track_take(enum gs_kind kind, uint64_t key, int *dev, uint64_t *bytes);
/* VMM memory lives until it is released and unmapped everywhere. Counts a map,
 * an unmap or the release of `handle`; true (with the entry's device and bytes,
 * entry removed) when the memory is now gone. */
enum gs_vmm_op { GS_VMM_MAP, GS_VMM_UNMAP, GS_VMM_RELEASE, GS_VMM_RETAIN };
bool gs_track_vmm(uint64_t handle, enum gs_vmm_op op, int *dev, uint64_t *bytes);
/* A handle imported from another process: nothing is charged until it is mapped
 * (its size is known then); it lives, as any VMM handle, until released and unmapped. */
void gs_track_vmm_import(uint64_t handle, int dev, CUcontext ctx);
/* For an imported handle: the bytes a mapping of `size` adds to its charge (0 for
 * any other handle), with the device to reserve them on. */
uint64_t gs_track_vmm_shortfall(uint64_t handle, uint64_t size, int *dev);
/* Records that the imported handle's charge is now `size`; false when it is not
 * an imported handle or already charged that much. */
bool gs_track_vmm_grow(uint64_t handle, uint64_t size);
/* VMM mappings of this process, by address range: cuMemUnmap may cover several. */
void gs_map_add(uint64_t ptr, uint64_t size, uint64_t handle);
/* Removes every mapping that starts inside [ptr, ptr + size) and calls
 * `gone(handle)` for each, outside any lock of the table. */
void gs_map_remove_range(uint64_t ptr, uint64_t size, void (*gone)(uint64_t handle));
/* Forgets every entry of a destroyed context (its memory went with it) and gives the
 * bytes back; returns the bytes released. */
uint64_t gs_track_drop_ctx(CUcontext ctx);
/* In a fork child: the parent's allocations are not the child's; forget them. */
void gs_track_forget_all(void);

/* ------------------------------------------------------------ helpers (memory.c) */
/* Region record (the container's device index) of the current context's
 * device; -1 when none. */
int gs_current_device(void);
/* gs_reserve; when refused, this process's memory pools are trimmed of what they
 * keep (their charge given back) and it is tried once more. */
bool gs_reserve_trimming(int dev, uint64_t bytes);
/* In a fork child: the parent's memory pools are not the child's to charge. */
void gs_pools_after_fork(void);
/* Region record of a CUDA ordinal of this process: the same GPU has the same
 * record in every process, whatever CUDA_VISIBLE_DEVICES each one has. */
int gs_record_of(int ordinal);

/* ------------------------------------------------------------ graph memory (graphmem.c) */
/* The graph a stream under capture is building (cuStreamGetCaptureInfo); NULL
 * when it cannot be named. */
CUgraph gs_capture_graph(CUstream s, bool ptsz);
/* Charges `graph` an allocation the caller reserved and the driver made (a
 * captured stream-ordered allocation, an allocation node) on device `ordinal`
 * (-1: the current context's); a NULL graph keeps it charged until its context ends. */
void gs_graph_charge(CUgraph graph, CUdeviceptr ptr, int dev, uint64_t bytes, CUdevice ordinal);
/* A free captured into the stream's graph: marks the graph's own allocation freed
 * (given back with the graph); gives nothing back now. */
void gs_graph_free_captured(CUstream s, bool ptsz, CUdeviceptr ptr);
/* A destroyed context: the graph memory charged in it is given back; returns the bytes. */
uint64_t gs_graphs_drop_ctx(CUcontext ctx);
/* In a fork child: the parent's graphs are not the child's. */
void gs_graphs_after_fork(void);

/* ------------------------------------------------------------ compute limiter (launch.c) */
/* Decides once, when the process joins, whether launches take the limiter path
 * (a limit or a low priority is set); the agent's flags are read per launch. */
void gs_limiter_setup(void);
/* The context is destroyed: the limiter's events on it went with it. */
void gs_limiter_forget_ctx(CUcontext ctx);
/* This thread's current context has changed (set, pushed, popped, created). */
void gs_limiter_ctx_switched(void);

/* ------------------------------------------------------------ telemetry (telemetry.c) */
/* Starts the publisher thread once when GPUSLICE_NATS_URL is set; never blocks. */
void gs_telemetry_start(void);
/* Called after fork() in the child: the thread is gone; restart lazily. */
void gs_telemetry_after_fork(void);

/* ------------------------------------------------------------ time */
uint64_t gs_now_ns(void); /* CLOCK_MONOTONIC */

#endif
