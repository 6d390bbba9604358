/*
 * Compute limiting. Without a limit a launch costs two atomic loads and the call.
 *
 * With one, a launch first waits while the container is ahead of its share, then
 * runs inside a measuring window, one per device of the process: a timing event
 * is recorded before the window's first kernel and one after its last on every
 * stream the window launched into (work on one stream is not ordered before an
 * event on another: up to GS_WINDOW_STREAMS, a launch into one more starts a new
 * window; a launch into a stream new to the window takes the slow path), and the
 * GPU time from the first to the latest of them is charged as busy / share of wall time to two virtual
 * clocks (a generic cell rate algorithm): the process's own, in its private
 * memory, and the container's (tat_ns in the region), which every process of the
 * container charges, so that the container as a whole gets its share. A launch
 * may start once now >= max(both clocks, the agent's floor) - GS_TAU_NS. The
 * region is writable by every process of the container, so nothing read from it
 * lets a process run above its own share: winding the container's clock back
 * leaves the private one, and the container's clock is only ever pushed later.
 * A process starts its own clock at the container's (or the floor the agent
 * last saw, from the control file), so the debt of the container's earlier
 * processes carries to the next one. A window closes after GS_WINDOW_NS of
 * launching or a number of launches (so the queue stays short); closing waits
 * for its last event. A window still open when the process exits is charged
 * then (a kernel still running: the time it ran so far), and a window whose
 * last kernel is still running at the next launch is charged the time it ran so
 * far before that launch waits, and the pause watcher charges it while it runs
 * with no launch after it (a kernel that never ends is paid while it runs).
 *
 * Pauses: a window must not charge the time the GPU sat idle because no launch
 * came (GS_GAP_NS or more between two). Where the GPU's work ended is known from
 * an event after every launch only (any one may be the last before a pause), and
 * an event costs about what a launch does. So windows come in two kinds:
 *  - marked: an event after every launch, each launch under the window's mutex;
 *    a pause closes the window at the event after its last launch: exact.
 *  - unmarked: no events but the two. Launches take a lock-free path: no driver
 *    call but the launch, no mutex, and no clock read before it (the clock read
 *    after the previous launch stands for now; that only errs towards the slow
 *    path, where the clock decides whether to wait). The pause watcher, a thread
 *    of the limiter, sees a pause begin: once the device had no launch for
 *    GS_WATCH_NS it records the window's end on the last launch's stream (the
 *    GPU reaches it when that work is done, however long the last kernel runs)
 *    and sends the next launch to the slow path, which closes the window at a
 *    pause, measured as a marked one, and goes on with it otherwise. A pause the
 *    watcher missed (starved of the CPU) is charged as busy: an estimate from
 *    the CPU's side would let a kernel queued last run through the pause free.
 * Windows are unmarked only while the GPU keeps pace: it finished the last
 * windows within GS_PACE_NS of their last launch (one late window is let pass),
 * a marked window measured a pause with the GPU keeping pace within the last
 * GS_TRUST pauses (or no pause came for GS_TRUST windows), and bursts between
 * pauses have GS_BURST launches or more. No event is ever recorded into a
 * stream being captured: a launch that records one checks its stream first (on
 * the lock-free path, the launch that fills the window), and so does the
 * watcher (a capture begun by another thread in the instant between its check
 * and its record would take the event in).
 *
 * When the limit applies: `force` always; `default` unless a live node agent says
 * the GPU is not shared right now; `disable` never. A low-priority process
 * (CUDA_TASK_PRIORITY >= 1) also pauses while a live agent sets GS_DEV_YIELD.
 * The agent's flags and heartbeat come from its control file (gs_control_t),
 * which the container cannot write: beside the grant (mounted read-only), or
 * without a grant at the region's path + ".control". Without one the agent is
 * taken as absent: limited, and nobody yields.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gs.h"

#define GS_WINDOW_NS 4000000ULL
/* A window's launches while the GPU falls behind; while it keeps pace the queue
 * stays short without the count, and windows may hold more, which spreads
 * their driver calls thinner. */
#define GS_WINDOW_LAUNCHES 64
#define GS_PACED_LAUNCHES 128
#define GS_GAP_NS 1000000ULL
#define GS_TAU_NS 2000000ULL
/* No window charges more than this: a clock further ahead is stale (a region
 * file kept across a reboot, where CLOCK_MONOTONIC restarted) and is reset. */
#define GS_MAX_AHEAD_NS 120000000000ULL
/* The GPU keeps pace when it finishes a window within this of its last launch. */
#define GS_PACE_NS 250000ULL
/* Pauses through unmarked windows between two measured by marked ones. */
#define GS_TRUST 256
/* Launches per pause below which windows are marked: an event per launch costs
 * little next to the pauses then, and an estimate would weigh on little work. */
#define GS_BURST 32
#define GS_CONTROL_FILE "control"
/* Streams one window follows (a launch into one more starts a new window). */
#define GS_WINDOW_STREAMS 8
/* The pause watcher records a window's end once its device had no launch for
 * this long: a pause may have begun (the GPU idle since is charged as busy). */
#define GS_WATCH_NS 100000ULL
/* How often the watcher charges a window whose last kernel runs on after its
 * launches stopped (a pause, or no launch ever again). */
#define GS_RUNNING_NS 10000000ULL

static atomic_bool limiter_on;
static bool limiter_usable; /* the driver has what windows need */
static uint32_t limit_of[GS_MAX_DEVICES]; /* the policy's: 0 under `disable` */
/* What a live node agent may change for this process: */
#define GS_AGENT_LIFTS 1  /* `default`: the limit, when the GPU is not shared */
#define GS_AGENT_YIELDS 2 /* low priority: it may ask for a pause */
static uint8_t agent_may;
/* Moves when a context is destroyed: per-thread device caches start afresh. */
static atomic_uint ctx_epoch;
/* The agent's control file, mapped read-only; NULL while there is none. */
static const gs_control_t *_Atomic control;
static _Atomic uint64_t control_tried_ns; /* the last attempt to map it */
/* The process's own clock per device: private, so the region cannot wind it back. */
static _Atomic uint64_t own_tat[GS_MAX_DEVICES];

/* window_t.gate: bit 0 is set while an unmarked window is open to the lock-free
 * path; each launch on that path adds GS_INFLIGHT until its driver call returns. */
#define GS_OPEN 1u
#define GS_INFLIGHT 2u

