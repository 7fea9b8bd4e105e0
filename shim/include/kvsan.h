/*
 * kvsan.h — the C ABI of libkvsan_shim.so, the kvsan KV-cache sanitizer.
 *
 * Two uses:
 *
 *  1. LD_PRELOAD into an unmodified release kvsan engine: the engine looks up
 *     kvsan_hook_table_v1 with dlsym(RTLD_DEFAULT, ...) and sends every KV page
 *     event through the table.
 *  2. An engine written in C, C++ or Python (ctypes) annotates its own KV
 *     pool with the kvsan_* functions below, the way engines annotate pools
 *     for Valgrind (mempool client requests) or compute-sanitizer (NVTX).
 *
 * The invariant checked: a request may read a KV slot only if that request,
 * in the page's current generation, wrote it (computed it or received it in
 * a completed transfer), or the page is shared with it read-only.
 *
 * Conventions of the kvsan_* functions:
 *  - they return int32_t: KVSAN_OK (0) or a negative KVSAN_ERR_* code;
 *  - a checked call returns KVSAN_OK and writes a KvsanVerdict: code
 *    KVSAN_VERDICT_CONTINUE, or KVSAN_VERDICT_ABORT with the violation's kind
 *    (kvsan_violation_kind_name) and id (the report on stderr names it);
 *  - arguments are checked before anything changes: null or misaligned
 *    pointers, struct sizes other than the library's (pass sizeof), unknown
 *    event or role codes, a non-zero reserved field, unknown pools, pages,
 *    slots or layers out of range are error codes, never undefined behaviour;
 *  - a refused call is printed (the first 16) and kept as the calling
 *    thread's last error (kvsan_last_error);
 *  - every function may be called from any thread.
 *
 * Call kvsan_check_version(KVSAN_ABI_VERSION) once at start-up.
 * The layout is checked against the library's by the kvsan test suite.
 */
#ifndef KVSAN_H
#define KVSAN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVSAN_ABI_VERSION_MAJOR 1
#define KVSAN_ABI_VERSION_MINOR 6
#define KVSAN_ABI_VERSION ((uint32_t)((KVSAN_ABI_VERSION_MAJOR << 16) | KVSAN_ABI_VERSION_MINOR))

/* Status codes. */
#define KVSAN_OK 0
#define KVSAN_ERR_NULL (-1)             /* a required pointer argument is null */
#define KVSAN_ERR_SIZE (-2)             /* a struct size argument is not the library's */
#define KVSAN_ERR_VERSION (-3)          /* the caller's ABI version is not supported */
#define KVSAN_ERR_NOT_ATTACHED (-4)     /* bad KVSAN_OPTIONS or log file: nothing is checked */
#define KVSAN_ERR_UNKNOWN_POOL (-5)     /* pool id never returned by kvsan_pool_register */
#define KVSAN_ERR_OUT_OF_RANGE (-6)     /* page, slot, layer or token range outside the pool/table */
#define KVSAN_ERR_INVALID_ARGUMENT (-7) /* undefined event/role code, reserved != 0, misaligned, non-UTF-8 */
#define KVSAN_ERR_BAD_GEOMETRY (-8)     /* a pool geometry that cannot be shadowed */
#define KVSAN_ERR_TOO_MANY_POOLS (-9)   /* the pool limit is reached */
#define KVSAN_ERR_GENERATION (-10)      /* the engine's page generation differs from the shadow's */
#define KVSAN_ERR_INTERNAL (-11)        /* the library failed inside (caught); it wrote a report */
#define KVSAN_ERR_DEVICE (-12)          /* a device check or NVTX call could not run (no CUDA, or built without it) */

/* KvsanVerdict.code */
#define KVSAN_VERDICT_CONTINUE 0u /* go on */
#define KVSAN_VERDICT_ABORT 1u    /* abort the request the call concerns */
#define KVSAN_VERDICT_ERROR 2u    /* (hook table only) the call could not be checked */

/* KvsanHookTable.flags */
#define KVSAN_FLAG_POISON 1u /* the engine should poison-fill freed pages */

/* KvsanPoolGeometry.role */
#define KVSAN_ROLE_UNIFIED 0u
#define KVSAN_ROLE_PREFILL 1u
#define KVSAN_ROLE_DECODE 2u
/* OR'd into the role (since ABI 1.5): the engine reports where received KV
 * lands (kvsan_transfer_land before each copy, kvsan_transfer_verify after),
 * so kvsan_transfer_recv only reserves the destination pages. Without it (an
 * engine built before 1.5) kvsan_transfer_recv marks the manifest's slots
 * written, and where the bytes land is not checked; registering such a
 * receiving pool says so on stderr. */
