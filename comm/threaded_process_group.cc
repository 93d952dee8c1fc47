#include "comm/threaded_process_group.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "comm/internal/reduce_math.h"

namespace fsdp::comm {
namespace {

enum class OpKind { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kAllToAll, kBarrier };

// One rank's side of a collective.
struct Call {
  OpKind kind = OpKind::kBarrier;
  at::Tensor output;
  at::Tensor input;
  ReduceOp op = ReduceOp::Sum();
  int root = -1;
  std::vector<int64_t> output_splits;
  std::vector<int64_t> input_splits;
  std::string text;  // "all_reduce(SUM) Float[4]"
};

// A one-shot event on std::mutex + condition_variable (pthread underneath, which
// ThreadSanitizer sees; Debian's absl is not instrumented, so absl::Notification would make
// every hand-over look like a race).
class Done {
 public:
  void Notify() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      notified_ = true;
    }
    cv_.notify_all();
  }
  bool HasBeenNotified() {
    std::lock_guard<std::mutex> lock(mu_);
    return notified_;
  }
  bool WaitFor(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [this] { return notified_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool notified_ = false;
};

// The meeting point of the k-th collective of every rank.
struct Rendezvous {
  explicit Rendezvous(int world_size) : calls(world_size), joined(world_size, false) {}
  std::vector<Call> calls;
  std::vector<bool> joined;  // guarded by World::mu_
  int arrived = 0;           // guarded by World::mu_
  std::exception_ptr error;  // written once, before `done` is notified
  Done done;
};

void FinishWithError(Rendezvous& rv, const std::string& message) {
  try {
    TORCH_CHECK_WITH(DistBackendError, false, message);
  } catch (...) {
    rv.error = std::current_exception();
  }
  rv.done.Notify();
}

// Checks that all ranks issued the same collective; returns a message if not.
std::string FindMismatch(const Rendezvous& rv, uint64_t seq) {
  const Call& first = rv.calls[0];
  for (size_t r = 1; r < rv.calls.size(); ++r) {
    const Call& other = rv.calls[r];
    bool same = other.kind == first.kind && other.op == first.op && other.root == first.root;
    if (same && first.kind != OpKind::kBarrier) {
      same = other.input.scalar_type() == first.input.scalar_type();
    }
    if (same) {
      switch (first.kind) {
        case OpKind::kAllGather:
        case OpKind::kReduceScatter: same = other.input.numel() == first.input.numel(); break;
        case OpKind::kAllReduce:
        case OpKind::kBroadcast: same = other.input.sizes() == first.input.sizes(); break;
        case OpKind::kAllToAll:
        case OpKind::kBarrier: break;
      }
    }
    if (!same) {
      return absl::StrCat("collective mismatch at #", seq, ": rank 0 called ", first.text, " but rank ", r, " called ",
                          other.text);
    }
  }
  if (first.kind == OpKind::kAllToAll) {
    for (size_t i = 0; i < rv.calls.size(); ++i) {
      for (size_t j = 0; j < rv.calls.size(); ++j) {
        if (rv.calls[i].output_splits[j] != rv.calls[j].input_splits[i]) {
          return absl::StrCat("all_to_all_single #", seq, ": rank ", i, " expects ", rv.calls[i].output_splits[j],
                              " rows from rank ", j, " but rank ", j, " sends ", rv.calls[j].input_splits[i]);
        }
      }
    }
  }
  return "";
}

// Rows of `t` along dim 0 as a 2-D [rows, row_numel] view.
at::Tensor Rows(const at::Tensor& t) {
  int64_t row_numel = 1;
  for (int64_t d = 1; d < t.dim(); ++d) row_numel *= t.size(d);
  return t.view({t.size(0), row_numel});
}

void Execute(Rendezvous& rv) {
  const int world = static_cast<int>(rv.calls.size());
  const Call& first = rv.calls[0];
  switch (first.kind) {
    case OpKind::kAllGather: {
      const int64_t n = first.input.numel();
      for (int r = 0; r < world; ++r) {
        auto out = rv.calls[r].output.view({-1});
        for (int j = 0; j < world; ++j) out.narrow(0, j * n, n).copy_(rv.calls[j].input.view({-1}));
      }
      break;
    }
    case OpKind::kReduceScatter: {
      const int64_t n = first.output.numel();
      for (int r = 0; r < world; ++r) {
        std::vector<at::Tensor> chunks;
        for (int j = 0; j < world; ++j) chunks.push_back(rv.calls[j].input.view({-1}).narrow(0, r * n, n));
        rv.calls[r].output.view({-1}).copy_(internal::ReduceInRankOrder(chunks, first.op));
      }
      break;
    }
    case OpKind::kAllReduce: {
      std::vector<at::Tensor> all;
      for (const Call& c : rv.calls) all.push_back(c.input);
      at::Tensor result = internal::ReduceInRankOrder(all, first.op);
      for (const Call& c : rv.calls) c.input.copy_(result);
      break;
    }
    case OpKind::kBroadcast: {
      const at::Tensor& src = rv.calls[first.root].input;
      for (int r = 0; r < world; ++r) {
        if (r != first.root) rv.calls[r].input.copy_(src);
      }
      break;
    }
    case OpKind::kAllToAll: {
      for (int i = 0; i < world; ++i) {
        auto out = Rows(rv.calls[i].output);
        int64_t out_offset = 0;
        for (int j = 0; j < world; ++j) {
          const int64_t rows = rv.calls[i].output_splits[j];
          int64_t in_offset = 0;
          for (int k = 0; k < i; ++k) in_offset += rv.calls[j].input_splits[k];
          out.narrow(0, out_offset, rows).copy_(Rows(rv.calls[j].input).narrow(0, in_offset, rows));
          out_offset += rows;
        }
      }
      break;
    }
    case OpKind::kBarrier: break;
  }
}

// One side of a point-to-point exchange, completed when the other side took or gave the data.
struct P2PState {
  std::exception_ptr error;  // written once, before `done` is notified
  Done done;
};
struct P2PSide {
  at::Tensor tensor;
  std::string text;  // "send Float[2, 3] from rank 0 to rank 1 tag 0"
  std::shared_ptr<P2PState> state;
};

void FinishP2P(P2PState& state, const std::string& error) {
  if (!error.empty()) {
    try {
      TORCH_CHECK_WITH(DistBackendError, false, error);
    } catch (...) {
      state.error = std::current_exception();
    }
  }
  state.done.Notify();
}

// A send meeting its recv: the data moves (or both fail, naming both sides).
void Exchange(const P2PSide& send, const P2PSide& recv) {
  std::string error;
  if (send.tensor.sizes() != recv.tensor.sizes() || send.tensor.scalar_type() != recv.tensor.scalar_type()) {
    error = absl::StrCat(send.text, " met ", recv.text, ": shapes and dtypes must match");
  } else {
    error = [&]() -> std::string {
      try {
        // As a collective's data moves (World::Join): no grad, no dispatch keys of this thread.
        c10::impl::ForceDispatchKeyGuard clean_dispatch(c10::default_included_set, c10::default_excluded_set);
        at::AutoGradMode no_grad(false);
        recv.tensor.copy_(send.tensor);
      } catch (const std::exception& e) {
        return e.what();
      }
      return "";
    }();
  }
  FinishP2P(*recv.state, error);
  FinishP2P(*send.state, error);
}

class World : public std::enable_shared_from_this<World> {
 public:
  explicit World(int size) : size_(size) {}
  int size() const { return size_; }

  // Registers `rank`'s call for collective #seq. The last rank to arrive runs it.
  std::shared_ptr<Rendezvous> Join(uint64_t seq, int rank, Call call) {
    std::shared_ptr<Rendezvous> rv;
    bool last = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!abort_reason_.empty()) {
        rv = std::make_shared<Rendezvous>(size_);
        FinishWithError(*rv, abort_reason_);
        return rv;
      }
      auto& slot = pending_[seq];
      if (!slot) slot = std::make_shared<Rendezvous>(size_);
      rv = slot;
      rv->calls[rank] = std::move(call);
      rv->joined[rank] = true;
      if (++rv->arrived == size_) {
        pending_.erase(seq);
        last = true;
      }
    }
    if (last) {
      std::string mismatch = FindMismatch(*rv, seq);
      if (!mismatch.empty()) {
        FinishWithError(*rv, mismatch);
        return rv;
      }
      try {
        // On the thread of whichever rank came last, but as a real backend's own thread would
        // run it: no grad, none of that thread's dispatch keys (a selective checkpoint region
        // on it must not see the data moves it does for every rank).
        c10::impl::ForceDispatchKeyGuard clean_dispatch(c10::default_included_set, c10::default_excluded_set);
        at::AutoGradMode no_grad(false);
        Execute(*rv);
      } catch (...) {
        rv->error = std::current_exception();
      }
      rv->calls.clear();  // drop tensor references as soon as the data moved
      rv->done.Notify();
    }
    return rv;
  }

