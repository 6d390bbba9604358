/*
 * fakenvml.c: a fake libnvidia-ml.so.1 (NVML) that agrees with fakecuda.c.
 * Built as build/fake/libnvidia-ml.so.1; with LD_LIBRARY_PATH pointing at
 * build/fake, pynvml (nvidia-ml-py) loads it like the real library.
 *
 * ENVIRONMENT (read by the nvmlInit* call that moves the library from
 * uninitialised to initialised, so a test may change it between an
 * nvmlShutdown and the next nvmlInit; sizes as in fakecuda.c: bytes, or a
 * suffix k/m/g/t = KiB/MiB/GiB/TiB):
 *   FAKECUDA_DEVICES  number of devices, default 1, at most 16
 *   FAKECUDA_MEMORY   total memory of each device, default 80g
 *   FAKENVML_USED     memory shown as used on every device, default 0
 *                     (capped at the total; free = total - used, reserved = 0)
 *   FAKENVML_PROCS    "pid:bytes,pid:bytes,..." the processes every device
 *                     lists in nvmlDeviceGetComputeRunningProcesses*; default
 *                     none; malformed entries are skipped, at most 64 kept
 *   FAKENVML_NAME     every device's name, default "Fake GPU" (at most 95
 *                     bytes kept)
 *   FAKENVML_NUMA     "n,n,...": device i's NUMA node is entry i; where there
 *                     is none (variable unset, entry missing, empty or
 *                     malformed) nvmlDeviceGetNumaNodeId returns
 *                     NVML_ERROR_NOT_SUPPORTED
 *   FAKENVML_MIG      "m,m,...": device i's current and pending MIG mode
 *                     (0 disabled, 1 enabled), entries as for FAKENVML_NUMA;
 *                     otherwise nvmlDeviceGetMigMode is NOT_SUPPORTED
 *   FAKENVML_LOST_FILE  a file naming lost devices: while it exists and lists
 *                     index i (decimal, separated by whitespace or commas),
 *                     every call on device i's handle returns
 *                     NVML_ERROR_GPU_IS_LOST. Only the path is read at init;
 *                     the file is read again on every such call, so a test may
 *                     create, change or remove it while the process runs.
 *   FAKENVML_UUIDS    "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx,...": device i's
 *                     UUID is entry i, with the rules of fakecuda.c's
 *                     FAKECUDA_UUIDS (hex in either case, blanks around an
 *                     entry ignored; a device with no entry, or an empty or
 *                     malformed one, keeps the default UUID below, the other
 *                     entries still apply; duplicates are not checked). Set it
 *                     to the same list as FAKECUDA_UUIDS for the two to agree:
 *                     this variable is not derived from that one.
 *   FAKENVML_GPU_UTIL, FAKENVML_MEM_UTIL  "n,n,...": device i's GPU and memory
 *                     utilisation in percent (nvmlDeviceGetUtilizationRates),
 *                     entries as for FAKENVML_NUMA; 0 where there is none
 *   FAKENVML_TEMPERATURE  "n,n,...": device i's GPU temperature in degrees C
 *                     (nvmlDeviceGetTemperature, NVML_TEMPERATURE_GPU; any other
 *                     sensor is NOT_SUPPORTED)
 *   FAKENVML_POWER    "n,n,...": device i's power draw in milliwatts
 *                     (nvmlDeviceGetPowerUsage)
 *   FAKENVML_ECC_CORRECTED, FAKENVML_ECC_UNCORRECTED  "n,n,...": device i's
 *                     ECC error count of that type (nvmlDeviceGetTotalEccErrors,
 *                     the same for the volatile and the aggregate counter)
 *                     For these four, a device with no entry (as for
 *                     FAKENVML_NUMA) answers NVML_ERROR_NOT_SUPPORTED.
 * A size that does not parse is taken as unset (the default applies); nothing
 * is ever printed.
 *
 * Device i has UUID "GPU-facefeed-0000-4000-8000-0000000000ii" (ii: i as two
 * lower-case hex digits), the same bytes fakecuda.c's cuDeviceGetUuid gives,
 * unless FAKENVML_UUIDS gives it one. nvmlDeviceGetUUID prints UUIDs with
 * lower-case hex, as NVML does (an upper-case FAKENVML_UUIDS entry comes back
 * lower-cased); nvmlDeviceGetHandleByUUID takes the hex in either case.
 * Minor number and index are i, and
 * nvmlDeviceGetProcessUtilization has no samples (NVML_ERROR_NOT_FOUND).
 * There is no event API (nvmlEventSet*, nvmlDeviceRegisterEvents) and no
 * nvmlDeviceGetPciInfo*: callers find the symbols missing.
 * nvmlInit* calls are counted and nvmlShutdown undoes one; every device
 * call made while uninitialised returns NVML_ERROR_UNINITIALIZED.
 */
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "gs_cuda.h"
#include "fake_size.h"
#include "fake_uuid.h"

