#include "comm/fake_process_group.h"

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"

namespace fsdp::comm {
namespace {

class FakeProcessGroup final : public ProcessGroup {
 public:
  FakeProcessGroup(int rank, int size, Timeout timeout) : ProcessGroup(rank, size, timeout) {}
  std::string backend_name() const override { return "fake"; }

 protected:
  WorkPtr DoAllGather(const at::Tensor& output, const at::Tensor& input) override {
    const int64_t n = input.numel();
    auto flat_out = output.view({-1});
    for (int r = 0; r < size(); ++r) flat_out.narrow(0, r * n, n).copy_(input.reshape({-1}));
    return Done("all_gather_into_tensor", output);
  }
  WorkPtr DoReduceScatter(const at::Tensor& output, const at::Tensor& input, ReduceOp) override {
    const int64_t n = output.numel();
    output.view({-1}).copy_(input.reshape({-1}).narrow(0, rank() * n, n));
    return Done("reduce_scatter_tensor", input);
  }
  WorkPtr DoAllReduce(const at::Tensor& tensor, ReduceOp) override { return Done("all_reduce", tensor); }
  WorkPtr DoBroadcast(const at::Tensor& tensor, int) override { return Done("broadcast", tensor); }
  WorkPtr DoAllToAll(const at::Tensor& output, const at::Tensor&, const std::vector<int64_t>&,
                     const std::vector<int64_t>&) override {
    return Done("all_to_all_single", output);
  }
  WorkPtr DoBarrier() override { return MakeCompletedWork(absl::StrCat("barrier on ", WhoAmI())); }
  std::shared_ptr<ProcessGroup> DoNewSubgroup(const std::vector<int>& ranks) override {
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i] == rank()) {
        return CreateFakeProcessGroup(static_cast<int>(i), static_cast<int>(ranks.size()), timeout());
      }
    }
    return nullptr;
  }

 private:
  WorkPtr Done(const char* op, const at::Tensor& t) {
    return MakeCompletedWork(absl::StrCat(op, " ", DescribeTensor(t), " on ", WhoAmI()));
  }
};

}  // namespace

ProcessGroupPtr CreateFakeProcessGroup(int rank, int world_size, Timeout timeout) {
  return std::make_shared<FakeProcessGroup>(rank, world_size, timeout);
}

}  // namespace fsdp::comm
