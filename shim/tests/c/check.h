/* What the C tests share: a failure count and a check of each call's status. */
#ifndef KVSAN_TEST_CHECK_H
#define KVSAN_TEST_CHECK_H

#include <stdio.h>

#include "kvsan.h"

static int failures = 0;

/* Counts a refused call as a failure, printing the library's message. */
static void ok(int32_t status, const char *what) {
    if (status != KVSAN_OK) {
        char msg[512];
        kvsan_last_error(msg, sizeof msg);
        printf("%s: %s: %s\n", what, kvsan_status_name(status), msg);
        failures++;
    }
}

/* expect_verdict(): the verdict must be no violation. */
#define KVSAN_TEST_CONTINUE UINT32_MAX

/* Prints `what: <the violation's kind, or continue>` and counts a failure
 * unless the verdict aborts with `kind` (KVSAN_TEST_CONTINUE: goes on). */
static inline void expect_verdict(const char *what, KvsanVerdict v, uint32_t kind) {
    const char *got = v.code == KVSAN_VERDICT_CONTINUE ? "continue"
                                                       : kvsan_violation_kind_name(v.kind);
    printf("%s: %s\n", what, got ? got : "(unknown kind)");
    int want_continue = kind == KVSAN_TEST_CONTINUE;
    if (want_continue ? v.code != KVSAN_VERDICT_CONTINUE
                      : v.code != KVSAN_VERDICT_ABORT || v.kind != kind) {
        printf("%s: expected %s\n", what,
               want_continue ? "continue" : kvsan_violation_kind_name(kind));
        failures++;
    }
}

#endif
