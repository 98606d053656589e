/* segment.c: named shared-memory segments with explicit owners and lifetimes.
 *
 * A segment is a file (normally under /dev/shm). Its creator:
 *   1. creates it with O_CREAT|O_EXCL, mode 0200 ("initialising");
 *   2. takes an OFD write lock on byte PDHAL_LOCK_PRODUCER and keeps it for its life: readers
 *      probe that lock (F_OFD_GETLK) to learn whether the producer is alive; the kernel drops
 *      it when the process dies, even as an unreaped zombie;
 *   3. sizes, maps and fills the header, then fchmods to 0600, which is the "ready" flag.
 * Openers refuse anything that is not ours, not a regular file, not exactly 0600, or whose
 * header disagrees.
 *
 * Locks live on an open file description used for nothing else: a mapping holds a reference
 * to the description it was made from, and a forked child inherits mappings, so a lock on
 * the mapped description would outlive its owner in any forked child. The atfork handler
 * closes the child's copy of the lock descriptor.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

/* ---- fork registry: a forked child must not hold our producer/reader locks ---- */

static pthread_mutex_t open_lock = PTHREAD_MUTEX_INITIALIZER;
static pdhal_segment *open_segments;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void atfork_prepare(void) { pthread_mutex_lock(&open_lock); }
static void atfork_parent(void) { pthread_mutex_unlock(&open_lock); }
static void atfork_child(void)
{
    /* The child shares our open file descriptions, and with them the OFD locks: close its
     * copies so the producer's death stays visible even if the child lives on. */
    for (pdhal_segment *s = open_segments; s; s = s->next_open) {
        if (s->fd >= 0) {
            close(s->fd);
            s->fd = -1;
        }
    }
    open_segments = NULL;
    pthread_mutex_unlock(&open_lock);
}
static void install_atfork(void) { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); }

static int reopen(int fd, int flags);

/* seg->fd: a description of its own for `fd`'s file (the locks are taken on it), entered
 * in the fork registry in the same step: a fork from another thread between the two would
 * leave the child that description, and with it the lock taken on it next. */
static int reopen_registered(pdhal_segment *seg, int fd, int flags)
{
    pthread_once(&atfork_once, install_atfork);
    pthread_mutex_lock(&open_lock);
    seg->fd = reopen(fd, flags);
    if (seg->fd >= 0) {
        seg->next_open = open_segments;
        open_segments = seg;
    }
    pthread_mutex_unlock(&open_lock);
    return seg->fd;
}

/* Out of the fork registry, its description closed (when this process opened it) in the
 * same step: a fork from another thread between the two would leave the child the
 * description, and with it the lock taken on it, which no atfork handler would close. */
static void registry_close(pdhal_segment *seg)
{
    pthread_mutex_lock(&open_lock);
    for (pdhal_segment **p = &open_segments; *p; p = &(*p)->next_open) {
        if (*p == seg) {
            *p = seg->next_open;
            break;
        }
    }
    if (seg->fd >= 0 && seg->pid == getpid())
        close(seg->fd);
    seg->fd = -1;
    pthread_mutex_unlock(&open_lock);
}

/* ---- locks ---- */

static int lock_byte(int fd, off_t byte, short type)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = byte, .l_len = 1};
    return fcntl(fd, F_OFD_SETLK, &fl) == 0 ? 0 : -errno;
}

/* 1 if another open file description holds a lock on `byte`, 0 if none, -errno. */
static int lock_held(int fd, off_t byte)
{
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = byte, .l_len = 1};
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0)
        return -errno;
    return fl.l_type != F_UNLCK;
}

/* A new open file description of the file behind `fd` (not a dup, which shares it). */
static int reopen(int fd, int flags)
{
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    return open(proc, flags | O_CLOEXEC);
}

/* ---- sizes ---- */

