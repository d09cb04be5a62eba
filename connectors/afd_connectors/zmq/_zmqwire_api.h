/*
 * afd_connectors.zmq._zmqwire's C API, for afd_connectors.zmq._zmqsteady (C++).
 *
 * _zmqwire exports one `zmqwire_api` table as the capsule `_zmqwire._C_API`
 * once load() resolved libzmq, so the steady-state module moves messages on
 * the same libzmq instance, with the same zero-copy tickets and the same
 * errors, without linking libzmq itself. Every function is called with the
 * GIL held; a blocking one releases it while it blocks.
 */
#ifndef AFD_ZMQWIRE_API_H
#define AFD_ZMQWIRE_API_H

#include <Python.h>

#ifdef __cplusplus
extern "C" {
#endif

/* libzmq's zmq_msg_t: 64 bytes, 8-byte aligned (zmq.h) */
typedef struct {
#ifdef __cplusplus
    alignas(8) unsigned char _[64];
#else
    _Alignas(8) unsigned char _[64];
#endif
} zmqwire_msg;

typedef struct {
    /* Send one part: copied below zero_copy_min bytes, else zero-copy with `owner` (may be NULL only for a
     * copied part) referenced until libzmq lets go. flags: ZMQWIRE_SNDMORE or 0. 0, or -1 with the error set
     * (zmq.ZMQError, as the module's send raises). */
    int (*send_part)(void *sock, const void *data, Py_ssize_t size, PyObject *owner, int flags);
    /* Receive the next part into `msg` (initialised): 1, 0 when the socket's receive timeout passed and
     * timeout_ok, else -1 with the error set. */
    int (*recv_part)(void *sock, zmqwire_msg *msg, int timeout_ok);
    void (*msg_init)(zmqwire_msg *msg);
    void (*msg_close)(zmqwire_msg *msg); /* safe without the GIL, from any thread */
    void *(*msg_data)(zmqwire_msg *msg);
    size_t (*msg_size)(const zmqwire_msg *msg);
    int (*msg_more)(const zmqwire_msg *msg);
    /* A new Frame (the module's zero-copy buffer type) that takes over `msg`, which is left empty. */
    PyObject *(*frame)(zmqwire_msg *msg);
} zmqwire_api;

#define ZMQWIRE_SNDMORE 2
#define ZMQWIRE_CAPSULE "afd_connectors.zmq._zmqwire._C_API"

#ifdef __cplusplus
}
#endif

#endif
