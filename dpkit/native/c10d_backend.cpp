// The C++ face of the torch.distributed backend "dpkit": a c10d::Backend whose every collective is the Python
// implementation's (dpkit/comm/backend.py), and a c10d::Work that asks the Python work for everything torch may
// ask of a Work.
//
// Why C++ at all: torch wraps whatever a Python backend returns in a holder that forwards only wait() and
// get_future(), so is_completed() stays false, result() and exception() raise "not implemented", recv from any
// source cannot say its source, and a Python backend has no sequence numbers, which
// TORCH_DISTRIBUTED_DEBUG=DETAIL needs. Here each of those is forwarded, and the backend names itself "dpkit".
//
// The fast path: all-reduce, reduce, broadcast, all-gather, reduce-scatter and even all-to-all (the tensor
// forms) of dense tensors of up to one slot, an all-reduce of any size whose caller waits at once, and the
// barrier, while none of the group's calls is queued in Python, run here, on the same shared-memory slots and by
// the same protocol as dpkit/comm/slots.py (the Python path; see its docstring): post the data into this rank's
// slot, its descriptor, then the counter; poll the peers' counters; read every rank's slot into the output (sums
// left to right in rank order, so the bits equal the Python path's), piece by piece where slots.py's piece_numel
// cuts the message. No GIL, no Python, no queue. When the peers have not all posted a piece within HANDOVER_NS (an
// async_op=True call, whose caller must go on) or WAITED_NS (a caller that waits at once), or their descriptors
// differ, the call, posted up to that piece, is handed to the Python implementation (finish_posted), whose queue
// completes it in order from that piece and whose wait names dead peers, times out and breaks the group as on
// every path. A group of one rank has nothing to wait for: its calls complete here at once. A call completed here
// for a caller that waits at once returns no Work (done()), which torch's Python takes as done.
//
// Built at first use by dpkit.native.load_extension("c10d_backend") against the running torch. It overrides
// the names every supported torch has (the old _allgather_base, _reduce_scatter_base, ..., to which the newer
// *_single names forward), so one source builds for all of them.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/chrono.h>

#include <ATen/record_function.h>
#include <sched.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
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

// A call the fast path completed before returning it: success, its tensors as the result.
class DoneWork : public Work {
 public:
  DoneWork(std::vector<at::Tensor> tensors, OpType type) : Work(-1, type), tensors_(std::move(tensors)) {
    finish();
  }

  bool wait(std::chrono::milliseconds) override { return true; }
  std::vector<at::Tensor> result() override { return tensors_; }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    future->markCompleted(c10::IValue(tensors_));
    return future;
  }

 private:
  std::vector<at::Tensor> tensors_;
};

constexpr int64_t HANDOVER_NS = 200000;  // as dpkit/comm/backend_work.py's HANDOVER_S
// A call whose caller waits at once (async_op=False) holds no one up while it polls: it polls longer before
// handing over to Python (whose wait tells a dead peer from a slow one).
constexpr int64_t WAITED_NS = 20000000;
// All-reduces, and broadcasts and reduces of at most a slot, go in pieces of this many bytes (slots.py's
// PIPELINED_PIECE_BYTES): in a broadcast or reduce one rank copies a piece while another copies or sums the one
// before it; in an all-reduce a piece's copy in and its sum meet this core's cache, not memory.
constexpr int64_t PIPELINED_PIECE_BYTES = 1 << 19;
constexpr int64_t SPINS = 1000;  // polls before yielding the core at each poll (at once when oversubscribed)

// Indices into slots.py's KINDS and OPS (with DTYPES, the descriptor every rank compares).
enum Kind : int64_t { ALL_REDUCE, BROADCAST, ALL_GATHER, REDUCE_SCATTER, BARRIER, REDUCE, ALL_TO_ALL };
constexpr int64_t OP_SUM = 0, OP_AVG = 1, OP_NONE = 8;
const char* const KIND_NAMES[] = {"all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier", "reduce",
                                  "all_to_all"};

