/*
 * A C engine's prefix cache through kvsan.h: full pages handed read-only
 * to later requests, checked against KVSAN_OPTIONS=prefix_share=...
 *
 * Pool: 4 pages x 4 slots x 2 layers. Owner 1 (tenant 7) fills page 0 and
 * half of page 1. Then, by the policy given as argv[1]:
 *   tenant  the cache (KVSAN_PREFIX_CACHE_REQUEST, tenant 7) registers
 *           page 0: continue; the half-written page 1: abort,
 *           unwritten-share; owner 1 lets go of page 0: continue;
 *           owner 2 (tenant 7) shares page 0 and reads it: continue;
 *           owner 3 (tenant 9) shares page 0: abort, cross-domain-share;
 *           owner 2 shares the half-written page 1: abort, unwritten-share;
 *           the cache evicts page 0 and owner 2 still reads it: continue;
 *           owner 1 fills page 2, the cache registers it, and owner 1
 *           writes into it: abort, foreign-write.
 *   salt    owners 1 and 3 declared salt 0x5eed, owner 2 salt 0xbad:
 *           owner 3 (another tenant, same salt) shares page 0: continue;
 *           owner 2 (same tenant, other salt): abort, cross-domain-share.
 * Prints one line per verdict; exit status 0 when each is the expected one.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "kvsan.h"

#define SLOTS 4
#define LAYERS 2

static void expect(const char *what, KvsanVerdict v, const char *kind) {
    const char *got = v.code == KVSAN_VERDICT_CONTINUE ? "continue"
                                                       : kvsan_violation_kind_name(v.kind);
    printf("%s: %s\n", what, got);
    if (strcmp(got, kind ? kind : "continue") != 0) {
        printf("%s: expected %s\n", what, kind ? kind : "continue");
        failures++;
    }
}

static KvsanPageRef filled(uint32_t pool, KvsanOwner who, uint32_t page, uint32_t slots) {
    KvsanPageRef ref;
    KvsanVerdict v;
    ok(kvsan_alloc(pool, who, page, 0, &ref, &v), "alloc");
    KvsanRange written = {0, slots}, layers = {0, LAYERS};
    ok(kvsan_write(pool, who, ref, written, layers, 1, &v), "write");
    return ref;
}

static KvsanVerdict share(uint32_t pool, KvsanPageRef page, KvsanOwner who) {
    KvsanVerdict v;
    ok(kvsan_share(pool, page, who, &v), "share");
    return v;
}

int main(int argc, char **argv) {
    const char *policy = argc > 1 ? argv[1] : "tenant";
    ok(kvsan_check_version(KVSAN_ABI_VERSION), "check_version");
    const char node[] = "prefix";
    KvsanPoolGeometry g = {4, SLOTS, LAYERS, KVSAN_ROLE_UNIFIED, 128, (const uint8_t *)node,
                           strlen(node)};
    uint32_t pool;
    ok(kvsan_pool_register(&g, sizeof g, &pool), "pool_register");
    KvsanOwner writer = {1, 7, 0}, same_tenant = {2, 7, 0}, other_tenant = {3, 9, 0};
    KvsanVerdict v;
    if (strcmp(policy, "salt") == 0) {
        ok(kvsan_declare_salt(writer, 0x5eed, &v), "declare_salt");
        ok(kvsan_declare_salt(same_tenant, 0xbad, &v), "declare_salt");
        ok(kvsan_declare_salt(other_tenant, 0x5eed, &v), "declare_salt");
    }
    KvsanPageRef full = filled(pool, writer, 0, SLOTS);
    KvsanPageRef half = filled(pool, writer, 1, SLOTS / 2);

    if (strcmp(policy, "salt") == 0) {
        expect("other tenant, same salt", share(pool, full, other_tenant), NULL);
        expect("same tenant, other salt", share(pool, full, same_tenant), "cross-domain-share");
    } else {
        KvsanOwner cache = {KVSAN_PREFIX_CACHE_REQUEST, writer.tenant, 0};
        expect("cache registers the full page", share(pool, full, cache), NULL);
        expect("cache registers the half-written page", share(pool, half, cache),
               "unwritten-share");
        ok(kvsan_free(pool, writer, full, 2, &v), "free");
        expect("writer lets go of the cached page", v, NULL);
        expect("same tenant", share(pool, full, same_tenant), NULL);
        KvsanRange layers = {0, LAYERS};
        ok(kvsan_read(pool, same_tenant, &full, 1, SLOTS, layers, 2, &v), "read");
        expect("same tenant reads the shared page", v, NULL);
        expect("other tenant", share(pool, full, other_tenant), "cross-domain-share");
        expect("half-written page", share(pool, half, same_tenant), "unwritten-share");
        ok(kvsan_free(pool, cache, full, 3, &v), "free");
        expect("cache evicts the page a request still shares", v, NULL);
        ok(kvsan_read(pool, same_tenant, &full, 1, SLOTS, layers, 3, &v), "read");
        expect("same tenant reads it after the eviction", v, NULL);
        KvsanPageRef again = filled(pool, writer, 2, SLOTS);
        expect("cache registers another page", share(pool, again, cache), NULL);
        KvsanRange slot = {0, 1};
        ok(kvsan_write(pool, writer, again, slot, layers, 4, &v), "write");
        expect("writer writes the page the cache holds", v, "foreign-write");
    }
    uint64_t count = 0;
    ok(kvsan_violation_count(&count), "violation_count");
    printf("violations: %" PRIu64 "\n", count);
    return failures == 0 ? 0 : 1;
}
