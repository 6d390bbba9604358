/*
 * A fake libnvidia-ml.so.1 for `make selftest`: reports the memory the fake
 * driver (fake_cuda.c, in the same process) shows: the limit when the fake plays
 * the interposer, the whole fake GPU under GS_FAKE_PLAIN. Only the entry points
 * the GPU kit calls (and the interposer's NVML hooks need).
 */
#include <cuda.h>
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "kit_nvml.h"
#include "selftest/fake_proc.h"

#define EXPORT __attribute__((visibility("default")))

EXPORT kit_nvmlReturn_t nvmlInit_v2(void);
EXPORT kit_nvmlReturn_t nvmlShutdown(void);
EXPORT const char *nvmlErrorString(kit_nvmlReturn_t r);
EXPORT kit_nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, kit_nvmlDevice_t *d);
EXPORT kit_nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, kit_nvmlDevice_t *d);
EXPORT kit_nvmlReturn_t nvmlDeviceGetMemoryInfo(kit_nvmlDevice_t d, kit_nvmlMemory_t *m);
EXPORT kit_nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(kit_nvmlDevice_t d, kit_nvmlMemory_v2_t *m);
EXPORT kit_nvmlReturn_t nvmlSystemGetDriverVersion(char *buf, unsigned int n);
EXPORT kit_nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v);
EXPORT kit_nvmlReturn_t nvmlDeviceGetName(kit_nvmlDevice_t d, char *buf, unsigned int n);
EXPORT kit_nvmlReturn_t nvmlDeviceGetUUID(kit_nvmlDevice_t d, char *buf, unsigned int n);
EXPORT kit_nvmlReturn_t nvmlDeviceGetIndex(kit_nvmlDevice_t d, unsigned int *i);
EXPORT kit_nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(kit_nvmlDevice_t d,
                                                                unsigned int *count,
                                                                kit_nvmlProcessInfo_t *infos);
EXPORT kit_nvmlReturn_t nvmlDeviceGetProcessUtilization(kit_nvmlDevice_t d,
                                                        kit_nvmlProcessUtilizationSample_t *s,
                                                        unsigned int *count,
                                                        unsigned long long last_seen);

static int dev_dummy;

kit_nvmlReturn_t nvmlInit_v2(void) { return KIT_NVML_SUCCESS; }
kit_nvmlReturn_t nvmlShutdown(void) { return KIT_NVML_SUCCESS; }
const char *nvmlErrorString(kit_nvmlReturn_t r) { return r ? "error" : "success"; }
kit_nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, kit_nvmlDevice_t *d) {
    if (i != 0) return 2;
    *d = (kit_nvmlDevice_t)&dev_dummy;
    return KIT_NVML_SUCCESS;
}
kit_nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, kit_nvmlDevice_t *d) {
    *d = (kit_nvmlDevice_t)&dev_dummy;
    return KIT_NVML_SUCCESS;
}
/* The fake driver's own numbers, through a name no interposer hooks. */
static int cuda_mem(size_t *fr, size_t *tot) {
    void (*fn)(unsigned long long *, unsigned long long *) = NULL;
    unsigned long long f = 0, t = 0;
    *(void **)(&fn) = dlsym(RTLD_DEFAULT, "gs_fake_meminfo");
    if (!fn) return 0;
    fn(&f, &t);
    *fr = (size_t)f;
    *tot = (size_t)t;
    return 1;
}
kit_nvmlReturn_t nvmlDeviceGetMemoryInfo(kit_nvmlDevice_t d, kit_nvmlMemory_t *m) {
    size_t fr, tot;
    if (!cuda_mem(&fr, &tot)) return 999;
    m->total = tot;
    m->free = fr;
    m->used = tot - fr;
    return KIT_NVML_SUCCESS;
}
kit_nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(kit_nvmlDevice_t d, kit_nvmlMemory_v2_t *m) {
    size_t fr, tot;
    if (m->version != KIT_NVML_MEMORY_V2_VERSION) return 25; /* NVML_ERROR_ARGUMENT_VERSION_MISMATCH */
    if (!cuda_mem(&fr, &tot)) return 999;
    m->total = tot;
    m->reserved = 0;
    m->free = fr;
    m->used = tot - fr;
    return KIT_NVML_SUCCESS;
}
kit_nvmlReturn_t nvmlSystemGetDriverVersion(char *buf, unsigned int n) {
    snprintf(buf, n, "000.00-fake");
    return KIT_NVML_SUCCESS;
}
kit_nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) {
    *v = 13000;
    return KIT_NVML_SUCCESS;
}
kit_nvmlReturn_t nvmlDeviceGetName(kit_nvmlDevice_t d, char *buf, unsigned int n) {
    snprintf(buf, n, "Fake GPU (gpuslice selftest)");
    return KIT_NVML_SUCCESS;
}
/* fake_cuda.c's cuDeviceGetUuid bytes are 0x10..0x1f */
kit_nvmlReturn_t nvmlDeviceGetUUID(kit_nvmlDevice_t d, char *buf, unsigned int n) {
    snprintf(buf, n, "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f");
    return KIT_NVML_SUCCESS;
}
kit_nvmlReturn_t nvmlDeviceGetIndex(kit_nvmlDevice_t d, unsigned int *i) {
    *i = 0;
    return KIT_NVML_SUCCESS;
}

