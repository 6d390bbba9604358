/*
 * gpuslice GPU kit: the driver-API programs run_kit.py starts, with and without
 * libgpuslice.so preloaded. One binary, one subcommand per measurement:
 *
 *   kit env                                   the GPU, driver and CUDA versions
 *   kit alloc --path P --limit B [--chunk B]  allocate through path P until refused
 *   kit lookup --limit B                      cuGetProcAddress_v2 / dlsym resolve to the interposer
 *   kit nvml --limit B --hold B [--wait]      NVML memory numbers while B bytes are held
 *   kit calibrate [--target-ms 2]             loop count for a ~2 ms fixed-work kernel
 *   kit compute --iters N [--seconds 4]       kernels per second of that kernel
 *               [--hold B]                    ... while holding B bytes (cuMemAlloc_v2)
 *   kit region --region PATH                  the region file's counters and processes
 *                                             (no CUDA: a reader beside the workload)
 *   kit launch [--count 200000]               ns per launch of an empty kernel
 *   kit allocpair [--count 20000]             ns per cuMemAlloc_v2 + cuMemFree_v2 pair
 *
 * Common options: --device N (CUDA ordinal, 0), --lib PATH (the interposer: where
 * resolved functions are expected to live), --region PATH (the region file to
 * read the interposer's counters from).
 *
 * Every subcommand prints one JSON object per line; the last is
 * {"event":"result","cmd":...}. A failing driver call ends the program with exit
 * status 3 and that result carrying "fatal": {"call","code","name"}.
 *
 * Kernels are hand-written PTX, JIT-compiled by the driver (cuModuleLoadDataEx),
 * so nothing but a C compiler, cuda.h and libcuda.so.1 is needed.
 */
#include <cuda.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kit_nvml.h"
#include "region_layout.h"

#define MiB (1024ULL * 1024ULL)

/* ------------------------------------------------------------------ kernels */
#include "kit_ptx.h"

/* ------------------------------------------------------------------ JSON writer */
#define JW_DEPTH 32
typedef struct {
    char buf[1 << 17];
    size_t len;
    int depth;
    char close[JW_DEPTH];
    int first[JW_DEPTH];
} jw_t;

static jw_t R; /* the result line, filled while the subcommand runs */
static jw_t E; /* other event lines */

static void jraw(jw_t *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void jraw(jw_t *w, const char *fmt, ...) {
    if (w->len >= sizeof w->buf - 1) return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(w->buf + w->len, sizeof w->buf - w->len, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    w->len += (size_t)n;
    if (w->len >= sizeof w->buf) w->len = sizeof w->buf - 1;
}

static void jlit(jw_t *w, const char *s) {
    jraw(w, "\"");
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            jraw(w, "\\%c", *p);
        else if (*p == '\n')
            jraw(w, "\\n");
        else if (*p < 0x20 || *p >= 0x7f)
            jraw(w, "\\u%04x", *p);
        else
            jraw(w, "%c", *p);
    }
    jraw(w, "\"");
}

static void jkey(jw_t *w, const char *key) {
    if (w->depth > 0) {
        if (!w->first[w->depth]) jraw(w, ",");
        w->first[w->depth] = 0;
    }
    if (key) {
        jlit(w, key);
        jraw(w, ":");
    }
}

static void jopen(jw_t *w, const char *key, char open, char close) {
    jkey(w, key);
    jraw(w, "%c", open);
    if (w->depth < JW_DEPTH - 1) w->depth++;
    w->close[w->depth] = close;
    w->first[w->depth] = 1;
}
static void jobj(jw_t *w, const char *key) { jopen(w, key, '{', '}'); }
static void jarr(jw_t *w, const char *key) { jopen(w, key, '[', ']'); }
static void jend(jw_t *w) {
    if (w->depth <= 0) return;
    jraw(w, "%c", w->close[w->depth]);
    w->depth--;
}
static void jstr(jw_t *w, const char *key, const char *v) {
    jkey(w, key);
    if (v)
        jlit(w, v);
    else
        jraw(w, "null");
}
static void ju64(jw_t *w, const char *key, unsigned long long v) {
    jkey(w, key);
    jraw(w, "%llu", v);
}
static void ji64(jw_t *w, const char *key, long long v) {
    jkey(w, key);
    jraw(w, "%lld", v);
}
static void jdbl(jw_t *w, const char *key, double v) {
    jkey(w, key);
    if (isfinite(v))
        jraw(w, "%.9g", v);
    else
        jraw(w, "null");
}
/* seconds since the epoch: fixed point, %g would drop the fraction */
static void jepoch(jw_t *w, const char *key, double v) {
    jkey(w, key);
    jraw(w, "%.6f", v);
}
static void jbool(jw_t *w, const char *key, int v) {
    jkey(w, key);
    jraw(w, v ? "true" : "false");
}
static void jnull(jw_t *w, const char *key) {
    jkey(w, key);
    jraw(w, "null");
}
static void jbegin(jw_t *w, const char *event) {
    w->len = 0;
    w->depth = 0;
    w->buf[0] = '\0';
    jobj(w, NULL);
    jstr(w, "event", event);
}
static void jemit(jw_t *w) {
    while (w->depth > 0) jend(w);
    fputs(w->buf, stdout);
    fputc('\n', stdout);
    fflush(stdout);
}

/* ------------------------------------------------------------------ arguments */
static int g_argc;
static char **g_argv;

static const char *arg_str(const char *name, const char *def) {
    for (int i = 0; i < g_argc; i++) {
        const char *a = g_argv[i];
        if (a[0] == '-' && a[1] == '-' && strcmp(a + 2, name) == 0)
            return (i + 1 < g_argc) ? g_argv[i + 1] : "";
    }
    return def;
}
static int arg_flag(const char *name) {
    for (int i = 0; i < g_argc; i++)
        if (g_argv[i][0] == '-' && g_argv[i][1] == '-' && strcmp(g_argv[i] + 2, name) == 0)
            return 1;
    return 0;
}
/* "4g", "300m", "4096", "1.5g" */
static int parse_size(const char *s, unsigned long long *out) {
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || v < 0) return 0;
    double mul = 1;
    switch (*end) {
    case 'k': case 'K': mul = 1024.0; end++; break;
    case 'm': case 'M': mul = 1024.0 * 1024.0; end++; break;
    case 'g': case 'G': mul = 1024.0 * 1024.0 * 1024.0; end++; break;
    case 't': case 'T': mul = 1024.0 * 1024.0 * 1024.0 * 1024.0; end++; break;
    default: break;
    }
    if (*end == 'i' || *end == 'I') end++;
    if (*end == 'b' || *end == 'B') end++;
    if (*end) return 0;
    *out = (unsigned long long)(v * mul + 0.5);
    return 1;
}
static unsigned long long arg_size(const char *name, unsigned long long def) {
    const char *s = arg_str(name, NULL);
    unsigned long long v;
    if (!s) return def;
    if (!parse_size(s, &v)) {
        fprintf(stderr, "kit: --%s: not a size: %s\n", name, s);
        exit(2);
    }
    return v;
}
static double arg_f64(const char *name, double def) {
    const char *s = arg_str(name, NULL);
    if (!s) return def;
    char *end = NULL;
    double v = strtod(s, &end);
    if (end == s || *end) {
        fprintf(stderr, "kit: --%s: not a number: %s\n", name, s);
        exit(2);
    }
    return v;
}

