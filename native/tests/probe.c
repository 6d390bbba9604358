/*
 * probe: runs the CUDA driver / NVML calls named on its command line, in order,
 * and prints one JSON object per command on stdout (flushed after each line):
 *
 *     probe [--proc] [--ptds] init ctx alloc 1g info free 0
 *     {"cmd":"init","rc":0}
 *     {"cmd":"ctx","rc":0,"dev":0}
 *     {"cmd":"alloc","rc":0,"id":0,"ptr":140241,"bytes":1073741824}
 *     ...
 *
 * "rc" is the CUresult / nvmlReturn_t of the call (-2: the function could not be
 * resolved, -1: a probe-side problem such as an unknown handle id). A failed call
 * never stops the run. Every handle the probe creates goes into one table; its
 * index is the "id" that `free` and `destroyctx` take. The whole command line is
 * checked before anything runs: a malformed one prints {"error":...} and exits 2.
 *
 * --proc  call every driver function through pointers from cuGetProcAddress_v2
 *         (cudaVersion 13000), itself found with dlsym(dlopen("libcuda.so.1")),
 *         which is how the CUDA runtime reaches the driver;
 * --ptds  as --proc, asking for the per-thread default stream variants.
 * --dlmopen as --proc, with the driver loaded by dlmopen into a new namespace.
 *
 * Sizes take k/m/g/t suffixes (KiB/MiB/GiB/TiB); numbers may be written 0x...
 * Used by tests/native against the fake driver (native/tests/fake).
 *
 * Commands ([X]: optional; DEV defaults to 0; an optional word is taken only when
 * it parses as one, so `dlsym NAME nvml` looks in NVML rather than running `nvml`):
 *   init | ctx [DEV] | newctx [DEV] | newctx3 [DEV] | newctx4 [DEV] | destroyctx ID
 *   release [DEV] | reset [DEV]
 *   alloc SIZE | pitch WIDTH HEIGHT ELEM | managed SIZE [host|global|single] | array W H FORMAT CH
 *   array3d W H D FORMAT CH | mipmap W H D FORMAT CH LEVELS | vmm SIZE [DEV]
 *   vmmmap ID (maps vmm ID at a new address; `free` of the map's id unmaps it)
 *   vmmpair SIZE (two handles mapped side by side, released, one unmap over both)
 *   async SIZE | poolalloc SIZE | free ID | freeraw PTR | trim BYTES | poolattr
 *   info | totalmem [DEV] | fakeused [DEV] | fakebusy [DEV] | uuid [DEV]
 *   fill SIZE | race SIZE COUNT START_NS (CLOCK_REALTIME)
 *   launch N US [KIND] | sync | run SECONDS US [KIND] (KIND: kernel|ex|coop|graph, or the
 *   legacy legacy|grid|gridasync, or multi: cuLaunchCooperativeKernelMultiDevice)
 *   threads T SECONDS US (`run` of kernels in T threads at once, on the current context)
 *   twostreams SECONDS US (see cmd_twostreams) | multi2 SECONDS US (see cmd_multi2)
 *   capture N US (N kernels launched into a new stream under capture; see cmd_capture)
 *   push [DEV] | pop (the primary context of DEV pushed onto / popped off the stack)
 *   proc NAME VERSION FLAGS [v1] | dlsym NAME [cuda|nvml|default (RTLD_DEFAULT)]
 *   nvml | nvmlmem IDX | nvmlprocs IDX | nvmlbyuuid UUID
 *   sleep MS | hold | lock PATH | getppid
 *   deepalloc SIZE (cuMemAlloc_v2 from deepbind.so beside the probe, loaded RTLD_DEEPBIND)
 *   fork | forkwait | exec (the rest of the line runs in a new image of this PID)
 * Memory paths past the plain calls (see cmd_nextalloc .. cmd_setlimit):
 *   nextalloc SIZE [default] (cuMemAlloc_v2 that next_lib.so, which the probe links
 *     against, looks up itself with dlsym(RTLD_NEXT), or RTLD_DEFAULT)
 *   pools N SIZE (N new pools, release threshold at most; SIZE allocated and freed in each)
 *   legacy alloc|pitch|info|totalmem|array|array3d|ctx link|dlsym|proc SIZE (the pre-3.2
 *     entry point, linked, from dlsym on the driver, or cuGetProcAddress_v2 at 3010)
 *   vmmretain ID (cuMemRetainAllocationHandle at map ID's address: a new vmm id)
 *   vmmshare ID (vmm ID exported as a file descriptor and imported: a new vmm id)
 *   capalloc SIZE [freed] (cuMemAllocAsync into a stream under capture, and its
 *     cuMemFreeAsync captured too: the graph is a new id; see cmd_capalloc)
 *   graphalloc SIZE [node|freed|nodefreed] (an allocation node, and a free node, in a
 *     new graph: a new id; see cmd_graphalloc)
 *   instantiate ID (graph ID: an executable graph, a new id) | graphlaunch ID
 *   (`free` of a graph's or executable graph's id destroys it)
 *   setlimit LIMIT VALUE (cuCtxSetLimit: 0 stack, 1 printf FIFO, 2 malloc heap)
 * nvmlbyuuid looks the device up with nvmlDeviceGetHandleByUUID and prints its
 * "index" and "nvml_uuid" (nvmlDeviceGetUUID), null when the lookup fails.
 * Creating commands print "id" (null on failure), "ptr" (the pointer or handle),
 * "bytes" (what was asked for; arrays leave it out) and "ns" (time in the call).
 *
 * fork ... forkwait: the process forks. The child runs the commands between `fork`
 * and its `forkwait` (or the end of the line), every line of its own carrying
 * "child":true, and exits with status 0 there (exit(3): the libraries' destructors
 * run). The parent prints {"cmd":"fork","rc":0,"pid":CHILD}, waits for the child,
 * prints {"cmd":"forkwait","rc":0,"status":S} (the child's exit status, 128 +
 * the signal when one killed it) and goes on after `forkwait`: e.g.
 *     probe init ctx alloc 600m fork init ctx alloc 300m forkwait hold
 * Forks nest: a `forkwait` closes the innermost open `fork`. When fork() fails, the
 * fork line's rc is its errno and the parent goes on after `forkwait` at once.
 * Both write to the same stdout, one whole line at a time, in no fixed order.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gs_cuda.h"

/* ------------------------------------------------------------------ driver prototypes */
/* Every symbol the interposer knows, with the signatures it wraps. */
#define CUDA_HOOK(name, params, args) CUresult name params;
#define CUDA_REAL(name, params, args) CUresult name params;
#define NVML_HOOK(name, params, args) nvmlReturn_t name params;
#define NVML_REAL(name, params, args) nvmlReturn_t name params;
#include "../src/hooks.def"

/* ...and the rest of what the probe calls. */
CUresult cuCtxSetCurrent(CUcontext ctx);
typedef struct CUgraph_st *CUgraph;
CUresult cuCtxPushCurrent_v2(CUcontext ctx);
CUresult cuCtxPopCurrent_v2(CUcontext *pctx);
CUresult cuStreamCreate(CUstream *phStream, unsigned int flags);
CUresult cuStreamDestroy_v2(CUstream hStream);
CUresult cuStreamBeginCapture_v2(CUstream hStream, int mode);
CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                     unsigned long long flags);
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags);
CUresult cuCtxSynchronize(void);
CUresult cuLaunch(CUfunction f);
CUresult cuLaunchGrid(CUfunction f, int grid_width, int grid_height);
CUresult cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream hStream);
CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *launchParamsList,
                                              unsigned int numDevices, unsigned int flags);
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev);
CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value);
CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep);
nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device);
nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device);
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos);

typedef CUresult (*get_proc_v2_t)(const char *, void **, int, cuuint64_t,
                                  CUdriverProcAddressQueryResult *);
typedef CUresult (*get_proc_v1_t)(const char *, void **, int, cuuint64_t);
typedef unsigned long long (*fake_counter_t)(int);

#define PROBE_UNRESOLVED (-2)
#define PROBE_ERROR (-1)
#define PROC_VERSION 13000

/*
 * The driver functions the probe calls: field, name cuGetProcAddress knows it by,
 * and the cudaVersion that selects this very variant (cuCtxCreate has three).
 */
#define API_LIST(X)                                                                          \
    X(cuInit, "cuInit", PROC_VERSION)                                                       \
    X(cuDeviceGet, "cuDeviceGet", PROC_VERSION)                                             \
    X(cuDeviceGetUuid, "cuDeviceGetUuid", PROC_VERSION)                                     \
    X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", PROC_VERSION)                   \
    X(cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease", PROC_VERSION)              \
    X(cuDevicePrimaryCtxReset_v2, "cuDevicePrimaryCtxReset", PROC_VERSION)                  \
    X(cuCtxSetCurrent, "cuCtxSetCurrent", PROC_VERSION)                                     \
    X(cuCtxGetCurrent, "cuCtxGetCurrent", PROC_VERSION)                                     \
    X(cuCtxPushCurrent_v2, "cuCtxPushCurrent", PROC_VERSION)                                \
    X(cuCtxPopCurrent_v2, "cuCtxPopCurrent", PROC_VERSION)                                  \
    X(cuCtxGetDevice, "cuCtxGetDevice", PROC_VERSION)                                       \
    X(cuCtxCreate_v2, "cuCtxCreate", 3020)                                                  \
    X(cuCtxCreate_v3, "cuCtxCreate", 11040)                                                 \
    X(cuCtxCreate_v4, "cuCtxCreate", PROC_VERSION)                                          \
    X(cuCtxDestroy_v2, "cuCtxDestroy", PROC_VERSION)                                        \
    X(cuCtxSynchronize, "cuCtxSynchronize", PROC_VERSION)                                   \
    X(cuMemAlloc_v2, "cuMemAlloc", PROC_VERSION)                                            \
    X(cuMemAllocPitch_v2, "cuMemAllocPitch", PROC_VERSION)                                  \
    X(cuMemAllocManaged, "cuMemAllocManaged", PROC_VERSION)                                 \
    X(cuMemFree_v2, "cuMemFree", PROC_VERSION)                                              \
    X(cuArrayCreate_v2, "cuArrayCreate", PROC_VERSION)                                      \
    X(cuArray3DCreate_v2, "cuArray3DCreate", PROC_VERSION)                                  \
    X(cuArrayDestroy, "cuArrayDestroy", PROC_VERSION)                                       \
    X(cuMipmappedArrayCreate, "cuMipmappedArrayCreate", PROC_VERSION)                       \
    X(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", PROC_VERSION)                     \
    X(cuMemCreate, "cuMemCreate", PROC_VERSION)                                             \
    X(cuMemRelease, "cuMemRelease", PROC_VERSION)                                           \
    X(cuMemAddressReserve, "cuMemAddressReserve", PROC_VERSION)                             \
    X(cuMemMap, "cuMemMap", PROC_VERSION)                                                   \
    X(cuMemUnmap, "cuMemUnmap", PROC_VERSION)                                               \
    X(cuMemAllocAsync, "cuMemAllocAsync", PROC_VERSION)                                     \
    X(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", PROC_VERSION)                     \
    X(cuMemFreeAsync, "cuMemFreeAsync", PROC_VERSION)                                       \
    X(cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool", PROC_VERSION)                 \
    X(cuMemPoolTrimTo, "cuMemPoolTrimTo", PROC_VERSION)                                     \
    X(cuMemPoolGetAttribute, "cuMemPoolGetAttribute", PROC_VERSION)                         \
    X(cuMemGetInfo_v2, "cuMemGetInfo", PROC_VERSION)                                        \
    X(cuDeviceTotalMem_v2, "cuDeviceTotalMem", PROC_VERSION)                                \
    X(cuLaunchKernel, "cuLaunchKernel", PROC_VERSION)                                       \
    X(cuLaunchKernelEx, "cuLaunchKernelEx", PROC_VERSION)                                   \
    X(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", PROC_VERSION)                 \
    X(cuGraphLaunch, "cuGraphLaunch", PROC_VERSION)                                         \
    X(cuLaunch, "cuLaunch", PROC_VERSION)                                                   \
    X(cuLaunchGrid, "cuLaunchGrid", PROC_VERSION)                                           \
    X(cuLaunchGridAsync, "cuLaunchGridAsync", PROC_VERSION)                                 \
    X(cuLaunchCooperativeKernelMultiDevice, "cuLaunchCooperativeKernelMultiDevice", PROC_VERSION) \
    X(cuStreamCreate, "cuStreamCreate", PROC_VERSION)                                       \
    X(cuStreamDestroy_v2, "cuStreamDestroy", PROC_VERSION)                                  \
    X(cuStreamBeginCapture_v2, "cuStreamBeginCapture", PROC_VERSION)                       \
    X(cuStreamEndCapture, "cuStreamEndCapture", PROC_VERSION)                               \
    X(cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags", PROC_VERSION)

static struct {
#define X(field, name, version) __typeof__(field) *field;
    API_LIST(X)
#undef X
} api;

/* Calls through the table; PROBE_UNRESOLVED when --proc could not resolve it. */
#define CALL(field, ...) (api.field ? api.field(__VA_ARGS__) : PROBE_UNRESOLVED)

static bool opt_proc, opt_ptds;
/* How many `fork`s this process is the child of: its lines say "child":true. */
static int fork_depth;

/* ------------------------------------------------------------------ JSON output */
static char *jbuf;
static size_t jlen, jcap;

static void j_raw(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void j_raw(const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(jbuf ? jbuf + jlen : NULL, jbuf ? jcap - jlen : 0, fmt, ap);
        va_end(ap);
        if (n < 0) return;
        if (jbuf && jlen + (size_t)n < jcap) {
            jlen += (size_t)n;
            return;
        }
        size_t cap = jcap ? jcap : 4096;
        while (cap <= jlen + (size_t)n) cap *= 2;
        char *grown = realloc(jbuf, cap);
        if (!grown) {
            fputs("probe: out of memory\n", stderr);
            _exit(70);
        }
        jbuf = grown;
        jcap = cap;
    }
}

static void j_string(const char *s) {
    j_raw("\"");
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            j_raw("\\%c", *p);
        else if (*p < 0x20 || *p >= 0x7f)
            j_raw("\\u%04x", *p);
        else
            j_raw("%c", *p);
    }
    j_raw("\"");
}