static uint64_t segment_bytes(uint32_t kind, uint64_t body_bytes, uint32_t ring_slots)
{
    switch (kind) {
    case PDHAL_KIND_QUERY:
        return sizeof(struct pdhal_segment_header);
    case PDHAL_KIND_CHUNK:
        return sizeof(struct pdhal_segment_header) +
               (uint64_t)ring_slots * sizeof(struct pdhal_ring_slot);
    case PDHAL_KIND_BUFFER:
        return PDHAL_BUFFER_HEADER_BYTES + body_bytes;
    default:
        return 0;
    }
}

static pdhal_segment *segment_new(const char *path)
{
    pdhal_segment *seg = calloc(1, sizeof *seg);
    if (!seg)
        return NULL;
    seg->fd = -1;
    seg->pid = getpid();
    atomic_init(&seg->refs, 1);
    atomic_init(&seg->reading, 0);
    pthread_mutex_init(&seg->publish_lock, NULL);
    strncpy(seg->path, path, sizeof seg->path - 1);
    return seg;
}

/* Free a handle nobody else can reach yet (create and open failing half-way). */
static void segment_destroy(pdhal_segment *seg)
{
    registry_close(seg);
    if (seg->hdr)
        munmap(seg->hdr, seg->map_bytes);
    pthread_mutex_destroy(&seg->publish_lock);
    free(seg);
}

/* Keep the layout (validated by the caller) in the handle, and point at the ring. */
static void adopt_layout(pdhal_segment *seg, uint32_t kind, uint32_t ring_slots,
                         uint64_t body_bytes)
{
    seg->kind = kind;
    seg->ring_slots = ring_slots;
    seg->body_bytes = body_bytes;
    seg->ring = kind == PDHAL_KIND_CHUNK
                    ? (struct pdhal_ring_slot *)((char *)seg->hdr + sizeof(struct pdhal_segment_header))
                    : NULL;
}

