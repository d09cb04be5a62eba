/*
 * afd_connectors.shm._shmsteady: ShmAFDConnector's steady state in C++, one call per contract call.
 *
 * Why: the shared-memory ring moves a 512 KiB round trip in ~17 us, so the contract's Python (role and stage
 * checks, the shape and seq_lens checks, the ring's cursor, the receive plan's lookup, and each native call's
 * argument parsing: ~2 us per call, four calls per round trip) was a third of the connector's time again. Here
 * the same checks read the tensor's fields and the slot's meta line directly.
 *
 * What stays in Python: every error, every first receive of a (slot, layer, tokens, dtype) (Python builds the
 * returned tensors or payload and hands them to this module with the copies that fill them), the waits that
 * outlast one futex slice (Python checks the peer's liveness and the deadline between slices), fan-in of
 * several attention peers, and extras on the attention side. A method returns None/False when it cannot serve
 * the call, having changed nothing the Python path does not do first itself (freeing the slot the previous
 * in-place receive held); the connector's Python path then serves it, or raises what it always raised.
 *
 * The ring's cursor stays the connector's: this module reads and writes the `next_seq` and `held` attributes of
 * its `_Ring` objects, so both paths see one cursor. Built by setup.py only where torch is importable at build
 * time, as _zmqsteady is.
 */
#include <unordered_map>
#include <utility>
#include <vector>

#include "_shmring_core.h"
#include "../_steady_checks.h"

namespace py = pybind11;

namespace {

/* one memcpy a receive runs: into a landing buffer, out of the slot */
struct Copy {
  char* dst;
  const char* src;
  size_t nbytes;
};

/* what a receive of one (slot offset, layer, tokens, dtype code) returns, and the copies that fill it */
struct Plan {
  py::object result;
  std::vector<Copy> copies;
};

struct PlanKey {
  int64_t at, layer, n;
  int code;
  bool operator==(const PlanKey& o) const { return at == o.at && layer == o.layer && n == o.n && code == o.code; }
};
struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const { return afd_steady::hash4(k.at, k.layer, k.n, k.code); }
};

/* one direction of one segment: the connector's _Ring (which owns the cursor) and its fixed addresses */
struct Ring {
  py::object obj;
  char* base = nullptr;
  uint64_t* published = nullptr;
  uint64_t* released = nullptr;
  uint64_t* reader_asleep = nullptr;
  uint64_t* writer_asleep = nullptr;
  int64_t slots_at = 0, slots = 0, slot_size = 0, tensors = 0;
  std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;
};

/* a published slot as the receive found it: its seq, offset and meta line */
struct Arrived {
  int64_t seq, at, layer, stage, n;
  int code;
};

/* shmring_py_publish, raising */
void publish(uint64_t* counter, uint64_t value, uint64_t* sleep_flag) {
  if (shmring_py_publish(counter, value, sleep_flag) < 0) throw py::error_already_set();
}

class ShmSteady {
 public:
  /* `rings`: per stage, the (a2f, f2a) _Ring pair of the one channel; `codes`: the dtypes in wire-code order. */
  ShmSteady(bool attention, py::list rings, int64_t hidden, py::dict sent, std::vector<at::ScalarType> codes,
            int64_t max_nbytes, uintptr_t spin, int64_t block_ns, bool in_place, size_t limit)
      : attention_(attention),
        hidden_(hidden),
        sent_(std::move(sent)),
        max_nbytes_(max_nbytes),
        spin_(reinterpret_cast<shmring_spin*>(spin)),
        block_ns_(block_ns),
        in_place_(in_place),
        limit_(limit),
        num_codes_(static_cast<int>(codes.size())) {
    for (size_t c = 0; c < codes.size(); ++c) {
      const size_t st = static_cast<size_t>(codes[c]);
      if (code_of_.size() <= st) code_of_.resize(st + 1, -1);
      code_of_[st] = static_cast<int>(c);
    }
    for (py::handle pair : rings) {
      auto both = py::reinterpret_borrow<py::tuple>(pair);
      a2f_.push_back(ring(both[0]));
      f2a_.push_back(ring(both[1]));
      stage_keys_.push_back(py::int_(stage_keys_.size()));
    }
  }

  // --- attention side ------------------------------------------------------------

