#include "comm/process_group.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace fsdp::comm {

std::string ReduceOp::ToString() const {
  switch (kind_) {
    case ReduceOpKind::kSum: return "SUM";
    case ReduceOpKind::kAvg: return "AVG";
    case ReduceOpKind::kMax: return "MAX";
    case ReduceOpKind::kMin: return "MIN";
    case ReduceOpKind::kPremulSum: return absl::StrFormat("PREMUL_SUM(%g)", factor_);
  }
  return "UNKNOWN";
}

// ------------------------------------------------------------------ Work

void Work::wait() { wait(default_timeout_); }

void Work::wait(Timeout timeout) {
  // Idempotent: c10d's Gloo work copies its result into the output again on every wait,
  // which would undo a completion step (AVG's division) that already ran.
  if (waited_) return;
  if (!WaitFor(timeout)) {
    std::string detail = TimeoutDetail();
    OnWaitFailed(absl::StrCat(description(), " timed out"));
    TORCH_CHECK_WITH(DistBackendError, false, description(), " timed out after ", timeout.count(), " ms",
                     detail.empty() ? "" : ": ", detail);
  }
  if (std::exception_ptr error = exception()) {
    OnWaitFailed(absl::StrCat(description(), " failed"));
    std::rethrow_exception(error);
  }
  if (recorder_ != nullptr) recorder_->Complete(record_id_);
  if (completion_step_ && !completion_step_done_) {
    completion_step_done_ = true;
    completion_step_();
    completion_step_ = nullptr;  // and what it captured (AVG's result tensor)
  }
  waited_ = true;
  ReleaseAfterWait();
}

void Work::OnWaitFailed(const std::string& reason) {
  if (recorder_ != nullptr) recorder_->DumpAfterFailure(reason);
}

void Work::AddCompletionStep(std::function<void()> fn) {
  if (!completion_step_) {
    completion_step_ = std::move(fn);
    return;
  }
  completion_step_ = [first = std::move(completion_step_), second = std::move(fn)] {
    first();
    second();
  };
}

namespace {
class CompletedWork final : public Work {
 public:
  explicit CompletedWork(std::string description) : Work(std::move(description), Timeout(0)) {}
  explicit CompletedWork(DescriptionFn describe) : Work(std::move(describe), Timeout(0)) {}
  bool is_completed() override { return true; }
  std::exception_ptr exception() override { return nullptr; }

 protected:
  bool WaitFor(Timeout) override { return true; }
};
}  // namespace

WorkPtr MakeCompletedWork(std::string description) { return std::make_shared<CompletedWork>(std::move(description)); }
WorkPtr MakeCompletedWork(std::function<std::string()> describe) {
  return std::make_shared<CompletedWork>(std::move(describe));
}

const std::string& Work::description() const {
  if (describe_) {
    description_ = describe_();
    describe_ = nullptr;
  }
  return description_;
}

at::Tensor ToObjectCollectiveDevice(const ProcessGroup& group, const at::Tensor& host) {
  return host.to(group.object_collective_device());
}

// ------------------------------------------------------------------ validation

std::string DescribeTensor(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  return absl::StrCat(c10::toString(t.scalar_type()), "[", absl::StrJoin(t.sizes(), ", "), "]",
                      t.device().is_cpu() ? "" : absl::StrCat("@", t.device().str()));
}

namespace {

void CheckTensor(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", arg, " is an undefined tensor");
  TORCH_CHECK(t.is_contiguous(), op, ": ", arg, " must be contiguous, got ", DescribeTensor(t), " with strides [",
              absl::StrJoin(t.strides(), ", "), "]");
  TORCH_CHECK(!t.is_sparse(), op, ": ", arg, " must be dense, got a sparse tensor");
}

void CheckSameKind(const char* op, const at::Tensor& output, const at::Tensor& input) {
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), op, ": output and input dtypes differ: output ",
              DescribeTensor(output), ", input ", DescribeTensor(input));
  TORCH_CHECK(output.device() == input.device(), op, ": output and input devices differ: output on ",
              output.device().str(), ", input on ", input.device().str());
}

