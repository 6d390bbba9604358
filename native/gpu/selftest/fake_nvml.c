/*
 * A fake libnvidia-ml.so.1 for `make selftest`: reports the memory the fake
 * driver (fake_cuda.c, in the same process) shows: the limit when the fake plays
 * the interposer, the whole fake GPU under GS_FAKE_PLAIN. Only the entry points
 * the GPU kit calls (and the interposer's NVML hooks need).
 */
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "kit_nvml.h"

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
