/*
 * fuzz_segment.c: a libFuzzer target over the C core's segment validator and its per-chunk
 * record decoder, built from csrc/ directly (not the Python extension) under ASan + UBSan.
 *
 * How to run:
 *   make fuzz-ci                    # ~30 s per mode (validate, then hostile), for CI
 *   make fuzz FUZZ_SECONDS=3600     # a long run, both modes mixed (default 300 s)
 * Both build tests/fuzz/build/fuzz_segment with
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
 *         -I pdhal/include -I csrc tests/fuzz/fuzz_segment.c csrc/{errors,wait,segment,...}.c
 * and fuzz a copy of tests/fuzz/corpus (seeds from tests/fuzz/make_seeds.py) that grows in
 * tests/fuzz/build/corpus-MODE (tests/fuzz/run.sh; libFuzzer's output: build/fuzz-MODE.log).
 * A crash, a leak, a UB report, a hang (-timeout=10) or a broken oracle below (abort) fails
 * the target and leaves the input in tests/fuzz/build/ (crash-*, leak-*, timeout-*).
 * Replay one:  tests/fuzz/build/fuzz_segment tests/fuzz/build/crash-<sha1>
 * Environment: PDHAL_FUZZ_MODE=validate|hostile pins the mode bit of the selector byte;
 * PDHAL_FUZZ_DIR is the folder for the private mkdtemp folder (default /dev/shm).
 *
 * Input: byte 0 is the selector, bit 0 the mode.
 *   0  validate: the rest of the input is an untrusted segment file (mode 0600, ours, in a
 *      private 0700 folder). Fix-ups so the fuzzer gets past the cheap checks: 0x02 writes
 *      a valid magic + version, 0x04 sets the header's size to the file's, 0x08 resizes the
 *      file to what the header's kind/ring_slots/body_bytes need (<= 1 MiB, zero padded;
 *      max_requests made valid). Bits 0x30 pick the file mode (0x20: 0644, 0x30: 0200), or
 *      with 0x80 an odd entry at the path (0x00 symlink to the file, 0x10 the file owned by
 *      another user when we are root, 0x20 a folder, 0x30 a FIFO), which nothing may open.
 *      Each kind is opened with flags 0, EXCLUSIVE_READER and EXCLUSIVE_READER|LIVE_PRODUCER
 *      (deadline 0); whatever opens is read through the public API: ring_slots, the whole
 *      body, progress load/wait (deadline passed), ring_next/ack, publish, stores. Then the
 *      stale file is reclaimed (pdhal_segment_reclaim; with 0x40, pdhal_segment_create over it).
 *   1  hostile: a real per-chunk segment (create + exclusive reader), a few steps published
 *      and read legitimately, then ops from the input: writes into our own MAP_SHARED view
 *      of the file (header past its first 64 bytes, slot progress/count/num_layers/table,
 *      raw bytes) interleaved with ring_next, ring_ack, begin_step (tables sized exactly),
 *      publish, per-query begin_step, stores, waits, probes, and a reader that restarts
 *      (resuming from the hostile `consumed`).
 * Oracles beyond "no crash" (and LeakSanitizer): no descriptor leaks; an accepted file's size
 * matches its layout; a delivered record fits the buffer, has count <= PDHAL_MAX_REQUESTS and
 * equals the ring slot it came from; a buffer's body is the file's bytes after the 4096-byte
 * header; a symlink, folder, FIFO or another user's file is never opened; a second exclusive
 * reader is refused; a begin_step past the limits is refused.
 */
#define _GNU_SOURCE
#include "internal.h" /* shared-memory layouts only (offsets); never struct pdhal_segment */

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define HDR_BYTES sizeof(struct pdhal_segment_header)
#define SLOT_BYTES sizeof(struct pdhal_ring_slot)
#define OFF_HDR(f) offsetof(struct pdhal_segment_header, f)
#define OFF_SLOT(f) offsetof(struct pdhal_ring_slot, f)
#define LAYOUT_CAP (UINT64_C(1) << 20) /* largest file the 0x08 fix-up builds */
#define MAX_OPS 64

