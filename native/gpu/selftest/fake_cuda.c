/*
 * A fake libcuda.so.1 for `make selftest`: just enough driver for the GPU kit's
 * programs to run end to end on a machine without a GPU. It also plays the
 * interposer's part, perfectly: with CUDA_DEVICE_MEMORY_LIMIT set it refuses
 * allocations beyond the limit and reports the limit as total memory; with
 * CUDA_DEVICE_SM_LIMIT set (policy not "disable") it spaces kernels on a
 * simulated timeline so that the share is exact. That checks the kit's
 * plumbing (arguments, JSON, checks, report), never the real interposer.
 *
 * Kernels do not run: gs_fma_loop "takes" iters * 4 ns, gs_empty nothing.
 *
 * GS_FAKE_PLAIN=1 makes it a plain driver instead (an 80 GiB GPU, no limits of
 * its own), for running the real libgpuslice.so on top of it (`make fake-check`).
 *
 * Priority, as the interposer plays it: with CUDA_TASK_PRIORITY >= 1 launches
 * wait while the control file beside the region (CUDA_DEVICE_MEMORY_SHARED_CACHE
 * + ".control", gs_control_t) has a fresh heartbeat and GS_DEV_YIELD set.
 *
 * GS_FAKE_PROC_DIR: each process keeps <dir>/<pid> (gs_fake_proc_t: bytes held,
 * kernel time, start) for the fake NVML's per-process queries.
 *
 * GS_FAKE_BREAK (comma-separated) plants interposer bugs, so the selftest can
 * show that the kit's checks catch them:
 *   managed-unlimited  cuMemAllocManaged ignores the limit
 *   array-leak         cuArrayDestroy does not give the bytes back
 *   sm-skew            kernels are spaced 25 % too far apart (share 0.8x)
 * A copy of this library under a file name holding "broken" has them all: a
 * peer library with bugs, for the selftest of the kit's --peer.
 */
#include <cuda.h>
#include <dlfcn.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "region_layout.h"
#include "selftest/fake_proc.h"

#undef cuGetProcAddress
CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                             unsigned int bx, unsigned int by, unsigned int bz, unsigned int shm,
                             CUstream s, void **params, void **extra);
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream);

#define GiB (1024ULL * 1024ULL * 1024ULL)
#define PHYS (80ULL * GiB)
#define NS_PER_ITER 4e-9

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned long long used;
static CUdeviceptr next_ptr = 0x7f0000000000ULL;

static unsigned long long env_size(const char *name) {
    const char *s = getenv(name);
    if (!s || !*s) return 0;
    char *end;
    double v = strtod(s, &end);
    switch (*end) {
    case 'k': case 'K': v *= 1024.0; break;
    case 'm': case 'M': v *= 1024.0 * 1024.0; break;
    case 'g': case 'G': v *= 1024.0 * 1024.0 * 1024.0; break;
    default: break;
    }
    return (unsigned long long)v;
}
static int plain(void) {
    const char *p = getenv("GS_FAKE_PLAIN");
    return p && *p && strcmp(p, "0") != 0;
}
static unsigned long long limit(void) { return plain() ? 0 : env_size("CUDA_DEVICE_MEMORY_LIMIT"); }
static unsigned long long total(void) { return limit() ? limit() : PHYS; }
static unsigned sm_limit(void) {
    const char *p = getenv("GPU_CORE_UTILIZATION_POLICY");
    if (plain() || (p && strcmp(p, "disable") == 0)) return 0;
    return (unsigned)env_size("CUDA_DEVICE_SM_LIMIT");
}

/* A copy of this library whose file name holds "broken" (a stand-in for a
 * peer library with bugs) has every bug planted. */
