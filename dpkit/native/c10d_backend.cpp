// The C++ face of the torch.distributed backend "dpkit": a c10d::Backend whose every collective is the Python
// implementation's (dpkit/comm/backend.py), and a c10d::Work that asks the Python work for everything torch may
// ask of a Work.
//
// Why C++ at all: torch wraps whatever a Python backend returns in a holder that forwards only wait() and
// get_future(), so is_completed() stays false, result() and exception() raise "not implemented", recv from any
// source cannot say its source, and a Python backend has no sequence numbers, which
// TORCH_DISTRIBUTED_DEBUG=DETAIL needs. Here each of those is forwarded, and the backend names itself "dpkit".
//
// Built at first use by dpkit.native.load_extension("c10d_backend") against the running torch. It overrides
// the names every supported torch has (the old _allgather_base, _reduce_scatter_base, ..., to which the newer
// *_single names forward), so one source builds for all of them.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/chrono.h>

#include <atomic>
#include <stdexcept>

namespace py = pybind11;
using c10d::OpType;
using c10d::Work;

namespace {

// A Work over a Python work object (dpkit.comm.backend_work.Work): every question goes to Python, under the GIL.
class ForwardedWork : public Work {
 public:
  ForwardedWork(py::object work, OpType type) : Work(-1, type), work_(std::move(work)) {}

  ~ForwardedWork() override {
    py::gil_scoped_acquire gil;
    work_ = py::object();
  }

  bool isCompleted() override { return ask<bool>("is_completed"); }
  bool isSuccess() const override { return ask<bool>("is_success"); }
  int sourceRank() const override { return ask<int>("source_rank"); }
  std::vector<at::Tensor> result() override { return ask<std::vector<at::Tensor>>("result"); }

  std::exception_ptr exception() const override {
    py::gil_scoped_acquire gil;
    py::object why = work_.attr("exception")();
    if (why.is_none()) {
      return nullptr;
    }
    return std::make_exception_ptr(std::runtime_error(py::str(why).cast<std::string>()));
  }

  bool wait(std::chrono::milliseconds timeout) override {
    py::gil_scoped_acquire gil;
    return work_.attr("wait")(timeout.count()).cast<bool>();
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    py::gil_scoped_acquire gil;
    return work_.attr("get_future")().cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>()->fut;
  }

 private:
  template <typename T>
  T ask(const char* method) const {
    py::gil_scoped_acquire gil;
    return work_.attr(method)().cast<T>();
  }

  py::object work_;
};

// The backend: each collective calls the Python implementation's method of the same (Python) name.
class Backend : public c10d::Backend {
 public:
  Backend(int rank, int size, py::object impl) : c10d::Backend(rank, size), impl_(std::move(impl)) {}

  ~Backend() override {
    py::gil_scoped_acquire gil;
    impl_ = py::object();
  }

  py::object impl() const { return impl_; }

  const std::string getBackendName() const override { return "dpkit"; }
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return sequence_; }

  bool supportsSplitting() const override { return false; }
  bool supportsCoalescing() const override { return false; }

  void shutdown() override { call_void("shutdown"); }
  void abort() override { call_void("shutdown"); }

  c10::intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) override {
    return call(OpType::BROADCAST, "broadcast", t, o);
  }
  c10::intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    return call(OpType::ALLREDUCE, "allreduce", t, o);
  }
  c10::intrusive_ptr<Work> allreduce_sparse(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    return call(OpType::ALLREDUCE, "allreduce", t, o);
  }
  c10::intrusive_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& t,
                                               const c10d::AllreduceCoalescedOptions& o) override {
    return call(OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", t, o);
  }
  c10::intrusive_ptr<Work> reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override {
    return call(OpType::REDUCE, "reduce", t, o);
  }
  c10::intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                     const c10d::AllgatherOptions& o) override {
    return call(OpType::ALLGATHER, "allgather", out, in, o);
  }
  c10::intrusive_ptr<Work> _allgather_base(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) override {
    return call(OpType::_ALLGATHER_BASE, "all_gather_single", out, in, o);
  }
  c10::intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& out,
                                               std::vector<at::Tensor>& in, const c10d::AllgatherOptions& o) override {
    return call(OpType::ALLGATHER_COALESCED, "allgather_coalesced", out, in, o);
  }
  c10::intrusive_ptr<Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                                           const c10d::AllgatherOptions& o) override {
    return call(OpType::COALESCED, "all_gather_single_coalesced", out, in, o);
  }
  c10::intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                  const c10d::GatherOptions& o) override {
    return call(OpType::GATHER, "gather", out, in, o);
  }
  c10::intrusive_ptr<Work> scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                                   const c10d::ScatterOptions& o) override {
    return call(OpType::SCATTER, "scatter", out, in, o);
  }
  c10::intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                                          const c10d::ReduceScatterOptions& o) override {
    return call(OpType::REDUCE_SCATTER, "reduce_scatter", out, in, o);
  }
  c10::intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                const c10d::ReduceScatterOptions& o) override {
    return call(OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_single", out, in, o);
  }
  c10::intrusive_ptr<Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                                           const c10d::ReduceScatterOptions& o) override {
    return call(OpType::COALESCED, "reduce_scatter_single_coalesced", out, in, o);
  }
  c10::intrusive_ptr<Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                         std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& o) override {
    return call(OpType::ALLTOALL_BASE, "all_to_all_single", out, in, out_splits, in_splits, o);
  }
  c10::intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                    const c10d::AllToAllOptions& o) override {
    return call(OpType::ALLTOALL, "alltoall", out, in, o);
  }
  c10::intrusive_ptr<Work> send(std::vector<at::Tensor>& t, int dst, int tag) override {
    return call(OpType::SEND, "send", t, dst, tag);
  }
  c10::intrusive_ptr<Work> recv(std::vector<at::Tensor>& t, int src, int tag) override {
    return call(OpType::RECV, "recv", t, src, tag);
  }
  c10::intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>& t, int tag) override {
    return call(OpType::RECVANYSOURCE, "recv_anysource", t, tag);
  }
  c10::intrusive_ptr<Work> barrier(const c10d::BarrierOptions& o) override {
    return call(OpType::BARRIER, "barrier", o);
  }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override {
    py::gil_scoped_acquire gil;
    impl_.attr("monitored_barrier")(o.timeout, wait_all_ranks);
  }

 private:
  template <typename... Args>
  c10::intrusive_ptr<Work> call(OpType type, const char* method, Args&... args) {
    ++sequence_;  // every rank counts the same calls: what DETAIL's checks compare across ranks
    py::gil_scoped_acquire gil;
    return c10::make_intrusive<ForwardedWork>(impl_.attr(method)(args...), type);
  }

  void call_void(const char* method) {
    py::gil_scoped_acquire gil;
    if (impl_) {
      impl_.attr(method)();
    }
  }

  py::object impl_;
  std::atomic<uint64_t> sequence_{0};
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::module::import("torch.distributed");  // c10d's Python types (Backend, the options) registered first
  py::class_<Backend, c10d::Backend, c10::intrusive_ptr<Backend>>(m, "Backend")
      .def(py::init<int, int, py::object>(), py::arg("rank"), py::arg("size"), py::arg("impl"))
      .def_property_readonly("impl", &Backend::impl);
}
