/*
 * The batch checks over kernel argument buffers, one layout at a time: the
 * buffers as a correct engine builds them pass, and a wrong row, a wrong
 * length, a wrong stride and a wrong slot are each caught in the row they
 * hit. Pool: 8 pages x 4 slots x 2 layers.
 *
 *   request A (tenant 1): page 0 full, page 1 slots 0..2  -> 6 tokens
 *   request B (tenant 2): page 2 full, page 3 slot 0      -> 5 tokens
 *
 * Prints one line per check; exit status 0 when every verdict is the
 * expected one.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "kvsan.h"

#define SLOTS 4
#define LAYERS 2

static uint32_t pool;
static const KvsanOwner A = {1, 1, 0}, B = {2, 2, 0};
static const KvsanOwner owners[2] = {{1, 1, 0}, {2, 2, 0}};
static const KvsanRange all_layers = {0, LAYERS};

static const char *kind_of(KvsanVerdict v) {
    return v.code == KVSAN_VERDICT_CONTINUE ? "continue" : kvsan_violation_kind_name(v.kind);
}

/* Each row's verdict must be the one expected. */
static void expect(const char *what, int32_t status, const KvsanVerdict *v, const char *row0,
                   const char *row1) {
    ok(status, what);
    printf("%s: %s, %s\n", what, kind_of(v[0]), kind_of(v[1]));
    if (status != KVSAN_OK || strcmp(kind_of(v[0]), row0) != 0 ||
        strcmp(kind_of(v[1]), row1) != 0) {
        printf("%s: expected %s, %s\n", what, row0, row1);
        failures++;
    }
}

/* A call the kernel could not make is refused with a status, naming the row. */
static void refused(const char *what, int32_t status, const char *needle) {
    char msg[512];
    kvsan_last_error(msg, sizeof msg);
    printf("%s: %s: %s\n", what, kvsan_status_name(status), msg);
    if (status != KVSAN_ERR_OUT_OF_RANGE || strstr(msg, needle) == NULL) {
        printf("%s: expected KVSAN_ERR_OUT_OF_RANGE mentioning \"%s\"\n", what, needle);
        failures++;
    }
}

static KvsanPageRef filled(KvsanOwner who, uint32_t page, uint32_t slots) {
    KvsanPageRef ref;
    KvsanVerdict v;
    ok(kvsan_alloc(pool, who, page, 0, &ref, &v), "alloc");
    KvsanRange written = {0, slots};
    ok(kvsan_write(pool, who, ref, written, all_layers, 1, &v), "write");
    return ref;
}

