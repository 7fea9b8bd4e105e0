// The KV store and paged-attention decode over the kvsan KV page pool, for a
// whole batch, through the arrays an attention backend takes, with every
// page checked in place before any byte of it is touched. Compiled at run
// time by NVRTC; no CUDA headers needed (f16 is carried as its 16 bits and
// converted with PTX `cvt`).
//
// Pool layout (f16), page after page:
//
//   pool = page 0 | page 1 | ... | page n_pages-1
//   page = [layer][K=0 | V=1][slot][kv_head][head_dim]
//   page_elems = n_layers * 2 * page_slots * n_kv_heads * head_dim
//
// Batch arrays (the CPU kernels' KvBatch, as words):
//
//   block_tables  n_entries = rows * width entries, row-major, 2 words each:
//                 page, generation (a PageRef)
//   seq_lens      per row: the tokens attention reads
//   query_start   rows + 1 offsets: row r's tokens are query_start[r] .. query_start[r+1]
//   store_slots   per token, 3 words: page, generation, slot; all 0xffffffff: padding
//   row_live      per row: 0 = the row stopped earlier in the step (skipped,
//                 zero output, no record)
//
// Entry e of row r is block_tables[r * width + e] (the flat index: past the
// row's width is the next row's entry, as the CPU kernels read it); one at
// or past n_entries is refused. Row r of the decode kernel has one query (at
// position seq_lens[r] - 1) and reads entries 0 .. ceil(seq_len / page_slots),
// slots 0 .. min(page_slots, seq_len - e * page_slots) of entry e.
//
// What is checked (`mode`):
//
//   KVSAN_MODE_BOUNDS       the bounds only: an entry outside the array, a page
//                           (or a store slot) outside the pool
//   KVSAN_MODE_GENERATIONS  and the PageRef's generation against the pool's
//                           generation array (one u32 per page)
//   KVSAN_MODE_SHADOW       and the sanitizer's kernel shadow, copied to the device:
//     records[2 * page]      state word: bits 0..31 generation; 32..34 state
//                            (0 free, 1 owned, 2 receiving, 3 quarantined,
//                            4 allocating); 35 owner is terminal; 36 owner
//                            released its reference; 37 shared read-only;
//                            38 first write seen
//     records[2 * page + 1]  owner request
//     bits[page * stride ..] `stride` words; bit layer * page_slots + slot set
//                            once the slot was written for the layer
//     owners[row]            the request of the row
//   exactly as kvsan-sanitizer's KernelShadow::check_read and
//   KernelShadow::store decide, in the same order (the checks and the codes
//   are in shadow_check.cuh, prepended to this source). The store kernel sets the
//   written bit of each store it makes (atomicOr).
//
// A refused access is not made: no K/V byte of a refused decode row is
// read and its output is zero; a refused store writes nothing and the row's
// later tokens are not stored (its earlier ones are, as on the CPU). The
// row's refusal record
//
//   refusals[KVSAN_REFUSAL_WORDS * row] =
//     { code, index, page, generation, current, slot, slots, layer }
//     code        KVSAN_REFUSED_* (0: none)
//     index       read: the block-table entry; store: the token
//     page, generation   the PageRef used (0, 0 for an entry outside the array)
//     current     the page's generation (pool array or shadow record), or NONE
//     slot        store: the slot; stale read: the first slot not written; else NONE
//     slots       read: the slots read (0 .. slots); store: 1
//     layer       the layer
//
// is written by the first block of the row to claim it (atomicCAS on code).
// Every block of a row checks the same accesses against the same memory, so
// all find the same first refused access (lowest entry, or lowest token).

#define KVSAN_DECODE_THREADS 128
#define KVSAN_STORE_THREADS 128
#define KVSAN_WARP 32
#define KVSAN_WARPS (KVSAN_DECODE_THREADS / KVSAN_WARP)
#define KVSAN_MAX_HEAD_DIM 256
#define KVSAN_DIMS_PER_LANE (KVSAN_MAX_HEAD_DIM / KVSAN_WARP)

__device__ __forceinline__ float kvsan_h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short kvsan_f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Rounds to the nearest f16 and back: queries meet an f16 cache at f16
// precision, as in the CPU kernels (and llama.cpp).
__device__ __forceinline__ float kvsan_round_f16(float f) {
    return kvsan_h2f(kvsan_f2h(f));
}