static int map_segment(pdhal_segment *seg, int fd, uint64_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return pdhal_fail(errno, "mmap of %s (%llu bytes) failed: %s", seg->path,
                          (unsigned long long)bytes, strerror(errno));
    seg->hdr = p;
    seg->map_bytes = bytes;
    return 0;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

/* Bytes populated per madvise call. The kernel holds the process's mmap lock for reading
 * through one call, and an mmap or munmap on another thread (a new thread's stack, an
 * allocator's arena) queues for it as a writer, with every page fault of every other
 * thread queued behind that. Between chunks the lock is released and those go first. */
#define PREFAULT_CHUNK ((size_t)32 << 20)

/* Map every page of a buffer its creator just made: a KV cache is touched whole anyway, and
 * a page fault per 4 KiB on first touch made the first copy through a fresh mapping 4x
 * slower. Best effort: older kernels (EINVAL) or a short memory cgroup leave the pages to
 * fault in later. An opener of another process's buffer does not populate it: its first
 * copies fault in what they touch. Populating on a thread of the opener's own froze the
 * opener (a messager mapping two decode ranks' GiB caches) for 10 to 100 s on a loaded host,
 * every thread of it, its sessions silent past their keepalive: under two busy loops
 * test_tensor_parallel failed 8 runs of 11 with it (in chunks of 32 or 2 MiB alike) and
 * passed 3 of 3 without. */
static void prefault_buffer(pdhal_segment *seg)
{
    if (seg->kind != PDHAL_KIND_BUFFER)
        return;
    char *base = (char *)seg->hdr;
    for (size_t at = 0; at < seg->map_bytes; at += PREFAULT_CHUNK) {
        size_t n = seg->map_bytes - at < PREFAULT_CHUNK ? seg->map_bytes - at : PREFAULT_CHUNK;
        if (madvise(base + at, n, MADV_POPULATE_WRITE) != 0)
            return;
    }
}

/* The folder part of `path` ("." when it has none) into `dir`. */
static void folder_of(const char *path, char dir[256])
{
    const char *slash = strrchr(path, '/');
    if (!slash) {
        strcpy(dir, ".");
        return;
    }
    size_t n = slash == path ? 1 : (size_t)(slash - path);
    memcpy(dir, path, n);
    dir[n] = '\0';
}

/* A usable name in a safe folder: 1..255 bytes (the handle keeps it whole, so close unlinks
 * exactly it), in a folder that no other user may fill with files of their own choosing. */
static int check_path(const char *path)
{
    size_t n = strnlen(path, 256);
    if (n == 0 || n >= 256)
        return pdhal_fail(ENAMETOOLONG, "segment path must be 1..255 bytes, got %zu", n);
    char dir[256];
    folder_of(path, dir);
    struct stat st;
    if (stat(dir, &st) != 0)
        return pdhal_fail(errno, "cannot use folder %s for pdhal segments: %s", dir,
                          strerror(errno));
    if ((st.st_mode & S_IWOTH) && !(st.st_mode & S_ISVTX))
        return pdhal_fail(EPERM,
                          "folder %s is writable by every user and has no sticky bit, so any "
                          "user could replace pdhal's segments there: set PDHAL_SHM_DIR to a "
                          "folder only you can write, or `chmod +t %s`",
                          dir, dir);
    return 0;
}

/* Reserve every byte of the file now, so a full tmpfs is an error here and never a SIGBUS
 * on first touch (in the producer, or in a reader of a segment that looked complete). */
static int reserve(int fd, const char *path, uint64_t bytes)
{
    int rc;
    do
        rc = posix_fallocate(fd, 0, (off_t)bytes);
    while (rc == EINTR);
    if (rc == 0)
        return 0;
    if (rc == ENOSPC) {
        char dir[256];
        folder_of(path, dir);
        struct statvfs vfs;
        unsigned long long have =
            statvfs(dir, &vfs) == 0 ? (unsigned long long)vfs.f_bavail * vfs.f_frsize : 0;
        return pdhal_fail(ENOSPC, "no space in %s: need %llu bytes, have %llu", dir,
                          (unsigned long long)bytes, have);
    }
    return pdhal_fail(rc, "cannot reserve %llu bytes for %s: %s", (unsigned long long)bytes,
                      path, strerror(rc));
}

static void sleep_briefly(void)
{
    struct timespec ts = {0, 2 * 1000 * 1000};
    nanosleep(&ts, NULL);
}

/* ---- reclaim ---- */

int pdhal_segment_reclaim(const char *path)
{
    int rc = check_path(path);
    if (rc)
        return rc;
    /* From open to close under the fork registry's lock: the producer lock this takes is on
     * a description of its own, and a fork from another thread meanwhile would leave the
     * child holding it (the file would look alive while the child lives). */
    pthread_once(&atfork_once, install_atfork);
    pthread_mutex_lock(&open_lock);
    int fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        int error = errno;
        pthread_mutex_unlock(&open_lock);
        if (error == ENOENT)
            return 0;
        return pdhal_fail(error, "cannot open %s to check its producer: %s", path,
                          strerror(error));
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        rc = pdhal_fail(errno, "fstat %s: %s", path, strerror(errno));
        goto out;
    }
    if (st.st_uid != geteuid()) {
        rc = pdhal_fail(EPERM, "%s belongs to uid %u, not to us (uid %u): refusing to touch it",
                        path, (unsigned)st.st_uid, (unsigned)geteuid());
        goto out;
    }
    if ((st.st_mode & 07777) != 0600 && (st.st_mode & 07777) != 0200) {
        rc = pdhal_fail(EACCES, "%s has mode %04o, not a pdhal segment (0600): refusing to touch it",
                        path, (unsigned)(st.st_mode & 07777));
        goto out;
    }
    /* Taking the producer lock ourselves proves nobody alive holds it, and keeps any other
     * reclaimer from judging this same file until we have unlinked it. */
    if (lock_byte(fd, PDHAL_LOCK_PRODUCER, F_WRLCK) != 0) {
        rc = 0; /* alive (or being reclaimed by someone else right now) */
        goto out;
    }
    struct stat named;
    if (stat(path, &named) == 0 && named.st_ino == st.st_ino && named.st_dev == st.st_dev) {
        unlink(path);
        rc = 1;
    }
out:
    close(fd);
    pthread_mutex_unlock(&open_lock);
    return rc;
}

