/*
 * A host-memory stand-in for libcuda.so.1, written for pagedkv's CPU tests.
 *
 * It proves the Python side of the driver layer (argument passing, handle bookkeeping,
 * error mapping, kernel-argument packing, stream ordering) and, through the kernel
 * harness (tests/kernel_harness), runs the real kernel sources on the CPU: "device"
 * memory is malloc'd host memory, streams are queues of work that runs when the host
 * waits for it, and cuLaunchKernel queues the harness's compiled kernel with a copy of
 * its arguments. It is no GPU: no memory model, no concurrency between CTAs, no timing.
 * cuda-bindings resolves every entry point through cuGetProcAddress(_v2), so that is the
 * one lookup implemented (with the per-thread-default-stream variants).
 *
 * Test controls (stub_*) record each launch's parameters byte for byte, count calls per
 * entry point, inject a failure status into the next call of a named entry point, report
 * what is still live and the last fault of queued work. PAGEDKV_STUB_SMS sets the SM
 * count, PAGEDKV_HARNESS_LIBS lists the kernel libraries, PAGEDKV_HARNESS_ORDER the CTA
 * order (ascending, descending, random:SEED).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream, *CUevent;

/* ELASTIC (VMM): defined in its section at the end of the file */
static int vmm_supported;
static int vmm_range_ok(CUdeviceptr p, size_t n);
CUresult cuMemGetAllocationGranularity(size_t *, const void *, int);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemAddressFree(CUdeviceptr, size_t);
CUresult cuMemCreate(unsigned long long *, size_t, const void *, unsigned long long);
CUresult cuMemRelease(unsigned long long);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, unsigned long long, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuMemSetAccess(CUdeviceptr, size_t, const void *, size_t);

/* CUDASWAP (mapped pinned memory, batched copies): defined in its section at the end */
static int swap_driver_version(void);
static void swap_host_alloc_recorded(void *p, size_t size, unsigned flags);
static void swap_host_free_recorded(void *p);
static int swap_proc_address(const char *symbol, int version, void **pfn, int *status);
/* CAPTURE (CUDA graphs): defined in its section at the end of the file */
static const char *capture_status_name(int code, const char **text);
static int capture_unsafe_call(void);

enum {
    SUCCESS = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, NO_DEVICE = 100,
    INVALID_DEVICE = 101, INVALID_IMAGE = 200, INVALID_CONTEXT = 201, INVALID_HANDLE = 400,
    NOT_FOUND = 500, NOT_READY = 600, ILLEGAL_ADDRESS = 700, MISALIGNED_ADDRESS = 716, LAUNCH_FAILED = 719,
    NOT_SUPPORTED = 801,
};

/* ---- status names ------------------------------------------------------------------- */

static const struct { int code; const char *name, *text; } STATUS[] = {
    {SUCCESS, "CUDA_SUCCESS", "no error"},
    {INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {MISALIGNED_ADDRESS, "CUDA_ERROR_MISALIGNED_ADDRESS", "misaligned address"},
    {LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
};
#define NSTATUS (sizeof(STATUS) / sizeof(STATUS[0]))

CUresult cuGetErrorName(CUresult error, const char **out) {
    for (size_t i = 0; i < NSTATUS; i++)
        if (STATUS[i].code == error) { *out = STATUS[i].name; return SUCCESS; }
    const char *text;
    if ((*out = capture_status_name(error, &text))) return SUCCESS;
    return INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult error, const char **out) {
    for (size_t i = 0; i < NSTATUS; i++)
        if (STATUS[i].code == error) { *out = STATUS[i].text; return SUCCESS; }
    if (capture_status_name(error, out)) return SUCCESS;
    return INVALID_VALUE;
}

/* ---- call counting and failure injection --------------------------------------------- */

#define MAX_NAMES 64
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct { char name[48]; long calls; int fail_status; int fail_armed; } counters[MAX_NAMES];

static int counter_index(const char *name) {
    for (int i = 0; i < MAX_NAMES; i++) {
        if (counters[i].name[0] == 0) { strncpy(counters[i].name, name, 47); return i; }
        if (strcmp(counters[i].name, name) == 0) return i;
    }
    return MAX_NAMES - 1;
}

/* Count the call; return the injected status if one is armed for this entry point. */
static int enter(const char *name) {
    pthread_mutex_lock(&lock);
    int i = counter_index(name);
    counters[i].calls++;
    int status = SUCCESS;
    if (counters[i].fail_armed) { counters[i].fail_armed = 0; status = counters[i].fail_status; }
    pthread_mutex_unlock(&lock);
    return status;
}

#define ENTER(name) do { int injected_ = enter(name); if (injected_) return injected_; } while (0)

long stub_call_count(const char *name) {
    pthread_mutex_lock(&lock);
    long n = counters[counter_index(name)].calls;
    pthread_mutex_unlock(&lock);
    return n;
}

void stub_fail_next(const char *name, int status) {
    pthread_mutex_lock(&lock);
    int i = counter_index(name);
    counters[i].fail_status = status;
    counters[i].fail_armed = 1;
    pthread_mutex_unlock(&lock);
}

/* ---- driver, device, context ---------------------------------------------------------- */

static int initialised, init_status, device_count = 1, sm_count = -1, cc_major = 9, cc_minor = 0;
static size_t total_mem = (size_t)1 << 30, used_mem;
static int primary_refs;
static char primary_ctx_storage;
static __thread CUcontext current_ctx;

void stub_set_init_status(int status) { init_status = status; }
void stub_set_device_count(int n) { device_count = n; }
void stub_set_total_mem(size_t n) { total_mem = n; }
void stub_set_device(int sms, int major, int minor) { sm_count = sms; cc_major = major; cc_minor = minor; }
int stub_primary_refs(void) { return primary_refs; }

CUresult cuInit(unsigned flags) {
    ENTER("cuInit");
    if (flags != 0) return INVALID_VALUE;
    if (init_status) return init_status;
    initialised = 1;
    return SUCCESS;
}

CUresult cuDriverGetVersion(int *version) {
    ENTER("cuDriverGetVersion");
    if (!version) return INVALID_VALUE;
    *version = swap_driver_version();
    return SUCCESS;
}

#define NEED_INIT() do { if (!initialised) return NOT_INITIALIZED; } while (0)
static int sticky_status; /* a fault of queued work: every later call returns it */
static void reset_device(void);
static int drain_all(void);
#define NEED_CTX() do { NEED_INIT(); if (current_ctx != &primary_ctx_storage || primary_refs <= 0) return INVALID_CONTEXT; \
                        if (sticky_status) return sticky_status; } while (0)

CUresult cuDeviceGetCount(int *count) {
    ENTER("cuDeviceGetCount");
    NEED_INIT();
    *count = device_count;
    return SUCCESS;
}

CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    ENTER("cuDeviceGet");
    NEED_INIT();
    if (ordinal < 0 || ordinal >= device_count) return INVALID_DEVICE;
    *dev = ordinal;
    return SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    ENTER("cuDeviceGetName");
    NEED_INIT();
    if (dev < 0 || dev >= device_count || len <= 0) return INVALID_VALUE;
    snprintf(name, (size_t)len, "pagedkv stub device %d", dev);
    return SUCCESS;
}

CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice dev) {
    ENTER("cuDeviceGetAttribute");
    NEED_INIT();
    if (dev < 0 || dev >= device_count) return INVALID_DEVICE;
    switch (attribute) {
    case 16:
        if (sm_count < 0) {
            const char *env = getenv("PAGEDKV_STUB_SMS");
            char *end = NULL;
            long n = env ? strtol(env, &end, 10) : 4;
            if (env && (*env == 0 || *end != 0 || n <= 0 || n > 100000)) return INVALID_VALUE; /* not an SM count */
            sm_count = (int)n;
        }
        *value = sm_count;
        return SUCCESS;
    case 75: *value = cc_major; return SUCCESS;
    case 76: *value = cc_minor; return SUCCESS;
    case 102: *value = vmm_supported; return SUCCESS; /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    default: return INVALID_VALUE;
    }
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev) {
    ENTER("cuDevicePrimaryCtxRetain");
    NEED_INIT();
    if (dev < 0 || dev >= device_count) return INVALID_DEVICE;
    primary_refs++;
    *ctx = &primary_ctx_storage;
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
    ENTER("cuDevicePrimaryCtxRelease");
    NEED_INIT();
    if (dev < 0 || dev >= device_count) return INVALID_DEVICE;
    if (primary_refs <= 0) return INVALID_CONTEXT;
    primary_refs--;
    if (primary_refs == 0 && sticky_status) reset_device(); /* the context is destroyed */
    return SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    ENTER("cuCtxSetCurrent");
    NEED_INIT();
    if (ctx && ctx != &primary_ctx_storage) return INVALID_CONTEXT;
    current_ctx = ctx;
    return SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *ctx) {
    ENTER("cuCtxGetCurrent");
    NEED_INIT();
    *ctx = current_ctx;
    return SUCCESS;
}


/* ---- device memory: malloc'd host memory, every range checked ---------------------------- */

#define MAX_ALLOCS 4096
static struct { CUdeviceptr base; size_t size; void *map; size_t map_size; } allocs[MAX_ALLOCS];

/* Device memory is mapped with an inaccessible page on each side, the allocation ending
 * as close to the upper one as 256-byte alignment allows, so a kernel running past an
 * allocation faults (the harness reports CUDA_ERROR_ILLEGAL_ADDRESS) instead of
 * corrupting the host. */
static void *map_device(size_t size, void **map, size_t *map_size) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE), body = (size + 255) / 256 * 256;
    size_t pages = (body + page - 1) / page * page;
    char *m = mmap(NULL, pages + 2 * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return NULL;
    if (mprotect(m + page, pages, PROT_READ | PROT_WRITE) != 0) { munmap(m, pages + 2 * page); return NULL; }
    *map = m;
    *map_size = pages + 2 * page;
    return m + page + (pages - body);
}
static int nallocs;

int stub_live_allocations(void) { return nallocs; }

/* 1 when [p, p + n) lies inside one live allocation. */
static int device_range_ok(CUdeviceptr p, size_t n) {
    if (vmm_range_ok(p, n)) return 1;
    for (int i = 0; i < nallocs; i++)
        if (p >= allocs[i].base && p + n <= allocs[i].base + allocs[i].size && p + n >= p) return 1;
    return 0;
}

CUresult cuMemAlloc(CUdeviceptr *dptr, size_t size) {
    ENTER("cuMemAlloc");
    NEED_CTX();
    { int capture_st = capture_unsafe_call(); if (capture_st) return capture_st; }
    if (!dptr || size == 0) return INVALID_VALUE;
    if (size > total_mem - used_mem || nallocs == MAX_ALLOCS) return OUT_OF_MEMORY;
    void *map;
    size_t map_size;
    void *p = map_device(size, &map, &map_size);
    if (!p) return OUT_OF_MEMORY;
    memset(p, 0xA5, size); /* like the GPU, fresh memory is not zeroed */
    allocs[nallocs].base = (CUdeviceptr)(uintptr_t)p;
    allocs[nallocs].size = size;
    allocs[nallocs].map = map;
    allocs[nallocs].map_size = map_size;
    nallocs++;
    used_mem += size;
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return SUCCESS;
}

CUresult cuMemFree(CUdeviceptr dptr) {
    ENTER("cuMemFree");
    NEED_CTX();
    { int capture_st = capture_unsafe_call(); if (capture_st) return capture_st; }
    int st = drain_all(); /* like the driver, freeing waits for the device */
    if (st) return st;
    for (int i = 0; i < nallocs; i++) {
        if (allocs[i].base == dptr) {
            used_mem -= allocs[i].size;
            munmap(allocs[i].map, allocs[i].map_size);
            allocs[i] = allocs[--nallocs];
            return SUCCESS;
        }
    }
    return INVALID_VALUE;
}

