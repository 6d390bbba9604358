/* The placement engine's compiled core: the interface between native/engine/engine.c
 * and gpuslice_scheduler/core.py, which reads this header at import and hands it to
 * cffi (ABI mode), so the struct layouts have this one definition.
 *
 * Every array is owned by the caller (NumPy); the core allocates only scratch
 * space and never keeps a pointer after it returns. Node n's cards are
 * node_start[n] .. node_start[n + 1] - 1. */
#ifndef GS_ENGINE_CORE_H
#define GS_ENGINE_CORE_H

#include <stdint.h>

#define GS_ENGINE_ABI 3
#define GS_CODE_COUNT 15

/* GPU and node policies */
#define GS_POLICY_FRAGMENTATION 0
#define GS_POLICY_BINPACK 1
#define GS_POLICY_SPREAD 2
#define GS_POLICY_NONE 3

/* why a node failed: nothing, its CPU or memory, or container c (GS_FAIL_CONTAINER + c) */
#define GS_FAIL_NONE 0
#define GS_FAIL_NODE_SHORT 1
#define GS_FAIL_CONTAINER 2

/* return values */
#define GS_OK 0
#define GS_ENOMEM 1
#define GS_EINVAL 2

typedef struct {
    int64_t node_count;
    const int64_t *node_start;
    const int64_t *model_id;
    const int64_t *numa;
    const int64_t *cap_mem;
    const int64_t *cap_cores;
    const int64_t *cap_slots;
    const int64_t *used_mem;
    const int64_t *used_cores;
    const int64_t *used_slots;
    const uint8_t *owned;
    const uint8_t *healthy;
    const uint8_t *present;
    const uint8_t *cordoned;
    const double *cpu_free;
    const double *mem_free;
} gs_cluster_t;

typedef struct {
    int64_t classes;
    int64_t parts;
    const double *weight;
    const double *cpu;
    const double *memory;
    const int64_t *need;
    const int64_t *part;
    const int64_t *part_mem_mib;
    const int64_t *part_mem_percent;
    const int64_t *part_cores;
    const uint8_t *part_exclusive;
    const uint8_t *model_ok; /* (models, parts), row-major */
    /* A node's free share its CPU or memory cannot feed (see engine.c): the CPU
     * (milli) and memory (MiB) it needs per milli-GPU of free share, 0 for not
     * priced, and the weight of that share against the fragments. */
    double cpu_per_share;
    double mem_per_share;
    double starved_weight;
} gs_mix_t;

typedef struct {
    int64_t count;
    int64_t mem_mib;     /* -1 when the memory is a percentage */
    int64_t mem_percent; /* -1 when the memory is in MiB */
    int64_t cores;
    uint8_t exclusive;
    uint8_t init;
    uint8_t sidecar;
} gs_container_t;

typedef struct {
    int32_t gpu_policy;
    int32_t node_policy;       /* GS_POLICY_NONE: follow the GPU policy */
    double cpu;
    double memory;
    int64_t containers;        /* -1: the pod asks for no GPU */
    const gs_container_t *container;
    const uint8_t *type_ok;    /* per model; NULL without type lists */
    const uint8_t *uuid_ok;    /* per card of the cluster; NULL without UUID lists */
    uint8_t numa_bind;
    /* weights of slots, cores and memory in HAMi's card score (binpack, spread) */
    double slot_weight;
    double core_weight;
    double mem_weight;
} gs_demand_t;

typedef struct {
    uint8_t *feasible;         /* per node */
    double *score;             /* per node; -inf where infeasible */
    int8_t *code;              /* per node */
    int64_t *chosen;           /* per container c, (nodes, count_c) card indexes, -1 none */
    int32_t *failed;           /* per node: GS_FAIL_* */
    int32_t *counts;           /* (nodes, GS_CODE_COUNT): that container's card codes */
} gs_result_t;

/* Fit, cards and score of `demand` on each of `nodes`; `mix` may be NULL. */
int gs_evaluate(const gs_cluster_t *cluster, const gs_demand_t *demand, const gs_mix_t *mix,
                const int64_t *nodes, int64_t n, gs_result_t *result);

/* Fragmentation and free share (milli-GPU) of each of `nodes` as they are. */
int gs_fragmentation(const gs_cluster_t *cluster, const gs_mix_t *mix, const int64_t *nodes,
                     int64_t n, double *fragmentation, double *total);

int gs_engine_abi(void);

#endif
