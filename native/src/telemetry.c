/*
 * Telemetry: a background thread samples the shared region every
 * GPUSLICE_TELEMETRY_INTERVAL into a bounded ring and drains the ring to NATS
 * (subject <prefix>.telemetry.<node token>.<pod uid>) over the plain NATS text
 * protocol.
 *
 * CUDA calls never touch this module: they update the region's counters and the
 * thread reads them. The thread alone owns the ring, the socket and every
 * buffer here, so nothing is locked. It never blocks on the network either: the
 * socket is non-blocking and one poll() waits for the next sample, the server's
 * bytes and room to send. When NATS is down or slow the ring fills and the oldest
 * samples are dropped and counted (dropped_samples in every report).
 *
 * Everything is allocated once when the thread starts (the ring) or static (the
 * buffers); the loop itself allocates nothing, except getaddrinfo() when it
 * (re)connects to a server given by name.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "gs.h"

#ifndef GS_VERSION
#define GS_VERSION "0.1.0"
#endif

#define TL_MS 1000000ull
#define TL_CONNECT_TIMEOUT_NS (500 * TL_MS)   /* TCP connect */
#define TL_HANDSHAKE_TIMEOUT_NS (2000 * TL_MS) /* INFO, then CONNECT+PING -> PONG */
#define TL_BACKOFF_MIN_NS (250 * TL_MS)
#define TL_BACKOFF_MAX_NS (5000 * TL_MS)
#define TL_STALL_NS (2000 * TL_MS)   /* unsent bytes this long: the server is too slow */
#define TL_PING_EVERY_NS (15000 * TL_MS)
#define TL_PINGS_OUT_MAX 2           /* unanswered PINGs before the link counts as dead */
#define TL_MIN_INTERVAL_NS (10 * TL_MS)
#define TL_DEFAULT_INTERVAL_NS (1000 * TL_MS)
#define TL_MAX_RING 4096
#define TL_DEFAULT_RING 64
#define TL_MAX_URLS 8
#define TL_MAX_ADDRS 4
#define TL_DEFAULT_PORT 4222
#define TL_DEFAULT_MAX_PAYLOAD (1024 * 1024)

/* A device's JSON: uuid escaped (at most 6 bytes per byte) plus the numbers. */
#define TL_DEV_JSON_MAX (GS_UUID_LEN * 6 + 256)
/* The sample's JSON: the escaped names and numbers, then every device. */
#define TL_JSON_MAX (8192 + GS_MAX_DEVICES * TL_DEV_JSON_MAX)
#define TL_SUBJECT_MAX 512
/* One PUB (line, payload, CRLF) plus room for a few control lines behind it. */
#define TL_OUT_MAX (TL_JSON_MAX + TL_SUBJECT_MAX + 64 + 256)
#define TL_IN_MAX (32 * 1024)

/* ------------------------------------------------------------ state */

enum { TL_OFF = 0, TL_RUNNING = 1, TL_DISABLED = 2 };
static atomic_int tl_state = TL_OFF;

