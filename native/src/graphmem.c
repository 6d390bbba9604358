/*
 * Graph memory: device memory a CUDA graph allocates. A stream-ordered
 * allocation made into a stream under capture, and a memory-allocation node
 * added to a graph, become part of the graph: the driver keeps that memory for
 * the graph (and the executable graphs instantiated from it) whatever the graph
 * frees inside itself, in a pool of its own that no call of the process names.
 *
 * So each such allocation is charged when it is captured or added (refused with
 * CUDA_ERROR_OUT_OF_MEMORY when it does not fit), to the graph being built
 * (cuStreamGetCaptureInfo names it), and a free captured into the graph or added
 * as a node gives nothing back. The charge is given back when the graph and
 * every executable graph instantiated from it are destroyed, or with the context
 * the allocation was made in; the device's cached graph memory is then trimmed
 * (cuDeviceGraphMemTrim) so what was given back is back with the driver. An
 * allocation the graph does not free itself outlives it: its charge stays, as a
 * plain allocation of its pointer, until cuMemFree(Async) of that pointer or the
 * context's end.
 *
 * The driver lets a graph holding allocation or free nodes be neither cloned
 * nor embedded as a child, nor lose nodes, and instantiated once at a time: its
 * memory is in it and its executable only.
 *
 * Where the exact figure cannot be known, more is charged, never less:
 *  - each graph is charged in full, though the driver may let graphs that never
 *    run at once share physical memory;
 *  - an allocation whose capturing graph cannot be named (no
 *    cuStreamGetCaptureInfo) stays charged until its context ends, as does one
 *    from a capture that fails (the driver drops that graph unseen);
 *  - a free node of one graph for another graph's allocation gives nothing back;
 *  - an allocation the graph does not free, freed outside it while the graph
 *    lives, stays charged until its context ends (the graph allocates it again
 *    at its next launch, and launches are not followed here);
 *  - cuDeviceGraphMemTrim by the application gives nothing back: the charge
 *    follows the graphs, not the driver's cache.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>

#include "gs.h"

/* CUDA_MEM_ALLOC_NODE_PARAMS (v1 and v2 alike), as cuda.h lays it out. */
typedef struct {
    struct {
        int allocType, handleTypes;
        CUmemLocation location;
        void *win32SecurityAttributes;
        size_t maxSize;
        unsigned short usage;
        unsigned char reserved[54];
    } poolProps;
    const void *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;
} gs_alloc_node_params_t;
_Static_assert(offsetof(gs_alloc_node_params_t, bytesize) == 104, "CUDA_MEM_ALLOC_NODE_PARAMS");

/* CUgraphNodeParams: the node's type, then its parameters at offset 16. */
enum { GS_NODE_MEM_ALLOC = 10, GS_NODE_MEM_FREE = 11, GS_NODE_PARAMS_AT = 16 };
enum { GS_CAPTURE_ACTIVE = 1 };

/* One allocation a graph holds. */
typedef struct {
    uint64_t graph; /* CUgraph; 0 when the capturing graph could not be named */
    uint64_t ptr, bytes;
    CUcontext ctx;
    int dev;          /* region record */
    CUdevice ordinal; /* for cuDeviceGraphMemTrim */
    bool freed;       /* the graph frees it itself */
    bool graph_gone;  /* cuGraphDestroy of its graph has been called */
} galloc_t;

/* An executable graph instantiated from a graph holding memory. */
typedef struct {
    uint64_t exec, graph;
} gexec_t;

static pthread_mutex_t graphs_mu = PTHREAD_MUTEX_INITIALIZER;
static galloc_t *allocs;
static size_t allocs_len, allocs_cap;
static gexec_t *execs;
static size_t execs_len, execs_cap;

static bool grow(void **array, size_t *cap, size_t len, size_t size) {
    if (len < *cap) return true;
    size_t n = *cap ? *cap * 2 : 64;
    void *p = realloc(*array, n * size);
    if (!p) return false;
    *array = p;
    *cap = n;
    return true;
}

static CUcontext current_ctx(void) {
    CUcontext ctx = NULL;
    if (gs_real.cuCtxGetCurrent) gs_real.cuCtxGetCurrent(&ctx);
    return ctx;
}