/* ------------------------------------------------------------------ time */
static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
static double epoch_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
static void sleep_s(double s) {
    if (s <= 0) return;
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}
static int cmp_dbl(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
static double median(double *v, int n) {
    if (n <= 0) return NAN;
    qsort(v, (size_t)n, sizeof *v, cmp_dbl);
    return (n % 2) ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ------------------------------------------------------------------ CUDA helpers */
static const char *cu_name(CUresult rc, char *tmp, size_t n) {
    const char *s = NULL;
    if (cuGetErrorName(rc, &s) == CUDA_SUCCESS && s) return s;
    snprintf(tmp, n, "CUDA_ERROR_%d", (int)rc);
    return tmp;
}
static void jcu(jw_t *w, const char *key, CUresult rc) {
    char tmp[32];
    jobj(w, key);
    ji64(w, "code", (long long)rc);
    jstr(w, "name", cu_name(rc, tmp, sizeof tmp));
    jend(w);
}

static void fatal_cu(const char *call, CUresult rc) __attribute__((noreturn));
static void fatal_cu(const char *call, CUresult rc) {
    char tmp[32];
    while (R.depth > 1) jend(&R);
    jobj(&R, "fatal");
    jstr(&R, "call", call);
    ji64(&R, "code", (long long)rc);
    jstr(&R, "name", cu_name(rc, tmp, sizeof tmp));
    jend(&R);
    jemit(&R);
    exit(3);
}
static void fatal_msg(const char *what) __attribute__((noreturn));
static void fatal_msg(const char *what) {
    while (R.depth > 1) jend(&R);
    jobj(&R, "fatal");
    jstr(&R, "call", what);
    jend(&R);
    jemit(&R);
    exit(3);
}

#define CK(call)                                                                              \
    do {                                                                                      \
        CUresult ck_rc_ = (call);                                                             \
        if (ck_rc_ != CUDA_SUCCESS) fatal_cu(#call, ck_rc_);                                  \
    } while (0)

static CUdevice g_dev;
static CUcontext g_ctx;
static int g_ordinal;
static char g_lib_real[PATH_MAX]; /* realpath of --lib, "" when not given */

static void setup_ctx(void) {
    CK(cuInit(0));
    CK(cuDeviceGet(&g_dev, g_ordinal));
    CK(cuDevicePrimaryCtxRetain(&g_ctx, g_dev));
    CK(cuCtxSetCurrent(g_ctx));
}

static int dev_attr(CUdevice_attribute a) {
    int v = -1;
    if (cuDeviceGetAttribute(&v, a, g_dev) != CUDA_SUCCESS) v = -1;
    return v;
}

/* Where a function pointer lives: file, symbol, and whether that file is --lib. */
static int in_lib(const void *fn, Dl_info *di) {
    char rp[PATH_MAX];
    memset(di, 0, sizeof *di);
    if (!fn || !dladdr(fn, di) || !di->dli_fname) return 0;
    if (!g_lib_real[0]) return 0;
    if (!realpath(di->dli_fname, rp)) return 0;
    return strcmp(rp, g_lib_real) == 0;
}
static int jwhere(jw_t *w, const char *key, const void *fn) {
    Dl_info di;
    int inside = in_lib(fn, &di);
    jobj(w, key);
    jbool(w, "found", fn != NULL);
    jstr(w, "file", fn ? di.dli_fname : NULL);
    jstr(w, "symbol", fn ? di.dli_sname : NULL);
    jbool(w, "in_lib", inside);
    jend(w);
    return inside;
}

/* Is cuMemAlloc_v2, as this program resolved it, the interposer's? */
static void jinterposed(jw_t *w) {
    void *fn = (void *)&cuMemAlloc_v2;
    Dl_info di;
    jbool(w, "interposed", in_lib(fn, &di));
    jstr(w, "cuMemAlloc_v2_from", di.dli_fname);
}

static void jmeminfo(jw_t *w, const char *key) {
    size_t fr = 0, tot = 0;
    CUresult rc = cuMemGetInfo_v2(&fr, &tot);
    jobj(w, key);
    if (rc == CUDA_SUCCESS) {
        ju64(w, "free", fr);
        ju64(w, "total", tot);
    } else {
        jcu(w, "error", rc);
    }
    jend(w);
}

/* The interposer's counters for this device, read straight from the region file. */
static void jregion(jw_t *w, const char *key) {
    const char *path = arg_str("region", NULL);
    if (!path || !*path) return;
    jobj(w, key);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0) {
        jstr(w, "error", strerror(errno));
        jend(w);
        return;
    }
    if (fstat(fd, &st) != 0 || (size_t)st.st_size < sizeof(gs_region_t)) {
        jstr(w, "error", "file smaller than gs_region_t");
        ju64(w, "file_size", (unsigned long long)st.st_size);
        close(fd);
        jend(w);
        return;
    }
    void *map = mmap(NULL, sizeof(gs_region_t), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED) {
        jstr(w, "error", strerror(errno));
        jend(w);
        return;
    }
    const gs_region_t *r = map;
    uint32_t magic = __atomic_load_n(&r->magic, __ATOMIC_ACQUIRE);
    ju64(w, "magic", magic);
    ju64(w, "version", r->version);
    if (magic != GS_REGION_MAGIC || r->version != GS_REGION_VERSION) {
        jstr(w, "error", "magic or version differs from region_layout.h");
    } else if (g_ordinal >= 0 && g_ordinal < GS_MAX_DEVICES) {
        const gs_device_t *d = &r->devices[g_ordinal];
        jstr(w, "uuid", d->uuid[GS_UUID_LEN - 1] ? "(unterminated)" : d->uuid);
        ju64(w, "limit", __atomic_load_n(&d->limit, __ATOMIC_RELAXED));
        ju64(w, "used", __atomic_load_n(&d->used, __ATOMIC_RELAXED));
        ju64(w, "peak", __atomic_load_n(&d->peak, __ATOMIC_RELAXED));
        ju64(w, "denied", __atomic_load_n(&d->denied, __ATOMIC_RELAXED));
        ju64(w, "sm_limit", __atomic_load_n(&d->sm_limit, __ATOMIC_RELAXED));
        ju64(w, "throttled_ns", __atomic_load_n(&d->throttled_ns, __ATOMIC_RELAXED));
        ju64(w, "busy_ns", __atomic_load_n(&d->busy_ns, __ATOMIC_RELAXED));
        uint32_t high = __atomic_load_n(&r->proc_high, __ATOMIC_RELAXED);
        unsigned live = 0;
        for (uint32_t i = 0; i < high && i < GS_MAX_PROCS; i++)
            if (__atomic_load_n(&r->procs[i].pid, __ATOMIC_RELAXED) != 0) live++;
        ju64(w, "procs", live);
        jarr(w, "proc_list");
        for (uint32_t i = 0; i < high && i < GS_MAX_PROCS; i++) {
            const gs_proc_t *p = &r->procs[i];
            int32_t pid = __atomic_load_n(&p->pid, __ATOMIC_RELAXED);
            if (pid == 0) continue;
            jobj(w, NULL);
            ji64(w, "pid", pid);
            ju64(w, "priority", __atomic_load_n(&p->priority, __ATOMIC_RELAXED));
            ju64(w, "used", __atomic_load_n(&p->used[g_ordinal], __ATOMIC_RELAXED));
            jend(w);
        }
        jend(w);
    }
    munmap(map, sizeof(gs_region_t));
    jend(w);
}

static CUmodule load_kernels(void) {
    static char log[8192];
    CUjit_option opts[2] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
    void *vals[2] = {log, (void *)(uintptr_t)sizeof log};
    CUmodule m = NULL;
    CUresult rc = cuModuleLoadDataEx(&m, KIT_PTX, 2, opts, vals);
    if (rc != CUDA_SUCCESS) {
        jstr(&R, "jit_log", log);
        fatal_cu("cuModuleLoadDataEx", rc);
    }
    return m;
}

/* ------------------------------------------------------------------ env */
static void nvml_env(jw_t *w);
static void context_cost(jw_t *w);

static int cmd_env(void) {
    int drv = 0, count = 0;
    char name[256] = "";
    size_t total = 0;
    CUuuid uuid;
    CK(cuInit(0));
    CK(cuDriverGetVersion(&drv));
    CK(cuDeviceGetCount(&count));
    CK(cuDeviceGet(&g_dev, g_ordinal));
    CK(cuDeviceGetName(name, sizeof name, g_dev));
    CK(cuDeviceTotalMem_v2(&total, g_dev));
    ji64(&R, "cuda_driver_version", drv);
    {
        char v[32];
        snprintf(v, sizeof v, "%d.%d", drv / 1000, (drv % 1000) / 10);
        jstr(&R, "cuda_driver_version_str", v);
    }
    ji64(&R, "device_count", count);
    ji64(&R, "device", g_ordinal);
    jstr(&R, "name", name);
    ju64(&R, "total_mem", total);
    ji64(&R, "sm_count", dev_attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT));
    ji64(&R, "cc_major", dev_attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR));
    ji64(&R, "cc_minor", dev_attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR));
    ji64(&R, "l2_bytes", dev_attr(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE));
    ji64(&R, "max_threads_per_sm", dev_attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR));
    ji64(&R, "managed_memory", dev_attr(CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY));
    ji64(&R, "memory_pools", dev_attr(CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED));
    ji64(&R, "vmm", dev_attr(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED));
    if (cuDeviceGetUuid_v2(&uuid, g_dev) == CUDA_SUCCESS) {
        const unsigned char *b = (const unsigned char *)uuid.bytes;
        char s[64];
        snprintf(s, sizeof s,
                 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                 b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                 b[14], b[15]);
        jstr(&R, "uuid", s);
    }
    {
        char bus[64] = "";
        if (cuDeviceGetPCIBusId(bus, sizeof bus, g_dev) == CUDA_SUCCESS)
            jstr(&R, "pci_bus_id", bus);
    }
    nvml_env(&R);
    context_cost(&R);
    return 0;
}

