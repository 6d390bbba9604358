/*
 * Settings, read once per process.
 *
 * In a container the limits are the node agent's: the grant file it mounts
 * read-only at GS_GRANT_DIR/grant (format below), the same for every process of
 * the container whatever its environment. The environment gives them only where
 * no grant directory exists (tests, bare metal); GPUSLICE_GRANT_DIR may then name
 * one (the local stack, which runs containers as plain processes).
 *
 * Fail closed: a grant or limit variable that cannot be read or parsed, or that
 * names an impossible value, sets gs_cfg.fail_closed and every allocation is
 * refused; it is never taken as "no limit". Settings that bound nothing (log
 * level, telemetry) are logged and defaulted instead.
 *
 * Grant file: text, one setting a line, fields separated by one space, '#'
 * starts a comment line; every key once except `device`, all required:
 *   gpuslice-grant 1                   first line: format and version
 *   node <name>
 *   pod <uid>
 *   container <name>
 *   policy default|force|disable
 *   priority 0|1
 *   control required|optional          optional: CUDA_DISABLE_CONTROL is honoured
 *   context-overhead <bytes>
 *   device <uuid> <memory bytes> <sm percent 0..100>   1 to GS_MAX_DEVICES lines
 */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gs.h"

gs_config_t gs_cfg = {.log_level = GS_LOG_WARN, .grant_dir_fd = -1};

#define GRANT_MAX_BYTES 65536

void gs_fail_closed(const char *fmt, ...) {
    if (gs_cfg.fail_closed) return; /* the first reason is the one reported */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(gs_cfg.fail_reason, sizeof gs_cfg.fail_reason, fmt, ap);
    va_end(ap);
    gs_cfg.fail_closed = true;
    gs_log(GS_LOG_ERROR, "%s: every GPU allocation of this process is refused", gs_cfg.fail_reason);
}

/* ------------------------------------------------------------ numbers */
/* Decimal digits only, at most `max`. */
static bool parse_uint(const char *text, uint64_t max, uint64_t *out) {
    if (!text || !isdigit((unsigned char)*text)) return false;
    uint64_t v = 0;
    for (const char *p = text; *p; p++) {
        if (!isdigit((unsigned char)*p)) return false;
        if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, (uint64_t)(*p - '0'), &v))
            return false;
    }
    if (v > max) return false;
    *out = v;
    return true;
}

/* "10g", "512m", "4096", "1.5g", "2GiB": a whole number of bytes of at least 1.
 * No signs, exponents, spaces inside or after, nothing that overflows or rounds
 * to zero. */
static bool parse_size(const char *text, uint64_t *out) {
    const char *p = text;
    while (*p == ' ' || *p == '\t') p++;
    if (!isdigit((unsigned char)*p)) return false;
    uint64_t whole = 0, frac = 0, frac_scale = 1;
    for (; isdigit((unsigned char)*p); p++)
        if (__builtin_mul_overflow(whole, 10, &whole) ||
            __builtin_add_overflow(whole, (uint64_t)(*p - '0'), &whole))
            return false;
    if (*p == '.') {
        p++;
        if (!isdigit((unsigned char)*p)) return false;
        for (; isdigit((unsigned char)*p); p++)
            if (frac_scale < 1000000000ULL) { /* digits past the ninth are dropped */
                frac = frac * 10 + (uint64_t)(*p - '0');
                frac_scale *= 10;
            }
    }
    uint64_t scale = 1;
    switch (tolower((unsigned char)*p)) {
    case 'k': scale = 1ULL << 10; p++; break;
    case 'm': scale = 1ULL << 20; p++; break;
    case 'g': scale = 1ULL << 30; p++; break;
    case 't': scale = 1ULL << 40; p++; break;
    default: break;
    }
    if (scale > 1 && (*p == 'i' || *p == 'I')) p++;
    if (*p == 'b' || *p == 'B') p++;
    if (*p) return false;
    uint64_t bytes;
    if (__builtin_mul_overflow(whole, scale, &bytes)) return false;
    /* frac < frac_scale <= 1e9 and scale <= 2^40: the product fits */
    unsigned __int128 part = (unsigned __int128)frac * scale / frac_scale;
    if (__builtin_add_overflow(bytes, (uint64_t)part, &bytes)) return false;
    if (bytes == 0 || bytes == GS_NO_LIMIT) return false;
    *out = bytes;
    return true;
}

