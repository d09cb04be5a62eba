/*
 * afd_connectors.p2p._p2pwire: P2pNcclAFDConnector's process-group calls and its
 * attention side's steady state, in C++ against c10d.
 *
 * Why: `afd bench connector --connector p2p` measured the connector's round
 * trip +10 to +34 us over the raw `posted` loop at 8 KiB, and a version whose
 * four calls made only the process-group calls read within the spread of that
 * loop. What costs is the contract's Python per call (checks, bookkeeping and
 * torch attribute reads: 10 us per round trip hot, twice that right after a
 * wait), and on 2 vCPUs every microsecond of it competes with Gloo's own loop
 * thread. Here the same checks read the tensor's fields directly and the
 * process-group calls cost no Python objects.
 *
 * What stays in Python: every error message, the first call of each new token
 * count (which validates everything and hands this module the stage's output
 * buffers), and the FFN side's receive plans. A fast-path method returns
 * False/None whenever any check fails, having changed nothing, and the
 * connector's Python path then raises the error it always raised.
 *
 * Built by setup.py only where torch is importable at build time (pip's
 * --no-build-isolation; scripts/bootstrap.sh installs that way), against that
 * torch's headers: a torch extension must match the torch it runs with.
 * Only c10d::Backend is used, so one source serves Gloo and NCCL.
 */
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using BackendPtr = c10::intrusive_ptr<c10d::Backend>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

/* One micro-batch stage: its process group and what is in flight on it. */
struct Stage {
  BackendPtr pg;
  std::vector<WorkPtr> sends;     // sends not yet waited for
  std::vector<at::Tensor> keep;   // the tensors they read, alive until then
  WorkPtr posted;                 // attention: the receive of the FFN output
  at::Tensor out[2];              // attention: the two output buffers, alternating
  int flip = 0;
  at::Tensor posted_out;          // the buffer `posted` fills
  std::vector<std::pair<at::Tensor, int>> posts;  // ffn: the receive plan, (buffer or row slice, peer)
  py::object step;                // attention: the control payload `announced` was read from
  int64_t announced = -1;         // its token count for this stage (-1: not one peer's count)
  int64_t last_layer = -1;        // attention: the layer attn_recv waited for last (for the error message)
};

/* Wait for `work`; a failure is RuntimeError("<what>: <reason>") (the connector maps it to PeerLostError). */
void wait_one(const WorkPtr& work, std::chrono::milliseconds timeout, const char* what) {
  try {
    work->wait(timeout);
  } catch (const c10::Error& e) {
    throw std::runtime_error(std::string(what) + ": " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string(what) + ": " + e.what());
  }
}

class P2pWire {
 public:
  P2pWire(std::vector<BackendPtr> groups, std::vector<int> peers, double timeout_s, at::ScalarType dtype,
          at::Device device, int64_t hidden, py::object control, py::dict sent)
      : peers_(std::move(peers)),
        timeout_(static_cast<int64_t>(timeout_s * 1000.0)),
        dtype_(dtype),
        device_(device),
        hidden_(hidden),
        control_(std::move(control)),
        sent_(std::move(sent)) {
    if (peers_.empty()) {
      throw std::invalid_argument("P2pWire needs at least one peer");
    }
    stages_.resize(groups.size());
    for (size_t s = 0; s < groups.size(); ++s) {
      stages_[s].pg = std::move(groups[s]);
      stage_keys_.push_back(py::int_(s));
    }
  }

  // --- both sides: sends -------------------------------------------------------

  /* Send each tensor to its peer; each stays alive until the stage's next ffn_wait_plan (or attn_finish). */
  void send(size_t stage, const std::vector<std::pair<at::Tensor, int>>& parts) {
    Stage& st = at(stage);
    py::gil_scoped_release nogil;
    for (const auto& [t, peer] : parts) {
      std::vector<at::Tensor> one{t};
      st.sends.push_back(st.pg->send(one, peer, 0));
      st.keep.push_back(t);
    }
  }

  // --- attention side ----------------------------------------------------------

  /* Send `tensors` to the FFN peer and post the receive of its output into the one of the stage's two output
   * buffers `out0`, `out1` (the same two while the token count repeats) that the previous receive did not fill. */
  void attn_post(size_t stage, const std::vector<at::Tensor>& tensors, at::Tensor out0, at::Tensor out1) {
    Stage& st = at(stage);
    st.out[0] = std::move(out0);
    st.out[1] = std::move(out1);
    py::gil_scoped_release nogil;
    for (const auto& t : tensors) {
      std::vector<at::Tensor> one{t};
      st.sends.push_back(st.pg->send(one, peers_[0], 0));
      st.keep.push_back(t);
    }
    post_output(st);
  }

  /* The FFN output of the last attn_post on `stage`, once every send and the receive completed. */
  at::Tensor attn_finish(size_t stage) {
    Stage& st = at(stage);
    py::gil_scoped_release nogil;
    return finish_output(st);
  }