CUresult cuMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    ENTER("cuMemGetInfo");
    NEED_CTX();
    *free_bytes = total_mem - used_mem;
    *total_bytes = total_mem;
    return SUCCESS;
}

#define MAX_HOST 256
static void *host_allocs[MAX_HOST];
static int nhost;

int stub_live_host_allocations(void) { return nhost; }

CUresult cuMemHostAlloc(void **pp, size_t size, unsigned flags) {
    ENTER("cuMemHostAlloc");
    NEED_CTX();
    { int capture_st = capture_unsafe_call(); if (capture_st) return capture_st; }
    if (!pp || size == 0 || nhost == MAX_HOST) return INVALID_VALUE;
    if (flags & ~7u) return INVALID_VALUE; /* PORTABLE | DEVICEMAP | WRITECOMBINED */
    *pp = aligned_alloc(4096, (size + 4095) / 4096 * 4096);
    if (!*pp) return OUT_OF_MEMORY;
    host_allocs[nhost++] = *pp;
    swap_host_alloc_recorded(*pp, size, flags);
    return SUCCESS;
}

CUresult cuMemFreeHost(void *p) {
    ENTER("cuMemFreeHost");
    NEED_CTX();
    { int capture_st = capture_unsafe_call(); if (capture_st) return capture_st; }
    int st = drain_all();
    if (st) return st;
    for (int i = 0; i < nhost; i++) {
        if (host_allocs[i] == p) {
            swap_host_free_recorded(p);
            free(p);
            host_allocs[i] = host_allocs[--nhost];
            return SUCCESS;
        }
    }
    return INVALID_VALUE;
}

/* ---- stream queues: async work runs when something waits for it --------------------------
 *
 * Launches, async copies, memsets and event records are queued on their stream and run
 * only when the host waits for them (cuStreamSynchronize, cuEventSynchronize,
 * cuCtxSynchronize, a synchronous copy, cuMemFree) or when queued work that is waited for
 * depends on them. Ordering follows the driver's rules: each stream is FIFO; work on the
 * legacy default stream waits for all earlier work of every blocking stream, and work on
 * a blocking stream waits for earlier legacy work; CU_STREAM_NON_BLOCKING streams do
 * neither; cuStreamWaitEvent makes later work wait for the event's work. A fault during
 * queued work is sticky: that wait and every later call return it, until the primary
 * context's last release resets the device.
 */

#define MAX_HANDLES 256
#define MAX_PARAMS 32

typedef struct Op Op;
typedef struct Stream {
    int blocking;      /* syncs with the legacy stream */
    Op *head, *tail;   /* pending work, FIFO */
    uint64_t last_seq; /* sequence number of the last work enqueued */
} Stream;

typedef struct Event {
    Stream *stream;
    uint64_t seq;      /* its record's work item; 0: never recorded */
    int done;
    double when_ms;
} Event;

typedef struct Function Function;

enum { OP_LAUNCH, OP_MEMSET, OP_COPY, OP_EVENT, OP_WAIT };

typedef struct Dep { Stream *stream; uint64_t seq; } Dep;

struct Op {
    int kind;
    uint64_t seq;
    Op *next;
    int ndeps;
    Dep *deps;
    /* OP_LAUNCH */
    Function *fn;
    unsigned grid[3], block[3];
    unsigned char *param_bytes;
    void *params[MAX_PARAMS];
    /* OP_MEMSET, OP_COPY */
    void *dst;
    const void *src;
    size_t n;
    int value;
    /* OP_EVENT */
    Event *event;
};

static pthread_mutex_t queue_lock = PTHREAD_MUTEX_INITIALIZER;

/* CAPTURE hooks (defined in its section at the end of the file; queue_lock held) */
static int capture_divert(Stream *s, Op *op);
static int capture_use_status(Stream *s);
static int capture_sync_status(Stream *s);
static int capture_ctx_sync_status(void);
static int capture_sync_copy_status(void);
static void capture_note_event(Event *e, Stream *s);
static void capture_forget_event(Event *e);
static int capture_event_status(Event *e);
static int capture_wait_status(Stream *s, Event *e);
static Stream legacy_stream = {1, NULL, NULL, 0};
static Stream *queues[2 * MAX_HANDLES]; /* created streams and per-thread default streams */
static int nqueues;
static uint64_t next_seq;
static char fault_message[512];
static __thread Stream *thread_stream; /* this thread's per-thread default stream */
static __thread int ptds_api;          /* inside a _ptds/_ptsz entry point */

/* The last fault of queued work ("" when none) and its status (0 when none). */
const char *stub_fault_message(void) { return fault_message; }
int stub_sticky_status(void) { return sticky_status; }


static Stream *per_thread_stream(void) {
    if (!thread_stream && nqueues < 2 * MAX_HANDLES) {
        thread_stream = calloc(1, sizeof(Stream));
        thread_stream->blocking = 1;
        queues[nqueues++] = thread_stream;
    }
    return thread_stream;
}

static void *stream_handles[MAX_HANDLES];
static int nstreams;

static int find_handle(void **table, int n, void *h) {
    for (int i = 0; i < n; i++) if (table[i] == h) return i;
    return -1;
}

/* The queue of a stream handle: 0 (legacy, or the per-thread stream inside a _ptds entry
 * point), 1 (CU_STREAM_LEGACY), 2 (CU_STREAM_PER_THREAD) or a live stream; NULL if none. */
static Stream *queue_of(CUstream s) {
    uintptr_t h = (uintptr_t)s;
    if (h == 0) return ptds_api ? per_thread_stream() : &legacy_stream; /* NULL: too many threads */
    if (h == 1) return &legacy_stream;
    if (h == 2) return per_thread_stream();
    return find_handle(stream_handles, nstreams, s) >= 0 ? (Stream *)s : NULL;
}

static int stream_ok(CUstream s) {
    pthread_mutex_lock(&queue_lock);
    int ok = queue_of(s) != NULL;
    pthread_mutex_unlock(&queue_lock);
    return ok;
}

static void add_dep(Op *op, Stream *s, uint64_t seq) {
    op->deps = realloc(op->deps, sizeof(Dep) * (size_t)(op->ndeps + 1));
    op->deps[op->ndeps].stream = s;
    op->deps[op->ndeps].seq = seq;
    op->ndeps++;
}

/* Append `op` to `s` with the legacy/blocking dependencies it has at this point. */
static void enqueue(Stream *s, Op *op) {
    op->seq = ++next_seq;
    if (capture_divert(s, op)) return;
    if (s == &legacy_stream) {
        for (int i = 0; i < nqueues; i++)
            if (queues[i]->blocking && queues[i]->head) add_dep(op, queues[i], queues[i]->last_seq);
    } else if (s->blocking && legacy_stream.head) {
        add_dep(op, &legacy_stream, legacy_stream.last_seq);
    }
    if (s->tail) s->tail->next = op; else s->head = op;
    s->tail = op;
    s->last_seq = op->seq;
}