__device__ __forceinline__ float kvsan_neg_inf() {
    return __int_as_float(0xff800000);
}

// One refused access, as the row's record holds it.
struct KvsanRefusal {
    unsigned int code;
    unsigned int index;
    unsigned int page;
    unsigned int generation;
    unsigned int current;
    unsigned int slot;
    unsigned int slots;
};

// Entry `entry` of `row`, whose sequence is seq_len tokens: the refusal of
// reading it (code KVSAN_REFUSED_NONE if it may be read).
__device__ KvsanRefusal kvsan_check_entry(
    unsigned int row,
    unsigned int entry,
    unsigned int seq_len,
    const unsigned int* __restrict__ block_tables,
    unsigned long long n_entries,
    unsigned int width,
    unsigned int n_pages,
    unsigned int page_slots,
    unsigned int layer,
    unsigned int mode,
    const unsigned int* __restrict__ generations,
    const unsigned long long* __restrict__ records,
    const unsigned long long* __restrict__ bits,
    unsigned int stride,
    unsigned long long reader)
{
    KvsanRefusal r;
    r.index = entry;
    // entry < ceil(seq_len / page_slots), so entry * page_slots < seq_len.
    const unsigned long long read = (unsigned long long)seq_len - (unsigned long long)entry * page_slots;
    r.slots = read < page_slots ? (unsigned int)read : page_slots;
    r.current = KVSAN_NONE;
    r.slot = KVSAN_NONE;
    const unsigned long long flat = (unsigned long long)row * width + entry;
    if (flat >= n_entries) {
        r.code = KVSAN_REFUSED_OUTSIDE_TABLE;
        r.page = 0u;
        r.generation = 0u;
        return r;
    }
    r.page = block_tables[2ull * flat];
    r.generation = block_tables[2ull * flat + 1ull];
    if (r.page >= n_pages) {
        r.code = KVSAN_REFUSED_OUTSIDE_POOL;
        return r;
    }
    r.code = kvsan_check_read_slots(mode, r.page, r.generation, layer, page_slots, 0u, r.slots,
                                    generations, records, bits, stride, reader, &r.current,
                                    &r.slot);
    return r;
}

// Token `token`'s store: the refusal (code KVSAN_REFUSED_NONE if it may be
// made, or if the token is padding: *padding says which).
__device__ KvsanRefusal kvsan_check_token(
    unsigned int token,
    const unsigned int* __restrict__ store_slots,
    unsigned int n_pages,
    unsigned int page_slots,
    unsigned int mode,
    const unsigned int* __restrict__ generations,
    const unsigned long long* __restrict__ records,
    unsigned long long writer,
    bool* padding)
{
    KvsanRefusal r;
    r.index = token;
    r.page = store_slots[3ull * token];
    r.generation = store_slots[3ull * token + 1ull];
    r.slot = store_slots[3ull * token + 2ull];
    r.slots = 1u;
    r.current = KVSAN_NONE;
    r.code = KVSAN_REFUSED_NONE;
    *padding = r.page == KVSAN_NONE && r.generation == KVSAN_NONE && r.slot == KVSAN_NONE;
    if (*padding) {
        return r;
    }
    if (r.page >= n_pages || r.slot >= page_slots) {
        r.code = KVSAN_REFUSED_OUTSIDE_POOL;
        return r;
    }
    r.code = kvsan_check_store(mode, r.page, r.generation, generations, records, writer, &r.current);
    return r;
}

// Writes `r` as the row's refusal if no block of the row has yet.
__device__ void kvsan_record(unsigned int* __restrict__ refusals, unsigned int row,
                             unsigned int layer, const KvsanRefusal& r)
{
    unsigned int* record = refusals + KVSAN_REFUSAL_WORDS * (unsigned long long)row;
    if (atomicCAS(&record[0], KVSAN_REFUSED_NONE, r.code) == KVSAN_REFUSED_NONE) {
        record[1] = r.index;
        record[2] = r.page;
        record[3] = r.generation;
        record[4] = r.current;
        record[5] = r.slot;
        record[6] = r.slots;
        record[7] = layer;
    }
}