#define KVSAN_POOL_REPORTS_LANDING 0x100u

/* Request events (kvsan_request_event). */
#define KVSAN_EVENT_QUEUED 0u
#define KVSAN_EVENT_ADMITTED 1u
#define KVSAN_EVENT_PREFILLING 2u
#define KVSAN_EVENT_TRANSFERRING 3u
#define KVSAN_EVENT_DECODING 4u
#define KVSAN_EVENT_FINISHED 5u
#define KVSAN_EVENT_REJECTED 6u
#define KVSAN_EVENT_ABORTED 7u

/* KvsanVerdict.kind: violation kinds' ABI codes, written, never reused. */
#define KVSAN_KIND_STALE_READ 0u
#define KVSAN_KIND_FOREIGN_READ 1u
#define KVSAN_KIND_GENERATION_MISMATCH 2u
#define KVSAN_KIND_READ_FREE_PAGE 3u
#define KVSAN_KIND_READ_DURING_TRANSFER 4u
#define KVSAN_KIND_FOREIGN_WRITE 5u
#define KVSAN_KIND_WRITE_AFTER_FREE 6u
#define KVSAN_KIND_DOUBLE_ALLOC 7u
#define KVSAN_KIND_DOUBLE_FREE 8u
#define KVSAN_KIND_FOREIGN_FREE 9u
#define KVSAN_KIND_TERMINAL_REQUEST_ACTIVITY 10u
#define KVSAN_KIND_SHORT_TRANSFER 11u
#define KVSAN_KIND_UNWRITTEN_TRANSFER 12u
#define KVSAN_KIND_PAGE_LEAK 13u
#define KVSAN_KIND_ILLEGAL_TRANSITION 14u
#define KVSAN_KIND_POISON_READ 15u
#define KVSAN_KIND_CROSS_DOMAIN_SHARE 16u
#define KVSAN_KIND_UNWRITTEN_SHARE 17u
#define KVSAN_KIND_MISDIRECTED_TRANSFER 18u
#define KVSAN_KIND_TRANSFER_DIGEST_MISMATCH 19u
#define KVSAN_KIND_TIER_BLOCK_ALIASED 20u
#define KVSAN_KIND_TIER_STORE_SOURCE_REUSED 21u
#define KVSAN_KIND_TIER_LOAD_UNSTORED 22u
#define KVSAN_KIND_TIER_FOREIGN_LOAD 23u
#define KVSAN_KIND_TIER_DIGEST_MISMATCH 24u

/* The request id reserved for the engine's prefix cache as a page holder
 * (UINT64_MAX; number requests below it). The cache takes a read-only
 * reference to a full page it registers with kvsan_share, as the owner
 * {KVSAN_PREFIX_CACHE_REQUEST, <the writer's tenant>, 0}, and lets go of it
 * with kvsan_free of the same owner when it evicts the page; the writer
 * frees its own reference as usual, and the page stays until its last
 * holder lets go. The cache has no lifecycle (no page-leak, no
 * events; kvsan_alloc refuses it), its shares are checked for a filled,
 * committed, current page but not against prefix_share (each request it
 * shares the page with is), and reports name it "prefix cache". */
#define KVSAN_PREFIX_CACHE_REQUEST UINT64_MAX

/* A request and the tenant it is billed to. 16 bytes. */
typedef struct KvsanOwner {
    uint64_t request;
    uint32_t tenant;
    uint32_t reserved; /* 0 */
} KvsanOwner;

/* A block-table entry: page index and the generation it was allocated at
 * (kvsan_alloc returns it). 8 bytes. */
typedef struct KvsanPageRef {
    uint32_t page;
    uint32_t generation;
} KvsanPageRef;

/* A half-open range start..end. 8 bytes. */
typedef struct KvsanRange {
    uint32_t start;
    uint32_t end;
} KvsanRange;

/* A pool's shape. node: the node's name, UTF-8, not NUL-terminated. 40 bytes on LP64. */
typedef struct KvsanPoolGeometry {
    uint32_t pages;
    uint32_t page_slots; /* 1..4096 */
    uint32_t layers;     /* 1..65536 */
    uint32_t role;       /* KVSAN_ROLE_*, | KVSAN_POOL_REPORTS_LANDING */
    uint64_t bytes_per_slot;
    const uint8_t *node;
    size_t node_len;
} KvsanPoolGeometry;