typedef struct {
    char uuid[GS_UUID_LEN];
    uint64_t used, limit, denied, throttled_ns;
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
static uint64_t tl_dropped;

/* SM use: busy time and wall time of the previous sample. */
static uint64_t tl_prev_busy[GS_MAX_DEVICES];
static uint64_t tl_prev_wall;
static bool tl_have_prev;

typedef struct {
    char host[256];
    char port[8];
    char user[128];
    char pass[256];
    bool userinfo; /* the URL carried credentials (user:pass@ or token@) */
    bool token;    /* userinfo was a bare token */
} tl_url_t;

static tl_url_t tl_urls[TL_MAX_URLS];
static int tl_nurls;

/* The connection. */
enum { C_DOWN, C_CONNECTING, C_WAIT_INFO, C_WAIT_PONG, C_UP };
static int tl_fd = -1;
static int tl_conn = C_DOWN;
static uint64_t tl_deadline;     /* of C_CONNECTING, C_WAIT_INFO and C_WAIT_PONG */
static uint64_t tl_next_connect; /* when C_DOWN */
static uint64_t tl_backoff = TL_BACKOFF_MIN_NS;
static int tl_url_idx, tl_addr_idx, tl_naddrs;
static struct sockaddr_storage tl_addrs[TL_MAX_ADDRS];
static socklen_t tl_addr_lens[TL_MAX_ADDRS];
static uint64_t tl_max_payload = TL_DEFAULT_MAX_PAYLOAD;
static uint64_t tl_next_ping;
static int tl_pings_out;
static bool tl_ever_up, tl_outage_logged, tl_payload_logged, tl_err_logged;
static bool tl_tls_logged, tl_auth_logged;

/* Buffers. */
static char tl_subject[TL_SUBJECT_MAX];
static size_t tl_subject_len;
static char tl_head[4096]; /* {"node":..,"pod_uid":..,"container":..,"pid":N,"time":" */
static size_t tl_head_len;
static char tl_json[TL_JSON_MAX];
static char tl_out[TL_OUT_MAX];
static size_t tl_out_off, tl_out_len;
static uint64_t tl_out_since; /* when the oldest unsent byte was queued */
static bool tl_out_has_pub;   /* the unsent bytes hold (part of) a sample... */
static size_t tl_pub_end;     /* ...which ends here */
static char tl_in[TL_IN_MAX];
static size_t tl_in_len;
static bool tl_in_skip; /* discarding the rest of an over-long line */

static uint64_t tl_interval;

/* ------------------------------------------------------------ small helpers */

static uint64_t tl_min(uint64_t a, uint64_t b) { return a < b ? a : b; }

/* Appends `s` as the body of a JSON string (no quotes) to buf[*pos..cap); returns
 * false when it does not fit. Control characters become \u00XX and bytes that are
 * not valid UTF-8 become U+FFFD, so the result is always valid JSON. */
static bool json_escape(char *buf, size_t cap, size_t *pos, const char *s) {
    static const char hex[] = "0123456789abcdef";
    size_t p = *pos;
    const unsigned char *u = (const unsigned char *)s;
    while (*u) {
        unsigned char c = *u;
        if (c == '"' || c == '\\') {
            if (p + 2 > cap) return false;
            buf[p++] = '\\';
            buf[p++] = (char)c;
            u++;
        } else if (c < 0x20 || c == 0x7f) {
            if (p + 6 > cap) return false;
            memcpy(buf + p, "\\u00", 4);
            buf[p + 4] = hex[c >> 4];
            buf[p + 5] = hex[c & 15];
            p += 6;
            u++;
        } else if (c < 0x80) {
            if (p + 1 > cap) return false;
            buf[p++] = (char)c;
            u++;
        } else {
            /* a UTF-8 sequence: copy it when well formed */
            size_t n = 0;
            uint32_t cp = 0, min = 0;
            if (c >= 0xc2 && c <= 0xdf) n = 2, cp = c & 0x1f, min = 0x80;
            else if (c >= 0xe0 && c <= 0xef) n = 3, cp = c & 0x0f, min = 0x800;
            else if (c >= 0xf0 && c <= 0xf4) n = 4, cp = c & 0x07, min = 0x10000;
            bool ok = n > 0;
            for (size_t i = 1; ok && i < n; i++) {
                if ((u[i] & 0xc0) != 0x80) ok = false;
                else cp = (cp << 6) | (u[i] & 0x3f);
            }
            if (ok && (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))) ok = false;
            if (ok) {
                if (p + n > cap) return false;
                memcpy(buf + p, u, n);
                p += n;
                u += n;
            } else {
                if (p + 6 > cap) return false;
                memcpy(buf + p, "\\ufffd", 6);
                p += 6;
                u++;
            }
        }
    }
    *pos = p;
    return true;
}

/* snprintf that appends at *pos; false when it does not fit. */
static bool appendf(char *buf, size_t cap, size_t *pos, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static bool appendf(char *buf, size_t cap, size_t *pos, const char *fmt, ...) {
    if (*pos >= cap) return false;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + *pos, cap - *pos, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= cap - *pos) return false;
    *pos += (size_t)n;
    return true;
}

static bool append(char *buf, size_t cap, size_t *pos, const char *s, size_t n) {
    if (n > cap - *pos) return false;
    memcpy(buf + *pos, s, n);
    *pos += n;
    return true;
}
#define append_lit(buf, cap, pos, lit) append((buf), (cap), (pos), "" lit, sizeof(lit) - 1)

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
    return appendf(buf, cap, pos, "%04lld-%02u-%02uT%02u:%02u:%02u.%03uZ", (long long)y, mo, d,
                   (unsigned)(rem / 3600), (unsigned)(rem / 60 % 60), (unsigned)(rem % 60), ms);
}

/* An errno's name: no strerror (its text may be translated, which can load message
 * catalogs and allocate). */
