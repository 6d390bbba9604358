/* fake_state.h: the fake GPU's state shared across processes.
 *
 * With FAKEGPU_STATE_DIR=<dir> set, every process using the fake driver
 * (fakecuda.c) keeps <dir>/procs/<pid>: one struct fake_proc_state, mapped
 * MAP_SHARED by its owner and updated in place at every allocation, free and
 * context change (used_bytes, ctx_count) and by each device's engine thread
 * (busy_ns, run_start_ns). The fake NVML (fakenvml.c) reads these files to list
 * a device's running processes and their utilisation, as the real NVML reads
 * the driver's own bookkeeping; the fake driver reads them to apply per-cgroup
 * memory limits across processes. A file whose pid is dead is stale: readers
 * ignore it (and may remove it). Each field is a naturally aligned 64-bit word
 * written with one store, so a reader never sees half of one.
 */
#ifndef FAKE_STATE_H
#define FAKE_STATE_H

#include <stdint.h>

#define FAKE_STATE_MAGIC 0x53504746u /* "FGPS" */
#define FAKE_STATE_VERSION 1u
#define FAKE_STATE_DEVICES 16

struct fake_proc_state {
    uint32_t magic, version;
    int32_t pid;
    uint32_t ndev;
    uint64_t used_bytes[FAKE_STATE_DEVICES];   /* device memory this process holds, as fakecuda_used_bytes */
    uint64_t busy_ns[FAKE_STATE_DEVICES];      /* kernel time completed on each device */
    uint64_t run_start_ns[FAKE_STATE_DEVICES]; /* CLOCK_MONOTONIC start of the kernel running now, 0 if none */
    uint64_t ctx_count[FAKE_STATE_DEVICES];    /* live contexts on each device */
};

/* The file goes on after the struct with this tail, which readers that do not
 * know it leave unread: when the kernel running now will end on its device's
 * timeline. A real card runs a kernel to its end whatever its process does; a
 * frozen process's engine thread cannot say so, so a reader counts the running
 * kernel from run_start_ns up to run_end_ns at most. */
struct fake_proc_state_tail {
    uint64_t run_end_ns[FAKE_STATE_DEVICES]; /* CLOCK_MONOTONIC, 0 if none */
};

#endif