  /* send_attn_output's steady state: True when it sent and recorded the send, False (nothing done) when any
   * check fails. The checks are the Python path's: [n, hidden] contiguous in the model's dtype on the device,
   * seq_lens == (n,) with n > 0, a stage in range, the step's announced count for it equal to n, no send pending
   * on it, and output buffers of n rows from an earlier call. */
  bool attn_send(const at::Tensor& t, py::handle metadata) {
    if (t.dim() != 2 || t.size(1) != hidden_ || t.scalar_type() != dtype_ || t.device() != device_ ||
        !t.is_contiguous()) {
      return false;
    }
    const int64_t n = t.size(0);
    py::object stage_obj = metadata.attr(s_stage_idx);
    const int64_t stage = PyLong_AsLongLong(stage_obj.ptr());
    if (stage < 0 || static_cast<size_t>(stage) >= stages_.size()) {
      PyErr_Clear();
      return false;
    }
    Stage& st = stages_[stage];
    py::object seq = metadata.attr(s_seq_lens);
    if (!PyTuple_Check(seq.ptr()) || PyTuple_GET_SIZE(seq.ptr()) != 1 ||
        PyLong_AsLongLong(PyTuple_GET_ITEM(seq.ptr(), 0)) != n || n <= 0) {
      PyErr_Clear();
      return false;
    }
    if (!st.out[0].defined() || st.out[st.flip ^ 1].size(0) != n) {
      return false;
    }
    const int pending = PyDict_Contains(sent_.ptr(), stage_keys_[stage].ptr());
    if (pending != 0) {
      if (pending < 0) {
        throw py::error_already_set();
      }
      return false;
    }
    py::object step = control_.attr(s_current);
    if (!step.is(st.step)) {
      st.step = step;
      st.announced = announced_count(step, stage);
    }
    if (st.announced != n) {
      return false;
    }
    py::object layer = metadata.attr(s_layer_idx);
    {
      py::gil_scoped_release nogil;
      std::vector<at::Tensor> one{t};
      st.sends.push_back(st.pg->send(one, peers_[0], 0));
      st.keep.push_back(t);
      post_output(st);
    }
    py::tuple record = py::make_tuple(layer, n);
    if (PyDict_SetItem(sent_.ptr(), stage_keys_[stage].ptr(), record.ptr()) != 0) {
      throw py::error_already_set();
    }
    return true;
  }

  /* recv_ffn_output's steady state: the output, or None (nothing done) unless a send of n > 0 rows is pending
   * on `stage`, its receive was posted here, and `ref` is [n, hidden] in the model's dtype on the device. */
  py::object attn_recv(const at::Tensor& ref, int64_t stage) {
    if (stage < 0 || static_cast<size_t>(stage) >= stages_.size()) {
      return py::none();
    }
    Stage& st = stages_[stage];
    PyObject* key = stage_keys_[stage].ptr();
    PyObject* record = PyDict_GetItemWithError(sent_.ptr(), key);  // borrowed
    if (record == nullptr || !PyTuple_Check(record) || PyTuple_GET_SIZE(record) != 2 || !st.posted) {
      PyErr_Clear();
      return py::none();
    }
    const int64_t n = PyLong_AsLongLong(PyTuple_GET_ITEM(record, 1));
    if (n <= 0 || ref.dim() != 2 || ref.size(0) != n || ref.size(1) != hidden_ || ref.scalar_type() != dtype_ ||
        ref.device() != device_) {
      PyErr_Clear();
      return py::none();
    }
    st.last_layer = PyLong_AsLongLong(PyTuple_GET_ITEM(record, 0));
    if (PyDict_DelItem(sent_.ptr(), key) != 0) {
      throw py::error_already_set();
    }
    at::Tensor out;
    {
      py::gil_scoped_release nogil;
      out = finish_output(st);
    }
    return py::cast(out);
  }

  // --- ffn side ----------------------------------------------------------------

  /* Complete the stage's previous sends, then post the receives of its plan (ffn_plan) and wait for them. */
  void ffn_wait_plan(size_t stage) {
    Stage& st = at(stage);
    py::gil_scoped_release nogil;
    finish_sends(st);
    std::vector<WorkPtr> works;
    works.reserve(st.posts.size());
    for (const auto& [t, peer] : st.posts) {
      std::vector<at::Tensor> one{t};
      works.push_back(st.pg->recv(one, peer, 0));
    }
    for (const auto& w : works) {
      wait_one(w, timeout_, "receive");
    }
  }

  /* The receives ffn_wait_plan posts for `stage`: (buffer, peer) each, set whenever the stage's receive plan changes. */
  void ffn_plan(size_t stage, std::vector<std::pair<at::Tensor, int>> posts) { at(stage).posts = std::move(posts); }

