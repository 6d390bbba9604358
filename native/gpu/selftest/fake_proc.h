/*
 * What each process of the fake driver (fake_cuda.c) tells the fake NVML
 * (fake_nvml.c) about itself, in GS_FAKE_PROC_DIR/<pid>: what a real driver
 * knows per process and NVML reports (memory, SM time).
 */
#ifndef FAKE_PROC_H
#define FAKE_PROC_H

typedef struct {
    unsigned long long used;     /* bytes the process holds on the fake GPU */
    unsigned long long busy_ns;  /* simulated kernel time launched */
    unsigned long long start_ns; /* CLOCK_MONOTONIC when the record was made */
} gs_fake_proc_t;

#endif
