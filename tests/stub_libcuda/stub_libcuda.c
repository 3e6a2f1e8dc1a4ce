/*
 * A host-memory stand-in for libcuda.so.1, written for pagedkv's CPU tests.
 *
 * It proves the Python side of the driver layer (argument passing, handle bookkeeping,
 * error mapping, kernel-argument packing), never the GPU: "device" memory is malloc'd
 * host memory, streams and events are host structs, and the four pagedkv kernels are
 * emulated on the host from their recorded parameters. cuda-bindings resolves every
 * entry point through cuGetProcAddress(_v2), so that is the one lookup implemented.
 *
 * Test controls (stub_*) record each launch's parameters byte for byte, count calls per
 * entry point, inject a failure status into the next call of a named entry point, and
 * report what is still live.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream, *CUevent;

enum {
    SUCCESS = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, NO_DEVICE = 100,
    INVALID_DEVICE = 101, INVALID_IMAGE = 200, INVALID_CONTEXT = 201, INVALID_HANDLE = 400,
    NOT_FOUND = 500, NOT_READY = 600, ILLEGAL_ADDRESS = 700, LAUNCH_FAILED = 719, NOT_SUPPORTED = 801,
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
    {LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
};
#define NSTATUS (sizeof(STATUS) / sizeof(STATUS[0]))

CUresult cuGetErrorName(CUresult error, const char **out) {
    for (size_t i = 0; i < NSTATUS; i++)
        if (STATUS[i].code == error) { *out = STATUS[i].name; return SUCCESS; }
    *out = NULL;
    return INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult error, const char **out) {
    for (size_t i = 0; i < NSTATUS; i++)
        if (STATUS[i].code == error) { *out = STATUS[i].text; return SUCCESS; }
    *out = NULL;
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

static int initialised, init_status, device_count = 1, sm_count = 4, cc_major = 9, cc_minor = 0;
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
    *version = 13000;
    return SUCCESS;
}

#define NEED_INIT() do { if (!initialised) return NOT_INITIALIZED; } while (0)
#define NEED_CTX() do { NEED_INIT(); if (current_ctx != &primary_ctx_storage || primary_refs <= 0) return INVALID_CONTEXT; } while (0)

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
    case 16: *value = sm_count; return SUCCESS;
    case 75: *value = cc_major; return SUCCESS;
    case 76: *value = cc_minor; return SUCCESS;
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

CUresult cuCtxSynchronize(void) {
    ENTER("cuCtxSynchronize");
    NEED_CTX();
    return SUCCESS;
}

/* ---- device memory: malloc'd host memory, every range checked ---------------------------- */

#define MAX_ALLOCS 4096
static struct { CUdeviceptr base; size_t size; } allocs[MAX_ALLOCS];
static int nallocs;

int stub_live_allocations(void) { return nallocs; }

/* 1 when [p, p + n) lies inside one live allocation. */
static int device_range_ok(CUdeviceptr p, size_t n) {
    for (int i = 0; i < nallocs; i++)
        if (p >= allocs[i].base && p + n <= allocs[i].base + allocs[i].size && p + n >= p) return 1;
    return 0;
}

CUresult cuMemAlloc(CUdeviceptr *dptr, size_t size) {
    ENTER("cuMemAlloc");
    NEED_CTX();
    if (!dptr || size == 0) return INVALID_VALUE;
    if (size > total_mem - used_mem || nallocs == MAX_ALLOCS) return OUT_OF_MEMORY;
    void *p = aligned_alloc(256, (size + 255) / 256 * 256);
    if (!p) return OUT_OF_MEMORY;
    memset(p, 0xA5, size); /* like the GPU, fresh memory is not zeroed */
    allocs[nallocs].base = (CUdeviceptr)(uintptr_t)p;
    allocs[nallocs].size = size;
    nallocs++;
    used_mem += size;
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return SUCCESS;
}