static const char *errname(int e) {
    static char other[24];
    switch (e) {
    case ECONNREFUSED: return "connection refused";
    case ECONNRESET: return "connection reset";
    case ECONNABORTED: return "connection aborted";
    case ETIMEDOUT: return "timed out";
    case EHOSTUNREACH: return "host unreachable";
    case ENETUNREACH: return "network unreachable";
    case ENETDOWN: return "network down";
    case EPIPE: return "broken pipe";
    case EADDRNOTAVAIL: return "address not available";
    case EAFNOSUPPORT: return "address family not supported";
    case EMFILE: return "too many open files";
    case ENFILE: return "too many open files in the system";
    case ENOBUFS: return "no buffer space";
    case ENOMEM: return "out of memory";
    case EACCES: return "permission denied";
    case EPERM: return "operation not permitted";
    case ENOTCONN: return "not connected";
    default: snprintf(other, sizeof other, "errno %d", e); return other;
    }
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

/* ------------------------------------------------------------ URLs */

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Copies s[0..n) percent-decoded into out; false when it does not fit. */
static bool pct_decode(const char *s, size_t n, char *out, size_t cap) {
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (c == '%' && i + 2 < n && hexval(s[i + 1]) >= 0 && hexval(s[i + 2]) >= 0) {
            c = (char)(hexval(s[i + 1]) * 16 + hexval(s[i + 2]));
            i += 2;
        }
        if (o + 1 >= cap) return false;
        out[o++] = c;
    }
    out[o] = '\0';
    return true;
}

/* One URL of GPUSLICE_NATS_URL, s[0..n), spaces trimmed. */
static bool parse_url(const char *text, size_t n, tl_url_t *u) {
    memset(u, 0, sizeof *u);
    const char *s = text;
    const char *end = s + n;
    const char *sep = NULL;
    for (const char *p = s; p + 2 < end; p++) {
        if (p[0] == ':' && p[1] == '/' && p[2] == '/') {
            sep = p;
            break;
        }
    }
    if (sep) {
        size_t sl = (size_t)(sep - s);
        if (sl == 4 && strncasecmp(s, "nats", 4) == 0) {
            /* plain */
        } else if ((sl == 3 && strncasecmp(s, "tls", 3) == 0) ||
                   (sl == 3 && strncasecmp(s, "wss", 3) == 0)) {
            if (!tl_tls_logged) {
                GS_LOG(GS_LOG_ERROR,
                       "telemetry: GPUSLICE_NATS_URL %.*s: TLS is not supported; "
                       "use a plain nats:// address",
                       (int)n, text);
                tl_tls_logged = true;
            }
            return false;
        } else {
            GS_LOG(GS_LOG_ERROR, "telemetry: GPUSLICE_NATS_URL %.*s: unsupported scheme",
                   (int)n, text);
            return false;
        }
        s = sep + 3;
    }
    /* authority ends at '/', '?' or '#' */
    const char *auth_end = s;
    while (auth_end < end && *auth_end != '/' && *auth_end != '?' && *auth_end != '#') auth_end++;
    const char *at = NULL;
    for (const char *p = s; p < auth_end; p++)
        if (*p == '@') at = p;
    if (at) {
        const char *colon = memchr(s, ':', (size_t)(at - s));
        u->userinfo = true;
        if (colon) {
            if (!pct_decode(s, (size_t)(colon - s), u->user, sizeof u->user) ||
                !pct_decode(colon + 1, (size_t)(at - colon - 1), u->pass, sizeof u->pass))
                goto bad;
        } else {
            if (!pct_decode(s, (size_t)(at - s), u->pass, sizeof u->pass)) goto bad;
            u->token = true;
        }
        s = at + 1;
    }
    const char *host = s, *host_end;
    const char *port = NULL;
    if (s < auth_end && *s == '[') {
        host = s + 1;
        host_end = memchr(host, ']', (size_t)(auth_end - host));
        if (!host_end) goto bad;
        if (host_end + 1 < auth_end) {
            if (host_end[1] != ':') goto bad;
            port = host_end + 2;
        }
    } else {
        host_end = memchr(s, ':', (size_t)(auth_end - s));
        if (host_end) port = host_end + 1;
        else host_end = auth_end;
    }
    size_t hl = (size_t)(host_end - host);
    if (hl == 0 || hl >= sizeof u->host) goto bad;
    memcpy(u->host, host, hl);
    u->host[hl] = '\0';
    if (port && port < auth_end) {
        size_t pl = (size_t)(auth_end - port);
        unsigned long v = 0;
        if (pl > 5) goto bad;
        for (size_t i = 0; i < pl; i++) {
            if (port[i] < '0' || port[i] > '9') goto bad;
            v = v * 10 + (unsigned long)(port[i] - '0');
        }
        if (v == 0 || v > 65535) goto bad;
        snprintf(u->port, sizeof u->port, "%lu", v);
    } else if (port) {
        goto bad; /* "host:" */
    } else {
        snprintf(u->port, sizeof u->port, "%d", TL_DEFAULT_PORT);
    }
    return true;
bad:
    GS_LOG(GS_LOG_ERROR, "telemetry: GPUSLICE_NATS_URL: cannot parse %.*s", (int)n, text);
    return false;
}