#define API __attribute__((visibility("default")))

#define FAKE_MAX_DEVICES 16
#define FAKE_MAX_PROCS 64
#define FAKE_NAME_LEN 95 /* NVML_DEVICE_NAME_V2_BUFFER_SIZE - 1 */
#define FAKE_UNSET -1     /* a per-device value the variable does not give */

/* ---------------------------------------------------------------- local ABI
 * What gs_cuda.h leaves out, laid out as nvml.h (and pynvml's ctypes) have it. */
enum {
    FAKE_NVML_ERROR_NO_PERMISSION = 4,
    FAKE_NVML_ERROR_ALREADY_INITIALIZED = 5,
    FAKE_NVML_ERROR_DRIVER_NOT_LOADED = 9,
    FAKE_NVML_ERROR_TIMEOUT = 10,
    FAKE_NVML_ERROR_GPU_IS_LOST = 15,
    FAKE_NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
};
typedef struct { /* nvmlProcessInfo_v1_t: what the unversioned query fills */
    unsigned int pid;
    unsigned long long usedGpuMemory;
} FakeProcessInfoV1;
typedef struct {
    unsigned int gpu;
    unsigned int memory;
} FakeUtilization;
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} FakeProcessUtilizationSample;

#define FAKE_INVALID_INSTANCE 0xFFFFFFFFu /* gpu/compute instance id without MIG */
#define FAKE_UUID_LEN 40                  /* "GPU-" + 36 */

/* ------------------------------------------------------- exported prototypes */
API nvmlReturn_t nvmlInit(void);
API nvmlReturn_t nvmlInit_v2(void);
API nvmlReturn_t nvmlInitWithFlags(unsigned int flags);
API nvmlReturn_t nvmlShutdown(void);
API const char *nvmlErrorString(nvmlReturn_t result);
API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length);
API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion);
API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion);
API nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount);
API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount);
API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device);
API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device);
API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device);
API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length);
API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length);
API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index);
API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber);
API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory);
API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory);
API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                      FakeProcessInfoV1 *infos);
API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                         nvmlProcessInfo_t *infos);
API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                         nvmlProcessInfo_t *infos);
API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, FakeUtilization *utilization);
API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                      unsigned int *pendingMode);
API nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node);
API nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                                 FakeProcessUtilizationSample *utilization,
                                                 unsigned int *processSamplesCount,
                                                 unsigned long long lastSeenTimeStamp);
API nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, unsigned int sensorType,
                                          unsigned int *temp);
API nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power);
API nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, unsigned int errorType,
                                             unsigned int counterType,
                                             unsigned long long *eccCounts);