CUresult cuMemFree(CUdeviceptr dptr) {
    ENTER("cuMemFree");
    NEED_CTX();
    for (int i = 0; i < nallocs; i++) {
        if (allocs[i].base == dptr) {
            used_mem -= allocs[i].size;
            free((void *)(uintptr_t)dptr);
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
    if (!pp || size == 0 || nhost == MAX_HOST) return INVALID_VALUE;
    (void)flags;
    *pp = aligned_alloc(4096, (size + 4095) / 4096 * 4096);
    if (!*pp) return OUT_OF_MEMORY;
    host_allocs[nhost++] = *pp;
    return SUCCESS;
}

CUresult cuMemFreeHost(void *p) {
    ENTER("cuMemFreeHost");
    NEED_CTX();
    for (int i = 0; i < nhost; i++) {
        if (host_allocs[i] == p) {
            free(p);
            host_allocs[i] = host_allocs[--nhost];
            return SUCCESS;
        }
    }
    return INVALID_VALUE;
}

/* ---- streams and events ------------------------------------------------------------------ */

#define MAX_HANDLES 256
static void *streams[MAX_HANDLES], *events[MAX_HANDLES];
static int nstreams, nevents;

int stub_live_streams(void) { return nstreams; }
int stub_live_events(void) { return nevents; }

static int find_handle(void **table, int n, void *h) {
    for (int i = 0; i < n; i++) if (table[i] == h) return i;
    return -1;
}

/* 0 (legacy), 1 (CU_STREAM_LEGACY), 2 (CU_STREAM_PER_THREAD) or a live stream. */
static int stream_ok(CUstream s) {
    return (uintptr_t)s <= 2 || find_handle(streams, nstreams, s) >= 0;
}

CUresult cuStreamCreate(CUstream *s, unsigned flags) {
    ENTER("cuStreamCreate");
    NEED_CTX();
    if (!s || flags > 1 || nstreams == MAX_HANDLES) return INVALID_VALUE;
    *s = malloc(16);
    streams[nstreams++] = *s;
    return SUCCESS;
}

CUresult cuStreamDestroy(CUstream s) {
    ENTER("cuStreamDestroy");
    NEED_CTX();
    int i = find_handle(streams, nstreams, s);
    if (i < 0) return INVALID_HANDLE;
    free(s);
    streams[i] = streams[--nstreams];
    return SUCCESS;
}

CUresult cuStreamSynchronize(CUstream s) {
    ENTER("cuStreamSynchronize");
    NEED_CTX();
    return stream_ok(s) ? SUCCESS : INVALID_HANDLE;
}

typedef struct { int recorded; double when_ms; } Event;

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

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
    int i = find_handle(events, nevents, e);
    if (i < 0) return INVALID_HANDLE;
    free(e);
    events[i] = events[--nevents];
    return SUCCESS;
}

CUresult cuEventRecord(CUevent e, CUstream s) {
    ENTER("cuEventRecord");
    NEED_CTX();
    if (find_handle(events, nevents, e) < 0 || !stream_ok(s)) return INVALID_HANDLE;
    ((Event *)e)->recorded = 1;
    ((Event *)e)->when_ms = now_ms();
    return SUCCESS;
}

CUresult cuEventSynchronize(CUevent e) {
    ENTER("cuEventSynchronize");
    NEED_CTX();
    return find_handle(events, nevents, e) < 0 ? INVALID_HANDLE : SUCCESS;
}

CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end) {
    ENTER("cuEventElapsedTime");
    NEED_CTX();
    if (find_handle(events, nevents, start) < 0 || find_handle(events, nevents, end) < 0) return INVALID_HANDLE;
    if (!((Event *)start)->recorded || !((Event *)end)->recorded) return NOT_READY;
    *ms = (float)(((Event *)end)->when_ms - ((Event *)start)->when_ms);
    return SUCCESS;
}

/* ---- memset and copies (stream order is program order on the host) ---------------------- */

CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n, CUstream s) {
    ENTER("cuMemsetD8Async");
    NEED_CTX();
    if (!stream_ok(s)) return INVALID_HANDLE;
    if (!device_range_ok(dst, n)) return INVALID_VALUE;
    memset((void *)(uintptr_t)dst, value, n);
    return SUCCESS;
}