/* ------------------------------------------------------------------ NVML */
typedef struct {
    void *h;
    kit_nvmlInit_v2_fn init;
    kit_nvmlShutdown_fn shutdown;
    kit_nvmlErrorString_fn err;
    kit_nvmlDeviceGetHandleByIndex_v2_fn by_index;
    kit_nvmlDeviceGetHandleByUUID_fn by_uuid;
    kit_nvmlDeviceGetMemoryInfo_fn mem;
    kit_nvmlDeviceGetMemoryInfo_v2_fn mem2;
    kit_nvmlSystemGetDriverVersion_fn drv;
    kit_nvmlSystemGetCudaDriverVersion_v2_fn cudadrv;
    kit_nvmlDeviceGetName_fn name;
} nvml_t;

/* dlsym goes through the interposer's dlsym when it is preloaded: that is the
 * path applications like nvidia-smi and pynvml take. */
static int nvml_open(nvml_t *n, jw_t *w) {
    memset(n, 0, sizeof *n);
    n->h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!n->h) {
        const char *e = dlerror();
        jstr(w, "nvml_error", e ? e : "dlopen libnvidia-ml.so.1 failed");
        return 0;
    }
#define NSYM(field, name) *(void **)(&n->field) = dlsym(n->h, name)
    NSYM(init, "nvmlInit_v2");
    NSYM(shutdown, "nvmlShutdown");
    NSYM(err, "nvmlErrorString");
    NSYM(by_index, "nvmlDeviceGetHandleByIndex_v2");
    NSYM(by_uuid, "nvmlDeviceGetHandleByUUID");
    NSYM(mem, "nvmlDeviceGetMemoryInfo");
    NSYM(mem2, "nvmlDeviceGetMemoryInfo_v2");
    NSYM(drv, "nvmlSystemGetDriverVersion");
    NSYM(cudadrv, "nvmlSystemGetCudaDriverVersion_v2");
    NSYM(name, "nvmlDeviceGetName");
#undef NSYM
    if (!n->init || n->init() != KIT_NVML_SUCCESS) {
        jstr(w, "nvml_error", "nvmlInit_v2 failed");
        return 0;
    }
    return 1;
}

static kit_nvmlDevice_t nvml_device(nvml_t *n, jw_t *w) {
    kit_nvmlDevice_t d = NULL;
    CUuuid uuid;
    /* CUDA ordinals and NVML indices may differ: match by UUID. */
    if (n->by_uuid && cuDeviceGetUuid_v2(&uuid, g_dev) == CUDA_SUCCESS) {
        const unsigned char *b = (const unsigned char *)uuid.bytes;
        char s[64];
        snprintf(s, sizeof s,
                 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                 b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                 b[14], b[15]);
        if (n->by_uuid(s, &d) == KIT_NVML_SUCCESS) return d;
    }
    if (n->by_index && n->by_index((unsigned)g_ordinal, &d) == KIT_NVML_SUCCESS) return d;
    jstr(w, "nvml_error", "no NVML handle for the device");
    return NULL;
}

