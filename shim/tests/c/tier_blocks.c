/*
 * A C engine with a host-memory KV tier of its own, reporting it through
 * kvsan.h (ABI 1.6): each store into a tier block, its completion, each
 * load back into a page, the digest of what landed, each release.
 *
 * Pool "decode-tier": 8 pages x 4 slots x 2 layers. Tier 0 ("host"), its
 * blocks numbered by the engine. Requests A (tenant 7) and B (tenant 8):
 *   1. A's page 0, slots 0..3 written, is stored into block 5; the store
 *      completes (digest D). A's page is freed (preemption), A takes page
 *      1, loads block 5 into it, verifies digest D, reads its 3 tokens:
 *      continue throughout; a read of 4 tokens is stale-read (the fourth
 *      slot was never stored).
 *   2. B's page 2 stored into block 5, which still holds A's KV:
 *      tier-block-aliased.
 *   3. B loads block 5 (A's KV) into its page 2: tier-foreign-load.
 *   4. A loads block 5 again and reports a digest other than D:
 *      tier-digest-mismatch.
 *   5. Block 6: B's page 3 stored, page freed and re-taken by A before the
 *      store completes: tier-store-source-reused; B's load of block 6 is
 *      then tier-load-unstored.
 *   6. Block 5 released; A's load of it: tier-load-unstored.
 *   7. kvsan_tier_store_done with stored = 2: KVSAN_ERR_INVALID_ARGUMENT.
 * Prints one line per verdict; exit status 0 when each is the expected one.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "kvsan.h"

#define SLOTS 4
#define LAYERS 2
#define HOST 0u

/* The engine's digests of what a block holds. Reports never show them. */
#define DIGEST 0x7e17d16e57ull
#define OTHER_DIGEST 0xbadd16e57ull

static KvsanPageRef take(uint32_t pool, KvsanOwner who, uint32_t page) {
    KvsanPageRef ref = {0, 0};
    KvsanVerdict v;
    ok(kvsan_alloc(pool, who, page, 0, &ref, &v), "alloc");
    expect_verdict("alloc", v, KVSAN_TEST_CONTINUE);
    return ref;
}

static void compute(uint32_t pool, KvsanOwner who, KvsanPageRef page, uint32_t slots) {
    KvsanVerdict v;
    ok(kvsan_write(pool, who, page, (KvsanRange){0, slots}, (KvsanRange){0, LAYERS}, 1, &v),
       "write");
    expect_verdict("write", v, KVSAN_TEST_CONTINUE);
}

static void release_page(uint32_t pool, KvsanOwner who, KvsanPageRef page) {
    KvsanVerdict v;
    ok(kvsan_free(pool, who, page, 2, &v), "free");
    expect_verdict("free", v, KVSAN_TEST_CONTINUE);
}

static KvsanVerdict store(uint32_t pool, KvsanOwner who, KvsanPageRef page, uint64_t block) {
    KvsanVerdict v;
    ok(kvsan_tier_store(pool, who, page, HOST, block, 3, &v), "tier_store");
    return v;
}

static KvsanVerdict done(uint64_t block, uint64_t digest) {
    KvsanVerdict v;
    ok(kvsan_tier_store_done(HOST, block, digest, 1, &v), "tier_store_done");
    return v;
}

static KvsanVerdict load(uint32_t pool, KvsanOwner who, KvsanPageRef page, uint64_t block) {
    KvsanVerdict v;
    ok(kvsan_tier_load(pool, who, page, HOST, block, 4, &v), "tier_load");
    return v;
}

static KvsanVerdict verify(uint32_t pool, KvsanOwner who, KvsanPageRef page, uint64_t block,
                           uint64_t digest) {
    KvsanVerdict v;
    ok(kvsan_tier_verify(pool, who, page, HOST, block, digest, &v), "tier_verify");
    return v;
}