  std::string MissingRanks(const Rendezvous& rv) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int> missing;
    for (int r = 0; r < size_; ++r) {
      if (!rv.joined[r]) missing.push_back(r);
    }
    if (missing.empty()) return "";
    return absl::StrCat("rank(s) [", absl::StrJoin(missing, ", "), "] never joined it");
  }

  // Posts a send (`is_send`) or recv of the channel (src, dst, tag); matched in posting order
  // with the other side's, on the thread of whichever side came second.
  std::shared_ptr<P2PState> Post(bool is_send, int src, int dst, int tag, P2PSide side) {
    side.state = std::make_shared<P2PState>();
    std::shared_ptr<P2PState> state = side.state;
    std::optional<P2PSide> other;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!abort_reason_.empty()) {
        FinishP2P(*state, abort_reason_);
        return state;
      }
      Channel& ch = channels_[{src, dst, tag}];
      std::deque<P2PSide>& theirs = is_send ? ch.recvs : ch.sends;
      if (theirs.empty()) {
        (is_send ? ch.sends : ch.recvs).push_back(std::move(side));
        return state;
      }
      other = std::move(theirs.front());
      theirs.pop_front();
    }
    if (is_send) {
      Exchange(side, *other);
    } else {
      Exchange(*other, side);
    }
    return state;
  }

  void Abort(const std::string& reason) {
    std::map<uint64_t, std::shared_ptr<Rendezvous>> pending;
    std::map<std::tuple<int, int, int>, Channel> channels;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!abort_reason_.empty()) return;
      abort_reason_ = reason;
      pending.swap(pending_);
      channels.swap(channels_);
    }
    for (auto& [seq, rv] : pending) FinishWithError(*rv, reason);
    for (auto& [key, ch] : channels) {
      for (const P2PSide& s : ch.sends) FinishP2P(*s.state, reason);
      for (const P2PSide& r : ch.recvs) FinishP2P(*r.state, reason);
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, sub] : subworlds_) sub->Abort(reason);
  }

  std::shared_ptr<World> Subworld(uint64_t split_index, const std::vector<int>& ranks) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& sub = subworlds_[{split_index, ranks}];
    if (!sub) {
      sub = std::make_shared<World>(static_cast<int>(ranks.size()));
      if (!abort_reason_.empty()) sub->Abort(abort_reason_);
    }
    return sub;
  }

 private:
  const int size_;
  std::mutex mu_;  // std::mutex, not absl::Mutex: see Done
  std::map<uint64_t, std::shared_ptr<Rendezvous>> pending_;
  // Point-to-point: the unmatched sends and recvs of each (src, dst, tag).
  struct Channel {
    std::deque<P2PSide> sends, recvs;
  };
  std::map<std::tuple<int, int, int>, Channel> channels_;
  std::string abort_reason_;
  std::map<std::pair<uint64_t, std::vector<int>>, std::shared_ptr<World>> subworlds_;
};