/* ---- per process: GS_FAKE_PROC_DIR/<pid> of live processes */
typedef struct {
    unsigned int pid;
    gs_fake_proc_t rec;
} live_t;

static unsigned int live_procs(live_t *out, unsigned int max) {
    const char *dir = getenv("GS_FAKE_PROC_DIR");
    unsigned int n = 0;
    DIR *d = dir && *dir ? opendir(dir) : NULL;
    if (!d) return 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL && n < max) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end || pid <= 0 || kill((pid_t)pid, 0) != 0) continue;
        char path[600];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        if (pread(fd, &out[n].rec, sizeof out[n].rec, 0) == (ssize_t)sizeof out[n].rec) {
            out[n].pid = (unsigned int)pid;
            n++;
        }
        close(fd);
    }
    closedir(d);
    return n;
}

kit_nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(kit_nvmlDevice_t d, unsigned int *count,
                                                         kit_nvmlProcessInfo_t *infos) {
    live_t live[64];
    unsigned int n = live_procs(live, 64);
    if (!infos || *count < n) {
        *count = n;
        return n ? KIT_NVML_ERROR_INSUFFICIENT_SIZE : KIT_NVML_SUCCESS;
    }
    for (unsigned int i = 0; i < n; i++) {
        infos[i].pid = live[i].pid;
        infos[i].usedGpuMemory = live[i].rec.used;
        infos[i].gpuInstanceId = infos[i].computeInstanceId = 0xFFFFFFFFu;
    }
    *count = n;
    return KIT_NVML_SUCCESS;
}

kit_nvmlReturn_t nvmlDeviceGetProcessUtilization(kit_nvmlDevice_t d,
                                                 kit_nvmlProcessUtilizationSample_t *s,
                                                 unsigned int *count,
                                                 unsigned long long last_seen) {
    live_t live[64];
    unsigned int n = live_procs(live, 64);
    struct timespec mono, real;
    clock_gettime(CLOCK_MONOTONIC, &mono);
    clock_gettime(CLOCK_REALTIME, &real);
    unsigned long long now = (unsigned long long)mono.tv_sec * 1000000000ULL + (unsigned long long)mono.tv_nsec;
    unsigned long long stamp = (unsigned long long)real.tv_sec * 1000000ULL + (unsigned long long)real.tv_nsec / 1000ULL;
    if (!n) return KIT_NVML_ERROR_NOT_FOUND;
    if (!s || *count < n) {
        *count = n;
        return KIT_NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < n; i++) {
        unsigned long long life = now > live[i].rec.start_ns ? now - live[i].rec.start_ns : 1;
        unsigned long long util = live[i].rec.busy_ns * 100ULL / (life ? life : 1);
        s[i].pid = live[i].pid;
        s[i].timeStamp = stamp > last_seen ? stamp : last_seen + 1;
        s[i].smUtil = (unsigned int)(util > 100 ? 100 : util);
        s[i].memUtil = s[i].encUtil = s[i].decUtil = 0;
    }
    *count = n;
    return KIT_NVML_SUCCESS;
}