/* "250ms", "1s", "2.5s", "100us"; a bare number is seconds. */
static bool parse_duration(const char *text, uint64_t *out) {
    errno = 0;
    char *end;
    double v = strtod(text, &end);
    if (errno || end == text || !(v >= 0)) return false;
    double scale = 1e9;
    if (!strcasecmp(end, "ms")) scale = 1e6;
    else if (!strcasecmp(end, "us")) scale = 1e3;
    else if (!strcasecmp(end, "ns")) scale = 1;
    else if (!strcasecmp(end, "s") || !*end) scale = 1e9;
    else if (!strcasecmp(end, "m")) scale = 60e9;
    else return false;
    if (!(v * scale < 1.8e19)) return false; /* beyond uint64_t, or NaN */
    *out = (uint64_t)(v * scale);
    return true;
}

static bool parse_policy(const char *text, enum gs_policy *out) {
    if (!strcasecmp(text, "default")) *out = GS_POLICY_DEFAULT;
    else if (!strcasecmp(text, "force")) *out = GS_POLICY_FORCE;
    else if (!strcasecmp(text, "disable")) *out = GS_POLICY_DISABLE;
    else return false;
    return true;
}

static bool valid_uuid(const char *s, size_t len) {
    if (len == 0 || len >= GS_UUID_LEN) return false;
    for (size_t i = 0; i < len; i++)
        if (!isalnum((unsigned char)s[i]) && s[i] != '-' && s[i] != '/') return false;
    return true;
}

/* ------------------------------------------------------------ the environment */
static bool env_bool(const char *name, bool *out) {
    const char *v = getenv(name);
    if (!v) return true;
    if (!strcasecmp(v, "true") || !strcmp(v, "1") || !strcasecmp(v, "yes")) *out = true;
    else if (!strcasecmp(v, "false") || !strcmp(v, "0") || !strcasecmp(v, "no") || !*v) *out = false;
    else return false;
    return true;
}

static void copy_env(const char *name, char *dst, size_t size) {
    const char *v = getenv(name);
    if (!v) return;
    size_t len = strlen(v);
    if (len >= size) {
        gs_log(GS_LOG_ERROR, "%s is longer than %zu characters; ignored", name, size - 1);
        return;
    }
    memcpy(dst, v, len + 1);
}

/* A limit variable: unset leaves *out; set, it must parse. */
static void env_size(const char *name, uint64_t *out) {
    const char *v = getenv(name);
    if (!v) return;
    if (!parse_size(v, out))
        gs_fail_closed("%s=%.64s is not a memory size (a whole number of bytes of at least 1, "
                       "or with k, m, g, t)",
                       name, v);
}

static void env_percent(const char *name, uint32_t *out) {
    const char *v = getenv(name);
    if (!v) return;
    uint64_t n;
    if (parse_uint(v, 100, &n)) *out = (uint32_t)n;
    else gs_fail_closed("%s=%.64s is not a percentage from 0 to 100", name, v);
}