CUgraph gs_capture_graph(CUstream s, bool ptsz) {
    int status = 0;
    CUgraph g = NULL;
    __typeof__(gs_real.cuStreamGetCaptureInfo_v2) v2 =
        ptsz ? gs_real.cuStreamGetCaptureInfo_v2_ptsz : gs_real.cuStreamGetCaptureInfo_v2;
    __typeof__(gs_real.cuStreamGetCaptureInfo_v3) v3 =
        ptsz ? gs_real.cuStreamGetCaptureInfo_v3_ptsz : gs_real.cuStreamGetCaptureInfo_v3;
    if (v2 && v2(s, &status, NULL, &g, NULL, NULL) == CUDA_SUCCESS) return g;
    if (v3 && v3(s, &status, NULL, &g, NULL, NULL, NULL) == CUDA_SUCCESS) return g;
    return NULL;
}

/* The graph's allocations are released once it and its executables are gone. Locked. */
static bool graph_held_locked(uint64_t graph) {
    for (size_t i = 0; i < execs_len; i++)
        if (execs[i].graph == graph) return true;
    return false;
}

/* Gives back what `graph`'s gone allocations held, if nothing holds them any more;
 * returns a device ordinal to trim, or -1. Locked. */
static CUdevice settle_locked(uint64_t graph) {
    CUdevice trim = -1;
    if (!graph || graph_held_locked(graph)) return trim;
    for (size_t i = allocs_len; i-- > 0;) {
        galloc_t a = allocs[i];
        if (a.graph != graph || !a.graph_gone) continue;
        allocs[i] = allocs[--allocs_len];
        if (a.freed) gs_unreserve(a.dev, a.bytes);
        else gs_track_add(GS_K_MEM, a.ptr, a.dev, a.bytes, a.ctx); /* outlives the graph */
        trim = a.ordinal;
    }
    return trim;
}

static void trim(CUdevice ordinal) {
    if (ordinal >= 0 && gs_real.cuDeviceGraphMemTrim) gs_real.cuDeviceGraphMemTrim(ordinal);
}

void gs_graph_charge(CUgraph graph, CUdeviceptr ptr, int dev, uint64_t bytes, CUdevice ordinal) {
    if (ordinal < 0 && (!gs_real.cuCtxGetDevice || gs_real.cuCtxGetDevice(&ordinal) != CUDA_SUCCESS))
        ordinal = -1;
    if (!graph) {
        static atomic_int logged;
        if (!atomic_exchange(&logged, 1))
            gs_log(GS_LOG_WARN, "the graph being captured could not be named "
                   "(cuStreamGetCaptureInfo): its allocations stay charged until their context "
                   "ends (logged once)");
    }
    pthread_mutex_lock(&graphs_mu);
    bool ok = grow((void **)&allocs, &allocs_cap, allocs_len, sizeof *allocs);
    if (ok)
        allocs[allocs_len++] = (galloc_t){.graph = (uint64_t)(uintptr_t)graph, .ptr = ptr,
                                          .bytes = bytes, .ctx = current_ctx(), .dev = dev,
                                          .ordinal = ordinal};
    pthread_mutex_unlock(&graphs_mu);
    if (!ok) /* never given back: more is charged, never less */
        gs_log(GS_LOG_ERROR, "out of host memory tracking graph memory; it stays charged");
}

/* A free captured into `graph` or added to it as a node: the graph frees its own
 * allocation (given back with the graph); anything else is not given back here. */
static void graph_frees(CUgraph graph, CUdeviceptr ptr) {
    pthread_mutex_lock(&graphs_mu);
    for (size_t i = 0; graph && i < allocs_len; i++)
        if (allocs[i].graph == (uint64_t)(uintptr_t)graph && allocs[i].ptr == ptr &&
            !allocs[i].freed && !allocs[i].graph_gone) {
            allocs[i].freed = true;
            break;
        }
    pthread_mutex_unlock(&graphs_mu);
}

void gs_graph_free_captured(CUstream s, bool ptsz, CUdeviceptr ptr) {
    graph_frees(gs_capture_graph(s, ptsz), ptr);
}

uint64_t gs_graphs_drop_ctx(CUcontext ctx) {
    uint64_t total = 0;
    pthread_mutex_lock(&graphs_mu);
    for (size_t i = allocs_len; i-- > 0;) {
        if (allocs[i].ctx != ctx) continue;
        gs_unreserve(allocs[i].dev, allocs[i].bytes);
        total += allocs[i].bytes;
        allocs[i] = allocs[--allocs_len];
    }
    for (size_t i = execs_len; i-- > 0;) { /* executables of graphs that hold nothing now */
        bool holds = false;
        for (size_t j = 0; j < allocs_len && !holds; j++) holds = allocs[j].graph == execs[i].graph;
        if (!holds) execs[i] = execs[--execs_len];
    }
    pthread_mutex_unlock(&graphs_mu);
    return total;
}