static void j_begin(const char *cmd) {
    jlen = 0;
    j_raw("{\"cmd\":");
    j_string(cmd);
    if (fork_depth > 0) j_raw(",\"child\":true");
}

static void j_key(const char *key) {
    j_raw(",");
    j_string(key);
    j_raw(":");
}

static void j_int(const char *key, long long v) {
    j_key(key);
    j_raw("%lld", v);
}

static void j_u64(const char *key, unsigned long long v) {
    j_key(key);
    j_raw("%llu", v);
}

static void j_dbl(const char *key, double v) {
    j_key(key);
    if (isfinite(v))
        j_raw("%.6g", v);
    else
        j_raw("null");
}

static void j_str(const char *key, const char *v) {
    j_key(key);
    if (v)
        j_string(v);
    else
        j_raw("null");
}

static void j_bool(const char *key, bool v) {
    j_key(key);
    j_raw(v ? "true" : "false");
}

static void j_null(const char *key) {
    j_key(key);
    j_raw("null");
}

static void j_end(void) {
    j_raw("}\n");
    fwrite(jbuf, 1, jlen, stdout);
    fflush(stdout);
}

/* A line with just the command and rc. */
static void j_rc(const char *cmd, long long rc) {
    j_begin(cmd);
    j_int("rc", rc);
    j_end();
}

static void j_fail_args(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void j_fail_args(const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    jlen = 0;
    j_raw("{\"error\":");
    j_string(msg);
    j_raw("}\n");
    fwrite(jbuf, 1, jlen, stdout);
    fflush(stdout);
    exit(2);
}

/* ------------------------------------------------------------------ handle table */
enum kind { K_NONE = 0, K_MEM, K_ARRAY, K_MIPMAP, K_VMM, K_ASYNC, K_CTX, K_MAP, K_GRAPH, K_EXEC };
static const char *const kind_names[] = {"none",  "mem", "array", "mipmap", "vmm",
                                         "async", "ctx", "map",   "graph",  "exec"};

typedef struct {
    enum kind kind;
    bool freed;
    unsigned long long handle;
    size_t bytes;
} entry_t;

static entry_t *table;
static size_t table_len, table_cap;

static long long table_add(enum kind kind, unsigned long long handle, size_t bytes) {
    if (table_len == table_cap) {
        size_t cap = table_cap ? table_cap * 2 : 64;
        entry_t *grown = realloc(table, cap * sizeof *grown);
        if (!grown) {
            fputs("probe: out of memory\n", stderr);
            _exit(70);
        }
        table = grown;
        table_cap = cap;
    }
    table[table_len] = (entry_t){.kind = kind, .handle = handle, .bytes = bytes};
    return (long long)table_len++;
}

/* ------------------------------------------------------------------ argument parsing */
static bool parse_u64(const char *s, unsigned long long *out) {
    if (!s || !*s || *s == '-' || *s == '+') return false;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) ? 16 : 10);
    if (errno || end == s || *end) return false;
    *out = v;
    return true;
}

static bool parse_size(const char *s, unsigned long long *out) {
    if (!s || !*s || *s == '-' || *s == '+') return false;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) ? 16 : 10);
    if (errno || end == s) return false;
    unsigned shift = 0;
    switch (*end) {
    case '\0': break;
    case 'k': case 'K': shift = 10; break;
    case 'm': case 'M': shift = 20; break;
    case 'g': case 'G': shift = 30; break;
    case 't': case 'T': shift = 40; break;
    default: return false;
    }
    if (*end && end[1]) return false;
    if (shift && v > (~0ULL >> shift)) return false;
    *out = v << shift;
    return true;
}

static bool parse_int(const char *s, int *out) {
    unsigned long long v;
    if (!parse_u64(s, &v) || v > 0x7fffffff) return false;
    *out = (int)v;
    return true;
}

static bool parse_float(const char *s, double *out) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v) || v < 0) return false;
    *out = v;
    return true;
}

static unsigned long long arg_u64(const char *s) {
    unsigned long long v = 0;
    (void)parse_u64(s, &v);
    return v;
}

static size_t arg_size(const char *s) {
    unsigned long long v = 0;
    (void)parse_size(s, &v);
    return (size_t)v;
}

/* An optional device argument (absent: 0). */
static int arg_dev(int argc, char **argv, int i) {
    int v = 0;
    if (i < argc) (void)parse_int(argv[i], &v);
    return v;
}

/* ------------------------------------------------------------------ helpers */
static uint64_t now_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static void sleep_ns(uint64_t ns) {
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ULL), .tv_nsec = (long)(ns % 1000000000ULL)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static CUresult get_device(int ordinal, CUdevice *dev) {
    *dev = ordinal;
    return CALL(cuDeviceGet, dev, ordinal);
}

/* Device of the current context, 0 when there is none. */
static int current_device(void) {
    CUdevice dev = 0;
    if (CALL(cuCtxGetDevice, &dev) != CUDA_SUCCESS) return 0;
    return dev;
}

static fake_counter_t fake_counter(const char *name) {
    void *sym = dlsym(RTLD_DEFAULT, name);
    fake_counter_t fn;
    memcpy(&fn, &sym, sizeof fn);
    return fn;
}

/* "busy_ns" (the fake engine's kernel time since busy0) and "share" (of `wall`),
 * or nulls where the driver is not the fake. */
static void j_busy_share(fake_counter_t busy, int dev, unsigned long long busy0, uint64_t wall) {
    if (busy) {
        unsigned long long b = busy(dev) - busy0;
        j_u64("busy_ns", b);
        j_dbl("share", wall ? (double)b / (double)wall : 0.0);
    } else {
        j_null("busy_ns");
        j_null("share");
    }
}

/* dladdr's library basename and symbol name for a pointer. */
static void j_where(const void *p) {
    Dl_info info;
    if (p && dladdr(p, &info) && info.dli_fname) {
        const char *slash = strrchr(info.dli_fname, '/');
        j_str("lib", slash ? slash + 1 : info.dli_fname);
        j_str("sym", info.dli_sname);
    } else {
        j_null("lib");
        j_null("sym");
    }
}

static bool opt_dlmopen;

static void *libcuda_handle(void) {
    static void *handle;
    if (!handle && opt_dlmopen) handle = dlmopen(LM_ID_NEWLM, "libcuda.so.1", RTLD_NOW);
    else if (!handle) handle = dlopen("libcuda.so.1", RTLD_NOW);
    return handle;
}

static void *libnvml_handle(void) {
    static void *handle;
    if (!handle) handle = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    return handle;
}

static get_proc_v2_t get_proc_v2(void) {
    void *h = libcuda_handle();
    void *sym = h ? dlsym(h, "cuGetProcAddress_v2") : NULL;
    get_proc_v2_t fn;
    memcpy(&fn, &sym, sizeof fn);
    return fn;
}

/* Fill the call table: the linked symbols, or cuGetProcAddress_v2 like cudart. */
static void api_setup(void) {
    if (!opt_proc) {
#define X(field, name, version) api.field = field;
        API_LIST(X)
#undef X
        return;
    }
    get_proc_v2_t gpa = get_proc_v2();
    if (!gpa) {
        fprintf(stderr, "probe: no cuGetProcAddress_v2 in libcuda.so.1: %s\n", dlerror());
        return;
    }
    cuuint64_t flags = opt_ptds ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                                : CU_GET_PROC_ADDRESS_DEFAULT;
#define X(field, name, version)                                                              \
    do {                                                                                     \
        void *fn = NULL;                                                                     \
        CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;            \
        CUresult r = gpa(name, &fn, version, flags, &st);                                    \
        if (r != CUDA_SUCCESS || st != CU_GET_PROC_ADDRESS_SUCCESS || !fn) {                 \
            fprintf(stderr, "probe: cuGetProcAddress_v2(%s, %d) = %d, status %d\n", name,    \
                    version, r, (int)st);                                                    \
            fn = NULL;                                                                       \
        }                                                                                    \
        memcpy(&api.field, &fn, sizeof api.field);                                           \
    } while (0);
    API_LIST(X)
#undef X
}

/* ------------------------------------------------------------------ commands */
static void cmd_init(int argc, char **argv) {
    j_rc("init", CALL(cuInit, 0));
}

/* Retains the primary context of the device argument; its ordinal in *ordinal. */
static CUresult retain_primary(int argc, char **argv, int *ordinal, CUcontext *ctx) {
    *ordinal = arg_dev(argc, argv, 0);
    *ctx = NULL;
    CUdevice dev;
    CUresult rc = get_device(*ordinal, &dev);
    return rc == CUDA_SUCCESS ? CALL(cuDevicePrimaryCtxRetain, ctx, dev) : rc;
}

static void j_ctx(const char *cmd, CUresult rc, int ordinal) {
    j_begin(cmd);
    j_int("rc", rc);
    j_int("dev", ordinal);
    j_end();
}

static void cmd_ctx(int argc, char **argv) {
    int ordinal;
    CUcontext ctx;
    CUresult rc = retain_primary(argc, argv, &ordinal, &ctx);
    if (rc == CUDA_SUCCESS) rc = CALL(cuCtxSetCurrent, ctx);
    j_ctx("ctx", rc, ordinal);
}

static void newctx_common(const char *cmd, int version, int argc, char **argv) {
    int ordinal = arg_dev(argc, argv, 0);
    CUdevice dev;
    CUcontext ctx = NULL;
    CUresult rc = get_device(ordinal, &dev);
    if (rc == CUDA_SUCCESS) {
        if (version == 2)
            rc = CALL(cuCtxCreate_v2, &ctx, 0, dev);
        else if (version == 3)
            rc = CALL(cuCtxCreate_v3, &ctx, NULL, 0, 0, dev);
        else
            rc = CALL(cuCtxCreate_v4, &ctx, NULL, 0, dev);
    }
    j_begin(cmd);
    j_int("rc", rc);
    j_int("dev", ordinal);
    if (rc == CUDA_SUCCESS)
        j_int("id", table_add(K_CTX, (unsigned long long)(uintptr_t)ctx, 0));
    else
        j_null("id");
    j_end();
}

