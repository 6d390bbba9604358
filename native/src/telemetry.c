/*
 * Telemetry: a background thread samples the shared region every
 * GPUSLICE_TELEMETRY_INTERVAL into a bounded ring and drains the ring to NATS
 * (subject <prefix>.telemetry.<node token>.<pod uid>) as JSON, through the
 * publisher of nats.c.
 *
 * CUDA calls never touch this module: they update the region's counters and the
 * thread reads them. The thread alone owns the ring, the NATS link and every
 * buffer here, so nothing is locked. It never blocks on the network either: one
 * poll() waits for the next sample, the server's bytes and room to send. When NATS
 * is down or slow the ring fills and the oldest samples are dropped and counted
 * (dropped_samples in every report).
 *
 * Everything is allocated once when the thread starts (the ring) or static (the
 * buffers); the loop itself allocates nothing, except getaddrinfo() when the link
 * (re)connects to a server given by name.
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gs.h"
#include "nats.h"

#define TL_MS 1000000ull
#define TL_MIN_INTERVAL_NS (10 * TL_MS)
#define TL_DEFAULT_INTERVAL_NS (1000 * TL_MS)
/* next_sample = now + interval must not wrap around into the past (a busy loop) */
#define TL_MAX_INTERVAL_NS (24 * 3600 * 1000 * TL_MS)
#define TL_MAX_RING 4096
#define TL_DEFAULT_RING 64

/* A device's JSON: uuid escaped (at most 6 bytes per byte) plus the names and
 * numbers (five counters of at most 20 digits and sm_percent: under 220 bytes). */
#define TL_DEV_JSON_MAX (GS_UUID_LEN * 6 + 256)
/* The sample's JSON: the escaped names and numbers, then every device. */
#define TL_JSON_MAX (8192 + GS_MAX_DEVICES * TL_DEV_JSON_MAX)
_Static_assert(TL_JSON_MAX <= GS_NATS_PAYLOAD_MAX, "a sample must fit one PUB");

/* ------------------------------------------------------------ state */

enum { TL_OFF = 0, TL_RUNNING = 1, TL_DISABLED = 2 };
static atomic_int tl_state = TL_OFF;

typedef struct {
    char uuid[GS_UUID_LEN];
    uint64_t used, peak, limit, denied, throttled_ns;
    uint32_t sm_tenths; /* SM use in tenths of a percent, 0..1000 */
} tl_dev_t;

typedef struct {
    int64_t real_s;     /* CLOCK_REALTIME when sampled */
    uint32_t real_ms;
    uint32_t ndev;
    tl_dev_t dev[GS_MAX_DEVICES];
} tl_sample_t;

/* The ring: kept across fork (the child reuses the parent's copy), emptied by
 * gs_telemetry_after_fork. */
static tl_sample_t *tl_ring;
static uint32_t tl_ring_cap, tl_ring_head, tl_ring_count;
static uint64_t tl_dropped; /* samples the ring or the server had no room for */

/* SM use: busy time and wall time of the previous sample. */
static uint64_t tl_prev_busy[GS_MAX_DEVICES];
static uint64_t tl_prev_wall;
static bool tl_have_prev;

static gs_nats_t tl_nats = GS_NATS_INITIALIZER;
static bool tl_ever_up, tl_outage_logged, tl_payload_logged;

/* Buffers. */
static char tl_subject[GS_NATS_SUBJECT_MAX];
static char tl_head[4096]; /* {"node":..,"pod_uid":..,"container":..,"pid":N,"time":" */
static size_t tl_head_len;
static char tl_json[TL_JSON_MAX];

static uint64_t tl_interval;

/* Every sample lost so far: dropped here, or cut off with a broken link. */
static uint64_t dropped(void) { return tl_dropped + tl_nats.lost; }

/* ------------------------------------------------------------ small helpers */

/* Days since 1970-01-01 to a civil date (proleptic Gregorian; H. Hinnant's
 * algorithm): no gmtime_r, which may read TZ and take libc's time-zone lock. */
