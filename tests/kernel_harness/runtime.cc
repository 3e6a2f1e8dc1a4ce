// The kernel harness runtime: runs one grid of a registered kernel on the calling host
// thread. CTAs run one after another in the order asked for; the CUDA threads of a CTA
// are fibers switched only at barriers, warp exchanges and exits, so a run is
// deterministic for a given order. Faults (misaligned access, __trap, barrier
// divergence) end the launch with a CUDA status and a message.
// On x86-64 a fiber switch saves and restores the callee-saved registers, MXCSR and the
// x87 control word and swaps stacks (pkv_fiber_switch below): glibc's swapcontext also
// saves the signal mask with a sigprocmask system call per switch, which was most of a
// harness run's time. Elsewhere, or built with -DPKV_UCONTEXT, fibers are ucontexts.
#include <signal.h>
#include <ucontext.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#ifdef PKV_MODEL
#include <dlfcn.h>

#include <algorithm>
#include <unordered_map>
#endif

#include "cuda_shim.h"
#include "harness.h"

#define PKV_EXPORT extern "C" __attribute__((visibility("default")))

extern "C" {
uint3 pkv_threadIdx, pkv_blockIdx;
dim3 pkv_blockDim, pkv_gridDim;
extern char __start_pkv_shared[] __attribute__((weak, visibility("hidden")));
extern char __stop_pkv_shared[] __attribute__((weak, visibility("hidden")));
#ifdef PKV_MODEL
extern char __start_pkv_constant[] __attribute__((weak, visibility("hidden")));
extern char __stop_pkv_constant[] __attribute__((weak, visibility("hidden")));
#endif
}

