// The page checks the kvsan CUDA kernels share: the refusal codes, the
// device shadow's record layout, and the read and store checks, exactly as
// kvsan-sanitizer's KernelShadow::check_read and KernelShadow::store decide,
// in the same order. Prepended to every source that checks pages
// (paged_attention.cu, check.cu), so each stays one translation unit that
// NVRTC compiles alone; no CUDA headers needed.
//
//   records[2 * page]      state word: bits 0..31 generation; 32..34 state
//                          (0 free, 1 owned, 2 receiving, 3 quarantined,
//                          4 allocating); 35 owner is terminal; 36 owner
//                          released its reference; 37 shared read-only;
//                          38 first write seen
//   records[2 * page + 1]  owner request
//   bits[page * stride ..] `stride` words; bit layer * page_slots + slot set
//                          once the slot was written for the layer

#define KVSAN_NONE 0xffffffffu

#define KVSAN_MODE_BOUNDS 0u
#define KVSAN_MODE_GENERATIONS 1u
#define KVSAN_MODE_SHADOW 2u

#define KVSAN_REFUSAL_WORDS 8u
#define KVSAN_REFUSED_NONE 0u
#define KVSAN_REFUSED_OUTSIDE_TABLE 1u
#define KVSAN_REFUSED_OUTSIDE_POOL 2u
#define KVSAN_REFUSED_GENERATION_MISMATCH 3u
#define KVSAN_REFUSED_READ_FREE_PAGE 4u
#define KVSAN_REFUSED_READ_DURING_TRANSFER 5u
#define KVSAN_REFUSED_FOREIGN_READ 6u
#define KVSAN_REFUSED_ARBITRATE 7u
#define KVSAN_REFUSED_TERMINAL 8u
#define KVSAN_REFUSED_STALE_READ 9u
#define KVSAN_REFUSED_WRITE_AFTER_FREE 10u
#define KVSAN_REFUSED_FOREIGN_WRITE 11u
// An engine's buffer the kernel could not use at all: a negative length or
// location, offsets that go backwards, a last page length outside
// 1 .. page_slots (check.cu only).
#define KVSAN_REFUSED_BAD_INPUT 12u

#define KVSAN_GENERATION_MASK 0xffffffffull
#define KVSAN_STATE_SHIFT 32
#define KVSAN_STATE_OWNED 1u
#define KVSAN_STATE_RECEIVING 2u
#define KVSAN_FLAG_TERMINAL_OWNER (1ull << 35)
#define KVSAN_FLAG_OWNER_RELEASED (1ull << 36)
#define KVSAN_FLAG_SHARED (1ull << 37)

// Bits lo .. hi of a word.
__device__ __forceinline__ unsigned long long kvsan_range_mask(unsigned int lo, unsigned int hi) {
    if (hi <= lo) {
        return 0ull;
    }
    if (hi - lo == 64u) {
        return ~0ull;
    }
    return ((1ull << (hi - lo)) - 1ull) << lo;
}

// The state a page's record is in, and whether it is free (free,
// quarantined, allocating: nobody may touch it).
__device__ __forceinline__ unsigned int kvsan_state(unsigned long long word) {
    return (unsigned int)((word >> KVSAN_STATE_SHIFT) & 7ull);
}

__device__ __forceinline__ bool kvsan_state_is_free(unsigned int state) {
    return state != KVSAN_STATE_OWNED && state != KVSAN_STATE_RECEIVING;
}

// Whether `who` is the holding owner of a page: its owner, not released.
__device__ __forceinline__ bool kvsan_held_by(
    unsigned long long word, unsigned long long owner, unsigned long long who)
{
    return (word & KVSAN_FLAG_OWNER_RELEASED) == 0ull && owner == who;
}