static void civil_from_days(int64_t z, int64_t *y, unsigned *m, unsigned *d) {
    z += 719468;
    int64_t era = (z >= 0 ? z : z - 146096) / 146097;
    unsigned doe = (unsigned)(z - era * 146097);
    unsigned yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    int64_t yy = (int64_t)yoe + era * 400;
    unsigned doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    unsigned mp = (5 * doy + 2) / 153;
    *d = doy - (153 * mp + 2) / 5 + 1;
    *m = mp < 10 ? mp + 3 : mp - 9;
    *y = yy + (*m <= 2);
}

/* "YYYY-MM-DDTHH:MM:SS.mmmZ" */
static bool append_time(char *buf, size_t cap, size_t *pos, int64_t secs, uint32_t ms) {
    int64_t days = secs >= 0 ? secs / 86400 : -((-secs + 86399) / 86400);
    int64_t rem = secs - days * 86400;
    int64_t y;
    unsigned mo, d;
    civil_from_days(days, &y, &mo, &d);
    return gs_appendf(buf, cap, pos, "%04lld-%02u-%02uT%02u:%02u:%02u.%03uZ", (long long)y, mo, d,
                      (unsigned)(rem / 3600), (unsigned)(rem / 60 % 60), (unsigned)(rem % 60), ms);
}

/* A subject token: non-empty, no whitespace, no wildcard, no '.'. */
static bool subject_token_ok(const char *s, bool dots_ok) {
    if (!*s) return false;
    for (const unsigned char *u = (const unsigned char *)s; *u; u++) {
        if (*u <= ' ' || *u == 0x7f || *u == '*' || *u == '>') return false;
        if (*u == '.' && !dots_ok) return false;
    }
    return true;
}

/* ------------------------------------------------------------ samples */

static void load_uuid(const char *src, char *dst) {
    size_t i = 0;
    for (; i + 1 < GS_UUID_LEN; i++) {
        char c = __atomic_load_n(&src[i], __ATOMIC_RELAXED);
        if (!c) break;
        dst[i] = c;
    }
    dst[i] = '\0';
}

/* Reads the region into the ring's next slot; drops the oldest when full. */
static void take_sample(uint64_t now) {
    if (tl_ring_count == tl_ring_cap) {
        tl_ring_head = (tl_ring_head + 1) % tl_ring_cap;
        tl_ring_count--;
        tl_dropped++;
    }
    tl_sample_t *smp = &tl_ring[(tl_ring_head + tl_ring_count) % tl_ring_cap];
    tl_ring_count++;

    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    smp->real_s = ts.tv_sec;
    smp->real_ms = (uint32_t)(ts.tv_nsec / 1000000);
    smp->ndev = 0;

    uint64_t dwall = tl_have_prev && now > tl_prev_wall ? now - tl_prev_wall : 0;
    gs_region_t *r = gs_region;
    uint32_t count = r ? __atomic_load_n(&r->device_count, __ATOMIC_RELAXED) : 0;
    if (count > GS_MAX_DEVICES) count = GS_MAX_DEVICES;
    for (uint32_t i = 0; i < count; i++) {
        gs_device_t *d = &r->devices[i];
        uint64_t busy = __atomic_load_n(&d->busy_ns, __ATOMIC_RELAXED);
        uint64_t prev = tl_prev_busy[i];
        tl_prev_busy[i] = busy;
        tl_dev_t *o = &smp->dev[smp->ndev];
        load_uuid(d->uuid, o->uuid);
        if (!o->uuid[0]) continue;
        o->used = __atomic_load_n(&d->used, __ATOMIC_RELAXED);
        /* the region's own peak, as it is: a reservation raises `used` a moment
         * before `peak`, so a sample may show peak < used; readers take the larger */
        o->peak = __atomic_load_n(&d->peak, __ATOMIC_RELAXED);
        o->limit = __atomic_load_n(&d->limit, __ATOMIC_RELAXED);
        o->denied = __atomic_load_n(&d->denied, __ATOMIC_RELAXED);
        o->throttled_ns = __atomic_load_n(&d->throttled_ns, __ATOMIC_RELAXED);
        uint64_t tenths = 0;
        if (dwall > 0 && busy > prev) {
            uint64_t dbusy = busy - prev;
            tenths = dbusy >= dwall ? 1000 : dbusy * 1000 / dwall;
        }
        o->sm_tenths = (uint32_t)gs_min_u64(tenths, 1000);
        smp->ndev++;
    }
    for (uint32_t i = count; i < GS_MAX_DEVICES; i++) tl_prev_busy[i] = 0;
    tl_prev_wall = now;
    tl_have_prev = true;
}