static Op *new_op(int kind) {
    Op *op = calloc(1, sizeof(Op));
    op->kind = kind;
    return op;
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static int execute_launch(Op *op);

static int execute(Op *op) {
    switch (op->kind) {
    case OP_LAUNCH: return execute_launch(op);
    case OP_MEMSET: memset(op->dst, op->value, op->n); return SUCCESS;
    case OP_COPY: memmove(op->dst, op->src, op->n); return SUCCESS;
    case OP_EVENT:
        if (op->event && op->event->seq == op->seq) { op->event->done = 1; op->event->when_ms = now_ms(); }
        return SUCCESS;
    default: return SUCCESS; /* OP_WAIT: its dependency has run */
    }
}

static void free_op(Op *op) {
    free(op->deps);
    free(op->param_bytes);
    free(op);
}

/* Run the work of `s` up to sequence number `seq` (and what it depends on). */
static int run_until(Stream *s, uint64_t seq) {
    while (s->head && s->head->seq <= seq) {
        if (sticky_status) return sticky_status;
        Op *op = s->head;
        for (int i = 0; i < op->ndeps; i++) {
            int st = run_until(op->deps[i].stream, op->deps[i].seq);
            if (st) return st;
        }
        int st = execute(op);
        s->head = op->next;
        if (!s->head) s->tail = NULL;
        free_op(op);
        if (st) { sticky_status = st; return st; }
    }
    return sticky_status;
}

static int run_all(void) {
    int st = run_until(&legacy_stream, UINT64_MAX);
    for (int i = 0; i < nqueues && !st; i++) st = run_until(queues[i], UINT64_MAX);
    return st;
}

static int drain_all(void) {
    pthread_mutex_lock(&queue_lock);
    int st = run_all();
    pthread_mutex_unlock(&queue_lock);
    return st;
}

/* A synchronous operation on the legacy stream (or the per-thread one in a _ptds entry
 * point): everything it is ordered after has run when this returns 0. */
static int run_before_sync_op(void) {
    Stream *s = ptds_api ? per_thread_stream() : &legacy_stream;
    Op *op = new_op(OP_WAIT);
    enqueue(s, op);
    return run_until(s, op->seq);
}

/* Drop every queue and the sticky error: the device was reset. */
static void reset_queues(void) {
    Stream *all[2 * MAX_HANDLES + 1];
    int n = 0;
    all[n++] = &legacy_stream;
    for (int i = 0; i < nqueues; i++) all[n++] = queues[i];
    for (int i = 0; i < n; i++) {
        while (all[i]->head) { Op *op = all[i]->head; all[i]->head = op->next; free_op(op); }
        all[i]->tail = NULL;
    }
    sticky_status = 0;
}

CUresult cuCtxSynchronize(void) {
    ENTER("cuCtxSynchronize");
    NEED_CTX();
    pthread_mutex_lock(&queue_lock);
    int st = capture_ctx_sync_status();
    if (!st) st = run_all();
    pthread_mutex_unlock(&queue_lock);
    return st;
}

/* ---- streams and events ------------------------------------------------------------------ */

static void *events[MAX_HANDLES];
static int nevents;

int stub_live_streams(void) { return nstreams; }
int stub_live_events(void) { return nevents; }

/* Work queued and not yet run, on every stream. */
int stub_pending_work(void) {
    pthread_mutex_lock(&queue_lock);
    int n = 0;
    for (Op *op = legacy_stream.head; op; op = op->next) n++;
    for (int i = 0; i < nqueues; i++) for (Op *op = queues[i]->head; op; op = op->next) n++;
    pthread_mutex_unlock(&queue_lock);
    return n;
}

CUresult cuStreamCreate(CUstream *s, unsigned flags) {
    ENTER("cuStreamCreate");
    NEED_CTX();
    if (!s || flags > 1 || nstreams == MAX_HANDLES) return INVALID_VALUE;
    Stream *q = calloc(1, sizeof(Stream));
    q->blocking = flags == 0;
    pthread_mutex_lock(&queue_lock);
    stream_handles[nstreams++] = q;
    queues[nqueues++] = q;
    pthread_mutex_unlock(&queue_lock);
    *s = q;
    return SUCCESS;
}

CUresult cuStreamDestroy(CUstream s) {
    ENTER("cuStreamDestroy");
    NEED_CTX();
    pthread_mutex_lock(&queue_lock);
    int i = find_handle(stream_handles, nstreams, s);
    if (i < 0) { pthread_mutex_unlock(&queue_lock); return INVALID_HANDLE; }
    /* the driver finishes a destroyed stream's work; here all queued work runs now, so no
     * later work is left depending on the freed queue */
    int st = run_all();
    if (st) { pthread_mutex_unlock(&queue_lock); return st; }
    stream_handles[i] = stream_handles[--nstreams];
    int q = find_handle((void **)queues, nqueues, s);
    queues[q] = queues[--nqueues];
    free(s);
    pthread_mutex_unlock(&queue_lock);
    return SUCCESS;
}

static CUresult stream_synchronize(CUstream s) {
    NEED_CTX();
    pthread_mutex_lock(&queue_lock);
    Stream *q = queue_of(s);
    int st = q ? capture_sync_status(q) : INVALID_HANDLE;
    if (!st) st = run_until(q, q->last_seq);
    pthread_mutex_unlock(&queue_lock);
    return st;
}
CUresult cuStreamSynchronize(CUstream s) { ENTER("cuStreamSynchronize"); return stream_synchronize(s); }

static CUresult stream_query(CUstream s) {
    NEED_CTX();
    pthread_mutex_lock(&queue_lock);
    Stream *q = queue_of(s);
    int st = !q ? INVALID_HANDLE : capture_sync_status(q);
    if (!st) st = q->head ? NOT_READY : SUCCESS;
    pthread_mutex_unlock(&queue_lock);
    return st;
}
CUresult cuStreamQuery(CUstream s) { ENTER("cuStreamQuery"); return stream_query(s); }

CUresult cuEventCreate(CUevent *e, unsigned flags) {
    ENTER("cuEventCreate");
    NEED_CTX();
    if (!e || flags > 15 || nevents == MAX_HANDLES) return INVALID_VALUE;
    Event *ev = calloc(1, sizeof(Event));
    *e = ev;
    events[nevents++] = ev;
    return SUCCESS;
}

CUresult cuEventDestroy(CUevent e) {
    ENTER("cuEventDestroy");
    NEED_CTX();
    pthread_mutex_lock(&queue_lock);
    int i = find_handle(events, nevents, e);
    if (i < 0) { pthread_mutex_unlock(&queue_lock); return INVALID_HANDLE; }
    /* queued records of a destroyed event still run; they must not touch it */
    Stream *all[2 * MAX_HANDLES + 1];
    int n = 0;
    all[n++] = &legacy_stream;
    for (int k = 0; k < nqueues; k++) all[n++] = queues[k];
    for (int k = 0; k < n; k++)
        for (Op *op = all[k]->head; op; op = op->next)
            if (op->event == e) op->event = NULL;
    capture_forget_event(e);
    free(e);
    events[i] = events[--nevents];
    pthread_mutex_unlock(&queue_lock);
    return SUCCESS;
}

static CUresult event_record(CUevent e, CUstream s) {
    NEED_CTX();
    pthread_mutex_lock(&queue_lock);
    Stream *q = queue_of(s);
    if (find_handle(events, nevents, e) < 0 || !q) { pthread_mutex_unlock(&queue_lock); return INVALID_HANDLE; }
    int capture_st = capture_use_status(q);
    if (capture_st) { pthread_mutex_unlock(&queue_lock); return capture_st; }
    Op *op = new_op(OP_EVENT);
    op->event = e;
    enqueue(q, op);
    ((Event *)e)->stream = q;
    ((Event *)e)->seq = op->seq;
    ((Event *)e)->done = 0;
    capture_note_event(e, q);
    pthread_mutex_unlock(&queue_lock);
    return SUCCESS;
}
CUresult cuEventRecord(CUevent e, CUstream s) { ENTER("cuEventRecord"); return event_record(e, s); }

CUresult cuEventSynchronize(CUevent e) {
    ENTER("cuEventSynchronize");
    NEED_CTX();
    pthread_mutex_lock(&queue_lock);
    int st = SUCCESS;
    if (find_handle(events, nevents, e) < 0) st = INVALID_HANDLE;
    else if ((st = capture_event_status(e))) {}
    else if (((Event *)e)->seq && !((Event *)e)->done) st = run_until(((Event *)e)->stream, ((Event *)e)->seq);
    pthread_mutex_unlock(&queue_lock);
    return st;
}

CUresult cuEventQuery(CUevent e) {
    ENTER("cuEventQuery");
    NEED_CTX();
    pthread_mutex_lock(&queue_lock);
    int st = find_handle(events, nevents, e) < 0 ? INVALID_HANDLE
             : capture_event_status(e) ? 900 /* CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED */
             : (((Event *)e)->seq && !((Event *)e)->done) ? NOT_READY : SUCCESS;
    pthread_mutex_unlock(&queue_lock);
    return st;
}

static CUresult stream_wait_event(CUstream s, CUevent e, unsigned flags) {
    NEED_CTX();
    pthread_mutex_lock(&queue_lock);
    Stream *q = queue_of(s);
    int st = SUCCESS;
    if (!q || find_handle(events, nevents, e) < 0) st = INVALID_HANDLE;
    else if (flags != 0) st = INVALID_VALUE;
    else if ((st = capture_use_status(q)) || (st = capture_wait_status(q, e))) {}
    else {
        Op *op = new_op(OP_WAIT);
        Event *ev = e;
        if (ev->seq && !ev->done) add_dep(op, ev->stream, ev->seq);
        enqueue(q, op);
    }
    pthread_mutex_unlock(&queue_lock);
    return st;
}
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags) { ENTER("cuStreamWaitEvent"); return stream_wait_event(s, e, flags); }

CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end) {
    ENTER("cuEventElapsedTime");
    NEED_CTX();
    if (find_handle(events, nevents, start) < 0 || find_handle(events, nevents, end) < 0) return INVALID_HANDLE;
    if (!((Event *)start)->done || !((Event *)end)->done) return NOT_READY;
    *ms = (float)(((Event *)end)->when_ms - ((Event *)start)->when_ms);
    return SUCCESS;
}

/* ---- memset and copies ------------------------------------------------------------------ */

static CUresult enqueue_bytes(int kind, CUstream s, void *dst, const void *src, int value, size_t n) {
    pthread_mutex_lock(&queue_lock);
    Stream *q = queue_of(s);
    if (!q) { pthread_mutex_unlock(&queue_lock); return INVALID_HANDLE; }
    int capture_st = capture_use_status(q);
    if (capture_st) { pthread_mutex_unlock(&queue_lock); return capture_st; }
    Op *op = new_op(kind);
    op->dst = dst; op->src = src; op->value = value; op->n = n;
    enqueue(q, op);
    pthread_mutex_unlock(&queue_lock);
    return SUCCESS;
}

/* A synchronous copy: waits for the work it is ordered after, then copies. */
static CUresult sync_copy(void *dst, const void *src, size_t n) {
    pthread_mutex_lock(&queue_lock);
    int st = capture_sync_copy_status();
    if (!st) st = run_before_sync_op();
    if (!st) memmove(dst, src, n);
    pthread_mutex_unlock(&queue_lock);
    return st;
}

static CUresult memset_d8_async(CUdeviceptr dst, unsigned char value, size_t n, CUstream s) {
    NEED_CTX();
    if (!stream_ok(s)) return INVALID_HANDLE;
    if (!device_range_ok(dst, n)) return INVALID_VALUE;
    return enqueue_bytes(OP_MEMSET, s, (void *)(uintptr_t)dst, NULL, value, n);
}
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n, CUstream s) {
    ENTER("cuMemsetD8Async");
    return memset_d8_async(dst, value, n, s);
}

static CUresult memcpy_htod(CUdeviceptr dst, const void *src, size_t n) {
    NEED_CTX();
    if (!device_range_ok(dst, n) || !src) return INVALID_VALUE;
    return sync_copy((void *)(uintptr_t)dst, src, n);
}
CUresult cuMemcpyHtoD(CUdeviceptr dst, const void *src, size_t n) { ENTER("cuMemcpyHtoD"); return memcpy_htod(dst, src, n); }

static CUresult memcpy_dtoh(void *dst, CUdeviceptr src, size_t n) {
    NEED_CTX();
    if (!device_range_ok(src, n) || !dst) return INVALID_VALUE;
    return sync_copy(dst, (const void *)(uintptr_t)src, n);
}
CUresult cuMemcpyDtoH(void *dst, CUdeviceptr src, size_t n) { ENTER("cuMemcpyDtoH"); return memcpy_dtoh(dst, src, n); }

static CUresult memcpy_dtod(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    NEED_CTX();
    if (!device_range_ok(dst, n) || !device_range_ok(src, n)) return INVALID_VALUE;
    return sync_copy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
}
CUresult cuMemcpyDtoD(CUdeviceptr dst, CUdeviceptr src, size_t n) { ENTER("cuMemcpyDtoD"); return memcpy_dtod(dst, src, n); }

static CUresult memcpy_htod_async(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    NEED_CTX();
    if (!stream_ok(s)) return INVALID_HANDLE;
    if (!device_range_ok(dst, n) || !src) return INVALID_VALUE;
    return enqueue_bytes(OP_COPY, s, (void *)(uintptr_t)dst, src, 0, n);
}
CUresult cuMemcpyHtoDAsync(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    ENTER("cuMemcpyHtoDAsync");
    return memcpy_htod_async(dst, src, n, s);
}

static CUresult memcpy_dtoh_async(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    NEED_CTX();
    if (!stream_ok(s)) return INVALID_HANDLE;
    if (!device_range_ok(src, n) || !dst) return INVALID_VALUE;
    return enqueue_bytes(OP_COPY, s, dst, (const void *)(uintptr_t)src, 0, n);
}
CUresult cuMemcpyDtoHAsync(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    ENTER("cuMemcpyDtoHAsync");
    return memcpy_dtoh_async(dst, src, n, s);
}

static CUresult memcpy_dtod_async(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    NEED_CTX();
    if (!stream_ok(s)) return INVALID_HANDLE;
    if (!device_range_ok(dst, n) || !device_range_ok(src, n)) return INVALID_VALUE;
    return enqueue_bytes(OP_COPY, s, (void *)(uintptr_t)dst, (const void *)(uintptr_t)src, 0, n);
}
CUresult cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    ENTER("cuMemcpyDtoDAsync");
    return memcpy_dtod_async(dst, src, n, s);
}

/* ---- modules and kernels: the kernel harness libraries (tests/kernel_harness) ----------- */

typedef int (*HarnessCount)(void);
typedef const char *(*HarnessName)(int);
typedef int (*HarnessParams)(int, int *, int *, int);
typedef int (*HarnessLaunch)(int, const unsigned *, const unsigned *, void **, int, unsigned long long, char *, int);
typedef int (*HarnessMaxThreads)(int);

typedef struct {
    void *handle;
    HarnessCount count;
    HarnessName name;
    HarnessParams params;
    HarnessLaunch launch;
    HarnessMaxThreads max_threads;
} HarnessLib;

#define MAX_LIBS 32
static HarnessLib libs[MAX_LIBS];
static int nlibs = -1; /* -1: PAGEDKV_HARNESS_LIBS not read yet */
static char harness_error[512];

/* Why a library of PAGEDKV_HARNESS_LIBS could not be used ("" when all loaded). */
const char *stub_harness_error(void) { return harness_error; }

struct Function {
    char name[64];
    HarnessLib *lib;
    int index;
    int nparams;
    int sizes[MAX_PARAMS], aligns[MAX_PARAMS];
    int max_threads; /* __launch_bounds__, else 1024 */
};

#define MAX_FUNCTIONS 64
typedef struct { unsigned char *image; size_t size; Function functions[MAX_FUNCTIONS]; int nfunctions; } Module;

static void *modules[MAX_HANDLES];
static int nmodules;

int stub_live_modules(void) { return nmodules; }

