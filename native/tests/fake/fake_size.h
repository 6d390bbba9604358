/* Sizes in the fakes' environment knobs: "4096", "512k", "80g", "1T", "80GiB".
 * Shared by the fake driver and the fake NVML so both read them alike. */
#ifndef FAKE_SIZE_H
#define FAKE_SIZE_H

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

/* With `rest`, parsing stops after the size and *rest points past it; without,
 * anything after the size makes it malformed. False when malformed. */
static inline bool parse_size(const char *s, const char **rest, uint64_t *out) {
    if (!s || *s < '0' || *s > '9') return false;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno) return false;
    unsigned shift = 0;
    switch (*end) {
    case 'k': case 'K': shift = 10; end++; break;
    case 'm': case 'M': shift = 20; end++; break;
    case 'g': case 'G': shift = 30; end++; break;
    case 't': case 'T': shift = 40; end++; break;
    default: break;
    }
    if (shift && (*end == 'i' || *end == 'I')) end++;
    if (*end == 'b' || *end == 'B') end++;
    if (shift && v > (UINT64_MAX >> shift)) return false;
    if (rest)
        *rest = end;
    else if (*end)
        return false;
    *out = (uint64_t)v << shift;
    return true;
}

#endif
