/*
 * Finding the real driver, and handing out our wrappers wherever the application
 * looks a driver function up: the dynamic linker (our exports come first),
 * dlsym on the driver's handle, and cuGetProcAddress(_v2), through which the CUDA
 * runtime >= 11.3 resolves the whole driver API.
 */
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <string.h>

#include "gs.h"

gs_real_t gs_real;
atomic_int gs_ready;

typedef void *(*dlsym_fn)(void *, const char *);
static _Atomic(dlsym_fn) real_dlsym_ptr;
static void *cuda_handle;
static void *nvml_handle;
static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;
static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;
/* Set while this thread loads a library: lookups made by its constructors pass through. */
static __thread bool loading;

/* glibc's dlsym, found past ourselves, so another interposer of dlsym keeps its place. */
static dlsym_fn real_dlsym(void) {
    dlsym_fn f = atomic_load_explicit(&real_dlsym_ptr, memory_order_acquire);
    if (GS_LIKELY(f != NULL)) return f;
    /* glibc >= 2.34 moved dlsym into libc; before, its base version was 2.2.5
     * on x86-64 and 2.17 on aarch64. */
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
    for (size_t i = 0; !f && i < sizeof versions / sizeof versions[0]; i++)
        f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    atomic_store_explicit(&real_dlsym_ptr, f, memory_order_release);
    return f;
}

/* ------------------------------------------------------------ name -> wrapper */
typedef struct {
    const char *name;
    void *wrapper;
} gs_entry_t;

static const gs_entry_t wrappers[] = {
#define CUDA_HOOK(name, params, args) {#name, (void *)name},
#define NVML_HOOK(name, params, args) {#name, (void *)name},
#include "hooks.def"
};

static void *gs_wrapper_for(const char *name) {
    if (!name || (name[0] != 'c' && name[0] != 'n')) return NULL;
    for (size_t i = 0; i < sizeof wrappers / sizeof wrappers[0]; i++)
        if (!strcmp(wrappers[i].name, name)) return wrappers[i].wrapper;
    return NULL;
}

/* Our wrapper of the real function `fn`: the exact version the driver chose. */
static void *wrapper_of_real(void *fn) {
    if (!fn) return NULL;
#define CUDA_HOOK(name, params, args)                                                         \
    if (fn == (void *)gs_real.name) return (void *)name;
#include "hooks.def"
    return NULL;
}

/* ------------------------------------------------------------ families
 * Every name of an accounted family (hooks.def) is handed out as our wrapper or
 * not at all while control is on: a version or variant of the driver's we do not
 * wrap (an old ABI, a newer _vN) would allocate, map, show memory or launch
 * unseen. Functions of other families pass through as the driver chose them. */
static const char *const families[] = {
#define CUDA_FAMILY(base) #base,
#include "hooks.def"
};

/* `name` without its stream suffix (_ptsz, _ptds) and version (_vN). */
static size_t base_length(const char *name) {
    size_t n = strlen(name);
    if (n > 5 && (!strcmp(name + n - 5, "_ptsz") || !strcmp(name + n - 5, "_ptds"))) n -= 5;
    size_t d = n;
    while (d > 0 && name[d - 1] >= '0' && name[d - 1] <= '9') d--;
    if (d < n && d >= 2 && name[d - 1] == 'v' && name[d - 2] == '_') n = d - 2;
    return n;
}

static bool in_family(const char *name) {
    if (!name || name[0] != 'c' || name[1] != 'u') return false;
    size_t n = base_length(name);
    for (size_t i = 0; i < sizeof families / sizeof families[0]; i++)
        if (strlen(families[i]) == n && !strncmp(families[i], name, n)) return true;
    return false;
}

static void family_refused(const char *how, const char *name) {
    static atomic_int logged;
    if (!atomic_exchange(&logged, 1))
        gs_log(GS_LOG_WARN, "%s(%s): the driver's function is not wrapped by gpuslice and would "
               "escape the container's limits; refused (logged once)", how, name);
}

/* A function the driver chose that we do not wrap (another version, another
 * ABI) passes through as it is, unless its family is accounted: then it is
 * refused (false, *pfn NULL). */
static bool resolve_wrapper(const char *symbol, void **pfn) {
    if (!pfn || !*pfn || gs_cfg.disabled) return true;
    void *w = wrapper_of_real(*pfn);
    if (w) {
        *pfn = w;
        return true;
    }
    if (!in_family(symbol)) return true;
    family_refused("cuGetProcAddress", symbol);
    *pfn = NULL;
    return false;
}