/* dlopen every library named in PAGEDKV_HARNESS_LIBS (os.pathsep separated), once. */
static void load_harness(void) {
    if (nlibs >= 0) return;
    nlibs = 0;
    const char *list = getenv("PAGEDKV_HARNESS_LIBS");
    if (!list) return;
    char *copy = strdup(list), *save = NULL;
    for (char *path = strtok_r(copy, ":", &save); path && nlibs < MAX_LIBS; path = strtok_r(NULL, ":", &save)) {
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            if (!harness_error[0]) snprintf(harness_error, sizeof harness_error, "%s", dlerror());
            continue;
        }
        HarnessLib *lib = &libs[nlibs];
        lib->handle = h;
        lib->count = (HarnessCount)dlsym(h, "pkv_harness_kernel_count");
        lib->name = (HarnessName)dlsym(h, "pkv_harness_kernel_name");
        lib->params = (HarnessParams)dlsym(h, "pkv_harness_kernel_params");
        lib->launch = (HarnessLaunch)dlsym(h, "pkv_harness_launch");
        lib->max_threads = (HarnessMaxThreads)dlsym(h, "pkv_harness_kernel_max_threads");
        if (lib->count && lib->name && lib->params && lib->launch && lib->max_threads) {
            nlibs++;
        } else {
            if (!harness_error[0]) snprintf(harness_error, sizeof harness_error, "%s is not a kernel harness library", path);
            dlclose(h);
        }
    }
    free(copy);
}

/* The library and index of kernel `name`, or NULL. */
static HarnessLib *find_kernel(const char *name, int *index) {
    load_harness();
    for (int l = 0; l < nlibs; l++) {
        int n = libs[l].count();
        for (int k = 0; k < n; k++)
            if (strcmp(libs[l].name(k), name) == 0) { *index = k; return &libs[l]; }
    }
    return NULL;
}

/* The parameter sizes of harness kernel `name` from its C++ signature (-1: no such kernel). */
int stub_kernel_params(const char *name, int *sizes, int max) {
    int index, aligns[MAX_PARAMS];
    HarnessLib *lib = find_kernel(name, &index);
    if (!lib) return -1;
    int n = lib->params(index, sizes, aligns, max);
    return n;
}

/* The size of an ELF64 image: the furthest of its section and program header tables. */
static size_t elf_size(const unsigned char *img) {
    uint64_t shoff, phoff;
    uint16_t phentsize, phnum, shentsize, shnum;
    memcpy(&phoff, img + 0x20, 8);
    memcpy(&shoff, img + 0x28, 8);
    memcpy(&phentsize, img + 0x36, 2);
    memcpy(&phnum, img + 0x38, 2);
    memcpy(&shentsize, img + 0x3A, 2);
    memcpy(&shnum, img + 0x3C, 2);
    size_t a = shoff + (size_t)shentsize * shnum, b = phoff + (size_t)phentsize * phnum;
    return a > b ? a : b;
}

CUresult cuModuleLoadData(CUmodule *mod, const void *image) {
    ENTER("cuModuleLoadData");
    NEED_CTX();
    const unsigned char *img = image;
    if (!mod || !img || memcmp(img, "\x7f" "ELF", 4) != 0 || img[4] != 2) return INVALID_IMAGE;
    Module *m = calloc(1, sizeof(Module));
    m->size = elf_size(img);
    m->image = malloc(m->size);
    memcpy(m->image, img, m->size);
    modules[nmodules++] = m;
    *mod = m;
    return SUCCESS;
}

CUresult cuModuleUnload(CUmodule mod) {
    ENTER("cuModuleUnload");
    NEED_CTX();
    int i = find_handle(modules, nmodules, mod);
    if (i < 0) return INVALID_HANDLE;
    int st = drain_all(); /* queued launches of its functions run first */
    if (st) return st;
    free(((Module *)mod)->image);
    free(mod);
    modules[i] = modules[--nmodules];
    return SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction *f, CUmodule mod, const char *name) {
    ENTER("cuModuleGetFunction");
    NEED_CTX();
    if (find_handle(modules, nmodules, mod) < 0) return INVALID_HANDLE;
    if (!f || !name) return INVALID_VALUE;
    Module *m = mod;
    /* the symbol must really be in the CUBIN NVRTC produced, and in a harness library */
    if (!memmem(m->image, m->size, name, strlen(name) + 1)) return NOT_FOUND;
    for (int i = 0; i < m->nfunctions; i++)
        if (strcmp(m->functions[i].name, name) == 0) { *f = &m->functions[i]; return SUCCESS; }
    int index;
    HarnessLib *lib = find_kernel(name, &index);
    if (!lib || m->nfunctions == MAX_FUNCTIONS || strlen(name) >= sizeof(m->functions[0].name)) return NOT_FOUND;
    Function *fn = &m->functions[m->nfunctions];
    int n = lib->params(index, fn->sizes, fn->aligns, MAX_PARAMS);
    if (n < 0 || n > MAX_PARAMS) return NOT_FOUND;
    strcpy(fn->name, name);
    fn->lib = lib;
    fn->index = index;
    fn->nparams = n;
    fn->max_threads = lib->max_threads(index);
    m->nfunctions++;
    *f = fn;
    return SUCCESS;
}

/* ---- launches: recorded byte for byte, queued, then run by the harness ------------------ */

typedef struct {
    char name[48];
    unsigned grid[3], block[3], shared;
    uint64_t stream;
    int nparams;
    int sizes[8];
    unsigned char params[8][8];
} LaunchRecord;

#define MAX_LAUNCHES 1024
static LaunchRecord launches[MAX_LAUNCHES];
static long nlaunches;

long stub_launch_count(void) { return nlaunches; }

int stub_launch_get(long i, LaunchRecord *out) {
    if (i < 0 || i >= nlaunches || i >= MAX_LAUNCHES) return -1;
    *out = launches[i];
    return 0;
}

/* CTA order of launches: PAGEDKV_HARNESS_ORDER = ascending (default), descending or
 * random:SEED; -1 (and the reason in the fault message) for anything else. */
static int launch_order(unsigned long long *seed) {
    const char *s = getenv("PAGEDKV_HARNESS_ORDER");
    *seed = 0;
    if (!s || strcmp(s, "ascending") == 0) return 0;
    if (strcmp(s, "descending") == 0) return 1;
    if (strncmp(s, "random:", 7) == 0 && s[7] >= '0' && s[7] <= '9') {
        char *end;
        *seed = strtoull(s + 7, &end, 10);
        if (*end == 0) return 2;
    }
    snprintf(fault_message, sizeof fault_message,
             "PAGEDKV_HARNESS_ORDER=%.200s is not ascending, descending or random:SEED", s);
    return -1;
}

static int execute_launch(Op *op) {
    unsigned long long seed;
    int order = launch_order(&seed);
    if (order < 0) return INVALID_VALUE;
    Function *fn = op->fn;
    char message[400];
    int st = fn->lib->launch(fn->index, op->grid, op->block, op->params, order, seed, message, (int)sizeof message);
    if (st) snprintf(fault_message, sizeof fault_message, "%s", message);
    return st;
}

static CUresult launch_kernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                              unsigned bz, unsigned shared, CUstream s, void **params, void **extra) {
    NEED_CTX();
    if (!f || !params || extra) return INVALID_VALUE;
    if (!stream_ok(s)) return INVALID_HANDLE;
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || bx * by * bz > 1024) return INVALID_VALUE;
    if (shared != 0) return INVALID_VALUE; /* the harness has no dynamic shared memory yet */
    Function *fn = f;
    if (bx * by * bz > (unsigned)fn->max_threads) return INVALID_VALUE; /* past its __launch_bounds__ */
    unsigned long long seed;
    if (launch_order(&seed) < 0) return INVALID_VALUE;
    /* the packed arguments must be laid out for the C++ parameter types: each pointer
     * aligned for its type, and consecutive pointers into one argument block at least
     * the previous parameter's size apart */
    for (int i = 0; i < fn->nparams; i++) {
        if (!params[i] || (uintptr_t)params[i] % (uintptr_t)fn->aligns[i]) return INVALID_VALUE;
        if (i > 0) {
            intptr_t gap = (intptr_t)params[i] - (intptr_t)params[i - 1];
            if (gap > 0 && gap < 256 && gap < fn->sizes[i - 1]) return INVALID_VALUE;
        }
    }
    LaunchRecord *rec = &launches[nlaunches % MAX_LAUNCHES];
    memset(rec, 0, sizeof(*rec));
    strncpy(rec->name, fn->name, sizeof(rec->name) - 1);
    rec->grid[0] = gx; rec->grid[1] = gy; rec->grid[2] = gz;
    rec->block[0] = bx; rec->block[1] = by; rec->block[2] = bz;
    rec->shared = shared;
    rec->stream = (uint64_t)(uintptr_t)s;
    rec->nparams = fn->nparams < 8 ? fn->nparams : 8;
    for (int i = 0; i < rec->nparams; i++) {
        rec->sizes[i] = fn->sizes[i] < 8 ? fn->sizes[i] : 8;
        memcpy(rec->params[i], params[i], (size_t)rec->sizes[i]);
    }
    nlaunches++;
    /* the driver copies the arguments at launch: the caller may reuse its buffer at once */
    size_t total = 0, at = 0;
    for (int i = 0; i < fn->nparams; i++) total += ((size_t)fn->sizes[i] + 15) / 16 * 16;
    Op *op = new_op(OP_LAUNCH);
    op->fn = fn;
    op->grid[0] = gx; op->grid[1] = gy; op->grid[2] = gz;
    op->block[0] = bx; op->block[1] = by; op->block[2] = bz;
    op->param_bytes = aligned_alloc(16, total ? total : 16);
    for (int i = 0; i < fn->nparams; i++) {
        memcpy(op->param_bytes + at, params[i], (size_t)fn->sizes[i]);
        op->params[i] = op->param_bytes + at;
        at += ((size_t)fn->sizes[i] + 15) / 16 * 16;
    }
    pthread_mutex_lock(&queue_lock);
    Stream *q = queue_of(s);
    int capture_st = q ? capture_use_status(q) : INVALID_HANDLE;
    if (!capture_st) enqueue(q, op);
    pthread_mutex_unlock(&queue_lock);
    if (capture_st) { free_op(op); return capture_st; }
    return SUCCESS;
}

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, CUstream s, void **params, void **extra) {
    ENTER("cuLaunchKernel");
    return launch_kernel(f, gx, gy, gz, bx, by, bz, shared, s, params, extra);
}

/* ---- per-thread-default-stream entry points (cuGetProcAddress with PER_THREAD flags) ---- */

#define PTDS(ret, name, counted, params, args) \
    static ret name##_ptds params { ENTER(counted); ptds_api = 1; ret r = args; ptds_api = 0; return r; }
PTDS(CUresult, cuMemcpyHtoD, "cuMemcpyHtoD", (CUdeviceptr d, const void *s, size_t n), memcpy_htod(d, s, n))
PTDS(CUresult, cuMemcpyDtoH, "cuMemcpyDtoH", (void *d, CUdeviceptr s, size_t n), memcpy_dtoh(d, s, n))
PTDS(CUresult, cuMemcpyDtoD, "cuMemcpyDtoD", (CUdeviceptr d, CUdeviceptr s, size_t n), memcpy_dtod(d, s, n))
PTDS(CUresult, cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync", (CUdeviceptr d, const void *s, size_t n, CUstream st),
     memcpy_htod_async(d, s, n, st))
PTDS(CUresult, cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync", (void *d, CUdeviceptr s, size_t n, CUstream st),
     memcpy_dtoh_async(d, s, n, st))
PTDS(CUresult, cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync", (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st),
     memcpy_dtod_async(d, s, n, st))
PTDS(CUresult, cuMemsetD8Async, "cuMemsetD8Async", (CUdeviceptr d, unsigned char v, size_t n, CUstream st),
     memset_d8_async(d, v, n, st))
