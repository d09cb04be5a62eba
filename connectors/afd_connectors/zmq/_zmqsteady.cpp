/*
 * afd_connectors.zmq._zmqsteady: ZmqAFDConnector's steady state in C++, one call per contract call.
 *
 * Why: `afd bench connector --connector zmq` measured the connector +15 to +35 us per 8 KiB round trip over the
 * `wire` baseline (the same C wire and tensors without the contract), and a run that used the connector's own
 * sockets without its Python read within +7 us of it. The contract's Python costs ~4 us per round trip hot;
 * run between blocking waits on 2 vCPUs, with libzmq's I/O threads evicting its caches, it costs many times
 * that. Here the same checks read the tensor's fields directly and a message moves without a Python object
 * per part, as afd_connectors.p2p._p2pwire does for P2pNcclAFDConnector.
 *
 * What stays in Python: every error, every first message of a new (layer, stage, tokens, dtype) (Python
 * validates it and hands this module the header bytes, the receive area and the payload to return), fan-in
 * of several attention peers, and extras on the attention side. A method returns None/False, having changed
 * nothing, when it cannot serve the call; the connector's Python path then does, and raises what it always
 * raised. Once a received message's first part is consumed, a message that is not exactly what was expected
 * comes back as the list afd_connectors.zmq._zmqwire.recv() returns, and the Python path checks it.
 *
 * Messages move through afd_connectors.zmq._zmqwire's C API (its `_C_API` capsule): the libzmq pyzmq loaded, the
 * same zero-copy tickets, the same errors. Built by setup.py only where torch is importable at build time, as
 * _p2pwire is.
 */
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../_steady_checks.h"
#include "_zmqwire_api.h"

namespace py = pybind11;

namespace {

/* (layer, stage, tokens, dtype): what decides a message's header and size */
struct Key {
  int64_t layer, stage, n;
  int dtype;
  bool operator==(const Key& o) const {
    return layer == o.layer && stage == o.stage && n == o.n && dtype == o.dtype;
  }
};
struct KeyHash {
  size_t operator()(const Key& k) const { return afd_steady::hash4(k.layer, k.stage, k.n, k.dtype); }
};

/* attention side: what the FFN output for a key must be, and where it lands */
struct Expect {
  std::string header;
  at::Tensor out;  // the receive area's view, for a frame copied there; undefined: the frame is adopted
  int64_t nbytes;  // the frame's size
};

/* ffn side: an a2f message accepted once on a stage, by its header bytes */
struct Known {
  std::vector<int64_t> sizes;   // each tensor frame's size
  std::vector<at::Tensor> views;  // each tensor's receive-area view (undefined: its frame is adopted zero-copy)
  std::vector<std::vector<int64_t>> shapes;
  std::vector<at::ScalarType> dtypes;
  py::object metadata;  // the payload's TransferMetadata
  py::tuple names;      // the extras' names, in order (the tensors after the hidden states)
  py::object landed;    // the payload over the receive areas when every view is defined, else None
};

/* ffn side, per stage: where each tensor frame may be copied (address, capacity), and its accepted headers */
struct FfnStage {
  bool ready = false;
  std::vector<std::pair<char*, int64_t>> into;
  std::unordered_map<std::string, Known> known;
};

struct Msg {
  zmqwire_msg m;
};

const zmqwire_api* api = nullptr;

/* A received part on the heap, closed and freed unless released (into a tensor's deleter or a Frame). */
struct MsgFree {
  void operator()(Msg* m) const {
    api->msg_close(&m->m);
    delete m;
  }
};
using MsgPtr = std::unique_ptr<Msg, MsgFree>;

MsgPtr new_msg() {
  MsgPtr m(new Msg);
  api->msg_init(&m->m);
  return m;
}

/* A tensor of `shape` and `dtype` over a received part, which it owns (closed when the tensor's storage goes). */
at::Tensor adopt(MsgPtr m, const std::vector<int64_t>& shape, at::ScalarType dtype) {
  Msg* raw = m.get();
  at::Tensor t = at::from_blob(api->msg_data(&raw->m), shape, [raw](void*) { MsgFree()(raw); },
                               at::TensorOptions().dtype(dtype));
  m.release();
  return t;
}

class ZmqSteady {
 public:
  ZmqSteady(std::vector<uintptr_t> sockets, int64_t hidden, py::dict sent, py::bytes ident, size_t limit,
            py::object payload_type)
      : hidden_(hidden), sent_(std::move(sent)), ident_(ident), limit_(limit), payload_type_(std::move(payload_type)) {
    for (uintptr_t s : sockets) {
      socks_.push_back(reinterpret_cast<void*>(s));
      stage_keys_.push_back(py::int_(socks_.size() - 1));
    }
    ffn_.resize(socks_.size());
  }

