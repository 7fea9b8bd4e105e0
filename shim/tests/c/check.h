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

#endif
