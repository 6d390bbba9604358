/*
 * Device memory: every path that consumes it reserves in the shared region before
 * the driver is called and gives back on failure or free; what the container is
 * shown (cuMemGetInfo, cuDeviceTotalMem) is its limit and its usage.
 */
#include "gs.h"

int gs_current_device(void) {
    CUdevice dev;
    if (!gs_real.cuCtxGetDevice || gs_real.cuCtxGetDevice(&dev) != CUDA_SUCCESS) return -1;
    return gs_record_of(dev);
}

static CUcontext current_ctx(void) {
    CUcontext ctx = NULL;
    if (gs_real.cuCtxGetCurrent) gs_real.cuCtxGetCurrent(&ctx);
    return ctx;
}

/*
 * The common shape of an allocation: reserve, call, roll back on failure, track.
 * `call` runs the driver function; `key` reads the handle it produced.
 */
#define GS_ALLOCATE(kind, dev, bytes, call, key)                                              \
    do {                                                                                      \
        if (!gs_reserve((dev), (bytes))) return CUDA_ERROR_OUT_OF_MEMORY;                     \
        CUresult rc_ = (call);                                                                \
        if (rc_ != CUDA_SUCCESS) {                                                            \
            gs_unreserve((dev), (bytes));                                                     \
            return rc_;                                                                       \
        }                                                                                     \
        gs_track_add((kind), (uint64_t)(key), (dev), (bytes), current_ctx());                 \
        return rc_;                                                                           \
    } while (0)

/* The common shape of a free: call, and on success give back what was tracked. */
static CUresult released(CUresult rc, enum gs_kind kind, uint64_t key) {
    int dev;
    uint64_t bytes;
    if (rc == CUDA_SUCCESS && gs_track_take(kind, key, &dev, &bytes)) gs_unreserve(dev, bytes);
    return rc;
}

/* ------------------------------------------------------------ linear memory */
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    int dev;
    if (!gs_enter() || !dptr || bytesize == 0 || (dev = gs_current_device()) == -1)
        return GS_CALL(cuMemAlloc_v2, (dptr, bytesize));
    GS_ALLOCATE(GS_K_MEM, dev, bytesize, GS_CALL(cuMemAlloc_v2, (dptr, bytesize)), *dptr);
}

CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    int dev;
    if (!gs_enter() || !dptr || bytesize == 0 || (dev = gs_current_device()) == -1)
        return GS_CALL(cuMemAllocManaged, (dptr, bytesize, flags));
    GS_ALLOCATE(GS_K_MEM, dev, bytesize, GS_CALL(cuMemAllocManaged, (dptr, bytesize, flags)), *dptr);
}

/* The driver picks the pitch; reserve for the widest it uses (512-byte rows) and
 * settle on the real size afterwards. */
CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                            unsigned int ElementSizeBytes) {
    int dev;
    if (!gs_enter() || !dptr || !pPitch || WidthInBytes == 0 || Height == 0 ||
        (dev = gs_current_device()) == -1)
        return GS_CALL(cuMemAllocPitch_v2, (dptr, pPitch, WidthInBytes, Height, ElementSizeBytes));
    uint64_t guess = ((WidthInBytes + 511) / 512) * 512 * (uint64_t)Height;
    if (!gs_reserve(dev, guess)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = GS_CALL(cuMemAllocPitch_v2, (dptr, pPitch, WidthInBytes, Height, ElementSizeBytes));
    if (rc != CUDA_SUCCESS) {
        gs_unreserve(dev, guess);
        return rc;
    }
    uint64_t real = (uint64_t)*pPitch * Height;
    if (real > guess && !gs_reserve(dev, real - guess)) {
        GS_CALL(cuMemFree_v2, (*dptr));
        gs_unreserve(dev, guess);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (real < guess) gs_unreserve(dev, guess - real);
    gs_track_add(GS_K_MEM, *dptr, dev, real, current_ctx());
    return rc;
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    if (!gs_enter()) return GS_CALL(cuMemFree_v2, (dptr));
    return released(GS_CALL(cuMemFree_v2, (dptr)), GS_K_MEM, dptr);
}

/* ------------------------------------------------------------ arrays */
static uint64_t format_bytes(CUarray_format f) {
    switch ((int)f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: return 2;
    default: return 4; /* 32-bit formats; the rest are no wider per channel */
    }
}

static uint64_t array_bytes(size_t w, size_t h, size_t d, CUarray_format f, unsigned channels) {
    return (uint64_t)w * (h ? h : 1) * (d ? d : 1) * format_bytes(f) * (channels ? channels : 1);
}

static uint64_t mipmap_bytes(const CUDA_ARRAY3D_DESCRIPTOR *a, unsigned levels) {
    uint64_t total = 0;
    size_t w = a->Width, h = a->Height, d = a->Depth;
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        total += array_bytes(w, h, d, a->Format, a->NumChannels);
        w = w > 1 ? w / 2 : 1;
        h = h > 1 ? h / 2 : h;
        d = d > 1 ? d / 2 : d;
    }
    return total;
}

CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *a) {
    int dev;
    if (!gs_enter() || !pHandle || !a || (dev = gs_current_device()) == -1)
        return GS_CALL(cuArrayCreate_v2, (pHandle, a));
    uint64_t bytes = array_bytes(a->Width, a->Height, 1, a->Format, a->NumChannels);
    GS_ALLOCATE(GS_K_ARRAY, dev, bytes, GS_CALL(cuArrayCreate_v2, (pHandle, a)), (uintptr_t)*pHandle);
}

CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *a) {
    int dev;
    if (!gs_enter() || !pHandle || !a || (dev = gs_current_device()) == -1)
        return GS_CALL(cuArray3DCreate_v2, (pHandle, a));
    uint64_t bytes = array_bytes(a->Width, a->Height, a->Depth, a->Format, a->NumChannels);
    GS_ALLOCATE(GS_K_ARRAY, dev, bytes, GS_CALL(cuArray3DCreate_v2, (pHandle, a)),
                (uintptr_t)*pHandle);
}

CUresult cuArrayDestroy(CUarray hArray) {
    if (!gs_enter()) return GS_CALL(cuArrayDestroy, (hArray));
    return released(GS_CALL(cuArrayDestroy, (hArray)), GS_K_ARRAY, (uintptr_t)hArray);
}

CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *a,
                                unsigned int numMipmapLevels) {
    int dev;
    if (!gs_enter() || !pHandle || !a || (dev = gs_current_device()) == -1)
        return GS_CALL(cuMipmappedArrayCreate, (pHandle, a, numMipmapLevels));
    GS_ALLOCATE(GS_K_MIPMAP, dev, mipmap_bytes(a, numMipmapLevels),
                GS_CALL(cuMipmappedArrayCreate, (pHandle, a, numMipmapLevels)), (uintptr_t)*pHandle);
}

CUresult cuMipmappedArrayDestroy(CUmipmappedArray h) {
    if (!gs_enter()) return GS_CALL(cuMipmappedArrayDestroy, (h));
    return released(GS_CALL(cuMipmappedArrayDestroy, (h)), GS_K_MIPMAP, (uintptr_t)h);
}

/* ------------------------------------------------------------ virtual memory management */
CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags) {
    if (!gs_enter() || !handle || !prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        prop->location.id < 0 || prop->location.id >= GS_MAX_DEVICES || size == 0)
        return GS_CALL(cuMemCreate, (handle, size, prop, flags));
    int dev = gs_record_of(prop->location.id);
    GS_ALLOCATE(GS_K_VMM, dev, size, GS_CALL(cuMemCreate, (handle, size, prop, flags)), *handle);
}

/* The driver frees the memory of a handle once it is released and unmapped
 * everywhere (applications commonly release right after mapping). */