  // --- attention side ------------------------------------------------------------

  /* Python validated a send of key (layer, stage, n, dtype): its header. */
  void remember_send(int64_t layer, int64_t stage, int64_t n, at::ScalarType dtype, py::bytes header) {
    remember(send_headers_, Key{layer, stage, n, static_cast<int>(dtype)}, std::string(header));
  }

  /* send_attn_output's steady state without extras: True when it recorded the send and sent, False (nothing
   * done) unless the checks of the Python path pass: a CPU [n, hidden] contiguous tensor, seq_lens == (n,),
   * a stage in range without a send pending, and a key Python validated before. */
  bool attn_send(py::handle obj, py::handle metadata) {
    Key k{};
    const at::Tensor* t = nullptr;
    const std::string* header = checked_send(obj, metadata, send_headers_, k, t);
    if (header == nullptr) return false;
    const int64_t layer = k.layer, stage = k.stage, n = k.n;
    PyObject* key = stage_keys_[stage].ptr();
    const int pending = PyDict_Contains(sent_.ptr(), key);
    if (pending != 0) {
      if (pending < 0) throw py::error_already_set();
      return false;
    }
    // bookkeeping first, as the Python path does: the send wakes libzmq's I/O thread
    py::tuple record = py::make_tuple(layer, n);
    if (PyDict_SetItem(sent_.ptr(), key, record.ptr()) != 0) throw py::error_already_set();
    void* sock = socks_[stage];
    if (api->send_part(sock, header->data(), static_cast<Py_ssize_t>(header->size()), nullptr, ZMQWIRE_SNDMORE) < 0 ||
        api->send_part(sock, t->data_ptr(), static_cast<Py_ssize_t>(t->nbytes()), obj.ptr(), 0) < 0) {
      PyObject *type, *value, *tb;
      PyErr_Fetch(&type, &value, &tb);
      PyDict_DelItem(sent_.ptr(), key);
      PyErr_Clear();
      PyErr_Restore(type, value, tb);
      throw py::error_already_set();
    }
    return true;
  }

  /* Python computed what the FFN output of key must be: its header, and the receive area's view `out` that a
   * frame of `nbytes` is copied into (None: the frame is adopted zero-copy). */
  void remember_recv(int64_t layer, int64_t stage, int64_t n, at::ScalarType dtype, py::bytes header,
                     py::object out, int64_t nbytes) {
    Expect e{std::string(header), out.is_none() ? at::Tensor() : THPVariable_Unpack(out.ptr()), nbytes};
    remember(expect_, Key{layer, stage, n, static_cast<int>(dtype)}, std::move(e));
  }

  /* recv_ffn_output's steady state. None: nothing done (no send pending on the stage, a key Python has not
   * seen, or the socket's receive slice passed without a message). Else the send record is taken and the
   * result is the output tensor, or (layer, tokens, message) with the message as _zmqwire.recv(sock, 1)
   * returns it when it is not exactly the expected one (the Python path checks it). */
  py::object attn_recv(py::handle ref_obj, int64_t stage) {
    if (stage < 0 || static_cast<size_t>(stage) >= socks_.size() || !THPVariable_Check(ref_obj.ptr())) {
      return py::none();
    }
    PyObject* key = stage_keys_[stage].ptr();
    int64_t layer, n;
    if (!afd_steady::sent_record(sent_, key, layer, n)) return py::none();
    const at::Tensor& ref = THPVariable_Unpack(ref_obj.ptr());
    auto it = expect_.find(Key{layer, stage, n, static_cast<int>(ref.scalar_type())});
    if (it == expect_.end()) return py::none();
    const Expect& e = it->second;
    void* sock = socks_[stage];
    MsgPtr head = first_part(sock);
    if (!head) return py::none();
    if (PyDict_DelItem(sent_.ptr(), key) != 0) throw py::error_already_set();
    const bool more = api->msg_more(&head->m);
    py::list parts;
    append_bytes(parts, head);
    if (!more || !holds(head, e.header)) return py::make_tuple(layer, n, append_frames(parts, sock, nullptr, more));
    MsgPtr data = next_part(sock);
    const int64_t size = static_cast<int64_t>(api->msg_size(&data->m));
    if (!api->msg_more(&data->m) && size == e.nbytes) {
      if (e.out.defined()) {
        std::memcpy(e.out.data_ptr(), api->msg_data(&data->m), static_cast<size_t>(size));
        return py::reinterpret_steal<py::object>(THPVariable_Wrap(e.out));
      }
      return py::reinterpret_steal<py::object>(THPVariable_Wrap(adopt(std::move(data), {n, hidden_}, ref.scalar_type())));
    }
    return py::make_tuple(layer, n, append_frames(parts, sock, std::move(data), true));
  }

