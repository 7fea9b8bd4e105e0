/*
 * A C engine's decode node receiving KV through kvsan.h (ABI 1.5): it
 * reports where each copy of received KV lands (kvsan_transfer_land) and
 * what the page holds once it is there (kvsan_transfer_verify).
 *
 * Pool "decode-landing": 8 pages x 4 slots x 2 layers, registered with
 * KVSAN_POOL_REPORTS_LANDING. Requests (tenant 7):
 *   A  6 tokens into pages 0 and 1: recv, land and verify each page with
 *      equal digests, commit, read: continue throughout.
 *   B  4 tokens into page 2, recv: continue. A copy of A's KV computes
 *      B's page as its destination: land aborts, misdirected-transfer; B's
 *      own copy then lands, verifies and commits: continue.
 *   C  4 tokens into page 3: recv, land: continue; verify with a digest
 *      other than the sender's: abort, transfer-digest-mismatch.
 *   D  4 tokens into page 4: recv, then commit with no landing reported:
 *      abort, short-transfer (the manifest alone marks nothing written).
 * Pool "decode-before-1.5": the same shape, registered without the bit, as
 * an engine built before 1.5 does. E: 4 tokens into page 0, recv, commit,
 * read: continue, with no landing reported.
 * Prints one line per verdict; exit status 0 when each is the expected one.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "kvsan.h"

#define SLOTS 4
#define LAYERS 2

/* The sender's digest and one that differs. Reports never show either. */
#define SENT_DIGEST 0x5e17d16e57ull
#define OTHER_DIGEST 0xbadd16e57ull

static uint32_t register_pool(const char *node, uint32_t role) {
    KvsanPoolGeometry g = {8, SLOTS, LAYERS, role, 128, (const uint8_t *)node, strlen(node)};
    uint32_t pool = 0;
    ok(kvsan_pool_register(&g, sizeof g, &pool), "pool_register");
    return pool;
}

static KvsanPageRef reserve(uint32_t pool, KvsanOwner who, uint32_t page) {
    KvsanPageRef ref = {0, 0};
    KvsanVerdict v;
    ok(kvsan_alloc(pool, who, page, 0, &ref, &v), "alloc");
    expect_verdict("alloc", v, KVSAN_TEST_CONTINUE);
    return ref;
}

/* The manifest of `tokens` tokens of `who` into dst[0..dst_len]. The
 * sender's pages are not this node's: kvsan_transfer_recv looks at the
 * destination only. */
static KvsanManifest manifest(uint32_t pool, KvsanOwner who, const KvsanPageRef *dst,
                              size_t dst_len, uint32_t tokens) {
    KvsanManifest m;
    memset(&m, 0, sizeof m);
    m.request = who;
    m.src_pool = pool;
    m.dst_pool = pool;
    m.dst_pages = dst;
    m.dst_len = dst_len;
    m.tokens = tokens;
    m.layers = (KvsanRange){0, LAYERS};
    return m;
}

static KvsanVerdict arrive(uint32_t pool, const KvsanManifest *m) {
    KvsanVerdict v;
    ok(kvsan_transfer_recv(pool, m, sizeof *m, &v), "transfer_recv");
    return v;
}

/* Tokens first_token.. of `who` into slots 0..n of `page`, all layers. */
static KvsanPageLanding landing(KvsanOwner who, KvsanPageRef page, uint64_t first_token,
                                uint32_t n, uint64_t landed_digest) {
    KvsanPageLanding l;
    memset(&l, 0, sizeof l);
    l.request = who;
    l.page = page;
    l.first_token = first_token;
    l.slots = (KvsanRange){0, n};
    l.layers = (KvsanRange){0, LAYERS};
    l.sent_digest = SENT_DIGEST;
    l.landed_digest = landed_digest;
    return l;
}

static KvsanVerdict land(uint32_t pool, KvsanPageLanding l) {
    KvsanVerdict v;
    ok(kvsan_transfer_land(pool, &l, sizeof l, &v), "transfer_land");
    return v;
}

static KvsanVerdict verify(uint32_t pool, KvsanPageLanding l) {
    KvsanVerdict v;
    ok(kvsan_transfer_verify(pool, &l, sizeof l, &v), "transfer_verify");
    return v;
}

static KvsanVerdict commit(uint32_t pool, KvsanOwner who, const KvsanPageRef *table,
                           size_t table_len, uint64_t tokens) {
    KvsanVerdict v;
    ok(kvsan_transfer_commit(pool, who, table, table_len, tokens, &v), "transfer_commit");
    return v;
}

static KvsanVerdict read_kv(uint32_t pool, KvsanOwner who, const KvsanPageRef *table,
                            size_t table_len, uint64_t tokens) {
    KvsanVerdict v;
    KvsanRange layers = {0, LAYERS};
    ok(kvsan_read(pool, who, table, table_len, tokens, layers, 1, &v), "read");
    return v;
}

