/* Settings from the environment, read once. A malformed value is reported with
 * the variable's name and ignored; the library never aborts the application. */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "gs.h"

gs_config_t gs_cfg = {.log_level = GS_LOG_WARN};

/* "10g", "512m", "4096", "1.5g": bytes. False when not a size. */
static bool gs_parse_size(const char *text, uint64_t *out) {
    const char *p = text;
    while (isspace((unsigned char)*p)) p++;
    if (!isdigit((unsigned char)*p)) return false;
    errno = 0;
    char *end;
    double value = strtod(p, &end);
    if (errno || end == p || value < 0) return false;
    double scale = 1;
    switch (tolower((unsigned char)*end)) {
    case 'k': scale = 1024.0; end++; break;
    case 'm': scale = 1024.0 * 1024; end++; break;
    case 'g': scale = 1024.0 * 1024 * 1024; end++; break;
    case 't': scale = 1024.0 * 1024 * 1024 * 1024; end++; break;
    default: break;
    }
    if (scale > 1 && (*end == 'i' || *end == 'I')) end++;
    if (scale > 1 && (*end == 'b' || *end == 'B')) end++;
    while (isspace((unsigned char)*end)) end++;
    if (*end) return false;
    double bytes = value * scale;
    if (bytes >= 18446744073709551615.0) return false;
    *out = (uint64_t)bytes;
    return true;
}

static bool parse_uint(const char *text, uint64_t max, uint64_t *out) {
    const char *p = text;
    while (isspace((unsigned char)*p)) p++;
    if (!isdigit((unsigned char)*p)) return false;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(p, &end, 10);
    while (isspace((unsigned char)*end)) end++;
    if (errno || *end || v > max) return false;
    *out = v;
    return true;
}

/* "250ms", "1s", "2.5s", "100us"; a bare number is seconds. */
static bool parse_duration(const char *text, uint64_t *out) {
    errno = 0;
    char *end;
    double v = strtod(text, &end);
    if (errno || end == text || v < 0) return false;
    double scale = 1e9;
    if (!strcasecmp(end, "ms")) scale = 1e6;
    else if (!strcasecmp(end, "us")) scale = 1e3;
    else if (!strcasecmp(end, "ns")) scale = 1;
    else if (!strcasecmp(end, "s") || !*end) scale = 1e9;
    else if (!strcasecmp(end, "m")) scale = 60e9;
    else return false;
    if (v * scale >= 1.8e19) return false; /* beyond uint64_t */
    *out = (uint64_t)(v * scale);
    return true;
}

static bool parse_bool(const char *name, const char *text, bool *out) {
    if (!strcasecmp(text, "true") || !strcmp(text, "1") || !strcasecmp(text, "yes")) {
        *out = true;
        return true;
    }
    if (!strcasecmp(text, "false") || !strcmp(text, "0") || !strcasecmp(text, "no") || !*text) {
        *out = false;
        return true;
    }
    gs_log(GS_LOG_ERROR, "%s=%s is not true or false; ignored", name, text);
    return false;
}

static bool copy_env(const char *name, char *dst, size_t size) {
    const char *v = getenv(name);
    if (!v) return true;
    if (strlen(v) >= size) {
        gs_log(GS_LOG_ERROR, "%s is longer than %zu characters; ignored", name, size - 1);
        return false;
    }
    memcpy(dst, v, strlen(v) + 1);
    return true;
}

static bool load_size(const char *name, uint64_t *out) {
    const char *v = getenv(name);
    if (!v || !*v) return true;
    if (gs_parse_size(v, out)) return true;
    gs_log(GS_LOG_ERROR, "%s=%s is not a size (a number of bytes, or with k, m, g); ignored",
           name, v);
    return false;
}

static bool load_percent(const char *name, uint32_t *out) {
    const char *v = getenv(name);
    if (!v || !*v) return true;
    uint64_t n;
    if (parse_uint(v, 100, &n)) {
        *out = (uint32_t)n;
        return true;
    }
    gs_log(GS_LOG_ERROR, "%s=%s is not a percentage from 0 to 100; ignored", name, v);
    return false;
}

