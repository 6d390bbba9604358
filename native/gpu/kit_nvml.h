/*
 * The few NVML types and entry points the GPU kit uses. nvml.h is not part of
 * every CUDA install, and the kit reaches NVML through dlopen/dlsym anyway (so
 * that the interposer's dlsym is on the path), so they are declared here.
 * Layouts follow the published nvml.h ABI.
 */
#ifndef KIT_NVML_H
#define KIT_NVML_H

typedef int kit_nvmlReturn_t;
typedef struct kit_nvmlDevice_st *kit_nvmlDevice_t;

#define KIT_NVML_SUCCESS 0
#define KIT_NVML_ERROR_NOT_FOUND 6
#define KIT_NVML_ERROR_INSUFFICIENT_SIZE 7

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} kit_nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} kit_nvmlMemory_v2_t;

/* nvmlProcessInfo_t (the v2 layout, which ..._v3 fills) */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} kit_nvmlProcessInfo_t;

/* nvmlProcessUtilizationSample_t */
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} kit_nvmlProcessUtilizationSample_t;

/* NVML_STRUCT_VERSION(Memory, 2) */
#define KIT_NVML_MEMORY_V2_VERSION ((unsigned int)sizeof(kit_nvmlMemory_v2_t) | (2U << 24U))

typedef kit_nvmlReturn_t (*kit_nvmlInit_v2_fn)(void);
typedef kit_nvmlReturn_t (*kit_nvmlShutdown_fn)(void);
typedef const char *(*kit_nvmlErrorString_fn)(kit_nvmlReturn_t);
typedef kit_nvmlReturn_t (*kit_nvmlDeviceGetHandleByIndex_v2_fn)(unsigned int, kit_nvmlDevice_t *);
typedef kit_nvmlReturn_t (*kit_nvmlDeviceGetHandleByUUID_fn)(const char *, kit_nvmlDevice_t *);
typedef kit_nvmlReturn_t (*kit_nvmlDeviceGetMemoryInfo_fn)(kit_nvmlDevice_t, kit_nvmlMemory_t *);
typedef kit_nvmlReturn_t (*kit_nvmlDeviceGetMemoryInfo_v2_fn)(kit_nvmlDevice_t,
                                                              kit_nvmlMemory_v2_t *);
typedef kit_nvmlReturn_t (*kit_nvmlSystemGetDriverVersion_fn)(char *, unsigned int);
typedef kit_nvmlReturn_t (*kit_nvmlSystemGetCudaDriverVersion_v2_fn)(int *);
typedef kit_nvmlReturn_t (*kit_nvmlDeviceGetName_fn)(kit_nvmlDevice_t, char *, unsigned int);

#endif