typedef struct {
    /* what the lock-free path reads. The holder of `mu` clears GS_OPEN and waits
     * for the launches in flight before it touches the window: the plain fields
     * change only while no one reads them without the mutex. */
    atomic_uint gate;
    atomic_uint launches;  /* counted once a launch is let in */
    _Atomic uint64_t seen; /* the clock after the device's last launch */
    uint64_t *tat;         /* the device's clock in the region */
    CUcontext ctx;
    _Atomic uint64_t deadline; /* GS_WINDOW_NS of launching after cpu_start */
    unsigned length;   /* launches it may hold */
    uint32_t limit;
    _Atomic uint64_t last_launch; /* the clock after the window's last launch */
    _Atomic uint64_t gaps;        /* the pauses an unmarked window kept, end to end */
    atomic_uint pauses;
    pthread_mutex_t mu;
    bool open, marked;
    bool ended; /* `end` was recorded after the last launch */
    CUevent start, end;
    uint64_t cpu_start, end_at; /* when `start` and `end` were recorded */
    uint64_t charged;           /* charged already, while its last kernel ran */
    /* The streams launched into in the window, by stream_key(), each with an end
     * event of its own (streams[0]'s is `end`, the others' more_end[i - 1]):
     * work on one stream is not ordered before an event on another. */
    CUstream streams[GS_WINDOW_STREAMS];
    CUevent more_end[GS_WINDOW_STREAMS - 1];
    unsigned nstreams;
    unsigned recorded; /* bit i: stream i's end was recorded in this window */
    /* kept from window to window: a window opens marked while `behind`,
     * `need_pause` or `sparse` is set */
    bool late;       /* the GPU finished the last window more than GS_PACE_NS late */
    bool behind;     /* ...and the one before: it does not keep pace */
    bool need_pause; /* the next pause must be measured */
    bool sparse;     /* pauses come after fewer than GS_BURST launches */
    unsigned trust;  /* pauses that may still be estimated */
    unsigned calm;   /* windows since the last pause */
} window_t;

static window_t windows[GS_MAX_DEVICES] __attribute__((aligned(64)));

/* The current context and its device, cached per thread for the lock-free path:
 * read afresh by every launch on the slow path (at least once a window) and when
 * the thread switches contexts through the driver API (context.c), dropped when
 * any context is destroyed (the epoch moves). Initial-exec: the library is
 * always preloaded, so its thread-locals sit in the static block, one load away. */
static __thread struct {
    CUcontext ctx; /* NULL: not cached */
    window_t *win;
    unsigned epoch;
    int dev;
} t_dev __attribute__((tls_model("initial-exec")));

static int launch_device(CUcontext *ctx_out);
static inline uint64_t now_ns(void);
static void control_open(uint64_t now);
static inline const gs_control_t *control_now(void);
static uint64_t clock_of(int d, uint64_t now);
static void limiter_exit(void);
static void watch_opened(void);
static CUresult record(CUevent event, CUstream stream, bool ptds);
static bool capturing(CUstream stream, bool ptds);
/* the pause watcher (see there) */
static pthread_mutex_t watch_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t watch_cv = PTHREAD_COND_INITIALIZER;
static bool watcher_started;
static atomic_uint watch_gen;     /* unmarked windows opened so far */
static int exit_pid; /* the process whose windows these are (not a fork child's) */

/* The cache follows the thread to its new context at once, so that a thread
 * moving between devices keeps the lock-free path. */
void gs_limiter_ctx_switched(void) {
    t_dev.ctx = NULL;
    CUcontext ctx;
    if (atomic_load_explicit(&limiter_on, memory_order_relaxed) &&
        atomic_load_explicit(&gs_attached, memory_order_acquire) == 1 && limiter_usable)
        (void)launch_device(&ctx);
}

/* A fork child joins the region afresh before it limits anything: until then its
 * launches take the slow path (the forking thread's cache is the parent's). */
static void limiter_after_fork(void) {
    atomic_fetch_add_explicit(&ctx_epoch, 1, memory_order_relaxed);
    t_dev.ctx = NULL;
    /* the watcher thread is the parent's */
    pthread_mutex_init(&watch_mu, NULL);
    pthread_cond_init(&watch_cv, NULL);
    __atomic_store_n(&watcher_started, false, __ATOMIC_RELAXED);
}

void gs_limiter_setup(void) {
    bool on = gs_cfg.priority >= 1;
    if (gs_cfg.policy != GS_POLICY_DISABLE)
        for (int d = 0; d < GS_MAX_DEVICES; d++) on |= gs_cfg.sm_limit[d] > 0;
    limiter_usable = gs_real.cuEventCreate && gs_real.cuEventRecord && gs_real.cuEventSynchronize &&
                     gs_real.cuEventDestroy_v2 && gs_real.cuCtxGetCurrent && gs_real.cuCtxGetDevice;
    agent_may = (gs_cfg.policy == GS_POLICY_DEFAULT ? GS_AGENT_LIFTS : 0) |
                (gs_cfg.priority >= 1 ? GS_AGENT_YIELDS : 0);
    for (int d = 0; d < GS_MAX_DEVICES; d++) {
        window_t *w = &windows[d];
        limit_of[d] = gs_cfg.policy == GS_POLICY_DISABLE ? 0 : gs_cfg.sm_limit[d];
        pthread_mutex_init(&w->mu, NULL);
        atomic_init(&w->gate, 0);
        w->tat = &gs_region->devices[d].tat_ns;
        atomic_init(&w->seen, 0);
        w->start = w->end = NULL; /* a fork child's are its parent's */
        for (int i = 0; i < GS_WINDOW_STREAMS - 1; i++) w->more_end[i] = NULL;
        w->nstreams = w->recorded = 0;
        w->ctx = NULL;
        w->open = w->ended = false;
        w->late = w->behind = w->sparse = false;
        w->need_pause = true; /* until a pause shows the GPU keeping pace */
        w->trust = w->calm = 0;
    }
    /* The control file is the agent's: mapped once per process, kept by a fork
     * child. A process joins the container's clock (and the agent's floor). */
    uint64_t now = now_ns();
    if (!control_now()) control_open(now);
    for (int d = 0; d < GS_MAX_DEVICES; d++) atomic_store(&own_tat[d], 0);
    for (int d = 0; d < GS_MAX_DEVICES; d++) atomic_store(&own_tat[d], clock_of(d, now));
    exit_pid = getpid();
    static bool atfork_done;
    if (!atfork_done) {
        pthread_atfork(NULL, NULL, limiter_after_fork);
        atexit(limiter_exit);
        atfork_done = true;
    }
    atomic_fetch_add_explicit(&ctx_epoch, 1, memory_order_release);
    atomic_store(&limiter_on, on);
}

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static void sleep_ns(uint64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000ULL), (long)(ns % 1000000000ULL)};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

/* ------------------------------------------------------------ the agent's control file */
/* Maps the control file when it is there and valid; tried at most once a second
 * (the agent may make it after the process started). Checked on the open
 * descriptor: with a grant, a regular file of the grant directory's owner that
 * no one may write, of the full size and this layout. */