static void cmd_newctx(int argc, char **argv) { newctx_common("newctx", 2, argc, argv); }
static void cmd_newctx3(int argc, char **argv) { newctx_common("newctx3", 3, argc, argv); }
static void cmd_newctx4(int argc, char **argv) { newctx_common("newctx4", 4, argc, argv); }

static void cmd_release(int argc, char **argv) {
    int ordinal = arg_dev(argc, argv, 0);
    CUdevice dev;
    CUresult rc = get_device(ordinal, &dev);
    if (rc == CUDA_SUCCESS) rc = CALL(cuDevicePrimaryCtxRelease_v2, dev);
    j_begin("release");
    j_int("rc", rc);
    j_int("dev", ordinal);
    j_end();
}

static void cmd_reset(int argc, char **argv) {
    int ordinal = arg_dev(argc, argv, 0);
    CUdevice dev;
    CUresult rc = get_device(ordinal, &dev);
    if (rc == CUDA_SUCCESS) rc = CALL(cuDevicePrimaryCtxReset_v2, dev);
    j_begin("reset");
    j_int("rc", rc);
    j_int("dev", ordinal);
    j_end();
}

/* "bytes" of a handle whose size the driver decides (arrays): left out. */
#define BYTES_UNKNOWN ((size_t)-1)

/* When the current command's driver call began (for its "ns"). */
static uint64_t call_t0;

/* The line of a call that creates a handle: rc, id (null on failure), the handle and how
 * long the call took since call_t0. */
static void j_created(const char *cmd, CUresult rc, enum kind kind, unsigned long long handle,
                      size_t bytes) {
    uint64_t took = now_ns(CLOCK_MONOTONIC) - call_t0;
    j_begin(cmd);
    j_int("rc", rc);
    if (rc == CUDA_SUCCESS) {
        j_int("id", table_add(kind, handle, bytes));
        j_u64("ptr", handle);
    } else {
        j_null("id");
    }
    if (bytes != BYTES_UNKNOWN) j_u64("bytes", bytes);
    j_u64("ns", took);
}

static void cmd_alloc(int argc, char **argv) {
    size_t size = arg_size(argv[0]);
    CUdeviceptr p = 0;
    call_t0 = now_ns(CLOCK_MONOTONIC);
    CUresult rc = CALL(cuMemAlloc_v2, &p, size);
    j_created("alloc", rc, K_MEM, p, size);
    j_end();
}

static void cmd_pitch(int argc, char **argv) {
    size_t width = arg_size(argv[0]), height = (size_t)arg_u64(argv[1]);
    unsigned elem = (unsigned)arg_u64(argv[2]);
    CUdeviceptr p = 0;
    size_t pitch = 0;
    call_t0 = now_ns(CLOCK_MONOTONIC);
    CUresult rc = CALL(cuMemAllocPitch_v2, &p, &pitch, width, height, elem);
    j_created("pitch", rc, K_MEM, p, pitch * height);
    j_u64("pitch", pitch);
    j_end();
}

static void cmd_managed(int argc, char **argv) {
    size_t size = arg_size(argv[0]);
    /* CU_MEM_ATTACH_GLOBAL unless told: host (2) or single (4) */
    unsigned flags = argc > 1 ? (!strcmp(argv[1], "host") ? 2u : !strcmp(argv[1], "single") ? 4u : 1u) : 1u;
    CUdeviceptr p = 0;
    call_t0 = now_ns(CLOCK_MONOTONIC);
    CUresult rc = CALL(cuMemAllocManaged, &p, size, flags);
    j_created("managed", rc, K_MEM, p, size);
    j_end();
}

static void cmd_array(int argc, char **argv) {
    CUDA_ARRAY_DESCRIPTOR d = {
        .Width = (size_t)arg_u64(argv[0]),
        .Height = (size_t)arg_u64(argv[1]),
        .Format = (CUarray_format)arg_u64(argv[2]),
        .NumChannels = (unsigned)arg_u64(argv[3]),
    };
    CUarray a = NULL;
    call_t0 = now_ns(CLOCK_MONOTONIC);
    CUresult rc = CALL(cuArrayCreate_v2, &a, &d);
    j_created("array", rc, K_ARRAY, (unsigned long long)(uintptr_t)a, BYTES_UNKNOWN);
    j_end();
}

/* W H D FORMAT CH */
static CUDA_ARRAY3D_DESCRIPTOR desc3d(char **argv) {
    return (CUDA_ARRAY3D_DESCRIPTOR){
        .Width = (size_t)arg_u64(argv[0]),
        .Height = (size_t)arg_u64(argv[1]),
        .Depth = (size_t)arg_u64(argv[2]),
        .Format = (CUarray_format)arg_u64(argv[3]),
        .NumChannels = (unsigned)arg_u64(argv[4]),
        .Flags = 0,
    };
}

static void cmd_array3d(int argc, char **argv) {
    CUDA_ARRAY3D_DESCRIPTOR d = desc3d(argv);
    CUarray a = NULL;
    call_t0 = now_ns(CLOCK_MONOTONIC);
    CUresult rc = CALL(cuArray3DCreate_v2, &a, &d);
    j_created("array3d", rc, K_ARRAY, (unsigned long long)(uintptr_t)a, BYTES_UNKNOWN);
    j_end();
}

static void cmd_mipmap(int argc, char **argv) {
    CUDA_ARRAY3D_DESCRIPTOR d = desc3d(argv);
    unsigned levels = (unsigned)arg_u64(argv[5]);
    CUmipmappedArray m = NULL;
    call_t0 = now_ns(CLOCK_MONOTONIC);
    CUresult rc = CALL(cuMipmappedArrayCreate, &m, &d, levels);
    j_created("mipmap", rc, K_MIPMAP, (unsigned long long)(uintptr_t)m, BYTES_UNKNOWN);
    j_end();
}

static void cmd_vmm(int argc, char **argv) {
    size_t size = arg_size(argv[0]);
    int ordinal = arg_dev(argc, argv, 1);
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal;
    CUmemGenericAllocationHandle h = 0;
    call_t0 = now_ns(CLOCK_MONOTONIC);
    CUresult rc = CALL(cuMemCreate, &h, size, &prop, 0);
    j_created("vmm", rc, K_VMM, h, size);
    j_int("dev", ordinal);
    j_end();
}

/* Maps the VMM allocation `ID` at a fresh address range; `free` of the new id unmaps it. */
static void cmd_vmmmap(int argc, char **argv) {
    unsigned long long id = arg_u64(argv[0]);
    if (id >= table_len || table[id].kind != K_VMM) {
        j_begin("vmmmap");
        j_int("rc", PROBE_ERROR);
        j_str("error", "no such vmm id");
        j_end();
        return;
    }
    size_t size = table[id].bytes;
    CUdeviceptr va = 0;
    call_t0 = now_ns(CLOCK_MONOTONIC);
    CUresult rc = CALL(cuMemAddressReserve, &va, size, 0, 0, 0);
    if (rc == CUDA_SUCCESS)
        rc = CALL(cuMemMap, va, size, 0, (CUmemGenericAllocationHandle)table[id].handle, 0);
    j_created("vmmmap", rc, K_MAP, va, size);
    j_end();
}

/* Two VMM allocations of SIZE mapped side by side, both released, then one
 * cuMemUnmap over the whole range (as NVIDIA's vectorAddMMAP sample does). */
static void cmd_vmmpair(int argc, char **argv) {
    size_t size = arg_size(argv[0]);
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = current_device();
    CUmemGenericAllocationHandle h[2] = {0, 0};
    CUdeviceptr va = 0;
    CUresult rc = CALL(cuMemAddressReserve, &va, 2 * size, 0, 0, 0);
    for (int i = 0; i < 2 && rc == CUDA_SUCCESS; i++) rc = CALL(cuMemCreate, &h[i], size, &prop, 0);
    for (int i = 0; i < 2 && rc == CUDA_SUCCESS; i++)
        rc = CALL(cuMemMap, va + (CUdeviceptr)i * size, size, 0, h[i], 0);
    for (int i = 0; i < 2 && rc == CUDA_SUCCESS; i++) rc = CALL(cuMemRelease, h[i]);
    if (rc == CUDA_SUCCESS) rc = CALL(cuMemUnmap, va, 2 * size);
    j_begin("vmmpair");
    j_int("rc", rc);
    j_end();
}

static void cmd_async(int argc, char **argv) {
    size_t size = arg_size(argv[0]);
    CUdeviceptr p = 0;
    call_t0 = now_ns(CLOCK_MONOTONIC);
    CUresult rc = CALL(cuMemAllocAsync, &p, size, NULL);
    j_created("async", rc, K_ASYNC, p, size);
    j_end();
}

static CUresult default_pool(CUmemoryPool *pool) {
    *pool = NULL;
    return CALL(cuDeviceGetDefaultMemPool, pool, current_device());
}

static void cmd_poolalloc(int argc, char **argv) {
    size_t size = arg_size(argv[0]);
    CUmemoryPool pool;
    CUdeviceptr p = 0;
    call_t0 = now_ns(CLOCK_MONOTONIC);
    CUresult rc = default_pool(&pool);
    if (rc == CUDA_SUCCESS) rc = CALL(cuMemAllocFromPoolAsync, &p, size, pool, NULL);
    j_created("poolalloc", rc, K_ASYNC, p, size);
    j_end();
}

static void cmd_free(int argc, char **argv) {
    unsigned long long id = arg_u64(argv[0]);
    j_begin("free");
    if (id >= table_len) {
        j_int("rc", PROBE_ERROR);
        j_u64("id", id);
        j_str("error", "no such id");
        j_end();
        return;
    }
    entry_t *e = &table[id];
    CUresult rc = PROBE_ERROR;
    switch (e->kind) {
    case K_MEM: rc = CALL(cuMemFree_v2, (CUdeviceptr)e->handle); break;
    case K_ARRAY: rc = CALL(cuArrayDestroy, (CUarray)(uintptr_t)e->handle); break;
    case K_MIPMAP: rc = CALL(cuMipmappedArrayDestroy, (CUmipmappedArray)(uintptr_t)e->handle); break;
    case K_VMM: rc = CALL(cuMemRelease, (CUmemGenericAllocationHandle)e->handle); break;
    case K_MAP: rc = CALL(cuMemUnmap, (CUdeviceptr)e->handle, e->bytes); break;
    case K_ASYNC: rc = CALL(cuMemFreeAsync, (CUdeviceptr)e->handle, NULL); break;
    case K_CTX: rc = CALL(cuCtxDestroy_v2, (CUcontext)(uintptr_t)e->handle); break;
    case K_GRAPH: rc = cuGraphDestroy((CUgraph)(uintptr_t)e->handle); break;
    case K_EXEC: rc = cuGraphExecDestroy((CUgraphExec)(uintptr_t)e->handle); break;
    case K_NONE: break;
    }
    j_int("rc", rc);
    j_u64("id", id);
    j_str("kind", kind_names[e->kind]);
    /* Freeing twice calls the driver again (a test of double frees); says so. */
    j_bool("again", e->freed);
    if (rc == CUDA_SUCCESS) e->freed = true;
    j_end();
}

/* cuMemFree_v2 of an address the probe never allocated. */
static void cmd_freeraw(int argc, char **argv) {
    unsigned long long address = arg_u64(argv[0]);
    CUresult rc = CALL(cuMemFree_v2, (CUdeviceptr)address);
    j_begin("freeraw");
    j_int("rc", rc);
    j_u64("address", address);
    j_end();
}

