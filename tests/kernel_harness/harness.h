// Registration of a kernel library's `extern "C" __global__` functions (build.py writes one
// PKV_KERNELS(...) line after the #include of the unchanged source) and the entry points
// the libcuda stub resolves by dlsym.
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>

#define PKV_MAX_PARAMS 32

struct PkvKernel {
    const char* name;
    int nparams;
    int sizes[PKV_MAX_PARAMS];
    int aligns[PKV_MAX_PARAMS];
    void (*entry)(void** params);
    int max_threads;  // from __launch_bounds__; 0 when the kernel declares none
};

template <class F>
struct PkvSignature;

// Each parameter's size and alignment come from the C++ signature; `call` unpacks the
// driver's `void** kernelParams` into the typed arguments.
template <class... A>
struct PkvSignature<void (*)(A...)> {
    static_assert(sizeof...(A) <= PKV_MAX_PARAMS);
    // not instrumented in a traffic-model build: reading the parameters is not kernel traffic
    template <void (*F)(A...), std::size_t... I>
    __attribute__((no_sanitize_address)) static void call_with(void** params, std::index_sequence<I...>) {
        F(*static_cast<std::remove_cvref_t<A>*>(params[I])...);
    }
    template <void (*F)(A...)>
    __attribute__((no_sanitize_address)) static void call(void** params) {
        call_with<F>(params, std::index_sequence_for<A...>{});
    }
    template <void (*F)(A...)>
    static PkvKernel make(const char* name, int max_threads) {
        PkvKernel k{name, (int)sizeof...(A), {(int)sizeof(std::remove_cvref_t<A>)...},
                    {(int)alignof(std::remove_cvref_t<A>)...}, &call<F>, max_threads};
        return k;
    }
};

// `bound` is the first __launch_bounds__ argument as written in the source (0: none),
// evaluated here so that macros and -D values resolve as in the kernel.
#define PKV_KERNEL(fn, bound) PkvSignature<decltype(&fn)>::make<&fn>(#fn, (int)(bound))

extern "C" {
extern const PkvKernel pkv_kernel_table[];
extern const int pkv_kernel_table_size;
}