static void nvml_env(jw_t *w) {
    nvml_t n;
    if (!nvml_open(&n, w)) return;
    char buf[128] = "";
    if (n.drv && n.drv(buf, sizeof buf) == KIT_NVML_SUCCESS) jstr(w, "driver_version", buf);
    int cv = 0;
    if (n.cudadrv && n.cudadrv(&cv) == KIT_NVML_SUCCESS) ji64(w, "nvml_cuda_driver_version", cv);
    kit_nvmlDevice_t d = nvml_device(&n, w);
    if (d && n.name && n.name(d, buf, sizeof buf) == KIT_NVML_SUCCESS) jstr(w, "nvml_name", buf);
    kit_nvmlMemory_t m;
    if (d && n.mem && n.mem(d, &m) == KIT_NVML_SUCCESS) {
        ju64(w, "nvml_total", m.total);
        ju64(w, "nvml_used", m.used);
    }
    if (n.shutdown) n.shutdown();
}

/* Device memory one primary context takes (what GPUSLICE_CONTEXT_OVERHEAD should
 * say): NVML's used memory before the context and after its first allocation
 * (freed again), on an otherwise idle GPU. */
static void context_cost(jw_t *w) {
    nvml_t n;
    if (!nvml_open(&n, w)) return;
    kit_nvmlDevice_t d = nvml_device(&n, w);
    kit_nvmlMemory_t before, after;
    CUcontext ctx;
    CUdeviceptr p;
    if (d && n.mem && n.mem(d, &before) == KIT_NVML_SUCCESS &&
        cuDevicePrimaryCtxRetain(&ctx, g_dev) == CUDA_SUCCESS) {
        if (cuCtxSetCurrent(ctx) == CUDA_SUCCESS && cuMemAlloc_v2(&p, 1 << 20) == CUDA_SUCCESS) {
            cuMemFree_v2(p);
            if (n.mem(d, &after) == KIT_NVML_SUCCESS && after.used >= before.used)
                ju64(w, "context_bytes", after.used - before.used);
        }
        cuDevicePrimaryCtxRelease_v2(g_dev);
    }
    if (n.shutdown) n.shutdown();
}

static void nvml_mem(nvml_t *n, kit_nvmlDevice_t d, jw_t *w, const char *key) {
    jobj(w, key);
    kit_nvmlMemory_t m;
    memset(&m, 0, sizeof m);
    if (!n->mem) {
        jstr(w, "v1_error", "symbol missing");
    } else {
        kit_nvmlReturn_t rc = n->mem(d, &m);
        if (rc == KIT_NVML_SUCCESS) {
            jobj(w, "v1");
            ju64(w, "total", m.total);
            ju64(w, "free", m.free);
            ju64(w, "used", m.used);
            jend(w);
        } else {
            ji64(w, "v1_error", rc);
        }
    }
    if (!n->mem2) {
        jstr(w, "v2_error", "symbol missing");
    } else {
        kit_nvmlMemory_v2_t m2;
        memset(&m2, 0, sizeof m2);
        m2.version = KIT_NVML_MEMORY_V2_VERSION;
        kit_nvmlReturn_t rc = n->mem2(d, &m2);
        if (rc == KIT_NVML_SUCCESS) {
            jobj(w, "v2");
            ju64(w, "total", m2.total);
            ju64(w, "reserved", m2.reserved);
            ju64(w, "free", m2.free);
            ju64(w, "used", m2.used);
            jend(w);
        } else {
            ji64(w, "v2_error", rc);
        }
    }
    jend(w);
}

static int cmd_nvml(void) {
    unsigned long long hold = arg_size("hold", 1024 * MiB);
    CUdeviceptr p = 0;
    nvml_t n;
    setup_ctx();
    jinterposed(&R);
    ju64(&R, "hold", hold);
    CK(cuMemAlloc_v2(&p, hold));
    jmeminfo(&R, "cuda_meminfo_holding");
    if (!nvml_open(&n, &R)) fatal_msg("nvml unavailable");
    jobj(&R, "nvml_functions");
    jwhere(&R, "nvmlDeviceGetMemoryInfo", (void *)n.mem);
    jwhere(&R, "nvmlDeviceGetMemoryInfo_v2", (void *)n.mem2);
    jend(&R);
    kit_nvmlDevice_t d = nvml_device(&n, &R);
    if (!d) fatal_msg("nvml device");
    nvml_mem(&n, d, &R, "holding");
    jregion(&R, "region_holding");
    if (arg_flag("wait")) {
        /* The runner queries nvidia-smi now, then closes our stdin. */
        jbegin(&E, "holding");
        ju64(&E, "hold", hold);
        jemit(&E);
        while (fgetc(stdin) != EOF) {
        }
    }
    CK(cuMemFree_v2(p));
    nvml_mem(&n, d, &R, "released");
    jmeminfo(&R, "cuda_meminfo_released");
    if (n.shutdown) n.shutdown();
    return 0;
}

/* ------------------------------------------------------------------ lookup */
typedef CUresult (*getproc_v1_t)(const char *, void **, int, cuuint64_t);
typedef CUresult (*memalloc_t)(CUdeviceptr *, size_t);
typedef CUresult (*memfree_t)(CUdeviceptr);
typedef CUresult (*meminfo_t)(size_t *, size_t *);

static void lookup_one(const char *label, const char *sym, int ver, cuuint64_t flags,
                       int expect_hooked, void **out) {
    void *fn = NULL;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult rc = cuGetProcAddress_v2(sym, &fn, ver, flags, &st);
    jobj(&R, NULL);
    jstr(&R, "label", label);
    jstr(&R, "symbol", sym);
    ji64(&R, "version", ver);
    ju64(&R, "flags", flags);
    jbool(&R, "expect_in_lib", expect_hooked);
    jcu(&R, "result", rc);
    ji64(&R, "status", (long long)st);
    jwhere(&R, "where", fn);
    jend(&R);
    if (out) *out = (rc == CUDA_SUCCESS) ? fn : NULL;
}