static void cmd_destroyctx(int argc, char **argv) {
    unsigned long long id = arg_u64(argv[0]);
    j_begin("destroyctx");
    if (id >= table_len || table[id].kind != K_CTX) {
        j_int("rc", PROBE_ERROR);
        j_u64("id", id);
        j_str("error", "no such context id");
        j_end();
        return;
    }
    entry_t *e = &table[id];
    CUresult rc = CALL(cuCtxDestroy_v2, (CUcontext)(uintptr_t)e->handle);
    j_int("rc", rc);
    j_u64("id", id);
    j_bool("again", e->freed);
    if (rc == CUDA_SUCCESS) e->freed = true;
    j_end();
}

static void cmd_trim(int argc, char **argv) {
    size_t keep = arg_size(argv[0]);
    CUmemoryPool pool;
    CUresult rc = default_pool(&pool);
    if (rc == CUDA_SUCCESS) rc = CALL(cuMemPoolTrimTo, pool, keep);
    j_begin("trim");
    j_int("rc", rc);
    j_u64("keep", keep);
    j_end();
}

static void cmd_poolattr(int argc, char **argv) {
    CUmemoryPool pool;
    cuuint64_t reserved = 0, used = 0;
    CUresult rc = default_pool(&pool);
    if (rc == CUDA_SUCCESS)
        rc = CALL(cuMemPoolGetAttribute, pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved);
    if (rc == CUDA_SUCCESS)
        rc = CALL(cuMemPoolGetAttribute, pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used);
    j_begin("poolattr");
    j_int("rc", rc);
    j_u64("reserved", reserved);
    j_u64("used", used);
    j_end();
}

static void cmd_info(int argc, char **argv) {
    size_t free_b = 0, total = 0;
    CUresult rc = CALL(cuMemGetInfo_v2, &free_b, &total);
    j_begin("info");
    j_int("rc", rc);
    j_u64("free", free_b);
    j_u64("total", total);
    j_end();
}

static void cmd_totalmem(int argc, char **argv) {
    int ordinal = arg_dev(argc, argv, 0);
    CUdevice dev;
    size_t bytes = 0;
    CUresult rc = get_device(ordinal, &dev);
    if (rc == CUDA_SUCCESS) rc = CALL(cuDeviceTotalMem_v2, &bytes, dev);
    j_begin("totalmem");
    j_int("rc", rc);
    j_int("dev", ordinal);
    j_u64("bytes", bytes);
    j_end();
}