/* ------------------------------------------------------------ loading */
static void load_cuda(void) {
    loading = true;
    gs_config_load();
    const char *path = gs_cfg.libcuda_path[0] ? gs_cfg.libcuda_path : "libcuda.so.1";
    cuda_handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!cuda_handle) {
        gs_log(GS_LOG_ERROR, "cannot load the CUDA driver %s: %s", path, dlerror());
    } else if (!real_dlsym()) {
        gs_log(GS_LOG_ERROR, "cannot find glibc's dlsym; the CUDA driver is unreachable");
    } else {
        dlsym_fn sym = real_dlsym();
#define CUDA_HOOK(name, params, args) gs_real.name = (__typeof__(gs_real.name))sym(cuda_handle, #name);
#define CUDA_REAL(name, params, args) gs_real.name = (__typeof__(gs_real.name))sym(cuda_handle, #name);
#include "hooks.def"
    }
    loading = false;
    atomic_store_explicit(&gs_ready, 1, memory_order_release);
}

void gs_init_slow(void) { pthread_once(&cuda_once, load_cuda); }

static void load_nvml(void) {
    gs_init();
    const char *path = gs_cfg.libnvml_path[0] ? gs_cfg.libnvml_path : "libnvidia-ml.so.1";
    loading = true;
    nvml_handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    loading = false;
    if (!nvml_handle) {
        gs_log(GS_LOG_ERROR, "cannot load NVML %s: %s", path, dlerror());
        return;
    }
    dlsym_fn sym = real_dlsym();
    if (!sym) return;
#define NVML_HOOK(name, params, args) gs_real.name = (__typeof__(gs_real.name))sym(nvml_handle, #name);
#define NVML_REAL(name, params, args) gs_real.name = (__typeof__(gs_real.name))sym(nvml_handle, #name);
#include "hooks.def"
}

void gs_nvml_init(void) { pthread_once(&nvml_once, load_nvml); }

/* ------------------------------------------------------------ dlsym */
static bool named_like(const char *path, const char *prefix) {
    if (!path) return false;
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    return !strncmp(base, prefix, strlen(prefix));
}

static bool configured(const char *path, const char *setting) {
    return setting[0] && path && !strcmp(path, setting);
}

/* Is `handle` the driver's or NVML's library? */
static __attribute__((noinline)) bool driver_handle(void *handle) {
    if (handle == cuda_handle || handle == nvml_handle) return handle != NULL;
    struct link_map *map = NULL;
    if (dlinfo(handle, RTLD_DI_LINKMAP, &map) != 0 || !map) return false;
    return named_like(map->l_name, "libcuda.so") || named_like(map->l_name, "libnvidia-ml.so") ||
           configured(map->l_name, gs_cfg.libcuda_path) || configured(map->l_name, gs_cfg.libnvml_path);
}

/* What a lookup of a driver name gets while control is on: our wrapper, or
 * `refused` (an accounted family's name we do not wrap, asked of the driver). */
static char refused_mark;
#define REFUSED ((void *)&refused_mark)

static __attribute__((noinline)) void *hooked_lookup(void *handle, const char *symbol) {
    if (!symbol || !((symbol[0] == 'c' && symbol[1] == 'u') || !strncmp(symbol, "nvml", 4)))
        return NULL;
    if (loading) return NULL;
    void *w = gs_wrapper_for(symbol);
    bool scope = handle == RTLD_NEXT || handle == RTLD_DEFAULT;
    if (!w && !in_family(symbol)) return NULL;
    if (!scope && !driver_handle(handle)) return NULL;
    gs_init();
    if (gs_cfg.disabled) return NULL;
    dlsym_fn real = real_dlsym();
    if (!real) return NULL;
    /* RTLD_NEXT from a library loaded after us (linked against the driver) and
     * RTLD_DEFAULT find the driver's function past our export: hand out the
     * wrapper where the driver has the function, and refuse an accounted
     * family's name we do not wrap (a version newer than this library) there
     * as on the driver's handle. */
    void *lib = handle;
    if (scope) {
        if (symbol[0] == 'n') gs_nvml_init();
        lib = symbol[0] == 'n' ? nvml_handle : cuda_handle;
        if (!lib) return NULL;
    }
    /* A function this driver lacks stays missing: callers probe for new APIs. */
    if (!real(lib, symbol)) return NULL;
    if (!w) {
        family_refused("dlsym", symbol);
        return REFUSED;
    }
    return w;
}