/* The oldest sample as JSON in tl_json; returns its length, 0 if it does not fit
 * (cannot happen with the sizes above). */
static size_t sample_json(const tl_sample_t *smp) {
    size_t p = 0;
    const size_t cap = sizeof tl_json;
    if (!gs_append(tl_json, cap, &p, tl_head, tl_head_len)) return 0;
    if (!append_time(tl_json, cap, &p, smp->real_s, smp->real_ms)) return 0;
    if (!GS_APPEND_LIT(tl_json, cap, &p, "\",\"devices\":[")) return 0;
    for (uint32_t i = 0; i < smp->ndev; i++) {
        const tl_dev_t *d = &smp->dev[i];
        if (i && !GS_APPEND_LIT(tl_json, cap, &p, ",")) return 0;
        if (!GS_APPEND_LIT(tl_json, cap, &p, "{\"uuid\":\"")) return 0;
        if (!gs_json_escape(tl_json, cap, &p, d->uuid)) return 0;
        if (!gs_appendf(tl_json, cap, &p,
                        "\",\"used_bytes\":%llu,\"peak_bytes\":%llu,\"limit_bytes\":%llu,"
                        "\"sm_percent\":%u.%u,\"throttled_ns\":%llu,\"denied_allocations\":%llu}",
                        (unsigned long long)d->used, (unsigned long long)d->peak,
                        (unsigned long long)d->limit,
                        d->sm_tenths / 10, d->sm_tenths % 10, (unsigned long long)d->throttled_ns,
                        (unsigned long long)d->denied))
            return 0;
    }
    if (!gs_appendf(tl_json, cap, &p, "],\"dropped_samples\":%llu}",
                    (unsigned long long)dropped()))
        return 0;
    return p;
}

/* Subject and the JSON's constant head; false when they cannot be built. */
static bool build_constants(void) {
    const char *prefix = gs_cfg.subject_prefix[0] ? gs_cfg.subject_prefix : "gpuslice";
    char node_tok[sizeof gs_cfg.node];
    size_t i = 0;
    for (; gs_cfg.node[i] && i + 1 < sizeof node_tok; i++)
        node_tok[i] = gs_cfg.node[i] == '.' ? '_' : gs_cfg.node[i];
    node_tok[i] = '\0';
    if (!subject_token_ok(prefix, true) || prefix[0] == '.' ||
        prefix[strlen(prefix) - 1] == '.' || strstr(prefix, "..")) {
        GS_LOG(GS_LOG_ERROR, "telemetry: GPUSLICE_SUBJECT_PREFIX '%s' is not a subject prefix; "
               "telemetry off", prefix);
        return false;
    }
    if (!subject_token_ok(node_tok, false)) {
        GS_LOG(GS_LOG_ERROR, "telemetry: GPUSLICE_NODE_NAME '%s' cannot be a subject token; "
               "telemetry off", gs_cfg.node);
        return false;
    }
    if (!subject_token_ok(gs_cfg.pod_uid, false)) {
        GS_LOG(GS_LOG_ERROR, "telemetry: GPUSLICE_POD_UID '%s' cannot be a subject token; "
               "telemetry off", gs_cfg.pod_uid);
        return false;
    }
    int n = snprintf(tl_subject, sizeof tl_subject, "%s.telemetry.%s.%s", prefix, node_tok,
                     gs_cfg.pod_uid);
    if (n < 0 || (size_t)n >= sizeof tl_subject) return false;

    size_t p = 0;
    const size_t cap = sizeof tl_head;
    bool ok = GS_APPEND_LIT(tl_head, cap, &p, "{\"node\":\"") &&
              gs_json_escape(tl_head, cap, &p, gs_cfg.node) &&
              GS_APPEND_LIT(tl_head, cap, &p, "\",\"pod_uid\":\"") &&
              gs_json_escape(tl_head, cap, &p, gs_cfg.pod_uid) &&
              GS_APPEND_LIT(tl_head, cap, &p, "\",\"container\":\"") &&
              gs_json_escape(tl_head, cap, &p, gs_cfg.container) &&
              gs_appendf(tl_head, cap, &p, "\",\"pid\":%ld,\"time\":\"", (long)getpid());
    if (!ok) return false;
    tl_head_len = p;
    return true;
}