static void control_open(uint64_t now) {
    uint64_t tried = atomic_load_explicit(&control_tried_ns, memory_order_relaxed);
    if ((tried && now - tried < 1000000000ULL) ||
        !atomic_compare_exchange_strong(&control_tried_ns, &tried, now ? now : 1))
        return;
    int fd = -1;
    uid_t owner = geteuid();
    char where[600];
    if (gs_cfg.granted) {
        struct stat dst;
        snprintf(where, sizeof where, "%s/%s", GS_GRANT_DIR, GS_CONTROL_FILE);
        if (gs_cfg.grant_dir_fd >= 0 && fstat(gs_cfg.grant_dir_fd, &dst) == 0) {
            owner = dst.st_uid;
            fd = openat(gs_cfg.grant_dir_fd, GS_CONTROL_FILE,
                        O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        }
    } else if (gs_cfg.region_path[0]) {
        snprintf(where, sizeof where, "%s.control", gs_cfg.region_path);
        fd = gs_open_nofollow(where, O_RDONLY | O_NONBLOCK, 0);
    } else {
        return;
    }
    static bool warned;
    if (fd < 0) {
        if (gs_cfg.granted && !warned) {
            warned = true;
            GS_LOG(GS_LOG_WARN, "no node agent control file %s (%s): compute limits apply and "
                   "nothing yields", where, gs_errname(errno));
        }
        return;
    }
    struct stat st;
    const char *why = NULL;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) why = "not a regular file";
    else if ((size_t)st.st_size != sizeof(gs_control_t)) why = "not the size of a control file";
    else if (gs_cfg.granted && (st.st_uid != owner || (st.st_mode & 0222)))
        why = "writable, or not the node agent's";
    void *m = MAP_FAILED;
    if (!why) {
        m = mmap(NULL, sizeof(gs_control_t), PROT_READ, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED) why = "cannot be mapped";
    }
    close(fd);
    if (!why) {
        const gs_control_t *c = m;
        if (__atomic_load_n(&c->magic, __ATOMIC_ACQUIRE) != GS_CONTROL_MAGIC ||
            c->version != GS_CONTROL_VERSION)
            why = "not a control file of this layout version";
    }
    if (why) {
        if (m != MAP_FAILED) munmap(m, sizeof(gs_control_t));
        if (!warned) {
            warned = true;
            GS_LOG(GS_LOG_WARN, "node agent control file %s refused: %s (owner %u, mode %04o, "
                   "layout version %u expected): compute limits apply and nothing yields",
                   where, why, (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777),
                   GS_CONTROL_VERSION);
        }
        return;
    }
    atomic_store_explicit(&control, (const gs_control_t *)m, memory_order_release);
}

static inline const gs_control_t *control_now(void) {
    return atomic_load_explicit(&control, memory_order_acquire);
}

static bool agent_live(uint64_t now) {
    const gs_control_t *c = control_now();
    if (!c) return false;
    uint64_t hb = __atomic_load_n(&c->heartbeat_ns, __ATOMIC_ACQUIRE);
    return hb && now >= hb && now - hb < GS_AGENT_FRESH_NS;
}

static inline uint32_t dev_flags(int d) {
    const gs_control_t *c = control_now();
    return c ? __atomic_load_n(&c->flags[d], __ATOMIC_ACQUIRE) : 0;
}

static inline uint32_t active_limit(int d, uint64_t now) {
    uint32_t limit = limit_of[d];
    if (limit && (agent_may & GS_AGENT_LIFTS) && agent_live(now) && !(dev_flags(d) & GS_DEV_SHARED))
        return 0;
    return limit;
}

/* A container clock (the region's, the agent's floor) counts unless it is
 * further ahead than any window may charge: a stale one from another boot. */
static inline uint64_t sane_clock(uint64_t tat, uint64_t now) {
    return tat > now + GS_MAX_AHEAD_NS ? 0 : tat;
}

/* When the device's next launch may start, less GS_TAU_NS: the latest of the
 * process's own clock, the container's and the agent's floor. */
static uint64_t clock_of(int d, uint64_t now) {
    uint64_t tat = atomic_load_explicit(&own_tat[d], memory_order_acquire);
    uint64_t shared = sane_clock(__atomic_load_n(&gs_region->devices[d].tat_ns, __ATOMIC_ACQUIRE), now);
    if (shared > tat) tat = shared;
    const gs_control_t *c = control_now();
    if (c) {
        uint64_t floor = sane_clock(__atomic_load_n(&c->tat_floor_ns[d], __ATOMIC_ACQUIRE), now);
        if (floor > tat) tat = floor;
    }
    return tat;
}

/* Region record of the current context's device, and that context, read from
 * the driver (the device too unless the cache has it); -1 when none. */
static int launch_device(CUcontext *ctx_out) {
    CUcontext ctx = NULL;
    unsigned epoch = atomic_load_explicit(&ctx_epoch, memory_order_acquire);
    if (gs_real.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx) {
        t_dev.ctx = NULL;
        return -1;
    }
    *ctx_out = ctx;
    if (t_dev.ctx == ctx && t_dev.epoch == epoch) return t_dev.dev;
    t_dev.ctx = NULL;
    int d = gs_current_device();
    if (d < 0) return -1;
    t_dev.ctx = ctx;
    t_dev.win = &windows[d];
    t_dev.epoch = epoch;
    t_dev.dev = d;
    return d;
}

/* Charges `busy` ns of GPU time, at `limit` percent, from `start` on: to the
 * process's own clock, and to the container's (pushed later only). */
static void charge(int d, uint64_t busy, uint32_t limit, uint64_t start) {
    gs_device_t *dev = &gs_region->devices[d];
    uint64_t cost = busy * 100 / limit;
    uint64_t own = atomic_load_explicit(&own_tat[d], memory_order_acquire);
    uint64_t next;
    do {
        next = (own > start ? own : start) + cost;
    } while (!atomic_compare_exchange_weak_explicit(&own_tat[d], &own, next, memory_order_acq_rel,
                                                    memory_order_acquire));
    uint64_t tat = __atomic_load_n(&dev->tat_ns, __ATOMIC_ACQUIRE);
    uint64_t now = now_ns();
    do {
        next = (sane_clock(tat, now) > start ? tat : start) + cost;
    } while (!__atomic_compare_exchange_n(&dev->tat_ns, &tat, next, true, __ATOMIC_ACQ_REL,
                                          __ATOMIC_ACQUIRE));
    __atomic_add_fetch(&dev->busy_ns, busy, __ATOMIC_RELAXED);
}

/* With the mutex held: keeps the lock-free path out and waits for those on it. */
static void shut(window_t *w) {
    atomic_fetch_and_explicit(&w->gate, ~GS_OPEN, memory_order_acq_rel);
    while (atomic_load_explicit(&w->gate, memory_order_acquire)) sched_yield();
}

/* Lets the lock-free path into an open unmarked window again; then unlocks. */
static void release(window_t *w) {
    if (w->open && !w->marked) atomic_fetch_or_explicit(&w->gate, GS_OPEN, memory_order_release);
    pthread_mutex_unlock(&w->mu);
}

/* A launch `gap` after the window's previous one, in an unmarked window, that
 * the pause watcher did not see: the GPU may have run through it, so it is
 * charged as busy (counted for the window's statistics only). */
static void note_pause(window_t *w, uint64_t gap) {
    atomic_fetch_add_explicit(&w->gaps, gap, memory_order_relaxed);
    atomic_fetch_add_explicit(&w->pauses, 1, memory_order_relaxed);
}

/* A stream as windows tell streams apart: the per-thread stream is (CUstream)2
 * however it was named (NULL under the _ptsz entry points; its events are
 * recorded by the thread launching). */
static inline CUstream stream_key(CUstream stream, bool ptds) {
    return (ptds && !stream) || stream == (CUstream)0x2 ? (CUstream)0x2 : stream;
}