static int cmd_lookup(void) {
    unsigned long long limit = arg_size("limit", 0);
    void *alloc_fn = NULL, *info_fn = NULL, *free_fn = NULL;
    setup_ctx();
    jinterposed(&R);
    ju64(&R, "limit", limit);
    jarr(&R, "proc_address");
    lookup_one("cuMemAlloc@12000", "cuMemAlloc", 12000, CU_GET_PROC_ADDRESS_DEFAULT, 1, &alloc_fn);
    lookup_one("cuLaunchKernel@12000 per-thread", "cuLaunchKernel", 12000,
               CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, 1, NULL);
    lookup_one("cuLaunchKernel@12000", "cuLaunchKernel", 12000, CU_GET_PROC_ADDRESS_DEFAULT, 1,
               NULL);
    lookup_one("cuMemGetInfo@12000", "cuMemGetInfo", 12000, CU_GET_PROC_ADDRESS_DEFAULT, 1,
               &info_fn);
    lookup_one("cuMemFree@12000", "cuMemFree", 12000, CU_GET_PROC_ADDRESS_DEFAULT, 1, &free_fn);
    lookup_one("cuMemAllocAsync@12000 per-thread", "cuMemAllocAsync", 12000,
               CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, 1, NULL);
    lookup_one("cuMemCreate@12000", "cuMemCreate", 12000, CU_GET_PROC_ADDRESS_DEFAULT, 1, NULL);
    lookup_one("cuDeviceTotalMem@12000", "cuDeviceTotalMem", 12000, CU_GET_PROC_ADDRESS_DEFAULT,
               1, NULL);
    lookup_one("cuGraphLaunch@12000 per-thread", "cuGraphLaunch", 12000,
               CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, 1, NULL);
    lookup_one("cuGetProcAddress@12000", "cuGetProcAddress", 12000, CU_GET_PROC_ADDRESS_DEFAULT,
               1, NULL);
    lookup_one("cuMemAlloc@11020", "cuMemAlloc", 11020, CU_GET_PROC_ADDRESS_DEFAULT, 1, NULL);
    lookup_one("cuMemcpyHtoD@12000 (not hooked)", "cuMemcpyHtoD", 12000,
               CU_GET_PROC_ADDRESS_DEFAULT, 0, NULL);
    jend(&R);

    /* dlsym on the driver's own handle, as the runtime and frameworks do. */
    jobj(&R, "dlsym");
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!h) h = dlopen("libcuda.so.1", RTLD_NOW);
    jbool(&R, "dlopen_ok", h != NULL);
    if (h) {
        jwhere(&R, "cuMemAlloc_v2", dlsym(h, "cuMemAlloc_v2"));
        jwhere(&R, "cuGetProcAddress_v2", dlsym(h, "cuGetProcAddress_v2"));
        jwhere(&R, "cuGetProcAddress", dlsym(h, "cuGetProcAddress"));
        jwhere(&R, "cuLaunchKernel", dlsym(h, "cuLaunchKernel"));
        jwhere(&R, "cuMemGetInfo_v2", dlsym(h, "cuMemGetInfo_v2"));
    }
    jwhere(&R, "RTLD_DEFAULT:cuMemAlloc_v2", dlsym(RTLD_DEFAULT, "cuMemAlloc_v2"));
    jend(&R);

    /* The pre-12 entry point (four arguments), found by name. */
    {
        getproc_v1_t v1 = NULL;
        *(void **)(&v1) = h ? dlsym(h, "cuGetProcAddress") : NULL;
        jobj(&R, "proc_address_v1");
        if (v1) {
            void *fn = NULL;
            CUresult rc = v1("cuMemAlloc", &fn, 11030, CU_GET_PROC_ADDRESS_DEFAULT);
            jcu(&R, "result", rc);
            jwhere(&R, "where", fn);
        } else {
            jstr(&R, "error", "cuGetProcAddress not found");
        }
        jend(&R);
    }

    /* The functions handed out must work and be limited. */
    jobj(&R, "functional");
    if (alloc_fn && free_fn && info_fn) {
        memalloc_t a = NULL;
        memfree_t f = NULL;
        meminfo_t mi = NULL;
        *(void **)(&a) = alloc_fn;
        *(void **)(&f) = free_fn;
        *(void **)(&mi) = info_fn;
        size_t fr0 = 0, tot0 = 0, fr1 = 0, tot1 = 0;
        CUdeviceptr p = 0, big = 0;
        jcu(&R, "meminfo_before", mi(&fr0, &tot0));
        ju64(&R, "free_before", fr0);
        ju64(&R, "total_before", tot0);
        if (limit) {
            CUresult rc = a(&big, (size_t)(limit + 64 * MiB));
            jcu(&R, "alloc_over_limit", rc);
            if (rc == CUDA_SUCCESS) f(big);
        }
        CUresult rc = a(&p, 64 * MiB);
        jcu(&R, "alloc_64m", rc);
        jcu(&R, "meminfo_holding", mi(&fr1, &tot1));
        ju64(&R, "free_holding", fr1);
        ju64(&R, "total_holding", tot1);
        if (rc == CUDA_SUCCESS) jcu(&R, "free_64m", f(p));
    } else {
        jstr(&R, "error", "cuMemAlloc/cuMemFree/cuMemGetInfo not resolved");
    }
    jend(&R);
    return 0;
}

/* ------------------------------------------------------------------ alloc */
enum path_id {
    P_MEM, P_PITCH, P_MANAGED, P_ARRAY, P_ARRAY3D, P_MIPMAP, P_VMM, P_ASYNC, P_POOL, P_COUNT
};
static const char *const PATH_NAMES[P_COUNT] = {
    "cuMemAlloc_v2",      "cuMemAllocPitch_v2",     "cuMemAllocManaged",
    "cuArrayCreate_v2",   "cuArray3DCreate_v2",     "cuMipmappedArrayCreate",
    "cuMemCreate",        "cuMemAllocAsync",        "cuMemAllocFromPoolAsync",
};

#define MAX_HANDLES 256
typedef union {
    CUdeviceptr p;
    CUarray a;
    CUmipmappedArray m;
    CUmemGenericAllocationHandle h;
} handle_t;

typedef struct {
    enum path_id id;
    unsigned long long chunk;
    CUstream stream;
    CUmemoryPool pool;
    size_t vmm_size;
    CUDA_ARRAY_DESCRIPTOR d2;
    CUDA_ARRAY3D_DESCRIPTOR d3;
    CUDA_ARRAY3D_DESCRIPTOR dmip;
    unsigned mip_levels;
    size_t pitch_width, pitch_height;
    unsigned long long nominal; /* bytes one allocation asks for */
} path_t;

