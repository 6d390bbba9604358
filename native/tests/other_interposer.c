/*
 * A second preloaded library that wraps a libc function the usual way: it
 * defines getppid() and finds the real one with dlsym(RTLD_NEXT, ...). Preloaded
 * after libgpuslice.so (whose dlsym hook sits in front of every lookup), it proves
 * that RTLD_NEXT still means "next after the caller" for other interposers: a
 * hook that answered as if libgpuslice.so were the caller would hand back this
 * very getppid, or nothing, and the process exits 3.
 *
 * other_interposer_calls() tells the probe how often the wrapper ran.
 */
#include <dlfcn.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

__attribute__((visibility("default"))) unsigned long other_interposer_calls(void);

static atomic_ulong calls;

unsigned long other_interposer_calls(void) { return atomic_load(&calls); }

static void die(const char *msg) {
    ssize_t ignored = write(STDERR_FILENO, msg, strlen(msg));
    (void)ignored;
    _exit(3);
}

__attribute__((visibility("default"))) pid_t getppid(void) {
    void *sym = dlsym(RTLD_NEXT, "getppid");
    pid_t (*real)(void);
    memcpy(&real, &sym, sizeof real);
    if (real == NULL) die("other_interposer: dlsym(RTLD_NEXT, \"getppid\") returned NULL\n");
    Dl_info mine, theirs;
    if (real == getppid ||
        (dladdr((void *)getppid, &mine) && dladdr(sym, &theirs) && mine.dli_fbase == theirs.dli_fbase))
        die("other_interposer: dlsym(RTLD_NEXT, \"getppid\") returned our own getppid\n");
    atomic_fetch_add(&calls, 1);
    return real();
}
