/*
 * The ring primitives both native halves of ShmAFDConnector use: afd_connectors.shm._shmring (C, called from the
 * connector's Python) and afd_connectors.shm._shmsteady (C++, its steady state). The shmring_* primitives touch no
 * Python; the shmring_py_* wrappers at the end, called with the GIL held, release it around what may take long
 * and report a failed futex call as an OSError.
 *
 * Doorbell protocol (one waiter per counter): the waiter spins on the counter for its spin budget; then it sets
 * its sleep flag, re-reads the counter (both sequentially consistent) and futex-waits on the counter's low 32
 * bits for up to block_ns. The publisher stores the counter (sequentially consistent) and calls FUTEX_WAKE only
 * when it then sees the sleep flag set. Either the publisher sees the flag, or the waiter's re-read sees the new
 * value, so a wake-up is never lost; FUTEX_WAIT also returns at once if the word changed.
 *
 * The spin is adaptive (struct shmring_spin). A futex wake-up costs the woken side 60-95 us on a 2-vCPU VM;
 * when one side's answer takes longer than the other side's spin, that side sleeps, its own answer is then
 * late by a wake-up, the first side sleeps in turn, and every round trip pays two wake-ups from then on (whole
 * benchmark blocks at 120-190 us per 512 KiB round trip instead of ~20). So a wait that slept and still ended
 * within max_ns raises the spin to cover it next time; a wait that ran past max_ns (the peer was computing,
 * not answering) puts the spin back to base_ns, so long waits burn only base_ns of a core; and waits that end
 * well inside the spin let it decay back toward base_ns.
 */
#ifndef AFD_SHMRING_CORE_H
#define AFD_SHMRING_CORE_H

#include <Python.h>

#include <errno.h>
#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SHMRING_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define SHMRING_RELAX() __asm__ __volatile__("yield" ::: "memory")
#else
#define SHMRING_RELAX() __asm__ __volatile__("" ::: "memory")
#endif

/* copies at least this large run without the GIL */
#define SHMRING_NOGIL_COPY_BYTES (64 * 1024)

/* slot meta line: seq u64, layer i32, stage i32, tokens u32, tensor count u32, dtype codes u8[40] */
struct shmring_slot_meta {
    uint64_t seq;
    int32_t layer;
    int32_t stage;
    uint32_t tokens;
    uint32_t count;
    uint8_t codes[40];
};

#ifdef __cplusplus
static_assert(sizeof(struct shmring_slot_meta) == 64, "the slot meta line is one cache line");
#else
_Static_assert(sizeof(struct shmring_slot_meta) == 64, "the slot meta line is one cache line");
#endif

static inline int64_t shmring_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* the futex word is the counter's low half (little-endian: its first 4 bytes) */
static inline uint32_t *shmring_futex_word(uint64_t *counter) {
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    return (uint32_t *)counter;
#else
    return (uint32_t *)counter + 1;
#endif
}

static inline int shmring_reached(uint64_t *counter, uint64_t want) {
    return __atomic_load_n(counter, __ATOMIC_ACQUIRE) >= want;
}

/* One waiter's spin budget, kept where both native halves see it (three int64s the connector owns): spin
 * base_ns at least and max_ns at most; cur_ns is the budget the next wait spins for. Relaxed atomics: a race
 * between two waits of one connector only blurs the estimate. */
struct shmring_spin {
    int64_t base_ns;
    int64_t max_ns;
    int64_t cur_ns;
};

/* Learn from one wait of waited_ns that slept or not and reached its value or not (see the header comment). */
static inline void shmring_spin_learn(struct shmring_spin *s, int64_t waited_ns, int slept, int reached) {
    int64_t base = s->base_ns, max = s->max_ns, cur = __atomic_load_n(&s->cur_ns, __ATOMIC_RELAXED), next = cur;
    if (slept) {
        /* waited_ns includes the wake-up; half again on top absorbs the spread of the next answer */
        next = reached && waited_ns <= max ? waited_ns + waited_ns / 2 : base;
        if (next > max) next = max;
        if (next < base) next = base;
    } else if (cur > base && 2 * waited_ns < cur) {
        int64_t target = 2 * waited_ns > base ? 2 * waited_ns : base;
        next = cur - (cur - target) / 8;
    }
    if (next != cur) __atomic_store_n(&s->cur_ns, next, __ATOMIC_RELAXED);
}