PTDS(CUresult, cuStreamSynchronize, "cuStreamSynchronize", (CUstream s), stream_synchronize(s))
PTDS(CUresult, cuStreamQuery, "cuStreamQuery", (CUstream s), stream_query(s))
PTDS(CUresult, cuEventRecord, "cuEventRecord", (CUevent e, CUstream s), event_record(e, s))
PTDS(CUresult, cuStreamWaitEvent, "cuStreamWaitEvent", (CUstream s, CUevent e, unsigned f), stream_wait_event(s, e, f))
PTDS(CUresult, cuLaunchKernel, "cuLaunchKernel",
     (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sh,
      CUstream s, void **p, void **x),
     launch_kernel(f, gx, gy, gz, bx, by, bz, sh, s, p, x))
#undef PTDS

/* The primary context was destroyed after a fault: its memory, streams, events and modules
 * go with it, and the device is usable again. */
static void reset_device(void) {
    pthread_mutex_lock(&queue_lock);
    reset_queues();
    for (int i = 0; i < nallocs; i++) munmap(allocs[i].map, allocs[i].map_size);
    nallocs = 0;
    used_mem = 0;
    for (int i = 0; i < nhost; i++) { swap_host_free_recorded(host_allocs[i]); free(host_allocs[i]); }
    nhost = 0;
    for (int i = 0; i < nstreams; i++) {
        int q = find_handle((void **)queues, nqueues, stream_handles[i]);
        queues[q] = queues[--nqueues];
        free(stream_handles[i]);
    }
    nstreams = 0;
    for (int i = 0; i < nevents; i++) free(events[i]);
    nevents = 0;
    for (int i = 0; i < nmodules; i++) { free(((Module *)modules[i])->image); free(modules[i]); }
    nmodules = 0;
    pthread_mutex_unlock(&queue_lock);
}

/* ---- entry-point lookup, as cuda-bindings does it ----------------------------------------- */

typedef struct { const char *name; void *fn; void *ptds; } EntryPoint;
static const EntryPoint ENTRY_POINTS[] = {
#define EP(f) {#f, (void *)f, NULL}
#define EP2(f) {#f, (void *)f, (void *)f##_ptds}
    EP(cuGetErrorName), EP(cuGetErrorString), EP(cuInit), EP(cuDriverGetVersion),
    EP(cuDeviceGetCount), EP(cuDeviceGet), EP(cuDeviceGetName), EP(cuDeviceGetAttribute),
    EP(cuDevicePrimaryCtxRetain), EP(cuDevicePrimaryCtxRelease), EP(cuCtxSetCurrent),
    EP(cuCtxGetCurrent), EP(cuCtxSynchronize), EP(cuMemAlloc), EP(cuMemFree), EP(cuMemGetInfo),
    EP(cuMemHostAlloc), EP(cuMemFreeHost), EP(cuStreamCreate), EP(cuStreamDestroy),
    EP2(cuStreamSynchronize), EP2(cuStreamQuery), EP(cuEventCreate), EP(cuEventDestroy), EP2(cuEventRecord),
    EP(cuEventSynchronize), EP(cuEventQuery), EP(cuEventElapsedTime), EP2(cuStreamWaitEvent),
    EP2(cuMemsetD8Async), EP2(cuMemcpyHtoD), EP2(cuMemcpyDtoH), EP2(cuMemcpyDtoD), EP2(cuMemcpyHtoDAsync),
    EP2(cuMemcpyDtoHAsync), EP2(cuMemcpyDtoDAsync), EP(cuModuleLoadData), EP(cuModuleUnload),
    EP(cuModuleGetFunction), EP2(cuLaunchKernel),
    EP(cuMemGetAllocationGranularity), EP(cuMemAddressReserve), EP(cuMemAddressFree), EP(cuMemCreate), EP(cuMemRelease), EP(cuMemMap), EP(cuMemUnmap), EP(cuMemSetAccess),
#undef EP
#undef EP2
};
#define NENTRY (sizeof(ENTRY_POINTS) / sizeof(ENTRY_POINTS[0]))

#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 2

static void *lookup(const char *symbol, uint64_t flags) {
    for (size_t i = 0; i < NENTRY; i++)
        if (strcmp(ENTRY_POINTS[i].name, symbol) == 0)
            return (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && ENTRY_POINTS[i].ptds
                       ? ENTRY_POINTS[i].ptds : ENTRY_POINTS[i].fn;
    /* any other cu* function this library exports (entry points added further down) */
    if (strncmp(symbol, "cu", 2) != 0) return NULL;
    Dl_info self;
    if (!dladdr((void *)lookup, &self)) return NULL;
    void *handle = dlopen(self.dli_fname, RTLD_NOW | RTLD_NOLOAD);
    if (!handle) return NULL;
    void *fn = dlsym(handle, symbol);
    Dl_info where;
    if (fn && (!dladdr(fn, &where) || strcmp(where.dli_fname, self.dli_fname) != 0)) fn = NULL; /* not ours */
    dlclose(handle);
    return fn;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status) {
    enter("cuGetProcAddress");
    if (!symbol || !pfn) return INVALID_VALUE;
    int swap = swap_proc_address(symbol, version, pfn, status);
    if (swap >= 0) return swap;
    *pfn = lookup(symbol, flags);
    if (status) *status = *pfn ? 0 : 1; /* CU_GET_PROC_ADDRESS_SUCCESS / SYMBOL_NOT_FOUND */
    return *pfn ? SUCCESS : NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}

/* libnvrtc asks for private tables; it compiles without them. */
CUresult cuGetExportTable(const void **table, const void *id) {
    (void)id;
    ENTER("cuGetExportTable");
    if (table) *table = NULL;
    return NOT_SUPPORTED;
}

/* ---- DRIVER additions ---------------------------------------------------------------- */
/* Entry points the driver layer needs beyond the core set (lookup() finds any exported cu*). */

static int occupancy_per_sm = 8;

void stub_set_occupancy(int per_sm) { occupancy_per_sm = per_sm; }

CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *num_blocks, CUfunction f, int block_size, size_t smem) {
    ENTER("cuOccupancyMaxActiveBlocksPerMultiprocessor");
    NEED_CTX();
    if (!num_blocks || !f || block_size <= 0 || block_size > 1024) return INVALID_VALUE;
    (void)smem;
    *num_blocks = occupancy_per_sm;
    return SUCCESS;
}

/* ---- ELASTIC (VMM) additions ---------------------------------------------------------------
 *
 * Virtual memory management on host memory with real protection: cuMemAddressReserve is an
 * mmap(PROT_NONE) of the range, cuMemCreate makes a physical handle (counted against the
 * device's total memory), cuMemMap binds a handle to a granule-aligned part of a
 * reservation (still PROT_NONE), cuMemSetAccess mprotects a mapped range read-write, and
 * cuMemUnmap makes it PROT_NONE again and drops its pages. So a kernel (run by the harness)
 * that touches an unmapped chunk takes a real SIGSEGV, which the harness turns into a failed
 * launch (CUDA_ERROR_ILLEGAL_ADDRESS, sticky); any other access (host code) meets a handler
 * that names the address and the reservation on stderr and lets the process die of the
 * signal. The context reset does not drop VMM state. Driver copies and memsets check their ranges first and return
 * CUDA_ERROR_INVALID_VALUE for a range that is not mapped with access. A handle can be
 * mapped at one place at a time (the stub cannot alias pages). stub_set_vmm_granularity sets
 * the granularity (default 2 MiB, a multiple of the page size); stub_set_vmm_supported(0)
 * makes the device report no VMM support (attribute 102).
 */
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_RESERVATIONS 1024
#define MAX_MEM_HANDLES 65536
static struct { CUdeviceptr base; size_t size; } reservations[MAX_RESERVATIONS];
static int nreservations;
typedef struct {
    size_t size;
    CUdeviceptr mapped_at; /* 0: not mapped */
    int access;            /* cuMemSetAccess granted read-write on the mapping */
    int released;          /* cuMemRelease called; freed once unmapped too */
} MemHandle;
static MemHandle *mem_handles[MAX_MEM_HANDLES];
static int nmem_handles;
static size_t vmm_granularity = (size_t)2 << 20;
static int vmm_supported = 1;
static struct sigaction previous_segv;
static int segv_installed;

void stub_set_vmm_granularity(size_t n) { vmm_granularity = n; }
void stub_set_vmm_supported(int on) { vmm_supported = on; }
int stub_live_reservations(void) { return nreservations; }
int stub_live_mem_handles(void) { return nmem_handles; }

static int reservation_of(CUdeviceptr p) {
    for (int i = 0; i < nreservations; i++)
        if (p >= reservations[i].base && p < reservations[i].base + reservations[i].size) return i;
    return -1;
}

/* 1 when [p, p + n) lies in one reservation and every byte is mapped with access. */
static int vmm_range_ok(CUdeviceptr p, size_t n) {
    int r = reservation_of(p);
    if (r < 0 || p + n < p || p + n > reservations[r].base + reservations[r].size) return 0;
    CUdeviceptr at = p, end = p + n;
    while (at < end) {
        int found = 0;
        for (int i = 0; i < nmem_handles; i++) {
            MemHandle *h = mem_handles[i];
            if (h->mapped_at && h->access && at >= h->mapped_at && at < h->mapped_at + h->size) {
                at = h->mapped_at + h->size;
                found = 1;
                break;
            }
        }
        if (!found) return 0;
    }
    return 1;
}

static void write_hex(char *out, unsigned long long v) {
    static const char digits[] = "0123456789abcdef";
    out[0] = '0'; out[1] = 'x';
    for (int i = 0; i < 16; i++) out[2 + i] = digits[(v >> (60 - 4 * i)) & 15];
    out[18] = 0;
}

static void segv_handler(int sig, siginfo_t *info, void *uc) {
    CUdeviceptr addr = (CUdeviceptr)(uintptr_t)info->si_addr;
    int r = reservation_of(addr);
    if (r >= 0) {
        char a[19], b[19], msg[256];
        write_hex(a, addr);
        write_hex(b, reservations[r].base);
        size_t n = 0;
        const char *parts[] = {"pagedkv stub: illegal address ", a, " (unmapped VMM chunk) in the reservation at ", b,
                               ": the device faulted\n"};
        for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++)
            for (const char *c = parts[i]; *c && n < sizeof msg; c++) msg[n++] = *c;
        ssize_t ignored = write(2, msg, n);
        (void)ignored;
        signal(SIGSEGV, SIG_DFL); /* returning re-runs the access, which now kills the process */
        return;
    }
    if (previous_segv.sa_flags & SA_SIGINFO) { previous_segv.sa_sigaction(sig, info, uc); return; }
    if (previous_segv.sa_handler == SIG_IGN) return;
    if (previous_segv.sa_handler != SIG_DFL) { previous_segv.sa_handler(sig); return; }
    signal(SIGSEGV, SIG_DFL);
}

static void install_segv_handler(void) {
    if (segv_installed) return;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = segv_handler;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &previous_segv);
    segv_installed = 1;
}

typedef struct { int type; int id; } CUmemLocation;
typedef struct { int type; int requestedHandleTypes; CUmemLocation location; } CUmemAllocationPropHead;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
typedef unsigned long long CUmemGenericAllocationHandle;

