/*
 * Malformed calls into libkvsan_shim.so: each must return its error code
 * (or, through the hook table, verdict code 2), leave the library usable
 * and never crash the process. Prints one FAIL line per unexpected result;
 * the exit status is the number of failures.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "kvsan.h"

static int failures = 0, checked = 0;

#define EXPECT(expr, want)                                                                   \
    do {                                                                                     \
        int32_t got_ = (expr);                                                               \
        checked++;                                                                           \
        if (got_ != (want)) {                                                                \
            printf("FAIL line %d: %s returned %d (%s), expected %s\n", __LINE__, #expr, got_, \
                   kvsan_status_name(got_), #want);                                          \
            failures++;                                                                      \
        }                                                                                    \
    } while (0)

#define CHECK(cond)                                                      \
    do {                                                                 \
        checked++;                                                       \
        if (!(cond)) {                                                   \
            printf("FAIL line %d: %s\n", __LINE__, #cond);               \
            failures++;                                                  \
        }                                                                \
    } while (0)

int main(void) {
    const char node[] = "malformed";
    KvsanPoolGeometry g = {8, 16, 4, KVSAN_ROLE_DECODE, 256, (const uint8_t *)node,
                           strlen(node)};
    uint32_t pool = 12345;
    KvsanVerdict v;
    KvsanOwner who = {1, 1, 0};
    KvsanRange layers = {0, 4};
    char msg[512];

    /* versions */
    EXPECT(kvsan_check_version(KVSAN_ABI_VERSION), KVSAN_OK);
    EXPECT(kvsan_check_version(KVSAN_ABI_VERSION + (1u << 16)), KVSAN_ERR_VERSION);
    EXPECT(kvsan_check_version(KVSAN_ABI_VERSION + 1), KVSAN_ERR_VERSION);
    CHECK(kvsan_abi_version() == KVSAN_ABI_VERSION);
    CHECK(kvsan_attached() == 1);

    /* pool registration */
    EXPECT(kvsan_pool_register(NULL, sizeof g, &pool), KVSAN_ERR_NULL);
    EXPECT(kvsan_pool_register(&g, sizeof g, NULL), KVSAN_ERR_NULL);
    EXPECT(kvsan_pool_register(&g, sizeof g - 8, &pool), KVSAN_ERR_SIZE);
    EXPECT(kvsan_pool_register(&g, sizeof g + 8, &pool), KVSAN_ERR_SIZE);
    CHECK(kvsan_last_error(msg, sizeof msg) > 0 && strstr(msg, "geometry_size") != NULL);
    KvsanPoolGeometry bad = g;
    bad.role = 9;
    EXPECT(kvsan_pool_register(&bad, sizeof bad, &pool), KVSAN_ERR_INVALID_ARGUMENT);
    bad.role = 9 | KVSAN_POOL_REPORTS_LANDING;
    EXPECT(kvsan_pool_register(&bad, sizeof bad, &pool), KVSAN_ERR_INVALID_ARGUMENT);
    bad.role = KVSAN_ROLE_DECODE | 0x200u;
    EXPECT(kvsan_pool_register(&bad, sizeof bad, &pool), KVSAN_ERR_INVALID_ARGUMENT);
    bad = g;
    bad.pages = 0;
    EXPECT(kvsan_pool_register(&bad, sizeof bad, &pool), KVSAN_ERR_BAD_GEOMETRY);
    bad = g;
    bad.node = NULL;
    EXPECT(kvsan_pool_register(&bad, sizeof bad, &pool), KVSAN_ERR_NULL);
    bad = g;
    bad.node = (const uint8_t *)"\xff\xfe";
    bad.node_len = 2;
    EXPECT(kvsan_pool_register(&bad, sizeof bad, &pool), KVSAN_ERR_INVALID_ARGUMENT);
    CHECK(pool == 12345); /* nothing written on failure */
    EXPECT(kvsan_pool_register(&g, sizeof g, &pool), KVSAN_OK);

    /* requests */
    EXPECT(kvsan_request_event(who, 42, &v), KVSAN_ERR_INVALID_ARGUMENT);
    EXPECT(kvsan_request_event(who, KVSAN_EVENT_QUEUED, NULL), KVSAN_ERR_NULL);
    KvsanOwner reserved = {1, 1, 5};
    EXPECT(kvsan_request_event(reserved, KVSAN_EVENT_QUEUED, &v), KVSAN_ERR_INVALID_ARGUMENT);
    EXPECT(kvsan_request_event(who, KVSAN_EVENT_QUEUED, &v), KVSAN_OK);
    EXPECT(kvsan_request_event(who, KVSAN_EVENT_ADMITTED, &v), KVSAN_OK);
    EXPECT(kvsan_request_event(who, KVSAN_EVENT_DECODING, &v), KVSAN_OK);

    /* pages */
    KvsanPageRef ref = {0, 0};
    EXPECT(kvsan_alloc(pool + 77, who, 0, 0, &ref, &v), KVSAN_ERR_UNKNOWN_POOL);
    EXPECT(kvsan_alloc(pool, who, 99, 0, &ref, &v), KVSAN_ERR_OUT_OF_RANGE);
    EXPECT(kvsan_alloc(pool, who, 0, 0, NULL, &v), KVSAN_ERR_NULL);
    EXPECT(kvsan_alloc(pool, who, 0, 0, &ref, NULL), KVSAN_ERR_NULL);
    EXPECT(kvsan_alloc(pool, who, 0, 0, &ref, &v), KVSAN_OK);
    CHECK(v.code == KVSAN_VERDICT_CONTINUE && ref.page == 0 && ref.generation == 1);

    KvsanRange slots = {0, 16};
    EXPECT(kvsan_write(pool, who, ref, (KvsanRange){2, 17}, layers, 0, &v), KVSAN_ERR_OUT_OF_RANGE);
    EXPECT(kvsan_write(pool, who, ref, (KvsanRange){3, 1}, layers, 0, &v), KVSAN_ERR_OUT_OF_RANGE);
    EXPECT(kvsan_write(pool, who, ref, slots, (KvsanRange){0, 5}, 0, &v), KVSAN_ERR_OUT_OF_RANGE);
    EXPECT(kvsan_write(pool + 1, who, ref, slots, layers, 0, &v), KVSAN_ERR_UNKNOWN_POOL);
    EXPECT(kvsan_write(pool, who, (KvsanPageRef){8, 1}, slots, layers, 0, &v),
           KVSAN_ERR_OUT_OF_RANGE);
    EXPECT(kvsan_write(pool, who, ref, slots, layers, 0, &v), KVSAN_OK);

    EXPECT(kvsan_read(pool, who, NULL, 2, 16, layers, 0, &v), KVSAN_ERR_NULL);
    KvsanPageRef table[3] = {ref, ref, ref};
    const KvsanPageRef *misaligned = (const KvsanPageRef *)((const char *)table + 1);
    EXPECT(kvsan_read(pool, who, misaligned, 1, 1, layers, 0, &v), KVSAN_ERR_INVALID_ARGUMENT);
    EXPECT(kvsan_read(pool, who, table, 1, 17, layers, 0, &v), KVSAN_ERR_OUT_OF_RANGE);
    EXPECT(kvsan_read(pool, who, table, 1, 16, (KvsanRange){0, 9}, 0, &v), KVSAN_ERR_OUT_OF_RANGE);
    EXPECT(kvsan_read(pool, who, table, 1, 16, layers, 0, NULL), KVSAN_ERR_NULL);
    EXPECT(kvsan_read(pool, who, table, 1, 16, layers, 0, &v), KVSAN_OK);
    CHECK(v.code == KVSAN_VERDICT_CONTINUE);

    /* transfers */
    KvsanManifest m;
    memset(&m, 0, sizeof m);
    m.request = who;
    m.src_pool = pool;
    m.dst_pool = pool;
    m.src_pages = table;
    m.src_len = 1;
    m.dst_pages = table;
    m.dst_len = 1;
    m.tokens = 16;
    m.layers = layers;
    EXPECT(kvsan_transfer_send(pool, NULL, sizeof m, &v), KVSAN_ERR_NULL);
    EXPECT(kvsan_transfer_send(pool, &m, sizeof m - 1, &v), KVSAN_ERR_SIZE);
    EXPECT(kvsan_transfer_recv(pool, &m, 0, &v), KVSAN_ERR_SIZE);
    KvsanManifest nulls = m;
    nulls.src_pages = NULL;
    EXPECT(kvsan_transfer_send(pool, &nulls, sizeof nulls, &v), KVSAN_ERR_NULL);
    nulls = m;
    nulls.request.reserved = 1;
    EXPECT(kvsan_transfer_send(pool, &nulls, sizeof nulls, &v), KVSAN_ERR_INVALID_ARGUMENT);
    EXPECT(kvsan_transfer_commit(pool + 3, who, table, 1, 16, &v), KVSAN_ERR_UNKNOWN_POOL);
    EXPECT(kvsan_transfer_commit(pool, who, NULL, 1, 16, &v), KVSAN_ERR_NULL);

    /* landings: refused before anything is checked, so no violation comes of
     * them (a well-formed landing into this owned, unreserved page would be
     * misdirected-transfer) */
    KvsanPageLanding landing;
    memset(&landing, 0, sizeof landing);
    landing.request = who;
    landing.page = ref;
    landing.slots = slots;
    landing.layers = layers;
    EXPECT(kvsan_transfer_land(pool, NULL, sizeof landing, &v), KVSAN_ERR_NULL);
    EXPECT(kvsan_transfer_verify(pool, NULL, sizeof landing, &v), KVSAN_ERR_NULL);
    EXPECT(kvsan_transfer_land(pool, &landing, sizeof landing - 8, &v), KVSAN_ERR_SIZE);
    EXPECT(kvsan_transfer_verify(pool, &landing, 0, &v), KVSAN_ERR_SIZE);
    CHECK(kvsan_last_error(msg, sizeof msg) > 0 && strstr(msg, "landing_size") != NULL);
    EXPECT(kvsan_transfer_land(pool, &landing, sizeof landing, NULL), KVSAN_ERR_NULL);
    EXPECT(kvsan_transfer_verify(pool, &landing, sizeof landing, NULL), KVSAN_ERR_NULL);
    EXPECT(kvsan_transfer_land(pool + 3, &landing, sizeof landing, &v), KVSAN_ERR_UNKNOWN_POOL);
    KvsanPageLanding off = landing;
    off.request.reserved = 1;
    EXPECT(kvsan_transfer_land(pool, &off, sizeof off, &v), KVSAN_ERR_INVALID_ARGUMENT);
    off = landing;
    off.page.page = 8;
    EXPECT(kvsan_transfer_land(pool, &off, sizeof off, &v), KVSAN_ERR_OUT_OF_RANGE);
    off = landing;
    off.slots = (KvsanRange){2, 17};
    EXPECT(kvsan_transfer_land(pool, &off, sizeof off, &v), KVSAN_ERR_OUT_OF_RANGE);
    off.slots = (KvsanRange){3, 1};
    EXPECT(kvsan_transfer_verify(pool, &off, sizeof off, &v), KVSAN_ERR_OUT_OF_RANGE);
    off = landing;
    off.layers = (KvsanRange){0, 5};
    EXPECT(kvsan_transfer_verify(pool, &off, sizeof off, &v), KVSAN_ERR_OUT_OF_RANGE);

    /* queries */
    EXPECT(kvsan_violation_count(NULL), KVSAN_ERR_NULL);
    EXPECT(kvsan_violation_count_of(0, NULL), KVSAN_ERR_NULL);
    uint64_t of = 99;
    EXPECT(kvsan_violation_count_of(100000, &of), KVSAN_ERR_INVALID_ARGUMENT);
    CHECK(of == 99);
    EXPECT(kvsan_check_count(NULL), KVSAN_ERR_NULL);
    EXPECT(kvsan_summary(msg, sizeof msg, NULL), KVSAN_ERR_NULL);
    size_t len = 0;
    EXPECT(kvsan_summary(NULL, 4, &len), KVSAN_ERR_NULL);
    EXPECT(kvsan_summary(NULL, 0, &len), KVSAN_OK);
    CHECK(len > 0);
    char tiny[6];
    EXPECT(kvsan_summary(tiny, sizeof tiny, &len), KVSAN_OK);
    CHECK(strlen(tiny) == 5 && len > 5);
    CHECK(kvsan_violation_kind_name(0) != NULL && strcmp(kvsan_violation_kind_name(0), "stale-read") == 0);
    CHECK(kvsan_violation_kind_name(100000) == NULL);
    CHECK(kvsan_status_name(KVSAN_ERR_NULL) != NULL && strcmp(kvsan_status_name(KVSAN_ERR_NULL), "KVSAN_ERR_NULL") == 0);
    CHECK(kvsan_status_name(7) == NULL);
    CHECK(kvsan_last_error(NULL, 0) > 0);

    /* NVTX registration: arguments first, then (this build has no `nvtx`
     * feature) a refusal that says why */
    KvsanNvtxPlane plane = {0x7f0000000000ull, 4096, 4096};
    EXPECT(kvsan_nvtx_describe_pool(pool, 0, &plane, 1, sizeof plane - 8), KVSAN_ERR_SIZE);
    EXPECT(kvsan_nvtx_describe_pool(pool, 0, NULL, 1, sizeof plane), KVSAN_ERR_NULL);
    EXPECT(kvsan_nvtx_describe_pool(pool, -1, &plane, 1, sizeof plane), KVSAN_ERR_INVALID_ARGUMENT);
    EXPECT(kvsan_nvtx_describe_pool(pool, 0, &plane, 0, sizeof plane), KVSAN_ERR_INVALID_ARGUMENT);
    EXPECT(kvsan_nvtx_describe_pool(pool, 0, &plane, 1, sizeof plane), KVSAN_ERR_DEVICE);
    CHECK(kvsan_last_error(msg, sizeof msg) > 0 && strstr(msg, "`nvtx` feature") != NULL);
    uint64_t requests[1] = {1};
    EXPECT(kvsan_nvtx_bind(pool, NULL, 1), KVSAN_ERR_NULL);
    EXPECT(kvsan_nvtx_bind(pool, requests, 1), KVSAN_ERR_DEVICE);
    EXPECT(kvsan_nvtx_unbind(pool), KVSAN_ERR_DEVICE);
    EXPECT(kvsan_nvtx_forget_pool(pool), KVSAN_ERR_DEVICE);

    /* the hook table: misuse is verdict code 2, never a crash */
    const KvsanHookTable *t = kvsan_hook_table_v1();
    CHECK(t != NULL);
    if (t) {
        CHECK(t->size == sizeof *t && t->version_major == KVSAN_ABI_VERSION_MAJOR);
        CHECK(t->read(t->ctx, pool, who, NULL, 3, 16, layers, 0).code == KVSAN_VERDICT_ERROR);
        CHECK(t->pool_register(t->ctx, &g, NULL).code == KVSAN_VERDICT_ERROR);
        CHECK(t->pool_register(t->ctx, NULL, &pool).code == KVSAN_VERDICT_ERROR);
        CHECK(t->transfer_send(t->ctx, pool, NULL).code == KVSAN_VERDICT_ERROR);
        CHECK(t->transfer_land(t->ctx, pool, NULL).code == KVSAN_VERDICT_ERROR);
        CHECK(t->transfer_verify(t->ctx, pool, NULL).code == KVSAN_VERDICT_ERROR);
        CHECK(t->request_event(t->ctx, who, 99).code == KVSAN_VERDICT_ERROR);
        CHECK(t->alloc(t->ctx, pool, who, (KvsanPageRef){1, 5}, 0).code == KVSAN_VERDICT_ERROR);
        CHECK(t->read(t->ctx, pool, who, table, 1, 16, layers, 0).code == KVSAN_VERDICT_CONTINUE);
    }

    /* still usable, and misuse is not a violation */
    uint64_t count = 99;
    EXPECT(kvsan_violation_count(&count), KVSAN_OK);
    CHECK(count == 0);
    CHECK(kvsan_refused_calls() > 30);
    printf("malformed calls: %d checked, %d failed\n", checked, failures);
    return failures;
}