/* Wait until *counter >= want: spin (for spin's budget; not at all when spin is NULL), then one futex wait of up
 * to block_ns. 1 when reached, 0 when the slice ended first. A wait with a spin teaches it (shmring_spin_learn).
 * Call it without the GIL. */
static inline int shmring_wait_ge(uint64_t *counter, uint64_t want, uint64_t *sleep_flag, struct shmring_spin *spin,
                                  int64_t block_ns) {
    int64_t start = shmring_now_ns();
    int64_t spin_ns = spin ? __atomic_load_n(&spin->cur_ns, __ATOMIC_RELAXED) : 0;
    for (unsigned i = 1;; i++) {
        if (shmring_reached(counter, want)) {
            /* at base a wait that did not sleep teaches nothing: skip the clock read */
            if (spin && spin_ns > spin->base_ns) shmring_spin_learn(spin, shmring_now_ns() - start, 0, 1);
            return 1;
        }
        if ((i & 31u) == 0 && shmring_now_ns() - start >= spin_ns) break;
        SHMRING_RELAX();
    }
    if (block_ns <= 0) return 0;
    __atomic_store_n(sleep_flag, 1, __ATOMIC_SEQ_CST);
    uint64_t seen = __atomic_load_n(counter, __ATOMIC_SEQ_CST);
    if (seen < want) {
        struct timespec ts = {(time_t)(block_ns / 1000000000LL), (long)(block_ns % 1000000000LL)};
        /* EAGAIN (the word moved), EINTR and ETIMEDOUT all end in the re-check below */
        syscall(SYS_futex, shmring_futex_word(counter), FUTEX_WAIT, (uint32_t)seen, &ts, NULL, 0);
    }
    __atomic_store_n(sleep_flag, 0, __ATOMIC_RELAXED);
    int reached = shmring_reached(counter, want);
    if (spin) shmring_spin_learn(spin, shmring_now_ns() - start, 1, reached);
    return reached;
}

/* Store value into *counter (sequentially consistent: everything written before is visible first), then wake its
 * waiter if *sleep_flag says it is blocked. 0, or -1 with errno set when FUTEX_WAKE failed. */
static inline int shmring_publish(uint64_t *counter, uint64_t value, uint64_t *sleep_flag) {
    __atomic_store_n(counter, value, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(sleep_flag, __ATOMIC_SEQ_CST) &&
        syscall(SYS_futex, shmring_futex_word(counter), FUTEX_WAKE, 1, NULL, NULL, 0) < 0)
        return -1;
    return 0;
}

/* Fill a slot's meta line after its data (codes[0] only; the caller writes further codes first). */
static inline void shmring_fill_meta(void *slot, uint64_t seq, int32_t layer, int32_t stage, uint32_t tokens,
                                     uint32_t count, uint8_t code0) {
    struct shmring_slot_meta *m = (struct shmring_slot_meta *)slot;
    m->seq = seq;
    m->layer = layer;
    m->stage = stage;
    m->tokens = tokens;
    m->count = count;
    m->codes[0] = code0;
}

/* ---- with the GIL held ---- */

/* shmring_wait_ge behind a GIL-free fast path; the GIL is released only when there is something to wait for */
static inline int shmring_py_wait_ge(uint64_t *counter, uint64_t want, uint64_t *sleep_flag,
                                     struct shmring_spin *spin, int64_t block_ns) {
    if (shmring_reached(counter, want)) return 1;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = shmring_wait_ge(counter, want, sleep_flag, spin, block_ns);
    Py_END_ALLOW_THREADS
    return ok;
}

/* shmring_publish; -1 with an OSError set if FUTEX_WAKE failed */
static inline int shmring_py_publish(uint64_t *counter, uint64_t value, uint64_t *sleep_flag) {
    if (shmring_publish(counter, value, sleep_flag) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

/* memcpy that lets other Python threads run during large copies */
static inline void shmring_py_copy(void *dst, const void *src, size_t n) {
    if (n >= SHMRING_NOGIL_COPY_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        memcpy(dst, src, n);
        Py_END_ALLOW_THREADS
    } else if (n > 0) {
        memcpy(dst, src, n);
    }
}

#endif /* AFD_SHMRING_CORE_H */