/* ------------------------------------------------------------ publishing */

/* The link's news, in our log: one warning per outage, not one per attempt. */
static void link_event(enum gs_nats_event ev, const char *host, const char *port,
                       const char *why) {
    switch (ev) {
    case GS_NATS_UP:
        if (tl_outage_logged || tl_ever_up)
            GS_LOG(GS_LOG_INFO,
                   "telemetry: connected to NATS at %s:%s (%llu samples dropped so far)", host,
                   port, (unsigned long long)dropped());
        else
            GS_LOG(GS_LOG_INFO, "telemetry: connected to NATS at %s:%s, publishing to %s", host,
                   port, tl_subject);
        tl_outage_logged = false;
        tl_ever_up = true;
        break;
    case GS_NATS_LOST:
        GS_LOG(GS_LOG_WARN,
               "telemetry: lost the connection to NATS at %s:%s (%s); reconnecting, "
               "samples wait in a ring of %u",
               host, port, why, tl_ring_cap);
        tl_outage_logged = true;
        break;
    case GS_NATS_UNREACHABLE:
        if (!tl_outage_logged) {
            GS_LOG(GS_LOG_WARN,
                   "telemetry: cannot reach NATS at %s:%s (%s); retrying, samples wait in a "
                   "ring of %u and the oldest are dropped",
                   host, port, why, tl_ring_cap);
            tl_outage_logged = true;
        } else {
            GS_LOG(GS_LOG_DEBUG, "telemetry: NATS at %s:%s: %s", host, port, why);
        }
        break;
    }
}

/* Moves samples from the ring onto the wire while the link takes them. */
static void drain(uint64_t now) {
    while (tl_ring_count > 0 && gs_nats_ready(&tl_nats)) {
        const tl_sample_t *smp = &tl_ring[tl_ring_head];
        size_t n = sample_json(smp);
        tl_ring_head = (tl_ring_head + 1) % tl_ring_cap;
        tl_ring_count--;
        if (n == 0 || !gs_nats_publish(&tl_nats, tl_subject, tl_json, n, now)) {
            tl_dropped++;
            if (!tl_payload_logged) {
                GS_LOG(GS_LOG_WARN,
                       "telemetry: a sample of %zu bytes exceeds the server's max_payload "
                       "(%llu bytes); such samples are dropped",
                       n, (unsigned long long)tl_nats.max_payload);
                tl_payload_logged = true;
            }
        }
    }
}

/* ------------------------------------------------------------ the thread */

