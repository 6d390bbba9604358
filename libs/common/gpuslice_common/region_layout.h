/*
 * gpuslice shared region: one file per container (CUDA_DEVICE_MEMORY_SHARED_CACHE),
 * mapped by every process of the container that uses CUDA and read by the node
 * agent. This header is the one definition of its layout: the interposer
 * (native/) includes it and the Python binding (gpuslice_common.region) parses it.
 *
 * Rules that keep both readers honest:
 *  - fixed-size fields only, naturally aligned, no pointers;
 *  - every field the interposer updates concurrently is accessed with atomic
 *    builtins on the C side; the node agent writes nothing here (its flags and
 *    heartbeat live in the control file below, which the container cannot
 *    write); `flags` and `agent_heartbeat_ns` are left from an earlier agent
 *    and read by no one;
 *  - any change of layout bumps GS_REGION_VERSION; readers refuse another version.
 * Only `#define NAME number` lines and typedefs appear here (the Python side
 * parses it with cffi).
 */
#ifndef GS_REGION_LAYOUT_H
#define GS_REGION_LAYOUT_H

#include <stdint.h>

#define GS_REGION_MAGIC 0x31525347
#define GS_REGION_VERSION 1
#define GS_MAX_DEVICES 16
#define GS_MAX_PROCS 1024
#define GS_UUID_LEN 96

/* device flags, set by the node agent in the control file */
#define GS_DEV_SHARED 1
#define GS_DEV_YIELD 2

/* the agent's flags count only while its heartbeat is younger than this */
#define GS_AGENT_FRESH_NS 5000000000

/* The node agent's control file ("control" beside the grant, mode 0444, in the
 * directory the container sees read-only): written by the agent alone, in
 * place, and mapped read-only by the interposer. Device i is the grant's i-th
 * device (the region's record i). */
#define GS_CONTROL_MAGIC 0x31435347
#define GS_CONTROL_VERSION 1
typedef struct {
    uint32_t magic;              /* GS_CONTROL_MAGIC */
    uint32_t version;            /* GS_CONTROL_VERSION */
    uint64_t heartbeat_ns;       /* CLOCK_MONOTONIC of the agent's last tick; 0: none yet */
    uint32_t flags[GS_MAX_DEVICES];        /* GS_DEV_* */
    uint64_t tat_floor_ns[GS_MAX_DEVICES]; /* the highest limiter clock the agent saw in the region */
    uint64_t reserved[8];
} gs_control_t;                  /* 272 bytes */

typedef struct {
    char uuid[GS_UUID_LEN];      /* "GPU-..." as NVML prints it; empty until a process attached */
    uint64_t limit;              /* bytes the container may hold on this device; 0 = no limit */
    uint64_t used;               /* bytes the container's processes hold or are allocating */
    uint64_t peak;               /* highest `used` seen */
    uint64_t denied;             /* allocations refused for the limit */
    uint64_t throttled_ns;       /* time launches waited in the compute limiter */
    uint64_t busy_ns;            /* kernel time measured by the compute limiter */
    uint64_t tat_ns;             /* the container's limiter clock (CLOCK_MONOTONIC ns): pushed later only */
    uint32_t sm_limit;           /* percent of the device's compute; 0 = no limit */
    uint32_t flags;              /* unused (the agent's flags are in the control file) */
    uint64_t reserved[12];
} gs_device_t;                   /* 256 bytes */

typedef struct {
    int32_t pid;                 /* 0: free slot */
    uint32_t priority;           /* CUDA_TASK_PRIORITY: 0 high, 1 low */
    uint64_t start_time;         /* start time in clock ticks after boot: tells a reused PID */
    uint64_t used[GS_MAX_DEVICES];
    uint64_t reserved[6];
} gs_proc_t;                     /* 192 bytes */

typedef struct {
    uint32_t magic;              /* GS_REGION_MAGIC, written last when the region is set up */
    uint32_t version;            /* GS_REGION_VERSION */
    uint32_t size;               /* sizeof(gs_region_t) */
    uint32_t device_count;       /* devices the container's processes have seen */
    uint64_t agent_heartbeat_ns; /* unused (the agent's heartbeat is in the control file) */
    uint32_t proc_high;          /* slots [0, proc_high) have ever been used */
    uint32_t pad0;
    uint64_t reserved[12];
    gs_device_t devices[GS_MAX_DEVICES];
    gs_proc_t procs[GS_MAX_PROCS];
} gs_region_t;

#endif