  // --- ffn side (one attention peer) ---------------------------------------------------

  /* Python served `stage` once: where the wire may copy each tensor frame (its ``into``), from now on. */
  void ffn_ready(int64_t stage, std::vector<std::pair<uintptr_t, int64_t>> into) {
    FfnStage& st = ffn_at(stage);
    st.into.clear();
    for (const auto& [addr, cap] : into) st.into.emplace_back(reinterpret_cast<char*>(addr), cap);
    st.ready = true;
  }

  /* Python accepted an a2f message with these header bytes on `stage`. Per tensor: its frame's size, the view of
   * its receive area (None: the frame arrives zero-copy), shape and dtype; the payload's metadata and the
   * extras' names; and `landed`, the payload over the receive areas (None unless every view exists). */
  void remember_a2f(int64_t stage, py::bytes header, std::vector<int64_t> sizes,
                    std::vector<std::optional<at::Tensor>> views, std::vector<std::vector<int64_t>> shapes,
                    std::vector<at::ScalarType> dtypes, py::object metadata, py::tuple names, py::object landed) {
    FfnStage& st = ffn_at(stage);
    const size_t count = sizes.size();
    if (views.size() != count || shapes.size() != count || dtypes.size() != count || count == 0 ||
        static_cast<size_t>(PyTuple_GET_SIZE(names.ptr())) != count - 1) {
      throw std::invalid_argument("remember_a2f: one size, view, shape and dtype per tensor; one name per extra");
    }
    Known k{std::move(sizes), {}, std::move(shapes), std::move(dtypes), std::move(metadata), std::move(names),
            std::move(landed)};
    for (auto& v : views) k.views.push_back(v.has_value() ? *v : at::Tensor());
    if (st.known.size() >= limit_) st.known.clear();
    st.known[std::string(header)] = std::move(k);
  }

  /* recv_attn_output's steady state: None (nothing done: the stage was not served yet, or the receive slice
   * passed); the payload when the message is from the peer with a header Python accepted and the frame sizes
   * it announced (the cached one when every frame landed in its area); else the message as
   * _zmqwire.recv(sock, 2, into) returns it, for the Python path to check. */
  py::object ffn_recv(int64_t stage) {
    if (stage < 0 || static_cast<size_t>(stage) >= socks_.size() || !ffn_[stage].ready) return py::none();
    FfnStage& st = ffn_[stage];
    void* sock = socks_[stage];
    MsgPtr ident = first_part(sock);
    if (!ident) return py::none();
    bool more = api->msg_more(&ident->m);
    const bool from_peer = more && holds(ident, ident_);
    py::list parts;
    append_bytes(parts, ident);
    std::string header;
    if (more) {
      MsgPtr head = next_part(sock);
      more = api->msg_more(&head->m);
      header.assign(static_cast<const char*>(api->msg_data(&head->m)), api->msg_size(&head->m));
      append_bytes(parts, head);
    }
    // every tensor frame, as _zmqwire.recv(sock, 2, into) would take it: copied into its area where it fits
    std::vector<MsgPtr> frames;  // null: copied into its area
    std::vector<int64_t> sizes;
    while (more) {
      MsgPtr m = next_part(sock);
      more = api->msg_more(&m->m);
      const size_t j = frames.size();
      const int64_t size = static_cast<int64_t>(api->msg_size(&m->m));
      sizes.push_back(size);
      if (j < st.into.size() && size <= st.into[j].second) {
        std::memcpy(st.into[j].first, api->msg_data(&m->m), static_cast<size_t>(size));
        m.reset();
      }
      frames.push_back(std::move(m));
    }
    if (!from_peer) return as_list(parts, frames, sizes);
    auto it = st.known.find(header);
    if (it != st.known.end() && it->second.sizes == sizes) {
      const Known& k = it->second;
      bool landed = true;
      for (size_t j = 0; j < frames.size(); ++j) {
        if ((frames[j] == nullptr) != k.views[j].defined()) return as_list(parts, frames, sizes);  // cannot be
        landed = landed && frames[j] == nullptr;
      }
      if (landed) return k.landed;
      std::vector<at::Tensor> tensors;
      for (size_t j = 0; j < frames.size(); ++j) {
        tensors.push_back(frames[j] ? adopt(std::move(frames[j]), k.shapes[j], k.dtypes[j]) : k.views[j]);
      }
      py::dict extras;
      for (size_t j = 1; j < tensors.size(); ++j) extras[k.names[j - 1]] = py::cast(tensors[j]);
      return payload_type_(py::cast(tensors[0]), k.metadata, extras);
    }
    return as_list(parts, frames, sizes);  // a header not seen here, or sizes it does not announce
  }