/* What a KV transfer claims to carry. Block tables from token 0. 80 bytes on LP64. */
typedef struct KvsanManifest {
    KvsanOwner request;
    uint32_t src_pool;
    uint32_t dst_pool;
    const KvsanPageRef *src_pages;
    size_t src_len;
    const KvsanPageRef *dst_pages;
    size_t dst_len;
    uint32_t first_token;
    uint32_t tokens;
    KvsanRange layers;
    uint64_t checksum;
} KvsanManifest;

/* One destination page of a transfer (since ABI 1.5): tokens first_token ..
 * first_token + (slots.end - slots.start) of `request`, layers `layers`,
 * land in slots `slots` of `page` (through the tag the receiver holds for
 * it). kvsan_transfer_land: what a copy is about to write (the digests are
 * not looked at); kvsan_transfer_verify: what the page holds once the bytes
 * are there. The digests are opaque to kvsan (it never sees KV bytes) and
 * never appear in a report. 64 bytes on LP64. */
typedef struct KvsanPageLanding {
    KvsanOwner request;
    KvsanPageRef page;
    uint64_t first_token;
    KvsanRange slots;
    KvsanRange layers;
    uint64_t sent_digest;   /* the sender's digest of these tokens' KV */
    uint64_t landed_digest; /* the receiver's digest of what the slots hold now */
} KvsanPageLanding;

/* Where a pool's kernel shadow lives (kvsan_kernel_shadow): the library's
 * page records, written bits and check counters, which an engine's KV kernels
 * read and update in place, with atomic operations only. 56 bytes.
 *
 *   record of page p: records + p * record_size (record_size 32)
 *     +0  uint64_t state word: bits 0..31 generation, 32..34 state
 *         (0 free, 1 owned, 2 receiving, 3 quarantined, 4 allocating),
 *         bit 35 owner ended, 36 owner released, 37 shared, 38 first write seen
 *     +8  uint64_t owner request   +16 uint32_t owner tenant
 *     +24 uint64_t first kernel write's step + 1 (0: none)
 *   written bits of page p: bits + p * stride_words; bit
 *     (layer * page_slots + slot) is set once the owner wrote that slot of
 *     that layer in the page's current generation
 *   counters[0]: pages read-checked, counters[1]: stores checked
 *
 * A read of slots 0..n of layer l of page p through a PageRef is legal when
 * the generation matches, the state is owned, the owner is the reader and
 * has not released or ended, and the n bits are set; a store into a slot is
 * legal when the generation matches, the state is owned or receiving, the
 * owner is the writer and has not released or ended, and the page is not
 * shared (bit 37: nobody writes a page others hold read-only). Anything
 * else goes to kvsan_kernel_refusal. */
typedef struct KvsanKernelShadow {
    uint32_t size; /* sizeof(KvsanKernelShadow) */
    uint32_t layout_version;
    uint32_t pages;
    uint32_t page_slots;
    uint32_t layers;
    uint32_t record_size;
    uint32_t stride_words; /* ceil(layers * page_slots / 64) */
    uint32_t reserved;
    const void *records;
    const uint64_t *bits;
    uint64_t *counters;
} KvsanKernelShadow;

/* A kernel access its in-place check did not pass. 32 bytes. */
typedef struct KvsanKernelAccess {
    uint32_t op;    /* KVSAN_ACCESS_* */
    uint32_t layer;
    KvsanPageRef page; /* the PageRef the kernel used */
    KvsanRange slots;  /* read: 0..n; store, poison: s..s+1 */
    uint32_t entry;    /* read, poison: block-table entry; store: token position */
    uint32_t reserved; /* 0 */
} KvsanKernelAccess;

/* KvsanKernelAccess.op */
#define KVSAN_ACCESS_READ 0u
#define KVSAN_ACCESS_STORE 1u
#define KVSAN_ACCESS_POISON 2u /* poison reached attention output from this slot */

/* What a check says. 16 bytes. */
typedef struct KvsanVerdict {
    uint32_t code;         /* KVSAN_VERDICT_* */
    uint32_t kind;         /* with ABORT: the violation kind's ABI code (KVSAN_KIND_*) */
    uint64_t violation_id; /* with ABORT: the id the report names (KV-000042) */
} KvsanVerdict;

/* ---- the hook table (what a release kvsan engine looks up) ---------------- */

typedef KvsanVerdict (*KvsanPoolRegisterFn)(void *ctx, const KvsanPoolGeometry *geometry,
                                            uint32_t *pool_out);
typedef KvsanVerdict (*KvsanRequestEventFn)(void *ctx, KvsanOwner owner, uint32_t event);
typedef KvsanVerdict (*KvsanPageFn)(void *ctx, uint32_t pool, KvsanOwner owner, KvsanPageRef page,
                                    uint64_t step);
