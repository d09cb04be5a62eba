/*
 * afd_connectors.shm._shmring: the native half of ShmAFDConnector's ring.
 *
 * Python keeps the layout, headers and errors; this module does only what
 * Python cannot do fast or at all: atomic counters with the right memory
 * order, a spin-then-futex wait that releases the GIL, the futex wake, and a
 * plain memcpy between two addresses. Every function takes raw addresses
 * inside a shared mapping the caller owns and keeps alive.
 *
 * The counters, the doorbell protocol and the slot meta line are _shmring_core.h's, shared with
 * afd_connectors.shm._shmsteady (the connector's steady state in C++).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_shmring_core.h"

/* nothing is mapped in the first page: a smaller "address" is a number passed in the wrong place */
#define SHMRING_FIRST_ADDR 4096u

/* the int obj as an address: 8-byte aligned and past the first page (or 0, where zero_ok), else a ValueError
 * naming `what` */
static int checked_addr(PyObject *obj, uintptr_t *out, const char *what, int zero_ok) {
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if ((v != 0 || !zero_ok) && (v < SHMRING_FIRST_ADDR || (v & 7u) != 0)) {
        PyErr_Format(PyExc_ValueError, "%s=%llu is %san 8-byte aligned address past the first page", what, v,
                     zero_ok ? "neither 0 nor " : "not ");
        return -1;
    }
    *out = (uintptr_t)v;
    return 0;
}

static int addr_arg(PyObject *obj, uintptr_t *out, const char *what) { return checked_addr(obj, out, what, 0); }

/* 0 (no spin) or the address of a struct shmring_spin */
static int spin_arg(PyObject *obj, struct shmring_spin **out) {
    uintptr_t v;
    if (checked_addr(obj, &v, "spin", 1) < 0) return -1;
    *out = (struct shmring_spin *)v;
    return 0;
}

static int u64_arg(PyObject *obj, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)v;
    return 0;
}

static int i64_arg(PyObject *obj, int64_t *out) {
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)v;
    return 0;
}

static int nargs_ok(Py_ssize_t nargs, Py_ssize_t want, const char *name) {
    if (nargs == want) return 1;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
    return 0;
}

PyDoc_STRVAR(wait_ge_doc,
             "wait_ge(counter, want, sleep_flag, spin, block_ns) -> bool\n\n"
             "Wait until the u64 at ``counter`` is >= ``want``: spin for the budget of the adaptive spin at\n"
             "address ``spin`` (three int64s: base, max and current ns; 0: no spin), then futex-wait up to\n"
             "``block_ns`` with the u64 at ``sleep_flag`` set, and update the budget from how the wait went.\n"
             "True when reached, False when the slice ended first (the caller checks its peer and deadline,\n"
             "then calls again). Runs without the GIL.");

static PyObject *py_wait_ge(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uintptr_t counter, sleep_flag;
    uint64_t want;
    struct shmring_spin *spin;
    int64_t block_ns;
    if (!nargs_ok(nargs, 5, "wait_ge") || addr_arg(args[0], &counter, "counter") < 0 || u64_arg(args[1], &want) < 0 ||
        addr_arg(args[2], &sleep_flag, "sleep_flag") < 0 || spin_arg(args[3], &spin) < 0 ||
        i64_arg(args[4], &block_ns) < 0)
        return NULL;
    return PyBool_FromLong(shmring_py_wait_ge((uint64_t *)counter, want, (uint64_t *)sleep_flag, spin, block_ns));
}

PyDoc_STRVAR(publish_doc,
             "publish(counter, value, sleep_flag) -> None\n\n"
             "Store ``value`` into the u64 at ``counter`` (sequentially consistent: everything written before\n"
             "is visible first) and wake its waiter if the u64 at ``sleep_flag`` says it is blocked.");

