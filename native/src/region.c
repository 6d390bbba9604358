/*
 * The shared region: usage of every process of the container, per device.
 *
 * Fast path (allocate, free): lock-free. A reservation raises the device's `used`
 * with compare-and-swap, refusing to pass the limit, before the driver is called;
 * then the process's own counter. A failed driver call rolls both back. So any
 * number of processes racing can never exceed the limit together.
 *
 * Slow path (a process joins, or a reservation would be refused): under an OFD
 * lock on the file, which the kernel drops when its holder dies, slots of dead
 * processes (gone, or their PID reused: start time differs) are freed and their
 * usage subtracted. A process killed at any point therefore blocks no one, and
 * its usage is reclaimed as soon as anyone needs it (or within a second by a
 * reader of memory info).
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "gs.h"

_Static_assert(sizeof(gs_device_t) == 256, "gs_device_t layout");
_Static_assert(sizeof(gs_proc_t) == 192, "gs_proc_t layout");
_Static_assert(sizeof(gs_region_t) == 128 + 256 * GS_MAX_DEVICES + 192 * GS_MAX_PROCS,
               "gs_region_t layout");

gs_region_t *gs_region;
gs_proc_t *gs_self;
static int region_fd = -1;
static gs_region_t *private_region;
static _Atomic uint64_t last_reclaim_ns;
/* What this process holds, kept where no other process can write: whatever
 * anyone does to the shared counters, one process never holds more than the
 * limit by itself. */
static uint64_t own_used[GS_MAX_DEVICES];

#define LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