static int prop_ok(const void *prop) {
    const CUmemAllocationPropHead *p = prop;
    /* CU_MEM_ALLOCATION_TYPE_PINNED on CU_MEM_LOCATION_TYPE_DEVICE of an existing device */
    return p && p->type == 1 && p->location.type == 1 && p->location.id >= 0 && p->location.id < device_count;
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const void *prop, int option) {
    ENTER("cuMemGetAllocationGranularity");
    NEED_CTX();
    if (!granularity || !prop_ok(prop) || option < 0 || option > 1) return INVALID_VALUE;
    if (!vmm_supported) return NOT_SUPPORTED;
    *granularity = vmm_granularity;
    return SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
    ENTER("cuMemAddressReserve");
    NEED_CTX();
    if (!vmm_supported) return NOT_SUPPORTED;
    if (!ptr || size == 0 || size % vmm_granularity || flags || addr) return INVALID_VALUE;
    if (alignment & (alignment - 1)) return INVALID_VALUE;
    if (nreservations == MAX_RESERVATIONS) return OUT_OF_MEMORY;
    size_t align = alignment > vmm_granularity ? alignment : vmm_granularity;
    void *raw = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return OUT_OF_MEMORY;
    uintptr_t start = ((uintptr_t)raw + align - 1) / align * align;
    if (start > (uintptr_t)raw) munmap(raw, start - (uintptr_t)raw);
    uintptr_t tail = start + size, raw_end = (uintptr_t)raw + size + align;
    if (raw_end > tail) munmap((void *)tail, raw_end - tail);
    install_segv_handler();
    reservations[nreservations].base = start;
    reservations[nreservations].size = size;
    nreservations++;
    *ptr = start;
    return SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    ENTER("cuMemAddressFree");
    NEED_CTX();
    int r = reservation_of(ptr);
    if (r < 0 || reservations[r].base != ptr || reservations[r].size != size) return INVALID_VALUE;
    for (int i = 0; i < nmem_handles; i++)
        if (mem_handles[i]->mapped_at >= ptr && mem_handles[i]->mapped_at < ptr + size) return INVALID_VALUE;
    munmap((void *)(uintptr_t)ptr, size);
    reservations[r] = reservations[--nreservations];
    return SUCCESS;
}

static int handle_index(CUmemGenericAllocationHandle h) {
    for (int i = 0; i < nmem_handles; i++) if ((CUmemGenericAllocationHandle)(uintptr_t)mem_handles[i] == h) return i;
    return -1;
}

static void drop_handle(int i) {
    used_mem -= mem_handles[i]->size;
    free(mem_handles[i]);
    mem_handles[i] = mem_handles[--nmem_handles];
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const void *prop, unsigned long long flags) {
    ENTER("cuMemCreate");
    NEED_CTX();
    if (!vmm_supported) return NOT_SUPPORTED;
    if (!handle || size == 0 || size % vmm_granularity || flags || !prop_ok(prop)) return INVALID_VALUE;
    if (size > total_mem - used_mem || nmem_handles == MAX_MEM_HANDLES) return OUT_OF_MEMORY;
    MemHandle *h = calloc(1, sizeof(MemHandle));
    h->size = size;
    mem_handles[nmem_handles++] = h;
    used_mem += size;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)h;
    return SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    ENTER("cuMemRelease");
    NEED_CTX();
    int i = handle_index(handle);
    if (i < 0 || mem_handles[i]->released) return INVALID_HANDLE;
    mem_handles[i]->released = 1;
    if (!mem_handles[i]->mapped_at) drop_handle(i); /* a mapped one goes with its unmap */
    return SUCCESS;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    ENTER("cuMemMap");
    NEED_CTX();
    int i = handle_index(handle), r = reservation_of(ptr);
    if (i < 0 || mem_handles[i]->released) return INVALID_HANDLE;
    MemHandle *h = mem_handles[i];
    if (r < 0 || flags || offset || size != h->size || ptr % vmm_granularity) return INVALID_VALUE;
    if (ptr + size > reservations[r].base + reservations[r].size) return INVALID_VALUE;
    if (h->mapped_at) return NOT_SUPPORTED; /* the stub cannot map a handle twice */
    for (int k = 0; k < nmem_handles; k++) {
        MemHandle *o = mem_handles[k];
        if (o->mapped_at && o->mapped_at < ptr + size && ptr < o->mapped_at + o->size) return INVALID_VALUE;
    }
    h->mapped_at = ptr;
    h->access = 0; /* no access until cuMemSetAccess */
    return SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const void *descs, size_t count) {
    ENTER("cuMemSetAccess");
    const CUmemAccessDesc *desc = descs;
    NEED_CTX();
    if (!desc || count != 1 || desc[0].location.type != 1 || desc[0].location.id < 0 ||
        desc[0].location.id >= device_count)
        return INVALID_VALUE;
    int prot = desc[0].flags == 3 ? PROT_READ | PROT_WRITE : desc[0].flags == 1 ? PROT_READ : desc[0].flags == 0 ? PROT_NONE : -1;
    if (prot < 0) return INVALID_VALUE;
    /* the range must be covered by mappings end to end */
    CUdeviceptr at = ptr, end = ptr + size;
    if (size == 0 || end < ptr) return INVALID_VALUE;
    while (at < end) {
        int found = 0;
        for (int i = 0; i < nmem_handles; i++) {
            MemHandle *h = mem_handles[i];
            if (h->mapped_at && at >= h->mapped_at && at < h->mapped_at + h->size) {
                at = h->mapped_at + h->size;
                found = 1;
                break;
            }
        }
        if (!found) return INVALID_VALUE;
    }
    if (mprotect((void *)(uintptr_t)ptr, size, prot)) return INVALID_VALUE;
    for (int i = 0; i < nmem_handles; i++) {
        MemHandle *h = mem_handles[i];
        if (h->mapped_at >= ptr && h->mapped_at < end) {
            if (prot != PROT_NONE && !h->access) memset((void *)(uintptr_t)h->mapped_at, 0xA5, h->size); /* fresh memory is not zeroed */
            h->access = prot != PROT_NONE;
        }
    }
    return SUCCESS;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    ENTER("cuMemUnmap");
    NEED_CTX();
    int st = drain_all(); /* like the driver, unmapping waits for the device */
    if (st) return st;
    CUdeviceptr end = ptr + size;
    if (size == 0 || end < ptr || reservation_of(ptr) < 0) return INVALID_VALUE;
    /* the range must be exactly whole mappings */
    CUdeviceptr at = ptr;
    while (at < end) {
        int found = 0;
        for (int i = 0; i < nmem_handles; i++)
            if (mem_handles[i]->mapped_at == at) { at += mem_handles[i]->size; found = 1; break; }
        if (!found) return INVALID_VALUE;
    }
    if (at != end) return INVALID_VALUE;
    mprotect((void *)(uintptr_t)ptr, size, PROT_NONE);
    madvise((void *)(uintptr_t)ptr, size, MADV_DONTNEED);
    for (int i = nmem_handles - 1; i >= 0; i--) {
        MemHandle *h = mem_handles[i];
        if (h->mapped_at >= ptr && h->mapped_at < end) {
            h->mapped_at = 0;
            h->access = 0;
            if (h->released) drop_handle(i);
        }
    }
    return SUCCESS;
}
/* ---- end of ELASTIC (VMM) additions ---- */

/* ---- CUDASWAP (host tier batched swaps) additions ---------------------------------------
 *
 * Mapped pinned memory and the batched copy of the host tier:
 * - cuGetProcAddress("cuGetProcAddress", version >= 12000) is cuGetProcAddress_v2 (the
 *   ABI with symbolStatus, which cuda-bindings' own cuGetProcAddress calls).
 * - cuMemHostAlloc records each allocation's size and flags (PORTABLE 1, DEVICEMAP 2,
 *   WRITECOMBINED 4; other bits are refused); cuMemHostGetDevicePointer answers for any
 *   address inside a DEVICEMAP allocation (flags must be 0; the device address is the host
 *   address, as with unified addressing) and refuses anything else.
 * - cuMemcpyBatchAsync in both ABIs: the CUDA 12.8 one (`cuMemcpyBatchAsync`, with
 *   failIdx) and CUDA 13's (`cuMemcpyBatchAsync_v2`, without). cuGetProcAddress of
 *   "cuMemcpyBatchAsync" gives the 13 ABI for a requested version >= 13000, the 12.8 ABI
 *   for 12080..12999, no pointer with CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT below
 *   12080, and CUDA_ERROR_INVALID_VALUE above the driver version (stub_set_driver_version,
 *   default 13000, is also what cuDriverGetVersion reports). PAGEDKV_STUB_NO_BATCH_MEMCPY=1
 *   makes the symbol not found (CUDA_ERROR_NOT_FOUND, SYMBOL_NOT_FOUND), like an older
 *   driver. Like the driver, a batch is refused (CUDA_ERROR_INVALID_VALUE, nothing queued,
 *   failIdx set where the ABI has it) for: count 0, a null array, the legacy NULL stream
 *   (0 or CU_STREAM_LEGACY), attributes that are missing, out of order or invalid
 *   (srcAccessOrder not STREAM/DURING_API_CALL/ANY, unknown flags, unknown location
 *   types), or a copy of 0 bytes; and a copy whose ranges are not inside one device or
 *   pinned host allocation. A valid batch queues one copy per range on the stream.
 *   stub_batch_attr(i, out) reads attribute i of the last accepted batch (and returns how
 *   many there were).
 */

static int driver_version_reported = 13000;

void stub_set_driver_version(int version) { driver_version_reported = version; }
static int swap_driver_version(void) { return driver_version_reported; }

#define MAX_HOST_RECORDS 1024
static struct { uintptr_t base; size_t size; unsigned flags; } host_records[MAX_HOST_RECORDS];
static int nhost_records;

static void swap_host_alloc_recorded(void *p, size_t size, unsigned flags) {
    if (nhost_records < MAX_HOST_RECORDS) {
        host_records[nhost_records].base = (uintptr_t)p;
        host_records[nhost_records].size = size;
        host_records[nhost_records].flags = flags;
        nhost_records++;
    }
}

static void swap_host_free_recorded(void *p) {
    for (int i = 0; i < nhost_records; i++)
        if (host_records[i].base == (uintptr_t)p) { host_records[i] = host_records[--nhost_records]; return; }
}

/* The record holding [p, p + n), or -1. */
static int host_record_of(uintptr_t p, size_t n) {
    for (int i = 0; i < nhost_records; i++)
        if (p >= host_records[i].base && p + n <= host_records[i].base + host_records[i].size && p + n >= p) return i;
    return -1;
}

/* The flags a live cuMemHostAlloc allocation starting at `p` was made with (-1: none). */
int stub_host_alloc_flags(void *p) {
    for (int i = 0; i < nhost_records; i++)
        if (host_records[i].base == (uintptr_t)p) return (int)host_records[i].flags;
    return -1;
}

static CUresult host_get_device_pointer(CUdeviceptr *dptr, void *p, unsigned flags) {
    NEED_CTX();
    if (!dptr || !p || flags != 0) return INVALID_VALUE;
    int r = host_record_of((uintptr_t)p, 1);
    if (r < 0 || !(host_records[r].flags & 2)) return INVALID_VALUE; /* not mapped (no DEVICEMAP) */
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return SUCCESS;
}
CUresult cuMemHostGetDevicePointer(CUdeviceptr *dptr, void *p, unsigned flags) {
    ENTER("cuMemHostGetDevicePointer");
    return host_get_device_pointer(dptr, p, flags);
}
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *dptr, void *p, unsigned flags) {
    ENTER("cuMemHostGetDevicePointer");
    return host_get_device_pointer(dptr, p, flags);
}

typedef struct { int type; int id; } SwapMemLocation;
typedef struct { int srcAccessOrder; SwapMemLocation srcLocHint, dstLocHint; unsigned flags; } SwapMemcpyAttributes;

#define MAX_BATCH_ATTRS 64
static SwapMemcpyAttributes last_attrs[MAX_BATCH_ATTRS];
static size_t last_attr_idx[MAX_BATCH_ATTRS];
static int last_nattrs;

/* Attribute i of the last accepted batch into out (24 bytes) and its first copy index into
 * *first; returns how many attributes that batch had (-1 for i out of range). */