/*
 * The pass-through must stay a tail call: glibc's dlsym reads its caller's
 * address to resolve RTLD_NEXT, and a jump keeps that caller the application.
 * (loader.c is built without sanitizer instrumentation for the same reason.)
 */
GS_EXPORT void *dlsym(void *handle, const char *symbol) {
    void *w = hooked_lookup(handle, symbol);
    if (w) return w == REFUSED ? NULL : w;
    dlsym_fn real = real_dlsym();
    if (GS_UNLIKELY(!real)) return NULL;
    return real(handle, symbol);
}

/* ------------------------------------------------------------ dlopen, dlmopen
 * Two ways past the exported wrappers, closed here (both are tail calls, so
 * glibc still sees the application as the caller for $ORIGIN and RPATH):
 *  - RTLD_DEEPBIND makes a library linked against libcuda bind to the driver
 *    before the global scope, where our wrappers are: the flag is dropped;
 *  - dlmopen into another link-map namespace loads a driver this library is not
 *    in: refused (NULL) while control is on. */
typedef void *(*dlopen_fn)(const char *, int);
typedef void *(*dlmopen_fn)(Lmid_t, const char *, int);

static void *next_libc(const char *name) {
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.3.4"};
    void *f = NULL;
    for (size_t i = 0; !f && i < sizeof versions / sizeof versions[0]; i++)
        f = dlvsym(RTLD_NEXT, name, versions[i]);
    return f;
}

static _Atomic(dlopen_fn) real_dlopen_ptr;
static _Atomic(dlmopen_fn) real_dlmopen_ptr;

static __attribute__((noinline)) int dlopen_flags(const char *file, int flags) {
    if (!(flags & RTLD_DEEPBIND) || loading) return flags;
    gs_init();
    if (gs_cfg.disabled) return flags;
    GS_LOG(GS_LOG_INFO, "dlopen(%s): RTLD_DEEPBIND dropped so the CUDA driver stays behind gpuslice",
           file ? file : "NULL");
    return flags & ~RTLD_DEEPBIND;
}

GS_EXPORT void *dlopen(const char *file, int flags) {
    dlopen_fn real = atomic_load_explicit(&real_dlopen_ptr, memory_order_acquire);
    if (GS_UNLIKELY(!real)) {
        real = (dlopen_fn)next_libc("dlopen");
        atomic_store_explicit(&real_dlopen_ptr, real, memory_order_release);
        if (!real) return NULL;
    }
    return real(file, dlopen_flags(file, flags));
}

static __attribute__((noinline)) bool dlmopen_refused(Lmid_t lmid, const char *file) {
    if (lmid == LM_ID_BASE || loading) return false;
    gs_init();
    if (gs_cfg.disabled) return false;
    gs_log(GS_LOG_ERROR, "dlmopen(%s) into another link-map namespace refused: a CUDA driver there "
           "would not be held to the container's limits", file ? file : "NULL");
    return true;
}

GS_EXPORT void *dlmopen(Lmid_t lmid, const char *file, int flags) {
    if (dlmopen_refused(lmid, file)) return NULL;
    dlmopen_fn real = atomic_load_explicit(&real_dlmopen_ptr, memory_order_acquire);
    if (GS_UNLIKELY(!real)) {
        real = (dlmopen_fn)next_libc("dlmopen");
        atomic_store_explicit(&real_dlmopen_ptr, real, memory_order_release);
        if (!real) return NULL;
    }
    return real(lmid, file, flags);
}

/* ------------------------------------------------------------ cuGetProcAddress */
CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    gs_init();
    if (!gs_real.cuGetProcAddress) return CUDA_ERROR_NOT_FOUND;
    CUresult rc = gs_real.cuGetProcAddress(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS && !resolve_wrapper(symbol, pfn)) return CUDA_ERROR_NOT_FOUND;
    return rc;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus) {
    gs_init();
    if (!gs_real.cuGetProcAddress_v2) {
        if (symbolStatus) *symbolStatus = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    CUresult rc = gs_real.cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (rc == CUDA_SUCCESS && !resolve_wrapper(symbol, pfn)) {
        if (symbolStatus) *symbolStatus = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    return rc;
}

CUresult cuInit(unsigned int flags) {
    gs_init();
    CUresult rc = GS_CALL(cuInit, (flags));
    if (rc == CUDA_SUCCESS && !gs_cfg.disabled) {
        gs_attach(); /* a hook called before cuInit may have joined already */
        if (atomic_load(&gs_attached) == 1) gs_name_devices();
    }
    return rc;
}