// Decode attention: one query per row (rows × n_heads × head_dim in q and
// out). Grid (rows, n_heads); one block of KVSAN_DECODE_THREADS threads per
// (row, query head). GQA: query head h reads KV head h / (n_heads / n_kv_heads).
// Queries are rounded to f16 before the dot products (as the CPU kernels
// do); scores, softmax and the V sum are f32.
extern "C" __global__ void kvsan_paged_attention_decode(
    const unsigned short* __restrict__ pool,
    unsigned int n_pages,
    unsigned int page_slots,
    unsigned int n_layers,
    unsigned int n_kv_heads,
    unsigned int head_dim,
    unsigned int layer,
    unsigned int n_heads,
    float scale,
    const float* __restrict__ q,
    const unsigned int* __restrict__ block_tables,
    unsigned long long n_entries,
    unsigned int width,
    const unsigned int* __restrict__ seq_lens,
    const unsigned int* __restrict__ row_live,
    unsigned int mode,
    const unsigned int* __restrict__ generations,
    const unsigned long long* __restrict__ records,
    const unsigned long long* __restrict__ bits,
    unsigned int stride,
    const unsigned long long* __restrict__ owners,
    unsigned int* __restrict__ refusals,
    float* __restrict__ out)
{
    __shared__ float q_s[KVSAN_MAX_HEAD_DIM];
    __shared__ float warp_m[KVSAN_WARPS];
    __shared__ float warp_l[KVSAN_WARPS];
    __shared__ unsigned int warp_seen[KVSAN_WARPS];
    __shared__ float warp_acc[KVSAN_WARPS][KVSAN_MAX_HEAD_DIM];
    __shared__ unsigned int first_bad;

    const unsigned int row = blockIdx.x;
    const unsigned int head = blockIdx.y;
    const unsigned int tid = threadIdx.x;
    const unsigned int lane = tid % KVSAN_WARP;
    const unsigned int warp = tid / KVSAN_WARP;
    float* out_head = out + ((unsigned long long)row * n_heads + head) * head_dim;

    if (row_live[row] == 0u) {
        // Stopped earlier in the step: nothing of it is read.
        for (unsigned int d = tid; d < head_dim; d += KVSAN_DECODE_THREADS) {
            out_head[d] = 0.0f;
        }
        return;
    }

    const unsigned int seq_len = seq_lens[row];
    const unsigned long long n_read =
        ((unsigned long long)seq_len + page_slots - 1ull) / page_slots;
    // Entries from the first one outside the array on are all refused, so
    // the lowest refused entry is at most that one: no need to look further.
    const unsigned long long row_base = (unsigned long long)row * width;
    const unsigned long long in_array = n_entries - row_base + 1ull;
    const unsigned int n_scan = (unsigned int)(n_read < in_array ? n_read : in_array);
    const unsigned long long reader = mode == KVSAN_MODE_SHADOW ? owners[row] : 0ull;

    // 1. Check every entry the row reads; find the first that must not be.
    if (tid == 0) {
        first_bad = KVSAN_NONE;
    }
    __syncthreads();
    for (unsigned long long e = tid; e < n_scan; e += KVSAN_DECODE_THREADS) {
        const KvsanRefusal r = kvsan_check_entry(row, (unsigned int)e, seq_len, block_tables, n_entries, width,
                                                 n_pages, page_slots, layer, mode, generations,
                                                 records, bits, stride, reader);
        if (r.code != KVSAN_REFUSED_NONE) {
            atomicMin(&first_bad, (unsigned int)e);
        }
    }
    __syncthreads();
    if (first_bad != KVSAN_NONE) {
        if (tid == 0) {
            const KvsanRefusal r = kvsan_check_entry(row, first_bad, seq_len, block_tables,
                                                     n_entries, width, n_pages, page_slots, layer,
                                                     mode, generations, records, bits, stride,
                                                     reader);
            kvsan_record(refusals, row, layer, r);
        }
        for (unsigned int d = tid; d < head_dim; d += KVSAN_DECODE_THREADS) {
            out_head[d] = 0.0f;
        }
        return;  // uniform across the block: no K/V byte of this row is read
    }

    // 2. Online softmax over the row's tokens, one token per warp at a time.
    // Every entry 0 .. n_read is inside the array and the pool (checked).
    const unsigned int* table = block_tables + 2ull * row_base;
    const unsigned int group = n_heads / n_kv_heads;
    const unsigned int kv_head = head / group;
    const float* q_head = q + ((unsigned long long)row * n_heads + head) * head_dim;
    for (unsigned int d = tid; d < head_dim; d += KVSAN_DECODE_THREADS) {
        q_s[d] = kvsan_round_f16(q_head[d]);
    }
    __syncthreads();

    const unsigned long long page_elems =
        (unsigned long long)n_layers * 2ull * page_slots * n_kv_heads * head_dim;
    const unsigned long long kv_stride = (unsigned long long)page_slots * n_kv_heads * head_dim;
    const unsigned long long k_layer_base = (unsigned long long)layer * 2ull * kv_stride;

    float m = kvsan_neg_inf();
    float l = 0.0f;
    float acc[KVSAN_DIMS_PER_LANE];
#pragma unroll
    for (int j = 0; j < KVSAN_DIMS_PER_LANE; ++j) {
        acc[j] = 0.0f;
    }

    for (unsigned long long t = warp; t < seq_len; t += KVSAN_WARPS) {
        const unsigned int page = table[2ull * (t / page_slots)];
        const unsigned int slot = (unsigned int)(t % page_slots);
        const unsigned long long at =
            (unsigned long long)page * page_elems + k_layer_base
            + ((unsigned long long)slot * n_kv_heads + kv_head) * head_dim;
        const unsigned short* k_row = pool + at;
        const unsigned short* v_row = pool + at + kv_stride;

        float partial = 0.0f;
#pragma unroll
        for (int j = 0; j < KVSAN_DIMS_PER_LANE; ++j) {
            const unsigned int d = lane + KVSAN_WARP * j;
            if (d < head_dim) {
                partial += q_s[d] * kvsan_h2f(k_row[d]);
            }
        }
#pragma unroll
        for (int offset = KVSAN_WARP / 2; offset > 0; offset /= 2) {
            partial += __shfl_xor_sync(0xffffffffu, partial, offset);
        }
        const float score = partial * scale;

        const float m_new = fmaxf(m, score);
        const float correction = expf(m - m_new);
        const float p = expf(score - m_new);
        l = l * correction + p;
#pragma unroll
        for (int j = 0; j < KVSAN_DIMS_PER_LANE; ++j) {
            const unsigned int d = lane + KVSAN_WARP * j;
            if (d < head_dim) {
                acc[j] = acc[j] * correction + p * kvsan_h2f(v_row[d]);
            }
        }
        m = m_new;
    }

    // 3. Combine the warps' partial softmax states.
    if (lane == 0) {
        warp_m[warp] = m;
        warp_l[warp] = l;
        warp_seen[warp] = warp < seq_len ? 1u : 0u;
    }
#pragma unroll
    for (int j = 0; j < KVSAN_DIMS_PER_LANE; ++j) {
        const unsigned int d = lane + KVSAN_WARP * j;
        if (d < head_dim) {
            warp_acc[warp][d] = acc[j];
        }
    }
    __syncthreads();

    float m_all = kvsan_neg_inf();
    for (int w = 0; w < KVSAN_WARPS; ++w) {
        if (warp_seen[w] != 0u) {
            m_all = fmaxf(m_all, warp_m[w]);
        }
    }
    float weights[KVSAN_WARPS];
    float l_all = 0.0f;
    for (int w = 0; w < KVSAN_WARPS; ++w) {
        // A warp that saw no token has m = -inf and l = 0: weight 0, never
        // exp(-inf - -inf). NaN (a poisoned page read unchecked) is not
        // filtered out: it reaches the output, where it shows.
        weights[w] = warp_seen[w] != 0u ? expf(warp_m[w] - m_all) : 0.0f;
        l_all += warp_l[w] * weights[w];
    }
    for (unsigned int d = tid; d < head_dim; d += KVSAN_DECODE_THREADS) {
        float num = 0.0f;
        for (int w = 0; w < KVSAN_WARPS; ++w) {
            if (warp_seen[w] != 0u) {
                num += warp_acc[w][d] * weights[w];
            }
        }
        // seq_len == 0 (no token) cannot reach here with a query, but stay 0.
        out_head[d] = seq_len > 0u ? num / l_all : 0.0f;
    }
}