static PyObject *py_publish(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uintptr_t counter, sleep_flag;
    uint64_t value;
    if (!nargs_ok(nargs, 3, "publish") || addr_arg(args[0], &counter, "counter") < 0 || u64_arg(args[1], &value) < 0 ||
        addr_arg(args[2], &sleep_flag, "sleep_flag") < 0)
        return NULL;
    if (shmring_py_publish((uint64_t *)counter, value, (uint64_t *)sleep_flag) < 0) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(write_slot_doc,
             "write_slot(released, free_at, slot, seq, src, nbytes, layer, stage, tokens, count, code0, published,\n"
             "           reader_asleep) -> bool\n\n"
             "One send: unless the u64 at ``released`` is below ``free_at`` (the slot is still being read:\n"
             "return False, nothing written), copy ``nbytes`` from address ``src`` to just after the meta line of\n"
             "``slot``, fill the meta line (``codes[0] = code0``; further codes are the caller's), publish ``seq``\n"
             "into ``published`` and wake the reader if ``reader_asleep`` says it is blocked. Returns True.");

static PyObject *py_write_slot(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uintptr_t released, slot, published, asleep;
    uint64_t seq, src;
    int64_t free_at, nbytes, layer, stage, tokens, count, code0;
    if (!nargs_ok(nargs, 13, "write_slot") || addr_arg(args[0], &released, "released") < 0 ||
        i64_arg(args[1], &free_at) < 0 || addr_arg(args[2], &slot, "slot") < 0 || u64_arg(args[3], &seq) < 0 ||
        u64_arg(args[4], &src) < 0 || i64_arg(args[5], &nbytes) < 0 || i64_arg(args[6], &layer) < 0 ||
        i64_arg(args[7], &stage) < 0 || i64_arg(args[8], &tokens) < 0 || i64_arg(args[9], &count) < 0 ||
        i64_arg(args[10], &code0) < 0 || addr_arg(args[11], &published, "published") < 0 ||
        addr_arg(args[12], &asleep, "reader_asleep") < 0)
        return NULL;
    if (layer < 0 || layer > INT32_MAX || stage < 0 || stage > INT32_MAX || tokens < 0 || tokens > UINT32_MAX ||
        count < 1 || count > 40 || code0 < 0 || code0 > 255 || nbytes < 0 || (nbytes > 0 && src == 0))
        return PyErr_Format(PyExc_ValueError,
                            "slot write out of range: layer=%lld stage=%lld tokens=%lld count=%lld code=%lld "
                            "nbytes=%lld",
                            (long long)layer, (long long)stage, (long long)tokens, (long long)count, (long long)code0,
                            (long long)nbytes);
    /* free_at <= 0 while the ring has never wrapped */
    if (free_at > 0 && __atomic_load_n((uint64_t *)released, __ATOMIC_ACQUIRE) < (uint64_t)free_at) Py_RETURN_FALSE;
    shmring_py_copy((char *)slot + sizeof(struct shmring_slot_meta), (const void *)(uintptr_t)src, (size_t)nbytes);
    shmring_fill_meta((void *)slot, seq, (int32_t)layer, (int32_t)stage, (uint32_t)tokens, (uint32_t)count,
                      (uint8_t)code0);
    if (shmring_py_publish((uint64_t *)published, seq, (uint64_t *)asleep) < 0) return NULL;
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(recv_slot_doc,
             "recv_slot(counter, want, sleep_flag, spin, block_ns, slot) -> tuple | None\n\n"
             "Wait as :func:`wait_ge` for ``counter`` >= ``want``; then return the meta line of the slot at\n"
             "address ``slot`` as ``(seq, layer, stage, tokens, count, code0)``, or None when the slice ended.");

static PyObject *py_recv_slot(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uintptr_t counter, sleep_flag, slot;
    uint64_t want;
    struct shmring_spin *spin;
    int64_t block_ns;
    if (!nargs_ok(nargs, 6, "recv_slot") || addr_arg(args[0], &counter, "counter") < 0 ||
        u64_arg(args[1], &want) < 0 || addr_arg(args[2], &sleep_flag, "sleep_flag") < 0 ||
        spin_arg(args[3], &spin) < 0 || i64_arg(args[4], &block_ns) < 0 || addr_arg(args[5], &slot, "slot") < 0)
        return NULL;
    if (!shmring_py_wait_ge((uint64_t *)counter, want, (uint64_t *)sleep_flag, spin, block_ns)) Py_RETURN_NONE;
    const struct shmring_slot_meta *m = (const struct shmring_slot_meta *)slot;
    return Py_BuildValue("(KiiIIB)", (unsigned long long)m->seq, (int)m->layer, (int)m->stage,
                         (unsigned int)m->tokens, (unsigned int)m->count, (unsigned char)m->codes[0]);
}

PyDoc_STRVAR(spin_learn_doc,
             "spin_learn(spin, waited_ns, slept, reached) -> None\n\n"
             "Apply to the adaptive spin at address ``spin`` what every wait with it applies after itself: a\n"
             "wait of ``waited_ns`` that slept (or not) and reached its value (or not). For tools and tests\n"
             "that check the rule apart from the timing of real waits.");

static PyObject *py_spin_learn(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    struct shmring_spin *spin;
    int64_t waited_ns;
    int slept, reached;
    if (!nargs_ok(nargs, 4, "spin_learn") || spin_arg(args[0], &spin) < 0 || i64_arg(args[1], &waited_ns) < 0 ||
        (slept = PyObject_IsTrue(args[2])) < 0 || (reached = PyObject_IsTrue(args[3])) < 0)
        return NULL;
    if (spin == NULL) return PyErr_Format(PyExc_ValueError, "spin=0 is not an adaptive spin's address");
    shmring_spin_learn(spin, waited_ns, slept, reached);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(load_doc, "load(addr) -> int\n\nAcquire-load the u64 at ``addr``.");

static PyObject *py_load(PyObject *self, PyObject *arg) {
    uintptr_t addr;
    if (addr_arg(arg, &addr, "addr") < 0) return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n((uint64_t *)addr, __ATOMIC_ACQUIRE));
}

PyDoc_STRVAR(copy_doc,
             "copy(dst, src, nbytes) -> None\n\n"
             "memcpy ``nbytes`` from address ``src`` to address ``dst`` (non-overlapping); large copies run\n"
             "without the GIL.");

static PyObject *py_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t dst, src;
    int64_t n;
    if (!nargs_ok(nargs, 3, "copy") || u64_arg(args[0], &dst) < 0 || u64_arg(args[1], &src) < 0 ||
        i64_arg(args[2], &n) < 0)
        return NULL;
    if (n < 0) return PyErr_Format(PyExc_ValueError, "nbytes=%lld is negative", (long long)n);
    if (n > 0 && (dst == 0 || src == 0))
        return PyErr_Format(PyExc_ValueError, "copy of %lld bytes with a null address", (long long)n);
    shmring_py_copy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)n);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"wait_ge", (PyCFunction)(void (*)(void))py_wait_ge, METH_FASTCALL, wait_ge_doc},
    {"publish", (PyCFunction)(void (*)(void))py_publish, METH_FASTCALL, publish_doc},
    {"write_slot", (PyCFunction)(void (*)(void))py_write_slot, METH_FASTCALL, write_slot_doc},
    {"recv_slot", (PyCFunction)(void (*)(void))py_recv_slot, METH_FASTCALL, recv_slot_doc},
    {"spin_learn", (PyCFunction)(void (*)(void))py_spin_learn, METH_FASTCALL, spin_learn_doc},
    {"load", py_load, METH_O, load_doc},
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_FASTCALL, copy_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "afd_connectors.shm._shmring",
    "Atomic counters, spin-then-futex doorbell and memcpy for ShmAFDConnector's shared-memory rings.", -1, methods,
};

PyMODINIT_FUNC PyInit__shmring(void) { return PyModule_Create(&module); }