static int broken_copy(void) {
    static int known = -1;
    if (known < 0) {
        Dl_info di;
        const char *base = NULL;
        if (dladdr((void *)&broken_copy, &di) && di.dli_fname) base = strrchr(di.dli_fname, '/');
        known = base && strstr(base, "broken") != NULL;
    }
    return known;
}
static int broken(const char *what) {
    const char *b = getenv("GS_FAKE_BREAK");
    return broken_copy() || (b && strstr(b, what) != NULL);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
static void sleep_until(double t) {
    double d = t - now_s();
    if (d <= 0) return;
    struct timespec ts = {(time_t)d, (long)((d - (double)(time_t)d) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* ---- this process's record for the fake NVML (GS_FAKE_PROC_DIR) */
static gs_fake_proc_t *proc_rec(void) {
    static gs_fake_proc_t *rec;
    static int tried;
    if (tried) return rec;
    tried = 1;
    const char *dir = getenv("GS_FAKE_PROC_DIR");
    char path[512];
    if (!dir || !*dir) return NULL;
    snprintf(path, sizeof path, "%s/%d", dir, (int)getpid());
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return NULL;
    if (ftruncate(fd, sizeof(gs_fake_proc_t)) == 0) {
        void *m = mmap(NULL, sizeof(gs_fake_proc_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (m != MAP_FAILED) rec = m;
    }
    close(fd);
    if (rec) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        rec->start_ns = (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
    }
    return rec;
}
static void proc_used(unsigned long long used_now) {
    gs_fake_proc_t *r = proc_rec();
    if (r) __atomic_store_n(&r->used, used_now, __ATOMIC_RELAXED);
}

/* ---- priority: the control file beside the region, as the interposer reads it */
static const gs_control_t *control_map(void) {
    static const gs_control_t *c;
    static double tried;
    if (c) return c;
    double now = 0;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    now = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
    if (tried && now - tried < 0.2) return NULL;
    tried = now;
    const char *region = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    char path[600];
    if (!region || !*region) return NULL;
    snprintf(path, sizeof path, "%s.control", region);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return NULL;
    void *m = mmap(NULL, sizeof(gs_control_t), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return NULL;
    c = m;
    return c;
}
static int low_priority(void) {
    const char *p = getenv("CUDA_TASK_PRIORITY");
    return !plain() && p && atoi(p) >= 1;
}
static void wait_while_yield(void) {
    for (;;) {
        const gs_control_t *c = control_map();
        if (!c || c->magic != GS_CONTROL_MAGIC) return;
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        unsigned long long now = (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
        unsigned long long hb = __atomic_load_n(&c->heartbeat_ns, __ATOMIC_ACQUIRE);
        if (!hb || now < hb || now - hb >= GS_AGENT_FRESH_NS) return;
        if (!(__atomic_load_n(&c->flags[0], __ATOMIC_ACQUIRE) & GS_DEV_YIELD)) return;
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
}

/* ---- allocations: key -> bytes */
#define SLOTS 8192
static struct {
    unsigned long long key, bytes;
} table[SLOTS];

static CUresult take_ex(unsigned long long bytes, unsigned long long *key_out, int make_ptr,
                        int unlimited) {
    pthread_mutex_lock(&mu);
    if (!unlimited && used + bytes > total()) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    for (int i = 0; i < SLOTS; i++) {
        if (table[i].key == 0) {
            unsigned long long key = *key_out;
            if (make_ptr) {
                key = next_ptr;
                next_ptr += (bytes + (2ULL << 20) - 1) / (2ULL << 20) * (2ULL << 20) + (2ULL << 20);
            }
            table[i].key = key;
            table[i].bytes = bytes;
            used += bytes;
            proc_used(used);
            *key_out = key;
            pthread_mutex_unlock(&mu);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
}
static CUresult take(unsigned long long bytes, unsigned long long *key_out, int make_ptr) {
    return take_ex(bytes, key_out, make_ptr, 0);
}
static CUresult give(unsigned long long key) {
    pthread_mutex_lock(&mu);
    for (int i = 0; i < SLOTS; i++) {
        if (table[i].key == key && key) {
            used -= table[i].bytes;
            proc_used(used);
            table[i].key = 0;
            pthread_mutex_unlock(&mu);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&mu);
    return CUDA_ERROR_INVALID_VALUE;
}

/* ---- init, devices, contexts */
CUresult cuInit(unsigned int flags) { return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *d = 0;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    snprintf(name, (size_t)len, "Fake GPU (gpuslice selftest)");
    return CUDA_SUCCESS;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) { *bytes = total(); return CUDA_SUCCESS; }
CUresult cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice dev) {
    switch (a) {
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = 132; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: *v = 50 << 20; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: *v = 2048; break;
    default: *v = 1; break;
    }
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice dev) {
    for (int i = 0; i < 16; i++) u->bytes[i] = (char)(0x10 + i);
    return CUDA_SUCCESS;
}
#undef cuDeviceGetUuid
CUresult cuDeviceGetUuid(CUuuid *u, CUdevice dev);
CUresult cuDeviceGetUuid(CUuuid *u, CUdevice dev) { return cuDeviceGetUuid_v2(u, dev); }
CUresult cuDeviceGetPCIBusId(char *bus, int len, CUdevice dev) {
    snprintf(bus, (size_t)len, "0000:00:00.0");
    return CUDA_SUCCESS;
}
static int ctx_dummy;
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice dev) {
    *c = (CUcontext)&ctx_dummy;
    return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    (void)dev;
    return CUDA_SUCCESS;
}
static __thread CUcontext current;
CUresult cuCtxSetCurrent(CUcontext c) {
    current = c;
    return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext *c) {
    *c = current;
    return CUDA_SUCCESS;
}
CUresult cuCtxGetDevice(CUdevice *d) {
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    *d = 0;
    return CUDA_SUCCESS;
}
CUresult cuGetErrorName(CUresult rc, const char **s) {
    switch (rc) {
    case CUDA_SUCCESS: *s = "CUDA_SUCCESS"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; return CUDA_SUCCESS;
    case CUDA_ERROR_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_FOUND: *s = "CUDA_ERROR_NOT_FOUND"; return CUDA_SUCCESS;
    default: *s = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
}

/* ---- memory */
/* What the fake NVML reports (a name no interposer hooks). */
__attribute__((visibility("default"))) void gs_fake_meminfo(unsigned long long *fr,
                                                            unsigned long long *tot);
void gs_fake_meminfo(unsigned long long *fr, unsigned long long *tot) {
    pthread_mutex_lock(&mu);
    *tot = total();
    *fr = total() - used;
    pthread_mutex_unlock(&mu);
}
CUresult cuMemGetInfo_v2(size_t *fr, size_t *tot) {
    pthread_mutex_lock(&mu);
    *tot = total();
    *fr = total() - used;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    unsigned long long k = 0;
    CUresult rc = take(n, &k, 1);
    if (rc == CUDA_SUCCESS) *p = k;
    return rc;
}
CUresult cuMemFree_v2(CUdeviceptr p) { return give(p); }
CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned int e) {
    *pitch = (w + 511) / 512 * 512;
    return cuMemAlloc_v2(p, *pitch * h);
}
CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned int flags) {
    unsigned long long k = 0;
    CUresult rc = take_ex(n, &k, 1, broken("managed-unlimited"));
    if (rc == CUDA_SUCCESS) *p = k;
    return rc;
}
static unsigned long long fmt_bytes(CUarray_format f) {
    switch (f) {
    case CU_AD_FORMAT_FLOAT: case CU_AD_FORMAT_UNSIGNED_INT32: case CU_AD_FORMAT_SIGNED_INT32: return 4;
    case CU_AD_FORMAT_HALF: case CU_AD_FORMAT_UNSIGNED_INT16: case CU_AD_FORMAT_SIGNED_INT16: return 2;
    default: return 1;
    }
}
static CUresult new_object(unsigned long long bytes, void **out) {
    void *obj = malloc(16);
    unsigned long long k = (unsigned long long)(uintptr_t)obj;
    if (!obj) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = take(bytes, &k, 0);
    if (rc != CUDA_SUCCESS) {
        free(obj);
        return rc;
    }
    *out = obj;
    return CUDA_SUCCESS;
}
static CUresult drop_object(void *obj) {
    CUresult rc = give((unsigned long long)(uintptr_t)obj);
    if (rc == CUDA_SUCCESS) free(obj);
    return rc;
}
CUresult cuArrayCreate_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d) {
    unsigned long long h = d->Height ? d->Height : 1;
    return new_object(d->Width * h * fmt_bytes(d->Format) * d->NumChannels, (void **)a);
}
CUresult cuArray3DCreate_v2(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *d) {
    unsigned long long h = d->Height ? d->Height : 1, z = d->Depth ? d->Depth : 1;
    return new_object(d->Width * h * z * fmt_bytes(d->Format) * d->NumChannels, (void **)a);
}
CUresult cuArrayDestroy(CUarray a) { return broken("array-leak") ? CUDA_SUCCESS : drop_object(a); }
CUresult cuMipmappedArrayCreate(CUmipmappedArray *m, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                unsigned int levels) {
    unsigned long long w = d->Width, h = d->Height ? d->Height : 1, z = d->Depth ? d->Depth : 1, t = 0;
    for (unsigned l = 0; l < levels; l++) {
        t += w * h * z * fmt_bytes(d->Format) * d->NumChannels;
        w = w > 1 ? w / 2 : 1;
        h = h > 1 ? h / 2 : 1;
        z = z > 1 ? z / 2 : 1;
    }
    return new_object(t, (void **)m);
}
CUresult cuMipmappedArrayDestroy(CUmipmappedArray m) { return drop_object(m); }
CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop,
                                       CUmemAllocationGranularity_flags o) {
    *g = 2 << 20;
    return CUDA_SUCCESS;
}
static unsigned long long next_handle = 1;
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *prop,
                     unsigned long long flags) {
    if (n % (2 << 20)) return CUDA_ERROR_INVALID_VALUE;
    unsigned long long k = __atomic_fetch_add(&next_handle, 1, __ATOMIC_RELAXED);
    CUresult rc = take(n, &k, 0);
    if (rc == CUDA_SUCCESS) *h = k;
    return rc;
}
CUresult cuMemRelease(CUmemGenericAllocationHandle h) { return give(h); }
static int pool_dummy;
static unsigned long long pool_bytes;
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *p, CUdevice dev) {
    *p = (CUmemoryPool)&pool_dummy;
    return CUDA_SUCCESS;
}
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) {
    CUresult rc = cuMemAlloc_v2(p, n);
    if (rc == CUDA_SUCCESS) __atomic_add_fetch(&pool_bytes, n, __ATOMIC_RELAXED);
    return rc;
}
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) { return cuMemAllocAsync(p, n, s); }
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s) {
    return cuMemAllocAsync(p, n, s);
}
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    unsigned long long bytes = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < SLOTS; i++)
        if (table[i].key == p) bytes = table[i].bytes;
    pthread_mutex_unlock(&mu);
    CUresult rc = give(p);
    if (rc == CUDA_SUCCESS) __atomic_sub_fetch(&pool_bytes, bytes, __ATOMIC_RELAXED);
    return rc;
}
CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) { return CUDA_SUCCESS; }
CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute a, void *v) {
    *(cuuint64_t *)v = __atomic_load_n(&pool_bytes, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) { return CUDA_SUCCESS; }

/* ---- modules, streams, events, launches on a simulated timeline */
struct CUmod_st { int dummy; };
struct CUfunc_st { int empty; };
struct CUstream_st { double busy_until, next_allowed; };
struct CUevent_st { double t; };
static struct CUmod_st the_module;
static struct CUfunc_st fma_fn = {0}, empty_fn = {1};
static struct CUstream_st default_stream;

CUresult cuModuleLoadDataEx(CUmodule *m, const void *image, unsigned int n, CUjit_option *o,
                            void **v) {
    if (!strstr((const char *)image, ".entry gs_fma_loop") || !strstr((const char *)image, ".entry gs_empty"))
        return CUDA_ERROR_INVALID_IMAGE;
    *m = &the_module;
    return CUDA_SUCCESS;
}
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
    if (strcmp(name, "gs_fma_loop") == 0)
        *f = &fma_fn;
    else if (strcmp(name, "gs_empty") == 0)
        *f = &empty_fn;
    else
        return CUDA_ERROR_NOT_FOUND;
    return CUDA_SUCCESS;
}
CUresult cuStreamCreate(CUstream *s, unsigned int flags) {
    *s = calloc(1, sizeof **s);
    return *s ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult cuStreamDestroy_v2(CUstream s) {
    free(s);
    return CUDA_SUCCESS;
}
static CUstream S(CUstream s) { return s ? s : &default_stream; }
CUresult cuStreamSynchronize(CUstream s) {
    sleep_until(S(s)->busy_until);
    return CUDA_SUCCESS;
}
CUresult cuEventCreate(CUevent *e, unsigned int flags) {
    *e = calloc(1, sizeof **e);
    return *e ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult cuEventDestroy_v2(CUevent e) {
    free(e);
    return CUDA_SUCCESS;
}
CUresult cuEventRecord(CUevent e, CUstream s) {
    double t = now_s();
    e->t = S(s)->busy_until > t ? S(s)->busy_until : t;
    return CUDA_SUCCESS;
}
CUresult cuEventSynchronize(CUevent e) {
    sleep_until(e->t);
    return CUDA_SUCCESS;
}
#undef cuEventElapsedTime
CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b);
CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b) {
    if (now_s() < b->t) return CUDA_ERROR_NOT_READY;
    *ms = (float)((b->t - a->t) * 1e3);
    return CUDA_SUCCESS;
}
CUresult cuEventElapsedTime_v2(float *ms, CUevent a, CUevent b) { return cuEventElapsedTime(ms, a, b); }
CUresult cuEventQuery(CUevent e) { return now_s() < e->t ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS; }
CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                        unsigned int bx, unsigned int by, unsigned int bz, unsigned int shm,
                        CUstream hs, void **params, void **extra) {
    CUstream s = S(hs);
    double dur = f->empty ? 0 : (double)*(unsigned *)params[1] * NS_PER_ITER;
    if (low_priority()) wait_while_yield();
    gs_fake_proc_t *rec = proc_rec();
    if (rec) __atomic_add_fetch(&rec->busy_ns, (unsigned long long)(dur * 1e9), __ATOMIC_RELAXED);
    double start = now_s();
    if (s->busy_until > start) start = s->busy_until;
    if (s->next_allowed > start) start = s->next_allowed;
    unsigned p = sm_limit();
    s->busy_until = start + dur;
    s->next_allowed = (p > 0 && p < 100) ? start + dur * 100.0 / p * (broken("sm-skew") ? 1.25 : 1.0) : 0;
    return CUDA_SUCCESS;
}
CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                             unsigned int bx, unsigned int by, unsigned int bz, unsigned int shm,
                             CUstream s, void **params, void **extra) {
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shm, s, params, extra);
}
CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s) { return CUDA_SUCCESS; }

