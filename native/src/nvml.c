/* NVML's memory view inside the container: the limit as the total, the
 * container's usage as used. Other NVML calls (process lists included) pass
 * through untouched. */
#include <string.h>

#include "gs.h"

/* Region device of an NVML handle: by UUID once a CUDA process named the devices,
 * else by NVML index (the container sees only its own GPUs, in order). */
static int region_device(nvmlDevice_t device) {
    char uuid[GS_UUID_LEN] = {0};
    bool named = gs_real.nvmlDeviceGetUUID &&
                 gs_real.nvmlDeviceGetUUID(device, uuid, sizeof uuid) == NVML_SUCCESS;
    if (gs_cfg.granted || gs_cfg.visible_count > 0) { /* the list's order is the records' */
        for (int v = 0; named && v < gs_cfg.visible_count; v++)
            if (!strcmp(gs_cfg.visible_uuid[v], uuid)) return v;
        return -1;
    }
    if (named) {
        int d = gs_region_find_uuid(uuid);
        if (d >= 0) return d;
    }
    unsigned int index;
    if (gs_real.nvmlDeviceGetIndex && gs_real.nvmlDeviceGetIndex(device, &index) == NVML_SUCCESS &&
        index < GS_MAX_DEVICES && !gs_region->devices[index].uuid[0])
        return (int)index;
    return -1;
}

/* Fills total/free/used for the container; false when no limit applies. */
static bool container_view(nvmlDevice_t device, unsigned long long *total, unsigned long long *free,
                           unsigned long long *used) {
    gs_init();
    if (gs_cfg.disabled || !gs_region_map()) return false;
    int d = region_device(device);
    /* a device outside the container's list is not the container's: nothing of it */
    bool listed_only = gs_cfg.granted || gs_cfg.visible_count > 0;
    uint64_t limit = d >= 0 ? gs_limit(d) : listed_only ? 0 : GS_NO_LIMIT;
    if (limit == GS_NO_LIMIT || limit > *total) return false;
    gs_reclaim_maybe();
    uint64_t u = d >= 0 ? gs_used(d) : 0;
    *total = limit;
    *used = u < limit ? u : limit;
    *free = limit - *used;
    return true;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    gs_nvml_init();
    if (!gs_real.nvmlDeviceGetMemoryInfo) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t rc = gs_real.nvmlDeviceGetMemoryInfo(device, memory);
    if (rc == NVML_SUCCESS && memory) container_view(device, &memory->total, &memory->free, &memory->used);
    return rc;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    gs_nvml_init();
    if (!gs_real.nvmlDeviceGetMemoryInfo_v2) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t rc = gs_real.nvmlDeviceGetMemoryInfo_v2(device, memory);
    if (rc == NVML_SUCCESS && memory &&
        container_view(device, &memory->total, &memory->free, &memory->used))
        memory->reserved = 0; /* the driver's reservation is not the container's */
    return rc;
}
