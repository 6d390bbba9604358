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
 *   FAKENVML_MIG_GEOMETRY  "g,g,...": device i's MIG geometry, "a100-40gb" or
 *                     "h100-80gb" (entries as for FAKENVML_NUMA); a device with
 *                     no entry takes h100-80gb when FAKECUDA_MEMORY is 64g or
 *                     more, else a100-40gb. Only devices with a FAKENVML_MIG
 *                     entry answer the MIG calls (NOT_SUPPORTED otherwise).
 *   FAKENVML_MIG_FILE  where the MIG instances live: read before and written
 *                     (atomically) after every MIG call, so they outlive the
 *                     process as a card's instances outlive the agent, and a
 *                     test may write instances made "by someone else". Unset:
 *                     in memory, cleared by the first nvmlInit. Format below.
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
 *   FAKEGPU_STATE_DIR  the fake GPU state the fake driver's processes keep
 *                     (fake_state.h): when set, a device's running processes
 *                     are the live pids of the files in <dir>/procs with a context or
 *                     memory on it (usedGpuMemory = used_bytes; FAKENVML_PROCS
 *                     is then ignored; files of dead pids are removed), and
 *                     nvmlDeviceGetProcessUtilization answers one sample per
 *                     such pid: smUtil = percent of the wall time since the
 *                     previous such call on that device that its kernels ran
 *                     (busy_ns, plus the kernel running now up to its end in
 *                     the file's tail), timeStamp the
 *                     CLOCK_REALTIME now in microseconds; a pid seen for the
 *                     first time is only remembered (no sample yet), and a
 *                     call without samples answers NVML_ERROR_NOT_FOUND. The
 *                     size query (samples NULL) counts and remembers nothing.
 *                     Unset: no samples (NVML_ERROR_NOT_FOUND), as before.
 *   FAKENVML_NO_PROCESS_INFO  "i,j,...": devices whose running-process and
 *                     process-utilisation queries answer NVML_ERROR_NOT_SUPPORTED
 *                     (a card or driver that cannot tell)
 * A size that does not parse is taken as unset (the default applies); nothing
 * is ever printed.
 *
 * Device i has UUID "GPU-facefeed-0000-4000-8000-0000000000ii" (ii: i as two
 * lower-case hex digits), the same bytes fakecuda.c's cuDeviceGetUuid gives,
 * unless FAKENVML_UUIDS gives it one. nvmlDeviceGetUUID prints UUIDs with
 * lower-case hex, as NVML does (an upper-case FAKENVML_UUIDS entry comes back
 * lower-cased); nvmlDeviceGetHandleByUUID takes the hex in either case.
 * Minor number and index are i; without FAKEGPU_STATE_DIR
 * nvmlDeviceGetProcessUtilization has no samples (NVML_ERROR_NOT_FOUND).
 * There is no event API (nvmlEventSet*, nvmlDeviceRegisterEvents) and no
 * nvmlDeviceGetPciInfo*: callers find the symbols missing.
 *
 * MIG (NVML's calls as pynvml makes them): GPU instance profiles 0 (1g), 1 (2g),
 * 2 (3g), 3 (4g), 4 (7g) and 9 (1g with two memory slices) with an A100-40GB's
 * or H100-80GB's memory, SMs and placements (profile info v1 and v2, whose name
 * is NVIDIA's "MIG 1g.5gb"); possible placements; GPU instances created at a
 * placement (INVALID_ARGUMENT for a placement the profile lacks,
 * INSUFFICIENT_RESOURCES where it overlaps an instance) or anywhere free,
 * listed, found by id, described and destroyed (IN_USE while a compute
 * instance is on it); one compute instance per GPU instance, of the CI profile
 * with the GI's slice count (0..4 for 1, 2, 3, 4, 7 slices), covering it; and
 * the MIG devices those make, index i being the i-th GPU instance (by id)
 * with a compute instance: UUID "MIG-<serial>-...", memory (the profile's),
 * parent device, GI and CI ids. MIG calls on a device whose FAKENVML_MIG
 * entry is 0 fail NOT_SUPPORTED, as they do on a card with MIG off.
 * FAKENVML_MIG_FILE lines: "serial <n>" (MIG UUIDs made so far) and
 * "gi <device> <GI id 1..14> <profile id> <start slice> <CI: 0 or -1> <MIG UUID or ->";
 * lines that do not parse are skipped.
 *
 * nvmlInit* calls are counted and nvmlShutdown undoes one; every device
 * call made while uninitialised returns NVML_ERROR_UNINITIALIZED.
 *
 * MEMORY LIMITS (driver r615+ per-cgroup limits): nvmlDeviceSetMemoryLimits_v1
 * and nvmlDeviceGetMemoryLimits_v1 keep the limits in <FAKEGPU_STATE_DIR>/limits
 * (fake_limits.h), where the fake driver enforces them on every allocation.
 * Both answer NVML_ERROR_NOT_SUPPORTED on a MIG device handle, on a device
 * listed in FAKENVML_NO_MEMORY_LIMITS ("i,j,...", read at each call) and when
 * FAKEGPU_STATE_DIR is unset (no driver would enforce them);
 * NVML_ERROR_INVALID_ARGUMENT for a nameSpace that is not an existing
 * directory at or below the cgroup2 mount (or holds whitespace), or a soft
 * limit above the hard one. Soft 0 and hard NVML_DEVICE_MEMORY_LIMIT_MAX
 * (all ones) clears a limit; Get answers those where none is set, with
 * currentUsed the memory the group's processes hold (their procs files).
 * No root check.
 */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "gs_cuda.h"
#include "fake_size.h"
#include "fake_uuid.h"
#include "fake_state.h"

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
    int geometry[FAKE_MAX_DEVICES];                   /* 0: A100-40GB, 1: H100-80GB */
    char mig_file[PATH_MAX];                          /* "" when unset */
    char state_dir[PATH_MAX];                         /* FAKEGPU_STATE_DIR, "" when unset */
    bool no_process_info[FAKE_MAX_DEVICES];           /* FAKENVML_NO_PROCESS_INFO */
} g_cfg;
static void mig_reset(void);
static void state_load_config(void);
static nvmlReturn_t state_processes(unsigned int dev, unsigned int *infoCount, void *infos, bool v1);
static nvmlReturn_t state_utilization(unsigned int dev, FakeProcessUtilizationSample *samples,
                                      unsigned int *count, unsigned long long lastSeen);
static bool is_mig_handle(nvmlDevice_t device);
static nvmlReturn_t mig_device_uuid(nvmlDevice_t device, char *uuid, unsigned int length);
static nvmlReturn_t mig_device_memory(nvmlDevice_t device, unsigned long long *total);
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

/* FAKENVML_MIG_GEOMETRY "g,g,...": entry i names device i's MIG geometry,
 * "a100-40gb" or "h100-80gb"; otherwise it follows the card's memory. */
static void parse_geometry(const char *s) {
    for (unsigned int i = 0; i < FAKE_MAX_DEVICES; i++) {
        const char *comma = s ? strchr(s, ',') : NULL;
        size_t len = s ? (comma ? (size_t)(comma - s) : strlen(s)) : 0;
        if (len == 9 && strncasecmp(s, "h100-80gb", 9) == 0)
            g_cfg.geometry[i] = 1;
        else if (len == 9 && strncasecmp(s, "a100-40gb", 9) == 0)
            g_cfg.geometry[i] = 0;
        else
            g_cfg.geometry[i] = g_cfg.memory >= ((uint64_t)64 << 30);
        s = comma ? comma + 1 : NULL;
    }
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
    parse_geometry(getenv("FAKENVML_MIG_GEOMETRY"));
    const char *mig_file = getenv("FAKENVML_MIG_FILE");
    if (!mig_file || snprintf(g_cfg.mig_file, sizeof g_cfg.mig_file, "%s", mig_file) >= PATH_MAX)
        g_cfg.mig_file[0] = '\0';
    mig_reset();
    state_load_config();
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
    case 19: return "In use by another client";
    case 23: return "Insufficient resources";
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
    if (is_mig_handle(device)) return mig_device_uuid(device, uuid, length);
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
    if (is_mig_handle(device)) {
        unsigned long long total = 0;
        nvmlReturn_t rc = memory ? mig_device_memory(device, &total) : NVML_ERROR_INVALID_ARGUMENT;
        if (rc == NVML_SUCCESS) *memory = (nvmlMemory_t){.total = total, .free = total, .used = 0};
        return rc;
    }
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
    if (g_cfg.no_process_info[d->index] || g_cfg.state_dir[0]) {
        rc = g_cfg.no_process_info[d->index] ? NVML_ERROR_NOT_SUPPORTED
                                             : state_processes(d->index, infoCount, infos, v1);
        pthread_mutex_unlock(&g_mu);
        return rc;
    }
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
    if (g_cfg.no_process_info[d->index]) {
        rc = NVML_ERROR_NOT_SUPPORTED;
    } else if (g_cfg.state_dir[0] && processSamplesCount) {
        rc = state_utilization(d->index, utilization, processSamplesCount, lastSeenTimeStamp);
    } else {
        rc = processSamplesCount ? NVML_ERROR_NOT_FOUND : NVML_ERROR_INVALID_ARGUMENT;
        if (processSamplesCount) *processSamplesCount = 0;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}


/* --------------------------------------------- shared state (FAKEGPU_STATE_DIR)
 * The processes of the fake driver, read from their state files (fake_state.h).
 * Called with g_mu held. */
#define FAKE_STATE_MAX_PIDS 1024 /* processes listed per device */
#define FAKE_UTIL_HISTORY 1024   /* (device, pid) pairs remembered for utilisation */

static struct {
    unsigned int dev, pid;
    bool used;
    uint64_t at_ns, busy_ns; /* CLOCK_MONOTONIC of the previous sample, kernel time then */
} g_util[FAKE_UTIL_HISTORY];

struct state_row {
    unsigned int pid;
    uint64_t used_bytes, busy_ns; /* busy_ns: completed + the running kernel so far */
};

static void state_load_config(void) {
    const char *dir = getenv("FAKEGPU_STATE_DIR");
    if (!dir || snprintf(g_cfg.state_dir, sizeof g_cfg.state_dir, "%s", dir) >= PATH_MAX)
        g_cfg.state_dir[0] = '\0';
    int off[FAKE_MAX_DEVICES];
    for (unsigned int i = 0; i < FAKE_MAX_DEVICES; i++) off[i] = FAKE_UNSET;
    const char *s = getenv("FAKENVML_NO_PROCESS_INFO");
    while (s && *s) { /* "i,j,...": indices, not per-device values */
        char *end;
        errno = 0;
        unsigned long i = strtoul(s, &end, 10);
        if (!errno && end != s && i < FAKE_MAX_DEVICES) off[i] = 1;
        s = strchr(s, ',');
        if (s) s++;
    }
    for (unsigned int i = 0; i < FAKE_MAX_DEVICES; i++) g_cfg.no_process_info[i] = off[i] == 1;
    memset(g_util, 0, sizeof g_util);
}

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The live processes with a context or memory on dev, at most `room`; how many. */
static unsigned int state_rows(unsigned int dev, struct state_row *rows, unsigned int room) {
    char procs[PATH_MAX + 8];
    snprintf(procs, sizeof procs, "%s/procs", g_cfg.state_dir);
    DIR *dir = opendir(procs);
    if (!dir) return 0;
    int dfd = dirfd(dir);
    unsigned int n = 0;
    uint64_t now = mono_ns();
    struct dirent *ent;
    while ((ent = readdir(dir)) != NULL && n < room) {
        char *end;
        errno = 0;
        unsigned long pid = strtoul(ent->d_name, &end, 10);
        if (errno || *end || end == ent->d_name || pid == 0 || pid > INT32_MAX) continue;
        if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) {
            unlinkat(dfd, ent->d_name, 0); /* a process that died: its file is stale */
            continue;
        }
        int fd = openat(dfd, ent->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        if (fd < 0) continue;
        struct {
            struct fake_proc_state st;
            struct fake_proc_state_tail tail;
        } file;
        memset(&file, 0, sizeof file);
        ssize_t got = pread(fd, &file, sizeof file, 0);
        close(fd);
        struct fake_proc_state st = file.st;
        if (got < (ssize_t)sizeof st || st.magic != FAKE_STATE_MAGIC ||
            st.version != FAKE_STATE_VERSION || st.pid != (int32_t)pid || dev >= FAKE_STATE_DEVICES)
            continue;
        if (!st.ctx_count[dev] && !st.used_bytes[dev]) continue;
        uint64_t busy = st.busy_ns[dev];
        uint64_t run_end = got == (ssize_t)sizeof file ? file.tail.run_end_ns[dev] : 0;
        uint64_t until = run_end && run_end < now ? run_end : now; /* a card runs a kernel to its end only */
        if (st.run_start_ns[dev] && st.run_start_ns[dev] < until) busy += until - st.run_start_ns[dev];
        rows[n].pid = (unsigned int)pid;
        rows[n].used_bytes = st.used_bytes[dev];
        rows[n].busy_ns = busy;
        n++;
    }
    closedir(dir);
    return n;
}

static nvmlReturn_t state_processes(unsigned int dev, unsigned int *infoCount, void *infos, bool v1) {
    static struct state_row rows[FAKE_STATE_MAX_PIDS]; /* under g_mu */
    if (!infoCount) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = state_rows(dev, rows, FAKE_STATE_MAX_PIDS);
    if (*infoCount < n) {
        *infoCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (n > 0 && !infos) return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < n; i++) {
        if (v1) {
            FakeProcessInfoV1 *row = (FakeProcessInfoV1 *)infos + i;
            row->pid = rows[i].pid;
            row->usedGpuMemory = rows[i].used_bytes;
        } else {
            nvmlProcessInfo_t *row = (nvmlProcessInfo_t *)infos + i;
            row->pid = rows[i].pid;
            row->usedGpuMemory = rows[i].used_bytes;
            row->gpuInstanceId = FAKE_INVALID_INSTANCE;
            row->computeInstanceId = FAKE_INVALID_INSTANCE;
        }
    }
    *infoCount = n;
    return NVML_SUCCESS;
}

static nvmlReturn_t state_utilization(unsigned int dev, FakeProcessUtilizationSample *samples,
                                      unsigned int *count, unsigned long long lastSeen) {
    static struct state_row rows[FAKE_STATE_MAX_PIDS]; /* under g_mu */
    unsigned int n = state_rows(dev, rows, FAKE_STATE_MAX_PIDS);
    if (!samples) { /* the size query: counts, remembers nothing */
        *count = n;
        return n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_ERROR_NOT_FOUND;
    }
    struct timespec real;
    clock_gettime(CLOCK_REALTIME, &real);
    unsigned long long stamp = (unsigned long long)real.tv_sec * 1000000ull +
                               (unsigned long long)real.tv_nsec / 1000ull;
    uint64_t now = mono_ns();
    unsigned int out = 0;
    for (unsigned int i = 0; i < n; i++) {
        int slot = -1, free_slot = -1;
        for (int h = 0; h < FAKE_UTIL_HISTORY; h++) {
            if (g_util[h].used && g_util[h].dev == dev && g_util[h].pid == rows[i].pid) {
                slot = h;
                break;
            }
            if (!g_util[h].used && free_slot < 0) free_slot = h;
        }
        if (slot < 0) { /* first seen: remembered, no sample yet */
            if (free_slot < 0) free_slot = (int)(rows[i].pid % FAKE_UTIL_HISTORY);
            g_util[free_slot].used = true;
            g_util[free_slot].dev = dev;
            g_util[free_slot].pid = rows[i].pid;
            g_util[free_slot].at_ns = now;
            g_util[free_slot].busy_ns = rows[i].busy_ns;
            continue;
        }
        uint64_t span = now - g_util[slot].at_ns;
        uint64_t ran = rows[i].busy_ns > g_util[slot].busy_ns ? rows[i].busy_ns - g_util[slot].busy_ns : 0;
        g_util[slot].at_ns = now;
        g_util[slot].busy_ns = rows[i].busy_ns;
        if (out >= *count || stamp <= lastSeen || span == 0) continue;
        uint64_t pct = ran >= span ? 100 : ran * 100 / span;
        samples[out].pid = rows[i].pid;
        samples[out].timeStamp = stamp;
        samples[out].smUtil = (unsigned int)pct;
        samples[out].memUtil = 0;
        samples[out].encUtil = 0;
        samples[out].decUtil = 0;
        out++;
    }
    /* forget the pairs of this device whose process is gone */
    for (int h = 0; h < FAKE_UTIL_HISTORY; h++) {
        if (!g_util[h].used || g_util[h].dev != dev) continue;
        bool live = false;
        for (unsigned int i = 0; i < n && !live; i++) live = rows[i].pid == g_util[h].pid;
        if (!live) g_util[h].used = false;
    }
    *count = out;
    return out ? NVML_SUCCESS : NVML_ERROR_NOT_FOUND;
}

/* ------------------------------------------------------------------- MIG
 * GPU instances (GI), one compute instance (CI) covering each, and the MIG
 * devices they make. Handles are addresses in fixed tables indexed by
 * (device, GI id), so they stay valid while the state is read again. */
#define FAKE_MAX_GI 14        /* GI ids 1..14 */
#define FAKE_MIG_SLICES 8     /* memory slices of a card */
#define FAKE_MIG_UUID_LEN 40  /* "MIG-" + 36 */

struct fgeom_profile {
    unsigned int id, slices, count, sms, start0, step, size;
    unsigned long long memory_mib;
};
/* A100-40GB: 108 SMs (98 in MIG mode); H100-80GB: 132 SMs. Placements are
 * start0, start0+step, ... (count of them), each `size` memory slices. */
static const struct fgeom_profile FAKE_A100_40GB[] = {
    {0, 1, 7, 14, 0, 1, 1, 4864},  {9, 1, 4, 14, 0, 2, 2, 9856}, {1, 2, 3, 28, 0, 2, 2, 9856},
    {2, 3, 2, 42, 0, 4, 4, 19968}, {3, 4, 1, 56, 0, 4, 4, 19968}, {4, 7, 1, 98, 0, 8, 8, 40192},
};
static const struct fgeom_profile FAKE_H100_80GB[] = {
    {0, 1, 7, 16, 0, 1, 1, 9984},  {9, 1, 4, 16, 0, 2, 2, 20096}, {1, 2, 3, 32, 0, 2, 2, 20096},
    {2, 3, 2, 60, 0, 4, 4, 40320}, {3, 4, 1, 64, 0, 4, 4, 40320}, {4, 7, 1, 132, 0, 8, 8, 80896},
};
#define FAKE_GEOM_PROFILES 6

enum {
    FAKE_NVML_ERROR_IN_USE = 19,
    FAKE_NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
    FAKE_DEVICE_MIG_ENABLE = 1,
};

typedef struct {
    unsigned int start, size;
} FakeGiPlacement;
typedef struct { /* nvmlGpuInstanceProfileInfo_t */
    unsigned int id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount,
        copyEngineCount, decoderCount, encoderCount, jpegCount, ofaCount;
    unsigned long long memorySizeMB;
} FakeGiProfileInfo;
typedef struct { /* nvmlGpuInstanceProfileInfo_v2_t */
    unsigned int version, id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount,
        copyEngineCount, decoderCount, encoderCount, jpegCount, ofaCount;
    unsigned long long memorySizeMB;
    char name[96];
} FakeGiProfileInfoV2;
#define FAKE_GI_PROFILE_INFO_V2 0x02000098u
typedef struct { /* nvmlComputeInstanceProfileInfo_v2_t */
    unsigned int version, id, sliceCount, instanceCount, multiprocessorCount, sharedCopyEngineCount,
        sharedDecoderCount, sharedEncoderCount, sharedJpegCount, sharedOfaCount;
    char name[96];
} FakeCiProfileInfoV2;
#define FAKE_CI_PROFILE_INFO_V2 0x02000088u
struct fhandle {
    unsigned int dev, gi;
};
typedef struct fhandle *FakeGpuInstance;
typedef struct fhandle *FakeComputeInstance;
typedef struct { /* nvmlGpuInstanceInfo_t */
    nvmlDevice_t device;
    unsigned int id, profileId;
    FakeGiPlacement placement;
} FakeGiInfo;
typedef struct { /* nvmlComputeInstanceInfo_t */
    nvmlDevice_t device;
    FakeGpuInstance gpuInstance;
    unsigned int id, profileId;
    FakeGiPlacement placement;
} FakeCiInfo;

struct fgi {
    bool used, ci;
    unsigned int profile, start;
    char uuid[FAKE_MIG_UUID_LEN + 1]; /* the MIG device's, "" without a CI */
};
static struct {
    struct fgi gi[FAKE_MAX_DEVICES][FAKE_MAX_GI + 1]; /* [dev][id], id 0 unused */
    unsigned long serial;                             /* MIG UUIDs made so far */
} g_mig;
static struct fhandle g_gi_h[FAKE_MAX_DEVICES][FAKE_MAX_GI + 1];
static struct fhandle g_ci_h[FAKE_MAX_DEVICES][FAKE_MAX_GI + 1];
static struct fhandle g_migdev_h[FAKE_MAX_DEVICES][FAKE_MAX_GI + 1];

/* MIG calls (defined below) */
API nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                     FakeGiProfileInfo *info);
API nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile,
                                                      FakeGiProfileInfoV2 *info);
API nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t device, unsigned int profileId,
                                                               FakeGiPlacement *placements,
                                                               unsigned int *count);
