/*
 * afd_connectors.zmq._zmqwire: ZmqAFDConnector's per-message send and receive in C.
 *
 * Profiling (afd bench connector --profile) showed the connector's cost over
 * raw pyzmq is Python per frame: each pyzmq call, frame object and byte view
 * costs a few microseconds, two to four times more right after a blocking wait.
 * This module moves one whole multipart message per call and nothing else;
 * Python keeps the headers, checks and errors.
 *
 * It calls the libzmq that pyzmq already loaded (load() takes its path and
 * dlopens it again, so the sockets, given as pyzmq's Socket.underlying
 * addresses, belong to the same library instance). No zmq header is needed:
 * the few functions used are declared below with libzmq's stable C ABI.
 *
 * Zero-copy sends without pyzmq's garbage thread: a large part is handed to
 * libzmq with a free function that only sets a flag in its ticket; the ticket
 * holds a reference to the Python object that owns the memory, and every later
 * call (holding the GIL) drops the references whose flag is set. Nothing runs
 * Python, or needs the GIL, on libzmq's I/O thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "_zmqwire_api.h"

/* libzmq's ABI: zmq_msg_t is 64 bytes, 8-byte aligned (zmq.h); flags and option numbers */
typedef zmqwire_msg zmq_msg_t;
typedef void(zmq_free_fn)(void *data, void *hint);
#define ZMQ_DONTWAIT 1
#define ZMQ_SNDMORE 2
#define ZMQ_MORE 1

static struct {
    int (*msg_init)(zmq_msg_t *);
    int (*msg_init_size)(zmq_msg_t *, size_t);
    int (*msg_init_data)(zmq_msg_t *, void *, size_t, zmq_free_fn *, void *);
    int (*msg_send)(zmq_msg_t *, void *, int);
    int (*msg_recv)(zmq_msg_t *, void *, int);
    int (*msg_close)(zmq_msg_t *);
    int (*msg_move)(zmq_msg_t *, zmq_msg_t *);
    void *(*msg_data)(zmq_msg_t *);
    size_t (*msg_size)(const zmq_msg_t *);
    int (*msg_more)(const zmq_msg_t *);
    int (*errno_)(void);
    const char *(*strerror)(int);
} Z;
static int loaded = 0;
static PyObject *error_type = NULL;      /* zmq.ZMQError: the same errors as pyzmq's */
static Py_ssize_t zero_copy_min = 65536; /* parts this large go zero-copy */

/* ---- tickets: Python owners of zero-copy parts, until libzmq frees them ---- */

typedef struct ticket {
    struct ticket *next;
    PyObject *owner;  /* a (tensor, address, nbytes) part's tensor, referenced; NULL for a buffer part */
    Py_buffer view;   /* a buffer part's export, held so its memory can neither move nor go */
    volatile int done; /* set by libzmq's I/O thread (free function), read under the GIL */
} ticket;
static ticket *pending = NULL;
static Py_ssize_t pending_count = 0;

static void ticket_done(void *data, void *hint) {
    (void)data;
    __atomic_store_n(&((ticket *)hint)->done, 1, __ATOMIC_RELEASE);
}

/* drop the owners of parts libzmq no longer uses (GIL held) */
static void sweep(void) {
    ticket **link = &pending;
    while (*link != NULL) {
        ticket *t = *link;
        if (__atomic_load_n(&t->done, __ATOMIC_ACQUIRE)) {
            *link = t->next;
            if (t->owner != NULL) {
                Py_DECREF(t->owner);
            } else {
                PyBuffer_Release(&t->view);
            }
            PyMem_RawFree(t);
            pending_count--;
        } else {
            link = &t->next;
        }
    }
}

static PyObject *zmq_error(int err) {
    PyObject *exc = PyObject_CallFunction(error_type, "i", err);
    if (exc != NULL) {
        PyErr_SetObject(error_type, exc);
        Py_DECREF(exc);
    }
    return NULL;
}

