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
};

template <class F>
struct PkvSignature;

// Each parameter's size and alignment come from the C++ signature; `call` unpacks the
// driver's `void** kernelParams` into the typed arguments.
template <class... A>
struct PkvSignature<void (*)(A...)> {
    static_assert(sizeof...(A) <= PKV_MAX_PARAMS);
    template <void (*F)(A...), std::size_t... I>
    static void call_with(void** params, std::index_sequence<I...>) {
        F(*static_cast<std::remove_cvref_t<A>*>(params[I])...);
    }
    template <void (*F)(A...)>
    static void call(void** params) {
        call_with<F>(params, std::index_sequence_for<A...>{});
    }
    template <void (*F)(A...)>
    static PkvKernel make(const char* name) {
        PkvKernel k{name, (int)sizeof...(A), {(int)sizeof(std::remove_cvref_t<A>)...},
                    {(int)alignof(std::remove_cvref_t<A>)...}, &call<F>};
        return k;
    }
};

#define PKV_KERNEL(fn) PkvSignature<decltype(&fn)>::make<&fn>(#fn)

extern "C" {
extern const PkvKernel pkv_kernel_table[];
extern const int pkv_kernel_table_size;
}