typedef KvsanVerdict (*KvsanWriteFn)(void *ctx, uint32_t pool, KvsanOwner owner, KvsanPageRef page,
                                     KvsanRange slots, KvsanRange layers, uint64_t step);
typedef KvsanVerdict (*KvsanReadFn)(void *ctx, uint32_t pool, KvsanOwner owner,
                                    const KvsanPageRef *table, size_t table_len, uint64_t tokens,
                                    KvsanRange layers, uint64_t step);
typedef KvsanVerdict (*KvsanTransferFn)(void *ctx, uint32_t pool, const KvsanManifest *manifest);
typedef KvsanVerdict (*KvsanCommitFn)(void *ctx, uint32_t pool, KvsanOwner owner,
                                      const KvsanPageRef *table, size_t table_len,
                                      uint64_t committed_tokens);
typedef KvsanVerdict (*KvsanKernelShadowFn)(void *ctx, uint32_t pool, KvsanKernelShadow *out);
typedef KvsanVerdict (*KvsanKernelRefusalFn)(void *ctx, uint32_t pool, KvsanOwner owner,
                                             const KvsanKernelAccess *access, uint64_t step);
typedef KvsanVerdict (*KvsanRequestEventAtFn)(void *ctx, uint32_t pool, KvsanOwner owner,
                                              uint32_t event);
typedef KvsanVerdict (*KvsanShareFn)(void *ctx, uint32_t pool, KvsanPageRef page,
                                     KvsanOwner sharer);
typedef KvsanVerdict (*KvsanDeclareSaltFn)(void *ctx, KvsanOwner owner, uint64_t salt);
typedef KvsanVerdict (*KvsanLandingFn)(void *ctx, uint32_t pool, const KvsanPageLanding *landing);
typedef KvsanVerdict (*KvsanTierPageFn)(void *ctx, uint32_t pool, KvsanOwner owner,
                                        KvsanPageRef page, uint32_t tier, uint64_t block,
                                        uint64_t step);
typedef KvsanVerdict (*KvsanTierStoreDoneFn)(void *ctx, uint32_t tier, uint64_t block,
                                             uint64_t digest, uint32_t stored);
typedef KvsanVerdict (*KvsanTierVerifyFn)(void *ctx, uint32_t pool, KvsanOwner owner,
                                          KvsanPageRef page, uint32_t tier, uint64_t block,
                                          uint64_t digest);
typedef KvsanVerdict (*KvsanTierReleaseFn)(void *ctx, uint32_t tier, uint64_t block);

/* Version 1.6, 192 bytes on LP64 (1.5 ends before tier_store, 152 bytes;
 * 1.2 to 1.4 end before transfer_land,
 * 136 bytes: 1.3 and 1.4 added C functions, not hooks; 1.1 ends before
 * share, 120 bytes; 1.0 before kernel_shadow, 96 bytes). `size` first; a
 * newer minor only appends. */
typedef struct KvsanHookTable {
    uint32_t size;
    uint16_t version_major;
    uint16_t version_minor;
    uint32_t flags; /* KVSAN_FLAG_* */
    uint32_t quarantine_pages;
    void *ctx;
    KvsanPoolRegisterFn pool_register;
    KvsanRequestEventFn request_event;
    KvsanPageFn alloc;
    KvsanPageFn free;
    KvsanWriteFn write;
    KvsanReadFn read;
    KvsanTransferFn transfer_send;
    KvsanTransferFn transfer_recv;
    KvsanCommitFn transfer_commit;
    KvsanKernelShadowFn kernel_shadow;   /* 1.1 */
    KvsanKernelRefusalFn kernel_refusal; /* 1.1 */
    KvsanRequestEventAtFn request_event_at; /* 1.1 */
    KvsanShareFn share;                     /* 1.2 */
    KvsanDeclareSaltFn declare_salt;        /* 1.2 */
    KvsanLandingFn transfer_land;           /* 1.5 */
    KvsanLandingFn transfer_verify;         /* 1.5 */
    KvsanTierPageFn tier_store;             /* 1.6 */
    KvsanTierStoreDoneFn tier_store_done;   /* 1.6 */
    KvsanTierPageFn tier_load;              /* 1.6 */
    KvsanTierVerifyFn tier_verify;          /* 1.6 */
    KvsanTierReleaseFn tier_release;        /* 1.6 */
} KvsanHookTable;