int stub_batch_attr(int i, SwapMemcpyAttributes *out, size_t *first) {
    if (i < 0 || i >= last_nattrs) return -1;
    if (out) *out = last_attrs[i];
    if (first) *first = last_attr_idx[i];
    return last_nattrs;
}

static int location_ok(SwapMemLocation loc) { return loc.type >= 0 && loc.type <= 4; }

static int batch_range_ok(CUdeviceptr p, size_t n) {
    return device_range_ok(p, n) || host_record_of((uintptr_t)p, n) >= 0;
}

static CUresult memcpy_batch(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                             SwapMemcpyAttributes *attrs, size_t *idxs, size_t nattrs, size_t *fail, CUstream s) {
    if (fail) *fail = SIZE_MAX;
    NEED_CTX();
    if (!dsts || !srcs || !sizes || !attrs || !idxs || count == 0) return INVALID_VALUE;
    if ((uintptr_t)s == 0 || (uintptr_t)s == 1) return INVALID_VALUE; /* "must not be legacy NULL stream" */
    if (!stream_ok(s)) return INVALID_HANDLE;
    if (nattrs == 0 || nattrs > count || idxs[0] != 0) return INVALID_VALUE;
    for (size_t k = 0; k < nattrs; k++) {
        if (k > 0 && idxs[k] <= idxs[k - 1]) return INVALID_VALUE;
        if (idxs[k] >= count) return INVALID_VALUE;
        if (attrs[k].srcAccessOrder < 1 || attrs[k].srcAccessOrder > 3) return INVALID_VALUE;
        if (attrs[k].flags & ~1u) return INVALID_VALUE;
        if (!location_ok(attrs[k].srcLocHint) || !location_ok(attrs[k].dstLocHint)) return INVALID_VALUE;
    }
    for (size_t i = 0; i < count; i++) {
        if (sizes[i] == 0 || !batch_range_ok(dsts[i], sizes[i]) || !batch_range_ok(srcs[i], sizes[i])) {
            if (fail) *fail = i;
            return INVALID_VALUE;
        }
    }
    pthread_mutex_lock(&queue_lock);
    Stream *q = queue_of(s);
    if (!q) { pthread_mutex_unlock(&queue_lock); return INVALID_HANDLE; }
    for (size_t i = 0; i < count; i++) {
        Op *op = new_op(OP_COPY);
        op->dst = (void *)(uintptr_t)dsts[i];
        op->src = (const void *)(uintptr_t)srcs[i];
        op->n = sizes[i];
        enqueue(q, op);
    }
    pthread_mutex_unlock(&queue_lock);
    last_nattrs = nattrs < MAX_BATCH_ATTRS ? (int)nattrs : MAX_BATCH_ATTRS;
    for (int k = 0; k < last_nattrs; k++) { last_attrs[k] = attrs[k]; last_attr_idx[k] = idxs[k]; }
    return SUCCESS;
}

/* the CUDA 12.8 ABI */
CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                            SwapMemcpyAttributes *attrs, size_t *idxs, size_t nattrs, size_t *fail, CUstream s) {
    ENTER("cuMemcpyBatchAsync");
    return memcpy_batch(dsts, srcs, sizes, count, attrs, idxs, nattrs, fail, s);
}

/* the CUDA 13 ABI */
CUresult cuMemcpyBatchAsync_v2(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                               SwapMemcpyAttributes *attrs, size_t *idxs, size_t nattrs, CUstream s) {
    ENTER("cuMemcpyBatchAsync");
    return memcpy_batch(dsts, srcs, sizes, count, attrs, idxs, nattrs, NULL, s);
}

/* cuGetProcAddress of the batched copy (-1: another symbol, looked up as before). */
static int swap_proc_address(const char *symbol, int version, void **pfn, int *status) {
    if (strcmp(symbol, "cuGetProcAddress") == 0 && version >= 12000) {
        /* since CUDA 12.0 the symbol's ABI is cuGetProcAddress_v2 (with symbolStatus) */
        *pfn = (void *)cuGetProcAddress_v2;
        if (status) *status = 0;
        return SUCCESS;
    }
    if (strcmp(symbol, "cuMemcpyBatchAsync") != 0) return -1;
    *pfn = NULL;
    const char *hide = getenv("PAGEDKV_STUB_NO_BATCH_MEMCPY");
    if (hide && strcmp(hide, "1") == 0) {
        if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
        return NOT_FOUND;
    }
    if (version > driver_version_reported) return INVALID_VALUE;
    if (version < 12080) {
        if (status) *status = 2; /* CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT */
        return SUCCESS;
    }
    *pfn = version >= 13000 ? (void *)cuMemcpyBatchAsync_v2 : (void *)cuMemcpyBatchAsync;
    if (status) *status = 0;
    return SUCCESS;
}
/* ---- end of CUDASWAP additions ---- */

/* ---- CAPTURE (CUDA graphs) additions -------------------------------------------------------
 *
 * Stream capture, the graphs it builds and their replay, with the driver's refusals of what
 * cannot be captured (the CUDA programming guide's "prohibited and unhandled operations"):
 *
 * - cuStreamBeginCapture(stream, mode) on a created stream (the legacy stream cannot
 *   capture: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED). From then on the stream's launches,
 *   async copies and memsets become graph nodes, in order, instead of queued work; an event
 *   record on it is a capture-internal record (no node; the event is then "captured"), a
 *   wait on it for an event of the same capture or one recorded outside any capture adds
 *   nothing (the stub has one linear chain per capture). Multi-stream capture (a stream
 *   joining a capture by waiting on a captured event) is not modelled: CUDA_ERROR_NOT_SUPPORTED.
 * - While a capture is ongoing (active, or invalidated and not ended):
 *   cuStreamSynchronize/cuStreamQuery of the capturing stream, cuCtxSynchronize, and
 *   cuEventSynchronize/cuEventQuery of a captured event return
 *   CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (900) and invalidate the capture; any use of the
 *   legacy stream (work, synchronous copies, synchronize, query) while a blocking stream
 *   captures returns CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (906) and invalidates those
 *   captures (cuStreamIsCapturing of the legacy stream returns 906 without invalidating);
 *   potentially unsafe calls (cuMemAlloc, cuMemFree, cuMemHostAlloc, cuMemFreeHost,
 *   synchronous copies) return 900 and invalidate the captures that prohibit them: under
 *   the calling thread's mode GLOBAL (the default; cuThreadExchangeStreamCaptureMode sets
 *   it) its own non-RELAXED captures and other threads' GLOBAL ones, under THREAD_LOCAL its
 *   own non-RELAXED ones, under RELAXED none. Work on an invalidated capturing stream
 *   returns CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (901).
 * - cuStreamEndCapture returns the graph, or 901 with a NULL graph for an invalidated
 *   capture (either way the stream leaves capture mode); CUDA_ERROR_ILLEGAL_STATE when the
 *   stream is not capturing, CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD (908) from another
 *   thread for a non-RELAXED capture.
 * - cuGraphInstantiate(exec, graph, flags) (cuGraphInstantiateWithFlags, as cuda-bindings 13
 *   calls it) copies the nodes;
 *   cuGraphLaunch(exec, stream) enqueues a copy of every node on the stream, in order, as
 *   ordinary queued work (kernels run by the harness when something waits; into a capture
 *   when that stream captures); cuGraphExecDestroy / cuGraphDestroy free them.
 * stub_live_graphs() / stub_live_graph_execs() count what is not destroyed yet;
 * stub_graph_nodes(graph) the nodes of a graph (-1: no such graph).
 */

enum {
    ILLEGAL_STATE = 401, CAPTURE_UNSUPPORTED = 900, CAPTURE_INVALIDATED = 901, CAPTURE_IMPLICIT = 906,
    CAPTURE_WRONG_THREAD = 908,
};
enum { CAPTURE_MODE_GLOBAL = 0, CAPTURE_MODE_THREAD_LOCAL = 1, CAPTURE_MODE_RELAXED = 2 };
enum { CAPTURE_NONE = 0, CAPTURE_ACTIVE = 1, CAPTURE_INVALID = 2 };

typedef struct Graph { Op **nodes; int n, cap; } Graph;
typedef struct GraphExec { Graph nodes; } GraphExec;
typedef struct Capture {
    Stream *stream;
    int status, mode;
    uint64_t id;
    pthread_t thread;
    Graph *graph;
} Capture;

static Capture captures[MAX_HANDLES];
static int ncaptures;
static uint64_t next_capture_id;
static struct { Event *event; uint64_t capture; } captured_events[MAX_HANDLES];
static int ncaptured_events;
static void *graphs[MAX_HANDLES], *graph_execs[MAX_HANDLES];
static int ngraphs, ngraph_execs;
static __thread int thread_capture_mode = CAPTURE_MODE_GLOBAL;

int stub_live_graphs(void) { return ngraphs; }
int stub_live_graph_execs(void) { return ngraph_execs; }

int stub_graph_nodes(void *graph) {
    pthread_mutex_lock(&queue_lock);
    int n = find_handle(graphs, ngraphs, graph) >= 0 ? ((Graph *)graph)->n : -1;
    pthread_mutex_unlock(&queue_lock);
    return n;
}

static const char *capture_status_name(int code, const char **text) {
    switch (code) {
    case ILLEGAL_STATE: *text = "operation not permitted in the current state"; return "CUDA_ERROR_ILLEGAL_STATE";
    case CAPTURE_UNSUPPORTED: *text = "operation not permitted when stream is capturing"; return "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
    case CAPTURE_INVALIDATED: *text = "operation failed due to a previous error during capture"; return "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED";
    case CAPTURE_IMPLICIT: *text = "operation would make the legacy stream depend on a capturing blocking stream"; return "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT";
    case CAPTURE_WRONG_THREAD: *text = "attempt to terminate a thread-local capture sequence from another thread"; return "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD";
    default: *text = NULL; return NULL;
    }
}

/* The capture of stream `s` (NULL when it does not capture). */
static Capture *capture_of(Stream *s) {
    for (int i = 0; i < ncaptures; i++) if (captures[i].stream == s) return &captures[i];
    return NULL;
}

static void invalidate(Capture *c) { if (c->status == CAPTURE_ACTIVE) c->status = CAPTURE_INVALID; }

/* The legacy stream while a blocking stream captures: 906, those captures invalidated. */
static int legacy_conflict(Stream *s, int invalidating) {
    if (s != &legacy_stream) return 0;
    int hit = 0;
    for (int i = 0; i < ncaptures; i++)
        if (captures[i].stream->blocking) { hit = 1; if (invalidating) invalidate(&captures[i]); }
    return hit ? CAPTURE_IMPLICIT : 0;
}

/* Before work is enqueued on `s` (queue_lock held). */
static int capture_use_status(Stream *s) {
    Capture *c = capture_of(s);
    if (c && c->status == CAPTURE_INVALID) return CAPTURE_INVALIDATED;
    return legacy_conflict(s, 1);
}

/* enqueue(): 1 when `op` went into the capture of `s` (or was dropped as no node). */
static int capture_divert(Stream *s, Op *op) {
    Capture *c = capture_of(s);
    if (!c) return 0;
    if (c->status != CAPTURE_ACTIVE || op->kind == OP_EVENT || op->kind == OP_WAIT) { free_op(op); return 1; }
    Graph *g = c->graph;
    if (g->n == g->cap) { g->cap = g->cap ? 2 * g->cap : 16; g->nodes = realloc(g->nodes, sizeof(Op *) * (size_t)g->cap); }
    free(op->deps);
    op->deps = NULL;
    op->ndeps = 0;
    op->next = NULL;
    g->nodes[g->n++] = op;
    return 1;
}

