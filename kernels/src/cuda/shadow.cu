// The device copy of the sanitizer's kernel shadow, kept in step by the
// host: scatter the listed pages' records and written words in, gather the
// listed pages' written words out. Compiled at run time by NVRTC; no CUDA
// headers needed.
//
//   records = page 0: state word, owner | page 1: ... | ...       (u64, 2 per page)
//   bits    = page 0: stride words | page 1: stride words | ...   (u64)
//
// One packed row per listed page on the host side of both: the scatter
// reads `2 + stride` words a page (state word, owner, then the written
// words), the gather writes `stride`. Grid: blocks striding over the listed
// words. The host checks every listed page against the pool before the
// launch; the kernels check again and skip a page outside it.

// Writes listed page k's record and written words from packed[k * (2 + stride) ..].
// A page listed twice gets the same words twice.
extern "C" __global__ void kvsan_shadow_scatter(
    unsigned long long* __restrict__ records,
    unsigned long long* __restrict__ bits,
    unsigned int n_pages,
    unsigned int stride,
    const unsigned int* __restrict__ pages,
    unsigned int n_listed,
    const unsigned long long* __restrict__ packed)
{
    const unsigned long long row = 2ull + stride;
    const unsigned long long total = (unsigned long long)n_listed * row;
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < total; i += step) {
        const unsigned long long k = i / row;
        const unsigned long long j = i % row;
        const unsigned int page = pages[k];
        if (page >= n_pages) {
            continue;
        }
        if (j < 2ull) {
            records[2ull * page + j] = packed[i];
        } else {
            bits[(unsigned long long)page * stride + (j - 2ull)] = packed[i];
        }
    }
}

// Copies listed page k's written words to out[k * stride ..] (zeros for a
// page outside the pool).
extern "C" __global__ void kvsan_shadow_gather_bits(
    const unsigned long long* __restrict__ bits,
    unsigned int n_pages,
    unsigned int stride,
    const unsigned int* __restrict__ pages,
    unsigned int n_listed,
    unsigned long long* __restrict__ out)
{
    const unsigned long long total = (unsigned long long)n_listed * stride;
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < total; i += step) {
        const unsigned int page = pages[i / stride];
        out[i] = page < n_pages ? bits[(unsigned long long)page * stride + i % stride] : 0ull;
    }
}