static_assert(sizeof(struct pdhal_segment_header) == 256, "make_seeds.py assumes 256");
static_assert(sizeof(struct pdhal_ring_slot) == 6208, "make_seeds.py assumes 6208");

static char g_dir[200];
static char g_file[256];  /* validate mode: the untrusted file */
static char g_target[256]; /* validate mode: where a symlink at g_file points */
static char g_chunk[256]; /* hostile mode: the real segment */
static int g_force_mode = -1;
static volatile uint8_t g_sink;

static void die(const char *what)
{
    fprintf(stderr, "fuzz_segment oracle failed: %s (pdhal_last_error: %s)\n", what,
            pdhal_last_error());
    abort();
}

static void cleanup(void)
{
    unlink(g_file);
    rmdir(g_file);
    unlink(g_target);
    unlink(g_chunk);
    rmdir(g_dir);
}

/* Folders left by our runs that crashed (no atexit then): pdhal-fuzz-PID-* of a PID that is
 * gone, holding only the harness's own file names. */
static void remove_stale(const char *base)
{
    DIR *d = opendir(base);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d))) {
        int pid = 0;
        if (sscanf(e->d_name, "pdhal-fuzz-%d-", &pid) != 1 || pid <= 0)
            continue;
        if (kill(pid, 0) == 0 || errno != ESRCH) /* alive, or not ours to judge */
            continue;
        char dir[512], path[600];
        snprintf(dir, sizeof dir, "%s/%s", base, e->d_name);
        DIR *inner = opendir(dir);
        if (!inner)
            continue;
        struct dirent *f;
        while ((f = readdir(inner))) {
            if (!strcmp(f->d_name, "untrusted") || !strcmp(f->d_name, "target") ||
                !strncmp(f->d_name, "chunk-", 6)) {
                snprintf(path, sizeof path, "%s/%s", dir, f->d_name);
                if (unlink(path) != 0 && errno == EISDIR)
                    rmdir(path);
            }
        }
        closedir(inner);
        rmdir(dir);
    }
    closedir(d);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    const char *base = getenv("PDHAL_FUZZ_DIR");
    if (!base || !*base)
        base = "/dev/shm";
    remove_stale(base);
    snprintf(g_dir, sizeof g_dir, "%s/pdhal-fuzz-%d-XXXXXX", base, (int)getpid());
    if (!mkdtemp(g_dir)) { /* mode 0700: only we can put files there */
        perror("fuzz_segment: mkdtemp");
        abort();
    }
    snprintf(g_file, sizeof g_file, "%s/untrusted", g_dir);
    snprintf(g_target, sizeof g_target, "%s/target", g_dir);
    snprintf(g_chunk, sizeof g_chunk, "%s/chunk-%d", g_dir, (int)getpid());
    const char *mode = getenv("PDHAL_FUZZ_MODE");
    if (mode && !strcmp(mode, "validate"))
        g_force_mode = 0;
    else if (mode && !strcmp(mode, "hostile"))
        g_force_mode = 1;
    else if (mode && *mode) {
        fprintf(stderr, "fuzz_segment: PDHAL_FUZZ_MODE must be validate or hostile\n");
        abort();
    }
    atexit(cleanup);
    return 0;
}

/* ---- little-endian field access on byte buffers (our copy, or our own mapping) ---- */

static uint64_t get_le(const uint8_t *p, size_t n)
{
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static void put_le(uint8_t *p, size_t n, uint64_t v)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* ---- input cursor: past the end every read is 0 ---- */

struct input {
    const uint8_t *p;
    size_t n;
};

static uint8_t in_u8(struct input *in)
{
    if (!in->n)
        return 0;
    in->n--;
    return *in->p++;
}

static uint64_t in_le(struct input *in, size_t n)
{
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++)
        v |= (uint64_t)in_u8(in) << (8 * i);
    return v;
}

static void in_bytes(struct input *in, uint8_t *dst, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = in_u8(in);
}

/* ---- shared helpers ---- */