static void *telemetry_main(void *arg) {
    (void)arg;
    pthread_setname_np(pthread_self(), "gpuslice-telem");

    if (!build_constants()) {
        atomic_store(&tl_state, TL_DISABLED);
        return NULL;
    }
    if (gs_nats_init(&tl_nats, "telemetry", link_event) == 0) {
        GS_LOG(GS_LOG_ERROR, "telemetry: GPUSLICE_NATS_URL '%s' holds no usable address; "
               "telemetry off", gs_cfg.nats_url);
        atomic_store(&tl_state, TL_DISABLED);
        return NULL;
    }
    uint32_t cap = gs_cfg.telemetry_ring ? gs_cfg.telemetry_ring : TL_DEFAULT_RING;
    if (cap > TL_MAX_RING) {
        GS_LOG(GS_LOG_WARN, "telemetry: GPUSLICE_TELEMETRY_RING=%u: keeping at most %u samples",
               cap, TL_MAX_RING);
        cap = TL_MAX_RING;
    }
    /* once per process image: a forked child reuses its copy of the parent's */
    if (!tl_ring) {
        tl_sample_t *ring = calloc(cap, sizeof *ring);
        if (!ring) {
            GS_LOG(GS_LOG_WARN, "telemetry: no memory for a ring of %u samples; telemetry off",
                   cap);
            atomic_store(&tl_state, TL_DISABLED);
            return NULL;
        }
        tl_ring_cap = cap;
        tl_ring = ring;
    }
    tl_interval = gs_cfg.telemetry_interval_ns ? gs_cfg.telemetry_interval_ns
                                               : TL_DEFAULT_INTERVAL_NS;
    if (tl_interval < TL_MIN_INTERVAL_NS) tl_interval = TL_MIN_INTERVAL_NS;
    if (tl_interval > TL_MAX_INTERVAL_NS) tl_interval = TL_MAX_INTERVAL_NS;
    GS_LOG(GS_LOG_DEBUG, "telemetry: every %llu ms to %s, ring of %u samples",
           (unsigned long long)(tl_interval / TL_MS), tl_subject, tl_ring_cap);

    uint64_t now = gs_now_ns();
    uint64_t next_sample = now;
    for (;;) {
        now = gs_now_ns();
        if (now >= next_sample) {
            take_sample(now);
            next_sample += tl_interval;
            if (next_sample <= now) next_sample = now + tl_interval;
        }
        gs_nats_step(&tl_nats, now);
        drain(now);

        /* wait for the next sample, the server, room to send or a deadline */
        struct pollfd pfd;
        uint64_t wake = gs_min_u64(next_sample, gs_nats_pollfd(&tl_nats, &pfd));
        now = gs_now_ns();
        uint64_t wait_ns = wake > now ? wake - now : 0;
        int timeout_ms = (int)gs_min_u64((wait_ns + TL_MS - 1) / TL_MS, 60000);
        if (poll(&pfd, pfd.fd >= 0 && pfd.events ? 1 : 0, timeout_ms) > 0)
            gs_nats_handle(&tl_nats, pfd.revents, gs_now_ns());
    }
    return NULL;
}

/* ------------------------------------------------------------ interface */

void gs_telemetry_start(void) {
    if (GS_LIKELY(atomic_load_explicit(&tl_state, memory_order_acquire) != TL_OFF)) return;
    if (!gs_cfg.nats_url[0]) return;
    int expected = TL_OFF;
    if (!gs_cfg.node[0] || !gs_cfg.pod_uid[0]) {
        if (atomic_compare_exchange_strong(&tl_state, &expected, TL_DISABLED))
            GS_LOG(GS_LOG_WARN, "telemetry: GPUSLICE_NATS_URL is set but %s is not; telemetry off",
                   !gs_cfg.node[0] ? "GPUSLICE_NODE_NAME" : "GPUSLICE_POD_UID");
        return;
    }
    if (!atomic_compare_exchange_strong(&tl_state, &expected, TL_RUNNING)) return;

    pthread_attr_t attr;
    if (pthread_attr_init(&attr) != 0) {
        atomic_store(&tl_state, TL_DISABLED);
        return;
    }
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 512 * 1024);
    /* the thread starts with every signal blocked: the application's handlers
     * never run on it */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_t tid;
    int rc = pthread_create(&tid, &attr, telemetry_main, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        GS_LOG(GS_LOG_WARN, "telemetry: cannot start the publisher thread (%s); telemetry off",
               gs_errname(rc));
        atomic_store(&tl_state, TL_DISABLED);
    }
}

void gs_telemetry_after_fork(void) {
    /* Only this thread exists in the child. The parent's connection is the
     * parent's: close our copy of the socket (the parent's stays open) and start
     * over with an empty ring, a fresh pid and no drops; the restarted thread sets
     * up a fresh link. */
    if (atomic_load(&tl_state) != TL_RUNNING) return;
    gs_nats_close(&tl_nats);
    tl_ring_head = tl_ring_count = 0;
    tl_dropped = 0;
    tl_have_prev = false;
    tl_ever_up = tl_outage_logged = tl_payload_logged = false;
    atomic_store(&tl_state, TL_OFF);
}