  /* send_attn_output's steady state without extras: True when it wrote and published the slot and recorded the
   * send; False (nothing done) unless the checks of the Python path pass (a CPU [n, hidden] contiguous tensor of
   * a wire dtype, seq_lens == (n,), a stage in range without a send pending, n within the slot) and the slot is
   * free within one wait slice. */
  bool attn_send(py::handle obj, py::handle metadata) {
    if (!attention_) return false;
    int64_t stage, layer;
    int code;
    const at::Tensor* t = checked_send(obj, metadata, stage, layer, code);
    if (t == nullptr) return false;
    Ring& r = a2f_[stage];
    PyObject* key = stage_keys_[stage].ptr();
    const int pending = PyDict_Contains(sent_.ptr(), key);
    if (pending != 0 || r.tensors != 1) {  // extras declared: Python reports the missing ones
      if (pending < 0) throw py::error_already_set();
      return false;
    }
    const int64_t n = t->size(0);
    if (!write(r, *t, layer, stage, n, code)) return false;
    py::tuple record = py::make_tuple(layer, n);
    if (PyDict_SetItem(sent_.ptr(), key, record.ptr()) != 0) throw py::error_already_set();
    return true;
  }

  /* Python built the result of a receive of slot `at` on stage's f2a ring: the tensor returned and the copies
   * (dst, src, nbytes) that fill it (none in place). */
  void remember_f2a(int64_t stage, int64_t at, int64_t n, int code, py::object out,
                    const std::vector<std::tuple<uintptr_t, uintptr_t, int64_t>>& copies) {
    remember(ring_at(f2a_, stage), PlanKey{at, -1, n, code}, std::move(out), copies);
  }

  /* recv_ffn_output's steady state: the output tensor, with the send record taken; None when the Python path
   * must serve it (no send pending, the slot not published within one wait slice, a meta line that is not the
   * expected one, or a (slot, tokens, dtype) Python has not planned). */
  py::object attn_recv(py::handle /*ref_tensor: the protocol's argument; the slot says shape and dtype*/,
                       int64_t stage) {
    if (!attention_ || stage < 0 || static_cast<size_t>(stage) >= f2a_.size()) return py::none();
    PyObject* key = stage_keys_[stage].ptr();
    int64_t layer, n;
    if (!afd_steady::sent_record(sent_, key, layer, n)) return py::none();
    Ring& r = f2a_[stage];
    Arrived a{};
    if (!arrive(r, a) || a.layer != layer || a.n != n) return py::none();
    const Plan* plan = find(r, PlanKey{a.at, -1, n, a.code});
    if (plan == nullptr) return py::none();
    if (PyDict_DelItem(sent_.ptr(), key) != 0) throw py::error_already_set();
    return finish(r, *plan, a.seq);
  }

  // --- ffn side (one attention peer) ---------------------------------------------------

  /* Python built the payload of a receive of slot `at` on stage's a2f ring, and the copies that fill it. */
  void remember_a2f(int64_t stage, int64_t at, int64_t layer, int64_t n, int code, py::object payload,
                    const std::vector<std::tuple<uintptr_t, uintptr_t, int64_t>>& copies) {
    remember(ring_at(a2f_, stage), PlanKey{at, layer, n, code}, std::move(payload), copies);
  }

  /* recv_attn_output's steady state: the payload; None when the Python path must serve it (the slot not published
   * within one wait slice, a meta line that is not the expected one, or a key Python has not planned). */
  py::object ffn_recv(int64_t stage) {
    if (attention_ || stage < 0 || static_cast<size_t>(stage) >= a2f_.size()) return py::none();
    Ring& r = a2f_[stage];
    Arrived a{};
    if (!arrive(r, a) || a.stage != stage) return py::none();
    const Plan* plan = find(r, PlanKey{a.at, a.layer, a.n, a.code});
    if (plan == nullptr) return py::none();
    return finish(r, *plan, a.seq);
  }

  /* send_ffn_output's steady state: True when written and published; False (nothing done) unless a CPU [n, hidden]
   * contiguous output of a wire dtype with seq_lens == (n,) on a stage in range, n within the slot, and a free
   * slot within one wait slice. */
  bool ffn_send(py::handle obj, py::handle metadata) {
    if (attention_) return false;
    int64_t stage, layer;
    int code;
    const at::Tensor* t = checked_send(obj, metadata, stage, layer, code);
    return t != nullptr && write(f2a_[stage], *t, layer, stage, t->size(0), code);
  }

