/* Text into fixed buffers, never past their end: bounded appends and JSON strings. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "gs.h"

bool gs_append(char *buf, size_t cap, size_t *pos, const char *s, size_t n) {
    if (n > cap - *pos) return false;
    memcpy(buf + *pos, s, n);
    *pos += n;
    return true;
}

bool gs_appendf(char *buf, size_t cap, size_t *pos, const char *fmt, ...) {
    if (*pos >= cap) return false;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + *pos, cap - *pos, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= cap - *pos) return false;
    *pos += (size_t)n;
    return true;
}

bool gs_json_escape(char *buf, size_t cap, size_t *pos, const char *s) {
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