// Before `reader` reads slots lo_slot .. hi_slot of `page` (below n_pages)
// for `layer` through a PageRef of `generation`: KVSAN_REFUSED_NONE, or the
// refusal. *current gets the page's generation (NONE unchecked), *slot the
// first slot not written of a stale read (else NONE). Shadow order as
// KernelShadow::check_read: generation, free, receiving, not the holding
// owner (foreign, or arbitrate when shared), terminal owner, written bits.
__device__ unsigned int kvsan_check_read_slots(
    unsigned int mode,
    unsigned int page,
    unsigned int generation,
    unsigned int layer,
    unsigned int page_slots,
    unsigned int lo_slot,
    unsigned int hi_slot,
    const unsigned int* __restrict__ generations,
    const unsigned long long* __restrict__ records,
    const unsigned long long* __restrict__ bits,
    unsigned int stride,
    unsigned long long reader,
    unsigned int* current,
    unsigned int* slot)
{
    *current = KVSAN_NONE;
    *slot = KVSAN_NONE;
    if (mode == KVSAN_MODE_GENERATIONS) {
        *current = generations[page];
        return *current == generation ? KVSAN_REFUSED_NONE : KVSAN_REFUSED_GENERATION_MISMATCH;
    }
    if (mode != KVSAN_MODE_SHADOW) {
        return KVSAN_REFUSED_NONE;
    }
    const unsigned long long word = records[2ull * page];
    const unsigned long long owner = records[2ull * page + 1ull];
    const unsigned int state = kvsan_state(word);
    *current = (unsigned int)(word & KVSAN_GENERATION_MASK);
    if (*current != generation) {
        return KVSAN_REFUSED_GENERATION_MISMATCH;
    }
    if (kvsan_state_is_free(state)) {
        return KVSAN_REFUSED_READ_FREE_PAGE;
    }
    if (state == KVSAN_STATE_RECEIVING) {
        return KVSAN_REFUSED_READ_DURING_TRANSFER;
    }
    if (!kvsan_held_by(word, owner, reader)) {
        return (word & KVSAN_FLAG_SHARED) != 0ull ? KVSAN_REFUSED_ARBITRATE
                                                   : KVSAN_REFUSED_FOREIGN_READ;
    }
    if ((word & KVSAN_FLAG_TERMINAL_OWNER) != 0ull) {
        return KVSAN_REFUSED_TERMINAL;
    }
    // Layer-major packed bits: slots lo_slot .. hi_slot of the layer are bits
    // lo .. hi of the page's words (one word, or two when they straddle).
    const unsigned long long layer_base = (unsigned long long)layer * page_slots;
    const unsigned long long lo = layer_base + lo_slot;
    const unsigned long long hi = layer_base + hi_slot;
    const unsigned long long* page_bits = bits + (unsigned long long)page * stride;
    for (unsigned long long w = lo / 64ull; w * 64ull < hi; ++w) {
        const unsigned long long base = w * 64ull;
        const unsigned int a = lo > base ? (unsigned int)(lo - base) : 0u;
        const unsigned int b = hi < base + 64ull ? (unsigned int)(hi - base) : 64u;
        const unsigned long long missing = kvsan_range_mask(a, b) & ~page_bits[w];
        if (missing != 0ull) {
            *slot = (unsigned int)(base + (unsigned long long)(__ffsll((long long)missing) - 1) - layer_base);
            return KVSAN_REFUSED_STALE_READ;
        }
    }
    return KVSAN_REFUSED_NONE;
}

// Before `writer` stores into a slot of `page` (below n_pages) through a
// PageRef of `generation`: KVSAN_REFUSED_NONE or the refusal; *current as
// for reads. Shadow order as KernelShadow::store: generation, free
// (write-after-free), not the holding owner or the page shared read-only
// (foreign write: nobody writes a page the prefix cache or a request
// shares, its owner included), terminal owner.
__device__ unsigned int kvsan_check_store(
    unsigned int mode,
    unsigned int page,
    unsigned int generation,
    const unsigned int* __restrict__ generations,
    const unsigned long long* __restrict__ records,
    unsigned long long writer,
    unsigned int* current)
{
    *current = KVSAN_NONE;
    if (mode == KVSAN_MODE_GENERATIONS) {
        *current = generations[page];
        return *current == generation ? KVSAN_REFUSED_NONE : KVSAN_REFUSED_GENERATION_MISMATCH;
    }
    if (mode != KVSAN_MODE_SHADOW) {
        return KVSAN_REFUSED_NONE;
    }
    const unsigned long long word = records[2ull * page];
    const unsigned long long owner = records[2ull * page + 1ull];
    *current = (unsigned int)(word & KVSAN_GENERATION_MASK);
    if (*current != generation) {
        return KVSAN_REFUSED_GENERATION_MISMATCH;
    }
    if (kvsan_state_is_free(kvsan_state(word))) {
        return KVSAN_REFUSED_WRITE_AFTER_FREE;
    }
    if (!kvsan_held_by(word, owner, writer) || (word & KVSAN_FLAG_SHARED) != 0ull) {
        return KVSAN_REFUSED_FOREIGN_WRITE;
    }
    if ((word & KVSAN_FLAG_TERMINAL_OWNER) != 0ull) {
        return KVSAN_REFUSED_TERMINAL;
    }
    return KVSAN_REFUSED_NONE;
}