/* Limits, policy and priority from the environment (no grant). */
static void load_env_limits(gs_config_t *c) {
    const char *v;
    uint64_t n;
    if (!env_bool("CUDA_DISABLE_CONTROL", &c->disabled))
        gs_fail_closed("CUDA_DISABLE_CONTROL=%.64s is not true or false", getenv("CUDA_DISABLE_CONTROL"));
    uint64_t all_mem = GS_NO_LIMIT;
    uint32_t all_sm = 0;
    env_size("CUDA_DEVICE_MEMORY_LIMIT", &all_mem);
    env_percent("CUDA_DEVICE_SM_LIMIT", &all_sm);
    for (int i = 0; i < GS_MAX_DEVICES; i++) {
        char name[64];
        c->mem_limit[i] = all_mem;
        c->sm_limit[i] = all_sm;
        snprintf(name, sizeof name, "CUDA_DEVICE_MEMORY_LIMIT_%d", i);
        env_size(name, &c->mem_limit[i]);
        snprintf(name, sizeof name, "CUDA_DEVICE_SM_LIMIT_%d", i);
        env_percent(name, &c->sm_limit[i]);
    }
    if ((v = getenv("GPU_CORE_UTILIZATION_POLICY")) && *v && !parse_policy(v, &c->policy))
        gs_fail_closed("GPU_CORE_UTILIZATION_POLICY=%.64s is not default, force or disable", v);
    if ((v = getenv("CUDA_TASK_PRIORITY")) && *v) {
        if (parse_uint(v, 1000, &n)) c->priority = (uint32_t)n;
        else gs_fail_closed("CUDA_TASK_PRIORITY=%.64s is not 0 (high) or 1 (low)", v);
    }
    if ((v = getenv("GPUSLICE_CONTEXT_OVERHEAD")) && *v) {
        if (parse_uint(v, GS_NO_LIMIT - 1, &n)) c->context_overhead = n; /* "0" allowed */
        else env_size("GPUSLICE_CONTEXT_OVERHEAD", &c->context_overhead);
    }
    copy_env("CUDA_DEVICE_MEMORY_SHARED_CACHE", c->region_path, sizeof c->region_path);
    if ((v = getenv("NVIDIA_VISIBLE_DEVICES")) && (!strncmp(v, "GPU-", 4) || !strncmp(v, "MIG-", 4))) {
        for (const char *p = v; *p && c->visible_count < GS_MAX_DEVICES;) {
            size_t len = strcspn(p, ",");
            if (valid_uuid(p, len)) {
                memcpy(c->visible_uuid[c->visible_count], p, len);
                c->visible_uuid[c->visible_count][len] = 0;
                c->visible_count++;
            }
            p += len;
            if (*p == ',') p++;
        }
    }
}

/* ------------------------------------------------------------ the grant */
static bool grant_line(gs_config_t *c, char *line, unsigned *seen, const char **why) {
    char *f[5];
    int n = 0;
    for (char *p = line; n < 5;) {
        f[n++] = p;
        char *sp = strchr(p, ' ');
        if (!sp) break;
        *sp = 0;
        p = sp + 1;
    }
    for (int i = 0; i < n; i++)
        if (!*f[i]) return (*why = "an empty field (two spaces, or a space at the end)"), false;
    static const char *const keys[] = {"node", "pod", "container", "policy", "priority", "control",
                                       "context-overhead", "device"};
    int key = -1;
    for (int k = 0; k < (int)(sizeof keys / sizeof keys[0]); k++)
        if (!strcmp(f[0], keys[k])) key = k;
    if (key < 0) return (*why = "an unknown key"), false;
    if (key != 7 && (*seen & (1u << key))) return (*why = "a key given twice"), false;
    *seen |= 1u << key;
    uint64_t v;
    if (key == 7) {
        if (n != 4) return (*why = "device needs a UUID, memory bytes and an SM percentage"), false;
        if (c->visible_count >= GS_MAX_DEVICES) return (*why = "more devices than the library supports"), false;
        size_t len = strlen(f[1]);
        if (!valid_uuid(f[1], len)) return (*why = "a device UUID that is not one"), false;
        for (int d = 0; d < c->visible_count; d++)
            if (!strcmp(c->visible_uuid[d], f[1])) return (*why = "a device given twice"), false;
        int d = c->visible_count;
        if (!parse_uint(f[2], GS_NO_LIMIT - 1, &c->mem_limit[d])) return (*why = "device memory that is not a number of bytes"), false;
        if (!parse_uint(f[3], 100, &v)) return (*why = "an SM percentage that is not 0 to 100"), false;
        c->sm_limit[d] = (uint32_t)v;
        memcpy(c->visible_uuid[d], f[1], len + 1);
        c->visible_count++;
        return true;
    }
    if (n != 2) return (*why = "a key with other than one value"), false;
    switch (key) {
    case 0:
        if (strlen(f[1]) >= sizeof c->node) return (*why = "a node name too long"), false;
        strcpy(c->node, f[1]);
        return true;
    case 1:
        if (strlen(f[1]) >= sizeof c->pod_uid) return (*why = "a pod UID too long"), false;
        strcpy(c->pod_uid, f[1]);
        return true;
    case 2:
        if (strlen(f[1]) >= sizeof c->container) return (*why = "a container name too long"), false;
        strcpy(c->container, f[1]);
        return true;
    case 3:
        return parse_policy(f[1], &c->policy) || (*why = "a policy not default, force or disable", false);
    case 4:
        if (!parse_uint(f[1], 1, &v)) return (*why = "a priority not 0 or 1"), false;
        c->priority = (uint32_t)v;
        return true;
    case 5:
        if (!strcmp(f[1], "required")) return true;
        if (!strcmp(f[1], "optional")) {
            bool off = false;
            if (env_bool("CUDA_DISABLE_CONTROL", &off)) c->disabled = off;
            return true;
        }
        return (*why = "control not required or optional"), false;
    default:
        if (!parse_uint(f[1], GS_NO_LIMIT - 1, &c->context_overhead)) return (*why = "a context overhead that is not a number of bytes"), false;
        return true;
    }
}