static void parse_urls(void) {
    tl_nurls = 0;
    const char *s = gs_cfg.nats_url;
    while (*s && tl_nurls < TL_MAX_URLS) {
        const char *comma = strchr(s, ',');
        const char *e = comma ? comma : s + strlen(s);
        const char *b = s;
        while (b < e && (*b == ' ' || *b == '\t')) b++;
        const char *t = e;
        while (t > b && (t[-1] == ' ' || t[-1] == '\t' || t[-1] == '\n' || t[-1] == '\r')) t--;
        if (t > b && parse_url(b, (size_t)(t - b), &tl_urls[tl_nurls])) tl_nurls++;
        if (!comma) break;
        s = comma + 1;
    }
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
        o->limit = __atomic_load_n(&d->limit, __ATOMIC_RELAXED);
        o->denied = __atomic_load_n(&d->denied, __ATOMIC_RELAXED);
        o->throttled_ns = __atomic_load_n(&d->throttled_ns, __ATOMIC_RELAXED);
        uint64_t tenths = 0;
        if (dwall > 0 && busy > prev) {
            uint64_t dbusy = busy - prev;
            tenths = dbusy >= dwall ? 1000 : dbusy * 1000 / dwall;
        }
        o->sm_tenths = (uint32_t)tl_min(tenths, 1000);
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
    if (!append(tl_json, cap, &p, tl_head, tl_head_len)) return 0;
    if (!append_time(tl_json, cap, &p, smp->real_s, smp->real_ms)) return 0;
    if (!append_lit(tl_json, cap, &p, "\",\"devices\":[")) return 0;
    for (uint32_t i = 0; i < smp->ndev; i++) {
        const tl_dev_t *d = &smp->dev[i];
        if (i && !append_lit(tl_json, cap, &p, ",")) return 0;
        if (!append_lit(tl_json, cap, &p, "{\"uuid\":\"")) return 0;
        if (!json_escape(tl_json, cap, &p, d->uuid)) return 0;
        if (!appendf(tl_json, cap, &p,
                     "\",\"used_bytes\":%llu,\"limit_bytes\":%llu,\"sm_percent\":%u.%u,"
                     "\"throttled_ns\":%llu,\"denied_allocations\":%llu}",
                     (unsigned long long)d->used, (unsigned long long)d->limit,
                     d->sm_tenths / 10, d->sm_tenths % 10, (unsigned long long)d->throttled_ns,
                     (unsigned long long)d->denied))
            return 0;
    }
    if (!appendf(tl_json, cap, &p, "],\"dropped_samples\":%llu}", (unsigned long long)tl_dropped))
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
    tl_subject_len = (size_t)n;

    size_t p = 0;
    const size_t cap = sizeof tl_head;
    bool ok = append_lit(tl_head, cap, &p, "{\"node\":\"") &&
              json_escape(tl_head, cap, &p, gs_cfg.node) &&
              append_lit(tl_head, cap, &p, "\",\"pod_uid\":\"") &&
              json_escape(tl_head, cap, &p, gs_cfg.pod_uid) &&
              append_lit(tl_head, cap, &p, "\",\"container\":\"") &&
              json_escape(tl_head, cap, &p, gs_cfg.container) &&
              appendf(tl_head, cap, &p, "\",\"pid\":%ld,\"time\":\"", (long)getpid());
    if (!ok) return false;
    tl_head_len = p;
    return true;
}

/* ------------------------------------------------------------ connection */

static const tl_url_t *cur_url(void) { return &tl_urls[tl_url_idx]; }

static void close_fd(void) {
    if (tl_fd >= 0) close(tl_fd);
    tl_fd = -1;
}

/* Drops the connection and whatever it had not sent; schedules the next try.
 * `established`: the link had been up (a new outage begins). */
static void conn_fail(uint64_t now, const char *why, bool established) {
    close_fd();
    if (tl_out_has_pub) tl_dropped++; /* a sample half sent is a sample lost */
    tl_out_off = tl_out_len = 0;
    tl_out_has_pub = false;
    tl_in_len = 0;
    tl_in_skip = false;
    tl_pings_out = 0;
    tl_conn = C_DOWN;
    const tl_url_t *u = cur_url();
    if (established) {
        GS_LOG(GS_LOG_WARN,
               "telemetry: lost the connection to NATS at %s:%s (%s); reconnecting, "
               "samples wait in a ring of %u",
               u->host, u->port, why, tl_ring_cap);
        tl_outage_logged = true;
        tl_backoff = TL_BACKOFF_MIN_NS;
        tl_addr_idx = 0;
        tl_naddrs = 0;
        tl_next_connect = now + tl_backoff;
        return;
    }
    if (!tl_outage_logged) {
        GS_LOG(GS_LOG_WARN,
               "telemetry: cannot reach NATS at %s:%s (%s); retrying, samples wait in a ring "
               "of %u and the oldest are dropped",
               u->host, u->port, why, tl_ring_cap);
        tl_outage_logged = true;
    } else {
        GS_LOG(GS_LOG_DEBUG, "telemetry: NATS at %s:%s: %s", u->host, u->port, why);
    }
    /* next address, next URL; after a full round, back off */
    if (++tl_addr_idx < tl_naddrs) {
        tl_next_connect = now;
        return;
    }
    tl_addr_idx = 0;
    tl_naddrs = 0;
    if (++tl_url_idx < tl_nurls) {
        tl_next_connect = now;
        return;
    }
    tl_url_idx = 0;
    tl_next_connect = now + tl_backoff;
    tl_backoff = tl_min(tl_backoff * 2, TL_BACKOFF_MAX_NS);
}