/* The table, valid for the rest of the process; NULL if the library refused
 * to attach (bad KVSAN_OPTIONS). */
const KvsanHookTable *kvsan_hook_table_v1(void);

/* ---- version and state ---------------------------------------------------- */

/* The library's ABI version, major << 16 | minor. */
uint32_t kvsan_abi_version(void);
/* KVSAN_OK if a caller built against caller_version (KVSAN_ABI_VERSION) can
 * use this library (same major, minor not newer), else KVSAN_ERR_VERSION. */
int32_t kvsan_check_version(uint32_t caller_version);
/* 1 if the library attached at load (KVSAN_OPTIONS parsed), else 0. */
int32_t kvsan_attached(void);

/* ---- pools and requests --------------------------------------------------- */

/* Registers a pool; geometry_size = sizeof(KvsanPoolGeometry). */
int32_t kvsan_pool_register(const KvsanPoolGeometry *geometry, size_t geometry_size,
                            uint32_t *pool_out);
/* A request enters state `event` (KVSAN_EVENT_*), in the whole process's view. */
int32_t kvsan_request_event(KvsanOwner owner, uint32_t event, KvsanVerdict *verdict_out);
/* The same in the view of the node that owns `pool`: in a disaggregated
 * engine each node reports its own events, and one node ending a request
 * (a cancel) does not end it for its peer until the peer reports its end. */
int32_t kvsan_request_event_at(uint32_t pool, KvsanOwner owner, uint32_t event,
                               KvsanVerdict *verdict_out);

/* ---- page events ---------------------------------------------------------- */

/* Page index `page` was taken from the free list for `owner`; writes its new
 * KvsanPageRef (the tag to keep in the block table). */
int32_t kvsan_alloc(uint32_t pool, KvsanOwner owner, uint32_t page, uint64_t step,
                    KvsanPageRef *page_out, KvsanVerdict *verdict_out);
/* `owner` returns `page`. */
int32_t kvsan_free(uint32_t pool, KvsanOwner owner, KvsanPageRef page, uint64_t step,
                   KvsanVerdict *verdict_out);
/* The prefix cache shares `page` read-only with `sharer`: a request that got
 * a cache hit (checked against prefix_share), or the cache itself
 * (KVSAN_PREFIX_CACHE_REQUEST) registering a page. The sharer lets go with
 * kvsan_free. While a page is shared nobody writes it, its owner included
 * (foreign-write). */
int32_t kvsan_share(uint32_t pool, KvsanPageRef page, KvsanOwner sharer,
                    KvsanVerdict *verdict_out);
/* `owner` declares its cache salt (a hash of it; 0: none) before it takes
 * pages: under KVSAN_OPTIONS=prefix_share=salt only requests that declared
 * the same salt share a page; under prefix_share=tenant (the default) only
 * requests of the writer's tenant that declared the same salt (unsalted
 * ones share among themselves). Reports never show a salt. */
int32_t kvsan_declare_salt(KvsanOwner owner, uint64_t salt, KvsanVerdict *verdict_out);
/* `owner` computed KV into slots x layers of `page`. */
int32_t kvsan_write(uint32_t pool, KvsanOwner owner, KvsanPageRef page, KvsanRange slots,
                    KvsanRange layers, uint64_t step, KvsanVerdict *verdict_out);
/* Attention of `owner` is about to read the first `tokens` positions of the
 * block table table[0..table_len] for `layers`. */
int32_t kvsan_read(uint32_t pool, KvsanOwner owner, const KvsanPageRef *table, size_t table_len,
                   uint64_t tokens, KvsanRange layers, uint64_t step, KvsanVerdict *verdict_out);

/* ---- kernels that check in place ------------------------------------------ */

/* Describes pool `pool`'s kernel shadow (out_size = sizeof(KvsanKernelShadow)). */
int32_t kvsan_kernel_shadow(uint32_t pool, KvsanKernelShadow *out, size_t out_size);
/* The cold path of a kernel access that did not pass its in-place check:
 * checked against the whole shadow, reported; the verdict says whether the
 * kernel may go on (access_size = sizeof(KvsanKernelAccess)). */
int32_t kvsan_kernel_refusal(uint32_t pool, KvsanOwner owner, const KvsanKernelAccess *access,
                             size_t access_size, uint64_t step, KvsanVerdict *verdict_out);

