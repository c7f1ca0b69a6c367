/* log.h — the daemon's log: one line per event on stderr, "LEVEL kvd: message".
 *
 * Lines name the failing call and errno the nginx way ("pidfd_open(1234) failed: ...").
 * Level is runtime-mutable (config log_level). Single-threaded: no locking.
 */
#ifndef KVD_LOG_H
#define KVD_LOG_H

typedef enum kvd_log_level_e {
    KVD_LOG_ERROR = 0,
    KVD_LOG_WARN = 1,
    KVD_LOG_INFO = 2,
    KVD_LOG_DEBUG = 3
} kvd_log_level_t;

/* "error" | "warn" | "info" | "debug"; unknown names leave the level unchanged (-1). */
int kvd_log_set_level(const char *name);
int kvd_log_enabled(kvd_log_level_t l);
void kvd_log(kvd_log_level_t l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define KVD_LOGE(...) kvd_log(KVD_LOG_ERROR, __VA_ARGS__)
#define KVD_LOGW(...) kvd_log(KVD_LOG_WARN, __VA_ARGS__)
#define KVD_LOGI(...) kvd_log(KVD_LOG_INFO, __VA_ARGS__)
#define KVD_LOGD(...)                                                                              \
    do {                                                                                           \
        if (kvd_log_enabled(KVD_LOG_DEBUG))                                                        \
            kvd_log(KVD_LOG_DEBUG, __VA_ARGS__);                                                   \
    } while (0)

#endif /* KVD_LOG_H */
