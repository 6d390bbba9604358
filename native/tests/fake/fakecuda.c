/*
 * fakecuda.c: a fake libcuda.so.1 (CUDA driver API) for testing the
 * interposer on machines without a GPU. Built as build/fake/libcuda.so.1;
 * point LD_LIBRARY_PATH (or GPUSLICE_LIBCUDA) at it.
 *
 * It behaves like the real driver wherever the interposer depends on it:
 * initialisation, thread-local context stacks, per-device memory accounting
 * with out-of-memory, stream-ordered pools, VMM, arrays, asynchronous kernel
 * execution, events and cuGetProcAddress versioning. Everything is thread-safe
 * and no call crashes on bad pointers or handles: handles are looked up in a
 * table before use, never dereferenced blindly.
 *
 * ENVIRONMENT (read once, at cuInit or at the first fakecuda_* call; sizes are
 * bytes, or take a suffix k/m/g/t = KiB/MiB/GiB/TiB, e.g. "80g", "512m"):
 *   FAKECUDA_DEVICES        number of devices, default 1, at most 16 (0: cuInit
 *                           fails with CUDA_ERROR_NO_DEVICE)
 *   FAKECUDA_MEMORY         capacity of each device, default 80g
 *   FAKECUDA_CONTEXT_BYTES  device memory each context consumes, default 0
 *   FAKECUDA_ALLOC_DELAY_MS every allocating call (cuMemAlloc*, arrays,
 *                           cuMemCreate, pool allocations) sleeps this long
 *                           after the memory is taken and before returning,
 *                           so a test can SIGKILL a process mid-allocation;
 *                           default 0
 *   FAKECUDA_SM_COUNT       CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, default 132
 *   FAKECUDA_UUIDS          "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx,...": device
 *                           i's UUID is entry i (hex digits in either case;
 *                           blanks around an entry are ignored); a device with
 *                           no entry keeps the default UUID (see DEVICES), and
 *                           so does one whose entry is empty or malformed
 *                           (wrong length, a non-hex digit, a misplaced '-', no
 *                           "GPU-" prefix): the other entries still apply to
 *                           their own devices. Entries past FAKE_MAX_DEVICES
 *                           are ignored; duplicates are not checked.
 *   FAKEGPU_STATE_DIR       a directory: the process keeps <dir>/procs/<pid>
 *                           (fake_state.h: its memory, contexts and kernel time
 *                           per device, mapped shared and updated in place), the
 *                           fake NVML's and other processes' view of it; unset:
 *                           nothing is written
 * A value that does not parse (a size, a count) is taken as unset: the default
 * applies and nothing is printed.
 *
 * PER-CGROUP LIMITS. With FAKEGPU_STATE_DIR set, every call that takes device
 * memory (allocations, arrays, cuMemCreate, pool growth, contexts) is also
 * refused with CUDA_ERROR_OUT_OF_MEMORY when it would take the processes of a
 * limited cgroup past the hard limit the fake NVML keeps for that device
 * (nvmlDeviceSetMemoryLimits_v1; fake_limits.h), as the driver r615+ does.
 *
 * MEMORY. Each device has FAKECUDA_MEMORY bytes for this process alone; an
 * allocation past it fails with CUDA_ERROR_OUT_OF_MEMORY. Device pointers
 * (cuMemAlloc_v2, cuMemAllocPitch_v2, cuMemAllocManaged, cuMemAllocAsync*) are
 * real host memory from mmap(MAP_NORESERVE): readable and writable, and free
 * until touched, so tests can allocate tens of GiB. What counts against the
 * device: allocations, arrays, cuMemCreate handles, the `reserved` bytes of
 * every pool, and FAKECUDA_CONTEXT_BYTES per live context.
 *   - cuMemAllocPitch_v2: pitch = WidthInBytes rounded up to 512, bytes =
 *     pitch * Height.
 *   - arrays: Width * max(Height,1) * max(Depth,1) * element size * channels;
 *     a mipmapped array is the sum over its levels, each level halving every
 *     non-zero dimension (never below 1).
 *   - pools hold `reserved` bytes of device memory and hand out `used` bytes:
 *     an allocation reuses free reserved bytes and grows `reserved` only by
 *     the shortfall; a free lowers `used` but keeps `reserved`;
 *     cuMemPoolTrimTo(pool, keep) lowers `reserved` to max(used, keep). The
 *     fake never trims by itself (the real driver may trim on synchronisation
 *     when the release threshold is exceeded; this one does not).
 *   - destroying a context (cuCtxDestroy_v2, the last
 *     cuDevicePrimaryCtxRelease_v2, cuDevicePrimaryCtxReset_v2) frees every
 *     allocation, array, cuMemCreate handle, pool allocation, event and stream
 *     made in it, and trims the device's pools to what is still in use.
 *   - cuMemCreate checks prop->location (a valid device) but neither the
 *     allocation type nor granularity alignment; cuMemAddressReserve ranges
 *     are plain mmap reservations and are not counted.
 *   - an unknown device pointer or pool fails with CUDA_ERROR_INVALID_VALUE;
 *     an unknown array, cuMemCreate handle, event or stream with
 *     CUDA_ERROR_INVALID_HANDLE. cuMemFree_v2 and cuMemFreeAsync each free
 *     both plain and pool pointers (at once, not stream-ordered).
 *   - cuMemAllocManaged takes flags 0 (taken as GLOBAL), GLOBAL, HOST or
 *     SINGLE; cuMemAllocPitch_v2 does not check ElementSizeBytes.
 *
 * CONTEXTS. The current context is per thread (a stack, as in the driver). A
 * destroyed or released context that is still current makes memory and launch
 * calls fail with CUDA_ERROR_INVALID_CONTEXT. A device's primary context keeps
 * one handle for the life of the process (retain after a full release
 * reactivates the same handle).
 *
 * KERNELS. Each device has one simulated engine: a worker thread that runs
 * queued work strictly in FIFO order, one item at a time, every stream of the
 * device sharing the one queue (a GPU running full-width kernels back to
 * back). A kernel runs for as many MICROSECONDS as the numeric value of its
 * handle:
 *     cuLaunchKernel((CUfunction)1000, 1,1,1, 1,1,1, 0, stream, NULL, NULL)
 * queues a 1 ms kernel. cuLaunchCooperativeKernel and cuLaunchKernelEx use
 * (uintptr_t)f, cuGraphLaunch uses (uintptr_t)hGraphExec; each has a _ptsz
 * twin. The legacy cuLaunch, cuLaunchGrid, cuLaunchGridAsync and
 * cuLaunchCooperativeKernelMultiDevice (each entry's function, on its stream)
 * use (uintptr_t)f too. A NULL handle is a kernel of zero length. Launches return at once;
 * the engine sleeps through each kernel on a continuous timeline (a kernel
 * queued while the engine is busy starts exactly when the previous one ends),
 * so N back-to-back kernels of d us take N*d us of wall time. cuEventRecord
 * marks the current end of the device's queue; cuEventQuery reports
 * CUDA_ERROR_NOT_READY until the engine gets there; cuEventSynchronize,
 * cuStreamSynchronize, cuCtxSynchronize and the synchronous memcpys wait for
 * everything queued on that device so far. Grid and block sizes are not
 * checked. Streams are cheap records that only remember their device (with
 * FAKECUDA_STREAM_ENGINES=1, each created stream runs on an engine of its own:
 * see CONCURRENT STREAMS).
 *
 * STREAM CAPTURE. cuStreamBeginCapture_v2 on a created stream (not the NULL,
 * legacy or per-thread one: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) starts a
 * capture, whatever the mode: launches into the stream then run nothing and
 * only add their microseconds to the capture. cuStreamEndCapture ends it and
 * hands back the CUgraph captured (a handle, made at cuStreamBeginCapture_v2 and
 * named by cuStreamGetCaptureInfo_v2/_v3 meanwhile), as long as those
 * microseconds; cuGraphInstantiate (every form) makes it a CUgraphExec of that
 * length, which cuGraphLaunch runs for that long (a CUgraphExec the fake did not
 * make runs for its numeric value, as a kernel does). Stricter than the driver: recording an event into a capturing
 * stream, or querying or synchronising it, invalidates the capture (the driver
 * would make the event part of the graph); cuStreamIsCapturing(_ptsz) then says
 * INVALIDATED (2), else ACTIVE (1) or NONE (0), and cuStreamEndCapture fails
 * with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED.
 *
 * DEVICES. Name "Fake GPU"; cuDeviceGetUuid(_v2) of device i is, unless
 * FAKECUDA_UUIDS gives it one, the 16 bytes
 *     fa ce fe ed 00 00 40 00 80 00 00 00 00 00 00 i
 * which NVML (and fakenvml.c) print as "GPU-facefeed-0000-4000-8000-0000000000ii"
 * (ii: i as two lower-case hex digits); a FAKECUDA_UUIDS entry gives the 16
 * bytes its 32 hex digits spell, in order (fakenvml.c's FAKENVML_UUIDS takes
 * the same list, so both can name the devices alike). cuDeviceGetAttribute answers
 * MULTIPROCESSOR_COUNT = FAKECUDA_SM_COUNT, compute capability 9.0, 1 for
 * unified addressing, managed memory, VMM and memory-pool support, and 0 for
 * everything else. cuDriverGetVersion is 13000.
 *
 * cuGetProcAddress / cuGetProcAddress_v2 take BASE names ("cuMemAlloc") and
 * pick the version the caller's cudaVersion asks for (table g_versions
 * below); with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM they return the
 * _ptsz twin where one exists. They return the fake's own functions from a
 * compiled-in table (g_symbols), never via dlsym. A name not in g_versions
 * resolves to the fake function of exactly that name.
 *
 * LEGACY, SHARING, GRAPH MEMORY, LIMITS (the block at the end of this file):
 *   - the pre-CUDA 3.2 entry points cuMemAlloc, cuMemAllocPitch, cuMemGetInfo,
 *     cuDeviceTotalMem, cuArrayCreate, cuArray3DCreate (32-bit sizes; a device
 *     pointer is handed out as its low 32 bits) and cuCtxCreate, which
 *     cuGetProcAddress gives for a cudaVersion below 3020; they allocate and
 *     count as their _v2 forms;
 *   - cuMemRetainAllocationHandle(addr): the cuMemCreate handle mapped at addr
 *     (cuMemMap records each mapping), one more reference: cuMemRelease of a
 *     retained handle drops a reference and frees nothing;
 *   - cuMemExportToShareableHandle (POSIX file descriptor only: a memfd holding
 *     the size) and cuMemImportFromShareableHandle: the import is a new handle
 *     of that size, counted on the current context's device as memory the
 *     importing process holds;
 *   - GRAPH MEMORY: cuGraphCreate hands out a 1 us graph; cuGraphAddMemAllocNode
 *     and cuGraphAddNode(_v2) with a memory-allocation node take bytesize on
 *     poolProps' device at once, returned in dptr, and a cuMemAllocAsync* into a
 *     capturing stream takes it on the stream's device for the graph being
 *     captured: memory the graph holds, counted against the device until the
 *     graph (cuGraphDestroy) and every executable graph made from it
 *     (cuGraphExecDestroy) are destroyed, or its context is; a capture that
 *     fails drops its graph and that memory. A free does not give it back:
 *     cuMemFreeAsync into a capturing stream and cuGraphAddMemFreeNode /
 *     cuGraphAddNode(_v2) with a memory-free node free nothing (any pointer),
 *     nor does cuMemFree(Async) of a graph's pointer outside a capture.
 *     Simpler than the driver: the memory is taken when the node is made, not
 *     at the first launch, and everything the graph allocated goes with it,
 *     freed inside the graph or not; cuDeviceGraphMemTrim has nothing to trim.
 *     Any other node type is CUDA_ERROR_NOT_SUPPORTED;
 *   - cuCtxSetLimit / cuCtxGetLimit: stack size (per thread, times
 *     FAKECUDA_SM_COUNT * 2048 resident threads), printf FIFO and malloc heap;
 *     what a limit takes beyond its default (1 KiB, 1 MiB, 8 MiB) counts as
 *     the context's device memory.
 *
 * cuGetExportTable answers CUDA_ERROR_NOT_SUPPORTED for every table: the
 * driver's private tables are undocumented, so the fake does not pretend to
 * have them. The CUDA runtime therefore does not run on it: libcudart 12.9 and
 * 13.x ask for table 6bd5fb6c-5bf4-e74a-8987-d93912fd9df9 right after cuInit
 * and answer every later call (cudaGetDeviceCount, cudaMalloc,
 * cudaGetDriverEntryPoint, ...) with the error this returns, without calling
 * the driver again. NVIDIA's driver-API client cuda-bindings needs no private
 * table and runs on it (tests/native/test_cuda_bindings.py).
 *
 * FAKE-ONLY EXPORTS for tests (declare them yourself, they take no context):
 *   unsigned long long fakecuda_busy_ns(int dev)    kernel time the engine has
 *                                                   executed (nominal durations)
 *   unsigned long long fakecuda_launches(int dev)   kernels/graphs queued
 *   unsigned long long fakecuda_used_bytes(int dev) device memory this process
 *                                                   holds: allocations + pool
 *                                                   reserved + contexts
 * Each returns 0 for an invalid device.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gs_cuda.h"
#include "fake_size.h"
#include "fake_uuid.h"
#include "fake_state.h"

#define API __attribute__((visibility("default")))

/* ---------------------------------------------------------------- local ABI
 * What gs_cuda.h leaves out, with the values and layouts of cuda.h. */
typedef struct {
    CUmemLocation location;
    int flags; /* CUmemAccess_flags */
} FakeMemAccessDesc;

typedef struct {
    int allocType;   /* CUmemAllocationType */
    int handleTypes; /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} FakeMemPoolProps;

enum {
    FAKE_CUDA_ERROR_CONTEXT_IS_DESTROYED = 709, /* only for cuGetErrorString */
    FAKE_CUDA_ERROR_DEINITIALIZED = 4,
};
enum {
    FAKE_ATTR_UNIFIED_ADDRESSING = 41,
    FAKE_ATTR_CC_MAJOR = 75,
    FAKE_ATTR_CC_MINOR = 76,
    FAKE_ATTR_MANAGED_MEMORY = 83,
    FAKE_ATTR_VMM_SUPPORTED = 102,
    FAKE_ATTR_MEMORY_POOLS_SUPPORTED = 115,
};
enum {
    FAKE_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES = 1,
    FAKE_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC = 2,
    FAKE_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES = 3,
    FAKE_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4,
    FAKE_MEMPOOL_ATTR_RESERVED_MEM_HIGH = 6,
    FAKE_MEMPOOL_ATTR_USED_MEM_HIGH = 8,
};
#define FAKE_ERROR_ILLEGAL_STATE 401
#define FAKE_ERROR_STREAM_CAPTURE_UNSUPPORTED 900
#define FAKE_ERROR_STREAM_CAPTURE_INVALIDATED 901
typedef struct CUgraph_st *CUgraph;
#define FAKE_CU_STREAM_LEGACY ((CUstream)0x1)
#define FAKE_CU_STREAM_PER_THREAD ((CUstream)0x2)
#define FAKE_CTX_FLAGS_MASK 0xFFu
#define FAKE_EVENT_FLAGS_MASK 0x7u  /* BLOCKING_SYNC | DISABLE_TIMING | INTERPROCESS */
#define FAKE_STREAM_FLAGS_MASK 0x1u /* NON_BLOCKING */
#define FAKE_MEM_ATTACH_MASK 0x7u   /* GLOBAL | HOST | SINGLE (0 is taken as GLOBAL) */