/* ---- batch checks over the kernels' own argument buffers ------------------ */
/* An engine that cannot change its attention or store kernel passes the
 * buffers it hands the kernel, with each row's request, just before the
 * launch. Each entry is checked where the kernel reads it (a row longer than
 * its stride reads the next row's entries), a page index at the page's
 * current generation. One verdict per row goes to verdicts_out[0..rows].
 * A buffer the kernel could not use (an index outside the buffer or the
 * pool, a negative length, offsets going backwards) is
 * KVSAN_ERR_OUT_OF_RANGE, its message naming the row; no verdict is written. */

/* Padded block table (vLLM, FlashAttention): row r reads seq_lens[r] tokens
 * through block_table[r * stride ...] (page indices). */
int32_t kvsan_check_block_table(uint32_t pool, const KvsanOwner *owners, size_t rows,
                                const int32_t *block_table, size_t table_len, size_t stride,
                                const int32_t *seq_lens, KvsanRange layers, uint64_t step,
                                KvsanVerdict *verdicts_out);
/* Pages in CSR form (FlashInfer): row r reads pages
 * indices[indptr[r] .. indptr[r + 1]], full but the last, which holds
 * last_page_len[r] tokens. indptr has rows + 1 entries, indices nnz. */
int32_t kvsan_check_paged_csr(uint32_t pool, const KvsanOwner *owners, size_t rows,
                              const int32_t *indptr, const int32_t *indices, size_t nnz,
                              const int32_t *last_page_len, KvsanRange layers, uint64_t step,
                              KvsanVerdict *verdicts_out);
/* Token-level table (SGLang): row r reads seq_lens[r] tokens at locations
 * req_to_token[req_indices[r] * stride + t] = page * page_slots + slot. */
int32_t kvsan_check_req_to_token(uint32_t pool, const KvsanOwner *owners, size_t rows,
                                 const int32_t *req_to_token, size_t table_len, size_t stride,
                                 const int32_t *req_indices, const int32_t *seq_lens,
                                 KvsanRange layers, uint64_t step, KvsanVerdict *verdicts_out);
/* Store slots (vLLM's reshape_and_cache): tokens query_start_loc[r] ..
 * query_start_loc[r + 1] are row r's; token t stores at location
 * slot_mapping[t] (page * page_slots + slot; -1 is padding). Each slot
 * stored is checked as kvsan_write and recorded written. */
int32_t kvsan_check_slot_mapping(uint32_t pool, const KvsanOwner *owners, size_t rows,
                                 const int32_t *query_start_loc, const int64_t *slot_mapping,
                                 size_t tokens, KvsanRange layers, uint64_t step,
                                 KvsanVerdict *verdicts_out);

/* The same four checks over CUDA device buffers, where the engine's kernel
 * will read them (since ABI 1.3): each buffer is a device address (a
 * CUdeviceptr, e.g. torch's tensor.data_ptr()) on device `device`, with its
 * length in values as above. The call waits for the device's queued work
 * (the engine's writes to the buffers), copies the pool's kernel shadow to
 * the device and runs kvsan's CUDA check kernel over the buffers in place;
 * the buffers are copied to the host only when a row is refused, and that
 * row is then reported by the host check above on the copied values (the
 * same verdicts, reports and KVSAN_ERR_OUT_OF_RANGE). Stores let through
 * are recorded written. KVSAN_ERR_DEVICE when the check cannot run: a
 * library built without the `cuda` feature, no CUDA driver or NVRTC, no
 * such device, or a CUDA failure (the message says which). */
int32_t kvsan_check_block_table_device(uint32_t pool, int32_t device, const KvsanOwner *owners,
                                       size_t rows, uint64_t block_table, size_t table_len,
                                       size_t stride, uint64_t seq_lens, KvsanRange layers,
                                       uint64_t step, KvsanVerdict *verdicts_out);
int32_t kvsan_check_paged_csr_device(uint32_t pool, int32_t device, const KvsanOwner *owners,
                                     size_t rows, uint64_t indptr, uint64_t indices, size_t nnz,
                                     uint64_t last_page_len, KvsanRange layers, uint64_t step,
                                     KvsanVerdict *verdicts_out);
int32_t kvsan_check_req_to_token_device(uint32_t pool, int32_t device, const KvsanOwner *owners,
                                        size_t rows, uint64_t req_to_token, size_t table_len,
                                        size_t stride, uint64_t req_indices, uint64_t seq_lens,
                                        KvsanRange layers, uint64_t step,
                                        KvsanVerdict *verdicts_out);
int32_t kvsan_check_slot_mapping_device(uint32_t pool, int32_t device, const KvsanOwner *owners,
                                        size_t rows, uint64_t query_start_loc,
                                        uint64_t slot_mapping, size_t tokens, KvsanRange layers,
                                        uint64_t step, KvsanVerdict *verdicts_out);