static bool resolve(void) {
    const tl_url_t *u = cur_url();
    tl_naddrs = 0;
    tl_addr_idx = 0;
    /* literal addresses need no resolver */
    struct sockaddr_in *in4 = (struct sockaddr_in *)&tl_addrs[0];
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)&tl_addrs[0];
    uint16_t port = (uint16_t)atoi(u->port);
    memset(&tl_addrs[0], 0, sizeof tl_addrs[0]);
    if (inet_pton(AF_INET, u->host, &in4->sin_addr) == 1) {
        in4->sin_family = AF_INET;
        in4->sin_port = htons(port);
        tl_addr_lens[0] = sizeof *in4;
        tl_naddrs = 1;
        return true;
    }
    if (inet_pton(AF_INET6, u->host, &in6->sin6_addr) == 1) {
        in6->sin6_family = AF_INET6;
        in6->sin6_port = htons(port);
        tl_addr_lens[0] = sizeof *in6;
        tl_naddrs = 1;
        return true;
    }
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    int rc = getaddrinfo(u->host, u->port, &hints, &res);
    if (rc != 0 || !res) return false;
    for (struct addrinfo *a = res; a && tl_naddrs < TL_MAX_ADDRS; a = a->ai_next) {
        if (a->ai_addrlen > sizeof tl_addrs[0]) continue;
        memcpy(&tl_addrs[tl_naddrs], a->ai_addr, a->ai_addrlen);
        tl_addr_lens[tl_naddrs] = (socklen_t)a->ai_addrlen;
        tl_naddrs++;
    }
    freeaddrinfo(res);
    return tl_naddrs > 0;
}