static void format_uuid(const CUuuid *u, char out[64]) {
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, 64,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
             b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

/* The device's UUID from the driver and, when NVML is initialised, from NVML. */
static void cmd_uuid(int argc, char **argv) {
    int ordinal = arg_dev(argc, argv, 0);
    CUdevice dev;
    CUuuid u;
    memset(&u, 0, sizeof u);
    char text[64] = "";
    CUresult rc = get_device(ordinal, &dev);
    if (rc == CUDA_SUCCESS) rc = CALL(cuDeviceGetUuid, &u, dev);
    if (rc == CUDA_SUCCESS) format_uuid(&u, text);
    nvmlDevice_t d = NULL;
    char nvml_text[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = "";
    nvmlReturn_t nrc = nvmlDeviceGetHandleByIndex_v2((unsigned)ordinal, &d);
    if (nrc == NVML_SUCCESS) nrc = nvmlDeviceGetUUID(d, nvml_text, sizeof nvml_text);
    j_begin("uuid");
    j_int("rc", rc);
    j_int("dev", ordinal);
    j_str("uuid", rc == CUDA_SUCCESS ? text : NULL);
    j_int("nvml_rc", nrc);
    j_str("nvml_uuid", nrc == NVML_SUCCESS ? nvml_text : NULL);
    j_end();
}

static void cmd_fakeused(int argc, char **argv) {
    int ordinal = arg_dev(argc, argv, 0);
    fake_counter_t fn = fake_counter("fakecuda_used_bytes");
    j_begin("fakeused");
    j_int("rc", fn ? 0 : PROBE_UNRESOLVED);
    j_int("dev", ordinal);
    if (fn)
        j_u64("bytes", fn(ordinal));
    else
        j_null("bytes");
    j_end();
}

/* fakebusy [DEV]: the kernel time the fake engine of DEV ran ("busy_ns"), and the
 * monotonic clock now ("at_ns"): a test takes the share of a stretch from two. */
static void cmd_fakebusy(int argc, char **argv) {
    int ordinal = arg_dev(argc, argv, 0);
    fake_counter_t fn = fake_counter("fakecuda_busy_ns");
    j_begin("fakebusy");
    j_int("rc", fn ? 0 : PROBE_UNRESOLVED);
    if (fn)
        j_u64("busy_ns", fn(ordinal));
    else
        j_null("busy_ns");
    j_u64("at_ns", now_ns(CLOCK_MONOTONIC));
    j_end();
}

#define FILL_MAX 1000000

static void cmd_fill(int argc, char **argv) {
    size_t size = arg_size(argv[0]);
    long long first = -1, count = 0;
    CUresult rc = CUDA_SUCCESS;
    while (count < FILL_MAX) {
        CUdeviceptr p = 0;
        rc = CALL(cuMemAlloc_v2, &p, size);
        if (rc != CUDA_SUCCESS) break;
        long long id = table_add(K_MEM, p, size);
        if (first < 0) first = id;
        count++;
    }
    j_begin("fill");
    j_int("rc", rc);
    j_int("count", count);
    j_u64("bytes", (unsigned long long)count * size);
    if (first >= 0)
        j_int("first", first);
    else
        j_null("first");
    j_bool("capped", count >= FILL_MAX);
    j_end();
}

static void cmd_race(int argc, char **argv) {
    size_t size = arg_size(argv[0]);
    unsigned long long n = arg_u64(argv[1]), start = arg_u64(argv[2]);
    uint64_t now = now_ns(CLOCK_REALTIME);
    if (now < start) {
        /* Sleep to just short of the start, then spin so every racer leaves together. */
        if (start - now > 2000000ULL) {
            struct timespec ts = {.tv_sec = (time_t)((start - 1000000ULL) / 1000000000ULL),
                                  .tv_nsec = (long)((start - 1000000ULL) % 1000000000ULL)};
            while (clock_nanosleep(CLOCK_REALTIME, TIMER_ABSTIME, &ts, NULL) == EINTR) {
            }
        }
        while (now_ns(CLOCK_REALTIME) < start) {
        }
    }
    uint64_t began = now_ns(CLOCK_REALTIME);
    long long ok = 0, first = -1;
    CUresult last_fail = CUDA_SUCCESS;
    for (unsigned long long i = 0; i < n; i++) {
        CUdeviceptr p = 0;
        CUresult rc = CALL(cuMemAlloc_v2, &p, size);
        if (rc == CUDA_SUCCESS) {
            long long id = table_add(K_MEM, p, size);
            if (first < 0) first = id;
            ok++;
        } else {
            last_fail = rc;
        }
    }
    j_begin("race");
    j_int("rc", last_fail);
    j_int("ok", ok);
    j_int("failed", (long long)n - ok);
    if (first >= 0)
        j_int("first", first);
    else
        j_null("first");
    j_u64("late_ns", start && began > start ? began - start : 0);
    j_end();
}

/* "fake_launches": kernels the fake driver counted on `dev` since `before` (null
 * without the fake). */
static void j_fake_launches(fake_counter_t counted, int dev, unsigned long long before) {
    if (counted)
        j_u64("fake_launches", counted(dev) - before);
    else
        j_null("fake_launches");
}

enum launch_kind { L_KERNEL, L_EX, L_COOP, L_GRAPH, L_LEGACY, L_GRID, L_GRIDASYNC, L_MULTI };

static const char *const launch_names[] = {"kernel", "ex",   "coop",      "graph",
                                           "legacy", "grid", "gridasync", "multi"};

static enum launch_kind parse_launch_kind(int argc, char **argv, int i) {
    if (i >= argc) return L_KERNEL;
    for (int k = 0; k <= L_MULTI; k++)
        if (!strcmp(argv[i], launch_names[k])) return (enum launch_kind)k;
    return L_KERNEL;
}

/* One kernel of `us` microseconds on stream 0: the fake runs a CUfunction for as
 * many microseconds as its handle's value. */
static CUresult launch_one(enum launch_kind kind, unsigned long long us) {
    CUfunction f = (CUfunction)(uintptr_t)us;
    switch (kind) {
    case L_KERNEL: return CALL(cuLaunchKernel, f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    case L_EX: {
        CUlaunchConfig cfg = {.gridDimX = 1, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 1,
                              .blockDimY = 1, .blockDimZ = 1, .sharedMemBytes = 0,
                              .hStream = NULL, .attrs = NULL, .numAttrs = 0};
        return CALL(cuLaunchKernelEx, &cfg, f, NULL, NULL);
    }
    case L_COOP: return CALL(cuLaunchCooperativeKernel, f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL);
    case L_GRAPH: return CALL(cuGraphLaunch, (CUgraphExec)(uintptr_t)us, NULL);
    /* the legacy entry points, and a multi-device launch of one entry */
    case L_LEGACY: return CALL(cuLaunch, f);
    case L_GRID: return CALL(cuLaunchGrid, f, 1, 1);
    case L_GRIDASYNC: return CALL(cuLaunchGridAsync, f, 1, 1, NULL);
    case L_MULTI: {
        CUDA_LAUNCH_PARAMS p = {.function = f, .gridDimX = 1, .gridDimY = 1, .gridDimZ = 1,
                                .blockDimX = 1, .blockDimY = 1, .blockDimZ = 1};
        return CALL(cuLaunchCooperativeKernelMultiDevice, &p, 1, 0);
    }
    }
    return PROBE_ERROR;
}

static void cmd_launch(int argc, char **argv) {
    unsigned long long n = arg_u64(argv[0]), us = arg_u64(argv[1]);
    enum launch_kind kind = parse_launch_kind(argc, argv, 2);
    int dev = current_device();
    fake_counter_t counted = fake_counter("fakecuda_launches");
    unsigned long long counted0 = counted ? counted(dev) : 0;
    CUresult first_fail = CUDA_SUCCESS;
    long long ok = 0;
    uint64_t t0 = now_ns(CLOCK_MONOTONIC);
    for (unsigned long long i = 0; i < n; i++) {
        CUresult rc = launch_one(kind, us);
        if (rc == CUDA_SUCCESS)
            ok++;
        else if (first_fail == CUDA_SUCCESS)
            first_fail = rc;
    }
    j_begin("launch");
    j_int("rc", first_fail);
    j_int("launched", ok);
    j_str("via", launch_names[kind]);
    j_u64("ns", now_ns(CLOCK_MONOTONIC) - t0);
    j_fake_launches(counted, dev, counted0);
    j_end();
}

/*
 * twostreams SECONDS US: for SECONDS, a kernel of US microseconds on a stream of
 * its own (made here), then an empty kernel on the NULL stream, paced as `run`
 * paces (a few kernels' worth queued); "share" = kernel time the fake engines
 * ran / wall time. Under FAKECUDA_STREAM_ENGINES=1 the stream's kernels run
 * beside the NULL stream's: a timing event on the NULL stream does not wait for
 * them.
 */
static void cmd_twostreams(int argc, char **argv) {
    double seconds = 0;
    (void)parse_float(argv[0], &seconds);
    unsigned long long us = arg_u64(argv[1]);
    int dev = current_device();
    fake_counter_t busy = fake_counter("fakecuda_busy_ns");
    CUstream side = NULL;
    CUresult rc = CALL(cuStreamCreate, &side, 0);
    uint64_t duration = (uint64_t)(seconds * 1e9), kernel_ns = us * 1000ULL;
    uint64_t lookahead = kernel_ns * 4 > 2000000ULL ? kernel_ns * 4 : 2000000ULL;
    unsigned long long busy0 = busy ? busy(dev) : 0;
    uint64_t submitted = 0;
    long long launches = 0;
    uint64_t t0 = now_ns(CLOCK_MONOTONIC);
    while (rc == CUDA_SUCCESS && now_ns(CLOCK_MONOTONIC) - t0 < duration) {
        uint64_t done = busy ? (uint64_t)(busy(dev) - busy0) : now_ns(CLOCK_MONOTONIC) - t0;
        if (submitted > done + lookahead) {
            sleep_ns(200000);
            continue;
        }
        rc = CALL(cuLaunchKernel, (CUfunction)(uintptr_t)us, 1, 1, 1, 1, 1, 1, 0, side, NULL, NULL);
        if (rc == CUDA_SUCCESS)
            rc = CALL(cuLaunchKernel, (CUfunction)0, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        launches += 2;
        submitted += kernel_ns;
    }
    CUresult src = CALL(cuCtxSynchronize);
    if (rc == CUDA_SUCCESS) rc = src;
    uint64_t wall = now_ns(CLOCK_MONOTONIC) - t0;
    j_begin("twostreams");
    j_int("rc", rc);
    j_int("launches", launches);
    j_u64("wall_ns", wall);
    j_busy_share(busy, dev, busy0, wall);
    j_end();
    if (side) CALL(cuStreamDestroy_v2, side);
}

/*
 * lostream SECONDS US HOW: kernels of US microseconds on the NULL stream, each
 * waited for (the GPU keeps pace), for one second; then one empty kernel on a
 * stream of its own, which is then destroyed (HOW "destroy") or left capturing
 * (HOW "capture"; "none": neither, the stream only made); then the NULL stream's
 * kernels again for SECONDS. "share" = kernel time the fake engine ran in that
 * last part / its wall time.
 */
static void cmd_lostream(int argc, char **argv) {
    double seconds = 0;
    (void)parse_float(argv[0], &seconds);
    unsigned long long us = arg_u64(argv[1]);
    const char *how = argc > 2 ? argv[2] : "none";
    int dev = current_device();
    fake_counter_t busy = fake_counter("fakecuda_busy_ns");
    CUstream side = NULL;
    CUresult rc = CALL(cuStreamCreate, &side, 0);
    long long launches = 0;
    uint64_t t0 = now_ns(CLOCK_MONOTONIC);
    while (rc == CUDA_SUCCESS && now_ns(CLOCK_MONOTONIC) - t0 < 1000000000ULL) {
        rc = CALL(cuLaunchKernel, (CUfunction)(uintptr_t)us, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        if (rc == CUDA_SUCCESS) rc = CALL(cuCtxSynchronize);
        launches++;
    }
    if (rc == CUDA_SUCCESS && strcmp(how, "none") != 0) {
        rc = CALL(cuLaunchKernel, (CUfunction)0, 1, 1, 1, 1, 1, 1, 0, side, NULL, NULL);
        if (rc == CUDA_SUCCESS && !strcmp(how, "destroy")) {
            rc = CALL(cuStreamDestroy_v2, side);
            side = NULL;
        } else if (rc == CUDA_SUCCESS) {
            rc = CALL(cuStreamBeginCapture_v2, side, 0);
        }
    }
    unsigned long long busy0 = busy ? busy(dev) : 0;
    uint64_t t1 = now_ns(CLOCK_MONOTONIC), duration = (uint64_t)(seconds * 1e9);
    while (rc == CUDA_SUCCESS && now_ns(CLOCK_MONOTONIC) - t1 < duration) {
        rc = CALL(cuLaunchKernel, (CUfunction)(uintptr_t)us, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        if (rc == CUDA_SUCCESS) rc = CALL(cuCtxSynchronize);
        launches++;
    }
    uint64_t wall = now_ns(CLOCK_MONOTONIC) - t1;
    j_begin("lostream");
    j_int("rc", rc);
    j_int("launches", launches);
    j_u64("wall_ns", wall);
    j_busy_share(busy, dev, busy0, wall);
    j_end();
}

/*
 * exflip SECONDS US: for SECONDS, cuLaunchKernelEx of US microseconds with one
 * config whose stream a second thread flips between the NULL stream and a stream
 * of its own all the while (the library reads it, then the driver does), paced
 * as `twostreams` paces; "share" = kernel time the fake engines ran / wall time.
 */
static CUstream volatile exflip_side;
static volatile int exflip_stop;
static CUlaunchConfig exflip_cfg;

static void *exflip_thread(void *arg) {
    (void)arg;
    CUstream volatile *target = &exflip_cfg.hStream;
    while (!exflip_stop) {
        *target = exflip_side;
        *target = NULL;
    }
    return NULL;
}

static void cmd_exflip(int argc, char **argv) {
    double seconds = 0;
    (void)parse_float(argv[0], &seconds);
    unsigned long long us = arg_u64(argv[1]);
    int dev = current_device();
    fake_counter_t busy = fake_counter("fakecuda_busy_ns");
    CUstream side = NULL;
    CUresult rc = CALL(cuStreamCreate, &side, 0);
    exflip_side = side;
    exflip_cfg = (CUlaunchConfig){.gridDimX = 1, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 1,
                                  .blockDimY = 1, .blockDimZ = 1, .hStream = NULL};
    exflip_stop = 0;
    pthread_t flipper;
    if (rc == CUDA_SUCCESS && pthread_create(&flipper, NULL, exflip_thread, NULL) != 0) rc = PROBE_ERROR;
    bool started = rc == CUDA_SUCCESS;
    uint64_t duration = (uint64_t)(seconds * 1e9), kernel_ns = us * 1000ULL;
    uint64_t lookahead = kernel_ns * 4 > 2000000ULL ? kernel_ns * 4 : 2000000ULL;
    unsigned long long busy0 = busy ? busy(dev) : 0;
    uint64_t submitted = 0;
    long long launches = 0;
    uint64_t t0 = now_ns(CLOCK_MONOTONIC);
    while (rc == CUDA_SUCCESS && now_ns(CLOCK_MONOTONIC) - t0 < duration) {
        uint64_t done = busy ? (uint64_t)(busy(dev) - busy0) : now_ns(CLOCK_MONOTONIC) - t0;
        if (submitted > done + lookahead) {
            sleep_ns(200000);
            continue;
        }
        rc = CALL(cuLaunchKernelEx, &exflip_cfg, (CUfunction)(uintptr_t)us, NULL, NULL);
        launches++;
        submitted += kernel_ns;
    }
    exflip_stop = 1;
    if (started) pthread_join(flipper, NULL);
    CUresult src = CALL(cuCtxSynchronize);
    if (rc == CUDA_SUCCESS) rc = src;
    uint64_t wall = now_ns(CLOCK_MONOTONIC) - t0;
    j_begin("exflip");
    j_int("rc", rc);
    j_int("launches", launches);
    j_u64("wall_ns", wall);
    j_busy_share(busy, dev, busy0, wall);
    j_end();
    if (side) CALL(cuStreamDestroy_v2, side);
}

/*
 * multi2 SECONDS US: for SECONDS, cuLaunchCooperativeKernelMultiDevice with two
 * entries: an empty kernel on the current device's NULL stream and a kernel of
 * US microseconds on a stream of device 1's primary context, paced as `run`
 * paces; "share" = kernel time device 1's fake engine ran / wall time.
 */
static void cmd_multi2(int argc, char **argv) {
    double seconds = 0;
    (void)parse_float(argv[0], &seconds);
    unsigned long long us = arg_u64(argv[1]);
    fake_counter_t busy = fake_counter("fakecuda_busy_ns");
    CUdevice dev1 = 0;
    CUcontext ctx1 = NULL, popped = NULL;
    CUstream s1 = NULL;
    CUresult rc = CALL(cuDeviceGet, &dev1, 1);
    if (rc == CUDA_SUCCESS) rc = CALL(cuDevicePrimaryCtxRetain, &ctx1, dev1);
    if (rc == CUDA_SUCCESS) rc = CALL(cuCtxPushCurrent_v2, ctx1);
    if (rc == CUDA_SUCCESS) {
        rc = CALL(cuStreamCreate, &s1, 0);
        CALL(cuCtxPopCurrent_v2, &popped);
    }
    CUDA_LAUNCH_PARAMS p[2] = {
        {.function = (CUfunction)0, .gridDimX = 1, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 1,
         .blockDimY = 1, .blockDimZ = 1, .hStream = NULL},
        {.function = (CUfunction)(uintptr_t)us, .gridDimX = 1, .gridDimY = 1, .gridDimZ = 1,
         .blockDimX = 1, .blockDimY = 1, .blockDimZ = 1, .hStream = s1},
    };
    uint64_t duration = (uint64_t)(seconds * 1e9), kernel_ns = us * 1000ULL;
    uint64_t lookahead = kernel_ns * 4 > 2000000ULL ? kernel_ns * 4 : 2000000ULL;
    unsigned long long busy0 = busy ? busy(1) : 0;
    uint64_t submitted = 0;
    long long launches = 0;
    uint64_t t0 = now_ns(CLOCK_MONOTONIC);
    while (rc == CUDA_SUCCESS && now_ns(CLOCK_MONOTONIC) - t0 < duration) {
        uint64_t done = busy ? (uint64_t)(busy(1) - busy0) : now_ns(CLOCK_MONOTONIC) - t0;
        if (submitted > done + lookahead) {
            sleep_ns(200000);
            continue;
        }
        rc = CALL(cuLaunchCooperativeKernelMultiDevice, p, 2, 0);
        launches++;
        submitted += kernel_ns;
    }
    if (ctx1 && CALL(cuCtxPushCurrent_v2, ctx1) == CUDA_SUCCESS) {
        CALL(cuCtxSynchronize);
        if (s1) CALL(cuStreamDestroy_v2, s1);
        CALL(cuCtxPopCurrent_v2, &popped);
    }
    uint64_t wall = now_ns(CLOCK_MONOTONIC) - t0;
    j_begin("multi2");
    j_int("rc", rc);
    j_int("launches", launches);
    j_u64("wall_ns", wall);
    j_busy_share(busy, 1, busy0, wall);
    j_end();
}

static void cmd_sync(int argc, char **argv) {
    uint64_t t0 = now_ns(CLOCK_MONOTONIC);
    CUresult rc = CALL(cuCtxSynchronize);
    j_begin("sync");
    j_int("rc", rc);
    j_u64("ns", now_ns(CLOCK_MONOTONIC) - t0);
    j_end();
}

/*
 * Back-to-back kernels for a wall-clock time. Launches are asynchronous, so the
 * probe keeps only a few kernels' worth of work queued (as a training loop does by
 * syncing now and then): the device never starves, and the final sync is short.
 */
static void cmd_run(int argc, char **argv) {
    double seconds = 0;
    (void)parse_float(argv[0], &seconds);
    unsigned long long us = arg_u64(argv[1]);
    enum launch_kind kind = parse_launch_kind(argc, argv, 2);
    int dev = current_device();
    fake_counter_t busy = fake_counter("fakecuda_busy_ns");
    fake_counter_t counted = fake_counter("fakecuda_launches");
    unsigned long long counted0 = counted ? counted(dev) : 0;
    uint64_t duration = (uint64_t)(seconds * 1e9);
    uint64_t kernel_ns = us * 1000ULL;
    uint64_t lookahead = kernel_ns * 4 > 2000000ULL ? kernel_ns * 4 : 2000000ULL;
    uint64_t nap = lookahead / 8 < 250000ULL ? lookahead / 8 : 250000ULL;
    unsigned long long busy0 = busy ? busy(dev) : 0;
    uint64_t submitted = 0;
    long long launches = 0;
    CUresult rc = CUDA_SUCCESS;
    uint64_t t0 = now_ns(CLOCK_MONOTONIC);
    for (;;) {
        uint64_t elapsed = now_ns(CLOCK_MONOTONIC) - t0;
        if (elapsed >= duration) break;
        uint64_t done = busy ? (uint64_t)(busy(dev) - busy0) : elapsed;
        if (submitted > done + lookahead) {
            sleep_ns(nap);
            continue;
        }
        rc = launch_one(kind, us);
        if (rc != CUDA_SUCCESS) break;
        launches++;
        submitted += kernel_ns;
    }
    CUresult src = CALL(cuCtxSynchronize);
    if (rc == CUDA_SUCCESS) rc = src;
    uint64_t wall = now_ns(CLOCK_MONOTONIC) - t0;
    j_begin("run");
    j_int("rc", rc);
    j_int("launches", launches);
    j_str("via", launch_names[kind]);
    j_u64("wall_ns", wall);
    j_busy_share(busy, dev, busy0, wall);
    j_fake_launches(counted, dev, counted0);
    j_end();
}

/*
 * `run` in T threads at once, all on the context current here (each makes it
 * its own): kernels of US microseconds on the default stream (the per-thread one
 * with --ptds), each thread keeping its own few kernels queued. Prints the
 * launches of all threads, and "share" = kernel time the engine ran / wall time.
 */
typedef struct {
    CUcontext ctx;
    uint64_t duration, kernel_ns, t0;
    fake_counter_t busy;
    int dev;
    unsigned long long busy0;
    long long launches;
    CUresult rc;
} run_thread_t;

static void *run_thread(void *arg) {
    run_thread_t *t = arg;
    uint64_t lookahead = t->kernel_ns * 4 > 2000000ULL ? t->kernel_ns * 4 : 2000000ULL;
    uint64_t nap = lookahead / 8 < 250000ULL ? lookahead / 8 : 250000ULL;
    uint64_t submitted = 0;
    t->rc = CALL(cuCtxSetCurrent, t->ctx);
    while (t->rc == CUDA_SUCCESS) {
        uint64_t elapsed = now_ns(CLOCK_MONOTONIC) - t->t0;
        if (elapsed >= t->duration) break;
        uint64_t done = t->busy ? (uint64_t)(t->busy(t->dev) - t->busy0) : elapsed;
        if (submitted > done + lookahead) {
            sleep_ns(nap);
            continue;
        }
        t->rc = launch_one(L_KERNEL, t->kernel_ns / 1000);
        if (t->rc == CUDA_SUCCESS) t->launches++;
        submitted += t->kernel_ns;
    }
    return NULL;
}

static void cmd_threads(int argc, char **argv) {
    unsigned long long n = arg_u64(argv[0]);
    double seconds = 0;
    (void)parse_float(argv[1], &seconds);
    unsigned long long us = arg_u64(argv[2]);
    if (n < 1) n = 1;
    if (n > 64) n = 64;
    run_thread_t t[64];
    pthread_t th[64];
    CUcontext ctx = NULL;
    CUresult rc = CALL(cuCtxGetCurrent, &ctx);
    fake_counter_t busy = fake_counter("fakecuda_busy_ns");
    int dev = current_device();
    unsigned long long busy0 = busy ? busy(dev) : 0;
    uint64_t t0 = now_ns(CLOCK_MONOTONIC);
    unsigned long long started = 0;
    for (unsigned long long i = 0; rc == CUDA_SUCCESS && i < n; i++, started++) {
        t[i] = (run_thread_t){.ctx = ctx, .duration = (uint64_t)(seconds * 1e9),
                              .kernel_ns = us * 1000ULL, .t0 = t0, .busy = busy, .dev = dev,
                              .busy0 = busy0};
        if (pthread_create(&th[i], NULL, run_thread, &t[i]) != 0) rc = PROBE_ERROR;
    }
    long long launches = 0;
    for (unsigned long long i = 0; i < started; i++) {
        pthread_join(th[i], NULL);
        launches += t[i].launches;
        if (rc == CUDA_SUCCESS) rc = t[i].rc;
    }
    CUresult src = CALL(cuCtxSynchronize);
    if (rc == CUDA_SUCCESS) rc = src;
    uint64_t wall = now_ns(CLOCK_MONOTONIC) - t0;
    j_begin("threads");
    j_int("rc", rc);
    j_int("threads", (long long)started);
    j_int("launches", launches);
    j_u64("wall_ns", wall);
    j_busy_share(busy, dev, busy0, wall);
    j_end();
}

/*
 * N kernels of US microseconds launched (cuLaunchKernel, the _ptsz one with
 * --ptds) into a new stream while it is being captured. Prints "rc" (the first
 * failure up to the last launch), "end_rc" (cuStreamEndCapture: 0 when the
 * capture stayed whole; the fake invalidates it when anything records an event
 * into the stream), "graph_us" (the instantiated graph: on the fake, its length)
 * and "ran": kernels the engine ran meanwhile (none should).
 */
static void cmd_capture(int argc, char **argv) {
    unsigned long long n = arg_u64(argv[0]), us = arg_u64(argv[1]);
    fake_counter_t counted = fake_counter("fakecuda_launches");
    int dev = current_device();
    unsigned long long counted0 = counted ? counted(dev) : 0;
    CUstream s = NULL;
    CUgraph g = NULL;
    CUgraphExec exec = NULL;
    CUresult rc = CALL(cuStreamCreate, &s, 0);
    if (rc == CUDA_SUCCESS) rc = CALL(cuStreamBeginCapture_v2, s, 0 /* global */);
    for (unsigned long long i = 0; rc == CUDA_SUCCESS && i < n; i++)
        rc = CALL(cuLaunchKernel, (CUfunction)(uintptr_t)us, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
    CUresult end = s ? CALL(cuStreamEndCapture, s, &g) : PROBE_ERROR;
    if (end == CUDA_SUCCESS) end = CALL(cuGraphInstantiateWithFlags, &exec, g, 0);
    unsigned long long ran = counted ? counted(dev) - counted0 : 0;
    if (s) CALL(cuStreamDestroy_v2, s);
    j_begin("capture");
    j_int("rc", rc);
    j_int("end_rc", end);
    unsigned long long (*exec_us)(CUgraphExec) =
        (unsigned long long (*)(CUgraphExec))dlsym(RTLD_DEFAULT, "fakecuda_exec_us");
    j_u64("graph_us", exec_us ? exec_us(exec) : (unsigned long long)(uintptr_t)exec);
    j_u64("ran", ran);
    j_end();
}

static void cmd_push(int argc, char **argv) {
    int ordinal;
    CUcontext ctx;
    CUresult rc = retain_primary(argc, argv, &ordinal, &ctx);
    if (rc == CUDA_SUCCESS) rc = CALL(cuCtxPushCurrent_v2, ctx);
    j_ctx("push", rc, ordinal);
}

static void cmd_pop(int argc, char **argv) {
    CUcontext ctx = NULL;
    j_rc("pop", CALL(cuCtxPopCurrent_v2, &ctx));
}

static void cmd_proc(int argc, char **argv) {
    const char *name = argv[0];
    int version = (int)arg_u64(argv[1]);
    cuuint64_t flags = arg_u64(argv[2]);
    bool v1 = argc > 3;
    void *h = libcuda_handle();
    void *fn = NULL;
    CUresult rc;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    j_begin("proc");
    if (v1) {
        void *sym = h ? dlsym(h, "cuGetProcAddress") : NULL;
        get_proc_v1_t gpa;
        memcpy(&gpa, &sym, sizeof gpa);
        rc = gpa ? gpa(name, &fn, version, flags) : PROBE_UNRESOLVED;
        j_int("rc", rc);
        j_null("status");
    } else {
        get_proc_v2_t gpa = get_proc_v2();
        rc = gpa ? gpa(name, &fn, version, flags, &st) : PROBE_UNRESOLVED;
        j_int("rc", rc);
        if (rc == PROBE_UNRESOLVED)
            j_null("status");
        else
            j_int("status", st);
    }
    j_str("name", name);
    j_int("version", version);
    j_u64("flags", flags);
    j_bool("found", fn != NULL);
    j_where(rc == CUDA_SUCCESS ? fn : NULL);
    j_end();
}

static void cmd_dlsym(int argc, char **argv) {
    const char *name = argv[0];
    bool nvml = argc > 1 && !strcmp(argv[1], "nvml");
    bool scope = argc > 1 && !strcmp(argv[1], "default"); /* RTLD_DEFAULT */
    void *h = scope ? RTLD_DEFAULT : nvml ? libnvml_handle() : libcuda_handle();
    void *fn = h || scope ? dlsym(h, name) : NULL;
    j_begin("dlsym");
    j_int("rc", h || scope ? 0 : PROBE_ERROR);
    j_str("name", name);
    j_bool("found", fn != NULL);
    j_where(fn);
    j_end();
}

static void cmd_nvml(int argc, char **argv) {
    j_rc("nvml", nvmlInit_v2());
}

static void cmd_nvmlmem(int argc, char **argv) {
    unsigned idx = (unsigned)arg_u64(argv[0]);
    nvmlDevice_t d = NULL;
    nvmlReturn_t rc = nvmlDeviceGetHandleByIndex_v2(idx, &d);
    nvmlMemory_t m = {0, 0, 0};
    nvmlMemory_v2_t m2;
    memset(&m2, 0, sizeof m2);
    m2.version = nvmlMemory_v2;
    nvmlReturn_t rc1 = rc, rc2 = rc;
    if (rc == NVML_SUCCESS) {
        rc1 = nvmlDeviceGetMemoryInfo(d, &m);
        rc2 = nvmlDeviceGetMemoryInfo_v2(d, &m2);
    }
    j_begin("nvmlmem");
    j_int("rc", rc1 != NVML_SUCCESS ? rc1 : rc2);
    j_int("handle_rc", rc);
    j_int("v1_rc", rc1);
    j_int("v2_rc", rc2);
    j_u64("total", m.total);
    j_u64("free", m.free);
    j_u64("used", m.used);
    j_u64("v2_total", m2.total);
    j_u64("v2_reserved", m2.reserved);
    j_u64("v2_free", m2.free);
    j_u64("v2_used", m2.used);
    j_end();
}

static void cmd_nvmlprocs(int argc, char **argv) {
    unsigned idx = (unsigned)arg_u64(argv[0]);
    nvmlDevice_t d = NULL;
    nvmlReturn_t rc = nvmlDeviceGetHandleByIndex_v2(idx, &d);
    unsigned count = 0;
    nvmlProcessInfo_t *infos = NULL;
    nvmlReturn_t size_rc = rc;
    if (rc == NVML_SUCCESS) {
        /* Ask for the count first, as nvidia-smi does, then read them. */
        size_rc = nvmlDeviceGetComputeRunningProcesses_v3(d, &count, NULL);
        unsigned cap = count + 8;
        infos = calloc(cap, sizeof *infos);
        count = cap;
        rc = infos ? nvmlDeviceGetComputeRunningProcesses_v3(d, &count, infos) : NVML_ERROR_UNKNOWN;
        if (rc != NVML_SUCCESS || count > cap) count = rc == NVML_SUCCESS ? cap : 0;
    }
    j_begin("nvmlprocs");
    j_int("rc", rc);
    j_int("size_rc", size_rc);
    j_key("procs");
    j_raw("[");
    for (unsigned i = 0; i < count; i++)
        j_raw("%s{\"pid\":%u,\"used\":%llu}", i ? "," : "", infos[i].pid, infos[i].usedGpuMemory);
    j_raw("]");
    j_end();
    free(infos);
}

static void cmd_nvmlbyuuid(int argc, char **argv) {
    nvmlDevice_t d = NULL;
    nvmlReturn_t rc = nvmlDeviceGetHandleByUUID(argv[0], &d);
    unsigned index = 0;
    char text[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = "";
    nvmlReturn_t irc = rc, urc = rc;
    if (rc == NVML_SUCCESS) {
        irc = nvmlDeviceGetIndex(d, &index);
        urc = nvmlDeviceGetUUID(d, text, sizeof text);
    }
    j_begin("nvmlbyuuid");
    j_int("rc", rc);
    j_str("uuid", argv[0]);
    if (irc == NVML_SUCCESS)
        j_u64("index", index);
    else
        j_null("index");
    j_str("nvml_uuid", urc == NVML_SUCCESS ? text : NULL);
    j_end();
}

static void cmd_sleep(int argc, char **argv) {
    unsigned long long ms = arg_u64(argv[0]);
    sleep_ns(ms * 1000000ULL);
    j_begin("sleep");
    j_int("rc", 0);
    j_u64("ms", ms);
    j_end();
}

static void cmd_hold(int argc, char **argv) {
    j_begin("hold");
    j_int("rc", 0);
    j_int("pid", getpid());
    j_end();
    for (;;) pause();
}

static void cmd_lock(int argc, char **argv) {
    const char *path = argv[0];
    int rc = 0;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) {
        rc = errno;
    } else {
        struct flock fl;
        memset(&fl, 0, sizeof fl);
        fl.l_type = F_WRLCK;
        fl.l_whence = SEEK_SET;
        fl.l_start = 0;
        fl.l_len = 0;
        while (fcntl(fd, F_OFD_SETLKW, &fl) != 0) {
            if (errno != EINTR) {
                rc = errno;
                close(fd);
                break;
            }
        }
    }
    /* The descriptor stays open: the lock lives until the process dies. */
    j_begin("lock");
    j_int("rc", rc);
    j_str("path", path);
    j_end();
}

/* The main thread leaves and another keeps the process: /proc/<pid>/stat then
 * says "Z" for the whole process and /proc/<pid>/root is gone, while its memory
 * and contexts live on. */
static void *hide_leader_thread(void *arg) {
    (void)arg;
    for (;;) pause();
    return NULL;
}

static void cmd_hideleader(int argc, char **argv) {
    pthread_t th;
    int rc = pthread_create(&th, NULL, hide_leader_thread, NULL);
    j_begin("hideleader");
    j_int("rc", rc);
    j_int("pid", getpid());
    j_end();
    if (rc == 0) pthread_exit(NULL);
}

static void cmd_getppid(int argc, char **argv) {
    pid_t v = getppid();
    void *sym = dlsym(RTLD_DEFAULT, "other_interposer_calls");
    unsigned long (*calls)(void);
    memcpy(&calls, &sym, sizeof calls);
    j_begin("getppid");
    j_int("rc", 0);
    j_int("value", v);
    if (calls)
        j_u64("calls", calls());
    else
        j_null("calls");
    j_end();
}

/* ------------------------------------------------------------------ command table */
/*
 * spec: one letter per argument. S size, N number, I device ordinal, F seconds,
 * W word; lower case = optional, taken only when the next word parses as one
 * (an optional word must be one of `choices`, "a|b|c").
 */
static void cmd_deepalloc(int argc, char **argv) {
    (void)argc;
    char path[4096];
    ssize_t n = readlink("/proc/self/exe", path, sizeof path - 32);
    j_begin("deepalloc");
    if (n <= 0) {
        j_int("rc", -1);
        j_end();
        return;
    }
    path[n] = 0;
    strcpy(strrchr(path, '/') + 1, "deepbind.so");
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    int (*fn)(size_t) = h ? (int (*)(size_t))dlsym(h, "deepbind_alloc") : NULL;
    j_int("rc", fn ? fn(arg_size(argv[0])) : -2);
    j_end();
}

/* ---- memory paths past the plain calls */
CUresult cuMemPoolCreate(CUmemoryPool *pool, const void *props);
CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value);
CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                      int handleType, unsigned long long flags);
CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags);

/* next_lib.so, which the probe links against (tests/next_lib.c). */
int next_alloc(size_t bytes, int use_default);

static void cmd_nextalloc(int argc, char **argv) {
    j_begin("nextalloc");
    j_int("rc", next_alloc(arg_size(argv[0]), argc > 1));
    j_end();
}

static void cmd_pools(int argc, char **argv) {
    unsigned long long count = arg_u64(argv[0]);
    size_t size = arg_size(argv[1]);
    struct {
        int allocType, handleTypes;
        CUmemLocation location;
        void *win32;
        size_t maxSize;
        unsigned short usage;
        unsigned char reserved[54];
    } props;
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = current_device();
    j_begin("pools");
    j_key("rcs");
    j_raw("[");
    for (unsigned long long i = 0; i < count; i++) {
        CUmemoryPool pool = NULL;
        cuuint64_t most = UINT64_MAX;
        CUdeviceptr p = 0;
        CUresult rc = cuMemPoolCreate(&pool, &props);
        if (rc == CUDA_SUCCESS) rc = cuMemPoolSetAttribute(pool, 4 /* RELEASE_THRESHOLD */, &most);
        if (rc == CUDA_SUCCESS) rc = CALL(cuMemAllocFromPoolAsync, &p, size, pool, NULL);
        if (rc == CUDA_SUCCESS) rc = CALL(cuMemFreeAsync, p, NULL);
        j_raw("%s%d", i ? "," : "", rc);
    }
    j_raw("]");
    j_int("rc", 0);
    j_end();
}

static void *legacy_fn(const char *name, const char *how) {
    if (!strcmp(how, "link")) return NULL; /* the caller uses the linked symbol */
    void *h = libcuda_handle();
    if (!h) return NULL;
    if (!strcmp(how, "dlsym")) return dlsym(h, name);
    get_proc_v2_t gpa = get_proc_v2();
    void *fn = NULL;
    CUdriverProcAddressQueryResult st;
    if (!gpa || gpa(name, &fn, 3010, 0, &st) != CUDA_SUCCESS) return NULL;
    return fn;
}

static void cmd_legacy(int argc, char **argv) {
    const char *what = argv[0], *how = argv[1];
    unsigned size = (unsigned)arg_size(argv[2]);
    bool link = !strcmp(how, "link");
    unsigned a = 0, b = 0;
    CUresult rc = PROBE_UNRESOLVED;
    static const char *const names[][2] = {
        {"alloc", "cuMemAlloc"}, {"pitch", "cuMemAllocPitch"}, {"info", "cuMemGetInfo"},
        {"totalmem", "cuDeviceTotalMem"}, {"array", "cuArrayCreate"},
        {"array3d", "cuArray3DCreate"}, {"ctx", "cuCtxCreate"}};
    const char *name = NULL;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(names[i][0], what)) name = names[i][1];
    void *fn = name ? legacy_fn(name, how) : NULL;
    if (!name) {
        rc = PROBE_ERROR;
    } else if (!strcmp(what, "alloc")) {
        __typeof__(cuMemAlloc) *f = link ? cuMemAlloc : (__typeof__(cuMemAlloc) *)fn;
        if (f) rc = f(&a, size);
    } else if (!strcmp(what, "pitch")) {
        __typeof__(cuMemAllocPitch) *f = link ? cuMemAllocPitch : (__typeof__(cuMemAllocPitch) *)fn;
        if (f) rc = f(&a, &b, size, 1, 4);
    } else if (!strcmp(what, "info")) {
        __typeof__(cuMemGetInfo) *f = link ? cuMemGetInfo : (__typeof__(cuMemGetInfo) *)fn;
        if (f) rc = f(&a, &b);
    } else if (!strcmp(what, "totalmem")) {
        __typeof__(cuDeviceTotalMem) *f = link ? cuDeviceTotalMem : (__typeof__(cuDeviceTotalMem) *)fn;
        if (f) rc = f(&a, 0);
    } else if (!strcmp(what, "array") || !strcmp(what, "array3d")) {
        unsigned desc[6] = {size, 1, 1, CU_AD_FORMAT_UNSIGNED_INT8, 1, 0};
        CUarray arr = NULL;
        if (!strcmp(what, "array")) {
            desc[2] = CU_AD_FORMAT_UNSIGNED_INT8; /* Width, Height, Format, NumChannels */
            desc[3] = 1;
        }
        __typeof__(cuArrayCreate) *f = !strcmp(what, "array")
                                           ? (link ? cuArrayCreate : (__typeof__(cuArrayCreate) *)fn)
                                           : (link ? cuArray3DCreate : (__typeof__(cuArray3DCreate) *)fn);
        if (f) rc = f(&arr, desc);
    } else {
        __typeof__(cuCtxCreate) *f = link ? cuCtxCreate : (__typeof__(cuCtxCreate) *)fn;
        CUcontext ctx = NULL;
        if (f) rc = f(&ctx, 0, 0);
    }
    j_begin("legacy");
    j_int("rc", rc);
    j_str("what", what);
    j_str("how", how);
    j_u64("a", a);
    j_u64("b", b);
    j_end();
}

static void cmd_vmmretain(int argc, char **argv) {
    unsigned long long id = arg_u64(argv[0]);
    CUmemGenericAllocationHandle h = 0;
    CUresult rc = PROBE_ERROR;
    size_t bytes = 0;
    if (id < table_len && table[id].kind == K_MAP) {
        bytes = table[id].bytes;
        rc = cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)table[id].handle);
    }
    j_created("vmmretain", rc, K_VMM, h, bytes);
    j_end();
}

static void cmd_vmmshare(int argc, char **argv) {
    unsigned long long id = arg_u64(argv[0]);
    CUmemGenericAllocationHandle h = 0;
    CUresult rc = PROBE_ERROR;
    size_t bytes = 0;
    int fd = -1;
    if (id < table_len && table[id].kind == K_VMM) {
        bytes = table[id].bytes;
        rc = cuMemExportToShareableHandle(&fd, (CUmemGenericAllocationHandle)table[id].handle,
                                          1 /* POSIX file descriptor */, 0);
        if (rc == CUDA_SUCCESS)
            rc = cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd, 1);
        if (fd >= 0) close(fd);
    }
    j_created("vmmshare", rc, K_VMM, h, bytes);
    j_end();
}

