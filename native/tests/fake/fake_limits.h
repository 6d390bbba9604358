/* fake_limits.h: the fake driver's per-cgroup device-memory limits, shared by
 * fakenvml.c (nvmlDeviceSetMemoryLimits_v1 / nvmlDeviceGetMemoryLimits_v1 keep
 * them) and fakecuda.c (every allocation is checked against them), as the real
 * driver r615+ keeps them for NVML and enforces them on allocation.
 *
 * With FAKEGPU_STATE_DIR=<dir> set the limits live in <dir>/limits, text, one
 * line per limit:
 *     <device index> <nameSpace> <soft bytes> <hard bytes>
 * nameSpace is the cgroup's full sysfs path (no whitespace). A process lies in
 * a limit when its cgroup v2 path (the "0::" line of /proc/<pid>/cgroup, under
 * the cgroup2 mount found in /proc/self/mountinfo) is the nameSpace or below
 * it. The memory a limit counts on a device is what the processes in it hold
 * there: used_bytes of their <dir>/procs/<pid> files (fake_state.h); a
 * process's own usage may be given instead of its file's. Lines that do not
 * parse are skipped. Writers replace the file by rename under an flock of
 * <dir>/limits.lock, so readers see a whole file.
 */
#ifndef FAKE_LIMITS_H
#define FAKE_LIMITS_H

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "fake_state.h"

#define FAKE_LIMITS_MAX 256     /* limits kept (per file) */
#define FAKE_LIMIT_NONE UINT64_MAX /* hard limit of "no limit" (NVML_DEVICE_MEMORY_LIMIT_MAX) */

struct fake_limit {
    unsigned int dev;
    uint64_t soft, hard;
    char ns[PATH_MAX];
};

/* The directory of FAKEGPU_STATE_DIR, or NULL when unset or empty. */
static inline const char *fake_state_dir(void) {
    const char *d = getenv("FAKEGPU_STATE_DIR");
    return d && *d ? d : NULL;
}

/* The mount point of the first cgroup2 file system in /proc/self/mountinfo. */
static inline bool fake_cgroup2_root(char *out, size_t n) {
    FILE *f = fopen("/proc/self/mountinfo", "re");
    if (!f) return false;
    char line[4096];
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) {
        /* id parent maj:min root mountpoint options... - fstype source options */
        const char *dash = strstr(line, " - ");
        char mnt[PATH_MAX], fstype[64];
        if (!dash || sscanf(dash + 3, "%63s", fstype) != 1 || strcmp(fstype, "cgroup2") != 0) continue;
        if (sscanf(line, "%*s %*s %*s %*s %4095s", mnt) != 1) continue;
        found = snprintf(out, n, "%s", mnt) < (int)n;
    }
    fclose(f);
    return found;
}

/* The full sysfs path of pid's cgroup v2 group under `root`. */
static inline bool fake_pid_cgroup(pid_t pid, const char *root, char *out, size_t n) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/cgroup", (int)pid);
    FILE *f = fopen(path, "re");
    if (!f) return false;
    char line[PATH_MAX + 8];
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) {
        if (strncmp(line, "0::", 3) != 0) continue;
        line[strcspn(line, "\n")] = '\0';
        const char *rel = line + 3;
        if (strcmp(rel, "/") == 0) rel = "";
        found = snprintf(out, n, "%s%s", root, rel) < (int)n;
    }
    fclose(f);
    return found;
}

/* Whether `path` is the group `ns` or lies below it. */
static inline bool fake_path_within(const char *path, const char *ns) {
    size_t len = strlen(ns);
    while (len > 1 && ns[len - 1] == '/') len--;
    return strncmp(path, ns, len) == 0 && (path[len] == '\0' || path[len] == '/');
}

/* Reads <dir>/limits into out (at most max); the number read (0 without a file). */
static inline int fake_limits_read(const char *dir, struct fake_limit *out, int max) {
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/limits", dir) >= (int)sizeof path) return 0;
    FILE *f = fopen(path, "re");
    if (!f) return 0;
    int n = 0;
    char line[PATH_MAX + 128];
    while (n < max && fgets(line, sizeof line, f)) {
        struct fake_limit *l = &out[n];
        unsigned long long soft, hard;
        if (sscanf(line, "%u %4095s %llu %llu", &l->dev, l->ns, &soft, &hard) != 4) continue;
        l->soft = soft;
        l->hard = hard;
        n++;
    }
    fclose(f);
    return n;
}

/* Whether pid is alive (a zombie's file is still counted: its memory is not
 * yet given back). */
static inline bool fake_pid_alive(pid_t pid) {
    return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM);
}

/* Memory on device `dev` held by the processes of <dir>/procs whose cgroup
 * lies in `ns`, leaving out `skip` (0: none). */
static inline uint64_t fake_ns_used(const char *dir, unsigned int dev, const char *ns,
                                    const char *root, pid_t skip) {
    if (dev >= 16) return 0;
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/procs", dir) >= (int)sizeof path) return 0;
    DIR *d = opendir(path);
    if (!d) return 0;
    uint64_t sum = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end || pid <= 0 || pid > INT_MAX || (pid_t)pid == skip) continue;
        if (!fake_pid_alive((pid_t)pid)) continue;
        char file[PATH_MAX];
        if (snprintf(file, sizeof file, "%s/%s", path, e->d_name) >= (int)sizeof file) continue;
        int fd = open(file, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        struct fake_proc_state st;
        ssize_t got = pread(fd, &st, sizeof st, 0);
        close(fd);
        if (got != (ssize_t)sizeof st || st.magic != FAKE_STATE_MAGIC ||
            st.version != FAKE_STATE_VERSION || st.pid != (int32_t)pid)
            continue;
        char cg[PATH_MAX];
        if (!fake_pid_cgroup((pid_t)pid, root, cg, sizeof cg) || !fake_path_within(cg, ns)) continue;
        sum += st.used_bytes[dev];
    }
    closedir(d);
    return sum;
}

#endif