static inline int stream_slot(const window_t *w, CUstream key) {
    for (unsigned i = 0; i < w->nstreams; i++)
        if (w->streams[i] == key) return (int)i;
    return -1;
}

static inline CUevent slot_end(const window_t *w, unsigned i) {
    return i == 0 ? w->end : w->more_end[i - 1];
}

/* Records stream i's end event. `watcher`: from the pause watcher's thread,
 * which reaches a per-thread stream only through the legacy one. */
static CUresult record_slot(window_t *w, unsigned i, bool watcher) {
    CUstream key = w->streams[i];
    CUstream stream = watcher && key == (CUstream)0x2 ? NULL : key;
    if (capturing(stream, false)) return CUDA_ERROR_NOT_READY;
    CUresult rc = record(slot_end(w, i), stream, false);
    if (rc == CUDA_SUCCESS) w->recorded |= 1u << i;
    return rc;
}

/* Records the end of every stream of the window; true when each one was. */
static bool record_all(window_t *w, bool watcher) {
    bool all = true;
    for (unsigned i = 0; i < w->nstreams; i++) all &= record_slot(w, i, watcher) == CUDA_SUCCESS;
    return all;
}

/* Adds a stream to the window (mutex held, gate shut): false when it follows
 * as many as it can, or no event could be made for it. */
static bool add_stream(window_t *w, CUstream key) {
    if (w->nstreams >= GS_WINDOW_STREAMS) return false;
    unsigned i = w->nstreams;
    if (i > 0 && !w->more_end[i - 1] &&
        gs_real.cuEventCreate(&w->more_end[i - 1], 0) != CUDA_SUCCESS) {
        w->more_end[i - 1] = NULL;
        return false;
    }
    w->streams[i] = key;
    w->nstreams = i + 1;
    return true;
}

/* Whether a recorded end is still ahead of the GPU. */
static bool still_running(window_t *w) {
    if (!gs_real.cuEventQuery) return false;
    for (unsigned i = 0; i < w->nstreams; i++)
        if ((w->recorded & (1u << i)) && gs_real.cuEventQuery(slot_end(w, i)) == CUDA_ERROR_NOT_READY)
            return true;
    return false;
}

/* The GPU time from `start` to the latest recorded end, after waiting for them;
 * false when the driver cannot say. */
static bool measured(window_t *w, uint64_t *busy) {
    bool any = false;
    uint64_t most = 0;
    for (unsigned i = 0; i < w->nstreams; i++) {
        if (!(w->recorded & (1u << i))) continue;
        CUevent e = slot_end(w, i);
        gs_real.cuEventSynchronize(e);
        float ms = 0;
        if (!gs_real.cuEventElapsedTime || gs_real.cuEventElapsedTime(&ms, w->start, e) != CUDA_SUCCESS)
            return false;
        if (ms > 0) most = ((uint64_t)((double)ms * 1e6) > most ? (uint64_t)((double)ms * 1e6) : most);
        any = true;
    }
    *busy = most;
    return any;
}

/* Ends the open window (mutex held, gate shut) and charges the time it took.
 * `full`: it reached its length, and `end` was just recorded after its last
 * launch; otherwise it ends at a pause or a change. */
static void close_window(window_t *w, int d, bool full) {
    unsigned pauses = atomic_load_explicit(&w->pauses, memory_order_relaxed);
    unsigned launches = atomic_load_explicit(&w->launches, memory_order_relaxed);
    uint64_t busy;
    if (w->ended) {
        if (!measured(w, &busy)) /* the CPU's view: until the wait at the length, the last launch at a pause */
            busy = (full ? now_ns() : w->end_at) - w->cpu_start;
        uint64_t span = w->end_at - w->cpu_start;
        uint64_t lag = busy > span ? busy - span : 0;
        w->behind = w->late && lag > GS_PACE_NS; /* once may be a hiccup */
        w->late = lag > GS_PACE_NS;
        if (pauses && w->late) { /* it may have run on through them: measure again */
            w->need_pause = true;
            w->trust = 0;
        }
        if (full) {
            if (!pauses && ++w->calm >= GS_TRUST) w->need_pause = false; /* it does not pause */
            w->sparse = launches < GS_BURST * pauses;
        } else { /* a pause, measured: estimate the next ones if the GPU kept pace */
            w->need_pause = w->late;
            w->trust = w->late ? 0 : GS_TRUST;
            w->calm = 0;
            w->sparse = launches < GS_BURST;
        }
    } else {
        /* Unmarked, and no end recorded: at a change (context, limit, a capture),
         * where it ends about now, or at a pause the watcher did not get to
         * (starved of the CPU), where the GPU may have run through it: charged
         * until now, never less than the GPU may have run. */
        busy = now_ns() - w->cpu_start;
        pauses++;
        w->sparse = launches < GS_BURST * pauses;
    }
    if (pauses) { /* estimated ones */
        w->calm = 0;
        w->trust = w->trust > pauses ? w->trust - pauses : 0;
        if (!w->trust) w->need_pause = true;
    }
    busy = busy > w->charged ? busy - w->charged : 0;
    charge(d, busy, w->limit, w->cpu_start);
    w->open = w->ended = false;
    w->nstreams = w->recorded = 0;
}

static CUresult record(CUevent event, CUstream stream, bool ptds) {
    if (ptds && gs_real.cuEventRecord_ptsz) return gs_real.cuEventRecord_ptsz(event, stream);
    return gs_real.cuEventRecord(event, stream);
}

/* Work launched into a stream being captured only joins a graph: it is
 * measured when the graph is launched, and events must not touch the capture. */
static bool capturing(CUstream stream, bool ptds) {
    int status = 0;
    CUresult (*query)(CUstream, int *) =
        ptds && gs_real.cuStreamIsCapturing_ptsz ? gs_real.cuStreamIsCapturing_ptsz
                                                 : gs_real.cuStreamIsCapturing;
    return query && query(stream, &status) == CUDA_SUCCESS && status != 0;
}

/* A context is gone, and its events with it: windows on it start afresh. */
void gs_limiter_forget_ctx(CUcontext ctx) {
    atomic_fetch_add_explicit(&ctx_epoch, 1, memory_order_release);
    for (int d = 0; d < GS_MAX_DEVICES; d++) {
        window_t *w = &windows[d];
        pthread_mutex_lock(&w->mu);
        shut(w);
        if (w->start && w->ctx == ctx) {
            w->start = w->end = NULL; /* destroyed with the context */
            for (int i = 0; i < GS_WINDOW_STREAMS - 1; i++) w->more_end[i] = NULL;
            w->nstreams = w->recorded = 0;
            w->ctx = NULL;
            w->open = w->ended = false;
        }
        release(w);
    }
}

