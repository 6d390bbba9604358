/* Log lines go straight to stderr with write(2): no stdio buffers, no locks shared
 * with the application; errno names come from a table of our own, not strerror. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#include "gs.h"

uint64_t gs_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

void gs_log(int level, const char *fmt, ...) {
    static const char *const names[] = {"error", "warning", "info", "debug", "trace"};
    char line[1024];
    int n = snprintf(line, sizeof line, "gpuslice[%d] %s: ", (int)getpid(),
                     names[level < 0 ? 0 : level > 4 ? 4 : level]);
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof line - 2) len = sizeof line - 2;
    line[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, len);
    (void)w;
}

const char *gs_errname(int e) {
    static __thread char other[24];
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