/* ---- NVTX registration for compute-sanitizer (since ABI 1.4) -------------- */

/* Where one plane of a pool's pages lies in device memory: page p is
 * [base + p * page_stride, + page_bytes). A page in several tensors (a K
 * and a V tensor per layer) is several planes. */
typedef struct KvsanNvtxPlane {
    uint64_t base;
    uint64_t page_stride;
    uint64_t page_bytes;
} KvsanNvtxPlane;

/* Describes pool `pool`'s pages on device `device` to NVTX, so that NVIDIA's
 * compute-sanitizer sees them: each allocation holding a plane becomes an
 * NVTX heap (a sub-allocator: memcheck reports an access to any part of it
 * no region covers), and every page the pool holds now (owned or
 * receiving) a region named after its page, generation and request. From
 * then on kvsan_alloc/free (and the hook table's alloc/free) keep the
 * regions in step: a freed page is unregistered, so a kernel reading it is
 * a memcheck error; a reused page is registered anew, so initcheck reports
 * a read of it before its new owner wrote it. plane_size =
 * sizeof(KvsanNvtxPlane). Call it once the CUDA context exists, once per
 * pool (the tool takes one heap per allocation), and
 * kvsan_nvtx_forget_pool before freeing the memory. The heap is the whole
 * allocation holding a plane: nothing else the kernels touch may live in
 * it. No tool attached (not run under compute-sanitizer): KVSAN_OK, and
 * the calls are bookkeeping only. KVSAN_ERR_DEVICE when the library was
 * built without the `nvtx` feature, or the driver cannot be reached;
 * KVSAN_ERR_INVALID_ARGUMENT for planes that overlap, lie outside a device
 * allocation, or a pool already described. */
int32_t kvsan_nvtx_describe_pool(uint32_t pool, int32_t device, const KvsanNvtxPlane *planes,
                                 size_t n_planes, size_t plane_size);
/* Binds, to the CUDA work this thread enqueues from now on, permissions in
 * which the pages held by the listed requests are read-write and every
 * other held page of the pool has no access: memcheck reports a kernel of
 * these requests touching another request's page. Replaces an earlier
 * binding of the pool. */
int32_t kvsan_nvtx_bind(uint32_t pool, const uint64_t *requests, size_t n_requests);
/* Ends the pool's binding, if any. */
int32_t kvsan_nvtx_unbind(uint32_t pool);
/* Ends the pool's NVTX description (its heaps and regions). */
int32_t kvsan_nvtx_forget_pool(uint32_t pool);

/* ---- transfers (disaggregated prefill -> decode) -------------------------- */
/* The sender calls kvsan_transfer_send before it ships; the receiver, on a
 * pool registered with KVSAN_POOL_REPORTS_LANDING:
 *   1. kvsan_transfer_recv when the transfer arrives: the destination pages
 *      must be the request's; they become receiving (reserved for it).
 *      Nothing counts as written yet.
 *   2. kvsan_transfer_land before each copy of received KV into a page: only
 *      on KVSAN_VERDICT_CONTINUE may the copy write, and then its slots
 *      count as written. A page the request does not hold, or holds but did
 *      not reserve, is misdirected-transfer (and stays as it was).
 *   3. kvsan_transfer_verify once the bytes are there, with the receiver's
 *      digest of what each page holds and the sender's digest of those
 *      tokens: different digests are transfer-digest-mismatch; equal ones
 *      also mark the slots written (how a landing no copy showed, an RDMA
 *      WRITE, gets marked).
 *   4. kvsan_transfer_commit before decode reads: every slot below the
 *      committed tokens must have been written (short-transfer otherwise).
 * On a pool registered without the bit, kvsan_transfer_recv marks the
 * manifest's slots written, as before 1.5, and neither 2 nor 3 is needed. */

/* manifest_size = sizeof(KvsanManifest). `pool` is the caller's side. */
int32_t kvsan_transfer_send(uint32_t pool, const KvsanManifest *manifest, size_t manifest_size,
                            KvsanVerdict *verdict_out);
int32_t kvsan_transfer_recv(uint32_t pool, const KvsanManifest *manifest, size_t manifest_size,
                            KvsanVerdict *verdict_out);
/* A copy is about to put received KV where `landing` says (since ABI 1.5);
 * landing_size = sizeof(KvsanPageLanding). */
int32_t kvsan_transfer_land(uint32_t pool, const KvsanPageLanding *landing, size_t landing_size,
                            KvsanVerdict *verdict_out);