static bool window_events(window_t *w, CUcontext ctx) {
    if (w->start && w->ctx == ctx) return true;
    if (w->start) {
        gs_real.cuEventDestroy_v2(w->start);
        gs_real.cuEventDestroy_v2(w->end);
        w->start = w->end = NULL;
        for (int i = 0; i < GS_WINDOW_STREAMS - 1; i++) {
            if (w->more_end[i]) gs_real.cuEventDestroy_v2(w->more_end[i]);
            w->more_end[i] = NULL;
        }
    }
    if (gs_real.cuEventCreate(&w->start, 0) != CUDA_SUCCESS) return false;
    if (gs_real.cuEventCreate(&w->end, 0) != CUDA_SUCCESS) {
        gs_real.cuEventDestroy_v2(w->start);
        w->start = NULL;
        return false;
    }
    w->ctx = ctx;
    return true;
}

static bool open_window(window_t *w, CUcontext ctx, uint32_t limit, CUstream stream, bool ptds) {
    if (!window_events(w, ctx)) return false;
    CUresult rc = record(w->start, stream, ptds);
    if (rc != CUDA_SUCCESS) { /* events from a context since destroyed: once more */
        w->start = w->end = NULL;
        for (int i = 0; i < GS_WINDOW_STREAMS - 1; i++) w->more_end[i] = NULL;
        if (window_events(w, ctx)) rc = record(w->start, stream, ptds);
    }
    if (rc != CUDA_SUCCESS) return false;
    w->cpu_start = now_ns();
    atomic_store_explicit(&w->launches, 0, memory_order_relaxed);
    atomic_store_explicit(&w->last_launch, w->cpu_start, memory_order_relaxed);
    atomic_store_explicit(&w->gaps, 0, memory_order_relaxed);
    atomic_store_explicit(&w->pauses, 0, memory_order_relaxed);
    atomic_store_explicit(&w->deadline, w->cpu_start + GS_WINDOW_NS, memory_order_relaxed);
    w->limit = limit;
    w->marked = w->behind || w->need_pause || w->sparse;
    w->length = w->behind ? GS_WINDOW_LAUNCHES : GS_PACED_LAUNCHES;
    w->ended = false;
    w->charged = 0;
    w->streams[0] = stream_key(stream, ptds);
    w->nstreams = 1;
    w->recorded = 0;
    w->open = true;
    /* marked windows need the watcher too, for a kernel running on after them */
    if (!w->marked || !__atomic_load_n(&watcher_started, __ATOMIC_ACQUIRE)) watch_opened();
    return true;
}

/* With the mutex held and the gate shut: a window whose recorded end the GPU
 * has not reached is charged the time it ran so far (closing takes it off);
 * false when it is not running on. */
static bool charge_ran(window_t *w, int d) {
    if (!w->open || !w->ended || !still_running(w)) return false;
    uint64_t ran = now_ns() - w->cpu_start;
    if (ran > w->charged) {
        charge(d, ran - w->charged, w->limit, w->cpu_start);
        w->charged = ran;
    }
    return true;
}

/* Before a launch after a pause, whose window would close (waiting for its
 * last kernel): when that kernel still runs, the time the window ran so far is
 * charged now, so the container's other processes see it (a kernel that never
 * ends is paid while it runs); closing takes it off what it charges. */
static void charge_running(window_t *w, int d, uint64_t now) {
    if (!gs_real.cuEventQuery || !w->open || !w->ended ||
        now <= atomic_load_explicit(&w->last_launch, memory_order_relaxed) + GS_GAP_NS)
        return; /* read without the mutex: a hint, checked again under it */
    pthread_mutex_lock(&w->mu);
    shut(w);
    (void)charge_ran(w, d);
    release(w);
}

/* At exit: every open window is charged, so that a short-lived process pays
 * too (its debt is the container's: the next process starts from it). A
 * window whose last kernel still runs is charged the time it ran. A window
 * whose mutex another thread holds through the exit is left. */
static void limiter_exit(void) {
    if (getpid() != exit_pid || !atomic_load(&limiter_on) || !limiter_usable ||
        atomic_load_explicit(&gs_attached, memory_order_acquire) != 1)
        return;
    for (int d = 0; d < GS_MAX_DEVICES; d++) {
        window_t *w = &windows[d];
        bool locked = false;
        for (int i = 0; i < 100 && !(locked = pthread_mutex_trylock(&w->mu) == 0); i++)
            sleep_ns(1000000);
        if (!locked) continue;
        shut(w);
        if (w->open) {
            if (w->ended && still_running(w)) {
                uint64_t ran = now_ns() - w->cpu_start;
                if (ran > w->charged) charge(d, ran - w->charged, w->limit, w->cpu_start);
                w->open = w->ended = false;
            } else {
                close_window(w, d, false);
            }
        }
        w->open = false;
        pthread_mutex_unlock(&w->mu);
    }
}

/* ------------------------------------------------------------ the pause watcher */
/*
 * An unmarked window has no event after each launch, so where the GPU's work
 * ended before a pause is unknown, and a kernel queued last before a pause may
 * run through it. The watcher thread sees the pause begin instead: once an open
 * unmarked window has had no launch for GS_PACE_NS, it records the window's end
 * event on the stream of its last launch (the GPU reaches it when that work is
 * done, or at once if it was) and shuts the lock-free path, so the launch after
 * the pause takes the slow path: at a pause the window closes measured, as a
 * marked one does; after a shorter gap it goes on (its end recorded again
 * later). It also charges, every GS_RUNNING_NS, the time a window whose last
 * kernel runs on a pause after its last launch has run so far (a process that
 * queues a long kernel and launches nothing after it would otherwise pay only
 * at its next launch or exit, and its container's other processes ran their
 * full share beside it): seen within a second, then every GS_RUNNING_NS while
 * it runs. The watcher sleeps while no window needs it.
 */

/* With the window's mutex held and its gate shut: records `end` for the pause
 * that began after its last launch. */
static bool watch_ctx(window_t *w) {
    static __thread CUcontext current;
    if (current != w->ctx) {
        if (!gs_real.cuCtxSetCurrent || gs_real.cuCtxSetCurrent(w->ctx) != CUDA_SUCCESS) return false;
        current = w->ctx;
    }
    return true;
}

static void watch_mark(window_t *w) {
    if (!watch_ctx(w)) return;
    w->recorded = 0;
    if (!record_all(w, true)) return; /* left unended: a pause is charged as busy */
    w->end_at = now_ns();
    w->ended = true;
}