#define FAKE_MAX_DEVICES 16
#define FAKE_GRANULARITY ((size_t)2 << 20)
#define FAKE_PITCH_ALIGN ((size_t)512)
#define FAKE_CTX_STACK 64

/* ------------------------------------------------------- exported prototypes
 * Everything the fake implements. g_symbols (cuGetProcAddress) lists the same. */
API CUresult cuInit(unsigned int flags);
API CUresult cuDriverGetVersion(int *driverVersion);
API CUresult cuGetErrorString(CUresult error, const char **pStr);
API CUresult cuGetErrorName(CUresult error, const char **pStr);
API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                 CUdriverProcAddressQueryResult *symbolStatus);
API CUresult cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId);

API CUresult cuDeviceGetCount(int *count);
API CUresult cuDeviceGet(CUdevice *device, int ordinal);
API CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev);
API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev);
API CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev);
API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev);
API CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev);
API CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool);

API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
API CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev);
API CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active);
API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);
API CUresult cuCtxCreate_v3(CUcontext *pctx, void *paramsArray, int numParams, unsigned int flags,
                            CUdevice dev);
API CUresult cuCtxCreate_v4(CUcontext *pctx, void *ctxCreateParams, unsigned int flags, CUdevice dev);
API CUresult cuCtxDestroy_v2(CUcontext ctx);
API CUresult cuCtxGetCurrent(CUcontext *pctx);
API CUresult cuCtxSetCurrent(CUcontext ctx);
API CUresult cuCtxPushCurrent_v2(CUcontext ctx);
API CUresult cuCtxPopCurrent_v2(CUcontext *pctx);
API CUresult cuCtxGetDevice(CUdevice *device);
API CUresult cuCtxSynchronize(void);

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                unsigned int ElementSizeBytes);
API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags);
API CUresult cuMemFree_v2(CUdeviceptr dptr);
API CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total);
API CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount);
API CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);

API CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray);
API CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray);
API CUresult cuArrayDestroy(CUarray hArray);
API CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle,
                                    const CUDA_ARRAY3D_DESCRIPTOR *pMipmappedArrayDesc,
                                    unsigned int numMipmapLevels);
API CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray);

API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                         const CUmemAllocationProp *prop, unsigned long long flags);
API CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
API CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                           int option);
API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                 unsigned long long flags);
API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                      unsigned long long flags);
API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const FakeMemAccessDesc *desc, size_t count);

API CUresult cuMemPoolCreate(CUmemoryPool *pool, const FakeMemPoolProps *poolProps);
API CUresult cuMemPoolDestroy(CUmemoryPool pool);
API CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep);
API CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value);
API CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value);
API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                     CUstream hStream);
API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                          CUstream hStream);
API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream);
API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream);

#define FAKE_LAUNCH_PARAMS                                                                    \
    (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,       \
     unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,                  \
     unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
#define FAKE_COOP_PARAMS                                                                      \
    (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,       \
     unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,                  \
     unsigned int sharedMemBytes, CUstream hStream, void **kernelParams)
API CUresult cuLaunchKernel FAKE_LAUNCH_PARAMS;
API CUresult cuLaunchKernel_ptsz FAKE_LAUNCH_PARAMS;
API CUresult cuLaunchCooperativeKernel FAKE_COOP_PARAMS;
API CUresult cuLaunchCooperativeKernel_ptsz FAKE_COOP_PARAMS;
API CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                              void **extra);
API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                   void **extra);
API CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream);
API CUresult cuLaunch(CUfunction f);
API CUresult cuStreamGetCtx(CUstream hStream, CUcontext *pctx);
API CUresult cuLaunchGrid(CUfunction f, int grid_width, int grid_height);
API CUresult cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream hStream);
API CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *launchParamsList,
                                                  unsigned int numDevices, unsigned int flags);
API CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream);

API CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags);
API CUresult cuEventRecord(CUevent hEvent, CUstream hStream);
API CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream);
API CUresult cuEventQuery(CUevent hEvent);
API CUresult cuEventSynchronize(CUevent hEvent);
API CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd);
API CUresult cuEventDestroy_v2(CUevent hEvent);
API CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags);
API CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority);
API CUresult cuStreamDestroy_v2(CUstream hStream);
API CUresult cuStreamSynchronize(CUstream hStream);
API CUresult cuStreamSynchronize_ptsz(CUstream hStream);
API CUresult cuStreamQuery(CUstream hStream);
API CUresult cuStreamQuery_ptsz(CUstream hStream);
API CUresult cuStreamBeginCapture_v2(CUstream hStream, int mode);
API CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph);
API CUresult cuStreamIsCapturing(CUstream hStream, int *captureStatus);
API CUresult cuStreamIsCapturing_ptsz(CUstream hStream, int *captureStatus);
API CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                         unsigned long long flags);

API unsigned long long fakecuda_busy_ns(int dev);
API unsigned long long fakecuda_launches(int dev);
API unsigned long long fakecuda_used_bytes(int dev);

/* ---- legacy ABI, sharing, graph memory, limits (implemented at the end) */
API CUresult cuMemAlloc(unsigned int *dptr, unsigned int bytesize);
API CUresult cuMemAllocPitch(unsigned int *dptr, unsigned int *pPitch, unsigned int WidthInBytes,
                             unsigned int Height, unsigned int ElementSizeBytes);
API CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total);
API CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev);
API CUresult cuArrayCreate(CUarray *pHandle, const void *desc);
API CUresult cuArray3DCreate(CUarray *pHandle, const void *desc);
API CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev);
API CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr);
API CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                          int handleType, unsigned long long flags);
API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                            int shHandleType);
API CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags);
API CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                    const CUgraphNode *dependencies, size_t numDependencies,
                                    void *nodeParams);
API CUresult cuGraphAddNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                            size_t numDependencies, void *nodeParams);
API CUresult cuGraphAddNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph,
                               const CUgraphNode *dependencies, const void *dependencyData,
                               size_t numDependencies, void *nodeParams);
API CUresult cuCtxSetLimit(int limit, size_t value);
API CUresult cuCtxGetLimit(size_t *pvalue, int limit);
API CUresult cuGraphDestroy(CUgraph hGraph);
API CUresult cuGraphExecDestroy(CUgraphExec hGraphExec);
API CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                char *logBuffer, size_t bufferSize);
API CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph,
                                   CUgraphNode *phErrorNode, char *logBuffer, size_t bufferSize);
API CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph, void *params);
API CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                               void *params);
API CUresult cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                   const CUgraphNode *dependencies, size_t numDependencies,
                                   CUdeviceptr dptr);
API CUresult cuStreamGetCaptureInfo_v2(CUstream hStream, int *status, cuuint64_t *id, CUgraph *graph,
                                       const CUgraphNode **deps, size_t *ndeps);
API CUresult cuStreamGetCaptureInfo_v2_ptsz(CUstream hStream, int *status, cuuint64_t *id,
                                            CUgraph *graph, const CUgraphNode **deps, size_t *ndeps);
API CUresult cuStreamGetCaptureInfo_v3(CUstream hStream, int *status, cuuint64_t *id, CUgraph *graph,
                                       const CUgraphNode **deps, const void **edges, size_t *ndeps);
API CUresult cuStreamGetCaptureInfo_v3_ptsz(CUstream hStream, int *status, cuuint64_t *id,
                                            CUgraph *graph, const CUgraphNode **deps,
                                            const void **edges, size_t *ndeps);
API CUresult cuDeviceGraphMemTrim(CUdevice device);
API unsigned long long fakecuda_exec_us(CUgraphExec exec);
static void fake_map_note(uintptr_t ptr, size_t size, uintptr_t handle);
static void fake_map_forget(uintptr_t ptr, size_t size);
static bool fake_release_retained(uintptr_t handle);
struct res;
static void fake_ctx_limits_gone(struct res *c);
static bool fake_captured_alloc(CUdeviceptr *dptr, size_t bytesize, CUstream s, CUresult *rc);
static bool fake_captured_free(CUdeviceptr dptr, CUstream s, CUresult *rc);
static uint64_t fake_exec_us(CUgraphExec exec);
static struct res *fake_graph_new(struct res *c);
static void fake_graph_release(struct res *g);

#define FAKE_SYMBOLS_MEMORY(X)                                                                \
    X(cuMemAlloc) X(cuMemAllocPitch) X(cuMemGetInfo) X(cuDeviceTotalMem) X(cuArrayCreate)     \
    X(cuArray3DCreate) X(cuCtxCreate) X(cuMemRetainAllocationHandle)                          \
    X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle) X(cuGraphCreate)        \
    X(cuGraphAddMemAllocNode) X(cuGraphAddNode) X(cuGraphAddNode_v2) X(cuCtxSetLimit)         \
    X(cuCtxGetLimit) FAKE_SYMBOLS_GRAPHS(X)
/* graphs and graph memory */
#define FAKE_SYMBOLS_GRAPHS(X)                                                                \
    X(cuGraphDestroy) X(cuGraphExecDestroy) X(cuGraphInstantiate) X(cuGraphInstantiate_v2)    \
    X(cuGraphInstantiateWithParams) X(cuGraphInstantiateWithParams_ptsz)                      \
    X(cuGraphAddMemFreeNode) X(cuStreamGetCaptureInfo_v2) X(cuStreamGetCaptureInfo_v2_ptsz)   \
    X(cuStreamGetCaptureInfo_v3) X(cuStreamGetCaptureInfo_v3_ptsz) X(cuDeviceGraphMemTrim)

/* ------------------------------------------------------------ symbol table
 * The one name -> function table: what cuGetProcAddress can hand out. */
#define FAKE_SYMBOLS(X)                                                                       \
    X(cuInit) X(cuDriverGetVersion) X(cuGetErrorString) X(cuGetErrorName) X(cuGetProcAddress) \
    X(cuGetProcAddress_v2) X(cuGetExportTable)                                                \
    X(cuDeviceGetCount) X(cuDeviceGet) X(cuDeviceGetName) X(cuDeviceGetUuid)                  \
    X(cuDeviceGetUuid_v2) X(cuDeviceGetAttribute) X(cuDeviceTotalMem_v2)                      \
    X(cuDeviceGetDefaultMemPool) X(cuDeviceGetMemPool) X(cuDeviceSetMemPool)                  \
    X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease_v2) X(cuDevicePrimaryCtxReset_v2) \
    X(cuDevicePrimaryCtxGetState) X(cuCtxCreate_v2) X(cuCtxCreate_v3) X(cuCtxCreate_v4)       \
    X(cuCtxDestroy_v2) X(cuCtxGetCurrent) X(cuCtxSetCurrent) X(cuCtxPushCurrent_v2)           \
    X(cuCtxPopCurrent_v2) X(cuCtxGetDevice) X(cuCtxSynchronize)                               \
    X(cuMemAlloc_v2) X(cuMemAllocPitch_v2) X(cuMemAllocManaged) X(cuMemFree_v2)               \
    X(cuMemGetInfo_v2) X(cuMemcpyHtoD_v2) X(cuMemcpyDtoH_v2)                                  \
    X(cuArrayCreate_v2) X(cuArray3DCreate_v2) X(cuArrayDestroy) X(cuMipmappedArrayCreate)     \
    X(cuMipmappedArrayDestroy)                                                                \
    X(cuMemCreate) X(cuMemRelease) X(cuMemGetAllocationGranularity) X(cuMemAddressReserve)    \
    X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess)                           \
    X(cuMemPoolCreate) X(cuMemPoolDestroy) X(cuMemPoolTrimTo) X(cuMemPoolGetAttribute)        \
    X(cuMemPoolSetAttribute) X(cuMemAllocAsync) X(cuMemAllocAsync_ptsz)                       \
    X(cuMemAllocFromPoolAsync) X(cuMemAllocFromPoolAsync_ptsz) X(cuMemFreeAsync)              \
    X(cuMemFreeAsync_ptsz)                                                                    \
    X(cuLaunchKernel) X(cuLaunchKernel_ptsz) X(cuLaunchCooperativeKernel)                     \
    X(cuLaunchCooperativeKernel_ptsz) X(cuLaunchKernelEx) X(cuLaunchKernelEx_ptsz)            \
    X(cuGraphLaunch) X(cuGraphLaunch_ptsz)                                                    \
    X(cuLaunch) X(cuLaunchGrid) X(cuLaunchGridAsync) X(cuLaunchCooperativeKernelMultiDevice)  \
    X(cuStreamGetCtx)                                                                         \
    X(cuEventCreate) X(cuEventRecord) X(cuEventRecord_ptsz) X(cuEventQuery)                   \
    X(cuEventSynchronize) X(cuEventElapsedTime) X(cuEventDestroy_v2) X(cuStreamCreate) X(cuStreamCreateWithPriority) \
    X(cuStreamDestroy_v2) X(cuStreamSynchronize) X(cuStreamSynchronize_ptsz) X(cuStreamQuery)  \
    X(cuStreamQuery_ptsz) X(cuStreamBeginCapture_v2) X(cuStreamEndCapture)                   \
    X(cuStreamIsCapturing) X(cuStreamIsCapturing_ptsz) X(cuGraphInstantiateWithFlags)

static const struct {
    const char *name;
    void *fn;
} g_symbols[] = {
#define FAKE_SYM(name) {#name, (void *)name},
    FAKE_SYMBOLS(FAKE_SYM)
    FAKE_SYMBOLS_MEMORY(FAKE_SYM)
#undef FAKE_SYM
};

/* The one per-version table: base name -> implementation for callers built
 * against cudaVersion >= since. Rows of one base go newest first. A base that
 * has rows but none low enough (the legacy 32-bit entry points, which the
 * fake does not implement) is CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT. */