/* ---- Frame: one received part, its memory owned until the last view goes ---- */

typedef struct {
    PyObject_HEAD zmq_msg_t msg;
} Frame;

static void frame_dealloc(Frame *self) {
    Z.msg_close(&self->msg);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int frame_getbuffer(Frame *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, Z.msg_data(&self->msg), (Py_ssize_t)Z.msg_size(&self->msg), 0,
                             flags);
}

static Py_ssize_t frame_len(Frame *self) { return (Py_ssize_t)Z.msg_size(&self->msg); }

static PyBufferProcs frame_as_buffer = {(getbufferproc)frame_getbuffer, NULL};
static PySequenceMethods frame_as_sequence = {.sq_length = (lenfunc)frame_len};

static PyTypeObject FrameType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "afd_connectors.zmq._zmqwire.Frame",
    .tp_basicsize = sizeof(Frame),
    .tp_dealloc = (destructor)frame_dealloc,
    .tp_as_buffer = &frame_as_buffer,
    .tp_as_sequence = &frame_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One received message part; a writable buffer over libzmq's own memory (no copy).",
};

/* ---- module functions ---- */

static zmqwire_api api; /* defined with the C API below */

static PyObject *wire_load(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) return PyErr_Format(PyExc_TypeError, "load(path, error_type, zero_copy_min) takes 3 arguments");
    const char *path = PyUnicode_AsUTF8(args[0]);
    if (path == NULL) return NULL;
    if (!PyExceptionClass_Check(args[1])) return PyErr_Format(PyExc_TypeError, "error_type must be an exception class");
    Py_ssize_t min = PyLong_AsSsize_t(args[2]);
    if (min < 0) return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "zero_copy_min must be >= 0");
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (lib == NULL) return PyErr_Format(PyExc_OSError, "libzmq at %s is not loaded in this process: %s", path, dlerror());
#define SYM(field, name)                                                                      \
    do {                                                                                      \
        *(void **)&Z.field = dlsym(lib, name);                                                \
        if (Z.field == NULL) return PyErr_Format(PyExc_OSError, "%s has no symbol %s", path, name); \
    } while (0)
    SYM(msg_init, "zmq_msg_init");
    SYM(msg_init_size, "zmq_msg_init_size");
    SYM(msg_init_data, "zmq_msg_init_data");
    SYM(msg_send, "zmq_msg_send");
    SYM(msg_recv, "zmq_msg_recv");
    SYM(msg_close, "zmq_msg_close");
    SYM(msg_move, "zmq_msg_move");
    SYM(msg_data, "zmq_msg_data");
    SYM(msg_size, "zmq_msg_size");
    SYM(msg_more, "zmq_msg_more");
    SYM(errno_, "zmq_errno");
    SYM(strerror, "zmq_strerror");
#undef SYM
    Py_INCREF(args[1]);
    Py_XSETREF(error_type, args[1]);
    zero_copy_min = min;
    loaded = 1;
    /* the C API, for afd_connectors.zmq._zmqsteady: usable from here on */
    PyObject *capsule = PyCapsule_New(&api, ZMQWIRE_CAPSULE, NULL);
    if (capsule == NULL || PyModule_AddObject(mod, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        return NULL;
    }
    Py_RETURN_NONE;
}

static int socket_arg(PyObject *obj, void **out) {
    if (!loaded) {
        PyErr_SetString(PyExc_RuntimeError, "afd_connectors.zmq._zmqwire.load() was not called");
        return -1;
    }
    void *p = PyLong_AsVoidPtr(obj);
    if (p == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "socket address is 0");
        return -1;
    }
    *out = p;
    return 0;
}

/* One zmq_msg_send or zmq_msg_recv: try without blocking (GIL held), then block without the
 * GIL, retrying on signals. Returns 1 when done; 0 when the socket's timeout passed and
 * timeout_ok (a receive slice); else -1 with the error set (EAGAIN: the send timeout passed). */
