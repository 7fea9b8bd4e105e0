// Standalone checks over the buffers an engine hands its own attention and
// store kernels (FlashAttention, FlashInfer, Triton, vLLM's
// reshape_and_cache), against the device copy of the sanitizer's kernel
// shadow, launched on the engine's stream just before the engine's kernel.
// The buffers are read where they lie on the device, as the engine's kernel
// will read them; nothing is copied to the host but one record per row.
// shadow_check.cuh (the codes, the record layout, the page checks) is
// prepended to this source.
//
// Layouts (every buffer i32 but slot_mapping, i64, as the engines keep them):
//
//   block table  block_table[n_table] read as rows of row_stride entries,
//                seq_lens[rows]; row r reads seq_lens[r] tokens through
//                entries block_table[r * row_stride + e], e < ceil(len / page_slots)
//                (vLLM, FlashAttention)
//   paged CSR    indptr[rows + 1], indices[n_indices], last_page_len[rows];
//                row r reads pages indices[indptr[r] .. indptr[r + 1]], all
//                full but the last, which holds last_page_len[r] tokens (FlashInfer)
//   token table  req_to_token[n_table] read as rows of row_stride locations,
//                req_indices[rows], seq_lens[rows]; row r reads token t at
//                location req_to_token[req_indices[r] * row_stride + t],
//                t < seq_lens[r]; a location is page * page_slots + slot (SGLang)
//   store slots  query_start_loc[rows + 1], slot_mapping[n_slots]; row r
//                stores token t (query_start_loc[r] <= t < query_start_loc[r + 1])
//                at location slot_mapping[t], -1 padding (vLLM's reshape_and_cache)
//
// An entry past the end of its buffer is read by the row it belongs to, as
// the engine's kernel reads it: a row whose length runs past its stride
// reads the next row's entries. The buffers carry no generations: each page
// is taken at the generation its shadow record holds now, so a stale or
// reused buffer shows as a read of a page another request holds
// (foreign-read) or that is free (read-free-page), not as a generation
// mismatch.
//
// Each row is looked at twice, like the host's batch checks
// (kvsan-sanitizer's Sanitizer::check_block_table and its neighbours): first
// whether the engine's kernel could use its buffers at all (every entry
// inside its buffer, every page inside the pool, lengths and offsets that
// make sense), then each access, in order, for every layer of
// layer_lo .. layer_hi, until the first refused one. The row's record
//
//   refusals[KVSAN_REFUSAL_WORDS * row] =
//     { code, index, page, generation, current, slot, slots, layer }
//     code        KVSAN_REFUSED_* (0: none)
//     index       block table, CSR: the row's entry; token table, store
//                 slots: the token; NONE for a length or offsets
//     page        the page of the access (a page outside the pool: its
//                 index, truncated to 32 bits); NONE when none was read
//     generation  the generation the page was taken at (its record's)
//     current     the same, or NONE
//     slot        a stale read: the first slot not written; a store: its
//                 slot; a token read: its slot; else NONE
//     slots       the slots read (0 .. slots) or 1
//     layer       the layer of the refused access, NONE for the bounds
//
// is written once per row. The read checks (block table, CSR, token table)
// give each row KVSAN_CHECK_LANES threads ("lanes"): lane l checks the
// entries l, l + LANES, … of the row, each first for its bounds, then (until
// the lane found a refused access) the access; it offers the lowest refusal
// it found as a key (phase << 32 | entry, phase 0 for the bounds, 1 for an
// access) to the row's word in `firsts` (kept inverted: zeroed before the
// launch, atomicMax keeps the lowest key). The lane that arrives last
// (`arrived`, zeroed before the launch) reads the row's lowest key and writes
// its record, computed again for that entry: the same first refusal the
// host finds walking the row in order (any bounds refusal before any
// access, then the lowest entry). The store check gives each row one thread
// (its tokens are a step's few, and a record pass stops at its first
// refused token).
//
// The store kernel, with `record` set, then sets the written bit of every
// slot it let through for every layer (atomicOr), as the host's
// check_slot_mapping records the writes it checked; the row's tokens after
// a refused one are not recorded.