API nvmlReturn_t nvmlDeviceCreateGpuInstance(nvmlDevice_t device, unsigned int profileId,
                                             FakeGpuInstance *gpuInstance);
API nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t device, unsigned int profileId,
                                                          const FakeGiPlacement *placement,
                                                          FakeGpuInstance *gpuInstance);
API nvmlReturn_t nvmlGpuInstanceDestroy(FakeGpuInstance gpuInstance);
API nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t device, unsigned int profileId,
                                           FakeGpuInstance *gpuInstances, unsigned int *count);
API nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id,
                                              FakeGpuInstance *gpuInstance);
API nvmlReturn_t nvmlGpuInstanceGetInfo(FakeGpuInstance gpuInstance, FakeGiInfo *info);
API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(FakeGpuInstance gpuInstance, unsigned int profile,
                                                               unsigned int engProfile,
                                                               FakeCiProfileInfoV2 *info);
API nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(FakeGpuInstance gpuInstance, unsigned int profileId,
                                                      FakeComputeInstance *computeInstance);
API nvmlReturn_t nvmlGpuInstanceGetComputeInstances(FakeGpuInstance gpuInstance, unsigned int profileId,
                                                    FakeComputeInstance *computeInstances,
                                                    unsigned int *count);
API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(FakeGpuInstance gpuInstance, unsigned int id,
                                                       FakeComputeInstance *computeInstance);