int main(void) {
    ok(kvsan_check_version(KVSAN_ABI_VERSION), "check_version");
    const char node[] = "batch";
    KvsanPoolGeometry g = {8, SLOTS, LAYERS, KVSAN_ROLE_UNIFIED, 128, (const uint8_t *)node,
                           strlen(node)};
    ok(kvsan_pool_register(&g, sizeof g, &pool), "pool_register");
    filled(A, 0, 4);
    KvsanPageRef a1 = filled(A, 1, 2);
    filled(B, 2, 4);
    filled(B, 3, 1);
    KvsanVerdict v[2];

    /* Padded block table (vLLM / FlashAttention). */
    int32_t table[4] = {0, 1, 2, 3}, swapped[4] = {2, 3, 0, 1};
    int32_t lens[2] = {6, 5}, too_long[2] = {7, 5};
    expect("block table", kvsan_check_block_table(pool, owners, 2, table, 4, 2, lens, all_layers, 2, v), v, "continue", "continue");
    expect("block table, rows swapped", kvsan_check_block_table(pool, owners, 2, swapped, 4, 2, lens, all_layers, 2, v), v, "foreign-read", "foreign-read");
    expect("block table, length past what row 0 wrote", kvsan_check_block_table(pool, owners, 2, table, 4, 2, too_long, all_layers, 2, v), v, "stale-read", "continue");
    /* Stride 1 where rows are 2 apart: row 1 reads entries 1 and 2. */
    expect("block table, wrong stride", kvsan_check_block_table(pool, owners, 2, table, 4, 1, lens, all_layers, 2, v), v, "continue", "foreign-read");
    int32_t negative[4] = {0, -1, 2, 3};
    refused("block table, page -1", kvsan_check_block_table(pool, owners, 2, negative, 4, 2, lens, all_layers, 2, v), "row 0: page index -1");
    refused("block table, buffer too short", kvsan_check_block_table(pool, owners, 2, table, 3, 2, lens, all_layers, 2, v), "row 1");

    /* Pages in CSR form (FlashInfer). */
    int32_t indptr[3] = {0, 2, 4}, indices[4] = {0, 1, 2, 3}, last[2] = {2, 1};
    int32_t swapped_indices[4] = {2, 3, 0, 1}, longer_last[2] = {2, 2};
    expect("paged CSR", kvsan_check_paged_csr(pool, owners, 2, indptr, indices, 4, last, all_layers, 3, v), v, "continue", "continue");
    expect("paged CSR, rows swapped", kvsan_check_paged_csr(pool, owners, 2, indptr, swapped_indices, 4, last, all_layers, 3, v), v, "foreign-read", "foreign-read");
    expect("paged CSR, last page longer than written", kvsan_check_paged_csr(pool, owners, 2, indptr, indices, 4, longer_last, all_layers, 3, v), v, "continue", "stale-read");
    int32_t backwards[3] = {0, 3, 2};
    refused("paged CSR, indptr backwards", kvsan_check_paged_csr(pool, owners, 2, backwards, indices, 4, last, all_layers, 3, v), "goes backwards");

    /* Token-level table (SGLang): locations page * 4 + slot, 8 per request. */
    int32_t r2t[16] = {0, 1, 2, 3, 4, 5, 0, 0, 8, 9, 10, 11, 12, 0, 0, 0};
    int32_t reqs[2] = {0, 1}, swapped_reqs[2] = {1, 0};
    expect("req_to_token", kvsan_check_req_to_token(pool, owners, 2, r2t, 16, 8, reqs, lens, all_layers, 4, v), v, "continue", "continue");
    expect("req_to_token, requests swapped", kvsan_check_req_to_token(pool, owners, 2, r2t, 16, 8, swapped_reqs, lens, all_layers, 4, v), v, "foreign-read", "foreign-read");
    int32_t bad_slot[16] = {0, 1, 2, 3, 4, 6, 0, 0, 8, 9, 10, 11, 12, 0, 0, 0};
    expect("req_to_token, a slot never written", kvsan_check_req_to_token(pool, owners, 2, bad_slot, 16, 8, reqs, lens, all_layers, 4, v), v, "stale-read", "continue");

    /* Store slots (reshape_and_cache): row A stores token 6 at page 1 slot
     * 2, row B token 5 at page 3 slot 1; -1 is padding. */
    int32_t qsl[3] = {0, 2, 3};
    int64_t slots[3] = {6, -1, 13}, wrong_slots[3] = {6, -1, 3};
    expect("slot_mapping, into A's page 0", kvsan_check_slot_mapping(pool, owners, 2, qsl, wrong_slots, 3, all_layers, 5, v), v, "continue", "foreign-write");
    expect("slot_mapping", kvsan_check_slot_mapping(pool, owners, 2, qsl, slots, 3, all_layers, 5, v), v, "continue", "continue");
    /* The stores were recorded: row A now reads 7 tokens. */
    expect("block table after the store", kvsan_check_block_table(pool, owners, 2, table, 4, 2, too_long, all_layers, 6, v), v, "continue", "continue");

    /* A stale buffer: page 1 freed since the table was built. */
    KvsanVerdict one;
    ok(kvsan_free(pool, A, a1, 7, &one), "free");
    expect("block table, a page freed since", kvsan_check_block_table(pool, owners, 2, table, 4, 2, lens, all_layers, 8, v), v, "read-free-page", "continue");

    uint64_t count = 0;
    ok(kvsan_violation_count(&count), "violation_count");
    printf("violations: %" PRIu64 "\n", count);
    return failures == 0 ? 0 : 1;
}