/* Shapes that ask for `chunk` bytes (rounded down to whole rows). */
static void path_prepare(path_t *s) {
    unsigned long long c = s->chunk;
    switch (s->id) {
    case P_MEM:
    case P_MANAGED:
    case P_ASYNC:
    case P_POOL:
        s->nominal = c;
        break;
    case P_PITCH:
        s->pitch_width = 40960; /* 10240 floats, a multiple of any pitch alignment */
        s->pitch_height = (size_t)(c / s->pitch_width);
        s->nominal = (unsigned long long)s->pitch_width * s->pitch_height; /* updated by pitch */
        break;
    case P_ARRAY:
        memset(&s->d2, 0, sizeof s->d2);
        s->d2.Width = 10240;
        s->d2.Height = (size_t)(c / (10240ULL * 4));
        s->d2.Format = CU_AD_FORMAT_FLOAT;
        s->d2.NumChannels = 1;
        s->nominal = (unsigned long long)s->d2.Width * s->d2.Height * 4;
        break;
    case P_ARRAY3D:
        memset(&s->d3, 0, sizeof s->d3);
        s->d3.Width = 320;
        s->d3.Height = 320;
        s->d3.Depth = (size_t)(c / (320ULL * 320 * 4));
        s->d3.Format = CU_AD_FORMAT_FLOAT;
        s->d3.NumChannels = 1;
        s->nominal = (unsigned long long)s->d3.Width * s->d3.Height * s->d3.Depth * 4;
        break;
    case P_MIPMAP: {
        /* two levels of a 2D float image: level 1 is a quarter of level 0 */
        memset(&s->dmip, 0, sizeof s->dmip);
        s->mip_levels = 2;
        s->dmip.Width = 8192;
        s->dmip.Height = (size_t)((c * 4 / 5) / (8192ULL * 4)) & ~(size_t)1;
        s->dmip.Depth = 0;
        s->dmip.Format = CU_AD_FORMAT_FLOAT;
        s->dmip.NumChannels = 1;
        unsigned long long tot = 0, w = s->dmip.Width, h = s->dmip.Height;
        for (unsigned l = 0; l < s->mip_levels; l++) {
            tot += w * h * 4;
            w = w > 1 ? w / 2 : 1;
            h = h > 1 ? h / 2 : 1;
        }
        s->nominal = tot;
        break;
    }
    case P_VMM: {
        CUmemAllocationProp prop;
        size_t gran = 0;
        memset(&prop, 0, sizeof prop);
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = (int)g_dev;
        CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
        if (gran == 0) gran = 2 * MiB;
        s->vmm_size = (size_t)((c + gran - 1) / gran * gran);
        s->nominal = s->vmm_size;
        ju64(&R, "vmm_granularity", gran);
        break;
    }
    default:
        break;
    }
}

static CUresult path_alloc(path_t *s, handle_t *h) {
    switch (s->id) {
    case P_MEM:
        return cuMemAlloc_v2(&h->p, (size_t)s->chunk);
    case P_PITCH: {
        size_t pitch = 0;
        CUresult rc = cuMemAllocPitch_v2(&h->p, &pitch, s->pitch_width, s->pitch_height, 4);
        if (rc == CUDA_SUCCESS) s->nominal = (unsigned long long)pitch * s->pitch_height;
        return rc;
    }
    case P_MANAGED:
        return cuMemAllocManaged(&h->p, (size_t)s->chunk, CU_MEM_ATTACH_GLOBAL);
    case P_ARRAY:
        return cuArrayCreate_v2(&h->a, &s->d2);
    case P_ARRAY3D:
        return cuArray3DCreate_v2(&h->a, &s->d3);
    case P_MIPMAP:
        return cuMipmappedArrayCreate(&h->m, &s->dmip, s->mip_levels);
    case P_VMM: {
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof prop);
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = (int)g_dev;
        return cuMemCreate(&h->h, s->vmm_size, &prop, 0);
    }
    case P_ASYNC:
        return cuMemAllocAsync(&h->p, (size_t)s->chunk, s->stream);
    case P_POOL:
        return cuMemAllocFromPoolAsync(&h->p, (size_t)s->chunk, s->pool, s->stream);
    default:
        return CUDA_ERROR_NOT_SUPPORTED;
    }
}

static CUresult path_release(path_t *s, handle_t *h) {
    switch (s->id) {
    case P_MEM:
    case P_PITCH:
    case P_MANAGED:
        return cuMemFree_v2(h->p);
    case P_ARRAY:
    case P_ARRAY3D:
        return cuArrayDestroy(h->a);
    case P_MIPMAP:
        return cuMipmappedArrayDestroy(h->m);
    case P_VMM:
        return cuMemRelease(h->h);
    case P_ASYNC:
    case P_POOL:
        return cuMemFreeAsync(h->p, s->stream);
    default:
        return CUDA_ERROR_NOT_SUPPORTED;
    }
}

static void jpool(path_t *s, const char *key) {
    cuuint64_t reserved = 0, used = 0;
    jobj(&R, key);
    CUresult a = cuMemPoolGetAttribute(s->pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved);
    CUresult b = cuMemPoolGetAttribute(s->pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used);
    if (a == CUDA_SUCCESS) ju64(&R, "reserved", reserved);
    if (b == CUDA_SUCCESS) ju64(&R, "used", used);
    jend(&R);
}

