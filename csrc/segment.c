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

static void registry_add(pdhal_segment *seg)
{
    pthread_once(&atfork_once, install_atfork);
    pthread_mutex_lock(&open_lock);
    seg->next_open = open_segments;
    open_segments = seg;
    pthread_mutex_unlock(&open_lock);
}

static void registry_remove(pdhal_segment *seg)
{
    pthread_mutex_lock(&open_lock);
    for (pdhal_segment **p = &open_segments; *p; p = &(*p)->next_open) {
        if (*p == seg) {
            *p = seg->next_open;
            break;
        }
    }
    pthread_mutex_unlock(&open_lock);
}

/* ---- locks ---- */

static int lock_byte(int fd, off_t byte)
{
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = byte, .l_len = 1};
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
    strncpy(seg->path, path, sizeof seg->path - 1);
    return seg;
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

/* Map every page of a buffer now: a KV cache is touched whole anyway, and a page fault per
 * 4 KiB on first touch made the first copy through a fresh mapping 4x slower. Best effort:
 * older kernels (EINVAL) or a short memory cgroup leave the pages to fault in later. */
static void prefault_buffer(pdhal_segment *seg, uint32_t kind)
{
    if (kind == PDHAL_KIND_BUFFER)
        (void)madvise(seg->hdr, seg->map_bytes, MADV_POPULATE_WRITE);
}

static void attach_ring(pdhal_segment *seg, uint32_t kind)
{
    seg->ring = kind == PDHAL_KIND_CHUNK
                    ? (struct pdhal_ring_slot *)((char *)seg->hdr + sizeof(struct pdhal_segment_header))
                    : NULL;
}

static int check_path(const char *path)
{
    size_t n = strnlen(path, 256);
    if (n == 0 || n >= 256)
        return pdhal_fail(ENAMETOOLONG, "segment path must be 1..255 bytes, got %zu", n);
    return 0;
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
    int fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT)
            return 0;
        return pdhal_fail(errno, "cannot open %s to check its producer: %s", path, strerror(errno));
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
    if (lock_byte(fd, PDHAL_LOCK_PRODUCER) != 0) {
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
    if (kind == PDHAL_KIND_CHUNK && (ring_slots < 2 || ring_slots > 4096))
        return pdhal_fail(EINVAL, "ring_slots must be 2..4096, got %u", ring_slots);
    if (kind != PDHAL_KIND_CHUNK)
        ring_slots = 0;
    uint64_t bytes = segment_bytes(kind, body_bytes, ring_slots);
    if (bytes == 0)
        return pdhal_fail(EINVAL, "unknown segment kind %u", kind);
    if (kind == PDHAL_KIND_BUFFER && (body_bytes == 0 || body_bytes > (UINT64_C(1) << 46)))
        return pdhal_fail(EINVAL, "buffer size must be 1..2^46 bytes, got %llu",
                          (unsigned long long)body_bytes);

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
    seg->fd = reopen(fd, O_WRONLY);
    if (seg->fd < 0 || fchmod(fd, 0200) != 0 || lock_byte(seg->fd, PDHAL_LOCK_PRODUCER) != 0 ||
        ftruncate(fd, (off_t)bytes) != 0) {
        rc = pdhal_fail(errno, "cannot initialise %s: %s", path, strerror(errno));
        goto fail;
    }
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
    attach_ring(seg, kind);
    prefault_buffer(seg, kind);
    /* The file was fresh (zero-filled), so every atomic starts at 0. Publishing the mode is
     * the ready flag; the header stores above are ordered before it by the syscall. */
    if (fchmod(fd, 0600) != 0) {
        rc = pdhal_fail(errno, "cannot publish %s: %s", path, strerror(errno));
        goto fail;
    }
    close(fd);
    registry_add(seg);
    *out = seg;
    return 0;
fail:
    if (seg->hdr)
        munmap(seg->hdr, seg->map_bytes);
    if (seg->fd >= 0)
        close(seg->fd);
    close(fd);
    unlink(path);
    free(seg);
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
    uint64_t expect = segment_bytes(h->kind, h->body_bytes, h->ring_slots);
    if (h->size != (uint64_t)st->st_size || expect != h->size ||
        (kind == PDHAL_KIND_CHUNK && (h->ring_slots < 2 || h->max_requests != PDHAL_MAX_REQUESTS)))
        return pdhal_fail(EMSGSIZE,
                          "%s has size %lld, header says %llu, layout needs %llu: corrupt or "
                          "written by another pdhal",
                          seg->path, (long long)st->st_size, (unsigned long long)h->size,
                          (unsigned long long)expect);
    return 0;
}