  /* Python validated an output of key for the peer: its header. */
  void remember_f2a(int64_t layer, int64_t stage, int64_t n, at::ScalarType dtype, py::bytes header) {
    remember(f2a_headers_, Key{layer, stage, n, static_cast<int>(dtype)}, std::string(header));
  }

  /* send_ffn_output's steady state: True when sent, False (nothing done) unless a CPU [n, hidden] contiguous
   * output with seq_lens == (n,) on a stage in range, of a key Python validated before. */
  bool ffn_send(py::handle obj, py::handle metadata) {
    Key k{};
    const at::Tensor* t = nullptr;
    const std::string* header = checked_send(obj, metadata, f2a_headers_, k, t);
    if (header == nullptr) return false;
    void* sock = socks_[k.stage];
    if (api->send_part(sock, ident_.data(), static_cast<Py_ssize_t>(ident_.size()), nullptr, ZMQWIRE_SNDMORE) < 0 ||
        api->send_part(sock, header->data(), static_cast<Py_ssize_t>(header->size()), nullptr, ZMQWIRE_SNDMORE) < 0 ||
        api->send_part(sock, t->data_ptr(), static_cast<Py_ssize_t>(t->nbytes()), obj.ptr(), 0) < 0) {
      throw py::error_already_set();
    }
    return true;
  }

  /* Forget every remembered header, area and payload (close; or the model changed). */
  void clear() {
    send_headers_.clear();
    f2a_headers_.clear();
    expect_.clear();
    for (auto& st : ffn_) {
      st.ready = false;
      st.into.clear();
      st.known.clear();
    }
  }

 private:
  FfnStage& ffn_at(int64_t stage) {
    if (stage < 0 || static_cast<size_t>(stage) >= ffn_.size()) {
      throw std::out_of_range("stage " + std::to_string(stage) + " out of range; num_stages=" +
                              std::to_string(ffn_.size()));
    }
    return ffn_[stage];
  }

  using Headers = std::unordered_map<Key, std::string, KeyHash>;

  /* Store `value` under `key`, clearing `map` first at `limit_` entries (token counts change while serving). */
  template <typename Map, typename V>
  void remember(Map& map, const Key& key, V value) {
    if (map.size() >= limit_) map.clear();
    map[key] = std::move(value);
  }

  /* A send's checks, both sides: `obj` a CPU [n, hidden] contiguous tensor, `metadata` with seq_lens == (n,) and a
   * stage in range, and its key in `headers` (Python validated it). The header, with `key` and the tensor `t` set;
   * else null. */
  const std::string* checked_send(py::handle obj, py::handle metadata, const Headers& headers, Key& key,
                                  const at::Tensor*& t) const {
    t = afd_steady::rows(obj, hidden_);
    if (t == nullptr) return nullptr;
    key.n = t->size(0);
    key.stage = afd_steady::int_attr(metadata, names_.stage_idx);
    if (key.stage < 0 || static_cast<size_t>(key.stage) >= socks_.size() ||
        !afd_steady::one_count(metadata, names_.seq_lens, key.n)) {
      return nullptr;
    }
    key.layer = afd_steady::int_attr(metadata, names_.layer_idx);
    key.dtype = static_cast<int>(t->scalar_type());
    auto it = headers.find(key);
    return it == headers.end() ? nullptr : &it->second;
  }

  /* The next message's first part, waiting at most the socket's receive slice; null when it passed. */
  static MsgPtr first_part(void* sock) {
    MsgPtr m = new_msg();
    const int got = api->recv_part(sock, &m->m, 1);
    if (got < 0) throw py::error_already_set();
    return got == 0 ? MsgPtr() : std::move(m);
  }