namespace {

enum Status { OK = 0, ILLEGAL_ADDRESS = 700, MISALIGNED_ADDRESS = 716, LAUNCH_FAILED = 719 };
enum State { READY, AT_BARRIER, AT_WARP, DONE };
enum Order { ASCENDING = 0, DESCENDING = 1, RANDOM = 2 };

constexpr size_t STACK_BYTES = 256 << 10;

#if defined(__x86_64__) && !defined(PKV_UCONTEXT)
#define PKV_FAST_FIBERS 1
using FiberContext = void*;  // the saved stack pointer of a switched-out fiber (or scheduler)
#else
#define PKV_FAST_FIBERS 0
using FiberContext = ucontext_t;
#endif

struct Fiber {
    FiberContext ctx;
    State state;
    unsigned barriers;      // __syncthreads passed
    const char* site_file;  // where it waits (barrier or warp exchange)
    int site_line;
    unsigned warp_mask;
    int warp_mode;
    uint3 tid;
};

struct Launch {
    const PkvKernel* kernel;
    void** params;
    unsigned nthreads;
    std::vector<Fiber> fibers;
    std::vector<char*> stacks;
    std::vector<unsigned> thread_order;
    std::vector<uint64_t> warp_slots;  // 32 per warp
    FiberContext scheduler;
    int current;
    int status;
    char* message;
    int message_len;
};

Launch* active;

#ifdef PKV_MODEL
#include "model.inc"
#else
inline void model_mark(unsigned) {}
inline void model_begin_launch(Launch*) {}
inline void model_end_cta(Launch*) {}
inline void model_end_launch(Launch*) {}
#endif

void fail(int status, const char* fmt, ...) {
    Launch* L = active;
    if (L->status == OK) {
        L->status = status;
        va_list ap;
        va_start(ap, fmt);
        char text[400];
        vsnprintf(text, sizeof text, fmt, ap);
        va_end(ap);
        snprintf(L->message, (size_t)L->message_len, "%s: %s (block %u,%u,%u thread %u,%u,%u)", L->kernel->name,
                 text, pkv_blockIdx.x, pkv_blockIdx.y, pkv_blockIdx.z, pkv_threadIdx.x, pkv_threadIdx.y,
                 pkv_threadIdx.z);
    }
}

#if PKV_FAST_FIBERS
}  // namespace
// pkv_fiber_switch(save, to): push the callee-saved registers and the MXCSR / x87 control
// words, store the stack pointer in *save, switch to the stack `to` and pop what was pushed
// there (by an earlier switch away from it, or by prepare_fiber); returns on that stack.
extern "C" void pkv_fiber_switch(void** save, void* to) __attribute__((visibility("hidden")));
asm(R"(
    .text
    .p2align 4
    .globl pkv_fiber_switch
    .hidden pkv_fiber_switch
    .type pkv_fiber_switch, @function
pkv_fiber_switch:
    .cfi_startproc
    endbr64
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .cfi_endproc
    .size pkv_fiber_switch, .-pkv_fiber_switch
)");
namespace {
#endif

void fiber_main() {
    Launch* L = active;
    L->kernel->entry(L->params);
    L->fibers[(size_t)L->current].state = DONE;
    // returning ends the context; uc_link (or fiber_entry) resumes the scheduler
}

// Leave the running fiber for the scheduler; returns when the scheduler resumes it.
void yield_to_scheduler() {
    Launch* L = active;
#if PKV_FAST_FIBERS
    pkv_fiber_switch(&L->fibers[(size_t)L->current].ctx, L->scheduler);
#else
    swapcontext(&L->fibers[(size_t)L->current].ctx, &L->scheduler);
#endif
}

[[noreturn]] void abort_fiber() {
    Launch* L = active;
    L->fibers[(size_t)L->current].state = DONE;
#if PKV_FAST_FIBERS
    void* abandoned;
    pkv_fiber_switch(&abandoned, L->scheduler);
#else
    setcontext(&L->scheduler);
#endif
    std::abort();
}

#if PKV_FAST_FIBERS
// A fresh fiber's first switch returns here, at the top of its stack.
[[noreturn]] void fiber_entry() {
    fiber_main();
    void* finished;
    pkv_fiber_switch(&finished, active->scheduler);
    std::abort();
}
#endif

// Make fiber t start the kernel at its next switch, on its own stack.
void prepare_fiber(Launch* L, unsigned t) {
    Fiber& f = L->fibers[t];
#if PKV_FAST_FIBERS
    // what pkv_fiber_switch pops, below a return into fiber_entry at a 16-byte aligned
    // slot (so fiber_entry starts as a called function does: rsp = 8 mod 16)
    void** top = reinterpret_cast<void**>((reinterpret_cast<uintptr_t>(L->stacks[t]) + STACK_BYTES) & ~uintptr_t(15));
    top[-1] = nullptr;  // fiber_entry's own return address: it never returns
    top[-2] = reinterpret_cast<void*>(&fiber_entry);
    for (int r = 3; r <= 8; r++) top[-r] = nullptr;  // rbp, rbx, r12-r15
    uint16_t fpu_control;
    asm volatile("fnstcw %0" : "=m"(fpu_control));
    const uint64_t control = (uint64_t)__builtin_ia32_stmxcsr() | (uint64_t)fpu_control << 32;
    std::memcpy(&top[-9], &control, sizeof control);
    f.ctx = &top[-9];
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = L->stacks[t];
    f.ctx.uc_stack.ss_size = STACK_BYTES;
    f.ctx.uc_link = &L->scheduler;
    makecontext(&f.ctx, fiber_main, 0);
#endif
}

uint64_t splitmix(uint64_t& s) {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

std::vector<unsigned> make_order(unsigned n, int order, uint64_t seed) {
    std::vector<unsigned> v(n);
    for (unsigned i = 0; i < n; i++) v[i] = order == DESCENDING ? n - 1 - i : i;
    if (order == RANDOM)
        for (unsigned i = n; i > 1; i--) std::swap(v[i - 1], v[splitmix(seed) % i]);
    return v;
}

void run_fiber(Launch* L, unsigned t) {
    Fiber& f = L->fibers[t];
    f.state = READY;
    L->current = (int)t;
    pkv_threadIdx = f.tid;
#if PKV_FAST_FIBERS
    pkv_fiber_switch(&L->scheduler, f.ctx);
#else
    swapcontext(&L->scheduler, &f.ctx);
#endif
    L->current = -1;
}

// Release warps whose every masked lane waits in the same kind of exchange; false if none
// could be (or the launch failed: lanes of one mask in different intrinsics).
bool release_warps(Launch* L) {
    bool released = false;
    const unsigned nwarps = (L->nthreads + 31) / 32;
    for (unsigned w = 0; w < nwarps; w++) {
        unsigned waiting = 0, mask = 0;
        bool mixed = false;
        for (unsigned lane = 0; lane < 32 && w * 32 + lane < L->nthreads; lane++) {
            const Fiber& f = L->fibers[w * 32 + lane];
            if (f.state != AT_WARP) continue;
            if (waiting && (f.warp_mask != mask)) mixed = true;
            mask = f.warp_mask;
            waiting |= 1u << lane;
        }
        if (!waiting) continue;
        if (mixed || waiting != mask) continue;  // someone in the mask has not arrived yet
        const Fiber& lead = L->fibers[w * 32 + (unsigned)__builtin_ctz(waiting)];
        for (unsigned lane = 0; lane < 32; lane++) {
            const Fiber& f = L->fibers[w * 32 + lane];
            if ((waiting >> lane & 1u) && f.warp_mode != lead.warp_mode) {
                pkv_threadIdx = f.tid;
                fail(LAUNCH_FAILED, "warp divergence: lanes of mask 0x%08x in different warp intrinsics (%s:%d, %s:%d)",
                     mask, f.site_file, f.site_line, lead.site_file, lead.site_line);
                return false;
            }
        }
        for (unsigned lane = 0; lane < 32; lane++)
            if (waiting >> lane & 1u) L->fibers[w * 32 + lane].state = READY;
        released = true;
    }
    return released;
}

// Run one CTA to completion; false when the launch failed.
bool run_cta(Launch* L, uint3 block) {
    pkv_blockIdx = block;
    char* const shared_begin = __start_pkv_shared;
    char* const shared_end = __stop_pkv_shared;
    if (shared_begin && shared_end > shared_begin) std::memset(shared_begin, 0xFF, (size_t)(shared_end - shared_begin));
    for (unsigned t = 0; t < L->nthreads; t++) {
        Fiber& f = L->fibers[t];
        f.state = READY;
        f.barriers = 0;
        f.site_file = nullptr;
        f.site_line = 0;
        f.tid = {t % pkv_blockDim.x, t / pkv_blockDim.x % pkv_blockDim.y, t / (pkv_blockDim.x * pkv_blockDim.y)};
        prepare_fiber(L, t);
    }
    for (;;) {
        bool ran = false;
        for (unsigned t : L->thread_order) {
            if (L->fibers[t].state != READY) continue;
            run_fiber(L, t);
            ran = true;
            if (L->status != OK) return false;
        }
        if (ran) continue;
        if (release_warps(L)) continue;
        if (L->status != OK) return false;
        // nobody can run: every live fiber waits at a barrier (or the CTA is done)
        const Fiber* first = nullptr;
        bool stuck_in_warp = false;
        for (unsigned t = 0; t < L->nthreads; t++) {
            const Fiber& f = L->fibers[t];
            if (f.state == AT_WARP) stuck_in_warp = true;
            if (f.state != AT_BARRIER) continue;
            if (!first) {
                first = &f;
            } else if (f.site_line != first->site_line || std::strcmp(f.site_file, first->site_file) != 0) {
                pkv_threadIdx = f.tid;
                fail(LAUNCH_FAILED, "barrier divergence: thread %u at __syncthreads %s:%d, thread %u at %s:%d", t,
                     f.site_file, f.site_line, (unsigned)(first - L->fibers.data()), first->site_file,
                     first->site_line);
                return false;
            }
        }
        if (stuck_in_warp) {
            for (unsigned t = 0; t < L->nthreads; t++)
                if (L->fibers[t].state == AT_WARP) {
                    pkv_threadIdx = L->fibers[t].tid;
                    fail(LAUNCH_FAILED, "warp divergence: a lane of mask 0x%08x never reached %s:%d",
                         L->fibers[t].warp_mask, L->fibers[t].site_file, L->fibers[t].site_line);
                    return false;
                }
        }
        if (!first) break;
        for (unsigned t = 0; t < L->nthreads; t++)
            if (L->fibers[t].state == AT_BARRIER) L->fibers[t].state = READY;
    }
    for (unsigned t = 1; t < L->nthreads; t++) {
        if (L->fibers[t].barriers != L->fibers[0].barriers) {
            pkv_threadIdx = L->fibers[t].tid;
            fail(LAUNCH_FAILED, "barrier divergence: thread %u passed %u __syncthreads, thread 0 passed %u", t,
                 L->fibers[t].barriers, L->fibers[0].barriers);
            return false;
        }
    }
    return true;
}

}  // namespace

extern "C" {

void pkv_syncthreads(const char* file, int line) {
    Launch* L = active;
    Fiber& f = L->fibers[(size_t)L->current];
    f.state = AT_BARRIER;
    f.site_file = file;
    f.site_line = line;
    f.barriers++;
    model_mark((unsigned)L->current);
    yield_to_scheduler();
}

static void warp_barrier(unsigned mask, int mode, const char* file, int line) {
    Launch* L = active;
    const unsigned t = (unsigned)L->current;
    const unsigned lane = t % 32, warp_base = t - lane;
    if (!(mask >> lane & 1u)) {
        fail(LAUNCH_FAILED, "warp intrinsic at %s:%d: lane %u is not in its own mask 0x%08x", file, line, lane, mask);
        abort_fiber();
    }
    for (unsigned l = 0; l < 32; l++)
        if ((mask >> l & 1u) && warp_base + l >= L->nthreads) {
            fail(LAUNCH_FAILED, "warp intrinsic at %s:%d: mask 0x%08x names lane %u past blockDim", file, line, mask, l);
            abort_fiber();
        }
    Fiber& f = L->fibers[t];
    f.state = AT_WARP;
    f.warp_mask = mask;
    f.warp_mode = mode;
    f.site_file = file;
    f.site_line = line;
    model_mark(t);
    yield_to_scheduler();
}

void pkv_syncwarp(unsigned mask, const char* file, int line) { warp_barrier(mask, -1, file, line); }

uint64_t pkv_warp_exchange(unsigned mask, uint64_t value, int mode, int arg, int width, const char* file, int line) {
    Launch* L = active;
    const unsigned t = (unsigned)L->current;
    const unsigned lane = t % 32, warp_base = t - lane;
    if (width <= 0 || width > 32 || (width & (width - 1))) {
        fail(LAUNCH_FAILED, "warp intrinsic at %s:%d: width %d is not a power of two up to 32", file, line, width);
        abort_fiber();
    }
    uint64_t* slots = &L->warp_slots[warp_base];
    slots[lane] = value;
    warp_barrier(mask, mode, file, line);
    uint64_t out;
    if (mode == PKV_BALLOT) {
        unsigned ballot = 0;
        for (unsigned l = 0; l < 32; l++)
            if ((mask >> l & 1u) && slots[l]) ballot |= 1u << l;
        out = ballot;
    } else {
        const unsigned seg = lane & ~(unsigned)(width - 1);
        unsigned src = lane;
        if (mode == PKV_SHFL_IDX) src = seg + ((unsigned)arg & (unsigned)(width - 1));
        if (mode == PKV_SHFL_XOR) src = lane ^ (unsigned)arg;
        if (mode == PKV_SHFL_UP) src = lane - seg >= (unsigned)arg ? lane - (unsigned)arg : lane;
        if (mode == PKV_SHFL_DOWN) src = lane - seg + (unsigned)arg < (unsigned)width ? lane + (unsigned)arg : lane;
        if (src >= 32 || (src & ~(unsigned)(width - 1)) != seg) src = lane;
        if (!(mask >> src & 1u)) {
            fail(LAUNCH_FAILED, "shuffle at %s:%d reads lane %u, outside mask 0x%08x", file, line, src, mask);
            abort_fiber();
        }
        out = slots[src];
    }
    warp_barrier(mask, mode, file, line);  // nobody overwrites a slot before every lane has read
    return out;
}

// A kernel touching unmapped memory (the stub keeps a guard page on each side of every
// allocation) ends the launch with CUDA_ERROR_ILLEGAL_ADDRESS.
static void on_memory_fault(int sig, siginfo_t* info, void*) {
    if (!active || active->current < 0) {
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    fail(ILLEGAL_ADDRESS, "illegal %s at address %p", sig == SIGBUS ? "access (SIGBUS)" : "memory access",
         info->si_addr);
    abort_fiber();
}

void pkv_trap(const char* file, int line) {
    fail(LAUNCH_FAILED, "__trap() at %s:%d", file, line);
    abort_fiber();
}

void pkv_check_alignment(const void* p, unsigned alignment, const char* what, const char* file, int line) {
    if ((uintptr_t)p % alignment == 0) return;
    fail(MISALIGNED_ADDRESS, "misaligned %s of address %p (needs %u-byte alignment) at %s:%d", what, p, alignment,
         file, line);
    abort_fiber();
}

// GCC's -fsanitize=alignment calls these on a misaligned (or null) access.
struct UbsanLocation {
    const char* file;
    uint32_t line, column;
};
struct UbsanTypeMismatch {
    UbsanLocation loc;
    const void* type;
    unsigned char log_alignment;
    unsigned char kind;
};

__attribute__((visibility("hidden"))) void __ubsan_handle_type_mismatch_v1(UbsanTypeMismatch* data, uintptr_t ptr) {
    if (!ptr)
        fail(ILLEGAL_ADDRESS, "null pointer access at %s:%u", data->loc.file, data->loc.line);
    else
        fail(MISALIGNED_ADDRESS, "misaligned access of address 0x%llx (needs %u-byte alignment) at %s:%u:%u",
             (unsigned long long)ptr, 1u << data->log_alignment, data->loc.file, data->loc.line, data->loc.column);
    abort_fiber();
}

__attribute__((visibility("hidden"))) void __ubsan_handle_type_mismatch_v1_abort(UbsanTypeMismatch* data,
                                                                                   uintptr_t ptr) {
    __ubsan_handle_type_mismatch_v1(data, ptr);
}

// ---- entry points for the stub -----------------------------------------------------------

PKV_EXPORT int pkv_harness_kernel_count(void) { return pkv_kernel_table_size; }

PKV_EXPORT const char* pkv_harness_kernel_name(int k) {
    return k >= 0 && k < pkv_kernel_table_size ? pkv_kernel_table[k].name : nullptr;
}

// Parameter sizes and alignments of kernel k; returns its parameter count (-1: no kernel k).
PKV_EXPORT int pkv_harness_kernel_params(int k, int* sizes, int* aligns, int max) {
    if (k < 0 || k >= pkv_kernel_table_size) return -1;
    const PkvKernel& kernel = pkv_kernel_table[k];
    for (int i = 0; i < kernel.nparams && i < max; i++) {
        sizes[i] = kernel.sizes[i];
        aligns[i] = kernel.aligns[i];
    }
    return kernel.nparams;
}

// The most threads a CTA of kernel k may have (its __launch_bounds__, else 1024; -1: no kernel k).
PKV_EXPORT int pkv_harness_kernel_max_threads(int k) {
    if (k < 0 || k >= pkv_kernel_table_size) return -1;
    return pkv_kernel_table[k].max_threads > 0 ? pkv_kernel_table[k].max_threads : 1024;
}

// Run kernel k over the grid; `order` 0/1/2 = CTAs (and fibers within a CTA) ascending,
// descending or shuffled by `seed`. Returns 0 or the CUDA status of the fault described
// in `message`. Not reentrant: the stub serialises launches.
PKV_EXPORT int pkv_harness_launch(int k, const unsigned* grid, const unsigned* block, void** params, int order,
                                  unsigned long long seed, char* message, int message_len) {
    if (k < 0 || k >= pkv_kernel_table_size) return 1;
    Launch L;
    L.kernel = &pkv_kernel_table[k];
    L.params = params;
    L.nthreads = block[0] * block[1] * block[2];
    L.fibers.resize(L.nthreads);
    L.stacks.resize(L.nthreads);
    L.warp_slots.assign(((L.nthreads + 31) / 32) * 32, 0);
    L.current = -1;
    L.status = OK;
    L.message = message;
    L.message_len = message_len;
    if (message_len > 0) message[0] = 0;
    for (auto& s : L.stacks) s = static_cast<char*>(std::malloc(STACK_BYTES));
    struct sigaction fault = {}, old_segv, old_bus;
    fault.sa_sigaction = on_memory_fault;
    fault.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&fault.sa_mask);
    sigaction(SIGSEGV, &fault, &old_segv);
    sigaction(SIGBUS, &fault, &old_bus);
    Launch* outer = active;
    active = &L;
    model_begin_launch(&L);
    pkv_blockDim = {block[0], block[1], block[2]};
    pkv_gridDim = {grid[0], grid[1], grid[2]};
    const unsigned nblocks = grid[0] * grid[1] * grid[2];
    L.thread_order = make_order(L.nthreads, order, seed ^ 0x5EEDull);
    const std::vector<unsigned> cta_order = make_order(nblocks, order, seed);
    for (unsigned b : cta_order) {
        const uint3 idx = {b % grid[0], b / grid[0] % grid[1], b / (grid[0] * grid[1])};
        const bool ok = run_cta(&L, idx);
        model_end_cta(&L);
        if (!ok) break;
    }
    model_end_launch(&L);
    sigaction(SIGSEGV, &old_segv, nullptr);
    sigaction(SIGBUS, &old_bus, nullptr);
    for (auto s : L.stacks) std::free(s);
    active = outer;
    return L.status;
}

}  // extern "C"