API nvmlReturn_t nvmlComputeInstanceGetInfo_v2(FakeComputeInstance computeInstance, FakeCiInfo *info);
API nvmlReturn_t nvmlComputeInstanceDestroy(FakeComputeInstance computeInstance);
API nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count);
API nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                     nvmlDevice_t *migDevice);
API nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice);
API nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device);
API nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id);
API nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id);

static void mig_reset(void) {
    memset(&g_mig, 0, sizeof g_mig);
    for (unsigned int d = 0; d < FAKE_MAX_DEVICES; d++)
        for (unsigned int id = 0; id <= FAKE_MAX_GI; id++) {
            g_gi_h[d][id] = g_ci_h[d][id] = g_migdev_h[d][id] = (struct fhandle){d, id};
        }
}

static const struct fgeom_profile *geometry(unsigned int dev) {
    return g_cfg.geometry[dev] ? FAKE_H100_80GB : FAKE_A100_40GB;
}

static const struct fgeom_profile *geom_profile(unsigned int dev, unsigned int id) {
    const struct fgeom_profile *g = geometry(dev);
    for (unsigned int i = 0; i < FAKE_GEOM_PROFILES; i++)
        if (g[i].id == id) return &g[i];
    return NULL;
}

/* "MIG <slices>g.<GB>gb", NVIDIA's name for a profile: its share of the card's
 * memory rounded up to eighths, times the card's size in whole GB. */