/* ---- create / open / close ---- */

int pdhal_segment_create(const char *path, uint32_t kind, uint64_t body_bytes, uint32_t ring_slots,
                         pdhal_segment **out)
{
    *out = NULL;
    int rc = check_path(path);
    if (rc)
        return rc;
    if (kind == PDHAL_KIND_CHUNK && (ring_slots < 2 || ring_slots > PDHAL_MAX_RING_SLOTS))
        return pdhal_fail(EINVAL, "ring_slots must be 2..4096, got %u", ring_slots);
    if (kind != PDHAL_KIND_CHUNK)
        ring_slots = 0;
    if (kind == PDHAL_KIND_BUFFER && (body_bytes == 0 || body_bytes > PDHAL_MAX_BODY_BYTES))
        return pdhal_fail(EINVAL, "buffer size must be 1..2^46 bytes, got %llu",
                          (unsigned long long)body_bytes);
    if (kind != PDHAL_KIND_BUFFER)
        body_bytes = 0;
    uint64_t bytes = segment_bytes(kind, body_bytes, ring_slots);
    if (bytes == 0)
        return pdhal_fail(EINVAL, "unknown segment kind %u", kind);

    int fd = -1;
    for (int attempt = 0; attempt < 16 && fd < 0; attempt++) {
        fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0200);
        if (fd >= 0)
            break;
        if (errno != EEXIST)
            return pdhal_fail(errno, "cannot create %s: %s", path, strerror(errno));
        rc = pdhal_segment_reclaim(path);
        if (rc < 0)
            return rc;
        if (rc == 0 && attempt < 15) {
            /* Locked: a live producer, or another process reclaiming it this very moment.
             * Give a concurrent reclaimer time to finish before calling it live. */
            sleep_briefly();
            continue;
        }
        if (rc == 0) {
            int32_t pid = -1;
            pdhal_segment *peek = NULL;
            if (pdhal_segment_open(path, kind, 0, 0, &peek) == 0) {
                pid = peek->hdr->creator_pid;
                pdhal_segment_close(peek);
            }
            return pdhal_fail(EBUSY, "%s already has a live producer (pid %d)", path, pid);
        }
    }
    if (fd < 0)
        return pdhal_fail(EBUSY, "%s kept reappearing while reclaiming it", path);

    pdhal_segment *seg = segment_new(path);
    if (!seg) {
        close(fd);
        unlink(path);
        return pdhal_fail(ENOMEM, "out of memory");
    }
    seg->is_creator = 1;
    /* O_WRONLY: mode 0200 grants it to non-root creators too, and a write lock needs it. */
    if (reopen_registered(seg, fd, O_WRONLY) < 0 || fchmod(fd, 0200) != 0 ||
        lock_byte(seg->fd, PDHAL_LOCK_PRODUCER, F_WRLCK) != 0) {
        rc = pdhal_fail(errno, "cannot initialise %s: %s", path, strerror(errno));
        goto fail;
    }
    rc = reserve(fd, path, bytes);
    if (rc == 0)
        rc = map_segment(seg, fd, bytes);
    if (rc)
        goto fail;
    struct pdhal_segment_header *h = seg->hdr;
    h->magic = PDHAL_MAGIC;
    h->version = PDHAL_SEGMENT_VERSION;
    h->kind = kind;
    h->size = bytes;
    h->creator_pid = (int32_t)getpid();
    h->creator_uid = (uint32_t)geteuid();
    h->ring_slots = ring_slots;
    h->max_requests = PDHAL_MAX_REQUESTS;
    h->body_bytes = body_bytes;
    adopt_layout(seg, kind, ring_slots, body_bytes);
    prefault_buffer(seg);
    /* The file was fresh (zero-filled), so every atomic starts at 0. Publishing the mode is
     * the ready flag; the header stores above are ordered before it by the syscall. */
    if (fchmod(fd, 0600) != 0) {
        rc = pdhal_fail(errno, "cannot publish %s: %s", path, strerror(errno));
        goto fail;
    }
    close(fd);
    *out = seg;
    return 0;
