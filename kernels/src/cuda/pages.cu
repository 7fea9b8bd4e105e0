// Whole-page operations on the kvsan KV page pool: poison-fill and copy.
// Compiled at run time by NVRTC; no CUDA headers needed.
//
// A page is page_elems f16 values (carried as their 16 bits), pages packed
// one after another:
//
//   pool = page 0 | page 1 | ... | page n_pages-1
//
// Grid: (one x per listed page or pair, y blocks striding over a page's
// elements). The host checks every listed page against the pool size before the
// launch; the kernels check again and skip an out-of-range page rather than
// write outside the pool.

// The poison pattern: an f16 quiet NaN whose payload spells 0x5A, so a dump
// tells a poisoned value (0x7E5A) from a NaN that arithmetic produced (GPUs
// produce 0x7FFF, x86 0x7E00). Any read of it turns attention output into NaN.
#define KVSAN_POISON_F16 ((unsigned short)0x7E5Au)

extern "C" __global__ void kvsan_poison_pages(
    unsigned short* __restrict__ pool,
    unsigned long long page_elems,
    unsigned int n_pages,
    const unsigned int* __restrict__ pages)
{
    const unsigned int page = pages[blockIdx.x];
    if (page >= n_pages) {
        return;
    }
    unsigned short* dst = pool + (unsigned long long)page * page_elems;
    const unsigned long long stride = (unsigned long long)gridDim.y * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.y * blockDim.x + threadIdx.x;
         i < page_elems; i += stride) {
        dst[i] = KVSAN_POISON_F16;
    }
}

// Copies page pairs[2k] of `src` to page pairs[2k + 1] of `dst`. Both pools
// have the same page_elems; `src` and `dst` are different allocations, and the
// host refuses a destination page listed twice, so no two blocks write the
// same element. When both pools start 16-byte aligned (device allocations
// do) and page_elems is a multiple of 8, every page starts 16-byte aligned
// and the copy moves 16 bytes per thread; otherwise 2 bytes.
extern "C" __global__ void kvsan_copy_pages(
    const unsigned short* __restrict__ src,
    unsigned int src_pages,
    unsigned short* __restrict__ dst,
    unsigned int dst_pages,
    unsigned long long page_elems,
    const unsigned int* __restrict__ pairs)
{
    const unsigned int from = pairs[2 * blockIdx.x];
    const unsigned int to = pairs[2 * blockIdx.x + 1];
    if (from >= src_pages || to >= dst_pages) {
        return;
    }
    const unsigned long long stride = (unsigned long long)gridDim.y * blockDim.x;
    const unsigned long long first = (unsigned long long)blockIdx.y * blockDim.x + threadIdx.x;
    const bool aligned =
        ((reinterpret_cast<unsigned long long>(src) | reinterpret_cast<unsigned long long>(dst))
         & 15ull) == 0ull;
    if (aligned && page_elems % 8ull == 0ull) {
        const uint4* s = reinterpret_cast<const uint4*>(src + (unsigned long long)from * page_elems);
        uint4* d = reinterpret_cast<uint4*>(dst + (unsigned long long)to * page_elems);
        const unsigned long long n = page_elems / 8ull;
        for (unsigned long long i = first; i < n; i += stride) {
            d[i] = s[i];
        }
    } else {
        const unsigned short* s = src + (unsigned long long)from * page_elems;
        unsigned short* d = dst + (unsigned long long)to * page_elems;
        for (unsigned long long i = first; i < page_elems; i += stride) {
            d[i] = s[i];
        }
    }
}