static int cmd_alloc(void) {
    static handle_t hs[MAX_HANDLES];
    const char *name = arg_str("path", NULL);
    unsigned long long limit = arg_size("limit", 0);
    path_t s;
    memset(&s, 0, sizeof s);
    s.id = P_COUNT;
    for (int i = 0; i < P_COUNT; i++)
        if (name && strcmp(name, PATH_NAMES[i]) == 0) s.id = (enum path_id)i;
    if (s.id == P_COUNT) {
        fprintf(stderr, "kit alloc: --path must be one of:");
        for (int i = 0; i < P_COUNT; i++) fprintf(stderr, " %s", PATH_NAMES[i]);
        fprintf(stderr, "\n");
        return 2;
    }
    s.chunk = arg_size("chunk", 300 * MiB);
    jstr(&R, "path", PATH_NAMES[s.id]);
    ju64(&R, "limit", limit);
    ju64(&R, "chunk", s.chunk);

    setup_ctx();
    jinterposed(&R);
    {
        size_t tm = 0;
        CUresult rc = cuDeviceTotalMem_v2(&tm, g_dev);
        if (rc == CUDA_SUCCESS)
            ju64(&R, "device_total_mem", tm);
        else
            jcu(&R, "device_total_mem_error", rc);
    }
    jmeminfo(&R, "info_before");
    if (s.id == P_ASYNC || s.id == P_POOL) {
        CK(cuStreamCreate(&s.stream, CU_STREAM_NON_BLOCKING));
        CK(cuDeviceGetDefaultMemPool(&s.pool, g_dev));
    }
    path_prepare(&s);
    ju64(&R, "nominal", s.nominal);

    /* Allocate until refused; never more than the limit allows plus a margin, so
     * a missing limit shows as "never refused" rather than filling the GPU. */
    unsigned long long cap = limit ? limit / (s.nominal ? s.nominal : 1) + 4 : 16;
    if (cap > MAX_HANDLES) cap = MAX_HANDLES;
    unsigned n = 0;
    CUresult refusal = CUDA_SUCCESS;
    double t0 = mono_s();
    for (unsigned i = 0; i < cap; i++) {
        CUresult rc = path_alloc(&s, &hs[n]);
        if (rc != CUDA_SUCCESS) {
            refusal = rc;
            break;
        }
        n++;
    }
    double t_alloc = mono_s() - t0;
    if (s.stream) CK(cuStreamSynchronize(s.stream));
    ju64(&R, "accepted", n);
    ju64(&R, "nominal_after", s.nominal); /* pitch: pitch x height of the last one */
    ju64(&R, "accepted_bytes", (unsigned long long)n * s.nominal);
    if (refusal != CUDA_SUCCESS)
        jcu(&R, "refusal", refusal);
    else
        jnull(&R, "refusal");
    ju64(&R, "cap", cap);
    jdbl(&R, "alloc_s", t_alloc);
    jmeminfo(&R, "info_after_alloc");
    if (s.pool) jpool(&s, "pool_after_alloc");
    jregion(&R, "region_after_alloc");

    unsigned errors = 0;
    CUresult first_err = CUDA_SUCCESS;
    for (unsigned i = 0; i < n; i++) {
        CUresult rc = path_release(&s, &hs[i]);
        if (rc != CUDA_SUCCESS) {
            errors++;
            if (first_err == CUDA_SUCCESS) first_err = rc;
        }
    }
    if (s.stream) CK(cuStreamSynchronize(s.stream));
    ju64(&R, "release_errors", errors);
    if (errors) jcu(&R, "release_first_error", first_err);
    jmeminfo(&R, "info_after_release");
    if (s.pool) {
        jpool(&s, "pool_after_release");
        CK(cuMemPoolTrimTo(s.pool, 0));
        jmeminfo(&R, "info_after_trim");
        jpool(&s, "pool_after_trim");
    }
    jregion(&R, "region_after_release");
    if (s.stream) cuStreamDestroy_v2(s.stream);
    return 0;
}

/* ------------------------------------------------------------------ compute */
static void compute_setup(CUmodule *m, CUfunction *f, CUdeviceptr *out, CUstream *st,
                          unsigned *grid) {
    setup_ctx();
    int sm = dev_attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
    if (sm <= 0) fatal_msg("SM count");
    unsigned bps = (unsigned)arg_f64("blocks-per-sm", 4);
    *grid = (unsigned)sm * bps;
    *m = load_kernels();
    CK(cuModuleGetFunction(f, *m, "gs_fma_loop"));
    CK(cuMemAlloc_v2(out, (size_t)*grid * 256 * sizeof(float)));
    CK(cuStreamCreate(st, CU_STREAM_NON_BLOCKING));
    ji64(&R, "sm_count", sm);
    ju64(&R, "grid", *grid);
    ju64(&R, "block", 256);
}

static CUresult launch_fma(CUfunction f, unsigned grid, CUstream st, CUdeviceptr *out,
                           unsigned *iters) {
    float mul = 0.999f, add = 0.001f;
    void *params[] = {out, iters, &mul, &add};
    return cuLaunchKernel(f, grid, 1, 1, 256, 1, 1, 0, st, params, NULL);
}

/* One kernel alone, host-timed between synchronisations: median of `reps`. */
static double time_kernel_ms(CUfunction f, unsigned grid, CUstream st, CUdeviceptr *out,
                             unsigned iters, int reps) {
    double t[16];
    if (reps > 16) reps = 16;
    CK(cuStreamSynchronize(st));
    for (int i = 0; i < reps; i++) {
        double a = mono_s();
        CK(launch_fma(f, grid, st, out, &iters));
        CK(cuStreamSynchronize(st));
        t[i] = (mono_s() - a) * 1e3;
    }
    return median(t, reps);
}

static int cmd_calibrate(void) {
    CUmodule m;
    CUfunction f;
    CUdeviceptr out;
    CUstream st;
    unsigned grid;
    double target = arg_f64("target-ms", 2.0);
    compute_setup(&m, &f, &out, &st, &grid);
    unsigned iters = 1024;
    double ms = 0;
    CK(launch_fma(f, grid, st, &out, &iters)); /* JIT, first-touch */
    CK(cuStreamSynchronize(st));
    jarr(&R, "steps");
    for (int round = 0; round < 8; round++) {
        ms = time_kernel_ms(f, grid, st, &out, iters, 5);
        jobj(&R, NULL);
        ju64(&R, "iters", iters);
        jdbl(&R, "ms", ms);
        jend(&R);
        if (fabs(ms - target) <= 0.05 * target) break;
        double scale = ms > 0.02 ? target / ms : 16.0;
        if (scale > 16) scale = 16;
        double next = (double)iters * scale;
        if (next < 1) next = 1;
        if (next > 4e9) next = 4e9;
        iters = (unsigned)next;
    }
    jend(&R);
    ms = time_kernel_ms(f, grid, st, &out, iters, 9);
    ju64(&R, "iters", iters);
    ju64(&R, "fma_per_thread", (unsigned long long)iters * FMA_PER_ITER);
    jdbl(&R, "kernel_ms", ms);
    jdbl(&R, "tflops", (double)grid * 256.0 * iters * FMA_PER_ITER * 2.0 / (ms * 1e-3) / 1e12);
    return 0;
}