fail:
    segment_destroy(seg);
    close(fd);
    unlink(path);
    return rc;
}

static int validate(pdhal_segment *seg, const struct stat *st, uint32_t kind)
{
    const struct pdhal_segment_header *h = seg->hdr;
    if (h->magic != PDHAL_MAGIC)
        return pdhal_fail(EBADMSG, "%s is not a pdhal segment (magic %#llx, expected %#llx)",
                          seg->path, (unsigned long long)h->magic, (unsigned long long)PDHAL_MAGIC);
    if (h->version != PDHAL_SEGMENT_VERSION)
        return pdhal_fail(EPROTONOSUPPORT,
                          "%s has layout version %u, this pdhal speaks version %u: run the same "
                          "pdhal version on both sides",
                          seg->path, h->version, PDHAL_SEGMENT_VERSION);
    if (h->kind != kind)
        return pdhal_fail(EPROTOTYPE, "%s is a segment of kind %u, expected kind %u", seg->path,
                          h->kind, kind);
    /* Each layout field in its own range before any size is computed from it. */
    uint32_t slots = h->ring_slots;
    uint64_t body = h->body_bytes;
    int layout_ok = kind == PDHAL_KIND_CHUNK
                        ? slots >= 2 && slots <= PDHAL_MAX_RING_SLOTS && body == 0 &&
                              h->max_requests == PDHAL_MAX_REQUESTS
                    : kind == PDHAL_KIND_BUFFER ? slots == 0 && body >= 1 && body <= PDHAL_MAX_BODY_BYTES
                                                : slots == 0 && body == 0;
    if (!layout_ok)
        return pdhal_fail(EMSGSIZE,
                          "%s has an impossible layout (ring_slots %u, body_bytes %llu, "
                          "max_requests %u): corrupt or written by another pdhal",
                          seg->path, slots, (unsigned long long)body, h->max_requests);
    uint64_t expect = segment_bytes(kind, body, slots);
    if (h->size != (uint64_t)st->st_size || expect != h->size)
        return pdhal_fail(EMSGSIZE,
                          "%s has size %lld, header says %llu, layout needs %llu: corrupt or "
                          "written by another pdhal",
                          seg->path, (long long)st->st_size, (unsigned long long)h->size,
                          (unsigned long long)expect);
    adopt_layout(seg, kind, slots, body);
    return 0;
}

/* Why an open found nothing usable yet (the caller waits and tries again). */
enum not_yet { MISSING, INITIALISING, PRODUCER_DEAD };

/* One attempt: 0 with *out set, -EAGAIN with *why set when the caller should wait, or
 * another -errno. */