bool gs_config_load(void) {
    gs_config_t *c = &gs_cfg;
    bool ok = true;
    const char *v;
    uint64_t n;

    if ((v = getenv("LIBCUDA_LOG_LEVEL")) && *v) {
        if (parse_uint(v, 4, &n)) c->log_level = (int)n;
        else {
            gs_log(GS_LOG_ERROR, "LIBCUDA_LOG_LEVEL=%s is not a level from 0 to 4; ignored", v);
            ok = false;
        }
    }
    if ((v = getenv("CUDA_DISABLE_CONTROL"))) ok &= parse_bool("CUDA_DISABLE_CONTROL", v, &c->disabled);
    if ((v = getenv("ACTIVE_OOM_KILLER"))) ok &= parse_bool("ACTIVE_OOM_KILLER", v, &c->oom_killer);

    uint64_t all_mem = 0;
    uint32_t all_sm = 0;
    ok &= load_size("CUDA_DEVICE_MEMORY_LIMIT", &all_mem);
    ok &= load_percent("CUDA_DEVICE_SM_LIMIT", &all_sm);
    for (int i = 0; i < GS_MAX_DEVICES; i++) {
        char name[64];
        c->mem_limit[i] = all_mem;
        c->sm_limit[i] = all_sm;
        snprintf(name, sizeof name, "CUDA_DEVICE_MEMORY_LIMIT_%d", i);
        ok &= load_size(name, &c->mem_limit[i]);
        snprintf(name, sizeof name, "CUDA_DEVICE_SM_LIMIT_%d", i);
        ok &= load_percent(name, &c->sm_limit[i]);
        if (c->sm_limit[i] >= 100) c->sm_limit[i] = 0; /* a whole device is no limit */
    }

    if ((v = getenv("GPU_CORE_UTILIZATION_POLICY")) && *v) {
        if (!strcasecmp(v, "default")) c->policy = GS_POLICY_DEFAULT;
        else if (!strcasecmp(v, "force")) c->policy = GS_POLICY_FORCE;
        else if (!strcasecmp(v, "disable")) c->policy = GS_POLICY_DISABLE;
        else {
            gs_log(GS_LOG_ERROR,
                   "GPU_CORE_UTILIZATION_POLICY=%s is not default, force or disable; using default", v);
            ok = false;
        }
    }
    if ((v = getenv("CUDA_TASK_PRIORITY")) && *v) {
        if (parse_uint(v, 1000, &n)) c->priority = (uint32_t)n;
        else {
            gs_log(GS_LOG_ERROR, "CUDA_TASK_PRIORITY=%s is not 0 (high) or 1 (low); ignored", v);
            ok = false;
        }
    }
    c->context_overhead = 384ULL << 20;
    ok &= load_size("GPUSLICE_CONTEXT_OVERHEAD", &c->context_overhead);

    ok &= copy_env("CUDA_DEVICE_MEMORY_SHARED_CACHE", c->region_path, sizeof c->region_path);
    c->visible_count = 0;
    if ((v = getenv("NVIDIA_VISIBLE_DEVICES")) && (!strncmp(v, "GPU-", 4) || !strncmp(v, "MIG-", 4))) {
        const char *p = v;
        while (*p && c->visible_count < GS_MAX_DEVICES) {
            size_t len = strcspn(p, ",");
            if (len > 0 && len < GS_UUID_LEN) {
                memcpy(c->visible_uuid[c->visible_count], p, len);
                c->visible_uuid[c->visible_count][len] = 0;
                c->visible_count++;
            }
            p += len;
            if (*p == ',') p++;
        }
    }
    ok &= copy_env("GPUSLICE_LIBCUDA", c->libcuda_path, sizeof c->libcuda_path);
    ok &= copy_env("GPUSLICE_LIBNVML", c->libnvml_path, sizeof c->libnvml_path);

    ok &= copy_env("GPUSLICE_NATS_URL", c->nats_url, sizeof c->nats_url);
    ok &= copy_env("GPUSLICE_NATS_USER", c->nats_user, sizeof c->nats_user);
    ok &= copy_env("GPUSLICE_NATS_PASSWORD", c->nats_pass, sizeof c->nats_pass);
    ok &= copy_env("GPUSLICE_NATS_TOKEN", c->nats_token, sizeof c->nats_token);
    strcpy(c->subject_prefix, "gpuslice");
    ok &= copy_env("GPUSLICE_SUBJECT_PREFIX", c->subject_prefix, sizeof c->subject_prefix);
    ok &= copy_env("GPUSLICE_NODE_NAME", c->node, sizeof c->node);
    ok &= copy_env("GPUSLICE_POD_UID", c->pod_uid, sizeof c->pod_uid);
    ok &= copy_env("GPUSLICE_CONTAINER_NAME", c->container, sizeof c->container);
    c->telemetry_interval_ns = 1000000000ULL;
    if ((v = getenv("GPUSLICE_TELEMETRY_INTERVAL")) && *v) {
        if (!parse_duration(v, &n) || n < 10000000ULL) {
            gs_log(GS_LOG_ERROR,
                   "GPUSLICE_TELEMETRY_INTERVAL=%s is not a duration of at least 10ms; using 1s", v);
            ok = false;
        } else {
            c->telemetry_interval_ns = n;
        }
    }
    c->telemetry_ring = 64;
    if ((v = getenv("GPUSLICE_TELEMETRY_RING")) && *v) {
        if (parse_uint(v, 4096, &n) && n > 0) c->telemetry_ring = (uint32_t)n;
        else {
            gs_log(GS_LOG_ERROR, "GPUSLICE_TELEMETRY_RING=%s is not a count from 1 to 4096; using 64", v);
            ok = false;
        }
    }
    return ok;
}