static const struct {
    const char *base;
    int since;
    const char *impl;
} g_versions[] = {
    {"cuMemAlloc", 3020, "cuMemAlloc_v2"},
    {"cuMemAllocPitch", 3020, "cuMemAllocPitch_v2"},
    {"cuMemFree", 3020, "cuMemFree_v2"},
    {"cuMemGetInfo", 3020, "cuMemGetInfo_v2"},
    {"cuArrayCreate", 3020, "cuArrayCreate_v2"},
    {"cuArray3DCreate", 3020, "cuArray3DCreate_v2"},
    {"cuDeviceTotalMem", 3020, "cuDeviceTotalMem_v2"},
    {"cuMemcpyHtoD", 3020, "cuMemcpyHtoD_v2"},
    {"cuMemcpyDtoH", 3020, "cuMemcpyDtoH_v2"},
    {"cuCtxDestroy", 4000, "cuCtxDestroy_v2"},
    {"cuCtxPushCurrent", 4000, "cuCtxPushCurrent_v2"},
    {"cuCtxPopCurrent", 4000, "cuCtxPopCurrent_v2"},
    {"cuEventDestroy", 4000, "cuEventDestroy_v2"},
    {"cuStreamDestroy", 4000, "cuStreamDestroy_v2"},
    {"cuStreamBeginCapture", 10010, "cuStreamBeginCapture_v2"},
    {"cuDevicePrimaryCtxRelease", 11000, "cuDevicePrimaryCtxRelease_v2"},
    {"cuDevicePrimaryCtxReset", 11000, "cuDevicePrimaryCtxReset_v2"},
    {"cuCtxCreate", 12050, "cuCtxCreate_v4"},
    {"cuCtxCreate", 11040, "cuCtxCreate_v3"},
    {"cuCtxCreate", 3020, "cuCtxCreate_v2"},
    {"cuGetProcAddress", 12000, "cuGetProcAddress_v2"},
    {"cuGetProcAddress", 0, "cuGetProcAddress"},
    {"cuDeviceGetUuid", 11040, "cuDeviceGetUuid_v2"},
    {"cuDeviceGetUuid", 0, "cuDeviceGetUuid"},
    /* the pre-3.2 ABI, for callers older than the rows above */
    {"cuMemAlloc", 0, "cuMemAlloc"},
    {"cuMemAllocPitch", 0, "cuMemAllocPitch"},
    {"cuMemGetInfo", 0, "cuMemGetInfo"},
    {"cuDeviceTotalMem", 0, "cuDeviceTotalMem"},
    {"cuArrayCreate", 0, "cuArrayCreate"},
    {"cuArray3DCreate", 0, "cuArray3DCreate"},
    {"cuCtxCreate", 0, "cuCtxCreate"},
    {"cuGraphAddNode", 12030, "cuGraphAddNode_v2"},
    {"cuGraphAddNode", 0, "cuGraphAddNode"},
    {"cuGraphInstantiate", 12000, "cuGraphInstantiateWithFlags"},
    {"cuGraphInstantiate", 11000, "cuGraphInstantiate_v2"},
    {"cuGraphInstantiate", 0, "cuGraphInstantiate"},
    {"cuStreamGetCaptureInfo", 12030, "cuStreamGetCaptureInfo_v3"},
    {"cuStreamGetCaptureInfo", 11030, "cuStreamGetCaptureInfo_v2"},
};

/* ------------------------------------------------------------------ config */
static struct {
    int devices;
    uint64_t memory;
    uint64_t context_bytes;
    uint64_t alloc_delay_ms;
    int sm_count;
    unsigned char uuid[FAKE_MAX_DEVICES][16]; /* cuDeviceGetUuid of each device */
} g_cfg;


static uint64_t env_size(const char *name, uint64_t dflt) {
    uint64_t v;
    return parse_size(getenv(name), NULL, &v) ? v : dflt;
}

/* FAKECUDA_UUIDS: entry i replaces out[i] when it parses (fake_uuid.h). */
static void parse_uuids(const char *s, unsigned char out[FAKE_MAX_DEVICES][16]) {
    bool set[FAKE_MAX_DEVICES] = {false};
    fake_uuid_list(s, FAKE_MAX_DEVICES, out, set);
}

/* ------------------------------------------------------------------ state */
enum kind { K_CTX = 1, K_ALLOC, K_ASYNC, K_ARRAY, K_MIPMAP, K_VMM, K_VA, K_POOL, K_EVENT, K_STREAM,
            K_GRAPH, K_EXEC, K_GALLOC /* graphs, executable graphs, graph memory */ };

/* One record for every live object. Handles given out are the record's own
 * address (contexts, arrays, pools, events, streams, cuMemCreate handles); a
 * device pointer's record is keyed by the pointer. Every handle that comes in
 * is looked up in the table before it is touched. */
struct res {
    uintptr_t key;
    struct res *hnext; /* hash chain */
    enum kind kind;
    int dev;
    struct res *ctx; /* owning context (allocations, events, streams) */
    size_t size;     /* bytes counted against the device (or the pool) */
    void *map;       /* mmap'd range: K_ALLOC, K_ASYNC, K_VA */
    size_t maplen;
    struct res *pool; /* K_ASYNC: the pool it came from */
    /* K_CTX */
    bool active, primary;
    uint64_t limit_bytes; /* K_CTX: what cuCtxSetLimit's limits take beyond their defaults */
    int retains;          /* K_VMM: cuMemRetainAllocationHandle references */
    /* K_POOL */
    uint64_t reserved, used, reserved_high, used_high, release_threshold;
    bool destroyed, is_default;
    /* K_STREAM: a capture in progress, and the microseconds launched into it */
    bool capturing, capture_invalid;
    uint64_t captured_us;
    int eng; /* K_STREAM: an engine of its own (see CONCURRENT STREAMS), 0: the device's */
    /* K_EVENT: recorded at queue position `target` of engine `dev`; `stamp` is when
     * the engine got there (0 until known) */
    uint64_t target, stamp;
    /* graphs (see GRAPH MEMORY): K_STREAM the graph it captures into, K_EXEC its
     * graph, K_GALLOC the graph holding it (compared, never followed); K_GRAPH and
     * K_EXEC the microseconds a launch runs; K_GRAPH its live executables */
    struct res *graph;
    uint64_t us;
    int execs;
};

#define FAKE_STAMPS 4096 /* completion times kept for cuEventElapsedTime */

struct engine {
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    bool started, idle;
    int waiters;
    uint64_t wake_at; /* lowest queue position a waiter waits for */
    uint64_t *ring; /* durations in us */
    size_t cap, head, count;
    uint64_t submitted, completed, busy_ns, launches;
    uint64_t done_at[FAKE_STAMPS]; /* done_at[n % FAKE_STAMPS]: when work item n finished */
};