// The KV store: token t's K and V (n_kv_heads * head_dim f32 each, in k and
// v at t * n_kv_heads * head_dim) go, as f16 (round to nearest even), to
// slot store_slots[t] of its page for `layer`. Grid (rows, token blocks);
// KVSAN_STORE_THREADS threads per block. Every block of a row checks all of
// the row's tokens (the checks read records only, never the pool) to find
// the first refused one; then block y stores the row's tokens y, y +
// gridDim.y, ... before it. Padding tokens are skipped. Two tokens of one
// batch storing into the same slot race (an engine bug the CPU kernel
// resolves last-wins).
extern "C" __global__ void kvsan_store_kv(
    unsigned short* __restrict__ pool,
    unsigned int n_pages,
    unsigned int page_slots,
    unsigned int n_layers,
    unsigned int n_kv_heads,
    unsigned int head_dim,
    unsigned int layer,
    const float* __restrict__ k,
    const float* __restrict__ v,
    const unsigned int* __restrict__ store_slots,
    const unsigned int* __restrict__ query_start,
    const unsigned int* __restrict__ row_live,
    unsigned int mode,
    const unsigned int* __restrict__ generations,
    const unsigned long long* __restrict__ records,
    unsigned long long* __restrict__ bits,
    unsigned int stride,
    const unsigned long long* __restrict__ owners,
    unsigned int* __restrict__ refusals)
{
    __shared__ unsigned int first_bad;

    const unsigned int row = blockIdx.x;
    const unsigned int tid = threadIdx.x;
    if (row_live[row] == 0u) {
        return;  // stopped earlier in the step
    }
    const unsigned int first = query_start[row];
    const unsigned int n = query_start[row + 1] - first;
    const unsigned long long writer = mode == KVSAN_MODE_SHADOW ? owners[row] : 0ull;

    // 1. The first of the row's tokens whose store is refused.
    if (tid == 0) {
        first_bad = KVSAN_NONE;
    }
    __syncthreads();
    for (unsigned long long i = tid; i < n; i += KVSAN_STORE_THREADS) {
        bool padding;
        const KvsanRefusal r = kvsan_check_token(first + (unsigned int)i, store_slots, n_pages,
                                                 page_slots, mode, generations, records, writer,
                                                 &padding);
        if (r.code != KVSAN_REFUSED_NONE) {
            atomicMin(&first_bad, (unsigned int)i);
        }
    }
    __syncthreads();
    const unsigned int stop = first_bad;
    if (stop != KVSAN_NONE && tid == 0) {
        bool padding;
        const KvsanRefusal r = kvsan_check_token(first + stop, store_slots, n_pages, page_slots,
                                                 mode, generations, records, writer, &padding);
        kvsan_record(refusals, row, layer, r);
    }

    // 2. This block's share of the tokens before it: each passed its check,
    // so its page and slot are inside the pool.
    const unsigned int width = n_kv_heads * head_dim;
    const unsigned long long page_elems = (unsigned long long)n_layers * 2ull * page_slots * width;
    const unsigned long long kv_stride = (unsigned long long)page_slots * width;
    const unsigned int limit = stop == KVSAN_NONE ? n : stop;
    for (unsigned long long i = blockIdx.y; i < limit; i += gridDim.y) {
        const unsigned int t = first + (unsigned int)i;
        const unsigned int page = store_slots[3ull * t];
        const unsigned int generation = store_slots[3ull * t + 1ull];
        const unsigned int slot = store_slots[3ull * t + 2ull];
        if (page == KVSAN_NONE && generation == KVSAN_NONE && slot == KVSAN_NONE) {
            continue;  // padding (uniform across the block)
        }
        const unsigned long long k_at = (unsigned long long)page * page_elems
            + (unsigned long long)layer * 2ull * kv_stride + (unsigned long long)slot * width;
        const unsigned long long v_at = k_at + kv_stride;
        const unsigned long long src = (unsigned long long)t * width;
        for (unsigned int d = tid; d < width; d += KVSAN_STORE_THREADS) {
            pool[k_at + d] = kvsan_f2h(k[src + d]);
            pool[v_at + d] = kvsan_f2h(v[src + d]);
        }
        if (mode == KVSAN_MODE_SHADOW && tid == 0) {
            const unsigned long long bit = (unsigned long long)layer * page_slots + slot;
            atomicOr(bits + (unsigned long long)page * stride + bit / 64ull, 1ull << (bit % 64ull));
        }
    }
}