static void parse_grant(gs_config_t *c, char *text, const char *where) {
    unsigned seen = 0;
    int lineno = 0;
    bool header = false;
    for (char *line = text; line && *line;) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = 0;
        lineno++;
        const char *why = NULL;
        if (line[0] == '#') {
        } else if (!header) {
            if (strcmp(line, "gpuslice-grant 1") != 0) why = "it does not start with \"gpuslice-grant 1\"";
            header = true;
        } else if (!grant_line(c, line, &seen, &why)) {
        }
        if (why) {
            gs_fail_closed("grant %s, line %d: %s", where, lineno, why);
            return;
        }
        line = nl ? nl + 1 : NULL;
    }
    if (!header || seen != 0xff || c->visible_count == 0)
        gs_fail_closed("grant %s is incomplete: it needs node, pod, container, policy, priority, "
                       "control, context-overhead and at least one device",
                       where);
}

/* The grant directory's descriptor: the fixed one, else GPUSLICE_GRANT_DIR where
 * the fixed one does not exist; -1 when there is no grant (errno ENOENT) or it
 * cannot be opened safely (fail_closed set). */
static int open_grant_dir(char *where, size_t size) {
    snprintf(where, size, "%s", GS_GRANT_DIR);
    int fd = gs_open_dir_nofollow(GS_GRANT_DIR);
    if (fd < 0 && errno == ENOENT) {
        const char *other = getenv("GPUSLICE_GRANT_DIR");
        if (!other) return -1;
        snprintf(where, size, "%s", other);
        fd = gs_open_dir_nofollow(other);
    }
    if (fd < 0) {
        gs_fail_closed("grant directory %s cannot be opened safely: %s", where, gs_errname(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISDIR(st.st_mode) || (st.st_mode & 022) ||
        (st.st_uid != 0 && st.st_uid != geteuid())) {
        gs_fail_closed("grant directory %s is writable by others or owned by another user", where);
        close(fd);
        return -1;
    }
    return fd;
}

static void load_grant(gs_config_t *c, int dfd, const char *dir) {
    char where[600];
    snprintf(where, sizeof where, "%s/%s", dir, GS_GRANT_FILE);
    struct stat dst, st;
    int fd = openat(dfd, GS_GRANT_FILE, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        gs_fail_closed("grant %s cannot be opened: %s", where, gs_errname(errno));
        return;
    }
    char *text = NULL;
    if (fstat(dfd, &dst) != 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        gs_fail_closed("grant %s is not a regular file", where);
    } else if ((st.st_mode & 0222) || st.st_uid != dst.st_uid) {
        gs_fail_closed("grant %s is writable (mode %03o) or not owned by its directory's owner",
                       where, (unsigned)(st.st_mode & 0777));
    } else if (st.st_size <= 0 || st.st_size > GRANT_MAX_BYTES) {
        gs_fail_closed("grant %s is %lld bytes; a grant is 1 to %d", where, (long long)st.st_size,
                       GRANT_MAX_BYTES);
    } else if (!(text = malloc((size_t)st.st_size + 1))) {
        gs_fail_closed("no memory to read grant %s", where);
    } else {
        ssize_t n = pread(fd, text, (size_t)st.st_size, 0);
        if (n != st.st_size) {
            gs_fail_closed("grant %s could not be read whole", where);
        } else {
            text[n] = 0;
            if (strlen(text) != (size_t)n) gs_fail_closed("grant %s holds a NUL byte", where);
            else parse_grant(c, text, where);
        }
    }
    free(text);
    close(fd);
}

/* ------------------------------------------------------------ loading */
static void load_common(gs_config_t *c) {
    const char *v;
    uint64_t n;
    if ((v = getenv("LIBCUDA_LOG_LEVEL")) && *v) {
        if (parse_uint(v, 4, &n)) c->log_level = (int)n;
        else gs_log(GS_LOG_ERROR, "LIBCUDA_LOG_LEVEL=%.64s is not a level from 0 to 4; ignored", v);
    }
    bool killer = false;
    if (env_bool("ACTIVE_OOM_KILLER", &killer)) c->oom_killer = killer;
    else gs_log(GS_LOG_ERROR, "ACTIVE_OOM_KILLER=%.64s is not true or false; ignored", getenv("ACTIVE_OOM_KILLER"));
    copy_env("GPUSLICE_LIBCUDA", c->libcuda_path, sizeof c->libcuda_path);
    copy_env("GPUSLICE_LIBNVML", c->libnvml_path, sizeof c->libnvml_path);
    copy_env("GPUSLICE_NATS_URL", c->nats_url, sizeof c->nats_url);
    copy_env("GPUSLICE_NATS_USER", c->nats_user, sizeof c->nats_user);
    copy_env("GPUSLICE_NATS_PASSWORD", c->nats_pass, sizeof c->nats_pass);
    copy_env("GPUSLICE_NATS_TOKEN", c->nats_token, sizeof c->nats_token);
    strcpy(c->subject_prefix, "gpuslice");
    copy_env("GPUSLICE_SUBJECT_PREFIX", c->subject_prefix, sizeof c->subject_prefix);
    c->telemetry_interval_ns = 1000000000ULL;
    if ((v = getenv("GPUSLICE_TELEMETRY_INTERVAL")) && *v) {
        if (!parse_duration(v, &n) || n < 10000000ULL)
            gs_log(GS_LOG_ERROR, "GPUSLICE_TELEMETRY_INTERVAL=%.64s is not a duration of at least 10ms; using 1s", v);
        else c->telemetry_interval_ns = n;
    }
    c->telemetry_ring = 64;
    if ((v = getenv("GPUSLICE_TELEMETRY_RING")) && *v) {
        if (parse_uint(v, 4096, &n) && n > 0) c->telemetry_ring = (uint32_t)n;
        else gs_log(GS_LOG_ERROR, "GPUSLICE_TELEMETRY_RING=%.64s is not a count from 1 to 4096; using 64", v);
    }
}

static void load_limits(gs_config_t *c);

void gs_config_load(void) {
    load_limits(&gs_cfg);
    for (int d = 0; d < GS_MAX_DEVICES; d++)
        if (gs_cfg.sm_limit[d] >= 100) gs_cfg.sm_limit[d] = 0; /* a whole device is no limit */
}

static void load_limits(gs_config_t *c) {
    load_common(c);
    c->context_overhead = 384ULL << 20;
    char dir[512];
    int dfd = open_grant_dir(dir, sizeof dir);
    if (dfd >= 0) {
        c->granted = true;
        c->grant_dir_fd = dfd; /* kept: the region is opened beneath it */
        for (int i = 0; i < GS_MAX_DEVICES; i++) c->mem_limit[i] = 0;
        load_grant(c, dfd, dir);
        /* Under a grant no setting of the process changes anything: the driver
         * and NVML are loaded by their standard names only, so a library the
         * tenant names cannot stand in for the driver the limits are read from. */
        if (c->libcuda_path[0] || c->libnvml_path[0])
            GS_LOG(GS_LOG_INFO, "GPUSLICE_LIBCUDA and GPUSLICE_LIBNVML ignored: the grant loads "
                   "libcuda.so.1 and libnvidia-ml.so.1 by their standard names");
        c->libcuda_path[0] = 0;
        c->libnvml_path[0] = 0;
        if (!c->disabled && getenv("CUDA_DISABLE_CONTROL") && !strcasecmp(getenv("CUDA_DISABLE_CONTROL"), "true"))
            gs_log(GS_LOG_WARN, "CUDA_DISABLE_CONTROL ignored: the grant requires control");
        return;
    }
    if (c->fail_closed) return;
    copy_env("GPUSLICE_NODE_NAME", c->node, sizeof c->node);
    copy_env("GPUSLICE_POD_UID", c->pod_uid, sizeof c->pod_uid);
    copy_env("GPUSLICE_CONTAINER_NAME", c->container, sizeof c->container);
    load_env_limits(c);
}