typedef int(msg_op)(zmq_msg_t *, void *, int);
static int transfer(msg_op *op, zmq_msg_t *msg, void *sock, int flags, int timeout_ok) {
    if (op(msg, sock, flags | ZMQ_DONTWAIT) >= 0) return 1;
    int err = Z.errno_();
    for (;;) {
        if (err == EINTR) {
            if (PyErr_CheckSignals() < 0) return -1;
        } else if (err != EAGAIN) {
            zmq_error(err);
            return -1;
        }
        int rc;
        Py_BEGIN_ALLOW_THREADS rc = op(msg, sock, flags);
        Py_END_ALLOW_THREADS if (rc >= 0) return 1;
        err = Z.errno_();
        if (err == EAGAIN) {
            if (timeout_ok) return 0;
            zmq_error(err);
            return -1;
        }
    }
}

static int send_msg(zmq_msg_t *msg, void *sock, int flags) {
    return transfer(Z.msg_send, msg, sock, flags, 0) < 0 ? -1 : 0;
}

/* Send one part by copy (small parts): what zmq_send does, then send_msg's two tries. */
static int send_copy(void *sock, const void *data, size_t size, int flags) {
    zmq_msg_t msg;
    if (Z.msg_init_size(&msg, size) != 0) {
        zmq_error(Z.errno_());
        return -1;
    }
    if (size) memcpy(Z.msg_data(&msg), data, size);
    if (send_msg(&msg, sock, flags) < 0) {
        Z.msg_close(&msg);
        return -1;
    }
    return 0;
}

/* Send one part of `size` bytes at `data`: copied below zero_copy_min, else zero-copy, its memory kept alive by
 * a ticket holding `owner` (referenced) or `view` (taken over). A `view` is released here in every case once the
 * part no longer needs it. 0, or -1 with the error set. */
static int send_data(void *sock, void *data, Py_ssize_t size, PyObject *owner, Py_buffer *view, int flags) {
    if (size < zero_copy_min) {
        int rc = send_copy(sock, data, (size_t)size, flags);
        if (view != NULL) PyBuffer_Release(view);
        return rc;
    }
    ticket *t = PyMem_RawMalloc(sizeof(ticket));
    zmq_msg_t msg;
    if (t == NULL || Z.msg_init_data(&msg, data, (size_t)size, ticket_done, t) != 0) {
        if (t == NULL) {
            PyErr_NoMemory();
        } else {
            zmq_error(Z.errno_());
        }
        PyMem_RawFree(t);
        if (view != NULL) PyBuffer_Release(view);
        return -1;
    }
    /* the ticket keeps the memory alive until libzmq's free function marks it done */
    Py_XINCREF(owner);
    t->owner = owner;
    if (view != NULL) t->view = *view;
    t->done = 0;
    t->next = pending;
    pending = t;
    pending_count++;
    if (send_msg(&msg, sock, flags) < 0) {
        Z.msg_close(&msg); /* not sent: libzmq releases it now, through ticket_done */
        return -1;
    }
    return 0;
}

/* send(socket, parts): one multipart message.
 * A part is a bytes-like object, or (owner, address, nbytes) for memory that
 * owner keeps alive (a tensor and its data_ptr()). Parts of at least
 * zero_copy_min bytes go zero-copy; their owner is referenced until libzmq is
 * done with them, so the caller must not write to that memory meanwhile. */