class ThreadedWork final : public Work {
 public:
  ThreadedWork(std::string description, Timeout timeout, std::shared_ptr<World> world, std::shared_ptr<Rendezvous> rv)
      : Work(std::move(description), timeout), world_(std::move(world)), rv_(std::move(rv)) {}

  bool is_completed() override { return rv_->done.HasBeenNotified(); }
  std::exception_ptr exception() override { return rv_->done.HasBeenNotified() ? rv_->error : nullptr; }

 protected:
  bool WaitFor(Timeout timeout) override { return rv_->done.WaitFor(timeout); }
  std::string TimeoutDetail() override { return world_->MissingRanks(*rv_); }

 private:
  std::shared_ptr<World> world_;
  std::shared_ptr<Rendezvous> rv_;
};

class P2PWork final : public Work {
 public:
  P2PWork(std::string description, Timeout timeout, std::shared_ptr<P2PState> state, std::string pending_detail)
      : Work(std::move(description), timeout), state_(std::move(state)), detail_(std::move(pending_detail)) {}

  bool is_completed() override { return state_->done.HasBeenNotified(); }
  std::exception_ptr exception() override { return state_->done.HasBeenNotified() ? state_->error : nullptr; }

 protected:
  bool WaitFor(Timeout timeout) override { return state_->done.WaitFor(timeout); }
  std::string TimeoutDetail() override { return detail_; }

 private:
  std::shared_ptr<P2PState> state_;
  std::string detail_;
};

class ThreadedProcessGroup final : public ProcessGroup {
 public:
  ThreadedProcessGroup(std::shared_ptr<World> world, int rank, Timeout timeout)
      : ProcessGroup(rank, world->size(), timeout), world_(std::move(world)) {}

  std::string backend_name() const override { return "threaded"; }
  World& world() { return *world_; }