/* The file size the core's layout rules give (0: no such kind). */
static uint64_t layout_bytes(uint32_t kind, uint32_t slots, uint64_t body)
{
    switch (kind) {
    case PDHAL_KIND_QUERY:
        return HDR_BYTES;
    case PDHAL_KIND_CHUNK:
        return HDR_BYTES + (uint64_t)slots * SLOT_BYTES;
    case PDHAL_KIND_BUFFER:
        return body > LAYOUT_CAP ? 0 : PDHAL_BUFFER_HEADER_BYTES + body;
    default:
        return 0;
    }
}

/* A record pdhal_ring_next says it delivered must fit, and be what the ring slot holds
 * (nothing else writes the mapping while the call runs: one thread). */
static void check_record(int rc, const int32_t *out, uint32_t capacity, uint64_t step,
                         const uint8_t *map, size_t map_bytes, uint32_t slots)
{
    if (rc != 1)
        return;
    if (out[0] < 0 || out[0] > PDHAL_MAX_REQUESTS)
        die("record count out of range");
    uint32_t count = (uint32_t)out[0];
    if (2 + 3 * count > capacity)
        die("record larger than the caller's buffer");
    if (!map || !slots)
        return;
    size_t at = HDR_BYTES + (size_t)(step % slots) * SLOT_BYTES;
    if (at + SLOT_BYTES > map_bytes)
        die("record from a slot past the mapping");
    const uint8_t *slot = map + at;
    uint64_t progress = get_le(slot + OFF_SLOT(progress), 8);
    if (progress >> PDHAL_LAYER_BITS != step)
        die("record's step is not the slot's step");
    if ((uint64_t)(uint32_t)out[1] >= (progress & PDHAL_LAYER_MASK))
        die("record's layer is not ready in the slot");
    if (get_le(slot + OFF_SLOT(count), 4) != count)
        die("record count differs from the slot's");
    if (memcmp(out + 2, slot + OFF_SLOT(table), 3 * count * sizeof(int32_t)) != 0)
        die("record table differs from the slot's");
}