void CheckReduceOp(const char* op, const at::Tensor& t, ReduceOp reduce_op) {
  const auto dtype = t.scalar_type();
  const bool integral = at::isIntegralType(dtype, /*includeBool=*/true);
  TORCH_CHECK(!(integral && reduce_op.kind() == ReduceOpKind::kPremulSum), op, ": ", reduce_op.ToString(),
              " needs a floating-point tensor, got ", DescribeTensor(t));
  TORCH_CHECK(!(integral && reduce_op.kind() == ReduceOpKind::kAvg), op,
              ": AVG needs a floating-point tensor (integer division would truncate), got ", DescribeTensor(t));
  TORCH_CHECK(
      !(at::isComplexType(dtype) && (reduce_op.kind() == ReduceOpKind::kMax || reduce_op.kind() == ReduceOpKind::kMin)),
      op, ": ", reduce_op.ToString(), " is undefined for complex tensors, got ", DescribeTensor(t));
  TORCH_CHECK(!(dtype == at::kBool && reduce_op.kind() == ReduceOpKind::kSum), op,
              ": SUM on a Bool tensor is not supported; use MAX (logical or) or MIN (and)");
}

}  // namespace

std::vector<int64_t> ResolveSplits(const std::vector<int64_t>& splits, const at::Tensor& t, int world_size) {
  if (!splits.empty()) return splits;
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  return std::vector<int64_t>(world_size, rows / world_size);
}

// ------------------------------------------------------------------ ProcessGroup

ProcessGroup::ProcessGroup(int rank, int size, Timeout timeout) : rank_(rank), size_(size), timeout_(timeout) {
  TORCH_CHECK(size >= 1, "ProcessGroup: size must be >= 1, got ", size);
  TORCH_CHECK(rank >= 0 && rank < size, "ProcessGroup: rank must be in [0, ", size, "), got ", rank);
  TORCH_CHECK(timeout.count() > 0, "ProcessGroup: timeout must be positive, got ", timeout.count(), " ms");
  // A backend's own group is a root until new_subgroup says otherwise (PyTorch's default
  // group is "0", "default_pg").
  FlightGroup root{"0", "default_pg", std::vector<int>(size)};
  std::iota(root.ranks.begin(), root.ranks.end(), 0);
  identity_ = std::make_shared<const FlightGroup>(std::move(root));
}

void ProcessGroup::SetFlightGroup(const FlightGroup& group) {
  TORCH_CHECK(static_cast<int>(group.ranks.size()) == size_, "SetFlightGroup: ", group.ranks.size(),
              " global ranks for a group of size ", size_);
  for (ProcessGroup* g = this; g != nullptr; g = g->DoInnerGroup()) {
    g->identity_ = std::make_shared<const FlightGroup>(group);
    g->recorder_ = nullptr;  // registers the new identity on the next collective
  }
}

template <typename Issue>
WorkPtr ProcessGroup::Recorded(FlightOp op, const at::Tensor* input, const at::Tensor* output,
                               const at::Tensor* traffic, Issue&& issue, int peer) {
  if (DoInnerGroup() != nullptr) return issue();
  if (recorder_ == nullptr) {
    recorder_ = &FlightRecorder::ForRank(identity_->ranks[rank_]);
    recorder_slot_ = recorder_->Register(identity_, backend_name());
  }
  if (traffic != nullptr) recorder_->AddTraffic(op, traffic->numel() * static_cast<int64_t>(traffic->element_size()));
  if (FlightRecorder::Capacity() == 0) return issue();
  const FlightTensor in{input ? input->scalar_type() : c10::ScalarType::Undefined,
                        input ? input->sizes() : c10::IntArrayRef()};
  const FlightTensor out{output ? output->scalar_type() : c10::ScalarType::Undefined,
                         output ? output->sizes() : c10::IntArrayRef()};
  const bool p2p = op == FlightOp::kSend || op == FlightOp::kRecv;
  const FlightPeer ranks{rank_, peer};
  const int64_t id =
      recorder_->Record(recorder_slot_, p2p ? ++p2p_issued_ : ++collectives_issued_, ++ops_issued_, op,
                        input ? &in : nullptr, output ? &out : nullptr, timeout_, p2p ? &ranks : nullptr);
  WorkPtr work = issue();
  work->recorder_ = recorder_;
  work->record_id_ = id;
  return work;
}

