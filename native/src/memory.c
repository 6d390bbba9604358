/*
 * Device memory: every path that consumes it reserves in the shared region before
 * the driver is called and gives back on failure or free; what the container is
 * shown (cuMemGetInfo, cuDeviceTotalMem) is its limit and its usage.
 */
#include <pthread.h>

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
        if (!gs_reserve_trimming((dev), (bytes))) return CUDA_ERROR_OUT_OF_MEMORY;                \
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

/* Managed memory attached to the host (CU_MEM_ATTACH_HOST) lives in host memory
 * until a kernel touches it, and the driver evicts its migrated pages under
 * pressure: it cannot hold a neighbour's device memory, so it is not charged (the
 * node agent measures what becomes resident). Attached globally it is charged in
 * full, as a device allocation. */
#define GS_MEM_ATTACH_HOST 0x2u

CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    int dev;
    if (!gs_enter() || !dptr || bytesize == 0 || (flags & GS_MEM_ATTACH_HOST) ||
        (dev = gs_current_device()) == -1)
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
    if (!gs_reserve_trimming(dev, guess)) return CUDA_ERROR_OUT_OF_MEMORY;
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

/* A handle imported from another process is charged here, when mapped: the
 * importer holds the memory for as long as it keeps the handle or a mapping,
 * whatever the exporter does. */
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    if (!gs_enter()) return GS_CALL(cuMemMap, (ptr, size, offset, handle, flags));
    int dev = -1;
    uint64_t extra = gs_track_vmm_shortfall(handle, (uint64_t)offset + size, &dev);
    if (extra && !gs_reserve_trimming(dev, extra)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = GS_CALL(cuMemMap, (ptr, size, offset, handle, flags));
    if (extra && (rc != CUDA_SUCCESS || !gs_track_vmm_grow(handle, (uint64_t)offset + size)))
        gs_unreserve(dev, extra);
    if (rc == CUDA_SUCCESS) gs_map_add(ptr, size, handle);
    return vmm_step(rc, handle, GS_VMM_MAP);
}