  /* Forget every plan (close). */
  void clear() {
    for (auto* rings : {&a2f_, &f2a_}) {
      for (Ring& r : *rings) r.plans.clear();
    }
  }

 private:
  Ring ring(py::handle obj) {
    Ring r;
    r.obj = py::reinterpret_borrow<py::object>(obj);
    r.base = reinterpret_cast<char*>(obj.attr("base").cast<uintptr_t>());
    r.published = reinterpret_cast<uint64_t*>(obj.attr("published").cast<uintptr_t>());
    r.released = reinterpret_cast<uint64_t*>(obj.attr("released").cast<uintptr_t>());
    r.reader_asleep = reinterpret_cast<uint64_t*>(obj.attr("reader_asleep").cast<uintptr_t>());
    r.writer_asleep = reinterpret_cast<uint64_t*>(obj.attr("writer_asleep").cast<uintptr_t>());
    r.slots_at = obj.attr("slots_at").cast<int64_t>();
    r.slots = obj.attr("slots").cast<int64_t>();
    r.slot_size = obj.attr("slot_size").cast<int64_t>();
    r.tensors = obj.attr("tensors").cast<int64_t>();
    return r;
  }

  static Ring& ring_at(std::vector<Ring>& rings, int64_t stage) {
    if (stage < 0 || static_cast<size_t>(stage) >= rings.size()) {
      throw std::out_of_range("stage " + std::to_string(stage) + " out of range; num_stages=" +
                              std::to_string(rings.size()));
    }
    return rings[stage];
  }

  void remember(Ring& r, const PlanKey& key, py::object result,
                const std::vector<std::tuple<uintptr_t, uintptr_t, int64_t>>& copies) {
    Plan plan{std::move(result), {}};
    for (const auto& [dst, src, nbytes] : copies) {
      if (nbytes < 0) throw std::invalid_argument("remember: a copy of a negative size");
      plan.copies.push_back(Copy{reinterpret_cast<char*>(dst), reinterpret_cast<const char*>(src),
                                 static_cast<size_t>(nbytes)});
    }
    if (r.plans.size() >= limit_) r.plans.clear();
    r.plans[key] = std::move(plan);
  }

  static const Plan* find(const Ring& r, const PlanKey& key) {
    auto it = r.plans.find(key);
    return it == r.plans.end() ? nullptr : &it->second;
  }

  /* The checks of a send on either side; the tensor, with stage, layer and dtype code set, or null. */
  const at::Tensor* checked_send(py::handle obj, py::handle metadata, int64_t& stage, int64_t& layer,
                                 int& code) const {
    const at::Tensor* t = afd_steady::rows(obj, hidden_);
    if (t == nullptr || static_cast<int64_t>(t->nbytes()) > max_nbytes_) return nullptr;
    const size_t st = static_cast<size_t>(t->scalar_type());
    code = st < code_of_.size() ? code_of_[st] : -1;
    stage = afd_steady::int_attr(metadata, names_.stage_idx);
    if (code < 0 || stage < 0 || static_cast<size_t>(stage) >= a2f_.size() ||
        !afd_steady::one_count(metadata, names_.seq_lens, t->size(0))) {
      return nullptr;
    }
    layer = afd_steady::int_attr(metadata, names_.layer_idx);
    return layer < 0 || layer > INT32_MAX ? nullptr : t;
  }

  int64_t get(const Ring& r, const py::str& name) const {
    PyObject* v = PyObject_GetAttr(r.obj.ptr(), name.ptr());
    if (v == nullptr) throw py::error_already_set();
    const int64_t out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (out == -1 && PyErr_Occurred()) throw py::error_already_set();
    return out;
  }

  void set(const Ring& r, const py::str& name, int64_t value) const {
    PyObject* v = PyLong_FromLongLong(value);
    if (v == nullptr || PyObject_SetAttr(r.obj.ptr(), name.ptr(), v) != 0) {
      Py_XDECREF(v);
      throw py::error_already_set();
    }
    Py_DECREF(v);
  }

  /* Wait up to one slice for *counter >= want. */
  bool wait(uint64_t* counter, uint64_t want, uint64_t* sleep_flag) const {
    return shmring_py_wait_ge(counter, want, sleep_flag, spin_, block_ns_) != 0;
  }