void gs_graphs_after_fork(void) {
    pthread_mutex_init(&graphs_mu, NULL); /* the lock may have been held */
    allocs_len = 0;
    execs_len = 0;
}

/* ------------------------------------------------------------ allocation and free nodes */
/* Reserves for an allocation node, adds it (`call`), charges it to the graph. */
#define GS_ADD_ALLOC_NODE(params, call)                                                       \
    do {                                                                                      \
        int dev_ = -1;                                                                        \
        CUdevice ordinal_ = -1;                                                               \
        if ((params) && (params)->poolProps.location.type == CU_MEM_LOCATION_TYPE_DEVICE &&   \
            (params)->poolProps.location.id >= 0)                                             \
            dev_ = gs_record_of(ordinal_ = (params)->poolProps.location.id);                  \
        else                                                                                  \
            dev_ = gs_current_device();                                                       \
        if (!(params) || (params)->bytesize == 0 || dev_ == -1) return (call);                \
        uint64_t bytes_ = (params)->bytesize;                                                 \
        if (!gs_reserve_trimming(dev_, bytes_)) return CUDA_ERROR_OUT_OF_MEMORY;              \
        CUresult rc_ = (call);                                                                \
        if (rc_ != CUDA_SUCCESS) gs_unreserve(dev_, bytes_);                                  \
        else gs_graph_charge(hGraph, (params)->dptr, dev_, bytes_, ordinal_);                 \
        return rc_;                                                                           \
    } while (0)

CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                const CUgraphNode *dependencies, size_t numDependencies,
                                void *nodeParams) {
    gs_alloc_node_params_t *p = nodeParams;
    if (!gs_enter())
        return GS_CALL(cuGraphAddMemAllocNode,
                       (phGraphNode, hGraph, dependencies, numDependencies, nodeParams));
    GS_ADD_ALLOC_NODE(p, GS_CALL(cuGraphAddMemAllocNode,
                                 (phGraphNode, hGraph, dependencies, numDependencies, nodeParams)));
}

CUresult cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                               const CUgraphNode *dependencies, size_t numDependencies,
                               CUdeviceptr dptr) {
    gs_init();
    CUresult rc = GS_CALL(cuGraphAddMemFreeNode,
                          (phGraphNode, hGraph, dependencies, numDependencies, dptr));
    if (rc == CUDA_SUCCESS && gs_enter()) graph_frees(hGraph, dptr);
    return rc;
}

static int node_type(const void *nodeParams) { return nodeParams ? *(const int *)nodeParams : -1; }

static gs_alloc_node_params_t *alloc_params(void *nodeParams) {
    return (gs_alloc_node_params_t *)((char *)nodeParams + GS_NODE_PARAMS_AT);
}

static CUdeviceptr free_ptr(const void *nodeParams) {
    return *(const CUdeviceptr *)((const char *)nodeParams + GS_NODE_PARAMS_AT);
}

CUresult cuGraphAddNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                        size_t numDependencies, void *nodeParams) {
    gs_init();
    int type = node_type(nodeParams);
    if (type == GS_NODE_MEM_ALLOC && gs_enter())
        GS_ADD_ALLOC_NODE(alloc_params(nodeParams),
                          GS_CALL(cuGraphAddNode,
                                  (phGraphNode, hGraph, dependencies, numDependencies, nodeParams)));
    CUresult rc =
        GS_CALL(cuGraphAddNode, (phGraphNode, hGraph, dependencies, numDependencies, nodeParams));
    if (rc == CUDA_SUCCESS && type == GS_NODE_MEM_FREE && gs_enter())
        graph_frees(hGraph, free_ptr(nodeParams));
    return rc;
}