#define KVSAN_CHECK_THREADS 128
#define KVSAN_CHECK_LANES 64u

// The first row this thread checks, and the distance to its next.
__device__ __forceinline__ unsigned int kvsan_first_row() {
    return blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ unsigned int kvsan_row_step() {
    return gridDim.x * blockDim.x;
}

__device__ __forceinline__ void kvsan_put_record(
    unsigned int* __restrict__ refusals,
    unsigned int row,
    unsigned int code,
    unsigned int index,
    unsigned int page,
    unsigned int current,
    unsigned int slot,
    unsigned int slots,
    unsigned int layer)
{
    unsigned int* r = refusals + (unsigned long long)KVSAN_REFUSAL_WORDS * row;
    r[0] = code;
    r[1] = index;
    r[2] = page;
    r[3] = current;
    r[4] = current;
    r[5] = slot;
    r[6] = slots;
    r[7] = layer;
}

// A refusal of the bounds (no layer, no generation).
__device__ __forceinline__ void kvsan_put_bounds(
    unsigned int* __restrict__ refusals,
    unsigned int row,
    unsigned int code,
    unsigned int index,
    unsigned int page)
{
    kvsan_put_record(refusals, row, code, index, page, KVSAN_NONE, KVSAN_NONE, KVSAN_NONE,
                     KVSAN_NONE);
}

// The first (row, lane) task of this thread and the distance to its next:
// task t is lane t % KVSAN_CHECK_LANES of row t / KVSAN_CHECK_LANES.
__device__ __forceinline__ unsigned long long kvsan_first_task() {
    return (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ unsigned long long kvsan_task_step() {
    return (unsigned long long)gridDim.x * blockDim.x;
}

// One refusal of a row, as its record holds it (code 0: none).
struct KvsanCheckRecord {
    unsigned int code;
    unsigned int index;
    unsigned int page;
    unsigned int current;
    unsigned int slot;
    unsigned int slots;
    unsigned int layer;
};

__device__ __forceinline__ KvsanCheckRecord kvsan_bounds_record(
    unsigned int code, unsigned int index, unsigned int page)
{
    KvsanCheckRecord r;
    r.code = code;
    r.index = index;
    r.page = page;
    r.current = KVSAN_NONE;
    r.slot = KVSAN_NONE;
    r.slots = KVSAN_NONE;
    r.layer = KVSAN_NONE;
    return r;
}

__device__ __forceinline__ KvsanCheckRecord kvsan_no_record() {
    return kvsan_bounds_record(KVSAN_REFUSED_NONE, KVSAN_NONE, KVSAN_NONE);
}

// Offers entry `entry`'s refusal (phase 0 bounds, 1 access) as the row's first.
__device__ __forceinline__ void kvsan_offer(
    unsigned long long* __restrict__ firsts, unsigned int row, unsigned int phase,
    unsigned int entry)
{
    const unsigned long long key = ((unsigned long long)phase << 32) | entry;
    atomicMax(firsts + row, ~key);
}

// Whether this lane is the row's last to arrive (it then writes the record).
// The fence puts this lane's offer before its arrival.
__device__ __forceinline__ bool kvsan_last_lane(unsigned int* __restrict__ arrived,
                                                unsigned int row)
{
    __threadfence();
    return atomicAdd(arrived + row, 1u) == KVSAN_CHECK_LANES - 1u;
}

// The row's lowest key once every lane arrived (~0: no refusal).
__device__ __forceinline__ unsigned long long kvsan_first_key(
    unsigned long long* __restrict__ firsts, unsigned int row)
{
    __threadfence();
    return ~atomicMax(firsts + row, 0ull);
}

__device__ __forceinline__ void kvsan_write_record(
    unsigned int* __restrict__ refusals, unsigned int row, KvsanCheckRecord r)
{
    kvsan_put_record(refusals, row, r.code, r.index, r.page, r.current, r.slot, r.slots,
                     r.layer);
}

// Whether a page index from an engine's buffer is a page of the pool.
__device__ __forceinline__ bool kvsan_in_pool(long long index, unsigned int n_pages) {
    return index >= 0ll && index < (long long)n_pages;
}

// Reading slots lo .. hi of `page` (inside the pool) for every layer of
// layer_lo .. layer_hi, at the page's current generation: the refusal code
// (KVSAN_REFUSED_NONE to go on), *layer_out the refused layer, *slot the
// first slot not written of a stale read.
__device__ unsigned int kvsan_check_page_layers(
    unsigned int page,
    unsigned int lo,
    unsigned int hi,
    unsigned int layer_lo,
    unsigned int layer_hi,
    unsigned int page_slots,
    const unsigned long long* __restrict__ records,
    const unsigned long long* __restrict__ bits,
    unsigned int stride,
    unsigned long long reader,
    unsigned int* current,
    unsigned int* layer_out,
    unsigned int* slot)
{
    const unsigned int generation = (unsigned int)(records[2ull * page] & KVSAN_GENERATION_MASK);
    *current = generation;
    *slot = KVSAN_NONE;
    for (unsigned int layer = layer_lo; layer < layer_hi; ++layer) {
        const unsigned int code = kvsan_check_read_slots(
            KVSAN_MODE_SHADOW, page, generation, layer, page_slots, lo, hi, 0, records, bits,
            stride, reader, current, slot);
        if (code != KVSAN_REFUSED_NONE) {
            *layer_out = layer;
            return code;
        }
    }
    return KVSAN_REFUSED_NONE;
}

// Reading slots lo .. hi of `page` (inside the pool) as access `index`
// of a row, for every checked layer: its record, code 0 if it may be read.
// `slots` is what the record says was read; a token's read (`token`)
// records its slot when no written bit is missing.
__device__ KvsanCheckRecord kvsan_access_record(
    unsigned int index,
    unsigned int page,
    unsigned int lo,
    unsigned int hi,
    unsigned int slots,
    bool token,
    unsigned int layer_lo,
    unsigned int layer_hi,
    unsigned int page_slots,
    const unsigned long long* __restrict__ records,
    const unsigned long long* __restrict__ bits,
    unsigned int stride,
    unsigned long long reader)
{
    unsigned int current, layer, slot;
    const unsigned int code = kvsan_check_page_layers(page, lo, hi, layer_lo, layer_hi, page_slots,
                                                      records, bits, stride, reader, &current,
                                                      &layer, &slot);
    if (code == KVSAN_REFUSED_NONE) {
        return kvsan_no_record();
    }
    KvsanCheckRecord r;
    r.code = code;
    r.index = index;
    r.page = page;
    r.current = current;
    r.slot = token && slot == KVSAN_NONE ? lo : slot;
    r.slots = slots;
    r.layer = layer;
    return r;
}

// A padded block table: row r, entry e.
__device__ KvsanCheckRecord kvsan_block_table_entry(
    unsigned int phase, unsigned int e, int len, unsigned long long base,
    const int* __restrict__ block_table, unsigned long long n_table, unsigned int n_pages,
    unsigned int page_slots, unsigned int layer_lo, unsigned int layer_hi,
    const unsigned long long* __restrict__ records, const unsigned long long* __restrict__ bits,
    unsigned int stride, unsigned long long reader)
{
    const unsigned long long at = base + e;
    if (phase == 0u) {
        if (at >= n_table) {
            return kvsan_bounds_record(KVSAN_REFUSED_OUTSIDE_TABLE, e, KVSAN_NONE);
        }
        if (!kvsan_in_pool(block_table[at], n_pages)) {
            return kvsan_bounds_record(KVSAN_REFUSED_OUTSIDE_POOL, e, (unsigned int)block_table[at]);
        }
        return kvsan_no_record();
    }
    const unsigned long long left = (unsigned long long)len - (unsigned long long)e * page_slots;
    const unsigned int slots = left < page_slots ? (unsigned int)left : page_slots;
    return kvsan_access_record(e, (unsigned int)block_table[at], 0u, slots, slots, false,
                               layer_lo, layer_hi, page_slots, records, bits, stride, reader);
}

// The arguments every check kernel starts with, in the order the host's
// launches pass them: the shadow's page records and written bits (`Bits`
// const for the read checks; the store check records into them), the
// pool's pages and slots per page, the bit words per page, the layers
// checked, each row's reader and the number of rows.
#define KVSAN_CHECK_HEAD(Bits)                                                    \
    const unsigned long long* __restrict__ records, Bits* __restrict__ bits,     \
        unsigned int n_pages, unsigned int page_slots, unsigned int stride,      \
        unsigned int layer_lo, unsigned int layer_hi,                            \
        const unsigned long long* __restrict__ owners, unsigned int rows

// The arguments every read check ends with: the rows' lowest refusal keys
// and lane arrivals (both zeroed before the launch), and the records.
#define KVSAN_LANE_TAIL                                                           \
    unsigned long long* __restrict__ firsts, unsigned int* __restrict__ arrived, \
        unsigned int* __restrict__ refusals

// A row of a read layout as its lanes walk it: whether its lengths or
// offsets are unusable (then it reads nothing), how many entries it has,
// and entry(phase, e), the record of entry e's bounds (phase 0) or access
// (phase 1).
template <typename Entry>
struct KvsanRow {
    bool bad;
    unsigned int n;
    Entry entry;
};

template <typename Entry>
__device__ __forceinline__ KvsanRow<Entry> kvsan_row(bool bad, unsigned int n, Entry entry) {
    return KvsanRow<Entry>{bad, bad ? 0u : n, entry};
}

// The lanes of every read layout: row_of(row) gives the row; each lane
// offers its lowest refusal, and the last lane to arrive writes the row's
// record (see the top of this file).
template <typename RowOf>
__device__ __forceinline__ void kvsan_check_rows(unsigned int rows,
                                                 unsigned long long* __restrict__ firsts,
                                                 unsigned int* __restrict__ arrived,
                                                 unsigned int* __restrict__ refusals,
                                                 RowOf row_of)
{
    const unsigned long long tasks = (unsigned long long)rows * KVSAN_CHECK_LANES;
    for (unsigned long long task = kvsan_first_task(); task < tasks; task += kvsan_task_step()) {
        const unsigned int row = (unsigned int)(task / KVSAN_CHECK_LANES);
        const unsigned int lane = (unsigned int)(task % KVSAN_CHECK_LANES);
        const auto r = row_of(row);
        bool access_refused = false;
        for (unsigned int e = lane; e < r.n; e += KVSAN_CHECK_LANES) {
            if (r.entry(0u, e).code != KVSAN_REFUSED_NONE) {
                kvsan_offer(firsts, row, 0u, e);
                break;
            }
            if (!access_refused && r.entry(1u, e).code != KVSAN_REFUSED_NONE) {
                kvsan_offer(firsts, row, 1u, e);
                access_refused = true;
            }
        }
        if (kvsan_last_lane(arrived, row)) {
            if (r.bad) {
                kvsan_put_bounds(refusals, row, KVSAN_REFUSED_BAD_INPUT, KVSAN_NONE, KVSAN_NONE);
                continue;
            }
            const unsigned long long key = kvsan_first_key(firsts, row);
            if (key != ~0ull) {
                kvsan_write_record(refusals, row,
                                   r.entry((unsigned int)(key >> 32), (unsigned int)key));
            }
        }
    }
}

extern "C" __global__ void kvsan_check_block_table(
    KVSAN_CHECK_HEAD(const unsigned long long),
    const int* __restrict__ block_table,
    unsigned long long n_table,
    unsigned long long row_stride,
    const int* __restrict__ seq_lens,
    KVSAN_LANE_TAIL)
{
    kvsan_check_rows(rows, firsts, arrived, refusals, [&](unsigned int row) {
        const int len = seq_lens[row];
        const unsigned long long base = (unsigned long long)row * row_stride;
        const unsigned long long reader = owners[row];
        const unsigned int entries =
            (unsigned int)(((unsigned long long)len + page_slots - 1ull) / page_slots);
        return kvsan_row(len < 0, entries, [=](unsigned int phase, unsigned int e) {
            return kvsan_block_table_entry(phase, e, len, base, block_table, n_table, n_pages,
                                           page_slots, layer_lo, layer_hi, records, bits, stride,
                                           reader);
        });
    });
}

// Pages in CSR form: row r, entry e of its n (the row's offsets checked).
__device__ KvsanCheckRecord kvsan_paged_csr_entry(
    unsigned int phase, unsigned int e, unsigned int n, int start, int last,
    const int* __restrict__ indices, unsigned long long n_indices, unsigned int n_pages,
    unsigned int page_slots, unsigned int layer_lo, unsigned int layer_hi,
    const unsigned long long* __restrict__ records, const unsigned long long* __restrict__ bits,
    unsigned int stride, unsigned long long reader)
{
    const unsigned long long at = (unsigned long long)start + e;
    if (phase == 0u) {
        if (at >= n_indices) {
            return kvsan_bounds_record(KVSAN_REFUSED_OUTSIDE_TABLE, e, KVSAN_NONE);
        }
        if (!kvsan_in_pool(indices[at], n_pages)) {
            return kvsan_bounds_record(KVSAN_REFUSED_OUTSIDE_POOL, e, (unsigned int)indices[at]);
        }
        return kvsan_no_record();
    }
    const unsigned int slots = e + 1u == n ? (unsigned int)last : page_slots;
    return kvsan_access_record(e, (unsigned int)indices[at], 0u, slots, slots, false, layer_lo,
                               layer_hi, page_slots, records, bits, stride, reader);
}

extern "C" __global__ void kvsan_check_paged_csr(
    KVSAN_CHECK_HEAD(const unsigned long long),
    const int* __restrict__ indptr,
    const int* __restrict__ indices,
    unsigned long long n_indices,
    const int* __restrict__ last_page_len,
    KVSAN_LANE_TAIL)
{
    kvsan_check_rows(rows, firsts, arrived, refusals, [&](unsigned int row) {
        const int start = indptr[row];
        const int end = indptr[row + 1u];
        const int last = last_page_len[row];
        const bool bad = start < 0 || end < start || last < 0
                         || (end > start && (last < 1 || (unsigned int)last > page_slots));
        const unsigned int n = bad ? 0u : (unsigned int)(end - start);
        const unsigned long long reader = owners[row];
        return kvsan_row(bad, n, [=](unsigned int phase, unsigned int e) {
            return kvsan_paged_csr_entry(phase, e, n, start, last, indices, n_indices, n_pages,
                                         page_slots, layer_lo, layer_hi, records, bits, stride,
                                         reader);
        });
    });
}

// A token-level table: row r, token t.
__device__ KvsanCheckRecord kvsan_req_to_token_entry(
    unsigned int phase, unsigned int t, unsigned long long base,
    const int* __restrict__ req_to_token, unsigned long long n_table, unsigned int n_pages,
    unsigned int page_slots, unsigned int layer_lo, unsigned int layer_hi,
    const unsigned long long* __restrict__ records, const unsigned long long* __restrict__ bits,
    unsigned int stride, unsigned long long reader)
{
    if (phase == 0u) {
        if (base + t >= n_table) {
            return kvsan_bounds_record(KVSAN_REFUSED_OUTSIDE_TABLE, t, KVSAN_NONE);
        }
        const int loc = req_to_token[base + t];
        if (loc < 0) {
            return kvsan_bounds_record(KVSAN_REFUSED_BAD_INPUT, t, KVSAN_NONE);
        }
        if (!kvsan_in_pool(loc / (int)page_slots, n_pages)) {
            return kvsan_bounds_record(KVSAN_REFUSED_OUTSIDE_POOL, t,
                                       (unsigned int)(loc / (int)page_slots));
        }
        return kvsan_no_record();
    }
    const unsigned int loc = (unsigned int)req_to_token[base + t];
    const unsigned int at = loc % page_slots;
    return kvsan_access_record(t, loc / page_slots, at, at + 1u, 1u, true, layer_lo, layer_hi,
                               page_slots, records, bits, stride, reader);
}

extern "C" __global__ void kvsan_check_req_to_token(
    KVSAN_CHECK_HEAD(const unsigned long long),
    const int* __restrict__ req_to_token,
    unsigned long long n_table,
    unsigned long long row_stride,
    const int* __restrict__ req_indices,
    const int* __restrict__ seq_lens,
    KVSAN_LANE_TAIL)
{
    kvsan_check_rows(rows, firsts, arrived, refusals, [&](unsigned int row) {
        const int req = req_indices[row];
        const int len = seq_lens[row];
        const bool bad = req < 0 || len < 0;
        const unsigned long long base = bad ? 0ull : (unsigned long long)req * row_stride;
        const unsigned long long reader = owners[row];
        return kvsan_row(bad, (unsigned int)len, [=](unsigned int phase, unsigned int t) {
            return kvsan_req_to_token_entry(phase, t, base, req_to_token, n_table, n_pages,
                                            page_slots, layer_lo, layer_hi, records, bits, stride,
                                            reader);
        });
    });
}

// Row r of a store kernel's slots; with `record`, the slots let through
// are marked written for every layer of layer_lo .. layer_hi.
extern "C" __global__ void kvsan_check_slot_mapping(
    KVSAN_CHECK_HEAD(unsigned long long),
    const int* __restrict__ query_start_loc,
    const long long* __restrict__ slot_mapping,
    unsigned long long n_slots,
    unsigned int record,
    unsigned int* __restrict__ refusals)
{
    for (unsigned int row = kvsan_first_row(); row < rows; row += kvsan_row_step()) {
        const int start = query_start_loc[row];
        const int end = query_start_loc[row + 1u];
        if (start < 0 || end < start) {
            kvsan_put_bounds(refusals, row, KVSAN_REFUSED_BAD_INPUT, KVSAN_NONE, KVSAN_NONE);
            continue;
        }
        bool usable = true;
        for (unsigned int t = (unsigned int)start; t < (unsigned int)end && usable; ++t) {
            if ((unsigned long long)t >= n_slots) {
                kvsan_put_bounds(refusals, row, KVSAN_REFUSED_OUTSIDE_TABLE, t, KVSAN_NONE);
                usable = false;
                continue;
            }
            const long long loc = slot_mapping[t];
            if (loc == -1ll) {
                continue;
            }
            if (loc < 0ll) {
                kvsan_put_bounds(refusals, row, KVSAN_REFUSED_BAD_INPUT, t, KVSAN_NONE);
                usable = false;
            } else if (!kvsan_in_pool(loc / (long long)page_slots, n_pages)) {
                kvsan_put_bounds(refusals, row, KVSAN_REFUSED_OUTSIDE_POOL, t,
                                 (unsigned int)(loc / (long long)page_slots));
                usable = false;
            }
        }
        for (unsigned int t = (unsigned int)start; t < (unsigned int)end && usable; ++t) {
            const long long loc = slot_mapping[t];
            if (loc == -1ll) {
                continue;
            }
            const unsigned int page = (unsigned int)(loc / (long long)page_slots);
            const unsigned int at = (unsigned int)(loc % (long long)page_slots);
            const unsigned int generation =
                (unsigned int)(records[2ull * page] & KVSAN_GENERATION_MASK);
            unsigned int current;
            const unsigned int code = kvsan_check_store(KVSAN_MODE_SHADOW, page, generation, 0,
                                                        records, owners[row], &current);
            if (code != KVSAN_REFUSED_NONE) {
                kvsan_put_record(refusals, row, code, t, page, current, at, 1u, KVSAN_NONE);
                usable = false;
            } else if (record != 0u) {
                for (unsigned int layer = layer_lo; layer < layer_hi; ++layer) {
                    const unsigned long long bit = (unsigned long long)layer * page_slots + at;
                    atomicOr(bits + (unsigned long long)page * stride + bit / 64ull,
                             1ull << (bit % 64ull));
                }
            }
        }
    }
}