// The slots as dpkit/comm/slots.py lays them out: per rank a record of `record_words` int64 (counter first,
// then per parity p the descriptor kind, dtype, numel, op, root at words 1 + 5p), then per rank two slots.
struct Slots {
  int64_t* queued = nullptr;  // calls queued in Python and not yet run (CallQueue.outstanding)
  int64_t* on = nullptr;  // 1 while the slots are mapped (DpkitBackend turns it off before unmapping them)
  char* base = nullptr;
  int rank = 0, size = 0, record_words = 0, broken_word = 0;
  int64_t slot_bytes = 0;
  bool spin = true;  // a core per rank: poll; oversubscribed: yield the core at every poll

  int64_t* record(int r) const { return reinterpret_cast<int64_t*>(base) + int64_t(r) * record_words; }
  char* slot(int r, int parity) const {
    return base + 8 * int64_t(record_words) * size + (2 * int64_t(r) + parity) * slot_bytes;
  }
  int64_t load(const int64_t* word) const { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }

  // The parity of the slot this rank posts its next piece into.
  int next_parity() const { return int((record(rank)[0] + 1) % 2); }

  // The elements of each piece of a message of `numel` elements of `itemsize` bytes of a call `kind`: as
  // slots.py's piece_numel, so that a call one rank runs here and another in Python pairs piece by piece.
  int64_t piece_numel(Kind kind, int64_t numel, int64_t itemsize) const {
    const int64_t per = slot_bytes / itemsize;
    if (kind == ALL_REDUCE || ((kind == BROADCAST || kind == REDUCE) && numel * itemsize <= slot_bytes)) {
      return std::max<int64_t>(1, std::min(per, PIPELINED_PIECE_BYTES / itemsize));
    }
    return per;
  }

  // One exchange: post `bytes` of `data` (null: nothing to post, or in the slot already) into this rank's next
  // slot, then the descriptor `code`, then the counter; wait for every rank's up to `budget_ns`. The parity of
  // the slots to read, or -1 when Python must finish the call (posted: it waits for it, checks the descriptors,
  // reads the slots).
  int post(const std::array<int64_t, 5>& code, const void* data, size_t bytes, int64_t budget_ns) const {
    int64_t* mine = record(rank);
    const int64_t epoch = mine[0] + 1;
    const int parity = int(epoch % 2);
    if (data != nullptr) {
      std::memcpy(slot(rank, parity), data, bytes);
    }
    std::memcpy(mine + 1 + 5 * parity, code.data(), sizeof code);
    __atomic_store_n(&mine[0], epoch, __ATOMIC_RELEASE);  // after the data and the descriptor
    return arrived(epoch, budget_ns) && agreed(parity, code.data()) ? parity : -1;
  }

  // Whether every rank posted `epoch` within `budget_ns` (polling; after SPINS polls, or at once when
  // oversubscribed, yielding the core at each: a peer may need it). A rank that broke has a negative counter:
  // never arrived here.
  bool arrived(int64_t epoch, int64_t budget_ns) const {
    auto start = std::chrono::steady_clock::now();
    for (int64_t polls = 0;; ++polls) {
      int r = 0;
      while (r < size && load(record(r)) >= epoch) {
        ++r;
      }
      if (r == size) {
        return true;
      }
      if (!spin || polls > SPINS) {
        sched_yield();
      }
      if (polls % 64 == 63 && std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::steady_clock::now() - start).count() > budget_ns) {
        return false;
      }
    }
  }

  // Whether every rank's descriptor of slot `parity` is `code` (else Python's check raises on every rank).
  bool agreed(int parity, const int64_t* code) const {
    for (int r = 0; r < size; ++r) {
      if (std::memcmp(record(r) + 1 + 5 * parity, code, 5 * sizeof(int64_t)) != 0) {
        return false;
      }
    }
    return true;
  }
};

// slots.py's DTYPES index of `t`; -1 for one the slots do not move (bool: the Python path sends it to gloo).
int64_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kDouble: return 1;
    case at::kHalf: return 2;
    case at::kBFloat16: return 3;
    case at::kByte: return 4;
    case at::kChar: return 5;
    case at::kShort: return 6;
    case at::kInt: return 7;
    case at::kLong: return 8;
    default: return -1;
  }
}