static int cmd_compute(void) {
    CUmodule m;
    CUfunction f;
    CUdeviceptr out;
    CUstream st;
    unsigned grid;
    unsigned iters = (unsigned)arg_f64("iters", 0);
    double secs = arg_f64("seconds", 4.0);
    double warm = arg_f64("warmup", 0.5);
    double start_at = arg_f64("start-at", 0);
    int q = (int)arg_f64("queue", 4);
    if (iters == 0) {
        fprintf(stderr, "kit compute: --iters N is required (see kit calibrate)\n");
        return 2;
    }
    if (q < 1) q = 1;
    if (q > 64) q = 64;
    unsigned long long hold_bytes = arg_size("hold", 0);
    CUdeviceptr held = 0;
    jinterposed(&R);
    compute_setup(&m, &f, &out, &st, &grid);
    if (hold_bytes) CK(cuMemAlloc_v2(&held, (size_t)hold_bytes));
    ju64(&R, "held", hold_bytes);
    ju64(&R, "iters", iters);
    ji64(&R, "queue", q);
    CUevent ev[64];
    for (int i = 0; i < q; i++) CK(cuEventCreate(&ev[i], CU_EVENT_DISABLE_TIMING));

    /* warm-up: JIT, clocks, the limiter's first measurements */
    double tw = mono_s();
    unsigned wn = 0;
    while (mono_s() - tw < warm || wn < 3) {
        CK(launch_fma(f, grid, st, &out, &iters));
        if (++wn % (unsigned)q == 0) CK(cuStreamSynchronize(st));
    }
    CK(cuStreamSynchronize(st));
    ju64(&R, "warmup_kernels", wn);

    /* all processes of a concurrent run start together */
    double late = 0;
    if (start_at > 0) {
        double now = epoch_s();
        if (now < start_at)
            sleep_s(start_at - now);
        else
            late = now - start_at;
    }
    jdbl(&R, "late_s", late);

    /* At most q kernels in flight: the loop ends within q kernels of `secs`. */
    double launch_sum = 0, launch_max = 0;
    unsigned long long launched = 0;
    double e0 = epoch_s(), t0 = mono_s();
    for (;;) {
        int slot = (int)(launched % (unsigned long long)q);
        if (launched >= (unsigned long long)q) CK(cuEventSynchronize(ev[slot]));
        double a = mono_s();
        CK(launch_fma(f, grid, st, &out, &iters));
        double l = mono_s() - a;
        launch_sum += l;
        if (l > launch_max) launch_max = l;
        CK(cuEventRecord(ev[slot], st));
        launched++;
        if (mono_s() - t0 >= secs) break;
    }
    CK(cuStreamSynchronize(st));
    double t1 = mono_s(), e1 = epoch_s();
    double el = t1 - t0;
    ju64(&R, "kernels", launched);
    jdbl(&R, "elapsed_s", el);
    jdbl(&R, "kernels_per_s", (double)launched / el);
    jdbl(&R, "launch_call_ms_mean", launch_sum / (double)launched * 1e3);
    jdbl(&R, "launch_call_ms_max", launch_max * 1e3);
    jepoch(&R, "t_start_epoch", e0);
    jepoch(&R, "t_end_epoch", e1);
    jregion(&R, "region");
    for (int i = 0; i < q; i++) cuEventDestroy_v2(ev[i]);
    if (held) cuMemFree_v2(held);
    return 0;
}

/* The region file as a node agent reads it, from a process without CUDA. */
static int cmd_region(void) {
    if (!arg_str("region", NULL)) {
        fprintf(stderr, "kit region: --region PATH is required\n");
        return 2;
    }
    jregion(&R, "region");
    return 0;
}

/* ------------------------------------------------------------------ overhead */
static int cmd_launch(void) {
    unsigned long long count = arg_size("count", 200000);
    int repeat = (int)arg_f64("repeat", 3);
    CUmodule m;
    CUfunction f;
    CUstream st;
    if (repeat < 1) repeat = 1;
    if (repeat > 16) repeat = 16;
    setup_ctx();
    jinterposed(&R);
    m = load_kernels();
    CK(cuModuleGetFunction(&f, m, "gs_empty"));
    CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
    for (int i = 0; i < 2000; i++) CK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, st, NULL, NULL));
    CK(cuStreamSynchronize(st));
    double ns[16];
    jarr(&R, "ns_per_launch_runs");
    for (int r = 0; r < repeat; r++) {
        double a = mono_s();
        for (unsigned long long i = 0; i < count; i++)
            CK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, st, NULL, NULL));
        CK(cuStreamSynchronize(st));
        ns[r] = (mono_s() - a) * 1e9 / (double)count;
        jdbl(&R, NULL, ns[r]);
    }
    jend(&R);
    ju64(&R, "count", count);
    double mn = ns[0];
    for (int r = 1; r < repeat; r++) mn = ns[r] < mn ? ns[r] : mn;
    jdbl(&R, "ns_min", mn);
    jdbl(&R, "ns_median", median(ns, repeat));
    return 0;
}

static int cmd_allocpair(void) {
    unsigned long long count = arg_size("count", 20000);
    unsigned long long size = arg_size("size", MiB);
    int repeat = (int)arg_f64("repeat", 3);
    if (repeat < 1) repeat = 1;
    if (repeat > 16) repeat = 16;
    setup_ctx();
    jinterposed(&R);
    CUdeviceptr p;
    for (int i = 0; i < 200; i++) {
        CK(cuMemAlloc_v2(&p, (size_t)size));
        CK(cuMemFree_v2(p));
    }
    double ns[16];
    jarr(&R, "ns_per_pair_runs");
    for (int r = 0; r < repeat; r++) {
        double a = mono_s();
        for (unsigned long long i = 0; i < count; i++) {
            CK(cuMemAlloc_v2(&p, (size_t)size));
            CK(cuMemFree_v2(p));
        }
        ns[r] = (mono_s() - a) * 1e9 / (double)count;
        jdbl(&R, NULL, ns[r]);
    }
    jend(&R);
    ju64(&R, "count", count);
    ju64(&R, "size", size);
    double mn = ns[0];
    for (int r = 1; r < repeat; r++) mn = ns[r] < mn ? ns[r] : mn;
    jdbl(&R, "ns_min", mn);
    jdbl(&R, "ns_median", median(ns, repeat));
    return 0;
}

/* ------------------------------------------------------------------ main */
static void usage(void) {
    fputs("usage: kit {env|alloc|lookup|nvml|calibrate|compute|launch|allocpair|region} [--opt value]...\n"
          "  see the top of kit.c (or native/gpu/README.md) for each subcommand's options\n",
          stderr);
}

int main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
        usage();
        return argc < 2 ? 2 : 0;
    }
    const char *cmd = argv[1];
    g_argc = argc - 2;
    g_argv = argv + 2;
    g_ordinal = (int)arg_f64("device", 0);
    const char *lib = arg_str("lib", NULL);
    if (lib && *lib && !realpath(lib, g_lib_real)) g_lib_real[0] = '\0';

    jbegin(&R, "result");
    jstr(&R, "cmd", cmd);
    ji64(&R, "pid", (long long)getpid());
    int rc;
    if (strcmp(cmd, "env") == 0)
        rc = cmd_env();
    else if (strcmp(cmd, "alloc") == 0)
        rc = cmd_alloc();
    else if (strcmp(cmd, "lookup") == 0)
        rc = cmd_lookup();
    else if (strcmp(cmd, "nvml") == 0)
        rc = cmd_nvml();
    else if (strcmp(cmd, "calibrate") == 0)
        rc = cmd_calibrate();
    else if (strcmp(cmd, "compute") == 0)
        rc = cmd_compute();
    else if (strcmp(cmd, "launch") == 0)
        rc = cmd_launch();
    else if (strcmp(cmd, "allocpair") == 0)
        rc = cmd_allocpair();
    else if (strcmp(cmd, "region") == 0)
        rc = cmd_region();
    else {
        usage();
        return 2;
    }
    if (rc == 0) jemit(&R);
    return rc;
}