static KvsanVerdict read_tokens(uint32_t pool, KvsanOwner who, KvsanPageRef page,
                                uint64_t tokens) {
    KvsanVerdict v;
    ok(kvsan_read(pool, who, &page, 1, tokens, (KvsanRange){0, LAYERS}, 5, &v), "read");
    return v;
}

int main(void) {
    const char *node = "decode-tier";
    KvsanPoolGeometry g = {8, SLOTS, LAYERS, 2, 128, (const uint8_t *)node, strlen(node)};
    uint32_t pool = 0;
    ok(kvsan_pool_register(&g, sizeof g, &pool), "pool_register");
    KvsanOwner a = {1, 7, 0}, b = {2, 8, 0};

    /* 1. preempted to the host tier and back */
    KvsanPageRef a0 = take(pool, a, 0);
    compute(pool, a, a0, 3);
    expect_verdict("A store page 0 into block 5", store(pool, a, a0, 5), KVSAN_TEST_CONTINUE);
    expect_verdict("A store done", done(5, DIGEST), KVSAN_TEST_CONTINUE);
    release_page(pool, a, a0);
    KvsanPageRef a1 = take(pool, a, 1);
    expect_verdict("A load block 5", load(pool, a, a1, 5), KVSAN_TEST_CONTINUE);
    expect_verdict("A verify", verify(pool, a, a1, 5, DIGEST), KVSAN_TEST_CONTINUE);
    expect_verdict("A read 3 tokens", read_tokens(pool, a, a1, 3), KVSAN_TEST_CONTINUE);
    expect_verdict("A read 4 tokens", read_tokens(pool, a, a1, 4), KVSAN_KIND_STALE_READ);

    /* 2. two pages into one block */
    KvsanPageRef b2 = take(pool, b, 2);
    compute(pool, b, b2, SLOTS);
    expect_verdict("B store into block 5", store(pool, b, b2, 5), KVSAN_KIND_TIER_BLOCK_ALIASED);

    /* 3. another request's block */
    expect_verdict("B load block 5", load(pool, b, b2, 5), KVSAN_KIND_TIER_FOREIGN_LOAD);

    /* 4. what landed is not what was stored */
    expect_verdict("A load block 5 again", load(pool, a, a1, 5), KVSAN_TEST_CONTINUE);
    expect_verdict("A verify, other digest", verify(pool, a, a1, 5, OTHER_DIGEST),
           KVSAN_KIND_TIER_DIGEST_MISMATCH);

    /* 5. the source page reused while its store is in flight */
    KvsanPageRef b3 = take(pool, b, 3);
    compute(pool, b, b3, SLOTS);
    expect_verdict("B store page 3 into block 6", store(pool, b, b3, 6), KVSAN_TEST_CONTINUE);
    release_page(pool, b, b3);
    KvsanPageRef a3 = take(pool, a, 3);
    compute(pool, a, a3, SLOTS);
    expect_verdict("B store done after reuse", done(6, DIGEST), KVSAN_KIND_TIER_STORE_SOURCE_REUSED);
    expect_verdict("B load block 6", load(pool, b, b2, 6), KVSAN_KIND_TIER_LOAD_UNSTORED);

    /* 6. released */
    KvsanVerdict v;
    ok(kvsan_tier_release(HOST, 5, &v), "tier_release");
    expect_verdict("release block 5", v, KVSAN_TEST_CONTINUE);
    expect_verdict("A load released block 5", load(pool, a, a1, 5), KVSAN_KIND_TIER_LOAD_UNSTORED);

    /* 7. a completion code the ABI does not define */
    int32_t status = kvsan_tier_store_done(HOST, 7, DIGEST, 2, &v);
    printf("store done with stored = 2: %s\n", kvsan_status_name(status));
    if (status != KVSAN_ERR_INVALID_ARGUMENT) {
        failures++;
    }

    uint64_t count = 0;
    ok(kvsan_violation_count(&count), "violation_count");
    printf("violations: %" PRIu64 "\n", count);
    if (count != 7) {
        failures++;
    }
    printf("failures: %d\n", failures);
    return failures == 0 ? 0 : 1;
}