static PyObject *wire_send(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    void *sock;
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "send(socket, parts) takes 2 arguments");
    if (socket_arg(args[0], &sock) < 0) return NULL;
    PyObject *parts = PySequence_Fast(args[1], "parts must be a sequence");
    if (parts == NULL) return NULL;
    if (pending != NULL) sweep();
    Py_ssize_t n = PySequence_Fast_GET_SIZE(parts);
    PyObject **items = PySequence_Fast_ITEMS(parts);
    for (Py_ssize_t i = 0; i < n; i++) {
        int flags = i + 1 < n ? ZMQ_SNDMORE : 0;
        PyObject *part = items[i];
        PyObject *owner = NULL;
        void *data;
        Py_ssize_t size;
        Py_buffer view;
        if (PyTuple_CheckExact(part) && PyTuple_GET_SIZE(part) == 3) {
            owner = PyTuple_GET_ITEM(part, 0);
            data = PyLong_AsVoidPtr(PyTuple_GET_ITEM(part, 1));
            size = PyLong_AsSsize_t(PyTuple_GET_ITEM(part, 2));
            if (PyErr_Occurred()) goto fail;
            if (size < 0 || (data == NULL && size > 0)) {
                PyErr_Format(PyExc_ValueError, "part %zd: (owner, address, nbytes) with address %p and nbytes %zd",
                             i, data, size);
                goto fail;
            }
        } else {
            if (PyObject_GetBuffer(part, &view, PyBUF_SIMPLE) < 0) goto fail;
            data = view.buf;
            size = view.len;
        }
        if (send_data(sock, data, size, owner, owner == NULL ? &view : NULL, flags) < 0) goto fail;
    }
    Py_DECREF(parts);
    Py_RETURN_NONE;
fail:
    Py_DECREF(parts);
    return NULL;
}

/* Receive one part into a Frame: 1 with a part, 0 when the socket's receive timeout passed, -1 on error. */
static int recv_part(void *sock, Frame *frame) { return transfer(Z.msg_recv, &frame->msg, sock, 0, 1); }

static Frame *new_frame(void) {
    Frame *f = PyObject_New(Frame, &FrameType);
    if (f == NULL) return NULL;
    Z.msg_init(&f->msg);
    return f;
}

/* recv(socket, nbytes_parts, into=None): the next whole multipart message as a list, or
 * None when the socket's receive timeout passed first (the caller checks liveness and
 * calls again). The first nbytes_parts parts come back as bytes (identities, headers).
 * Data part j comes back as the int size it had after being copied to into[j], when into
 * gives j an (address, capacity) the part fits; else as a Frame, a zero-copy buffer over
 * the received memory. The caller picks the capacities: what is cheaper to copy than to adopt. */
static PyObject *wire_recv(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    void *sock;
    if (nargs != 2 && nargs != 3)
        return PyErr_Format(PyExc_TypeError, "recv(socket, nbytes_parts, into=None) takes 2 or 3 arguments");
    if (socket_arg(args[0], &sock) < 0) return NULL;
    Py_ssize_t nbytes_parts = PyLong_AsSsize_t(args[1]);
    if (nbytes_parts == -1 && PyErr_Occurred()) return NULL;
    PyObject *into = nargs == 3 && args[2] != Py_None ? args[2] : NULL;
    if (into != NULL && !PyTuple_CheckExact(into)) return PyErr_Format(PyExc_TypeError, "into must be a tuple");
    if (pending != NULL) sweep();
    Frame *f = new_frame();
    if (f == NULL) return NULL;
    int got = recv_part(sock, f);
    if (got <= 0) {
        Py_DECREF(f);
        if (got < 0) return NULL;
        Py_RETURN_NONE;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        Py_DECREF(f);
        return NULL;
    }
    for (Py_ssize_t i = 0;; i++) {
        int more = Z.msg_more(&f->msg);
        Py_ssize_t size = (Py_ssize_t)Z.msg_size(&f->msg), j = i - nbytes_parts;
        PyObject *item;
        if (i < nbytes_parts) {
            item = PyBytes_FromStringAndSize(Z.msg_data(&f->msg), size);
            Py_DECREF(f);
        } else if (into != NULL && j < PyTuple_GET_SIZE(into)) {
            PyObject *dest = PyTuple_GET_ITEM(into, j);
            void *addr = NULL;
            Py_ssize_t capacity = -1;
            if (PyTuple_CheckExact(dest) && PyTuple_GET_SIZE(dest) == 2) {
                addr = PyLong_AsVoidPtr(PyTuple_GET_ITEM(dest, 0));
                capacity = PyLong_AsSsize_t(PyTuple_GET_ITEM(dest, 1));
            }
            if (PyErr_Occurred() || (dest != Py_None && (addr == NULL || capacity < 0))) {
                if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "into[%zd] is not (address, capacity)", j);
                Py_DECREF(f);
                Py_DECREF(out);
                return NULL;
            }
            if (addr != NULL && size <= capacity) {
                memcpy(addr, Z.msg_data(&f->msg), (size_t)size);
                item = PyLong_FromSsize_t(size);
                Py_DECREF(f);
            } else {
                item = (PyObject *)f;
            }
        } else {
            item = (PyObject *)f;
        }
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
        if (!more) return out;
        f = new_frame(); /* later parts of a multipart message are already here */
        if (f == NULL || recv_part(sock, f) <= 0) {
            Py_XDECREF(f);
            Py_DECREF(out);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_OSError, "multipart message ended early");
            return NULL;
        }
    }
}