/* cuMemAllocAsync into a new stream under capture, with "freed" its cuMemFreeAsync
 * captured too; the graph captured is a new id ("rc": the allocation's). */
static void cmd_capalloc(int argc, char **argv) {
    size_t size = arg_size(argv[0]);
    CUstream s = NULL;
    CUdeviceptr p = 0;
    CUgraph g = NULL;
    CUresult rc = CALL(cuStreamCreate, &s, 0);
    if (rc == CUDA_SUCCESS) rc = CALL(cuStreamBeginCapture_v2, s, 0);
    CUresult alloc = rc == CUDA_SUCCESS ? CALL(cuMemAllocAsync, &p, size, s) : rc;
    CUresult freed = alloc == CUDA_SUCCESS && argc > 1 ? CALL(cuMemFreeAsync, p, s) : PROBE_ERROR;
    CUresult end = s ? CALL(cuStreamEndCapture, s, &g) : PROBE_ERROR;
    if (s) CALL(cuStreamDestroy_v2, s);
    j_begin("capalloc");
    j_int("rc", alloc);
    j_int("free_rc", freed);
    j_int("end_rc", end);
    if (end == CUDA_SUCCESS) j_int("id", table_add(K_GRAPH, (uintptr_t)g, size));
    else j_null("id");
    j_end();
}