int main(void) {
    ok(kvsan_check_version(KVSAN_ABI_VERSION), "check_version");
    uint32_t pool = register_pool("decode-landing", KVSAN_ROLE_DECODE | KVSAN_POOL_REPORTS_LANDING);
    KvsanOwner a = {1, 7, 0}, b = {2, 7, 0}, c = {3, 7, 0}, d = {4, 7, 0};

    /* (a) A's transfer, each copy where the manifest says */
    KvsanPageRef a_pages[2] = {reserve(pool, a, 0), reserve(pool, a, 1)};
    KvsanManifest ma = manifest(pool, a, a_pages, 2, 6);
    expect_verdict("A recv", arrive(pool, &ma), KVSAN_TEST_CONTINUE);
    KvsanPageLanding a0 = landing(a, a_pages[0], 0, SLOTS, SENT_DIGEST);
    KvsanPageLanding a1 = landing(a, a_pages[1], SLOTS, 6 - SLOTS, SENT_DIGEST);
    expect_verdict("A land page 0", land(pool, a0), KVSAN_TEST_CONTINUE);
    expect_verdict("A land page 1", land(pool, a1), KVSAN_TEST_CONTINUE);
    expect_verdict("A verify page 0", verify(pool, a0), KVSAN_TEST_CONTINUE);
    expect_verdict("A verify page 1", verify(pool, a1), KVSAN_TEST_CONTINUE);
    expect_verdict("A commit", commit(pool, a, a_pages, 2, 6), KVSAN_TEST_CONTINUE);
    expect_verdict("A read", read_kv(pool, a, a_pages, 2, 6), KVSAN_TEST_CONTINUE);

    /* (b) a copy of A's KV aimed at B's reserved page */
    KvsanPageRef b_page = reserve(pool, b, 2);
    KvsanManifest mb = manifest(pool, b, &b_page, 1, SLOTS);
    expect_verdict("B recv", arrive(pool, &mb), KVSAN_TEST_CONTINUE);
    expect_verdict("A's KV into B's page", land(pool, landing(a, b_page, 0, SLOTS, SENT_DIGEST)),
           KVSAN_KIND_MISDIRECTED_TRANSFER);
    KvsanPageLanding b0 = landing(b, b_page, 0, SLOTS, SENT_DIGEST);
    expect_verdict("B land", land(pool, b0), KVSAN_TEST_CONTINUE);
    expect_verdict("B verify", verify(pool, b0), KVSAN_TEST_CONTINUE);
    expect_verdict("B commit", commit(pool, b, &b_page, 1, SLOTS), KVSAN_TEST_CONTINUE);

    /* (c) what landed is not what was sent */
    KvsanPageRef c_page = reserve(pool, c, 3);
    KvsanManifest mc = manifest(pool, c, &c_page, 1, SLOTS);
    expect_verdict("C recv", arrive(pool, &mc), KVSAN_TEST_CONTINUE);
    expect_verdict("C land", land(pool, landing(c, c_page, 0, SLOTS, SENT_DIGEST)), KVSAN_TEST_CONTINUE);
    expect_verdict("C verify, other digest", verify(pool, landing(c, c_page, 0, SLOTS, OTHER_DIGEST)),
           KVSAN_KIND_TRANSFER_DIGEST_MISMATCH);

    /* (d) the manifest alone marks nothing written */
    KvsanPageRef d_page = reserve(pool, d, 4);
    KvsanManifest md = manifest(pool, d, &d_page, 1, SLOTS);
    expect_verdict("D recv", arrive(pool, &md), KVSAN_TEST_CONTINUE);
    expect_verdict("D commit, nothing landed", commit(pool, d, &d_page, 1, SLOTS),
           KVSAN_KIND_SHORT_TRANSFER);

    /* (e) an engine built before 1.5: the manifest is taken as written */
    uint32_t before = register_pool("decode-before-1.5", KVSAN_ROLE_DECODE);
    KvsanOwner e = {5, 7, 0};
    KvsanPageRef e_page = reserve(before, e, 0);
    KvsanManifest me = manifest(before, e, &e_page, 1, SLOTS);
    expect_verdict("E recv (before 1.5)", arrive(before, &me), KVSAN_TEST_CONTINUE);
    expect_verdict("E commit (before 1.5)", commit(before, e, &e_page, 1, SLOTS), KVSAN_TEST_CONTINUE);
    expect_verdict("E read (before 1.5)", read_kv(before, e, &e_page, 1, SLOTS), KVSAN_TEST_CONTINUE);

    uint64_t count = 0, misdirected = 0, mismatched = 0;
    ok(kvsan_violation_count(&count), "violation_count");
    ok(kvsan_violation_count_of(KVSAN_KIND_MISDIRECTED_TRANSFER, &misdirected),
       "violation_count_of");
    ok(kvsan_violation_count_of(KVSAN_KIND_TRANSFER_DIGEST_MISMATCH, &mismatched),
       "violation_count_of");
    printf("violations: %" PRIu64 " (misdirected-transfer: %" PRIu64
           ", transfer-digest-mismatch: %" PRIu64 ")\n",
           count, misdirected, mismatched);
    return failures == 0 ? 0 : 1;
}