bool sums(at::ScalarType t) {  // the dtypes summed here; the others go to Python
  return t == at::kFloat || t == at::kDouble || t == at::kInt || t == at::kLong;
}

// out[0, n) <- the sum over ranks of elements [from, from + n) of their slot `parity`, left to right in rank
// order (as torch.add, then add_, on the Python path), divided by the ranks when `mean`. `in_out`: this rank's
// contribution is in `out` already (an all-reduce, a reduce's root: the caller's tensor, posted from it); rank 0 or
// 1 then reads it there, not from its slot: the same values, so the same bits, and one array fewer through the
// cache (the one this rank has just written, which the peers are reading). Ranks 2 and up add theirs after `out`
// is overwritten: from the slot. No other pointer aliases `out` (so the loops vectorize).
template <typename T>
void reduce_slots(const Slots& s, int parity, int64_t from, T* __restrict__ out, int64_t n, bool mean, bool in_out) {
  auto part = [&](int r) { return reinterpret_cast<const T*>(s.slot(r, parity)) + from; };
  if (in_out && s.rank < 2) {
    const T* __restrict__ other = part(1 - s.rank);
    if (s.rank == 0) {
      for (int64_t i = 0; i < n; ++i) {
        out[i] = out[i] + other[i];
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        out[i] = other[i] + out[i];
      }
    }
  } else {
    const T* __restrict__ p0 = part(0);
    const T* __restrict__ p1 = part(1);
    for (int64_t i = 0; i < n; ++i) {
      out[i] = p0[i] + p1[i];
    }
  }
  for (int r = 2; r < s.size; ++r) {
    const T* __restrict__ p = part(r);
    for (int64_t i = 0; i < n; ++i) {
      out[i] += p[i];
    }
  }
  if (mean) {
    const T ranks = T(s.size);
    for (int64_t i = 0; i < n; ++i) {
      out[i] /= ranks;
    }
  }
}

// The same over `n` elements of dtype `type` at `out`.
void reduce_slots(const Slots& s, int parity, int64_t from, at::ScalarType type, void* out, int64_t n, bool mean,
                  bool in_out) {
  switch (type) {
    case at::kFloat: return reduce_slots(s, parity, from, static_cast<float*>(out), n, mean, in_out);
    case at::kDouble: return reduce_slots(s, parity, from, static_cast<double*>(out), n, mean, in_out);
    case at::kInt: return reduce_slots(s, parity, from, static_cast<int32_t*>(out), n, false, in_out);
    default: return reduce_slots(s, parity, from, static_cast<int64_t*>(out), n, false, in_out);
  }
}

void reduce_slots(const Slots& s, int parity, int64_t from, at::Tensor& out, bool mean, bool in_out) {
  reduce_slots(s, parity, from, out.scalar_type(), out.data_ptr(), out.numel(), mean, in_out);
}

// dst[0, n) <- src[0, n), written past the caches where the CPU can (x86's non-temporal stores; elsewhere a plain
// copy): an ordinary store first reads each line it writes into this core's cache, so a copy into memory that is
// in no cache moves each line three times, a streamed one twice, and evicts nothing the caller holds. For outputs
// too large to be in a cache by the time anyone reads them (slots.py's streamed_bytes). The fence at the end makes
// the streamed stores visible before whatever this rank writes next, as ordinary stores are.
void stream_bytes(char* dst, const char* src, size_t n) {
#if defined(__x86_64__)
  const size_t head = std::min(n, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  size_t i = head;
  for (; i + 64 <= n; i += 64) {  // a 64-byte cache line at a time: its four 16-byte loads, then its stores
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, n - i);
  _mm_sfence();
#else
  std::memcpy(dst, src, n);
#endif
}

// slots.py's streamed copy: `dst` <- `src`, both contiguous CPU tensors of the same bytes, without the GIL. They do
// not overlap: slots.py cuts them from a call's output and its input or a slot, and skips a block already in place.
void stream_copy(at::Tensor dst, const at::Tensor& src) {
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous() && dst.nbytes() == src.nbytes() && dst.is_cpu() &&
                  src.is_cpu(),
              "stream_copy: two contiguous CPU tensors of the same bytes");
  py::gil_scoped_release released;
  stream_bytes(static_cast<char*>(dst.data_ptr()), static_cast<const char*>(src.data_ptr()), dst.nbytes());
}