static int try_open(const char *path, uint32_t kind, uint32_t flags, pdhal_segment **out,
                    enum not_yet *why)
{
    int fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ELOOP)
            return pdhal_fail(ELOOP, "%s is a symbolic link: refusing to follow it", path);
        if (errno == EACCES) { /* mode 0200 while its creator fills it (non-root view) */
            *why = INITIALISING;
            return -EAGAIN;
        }
        if (errno == ENOENT) {
            *why = MISSING;
            return -EAGAIN;
        }
        return pdhal_fail(errno, "cannot open %s: %s", path, strerror(errno));
    }
    struct stat st;
    int rc = 0;
    if (fstat(fd, &st) != 0)
        rc = pdhal_fail(errno, "fstat %s: %s", path, strerror(errno));
    else if (st.st_uid != geteuid())
        rc = pdhal_fail(EPERM, "%s belongs to uid %u, expected our uid %u: refusing it", path,
                        (unsigned)st.st_uid, (unsigned)geteuid());
    else if (!S_ISREG(st.st_mode))
        rc = pdhal_fail(EINVAL, "%s is not a regular file", path);
    else if ((st.st_mode & 07777) == 0200) {
        *why = INITIALISING;
        rc = -EAGAIN;
    } else if ((st.st_mode & 07777) != 0600)
        rc = pdhal_fail(EACCES, "%s has mode %04o, expected 0600: refusing it", path,
                        (unsigned)(st.st_mode & 07777));
    else if ((uint64_t)st.st_size < sizeof(struct pdhal_segment_header))
        rc = pdhal_fail(EMSGSIZE, "%s is %lld bytes, smaller than a pdhal header", path,
                        (long long)st.st_size);
    if (rc) {
        close(fd);
        return rc;
    }
    pdhal_segment *seg = segment_new(path);
    if (!seg) {
        close(fd);
        return pdhal_fail(ENOMEM, "out of memory");
    }
    if (reopen_registered(seg, fd, O_RDWR) < 0) /* (rc is 0 here) */
        rc = pdhal_fail(errno, "cannot reopen %s: %s", path, strerror(errno));
    if (rc == 0)
        rc = map_segment(seg, fd, (uint64_t)st.st_size);
    close(fd); /* the mapping keeps what it needs */
    if (rc == 0)
        rc = validate(seg, &st, kind);
    if (rc == 0 && (flags & PDHAL_OPEN_LIVE_PRODUCER)) {
        int alive = pdhal_segment_producer_alive(seg);
        if (alive == 0) {
            *why = PRODUCER_DEAD;
            rc = -EAGAIN;
        } else if (alive < 0) {
            rc = alive;
        }
    }
    if (rc == 0 && (flags & PDHAL_OPEN_EXCLUSIVE_READER)) {
        if (lock_byte(seg->fd, PDHAL_LOCK_READER, F_WRLCK) != 0)
            rc = pdhal_fail(EBUSY, "%s already has a reader attached (one reader per channel)",
                            path);
        else /* release: a producer that sees the pid also sees our lock (pairs with acquire) */
            atomic_store_explicit(&seg->hdr->reader_pid, (int32_t)getpid(), memory_order_release);
        seg->is_reader = 1;
    } else if (rc == 0 && kind == PDHAL_KIND_QUERY) {
        /* Per-query readers share the reader byte, so the producer can tell that one is
         * attached (and that the last one left) the way the per-chunk producer does. */
        if (lock_byte(seg->fd, PDHAL_LOCK_READER, F_RDLCK) != 0)
            rc = pdhal_fail(errno, "cannot register as a reader of %s: %s", path,
                            strerror(errno));
    }
    if (rc) {
        segment_destroy(seg);
        return rc;
    }
    *out = seg;
    return 0;
}

int pdhal_segment_open(const char *path, uint32_t kind, int64_t deadline_ns, uint32_t flags,
                       pdhal_segment **out)
{
    *out = NULL;
    int rc = check_path(path);
    if (rc)
        return rc;
    if (flags & ~(uint32_t)(PDHAL_OPEN_EXCLUSIVE_READER | PDHAL_OPEN_LIVE_PRODUCER |
                            PDHAL_OPEN_UNINTERRUPTED))
        return pdhal_fail(EINVAL, "unknown open flags %#x", flags);
    int64_t entered = pdhal_now_ns();
    pdhal_segment *seg = NULL;
    for (;;) {
        enum not_yet why = MISSING;
        rc = try_open(path, kind, flags, &seg, &why);
        if (rc != -EAGAIN)
            break;
        int64_t now = pdhal_now_ns();
        if (now >= deadline_ns) {
            if (why == INITIALISING)
                return pdhal_fail(ETIMEDOUT, "%s is still being initialised by its creator", path);
            if (why == PRODUCER_DEAD)
                return pdhal_fail(ENOENT, "%s is left by a producer that died, and no new "
                                          "producer has taken it over", path);
            return pdhal_fail(ENOENT, "%s does not exist (its producer has not started, or has "
                                      "closed it)", path);
        }
        if (!(flags & PDHAL_OPEN_UNINTERRUPTED) && now - entered > pdhal_wait_slice_ns())
            /* let the caller run signal handlers */
            return pdhal_fail(EINTR, "interrupted (a wait slice ended)");
        sleep_briefly();
    }
    if (rc)
        return rc;
    if (kind == PDHAL_KIND_CHUNK) {
        /* Resume after what a previous reader finished: the producer never overwrites an
         * unfinished step, so everything from there on is still in the ring. */
        seg->cursor_step = atomic_load_explicit(&seg->hdr->consumed, memory_order_acquire) + 1;
        seg->cursor_layer = 0;
    }
    *out = seg;
    return 0;
}