static void *map_file(const char *path, size_t bytes, int prot, int *fd_out)
{
    int fd = open(path, (prot & PROT_WRITE ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    void *p = mmap(NULL, bytes, prot, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        close(fd);
        return NULL;
    }
    *fd_out = fd;
    return p;
}

/* ---- mode 0: validation of untrusted files ---- */

/* Nothing left at the validate mode's paths, whatever the last input put there. */
static void clear_entries(void)
{
    if (unlink(g_file) != 0 && errno == EISDIR)
        rmdir(g_file);
    unlink(g_target);
}

static int write_file(const char *path, const uint8_t *buf, size_t len, mode_t mode)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
        return -1;
    for (size_t done = 0; done < len;) {
        ssize_t n = write(fd, buf + done, len - done);
        if (n <= 0) {
            close(fd);
            return -1;
        }
        done += (size_t)n;
    }
    int rc = fchmod(fd, mode);
    close(fd);
    return rc;
}

/* Read an opened segment through every public call a reader makes. */
static void exercise_opened(pdhal_segment *seg, uint32_t kind, uint32_t flags, const uint8_t *file,
                            size_t len, const uint8_t *map)
{
    uint32_t slots = pdhal_segment_ring_slots(seg);
    const uint8_t *body = pdhal_segment_body(seg);
    uint64_t body_bytes = pdhal_segment_body_bytes(seg);
    switch (kind) {
    case PDHAL_KIND_QUERY:
        if (len != HDR_BYTES || slots || body || body_bytes)
            die("query segment accepted with a wrong layout");
        break;
    case PDHAL_KIND_CHUNK:
        if (slots < 2 || slots > PDHAL_MAX_RING_SLOTS || len != HDR_BYTES + (size_t)slots * SLOT_BYTES ||
            body || body_bytes)
            die("chunk segment accepted with a wrong layout");
        break;
    case PDHAL_KIND_BUFFER:
        if (slots || !body || body_bytes == 0 || len != PDHAL_BUFFER_HEADER_BYTES + body_bytes)
            die("buffer segment accepted with a wrong layout");
        /* every byte of the body it claims: the file's bytes after the buffer header */
        if (memcmp(body, file + PDHAL_BUFFER_HEADER_BYTES, body_bytes) != 0)
            die("buffer body is not the file's payload");
        uint8_t x = 0;
        for (uint64_t i = 0; i < body_bytes; i++)
            x ^= body[i];
        g_sink = x;
        break;
    }
    (void)pdhal_segment_creator_pid(seg);
    (void)pdhal_segment_producer_alive(seg);
    (void)pdhal_segment_reader_attached(seg);

    uint64_t v = pdhal_progress_load(seg);
    if (v != get_le(map + OFF_HDR(progress), 8))
        die("progress_load is not the header's progress word");
    uint64_t now = 0;
    /* Nobody holds the producer lock: -EOWNERDEAD unless progress already passed `since`. */
    int rc = pdhal_progress_wait(seg, v, 1, 0, &now);
    if (rc == 0)
        die("progress_wait returned progress that had not moved");
    if (v) {
        rc = pdhal_progress_wait(seg, v - 1, 1, 1000, &now);
        if (rc != 0 || now != v)
            die("progress_wait missed progress already there");
    }

    if (kind == PDHAL_KIND_CHUNK) {
        static int32_t out[PDHAL_RECORD_WORDS];
        static const uint32_t caps[] = {2, 5, PDHAL_RECORD_WORDS, 4, PDHAL_RECORD_WORDS,
                                        PDHAL_RECORD_WORDS};
        for (size_t i = 0; i < sizeof caps / sizeof caps[0]; i++) {
            uint64_t step = 0;
            rc = pdhal_ring_next(seg, out, caps[i], 0, 0, &step);
            if (!(flags & PDHAL_OPEN_EXCLUSIVE_READER) && rc != -EPERM)
                die("ring_next worked without the reader lock");
            check_record(rc, out, caps[i], step, map, len, slots);
        }
        rc = pdhal_ring_ack(seg);
        if (!(flags & PDHAL_OPEN_EXCLUSIVE_READER) && rc != -EPERM)
            die("ring_ack worked without the reader lock");
        int32_t table[3] = {1, 2, 3};
        uint64_t step = 0;
        if (pdhal_ring_begin_step(seg, table, 1, 1, 0, &step) != -EPERM)
            die("a reader published a step");
    }
    /* Stores through the reader's handle: in-range slots write the mapping, others nothing. */
    static const uint32_t pub_slots[] = {PDHAL_QUERY_SLOT, 0, 1, 4095, 4096, 0xfffffffe};
    for (size_t i = 0; i < sizeof pub_slots / sizeof pub_slots[0]; i++) {
        uint32_t slot = pub_slots[i];
        pdhal_progress_publish(seg, slot, v + 1);
        pdhal_store *st = pdhal_store_new(seg, slot, v + 2);
        int valid = slot == PDHAL_QUERY_SLOT || (kind == PDHAL_KIND_CHUNK && slot < slots);
        if (!st != !valid)
            die("store_new disagrees with the ring's size");
        if (st)
            pdhal_store_run(st);
    }
}

static void fuzz_validate(uint8_t sel, const uint8_t *data, size_t size)
{
    size_t len = size;
    if ((sel & 0x08) && size >= HDR_BYTES) {
        uint64_t want = layout_bytes((uint32_t)get_le(data + OFF_HDR(kind), 4),
                                     (uint32_t)get_le(data + OFF_HDR(ring_slots), 4),
                                     get_le(data + OFF_HDR(body_bytes), 8));
        if (want && want <= LAYOUT_CAP)
            len = (size_t)want;
    }
    uint8_t *file = calloc(len ? len : 1, 1);
    if (!file)
        abort();
    memcpy(file, data, size < len ? size : len);
    if (len >= HDR_BYTES) {
        if (sel & 0x02) {
            put_le(file + OFF_HDR(magic), 8, PDHAL_MAGIC);
            put_le(file + OFF_HDR(version), 4, PDHAL_SEGMENT_VERSION);
        }
        if (sel & 0x0c)
            put_le(file + OFF_HDR(size), 8, len);
        if ((sel & 0x08) && get_le(file + OFF_HDR(kind), 4) == PDHAL_KIND_CHUNK)
            put_le(file + OFF_HDR(max_requests), 4, PDHAL_MAX_REQUESTS);
    }
    static const mode_t modes[] = {0600, 0600, 0644, 0200};
    int odd = sel & 0x80, variant = (sel >> 4) & 3;
    clear_entries();
    const char *real = odd && variant == 0 ? g_target : g_file;
    int regular = !odd || variant <= 1; /* a file holds the bytes (at `real`) */
    if (regular && write_file(real, file, len, odd ? 0600 : modes[variant]) != 0) {
        perror("fuzz_segment: writing the segment file");
        abort();
    }
    if (odd) {
        int rc = 0;
        if (variant == 0)
            rc = symlink(g_target, g_file);
        else if (variant == 1)
            rc = geteuid() == 0 ? chown(g_file, 65534, (gid_t)-1) : 0;
        else if (variant == 2)
            rc = mkdir(g_file, 0700);
        else
            rc = mkfifo(g_file, 0600);
        if (rc != 0) {
            perror("fuzz_segment: making the odd entry");
            abort();
        }
    }
    /* Our own read-only view, to check what the core reads against. */
    int fd = -1;
    const uint8_t *map = len && regular ? map_file(real, len, PROT_READ, &fd) : NULL;
    if (len && regular && !map) {
        perror("fuzz_segment: mapping the segment file");
        abort();
    }
    static const uint32_t kinds[] = {PDHAL_KIND_QUERY, PDHAL_KIND_CHUNK, PDHAL_KIND_BUFFER};
    static const uint32_t flag_sets[] = {0, PDHAL_OPEN_EXCLUSIVE_READER,
                                         PDHAL_OPEN_EXCLUSIVE_READER | PDHAL_OPEN_LIVE_PRODUCER};
    for (size_t k = 0; k < 3; k++) {
        for (size_t f = 0; f < 3; f++) {
            pdhal_segment *seg = NULL;
            int rc = pdhal_segment_open(g_file, kinds[k], 0, flag_sets[f], &seg);
            if (rc == 0) {
                if (!seg || !map)
                    die("open succeeded without a handle or on an empty file");
                if (odd && (variant != 1 || geteuid() == 0))
                    die("a symlink, folder, FIFO or another user's file was opened");
                if (flag_sets[f] & PDHAL_OPEN_LIVE_PRODUCER)
                    die("LIVE_PRODUCER open of a file with no producer succeeded");
                exercise_opened(seg, kinds[k], flag_sets[f], file, len, map);
                pdhal_segment_close(seg);
            } else if (seg) {
                die("failed open left a handle");
            }
        }
    }
    if (map) {
        munmap((void *)map, len);
        close(fd);
    }
    /* A stale file whose producer is gone: reclaimed (mode 0600/0200 and ours), or refused. */
    if (sel & 0x40) {
        pdhal_segment *seg = NULL;
        int rc = pdhal_segment_create(g_file, PDHAL_KIND_QUERY, 0, 0, &seg);
        if (rc == 0) {
            if (pdhal_progress_load(seg) != 0 || pdhal_segment_ring_slots(seg) != 0)
                die("a segment created over a stale file kept its contents");
            pdhal_segment_close(seg);
        }
    } else {
        int rc = pdhal_segment_reclaim(g_file);
        struct stat st;
        if (rc == 1 && lstat(g_file, &st) == 0)
            die("reclaim said removed but the file is there");
        if (rc == 1 && odd && variant != 3 && (variant != 1 || geteuid() == 0))
            die("reclaim removed a symlink, a folder or another user's file");
    }
    clear_entries();
    free(file);
}

/* ---- mode 1: a hostile writer after validation ---- */

enum op {
    OP_WRITE_HEADER,    /* bytes into the header past its identity (64..255) */
    OP_WRITE_FIELD,     /* one header atomic, a whole value */
    OP_WRITE_PROGRESS,  /* a slot's progress word */
    OP_WRITE_COUNT,     /* a slot's count */
    OP_WRITE_LAYERS,    /* a slot's num_layers */
    OP_WRITE_TABLE,     /* one table word of a slot */
    OP_WRITE_RAW,       /* bytes anywhere past the identity */
    OP_NEXT,            /* pdhal_ring_next, deadline 0 */
    OP_ACK,             /* pdhal_ring_ack */
    OP_BEGIN_STEP,      /* pdhal_ring_begin_step, deadline 0 */
    OP_PUBLISH,         /* pdhal_progress_publish from the producer */
    OP_STORE,           /* pdhal_store_new + run */
    OP_WAIT,            /* pdhal_progress_wait from the reader, deadline passed */
    OP_PROBE,           /* liveness probes, a second reader */
    OP_RESTART_READER,  /* the reader closes (a step may be begun meanwhile) and reopens */
    OP_COUNT
};

struct hostile {
    pdhal_segment *prod, *reader;
    uint8_t *map;
    size_t map_bytes;
    uint32_t slots;
    int32_t out[PDHAL_RECORD_WORDS];
};

static void h_next(struct hostile *h, uint32_t capacity)
{
    uint64_t step = 0;
    int rc = pdhal_ring_next(h->reader, h->out, capacity, 0, 0, &step);
    check_record(rc, h->out, capacity, step, h->map, h->map_bytes, h->slots);
}

static void h_begin(struct hostile *h, struct input *in)
{
    /* Mostly small tables and layer counts; sometimes the limits, or past them (refused). The
     * table is exactly 3 * count words on the heap, so ASan sees any read past it. */
    uint8_t c = in_u8(in);
    uint32_t count = c == 0xff ? PDHAL_MAX_REQUESTS + 1 : c == 0xfe ? PDHAL_MAX_REQUESTS : c % 5;
    uint8_t l = in_u8(in);
    uint32_t num_layers = l == 0xff ? PDHAL_MAX_LAYER + 2 : l == 0xfe ? PDHAL_MAX_LAYER + 1 : l % 5;
    int32_t *table = malloc(3 * (size_t)count * sizeof *table + 1);
    if (!table)
        abort();
    for (uint32_t i = 0; i < 3 * count; i++)
        table[i] = (int32_t)in_le(in, 2);
    uint64_t step = 0;
    int rc = pdhal_ring_begin_step(h->prod, table, count, num_layers, 0, &step);
    if (rc == 0 && (count > PDHAL_MAX_REQUESTS || num_layers == 0 || num_layers > PDHAL_MAX_LAYER + 1))
        die("begin_step accepted a table past the limits");
    free(table);
}

static uint32_t pick_slot(struct hostile *h, uint8_t b)
{
    if (b == 0xff)
        return PDHAL_QUERY_SLOT;
    if (b == 0xfe)
        return 0xfffffffe;
    return b % (h->slots + 2); /* two past the ring: must store nothing */
}

static uint64_t pick_value(struct input *in, struct hostile *h)
{
    uint8_t how = in_u8(in);
    uint64_t latest = get_le(h->map + OFF_HDR(latest_step), 8);
    switch (how & 3) {
    case 0: /* a layer of a recent step */
        return ((latest - (how >> 2 & 3)) << PDHAL_LAYER_BITS) | (in_u8(in) % 8);
    case 1:
        return UINT64_MAX - (how >> 2);
    default:
        return in_le(in, 8);
    }
}

static void fuzz_hostile(const uint8_t *data, size_t size)
{
    struct input in = {data, size};
    static struct hostile h;
    memset(&h, 0, sizeof h);
    uint8_t b = in_u8(&in);
    h.slots = 2 + (b & 7);
    h.map_bytes = HDR_BYTES + (size_t)h.slots * SLOT_BYTES;
    if (pdhal_segment_create(g_chunk, PDHAL_KIND_CHUNK, 0, h.slots, &h.prod) != 0) {
        fprintf(stderr, "fuzz_segment: create %s: %s\n", g_chunk, pdhal_last_error());
        abort();
    }
    if (pdhal_segment_open(g_chunk, PDHAL_KIND_CHUNK, 0, PDHAL_OPEN_EXCLUSIVE_READER,
                           &h.reader) != 0) {
        fprintf(stderr, "fuzz_segment: open %s: %s\n", g_chunk, pdhal_last_error());
        abort();
    }
    int fd = -1;
    h.map = map_file(g_chunk, h.map_bytes, PROT_READ | PROT_WRITE, &fd);
    if (!h.map) {
        perror("fuzz_segment: mapping the per-chunk segment");
        abort();
    }

    /* Legitimate traffic first: steps published (all layers), some records read. */
    uint8_t legit = in_u8(&in);
    for (uint32_t i = 0; i < (legit & 3u); i++) {
        int32_t table[6] = {(int32_t)i, 0, 16, (int32_t)i + 1, 16, 32};
        uint32_t layers = 1 + (legit >> 4 & 3);
        uint64_t step = 0;
        if (pdhal_ring_begin_step(h.prod, table, 1 + (i & 1), layers, 0, &step) != 0)
            break;
        for (uint32_t l = 0; l < layers; l++)
            pdhal_progress_publish(h.prod, (uint32_t)(step % h.slots),
                                   (step << PDHAL_LAYER_BITS) | (l + 1));
    }
    for (uint32_t i = 0; i < (legit >> 2 & 3u); i++)
        h_next(&h, PDHAL_RECORD_WORDS);

    static const size_t fields[][2] = {
        {OFF_HDR(progress), 8},   {OFF_HDR(seq), 4},        {OFF_HDR(waiters), 4},
        {OFF_HDR(latest_step), 8}, {OFF_HDR(consumed), 8},  {OFF_HDR(reader_seq), 4},
        {OFF_HDR(reader_waiters), 4}, {OFF_HDR(reader_pid), 4},
    };
    for (int n = 0; n < MAX_OPS && in.n; n++) {
        uint8_t op = in_u8(&in) % OP_COUNT;
        uint8_t *slot = h.map + HDR_BYTES;
        switch (op) {
        case OP_WRITE_HEADER: {
            size_t off = 64 + in_u8(&in) % (HDR_BYTES - 64);
            size_t len = 1 + in_u8(&in) % 16;
            if (off + len > HDR_BYTES)
                len = HDR_BYTES - off;
            in_bytes(&in, h.map + off, len);
            break;
        }
        case OP_WRITE_FIELD: {
            const size_t *f = fields[in_u8(&in) % (sizeof fields / sizeof fields[0])];
            put_le(h.map + f[0], f[1], pick_value(&in, &h));
            break;
        }
        case OP_WRITE_PROGRESS:
            slot += (size_t)(in_u8(&in) % h.slots) * SLOT_BYTES;
            put_le(slot + OFF_SLOT(progress), 8, pick_value(&in, &h));
            break;
        case OP_WRITE_COUNT:
            slot += (size_t)(in_u8(&in) % h.slots) * SLOT_BYTES;
            put_le(slot + OFF_SLOT(count), 4, in_le(&in, 4));
            break;
        case OP_WRITE_LAYERS:
            slot += (size_t)(in_u8(&in) % h.slots) * SLOT_BYTES;
            put_le(slot + OFF_SLOT(num_layers), 4, in_le(&in, 4));
            break;
        case OP_WRITE_TABLE: {
            slot += (size_t)(in_u8(&in) % h.slots) * SLOT_BYTES;
            size_t i = in_le(&in, 2) % (3 * PDHAL_MAX_REQUESTS);
            put_le(slot + OFF_SLOT(table) + 4 * i, 4, in_le(&in, 4));
            break;
        }
        case OP_WRITE_RAW: {
            size_t off = 64 + in_le(&in, 4) % (h.map_bytes - 64);
            size_t len = 1 + in_u8(&in) % 16;
            if (off + len > h.map_bytes)
                len = h.map_bytes - off;
            in_bytes(&in, h.map + off, len);
            break;
        }
        case OP_NEXT: {
            uint8_t c = in_u8(&in);
            h_next(&h, c & 0x80 ? c & 0x7f : PDHAL_RECORD_WORDS);
            break;
        }
        case OP_ACK:
            (void)pdhal_ring_ack(h.reader);
            break;
        case OP_BEGIN_STEP:
            h_begin(&h, &in);
            break;
        case OP_PUBLISH: {
            uint8_t b = in_u8(&in);
            if (b == 0xfd) { /* the per-query step counter, from a hostile progress word */
                uint64_t step = 0;
                if (pdhal_progress_begin_step(h.prod, &step) == 0 &&
                    get_le(h.map + OFF_HDR(progress), 8) != step << PDHAL_LAYER_BITS)
                    die("progress_begin_step returned a step it did not store");
                break;
            }
            pdhal_progress_publish(h.prod, pick_slot(&h, b), pick_value(&in, &h));
            break;
        }
        case OP_STORE: {
            uint32_t s = pick_slot(&h, in_u8(&in));
            pdhal_store *st = pdhal_store_new(h.prod, s, pick_value(&in, &h));
            if (!st != !(s == PDHAL_QUERY_SLOT || s < h.slots))
                die("store_new disagrees with the ring's size");
            if (st)
                pdhal_store_run(st);
            break;
        }
        case OP_WAIT: {
            uint64_t now = 0, since = pick_value(&in, &h);
            int rc = pdhal_progress_wait(h.reader, since, 1, in_u8(&in) & 1 ? 1000 : 0, &now);
            if (rc == 0 && now <= since)
                die("progress_wait returned progress not past `since`");
            break;
        }
        case OP_PROBE: {
            if (pdhal_segment_producer_alive(h.reader) != 1)
                die("the live producer looks dead");
            if (pdhal_segment_reader_attached(h.prod) != 1)
                die("the attached reader looks gone");
            pdhal_segment *second = NULL;
            if (pdhal_segment_open(g_chunk, PDHAL_KIND_CHUNK, 0, PDHAL_OPEN_EXCLUSIVE_READER,
                                   &second) != -EBUSY)
                die("a second exclusive reader was not refused");
            if (pdhal_segment_open(g_chunk, PDHAL_KIND_CHUNK, 0, 0, &second) == 0) {
                uint64_t step;
                if (pdhal_ring_next(second, h.out, PDHAL_RECORD_WORDS, 0, 0, &step) != -EPERM)
                    die("a plain handle read the ring");
                pdhal_segment_close(second);
            }
            break;
        }
        case OP_RESTART_READER: {
            pdhal_segment_close(h.reader);
            h.reader = NULL;
            if (in_u8(&in) & 1) /* no reader attached, one had been: -EPIPE when it must wait */
                h_begin(&h, &in);
            if (pdhal_segment_open(g_chunk, PDHAL_KIND_CHUNK, 0, PDHAL_OPEN_EXCLUSIVE_READER,
                                   &h.reader) != 0)
                die("the reader could not reopen its channel");
            break;
        }
        }
    }

    /* Whatever the ops left behind: the calls the task names, in order. */
    for (int i = 0; i < 4; i++)
        h_next(&h, PDHAL_RECORD_WORDS);
    (void)pdhal_ring_ack(h.reader);
    int32_t table[3] = {7, 0, 16};
    uint64_t step = 0;
    if (pdhal_ring_begin_step(h.prod, table, 1, 2, 0, &step) == 0) {
        pdhal_progress_publish(h.prod, (uint32_t)(step % h.slots), (step << PDHAL_LAYER_BITS) | 1);
        h_next(&h, PDHAL_RECORD_WORDS);
    }
    pdhal_progress_publish(h.prod, PDHAL_QUERY_SLOT, 1);

    munmap(h.map, h.map_bytes);
    close(fd);
    pdhal_segment_close(h.reader);
    pdhal_segment_close(h.prod); /* the creator unlinks the name */
}

/* The lowest free descriptor: one an input leaks raises it. Measured around each input, as
 * libFuzzer itself may keep new ones between inputs (the symbolizer's pipes). */
static int lowest_free_fd(void)
{
    int fd = dup(2);
    close(fd);
    return fd;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    int fd_floor = lowest_free_fd();
    uint8_t sel = data[0];
    int mode = g_force_mode >= 0 ? g_force_mode : (sel & 1);
    if (mode == 0)
        fuzz_validate(sel, data + 1, size - 1);
    else
        fuzz_hostile(data + 1, size - 1);
    if (lowest_free_fd() != fd_floor)
        die("a file descriptor leaked");
    return 0;
}