static void conn_start(uint64_t now) {
    if (tl_naddrs == 0 && !resolve()) {
        conn_fail(now, "cannot resolve the host", false);
        return;
    }
    int af = tl_addrs[tl_addr_idx].ss_family;
    tl_fd = socket(af, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (tl_fd < 0) {
        conn_fail(now, errname(errno), false);
        return;
    }
    int one = 1;
    (void)setsockopt(tl_fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    tl_max_payload = TL_DEFAULT_MAX_PAYLOAD;
    tl_in_len = 0;
    tl_in_skip = false;
    tl_out_off = tl_out_len = 0;
    tl_out_has_pub = false;
    if (connect(tl_fd, (struct sockaddr *)&tl_addrs[tl_addr_idx], tl_addr_lens[tl_addr_idx]) ==
        0) {
        tl_conn = C_WAIT_INFO;
        tl_deadline = now + TL_HANDSHAKE_TIMEOUT_NS;
    } else if (errno == EINPROGRESS || errno == EINTR) {
        tl_conn = C_CONNECTING;
        tl_deadline = now + TL_CONNECT_TIMEOUT_NS;
    } else {
        conn_fail(now, errname(errno), false);
    }
}

/* Queues a control line (PING, PONG, CONNECT) behind whatever is unsent. */
static bool queue(const char *s, size_t n) {
    if (tl_out_off > 0 && tl_out_off == tl_out_len) tl_out_off = tl_out_len = 0;
    if (n > sizeof tl_out - tl_out_len && tl_out_off > 0) {
        memmove(tl_out, tl_out + tl_out_off, tl_out_len - tl_out_off);
        tl_out_len -= tl_out_off;
        tl_pub_end = tl_pub_end > tl_out_off ? tl_pub_end - tl_out_off : 0;
        tl_out_off = 0;
    }
    if (n > sizeof tl_out - tl_out_len) return false;
    if (tl_out_len == tl_out_off) tl_out_since = gs_now_ns();
    memcpy(tl_out + tl_out_len, s, n);
    tl_out_len += n;
    return true;
}

/* Sends what it can without waiting; false when the link broke. */
static bool flush(uint64_t now, const char **why) {
    while (tl_out_off < tl_out_len) {
        ssize_t n = send(tl_fd, tl_out + tl_out_off, tl_out_len - tl_out_off,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            tl_out_off += (size_t)n;
            tl_out_since = now;
            if (tl_out_off >= tl_pub_end) tl_out_has_pub = false;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
        *why = n < 0 ? errname(errno) : "send failed";
        return false;
    }
    tl_out_off = tl_out_len = 0;
    tl_out_has_pub = false;
    return true;
}

/* Value of "key": in an INFO line: numbers and booleans only. */
static const char *info_value(const char *line, const char *key) {
    size_t kl = strlen(key);
    for (const char *p = strstr(line, key); p; p = strstr(p + 1, key)) {
        if (p == line || p[-1] != '"' || p[kl] != '"') continue;
        const char *v = p + kl + 1;
        while (*v == ' ') v++;
        if (*v != ':') continue;
        v++;
        while (*v == ' ') v++;
        return v;
    }
    return NULL;
}

static bool info_bool(const char *line, const char *key) {
    const char *v = info_value(line, key);
    return v && strncmp(v, "true", 4) == 0;
}

/* Parses INFO; false when the server cannot be used. */
static bool handle_info(const char *line, bool *auth_required) {
    const char *v = info_value(line, "max_payload");
    if (v && *v >= '0' && *v <= '9') {
        uint64_t mp = strtoull(v, NULL, 10);
        if (mp > 0) tl_max_payload = mp;
    }
    if (auth_required) *auth_required = info_bool(line, "auth_required");
    if (info_bool(line, "tls_required")) {
        if (!tl_tls_logged) {
            GS_LOG(GS_LOG_ERROR,
                   "telemetry: NATS at %s:%s requires TLS, which is not supported",
                   cur_url()->host, cur_url()->port);
            tl_tls_logged = true;
        }
        return false;
    }
    return true;
}

static bool send_connect(bool auth_required, const char **why) {
    static char buf[2048];
    const tl_url_t *u = cur_url();
    const char *user = NULL, *pass = NULL, *token = NULL;
    if (u->userinfo) {
        if (u->token) token = u->pass;
        else user = u->user, pass = u->pass;
    } else if (gs_cfg.nats_token[0]) {
        token = gs_cfg.nats_token;
    } else if (gs_cfg.nats_user[0]) {
        user = gs_cfg.nats_user;
        pass = gs_cfg.nats_pass;
    }
    if (auth_required && !user && !token && !tl_auth_logged) {
        GS_LOG(GS_LOG_WARN,
               "telemetry: NATS at %s:%s requires authentication but no credentials are set "
               "(GPUSLICE_NATS_USER/GPUSLICE_NATS_PASSWORD or GPUSLICE_NATS_TOKEN)",
               u->host, u->port);
        tl_auth_logged = true;
    }
    size_t p = 0;
    const size_t cap = sizeof buf;
    bool ok = appendf(buf, cap, &p,
                      "CONNECT {\"verbose\":false,\"pedantic\":false,\"tls_required\":false,"
                      "\"name\":\"gpuslice-interposer\",\"lang\":\"c\",\"version\":\"%s\","
                      "\"protocol\":1,\"headers\":false,\"no_responders\":false",
                      GS_VERSION);
    if (ok && user) {
        ok = append_lit(buf, cap, &p, ",\"user\":\"") && json_escape(buf, cap, &p, user) &&
             append_lit(buf, cap, &p, "\",\"pass\":\"") && json_escape(buf, cap, &p, pass) &&
             append_lit(buf, cap, &p, "\"");
    } else if (ok && token) {
        ok = append_lit(buf, cap, &p, ",\"auth_token\":\"") && json_escape(buf, cap, &p, token) &&
             append_lit(buf, cap, &p, "\"");
    }
    ok = ok && append_lit(buf, cap, &p, "}\r\nPING\r\n");
    if (!ok || !queue(buf, p)) {
        *why = "CONNECT too long";
        return false;
    }
    return true;
}

/* One line from the server (CRLF stripped); false when the link must be dropped. */
static bool handle_line(uint64_t now, char *line, const char **why) {
    static char reason[160];
    if (strncasecmp(line, "PING", 4) == 0) {
        if (!queue("PONG\r\n", 6)) {
            *why = "output full";
            return false;
        }
        return true;
    }
    if (strncasecmp(line, "PONG", 4) == 0) {
        if (tl_conn == C_WAIT_PONG) {
            const tl_url_t *u = cur_url();
            tl_conn = C_UP;
            tl_backoff = TL_BACKOFF_MIN_NS;
            tl_next_ping = now + TL_PING_EVERY_NS;
            tl_pings_out = 0;
            if (tl_outage_logged || tl_ever_up)
                GS_LOG(GS_LOG_INFO,
                       "telemetry: connected to NATS at %s:%s (%llu samples dropped so far)",
                       u->host, u->port, (unsigned long long)tl_dropped);
            else
                GS_LOG(GS_LOG_INFO, "telemetry: connected to NATS at %s:%s, publishing to %s",
                       u->host, u->port, tl_subject);
            tl_outage_logged = false;
            tl_ever_up = true;
        } else {
            tl_pings_out = 0;
        }
        return true;
    }
    if (strncasecmp(line, "INFO", 4) == 0) {
        bool auth = false;
        if (!handle_info(line + 4, &auth)) {
            *why = "TLS required";
            return false;
        }
        if (tl_conn == C_WAIT_INFO) {
            if (!send_connect(auth, why)) return false;
            tl_conn = C_WAIT_PONG;
            tl_deadline = now + TL_HANDSHAKE_TIMEOUT_NS;
        }
        return true;
    }
    if (strncasecmp(line, "-ERR", 4) == 0) {
        snprintf(reason, sizeof reason, "server: %s", line + (line[4] == ' ' ? 5 : 4));
        if (tl_conn != C_UP) {
            *why = reason;
            return false;
        }
        /* some errors (a permissions violation) leave the link up; after the others
         * the server closes it, which the next read sees */
        if (!tl_err_logged) {
            GS_LOG(GS_LOG_WARN, "telemetry: NATS at %s:%s: %s", cur_url()->host,
                   cur_url()->port, reason);
            tl_err_logged = true;
        }
        return true;
    }
    /* +OK, MSG (we subscribe to nothing): ignore */
    return true;
}

/* Reads what the server sent; false when the link must be dropped. */
static bool read_input(uint64_t now, const char **why) {
    for (;;) {
        if (tl_in_len == sizeof tl_in) {
            /* an over-long line (a huge INFO): use its head, skip the rest */
            tl_in[sizeof tl_in - 1] = '\0';
            if (!tl_in_skip && !handle_line(now, tl_in, why)) return false;
            tl_in_skip = true;
            tl_in_len = 0;
        }
        ssize_t n = recv(tl_fd, tl_in + tl_in_len, sizeof tl_in - tl_in_len, MSG_DONTWAIT);
        if (n == 0) {
            *why = "closed by the server";
            return false;
        }
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
            *why = errname(errno);
            return false;
        }
        size_t start = 0, end = tl_in_len + (size_t)n;
        for (size_t i = tl_in_len; i < end; i++) {
            if (tl_in[i] != '\n') continue;
            size_t le = i;
            if (le > start && tl_in[le - 1] == '\r') le--;
            tl_in[le] = '\0';
            if (tl_in_skip) tl_in_skip = false;
            else if (!handle_line(now, tl_in + start, why)) return false;
            start = i + 1;
        }
        memmove(tl_in, tl_in + start, end - start);
        tl_in_len = end - start;
    }
}

/* Moves samples from the ring onto the wire while the socket takes them. */
static bool drain(uint64_t now, const char **why) {
    if (!flush(now, why)) return false;
    while (tl_ring_count > 0 && tl_out_off == tl_out_len) {
        const tl_sample_t *smp = &tl_ring[tl_ring_head];
        size_t n = sample_json(smp);
        tl_ring_head = (tl_ring_head + 1) % tl_ring_cap;
        tl_ring_count--;
        if (n == 0 || n > tl_max_payload) {
            tl_dropped++;
            if (!tl_payload_logged) {
                GS_LOG(GS_LOG_WARN,
                       "telemetry: a sample of %zu bytes exceeds the server's max_payload "
                       "(%llu bytes); such samples are dropped",
                       n, (unsigned long long)tl_max_payload);
                tl_payload_logged = true;
            }
            continue;
        }
        char line[TL_SUBJECT_MAX + 32];
        int hl = snprintf(line, sizeof line, "PUB %s %zu\r\n", tl_subject, n);
        tl_out_off = tl_out_len = 0;
        size_t p = 0;
        if (hl < 0 || !append(tl_out, sizeof tl_out, &p, line, (size_t)hl) ||
            !append(tl_out, sizeof tl_out, &p, tl_json, n) ||
            !append(tl_out, sizeof tl_out, &p, "\r\n", 2)) {
            tl_dropped++;
            continue;
        }
        tl_out_len = p;
        tl_out_since = now;
        tl_out_has_pub = true;
        tl_pub_end = p;
        if (!flush(now, why)) return false;
    }
    return true;
}

/* ------------------------------------------------------------ the thread */

static void *telemetry_main(void *arg) {
    (void)arg;
    pthread_setname_np(pthread_self(), "gpuslice-telem");

    if (!build_constants()) {
        atomic_store(&tl_state, TL_DISABLED);
        return NULL;
    }
    parse_urls();
    if (tl_nurls == 0) {
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
    GS_LOG(GS_LOG_DEBUG, "telemetry: every %llu ms to %s, ring of %u samples",
           (unsigned long long)(tl_interval / TL_MS), tl_subject, tl_ring_cap);

    uint64_t now = gs_now_ns();
    uint64_t next_sample = now;
    tl_next_connect = now;
    for (;;) {
        now = gs_now_ns();
        if (now >= next_sample) {
            take_sample(now);
            next_sample += tl_interval;
            if (next_sample <= now) next_sample = now + tl_interval;
        }
        const char *why = NULL;
        switch (tl_conn) {
        case C_DOWN:
            if (now >= tl_next_connect) conn_start(now);
            break;
        case C_CONNECTING:
        case C_WAIT_INFO:
        case C_WAIT_PONG:
            if (now >= tl_deadline) conn_fail(now, "timed out", false);
            break;
        case C_UP:
            if (now >= tl_next_ping) {
                if (tl_pings_out >= TL_PINGS_OUT_MAX) {
                    conn_fail(now, "no answer to PING", true);
                    break;
                }
                tl_pings_out++;
                tl_next_ping = now + TL_PING_EVERY_NS;
                (void)queue("PING\r\n", 6);
            }
            if (tl_out_off < tl_out_len && now - tl_out_since >= TL_STALL_NS) {
                conn_fail(now, "the server takes no data", true);
                break;
            }
            if (!drain(now, &why)) conn_fail(now, why, true);
            break;
        }

        /* wait for the next sample, the server, room to send or a deadline */
        uint64_t wake = next_sample;
        struct pollfd pfd = {.fd = tl_fd, .events = 0, .revents = 0};
        switch (tl_conn) {
        case C_DOWN:
            wake = tl_min(wake, tl_next_connect);
            break;
        case C_CONNECTING:
            pfd.events = POLLOUT;
            wake = tl_min(wake, tl_deadline);
            break;
        case C_WAIT_INFO:
        case C_WAIT_PONG:
            pfd.events = POLLIN | (tl_out_off < tl_out_len ? POLLOUT : 0);
            wake = tl_min(wake, tl_deadline);
            break;
        case C_UP:
            pfd.events = POLLIN | (tl_out_off < tl_out_len ? POLLOUT : 0);
            wake = tl_min(wake, tl_next_ping);
            if (tl_out_off < tl_out_len) wake = tl_min(wake, tl_out_since + TL_STALL_NS);
            break;
        }
        now = gs_now_ns();
        uint64_t wait_ns = wake > now ? wake - now : 0;
        int timeout_ms = (int)tl_min((wait_ns + TL_MS - 1) / TL_MS, 60000);
        int rc = poll(&pfd, tl_fd >= 0 && pfd.events ? 1 : 0, timeout_ms);
        if (rc <= 0 || tl_fd < 0) continue;
        now = gs_now_ns();
        if (tl_conn == C_CONNECTING) {
            int err = 0;
            socklen_t len = sizeof err;
            if (getsockopt(tl_fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0) err = errno;
            if (err) {
                conn_fail(now, errname(err), false);
            } else {
                tl_conn = C_WAIT_INFO;
                tl_deadline = now + TL_HANDSHAKE_TIMEOUT_NS;
            }
            continue;
        }
        if (pfd.revents & (POLLIN | POLLHUP | POLLERR)) {
            if (!read_input(now, &why)) {
                conn_fail(now, why ? why : "read failed", tl_conn == C_UP);
                continue;
            }
        }
        if (tl_fd >= 0 && tl_out_off < tl_out_len && !flush(now, &why))
            conn_fail(now, why, tl_conn == C_UP);
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
               errname(rc));
        atomic_store(&tl_state, TL_DISABLED);
    }
}

void gs_telemetry_after_fork(void) {
    /* Only this thread exists in the child. The parent's connection is the
     * parent's: close our copy of the socket (the parent's stays open) and start
     * over with an empty ring, a fresh pid and no drops. */
    if (atomic_load(&tl_state) != TL_RUNNING) return;
    if (tl_fd >= 0) close(tl_fd);
    tl_fd = -1;
    tl_conn = C_DOWN;
    tl_ring_head = tl_ring_count = 0;
    tl_dropped = 0;
    tl_have_prev = false;
    tl_out_off = tl_out_len = 0;
    tl_out_has_pub = false;
    tl_in_len = 0;
    tl_in_skip = false;
    tl_pings_out = 0;
    tl_backoff = TL_BACKOFF_MIN_NS;
    tl_url_idx = tl_addr_idx = tl_naddrs = 0;
    tl_ever_up = tl_outage_logged = tl_payload_logged = tl_err_logged = false;
    atomic_store(&tl_state, TL_OFF);
}
