/*
 * The NATS publisher (see nats.h): a handful of states, one non-blocking socket,
 * one output buffer holding at most one message and the control lines behind it.
 *
 * DOWN -> CONNECTING (TCP) -> WAIT_INFO (the server's INFO) -> WAIT_PONG (our
 * CONNECT and PING sent) -> CONNECTED. Any failure drops the connection and
 * whatever it had not sent, and tries the next address, then the next URL; after
 * a full round it backs off (250 ms doubling to 5 s). An established link that
 * breaks tries its URL again, resolved afresh, after 250 ms. Once up, the link
 * PINGs every 15 s and drops a server that leaves two PINGs unanswered or takes
 * none of the queued bytes for 2 s; it answers the server's PINGs.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gs.h"
#include "nats.h"

#ifndef GS_VERSION
#define GS_VERSION "0.1.0"
#endif

#define NATS_MS 1000000ull
#define NATS_CONNECT_TIMEOUT_NS (500 * NATS_MS)   /* TCP connect */
#define NATS_HANDSHAKE_TIMEOUT_NS (2000 * NATS_MS) /* INFO, then CONNECT+PING -> PONG */
#define NATS_BACKOFF_MIN_NS (250 * NATS_MS)
#define NATS_BACKOFF_MAX_NS (5000 * NATS_MS)
#define NATS_STALL_NS (2000 * NATS_MS) /* unsent bytes this long: the server is too slow */
#define NATS_PING_EVERY_NS (15000 * NATS_MS)
#define NATS_PINGS_OUT_MAX 2 /* unanswered PINGs before the link counts as dead */
#define NATS_DEFAULT_PORT 4222
#define NATS_DEFAULT_MAX_PAYLOAD (1024 * 1024)

/* Warnings about what cannot work (TLS, missing credentials): once per process
 * image, which a fork child inherits. */
static bool tls_logged, auth_logged;

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

/* One URL of GPUSLICE_NATS_URL, text[0..n), spaces trimmed. */
static bool parse_url(const gs_nats_t *nc, const char *text, size_t n, gs_nats_url_t *u) {
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
            if (!tls_logged) {
                GS_LOG(GS_LOG_ERROR,
                       "%s: GPUSLICE_NATS_URL %.*s: TLS is not supported; "
                       "use a plain nats:// address",
                       nc->who, (int)n, text);
                tls_logged = true;
            }
            return false;
        } else {
            GS_LOG(GS_LOG_ERROR, "%s: GPUSLICE_NATS_URL %.*s: unsupported scheme", nc->who,
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
        snprintf(u->port, sizeof u->port, "%d", NATS_DEFAULT_PORT);
    }
    return true;
bad:
    GS_LOG(GS_LOG_ERROR, "%s: GPUSLICE_NATS_URL: cannot parse %.*s", nc->who, (int)n, text);
    return false;
}

static void parse_urls(gs_nats_t *nc) {
    nc->nurls = 0;
    const char *s = gs_cfg.nats_url;
    while (*s && nc->nurls < GS_NATS_MAX_URLS) {
        const char *comma = strchr(s, ',');
        const char *e = comma ? comma : s + strlen(s);
        const char *b = s;
        while (b < e && (*b == ' ' || *b == '\t')) b++;
        const char *t = e;
        while (t > b && (t[-1] == ' ' || t[-1] == '\t' || t[-1] == '\n' || t[-1] == '\r')) t--;
        if (t > b && parse_url(nc, b, (size_t)(t - b), &nc->urls[nc->nurls])) nc->nurls++;
        if (!comma) break;
        s = comma + 1;
    }
}

/* ------------------------------------------------------------ connection */

static const gs_nats_url_t *cur_url(const gs_nats_t *nc) { return &nc->urls[nc->url_idx]; }

/* Drops the connection and whatever it had not sent; schedules the next try.
 * `established`: the link had been up (a new outage begins). */