/* A new graph (a new id) with an allocation node: cuGraphAddMemAllocNode, or with
 * "node" cuGraphAddNode_v2; "freed" adds a free node of it (cuGraphAddMemFreeNode),
 * "nodefreed" both through cuGraphAddNode_v2. "rc": the allocation node's. */
static void cmd_graphalloc(int argc, char **argv) {
    size_t size = arg_size(argv[0]);
    const char *how = argc > 1 ? argv[1] : "";
    bool by_node = !strcmp(how, "node") || !strcmp(how, "nodefreed");
    bool with_free = !strcmp(how, "freed") || !strcmp(how, "nodefreed");
    CUgraph g = NULL;
    CUgraphNode node = NULL, free_node = NULL;
    struct {
        unsigned char poolProps[88];
        const void *accessDescs;
        size_t accessDescCount;
        size_t bytesize;
        CUdeviceptr dptr;
    } params;
    struct {
        int type;
        int reserved0[3];
        __typeof__(params) alloc;
        long long rest[20];
    } node_params;
    memset(&params, 0, sizeof params);
    params.poolProps[0] = CU_MEM_ALLOCATION_TYPE_PINNED;
    params.poolProps[8] = CU_MEM_LOCATION_TYPE_DEVICE;
    params.poolProps[12] = (unsigned char)current_device();
    params.bytesize = size;
    memset(&node_params, 0, sizeof node_params);
    node_params.type = 10; /* CU_GRAPH_NODE_TYPE_MEM_ALLOC */
    node_params.alloc = params;
    CUresult made = cuGraphCreate(&g, 0), rc = made, freed = PROBE_ERROR;
    if (rc == CUDA_SUCCESS)
        rc = by_node ? cuGraphAddNode_v2(&node, g, NULL, NULL, 0, &node_params)
                     : cuGraphAddMemAllocNode(&node, g, NULL, 0, &params);
    CUdeviceptr p = by_node ? node_params.alloc.dptr : params.dptr;
    if (rc == CUDA_SUCCESS && with_free && by_node) {
        memset(&node_params, 0, sizeof node_params);
        node_params.type = 11; /* CU_GRAPH_NODE_TYPE_MEM_FREE */
        memcpy(&node_params.alloc, &p, sizeof p);
        freed = cuGraphAddNode_v2(&free_node, g, &node, NULL, 1, &node_params);
    } else if (rc == CUDA_SUCCESS && with_free) {
        freed = cuGraphAddMemFreeNode(&free_node, g, &node, 1, p);
    }
    j_begin("graphalloc");
    j_int("rc", rc);
    j_int("free_rc", freed);
    if (made == CUDA_SUCCESS) j_int("id", table_add(K_GRAPH, (uintptr_t)g, size));
    else j_null("id");
    j_end();
}