// The slots of slots.py's Slots.native_layout(): (the mapping's address, rank, ranks, words per record, the broken
// word, bytes per slot, whether to poll before yielding the core).
using Layout = std::tuple<int64_t, int, int, int, int, int64_t, bool>;

Slots mapped(const Layout& layout) {
  Slots s;
  s.base = reinterpret_cast<char*>(std::get<0>(layout));
  s.rank = std::get<1>(layout);
  s.size = std::get<2>(layout);
  s.record_words = std::get<3>(layout);
  s.broken_word = std::get<4>(layout);
  s.slot_bytes = std::get<5>(layout);
  s.spin = std::get<6>(layout);
  return s;
}

// One sum of `t` (contiguous, of a dtype the sums take) over the slots `s`, in place, by `op` (OP_SUM or OP_AVG):
// an ALL_REDUCE, or a REDUCE to `root` (the others' `t` unchanged), from the piece that starts at element `start`
// (every piece before it done). For each piece: post it, wait up to `budget_ns` for the peers', and sum it into `t`
// on every rank of an all-reduce, on a reduce's root. (Never a tensor over this rank's own slot: the sum would
// overwrite it while the peers read it.) -1 when done; else the element where the piece starts that is posted but
// left to Python (a peer not there in time, or descriptors that differ), which finishes it as a hand-over
// (announced).
int64_t sum_in_place(const Slots& s, at::Tensor& t, Kind kind, int64_t op, int root, int64_t budget_ns,
                     int64_t start = 0) {
  const std::array<int64_t, 5> code{kind, dtype_code(t.scalar_type()), t.numel(), op, root};
  const int64_t item = t.element_size(), per = s.piece_numel(kind, t.numel(), item);
  const bool sums_here = kind == ALL_REDUCE || root == s.rank;
  // A reduce's root 0 or 1 sums its own part from `t` (reduce_slots' in_out), and no other rank reads a reduce's
  // slots: it posts no data (slots.py's own_part_unread).
  const bool posts = !(kind == REDUCE && root == s.rank && s.rank < 2);
  char* data = static_cast<char*>(t.data_ptr());
  for (int64_t lo = start; lo < t.numel(); lo += per) {
    const int64_t n = std::min(per, t.numel() - lo);
    const int parity = s.post(code, posts ? data + lo * item : nullptr, n * item, budget_ns);
    if (parity < 0) {
      return lo;
    }
    if (sums_here) {  // the piece holds this rank's contribution: in_out
      reduce_slots(s, parity, 0, t.scalar_type(), data + lo * item, n, op == OP_AVG, true);
    }
  }
  return -1;
}

// The all-reduce of slots.py's Slots.all_reduce, here, without the GIL, over the ranks of `layout` (`mean`: the
// sum divided), from the piece that starts at element `start`: as sum_in_place. Python's wait, which
// sleeps between looks, takes over after HANDOVER_NS: a late peer may need this core.
int64_t slots_all_reduce(const Layout& layout, at::Tensor t, bool mean, int64_t start) {
  const Slots s = mapped(layout);
  py::gil_scoped_release released;
  return sum_in_place(s, t, ALL_REDUCE, mean ? OP_AVG : OP_SUM, 0, HANDOVER_NS, start);
}