  /* Copy `t` into the ring's next slot, fill its meta line and publish it; false (nothing written) when the slot
   * is still being read after one wait slice (the Python path waits on, checking the peer). */
  bool write(Ring& r, const at::Tensor& t, int64_t layer, int64_t stage, int64_t n, int code) {
    const int64_t seq = get(r, names_.next_seq);
    const int64_t free_at = seq - r.slots;  // <= 0 while the ring has never wrapped
    if (free_at > 0 && !wait(r.released, static_cast<uint64_t>(free_at), r.writer_asleep)) return false;
    char* slot = r.base + r.slots_at + ((seq - 1) % r.slots) * r.slot_size;
    shmring_py_copy(slot + sizeof(shmring_slot_meta), t.data_ptr(), t.nbytes());
    shmring_fill_meta(slot, static_cast<uint64_t>(seq), static_cast<int32_t>(layer), static_cast<int32_t>(stage),
                      static_cast<uint32_t>(n), 1, static_cast<uint8_t>(code));
    publish(r.published, static_cast<uint64_t>(seq), r.reader_asleep);
    set(r, names_.next_seq, seq + 1);
    return true;
  }

  /* Free slot `seq`, the one read last: as the connector's _release. */
  void release(Ring& r, int64_t seq) {
    set(r, names_.next_seq, seq + 1);
    set(r, names_.held, 0);
    publish(r.released, static_cast<uint64_t>(seq), r.writer_asleep);
  }

  /* The ring's next slot once published within one wait slice, with a meta line of the expected seq, a wire dtype
   * and the ring's tensor count; false otherwise (the Python path waits on, or reports the meta line). Frees the
   * slot the previous in-place receive held first, as the connector's _await does. */
  bool arrive(Ring& r, Arrived& a) {
    int64_t seq = get(r, names_.next_seq);
    if (get(r, names_.held) != 0) release(r, seq++);
    const int64_t at = r.slots_at + ((seq - 1) % r.slots) * r.slot_size;
    if (!wait(r.published, static_cast<uint64_t>(seq), r.reader_asleep)) return false;
    const auto* m = reinterpret_cast<const shmring_slot_meta*>(r.base + at);
    if (m->seq != static_cast<uint64_t>(seq) || m->codes[0] >= num_codes_ || m->count != r.tensors) return false;
    a = Arrived{seq, at, m->layer, m->stage, static_cast<int64_t>(m->tokens), m->codes[0]};
    return true;
  }

  /* After receiving slot `seq` whose plan is found: its copies, then the slot kept for the views (in place) or
   * freed. */
  py::object finish(Ring& r, const Plan& plan, int64_t seq) {
    for (const Copy& c : plan.copies) shmring_py_copy(c.dst, c.src, c.nbytes);
    if (in_place_) {
      set(r, names_.held, seq);
    } else {
      release(r, seq);
    }
    return plan.result;
  }

  struct Names : afd_steady::MetadataNames {
    py::str next_seq{"next_seq"};
    py::str held{"held"};
  };

  bool attention_;
  int64_t hidden_;
  py::dict sent_;
  int64_t max_nbytes_;
  shmring_spin* spin_;  // the connector's adaptive spin (it owns the memory and outlives this object)
  int64_t block_ns_;
  bool in_place_;
  size_t limit_;
  int num_codes_;
  std::vector<int> code_of_;  // ScalarType -> wire code, -1: not carried
  std::vector<Ring> a2f_, f2a_;
  std::vector<py::object> stage_keys_;
  Names names_;
};

}  // namespace

PYBIND11_MODULE(_shmsteady, m) {
  m.doc() = "ShmAFDConnector's steady state in C++ (see the source's header).";
  py::class_<ShmSteady>(m, "ShmSteady")
      .def(py::init<bool, py::list, int64_t, py::dict, std::vector<at::ScalarType>, int64_t, uintptr_t, int64_t, bool,
                    size_t>(),
           py::arg("attention"), py::arg("rings"), py::arg("hidden"), py::arg("sent"), py::arg("codes"),
           py::arg("max_nbytes"), py::arg("spin"), py::arg("block_ns"), py::arg("in_place"), py::arg("limit"))
      .def("attn_send", &ShmSteady::attn_send)
      .def("remember_f2a", &ShmSteady::remember_f2a)
      .def("attn_recv", &ShmSteady::attn_recv)
      .def("remember_a2f", &ShmSteady::remember_a2f)
      .def("ffn_recv", &ShmSteady::ffn_recv)
      .def("ffn_send", &ShmSteady::ffn_send)
      .def("clear", &ShmSteady::clear);
}