void ProcessGroup::CheckShardedPair(const char* op, const at::Tensor& output, const at::Tensor& input,
                                    bool output_is_full) const {
  CheckTensor(op, "output", output);
  CheckTensor(op, "input", input);
  CheckSameKind(op, output, input);
  const char* full_name = output_is_full ? "output" : "input";
  const char* shard_name = output_is_full ? "input" : "output";
  const at::Tensor& full = output_is_full ? output : input;
  const at::Tensor& shard = output_is_full ? input : output;
  TORCH_CHECK(full.numel() == shard.numel() * size_, op, ": ", full_name, " must have world_size (", size_, ") x ",
              shard_name, " numel (", shard.numel(), ") = ", shard.numel() * size_, " elements, got ", full_name, " ",
              DescribeTensor(full), " with ", full.numel());
}

std::string ProcessGroup::WhoAmI() const { return absl::StrCat(backend_name(), " rank ", rank_, "/", size_); }

WorkPtr ProcessGroup::all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input) {
  CheckShardedPair("all_gather_into_tensor", output, input, /*output_is_full=*/true);
  return Recorded(FlightOp::kAllGather, &input, &output, &output, [&] { return DoAllGather(output, input); });
}

WorkPtr ProcessGroup::reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  CheckShardedPair("reduce_scatter_tensor", output, input, /*output_is_full=*/false);
  CheckReduceOp("reduce_scatter_tensor", input, op);
  return Recorded(FlightOp::kReduceScatter, &input, &output, &input,
                  [&] { return DoReduceScatter(output, input, op); });
}

WorkPtr ProcessGroup::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  constexpr const char* kOp = "all_reduce";
  CheckTensor(kOp, "tensor", tensor);
  CheckReduceOp(kOp, tensor, op);
  return Recorded(FlightOp::kAllReduce, &tensor, &tensor, &tensor, [&] { return DoAllReduce(tensor, op); });
}

WorkPtr ProcessGroup::broadcast(const at::Tensor& tensor, int root) {
  constexpr const char* kOp = "broadcast";
  CheckTensor(kOp, "tensor", tensor);
  TORCH_CHECK(root >= 0 && root < size_, kOp, ": root must be in [0, ", size_, "), got ", root);
  return Recorded(FlightOp::kBroadcast, &tensor, &tensor, &tensor, [&] { return DoBroadcast(tensor, root); });
}

WorkPtr ProcessGroup::all_to_all_single(const at::Tensor& output, const at::Tensor& input,
                                        std::vector<int64_t> output_split_sizes,
                                        std::vector<int64_t> input_split_sizes) {
  constexpr const char* kOp = "all_to_all_single";
  CheckTensor(kOp, "output", output);
  CheckTensor(kOp, "input", input);
  CheckSameKind(kOp, output, input);
  const auto check_splits = [&](const char* arg, const at::Tensor& t, const std::vector<int64_t>& splits) {
    TORCH_CHECK(t.dim() >= 1, kOp, ": ", arg, " must have at least one dimension, got ", DescribeTensor(t));
    if (splits.empty()) {
      TORCH_CHECK(t.size(0) % size_ == 0, kOp, ": ", arg, " dim 0 (", t.size(0), ") must divide by world_size (", size_,
                  ") when no split sizes are given");
      return;
    }
    TORCH_CHECK(static_cast<int>(splits.size()) == size_, kOp, ": ", arg, "_split_sizes must have world_size (", size_,
                ") entries, got ", splits.size());
    for (size_t i = 0; i < splits.size(); ++i) {
      TORCH_CHECK(splits[i] >= 0, kOp, ": ", arg, "_split_sizes[", i, "] must be >= 0, got ", splits[i]);
    }
    const int64_t total = std::accumulate(splits.begin(), splits.end(), int64_t{0});
    TORCH_CHECK(total == t.size(0), kOp, ": ", arg, "_split_sizes sum to ", total, " but ", arg, " dim 0 is ",
                t.size(0));
  };
  check_splits("output", output, output_split_sizes);
  check_splits("input", input, input_split_sizes);
  TORCH_CHECK(output.sizes().slice(1) == input.sizes().slice(1), kOp,
              ": output and input must agree beyond dim 0, got output ", DescribeTensor(output), " and input ",
              DescribeTensor(input));
  return Recorded(FlightOp::kAllToAll, &input, &output, &input, [&] {
    return DoAllToAll(output, input, ResolveSplits(output_split_sizes, output, size_),
                      ResolveSplits(input_split_sizes, input, size_));
  });
}

