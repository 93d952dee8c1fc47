#include "comm/gloo_process_group.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/internal/tcp_store.h"

namespace fsdp::comm {
namespace {

class GlooWork final : public Work {
 public:
  GlooWork(std::string description, Timeout timeout, c10::intrusive_ptr<c10d::Work> work)
      : Work(std::move(description), timeout), work_(std::move(work)) {}

  bool is_completed() override { return work_->isCompleted(); }
  std::exception_ptr exception() override {
    if (error_) return error_;
    return work_->isCompleted() ? work_->exception() : nullptr;
  }

 protected:
  bool WaitFor(Timeout timeout) override {
    try {
      work_->wait(timeout);
    } catch (const std::exception& e) {
      if (!work_->isCompleted()) return false;
      // Re-raise gloo's failure with the collective's description in front.
      try {
        TORCH_CHECK_WITH(DistBackendError, false, description(), " failed: ", e.what());
      } catch (...) {
        error_ = std::current_exception();
      }
    }
    return true;
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::exception_ptr error_;
};

c10d::ReduceOp ToC10d(ReduceOp op) {
  switch (op.kind()) {
    case ReduceOpKind::kMax: return c10d::ReduceOp::MAX;
    case ReduceOpKind::kMin: return c10d::ReduceOp::MIN;
    default: return c10d::ReduceOp::SUM;  // AVG and PREMUL_SUM are built from SUM
  }
}

class GlooProcessGroup final : public ProcessGroup {
 public:
  GlooProcessGroup(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                   const GlooOptions& options)
      : ProcessGroup(rank, size, options.timeout), store_(store), options_(options) {
    auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
    gloo_options->devices.push_back(
        c10d::ProcessGroupGloo::createDeviceForHostname(options.hostname));
    gloo_options->threads = options.threads;
    backend_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, gloo_options);
  }

  std::string backend_name() const override { return "gloo"; }

 protected:
  WorkPtr DoAllGather(const at::Tensor& output, const at::Tensor& input) override {
    const std::string what = Describe("all_gather_into_tensor", input);
    if (input.numel() == 0) return MakeCompletedWork(what);
    at::Tensor out = output.view({-1});
    at::Tensor in = input.view({-1});
    return Wrap(what, backend_->all_gather_single(out, in));
  }

  WorkPtr DoReduceScatter(const at::Tensor& output, const at::Tensor& input,
                          ReduceOp op) override {
    const std::string what = Describe(absl::StrCat("reduce_scatter_tensor(", op.ToString(), ")"), input);
    if (output.numel() == 0) return MakeCompletedWork(what);
    at::Tensor out = output.view({-1});
    // PREMUL_SUM must not modify the caller's input: scale a copy.
    at::Tensor in = op.kind() == ReduceOpKind::kPremulSum ? input.view({-1}).mul(op.factor())
                                                           : input.view({-1});
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = ToC10d(op);
    // c10d's work keeps `in` (the scaled copy) alive until the collective finished.
    WorkPtr work = Wrap(what, backend_->reduce_scatter_single(out, in, opts));
    AddAverageStep(*work, output, op);
    return work;
  }

  WorkPtr DoAllReduce(const at::Tensor& tensor, ReduceOp op) override {
    const std::string what = Describe(absl::StrCat("all_reduce(", op.ToString(), ")"), tensor);
    if (tensor.numel() == 0) return MakeCompletedWork(what);
    if (op.kind() == ReduceOpKind::kPremulSum) tensor.mul_(op.factor());
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = ToC10d(op);
    WorkPtr work = Wrap(what, backend_->allreduce(tensors, opts));
    AddAverageStep(*work, tensor, op);
    return work;
  }

  WorkPtr DoBroadcast(const at::Tensor& tensor, int root) override {
    const std::string what = Describe(absl::StrCat("broadcast(root=", root, ")"), tensor);
    if (tensor.numel() == 0) return MakeCompletedWork(what);
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    return Wrap(what, backend_->broadcast(tensors, opts));
  }

