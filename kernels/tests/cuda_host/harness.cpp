// Runs one check kernel of check.cu over the arrays on standard input and
// prints its refusal records and the written words after it.
//
// Input (whitespace-separated integers; an array is its length, then its
// values):
//   layout (0 block table, 1 paged CSR, 2 token table, 3 store slots)
//   rows n_pages page_slots stride layer_lo layer_hi grid block
//   records bits owners                          (arrays)
//   layout 0: block_table row_stride seq_lens
//   layout 1: indptr indices last_page_len
//   layout 2: req_to_token row_stride req_indices seq_lens
//   layout 3: query_start_loc slot_mapping record
// Output: rows * KVSAN_REFUSAL_WORDS record words on one line, the written
// words on the next.
#include "prelude.h"
#include "check_all.cu"

#include <cstdio>
#include <cstdlib>
#include <vector>

// The next integer, signed or not (a shadow word may use all 64 bits).
static long long next() {
    char token[32];
    if (std::scanf("%31s", token) != 1) {
        std::fprintf(stderr, "harness: input ends early\n");
        std::exit(2);
    }
    if (token[0] == '-') {
        return std::strtoll(token, nullptr, 10);
    }
    return (long long)std::strtoull(token, nullptr, 10);
}

// An array of its length; never empty, so its pointer is always valid.
template <typename T>
static std::vector<T> array(unsigned long long* len) {
    *len = (unsigned long long)next();
    std::vector<T> v(*len == 0 ? 1 : *len);
    for (unsigned long long i = 0; i < *len; ++i) {
        v[i] = (T)next();
    }
    return v;
}

int main() {
    const int layout = (int)next();
    const unsigned int rows = (unsigned int)next();
    const unsigned int n_pages = (unsigned int)next();
    const unsigned int page_slots = (unsigned int)next();
    const unsigned int stride = (unsigned int)next();
    const unsigned int layer_lo = (unsigned int)next();
    const unsigned int layer_hi = (unsigned int)next();
    const unsigned int grid = (unsigned int)next();
    const unsigned int block = (unsigned int)next();
    unsigned long long n;
    std::vector<unsigned long long> records = array<unsigned long long>(&n);
    unsigned long long n_bits;
    std::vector<unsigned long long> bits = array<unsigned long long>(&n_bits);
    std::vector<unsigned long long> owners = array<unsigned long long>(&n);
    std::vector<unsigned int> refusals(KVSAN_REFUSAL_WORDS * (rows == 0 ? 1 : rows), 0u);
    // The read checks' per-row scratch, zeroed as the launcher zeroes it.
    std::vector<unsigned long long> firsts(rows == 0 ? 1 : rows, 0ull);
    std::vector<unsigned int> arrived(rows == 0 ? 1 : rows, 0u);

    unsigned long long la = 0, lb = 0, lc = 0, ld = 0;
    std::vector<int> a, b, c, d;
    std::vector<long long> slots;
    unsigned long long row_stride = 0, record = 0;
    switch (layout) {
    case 0:
        a = array<int>(&la);
        row_stride = (unsigned long long)next();
        b = array<int>(&lb);
        break;
    case 1:
        a = array<int>(&la);
        b = array<int>(&lb);
        c = array<int>(&lc);
        break;
    case 2:
        a = array<int>(&la);
        row_stride = (unsigned long long)next();
        b = array<int>(&lb);
        c = array<int>(&lc);
        break;
    case 3:
        a = array<int>(&la);
        slots = array<long long>(&ld);
        record = (unsigned long long)next();
        break;
    default:
        std::fprintf(stderr, "harness: unknown layout %d\n", layout);
        return 2;
    }

    gridDim.x = grid;
    blockDim.x = block;
    for (unsigned int g = 0; g < grid; ++g) {
        for (unsigned int t = 0; t < block; ++t) {
            blockIdx.x = g;
            threadIdx.x = t;
            switch (layout) {
            case 0:
                kvsan_check_block_table(records.data(), bits.data(), n_pages, page_slots, stride,
                                        layer_lo, layer_hi, owners.data(), rows, a.data(), la,
                                        row_stride, b.data(), firsts.data(), arrived.data(),
                                        refusals.data());
                break;
            case 1:
                kvsan_check_paged_csr(records.data(), bits.data(), n_pages, page_slots, stride,
                                      layer_lo, layer_hi, owners.data(), rows, a.data(),
                                      b.data(), lb, c.data(), firsts.data(), arrived.data(),
                                      refusals.data());
                break;
            case 2:
                kvsan_check_req_to_token(records.data(), bits.data(), n_pages, page_slots, stride,
                                         layer_lo, layer_hi, owners.data(), rows, a.data(), la,
                                         row_stride, b.data(), c.data(), firsts.data(),
                                         arrived.data(), refusals.data());
                break;
            default:
                kvsan_check_slot_mapping(records.data(), bits.data(), n_pages, page_slots,
                                         stride, layer_lo, layer_hi, owners.data(), rows,
                                         a.data(), slots.data(), ld, (unsigned int)record,
                                         refusals.data());
                break;
            }
        }
    }
    for (unsigned int i = 0; i < KVSAN_REFUSAL_WORDS * rows; ++i) {
        std::printf("%u ", refusals[i]);
    }
    std::printf("\n");
    for (unsigned long long i = 0; i < n_bits; ++i) {
        std::printf("%llu ", bits[i]);
    }
    std::printf("\n");
    return 0;
}