WorkPtr ProcessGroup::barrier() {
  return Recorded(FlightOp::kBarrier, nullptr, nullptr, nullptr, [&] { return DoBarrier(); });
}

void ProcessGroup::CheckP2P(const char* op, const at::Tensor& tensor, int peer, int tag) const {
  CheckTensor(op, "tensor", tensor);
  const char* who = std::strcmp(op, "send") == 0 ? "dst" : "src";
  TORCH_CHECK(peer >= 0 && peer < size_, op, ": ", who, " must be a rank of this group, in [0, ", size_, "), got ",
              peer);
  TORCH_CHECK(peer != rank_, op, ": ", who, " must not be this rank (", rank_, ")");
  TORCH_CHECK(tag >= 0, op, ": tag must be >= 0, got ", tag);
}

WorkPtr ProcessGroup::send(const at::Tensor& tensor, int dst, int tag) {
  CheckP2P("send", tensor, dst, tag);
  return Recorded(
      FlightOp::kSend, &tensor, nullptr, &tensor, [&] { return DoSend(tensor, dst, tag); }, dst);
}

WorkPtr ProcessGroup::recv(const at::Tensor& tensor, int src, int tag) {
  CheckP2P("recv", tensor, src, tag);
  return Recorded(
      FlightOp::kRecv, nullptr, &tensor, &tensor, [&] { return DoRecv(tensor, src, tag); }, src);
}

void ProcessGroup::batch_isend_irecv(const std::vector<P2POp>& ops, std::vector<WorkPtr>& works) {
  // Every op checked before any is issued, so a bad one leaves none in flight.
  for (size_t i = 0; i < ops.size(); ++i) {
    const P2POp& p = ops[i];
    try {
      CheckP2P(p.kind == P2POp::Kind::kSend ? "send" : "recv", p.tensor, p.peer, p.tag);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "batch_isend_irecv: ops[", i, "]: ", e.what_without_backtrace());
    }
  }
  for (const P2POp& p : ops)
    works.push_back(p.kind == P2POp::Kind::kSend ? send(p.tensor, p.peer, p.tag) : recv(p.tensor, p.peer, p.tag));
}

std::shared_ptr<ProcessGroup> ProcessGroup::new_subgroup(const std::vector<int>& ranks, const std::string& desc) {
  TORCH_CHECK(!ranks.empty(), "new_subgroup: ranks must not be empty");
  for (size_t i = 0; i < ranks.size(); ++i) {
    TORCH_CHECK(ranks[i] >= 0 && ranks[i] < size_, "new_subgroup: ranks[", i, "] = ", ranks[i],
                " is not a rank of this group of size ", size_);
    TORCH_CHECK(i == 0 || ranks[i] > ranks[i - 1], "new_subgroup: ranks must be sorted and unique, got [",
                absl::StrJoin(ranks, ", "), "]");
  }
  std::shared_ptr<ProcessGroup> child = DoNewSubgroup(ranks);
  // Counted on every rank of this group, members or not, so each member names it alike.
  const int index = ++subgroups_created_;
  if (child != nullptr) {
    FlightGroup group{absl::StrCat(identity_->name, ".", index), desc.empty() ? "undefined" : desc, {}};
    for (int r : ranks) group.ranks.push_back(identity_->ranks[r]);
    child->SetFlightGroup(group);
  }
  return child;
}

}  // namespace fsdp::comm