  WorkPtr DoAllToAll(const at::Tensor& output, const at::Tensor& input,
                     const std::vector<int64_t>& output_split_sizes,
                     const std::vector<int64_t>& input_split_sizes) override {
    const std::string what = Describe(
        absl::StrCat("all_to_all_single(in [", absl::StrJoin(input_split_sizes, ","), "], out [",
                     absl::StrJoin(output_split_sizes, ","), "])"),
        input);
    at::Tensor out = output;
    at::Tensor in = input;
    std::vector<int64_t> out_splits = output_split_sizes;
    std::vector<int64_t> in_splits = input_split_sizes;
    return Wrap(what, backend_->all_to_all_single(out, in, out_splits, in_splits));
  }

  WorkPtr DoBarrier() override {
    return Wrap(absl::StrCat("barrier on ", WhoAmI()), backend_->barrier());
  }

  std::shared_ptr<ProcessGroup> DoNewSubgroup(const std::vector<int>& ranks) override {
    const uint64_t index = next_split_++;
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i] != rank()) continue;
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>(
          absl::StrCat("fsdp_subgroup_", index, "_", absl::StrJoin(ranks, "_")), store_);
      return std::make_shared<GlooProcessGroup>(prefixed, static_cast<int>(i),
                                                static_cast<int>(ranks.size()), options_);
    }
    return nullptr;
  }

 private:
  std::string Describe(const std::string& op_text, const at::Tensor& t) const {
    return absl::StrCat(op_text, " ", DescribeTensor(t), " on ", WhoAmI());
  }

  WorkPtr Wrap(const std::string& what, c10::intrusive_ptr<c10d::Work> work) {
    return std::make_shared<GlooWork>(what, timeout(), std::move(work));
  }

  // Gloo has no AVG: reduce with SUM, divide once the data arrived.
  void AddAverageStep(Work& work, const at::Tensor& result, ReduceOp op) {
    if (op.kind() != ReduceOpKind::kAvg) return;
    const double world = size();
    work.AddCompletionStep([result, world] { result.div_(world); });
  }

  c10::intrusive_ptr<c10d::Store> store_;
  GlooOptions options_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> backend_;
  uint64_t next_split_ = 0;
};

void CheckOptions(const GlooOptions& options) {
  TORCH_CHECK(options.threads >= 1, "GlooOptions.threads must be >= 1, got ", options.threads);
  TORCH_CHECK(!options.hostname.empty(), "GlooOptions.hostname must not be empty");
}

}  // namespace

ProcessGroupPtr CreateGlooProcessGroupWithFileStore(const std::string& store_path, int rank,
                                                    int world_size, const GlooOptions& options) {
  CheckOptions(options);
  TORCH_CHECK(world_size >= 1, "CreateGlooProcessGroupWithFileStore: world_size must be >= 1, got ",
              world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size,
              "CreateGlooProcessGroupWithFileStore: rank must be in [0, ", world_size, "), got ",
              rank);
  TORCH_CHECK(!store_path.empty(), "CreateGlooProcessGroupWithFileStore: store_path is empty");
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, world_size);
  store->setTimeout(options.timeout);
  return std::make_shared<GlooProcessGroup>(store, rank, world_size, options);
}

ProcessGroupPtr CreateGlooProcessGroupWithTcpStore(const TorchrunEnv& env,
                                                   const GlooOptions& options) {
  CheckOptions(options);
  auto store = internal::ConnectTcpStore(env, options.timeout, "CreateGlooProcessGroupWithTcpStore");
  return std::make_shared<GlooProcessGroup>(store, env.rank, env.world_size, options);
}

ProcessGroupPtr CreateGlooProcessGroupFromEnv(const GlooOptions& options) {
  return CreateGlooProcessGroupWithTcpStore(ReadTorchrunEnv(), options);
}

}  // namespace fsdp::comm