/* ------------------------------------------------------------------ state */
struct fdev {
    unsigned int index;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_refs; /* nvmlInit* calls not yet shut down */
static struct {
    unsigned int devices;
    uint64_t memory, used;
    unsigned int nprocs;
    struct {
        unsigned int pid;
        uint64_t bytes;
    } procs[FAKE_MAX_PROCS];
    char name[FAKE_NAME_LEN + 1];
    int numa[FAKE_MAX_DEVICES], mig[FAKE_MAX_DEVICES]; /* FAKE_UNSET: not supported */
    int gpu_util[FAKE_MAX_DEVICES], mem_util[FAKE_MAX_DEVICES]; /* FAKE_UNSET: 0 */
    int temperature[FAKE_MAX_DEVICES], power[FAKE_MAX_DEVICES]; /* FAKE_UNSET: not supported */
    int ecc[2][FAKE_MAX_DEVICES]; /* [corrected, uncorrected]; FAKE_UNSET: not supported */
    char lost_file[PATH_MAX];                         /* "" when unset */
    char uuid[FAKE_MAX_DEVICES][FAKE_UUID_LEN + 1];   /* lower-case hex */
} g_cfg;
static struct fdev g_devs[FAKE_MAX_DEVICES];

static uint64_t env_size(const char *name, uint64_t dflt) {
    uint64_t v;
    return parse_size(getenv(name), NULL, &v) ? v : dflt;
}

/* "pid:bytes,pid:bytes": keeps the well-formed entries. */
static void parse_procs(const char *s) {
    g_cfg.nprocs = 0;
    while (s && *s && g_cfg.nprocs < FAKE_MAX_PROCS) {
        const char *comma = strchr(s, ',');
        size_t len = comma ? (size_t)(comma - s) : strlen(s);
        char item[96];
        if (len < sizeof item) {
            memcpy(item, s, len);
            item[len] = '\0';
            char *colon = strchr(item, ':');
            uint64_t bytes;
            if (colon && colon > item) {
                *colon = '\0';
                char *end;
                errno = 0;
                unsigned long pid = strtoul(item, &end, 10);
                if (!errno && !*end && pid <= 0xFFFFFFFFul && parse_size(colon + 1, NULL, &bytes)) {
                    g_cfg.procs[g_cfg.nprocs].pid = (unsigned int)pid;
                    g_cfg.procs[g_cfg.nprocs].bytes = bytes;
                    g_cfg.nprocs++;
                }
            }
        }
        s = comma ? comma + 1 : NULL;
    }
}

/* "v,v,...": out[i] = entry i, FAKE_UNSET where missing, empty or malformed. */
static void parse_per_device(const char *s, int out[FAKE_MAX_DEVICES]) {
    for (unsigned int i = 0; i < FAKE_MAX_DEVICES; i++) out[i] = FAKE_UNSET;
    for (unsigned int i = 0; s && *s && i < FAKE_MAX_DEVICES; i++) {
        while (*s == ' ') s++;
        char *end;
        errno = 0;
        long v = isdigit((unsigned char)*s) ? strtol(s, &end, 10) : -1;
        if (v >= 0 && !errno && v <= INT_MAX && (*end == ',' || *end == '\0')) out[i] = (int)v;
        const char *comma = strchr(s, ',');
        s = comma ? comma + 1 : NULL;
    }
}

/* FAKENVML_UUIDS: entry i replaces out[i], hex lower-cased as NVML prints it,
 * when it parses (fake_uuid.h); other entries leave out[i] alone. */
static void parse_uuids(const char *s, char out[FAKE_MAX_DEVICES][FAKE_UUID_LEN + 1]) {
    unsigned char bytes[FAKE_MAX_DEVICES][16];
    bool set[FAKE_MAX_DEVICES] = {false};
    fake_uuid_list(s, FAKE_MAX_DEVICES, bytes, set);
    for (unsigned int i = 0; i < FAKE_MAX_DEVICES; i++) {
        if (!set[i]) continue;
        const unsigned char *b = bytes[i];
        snprintf(out[i], FAKE_UUID_LEN + 1,
                 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
                 b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
                 b[15]);
    }
}

/* Whether the FAKENVML_LOST_FILE lists device `index` now (called with g_mu held). */
static bool is_lost(unsigned int index) {
    if (!g_cfg.lost_file[0]) return false;
    FILE *f = fopen(g_cfg.lost_file, "r");
    if (!f) return false;
    char buf[4096];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    for (char *p = buf; *p;) {
        if (!isdigit((unsigned char)*p)) {
            p++;
            continue;
        }
        char *end;
        unsigned long v = strtoul(p, &end, 10);
        if (v == index) return true;
        p = end;
    }
    return false;
}

static void load_config(void) {
    uint64_t n = env_size("FAKECUDA_DEVICES", 1);
    g_cfg.devices = n > FAKE_MAX_DEVICES ? FAKE_MAX_DEVICES : (unsigned int)n;
    g_cfg.memory = env_size("FAKECUDA_MEMORY", (uint64_t)80 << 30);
    g_cfg.used = env_size("FAKENVML_USED", 0);
    if (g_cfg.used > g_cfg.memory) g_cfg.used = g_cfg.memory;
    parse_procs(getenv("FAKENVML_PROCS"));
    const char *name = getenv("FAKENVML_NAME");
    snprintf(g_cfg.name, sizeof g_cfg.name, "%s", name && *name ? name : "Fake GPU");
    parse_per_device(getenv("FAKENVML_NUMA"), g_cfg.numa);
    parse_per_device(getenv("FAKENVML_MIG"), g_cfg.mig);
    parse_per_device(getenv("FAKENVML_GPU_UTIL"), g_cfg.gpu_util);
    parse_per_device(getenv("FAKENVML_MEM_UTIL"), g_cfg.mem_util);
    parse_per_device(getenv("FAKENVML_TEMPERATURE"), g_cfg.temperature);
    parse_per_device(getenv("FAKENVML_POWER"), g_cfg.power);
    parse_per_device(getenv("FAKENVML_ECC_CORRECTED"), g_cfg.ecc[0]);
    parse_per_device(getenv("FAKENVML_ECC_UNCORRECTED"), g_cfg.ecc[1]);
    const char *lost = getenv("FAKENVML_LOST_FILE");
    if (!lost || snprintf(g_cfg.lost_file, sizeof g_cfg.lost_file, "%s", lost) >= PATH_MAX)
        g_cfg.lost_file[0] = '\0';
    for (unsigned int i = 0; i < FAKE_MAX_DEVICES; i++) {
        g_devs[i].index = i;
        snprintf(g_cfg.uuid[i], sizeof g_cfg.uuid[i], "GPU-facefeed-0000-4000-8000-0000000000%02x", i);
    }
    parse_uuids(getenv("FAKENVML_UUIDS"), g_cfg.uuid);
}

/* The device a handle names, or NULL; takes g_mu and keeps it when a device
 * is returned (the caller unlocks). *rc says why when NULL: a device listed in
 * FAKENVML_LOST_FILE gives NVML_ERROR_GPU_IS_LOST. */
static struct fdev *enter(nvmlDevice_t device, nvmlReturn_t *rc) {
    pthread_mutex_lock(&g_mu);
    if (g_refs == 0) {
        *rc = NVML_ERROR_UNINITIALIZED;
    } else {
        uintptr_t p = (uintptr_t)device, base = (uintptr_t)g_devs;
        if (p >= base && p < base + g_cfg.devices * sizeof g_devs[0] &&
            (p - base) % sizeof g_devs[0] == 0) {
            struct fdev *d = (struct fdev *)device;
            if (!is_lost(d->index)) return d;
            *rc = FAKE_NVML_ERROR_GPU_IS_LOST;
        } else {
            *rc = NVML_ERROR_INVALID_ARGUMENT;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return NULL;
}

static bool initialised(void) {
    pthread_mutex_lock(&g_mu);
    bool ok = g_refs > 0;
    pthread_mutex_unlock(&g_mu);
    return ok;
}


/* Copies s into buf of `length` bytes, or NVML_ERROR_INSUFFICIENT_SIZE. */
static nvmlReturn_t put_string(const char *s, char *buf, unsigned int length) {
    if (!buf) return NVML_ERROR_INVALID_ARGUMENT;
    size_t n = strlen(s);
    if (length <= n) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buf, s, n + 1);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------- init */
API nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    pthread_mutex_lock(&g_mu);
    if (g_refs == 0) load_config();
    g_refs++;
    pthread_mutex_unlock(&g_mu);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
API nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

API nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t rc = NVML_SUCCESS;
    if (g_refs == 0)
        rc = NVML_ERROR_UNINITIALIZED;
    else
        g_refs--;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case FAKE_NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case FAKE_NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case FAKE_NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case FAKE_NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case FAKE_NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case FAKE_NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

/* ----------------------------------------------------------------- system */
API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!initialised()) return NVML_ERROR_UNINITIALIZED;
    return put_string("580.65.06", version, length);
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion) {
    if (!initialised()) return NVML_ERROR_UNINITIALIZED;
    if (!cudaDriverVersion) return NVML_ERROR_INVALID_ARGUMENT;
    *cudaDriverVersion = 13000;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion) {
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

/* ---------------------------------------------------------------- devices */
API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t rc = NVML_SUCCESS;
    if (g_refs == 0)
        rc = NVML_ERROR_UNINITIALIZED;
    else if (!deviceCount)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else
        *deviceCount = g_cfg.devices;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount) { return nvmlDeviceGetCount_v2(deviceCount); }

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t rc = NVML_SUCCESS;
    if (g_refs == 0)
        rc = NVML_ERROR_UNINITIALIZED;
    else if (!device || index >= g_cfg.devices)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else
        *device = (nvmlDevice_t)&g_devs[index];
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t rc = NVML_ERROR_NOT_FOUND;
    if (g_refs == 0) {
        rc = NVML_ERROR_UNINITIALIZED;
    } else if (!uuid || !device) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        for (unsigned int i = 0; i < g_cfg.devices; i++) {
            if (strcasecmp(uuid, g_cfg.uuid[i]) == 0) {
                *device = (nvmlDevice_t)&g_devs[i];
                rc = NVML_SUCCESS;
                break;
            }
        }
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    nvmlReturn_t rc;
    struct fdev *d = enter(device, &rc);
    if (!d) return rc;
    rc = put_string(g_cfg.uuid[d->index], uuid, length);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    nvmlReturn_t rc;
    struct fdev *d = enter(device, &rc);
    if (!d) return rc;
    rc = put_string(g_cfg.name, name, length);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* For the one-unsigned-int queries: index, minor number, NUMA node (from
 * `per_device`, NOT_SUPPORTED where FAKE_UNSET; NULL for the index). */
static nvmlReturn_t device_uint(nvmlDevice_t device, unsigned int *out, const int *per_device) {
    nvmlReturn_t rc;
    struct fdev *d = enter(device, &rc);
    if (!d) return rc;
    rc = NVML_SUCCESS;
    if (!out)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (!per_device)
        *out = d->index;
    else if (per_device[d->index] == FAKE_UNSET)
        rc = NVML_ERROR_NOT_SUPPORTED;
    else
        *out = (unsigned int)per_device[d->index];
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    return device_uint(device, index, NULL);
}

API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber) {
    return device_uint(device, minorNumber, NULL);
}

API nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node) {
    return device_uint(device, node, g_cfg.numa);
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    nvmlReturn_t rc;
    struct fdev *d = enter(device, &rc);
    if (!d) return rc;
    rc = NVML_SUCCESS;
    if (!memory) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        memory->total = g_cfg.memory;
        memory->used = g_cfg.used;
        memory->free = g_cfg.memory - g_cfg.used;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    nvmlReturn_t rc;
    struct fdev *d = enter(device, &rc);
    if (!d) return rc;
    rc = NVML_SUCCESS;
    if (!memory) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (memory->version != nvmlMemory_v2) {
        rc = FAKE_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    } else {
        memory->total = g_cfg.memory;
        memory->reserved = 0;
        memory->used = g_cfg.used;
        memory->free = g_cfg.memory - g_cfg.used;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* The NVML size protocol: *infoCount in = room, out = entries (or entries
 * needed, with NVML_ERROR_INSUFFICIENT_SIZE). v1 rows are {pid, bytes}. */
static nvmlReturn_t running_processes(nvmlDevice_t device, unsigned int *infoCount, void *infos,
                                      bool v1) {
    nvmlReturn_t rc;
    struct fdev *d = enter(device, &rc);
    if (!d) return rc;
    unsigned int n = g_cfg.nprocs;
    rc = NVML_SUCCESS;
    if (!infoCount) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (*infoCount < n) {
        *infoCount = n;
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    } else if (n > 0 && !infos) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        for (unsigned int i = 0; i < n; i++) {
            if (v1) {
                FakeProcessInfoV1 *row = (FakeProcessInfoV1 *)infos + i;
                row->pid = g_cfg.procs[i].pid;
                row->usedGpuMemory = g_cfg.procs[i].bytes;
            } else {
                nvmlProcessInfo_t *row = (nvmlProcessInfo_t *)infos + i;
                row->pid = g_cfg.procs[i].pid;
                row->usedGpuMemory = g_cfg.procs[i].bytes;
                row->gpuInstanceId = FAKE_INVALID_INSTANCE;
                row->computeInstanceId = FAKE_INVALID_INSTANCE;
            }
        }
        *infoCount = n;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                      FakeProcessInfoV1 *infos) {
    return running_processes(device, infoCount, infos, true);
}

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                         nvmlProcessInfo_t *infos) {
    return running_processes(device, infoCount, infos, false);
}

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                         nvmlProcessInfo_t *infos) {
    return running_processes(device, infoCount, infos, false);
}