struct device {
    uint64_t used; /* bytes this process holds on the device */
    struct res *primary;
    int primary_refs;
    struct res *default_pool, *current_pool;
    struct engine eng;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* everything but the engines */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static atomic_int g_inited;
static struct device g_dev[FAKE_MAX_DEVICES];

static struct res **g_buckets;
static size_t g_nbuckets, g_nres;

static __thread struct res *t_stack[FAKE_CTX_STACK];
static __thread int t_depth;

static void load_config(void) {
    uint64_t n = env_size("FAKECUDA_DEVICES", 1);
    g_cfg.devices = n > FAKE_MAX_DEVICES ? FAKE_MAX_DEVICES : (int)n;
    g_cfg.memory = env_size("FAKECUDA_MEMORY", (uint64_t)80 << 30);
    g_cfg.context_bytes = env_size("FAKECUDA_CONTEXT_BYTES", 0);
    g_cfg.alloc_delay_ms = env_size("FAKECUDA_ALLOC_DELAY_MS", 0);
    uint64_t sm = env_size("FAKECUDA_SM_COUNT", 132);
    g_cfg.sm_count = sm > 1000000 ? 1000000 : (int)sm;
    static const unsigned char base[16] = {0xfa, 0xce, 0xfe, 0xed, 0x00, 0x00, 0x40, 0x00,
                                           0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
    for (int i = 0; i < FAKE_MAX_DEVICES; i++) {
        memcpy(g_cfg.uuid[i], base, sizeof base);
        g_cfg.uuid[i][15] = (unsigned char)i;
    }
    parse_uuids(getenv("FAKECUDA_UUIDS"), g_cfg.uuid);
    for (int i = 0; i < FAKE_MAX_DEVICES; i++) {
        struct engine *e = &g_dev[i].eng;
        pthread_mutex_init(&e->mu, NULL);
        pthread_cond_init(&e->work, NULL);
        pthread_cond_init(&e->done, NULL);
        e->wake_at = UINT64_MAX;
    }
}

static void config(void) { pthread_once(&g_once, load_config); }

/* ------------------------------------------- shared state (FAKEGPU_STATE_DIR)
 * fake_state.h: this process's <dir>/procs/<pid>, mapped shared and updated in
 * place, so the fake NVML and other processes see what it holds and runs. The
 * file is made at the first change to publish; a forked child makes its own at
 * its first change (the parent's mapping is not its to write); a clean exit
 * removes it, and readers skip the file of a pid that died. Without the
 * variable nothing is written. */
static char g_state_dir[4096]; /* "" when unset */
static struct fake_proc_state *g_state;
static struct fake_proc_state_tail *g_state_tail; /* right after *g_state */
#define FAKE_STATE_BYTES (sizeof(struct fake_proc_state) + sizeof(struct fake_proc_state_tail))
static pid_t g_state_pid;
static char g_state_path[4096 + 64];
static pthread_mutex_t g_state_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t g_state_ctx[FAKE_MAX_DEVICES]; /* live contexts per device, under g_mu */

static void state_config(void);
static pthread_once_t g_state_once = PTHREAD_ONCE_INIT;
static void state_config(void) {
    const char *dir = getenv("FAKEGPU_STATE_DIR");
    if (!dir || !*dir || snprintf(g_state_dir, sizeof g_state_dir, "%s", dir) >= (int)sizeof g_state_dir)
        g_state_dir[0] = '\0';
}

/* This process's mapped state, or NULL (no directory, or it cannot be made). */
static struct fake_proc_state *state_get(void) {
    pthread_once(&g_state_once, state_config);
    if (!g_state_dir[0]) return NULL;
    pid_t pid = getpid();
    pthread_mutex_lock(&g_state_mu);
    if (g_state && g_state_pid != pid) { /* a forked child: the mapping is the parent's */
        munmap(g_state, FAKE_STATE_BYTES);
        g_state = NULL;
    }
    if (!g_state) {
        char procs[4096 + 16];
        snprintf(procs, sizeof procs, "%s/procs", g_state_dir);
        if (mkdir(procs, 0755) == 0) chmod(procs, 01777); /* tenants of any user write here */
        snprintf(g_state_path, sizeof g_state_path, "%s/%d", procs, (int)pid);
        int fd = open(g_state_path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
        if (fd >= 0) {
            if (ftruncate(fd, FAKE_STATE_BYTES) == 0) {
                void *m = mmap(NULL, FAKE_STATE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
                if (m != MAP_FAILED) {
                    g_state = m;
                    g_state_tail = (struct fake_proc_state_tail *)(void *)((char *)m + sizeof *g_state);
                    g_state_pid = pid;
                    g_state->pid = (int32_t)pid;
                    g_state->ndev = (uint32_t)g_cfg.devices;
                    g_state->version = FAKE_STATE_VERSION;
                    __atomic_store_n(&g_state->magic, FAKE_STATE_MAGIC, __ATOMIC_RELEASE);
                }
            }
            close(fd);
        }
    }
    struct fake_proc_state *s = g_state;
    pthread_mutex_unlock(&g_state_mu);
    return s;
}

/* Publishes device dev's used bytes and live contexts. Call with g_mu held. */
static void state_used(int dev) {
    struct fake_proc_state *s = state_get();
    if (!s || dev < 0 || dev >= FAKE_STATE_DEVICES) return;
    __atomic_store_n(&s->used_bytes[dev], g_dev[dev].used, __ATOMIC_RELAXED);
    __atomic_store_n(&s->ctx_count[dev], g_state_ctx[dev], __ATOMIC_RELAXED);
}

/* A context on dev came (+1) or went (-1). Call with g_mu held. */
static void state_ctx(int dev, int delta) {
    if (dev < 0 || dev >= FAKE_MAX_DEVICES) return;
    if (delta > 0 || g_state_ctx[dev] > 0) g_state_ctx[dev] += (uint64_t)(int64_t)delta;
    state_used(dev);
}

/* The engine of dev started a kernel at start_ns (CLOCK_MONOTONIC) that ends at
 * end_ns, or (start_ns 0) finished one, having run busy_ns in all. */
static void state_engine(int dev, uint64_t start_ns, uint64_t end_ns, uint64_t busy_ns) {
    struct fake_proc_state *s = state_get();
    if (!s || dev < 0 || dev >= FAKE_STATE_DEVICES) return;
    if (!start_ns) __atomic_store_n(&s->busy_ns[dev], busy_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&g_state_tail->run_end_ns[dev], start_ns ? end_ns : 0, __ATOMIC_RELAXED);
    __atomic_store_n(&s->run_start_ns[dev], start_ns, __ATOMIC_RELEASE);
}

__attribute__((destructor)) static void state_remove(void) {
    pthread_mutex_lock(&g_state_mu);
    if (g_state && g_state_pid == getpid()) unlink(g_state_path);
    pthread_mutex_unlock(&g_state_mu);
}

#define NEED_INIT()                                                                           \
    do {                                                                                      \
        if (!atomic_load_explicit(&g_inited, memory_order_acquire))                           \
            return CUDA_ERROR_NOT_INITIALIZED;                                                \
    } while (0)

static bool valid_dev(CUdevice d) { return d >= 0 && d < g_cfg.devices; }

/* --------------------------------------------------------------- the table */
static size_t hash_key(uintptr_t k) {
    uint64_t x = (uint64_t)k;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (size_t)x;
}

static struct res *tab_find(uintptr_t key) {
    if (!g_buckets) return NULL;
    for (struct res *r = g_buckets[hash_key(key) & (g_nbuckets - 1)]; r; r = r->hnext)
        if (r->key == key) return r;
    return NULL;
}

static struct res *tab_find_kind(uintptr_t key, enum kind k) {
    struct res *r = key ? tab_find(key) : NULL;
    return r && r->kind == k ? r : NULL;
}

static bool tab_grow(void) {
    size_t n = g_nbuckets ? g_nbuckets * 2 : 256;
    struct res **b = calloc(n, sizeof *b);
    if (!b) return g_buckets != NULL; /* keep the old table, just longer chains */
    for (size_t i = 0; i < g_nbuckets; i++) {
        struct res *r = g_buckets[i];
        while (r) {
            struct res *next = r->hnext;
            size_t h = hash_key(r->key) & (n - 1);
            r->hnext = b[h];
            b[h] = r;
            r = next;
        }
    }
    free(g_buckets);
    g_buckets = b;
    g_nbuckets = n;
    return true;
}

static bool tab_insert(struct res *r) {
    if ((g_nres >= g_nbuckets || !g_buckets) && !tab_grow()) return false;
    size_t h = hash_key(r->key) & (g_nbuckets - 1);
    r->hnext = g_buckets[h];
    g_buckets[h] = r;
    g_nres++;
    return true;
}

static void tab_remove(struct res *r) {
    struct res **pp = &g_buckets[hash_key(r->key) & (g_nbuckets - 1)];
    for (; *pp; pp = &(*pp)->hnext) {
        if (*pp == r) {
            *pp = r->hnext;
            g_nres--;
            return;
        }
    }
}

/* A new record whose handle is its own address, inserted; NULL when out of memory. */
static struct res *new_handle(enum kind k, int dev, struct res *ctx) {
    struct res *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->key = (uintptr_t)r;
    r->kind = k;
    r->dev = dev;
    r->ctx = ctx;
    if (!tab_insert(r)) {
        free(r);
        return NULL;
    }
    return r;
}

/* ------------------------------------------------------ contexts (locked) */
static struct res *cur_ctx(void) { return t_depth > 0 ? t_stack[t_depth - 1] : NULL; }

/* The calling thread's current, live context. Call with g_mu held. */
static CUresult need_ctx(struct res **out) {
    struct res *c = cur_ctx();
    if (!c || !c->active) return CUDA_ERROR_INVALID_CONTEXT;
    *out = c;
    return CUDA_SUCCESS;
}

/* The device a stream's work goes to: NULL / legacy / per-thread streams use
 * the current context's. Call with g_mu held. */
static CUresult stream_dev(CUstream s, int *dev) {
    if (s == NULL || s == FAKE_CU_STREAM_LEGACY || s == FAKE_CU_STREAM_PER_THREAD) {
        struct res *c;
        CUresult rc = need_ctx(&c);
        if (rc) return rc;
        *dev = c->dev;
        return CUDA_SUCCESS;
    }
    struct res *r = tab_find_kind((uintptr_t)s, K_STREAM);
    if (!r) return CUDA_ERROR_INVALID_HANDLE;
    *dev = r->dev;
    return CUDA_SUCCESS;
}

static void pool_note_high(struct res *p) {
    if (p->reserved > p->reserved_high) p->reserved_high = p->reserved;
    if (p->used > p->used_high) p->used_high = p->used;
}

/* Lowers a pool's reserve to max(used, keep); frees a destroyed pool once empty. */
static void pool_trim(struct res *p, uint64_t keep) {
    uint64_t target = p->used > keep ? p->used : keep;
    if (target < p->reserved) {
        g_dev[p->dev].used -= p->reserved - target;
        p->reserved = target;
        state_used(p->dev);
    }
    if (p->destroyed && p->used == 0) free(p); /* already out of the table */
}

/* Frees one record and gives back what it counted. Call with g_mu held. */
static void res_free(struct res *r) {
    tab_remove(r);
    switch (r->kind) {
    case K_ALLOC:
    case K_ARRAY:
    case K_MIPMAP:
    case K_VMM:
    case K_GALLOC:
        g_dev[r->dev].used -= r->size;
        state_used(r->dev);
        break;
    case K_ASYNC:
        r->pool->used -= r->size;
        if (r->pool->destroyed) pool_trim(r->pool, 0);
        break;
    default:
        break;
    }
    if (r->map) munmap(r->map, r->maplen);
    free(r);
}

/* Destroys a context: everything made in it goes, the device's pools are
 * trimmed to what is still in use, and the context's bytes come back. */
static void ctx_teardown(struct res *c) {
    for (size_t i = 0; i < g_nbuckets; i++) {
        struct res *r = g_buckets[i];
        while (r) {
            struct res *next = r->hnext;
            if (r->ctx == c) res_free(r);
            r = next;
        }
    }
    struct device *d = &g_dev[c->dev];
    for (size_t i = 0; i < g_nbuckets; i++)
        for (struct res *r = g_buckets[i]; r; r = r->hnext)
            if (r->kind == K_POOL && r->dev == c->dev) pool_trim(r, 0);
    fake_ctx_limits_gone(c);
    d->used -= c->size;
    c->size = 0;
    c->active = false;
    state_ctx(c->dev, -1);
}

static bool ctx_push(struct res *c) {
    if (t_depth >= FAKE_CTX_STACK) return false;
    t_stack[t_depth++] = c;
    return true;
}

/* ------------------------------------------------------- concurrent streams */
/* FAKECUDA_STREAM_ENGINES=1: each stream made by cuStreamCreate(WithPriority)
 * gets an engine of its own (the first FAKE_STREAM_ENGINES of the process; later
 * ones share their device's), so its work runs beside the work of the device's
 * other streams, as a non-blocking stream's does on a GPU. An event recorded
 * into it marks that engine's queue only; cuStreamSynchronize waits for it;
 * cuCtxSynchronize, the synchronous copies and fakecuda_busy_ns /
 * fakecuda_launches cover every engine of the device. The NULL, legacy and
 * per-thread streams stay on the device's engine. Engine ids below
 * FAKE_MAX_DEVICES are the devices'; the others are these. */
#define FAKE_STREAM_ENGINES 16
static struct engine g_seng[FAKE_STREAM_ENGINES];
static int g_seng_dev[FAKE_STREAM_ENGINES];
static int g_seng_count; /* under g_mu */

static struct engine *eng_at(int id) {
    return id < FAKE_MAX_DEVICES ? &g_dev[id].eng : &g_seng[id - FAKE_MAX_DEVICES];
}

/* A new stream's engine id, with g_mu held: its own when the mode is on. */
static int stream_engine_new(int dev) {
    static int mode = -1;
    if (mode < 0) {
        const char *v = getenv("FAKECUDA_STREAM_ENGINES");
        mode = v && !strcmp(v, "1");
    }
    if (!mode || g_seng_count >= FAKE_STREAM_ENGINES) return 0;
    struct engine *e = &g_seng[g_seng_count];
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->work, NULL);
    pthread_cond_init(&e->done, NULL);
    e->wake_at = UINT64_MAX;
    g_seng_dev[g_seng_count] = dev;
    return FAKE_MAX_DEVICES + g_seng_count++;
}

/* The engine a stream's work goes to, with g_mu held (`dev`: the stream's device). */
static int stream_engine(CUstream s, int dev) {
    if (s == NULL || s == FAKE_CU_STREAM_LEGACY || s == FAKE_CU_STREAM_PER_THREAD) return dev;
    struct res *r = tab_find_kind((uintptr_t)s, K_STREAM);
    return r && r->eng ? r->eng : dev;
}

/* The stream engines of `dev`, with g_mu held: how many, ids into `ids`. */
static int device_stream_engines(int dev, int ids[FAKE_STREAM_ENGINES]) {
    int n = 0;
    for (int i = 0; i < g_seng_count; i++)
        if (g_seng_dev[i] == dev) ids[n++] = FAKE_MAX_DEVICES + i;
    return n;
}

/* ------------------------------------------------------------------ engine */
static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_until(uint64_t deadline_ns) {
    struct timespec ts = {.tv_sec = (time_t)(deadline_ns / 1000000000ull),
                          .tv_nsec = (long)(deadline_ns % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

static void sleep_ms(uint64_t ms) {
    if (ms) sleep_until(now_ns() + ms * 1000000ull);
}

/* One worker per device: pops kernels in FIFO order and sleeps through each on
 * a continuous timeline (back-to-back work starts where the previous ended). */
static void *engine_main(void *arg) {
    struct engine *e = arg;
    int dev = (int)((struct device *)(void *)((char *)e - offsetof(struct device, eng)) - g_dev);
    uint64_t timeline = 0;
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL); /* wake on time for short kernels */
    pthread_mutex_lock(&e->mu);
    for (;;) {
        bool waited = false;
        while (e->count == 0) {
            e->idle = true;
            waited = true;
            pthread_cond_wait(&e->work, &e->mu);
        }
        e->idle = false;
        uint64_t us = e->ring[e->head];
        e->head = (e->head + 1) % e->cap;
        e->count--;
        pthread_mutex_unlock(&e->mu);

        uint64_t now = now_ns();
        if (waited || timeline + 1000000000ull < now)
            timeline = now; /* idle (or stalled for over a second): start now */
        uint64_t ns = us > UINT64_MAX / 1000 ? UINT64_MAX / 2 : us * 1000;
        state_engine(dev, timeline ? timeline : 1, timeline + ns, 0);
        timeline += ns;
        if (timeline > now) sleep_until(timeline); /* behind schedule: no syscall */

        pthread_mutex_lock(&e->mu);
        e->busy_ns += ns;
        state_engine(dev, 0, 0, e->busy_ns);
        e->completed++;
        e->done_at[e->completed % FAKE_STAMPS] = timeline;
        if (e->waiters && e->completed >= e->wake_at) { /* waiters re-arm wake_at */
            e->wake_at = UINT64_MAX;
            pthread_cond_broadcast(&e->done);
        }
    }
    return NULL;
}

static CUresult engine_submit(int dev, uint64_t us) {
    struct engine *e = eng_at(dev);
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&e->mu);
    if (!e->started) {
        pthread_attr_t attr;
        sigset_t all, old;
        pthread_t th;
        sigfillset(&all);
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_sigmask(SIG_SETMASK, &all, &old); /* the worker takes no signals */
        int err = pthread_create(&th, &attr, engine_main, e);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&attr);
        if (err) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
            goto out;
        }
        e->started = true;
    }
    if (e->count == e->cap) {
        size_t ncap = e->cap ? e->cap * 2 : 1024;
        uint64_t *ring = malloc(ncap * sizeof *ring);
        if (!ring) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
            goto out;
        }
        for (size_t i = 0; i < e->count; i++) ring[i] = e->ring[(e->head + i) % e->cap];
        free(e->ring);
        e->ring = ring;
        e->cap = ncap;
        e->head = 0;
    }
    e->ring[(e->head + e->count) % e->cap] = us;
    e->count++;
    e->submitted++;
    e->launches++;
    if (e->idle) pthread_cond_signal(&e->work);
out:
    pthread_mutex_unlock(&e->mu);
    return rc;
}

static uint64_t engine_mark(int dev) {
    struct engine *e = eng_at(dev);
    pthread_mutex_lock(&e->mu);
    uint64_t t = e->submitted;
    pthread_mutex_unlock(&e->mu);
    return t;
}

static bool engine_reached(int dev, uint64_t target) {
    struct engine *e = eng_at(dev);
    pthread_mutex_lock(&e->mu);
    bool done = e->completed >= target;
    pthread_mutex_unlock(&e->mu);
    return done;
}

/* Waits until the engine has run everything up to queue position `target`
 * (UINT64_MAX: everything queued so far). */
static void engine_wait(int dev, uint64_t target) {
    struct engine *e = eng_at(dev);
    pthread_mutex_lock(&e->mu);
    if (target == UINT64_MAX) target = e->submitted;
    e->waiters++;
    while (e->completed < target) {
        if (target < e->wake_at) e->wake_at = target;
        pthread_cond_wait(&e->done, &e->mu);
    }
    e->waiters--;
    pthread_mutex_unlock(&e->mu);
}

/* Everything queued on a device so far, on every engine of it, is done. */
static void engine_wait_device(int dev) {
    int ids[FAKE_STREAM_ENGINES];
    pthread_mutex_lock(&g_mu);
    int n = device_stream_engines(dev, ids);
    pthread_mutex_unlock(&g_mu);
    engine_wait(dev, UINT64_MAX);
    for (int i = 0; i < n; i++) engine_wait(ids[i], UINT64_MAX);
}

/* ------------------------------------------------------------- init, misc */
API CUresult cuInit(unsigned int flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    config();
    if (g_cfg.devices <= 0) return CUDA_ERROR_NO_DEVICE;
    atomic_store_explicit(&g_inited, 1, memory_order_release);
    return CUDA_SUCCESS;
}

API CUresult cuDriverGetVersion(int *driverVersion) {
    if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = 13000;
    return CUDA_SUCCESS;
}

static const struct {
    CUresult code;
    const char *name, *text;
} g_errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {FAKE_CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {FAKE_CUDA_ERROR_CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static CUresult error_lookup(CUresult error, const char **pStr, bool name) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof g_errors / sizeof g_errors[0]; i++) {
        if (g_errors[i].code == error) {
            *pStr = name ? g_errors[i].name : g_errors[i].text;
            return CUDA_SUCCESS;
        }
    }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuGetErrorString(CUresult error, const char **pStr) { return error_lookup(error, pStr, false); }
API CUresult cuGetErrorName(CUresult error, const char **pStr) { return error_lookup(error, pStr, true); }

/* No private tables (see the top of this file). */
API CUresult cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId) {
    if (ppExportTable) *ppExportTable = NULL;
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* ---------------------------------------------------------- cuGetProcAddress */
static void *symbol_find(const char *name) {
    for (size_t i = 0; i < sizeof g_symbols / sizeof g_symbols[0]; i++)
        if (strcmp(g_symbols[i].name, name) == 0) return g_symbols[i].fn;
    return NULL;
}

static CUresult proc_address(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *status) {
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    if (flags & ~(cuuint64_t)(CU_GET_PROC_ADDRESS_LEGACY_STREAM |
                              CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM))
        return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    const char *impl = symbol; /* names without rows resolve to themselves */
    bool versioned = false, fits = false;
    for (size_t i = 0; i < sizeof g_versions / sizeof g_versions[0]; i++) {
        if (strcmp(g_versions[i].base, symbol) != 0) continue;
        versioned = true;
        if (cudaVersion >= g_versions[i].since) { /* newest row the caller may have */
            impl = g_versions[i].impl;
            fits = true;
            break;
        }
    }
    if (versioned && !fits) {
        if (status) *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
        return CUDA_ERROR_NOT_FOUND;
    }
    void *fn = NULL;
    if (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) {
        char twin[128];
        if ((size_t)snprintf(twin, sizeof twin, "%s_ptsz", impl) < sizeof twin) fn = symbol_find(twin);
        if (!fn && (size_t)snprintf(twin, sizeof twin, "%s_ptds", impl) < sizeof twin)
            fn = symbol_find(twin);
    }
    if (!fn) fn = symbol_find(impl);
    if (!fn) {
        if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = fn;
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    return proc_address(symbol, pfn, cudaVersion, flags, NULL);
}

API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                 CUdriverProcAddressQueryResult *symbolStatus) {
    return proc_address(symbol, pfn, cudaVersion, flags, symbolStatus);
}

/* ------------------------------------------------------------------ devices */
API CUresult cuDeviceGetCount(int *count) {
    NEED_INIT();
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = g_cfg.devices;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    NEED_INIT();
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    NEED_INIT();
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "%s", "Fake GPU");
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) {
    NEED_INIT();
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    memcpy(uuid->bytes, g_cfg.uuid[dev], sizeof uuid->bytes);
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) { return cuDeviceGetUuid_v2(uuid, dev); }

API CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev) {
    NEED_INIT();
    if (!pi) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *pi = g_cfg.sm_count; break;
    case FAKE_ATTR_CC_MAJOR: *pi = 9; break;
    case FAKE_ATTR_CC_MINOR: *pi = 0; break;
    case FAKE_ATTR_UNIFIED_ADDRESSING:
    case FAKE_ATTR_MANAGED_MEMORY:
    case FAKE_ATTR_VMM_SUPPORTED:
    case FAKE_ATTR_MEMORY_POOLS_SUPPORTED: *pi = 1; break;
    default: *pi = 0; break;
    }
    return CUDA_SUCCESS;
}