CUresult cuMemcpyHtoD(CUdeviceptr dst, const void *src, size_t n) {
    ENTER("cuMemcpyHtoD");
    NEED_CTX();
    if (!device_range_ok(dst, n) || !src) return INVALID_VALUE;
    memcpy((void *)(uintptr_t)dst, src, n);
    return SUCCESS;
}

CUresult cuMemcpyDtoH(void *dst, CUdeviceptr src, size_t n) {
    ENTER("cuMemcpyDtoH");
    NEED_CTX();
    if (!device_range_ok(src, n) || !dst) return INVALID_VALUE;
    memcpy(dst, (void *)(uintptr_t)src, n);
    return SUCCESS;
}

CUresult cuMemcpyDtoD(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    ENTER("cuMemcpyDtoD");
    NEED_CTX();
    if (!device_range_ok(dst, n) || !device_range_ok(src, n)) return INVALID_VALUE;
    memmove((void *)(uintptr_t)dst, (void *)(uintptr_t)src, n);
    return SUCCESS;
}

CUresult cuMemcpyHtoDAsync(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    ENTER("cuMemcpyHtoDAsync");
    NEED_CTX();
    if (!stream_ok(s)) return INVALID_HANDLE;
    if (!device_range_ok(dst, n) || !src) return INVALID_VALUE;
    memcpy((void *)(uintptr_t)dst, src, n);
    return SUCCESS;
}

CUresult cuMemcpyDtoHAsync(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    ENTER("cuMemcpyDtoHAsync");
    NEED_CTX();
    if (!stream_ok(s)) return INVALID_HANDLE;
    if (!device_range_ok(src, n) || !dst) return INVALID_VALUE;
    memcpy(dst, (void *)(uintptr_t)src, n);
    return SUCCESS;
}

CUresult cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    ENTER("cuMemcpyDtoDAsync");
    NEED_CTX();
    if (!stream_ok(s)) return INVALID_HANDLE;
    if (!device_range_ok(dst, n) || !device_range_ok(src, n)) return INVALID_VALUE;
    memmove((void *)(uintptr_t)dst, (void *)(uintptr_t)src, n);
    return SUCCESS;
}

/* ---- modules and kernels ------------------------------------------------------------------ */

/* Parameter sizes of the pagedkv kernels, in order, as declared in pagedkv/nvrtc_src. */
static const struct { const char *name; int nparams; int sizes[8]; } KERNELS[] = {
    {"pagedkv_fill_blocks", 5, {8, 4, 8, 4, 4}},
    {"pagedkv_copy_blocks", 5, {8, 4, 8, 8, 4}},
    {"pagedkv_reduce_bf16_partial", 6, {8, 8, 8, 8, 4, 8}},
    {"pagedkv_reduce_bf16_final", 3, {8, 4, 8}},
};
#define NKERNELS (sizeof(KERNELS) / sizeof(KERNELS[0]))

typedef struct { int kernel; } Function;
typedef struct { unsigned char *image; size_t size; Function functions[NKERNELS]; } Module;

static void *modules[MAX_HANDLES];
static int nmodules;

int stub_live_modules(void) { return nmodules; }

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
    free(((Module *)mod)->image);
    free(mod);
    modules[i] = modules[--nmodules];
    return SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction *f, CUmodule mod, const char *name) {
    ENTER("cuModuleGetFunction");
    NEED_CTX();
    if (find_handle(modules, nmodules, mod) < 0) return INVALID_HANDLE;
    Module *m = mod;
    for (size_t k = 0; k < NKERNELS; k++) {
        if (strcmp(KERNELS[k].name, name) == 0) {
            /* the symbol must really be in the CUBIN NVRTC produced */
            if (!memmem(m->image, m->size, name, strlen(name) + 1)) return NOT_FOUND;
            m->functions[k].kernel = (int)k;
            *f = &m->functions[k];
            return SUCCESS;
        }
    }
    return NOT_FOUND;
}

