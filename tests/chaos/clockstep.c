/* A wall-clock step for the processes it is preloaded into (LD_PRELOAD), as an NTP step or an
 * operator's `date -s` does to a machine: CLOCK_REALTIME (and its coarse variant),
 * gettimeofday() and time() read the real clock plus an offset in seconds, which is read from
 * the file CHAOS_CLOCK_FILE names (at most every 100 ms; a missing or empty file is 0).
 * CLOCK_MONOTONIC and every other clock are left alone, as a real step leaves them: timers,
 * sleeps and timeouts keep their length. tests/chaos/clock.py builds it with the system's cc.
 * (libfaketime does this too, but its 0.9.10 makes time.sleep() fail with EINVAL once it is
 * told to leave the monotonic clock alone, and faking that clock is a different fault.) */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

typedef int (*clock_gettime_fn)(clockid_t, struct timespec *);

static clock_gettime_fn real_clock_gettime;
static volatile long long offset_ns;
static volatile long long next_read_ns;

static long long monotonic_ns(void) {
    struct timespec ts;
    real_clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void refresh(void) {
    long long now = monotonic_ns();
    if (now < next_read_ns) return;
    next_read_ns = now + 100000000LL;
    const char *path = getenv("CHAOS_CLOCK_FILE");
    if (path == NULL) return;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    char buf[64];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return;
    buf[n] = 0;
    offset_ns = (long long)(strtod(buf, NULL) * 1e9);
}

static void shift(struct timespec *ts) {
    long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + offset_ns;
    ts->tv_sec = ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
    if (ts->tv_nsec < 0) {
        ts->tv_nsec += 1000000000LL;
        ts->tv_sec -= 1;
    }
}

static void init(void) {
    if (real_clock_gettime == NULL)
        real_clock_gettime = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    init();
    int rc = real_clock_gettime(id, ts);
    if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
        refresh();
        shift(ts);
    }
    return rc;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    struct timespec ts;
    int rc = clock_gettime(CLOCK_REALTIME, &ts);
    (void)tz;
    if (rc == 0 && tv != NULL) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return rc;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out != NULL) *out = ts.tv_sec;
    return ts.tv_sec;
}