  /* Send one output to one peer (the FFN side's steady state); it stays alive until the stage's next ffn_wait_plan. */
  void ffn_send_one(size_t stage, const at::Tensor& t, int peer) {
    Stage& st = at(stage);
    py::gil_scoped_release nogil;
    std::vector<at::Tensor> one{t};
    st.sends.push_back(st.pg->send(one, peer, 0));
    st.keep.push_back(t);
  }

  // --- lifecycle -----------------------------------------------------------------

  /* Forget everything in flight (close, after the groups shut down) and the stages' buffers. */
  void clear() {
    for (auto& st : stages_) {
      st.sends.clear();
      st.keep.clear();
      st.posted.reset();
      st.posted_out = at::Tensor();
      st.posts.clear();
      st.out[0] = at::Tensor();
      st.out[1] = at::Tensor();
      st.step = py::object();
      st.announced = -1;
      st.last_layer = -1;
    }
  }

  /* The layer of the FFN output attn_recv waited for last on `stage` (its error names it). */
  int64_t last_layer(size_t stage) { return at(stage).last_layer; }

 private:
  Stage& at(size_t stage) {
    if (stage >= stages_.size()) {
      throw std::out_of_range("stage " + std::to_string(stage) + " out of range; num_stages=" +
                              std::to_string(stages_.size()));
    }
    return stages_[stage];
  }

  /* One peer's count for `stage` in the control payload `step`, or -1. */
  int64_t announced_count(const py::object& step, int64_t stage) const {
    if (step.is_none()) {
      return -1;
    }
    py::object counts = step.attr(s_stage_token_counts);
    if (!PyTuple_Check(counts.ptr()) || stage >= PyTuple_GET_SIZE(counts.ptr())) {
      return -1;
    }
    PyObject* mine = PyTuple_GET_ITEM(counts.ptr(), stage);
    if (!PyTuple_Check(mine) || PyTuple_GET_SIZE(mine) != 1) {
      return -1;
    }
    const int64_t n = PyLong_AsLongLong(PyTuple_GET_ITEM(mine, 0));
    if (PyErr_Occurred()) {
      PyErr_Clear();
      return -1;
    }
    return n;
  }

  /* Post the receive of the FFN output into the buffer after the one the previous receive filled (no GIL). */
  void post_output(Stage& st) {
    st.flip ^= 1;
    st.posted_out = st.out[st.flip];
    std::vector<at::Tensor> one{st.posted_out};
    st.posted = st.pg->recv(one, peers_[0], 0);
  }

  void finish_sends(Stage& st) {
    std::vector<WorkPtr> sends;
    sends.swap(st.sends);
    std::vector<at::Tensor> keep;
    keep.swap(st.keep);
    for (const auto& w : sends) {
      wait_one(w, timeout_, "send");
    }
  }

  at::Tensor finish_output(Stage& st) {
    WorkPtr posted = std::move(st.posted);
    st.posted.reset();
    finish_sends(st);
    if (posted) {
      wait_one(posted, timeout_, "receive");
    }
    return st.posted_out;
  }

  // attribute names, made once (a const char* would make a str per read)
  py::str s_stage_idx{"stage_idx"};
  py::str s_layer_idx{"layer_idx"};
  py::str s_seq_lens{"seq_lens"};
  py::str s_current{"current"};
  py::str s_stage_token_counts{"stage_token_counts"};

  std::vector<Stage> stages_;
  std::vector<py::object> stage_keys_;
  std::vector<int> peers_;
  std::chrono::milliseconds timeout_;
  at::ScalarType dtype_;
  at::Device device_;
  int64_t hidden_;
  py::object control_;
  py::dict sent_;
};

}  // namespace

PYBIND11_MODULE(_p2pwire, m) {
  m.doc() = "P2pNcclAFDConnector's process-group calls and attention steady state in C++ (see the source's header).";
  py::class_<P2pWire>(m, "P2pWire")
      .def(py::init<std::vector<BackendPtr>, std::vector<int>, double, at::ScalarType, at::Device, int64_t,
                    py::object, py::dict>(),
           py::arg("groups"), py::arg("peers"), py::arg("timeout_s"), py::arg("dtype"), py::arg("device"),
           py::arg("hidden"), py::arg("control"), py::arg("sent"))
      .def("send", &P2pWire::send)
      .def("attn_post", &P2pWire::attn_post)
      .def("attn_finish", &P2pWire::attn_finish)
      .def("attn_send", &P2pWire::attn_send)
      .def("attn_recv", &P2pWire::attn_recv)
      .def("ffn_plan", &P2pWire::ffn_plan)
      .def("ffn_wait_plan", &P2pWire::ffn_wait_plan)
      .def("ffn_send_one", &P2pWire::ffn_send_one)
      .def("clear", &P2pWire::clear)
      .def("last_layer", &P2pWire::last_layer)
      .def_property_readonly("name", [](const P2pWire&) { return "native"; });
}