static void conn_fail(gs_nats_t *nc, uint64_t now, const char *why, bool established) {
    gs_nats_close(nc);
    if (nc->out_has_pub) nc->lost++;
    nc->out_off = nc->out_len = 0;
    nc->out_has_pub = false;
    nc->in_len = 0;
    nc->in_skip = false;
    nc->pings_out = 0;
    const gs_nats_url_t *u = cur_url(nc);
    nc->on_event(established ? GS_NATS_LOST : GS_NATS_UNREACHABLE, u->host, u->port, why);
    if (established) {
        nc->backoff = NATS_BACKOFF_MIN_NS;
        nc->addr_idx = 0;
        nc->naddrs = 0;
        nc->next_connect = now + nc->backoff;
        return;
    }
    /* next address, next URL; after a full round, back off */
    if (++nc->addr_idx < nc->naddrs) {
        nc->next_connect = now;
        return;
    }
    nc->addr_idx = 0;
    nc->naddrs = 0;
    if (++nc->url_idx < nc->nurls) {
        nc->next_connect = now;
        return;
    }
    nc->url_idx = 0;
    nc->next_connect = now + nc->backoff;
    nc->backoff = gs_min_u64(nc->backoff * 2, NATS_BACKOFF_MAX_NS);
}

static bool resolve(gs_nats_t *nc) {
    const gs_nats_url_t *u = cur_url(nc);
    nc->naddrs = 0;
    nc->addr_idx = 0;
    /* literal addresses need no resolver */
    struct sockaddr_in *in4 = (struct sockaddr_in *)&nc->addrs[0];
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)&nc->addrs[0];
    uint16_t port = (uint16_t)atoi(u->port);
    memset(&nc->addrs[0], 0, sizeof nc->addrs[0]);
    if (inet_pton(AF_INET, u->host, &in4->sin_addr) == 1) {
        in4->sin_family = AF_INET;
        in4->sin_port = htons(port);
        nc->addr_lens[0] = sizeof *in4;
        nc->naddrs = 1;
        return true;
    }
    if (inet_pton(AF_INET6, u->host, &in6->sin6_addr) == 1) {
        in6->sin6_family = AF_INET6;
        in6->sin6_port = htons(port);
        nc->addr_lens[0] = sizeof *in6;
        nc->naddrs = 1;
        return true;
    }
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    int rc = getaddrinfo(u->host, u->port, &hints, &res);
    if (rc != 0 || !res) return false;
    for (struct addrinfo *a = res; a && nc->naddrs < GS_NATS_MAX_ADDRS; a = a->ai_next) {
        if (a->ai_addrlen > sizeof nc->addrs[0]) continue;
        memcpy(&nc->addrs[nc->naddrs], a->ai_addr, a->ai_addrlen);
        nc->addr_lens[nc->naddrs] = (socklen_t)a->ai_addrlen;
        nc->naddrs++;
    }
    freeaddrinfo(res);
    return nc->naddrs > 0;
}

