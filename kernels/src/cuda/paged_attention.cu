// Paged-attention decode over the kvsan KV page pool, with the in-kernel
// generation (tag) check. Compiled at run time by NVRTC; no CUDA headers
// needed (f16 is carried as its 16 bits and converted with PTX `cvt`).
//
// Pool layout (f16), page after page:
//
//   pool = page 0 | page 1 | ... | page n_pages-1
//   page = [layer][K=0 | V=1][slot][kv_head][head_dim]
//   page_elems = n_layers * 2 * page_slots * n_kv_heads * head_dim
//
// Block tables are arrays of PageRef {page: u32, generation: u32}, the
// sequences' tables concatenated; table_offsets[s] is where sequence s's
// table starts (in PageRefs). A sequence of seq_len tokens reads entries
// 0 .. ceil(seq_len / page_slots) of its table.
//
// Queries are rounded to f16 before the dot products (as the CPU kernels
// do); scores, softmax and the V sum are f32.
//
// Grid: (n_seqs, n_heads); one block of KVSAN_DECODE_THREADS threads per
// (sequence, query head). GQA: query head h reads kv head
// h / (n_heads / n_kv_heads).
//
// Before any K/V byte is read, the block scans its sequence's table. An entry
// whose page is outside the pool is refused always; with `checked` != 0 an
// entry whose generation differs from page_generations[page] is refused too.
// A refused sequence gets no output; its error record
//
//   seq_errors[s] = { status, table_index, page, expected, actual }
//   status: 0 = read, 1 = generation mismatch, 2 = page out of range
//
// is written by the first block of that sequence to claim it (atomicCAS on
// status). All blocks of a sequence scan the same table, so they agree on the
// first refused entry.

#define KVSAN_DECODE_THREADS 128
#define KVSAN_WARP 32
#define KVSAN_WARPS (KVSAN_DECODE_THREADS / KVSAN_WARP)
#define KVSAN_MAX_HEAD_DIM 256
#define KVSAN_DIMS_PER_LANE (KVSAN_MAX_HEAD_DIM / KVSAN_WARP)
#define KVSAN_NONE 0xffffffffu
#define KVSAN_STATUS_GENERATION 1u
#define KVSAN_STATUS_OUT_OF_RANGE 2u
#define KVSAN_ERROR_WORDS 5u

__device__ __forceinline__ float kvsan_h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Rounds to the nearest f16 and back: queries meet an f16 cache at f16
// precision, as in the CPU kernels (and llama.cpp).
__device__ __forceinline__ float kvsan_round_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return kvsan_h2f(h);
}

__device__ __forceinline__ float kvsan_neg_inf() {
    return __int_as_float(0xff800000);
}

extern "C" __global__ void kvsan_paged_attention_decode(
    const unsigned short* __restrict__ pool,
    const unsigned int* __restrict__ page_generations,
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
    const unsigned int* __restrict__ table_offsets,
    const unsigned int* __restrict__ seq_lens,
    unsigned int checked,
    unsigned int* __restrict__ seq_errors,
    float* __restrict__ out)
{
    __shared__ float q_s[KVSAN_MAX_HEAD_DIM];
    __shared__ float warp_m[KVSAN_WARPS];
    __shared__ float warp_l[KVSAN_WARPS];
    __shared__ unsigned int warp_seen[KVSAN_WARPS];
    __shared__ float warp_acc[KVSAN_WARPS][KVSAN_MAX_HEAD_DIM];
    __shared__ unsigned int first_bad;

    const unsigned int seq = blockIdx.x;
    const unsigned int head = blockIdx.y;
    const unsigned int tid = threadIdx.x;
    const unsigned int lane = tid % KVSAN_WARP;
    const unsigned int warp = tid / KVSAN_WARP;

    const unsigned int seq_len = seq_lens[seq];
    const unsigned int n_entries = (seq_len + page_slots - 1) / page_slots;
    const unsigned int* table = block_tables + 2ull * table_offsets[seq];

    // 1. Tag check: find the first entry that must not be read.
    if (tid == 0) {
        first_bad = KVSAN_NONE;
    }
    __syncthreads();
    for (unsigned int i = tid; i < n_entries; i += KVSAN_DECODE_THREADS) {
        const unsigned int page = table[2 * i];
        const unsigned int generation = table[2 * i + 1];
        if (page >= n_pages || (checked != 0u && page_generations[page] != generation)) {
            atomicMin(&first_bad, i);
        }
    }
    __syncthreads();
    if (first_bad != KVSAN_NONE) {
        if (tid == 0) {
            const unsigned int i = first_bad;
            const unsigned int page = table[2 * i];
            const unsigned int expected = table[2 * i + 1];
            const unsigned int status =
                page >= n_pages ? KVSAN_STATUS_OUT_OF_RANGE : KVSAN_STATUS_GENERATION;
            const unsigned int actual = page >= n_pages ? KVSAN_NONE : page_generations[page];
            unsigned int* record = seq_errors + KVSAN_ERROR_WORDS * seq;
            if (atomicCAS(&record[0], 0u, status) == 0u) {
                record[1] = i;
                record[2] = page;
                record[3] = expected;
                record[4] = actual;
            }
        }
        return;  // uniform across the block: no K/V byte of this sequence is read
    }

    // 2. Online softmax over the sequence's tokens, one token per warp at a time.
    const unsigned int group = n_heads / n_kv_heads;
    const unsigned int kv_head = head / group;
    const float* q_head = q + ((unsigned long long)seq * n_heads + head) * head_dim;
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

    for (unsigned int t = warp; t < seq_len; t += KVSAN_WARPS) {
        const unsigned int page = table[2 * (t / page_slots)];
        const unsigned int slot = t % page_slots;
        const unsigned long long row =
            (unsigned long long)page * page_elems + k_layer_base
            + ((unsigned long long)slot * n_kv_heads + kv_head) * head_dim;
        const unsigned short* k_row = pool + row;
        const unsigned short* v_row = pool + row + kv_stride;

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
        m_all = fmaxf(m_all, warp_m[w]);
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
    float* out_head = out + ((unsigned long long)seq * n_heads + head) * head_dim;
    for (unsigned int d = tid; d < head_dim; d += KVSAN_DECODE_THREADS) {
        float num = 0.0f;
        for (int w = 0; w < KVSAN_WARPS; ++w) {
            num += warp_acc[w][d] * weights[w];
        }
        // seq_len == 0: no token, the output is 0.
        out_head[d] = seq_len > 0u ? num / l_all : 0.0f;
    }
}
