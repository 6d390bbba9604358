/*
 * Opening files a container could tamper with: every component of the path is
 * opened with O_NOFOLLOW from the one before, so no symlink anywhere on the way
 * is followed, and what is checked (fstat) is the open descriptor itself, never
 * a path resolved again later.
 */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include "gs.h"

int gs_open_dir_nofollow(const char *path) {
    if (!path || path[0] != '/') {
        errno = EINVAL;
        return -1;
    }
    int fd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    const char *p = path;
    while (fd >= 0 && *p) {
        while (*p == '/') p++;
        size_t len = strcspn(p, "/");
        if (len == 0) break;
        char name[256];
        if (len >= sizeof name || (len == 2 && p[0] == '.' && p[1] == '.')) {
            close(fd);
            errno = EINVAL;
            return -1;
        }
        memcpy(name, p, len);
        name[len] = 0;
        p += len;
        int next = openat(fd, name, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        int saved = errno;
        close(fd);
        errno = saved;
        fd = next;
    }
    return fd;
}

int gs_open_parent_nofollow(const char *path, const char **name) {
    const char *slash = path ? strrchr(path, '/') : NULL;
    if (!slash || !slash[1] || path[0] != '/') {
        errno = EINVAL;
        return -1;
    }
    char dir[512];
    size_t len = (size_t)(slash - path);
    if (len >= sizeof dir) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(dir, path, len);
    dir[len] = 0;
    *name = slash + 1;
    return gs_open_dir_nofollow(len ? dir : "/");
}

int gs_open_nofollow(const char *path, int flags, mode_t mode) {
    const char *name;
    int dfd = gs_open_parent_nofollow(path, &name);
    if (dfd < 0) return -1;
    int fd = openat(dfd, name, flags | O_NOFOLLOW | O_CLOEXEC, mode);
    int saved = errno;
    close(dfd);
    errno = saved;
    return fd;
}