  /* The next part of a message whose earlier parts arrived (libzmq delivers a message whole). */
  static MsgPtr next_part(void* sock) {
    MsgPtr m = new_msg();
    if (api->recv_part(sock, &m->m, 0) <= 0) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_OSError, "multipart message ended early");
      throw py::error_already_set();
    }
    return m;
  }

  /* Whether part `m` holds exactly the bytes of `want`. */
  static bool holds(const MsgPtr& m, const std::string& want) {
    return api->msg_size(&m->m) == want.size() && std::memcmp(api->msg_data(&m->m), want.data(), want.size()) == 0;
  }

  /* Append the new reference `item` to `parts` (null: the error is set). */
  static void append(py::list& parts, PyObject* item) {
    if (item == nullptr || PyList_Append(parts.ptr(), item) != 0) {
      Py_XDECREF(item);
      throw py::error_already_set();
    }
    Py_DECREF(item);
  }

  static void append_bytes(py::list& parts, const MsgPtr& m) {
    append(parts, PyBytes_FromStringAndSize(static_cast<const char*>(api->msg_data(&m->m)),
                                            static_cast<Py_ssize_t>(api->msg_size(&m->m))));
  }

  /* `parts` (ident, header) then each tensor frame as _zmqwire.recv lists it: its size when copied, else a Frame. */
  static py::list as_list(py::list& parts, std::vector<MsgPtr>& frames, const std::vector<int64_t>& sizes) {
    for (size_t j = 0; j < frames.size(); ++j) {
      append(parts, frames[j] ? api->frame(&frames[j]->m) : PyLong_FromLongLong(sizes[j]));
    }
    return parts;
  }

  /* `parts`, then `data` (a part already received, or null) and, while `more`, every later part of the message,
   * each as a Frame: how _zmqwire.recv lists the parts it neither decodes nor copies. */
  static py::list append_frames(py::list& parts, void* sock, MsgPtr data, bool more) {
    if (data) {
      more = api->msg_more(&data->m);
      append(parts, api->frame(&data->m));  // takes the part over
    }
    while (more) {
      MsgPtr m = next_part(sock);
      more = api->msg_more(&m->m);
      append(parts, api->frame(&m->m));
    }
    return parts;
  }

  afd_steady::MetadataNames names_;

  std::vector<void*> socks_;
  std::vector<py::object> stage_keys_;
  int64_t hidden_;
  py::dict sent_;
  std::string ident_;
  size_t limit_;
  py::object payload_type_;  // A2FPayload
  Headers send_headers_;
  Headers f2a_headers_;
  std::unordered_map<Key, Expect, KeyHash> expect_;
  std::vector<FfnStage> ffn_;
};

}  // namespace

PYBIND11_MODULE(_zmqsteady, m) {
  m.doc() = "ZmqAFDConnector's steady state in C++ (see the source's header).";
  m.def(
      "bind",
      [](py::object capsule) {
        void* p = PyCapsule_GetPointer(capsule.ptr(), ZMQWIRE_CAPSULE);
        if (p == nullptr) throw py::error_already_set();
        api = static_cast<const zmqwire_api*>(p);
      },
      "bind(capsule): use afd_connectors.zmq._zmqwire's C API (its _C_API, present once its load() ran).");
  py::class_<ZmqSteady>(m, "ZmqSteady")
      .def(py::init([](std::vector<uintptr_t> sockets, int64_t hidden, py::dict sent, py::bytes ident,
                       size_t limit, py::object payload_type) {
             if (api == nullptr) throw std::runtime_error("afd_connectors.zmq._zmqsteady.bind() was not called");
             return new ZmqSteady(std::move(sockets), hidden, std::move(sent), std::move(ident), limit,
                                  std::move(payload_type));
           }),
           py::arg("sockets"), py::arg("hidden"), py::arg("sent"), py::arg("ident"), py::arg("limit"),
           py::arg("payload_type"))
      .def("remember_send", &ZmqSteady::remember_send)
      .def("attn_send", &ZmqSteady::attn_send)
      .def("remember_recv", &ZmqSteady::remember_recv)
      .def("attn_recv", &ZmqSteady::attn_recv)
      .def("ffn_ready", &ZmqSteady::ffn_ready)
      .def("remember_a2f", &ZmqSteady::remember_a2f)
      .def("ffn_recv", &ZmqSteady::ffn_recv)
      .def("remember_f2a", &ZmqSteady::remember_f2a)
      .def("ffn_send", &ZmqSteady::ffn_send)
      .def("clear", &ZmqSteady::clear);
}