/* ---- launches: recorded byte for byte, then emulated ---------------------------------------- */

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

static uint64_t u64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static int32_t i32(const unsigned char *p) { int32_t v; memcpy(&v, p, 4); return v; }

typedef struct { int64_t base, stride, nbytes; } Region;

/* The exact BF16 reduction's emulation, in the DRIVER additions at the end. */
#define EXACT_RESULT_WORDS 36
static void exact_reduce_partial(int64_t base, int64_t stride, int64_t nbytes, const int32_t *blocks, int n,
                                 int64_t *partials, unsigned grid);
static void exact_reduce_final(const int64_t *partials, int n, int64_t *out);

/* Emulate kernel k; ILLEGAL_ADDRESS when it would touch memory outside every allocation. */
static CUresult emulate(int k, unsigned char (*p)[8], unsigned grid) {
    if (k == 0 || k == 1) {
        const Region *table = (const Region *)(uintptr_t)u64(p[0]);
        int rows = i32(p[1]);
        int n = k == 0 ? i32(p[3]) : i32(p[4]);
        const int32_t *first = (const int32_t *)(uintptr_t)u64(p[2]);
        const int32_t *second = k == 1 ? (const int32_t *)(uintptr_t)u64(p[3]) : NULL;
        if (!device_range_ok((CUdeviceptr)(uintptr_t)table, sizeof(Region) * rows) ||
            !device_range_ok((CUdeviceptr)(uintptr_t)first, 4 * (size_t)n) ||
            (second && !device_range_ok((CUdeviceptr)(uintptr_t)second, 4 * (size_t)n)))
            return ILLEGAL_ADDRESS;
        for (int r = 0; r < rows; r++) {
            for (int i = 0; i < n; i++) {
                CUdeviceptr a = table[r].base + (int64_t)first[i] * table[r].stride;
                if (!device_range_ok(a, table[r].nbytes)) return ILLEGAL_ADDRESS;
                if (k == 0) {
                    memset((void *)(uintptr_t)a, (int)(u64(p[4]) & 0xFF), table[r].nbytes);
                } else {
                    CUdeviceptr d = table[r].base + (int64_t)second[i] * table[r].stride;
                    if (!device_range_ok(d, table[r].nbytes)) return ILLEGAL_ADDRESS;
                    memcpy((void *)(uintptr_t)d, (void *)(uintptr_t)a, table[r].nbytes);
                }
            }
        }
        return SUCCESS;
    }
    if (k == 2) {
        int64_t base = (int64_t)u64(p[0]), stride = (int64_t)u64(p[1]), nbytes = (int64_t)u64(p[2]);
        const int32_t *blocks = (const int32_t *)(uintptr_t)u64(p[3]);
        int n = i32(p[4]);
        int64_t *partials = (int64_t *)(uintptr_t)u64(p[5]);
        if (!device_range_ok((CUdeviceptr)(uintptr_t)blocks, 4 * (size_t)n) ||
            !device_range_ok((CUdeviceptr)(uintptr_t)partials, 8 * EXACT_RESULT_WORDS * (size_t)grid))
            return ILLEGAL_ADDRESS;
        for (int i = 0; i < n; i++)
            if (!device_range_ok(base + (int64_t)blocks[i] * stride, nbytes)) return ILLEGAL_ADDRESS;
        exact_reduce_partial(base, stride, nbytes, blocks, n, partials, grid);
        return SUCCESS;
    }
    const int64_t *partials = (const int64_t *)(uintptr_t)u64(p[0]);
    int n = i32(p[1]);
    int64_t *out = (int64_t *)(uintptr_t)u64(p[2]);
    if (!device_range_ok((CUdeviceptr)(uintptr_t)partials, 8 * EXACT_RESULT_WORDS * (size_t)n) ||
        !device_range_ok((CUdeviceptr)(uintptr_t)out, 8 * EXACT_RESULT_WORDS))
        return ILLEGAL_ADDRESS;
    exact_reduce_final(partials, n, out);
    return SUCCESS;
}

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, CUstream s, void **params, void **extra) {
    ENTER("cuLaunchKernel");
    NEED_CTX();
    if (!f || !params || extra) return INVALID_VALUE;
    if (!stream_ok(s)) return INVALID_HANDLE;
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || bx * by * bz > 1024) return INVALID_VALUE;
    int k = ((Function *)f)->kernel;
    LaunchRecord *rec = &launches[nlaunches % MAX_LAUNCHES];
    memset(rec, 0, sizeof(*rec));
    strncpy(rec->name, KERNELS[k].name, sizeof(rec->name) - 1);
    rec->grid[0] = gx; rec->grid[1] = gy; rec->grid[2] = gz;
    rec->block[0] = bx; rec->block[1] = by; rec->block[2] = bz;
    rec->shared = shared;
    rec->stream = (uint64_t)(uintptr_t)s;
    rec->nparams = KERNELS[k].nparams;
    for (int i = 0; i < KERNELS[k].nparams; i++) {
        rec->sizes[i] = KERNELS[k].sizes[i];
        memcpy(rec->params[i], params[i], (size_t)KERNELS[k].sizes[i]);
    }
    nlaunches++;
    return emulate(k, rec->params, gx);
}