static void *watcher_main(void *arg) {
    (void)arg;
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0); /* its sleeps are short and their end matters */
    for (;;) {
        unsigned gen = atomic_load_explicit(&watch_gen, memory_order_acquire);
        uint64_t now = now_ns(), next = now + GS_GAP_NS;
        bool any = false; /* an unmarked window whose pause may still come */
        for (int d = 0; d < GS_MAX_DEVICES; d++) {
            window_t *w = &windows[d];
            if (pthread_mutex_trylock(&w->mu) != 0) { /* a launch holds it: look again soon */
                any = true;
                next = gs_min_u64(next, now + GS_WATCH_NS);
                continue;
            }
            if (!w->open || !w->start) {
                pthread_mutex_unlock(&w->mu);
                continue;
            }
            if (w->ended) { /* a kernel may run on after the last launch: looked at
                             * within a second, then every GS_RUNNING_NS while it runs */
                if (now > atomic_load_explicit(&w->last_launch, memory_order_relaxed) + GS_GAP_NS &&
                    watch_ctx(w)) {
                    shut(w);
                    if (charge_ran(w, d)) {
                        any = true;
                        next = gs_min_u64(next, now + GS_RUNNING_NS);
                    }
                }
                pthread_mutex_unlock(&w->mu); /* its gate stays as it was: shut */
                continue;
            }
            if (w->marked) {
                pthread_mutex_unlock(&w->mu);
                continue;
            }
            uint64_t last = atomic_load_explicit(&w->last_launch, memory_order_relaxed);
            any = true; /* (a window it ends below no longer needs it) */
            if (now < last + GS_WATCH_NS) {
                next = gs_min_u64(next, last + GS_WATCH_NS);
                pthread_mutex_unlock(&w->mu);
                continue;
            }
            shut(w);
            if (atomic_load_explicit(&w->last_launch, memory_order_relaxed) == last) watch_mark(w);
            if (w->ended) { /* the gate stays shut: the next launch takes the slow path */
                pthread_mutex_unlock(&w->mu);
            } else {
                next = gs_min_u64(next, now + GS_WATCH_NS); /* not recorded: again soon */
                release(w);
            }
        }
        /* Until the next window may be due, or a second with none open; a window
         * opened since the scan began (maybe unseen) wakes it at once. */
        uint64_t until = any ? next : now_ns() + 1000000000ULL;
        struct timespec ts = {(time_t)(until / 1000000000ULL), (long)(until % 1000000000ULL)};
        pthread_mutex_lock(&watch_mu);
        if (atomic_load_explicit(&watch_gen, memory_order_acquire) == gen)
            pthread_cond_timedwait(&watch_cv, &watch_mu, &ts);
        pthread_mutex_unlock(&watch_mu);
    }
    return NULL;
}

/* An unmarked window opened: the watcher starts, or wakes to time it. */
static void watch_opened(void) {
    atomic_fetch_add_explicit(&watch_gen, 1, memory_order_acq_rel);
    pthread_mutex_lock(&watch_mu);
    if (!__atomic_load_n(&watcher_started, __ATOMIC_ACQUIRE)) {
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&watch_cv, &ca);
        pthread_condattr_destroy(&ca);
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        __atomic_store_n(&watcher_started, pthread_create(&t, &attr, watcher_main, NULL) == 0,
                         __ATOMIC_RELEASE);
        pthread_attr_destroy(&attr);
        if (!__atomic_load_n(&watcher_started, __ATOMIC_ACQUIRE))
            GS_LOG(GS_LOG_WARN, "cannot start the pause watcher: pauses are charged as busy");
    }
    pthread_cond_signal(&watch_cv);
    pthread_mutex_unlock(&watch_mu);
}

enum { GS_SLOW = -1, GS_PLAIN, GS_JOINED, GS_FILLS };

/*
 * The lock-free path, before the driver call: it reads no clock (see the top of
 * the file) and calls nothing, so the launch's arguments pass through untouched.
 * GS_JOINED: the launch joins the open unmarked window `*out` (fast_end after the
 * driver call). GS_PLAIN: no limit applies to it now (plain_end after).
 * GS_FILLS: it is the last launch of that window (fill_begin). GS_SLOW: the rest
 * (no cached device, a wait or a yield due, no window or a marked one).
 */
static inline __attribute__((always_inline)) int fast_begin(window_t **out, CUstream key) {
    CUcontext ctx = t_dev.ctx;
    if (GS_UNLIKELY(!ctx || t_dev.epoch != atomic_load_explicit(&ctx_epoch, memory_order_relaxed)))
        return GS_SLOW;
    int d = t_dev.dev;
    window_t *w = t_dev.win;
    *out = w;
    uint64_t seen = atomic_load_explicit(&w->seen, memory_order_relaxed);
    uint32_t limit = limit_of[d];
    if (GS_UNLIKELY(agent_may)) {
        if ((agent_may & GS_AGENT_YIELDS) && (dev_flags(d) & GS_DEV_YIELD)) return GS_SLOW;
        limit = active_limit(d, seen);
    }
    if (!limit) return GS_PLAIN;
    if (__atomic_load_n(w->tat, __ATOMIC_ACQUIRE) > seen + GS_TAU_NS ||
        atomic_load_explicit(&own_tat[d], memory_order_relaxed) > seen + GS_TAU_NS)
        return GS_SLOW;
    if (GS_UNLIKELY(!(atomic_fetch_add_explicit(&w->gate, GS_INFLIGHT, memory_order_acquire) &
                      GS_OPEN) ||
                    w->ctx != ctx || (w->streams[0] != key && stream_slot(w, key) < 0))) {
        /* (a stream new to the window joins it on the slow path) */
        atomic_fetch_sub_explicit(&w->gate, GS_INFLIGHT, memory_order_release);
        return GS_SLOW;
    }
    if (GS_UNLIKELY(atomic_fetch_add_explicit(&w->launches, 1, memory_order_relaxed) + 1 >=
                        w->length ||
                    seen >= atomic_load_explicit(&w->deadline, memory_order_relaxed))) {
        atomic_fetch_sub_explicit(&w->launches, 1, memory_order_relaxed);
        atomic_fetch_sub_explicit(&w->gate, GS_INFLIGHT, memory_order_release);
        return GS_FILLS; /* it records the window's end */
    }
    return GS_JOINED;
}

/* After the driver call of a launch that joined: the clock, and a pause before it. */
static inline void fast_end(window_t *w) {
    uint64_t now = now_ns();
    atomic_store_explicit(&w->seen, now, memory_order_relaxed);
    uint64_t prev = atomic_exchange_explicit(&w->last_launch, now, memory_order_relaxed);
    if (GS_UNLIKELY(now > prev + GS_GAP_NS)) note_pause(w, now - prev);
    atomic_fetch_sub_explicit(&w->gate, GS_INFLIGHT, memory_order_release);
}

static inline void plain_end(window_t *w) {
    atomic_store_explicit(&w->seen, now_ns(), memory_order_relaxed);
}

/* The launch that fills an unmarked window: true when it is still to be filled
 * (the window's mutex is then held, its gate shut, until fill_end records the
 * end after this launch), false when the launch must take the slow path. */
static bool fill_begin(window_t *w, CUstream stream, bool ptds) {
    if (capturing(stream, ptds)) return false;
    pthread_mutex_lock(&w->mu);
    shut(w);
    if (w->open && !w->marked && w->ctx == t_dev.ctx &&
        (atomic_load_explicit(&w->launches, memory_order_relaxed) + 1 >= w->length ||
         atomic_load_explicit(&w->seen, memory_order_relaxed) >=
             atomic_load_explicit(&w->deadline, memory_order_relaxed)))
        return true;
    release(w);
    return false;
}

/* Waits as the share and the agent require; returns the device whose window the
 * launch joins (its mutex held, its gate shut), or -1 when no window measures it. */