static CUresult vmm_step(CUresult rc, uint64_t handle, enum gs_vmm_op op) {
    int dev;
    uint64_t bytes;
    if (rc == CUDA_SUCCESS && gs_track_vmm(handle, op, &dev, &bytes)) gs_unreserve(dev, bytes);
    return rc;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    if (!gs_enter()) return GS_CALL(cuMemRelease, (handle));
    return vmm_step(GS_CALL(cuMemRelease, (handle)), handle, GS_VMM_RELEASE);
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    if (!gs_enter()) return GS_CALL(cuMemMap, (ptr, size, offset, handle, flags));
    CUresult rc = GS_CALL(cuMemMap, (ptr, size, offset, handle, flags));
    if (rc == CUDA_SUCCESS) gs_map_add(ptr, size, handle);
    return vmm_step(rc, handle, GS_VMM_MAP);
}

static void unmapped(uint64_t handle) { vmm_step(CUDA_SUCCESS, handle, GS_VMM_UNMAP); }

/* One unmap may cover several mappings placed side by side: each one it covers
 * is gone. */
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    if (!gs_enter()) return GS_CALL(cuMemUnmap, (ptr, size));
    CUresult rc = GS_CALL(cuMemUnmap, (ptr, size));
    if (rc == CUDA_SUCCESS) gs_map_remove_range(ptr, size, unmapped);
    return rc;
}

/* ------------------------------------------------------------ stream-ordered pools
 * Counted as the bytes handed out: a pool's cached remainder is reusable only by
 * that pool and never exceeds its peak, which the limit bounds (so trimming it,
 * cuMemPoolTrimTo, changes no count and is not hooked). */
#define GS_ASYNC_ALLOC(fn, args)                                                              \
    do {                                                                                      \
        int dev_;                                                                             \
        if (!gs_enter() || !dptr || bytesize == 0 || (dev_ = gs_current_device()) == -1)        \
            return GS_CALL(fn, args);                                                         \
        GS_ALLOCATE(GS_K_MEM, dev_, bytesize, GS_CALL(fn, args), *dptr);                      \
    } while (0)

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    GS_ASYNC_ALLOC(cuMemAllocAsync, (dptr, bytesize, hStream));
}

CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    GS_ASYNC_ALLOC(cuMemAllocAsync_ptsz, (dptr, bytesize, hStream));
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                 CUstream hStream) {
    GS_ASYNC_ALLOC(cuMemAllocFromPoolAsync, (dptr, bytesize, pool, hStream));
}

CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                      CUstream hStream) {
    GS_ASYNC_ALLOC(cuMemAllocFromPoolAsync_ptsz, (dptr, bytesize, pool, hStream));
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    if (!gs_enter()) return GS_CALL(cuMemFreeAsync, (dptr, hStream));
    return released(GS_CALL(cuMemFreeAsync, (dptr, hStream)), GS_K_MEM, dptr);
}

CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    if (!gs_enter()) return GS_CALL(cuMemFreeAsync_ptsz, (dptr, hStream));
    return released(GS_CALL(cuMemFreeAsync_ptsz, (dptr, hStream)), GS_K_MEM, dptr);
}

/* ------------------------------------------------------------ what the container sees */
CUresult cuMemGetInfo_v2(size_t *free, size_t *total) {
    CUresult rc = GS_CALL(cuMemGetInfo_v2, (free, total));
    int dev;
    if (rc != CUDA_SUCCESS || !gs_enter() || !free || !total || (dev = gs_current_device()) == -1)
        return rc;
    uint64_t limit = gs_limit(dev);
    if (limit == GS_NO_LIMIT) return rc;
    gs_reclaim_maybe();
    uint64_t used = gs_used(dev);
    uint64_t left = used < limit ? limit - used : 0;
    *total = (size_t)(limit < *total ? limit : *total);
    *free = (size_t)(left < *free ? left : *free);
    return rc;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    CUresult rc = GS_CALL(cuDeviceTotalMem_v2, (bytes, dev));
    if (rc != CUDA_SUCCESS || !bytes || dev < 0 || dev >= GS_MAX_DEVICES) return rc;
    gs_init();
    uint64_t limit = gs_cfg.disabled ? GS_NO_LIMIT : gs_limit(gs_record_of(dev));
    if (limit != GS_NO_LIMIT && limit < *bytes) *bytes = (size_t)limit;
    return rc;
}
