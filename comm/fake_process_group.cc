#include "comm/fake_process_group.h"

#include <ATen/ATen.h>

#include <cstring>
#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"

namespace fsdp::comm {
namespace {

class FakeProcessGroup final : public ProcessGroup {
 public:
  FakeProcessGroup(int rank, int size, Timeout timeout) : ProcessGroup(rank, size, timeout) {}
  std::string backend_name() const override { return "fake"; }

 protected:
  // What its semantics need: every rank's slot holds this rank's input (a memcpy each on the
  // CPU: the public method checked both tensors are contiguous and sized), and the
  // reduce-scatter keeps this rank's chunk.
  WorkPtr DoAllGather(const at::Tensor& output, const at::Tensor& input) override {
    const int64_t n = input.numel();
    if (output.is_cpu() && input.is_cpu()) {
      const size_t bytes = input.nbytes();
      auto* out = static_cast<char*>(output.data_ptr());
      const auto* in = static_cast<const char*>(input.const_data_ptr());
      for (int r = 0; r < size(); ++r) {
        if (out + r * bytes != in) std::memcpy(out + r * bytes, in, bytes);
      }
    } else {
      auto flat_out = output.view({-1});
      for (int r = 0; r < size(); ++r) flat_out.narrow(0, r * n, n).copy_(input.reshape({-1}));
    }
    return Done(Op::kAllGather, output);
  }
  WorkPtr DoReduceScatter(const at::Tensor& output, const at::Tensor& input, ReduceOp) override {
    const int64_t n = output.numel();
    if (output.is_cpu() && input.is_cpu()) {
      std::memcpy(output.data_ptr(), static_cast<const char*>(input.data_ptr()) + rank() * output.nbytes(),
                  output.nbytes());
    } else {
      output.view({-1}).copy_(input.reshape({-1}).narrow(0, rank() * n, n));
    }
    return Done(Op::kReduceScatter, input);
  }
  WorkPtr DoAllReduce(const at::Tensor& tensor, ReduceOp) override { return Done(Op::kAllReduce, tensor); }
  WorkPtr DoBroadcast(const at::Tensor& tensor, int) override { return Done(Op::kBroadcast, tensor); }
  WorkPtr DoAllToAll(const at::Tensor& output, const at::Tensor&, const std::vector<int64_t>&,
                     const std::vector<int64_t>&) override {
    return Done(Op::kAllToAll, output);
  }
  WorkPtr DoBarrier() override { return MakeCompletedWork(absl::StrCat("barrier on ", WhoAmI())); }
  // As PyTorch's FakeProcessGroup: a send goes nowhere, a recv leaves its buffer as it is.
  WorkPtr DoSend(const at::Tensor&, int dst, int tag) override {
    return MakeCompletedWork(absl::StrCat("send to ", dst, " tag ", tag, " on ", WhoAmI()));
  }
  WorkPtr DoRecv(const at::Tensor&, int src, int tag) override {
    return MakeCompletedWork(absl::StrCat("recv from ", src, " tag ", tag, " on ", WhoAmI()));
  }
  std::shared_ptr<ProcessGroup> DoNewSubgroup(const std::vector<int>& ranks) override {
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i] == rank()) {
        return CreateFakeProcessGroup(static_cast<int>(i), static_cast<int>(ranks.size()), timeout());
      }
    }
    return nullptr;
  }

 private:
  // The description is built only if asked for (an error or a trace). Its inputs are packed
  // into 16 trivially copyable bytes, which std::function keeps inline: no allocation per
  // collective beside the Work (bench/fsdp2 issues three per layer and step on this group).
  enum class Op : uint8_t { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kAllToAll };
  struct Describe {
    int64_t numel : 48;  // a Fake collective of 2^47 elements or more would not fit memory
    int64_t dtype : 8;
    int64_t op : 8;
    int32_t rank, world;
    std::string operator()() const {
      static constexpr const char* kNames[] = {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce",
                                               "broadcast", "all_to_all_single"};
      return absl::StrCat(kNames[op], " ", c10::toString(static_cast<c10::ScalarType>(dtype)), " (", numel,
                          " elements) on fake rank ", rank, "/", world);
    }
  };
  static_assert(sizeof(Describe) <= 16 && std::is_trivially_copyable_v<Describe>);
  WorkPtr Done(Op op, const at::Tensor& t) {
    return MakeCompletedWork(
        Describe{t.numel(), static_cast<int64_t>(t.scalar_type()), static_cast<int64_t>(op), rank(), size()});
  }
};

}  // namespace

ProcessGroupPtr CreateFakeProcessGroup(int rank, int world_size, Timeout timeout) {
  return std::make_shared<FakeProcessGroup>(rank, world_size, timeout);
}

}  // namespace fsdp::comm