CUresult cuGraphAddNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                           const void *dependencyData, size_t numDependencies, void *nodeParams) {
    gs_init();
    int type = node_type(nodeParams);
    if (type == GS_NODE_MEM_ALLOC && gs_enter())
        GS_ADD_ALLOC_NODE(alloc_params(nodeParams),
                          GS_CALL(cuGraphAddNode_v2, (phGraphNode, hGraph, dependencies,
                                                      dependencyData, numDependencies, nodeParams)));
    CUresult rc = GS_CALL(cuGraphAddNode_v2, (phGraphNode, hGraph, dependencies, dependencyData,
                                              numDependencies, nodeParams));
    if (rc == CUDA_SUCCESS && type == GS_NODE_MEM_FREE && gs_enter())
        graph_frees(hGraph, free_ptr(nodeParams));
    return rc;
}

/* ------------------------------------------------------------ instantiation, destruction */
/* An executable graph of a graph holding memory keeps that memory alive. */
static CUresult instantiated(CUresult rc, CUgraphExec *exec, CUgraph graph) {
    if (rc != CUDA_SUCCESS || !exec || !*exec || !graph || !gs_enter()) return rc;
    pthread_mutex_lock(&graphs_mu);
    bool holds = false;
    for (size_t i = 0; i < allocs_len && !holds; i++)
        holds = allocs[i].graph == (uint64_t)(uintptr_t)graph;
    if (holds && grow((void **)&execs, &execs_cap, execs_len, sizeof *execs))
        execs[execs_len++] = (gexec_t){(uint64_t)(uintptr_t)*exec, (uint64_t)(uintptr_t)graph};
    else if (holds) /* untracked, the graph's memory would be given back under it: keep it */
        for (size_t i = 0; i < allocs_len; i++)
            if (allocs[i].graph == (uint64_t)(uintptr_t)graph) allocs[i].graph = 0;
    pthread_mutex_unlock(&graphs_mu);
    return rc;
}

CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                            char *logBuffer, size_t bufferSize) {
    gs_init();
    return instantiated(
        GS_CALL(cuGraphInstantiate, (phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize)),
        phGraphExec, hGraph);
}

CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                               char *logBuffer, size_t bufferSize) {
    gs_init();
    return instantiated(
        GS_CALL(cuGraphInstantiate_v2, (phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize)),
        phGraphExec, hGraph);
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                     unsigned long long flags) {
    gs_init();
    return instantiated(GS_CALL(cuGraphInstantiateWithFlags, (phGraphExec, hGraph, flags)),
                        phGraphExec, hGraph);
}

CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                      void *instantiateParams) {
    gs_init();
    return instantiated(
        GS_CALL(cuGraphInstantiateWithParams, (phGraphExec, hGraph, instantiateParams)),
        phGraphExec, hGraph);
}

CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                           void *instantiateParams) {
    gs_init();
    return instantiated(
        GS_CALL(cuGraphInstantiateWithParams_ptsz, (phGraphExec, hGraph, instantiateParams)),
        phGraphExec, hGraph);
}

/* The lock spans the driver call: a handle the driver frees may be handed out
 * again at once, and a new graph's memory must not be taken for the old one's. */
CUresult cuGraphExecDestroy(CUgraphExec hGraphExec) {
    if (!gs_enter()) return GS_CALL(cuGraphExecDestroy, (hGraphExec));
    pthread_mutex_lock(&graphs_mu);
    CUresult rc = GS_CALL(cuGraphExecDestroy, (hGraphExec));
    CUdevice to_trim = -1;
    for (size_t i = 0; rc == CUDA_SUCCESS && i < execs_len; i++) {
        if (execs[i].exec != (uint64_t)(uintptr_t)hGraphExec) continue;
        uint64_t graph = execs[i].graph;
        execs[i] = execs[--execs_len];
        to_trim = settle_locked(graph);
        break;
    }
    pthread_mutex_unlock(&graphs_mu);
    trim(to_trim);
    return rc;
}

CUresult cuGraphDestroy(CUgraph hGraph) {
    if (!gs_enter()) return GS_CALL(cuGraphDestroy, (hGraph));
    pthread_mutex_lock(&graphs_mu);
    CUresult rc = GS_CALL(cuGraphDestroy, (hGraph));
    CUdevice to_trim = -1;
    if (rc == CUDA_SUCCESS && hGraph) {
        for (size_t i = 0; i < allocs_len; i++)
            if (allocs[i].graph == (uint64_t)(uintptr_t)hGraph) allocs[i].graph_gone = true;
        to_trim = settle_locked((uint64_t)(uintptr_t)hGraph);
    }
    pthread_mutex_unlock(&graphs_mu);
    trim(to_trim);
    return rc;
}