API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    NEED_INIT();
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = (size_t)g_cfg.memory;
    return CUDA_SUCCESS;
}

#include "fake_limits.h"

/* ------------------------------------------------------ per-cgroup limits
 * The driver's per-cgroup hard limits (fake_limits.h), kept by the fake NVML
 * in <FAKEGPU_STATE_DIR>/limits: taking `grow` more bytes on device `dev` is
 * refused when, for a limit on that device whose nameSpace holds this
 * process's cgroup, what the group's processes hold there (this process's own
 * g_dev[dev].used, the others' procs files) plus `grow` passes the hard
 * limit. No state directory, no limits file: nothing is refused. Call with
 * g_mu held. */
static bool cgroup_limit_refuses(int dev, uint64_t grow) {
    const char *dir = fake_state_dir();
    if (!dir || grow == 0) return false;
    static struct fake_limit limits[FAKE_LIMITS_MAX]; /* under g_mu */
    int n = fake_limits_read(dir, limits, FAKE_LIMITS_MAX);
    char root[PATH_MAX], self[PATH_MAX];
    if (n == 0 || !fake_cgroup2_root(root, sizeof root) ||
        !fake_pid_cgroup(getpid(), root, self, sizeof self))
        return false;
    for (int i = 0; i < n; i++) {
        const struct fake_limit *l = &limits[i];
        if ((int)l->dev != dev || l->hard == FAKE_LIMIT_NONE || !fake_path_within(self, l->ns))
            continue;
        uint64_t held = fake_ns_used(dir, l->dev, l->ns, root, getpid()) + g_dev[dev].used;
        if (held > l->hard || grow > l->hard - held) return true;
    }
    return false;
}

/* The device's default pool, made on first use. Call with g_mu held. */
static struct res *default_pool(int dev) {
    struct device *d = &g_dev[dev];
    if (!d->default_pool) {
        d->default_pool = new_handle(K_POOL, dev, NULL);
        if (d->default_pool) d->default_pool->is_default = true;
    }
    if (!d->current_pool) d->current_pool = d->default_pool;
    return d->default_pool;
}

API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev) {
    NEED_INIT();
    if (!pool_out) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    struct res *p = default_pool(dev);
    pthread_mutex_unlock(&g_mu);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    *pool_out = (CUmemoryPool)p;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    NEED_INIT();
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    default_pool(dev);
    struct res *p = g_dev[dev].current_pool;
    pthread_mutex_unlock(&g_mu);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    *pool = (CUmemoryPool)p;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool) {
    NEED_INIT();
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    struct res *p = tab_find_kind((uintptr_t)pool, K_POOL);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (p && p->dev == dev) {
        g_dev[dev].current_pool = p;
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* ------------------------------------------------------------------ contexts */
API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    NEED_INIT();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    struct device *d = &g_dev[dev];
    if (!d->primary) {
        d->primary = new_handle(K_CTX, dev, NULL);
        if (!d->primary) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
            goto out;
        }
        d->primary->primary = true;
    }
    if (d->primary_refs == 0) {
        if (d->used + g_cfg.context_bytes > g_cfg.memory) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
            goto out;
        }
        if (cgroup_limit_refuses(dev, g_cfg.context_bytes)) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
            goto out;
        }
        d->used += g_cfg.context_bytes;
        d->primary->size = g_cfg.context_bytes;
        d->primary->active = true;
        state_ctx(dev, +1);
    }
    d->primary_refs++;
    *pctx = (CUcontext)d->primary;
out:
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    NEED_INIT();
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    struct device *d = &g_dev[dev];
    if (d->primary_refs == 0) {
        rc = CUDA_ERROR_INVALID_CONTEXT;
    } else if (--d->primary_refs == 0) {
        ctx_teardown(d->primary);
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    NEED_INIT();
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    struct device *d = &g_dev[dev];
    if (d->primary && d->primary->active) ctx_teardown(d->primary);
    d->primary_refs = 0;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    NEED_INIT();
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    *flags = 0;
    *active = g_dev[dev].primary_refs > 0;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

static CUresult ctx_create(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    NEED_INIT();
    if (!pctx || (flags & ~FAKE_CTX_FLAGS_MASK)) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    struct device *d = &g_dev[dev];
    struct res *c = NULL;
    if (d->used + g_cfg.context_bytes > g_cfg.memory) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else if (cgroup_limit_refuses(dev, g_cfg.context_bytes)) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else if (t_depth >= FAKE_CTX_STACK || !(c = new_handle(K_CTX, dev, NULL))) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        c->active = true;
        c->size = g_cfg.context_bytes;
        d->used += c->size;
        state_ctx(dev, +1);
        ctx_push(c);
        *pctx = (CUcontext)c;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    return ctx_create(pctx, flags, dev);
}

API CUresult cuCtxCreate_v3(CUcontext *pctx, void *paramsArray, int numParams, unsigned int flags,
                            CUdevice dev) {
    if (numParams < 0 || (numParams > 0 && !paramsArray)) return CUDA_ERROR_INVALID_VALUE;
    return ctx_create(pctx, flags, dev);
}

API CUresult cuCtxCreate_v4(CUcontext *pctx, void *ctxCreateParams, unsigned int flags, CUdevice dev) {
    return ctx_create(pctx, flags, dev);
}

API CUresult cuCtxDestroy_v2(CUcontext ctx) {
    NEED_INIT();
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    struct res *c = tab_find_kind((uintptr_t)ctx, K_CTX);
    if (!c || c->primary || !c->active) {
        rc = CUDA_ERROR_INVALID_CONTEXT;
    } else {
        ctx_teardown(c); /* the record stays (inactive) so stale handles stay recognisable */
        if (cur_ctx() == c) t_depth--;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuCtxGetCurrent(CUcontext *pctx) {
    NEED_INIT();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = (CUcontext)cur_ctx();
    return CUDA_SUCCESS;
}

/* A context that may be made current: known, and not a destroyed cuCtxCreate one. */
static struct res *bindable_ctx(CUcontext ctx) {
    struct res *c = tab_find_kind((uintptr_t)ctx, K_CTX);
    return c && (c->active || c->primary) ? c : NULL;
}

API CUresult cuCtxSetCurrent(CUcontext ctx) {
    NEED_INIT();
    if (!ctx) {
        if (t_depth > 0) t_depth--;
        return CUDA_SUCCESS;
    }
    pthread_mutex_lock(&g_mu);
    struct res *c = bindable_ctx(ctx);
    pthread_mutex_unlock(&g_mu);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    if (t_depth == 0) t_depth = 1;
    t_stack[t_depth - 1] = c;
    return CUDA_SUCCESS;
}

API CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    NEED_INIT();
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct res *c = bindable_ctx(ctx);
    pthread_mutex_unlock(&g_mu);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    return ctx_push(c) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

API CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
    NEED_INIT();
    if (t_depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    struct res *c = t_stack[--t_depth];
    if (pctx) *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetDevice(CUdevice *device) {
    NEED_INIT();
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct res *c;
    CUresult rc = need_ctx(&c);
    if (!rc) *device = c->dev;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuCtxSynchronize(void) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    struct res *c;
    CUresult rc = need_ctx(&c);
    int dev = rc ? 0 : c->dev;
    pthread_mutex_unlock(&g_mu);
    if (!rc) engine_wait_device(dev);
    return rc;
}

/* ------------------------------------------------------------------ memory */
static size_t page_round(size_t n) {
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    return n > SIZE_MAX - pg ? 0 : (n + pg - 1) / pg * pg;
}

static void *map_bytes(size_t n, size_t *len) {
    *len = page_round(n ? n : 1);
    if (!*len) return NULL;
    void *p = mmap(NULL, *len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

/* Takes `bytes` of the current context's device for a new record of kind k.
 * With `mapped` the record gets fresh host memory and is keyed by it;
 * otherwise it is keyed by its own address (a handle). */
static CUresult alloc_record(enum kind k, uint64_t bytes, bool mapped, struct res **out) {
    pthread_mutex_lock(&g_mu);
    struct res *c;
    CUresult rc = need_ctx(&c);
    if (rc) goto out;
    struct device *d = &g_dev[c->dev];
    if (bytes > g_cfg.memory || d->used > g_cfg.memory - bytes) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto out;
    }
    if (cgroup_limit_refuses(c->dev, bytes)) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto out;
    }
    struct res *r = calloc(1, sizeof *r);
    if (!r) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto out;
    }
    r->kind = k;
    r->dev = c->dev;
    r->ctx = c;
    r->size = (size_t)bytes;
    r->key = (uintptr_t)r;
    if (mapped) {
        r->map = map_bytes(r->size, &r->maplen);
        r->key = (uintptr_t)r->map;
    }
    if ((mapped && !r->map) || !tab_insert(r)) {
        if (r->map) munmap(r->map, r->maplen);
        free(r);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto out;
    }
    d->used += bytes;
    state_used(c->dev);
    *out = r;
out:
    pthread_mutex_unlock(&g_mu);
    if (!rc) sleep_ms(g_cfg.alloc_delay_ms);
    return rc;
}

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    NEED_INIT();
    if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    struct res *r;
    CUresult rc = alloc_record(K_ALLOC, bytesize, true, &r);
    if (!rc) *dptr = (CUdeviceptr)r->key;
    return rc;
}

API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                unsigned int ElementSizeBytes) {
    NEED_INIT();
    if (!dptr || !pPitch || WidthInBytes == 0 || Height == 0) return CUDA_ERROR_INVALID_VALUE;
    if (WidthInBytes > SIZE_MAX - FAKE_PITCH_ALIGN) return CUDA_ERROR_INVALID_VALUE;
    size_t pitch = (WidthInBytes + FAKE_PITCH_ALIGN - 1) / FAKE_PITCH_ALIGN * FAKE_PITCH_ALIGN;
    size_t bytes;
    if (__builtin_mul_overflow(pitch, Height, &bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
    struct res *r;
    CUresult rc = alloc_record(K_ALLOC, bytes, true, &r);
    if (!rc) {
        *dptr = (CUdeviceptr)r->key;
        *pPitch = pitch;
    }
    return rc;
}

API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    NEED_INIT();
    if (!dptr || bytesize == 0 || (flags & ~FAKE_MEM_ATTACH_MASK)) return CUDA_ERROR_INVALID_VALUE;
    struct res *r;
    CUresult rc = alloc_record(K_ALLOC, bytesize, true, &r);
    if (!rc) *dptr = (CUdeviceptr)r->key;
    return rc;
}

/* Frees a device pointer from cuMemAlloc* or a pool (either free call takes either). */
static CUresult free_pointer(CUdeviceptr dptr, CUstream s, bool with_stream) {
    NEED_INIT();
    CUresult captured_rc;
    if (with_stream && fake_captured_free(dptr, s, &captured_rc)) return captured_rc;
    pthread_mutex_lock(&g_mu);
    struct res *c, *r;
    int dev = 0;
    CUresult rc = need_ctx(&c);
    if (!rc && with_stream) rc = stream_dev(s, &dev);
    if (!rc) {
        r = dptr ? tab_find((uintptr_t)dptr) : NULL;
        if (r && (r->kind == K_ALLOC || r->kind == K_ASYNC))
            res_free(r);
        else if (r && r->kind == K_GALLOC)
            ; /* a graph's: the graph keeps it */
        else
            rc = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuMemFree_v2(CUdeviceptr dptr) { return free_pointer(dptr, NULL, false); }

API CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    NEED_INIT();
    if (!free_bytes || !total) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct res *c;
    CUresult rc = need_ctx(&c);
    if (!rc) {
        uint64_t used = g_dev[c->dev].used;
        *free_bytes = (size_t)(used >= g_cfg.memory ? 0 : g_cfg.memory - used);
        *total = (size_t)g_cfg.memory;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* True when [p, p+n) lies inside one live mapping (allocation or VA range). Locked. */
static bool range_mapped(uintptr_t p, size_t n, int *dev) {
    for (size_t i = 0; i < g_nbuckets; i++) {
        for (struct res *r = g_buckets[i]; r; r = r->hnext) {
            if (!r->map || (r->kind != K_ALLOC && r->kind != K_ASYNC && r->kind != K_VA)) continue;
            uintptr_t b = (uintptr_t)r->map;
            if (p >= b && p - b <= r->maplen && n <= r->maplen - (p - b)) {
                if (dev) *dev = r->dev;
                return true;
            }
        }
    }
    return false;
}

/* Synchronous copies: checked, then ordered after the work already queued. */
static CUresult copy_check(uintptr_t dptr, const void *host, size_t n, int *dev) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    struct res *c;
    CUresult rc = need_ctx(&c);
    if (!rc) {
        *dev = c->dev;
        if (n && (!host || !range_mapped(dptr, n, dev))) rc = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&g_mu);
    if (!rc) engine_wait_device(*dev);
    return rc;
}

API CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
    int dev;
    CUresult rc = copy_check((uintptr_t)dstDevice, srcHost, ByteCount, &dev);
    if (!rc && ByteCount) memcpy((void *)(uintptr_t)dstDevice, srcHost, ByteCount);
    return rc;
}

API CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
    int dev;
    CUresult rc = copy_check((uintptr_t)srcDevice, dstHost, ByteCount, &dev);
    if (!rc && ByteCount) memcpy(dstHost, (const void *)(uintptr_t)srcDevice, ByteCount);
    return rc;
}

/* ------------------------------------------------------------------ arrays */
static size_t format_bytes(CUarray_format f) {
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT: return 4;
    default: return 0;
    }
}

/* Bytes of a w x h x d array (zero h/d count as 1); false on overflow. */
static bool array_level_bytes(size_t w, size_t h, size_t d, size_t elem, uint64_t *out) {
    uint64_t b;
    if (__builtin_mul_overflow((uint64_t)w, (uint64_t)(h ? h : 1), &b)) return false;
    if (__builtin_mul_overflow(b, (uint64_t)(d ? d : 1), &b)) return false;
    if (__builtin_mul_overflow(b, (uint64_t)elem, &b)) return false;
    *out = b;
    return true;
}

/* Element size * channels, or 0 when the descriptor is malformed. */
static size_t array_elem(size_t width, CUarray_format format, unsigned channels) {
    size_t fb = format_bytes(format);
    if (width == 0 || fb == 0 || (channels != 1 && channels != 2 && channels != 4)) return 0;
    return fb * channels;
}

static CUresult array_create(CUarray *pHandle, size_t w, size_t h, size_t d, size_t elem) {
    uint64_t bytes;
    if (!array_level_bytes(w, h, d, elem, &bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
    struct res *r;
    CUresult rc = alloc_record(K_ARRAY, bytes, false, &r);
    if (!rc) *pHandle = (CUarray)r;
    return rc;
}

API CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc) {
    NEED_INIT();
    if (!pHandle || !desc) return CUDA_ERROR_INVALID_VALUE;
    size_t elem = array_elem(desc->Width, desc->Format, desc->NumChannels);
    if (!elem) return CUDA_ERROR_INVALID_VALUE;
    return array_create(pHandle, desc->Width, desc->Height, 0, elem);
}

API CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc) {
    NEED_INIT();
    if (!pHandle || !desc) return CUDA_ERROR_INVALID_VALUE;
    size_t elem = array_elem(desc->Width, desc->Format, desc->NumChannels);
    if (!elem) return CUDA_ERROR_INVALID_VALUE;
    return array_create(pHandle, desc->Width, desc->Height, desc->Depth, elem);
}

/* Frees the handle-keyed record h of kind k (needs a current context, as frees do). */
static CUresult free_handle(uintptr_t h, enum kind k) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    struct res *c;
    CUresult rc = need_ctx(&c);
    if (!rc) {
        struct res *r = tab_find_kind(h, k);
        if (r)
            res_free(r);
        else
            rc = CUDA_ERROR_INVALID_HANDLE;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuArrayDestroy(CUarray hArray) { return free_handle((uintptr_t)hArray, K_ARRAY); }

API CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                    unsigned int numMipmapLevels) {
    NEED_INIT();
    if (!pHandle || !desc || numMipmapLevels == 0 || numMipmapLevels > 64)
        return CUDA_ERROR_INVALID_VALUE;
    size_t elem = array_elem(desc->Width, desc->Format, desc->NumChannels);
    if (!elem) return CUDA_ERROR_INVALID_VALUE;
    size_t w = desc->Width, h = desc->Height, d = desc->Depth;
    uint64_t total = 0, level;
    for (unsigned i = 0; i < numMipmapLevels; i++) {
        if (!array_level_bytes(w, h, d, elem, &level) || __builtin_add_overflow(total, level, &total))
            return CUDA_ERROR_OUT_OF_MEMORY;
        w = w > 1 ? w / 2 : w;
        h = h > 1 ? h / 2 : h;
        d = d > 1 ? d / 2 : d;
    }
    struct res *r;
    CUresult rc = alloc_record(K_MIPMAP, total, false, &r);
    if (!rc) *pHandle = (CUmipmappedArray)r;
    return rc;
}

API CUresult cuMipmappedArrayDestroy(CUmipmappedArray h) { return free_handle((uintptr_t)h, K_MIPMAP); }

/* --------------------------------------------------------------------- VMM */
static bool device_location(const CUmemLocation *loc) {
    return loc->type == CU_MEM_LOCATION_TYPE_DEVICE && valid_dev(loc->id);
}

API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                         const CUmemAllocationProp *prop, unsigned long long flags) {
    NEED_INIT();
    if (!handle || !prop || size == 0 || flags != 0 || !device_location(&prop->location))
        return CUDA_ERROR_INVALID_VALUE;
    /* Counted on prop's device, whichever context is current. */
    struct res *r = NULL;
    CUresult rc;
    pthread_mutex_lock(&g_mu);
    struct res *c;
    int dev = prop->location.id;
    rc = need_ctx(&c);
    if (!rc && (size > g_cfg.memory || g_dev[dev].used > g_cfg.memory - size))
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (!rc && cgroup_limit_refuses(dev, size)) rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (!rc && !(r = new_handle(K_VMM, dev, c))) rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (!rc) {
        r->size = size;
        g_dev[dev].used += size;
        state_used(dev);
        *handle = (CUmemGenericAllocationHandle)(uintptr_t)r;
    }
    pthread_mutex_unlock(&g_mu);
    if (!rc) sleep_ms(g_cfg.alloc_delay_ms);
    return rc;
}

API CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    if (fake_release_retained((uintptr_t)handle)) return CUDA_SUCCESS;
    return free_handle((uintptr_t)handle, K_VMM);
}

API CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                           int option) {
    NEED_INIT();
    if (!granularity || !prop || (option != 0 && option != 1) || !device_location(&prop->location))
        return CUDA_ERROR_INVALID_VALUE;
    *granularity = FAKE_GRANULARITY;
    return CUDA_SUCCESS;
}

API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                 unsigned long long flags) {
    NEED_INIT();
    if (!ptr || size == 0 || flags != 0 || (alignment & (alignment - 1)))
        return CUDA_ERROR_INVALID_VALUE;
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    size_t len = page_round(size);
    size_t extra = alignment > pg ? alignment : 0;
    if (!len || len > SIZE_MAX - extra) return CUDA_ERROR_OUT_OF_MEMORY;
    size_t got;
    char *base = map_bytes(len + extra, &got);
    if (!base) return CUDA_ERROR_OUT_OF_MEMORY;
    char *p = base;
    if (extra) { /* keep only an aligned window */
        p = (char *)(((uintptr_t)base + alignment - 1) & ~(uintptr_t)(alignment - 1));
        if (p > base) munmap(base, (size_t)(p - base));
        size_t tail = got - (size_t)(p - base) - len;
        if (tail) munmap(p + len, tail);
    }
    pthread_mutex_lock(&g_mu);
    struct res *r = calloc(1, sizeof *r);
    CUresult rc = CUDA_SUCCESS;
    if (r) {
        r->kind = K_VA;
        r->key = (uintptr_t)p;
        r->map = p;
        r->maplen = len;
        r->size = size;
        r->dev = -1;
    }
    if (!r || !tab_insert(r)) {
        free(r);
        munmap(p, len);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        *ptr = (CUdeviceptr)(uintptr_t)p;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    struct res *r = tab_find_kind((uintptr_t)ptr, K_VA);
    CUresult rc = CUDA_SUCCESS;
    if (!r || r->size != size)
        rc = CUDA_ERROR_INVALID_VALUE;
    else
        res_free(r);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* True when [p, p+n) is inside one cuMemAddressReserve range. Locked. */
static bool in_va_range(uintptr_t p, size_t n) {
    for (size_t i = 0; i < g_nbuckets; i++)
        for (struct res *r = g_buckets[i]; r; r = r->hnext)
            if (r->kind == K_VA && p >= r->key && p - r->key <= r->size && n <= r->size - (p - r->key))
                return true;
    return false;
}

API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                      unsigned long long flags) {
    NEED_INIT();
    if (size == 0 || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    CUresult rc = CUDA_SUCCESS;
    struct res *h = tab_find_kind((uintptr_t)handle, K_VMM);
    if (!h)
        rc = CUDA_ERROR_INVALID_HANDLE;
    else if (offset > h->size || size > h->size - offset || !in_va_range((uintptr_t)ptr, size))
        rc = CUDA_ERROR_INVALID_VALUE;
    if (!rc) fake_map_note((uintptr_t)ptr, size, (uintptr_t)handle);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    NEED_INIT();
    if (size == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    bool ok = in_va_range((uintptr_t)ptr, size);
    if (ok) fake_map_forget((uintptr_t)ptr, size);
    pthread_mutex_unlock(&g_mu);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const FakeMemAccessDesc *desc, size_t count) {
    NEED_INIT();
    if (size == 0 || !desc || count == 0) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count; i++)
        if (!device_location(&desc[i].location)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    bool ok = in_va_range((uintptr_t)ptr, size);
    pthread_mutex_unlock(&g_mu);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ------------------------------------------------------------------- pools */
API CUresult cuMemPoolCreate(CUmemoryPool *pool, const FakeMemPoolProps *props) {
    NEED_INIT();
    if (!pool || !props || !device_location(&props->location)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct res *p = new_handle(K_POOL, props->location.id, NULL);
    pthread_mutex_unlock(&g_mu);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    *pool = (CUmemoryPool)p;
    return CUDA_SUCCESS;
}

/* A destroyed pool gives back what it does not use at once; its record lives
 * on, out of the table, until its last allocation is freed. */
API CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    struct res *p = tab_find_kind((uintptr_t)pool, K_POOL);
    CUresult rc = CUDA_SUCCESS;
    if (!p || p->is_default) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        tab_remove(p);
        if (g_dev[p->dev].current_pool == p) g_dev[p->dev].current_pool = g_dev[p->dev].default_pool;
        p->destroyed = true;
        pool_trim(p, 0); /* frees p when nothing is outstanding */
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    struct res *p = tab_find_kind((uintptr_t)pool, K_POOL);
    if (p) pool_trim(p, minBytesToKeep);
    pthread_mutex_unlock(&g_mu);
    return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value) {
    NEED_INIT();
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct res *p = tab_find_kind((uintptr_t)pool, K_POOL);
    CUresult rc = CUDA_SUCCESS;
    if (!p) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        switch (attr) {
        case FAKE_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
        case FAKE_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
        case FAKE_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: *(int *)value = 1; break;
        case FAKE_MEMPOOL_ATTR_RELEASE_THRESHOLD: *(cuuint64_t *)value = p->release_threshold; break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: *(cuuint64_t *)value = p->reserved; break;
        case FAKE_MEMPOOL_ATTR_RESERVED_MEM_HIGH: *(cuuint64_t *)value = p->reserved_high; break;
        case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *(cuuint64_t *)value = p->used; break;
        case FAKE_MEMPOOL_ATTR_USED_MEM_HIGH: *(cuuint64_t *)value = p->used_high; break;
        default: rc = CUDA_ERROR_INVALID_VALUE; break;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value) {
    NEED_INIT();
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct res *p = tab_find_kind((uintptr_t)pool, K_POOL);
    CUresult rc = CUDA_SUCCESS;
    if (!p) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        switch (attr) {
        case FAKE_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
        case FAKE_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
        case FAKE_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: break;
        case FAKE_MEMPOOL_ATTR_RELEASE_THRESHOLD: p->release_threshold = *(cuuint64_t *)value; break;
        case FAKE_MEMPOOL_ATTR_RESERVED_MEM_HIGH: /* only a reset to 0 is allowed */
        case FAKE_MEMPOOL_ATTR_USED_MEM_HIGH:
            if (*(cuuint64_t *)value != 0)
                rc = CUDA_ERROR_INVALID_VALUE;
            else if (attr == FAKE_MEMPOOL_ATTR_RESERVED_MEM_HIGH)
                p->reserved_high = p->reserved;
            else
                p->used_high = p->used;
            break;
        default: rc = CUDA_ERROR_INVALID_VALUE; break;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* A pool allocation: reuse the pool's free reserve, grow it by the shortfall.
 * pool NULL: the current pool of the stream's device. */
static CUresult pool_alloc(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s,
                           bool explicit_pool) {
    NEED_INIT();
    if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult captured_rc;
    if (fake_captured_alloc(dptr, bytesize, s, &captured_rc)) return captured_rc;
    pthread_mutex_lock(&g_mu);
    struct res *c, *p = NULL, *r = NULL;
    int dev = 0;
    CUresult rc = need_ctx(&c);
    if (!rc) rc = stream_dev(s, &dev);
    if (!rc) {
        if (explicit_pool)
            p = tab_find_kind((uintptr_t)pool, K_POOL);
        else if (default_pool(dev))
            p = g_dev[dev].current_pool;
        if (!p) rc = explicit_pool ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_OUT_OF_MEMORY;
    }
    uint64_t grow = 0;
    if (!rc) {
        struct device *d = &g_dev[p->dev];
        uint64_t spare = p->reserved - p->used;
        grow = bytesize > spare ? bytesize - spare : 0;
        if (grow > g_cfg.memory || d->used > g_cfg.memory - grow) rc = CUDA_ERROR_OUT_OF_MEMORY;
        if (!rc && cgroup_limit_refuses(p->dev, grow)) rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (!rc) {
        r = calloc(1, sizeof *r);
        if (r) r->map = map_bytes(bytesize, &r->maplen);
        if (r && r->map) {
            r->kind = K_ASYNC;
            r->key = (uintptr_t)r->map;
            r->dev = p->dev;
            r->ctx = c;
            r->size = bytesize;
            r->pool = p;
        }
        if (!r || !r->map || !tab_insert(r)) {
            if (r && r->map) munmap(r->map, r->maplen);
            free(r);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    if (!rc) {
        g_dev[p->dev].used += grow;
        state_used(p->dev);
        p->reserved += grow;
        p->used += bytesize;
        pool_note_high(p);
        *dptr = (CUdeviceptr)r->key;
    }
    pthread_mutex_unlock(&g_mu);
    if (!rc) sleep_ms(g_cfg.alloc_delay_ms);
    return rc;
}

API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return pool_alloc(dptr, bytesize, NULL, hStream, false);
}
API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return pool_alloc(dptr, bytesize, NULL, hStream, false);
}
API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                     CUstream hStream) {
    return pool_alloc(dptr, bytesize, pool, hStream, true);
}
API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                          CUstream hStream) {
    return pool_alloc(dptr, bytesize, pool, hStream, true);
}
API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) { return free_pointer(dptr, hStream, true); }
API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    return free_pointer(dptr, hStream, true);
}

/* ---------------------------------------------------------------- launches */
/* The stream if it is being captured (g_mu held). */
static struct res *capture_of(CUstream s) {
    struct res *r = s == NULL || s == FAKE_CU_STREAM_LEGACY || s == FAKE_CU_STREAM_PER_THREAD
                        ? NULL
                        : tab_find_kind((uintptr_t)s, K_STREAM);
    return r && r->capturing ? r : NULL;
}

static CUresult launch(CUstream s, uintptr_t us) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    struct res *c, *cap = NULL;
    int dev = 0;
    CUresult rc = need_ctx(&c);
    if (!rc) rc = stream_dev(s, &dev);
    if (!rc && (cap = capture_of(s))) cap->captured_us += us; /* joins the graph, runs nothing */
    int eng = rc ? 0 : stream_engine(s, dev);
    pthread_mutex_unlock(&g_mu);
    return rc || cap ? rc : engine_submit(eng, (uint64_t)us);
}

API CUresult cuLaunchKernel FAKE_LAUNCH_PARAMS { return launch(hStream, (uintptr_t)f); }
API CUresult cuLaunchKernel_ptsz FAKE_LAUNCH_PARAMS { return launch(hStream, (uintptr_t)f); }
API CUresult cuLaunchCooperativeKernel FAKE_COOP_PARAMS { return launch(hStream, (uintptr_t)f); }
API CUresult cuLaunchCooperativeKernel_ptsz FAKE_COOP_PARAMS { return launch(hStream, (uintptr_t)f); }

API CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                              void **extra) {
    NEED_INIT();
    if (!config || (config->numAttrs && !config->attrs)) return CUDA_ERROR_INVALID_VALUE;
    return launch(config->hStream, (uintptr_t)f);
}
API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                   void **extra) {
    return cuLaunchKernelEx(config, f, kernelParams, extra);
}

API CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) {
    return launch(hStream, (uintptr_t)fake_exec_us(hGraphExec));
}
API CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream) {
    return launch(hStream, (uintptr_t)fake_exec_us(hGraphExec));
}