/* ---- entry-point lookup, as cuda-bindings does it ----------------------------------------- */

static const struct { const char *name; void *fn; } ENTRY_POINTS[] = {
#define EP(f) {#f, (void *)f}
    EP(cuGetErrorName), EP(cuGetErrorString), EP(cuInit), EP(cuDriverGetVersion),
    EP(cuDeviceGetCount), EP(cuDeviceGet), EP(cuDeviceGetName), EP(cuDeviceGetAttribute),
    EP(cuDevicePrimaryCtxRetain), EP(cuDevicePrimaryCtxRelease), EP(cuCtxSetCurrent),
    EP(cuCtxGetCurrent), EP(cuCtxSynchronize), EP(cuMemAlloc), EP(cuMemFree), EP(cuMemGetInfo),
    EP(cuMemHostAlloc), EP(cuMemFreeHost), EP(cuStreamCreate), EP(cuStreamDestroy),
    EP(cuStreamSynchronize), EP(cuEventCreate), EP(cuEventDestroy), EP(cuEventRecord),
    EP(cuEventSynchronize), EP(cuEventElapsedTime), EP(cuMemsetD8Async), EP(cuMemcpyHtoD),
    EP(cuMemcpyDtoH), EP(cuMemcpyDtoD), EP(cuMemcpyHtoDAsync), EP(cuMemcpyDtoHAsync),
    EP(cuMemcpyDtoDAsync), EP(cuModuleLoadData), EP(cuModuleUnload), EP(cuModuleGetFunction),
    EP(cuLaunchKernel),
#undef EP
};
#define NENTRY (sizeof(ENTRY_POINTS) / sizeof(ENTRY_POINTS[0]))

static void *driver_additions_lookup(const char *symbol);