/* ---- the C API (_zmqwire_api.h) ---- */

static int api_send_part(void *sock, const void *data, Py_ssize_t size, PyObject *owner, int flags) {
    if (owner == NULL && size >= zero_copy_min) {
        PyErr_Format(PyExc_ValueError, "a zero-copy part of %zd bytes needs an owner", size);
        return -1;
    }
    if (pending != NULL) sweep();
    return send_data(sock, (void *)data, size, owner, NULL, flags);
}

static int api_recv_part(void *sock, zmq_msg_t *msg, int timeout_ok) {
    if (pending != NULL) sweep();
    return transfer(Z.msg_recv, msg, sock, 0, timeout_ok);
}

static void api_msg_init(zmq_msg_t *msg) { Z.msg_init(msg); }
static void api_msg_close(zmq_msg_t *msg) { Z.msg_close(msg); }
static void *api_msg_data(zmq_msg_t *msg) { return Z.msg_data(msg); }
static size_t api_msg_size(const zmq_msg_t *msg) { return Z.msg_size(msg); }
static int api_msg_more(const zmq_msg_t *msg) { return Z.msg_more(msg); }

static PyObject *api_frame(zmq_msg_t *msg) {
    Frame *f = new_frame();
    if (f == NULL) return NULL;
    Z.msg_move(&f->msg, msg);
    return (PyObject *)f;
}

static zmqwire_api api = {api_send_part, api_recv_part, api_msg_init, api_msg_close, api_msg_data,
                          api_msg_size,  api_msg_more,  api_frame};

static PyObject *wire_pending(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    sweep();
    return PyLong_FromSsize_t(pending_count);
}

static PyMethodDef methods[] = {
    {"load", (PyCFunction)(void (*)(void))wire_load, METH_FASTCALL,
     "load(path, error_type, zero_copy_min): resolve libzmq's functions from the copy loaded at path."},
    {"send", (PyCFunction)(void (*)(void))wire_send, METH_FASTCALL,
     "send(socket_address, parts): send one multipart message."},
    {"recv", (PyCFunction)(void (*)(void))wire_recv, METH_FASTCALL,
     "recv(socket_address, nbytes_parts, into=None): the next multipart message, or None on the receive "
     "timeout."},
    {"pending", wire_pending, METH_NOARGS,
     "pending(): zero-copy parts libzmq still holds (their owners stay referenced)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_zmqwire", NULL, -1, methods};

PyMODINIT_FUNC PyInit__zmqwire(void) {
    if (PyType_Ready(&FrameType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&FrameType);
    if (PyModule_AddObject(m, "Frame", (PyObject *)&FrameType) < 0) {
        Py_DECREF(&FrameType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