static void conn_start(gs_nats_t *nc, uint64_t now) {
    if (nc->naddrs == 0 && !resolve(nc)) {
        conn_fail(nc, now, "cannot resolve the host", false);
        return;
    }
    int af = nc->addrs[nc->addr_idx].ss_family;
    nc->fd = socket(af, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (nc->fd < 0) {
        conn_fail(nc, now, gs_errname(errno), false);
        return;
    }
    int one = 1;
    (void)setsockopt(nc->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    nc->max_payload = NATS_DEFAULT_MAX_PAYLOAD;
    nc->in_len = 0;
    nc->in_skip = false;
    nc->out_off = nc->out_len = 0;
    nc->out_has_pub = false;
    if (connect(nc->fd, (struct sockaddr *)&nc->addrs[nc->addr_idx],
                nc->addr_lens[nc->addr_idx]) == 0) {
        nc->state = GS_NATS_WAIT_INFO;
        nc->deadline = now + NATS_HANDSHAKE_TIMEOUT_NS;
    } else if (errno == EINPROGRESS || errno == EINTR) {
        nc->state = GS_NATS_CONNECTING;
        nc->deadline = now + NATS_CONNECT_TIMEOUT_NS;
    } else {
        conn_fail(nc, now, gs_errname(errno), false);
    }
}

/* Queues a control line (PING, PONG, CONNECT) behind whatever is unsent. */
static bool queue(gs_nats_t *nc, const char *s, size_t n) {
    if (nc->out_off > 0 && nc->out_off == nc->out_len) nc->out_off = nc->out_len = 0;
    if (n > sizeof nc->out - nc->out_len && nc->out_off > 0) {
        memmove(nc->out, nc->out + nc->out_off, nc->out_len - nc->out_off);
        nc->out_len -= nc->out_off;
        nc->pub_end = nc->pub_end > nc->out_off ? nc->pub_end - nc->out_off : 0;
        nc->out_off = 0;
    }
    if (n > sizeof nc->out - nc->out_len) return false;
    if (nc->out_len == nc->out_off) nc->out_since = gs_now_ns();
    memcpy(nc->out + nc->out_len, s, n);
    nc->out_len += n;
    return true;
}

/* Sends what it can without waiting; false when the link broke. */
static bool flush(gs_nats_t *nc, uint64_t now, const char **why) {
    while (nc->out_off < nc->out_len) {
        ssize_t n = send(nc->fd, nc->out + nc->out_off, nc->out_len - nc->out_off,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            nc->out_off += (size_t)n;
            nc->out_since = now;
            if (nc->out_off >= nc->pub_end) nc->out_has_pub = false;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
        *why = n < 0 ? gs_errname(errno) : "send failed";
        return false;
    }
    nc->out_off = nc->out_len = 0;
    nc->out_has_pub = false;
    return true;
}

/* ------------------------------------------------------------ the server's lines */

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
static bool handle_info(gs_nats_t *nc, const char *line, bool *auth_required) {
    const char *v = info_value(line, "max_payload");
    if (v && *v >= '0' && *v <= '9') {
        uint64_t mp = strtoull(v, NULL, 10);
        if (mp > 0) nc->max_payload = mp;
    }
    *auth_required = info_bool(line, "auth_required");
    if (info_bool(line, "tls_required")) {
        if (!tls_logged) {
            GS_LOG(GS_LOG_ERROR, "%s: NATS at %s:%s requires TLS, which is not supported",
                   nc->who, cur_url(nc)->host, cur_url(nc)->port);
            tls_logged = true;
        }
        return false;
    }
    return true;
}

static bool send_connect(gs_nats_t *nc, bool auth_required, const char **why) {
    static char buf[2048];
    const gs_nats_url_t *u = cur_url(nc);
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
    if (auth_required && !user && !token && !auth_logged) {
        GS_LOG(GS_LOG_WARN,
               "%s: NATS at %s:%s requires authentication but no credentials are set "
               "(GPUSLICE_NATS_USER/GPUSLICE_NATS_PASSWORD or GPUSLICE_NATS_TOKEN)",
               nc->who, u->host, u->port);
        auth_logged = true;
    }
    size_t p = 0;
    const size_t cap = sizeof buf;
    bool ok = gs_appendf(buf, cap, &p,
                         "CONNECT {\"verbose\":false,\"pedantic\":false,\"tls_required\":false,"
                         "\"name\":\"gpuslice-interposer\",\"lang\":\"c\",\"version\":\"%s\","
                         "\"protocol\":1,\"headers\":false,\"no_responders\":false",
                         GS_VERSION);
    if (ok && user) {
        ok = GS_APPEND_LIT(buf, cap, &p, ",\"user\":\"") && gs_json_escape(buf, cap, &p, user) &&
             GS_APPEND_LIT(buf, cap, &p, "\",\"pass\":\"") && gs_json_escape(buf, cap, &p, pass) &&
             GS_APPEND_LIT(buf, cap, &p, "\"");
    } else if (ok && token) {
        ok = GS_APPEND_LIT(buf, cap, &p, ",\"auth_token\":\"") &&
             gs_json_escape(buf, cap, &p, token) && GS_APPEND_LIT(buf, cap, &p, "\"");
    }
    ok = ok && GS_APPEND_LIT(buf, cap, &p, "}\r\nPING\r\n");
    if (!ok || !queue(nc, buf, p)) {
        *why = "CONNECT too long";
        return false;
    }
    return true;
}

/* One line from the server (CRLF stripped); false when the link must be dropped. */
static bool handle_line(gs_nats_t *nc, uint64_t now, char *line, const char **why) {
    static char reason[160];
    if (strncasecmp(line, "PING", 4) == 0) {
        if (!queue(nc, "PONG\r\n", 6)) {
            *why = "output full";
            return false;
        }
        return true;
    }
    if (strncasecmp(line, "PONG", 4) == 0) {
        if (nc->state == GS_NATS_WAIT_PONG) {
            const gs_nats_url_t *u = cur_url(nc);
            nc->state = GS_NATS_CONNECTED;
            nc->backoff = NATS_BACKOFF_MIN_NS;
            nc->next_ping = now + NATS_PING_EVERY_NS;
            nc->pings_out = 0;
            nc->on_event(GS_NATS_UP, u->host, u->port, NULL);
        } else {
            nc->pings_out = 0;
        }
        return true;
    }
    if (strncasecmp(line, "INFO", 4) == 0) {
        bool auth = false;
        if (!handle_info(nc, line + 4, &auth)) {
            *why = "TLS required";
            return false;
        }
        if (nc->state == GS_NATS_WAIT_INFO) {
            if (!send_connect(nc, auth, why)) return false;
            nc->state = GS_NATS_WAIT_PONG;
            nc->deadline = now + NATS_HANDSHAKE_TIMEOUT_NS;
        }
        return true;
    }
    if (strncasecmp(line, "-ERR", 4) == 0) {
        snprintf(reason, sizeof reason, "server: %s", line + (line[4] == ' ' ? 5 : 4));
        if (nc->state != GS_NATS_CONNECTED) {
            *why = reason;
            return false;
        }
        /* some errors (a permissions violation) leave the link up; after the others
         * the server closes it, which the next read sees */
        if (!nc->err_logged) {
            GS_LOG(GS_LOG_WARN, "%s: NATS at %s:%s: %s", nc->who, cur_url(nc)->host,
                   cur_url(nc)->port, reason);
            nc->err_logged = true;
        }
        return true;
    }
    /* +OK, MSG (we subscribe to nothing): ignore */
    return true;
}

/* Reads what the server sent; false when the link must be dropped. */
static bool read_input(gs_nats_t *nc, uint64_t now, const char **why) {
    for (;;) {
        if (nc->in_len == sizeof nc->in) {
            /* an over-long line (a huge INFO): use its head, skip the rest */
            nc->in[sizeof nc->in - 1] = '\0';
            if (!nc->in_skip && !handle_line(nc, now, nc->in, why)) return false;
            nc->in_skip = true;
            nc->in_len = 0;
        }
        ssize_t n = recv(nc->fd, nc->in + nc->in_len, sizeof nc->in - nc->in_len, MSG_DONTWAIT);
        if (n == 0) {
            *why = "closed by the server";
            return false;
        }
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
            *why = gs_errname(errno);
            return false;
        }
        size_t start = 0, end = nc->in_len + (size_t)n;
        for (size_t i = nc->in_len; i < end; i++) {
            if (nc->in[i] != '\n') continue;
            size_t le = i;
            if (le > start && nc->in[le - 1] == '\r') le--;
            nc->in[le] = '\0';
            if (nc->in_skip) nc->in_skip = false;
            else if (!handle_line(nc, now, nc->in + start, why)) return false;
            start = i + 1;
        }
        memmove(nc->in, nc->in + start, end - start);
        nc->in_len = end - start;
    }
}

/* ------------------------------------------------------------ interface */

int gs_nats_init(gs_nats_t *nc, const char *who, gs_nats_event_fn on_event) {
    memset(nc, 0, sizeof *nc);
    nc->fd = -1;
    nc->state = GS_NATS_DOWN;
    nc->backoff = NATS_BACKOFF_MIN_NS;
    nc->who = who;
    nc->on_event = on_event;
    parse_urls(nc);
    return nc->nurls;
}

void gs_nats_step(gs_nats_t *nc, uint64_t now) {
    const char *why = NULL;
    switch (nc->state) {
    case GS_NATS_DOWN:
        if (now >= nc->next_connect) conn_start(nc, now);
        break;
    case GS_NATS_CONNECTING:
    case GS_NATS_WAIT_INFO:
    case GS_NATS_WAIT_PONG:
        if (now >= nc->deadline) conn_fail(nc, now, "timed out", false);
        break;
    case GS_NATS_CONNECTED:
        if (now >= nc->next_ping) {
            if (nc->pings_out >= NATS_PINGS_OUT_MAX) {
                conn_fail(nc, now, "no answer to PING", true);
                break;
            }
            nc->pings_out++;
            nc->next_ping = now + NATS_PING_EVERY_NS;
            (void)queue(nc, "PING\r\n", 6);
        }
        /* out_since may be later than `now` (queue() stamps it afresh): no stall then. */
        if (nc->out_off < nc->out_len && now > nc->out_since &&
            now - nc->out_since >= NATS_STALL_NS) {
            conn_fail(nc, now, "the server takes no data", true);
            break;
        }
        if (!flush(nc, now, &why)) conn_fail(nc, now, why, true);
        break;
    }
}

bool gs_nats_publish(gs_nats_t *nc, const char *subject, const char *payload, size_t n,
                     uint64_t now) {
    if (n > nc->max_payload) return false;
    size_t p = 0;
    nc->out_off = nc->out_len = 0;
    if (!gs_appendf(nc->out, sizeof nc->out, &p, "PUB %s %zu\r\n", subject, n) ||
        !gs_append(nc->out, sizeof nc->out, &p, payload, n) ||
        !GS_APPEND_LIT(nc->out, sizeof nc->out, &p, "\r\n"))
        return false;
    nc->out_len = p;
    nc->out_since = now;
    nc->out_has_pub = true;
    nc->pub_end = p;
    const char *why = NULL;
    if (!flush(nc, now, &why)) conn_fail(nc, now, why, true);
    return true;
}

uint64_t gs_nats_pollfd(const gs_nats_t *nc, struct pollfd *pfd) {
    bool unsent = nc->out_off < nc->out_len;
    *pfd = (struct pollfd){.fd = nc->fd, .events = 0, .revents = 0};
    switch (nc->state) {
    case GS_NATS_DOWN:
        break;
    case GS_NATS_CONNECTING:
        pfd->events = POLLOUT;
        return nc->deadline;
    case GS_NATS_WAIT_INFO:
    case GS_NATS_WAIT_PONG:
        pfd->events = POLLIN | (unsent ? POLLOUT : 0);
        return nc->deadline;
    case GS_NATS_CONNECTED:
        pfd->events = POLLIN | (unsent ? POLLOUT : 0);
        return unsent ? gs_min_u64(nc->next_ping, nc->out_since + NATS_STALL_NS) : nc->next_ping;
    }
    return nc->next_connect;
}

void gs_nats_handle(gs_nats_t *nc, short revents, uint64_t now) {
    const char *why = NULL;
    if (nc->state == GS_NATS_CONNECTING) {
        int err = 0;
        socklen_t len = sizeof err;
        if (getsockopt(nc->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0) err = errno;
        if (err) {
            conn_fail(nc, now, gs_errname(err), false);
        } else {
            nc->state = GS_NATS_WAIT_INFO;
            nc->deadline = now + NATS_HANDSHAKE_TIMEOUT_NS;
        }
        return;
    }
    if (revents & (POLLIN | POLLHUP | POLLERR)) {
        if (!read_input(nc, now, &why)) {
            conn_fail(nc, now, why ? why : "read failed", nc->state == GS_NATS_CONNECTED);
            return;
        }
    }
    if (nc->fd >= 0 && nc->out_off < nc->out_len && !flush(nc, now, &why))
        conn_fail(nc, now, why, nc->state == GS_NATS_CONNECTED);
}

void gs_nats_close(gs_nats_t *nc) {
    int fd = nc->fd;
    nc->fd = -1; /* first: a fork child must never close a number reused meanwhile */
    if (fd >= 0) close(fd);
    nc->state = GS_NATS_DOWN;
}
