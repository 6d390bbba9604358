/*
 * A minimal NATS publisher over the plain text protocol (nats.c): the servers of
 * GPUSLICE_NATS_URL, with GPUSLICE_NATS_USER/_PASSWORD/_TOKEN or credentials in
 * the URL, and nothing but PUB.
 *
 * It never blocks: the socket is non-blocking and its owner waits in poll(). One
 * thread owns a link; nothing is locked. The owner's loop:
 *
 *     gs_nats_step(&nc, now);                   connects, times out, pings, sends
 *     while (have a message && gs_nats_ready(&nc))
 *         gs_nats_publish(&nc, subject, payload, n, now);
 *     wake = gs_nats_pollfd(&nc, &pfd);         then poll(&pfd, ...) until wake at most
 *     gs_nats_handle(&nc, pfd.revents, now);    after poll() reported the descriptor
 *
 * A broken link is dropped with whatever it had not sent and retried with backoff,
 * over every address of every URL in turn. Nothing is allocated, except by
 * getaddrinfo() when a server is given by name.
 */
#ifndef GS_NATS_H
#define GS_NATS_H

#include <poll.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#define GS_NATS_MAX_URLS 8
#define GS_NATS_MAX_ADDRS 4
#define GS_NATS_SUBJECT_MAX 512          /* a subject is shorter */
#define GS_NATS_PAYLOAD_MAX (24 * 1024)  /* the largest payload gs_nats_publish takes */
/* One PUB (line, payload, CRLF) plus room for a few control lines behind it. */
#define GS_NATS_OUT_MAX (GS_NATS_SUBJECT_MAX + GS_NATS_PAYLOAD_MAX + 64 + 256)
#define GS_NATS_IN_MAX (32 * 1024)

/* What happened to the link, for its owner's log lines. */
enum gs_nats_event {
    GS_NATS_UP,          /* handshake done: publishing */
    GS_NATS_LOST,        /* an established link broke */
    GS_NATS_UNREACHABLE, /* one attempt to connect failed */
};
/* host and port of the server concerned; `why` is NULL for GS_NATS_UP. */
typedef void (*gs_nats_event_fn)(enum gs_nats_event ev, const char *host, const char *port,
                                 const char *why);

typedef struct {
    char host[256];
    char port[8];
    char user[128];
    char pass[256];
    bool userinfo; /* the URL carried credentials (user:pass@ or token@) */
    bool token;    /* userinfo was a bare token */
} gs_nats_url_t;

enum gs_nats_state { GS_NATS_DOWN, GS_NATS_CONNECTING, GS_NATS_WAIT_INFO, GS_NATS_WAIT_PONG,
                     GS_NATS_CONNECTED };

/* The owner reads max_payload and lost; everything else is the link's. */
typedef struct {
    uint64_t max_payload; /* the server's (INFO; 1 MiB until it says) */
    uint64_t lost;        /* published messages a broken link cut off before they were sent */

    const char *who; /* begins its log lines */
    gs_nats_event_fn on_event;
    gs_nats_url_t urls[GS_NATS_MAX_URLS];
    int nurls;
    int fd;
    enum gs_nats_state state;
    uint64_t deadline;     /* of CONNECTING, WAIT_INFO and WAIT_PONG */
    uint64_t next_connect; /* when DOWN */
    uint64_t backoff;
    int url_idx, addr_idx, naddrs;
    struct sockaddr_storage addrs[GS_NATS_MAX_ADDRS];
    socklen_t addr_lens[GS_NATS_MAX_ADDRS];
    uint64_t next_ping;
    int pings_out;
    bool err_logged;
    char out[GS_NATS_OUT_MAX];
    size_t out_off, out_len;
    uint64_t out_since; /* when the oldest unsent byte was queued */
    bool out_has_pub;   /* the unsent bytes hold (part of) a message... */
    size_t pub_end;     /* ...which ends here */
    char in[GS_NATS_IN_MAX];
    size_t in_len;
    bool in_skip; /* discarding the rest of an over-long line */
} gs_nats_t;

/* A link never started: gs_nats_close leaves it alone. */
#define GS_NATS_INITIALIZER {.fd = -1}

/* Parses GPUSLICE_NATS_URL (a comma-separated list; each bad URL is logged and
 * skipped) and sets the link up, down, to connect at the next step. `who` begins
 * its log lines; `on_event` hears when it comes up, breaks or cannot connect.
 * Returns the number of usable URLs: with none, the link is of no use. */
int gs_nats_init(gs_nats_t *nc, const char *who, gs_nats_event_fn on_event);
/* Does what is due at `now`: connects, gives up on a slow handshake, pings, drops a
 * link that sends nothing back or takes no data, sends what is queued. */
void gs_nats_step(gs_nats_t *nc, uint64_t now);
/* Up, with nothing left unsent: gs_nats_publish may queue a message. */
static inline bool gs_nats_ready(const gs_nats_t *nc) {
    return nc->state == GS_NATS_CONNECTED && nc->out_off == nc->out_len;
}
/* Queues PUB `subject` (shorter than GS_NATS_SUBJECT_MAX) with `payload` (at most
 * GS_NATS_PAYLOAD_MAX bytes) and sends what it can; only when gs_nats_ready(). False,
 * with nothing queued, when the payload is over the server's max_payload. */
bool gs_nats_publish(gs_nats_t *nc, const char *subject, const char *payload, size_t n,
                     uint64_t now);
/* Fills `pfd` with what to wait for (fd -1 while down); returns when gs_nats_step
 * is due at the latest. */
uint64_t gs_nats_pollfd(const gs_nats_t *nc, struct pollfd *pfd);
/* After poll() reported the descriptor: completes a connect, reads and answers the
 * server, sends what is queued. */
void gs_nats_handle(gs_nats_t *nc, short revents, uint64_t now);
/* Closes the socket without a word to the server (in a fork child: the parent's
 * connection stays up) and leaves the link down; gs_nats_init starts it afresh. */
void gs_nats_close(gs_nats_t *nc);

#endif