/* Subtracts at most what is there; returns what was subtracted. */
static uint64_t sat_sub(uint64_t *p, uint64_t v) {
    uint64_t cur = LOAD(p);
    uint64_t next;
    do {
        next = cur > v ? cur - v : 0;
    } while (!__atomic_compare_exchange_n(p, &cur, next, true, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    return cur - next;
}

static void raise_max(uint64_t *p, uint64_t v) {
    uint64_t cur = LOAD(p);
    while (cur < v &&
           !__atomic_compare_exchange_n(p, &cur, v, true, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    }
}

/* ------------------------------------------------------------ locking */
/* Whole-file OFD write lock: per open file, dropped by the kernel when the holder
 * dies. Waits at most `GS_LOCK_WAIT_NS`; a holder that is alive but stopped must
 * not stall everyone, and everything done under the lock is also safe without it
 * apart from PID-reuse races, which the start-time check covers. */
#define GS_LOCK_WAIT_NS 1000000000ULL

static _Atomic uint64_t lock_gave_up_ns; /* after one wait in vain, try without waiting for a while */

static bool lock_region(void) {
    if (region_fd < 0) return false;
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 0};
    uint64_t now = gs_now_ns();
    uint64_t gave_up = LOAD(&lock_gave_up_ns);
    uint64_t deadline = gave_up && now - gave_up < 5 * GS_LOCK_WAIT_NS ? now : now + GS_LOCK_WAIT_NS;
    for (;;) {
        if (fcntl(region_fd, F_OFD_SETLK, &fl) == 0) {
            STORE(&lock_gave_up_ns, 0);
            return true;
        }
        if (errno != EAGAIN && errno != EACCES && errno != EINTR) return false;
        if (gs_now_ns() >= deadline) {
            if (deadline != now) GS_LOG(GS_LOG_WARN, "region lock busy for 1s; going on without it");
            STORE(&lock_gave_up_ns, gs_now_ns());
            return false;
        }
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
}

static void unlock_region(bool held) {
    if (!held) return;
    struct flock fl = {.l_type = F_UNLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 0};
    fcntl(region_fd, F_OFD_SETLK, &fl);
}

/* ------------------------------------------------------------ liveness */
/* From /proc/<pid>/stat: the state (field 3) and the start time in clock ticks
 * after boot (field 22). False when the process is not there to read. */
static bool proc_stat(int pid, char *state, uint64_t *start_time) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return false;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    if (!p || p[1] != ' ' || !p[2]) return false;
    *state = p[2];
    int field = 2;
    for (; *p && field < 22; p++)
        if (*p == ' ') field++;
    unsigned long long t = 0;
    *start_time = sscanf(p, "%llu", &t) == 1 ? t : 0;
    return true;
}

static uint64_t start_time_of(int pid) {
    char state;
    uint64_t t = 0;
    return proc_stat(pid, &state, &t) ? t : 0;
}

/* A zombie (killed, not yet reaped) holds no GPU memory: the driver let go of
 * it when the process exited. So is a process whose PID now names another. */
static bool alive(int pid, uint64_t start_time) {
    if (pid <= 0) return false;
    char state = 0;
    uint64_t now = 0;
    if (!proc_stat(pid, &state, &now)) {
        /* /proc unreadable (hidepid): fall back to whether the PID exists */
        return !(kill(pid, 0) != 0 && errno == ESRCH);
    }
    if (state == 'Z' || state == 'X' || state == 'x') return false;
    if (start_time && now && now != start_time) return false; /* the PID was reused */
    return true;
}

/* Frees a slot: its usage leaves the devices, then the slot itself. */
static void free_slot(gs_proc_t *p) {
    for (int d = 0; d < GS_MAX_DEVICES; d++) {
        uint64_t v = __atomic_exchange_n(&p->used[d], 0, __ATOMIC_ACQ_REL);
        if (v) sat_sub(&gs_region->devices[d].used, v);
    }
    STORE(&p->start_time, 0);
    STORE(&p->pid, 0);
}

/* Slots of processes that are gone, or of this very PID before an exec (the
 * old image's memory went with it; this image has not joined yet). */
static int reclaim_locked(void) {
    int freed = 0;
    int32_t me = (int32_t)getpid();
    uint32_t high = LOAD(&gs_region->proc_high);
    if (high > GS_MAX_PROCS) high = GS_MAX_PROCS;
    for (uint32_t i = 0; i < high; i++) {
        gs_proc_t *p = &gs_region->procs[i];
        int32_t pid = LOAD(&p->pid);
        if (pid == 0 || p == gs_self) continue;
        if (!(pid == me && !gs_self) && alive(pid, LOAD(&p->start_time))) continue;
        free_slot(p);
        GS_LOG(GS_LOG_INFO, "reclaimed the usage of exited process %d", pid);
        freed++;
    }
    return freed;
}

/* Frees the slots of dead processes and their usage; returns slots reclaimed. */
static int gs_reclaim_dead(void) {
    if (!gs_region || region_fd < 0) return 0;
    bool held = lock_region();
    int n = reclaim_locked();
    unlock_region(held);
    STORE(&last_reclaim_ns, gs_now_ns());
    return n;
}

void gs_reclaim_maybe(void) {
    uint64_t now = gs_now_ns();
    if (now - LOAD(&last_reclaim_ns) >= 1000000000ULL) gs_reclaim_dead();
}

/* ------------------------------------------------------------ mapping */
static void init_header(gs_region_t *r) {
    r->version = GS_REGION_VERSION;
    r->size = (uint32_t)sizeof(gs_region_t);
    STORE(&r->magic, (uint32_t)GS_REGION_MAGIC);
}

static bool map_private(void) {
    void *m = mmap(NULL, sizeof(gs_region_t), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (m == MAP_FAILED) {
        gs_log(GS_LOG_ERROR, "cannot allocate the usage region: %s", gs_errname(errno));
        return false;
    }
    private_region = m;
    init_header(private_region);
    gs_region = private_region;
    return true;
}

/* The descriptor names a file this process may share: checked on the open
 * descriptor itself. With a grant, the file the node agent made: regular, its
 * owner the grant's, mode 0666 (the container runs as any user), one link, full
 * size. Without, a file of this user that no one else can write. */
static bool check_region_fd(const char *path, uid_t agent) {
    struct stat st;
    if (fstat(region_fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        gs_fail_closed("shared region %s is not a regular file", path);
        return false;
    }
    if (st.st_nlink != 1) {
        gs_fail_closed("shared region %s has %lu links; the region is a file of its own", path,
                       (unsigned long)st.st_nlink);
        return false;
    }
    unsigned mode = (unsigned)(st.st_mode & 07777);
    if (gs_cfg.granted) {
        if (st.st_uid != agent || mode != 0666 || (size_t)st.st_size != sizeof(gs_region_t)) {
            gs_fail_closed("shared region %s (owner %u, mode %04o, %lld bytes) is not the one the node "
                           "agent made (owner %u, mode 0666, %zu bytes)",
                           path, (unsigned)st.st_uid, mode, (long long)st.st_size, (unsigned)agent,
                           sizeof(gs_region_t));
            return false;
        }
    } else if (st.st_uid != geteuid() || (mode & 077)) {
        gs_fail_closed("shared region %s (owner %u, mode %04o) must belong to this user (%u) and "
                       "be closed to others",
                       path, (unsigned)st.st_uid, mode, (unsigned)geteuid());
        return false;
    }
    return true;
}

static bool map_file_locked(const char *path) {
    struct stat st;
    if (fstat(region_fd, &st) != 0) return false;
    if (st.st_size == 0 && !gs_cfg.granted) {
        if (ftruncate(region_fd, (off_t)sizeof(gs_region_t)) != 0) {
            gs_fail_closed("cannot size the shared region %s: %s", path, gs_errname(errno));
            return false;
        }
    } else if ((size_t)st.st_size < sizeof(gs_region_t)) {
        uint32_t head[2] = {0, 0};
        ssize_t n = pread(region_fd, head, sizeof head, 0);
        gs_fail_closed("shared region %s is %lld bytes (magic %#x, version %u); this gpuslice needs a "
                       "version %u region of %zu bytes",
                       path, (long long)st.st_size, n == sizeof head ? head[0] : 0,
                       n == sizeof head ? head[1] : 0, GS_REGION_VERSION, sizeof(gs_region_t));
        return false;
    }
    void *m = mmap(NULL, sizeof(gs_region_t), PROT_READ | PROT_WRITE, MAP_SHARED, region_fd, 0);
    if (m == MAP_FAILED) {
        gs_fail_closed("cannot map the shared region %s: %s", path, gs_errname(errno));
        return false;
    }
    gs_region_t *r = m;
    uint32_t magic = LOAD(&r->magic);
    if (magic == 0 && r->version == 0 && !gs_cfg.granted) init_header(r);
    else if (magic != GS_REGION_MAGIC || r->version != GS_REGION_VERSION ||
             r->size != sizeof(gs_region_t)) {
        gs_fail_closed("shared region %s has magic %#x, layout version %u, size %u; this gpuslice "
                       "uses version %u of %zu bytes",
                       path, magic, r->version, r->size, GS_REGION_VERSION, sizeof(gs_region_t));
        munmap(m, sizeof(gs_region_t));
        return false;
    }
    gs_region = r;
    return true;
}

/* A new region at `path`, made in full under a temporary name and renamed into
 * place without replacing one another process made meanwhile (whose file is
 * then opened): no reader ever sees it empty or half set up. */
static int create_region(const char *path) {
    const char *name;
    char tmp[64];
    int dfd = gs_open_parent_nofollow(path, &name);
    if (dfd < 0) return -1;
    snprintf(tmp, sizeof tmp, ".region.%d.%llu.tmp", (int)getpid(), (unsigned long long)gs_now_ns());
    int fd = openat(dfd, tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    bool ok = fd >= 0 && ftruncate(fd, (off_t)sizeof(gs_region_t)) == 0;
    if (ok) {
        void *m = mmap(NULL, sizeof(gs_region_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        ok = m != MAP_FAILED;
        if (ok) {
            init_header(m);
            munmap(m, sizeof(gs_region_t));
        }
    }
    int saved = errno;
    if (ok && syscall(SYS_renameat2, dfd, tmp, dfd, name, 1 /* RENAME_NOREPLACE */) != 0) {
        saved = errno;
        ok = false;
    }
    if (!ok && fd >= 0) unlinkat(dfd, tmp, 0);
    if (fd >= 0) close(fd);
    int out = -1;
    if (ok || saved == EEXIST) /* made, or another process's is there: open what is in place */
        out = openat(dfd, name, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    else
        errno = saved;
    saved = errno;
    close(dfd);
    errno = saved;
    return out;
}

/* Opens the region file: beneath the grant's directory (never created: the
 * agent makes it), else the configured path with no link followed. */
static bool open_region(char *path, size_t size) {
    uid_t agent = 0;
    if (gs_cfg.granted) {
        struct stat dst;
        snprintf(path, size, "%s", GS_REGION_FILE);
        if (fstat(gs_cfg.grant_dir_fd, &dst) != 0) return false;
        agent = dst.st_uid;
        region_fd = openat(gs_cfg.grant_dir_fd, GS_REGION_FILE,
                           O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    } else {
        snprintf(path, size, "%s", gs_cfg.region_path);
        region_fd = gs_open_nofollow(gs_cfg.region_path, O_RDWR | O_NONBLOCK, 0);
        if (region_fd < 0 && errno == ENOENT) region_fd = create_region(gs_cfg.region_path);
    }
    if (region_fd < 0) {
        gs_fail_closed("cannot open the shared region %s safely: %s", path, gs_errname(errno));
        return false;
    }
    if (!check_region_fd(path, agent)) {
        close(region_fd);
        region_fd = -1;
        return false;
    }
    return true;
}

static pthread_mutex_t map_mutex = PTHREAD_MUTEX_INITIALIZER;
static int map_state; /* 0 not tried, 1 mapped, -1 refused */

bool gs_region_map(void) {
    pthread_mutex_lock(&map_mutex);
    if (map_state == 0) {
        char path[512];
        if (!gs_cfg.granted && !gs_cfg.region_path[0]) {
            map_state = map_private() ? 1 : -1;
        } else if (!open_region(path, sizeof path)) {
            map_state = -1;
        } else {
            bool held = lock_region();
            bool ok = map_file_locked(path);
            unlock_region(held);
            if (!ok) {
                close(region_fd);
                region_fd = -1;
            }
            map_state = ok ? 1 : -1;
        }
        /* Refused: the process keeps a private region to count in, and every
         * reservation is refused (gs_fail_closed was called). */
        if (map_state == -1 && gs_cfg.fail_closed && map_private()) map_state = 1;
    }
    bool ok = map_state == 1;
    pthread_mutex_unlock(&map_mutex);
    return ok;
}

bool gs_region_attach(void) {
    if (!gs_region_map()) return false;
    if (gs_self) return true;
    bool held = lock_region();
    reclaim_locked();
    int32_t me = (int32_t)getpid();
    bool others = false;
    uint32_t high = LOAD(&gs_region->proc_high);
    for (uint32_t i = 0; i < high && i < GS_MAX_PROCS; i++)
        if (LOAD(&gs_region->procs[i].pid) != 0) others = true;
    gs_proc_t *slot = NULL;
    for (uint32_t i = 0; i < GS_MAX_PROCS && !slot; i++) {
        int32_t expected = 0;
        if (__atomic_compare_exchange_n(&gs_region->procs[i].pid, &expected, me, false,
                                        __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            slot = &gs_region->procs[i];
            high = LOAD(&gs_region->proc_high);
            while (high < i + 1 &&
                   !__atomic_compare_exchange_n(&gs_region->proc_high, &high, i + 1, true,
                                                __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            }
        }
    }
    if (!slot) {
        unlock_region(held);
        gs_fail_closed("shared region is full (%d processes)", GS_MAX_PROCS);
        return false;
    }
    for (int d = 0; d < GS_MAX_DEVICES; d++) STORE(&slot->used[d], 0);
    STORE(&slot->start_time, start_time_of(me));
    STORE(&slot->priority, gs_cfg.priority);
    /* Alone (under the lock, every other slot dead or free): nothing can be in
     * flight, so the counters restart from zero, healing any drift. Not the
     * limiter's clock: the debt of the container's past processes carries to
     * this one (launch.c takes a clock from another boot, far ahead, as stale). */
    if (!others && held)
        for (int d = 0; d < GS_MAX_DEVICES; d++) STORE(&gs_region->devices[d].used, 0);
    for (int d = 0; d < GS_MAX_DEVICES; d++) {
        gs_device_t *dev = &gs_region->devices[d];
        uint64_t limit = gs_cfg.mem_limit[d];
        uint64_t shown = limit == GS_NO_LIMIT ? 0 : limit;
        if (gs_cfg.granted) {
            /* The grant is the truth; the region shows it (and is mended if written). */
            if (d < gs_cfg.visible_count) {
                STORE(&dev->limit, shown);
                STORE(&dev->sm_limit, gs_cfg.sm_limit[d]);
            }
            continue;
        }
        /* Without a grant the first process to join records the container's
         * limits, and no later process runs above them whatever its environment. */
        uint64_t old = 0;
        if (shown && !__atomic_compare_exchange_n(&dev->limit, &old, shown, false, __ATOMIC_ACQ_REL,
                                                  __ATOMIC_ACQUIRE) &&
            old < shown)
            gs_cfg.mem_limit[d] = old;
        if (!shown && (old = LOAD(&dev->limit)) != 0) gs_cfg.mem_limit[d] = old;
        uint32_t sm_old = 0;
        uint32_t sm = gs_cfg.sm_limit[d] >= 100 ? 0 : gs_cfg.sm_limit[d];
        if (sm && !__atomic_compare_exchange_n(&dev->sm_limit, &sm_old, sm, false, __ATOMIC_ACQ_REL,
                                               __ATOMIC_ACQUIRE) &&
            sm_old < sm)
            gs_cfg.sm_limit[d] = sm_old;
        if (!sm && (sm_old = LOAD(&dev->sm_limit)) != 0) gs_cfg.sm_limit[d] = sm_old;
    }
    gs_self = slot;
    unlock_region(held);
    STORE(&last_reclaim_ns, gs_now_ns());
    return true;
}

void gs_region_detach(void) {
    gs_proc_t *p = gs_self;
    if (!p || !gs_region) return;
    gs_self = NULL;
    free_slot(p);
}

static void gs_region_set_uuid(int dev, const char *uuid) {
    if (dev < 0 || dev >= GS_MAX_DEVICES || !gs_region) return;
    gs_device_t *d = &gs_region->devices[dev];
    if (strncmp(d->uuid, uuid, GS_UUID_LEN) != 0) {
        char buf[GS_UUID_LEN] = {0};
        strncpy(buf, uuid, GS_UUID_LEN - 1);
        memcpy(d->uuid, buf, GS_UUID_LEN);
    }
    uint32_t count = LOAD(&gs_region->device_count);
    while (count < (uint32_t)dev + 1 &&
           !__atomic_compare_exchange_n(&gs_region->device_count, &count, (uint32_t)dev + 1, true,
                                        __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    }
}

int gs_region_place_uuid(const char *uuid, int preferred, int ordinal) {
    if (!gs_region || !uuid[0]) return ordinal;
    bool held = lock_region();
    int rec = preferred;
    if (rec < 0) rec = gs_region_find_uuid(uuid);
    if (rec < 0 && ordinal >= 0 && ordinal < GS_MAX_DEVICES && !gs_region->devices[ordinal].uuid[0])
        rec = ordinal;
    for (int i = 0; rec < 0 && i < GS_MAX_DEVICES; i++)
        if (!gs_region->devices[i].uuid[0]) rec = i;
    if (rec >= 0) gs_region_set_uuid(rec, uuid);
    unlock_region(held);
    return rec >= 0 ? rec : ordinal;
}

int gs_region_find_uuid(const char *uuid) {
    if (!gs_region || !uuid || !uuid[0]) return -1;
    uint32_t n = LOAD(&gs_region->device_count);
    for (uint32_t i = 0; i < n && i < GS_MAX_DEVICES; i++)
        if (!strncmp(gs_region->devices[i].uuid, uuid, GS_UUID_LEN)) return (int)i;
    return -1;
}

/* ------------------------------------------------------------ reservations */
bool gs_reserve(int dev, uint64_t bytes) {
    gs_proc_t *self = gs_self; /* once: exit may clear it under another thread */
    if (GS_UNLIKELY(gs_cfg.fail_closed || !self || dev == GS_REC_DENIED)) {
        if (dev == GS_REC_DENIED)
            GS_LOG(GS_LOG_WARN, "allocation of %llu bytes refused: the device is not granted to this "
                   "container", (unsigned long long)bytes);
        return false;
    }
    if (dev < 0 || dev >= GS_MAX_DEVICES) return true;
    gs_device_t *d = &gs_region->devices[dev];
    uint64_t limit = gs_cfg.mem_limit[dev];
    uint64_t own = __atomic_add_fetch(&own_used[dev], bytes, __ATOMIC_ACQ_REL);
    if (own < bytes || own > limit) {
        __atomic_sub_fetch(&own_used[dev], bytes, __ATOMIC_ACQ_REL);
        goto refused;
    }
    for (int attempt = 0; attempt < 2; attempt++) {
        uint64_t cur = LOAD(&d->used);
        for (;;) {
            if (bytes > limit || cur > limit - bytes) break;
            if (__atomic_compare_exchange_n(&d->used, &cur, cur + bytes, true, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE)) {
                __atomic_add_fetch(&self->used[dev], bytes, __ATOMIC_ACQ_REL);
                raise_max(&d->peak, cur + bytes);
                return true;
            }
        }
        /* Over the limit: a dead process's usage may be what stands in the way. */
        if (attempt == 0 && gs_reclaim_dead() == 0) break;
    }
    __atomic_sub_fetch(&own_used[dev], bytes, __ATOMIC_ACQ_REL);
refused:
    __atomic_add_fetch(&d->denied, 1, __ATOMIC_RELAXED);
    GS_LOG(GS_LOG_WARN, "device %d: allocation of %llu bytes refused: %llu of %llu bytes in use", dev,
           (unsigned long long)bytes, (unsigned long long)LOAD(&d->used), (unsigned long long)limit);
    if (gs_cfg.oom_killer) {
        gs_log(GS_LOG_ERROR, "device %d: over the memory limit of %llu bytes; ACTIVE_OOM_KILLER ends this process",
               dev, (unsigned long long)limit);
        kill(getpid(), SIGKILL);
    }
    return false;
}

void gs_unreserve(int dev, uint64_t bytes) {
    gs_proc_t *self = gs_self;
    if (dev < 0 || dev >= GS_MAX_DEVICES || !self || !bytes) return;
    /* Only what this process held leaves the device: never others' usage. */
    sat_sub(&own_used[dev], bytes);
    uint64_t held = sat_sub(&self->used[dev], bytes);
    if (held) sat_sub(&gs_region->devices[dev].used, held);
}

uint64_t gs_used(int dev) {
    if (dev < 0 || dev >= GS_MAX_DEVICES || !gs_region) return 0;
    return LOAD(&gs_region->devices[dev].used);
}

uint64_t gs_limit(int dev) {
    if (gs_cfg.fail_closed || dev == GS_REC_DENIED) return 0;
    if (dev < 0 || dev >= GS_MAX_DEVICES) return GS_NO_LIMIT;
    return gs_cfg.mem_limit[dev];
}

void gs_region_after_fork(void) {
    /* The child shares the parent's mapping but not its slot, its allocations or
     * (for OFD locks) its open file: it joins afresh on its next CUDA call. */
    gs_self = NULL;
    memset(own_used, 0, sizeof own_used);
    if (region_fd >= 0) {
        close(region_fd);
        region_fd = -1;
    }
    if (gs_region && gs_region != private_region) munmap(gs_region, sizeof(gs_region_t));
    gs_region = NULL;
    private_region = NULL;
    pthread_mutex_init(&map_mutex, NULL);
    map_state = 0;
}
