/* fake_state.h: the fake GPU's state shared across processes.
 *
 * With FAKEGPU_STATE_DIR=<dir> set, each process using the fake driver keeps
 * <dir>/procs/<pid>, one struct fake_proc_state mmapped MAP_SHARED by its
 * owner and updated in place, so the fake NVML (in another process, as NVML
 * runs in the node agent) can list the processes on each device with their
 * memory and kernel time. Files of dead pids are ignored.
 */
#ifndef FAKE_STATE_H
#define FAKE_STATE_H

#include <stdint.h>

#define FAKE_STATE_MAGIC 0x53504746u /* "FGPS" */
#define FAKE_STATE_VERSION 1u

struct fake_proc_state {
    uint32_t magic, version;
    int32_t pid;
    uint32_t ndev;
    uint64_t used_bytes[16];   /* device memory this process holds, as fakecuda_used_bytes */
    uint64_t busy_ns[16];      /* kernel time completed on each device */
    uint64_t run_start_ns[16]; /* CLOCK_MONOTONIC start of the kernel running now, 0 if none */
    uint64_t ctx_count[16];    /* live contexts on each device */
};

#endif
