/* Device UUIDs in the fakes' environment knobs (FAKECUDA_UUIDS, FAKENVML_UUIDS):
 * a comma list of "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", hex in either
 * case. Shared by the fake driver and the fake NVML so both read them alike. */
#ifndef FAKE_UUID_H
#define FAKE_UUID_H

#include <stdbool.h>
#include <stddef.h>
#include <string.h>

#define FAKE_UUID_SHAPE "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"

static inline int fake_hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* The `len` bytes at s as a UUID into its 16 bytes; false, out untouched, when
 * malformed. */
static inline bool fake_uuid_parse(const char *s, size_t len, unsigned char out[16]) {
    static const char shape[] = FAKE_UUID_SHAPE;
    unsigned char bytes[16] = {0};
    if (len != sizeof shape - 1) return false;
    unsigned n = 0; /* hex digits so far */
    for (size_t i = 0; i < len; i++) {
        if (shape[i] != 'x') {
            if (s[i] != shape[i]) return false;
            continue;
        }
        int v = fake_hex_digit(s[i]);
        if (v < 0) return false;
        bytes[n / 2] = (unsigned char)(bytes[n / 2] | (n % 2 ? v : v << 4));
        n++;
    }
    memcpy(out, bytes, sizeof bytes);
    return true;
}

/* Entry i of the list s (blanks around it ignored), for i < max, into out[i]
 * with set[i] true when it parses; empty, malformed and missing entries leave
 * out[i] and set[i] alone. */
static inline void fake_uuid_list(const char *s, unsigned max, unsigned char (*out)[16],
                                  bool *set) {
    for (unsigned i = 0; s && *s && i < max; i++) {
        const char *comma = strchr(s, ',');
        const char *end = comma ? comma : s + strlen(s);
        while (s < end && (*s == ' ' || *s == '\t')) s++;
        while (end > s && (end[-1] == ' ' || end[-1] == '\t')) end--;
        if (fake_uuid_parse(s, (size_t)(end - s), out[i])) set[i] = true;
        s = comma ? comma + 1 : NULL;
    }
}

#endif
