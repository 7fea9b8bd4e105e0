/*
 * A toy engine that annotates its own KV page pool with kvsan.h.
 *
 * Pool: 4 pages x 4 slots x 2 layers, a LIFO free list that does not clear
 * pages on reuse (as production engines do). Three requests:
 *
 *   victim    allocates page 0, computes 4 slots, reads them, frees page 0
 *   probe     gets page 0 back (LIFO), computes only slot 0, then attention
 *             reads 4 slots: slots 1..3 still hold the victim's KV
 *             -> kvsan says abort, stale-read (and prints the report)
 *   neighbour allocates page 1, computes 3 slots, reads 3: legal, continues
 *
 * Build and run (from the repository root):
 *   cargo build -p kvsan-shim
 *   cc -Ishim/include shim/examples/toy_pool.c -Ltarget/debug -lkvsan_shim \
 *      -Wl,-rpath,$PWD/target/debug -o /tmp/toy_pool && /tmp/toy_pool
 * Exit status 0 when every verdict is the expected one.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "kvsan.h"

#define PAGES 4
#define SLOTS 4
#define LAYERS 2

static int failures = 0;

/* Dies loudly on a refused call: the toy engine makes none. */
static void ok(int32_t status, const char *what) {
    if (status != KVSAN_OK) {
        char msg[512];
        kvsan_last_error(msg, sizeof msg);
        printf("%s: %s: %s\n", what, kvsan_status_name(status), msg);
        failures++;
    }
}

static const char *describe(KvsanVerdict v) {
    static char buf[128];
    if (v.code == KVSAN_VERDICT_CONTINUE) return "continue";
    snprintf(buf, sizeof buf, "abort %s KV-%06" PRIu64, kvsan_violation_kind_name(v.kind),
             v.violation_id);
    return buf;
}

static void expect(const char *who, KvsanVerdict v, uint32_t code, const char *kind) {
    printf("%s read: %s\n", who, describe(v));
    if (v.code != code || (kind && strcmp(kvsan_violation_kind_name(v.kind), kind) != 0)) {
        printf("%s: unexpected verdict\n", who);
        failures++;
    }
}

/* A tiny pool: LIFO free list of page indices; the block table keeps tags. */
static uint32_t free_list[PAGES] = {3, 2, 1, 0};
static int free_top = PAGES;

static KvsanPageRef alloc_page(uint32_t pool, KvsanOwner who) {
    KvsanPageRef ref;
    KvsanVerdict v;
    uint32_t page = free_list[--free_top];
    ok(kvsan_alloc(pool, who, page, 0, &ref, &v), "alloc");
    return ref;
}

static void free_page(uint32_t pool, KvsanOwner who, KvsanPageRef ref) {
    KvsanVerdict v;
    ok(kvsan_free(pool, who, ref, 0, &v), "free");
    free_list[free_top++] = ref.page;
}

static void event(KvsanOwner who, uint32_t e) {
    KvsanVerdict v;
    ok(kvsan_request_event(who, e, &v), "request_event");
}

static KvsanVerdict compute_and_read(uint32_t pool, KvsanOwner who, KvsanPageRef ref,
                                     uint32_t computed, uint64_t read) {
    KvsanVerdict v;
    KvsanRange slots = {0, computed}, layers = {0, LAYERS};
    ok(kvsan_write(pool, who, ref, slots, layers, 1, &v), "write");
    ok(kvsan_read(pool, who, &ref, 1, read, layers, 2, &v), "read");
    return v;
}

int main(void) {
    ok(kvsan_check_version(KVSAN_ABI_VERSION), "check_version");
    const char node[] = "toy";
    KvsanPoolGeometry g = {PAGES, SLOTS, LAYERS, KVSAN_ROLE_UNIFIED, 128, (const uint8_t *)node,
                           strlen(node)};
    uint32_t pool;
    ok(kvsan_pool_register(&g, sizeof g, &pool), "pool_register");

    KvsanOwner victim = {1, 7, 0}, probe = {2, 9, 0}, neighbour = {3, 9, 0};

    event(victim, KVSAN_EVENT_QUEUED);
    event(victim, KVSAN_EVENT_ADMITTED);
    event(victim, KVSAN_EVENT_DECODING);
    KvsanPageRef v_page = alloc_page(pool, victim);
    expect("victim", compute_and_read(pool, victim, v_page, 4, 4), KVSAN_VERDICT_CONTINUE, NULL);
    free_page(pool, victim, v_page);
    event(victim, KVSAN_EVENT_FINISHED);

    event(probe, KVSAN_EVENT_QUEUED);
    event(probe, KVSAN_EVENT_ADMITTED);
    event(probe, KVSAN_EVENT_DECODING);
    KvsanPageRef p_page = alloc_page(pool, probe);
    if (p_page.page != v_page.page) {
        printf("probe did not get the victim's page back\n");
        failures++;
    }
    KvsanVerdict pv = compute_and_read(pool, probe, p_page, 1, 4);
    expect("probe", pv, KVSAN_VERDICT_ABORT, "stale-read");
    /* The engine aborts the probe: free its page, then the event. */
    free_page(pool, probe, p_page);
    event(probe, KVSAN_EVENT_ABORTED);

    event(neighbour, KVSAN_EVENT_QUEUED);
    event(neighbour, KVSAN_EVENT_ADMITTED);
    event(neighbour, KVSAN_EVENT_DECODING);
    KvsanPageRef n_page = alloc_page(pool, neighbour);
    expect("neighbour", compute_and_read(pool, neighbour, n_page, 3, 3), KVSAN_VERDICT_CONTINUE,
           NULL);
    free_page(pool, neighbour, n_page);
    event(neighbour, KVSAN_EVENT_FINISHED);

    uint64_t count = 0;
    ok(kvsan_violation_count(&count), "violation_count");
    char summary[256];
    size_t len = 0;
    ok(kvsan_summary(summary, sizeof summary, &len), "summary");
    printf("violations: %" PRIu64 "\nsummary: %s\n", count, summary);
    if (count != 1) failures++;
    /* The one violation is a stale read (code 0, "stale-read"), and the
     * checks behind it were counted. */
    uint64_t stale = 0, other = 0, checks = 0;
    ok(kvsan_violation_count_of(pv.kind, &stale), "violation_count_of");
    ok(kvsan_violation_count_of(pv.kind + 1, &other), "violation_count_of");
    ok(kvsan_check_count(&checks), "check_count");
    printf("stale reads: %" PRIu64 ", checks: %" PRIu64 "\n", stale, checks);
    if (stale != 1 || other != 0 || checks == 0) failures++;
    return failures == 0 ? 0 : 1;
}