 protected:
  WorkPtr DoAllGather(const at::Tensor& output, const at::Tensor& input) override {
    return Submit({OpKind::kAllGather, output, input}, "all_gather_into_tensor", input);
  }
  WorkPtr DoReduceScatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op) override {
    return Submit({OpKind::kReduceScatter, output, input, op},
                  absl::StrCat("reduce_scatter_tensor(", op.ToString(), ")"), input);
  }
  WorkPtr DoAllReduce(const at::Tensor& tensor, ReduceOp op) override {
    return Submit({OpKind::kAllReduce, tensor, tensor, op}, absl::StrCat("all_reduce(", op.ToString(), ")"), tensor);
  }
  WorkPtr DoBroadcast(const at::Tensor& tensor, int root) override {
    Call call{OpKind::kBroadcast, tensor, tensor};
    call.root = root;
    return Submit(std::move(call), absl::StrCat("broadcast(root=", root, ")"), tensor);
  }
  WorkPtr DoAllToAll(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& output_split_sizes,
                     const std::vector<int64_t>& input_split_sizes) override {
    Call call{OpKind::kAllToAll, output, input};
    call.output_splits = output_split_sizes;
    call.input_splits = input_split_sizes;
    return Submit(std::move(call),
                  absl::StrCat("all_to_all_single(in [", absl::StrJoin(input_split_sizes, ","), "], out [",
                               absl::StrJoin(output_split_sizes, ","), "])"),
                  input);
  }
  WorkPtr DoBarrier() override { return Submit({OpKind::kBarrier}, "barrier", at::Tensor()); }

  // A send completes once the peer's recv took the data (no copy is kept), as NCCL's does.
  WorkPtr DoSend(const at::Tensor& tensor, int dst, int tag) override {
    const std::string what = absl::StrCat("send ", DescribeTensor(tensor), " to rank ", dst, " tag ", tag);
    std::string detail = absl::StrCat("rank ", dst, " posted no recv from rank ", rank(), " with tag ", tag);
    auto state =
        world_->Post(/*is_send=*/true, rank(), dst, tag, {tensor, absl::StrCat(what, " from rank ", rank()), nullptr});
    return std::make_shared<P2PWork>(absl::StrCat(what, " on ", WhoAmI()), timeout(), std::move(state),
                                     std::move(detail));
  }
  WorkPtr DoRecv(const at::Tensor& tensor, int src, int tag) override {
    const std::string what = absl::StrCat("recv ", DescribeTensor(tensor), " from rank ", src, " tag ", tag);
    std::string detail = absl::StrCat("rank ", src, " sent nothing to rank ", rank(), " with tag ", tag);
    auto state =
        world_->Post(/*is_send=*/false, src, rank(), tag, {tensor, absl::StrCat(what, " at rank ", rank()), nullptr});
    return std::make_shared<P2PWork>(absl::StrCat(what, " on ", WhoAmI()), timeout(), std::move(state),
                                     std::move(detail));
  }

  std::shared_ptr<ProcessGroup> DoNewSubgroup(const std::vector<int>& ranks) override {
    auto sub = world_->Subworld(next_split_++, ranks);
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i] == rank()) {
        return std::make_shared<ThreadedProcessGroup>(sub, static_cast<int>(i), timeout());
      }
    }
    return nullptr;
  }

 private:
  WorkPtr Submit(Call call, const std::string& op_text, const at::Tensor& shown) {
    const uint64_t seq = next_seq_++;
    call.text = shown.defined() ? absl::StrCat(op_text, " ", DescribeTensor(shown)) : op_text;
    std::string description = absl::StrCat(call.text, " #", seq, " on ", WhoAmI());
    auto rv = world_->Join(seq, rank(), std::move(call));
    return std::make_shared<ThreadedWork>(std::move(description), timeout(), world_, std::move(rv));
  }

  std::shared_ptr<World> world_;
  uint64_t next_seq_ = 0;
  uint64_t next_split_ = 0;
};

}  // namespace

std::vector<ProcessGroupPtr> CreateThreadedProcessGroups(int world_size, Timeout timeout) {
  TORCH_CHECK(world_size >= 1, "CreateThreadedProcessGroups: world_size must be >= 1, got ", world_size);
  auto world = std::make_shared<World>(world_size);
  std::vector<ProcessGroupPtr> groups;
  for (int r = 0; r < world_size; ++r) {
    groups.push_back(std::make_shared<ThreadedProcessGroup>(world, r, timeout));
  }
  return groups;
}

void AbortThreadedWorld(ProcessGroup& group, const std::string& reason) {
  auto* threaded = dynamic_cast<ThreadedProcessGroup*>(&group);
  TORCH_CHECK(threaded != nullptr, "AbortThreadedWorld: group is a ", group.backend_name(),
              " group, not a threaded one");
  threaded->world().Abort(reason);
}

}  // namespace fsdp::comm