// The backend: each collective calls the Python implementation's method of the same (Python) name.
class Backend : public c10d::Backend {
 public:
  Backend(int rank, int size, py::object impl) : c10d::Backend(rank, size), impl_(std::move(impl)) {
    py::object fast = impl_.attr("enable_fast_path")();  // None, or the words of the slots (DpkitBackend)
    if (!fast.is_none()) {
      auto w = fast.cast<std::tuple<int64_t, int64_t, Layout>>();
      slots_ = mapped(std::get<2>(w));
      slots_.queued = reinterpret_cast<int64_t*>(std::get<0>(w));
      slots_.on = reinterpret_cast<int64_t*>(std::get<1>(w));
    }
  }

  ~Backend() override {
    py::gil_scoped_acquire gil;
    impl_ = py::object();
  }

  py::object impl() const { return impl_; }
  uint64_t fast_calls() const { return fast_calls_; }  // calls the fast path completed
  uint64_t handed_over() const { return handed_over_; }  // calls it posted and handed to Python

  const std::string getBackendName() const override { return "dpkit"; }
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return sequence_; }

  bool supportsSplitting() const override { return false; }
  bool supportsCoalescing() const override { return false; }

  void shutdown() override { call_void("shutdown"); }  // the Python side turns the fast path off first
  void abort() override { call_void("shutdown"); }

  c10::intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) override {
    if (t.size() == 1 && o.rootTensor == 0 && fast({t[0]}, dense_bytes(t[0]))) {
      RECORD_USER_SCOPE("dpkit:broadcast");
      ++sequence_;  // once per call, as call() counts
      if (alone()) {
        return done(t, OpType::BROADCAST, o.asyncOp);
      }
      const int root = int(o.rootRank);
      const bool mine = root == slots_.rank;
      char* data = static_cast<char*>(t[0].data_ptr());
      const std::array<int64_t, 5> code{BROADCAST, dtype_code(t[0].scalar_type()), t[0].numel(), OP_NONE, root};
      const int64_t item = t[0].element_size(), per = slots_.piece_numel(BROADCAST, t[0].numel(), item);
      // Piece by piece: the root copies piece k + 1 into its slot while the others copy piece k out of it.
      for (int64_t lo = 0; lo < t[0].numel(); lo += per) {
        const int64_t bytes = std::min(per, t[0].numel() - lo) * item;
        const int parity = post(code, mine ? data + lo * item : nullptr, bytes, o.asyncOp);
        if (parity < 0) {
          return handed_over(BROADCAST, OpType::BROADCAST, t, OP_NONE, root, lo);
        }
        if (!mine) {
          std::memcpy(data + lo * item, slots_.slot(root, parity), bytes);
        }
      }
      return done(t, OpType::BROADCAST, o.asyncOp);
    }
    return call(OpType::BROADCAST, "broadcast", t, o);
  }
  c10::intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    const int64_t op = summing(o.reduceOp, t[0]);
    // Of any size when the caller waits at once: it has nothing to overlap. An async_op=True call larger than a
    // slot goes to Python's queue, whose thread runs it (in C++ too, slots_all_reduce) while the caller goes on.
    if (t.size() == 1 && op >= 0 && fast({t[0]}, o.asyncOp ? dense_bytes(t[0]) : 0)) {
      RECORD_USER_SCOPE("dpkit:all_reduce");
      ++sequence_;  // once per call, as call() counts
      if (alone()) {  // the sum and the mean of one tensor: itself
        return done(t, OpType::ALLREDUCE, o.asyncOp);
      }
      const int64_t left = sum_in_place(slots_, t[0], ALL_REDUCE, op, 0, budget_ns(o.asyncOp));
      if (left >= 0) {
        return handed_over(ALL_REDUCE, OpType::ALLREDUCE, t, op, 0, left);
      }
      return done(t, OpType::ALLREDUCE, o.asyncOp);
    }
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
    const int64_t op = summing(o.reduceOp, t[0]);
    if (t.size() == 1 && o.rootTensor == 0 && op >= 0 && fast({t[0]}, dense_bytes(t[0]))) {
      RECORD_USER_SCOPE("dpkit:reduce");
      ++sequence_;  // once per call, as call() counts
      if (alone()) {
        return done(t, OpType::REDUCE, o.asyncOp);
      }
      // Piece by piece: the others copy piece k + 1 into their slots while the root sums piece k.
      const int root = int(o.rootRank);
      const int64_t left = sum_in_place(slots_, t[0], REDUCE, op, root, budget_ns(o.asyncOp));
      if (left >= 0) {
        return handed_over(REDUCE, OpType::REDUCE, t, op, root, left);
      }
      return done(t, OpType::REDUCE, o.asyncOp);
    }
    return call(OpType::REDUCE, "reduce", t, o);
  }
  c10::intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                     const c10d::AllgatherOptions& o) override {
    return call(OpType::ALLGATHER, "allgather", out, in, o);
  }
  c10::intrusive_ptr<Work> _allgather_base(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) override {
    if (out.numel() == in.numel() * size_ && out.scalar_type() == in.scalar_type() && fast({out, in}, dense_bytes(in))) {
      RECORD_USER_SCOPE("dpkit:all_gather");
      ++sequence_;  // once per call, as call() counts
      if (alone()) {
        copy(out, in);
        return done(std::vector<at::Tensor>{out}, OpType::_ALLGATHER_BASE, o.asyncOp);
      }
      const int parity = post({ALL_GATHER, dtype_code(in.scalar_type()), in.numel(), OP_NONE, 0}, in, o.asyncOp);
      std::vector<at::Tensor> both{out, in};
      if (parity < 0) {
        return handed_over(ALL_GATHER, OpType::_ALLGATHER_BASE, both, OP_NONE, 0);
      }
      char* to = static_cast<char*>(out.data_ptr());
      // This rank's own block from `in`, not from its slot (one array fewer through the cache); memmove: an
      // all-gather in place has `in` as that block of `out`.
      for (int r = 0; r < slots_.size; ++r) {
        if (r == slots_.rank) {
          std::memmove(to + r * in.nbytes(), in.data_ptr(), in.nbytes());
        } else {
          std::memcpy(to + r * in.nbytes(), slots_.slot(r, parity), in.nbytes());
        }
      }
      return done(std::vector<at::Tensor>{out}, OpType::_ALLGATHER_BASE, o.asyncOp);
    }
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
    const int64_t op = summing(o.reduceOp, in);
    if (op >= 0 && in.numel() == out.numel() * size_ && out.scalar_type() == in.scalar_type() &&
        fast({out, in}, dense_bytes(in))) {
      RECORD_USER_SCOPE("dpkit:reduce_scatter");
      ++sequence_;  // once per call, as call() counts
      if (alone()) {
        copy(out, in);
        return done(std::vector<at::Tensor>{out}, OpType::_REDUCE_SCATTER_BASE, o.asyncOp);
      }
      const int parity = post({REDUCE_SCATTER, dtype_code(in.scalar_type()), in.numel(), op, 0}, in, o.asyncOp);
      std::vector<at::Tensor> both{out, in};
      if (parity < 0) {
        return handed_over(REDUCE_SCATTER, OpType::_REDUCE_SCATTER_BASE, both, op, 0);
      }
      reduce_slots(slots_, parity, slots_.rank * out.numel(), out, op == OP_AVG, false);
      return done(std::vector<at::Tensor>{out}, OpType::_REDUCE_SCATTER_BASE, o.asyncOp);
    }
    return call(OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_single", out, in, o);
  }
  c10::intrusive_ptr<Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                                           const c10d::ReduceScatterOptions& o) override {
    return call(OpType::COALESCED, "reduce_scatter_single_coalesced", out, in, o);
  }
  c10::intrusive_ptr<Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                         std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& o) override {
    if (even(out, in, out_splits, in_splits) && fast({out, in}, dense_bytes(in))) {
      RECORD_USER_SCOPE("dpkit:all_to_all");
      ++sequence_;  // once per call, as call() counts
      if (alone()) {
        copy(out, in);
        return done(std::vector<at::Tensor>{out}, OpType::ALLTOALL_BASE, o.asyncOp);
      }
      // Block j of `out` is this rank's block of rank j's input. The others read only their own blocks of this
      // rank's slot: this rank's block goes from `in` to `out` directly, never through the slot.
      const size_t block = in.nbytes() / slots_.size, own = slots_.rank * block;
      const char* from = static_cast<const char*>(in.data_ptr());
      char* to = static_cast<char*>(out.data_ptr());
      char* slot = slots_.slot(slots_.rank, slots_.next_parity());
      std::memcpy(slot, from, own);
      std::memcpy(slot + own + block, from + own + block, in.nbytes() - own - block);
      const int parity = post({ALL_TO_ALL, dtype_code(in.scalar_type()), in.numel(), OP_NONE, 0}, nullptr, 0,
                              o.asyncOp);
      std::vector<at::Tensor> both{out, in};
      if (parity < 0) {
        return handed_over(ALL_TO_ALL, OpType::ALLTOALL_BASE, both, OP_NONE, 0);
      }
      for (int j = 0; j < slots_.size; ++j) {
        std::memcpy(to + j * block, j == slots_.rank ? from + own : slots_.slot(j, parity) + own, block);
      }
      return done(std::vector<at::Tensor>{out}, OpType::ALLTOALL_BASE, o.asyncOp);
    }
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
    if (fast({}, 0)) {
      RECORD_USER_SCOPE("dpkit:barrier");
      ++sequence_;  // once per call, as call() counts
      std::vector<at::Tensor> none;
      if (alone()) {
        return done(none, OpType::BARRIER, o.asyncOp);
      }
      if (post({BARRIER, 0, 0, OP_NONE, 0}, at::Tensor(), o.asyncOp) < 0) {
        return handed_over(BARRIER, OpType::BARRIER, none, OP_NONE, 0);
      }
      return done(none, OpType::BARRIER, o.asyncOp);
    }
    return call(OpType::BARRIER, "barrier", o);
  }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override {
    py::gil_scoped_acquire gil;
    impl_.attr("monitored_barrier")(o.timeout, wait_all_ranks);
  }

 private:
  // OP_SUM or OP_AVG when the fast path sums `t` by `op` (AVG on floating dtypes only: the Python path
  // truncates an integer mean), else -1.
  static int64_t summing(c10d::ReduceOp op, const at::Tensor& t) {
    if (!sums(t.scalar_type())) {
      return -1;
    }
    return op == c10d::ReduceOp::SUM ? OP_SUM : op == c10d::ReduceOp::AVG && t.is_floating_point() ? OP_AVG : -1;
  }

  // Whether an all-to-all moves equal blocks (the splits empty, or each the block), as the slots do.
  bool even(const at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& out_splits,
            const std::vector<int64_t>& in_splits) const {
    const int64_t n = size_;
    if (n == 0 || out.numel() != in.numel() || in.numel() % n != 0 || out.scalar_type() != in.scalar_type()) {
      return false;
    }
    for (const auto* splits : {&out_splits, &in_splits}) {
      for (int64_t split : *splits) {
        if (split != in.numel() / n) {
          return false;
        }
      }
    }
    return true;
  }

  // The bytes of `t`, or more than any slot holds when it is not strided (sparse: no bytes to ask for).
  static size_t dense_bytes(const at::Tensor& t) {
    return t.layout() == at::kStrided ? t.nbytes() : SIZE_MAX;
  }

  // Whether the fast path takes a call on `tensors` that must fit `nbytes` into one slot (0: a call that goes
  // piece by piece at any size): the tensors are contiguous CPU tensors of a dtype the slots move (the Python
  // path's choice too: every rank takes the slots or none); and, but in a group of one rank (nothing to wait for:
  // `alone` calls complete at once), the slots are on, nothing is queued in Python (calls run in program order), no
  // rank broke, and `nbytes` fits one slot. Anything else goes to Python, which checks and refuses as on every
  // path.
  bool fast(std::initializer_list<at::Tensor> tensors, size_t nbytes) const {
    for (const at::Tensor& t : tensors) {
      if (!t.device().is_cpu() || t.layout() != at::kStrided || !t.is_contiguous() || t.numel() == 0 ||
          dtype_code(t.scalar_type()) < 0) {
        return false;
      }
    }
    if (alone()) {
      return true;
    }
    const Slots& s = slots_;
    if (s.on == nullptr || s.load(s.on) == 0 || s.load(s.queued) != 0 || nbytes > size_t(s.slot_bytes)) {
      return false;
    }
    for (int r = 0; r < s.size; ++r) {
      if (s.load(&s.record(r)[s.broken_word]) != 0 || s.load(&s.record(r)[0]) < 0) {
        return false;  // Python raises BrokenGroupError naming the first failure
      }
    }
    return true;
  }

  bool alone() const { return size_ == 1; }

  // A collective of one rank, out of place: `out` <- `in` (of the same bytes).
  static void copy(at::Tensor& out, const at::Tensor& in) {
    if (out.data_ptr() != in.data_ptr()) {
      std::memcpy(out.data_ptr(), in.data_ptr(), in.nbytes());
    }
  }

  // How long a call waits for its peers before handing over: HANDOVER_NS, or WAITED_NS when the caller waits at
  // once (not `async_op`).
  static int64_t budget_ns(bool async_op) { return async_op ? HANDOVER_NS : WAITED_NS; }

  // One exchange (Slots::post), waiting up to budget_ns(async_op).
  int post(const std::array<int64_t, 5>& code, const void* data, size_t bytes, bool async_op) {
    return slots_.post(code, data, bytes, budget_ns(async_op));
  }

  // One exchange of all of `data` (undefined: nothing to post), as above.
  int post(const std::array<int64_t, 5>& code, const at::Tensor& data, bool async_op) {
    return post(code, data.defined() ? data.data_ptr() : nullptr, data.defined() ? data.nbytes() : 0, async_op);
  }

  // A call completed here: its Work, done; or no Work for a caller that waits at once (`async_op` False). Torch's
  // Python (dist.all_reduce and every collective like it) takes none as "the backend has synced" and skips what a
  // Work costs such a call: making it, wrapping it for Python, waiting on it. Torch's capture of in-flight
  // collectives (allow_inflight_collective_as_graph_input) registers every call's Work, so it gets one.
  c10::intrusive_ptr<Work> done(std::vector<at::Tensor> tensors, OpType type, bool async_op) {
    ++fast_calls_;
    if (!async_op && !c10d::allow_inflight_collective_as_graph_input()) {
      return {};
    }
    return c10::make_intrusive<DoneWork>(std::move(tensors), type);
  }

  // The posted call `kind` on `tensors`, completed by the Python implementation (DpkitBackend.finish_posted)
  // from the piece that starts at element `from` (posted here; every piece before it done).
  c10::intrusive_ptr<Work> handed_over(Kind kind, OpType type, std::vector<at::Tensor>& tensors, int64_t op,
                                       int64_t root, int64_t from = 0) {
    ++handed_over_;
    py::gil_scoped_acquire gil;
    py::object work = impl_.attr("finish_posted")(KIND_NAMES[kind], tensors, op == OP_AVG ? "avg" : "sum", root,
                                                  from);
    return c10::make_intrusive<ForwardedWork>(std::move(work), type);
  }

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
  Slots slots_;
  std::atomic<uint64_t> sequence_{0}, fast_calls_{0}, handed_over_{0};
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::module::import("torch.distributed");  // c10d's Python types (Backend, the options) registered first
  py::class_<Backend, c10d::Backend, c10::intrusive_ptr<Backend>>(m, "Backend")
      .def(py::init<int, int, py::object>(), py::arg("rank"), py::arg("size"), py::arg("impl"))
      .def_property_readonly("impl", &Backend::impl)
      .def_property_readonly("fast_calls", [](const Backend& b) { return b.fast_calls(); })
      .def_property_readonly("handed_over", [](const Backend& b) { return b.handed_over(); });
  m.def("slots_all_reduce", &slots_all_reduce, py::arg("layout"), py::arg("tensor"), py::arg("mean"),
        py::arg("start") = 0);
  m.def("stream_copy", &stream_copy, py::arg("dst"), py::arg("src"));
}