static void *lookup(const char *symbol) {
    for (size_t i = 0; i < NENTRY; i++)
        if (strcmp(ENTRY_POINTS[i].name, symbol) == 0) return ENTRY_POINTS[i].fn;
    return driver_additions_lookup(symbol);
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status) {
    (void)version; (void)flags;
    enter("cuGetProcAddress");
    if (!symbol || !pfn) return INVALID_VALUE;
    *pfn = lookup(symbol);
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
/* Entry points and emulations the DRIVER work needs; everything above stays as it was,
 * but for the two forward declarations the emulation and lookup() call into. */

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

/* Exact BF16 sums as pagedkv/exact_sum.py defines them: 32-bit digits in int64 words,
 * sum (9 digits, units 2^-133), sum of |x| (9), sum of squares (17, units 2^-266), flags. */
#define EX_SUM_DIGITS 9
#define EX_SSQ_DIGITS 17
#define EX_SUM 0
#define EX_SABS EX_SUM_DIGITS
#define EX_SSQ (2 * EX_SUM_DIGITS)
#define EX_FLAGS (2 * EX_SUM_DIGITS + EX_SSQ_DIGITS)

static void ex_carry(int64_t *d, int n) {
    for (int i = 0; i + 1 < n; i++) {
        int64_t c = d[i] >> 32;
        d[i] -= c * 4294967296LL;
        d[i + 1] += c;
    }
}

static void ex_normalize(int64_t *d) {
    ex_carry(d + EX_SUM, EX_SUM_DIGITS);
    ex_carry(d + EX_SABS, EX_SUM_DIGITS);
    ex_carry(d + EX_SSQ, EX_SSQ_DIGITS);
}

static void ex_add(int64_t *d, uint16_t bits) {
    uint32_t e = (bits >> 7) & 0xFF, f = bits & 0x7F;
    if (e == 0xFF) { d[EX_FLAGS] |= f ? 1 : ((bits & 0x8000) ? 4 : 2); return; }
    uint32_t m = e ? (f | 0x80) : f, s = e ? e - 1 : 0;
    if (!m) return;
    uint64_t v = (uint64_t)m << (s & 31), q = (uint64_t)(m * m) << ((2 * s) & 31);
    int dv = (int)(s >> 5), dq = (int)((2 * s) >> 5);
    int64_t lo = (int64_t)(v & 0xFFFFFFFFu), hi = (int64_t)(v >> 32);
    int64_t sign = (bits & 0x8000) ? -1 : 1;
    d[EX_SUM + dv] += sign * lo; d[EX_SUM + dv + 1] += sign * hi;
    d[EX_SABS + dv] += lo; d[EX_SABS + dv + 1] += hi;
    d[EX_SSQ + dq] += (int64_t)(q & 0xFFFFFFFFu); d[EX_SSQ + dq + 1] += (int64_t)(q >> 32);
}

static void exact_reduce_partial(int64_t base, int64_t stride, int64_t nbytes, const int32_t *blocks, int n,
                                 int64_t *partials, unsigned grid) {
    for (unsigned c = 0; c < grid; c++) {
        int64_t *d = partials + (size_t)EXACT_RESULT_WORDS * c;
        memset(d, 0, 8 * EXACT_RESULT_WORDS);
        long added = 0;
        for (int i = (int)c; i < n; i += (int)grid) {
            const uint16_t *v = (const uint16_t *)(uintptr_t)(base + (int64_t)blocks[i] * stride);
            for (int64_t j = 0; j < nbytes / 2; j++) {
                uint16_t bits;
                memcpy(&bits, v + j, 2);
                ex_add(d, bits);
                if (++added == (1L << 30)) { ex_normalize(d); added = 0; }
            }
        }
        ex_normalize(d);
    }
}

static void exact_reduce_final(const int64_t *partials, int n, int64_t *out) {
    int64_t d[EXACT_RESULT_WORDS] = {0};
    for (int p = 0; p < n; p++) {
        for (int j = 0; j < EX_FLAGS; j++) d[j] += partials[(size_t)EXACT_RESULT_WORDS * p + j];
        d[EX_FLAGS] |= partials[(size_t)EXACT_RESULT_WORDS * p + EX_FLAGS];
        ex_normalize(d);
    }
    memcpy(out, d, sizeof(d));
}

static const struct { const char *name; void *fn; } DRIVER_ENTRY_POINTS[] = {
    {"cuOccupancyMaxActiveBlocksPerMultiprocessor", (void *)cuOccupancyMaxActiveBlocksPerMultiprocessor},
};

static void *driver_additions_lookup(const char *symbol) {
    for (size_t i = 0; i < sizeof(DRIVER_ENTRY_POINTS) / sizeof(DRIVER_ENTRY_POINTS[0]); i++)
        if (strcmp(DRIVER_ENTRY_POINTS[i].name, symbol) == 0) return DRIVER_ENTRY_POINTS[i].fn;
    return NULL;
}