/* ---- entry points by name */
#define E(name) {#name, (void *)&name}
static const struct {
    const char *name;
    void *fn;
} entries[] = {
    E(cuInit), E(cuDriverGetVersion), E(cuDeviceGetCount), E(cuDeviceGet), E(cuDeviceGetName),
    E(cuDeviceTotalMem_v2), E(cuDeviceGetAttribute), E(cuDeviceGetUuid_v2), E(cuMemGetInfo_v2),
    E(cuMemAlloc_v2), E(cuMemFree_v2), E(cuMemAllocPitch_v2), E(cuMemAllocManaged), E(cuMemCreate),
    E(cuMemRelease), E(cuMemAllocAsync), E(cuMemAllocAsync_ptsz), E(cuMemAllocFromPoolAsync),
    E(cuMemFreeAsync), E(cuLaunchKernel), E(cuLaunchKernel_ptsz), E(cuGraphLaunch_ptsz),
    E(cuGetProcAddress_v2), E(cuGetProcAddress), E(cuMemcpyHtoD_v2), E(cuEventElapsedTime),
    E(cuEventElapsedTime_v2), E(cuEventQuery), E(cuEventCreate), E(cuEventRecord),
    E(cuEventSynchronize), E(cuEventDestroy_v2), E(cuStreamSynchronize), E(cuCtxGetCurrent),
    E(cuCtxGetDevice), E(cuCtxSetCurrent), E(cuDeviceGetUuid), E(cuArrayCreate_v2),
    E(cuArray3DCreate_v2), E(cuArrayDestroy), E(cuMipmappedArrayCreate), E(cuMipmappedArrayDestroy),
};

static void *find(const char *name) {
    for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++)
        if (strcmp(entries[i].name, name) == 0) return entries[i].fn;
    return NULL;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int ver, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *st) {
    char buf[256];
    void *fn = NULL;
    if (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) {
        snprintf(buf, sizeof buf, "%s_ptsz", symbol);
        fn = find(buf);
    }
    if (!fn) {
        snprintf(buf, sizeof buf, "%s_v2", symbol);
        fn = find(buf);
    }
    if (!fn) fn = find(symbol);
    *pfn = fn;
    if (st) *st = fn ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return fn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}
CUresult cuGetProcAddress(const char *symbol, void **pfn, int ver, cuuint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, ver, flags, NULL);
}
