// Lets a C++ compiler build the check kernels (check.cu, with
// shadow_check.cuh before it) as ordinary functions, so their decisions can
// be compared with the sanitizer's host-side batch checks on a machine
// without a GPU. The CUDA built-ins they use are given their meaning for
// one thread at a time: the harness runs every (block, thread) of a grid in
// turn, so the grid-stride row loop is exercised as the device runs it.
#include <cstdint>

struct kvsan_dim3 {
    unsigned int x, y, z;
};
static kvsan_dim3 blockIdx, blockDim, threadIdx, gridDim;

#define __device__
#define __global__
#define __forceinline__ inline

static inline int __ffsll(long long x) {
    return __builtin_ffsll(x);
}

static inline unsigned long long atomicOr(unsigned long long* address, unsigned long long value) {
    const unsigned long long old = *address;
    *address = old | value;
    return old;
}

static inline unsigned long long atomicMax(unsigned long long* address, unsigned long long value) {
    const unsigned long long old = *address;
    *address = old > value ? old : value;
    return old;
}

static inline unsigned int atomicAdd(unsigned int* address, unsigned int value) {
    const unsigned int old = *address;
    *address = old + value;
    return old;
}

// One thread at a time: every write is seen by the next thread.
static inline void __threadfence() {}