static void profile_name(const struct fgeom_profile *p, char *out, size_t len) {
    unsigned long long total_mib = g_cfg.memory >> 20, total_gb = (total_mib + 1023) / 1024;
    if (total_mib == 0) total_mib = 1;
    unsigned long long eighths = (p->memory_mib * 8 + total_mib - 1) / total_mib;
    snprintf(out, len, "MIG %ug.%llugb", p->slices, (eighths * total_gb + 4) / 8);
}

/* FAKENVML_MIG_FILE: the instances, read before and written after each MIG
 * call, so that they outlive the process as a card's do. Lines:
 *   serial <n>
 *   gi <dev> <id> <profile id> <start> <ci: 0 or -1> <MIG uuid or ->
 * Lines that do not parse, or name an unknown device, profile or id, are skipped. */
static void mig_load(void) {
    if (!g_cfg.mig_file[0]) return;
    FILE *f = fopen(g_cfg.mig_file, "r");
    memset(&g_mig, 0, sizeof g_mig);
    if (!f) return;
    char line[256];
    while (fgets(line, sizeof line, f)) {
        unsigned int dev, id, profile, start;
        int ci;
        char uuid[64];
        unsigned long serial;
        if (sscanf(line, "serial %lu", &serial) == 1) {
            g_mig.serial = serial;
        } else if (sscanf(line, "gi %u %u %u %u %d %63s", &dev, &id, &profile, &start, &ci, uuid) == 6 &&
                   dev < FAKE_MAX_DEVICES && id >= 1 && id <= FAKE_MAX_GI && geom_profile(dev, profile) &&
                   start < FAKE_MIG_SLICES && (ci == 0 || ci == -1)) {
            struct fgi *gi = &g_mig.gi[dev][id];
            gi->used = true;
            gi->profile = profile;
            gi->start = start;
            gi->ci = ci == 0;
            bool good = strlen(uuid) == FAKE_MIG_UUID_LEN && strncmp(uuid, "MIG-", 4) == 0;
            snprintf(gi->uuid, sizeof gi->uuid, "%.40s", gi->ci && good ? uuid : "");
            if (gi->ci && !gi->uuid[0]) gi->ci = false;
        }
    }
    fclose(f);
}

static nvmlReturn_t mig_save(void) {
    if (!g_cfg.mig_file[0]) return NVML_SUCCESS;
    char tmp[PATH_MAX + 8];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", g_cfg.mig_file) >= (int)sizeof tmp) return NVML_ERROR_UNKNOWN;
    FILE *f = fopen(tmp, "w");
    if (!f) return NVML_ERROR_UNKNOWN;
    fprintf(f, "serial %lu\n", g_mig.serial);
    for (unsigned int d = 0; d < FAKE_MAX_DEVICES; d++)
        for (unsigned int id = 1; id <= FAKE_MAX_GI; id++) {
            const struct fgi *gi = &g_mig.gi[d][id];
            if (gi->used)
                fprintf(f, "gi %u %u %u %u %d %s\n", d, id, gi->profile, gi->start, gi->ci ? 0 : -1,
                        gi->ci ? gi->uuid : "-");
        }
    bool ok = fclose(f) == 0;
    if (!ok || rename(tmp, g_cfg.mig_file) != 0) return NVML_ERROR_UNKNOWN;
    return NVML_SUCCESS;
}

