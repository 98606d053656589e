/* errors.c: the per-thread error detail behind pdhal_last_error(). */
#include "internal.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char last_error[512] = "no error";

const char *pdhal_last_error(void) { return last_error; }

int pdhal_abi_version(void) { return PDHAL_ABI_VERSION; }

/* Record a detail message and return -err, so callers can write `return pdhal_fail(...)`. */
int pdhal_fail(int err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return -err;
}