/* relaxed: a reference is only ever taken from one already held, so the count cannot reach 0
 * meanwhile; nothing is published by taking it. */
void pdhal_segment_ref(pdhal_segment *seg)
{
    atomic_fetch_add_explicit(&seg->refs, 1, memory_order_relaxed);
}

void pdhal_segment_unref(pdhal_segment *seg)
{
    /* acq_rel: every use before another holder's release happens before the last one frees */
    if (atomic_fetch_sub_explicit(&seg->refs, 1, memory_order_acq_rel) != 1)
        return;
    munmap(seg->hdr, seg->map_bytes);
    pthread_mutex_destroy(&seg->publish_lock);
    free(seg);
}

void pdhal_segment_close(pdhal_segment *seg)
{
    if (!seg)
        return;
    if (seg->kernel_id || seg->ring) /* named by kernel forms, or the current chunk step */
        pdhal_kernel_forget_channel(seg);
    /* Only the creating process unlinks: a forked child dropping an inherited handle must not
     * remove its parent's segment. */
    if (seg->is_creator && seg->pid == getpid()) {
        struct stat named, mine;
        if (seg->fd >= 0 && fstat(seg->fd, &mine) == 0 && stat(seg->path, &named) == 0 &&
            named.st_ino == mine.st_ino && named.st_dev == mine.st_dev)
            unlink(seg->path);
    }
    if (seg->is_reader && seg->fd >= 0 && seg->pid == getpid())
        /* A clean detach, not a death: a producer waiting on this reader keeps waiting for
         * the next one (until its timeout) instead of reporting the reader dead. release:
         * pairs with the acquire of reader_pid in wait_for_reader; stored while our lock is
         * still held, so no new reader's pid is overwritten. */
        atomic_store_explicit(&seg->hdr->reader_pid, 0, memory_order_release);
    registry_close(seg);
    pdhal_segment_unref(seg);
}

int pdhal_segment_producer_alive(pdhal_segment *seg)
{
    if (seg->is_creator)
        return seg->fd >= 0;
    if (seg->fd < 0)
        return pdhal_fail(EBADF, "segment handle %s was closed or inherited across fork",
                          seg->path);
    int held = lock_held(seg->fd, PDHAL_LOCK_PRODUCER);
    return held < 0 ? pdhal_fail(-held, "probing producer lock of %s failed", seg->path) : held;
}

int pdhal_segment_require_producer(pdhal_segment *seg)
{
    int alive = pdhal_segment_producer_alive(seg);
    if (alive < 0)
        return alive;
    if (alive == 0)
        return pdhal_fail(EOWNERDEAD, "producer (pid %d) of %s died", seg->hdr->creator_pid,
                          seg->path);
    return 0;
}

int pdhal_segment_reader_attached(pdhal_segment *seg)
{
    if (seg->fd < 0)
        return pdhal_fail(EBADF, "segment handle %s was closed or inherited across fork",
                          seg->path);
    int held = lock_held(seg->fd, PDHAL_LOCK_READER);
    return held < 0 ? pdhal_fail(-held, "probing reader lock of %s failed", seg->path) : held;
}

int32_t pdhal_segment_creator_pid(pdhal_segment *seg) { return seg->hdr->creator_pid; }

uint32_t pdhal_segment_ring_slots(pdhal_segment *seg) { return seg->ring_slots; }

void *pdhal_segment_body(pdhal_segment *seg)
{
    if (seg->kind != PDHAL_KIND_BUFFER)
        return NULL;
    return (char *)seg->hdr + PDHAL_BUFFER_HEADER_BYTES;
}

uint64_t pdhal_segment_body_bytes(pdhal_segment *seg) { return seg->body_bytes; }