/* A retained handle is one more reference: the memory lives until it too is
 * released. */
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    gs_init();
    CUresult rc = GS_CALL(cuMemRetainAllocationHandle, (handle, addr));
    if (rc == CUDA_SUCCESS && handle && gs_enter()) vmm_step(rc, *handle, GS_VMM_RETAIN);
    return rc;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                        int shHandleType) {
    int dev;
    if (!gs_enter() || !handle || (dev = gs_current_device()) == -1)
        return GS_CALL(cuMemImportFromShareableHandle, (handle, osHandle, shHandleType));
    if (!gs_reserve(dev, 0)) return CUDA_ERROR_OUT_OF_MEMORY; /* a device not granted */
    CUresult rc = GS_CALL(cuMemImportFromShareableHandle, (handle, osHandle, shHandleType));
    if (rc == CUDA_SUCCESS) gs_track_vmm_import(*handle, dev, current_ctx());
    return rc;
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
 * A pool holds device memory beyond what it hands out: freed blocks stay reserved
 * up to its release threshold, and several pools each keep their own. The bytes
 * handed out are charged per allocation; what each pool of this process holds
 * beyond them (the driver's RESERVED_MEM_CURRENT - USED_MEM_CURRENT) is charged
 * to the pool, settled after every stream-ordered allocation and free (and at
 * cuMemPoolTrimTo and cuMemGetInfo: a free the driver has not reached in stream
 * order yet shows up at the next settling). When a
 * reservation does not fit, the process's pools are trimmed (cuMemPoolTrimTo) and
 * it is tried once more; a pool whose cached bytes do not fit is trimmed at once.
 *
 * An allocation or free into a stream under capture joins the graph being
 * built: graphmem.c charges it to that graph (not to a pool), and a captured
 * free gives nothing back. */
enum { GS_MEMPOOL_RESERVED = 5, GS_MEMPOOL_USED = 7, GS_MAX_POOLS = 64 };

typedef struct {
    CUmemoryPool pool;
    int dev;           /* region record */
    uint64_t charged;  /* cached bytes reserved for it */
} pool_entry_t;

static pthread_mutex_t pools_mu = PTHREAD_MUTEX_INITIALIZER;
static pool_entry_t pools[GS_MAX_POOLS];
static int pool_count;

/* Bytes a pool holds beyond what it hands out; false when the pool is gone. */
static bool pool_cached(CUmemoryPool pool, uint64_t *cached) {
    cuuint64_t reserved = 0, used = 0;
    if (!gs_real.cuMemPoolGetAttribute ||
        gs_real.cuMemPoolGetAttribute(pool, GS_MEMPOOL_RESERVED, &reserved) != CUDA_SUCCESS ||
        gs_real.cuMemPoolGetAttribute(pool, GS_MEMPOOL_USED, &used) != CUDA_SUCCESS)
        return false;
    *cached = reserved > used ? reserved - used : 0;
    return true;
}

/* Charges pools[i] what it holds now; trims it when that does not fit. Locked. */
static void pool_settle_locked(int i) {
    pool_entry_t *p = &pools[i];
    uint64_t cached;
    if (!pool_cached(p->pool, &cached)) { /* destroyed: its memory went with it */
        gs_unreserve(p->dev, p->charged);
        pools[i] = pools[--pool_count];
        return;
    }
    if (cached > p->charged && !gs_reserve(p->dev, cached - p->charged)) {
        if (gs_real.cuMemPoolTrimTo) gs_real.cuMemPoolTrimTo(p->pool, 0);
        if (!pool_cached(p->pool, &cached)) cached = 0;
        if (cached > p->charged && !gs_reserve(p->dev, cached - p->charged)) {
            GS_LOG(GS_LOG_WARN, "a memory pool keeps %llu bytes the limit has no room for",
                   (unsigned long long)(cached - p->charged));
            cached = p->charged;
        }
    }
    if (cached < p->charged) gs_unreserve(p->dev, p->charged - cached);
    p->charged = cached;
}

/* Settles `pool` (added when new; an allocation changes only its own pool), or
 * with NULL every pool of the process (a free does not say which pool it fed). */
static void pools_settle(CUmemoryPool pool, int dev) {
    pthread_mutex_lock(&pools_mu);
    int at = -1;
    for (int i = 0; i < pool_count && pool && at < 0; i++)
        if (pools[i].pool == pool) at = i;
    if (pool && at < 0 && pool_count < GS_MAX_POOLS) {
        at = pool_count;
        pools[pool_count++] = (pool_entry_t){pool, dev, 0};
    } else if (pool && at < 0) {
        GS_LOG(GS_LOG_WARN, "more than %d memory pools: the rest are not charged", GS_MAX_POOLS);
    }
    if (pool && at >= 0) pool_settle_locked(at);
    for (int i = pool_count - 1; i >= 0 && !pool; i--) pool_settle_locked(i);
    pthread_mutex_unlock(&pools_mu);
}

bool gs_reserve_trimming(int dev, uint64_t bytes) {
    if (gs_reserve(dev, bytes)) return true;
    bool trimmed = false;
    pthread_mutex_lock(&pools_mu);
    for (int i = pool_count - 1; i >= 0; i--) {
        if (pools[i].charged == 0) continue;
        if (gs_real.cuMemPoolTrimTo) gs_real.cuMemPoolTrimTo(pools[i].pool, 0);
        pool_settle_locked(i);
        trimmed = true;
    }
    pthread_mutex_unlock(&pools_mu);
    return trimmed && gs_reserve(dev, bytes);
}

/* The pool cuMemAllocAsync takes from: the current pool of the context's device. */
static CUmemoryPool current_pool(void) {
    CUdevice ordinal;
    CUmemoryPool pool = NULL;
    if (!gs_real.cuCtxGetDevice || gs_real.cuCtxGetDevice(&ordinal) != CUDA_SUCCESS ||
        !gs_real.cuDeviceGetMemPool || gs_real.cuDeviceGetMemPool(&pool, ordinal) != CUDA_SUCCESS)
        return NULL;
    return pool;
}

static bool capturing(CUstream s, bool ptsz) {
    int status = 0;
    CUresult (*is_capturing)(CUstream, int *) =
        ptsz ? gs_real.cuStreamIsCapturing_ptsz : gs_real.cuStreamIsCapturing;
    return is_capturing && is_capturing(s, &status) == CUDA_SUCCESS && status != 0;
}

#define GS_ASYNC_ALLOC(fn, args, pool_, explicit_)                                            \
    do {                                                                                      \
        int dev_;                                                                             \
        if (!gs_enter() || !dptr || bytesize == 0 || (dev_ = gs_current_device()) == -1)        \
            return GS_CALL(fn, args);                                                         \
        bool captured_ = capturing(hStream, ptsz_);                                           \
        CUgraph graph_ = captured_ ? gs_capture_graph(hStream, ptsz_) : NULL;                 \
        CUmemoryPool p_ = (explicit_) ? (pool_) : current_pool();                             \
        if (!gs_reserve_trimming(dev_, bytesize)) return CUDA_ERROR_OUT_OF_MEMORY;                \
        CUresult rc_ = GS_CALL(fn, args);                                                     \
        if (rc_ != CUDA_SUCCESS) {                                                            \
            gs_unreserve(dev_, bytesize);                                                     \
            return rc_;                                                                       \
        }                                                                                     \
        if (captured_) {                                                                      \
            gs_graph_charge(graph_, *dptr, dev_, bytesize, -1);                               \
            return rc_;                                                                       \
        }                                                                                     \
        gs_track_add(GS_K_MEM, *dptr, dev_, bytesize, current_ctx());                         \
        if (p_) pools_settle(p_, dev_);                                                       \
        return rc_;                                                                           \
    } while (0)

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    const bool ptsz_ = false;
    GS_ASYNC_ALLOC(cuMemAllocAsync, (dptr, bytesize, hStream), NULL, false);
}

CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    const bool ptsz_ = true;
    GS_ASYNC_ALLOC(cuMemAllocAsync_ptsz, (dptr, bytesize, hStream), NULL, false);
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                 CUstream hStream) {
    const bool ptsz_ = false;
    GS_ASYNC_ALLOC(cuMemAllocFromPoolAsync, (dptr, bytesize, pool, hStream), pool, true);
}

CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                      CUstream hStream) {
    const bool ptsz_ = true;
    GS_ASYNC_ALLOC(cuMemAllocFromPoolAsync_ptsz, (dptr, bytesize, pool, hStream), pool, true);
}

/* Trimming gives back at once what the pool let go of. */
CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    gs_init();
    CUresult rc = GS_CALL(cuMemPoolTrimTo, (pool, minBytesToKeep));
    if (rc == CUDA_SUCCESS && gs_enter()) pools_settle(NULL, -1);
    return rc;
}

/* The freed block goes back to its pool: what the pools hold is settled again.
 * A free captured into a graph frees nothing now (graphmem.c). */
static CUresult async_freed(CUresult rc, CUdeviceptr dptr) {
    released(rc, GS_K_MEM, dptr);
    if (rc == CUDA_SUCCESS) pools_settle(NULL, -1);
    return rc;
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    if (!gs_enter()) return GS_CALL(cuMemFreeAsync, (dptr, hStream));
    if (!capturing(hStream, false)) return async_freed(GS_CALL(cuMemFreeAsync, (dptr, hStream)), dptr);
    CUresult rc = GS_CALL(cuMemFreeAsync, (dptr, hStream));
    if (rc == CUDA_SUCCESS) gs_graph_free_captured(hStream, false, dptr);
    return rc;
}

CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    if (!gs_enter()) return GS_CALL(cuMemFreeAsync_ptsz, (dptr, hStream));
    if (!capturing(hStream, true))
        return async_freed(GS_CALL(cuMemFreeAsync_ptsz, (dptr, hStream)), dptr);
    CUresult rc = GS_CALL(cuMemFreeAsync_ptsz, (dptr, hStream));
    if (rc == CUDA_SUCCESS) gs_graph_free_captured(hStream, true, dptr);
    return rc;
}

void gs_pools_after_fork(void) {
    pthread_mutex_init(&pools_mu, NULL); /* the lock may have been held */
    pool_count = 0;
}

/* ------------------------------------------------------------ the legacy ABI
 * The entry points of CUDA before 3.2 (32-bit sizes and device pointers) are
 * still exported by the driver. Nothing built in the last fifteen years calls
 * them; they would allocate or show memory past the limits, so while control is
 * on they are refused rather than wrapped. */
static CUresult legacy_refused(const char *name) {
    static atomic_int logged;
    if (!atomic_exchange(&logged, 1))
        gs_log(GS_LOG_WARN, "%s (the pre-CUDA 3.2 entry point) refused: use its _v2 form (logged "
               "once)", name);
    return CUDA_ERROR_NOT_SUPPORTED;
}

#define GS_LEGACY(name, args)                                                                 \
    do {                                                                                      \
        if (gs_enter()) return legacy_refused(#name);                                         \
        return GS_CALL(name, args);                                                           \
    } while (0)

CUresult cuMemAlloc(unsigned int *dptr, unsigned int bytesize) {
    GS_LEGACY(cuMemAlloc, (dptr, bytesize));
}

CUresult cuMemAllocPitch(unsigned int *dptr, unsigned int *pPitch, unsigned int WidthInBytes,
                         unsigned int Height, unsigned int ElementSizeBytes) {
    GS_LEGACY(cuMemAllocPitch, (dptr, pPitch, WidthInBytes, Height, ElementSizeBytes));
}

CUresult cuMemGetInfo(unsigned int *free, unsigned int *total) {
    GS_LEGACY(cuMemGetInfo, (free, total));
}

CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) {
    GS_LEGACY(cuDeviceTotalMem, (bytes, dev));
}

CUresult cuArrayCreate(CUarray *pHandle, const void *pAllocateArray) {
    GS_LEGACY(cuArrayCreate, (pHandle, pAllocateArray));
}

CUresult cuArray3DCreate(CUarray *pHandle, const void *pAllocateArray) {
    GS_LEGACY(cuArray3DCreate, (pHandle, pAllocateArray));
}

/* ------------------------------------------------------------ what the container sees */
CUresult cuMemGetInfo_v2(size_t *free, size_t *total) {
    CUresult rc = GS_CALL(cuMemGetInfo_v2, (free, total));
    int dev;
    if (rc != CUDA_SUCCESS || !gs_enter() || !free || !total || (dev = gs_current_device()) == -1)
        return rc;
    uint64_t limit = gs_limit(dev);
    if (limit == GS_NO_LIMIT) return rc;
    pools_settle(NULL, -1); /* the driver may have trimmed a pool at a synchronisation */
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