/* Before cuStreamSynchronize / cuStreamQuery of `s`. */
static int capture_sync_status(Stream *s) {
    Capture *c = capture_of(s);
    if (c) { invalidate(c); return CAPTURE_UNSUPPORTED; }
    return legacy_conflict(s, 1);
}

/* Before cuCtxSynchronize. */
static int capture_ctx_sync_status(void) {
    for (int i = 0; i < ncaptures; i++) invalidate(&captures[i]);
    return ncaptures ? CAPTURE_UNSUPPORTED : 0;
}

/* Before a potentially unsafe call on the calling thread (see the section comment). */
static int capture_unsafe_status(void) {
    int hit = 0;
    pthread_t self = pthread_self();
    for (int i = 0; i < ncaptures; i++) {
        Capture *c = &captures[i];
        int own = pthread_equal(c->thread, self);
        int prohibits = thread_capture_mode == CAPTURE_MODE_RELAXED ? 0
                        : own ? c->mode != CAPTURE_MODE_RELAXED
                        : thread_capture_mode == CAPTURE_MODE_GLOBAL && c->mode == CAPTURE_MODE_GLOBAL;
        if (prohibits) { hit = 1; invalidate(c); }
    }
    return hit ? CAPTURE_UNSUPPORTED : 0;
}

static int capture_unsafe_call(void) {
    pthread_mutex_lock(&queue_lock);
    int st = capture_unsafe_status();
    pthread_mutex_unlock(&queue_lock);
    return st;
}

/* Before a synchronous copy (on the legacy stream, or this thread's stream under ptds). */
static int capture_sync_copy_status(void) {
    Stream *s = ptds_api ? per_thread_stream() : &legacy_stream;
    int st = legacy_conflict(s, 1);
    Capture *c = capture_of(s);
    if (!st && c) { invalidate(c); st = CAPTURE_UNSUPPORTED; }
    int unsafe = capture_unsafe_status();
    return st ? st : unsafe;
}

static int captured_event_index(Event *e) {
    for (int i = 0; i < ncaptured_events; i++) if (captured_events[i].event == e) return i;
    return -1;
}

/* After event `e` was recorded on `s`: captured when `s` captures. */
static void capture_note_event(Event *e, Stream *s) {
    Capture *c = capture_of(s);
    int i = captured_event_index(e);
    if (c && i < 0 && ncaptured_events < MAX_HANDLES) {
        captured_events[ncaptured_events].event = e;
        captured_events[ncaptured_events++].capture = c->id;
    } else if (c && i >= 0) {
        captured_events[i].capture = c->id;
    } else if (!c && i >= 0) {
        captured_events[i] = captured_events[--ncaptured_events];
    }
}

static void capture_forget_event(Event *e) {
    int i = captured_event_index(e);
    if (i >= 0) captured_events[i] = captured_events[--ncaptured_events];
}

/* Before cuEventSynchronize / cuEventQuery of `e`. */
static int capture_event_status(Event *e) {
    int i = captured_event_index(e);
    if (i < 0) return 0;
    for (int k = 0; k < ncaptures; k++) if (captures[k].id == captured_events[i].capture) invalidate(&captures[k]);
    return CAPTURE_UNSUPPORTED;
}

/* Before stream `s` waits on event `e`: a non-capturing stream cannot join a capture here. */
static int capture_wait_status(Stream *s, Event *e) {
    int i = captured_event_index(e);
    if (i < 0 || capture_of(s)) return 0;
    for (int k = 0; k < ncaptures; k++) if (captures[k].id == captured_events[i].capture) return NOT_SUPPORTED;
    return 0;
}

static void free_graph_nodes(Graph *g) {
    for (int i = 0; i < g->n; i++) free_op(g->nodes[i]);
    free(g->nodes);
    g->nodes = NULL;
    g->n = g->cap = 0;
}

CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
    ENTER("cuThreadExchangeStreamCaptureMode");
    NEED_INIT();
    if (!mode || *mode < CAPTURE_MODE_GLOBAL || *mode > CAPTURE_MODE_RELAXED) return INVALID_VALUE;
    int previous = thread_capture_mode;
    thread_capture_mode = *mode;
    *mode = previous;
    return SUCCESS;
}

CUresult cuStreamBeginCapture(CUstream s, int mode) {
    ENTER("cuStreamBeginCapture");
    NEED_CTX();
    if (mode < CAPTURE_MODE_GLOBAL || mode > CAPTURE_MODE_RELAXED) return INVALID_VALUE;
    pthread_mutex_lock(&queue_lock);
    Stream *q = queue_of(s);
    int st = !q ? INVALID_HANDLE : q == &legacy_stream ? CAPTURE_UNSUPPORTED : capture_of(q) ? ILLEGAL_STATE
             : ncaptures == MAX_HANDLES ? OUT_OF_MEMORY : SUCCESS;
    if (!st) {
        Capture *c = &captures[ncaptures++];
        c->stream = q;
        c->status = CAPTURE_ACTIVE;
        c->mode = mode;
        c->id = ++next_capture_id;
        c->thread = pthread_self();
        c->graph = calloc(1, sizeof(Graph));
    }
    pthread_mutex_unlock(&queue_lock);
    return st;
}

CUresult cuStreamEndCapture(CUstream s, void **graph) {
    ENTER("cuStreamEndCapture");
    NEED_CTX();
    if (!graph) return INVALID_VALUE;
    pthread_mutex_lock(&queue_lock);
    Stream *q = queue_of(s);
    Capture *c = q ? capture_of(q) : NULL;
    int st = !q ? INVALID_HANDLE : !c ? ILLEGAL_STATE
             : c->mode != CAPTURE_MODE_RELAXED && !pthread_equal(c->thread, pthread_self()) ? CAPTURE_WRONG_THREAD
             : SUCCESS;
    if (!st) {
        for (int i = ncaptured_events - 1; i >= 0; i--)
            if (captured_events[i].capture == c->id) captured_events[i] = captured_events[--ncaptured_events];
        if (c->status == CAPTURE_INVALID || ngraphs == MAX_HANDLES) {
            st = c->status == CAPTURE_INVALID ? CAPTURE_INVALIDATED : OUT_OF_MEMORY;
            free_graph_nodes(c->graph);
            free(c->graph);
            *graph = NULL;
        } else {
            graphs[ngraphs++] = c->graph;
            *graph = c->graph;
        }
        *c = captures[--ncaptures];
    }
    pthread_mutex_unlock(&queue_lock);
    return st;
}

CUresult cuStreamIsCapturing(CUstream s, int *status) {
    ENTER("cuStreamIsCapturing");
    NEED_CTX();
    if (!status) return INVALID_VALUE;
    pthread_mutex_lock(&queue_lock);
    Stream *q = queue_of(s);
    int st = !q ? INVALID_HANDLE : legacy_conflict(q, 0);
    if (!st) { Capture *c = capture_of(q); *status = c ? c->status : CAPTURE_NONE; }
    pthread_mutex_unlock(&queue_lock);
    return st;
}

/* CUDA 13's cuStreamGetCaptureInfo (the _v3 signature): no dependency nodes are reported
 * (a stub capture is one chain, and nodes have no handles). */
CUresult cuStreamGetCaptureInfo(CUstream s, int *status, uint64_t *id, void **graph, const void **deps,
                                const void **edges, size_t *ndeps) {
    ENTER("cuStreamGetCaptureInfo");
    NEED_CTX();
    if (!status) return INVALID_VALUE;
    pthread_mutex_lock(&queue_lock);
    Stream *q = queue_of(s);
    int st = !q ? INVALID_HANDLE : legacy_conflict(q, 0);
    if (!st) {
        Capture *c = capture_of(q);
        *status = c ? c->status : CAPTURE_NONE;
        if (c && c->status == CAPTURE_ACTIVE) {
            if (id) *id = c->id;
            if (graph) *graph = c->graph;
            if (deps) *deps = NULL;
            if (edges) *edges = NULL;
            if (ndeps) *ndeps = 0;
        }
    }
    pthread_mutex_unlock(&queue_lock);
    return st;
}

static Op *clone_op(const Op *op) {
    Op *copy = new_op(op->kind);
    *copy = *op;
    copy->next = NULL;
    copy->deps = NULL;
    copy->ndeps = 0;
    copy->param_bytes = NULL;
    if (op->kind == OP_LAUNCH) {
        size_t total = 0;
        for (int i = 0; i < op->fn->nparams; i++) total += ((size_t)op->fn->sizes[i] + 15) / 16 * 16;
        copy->param_bytes = aligned_alloc(16, total ? total : 16);
        memcpy(copy->param_bytes, op->param_bytes, total);
        for (int i = 0; i < op->fn->nparams; i++)
            copy->params[i] = copy->param_bytes + ((unsigned char *)op->params[i] - op->param_bytes);
    }
    return copy;
}

/* cuda-bindings 13's cuGraphInstantiate(graph, flags) calls this entry point (cuda.h 12+
 * defines cuGraphInstantiate as cuGraphInstantiateWithFlags). */
CUresult cuGraphInstantiateWithFlags(void **exec, void *graph, unsigned long long flags) {
    ENTER("cuGraphInstantiate");
    NEED_CTX();
    if (!exec || flags > 15) return INVALID_VALUE;
    pthread_mutex_lock(&queue_lock);
    int st = find_handle(graphs, ngraphs, graph) < 0 ? INVALID_HANDLE : ngraph_execs == MAX_HANDLES ? OUT_OF_MEMORY : SUCCESS;
    if (!st) {
        Graph *g = graph;
        GraphExec *x = calloc(1, sizeof(GraphExec));
        x->nodes.nodes = malloc(sizeof(Op *) * (size_t)(g->n ? g->n : 1));
        for (int i = 0; i < g->n; i++) x->nodes.nodes[i] = clone_op(g->nodes[i]);
        x->nodes.n = x->nodes.cap = g->n;
        graph_execs[ngraph_execs++] = x;
        *exec = x;
    }
    pthread_mutex_unlock(&queue_lock);
    return st;
}

static CUresult graph_launch(void *exec, CUstream s) {
    NEED_CTX();
    pthread_mutex_lock(&queue_lock);
    Stream *q = queue_of(s);
    int st = find_handle(graph_execs, ngraph_execs, exec) < 0 || !q ? INVALID_HANDLE : capture_use_status(q);
    if (!st) {
        GraphExec *x = exec;
        for (int i = 0; i < x->nodes.n; i++) enqueue(q, clone_op(x->nodes.nodes[i]));
    }
    pthread_mutex_unlock(&queue_lock);
    return st;
}
CUresult cuGraphLaunch(void *exec, CUstream s) { ENTER("cuGraphLaunch"); return graph_launch(exec, s); }

CUresult cuGraphExecDestroy(void *exec) {
    ENTER("cuGraphExecDestroy");
    NEED_CTX();
    pthread_mutex_lock(&queue_lock);
    int i = find_handle(graph_execs, ngraph_execs, exec);
    if (i >= 0) {
        free_graph_nodes(&((GraphExec *)exec)->nodes); /* launched copies are queued separately */
        free(exec);
        graph_execs[i] = graph_execs[--ngraph_execs];
    }
    pthread_mutex_unlock(&queue_lock);
    return i < 0 ? INVALID_HANDLE : SUCCESS;
}

CUresult cuGraphDestroy(void *graph) {
    ENTER("cuGraphDestroy");
    NEED_CTX();
    pthread_mutex_lock(&queue_lock);
    int i = find_handle(graphs, ngraphs, graph);
    if (i >= 0) {
        free_graph_nodes(graph);
        free(graph);
        graphs[i] = graphs[--ngraphs];
    }
    pthread_mutex_unlock(&queue_lock);
    return i < 0 ? INVALID_HANDLE : SUCCESS;
}
/* ---- end of CAPTURE (CUDA graphs) additions ---- */