static int before_launch(CUstream stream, bool ptds) {
    if (!gs_enter() || !limiter_usable) return -1;
    CUcontext ctx;
    int d = launch_device(&ctx);
    if (d < 0) return -1;
    window_t *w = &windows[d];
    if (capturing(stream, ptds)) {
        /* Launches of a capture may have joined an unmarked window on the
         * lock-free path; its time ends with the capture's first one here. */
        pthread_mutex_lock(&w->mu);
        shut(w);
        if (w->open && !w->marked) close_window(w, d, false);
        release(w);
        return -1;
    }
    gs_device_t *dev = &gs_region->devices[d];
    uint64_t now = now_ns();
    uint64_t waited = 0;
    if (!control_now()) control_open(now);
    charge_running(w, d, now);
    while ((agent_may & GS_AGENT_YIELDS) && agent_live(now) && (dev_flags(d) & GS_DEV_YIELD)) {
        sleep_ns(1000000);
        uint64_t later = now_ns();
        waited += later - now;
        now = later;
    }
    uint32_t limit = active_limit(d, now);
    if (limit) {
        uint64_t tat = __atomic_load_n(&dev->tat_ns, __ATOMIC_ACQUIRE);
        if (tat > now + GS_MAX_AHEAD_NS &&
            __atomic_compare_exchange_n(&dev->tat_ns, &tat, now, false, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            GS_LOG(GS_LOG_WARN, "device %d: limiter clock was %llu s ahead; reset", d,
                   (unsigned long long)((tat - now) / 1000000000ULL));
        }
        tat = clock_of(d, now);
        if (tat > now + GS_TAU_NS) {
            sleep_ns(tat - GS_TAU_NS - now);
            uint64_t later = now_ns();
            waited += later - now;
            now = later;
        }
    }
    if (waited) __atomic_add_fetch(&dev->throttled_ns, waited, __ATOMIC_RELAXED);
    atomic_store_explicit(&w->seen, now, memory_order_relaxed);
    if (!limit) return -1;
    pthread_mutex_lock(&w->mu);
    shut(w);
    now = now_ns(); /* another thread may have launched while this one waited */
    if (w->open && (w->ctx != ctx || w->limit != limit ||
                    now > atomic_load_explicit(&w->last_launch, memory_order_relaxed) + GS_GAP_NS))
        close_window(w, d, false);
    else if (w->open && !w->marked && w->ended)
        w->ended = false; /* the watcher's end, at a gap shorter than a pause: it goes on */
    if (!w->open && !open_window(w, ctx, limit, stream, ptds)) {
        release(w);
        return -1;
    }
    CUstream key = stream_key(stream, ptds);
    if (stream_slot(w, key) < 0 && !add_stream(w, key)) {
        /* it follows all the streams it can: the next window follows this one */
        if (record_all(w, false)) {
            w->ended = true;
            w->end_at = now_ns();
        }
        close_window(w, d, false);
        if (!open_window(w, ctx, limit, stream, ptds)) {
            release(w);
            return -1;
        }
    }
    return d;
}

/* After the driver call of a launch that holds its window's mutex. */
static void after_launch(int d, CUstream stream, bool ptds, CUresult rc) {
    window_t *w = &windows[d];
    if (rc == CUDA_SUCCESS) {
        unsigned n = atomic_fetch_add_explicit(&w->launches, 1, memory_order_relaxed) + 1;
        uint64_t now = now_ns();
        bool full = n >= w->length || now >= atomic_load_explicit(&w->deadline, memory_order_relaxed);
        if (w->marked || full) {
            /* marked: this stream's end after this launch; full: every stream's */
            int slot = stream_slot(w, stream_key(stream, ptds));
            bool ok = full ? record_all(w, false)
                           : slot >= 0 && record_slot(w, (unsigned)slot, false) == CUDA_SUCCESS;
            if (ok) {
                now = now_ns();
                w->ended = true;
                w->end_at = now;
            } else if (!w->marked) {
                /* A stream whose end cannot be recorded (destroyed, or being
                 * captured): closed unmeasured, charged until now, which the GPU
                 * may have run; waiting for an end that never comes left the
                 * window open, and nothing charged while launches kept coming. */
                w->ended = false;
            }
        }
        atomic_store_explicit(&w->last_launch, now, memory_order_relaxed);
        atomic_store_explicit(&w->seen, now, memory_order_relaxed);
        if (full) close_window(w, d, true);
    } else if (atomic_load_explicit(&w->launches, memory_order_relaxed) == 0) {
        w->open = false; /* nothing ran in it */
    }
    release(w);
}

/* After the driver call of the launch that fills an unmarked window, which came
 * without a clock read: a pause before it first, as fast_end would. */
static void fill_end(window_t *w, CUstream stream, bool ptds, CUresult rc) {
    uint64_t now = now_ns();
    uint64_t prev = atomic_load_explicit(&w->last_launch, memory_order_relaxed);
    if (rc == CUDA_SUCCESS && now > prev + GS_GAP_NS) note_pause(w, now - prev);
    after_launch((int)(w - windows), stream, ptds, rc);
}

/*
 * Each entry point is a fast path that only reads two flags and jumps to the
 * driver (a sibling call: no frame of its own), and an out-of-line path for
 * limited launches: lock-free when it can be, else the slow path.
 */
#define GS_LAUNCH_ENTRY(fn, params, args, stream, ptds) \
    GS_LAUNCH_ENTRY_COPYING(fn, params, args, stream, ptds, (void)0)
/* `copy`: a statement that points a parameter the launch reads through (a
 * config) at a copy of it first, so that the stream the window follows is the
 * one the driver launches into, whatever another thread writes meanwhile. */
#define GS_LAUNCH_ENTRY_COPYING(fn, params, args, stream, ptds, copy)                        \
    static __attribute__((noinline)) CUresult fn##_slow params {                              \
        gs_init();                                                                            \
        if (!atomic_load_explicit(&limiter_on, memory_order_relaxed)) return GS_CALL(fn, args); \
        int d_ = before_launch((stream), (ptds));                                             \
        CUresult rc_ = GS_CALL(fn, args);                                                     \
        if (d_ >= 0) after_launch(d_, (stream), (ptds), rc_);                                 \
        return rc_;                                                                           \
    }                                                                                         \
    static __attribute__((noinline)) CUresult fn##_fill params {                              \
        window_t *w_ = t_dev.win;                                                             \
        if (!fill_begin(w_, (stream), (ptds))) return fn##_slow args;                         \
        CUresult rc_ = gs_real.fn args;                                                       \
        fill_end(w_, (stream), (ptds), rc_);                                                  \
        return rc_;                                                                           \
    }                                                                                         \
    /* No call before the driver's: the arguments stay where they came (the    \
     * rare paths are plain calls, as GCC loads a sibling call's stack arguments \
     * into registers on entry). */                                                         \
    static __attribute__((noinline)) CUresult fn##_limited params {                           \
        window_t *w_ = NULL;                                                                  \
        CUresult rc_;                                                                         \
        copy;                                                                                 \
        if (GS_LIKELY(gs_real.fn != NULL)) { /* and t_dev is empty until the library joined */ \
            switch (fast_begin(&w_, stream_key((stream), (ptds)))) {                          \
            case GS_JOINED:                                                                   \
                rc_ = gs_real.fn args;                                                        \
                fast_end(w_);                                                                 \
                return rc_;                                                                   \
            case GS_PLAIN:                                                                    \
                rc_ = gs_real.fn args;                                                        \
                plain_end(w_);                                                                \
                return rc_;                                                                   \
            case GS_FILLS: rc_ = fn##_fill args; break;                                       \
            default: rc_ = fn##_slow args; break;                                             \
            }                                                                                 \
        } else {                                                                              \
            rc_ = fn##_slow args;                                                             \
        }                                                                                     \
        __asm__ volatile("" ::: "memory"); /* calls, not sibling calls: see above */          \
        return rc_;                                                                           \
    }                                                                                         \
    CUresult fn params {                                                                      \
        if (GS_LIKELY(atomic_load_explicit(&gs_ready, memory_order_acquire) &&                \
                      !atomic_load_explicit(&limiter_on, memory_order_relaxed) &&             \
                      gs_real.fn != NULL))                                                    \
            return gs_real.fn args;                                                           \
        return fn##_limited args;                                                             \
    }

