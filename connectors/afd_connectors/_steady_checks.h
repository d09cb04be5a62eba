/*
 * The per-call checks the connectors' C++ steady states share (afd_connectors.zmq._zmqsteady, _shmsteady): they read
 * a contract call's arguments as the Python path does, without raising. Each answers "the Python path would accept
 * this" or "let the Python path decide"; the Python path then raises what it always raised.
 */
#ifndef AFD_STEADY_CHECKS_H
#define AFD_STEADY_CHECKS_H

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

// hidden, as pybind11 hides its own types: a struct with py::str fields must not be more visible than they are
namespace __attribute__((visibility("hidden"))) afd_steady {

namespace py = pybind11;

/* The hash of a cache key of four integers (the steady states' Key and PlanKey). */
inline size_t hash4(int64_t a, int64_t b, int64_t c, int64_t d) {
  size_t h = static_cast<size_t>(a) * 1000003u;
  h ^= static_cast<size_t>(b) * 10007u + static_cast<size_t>(c) * 131u + static_cast<size_t>(d);
  return h;
}

/* Attribute names, made once (a const char* would make a str per read). */
struct MetadataNames {
  py::str stage_idx{"stage_idx"};
  py::str layer_idx{"layer_idx"};
  py::str seq_lens{"seq_lens"};
};

/* `obj` as a CPU [n, hidden] contiguous tensor (null otherwise). */
inline const at::Tensor* rows(py::handle obj, int64_t hidden) {
  if (!THPVariable_Check(obj.ptr())) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj.ptr());
  if (!t.device().is_cpu() || t.dim() != 2 || t.size(1) != hidden || !t.is_contiguous()) return nullptr;
  return &t;
}

/* metadata.<name> as an int, or -1 */
inline int64_t int_attr(py::handle metadata, const py::str& name) {
  PyObject* v = PyObject_GetAttr(metadata.ptr(), name.ptr());
  if (v == nullptr) {
    PyErr_Clear();
    return -1;
  }
  const int64_t out = PyLong_Check(v) ? PyLong_AsLongLong(v) : -1;
  Py_DECREF(v);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return -1;
  }
  return out;
}

/* metadata.seq_lens == (n,) with n > 0 */
inline bool one_count(py::handle metadata, const py::str& seq_lens, int64_t n) {
  PyObject* seq = PyObject_GetAttr(metadata.ptr(), seq_lens.ptr());
  if (seq == nullptr) {
    PyErr_Clear();
    return false;
  }
  bool ok = n > 0 && PyTuple_Check(seq) && PyTuple_GET_SIZE(seq) == 1 && PyLong_Check(PyTuple_GET_ITEM(seq, 0)) &&
            PyLong_AsLongLong(PyTuple_GET_ITEM(seq, 0)) == n;
  Py_DECREF(seq);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    ok = false;
  }
  return ok;
}

/* The (layer, tokens) a connector's send record holds for `key` (its stage), false without one. */
inline bool sent_record(const py::dict& sent, PyObject* key, int64_t& layer, int64_t& n) {
  PyObject* record = PyDict_GetItemWithError(sent.ptr(), key);  // borrowed
  if (record == nullptr || !PyTuple_Check(record) || PyTuple_GET_SIZE(record) != 2) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return false;
  }
  layer = PyLong_AsLongLong(PyTuple_GET_ITEM(record, 0));
  n = PyLong_AsLongLong(PyTuple_GET_ITEM(record, 1));
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

}  // namespace afd_steady

#endif  // AFD_STEADY_CHECKS_H