int pdhal_segment_open(const char *path, uint32_t kind, int64_t deadline_ns, int exclusive_reader,
                       pdhal_segment **out)
{
    *out = NULL;
    int rc = check_path(path);
    if (rc)
        return rc;
    struct stat st;
    int fd;
    int64_t entered = pdhal_now_ns();
    for (;;) {
        int initialising = 0;
        fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0) {
            if (errno == ELOOP)
                return pdhal_fail(ELOOP, "%s is a symbolic link: refusing to follow it", path);
            if (errno == EACCES)
                initialising = 1; /* mode 0200 while its creator fills it (non-root view) */
            else if (errno != ENOENT)
                return pdhal_fail(errno, "cannot open %s: %s", path, strerror(errno));
        } else {
            if (fstat(fd, &st) != 0) {
                rc = pdhal_fail(errno, "fstat %s: %s", path, strerror(errno));
                close(fd);
                return rc;
            }
            if (st.st_uid != geteuid()) {
                close(fd);
                return pdhal_fail(EPERM, "%s belongs to uid %u, expected our uid %u: refusing it",
                                  path, (unsigned)st.st_uid, (unsigned)geteuid());
            }
            if (!S_ISREG(st.st_mode)) {
                close(fd);
                return pdhal_fail(EINVAL, "%s is not a regular file", path);
            }
            unsigned mode = st.st_mode & 07777;
            if (mode == 0600)
                break;
            close(fd);
            if (mode != 0200)
                return pdhal_fail(EACCES, "%s has mode %04o, expected 0600: refusing it", path, mode);
            initialising = 1;
        }
        int64_t now = pdhal_now_ns();
        if (now >= deadline_ns) {
            if (initialising)
                return pdhal_fail(ETIMEDOUT, "%s is still being initialised by its creator", path);
            return pdhal_fail(ENOENT, "%s does not exist (its producer has not started, or has "
                                      "closed it)", path);
        }
        if (now - entered > PDHAL_WAIT_SLICE_NS) /* let the caller run signal handlers */
            return pdhal_fail(EINTR, "interrupted (a wait slice ended)");
        sleep_briefly();
    }
    if ((uint64_t)st.st_size < sizeof(struct pdhal_segment_header)) {
        close(fd);
        return pdhal_fail(EMSGSIZE, "%s is %lld bytes, smaller than a pdhal header", path,
                          (long long)st.st_size);
    }
    pdhal_segment *seg = segment_new(path);
    if (!seg) {
        close(fd);
        return pdhal_fail(ENOMEM, "out of memory");
    }
    seg->fd = reopen(fd, O_RDWR);
    rc = seg->fd < 0 ? pdhal_fail(errno, "cannot reopen %s: %s", path, strerror(errno)) : 0;
    if (rc == 0)
        rc = map_segment(seg, fd, (uint64_t)st.st_size);
    close(fd); /* the mapping keeps what it needs */
    if (rc == 0)
        rc = validate(seg, &st, kind);
    if (rc == 0) {
        attach_ring(seg, kind);
        prefault_buffer(seg, kind);
    }
    if (rc == 0 && exclusive_reader) {
        if (lock_byte(seg->fd, PDHAL_LOCK_READER) != 0)
            rc = pdhal_fail(EBUSY, "%s already has a reader attached (one reader per channel)",
                            path);
        else /* release: a producer that sees the pid also sees our lock (pairs with acquire) */
            atomic_store_explicit(&seg->hdr->reader_pid, (int32_t)getpid(), memory_order_release);
    }
    if (rc) {
        if (seg->hdr)
            munmap(seg->hdr, seg->map_bytes);
        if (seg->fd >= 0)
            close(seg->fd);
        free(seg);
        return rc;
    }
    if (kind == PDHAL_KIND_CHUNK) {
        /* Resume after what a previous reader consumed: the producer never overwrites an
         * unread step, so everything from there on is still in the ring. */
        seg->cursor_step = atomic_load_explicit(&seg->hdr->consumed, memory_order_acquire) + 1;
        seg->cursor_layer = 0;
    }
    registry_add(seg);
    *out = seg;
    return 0;
}

void pdhal_segment_ref(pdhal_segment *seg) { atomic_fetch_add(&seg->refs, 1); }

void pdhal_segment_unref(pdhal_segment *seg)
{
    if (atomic_fetch_sub(&seg->refs, 1) != 1)
        return;
    munmap(seg->hdr, seg->map_bytes);
    free(seg);
}

void pdhal_segment_close(pdhal_segment *seg)
{
    if (!seg)
        return;
    registry_remove(seg);
    /* Only the creating process unlinks: a forked child dropping an inherited handle must not
     * remove its parent's segment. */
    if (seg->is_creator && seg->pid == getpid()) {
        struct stat named, mine;
        if (seg->fd >= 0 && fstat(seg->fd, &mine) == 0 && stat(seg->path, &named) == 0 &&
            named.st_ino == mine.st_ino && named.st_dev == mine.st_dev)
            unlink(seg->path);
    }
    if (seg->fd >= 0 && seg->pid == getpid())
        close(seg->fd);
    seg->fd = -1;
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

uint32_t pdhal_segment_ring_slots(pdhal_segment *seg) { return seg->hdr->ring_slots; }

void *pdhal_segment_body(pdhal_segment *seg)
{
    if (seg->hdr->kind != PDHAL_KIND_BUFFER)
        return NULL;
    return (char *)seg->hdr + PDHAL_BUFFER_HEADER_BYTES;
}

uint64_t pdhal_segment_body_bytes(pdhal_segment *seg) { return seg->hdr->body_bytes; }