GS_LAUNCH_ENTRY(cuLaunchKernel, GS_LAUNCH_PARAMS, GS_LAUNCH_ARGS, hStream, false)
GS_LAUNCH_ENTRY(cuLaunchKernel_ptsz, GS_LAUNCH_PARAMS, GS_LAUNCH_ARGS, hStream, true)
/* The config is read once, into a copy the driver gets: its stream read from
 * the caller's config, then read again by the driver, could differ (another
 * thread flipping it ran kernels on a stream the window did not follow). */
#define GS_COPY_CONFIG                                                                        \
    CUlaunchConfig config_copy_;                                                              \
    if (config) {                                                                             \
        config_copy_ = *(const volatile CUlaunchConfig *)config;                              \
        config = &config_copy_;                                                               \
    }
GS_LAUNCH_ENTRY_COPYING(cuLaunchKernelEx,
                        (const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                         void **extra),
                        (config, f, kernelParams, extra), config ? config->hStream : NULL, false,
                        GS_COPY_CONFIG)
GS_LAUNCH_ENTRY_COPYING(cuLaunchKernelEx_ptsz,
                        (const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                         void **extra),
                        (config, f, kernelParams, extra), config ? config->hStream : NULL, true,
                        GS_COPY_CONFIG)
GS_LAUNCH_ENTRY(cuLaunchCooperativeKernel, GS_COOP_PARAMS, GS_COOP_ARGS, hStream, false)
GS_LAUNCH_ENTRY(cuLaunchCooperativeKernel_ptsz, GS_COOP_PARAMS, GS_COOP_ARGS, hStream, true)
GS_LAUNCH_ENTRY(cuGraphLaunch, (CUgraphExec hGraphExec, CUstream hStream), (hGraphExec, hStream),
                hStream, false)
GS_LAUNCH_ENTRY(cuGraphLaunch_ptsz, (CUgraphExec hGraphExec, CUstream hStream),
                (hGraphExec, hStream), hStream, true)
/* The legacy launches run on the NULL stream (cuLaunchGridAsync: its own). */
GS_LAUNCH_ENTRY(cuLaunch, (CUfunction f), (f), NULL, false)
GS_LAUNCH_ENTRY(cuLaunchGrid, (CUfunction f, int grid_width, int grid_height),
                (f, grid_width, grid_height), NULL, false)
GS_LAUNCH_ENTRY(cuLaunchGridAsync, (CUfunction f, int grid_width, int grid_height, CUstream hStream),
                (f, grid_width, grid_height, hStream), hStream, false)

/*
 * A multi-device cooperative launch runs a kernel on each entry's stream, each
 * on that stream's device: every device's share is waited for and each kernel
 * measured in its device's window, the stream's context made current for it.
 * The windows are held in device order (no other path holds two at once), and
 * the driver is called with all of them held. An entry whose stream's context
 * cannot be read, or a device seen twice, is left to the driver's own checks.
 */
CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *launchParamsList,
                                              unsigned int numDevices, unsigned int flags) {
    gs_init();
    if (!atomic_load_explicit(&limiter_on, memory_order_relaxed) || !launchParamsList ||
        !numDevices || numDevices > GS_MAX_DEVICES || !gs_real.cuStreamGetCtx ||
        !gs_real.cuCtxPushCurrent_v2 || !gs_real.cuCtxPopCurrent_v2 || !gs_enter())
        return GS_CALL(cuLaunchCooperativeKernelMultiDevice, (launchParamsList, numDevices, flags));
    /* read once, and the driver gets the copy: the streams the windows follow
     * are those it launches into, whatever another thread writes meanwhile */
    CUDA_LAUNCH_PARAMS list[GS_MAX_DEVICES];
    for (unsigned i = 0; i < numDevices; i++)
        list[i] = ((const volatile CUDA_LAUNCH_PARAMS *)launchParamsList)[i];
    struct {
        CUcontext ctx;
        CUstream stream;
        int dev; /* the window held, -1: none */
    } held[GS_MAX_DEVICES];
    unsigned n = 0;
    for (unsigned i = 0; i < numDevices; i++) {
        CUcontext ctx = NULL;
        if (gs_real.cuStreamGetCtx(list[i].hStream, &ctx) != CUDA_SUCCESS || !ctx) continue;
        held[n].ctx = ctx;
        held[n].stream = list[i].hStream;
        held[n].dev = -1;
        n++;
    }
    /* each entry's device, then in device order: wait and join its window */
    int devs[GS_MAX_DEVICES];
    for (unsigned i = 0; i < n; i++) {
        devs[i] = -1;
        if (gs_real.cuCtxPushCurrent_v2(held[i].ctx) != CUDA_SUCCESS) continue;
        devs[i] = gs_current_device();
        CUcontext popped;
        gs_real.cuCtxPopCurrent_v2(&popped);
    }
    bool taken[GS_MAX_DEVICES] = {false};
    for (int d = 0; d < GS_MAX_DEVICES; d++)
        for (unsigned i = 0; i < n; i++) {
            if (devs[i] != d || taken[d]) continue;
            taken[d] = true;
            if (gs_real.cuCtxPushCurrent_v2(held[i].ctx) != CUDA_SUCCESS) continue;
            t_dev.ctx = NULL;
            held[i].dev = before_launch(held[i].stream, false);
            CUcontext popped;
            gs_real.cuCtxPopCurrent_v2(&popped);
        }
    t_dev.ctx = NULL; /* the per-thread cache followed the pushes */
    CUresult rc = GS_CALL(cuLaunchCooperativeKernelMultiDevice, (list, numDevices, flags));
    for (unsigned i = 0; i < n; i++) {
        if (held[i].dev < 0) continue;
        bool pushed = gs_real.cuCtxPushCurrent_v2(held[i].ctx) == CUDA_SUCCESS;
        after_launch(held[i].dev, held[i].stream, false, rc);
        if (pushed) {
            CUcontext popped;
            gs_real.cuCtxPopCurrent_v2(&popped);
        }
    }
    t_dev.ctx = NULL;
    return rc;
}