/* cuGraphInstantiateWithFlags of graph ID: the executable graph is a new id. */
static void cmd_instantiate(int argc, char **argv) {
    unsigned long long id = arg_u64(argv[0]);
    CUgraphExec exec = NULL;
    CUresult rc = PROBE_ERROR;
    if (id < table_len && table[id].kind == K_GRAPH)
        rc = CALL(cuGraphInstantiateWithFlags, &exec, (CUgraph)(uintptr_t)table[id].handle, 0);
    j_created("instantiate", rc, K_EXEC, (uintptr_t)exec, BYTES_UNKNOWN);
    j_end();
}

/* cuGraphLaunch of executable graph ID on the NULL stream, then cuCtxSynchronize. */
static void cmd_graphlaunch(int argc, char **argv) {
    unsigned long long id = arg_u64(argv[0]);
    CUresult rc = PROBE_ERROR;
    if (id < table_len && table[id].kind == K_EXEC)
        rc = CALL(cuGraphLaunch, (CUgraphExec)(uintptr_t)table[id].handle, NULL);
    if (rc == CUDA_SUCCESS) rc = CALL(cuCtxSynchronize);
    j_rc("graphlaunch", rc);
}

static void cmd_setlimit(int argc, char **argv) {
    int limit = (int)arg_u64(argv[0]);
    size_t value = arg_size(argv[1]);
    j_begin("setlimit");
    j_int("rc", cuCtxSetLimit(limit, value));
    j_int("limit", limit);
    j_u64("value", value);
    j_end();
}

typedef struct {
    const char *name;
    const char *spec;
    const char *choices;
    void (*fn)(int argc, char **argv);
} command_t;

static const command_t commands[] = {
    {"init", "", NULL, cmd_init},
    {"ctx", "i", NULL, cmd_ctx},
    {"newctx", "i", NULL, cmd_newctx},
    {"newctx3", "i", NULL, cmd_newctx3},
    {"newctx4", "i", NULL, cmd_newctx4},
    {"destroyctx", "N", NULL, cmd_destroyctx},
    {"release", "i", NULL, cmd_release},
    {"reset", "i", NULL, cmd_reset},
    {"alloc", "S", NULL, cmd_alloc},
    {"pitch", "SNN", NULL, cmd_pitch},
    {"managed", "Sw", "host|global|single", cmd_managed},
    {"array", "NNNN", NULL, cmd_array},
    {"array3d", "NNNNN", NULL, cmd_array3d},
    {"mipmap", "NNNNNN", NULL, cmd_mipmap},
    {"vmm", "Si", NULL, cmd_vmm},
    {"vmmmap", "N", NULL, cmd_vmmmap},
    {"vmmpair", "S", NULL, cmd_vmmpair},
    {"async", "S", NULL, cmd_async},
    {"poolalloc", "S", NULL, cmd_poolalloc},
    {"free", "N", NULL, cmd_free},
    {"freeraw", "N", NULL, cmd_freeraw},
    {"trim", "S", NULL, cmd_trim},
    {"poolattr", "", NULL, cmd_poolattr},
    {"info", "", NULL, cmd_info},
    {"totalmem", "i", NULL, cmd_totalmem},
    {"fakeused", "i", NULL, cmd_fakeused},
    {"fakebusy", "i", NULL, cmd_fakebusy},
    {"uuid", "i", NULL, cmd_uuid},
    {"fill", "S", NULL, cmd_fill},
    {"race", "SNN", NULL, cmd_race},
    {"launch", "NNw", "kernel|ex|coop|graph|legacy|grid|gridasync|multi", cmd_launch},
    {"sync", "", NULL, cmd_sync},
    {"twostreams", "FN", NULL, cmd_twostreams},
    {"multi2", "FN", NULL, cmd_multi2},
    {"exflip", "FN", NULL, cmd_exflip},
    {"lostream", "FNw", "none|destroy|capture", cmd_lostream},
    {"run", "FNw", "kernel|ex|coop|graph|legacy|grid|gridasync|multi", cmd_run},
    {"threads", "NFN", NULL, cmd_threads},
    {"capture", "NN", NULL, cmd_capture},
    {"push", "i", NULL, cmd_push},
    {"pop", "", NULL, cmd_pop},
    {"proc", "WNNw", "v1", cmd_proc},
    {"dlsym", "Ww", "cuda|nvml|default", cmd_dlsym},
    {"nvml", "", NULL, cmd_nvml},
    {"nvmlmem", "N", NULL, cmd_nvmlmem},
    {"nvmlprocs", "N", NULL, cmd_nvmlprocs},
    {"nvmlbyuuid", "W", NULL, cmd_nvmlbyuuid},
    {"sleep", "N", NULL, cmd_sleep},
    {"hold", "", NULL, cmd_hold},
    {"lock", "W", NULL, cmd_lock},
    {"getppid", "", NULL, cmd_getppid},
    {"deepalloc", "S", NULL, cmd_deepalloc},
    {"nextalloc", "Sw", "default", cmd_nextalloc},
    {"pools", "NS", NULL, cmd_pools},
    {"legacy", "WWS", NULL, cmd_legacy},
    {"vmmretain", "N", NULL, cmd_vmmretain},
    {"vmmshare", "N", NULL, cmd_vmmshare},
    {"capalloc", "Sw", "freed", cmd_capalloc},
    {"graphalloc", "Sw", "node|freed|nodefreed", cmd_graphalloc},
    {"instantiate", "N", NULL, cmd_instantiate},
    {"graphlaunch", "N", NULL, cmd_graphlaunch},
    {"setlimit", "NS", NULL, cmd_setlimit},
    {"hideleader", "", NULL, cmd_hideleader},
    /* run by main: they decide which commands run next */
    {"fork", "", NULL, NULL},
    {"forkwait", "", NULL, NULL},
    {"exec", "", NULL, NULL},
};

static bool in_choices(const char *word, const char *choices) {
    size_t n = strlen(word);
    for (const char *p = choices; p && *p;) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && !strncmp(p, word, n)) return true;
        p = bar ? bar + 1 : NULL;
    }
    return false;
}

static bool arg_fits(char type, const char *word, const char *choices) {
    unsigned long long u;
    int i;
    double f;
    switch (type) {
    case 'S': case 's': return parse_size(word, &u);
    case 'N': case 'n': return parse_u64(word, &u);
    case 'I': case 'i': return parse_int(word, &i);
    case 'F': case 'f': return parse_float(word, &f);
    case 'W': return *word != '\0';
    case 'w': return choices && in_choices(word, choices);
    }
    return false;
}

static const command_t *find_command(const char *name) {
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(commands[i].name, name)) return &commands[i];
    return NULL;
}

/* How many words after argv[at] belong to the command there; exits 2 when malformed. */
static int take_args(const command_t *c, int argc, char **argv, int at) {
    int n = 0;
    for (const char *t = c->spec; *t; t++) {
        int i = at + 1 + n;
        bool optional = *t >= 'a' && *t <= 'z';
        if (i >= argc || !arg_fits(*t, argv[i], c->choices)) {
            if (optional) break;
            if (i >= argc)
                j_fail_args("%s: missing argument %d (spec %s)", c->name, n + 1, c->spec);
            j_fail_args("%s: bad argument %d: '%s' (spec %s)", c->name, n + 1, argv[i], c->spec);
        }
        n++;
    }
    return n;
}

/* ------------------------------------------------------------------ fork */
/* Where the command after the `forkwait` that closes the `fork` at argv[at] begins
 * (argc when none does). */
static int after_forkwait(int argc, char **argv, int at) {
    int depth = 0;
    for (int i = at + 1; i < argc;) {
        const command_t *c = find_command(argv[i]);
        int n = take_args(c, argc, argv, i);
        if (!strcmp(c->name, "fork")) depth++;
        else if (!strcmp(c->name, "forkwait") && depth-- == 0) return i + 1;
        i += 1 + n;
    }
    return argc;
}

/* The `fork` at argv[at]; returns where this process goes on. */
static int run_fork(int argc, char **argv, int at) {
    pid_t pid = fork();
    if (pid == 0) {
        fork_depth++;
        return at + 1;
    }
    int err = pid < 0 ? errno : 0;
    j_begin("fork");
    j_int("rc", err);
    if (pid > 0)
        j_int("pid", pid);
    else
        j_null("pid");
    j_end();
    if (pid > 0) {
        int status = 0;
        pid_t got;
        while ((got = waitpid(pid, &status, 0)) < 0 && errno == EINTR) {
        }
        j_begin("forkwait");
        j_int("rc", got < 0 ? errno : 0);
        if (got < 0)
            j_null("status");
        else
            j_int("status", WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
        j_end();
    }
    return after_forkwait(argc, argv, at);
}

/* exec: the same program, same options, with the commands after `exec`; the
 * process (its PID) goes on as a new image. */
static void run_exec(int argc, char **argv, int first, int rest) {
    char **args = calloc((size_t)argc + 1, sizeof *args);
    int n = 0;
    args[n++] = argv[0];
    for (int i = 1; i < first; i++) args[n++] = argv[i];
    for (int i = rest; i < argc; i++) args[n++] = argv[i];
    args[n] = NULL;
    j_begin("exec");
    j_int("rc", 0);
    j_int("pid", (int)getpid());
    j_end();
    execv("/proc/self/exe", args);
    j_begin("exec");
    j_int("rc", errno);
    j_end();
    exit(1);
}

int main(int argc, char **argv) {
    signal(SIGPIPE, SIG_IGN);
    int first = 1;
    for (; first < argc && !strncmp(argv[first], "--", 2); first++) {
        if (!strcmp(argv[first], "--proc")) {
            opt_proc = true;
        } else if (!strcmp(argv[first], "--ptds")) {
            opt_proc = opt_ptds = true;
        } else if (!strcmp(argv[first], "--dlmopen")) {
            opt_proc = opt_dlmopen = true;
        } else {
            j_fail_args("unknown option '%s'", argv[first]);
        }
    }
    /* Check the whole line before running anything. */
    int open_forks = 0;
    for (int i = first; i < argc;) {
        const command_t *c = find_command(argv[i]);
        if (!c) j_fail_args("unknown command '%s'", argv[i]);
        if (!strcmp(c->name, "fork")) open_forks++;
        if (!strcmp(c->name, "forkwait") && open_forks-- == 0)
            j_fail_args("forkwait without a fork before it");
        i += 1 + take_args(c, argc, argv, i);
    }
    api_setup();
    for (int i = first; i < argc;) {
        const command_t *c = find_command(argv[i]);
        int n = take_args(c, argc, argv, i);
        if (!strcmp(c->name, "fork")) {
            i = run_fork(argc, argv, i);
            continue;
        }
        if (!strcmp(c->name, "forkwait")) exit(0); /* a child at the end of its part */
        if (!strcmp(c->name, "exec")) run_exec(argc, argv, first, i + 1);
        c->fn(n, argv + i + 1);
        i += 1 + n;
    }
    return 0;
}