/* Received KV is in `landing`'s page: its digests compared (since ABI 1.5);
 * landing_size = sizeof(KvsanPageLanding). */
int32_t kvsan_transfer_verify(uint32_t pool, const KvsanPageLanding *landing, size_t landing_size,
                              KvsanVerdict *verdict_out);
/* The receiver starts using the first committed_tokens positions of table. */
int32_t kvsan_transfer_commit(uint32_t pool, KvsanOwner owner, const KvsanPageRef *table,
                              size_t table_len, uint64_t committed_tokens,
                              KvsanVerdict *verdict_out);

/* ---- KV tiers (since ABI 1.6) ---------------------------------------------- */

/* An engine that moves KV pages out of a pool (host memory, disk) and back
 * names each tier block (tier, block) with its own numbers, and reports:
 *   1. kvsan_tier_store when a store into a block starts reading `page`, for
 *      `owner` (the request, or the prefix cache's owner
 *      {KVSAN_PREFIX_CACHE_REQUEST, <the writer's tenant>, 0} evicting a
 *      cached page). The page must be held by the owner at its tag; a block
 *      still storing or holding another page is tier-block-aliased. The
 *      block takes the page's identity: its writer and salt, whether it is
 *      the prefix cache's, its written slots now.
 *   2. kvsan_tier_store_done when the store completed (stored = 1, with the
 *      engine's digest of what the tier holds) or failed (stored = 0). A
 *      source page freed or re-allocated before the store completed is
 *      tier-store-source-reused; such a block, like a failed one, is never
 *      loaded.
 *   3. kvsan_tier_load before each copy of a block into a page: only on
 *      KVSAN_VERDICT_CONTINUE may the copy write, and then exactly the slots
 *      the store found written count as written. A block whose store did
 *      not complete is tier-load-unstored; another request's block, or a
 *      prefix-cache block the isolation policy keeps from `owner`, is
 *      tier-foreign-load; the page is checked like a store into it.
 *   4. kvsan_tier_verify once the bytes are there, with the engine's digest
 *      of what the page holds: unequal to the store's, tier-digest-mismatch.
 *   5. kvsan_tier_release when the tier lets go of the block.
 * Digests are the engine's (any 64-bit digest of the page's bytes, the same
 * at store and load); reports never print them. */
int32_t kvsan_tier_store(uint32_t pool, KvsanOwner owner, KvsanPageRef page, uint32_t tier,
                         uint64_t block, uint64_t step, KvsanVerdict *verdict_out);
int32_t kvsan_tier_store_done(uint32_t tier, uint64_t block, uint64_t digest, uint32_t stored,
                              KvsanVerdict *verdict_out);
int32_t kvsan_tier_load(uint32_t pool, KvsanOwner owner, KvsanPageRef page, uint32_t tier,
                        uint64_t block, uint64_t step, KvsanVerdict *verdict_out);
int32_t kvsan_tier_verify(uint32_t pool, KvsanOwner owner, KvsanPageRef page, uint32_t tier,
                          uint64_t block, uint64_t digest, KvsanVerdict *verdict_out);
int32_t kvsan_tier_release(uint32_t tier, uint64_t block, KvsanVerdict *verdict_out);

/* ---- results and diagnostics ---------------------------------------------- */

/* Violations counted so far. */
int32_t kvsan_violation_count(uint64_t *count_out);
/* Violations of kind `kind` (a KvsanVerdict.kind code) counted so far;
 * KVSAN_ERR_INVALID_ARGUMENT for a code this library does not define. */
int32_t kvsan_violation_count_of(uint32_t kind, uint64_t *count_out);
/* Checks performed so far (pages read-checked, writes and stores,
 * transfers, allocations, frees). */
int32_t kvsan_check_count(uint64_t *count_out);
/* The summary line ("kvsan: N violations (kind: n, ...)") into buf,
 * truncated and NUL-terminated; its full length in *len_out. */
int32_t kvsan_summary(char *buf, size_t buf_len, size_t *len_out);
/* The calling thread's last refused call's message into buf (truncated,
 * NUL-terminated); returns its full length, 0 if none. */
size_t kvsan_last_error(char *buf, size_t buf_len);
/* Calls refused since load, all threads. */
uint64_t kvsan_refused_calls(void);
/* "stale-read" for a KvsanVerdict.kind, or NULL. Static string. */
const char *kvsan_violation_kind_name(uint32_t kind);
/* "KVSAN_ERR_NULL" for a status code, or NULL. Static string. */
const char *kvsan_status_name(int32_t status);

#ifdef __cplusplus
}
#endif

#endif /* KVSAN_H */
