/* log.c — see log.h. Timestamps are CLOCK_REALTIME with milliseconds so that lines from the
 * daemon and from test clients interleave readably in one CI log. */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static kvd_log_level_t kvd_log_level = KVD_LOG_INFO;
static const char *const kvd_log_names[] = {"error", "warn", "info", "debug"};

int kvd_log_set_level(const char *name)
{
    for (int i = 0; i < 4; i++)
        if (name && strcmp(name, kvd_log_names[i]) == 0) {
            kvd_log_level = (kvd_log_level_t)i;
            return 0;
        }
    return -1;
}

int kvd_log_enabled(kvd_log_level_t l)
{
    return l <= kvd_log_level;
}

void kvd_log(kvd_log_level_t l, const char *fmt, ...)
{
    if (!kvd_log_enabled(l))
        return;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    localtime_r(&ts.tv_sec, &tm);
    char line[2048];
    int n = snprintf(line, sizeof line, "%02d:%02d:%02d.%03ld %-5s kvd: ", tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000L, kvd_log_names[l]);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof line)
        vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s\n", line);
}
