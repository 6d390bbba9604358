/* What this process allocated through the hooks: key -> (device, bytes, context),
 * so a free gives back exactly what its allocation reserved. Sharded by key hash,
 * one mutex per shard; entries come from a free list, refilled in blocks. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gs.h"

#define SHARDS 64
#define BUCKETS 1024 /* per shard */

typedef struct entry {
    struct entry *next;
    uint64_t key;
    uint64_t bytes;
    CUcontext ctx;
    int dev;
    int kind;
    int maps;      /* GS_K_VMM: mappings alive */
    int retains;   /* GS_K_VMM: cuMemRetainAllocationHandle references not yet released */
    bool released; /* GS_K_VMM: cuMemRelease was called */
    bool imported; /* GS_K_VMM: from cuMemImportFromShareableHandle, charged as mapped */
} entry_t;

typedef struct {
    pthread_mutex_t mu;
    entry_t *buckets[BUCKETS];
    entry_t *free;
} shard_t;

static shard_t shards[SHARDS];
static pthread_once_t shards_once = PTHREAD_ONCE_INIT;

static void shards_init(void) {
    for (int i = 0; i < SHARDS; i++) pthread_mutex_init(&shards[i].mu, NULL);
}

static inline uint64_t mix(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

static inline shard_t *shard_of(uint64_t h) { return &shards[h % SHARDS]; }
static inline size_t bucket_of(uint64_t h) { return (size_t)((h / SHARDS) % BUCKETS); }

static entry_t **find_locked(shard_t *s, uint64_t h, enum gs_kind kind, uint64_t key) {
    for (entry_t **pp = &s->buckets[bucket_of(h)]; *pp; pp = &(*pp)->next)
        if ((*pp)->key == key && (*pp)->kind == (int)kind) return pp;
    return NULL;
}

static entry_t *new_entry(shard_t *s) {
    if (!s->free) {
        entry_t *block = calloc(64, sizeof(entry_t));
        if (!block) return NULL;
        for (int i = 0; i < 64; i++) {
            block[i].next = s->free;
            s->free = &block[i];
        }
    }
    entry_t *e = s->free;
    s->free = e->next;
    return e;
}

void gs_track_add(enum gs_kind kind, uint64_t key, int dev, uint64_t bytes, CUcontext ctx) {
    pthread_once(&shards_once, shards_init);
    uint64_t h = mix(key ^ ((uint64_t)kind << 58));
    shard_t *s = shard_of(h);
    pthread_mutex_lock(&s->mu);
    entry_t *e = new_entry(s);
    if (e) {
        *e = (entry_t){.next = s->buckets[bucket_of(h)], .key = key, .bytes = bytes, .ctx = ctx,
                       .dev = dev, .kind = (int)kind};
        s->buckets[bucket_of(h)] = e;
    }
    pthread_mutex_unlock(&s->mu);
    if (!e) {
        /* Without an entry the free could not give the bytes back: give them now. */
        gs_unreserve(dev, bytes);
        gs_log(GS_LOG_ERROR, "out of host memory tracking an allocation; it is not counted");
    }
}

bool gs_track_take(enum gs_kind kind, uint64_t key, int *dev, uint64_t *bytes) {
    pthread_once(&shards_once, shards_init);
    uint64_t h = mix(key ^ ((uint64_t)kind << 58));
    shard_t *s = shard_of(h);
    pthread_mutex_lock(&s->mu);
    entry_t **pp = find_locked(s, h, kind, key);
    if (pp) {
        entry_t *e = *pp;
        *dev = e->dev;
        *bytes = e->bytes;
        *pp = e->next;
        e->next = s->free;
        s->free = e;
    }
    pthread_mutex_unlock(&s->mu);
    return pp != NULL;
}

bool gs_track_vmm(uint64_t handle, enum gs_vmm_op op, int *dev, uint64_t *bytes) {
    pthread_once(&shards_once, shards_init);
    uint64_t h = mix(handle ^ ((uint64_t)GS_K_VMM << 58));
    shard_t *s = shard_of(h);
    bool gone = false;
    pthread_mutex_lock(&s->mu);
    entry_t **pp = find_locked(s, h, GS_K_VMM, handle);
    if (pp) {
        entry_t *e = *pp;
        if (op == GS_VMM_MAP) e->maps++;
        else if (op == GS_VMM_UNMAP && e->maps > 0) e->maps--;
        else if (op == GS_VMM_RETAIN) e->retains++;
        else if (op == GS_VMM_RELEASE && e->retains > 0) e->retains--;
        else if (op == GS_VMM_RELEASE) e->released = true;
        if (e->released && e->retains == 0 && e->maps == 0) {
            *dev = e->dev;
            *bytes = e->bytes;
            *pp = e->next;
            e->next = s->free;
            s->free = e;
            gone = true;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return gone;
}

void gs_track_vmm_import(uint64_t handle, int dev, CUcontext ctx) {
    gs_track_add(GS_K_VMM, handle, dev, 0, ctx);
    uint64_t h = mix(handle ^ ((uint64_t)GS_K_VMM << 58));
    shard_t *s = shard_of(h);
    pthread_mutex_lock(&s->mu);
    entry_t **pp = find_locked(s, h, GS_K_VMM, handle);
    if (pp) (*pp)->imported = true;
    pthread_mutex_unlock(&s->mu);
}

uint64_t gs_track_vmm_shortfall(uint64_t handle, uint64_t size, int *dev) {
    pthread_once(&shards_once, shards_init);
    uint64_t h = mix(handle ^ ((uint64_t)GS_K_VMM << 58));
    shard_t *s = shard_of(h);
    uint64_t need = 0;
    pthread_mutex_lock(&s->mu);
    entry_t **pp = find_locked(s, h, GS_K_VMM, handle);
    if (pp && (*pp)->imported && size > (*pp)->bytes) {
        need = size - (*pp)->bytes;
        *dev = (*pp)->dev;
    }
    pthread_mutex_unlock(&s->mu);
    return need;
}

bool gs_track_vmm_grow(uint64_t handle, uint64_t size) {
    pthread_once(&shards_once, shards_init);
    uint64_t h = mix(handle ^ ((uint64_t)GS_K_VMM << 58));
    shard_t *s = shard_of(h);
    bool grown = false;
    pthread_mutex_lock(&s->mu);
    entry_t **pp = find_locked(s, h, GS_K_VMM, handle);
    if (pp && (*pp)->imported && size > (*pp)->bytes) {
        (*pp)->bytes = size;
        grown = true;
    }
    pthread_mutex_unlock(&s->mu);
    return grown;
}

uint64_t gs_track_drop_ctx(CUcontext ctx) {
    pthread_once(&shards_once, shards_init);
    uint64_t total = 0;
    for (int i = 0; i < SHARDS; i++) {
        shard_t *s = &shards[i];
        pthread_mutex_lock(&s->mu);
        for (size_t b = 0; b < BUCKETS; b++) {
            entry_t **pp = &s->buckets[b];
            while (*pp) {
                entry_t *e = *pp;
                if (e->ctx == ctx && e->kind != GS_K_CTX) {
                    gs_unreserve(e->dev, e->bytes);
                    total += e->bytes;
                    *pp = e->next;
                    e->next = s->free;
                    s->free = e;
                } else {
                    pp = &e->next;
                }
            }
        }
        pthread_mutex_unlock(&s->mu);
    }
    return total + gs_graphs_drop_ctx(ctx); /* graph memory made in it */
}

/* ------------------------------------------------------------ VMM mappings
 * Few and long-lived (each maps a large handle): a sorted array, one mutex. */
typedef struct {
    uint64_t ptr, size, handle;
} mapping_t;

static pthread_mutex_t maps_mu = PTHREAD_MUTEX_INITIALIZER;
static mapping_t *maps;
static size_t maps_len, maps_cap;

/* First mapping starting at or after `ptr`. */
static size_t maps_lower_bound(uint64_t ptr) {
    size_t lo = 0, hi = maps_len;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (maps[mid].ptr < ptr) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

void gs_map_add(uint64_t ptr, uint64_t size, uint64_t handle) {
    pthread_mutex_lock(&maps_mu);
    if (maps_len == maps_cap) {
        size_t cap = maps_cap ? maps_cap * 2 : 64;
        mapping_t *grown = realloc(maps, cap * sizeof *maps);
        if (!grown) {
            pthread_mutex_unlock(&maps_mu);
            gs_log(GS_LOG_ERROR, "out of host memory tracking a mapping; its unmap is not counted");
            return;
        }
        maps = grown;
        maps_cap = cap;
    }
    size_t i = maps_lower_bound(ptr);
    memmove(&maps[i + 1], &maps[i], (maps_len - i) * sizeof *maps);
    maps[i] = (mapping_t){ptr, size, handle};
    maps_len++;
    pthread_mutex_unlock(&maps_mu);
}

void gs_map_remove_range(uint64_t ptr, uint64_t size, void (*gone)(uint64_t handle)) {
    uint64_t end = ptr + size < ptr ? UINT64_MAX : ptr + size;
    uint64_t small[16];
    uint64_t *handles = small;
    size_t count = 0;
    pthread_mutex_lock(&maps_mu);
    size_t first = maps_lower_bound(ptr), last = first;
    while (last < maps_len && maps[last].ptr < end) last++;
    count = last - first;
    if (count > sizeof small / sizeof small[0] && !(handles = malloc(count * sizeof *handles))) {
        handles = small; /* no memory: give back what fits, keep the rest mapped */
        count = sizeof small / sizeof small[0];
        last = first + count;
    }
    for (size_t i = 0; i < count; i++) handles[i] = maps[first + i].handle;
    memmove(&maps[first], &maps[last], (maps_len - last) * sizeof *maps);
    maps_len -= count;
    pthread_mutex_unlock(&maps_mu);
    for (size_t i = 0; i < count; i++) gone(handles[i]);
    if (handles != small) free(handles);
}

void gs_track_forget_all(void) {
    pthread_once(&shards_once, shards_init);
    pthread_mutex_init(&maps_mu, NULL); /* a fork child: the lock may have been held */
    maps_len = 0;
    for (int i = 0; i < SHARDS; i++) {
        shard_t *s = &shards[i];
        pthread_mutex_init(&s->mu, NULL); /* a fork child: the lock may have been held */
        for (size_t b = 0; b < BUCKETS; b++) {
            entry_t *e = s->buckets[b];
            while (e) {
                entry_t *next = e->next;
                e->next = s->free;
                s->free = e;
                e = next;
            }
            s->buckets[b] = NULL;
        }
    }
}