/* cuStreamGetCtx: a created stream's context; the NULL, legacy and per-thread
 * streams are the current context's. */
API CUresult cuStreamGetCtx(CUstream hStream, CUcontext *pctx) {
    NEED_INIT();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct res *c = NULL;
    CUresult rc = CUDA_SUCCESS;
    if (hStream == NULL || hStream == FAKE_CU_STREAM_LEGACY || hStream == FAKE_CU_STREAM_PER_THREAD) {
        rc = need_ctx(&c);
    } else {
        struct res *r = tab_find_kind((uintptr_t)hStream, K_STREAM);
        if (!r) rc = CUDA_ERROR_INVALID_HANDLE;
        else c = r->ctx;
    }
    if (!rc) *pctx = (CUcontext)c;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* The legacy launches (cuLaunch, cuLaunchGrid on the NULL stream, cuLaunchGridAsync
 * on its own) run (uintptr_t)f microseconds like cuLaunchKernel; grid sizes are
 * not checked. cuLaunchCooperativeKernelMultiDevice runs each entry's function on
 * its entry's stream (and so on that stream's device), in order. */
API CUresult cuLaunch(CUfunction f) { return launch(NULL, (uintptr_t)f); }
API CUresult cuLaunchGrid(CUfunction f, int grid_width, int grid_height) {
    return launch(NULL, (uintptr_t)f);
}
API CUresult cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream hStream) {
    return launch(hStream, (uintptr_t)f);
}
API CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *launchParamsList,
                                                  unsigned int numDevices, unsigned int flags) {
    NEED_INIT();
    if (!launchParamsList || !numDevices) return CUDA_ERROR_INVALID_VALUE;
    for (unsigned int i = 0; i < numDevices; i++) {
        CUresult rc = launch(launchParamsList[i].hStream, (uintptr_t)launchParamsList[i].function);
        if (rc) return rc;
    }
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ events */
API CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) {
    NEED_INIT();
    if (!phEvent || (Flags & ~FAKE_EVENT_FLAGS_MASK)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct res *c, *e = NULL;
    CUresult rc = need_ctx(&c);
    if (!rc && !(e = new_handle(K_EVENT, c->dev, c))) rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (!rc) *phEvent = (CUevent)e;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuEventRecord(CUevent hEvent, CUstream hStream) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    struct res *e = tab_find_kind((uintptr_t)hEvent, K_EVENT);
    int dev = 0;
    CUresult rc = e ? stream_dev(hStream, &dev) : CUDA_ERROR_INVALID_HANDLE;
    struct res *cap = rc ? NULL : capture_of(hStream);
    if (cap) {
        cap->capture_invalid = true; /* see STREAM CAPTURE */
    } else if (!rc) {
        e->dev = stream_engine(hStream, dev); /* an engine id (CONCURRENT STREAMS) */
        e->target = engine_mark(e->dev); /* engine lock nests inside g_mu, never the reverse */
        e->stamp = engine_reached(e->dev, e->target) ? now_ns() : 0;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream) { return cuEventRecord(hEvent, hStream); }

/* The queue position an event waits for. */
static CUresult event_target(CUevent hEvent, int *dev, uint64_t *target) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    struct res *e = tab_find_kind((uintptr_t)hEvent, K_EVENT);
    if (e) {
        *dev = e->dev;
        *target = e->target;
    }
    pthread_mutex_unlock(&g_mu);
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

API CUresult cuEventQuery(CUevent hEvent) {
    int dev;
    uint64_t target;
    CUresult rc = event_target(hEvent, &dev, &target);
    if (rc) return rc;
    return engine_reached(dev, target) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

API CUresult cuEventSynchronize(CUevent hEvent) {
    int dev;
    uint64_t target;
    CUresult rc = event_target(hEvent, &dev, &target);
    if (!rc) engine_wait(dev, target);
    return rc;
}

/* When the engine reached an event: its record time if the queue was already
 * there, else the completion time of the work item before it. */
static CUresult event_stamp(CUevent hEvent, uint64_t *stamp) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    struct res *ev = tab_find_kind((uintptr_t)hEvent, K_EVENT);
    CUresult rc = CUDA_SUCCESS;
    if (!ev) rc = CUDA_ERROR_INVALID_HANDLE;
    else if (!ev->stamp) {
        struct engine *e = eng_at(ev->dev);
        pthread_mutex_lock(&e->mu);
        if (e->completed < ev->target) rc = CUDA_ERROR_NOT_READY;
        else if (e->completed - ev->target >= FAKE_STAMPS) rc = CUDA_ERROR_INVALID_VALUE;
        else ev->stamp = e->done_at[ev->target % FAKE_STAMPS];
        pthread_mutex_unlock(&e->mu);
    }
    if (!rc) *stamp = ev->stamp;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    uint64_t a, b;
    CUresult rc;
    if (!pMilliseconds) return CUDA_ERROR_INVALID_VALUE;
    if ((rc = event_stamp(hStart, &a)) || (rc = event_stamp(hEnd, &b))) return rc;
    *pMilliseconds = (float)(((double)b - (double)a) / 1e6);
    return CUDA_SUCCESS;
}

API CUresult cuEventDestroy_v2(CUevent hEvent) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    struct res *e = tab_find_kind((uintptr_t)hEvent, K_EVENT);
    if (e) res_free(e);
    pthread_mutex_unlock(&g_mu);
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* ----------------------------------------------------------------- streams */
API CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) {
    NEED_INIT();
    if (!phStream || (Flags & ~FAKE_STREAM_FLAGS_MASK)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct res *c, *s = NULL;
    CUresult rc = need_ctx(&c);
    if (!rc && !(s = new_handle(K_STREAM, c->dev, c))) rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (!rc) s->eng = stream_engine_new(c->dev);
    if (!rc) *phStream = (CUstream)s;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority) {
    return cuStreamCreate(phStream, flags);
}

API CUresult cuStreamDestroy_v2(CUstream hStream) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    struct res *s = tab_find_kind((uintptr_t)hStream, K_STREAM);
    if (s) res_free(s);
    pthread_mutex_unlock(&g_mu);
    return s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

static CUresult stream_target(CUstream s, int *dev, uint64_t *target) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    CUresult rc = stream_dev(s, dev);
    struct res *cap = rc ? NULL : capture_of(s);
    if (cap) {
        cap->capture_invalid = true;
        rc = FAKE_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    if (!rc) *dev = stream_engine(s, *dev);
    if (!rc) *target = engine_mark(*dev);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuStreamSynchronize(CUstream hStream) {
    int dev;
    uint64_t target;
    CUresult rc = stream_target(hStream, &dev, &target);
    if (!rc) engine_wait(dev, target);
    return rc;
}

API CUresult cuStreamSynchronize_ptsz(CUstream hStream) { return cuStreamSynchronize(hStream); }

API CUresult cuStreamQuery(CUstream hStream) {
    int dev;
    uint64_t target;
    CUresult rc = stream_target(hStream, &dev, &target);
    if (rc) return rc;
    return engine_reached(dev, target) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

API CUresult cuStreamQuery_ptsz(CUstream hStream) { return cuStreamQuery(hStream); }

/* ----------------------------------------------------------- stream capture */
API CUresult cuStreamBeginCapture_v2(CUstream hStream, int mode) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    int dev;
    CUresult rc = stream_dev(hStream, &dev);
    struct res *r = rc ? NULL : tab_find_kind((uintptr_t)hStream, K_STREAM);
    if (!rc && !r) rc = FAKE_ERROR_STREAM_CAPTURE_UNSUPPORTED; /* NULL, legacy, per-thread */
    else if (r && r->capturing) rc = FAKE_ERROR_ILLEGAL_STATE;
    if (r && !rc && !(r->graph = fake_graph_new(r->ctx))) rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (r && !rc) {
        r->capturing = true;
        r->capture_invalid = false;
        r->captured_us = 0;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph) {
    NEED_INIT();
    if (!phGraph) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct res *r = capture_of(hStream);
    CUresult rc = CUDA_SUCCESS;
    *phGraph = NULL;
    if (!r) {
        rc = FAKE_ERROR_ILLEGAL_STATE;
    } else {
        r->capturing = false;
        if (r->capture_invalid) {
            rc = FAKE_ERROR_STREAM_CAPTURE_INVALIDATED;
            fake_graph_release(r->graph); /* the graph and what it held go */
        } else {
            r->graph->us = r->captured_us;
            *phGraph = (CUgraph)r->graph;
        }
        r->graph = NULL;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuStreamIsCapturing(CUstream hStream, int *captureStatus) {
    NEED_INIT();
    if (!captureStatus) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    int dev;
    CUresult rc = stream_dev(hStream, &dev);
    struct res *r = rc ? NULL : capture_of(hStream);
    if (!rc) *captureStatus = !r ? 0 : r->capture_invalid ? 2 : 1;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuStreamIsCapturing_ptsz(CUstream hStream, int *captureStatus) {
    return cuStreamIsCapturing(hStream, captureStatus);
}

API CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                         unsigned long long flags) {
    NEED_INIT();
    if (!phGraphExec) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct res *g = tab_find_kind((uintptr_t)hGraph, K_GRAPH), *x = NULL;
    CUresult rc = CUDA_SUCCESS;
    if (g && g->destroyed) rc = CUDA_ERROR_INVALID_VALUE;
    else if (g && !(x = new_handle(K_EXEC, g->dev, g->ctx))) rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (x) {
        x->graph = g;
        x->us = g->us;
        g->execs++;
    }
    pthread_mutex_unlock(&g_mu);
    if (!rc) *phGraphExec = x ? (CUgraphExec)x : (CUgraphExec)hGraph; /* not a graph: its value */
    return rc;
}

/* ---------------------------------------------------------- fake-only exports */
static struct engine *engine_of(int dev) {
    config();
    return dev >= 0 && dev < g_cfg.devices ? &g_dev[dev].eng : NULL;
}

/* A counter of a device's engines, its streams' own included. */
static unsigned long long engines_sum(int dev, bool busy) {
    if (!engine_of(dev)) return 0;
    int ids[FAKE_STREAM_ENGINES + 1];
    pthread_mutex_lock(&g_mu);
    int n = device_stream_engines(dev, ids + 1);
    pthread_mutex_unlock(&g_mu);
    ids[0] = dev;
    unsigned long long v = 0;
    for (int i = 0; i <= n; i++) {
        struct engine *e = eng_at(ids[i]);
        pthread_mutex_lock(&e->mu);
        v += busy ? e->busy_ns : e->launches;
        pthread_mutex_unlock(&e->mu);
    }
    return v;
}

API unsigned long long fakecuda_busy_ns(int dev) { return engines_sum(dev, true); }

API unsigned long long fakecuda_launches(int dev) { return engines_sum(dev, false); }

API unsigned long long fakecuda_used_bytes(int dev) {
    if (!engine_of(dev)) return 0;
    pthread_mutex_lock(&g_mu);
    unsigned long long v = g_dev[dev].used;
    pthread_mutex_unlock(&g_mu);
    return v;
}

/* ============================================================ legacy ABI, sharing,
 * graph memory, context limits (see "LEGACY, SHARING, ..." at the top) */
#include <limits.h>
#include <sys/syscall.h>

API CUresult cuMemAlloc(unsigned int *dptr, unsigned int bytesize) {
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr p = 0;
    CUresult rc = cuMemAlloc_v2(&p, bytesize);
    if (!rc) *dptr = (unsigned int)p;
    return rc;
}

API CUresult cuMemAllocPitch(unsigned int *dptr, unsigned int *pPitch, unsigned int WidthInBytes,
                             unsigned int Height, unsigned int ElementSizeBytes) {
    if (!dptr || !pPitch) return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr p = 0;
    size_t pitch = 0;
    CUresult rc = cuMemAllocPitch_v2(&p, &pitch, WidthInBytes, Height, ElementSizeBytes);
    if (!rc) {
        *dptr = (unsigned int)p;
        *pPitch = (unsigned int)pitch;
    }
    return rc;
}

static unsigned int clamp_u32(size_t v) { return v > UINT_MAX ? UINT_MAX : (unsigned int)v; }

API CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total) {
    if (!free_bytes || !total) return CUDA_ERROR_INVALID_VALUE;
    size_t f = 0, t = 0;
    CUresult rc = cuMemGetInfo_v2(&f, &t);
    if (!rc) {
        *free_bytes = clamp_u32(f);
        *total = clamp_u32(t);
    }
    return rc;
}

API CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) {
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    size_t b = 0;
    CUresult rc = cuDeviceTotalMem_v2(&b, dev);
    if (!rc) *bytes = clamp_u32(b);
    return rc;
}

typedef struct {
    unsigned int Width, Height;
    CUarray_format Format;
    unsigned int NumChannels;
} FakeArrayDescV1;

typedef struct {
    unsigned int Width, Height, Depth;
    CUarray_format Format;
    unsigned int NumChannels, Flags;
} FakeArray3DDescV1;

API CUresult cuArrayCreate(CUarray *pHandle, const void *desc) {
    const FakeArrayDescV1 *a = desc;
    if (!a) return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY_DESCRIPTOR d = {a->Width, a->Height, a->Format, a->NumChannels};
    return cuArrayCreate_v2(pHandle, &d);
}

API CUresult cuArray3DCreate(CUarray *pHandle, const void *desc) {
    const FakeArray3DDescV1 *a = desc;
    if (!a) return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY3D_DESCRIPTOR d = {a->Width, a->Height, a->Depth, a->Format, a->NumChannels, a->Flags};
    return cuArray3DCreate_v2(pHandle, &d);
}

API CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    return ctx_create(pctx, flags, dev);
}

/* ---- mappings of cuMemCreate handles, for cuMemRetainAllocationHandle (g_mu held) */
#define FAKE_MAX_MAPS 256
static struct {
    uintptr_t ptr, handle;
    size_t size;
} g_maps[FAKE_MAX_MAPS];
static int g_nmaps;

static void fake_map_note(uintptr_t ptr, size_t size, uintptr_t handle) {
    if (g_nmaps < FAKE_MAX_MAPS) {
        g_maps[g_nmaps].ptr = ptr;
        g_maps[g_nmaps].size = size;
        g_maps[g_nmaps].handle = handle;
        g_nmaps++;
    }
}

static void fake_map_forget(uintptr_t ptr, size_t size) {
    for (int i = g_nmaps - 1; i >= 0; i--)
        if (g_maps[i].ptr >= ptr && g_maps[i].ptr - ptr < size) g_maps[i] = g_maps[--g_nmaps];
}

API CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    NEED_INIT();
    if (!handle || !addr) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < g_nmaps; i++) {
        uintptr_t a = (uintptr_t)addr;
        if (a >= g_maps[i].ptr && a - g_maps[i].ptr < g_maps[i].size) {
            struct res *h = tab_find_kind(g_maps[i].handle, K_VMM);
            if (h) {
                h->retains++;
                *handle = (CUmemGenericAllocationHandle)g_maps[i].handle;
                rc = CUDA_SUCCESS;
            }
            break;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* A retained handle's cuMemRelease drops a reference and frees nothing. */
static bool fake_release_retained(uintptr_t handle) {
    pthread_mutex_lock(&g_mu);
    struct res *h = tab_find_kind(handle, K_VMM);
    bool retained = h && h->retains > 0;
    if (retained) h->retains--;
    pthread_mutex_unlock(&g_mu);
    return retained;
}

/* ---- sharing (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR only) */
#define FAKE_HANDLE_TYPE_POSIX_FD 1

API CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                          int handleType, unsigned long long flags) {
    NEED_INIT();
    if (!shareableHandle || handleType != FAKE_HANDLE_TYPE_POSIX_FD || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct res *h = tab_find_kind((uintptr_t)handle, K_VMM);
    uint64_t size = h ? h->size : 0;
    pthread_mutex_unlock(&g_mu);
    if (!h) return CUDA_ERROR_INVALID_HANDLE;
    int fd = (int)syscall(SYS_memfd_create, "fakecuda-vmm", 0);
    if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    if (pwrite(fd, &size, sizeof size, 0) != (ssize_t)sizeof size) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *(int *)shareableHandle = fd;
    return CUDA_SUCCESS;
}

API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                            int shHandleType) {
    NEED_INIT();
    if (!handle || shHandleType != FAKE_HANDLE_TYPE_POSIX_FD) return CUDA_ERROR_INVALID_VALUE;
    uint64_t size = 0;
    if (pread((int)(intptr_t)osHandle, &size, sizeof size, 0) != (ssize_t)sizeof size || size == 0)
        return CUDA_ERROR_INVALID_HANDLE;
    struct res *r;
    CUresult rc = alloc_record(K_VMM, size, false, &r);
    if (!rc) *handle = (CUmemGenericAllocationHandle)(uintptr_t)r;
    return rc;
}

/* ---- graphs and graph memory (see GRAPH MEMORY at the top) */
#define FAKE_GRAPH_NODE_TYPE_MEM_ALLOC 10
#define FAKE_GRAPH_NODE_TYPE_MEM_FREE 11

typedef struct {
    FakeMemPoolProps poolProps;
    const FakeMemAccessDesc *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;
} FakeMemAllocNodeParams;


/* A new, empty graph of context c (g_mu held). */
static struct res *fake_graph_new(struct res *c) {
    return new_handle(K_GRAPH, c ? c->dev : 0, c);
}

/* The graph's memory and the graph itself go (g_mu held). */
static void fake_graph_release(struct res *g) {
    for (size_t i = 0; i < g_nbuckets; i++) {
        struct res *r = g_buckets[i];
        while (r) {
            struct res *next = r->hnext;
            if (r->kind == K_GALLOC && r->graph == g) res_free(r);
            r = next;
        }
    }
    res_free(g);
}

/* A live (not destroyed) graph of this handle (g_mu held). */
static struct res *live_graph(CUgraph h) {
    struct res *g = tab_find_kind((uintptr_t)h, K_GRAPH);
    return g && !g->destroyed ? g : NULL;
}

/* Device memory held by graph g on its device, at ptr (g_mu held). */
static CUresult graph_alloc(struct res *g, struct res *c, int dev, size_t bytes, CUdeviceptr *ptr) {
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_VALUE;
    struct device *d = &g_dev[dev];
    if (bytes > g_cfg.memory || d->used > g_cfg.memory - bytes) return CUDA_ERROR_OUT_OF_MEMORY;
    struct res *r = calloc(1, sizeof *r);
    if (r) r->map = map_bytes(bytes, &r->maplen);
    if (!r || !r->map) {
        free(r);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *r = (struct res){.key = (uintptr_t)r->map, .kind = K_GALLOC, .dev = dev, .ctx = c,
                      .size = bytes, .map = r->map, .maplen = r->maplen, .graph = g};
    if (!tab_insert(r)) {
        munmap(r->map, r->maplen);
        free(r);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    d->used += bytes;
    *ptr = (CUdeviceptr)r->key;
    return CUDA_SUCCESS;
}

/* A stream-ordered allocation into a capturing stream joins its graph: true
 * (with *rc) when s is capturing. */
static bool fake_captured_alloc(CUdeviceptr *dptr, size_t bytesize, CUstream s, CUresult *rc) {
    pthread_mutex_lock(&g_mu);
    struct res *cap = capture_of(s), *c = NULL;
    if (cap) {
        *rc = need_ctx(&c);
        if (!*rc && cap->capture_invalid) *rc = FAKE_ERROR_STREAM_CAPTURE_INVALIDATED;
        if (!*rc) *rc = graph_alloc(cap->graph, c, cap->dev, bytesize, dptr);
    }
    pthread_mutex_unlock(&g_mu);
    return cap != NULL;
}

/* A stream-ordered free into a capturing stream joins its graph and frees nothing. */
static bool fake_captured_free(CUdeviceptr dptr, CUstream s, CUresult *rc) {
    pthread_mutex_lock(&g_mu);
    struct res *cap = capture_of(s), *r = NULL;
    if (cap) {
        r = dptr ? tab_find((uintptr_t)dptr) : NULL;
        *rc = r && (r->kind == K_ALLOC || r->kind == K_ASYNC || r->kind == K_GALLOC)
                  ? CUDA_SUCCESS
                  : CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&g_mu);
    return cap != NULL;
}

static uint64_t fake_exec_us(CUgraphExec exec) {
    pthread_mutex_lock(&g_mu);
    struct res *x = tab_find_kind((uintptr_t)exec, K_EXEC);
    uint64_t us = x ? x->us : (uint64_t)(uintptr_t)exec;
    pthread_mutex_unlock(&g_mu);
    return us;
}

API unsigned long long fakecuda_exec_us(CUgraphExec exec) { return fake_exec_us(exec); }

API CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags) {
    NEED_INIT();
    if (!phGraph || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct res *c = NULL, *g = NULL;
    CUresult rc = need_ctx(&c);
    if (!rc && !(g = fake_graph_new(c))) rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (!rc) {
        g->us = 1;
        *phGraph = (CUgraph)g;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuGraphDestroy(CUgraph hGraph) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    struct res *g = live_graph(hGraph);
    if (g && g->execs == 0) fake_graph_release(g);
    else if (g) g->destroyed = true; /* its executables keep it */
    pthread_mutex_unlock(&g_mu);
    return g ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuGraphExecDestroy(CUgraphExec hGraphExec) {
    NEED_INIT();
    pthread_mutex_lock(&g_mu);
    struct res *x = tab_find_kind((uintptr_t)hGraphExec, K_EXEC);
    if (x) {
        struct res *g = x->graph;
        res_free(x);
        if (--g->execs == 0 && g->destroyed) fake_graph_release(g);
    }
    pthread_mutex_unlock(&g_mu);
    return x ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                char *logBuffer, size_t bufferSize) {
    return cuGraphInstantiateWithFlags(phGraphExec, hGraph, 0);
}
API CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph,
                                   CUgraphNode *phErrorNode, char *logBuffer, size_t bufferSize) {
    return cuGraphInstantiateWithFlags(phGraphExec, hGraph, 0);
}
API CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph, void *params) {
    return cuGraphInstantiateWithFlags(phGraphExec, hGraph, 0);
}
API CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                               void *params) {
    return cuGraphInstantiateWithFlags(phGraphExec, hGraph, 0);
}

/* Graph memory is the graph's until it goes: nothing cached to trim. */
API CUresult cuDeviceGraphMemTrim(CUdevice device) {
    NEED_INIT();
    return valid_dev(device) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

API CUresult cuStreamGetCaptureInfo_v3(CUstream hStream, int *status, cuuint64_t *id, CUgraph *graph,
                                       const CUgraphNode **deps, const void **edges, size_t *ndeps) {
    NEED_INIT();
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    int dev;
    CUresult rc = stream_dev(hStream, &dev);
    struct res *r = rc ? NULL : capture_of(hStream);
    if (!rc) {
        *status = !r ? 0 : r->capture_invalid ? 2 : 1;
        if (id) *id = r ? (cuuint64_t)(uintptr_t)r->graph : 0;
        if (graph) *graph = r && !r->capture_invalid ? (CUgraph)r->graph : NULL;
        if (deps) *deps = NULL;
        if (edges) *edges = NULL;
        if (ndeps) *ndeps = 0;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}
API CUresult cuStreamGetCaptureInfo_v3_ptsz(CUstream hStream, int *status, cuuint64_t *id,
                                            CUgraph *graph, const CUgraphNode **deps,
                                            const void **edges, size_t *ndeps) {
    return cuStreamGetCaptureInfo_v3(hStream, status, id, graph, deps, edges, ndeps);
}
API CUresult cuStreamGetCaptureInfo_v2(CUstream hStream, int *status, cuuint64_t *id, CUgraph *graph,
                                       const CUgraphNode **deps, size_t *ndeps) {
    return cuStreamGetCaptureInfo_v3(hStream, status, id, graph, deps, NULL, ndeps);
}
API CUresult cuStreamGetCaptureInfo_v2_ptsz(CUstream hStream, int *status, cuuint64_t *id,
                                            CUgraph *graph, const CUgraphNode **deps, size_t *ndeps) {
    return cuStreamGetCaptureInfo_v3(hStream, status, id, graph, deps, NULL, ndeps);
}

/* An allocation node: bytesize held by the graph on poolProps' device. */
API CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                    const CUgraphNode *dependencies, size_t numDependencies,
                                    void *nodeParams) {
    NEED_INIT();
    FakeMemAllocNodeParams *p = nodeParams;
    if (!phGraphNode || !p || p->bytesize == 0 || !device_location(&p->poolProps.location))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct res *g = live_graph(hGraph), *c = NULL;
    CUresult rc = g ? need_ctx(&c) : CUDA_ERROR_INVALID_VALUE;
    if (!rc) rc = graph_alloc(g, c, p->poolProps.location.id, p->bytesize, &p->dptr);
    if (!rc) *phGraphNode = (CUgraphNode)(uintptr_t)p->dptr;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* A free node frees nothing: the graph keeps its memory until it goes. */
API CUresult cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                   const CUgraphNode *dependencies, size_t numDependencies,
                                   CUdeviceptr dptr) {
    NEED_INIT();
    if (!phGraphNode) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct res *g = live_graph(hGraph), *r = dptr ? tab_find((uintptr_t)dptr) : NULL;
    CUresult rc = g && r && (r->kind == K_GALLOC || r->kind == K_ALLOC || r->kind == K_ASYNC)
                      ? CUDA_SUCCESS
                      : CUDA_ERROR_INVALID_VALUE;
    if (!rc) *phGraphNode = (CUgraphNode)((uintptr_t)dptr + 1);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

static CUresult add_node(CUgraphNode *phGraphNode, CUgraph hGraph, void *nodeParams) {
    if (!nodeParams) return CUDA_ERROR_INVALID_VALUE;
    int type = *(int *)nodeParams;
    void *params = (char *)nodeParams + 16;
    if (type == FAKE_GRAPH_NODE_TYPE_MEM_ALLOC)
        return cuGraphAddMemAllocNode(phGraphNode, hGraph, NULL, 0, params);
    if (type == FAKE_GRAPH_NODE_TYPE_MEM_FREE)
        return cuGraphAddMemFreeNode(phGraphNode, hGraph, NULL, 0, *(CUdeviceptr *)params);
    return CUDA_ERROR_NOT_SUPPORTED;
}

API CUresult cuGraphAddNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                            size_t numDependencies, void *nodeParams) {
    return add_node(phGraphNode, hGraph, nodeParams);
}

API CUresult cuGraphAddNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph,
                               const CUgraphNode *dependencies, const void *dependencyData,
                               size_t numDependencies, void *nodeParams) {
    return add_node(phGraphNode, hGraph, nodeParams);
}

/* ---- context limits */
static const uint64_t g_limit_default[3] = {1024, (uint64_t)1 << 20, (uint64_t)8 << 20};
static struct {
    struct res *ctx;
    uint64_t value[3];
} g_limits[64];

static uint64_t *limits_of(struct res *c, bool add) {
    for (int i = 0; i < 64; i++)
        if (g_limits[i].ctx == c) return g_limits[i].value;
    if (!add) return NULL;
    for (int i = 0; i < 64; i++)
        if (!g_limits[i].ctx) {
            g_limits[i].ctx = c;
            memcpy(g_limits[i].value, g_limit_default, sizeof g_limit_default);
            return g_limits[i].value;
        }
    return NULL;
}

static uint64_t limit_bytes(int limit, uint64_t value) {
    uint64_t extra = value > g_limit_default[limit] ? value - g_limit_default[limit] : 0;
    return limit == 0 ? extra * (uint64_t)g_cfg.sm_count * 2048 : extra;
}

static void fake_ctx_limits_gone(struct res *c) {
    uint64_t *v = limits_of(c, false);
    if (!v) return;
    c->limit_bytes = 0;
    for (int i = 0; i < 64; i++)
        if (g_limits[i].ctx == c) g_limits[i].ctx = NULL;
}

API CUresult cuCtxSetLimit(int limit, size_t value) {
    NEED_INIT();
    if (limit < 0 || limit > 2) return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&g_mu);
    struct res *c;
    CUresult rc = need_ctx(&c);
    uint64_t *v = rc ? NULL : limits_of(c, true);
    if (!rc && !v) rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (!rc) {
        uint64_t before = limit_bytes(limit, v[limit]), after = limit_bytes(limit, value);
        struct device *d = &g_dev[c->dev];
        if (after > before && (after - before > g_cfg.memory || d->used > g_cfg.memory - (after - before))) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            d->used = d->used + after - before;
            c->size = c->size + after - before;
            c->limit_bytes = c->limit_bytes + after - before;
            v[limit] = value;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuCtxGetLimit(size_t *pvalue, int limit) {
    NEED_INIT();
    if (!pvalue || limit < 0 || limit > 2) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct res *c;
    CUresult rc = need_ctx(&c);
    if (!rc) {
        uint64_t *v = limits_of(c, false);
        *pvalue = (size_t)(v ? v[limit] : g_limit_default[limit]);
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/*
 * A DRIVER NEWER THAN THE LIBRARY: cuMemAlloc_v3 stands for a version of an
 * accounted family that a later driver adds and the interposer does not wrap
 * (no CUDA release has it). It allocates as cuMemAlloc_v2 does and is reached by
 * its name only (dlsym), never from cuGetProcAddress.
 */
API CUresult cuMemAlloc_v3(CUdeviceptr *dptr, size_t bytesize);
API CUresult cuMemAlloc_v3(CUdeviceptr *dptr, size_t bytesize) { return cuMemAlloc_v2(dptr, bytesize); }