/* A device handle with MIG enabled, g_mu held and the instances read (the
 * caller unlocks); NULL and *rc otherwise. `enabled`: MIG mode must be on. */
static struct fdev *enter_mig(nvmlDevice_t device, nvmlReturn_t *rc, bool enabled) {
    struct fdev *d = enter(device, rc);
    if (!d) return NULL;
    int mode = g_cfg.mig[d->index];
    if (mode == FAKE_UNSET || (enabled && mode != FAKE_DEVICE_MIG_ENABLE)) {
        *rc = NVML_ERROR_NOT_SUPPORTED;
        pthread_mutex_unlock(&g_mu);
        return NULL;
    }
    mig_load();
    return d;
}

/* An instance handle of `table` that names a live GI (with a CI when `ci`),
 * g_mu held (the caller unlocks); NULL and *rc otherwise. */
static struct fgi *enter_instance(const struct fhandle *h, struct fhandle table[][FAKE_MAX_GI + 1],
                                  bool ci, nvmlReturn_t *rc, unsigned int *dev) {
    pthread_mutex_lock(&g_mu);
    *rc = NVML_ERROR_INVALID_ARGUMENT;
    if (g_refs == 0) {
        *rc = NVML_ERROR_UNINITIALIZED;
    } else {
        uintptr_t p = (uintptr_t)h, base = (uintptr_t)&table[0][0];
        size_t span = sizeof(struct fhandle) * FAKE_MAX_DEVICES * (FAKE_MAX_GI + 1);
        if (h && p >= base && p < base + span && (p - base) % sizeof *h == 0 && h->dev < g_cfg.devices &&
            g_cfg.mig[h->dev] == FAKE_DEVICE_MIG_ENABLE) {
            mig_load();
            struct fgi *gi = &g_mig.gi[h->dev][h->gi];
            if (is_lost(h->dev)) {
                *rc = FAKE_NVML_ERROR_GPU_IS_LOST;
            } else if (gi->used && (!ci || gi->ci)) {
                *dev = h->dev;
                return gi;
            } else {
                *rc = NVML_ERROR_NOT_FOUND;
            }
        }
    }
    pthread_mutex_unlock(&g_mu);
    return NULL;
}

static void fill_profile_info(const struct fgeom_profile *p, FakeGiProfileInfo *info) {
    memset(info, 0, sizeof *info);
    info->id = p->id;
    info->sliceCount = p->slices;
    info->instanceCount = p->count;
    info->multiprocessorCount = p->sms;
    info->copyEngineCount = p->slices;
    info->memorySizeMB = p->memory_mib;
}

API nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                     FakeGiProfileInfo *info) {
    nvmlReturn_t rc;
    struct fdev *d = enter_mig(device, &rc, false);
    if (!d) return rc;
    const struct fgeom_profile *p = geom_profile(d->index, profile);
    rc = NVML_SUCCESS;
    if (!info || profile > 0x11)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (!p)
        rc = NVML_ERROR_NOT_SUPPORTED;
    else
        fill_profile_info(p, info);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile,
                                                      FakeGiProfileInfoV2 *info) {
    nvmlReturn_t rc;
    struct fdev *d = enter_mig(device, &rc, false);
    if (!d) return rc;
    const struct fgeom_profile *p = geom_profile(d->index, profile);
    rc = NVML_SUCCESS;
    if (!info || profile > 0x11) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (info->version != FAKE_GI_PROFILE_INFO_V2) {
        rc = FAKE_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    } else if (!p) {
        rc = NVML_ERROR_NOT_SUPPORTED;
    } else {
        FakeGiProfileInfo v1;
        fill_profile_info(p, &v1);
        unsigned int version = info->version;
        memset(info, 0, sizeof *info);
        info->version = version;
        info->id = v1.id;
        info->sliceCount = v1.sliceCount;
        info->instanceCount = v1.instanceCount;
        info->multiprocessorCount = v1.multiprocessorCount;
        info->copyEngineCount = v1.copyEngineCount;
        info->memorySizeMB = v1.memorySizeMB;
        profile_name(p, info->name, sizeof info->name);
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t device, unsigned int profileId,
                                                               FakeGiPlacement *placements,
                                                               unsigned int *count) {
    nvmlReturn_t rc;
    struct fdev *d = enter_mig(device, &rc, false);
    if (!d) return rc;
    const struct fgeom_profile *p = geom_profile(d->index, profileId);
    rc = NVML_SUCCESS;
    if (!count) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (!p) {
        rc = NVML_ERROR_NOT_SUPPORTED;
    } else if (!placements) {
        *count = p->count;
    } else if (*count < p->count) {
        *count = p->count;
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        for (unsigned int i = 0; i < p->count; i++) {
            placements[i].start = p->start0 + i * p->step;
            placements[i].size = p->size;
        }
        *count = p->count;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* The mask of memory slices the GIs of device `dev` cover. */
static unsigned int slices_taken(unsigned int dev) {
    unsigned int taken = 0;
    for (unsigned int id = 1; id <= FAKE_MAX_GI; id++) {
        const struct fgi *gi = &g_mig.gi[dev][id];
        if (gi->used) taken |= ((1u << geom_profile(dev, gi->profile)->size) - 1) << gi->start;
    }
    return taken;
}

static nvmlReturn_t create_gi(struct fdev *d, unsigned int profileId, const FakeGiPlacement *want,
                              FakeGpuInstance *out) {
    const struct fgeom_profile *p = geom_profile(d->index, profileId);
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (!p) return NVML_ERROR_NOT_SUPPORTED;
    unsigned int taken = slices_taken(d->index), start = FAKE_MIG_SLICES;
    for (unsigned int i = 0; i < p->count; i++) {
        unsigned int s = p->start0 + i * p->step, mask = ((1u << p->size) - 1) << s;
        if (want && (want->start != s || want->size != p->size)) continue;
        if (!(taken & mask)) {
            start = s;
            break;
        }
        if (want) return FAKE_NVML_ERROR_INSUFFICIENT_RESOURCES;
    }
    if (start == FAKE_MIG_SLICES) return want ? NVML_ERROR_INVALID_ARGUMENT : FAKE_NVML_ERROR_INSUFFICIENT_RESOURCES;
    unsigned int same = 0, id = 0;
    for (unsigned int i = FAKE_MAX_GI; i >= 1; i--) {
        if (!g_mig.gi[d->index][i].used) id = i;
        else if (g_mig.gi[d->index][i].profile == profileId) same++;
    }
    if (id == 0 || same >= p->count) return FAKE_NVML_ERROR_INSUFFICIENT_RESOURCES;
    struct fgi *gi = &g_mig.gi[d->index][id];
    memset(gi, 0, sizeof *gi);
    gi->used = true;
    gi->profile = profileId;
    gi->start = start;
    nvmlReturn_t rc = mig_save();
    if (rc != NVML_SUCCESS) {
        gi->used = false;
        return rc;
    }
    *out = &g_gi_h[d->index][id];
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceCreateGpuInstance(nvmlDevice_t device, unsigned int profileId,
                                             FakeGpuInstance *gpuInstance) {
    nvmlReturn_t rc;
    struct fdev *d = enter_mig(device, &rc, true);
    if (!d) return rc;
    rc = create_gi(d, profileId, NULL, gpuInstance);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t device, unsigned int profileId,
                                                          const FakeGiPlacement *placement,
                                                          FakeGpuInstance *gpuInstance) {
    nvmlReturn_t rc;
    struct fdev *d = enter_mig(device, &rc, true);
    if (!d) return rc;
    rc = placement ? create_gi(d, profileId, placement, gpuInstance) : NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlGpuInstanceDestroy(FakeGpuInstance gpuInstance) {
    nvmlReturn_t rc;
    unsigned int dev;
    struct fgi *gi = enter_instance(gpuInstance, g_gi_h, false, &rc, &dev);
    if (!gi) return rc;
    if (gi->ci) {
        rc = FAKE_NVML_ERROR_IN_USE; /* its compute instances go first */
    } else {
        gi->used = false;
        rc = mig_save();
        if (rc != NVML_SUCCESS) gi->used = true;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t device, unsigned int profileId,
                                           FakeGpuInstance *gpuInstances, unsigned int *count) {
    nvmlReturn_t rc;
    struct fdev *d = enter_mig(device, &rc, true);
    if (!d) return rc;
    rc = NVML_SUCCESS;
    if (!count || !gpuInstances) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (!geom_profile(d->index, profileId)) {
        rc = NVML_ERROR_NOT_SUPPORTED;
    } else {
        unsigned int n = 0;
        for (unsigned int id = 1; id <= FAKE_MAX_GI; id++) {
            const struct fgi *gi = &g_mig.gi[d->index][id];
            if (gi->used && gi->profile == profileId) gpuInstances[n++] = &g_gi_h[d->index][id];
        }
        *count = n; /* the caller's array has room for the profile's instanceCount */
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id,
                                              FakeGpuInstance *gpuInstance) {
    nvmlReturn_t rc;
    struct fdev *d = enter_mig(device, &rc, true);
    if (!d) return rc;
    rc = NVML_SUCCESS;
    if (!gpuInstance || id < 1 || id > FAKE_MAX_GI)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (!g_mig.gi[d->index][id].used)
        rc = NVML_ERROR_NOT_FOUND;
    else
        *gpuInstance = &g_gi_h[d->index][id];
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlGpuInstanceGetInfo(FakeGpuInstance gpuInstance, FakeGiInfo *info) {
    nvmlReturn_t rc;
    unsigned int dev;
    struct fgi *gi = enter_instance(gpuInstance, g_gi_h, false, &rc, &dev);
    if (!gi) return rc;
    rc = NVML_SUCCESS;
    if (!info) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        info->device = (nvmlDevice_t)&g_devs[dev];
        info->id = gpuInstance->gi;
        info->profileId = gi->profile;
        info->placement.start = gi->start;
        info->placement.size = geom_profile(dev, gi->profile)->size;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* Compute instances: one per GI, of the CI profile with the GI's slice count
 * (CI profile ids 0..4 are 1, 2, 3, 4 and 7 slices, as GI profiles 0..4). */
static unsigned int ci_profile_of(unsigned int dev, const struct fgi *gi) {
    return geom_profile(dev, gi->profile)->slices == 7 ? 4 : geom_profile(dev, gi->profile)->slices - 1;
}

API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(FakeGpuInstance gpuInstance, unsigned int profile,
                                                               unsigned int engProfile,
                                                               FakeCiProfileInfoV2 *info) {
    nvmlReturn_t rc;
    unsigned int dev;
    struct fgi *gi = enter_instance(gpuInstance, g_gi_h, false, &rc, &dev);
    if (!gi) return rc;
    rc = NVML_SUCCESS;
    if (!info || engProfile != 0) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (info->version != FAKE_CI_PROFILE_INFO_V2) {
        rc = FAKE_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    } else if (profile != ci_profile_of(dev, gi)) {
        rc = NVML_ERROR_NOT_SUPPORTED;
    } else {
        const struct fgeom_profile *p = geom_profile(dev, gi->profile);
        unsigned int version = info->version;
        memset(info, 0, sizeof *info);
        info->version = version;
        info->id = profile;
        info->sliceCount = p->slices;
        info->instanceCount = 1;
        info->multiprocessorCount = p->sms;
        snprintf(info->name, sizeof info->name, "MIG %ug", p->slices);
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(FakeGpuInstance gpuInstance, unsigned int profileId,
                                                      FakeComputeInstance *computeInstance) {
    nvmlReturn_t rc;
    unsigned int dev;
    struct fgi *gi = enter_instance(gpuInstance, g_gi_h, false, &rc, &dev);
    if (!gi) return rc;
    if (!computeInstance) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (profileId != ci_profile_of(dev, gi)) {
        rc = NVML_ERROR_NOT_SUPPORTED;
    } else if (gi->ci) {
        rc = FAKE_NVML_ERROR_INSUFFICIENT_RESOURCES;
    } else {
        unsigned long serial = ++g_mig.serial;
        gi->ci = true;
        snprintf(gi->uuid, sizeof gi->uuid, "MIG-%08lx-%04x-4%03x-8000-%012lx", serial & 0xffffffffUL,
                 dev & 0xffffu, gpuInstance->gi & 0xfffu, serial);
        rc = mig_save();
        if (rc != NVML_SUCCESS) {
            gi->ci = false;
            gi->uuid[0] = '\0';
        } else {
            *computeInstance = &g_ci_h[dev][gpuInstance->gi];
        }
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlGpuInstanceGetComputeInstances(FakeGpuInstance gpuInstance, unsigned int profileId,
                                                    FakeComputeInstance *computeInstances,
                                                    unsigned int *count) {
    nvmlReturn_t rc;
    unsigned int dev;
    struct fgi *gi = enter_instance(gpuInstance, g_gi_h, false, &rc, &dev);
    if (!gi) return rc;
    rc = NVML_SUCCESS;
    if (!computeInstances || !count) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (profileId != ci_profile_of(dev, gi)) {
        *count = 0;
    } else {
        *count = gi->ci ? 1 : 0;
        if (gi->ci) computeInstances[0] = &g_ci_h[dev][gpuInstance->gi];
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(FakeGpuInstance gpuInstance, unsigned int id,
                                                       FakeComputeInstance *computeInstance) {
    nvmlReturn_t rc;
    unsigned int dev;
    struct fgi *gi = enter_instance(gpuInstance, g_gi_h, false, &rc, &dev);
    if (!gi) return rc;
    rc = NVML_SUCCESS;
    if (!computeInstance)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (id != 0 || !gi->ci)
        rc = NVML_ERROR_NOT_FOUND;
    else
        *computeInstance = &g_ci_h[dev][gpuInstance->gi];
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlComputeInstanceGetInfo_v2(FakeComputeInstance computeInstance, FakeCiInfo *info) {
    nvmlReturn_t rc;
    unsigned int dev;
    struct fgi *gi = enter_instance(computeInstance, g_ci_h, true, &rc, &dev);
    if (!gi) return rc;
    rc = NVML_SUCCESS;
    if (!info) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        info->device = (nvmlDevice_t)&g_devs[dev];
        info->gpuInstance = &g_gi_h[dev][computeInstance->gi];
        info->id = 0;
        info->profileId = ci_profile_of(dev, gi);
        info->placement.start = 0;
        info->placement.size = geom_profile(dev, gi->profile)->slices;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlComputeInstanceDestroy(FakeComputeInstance computeInstance) {
    nvmlReturn_t rc;
    unsigned int dev;
    struct fgi *gi = enter_instance(computeInstance, g_ci_h, true, &rc, &dev);
    if (!gi) return rc;
    char uuid[sizeof gi->uuid];
    memcpy(uuid, gi->uuid, sizeof uuid);
    gi->ci = false;
    gi->uuid[0] = '\0';
    rc = mig_save();
    if (rc != NVML_SUCCESS) {
        gi->ci = true;
        memcpy(gi->uuid, uuid, sizeof uuid);
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* ------------------------------------------------------------ MIG devices
 * One per GI with a CI; index i is the i-th such GI by id. */
API nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    nvmlReturn_t rc;
    struct fdev *d = enter_mig(device, &rc, false);
    if (!d) return rc;
    rc = NVML_SUCCESS;
    if (!count)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else
        *count = g_cfg.mig[d->index] == FAKE_DEVICE_MIG_ENABLE ? 7 : 0;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                     nvmlDevice_t *migDevice) {
    nvmlReturn_t rc;
    struct fdev *d = enter_mig(device, &rc, true);
    if (!d) return rc;
    rc = migDevice ? NVML_ERROR_NOT_FOUND : NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = 0;
    for (unsigned int id = 1; migDevice && id <= FAKE_MAX_GI; id++) {
        if (!g_mig.gi[d->index][id].ci) continue;
        if (n++ == index) {
            *migDevice = (nvmlDevice_t)&g_migdev_h[d->index][id];
            rc = NVML_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* Whether `device` lies in the MIG device table (no lock needed: addresses only). */
static bool is_mig_handle(nvmlDevice_t device) {
    uintptr_t p = (uintptr_t)device, base = (uintptr_t)&g_migdev_h[0][0];
    return p >= base && p < base + sizeof g_migdev_h && (p - base) % sizeof(struct fhandle) == 0;
}

API nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    if (!isMigDevice) return NVML_ERROR_INVALID_ARGUMENT;
    if (!is_mig_handle(device)) {
        nvmlReturn_t rc;
        if (!enter(device, &rc)) return rc;
        pthread_mutex_unlock(&g_mu);
    }
    *isMigDevice = is_mig_handle(device);
    return NVML_SUCCESS;
}

/* A MIG device handle's GI (with its CI), g_mu held; NULL and *rc otherwise. */
static struct fgi *enter_mig_device(nvmlDevice_t device, nvmlReturn_t *rc, unsigned int *dev) {
    return enter_instance((const struct fhandle *)device, g_migdev_h, true, rc, dev);
}

API nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device) {
    nvmlReturn_t rc;
    unsigned int dev;
    if (!enter_mig_device(migDevice, &rc, &dev)) return rc;
    rc = device ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
    if (device) *device = (nvmlDevice_t)&g_devs[dev];
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    nvmlReturn_t rc;
    unsigned int dev;
    if (!enter_mig_device(device, &rc, &dev)) return rc;
    rc = id ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
    if (id) *id = ((const struct fhandle *)device)->gi;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    nvmlReturn_t rc;
    unsigned int dev;
    if (!enter_mig_device(device, &rc, &dev)) return rc;
    rc = id ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
    if (id) *id = 0;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* UUID and memory of a MIG device (nvmlDeviceGetUUID, nvmlDeviceGetMemoryInfo*). */
static nvmlReturn_t mig_device_uuid(nvmlDevice_t device, char *uuid, unsigned int length) {
    nvmlReturn_t rc;
    unsigned int dev;
    struct fgi *gi = enter_mig_device(device, &rc, &dev);
    if (!gi) return rc;
    rc = put_string(gi->uuid, uuid, length);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

static nvmlReturn_t mig_device_memory(nvmlDevice_t device, unsigned long long *total) {
    nvmlReturn_t rc;
    unsigned int dev;
    struct fgi *gi = enter_mig_device(device, &rc, &dev);
    if (!gi) return rc;
    *total = geom_profile(dev, gi->profile)->memory_mib << 20;
    pthread_mutex_unlock(&g_mu);
    return NVML_SUCCESS;
}

#include "fake_limits.h"

/* ------------------------------------------------------------ memory limits
 * nvmlSetMemoryLimits_v1_t / nvmlGetMemoryLimits_v1_t as nvml.h (CUDA 13.4)
 * lays them out: no version field. */
typedef struct {
    const char *nameSpace;
    unsigned long long softLimit, hardLimit;
} FakeSetMemoryLimitsV1;
typedef struct {
    const char *nameSpace;
    unsigned long long softLimit, hardLimit, currentUsed;
} FakeGetMemoryLimitsV1;

API nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device, FakeSetMemoryLimitsV1 *limits);
API nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device, FakeGetMemoryLimitsV1 *limits);

/* Whether FAKENVML_NO_MEMORY_LIMITS lists device `index`. */
static bool limits_unsupported(unsigned int index) {
    const char *s = getenv("FAKENVML_NO_MEMORY_LIMITS");
    while (s && *s) {
        char *end;
        unsigned long v = strtoul(s, &end, 10);
        if (end != s && v == index) return true;
        s = strchr(end, ',');
        if (s) s++;
    }
    return false;
}

/* The device index for a limits call, or an error: g_mu is not held after. */
static nvmlReturn_t limits_device(nvmlDevice_t device, const char *ns, unsigned int *index,
                                  char root[PATH_MAX]) {
    if (is_mig_handle(device)) return NVML_ERROR_NOT_SUPPORTED;
    nvmlReturn_t rc;
    struct fdev *d = enter(device, &rc);
    if (!d) return rc;
    *index = d->index;
    pthread_mutex_unlock(&g_mu);
    if (limits_unsupported(*index) || !fake_state_dir()) return NVML_ERROR_NOT_SUPPORTED;
    struct stat st;
    if (!ns || ns[0] != '/' || strpbrk(ns, " \t\n\r") || strlen(ns) >= PATH_MAX ||
        !fake_cgroup2_root(root, PATH_MAX) || !fake_path_within(ns, root) || stat(ns, &st) != 0 ||
        !S_ISDIR(st.st_mode))
        return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device, FakeSetMemoryLimitsV1 *limits) {
    if (!limits) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int index;
    char root[PATH_MAX];
    nvmlReturn_t rc = limits_device(device, limits->nameSpace, &index, root);
    if (rc) return rc;
    if (limits->softLimit > limits->hardLimit) return NVML_ERROR_INVALID_ARGUMENT;
    const char *dir = fake_state_dir();
    char lock[PATH_MAX], path[PATH_MAX], tmp[PATH_MAX];
    if (snprintf(lock, sizeof lock, "%s/limits.lock", dir) >= (int)sizeof lock ||
        snprintf(path, sizeof path, "%s/limits", dir) >= (int)sizeof path ||
        snprintf(tmp, sizeof tmp, "%s/limits.%d", dir, (int)getpid()) >= (int)sizeof tmp)
        return NVML_ERROR_INVALID_ARGUMENT;
    static struct fake_limit have[FAKE_LIMITS_MAX]; /* under g_limits_mu */
    static pthread_mutex_t g_limits_mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&g_limits_mu);
    int fd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0 || flock(fd, LOCK_EX) != 0) {
        if (fd >= 0) close(fd);
        pthread_mutex_unlock(&g_limits_mu);
        return NVML_ERROR_UNKNOWN;
    }
    int n = fake_limits_read(dir, have, FAKE_LIMITS_MAX);
    FILE *out = fopen(tmp, "we");
    rc = out ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
    bool clear = limits->softLimit == 0 && limits->hardLimit == FAKE_LIMIT_NONE;
    int kept = 0;
    for (int i = 0; out && i < n; i++) {
        if (have[i].dev == index && strcmp(have[i].ns, limits->nameSpace) == 0) continue;
        fprintf(out, "%u %s %llu %llu\n", have[i].dev, have[i].ns,
                (unsigned long long)have[i].soft, (unsigned long long)have[i].hard);
        kept++;
    }
    if (out && !clear && kept >= FAKE_LIMITS_MAX) rc = FAKE_NVML_ERROR_INSUFFICIENT_RESOURCES;
    if (out && !clear && !rc)
        fprintf(out, "%u %s %llu %llu\n", index, limits->nameSpace, limits->softLimit,
                limits->hardLimit);
    if (out && fclose(out) != 0) rc = NVML_ERROR_UNKNOWN;
    if (out && !rc && rename(tmp, path) != 0) rc = NVML_ERROR_UNKNOWN;
    if (out && rc) unlink(tmp);
    flock(fd, LOCK_UN);
    close(fd);
    pthread_mutex_unlock(&g_limits_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device, FakeGetMemoryLimitsV1 *limits) {
    if (!limits) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int index;
    char root[PATH_MAX];
    nvmlReturn_t rc = limits_device(device, limits->nameSpace, &index, root);
    if (rc) return rc;
    static struct fake_limit have[FAKE_LIMITS_MAX];
    static pthread_mutex_t g_read_mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&g_read_mu);
    int n = fake_limits_read(fake_state_dir(), have, FAKE_LIMITS_MAX);
    limits->softLimit = 0;
    limits->hardLimit = FAKE_LIMIT_NONE;
    for (int i = 0; i < n; i++) {
        if (have[i].dev == index && strcmp(have[i].ns, limits->nameSpace) == 0) {
            limits->softLimit = have[i].soft;
            limits->hardLimit = have[i].hard;
        }
    }
    pthread_mutex_unlock(&g_read_mu);
    limits->currentUsed = fake_ns_used(fake_state_dir(), index, limits->nameSpace, root, 0);
    return NVML_SUCCESS;
}

/*
 * GRAPHICS AND MPS PROCESSES: FAKENVML_GRAPHICS_PROCS and FAKENVML_MPS_PROCS
 * ("pid:bytes,pid:bytes,...", read at each call, at most 64 entries, malformed
 * ones skipped) are the processes every device lists in
 * nvmlDeviceGetGraphicsRunningProcesses* (a Vulkan or OpenGL process, which the
 * compute list does not show) and nvmlDeviceGetMPSComputeRunningProcesses* (MPS
 * clients); none by default. A device in FAKENVML_NO_PROCESS_INFO answers
 * NVML_ERROR_NOT_SUPPORTED, as for the compute list.
 */
API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                          nvmlProcessInfo_t *infos);
API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                          nvmlProcessInfo_t *infos);
API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos);
API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos);

static nvmlReturn_t env_processes(const char *var, nvmlDevice_t device, unsigned int *infoCount,
                                  nvmlProcessInfo_t *infos) {
    nvmlReturn_t rc;
    struct fdev *d = enter(device, &rc);
    if (!d) return rc;
    unsigned int pids[64];
    uint64_t bytes[64];
    unsigned int n = 0;
    for (const char *s = getenv(var); s && *s && n < 64;) {
        const char *comma = strchr(s, ',');
        size_t len = comma ? (size_t)(comma - s) : strlen(s);
        char item[96];
        char *colon, *end;
        if (len < sizeof item) {
            memcpy(item, s, len);
            item[len] = '\0';
            colon = strchr(item, ':');
            if (colon && colon > item) {
                *colon = '\0';
                errno = 0;
                unsigned long pid = strtoul(item, &end, 10);
                if (!errno && !*end && pid <= 0xFFFFFFFFul && parse_size(colon + 1, NULL, &bytes[n]))
                    pids[n++] = (unsigned int)pid;
            }
        }
        s = comma ? comma + 1 : NULL;
    }
    if (g_cfg.no_process_info[d->index]) {
        rc = NVML_ERROR_NOT_SUPPORTED;
    } else if (!infoCount) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (*infoCount < n) {
        *infoCount = n;
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    } else if (n > 0 && !infos) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        for (unsigned int i = 0; i < n; i++) {
            infos[i].pid = pids[i];
            infos[i].usedGpuMemory = bytes[i];
            infos[i].gpuInstanceId = FAKE_INVALID_INSTANCE;
            infos[i].computeInstanceId = FAKE_INVALID_INSTANCE;
        }
        *infoCount = n;
        rc = NVML_SUCCESS;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device,
                                                          unsigned int *infoCount,
                                                          nvmlProcessInfo_t *infos) {
    return env_processes("FAKENVML_GRAPHICS_PROCS", device, infoCount, infos);
}

API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device,
                                                          unsigned int *infoCount,
                                                          nvmlProcessInfo_t *infos) {
    return env_processes("FAKENVML_GRAPHICS_PROCS", device, infoCount, infos);
}

API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device,
                                                            unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos) {
    return env_processes("FAKENVML_MPS_PROCS", device, infoCount, infos);
}

API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t device,
                                                            unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos) {
    return env_processes("FAKENVML_MPS_PROCS", device, infoCount, infos);
}