API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, FakeUtilization *utilization) {
    nvmlReturn_t rc;
    struct fdev *d = enter(device, &rc);
    if (!d) return rc;
    rc = NVML_SUCCESS;
    if (!utilization) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        int gpu = g_cfg.gpu_util[d->index], mem = g_cfg.mem_util[d->index];
        utilization->gpu = gpu == FAKE_UNSET ? 0 : (unsigned int)gpu;
        utilization->memory = mem == FAKE_UNSET ? 0 : (unsigned int)mem;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, unsigned int sensorType,
                                          unsigned int *temp) {
    if (sensorType != 0) { /* NVML_TEMPERATURE_GPU */
        nvmlReturn_t rc;
        if (!enter(device, &rc)) return rc;
        pthread_mutex_unlock(&g_mu);
        return NVML_ERROR_NOT_SUPPORTED;
    }
    return device_uint(device, temp, g_cfg.temperature);
}

API nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    return device_uint(device, power, g_cfg.power);
}

API nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, unsigned int errorType,
                                             unsigned int counterType,
                                             unsigned long long *eccCounts) {
    nvmlReturn_t rc;
    struct fdev *d = enter(device, &rc);
    if (!d) return rc;
    rc = NVML_SUCCESS;
    if (!eccCounts || errorType > 1 || counterType > 1) /* corrected/uncorrected, volatile/aggregate */
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (g_cfg.ecc[errorType][d->index] == FAKE_UNSET)
        rc = NVML_ERROR_NOT_SUPPORTED;
    else
        *eccCounts = (unsigned long long)g_cfg.ecc[errorType][d->index];
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                      unsigned int *pendingMode) {
    nvmlReturn_t rc;
    struct fdev *d = enter(device, &rc);
    if (!d) return rc;
    rc = NVML_SUCCESS;
    if (!currentMode || !pendingMode) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (g_cfg.mig[d->index] == FAKE_UNSET) {
        rc = NVML_ERROR_NOT_SUPPORTED;
    } else {
        *currentMode = (unsigned int)g_cfg.mig[d->index]; /* 1: NVML_DEVICE_MIG_ENABLE */
        *pendingMode = *currentMode;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                                 FakeProcessUtilizationSample *utilization,
                                                 unsigned int *processSamplesCount,
                                                 unsigned long long lastSeenTimeStamp) {
    nvmlReturn_t rc;
    struct fdev *d = enter(device, &rc);
    if (!d) return rc;
    rc = processSamplesCount ? NVML_ERROR_NOT_FOUND : NVML_ERROR_INVALID_ARGUMENT;
    if (processSamplesCount) *processSamplesCount = 0;
    pthread_mutex_unlock(&g_mu);
    return rc;
}
