// Profiler ranges under PyTorch 2.15's names: a CPU Kineto trace (the profiler PyTorch's
// torch.profiler drives) of one FSDP2 step and one FSDP1 step holds PyTorch's labels
// (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py and _fsdp_state.py;
// torch/distributed/fsdp/_runtime_utils.py and fully_sharded_data_parallel.py), nested as
// PyTorch nests them. One rank of a Fake group, on this thread (the profiler is per thread).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "comm/fake_process_group.h"
#include "comm/profiler_range.h"
#include "dcp/dcp.h"
#include "dtensor/dtensor.h"
#include "fsdp/fsdp1/fully_sharded_data_parallel.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "mesh/device_mesh.h"
#include "testing/multi_rank.h"
#include "testing/test_dir.h"

namespace fsdp {
namespace {

using Linear = Hooked<torch::nn::LinearImpl>;

struct TwoBlocksImpl : torch::nn::Module {
  TwoBlocksImpl() : l0(register_module("l0", Linear(4, 4))), l1(register_module("l1", Linear(4, 4))) {}
  at::Tensor forward(const at::Tensor& x) { return l1(l0(x)); }
  Linear l0, l1;
};
using TwoBlocks = Hooked<TwoBlocksImpl>;

struct Range {
  std::string name;
  uint64_t start, end;
};

// The user-scope ranges (torch.profiler.record_function's) a CPU Kineto trace of `body` holds.
std::vector<Range> TraceRanges(const std::function<void()>& body) {
  namespace prof = torch::profiler::impl;
  const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
  const std::set<prof::ActivityType> activities{prof::ActivityType::CPU};
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
  body();
  const auto result = torch::autograd::profiler::disableProfiler();
  std::vector<Range> ranges;
  for (const auto& e : result->events()) {
    const std::string name = e.name();
    if (absl::StartsWith(name, "FSDP::") || absl::StartsWith(name, "FullyShardedDataParallel") ||
        absl::StartsWith(name, "dcp.") || name == "Redistribute") {
      ranges.push_back({name, e.startNs(), e.endNs()});
    }
  }
  return ranges;
}

const Range* Find(const std::vector<Range>& ranges, const std::string& name) {
  for (const auto& r : ranges) {
    if (r.name == name) return &r;
  }
  return nullptr;
}

std::string Names(const std::vector<Range>& ranges) {
  std::string out;
  for (const auto& r : ranges) out += "\n  " + r.name;
  return out;
}

// `inner` lies within `outer` (both present).
void ExpectNested(const std::vector<Range>& ranges, const std::string& inner, const std::string& outer) {
  const Range* i = Find(ranges, inner);
  const Range* o = Find(ranges, outer);
  ASSERT_NE(i, nullptr) << inner << " is not in the trace:" << Names(ranges);
  ASSERT_NE(o, nullptr) << outer << " is not in the trace:" << Names(ranges);
  EXPECT_TRUE(i->start >= o->start && i->end <= o->end) << inner << " is not inside " << outer;
}

void Step(torch::nn::Module& model, const std::function<at::Tensor(const at::Tensor&)>& forward) {
  forward(at::ones({2, 4})).sum().backward();
  model.zero_grad();
}

TEST(ProfilerRanges, Fsdp2StepHasPyTorchsRanges) {
  TwoBlocks model;
  auto mesh = mesh::DeviceMesh::Create(comm::CreateFakeProcessGroup(0, 2), {2});
  fsdp2::fully_shard(model->l0.ptr(), {.mesh = mesh});
  fsdp2::fully_shard(model->l1.ptr(), {.mesh = mesh});
  fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
  const auto forward = [&](const at::Tensor& x) { return model(x); };
  Step(*model, forward);  // lazy init names the groups
  const std::vector<Range> r = TraceRanges([&] { Step(*model, forward); });
  for (const char* name :
       {"FSDP::root_pre_forward", "FSDP::pre_forward (l0)", "FSDP::all_gather (l0)", "FSDP::all_gather_copy_out (l0)",
        "FSDP::post_forward (l0)", "FSDP::pre_forward (l1)", "FSDP::post_forward (l1)", "FSDP::pre_backward (l1)",
        "FSDP::backward_prefetch for l0", "FSDP::post_backward_reshard (l1)", "FSDP::post_backward_reduce (l1)",
        "FSDP::pre_backward (l0)", "FSDP::post_backward_reduce (l0)", "FSDP::root_post_backward_callback"}) {
    EXPECT_NE(Find(r, name), nullptr) << name << " is not in the trace:" << Names(r);
  }
  ExpectNested(r, "FSDP::all_gather (l0)", "FSDP::pre_forward (l0)");
  ExpectNested(r, "FSDP::all_gather_copy_out (l0)", "FSDP::pre_forward (l0)");
  // The backward prefetch of l0 is issued from l1's pre-backward, l0's all-gather in it.
  ExpectNested(r, "FSDP::backward_prefetch for l0", "FSDP::pre_backward (l1)");
  const Range* root = Find(r, "FSDP::root_pre_forward");
  const Range* first = Find(r, "FSDP::pre_forward (l0)");
  ASSERT_TRUE(root && first);
  EXPECT_LE(root->end, first->start) << "the root pre-forward ends before the first group's pre-forward";
}

TEST(ProfilerRanges, Fsdp1StepHasPyTorchsRanges) {
  TwoBlocks model;
  const fsdp1::FSDPOptions options{.process_group = comm::CreateFakeProcessGroup(0, 2)};
  fsdp1::wrap_fsdp(model->l0.ptr(), options);
  fsdp1::wrap_fsdp(model->l1.ptr(), options);
  fsdp1::wrap_fsdp(model.ptr(), options);
  const auto forward = [&](const at::Tensor& x) { return model(x); };
  Step(*model, forward);
  const std::vector<Range> r = TraceRanges([&] { Step(*model, forward); });
  for (const char* name :
       {"FullyShardedDataParallel.forward", "FullyShardedDataParallel._root_pre_forward",
        "FullyShardedDataParallel._pre_forward", "FullyShardedDataParallel._post_forward",
        "FullyShardedDataParallel._pre_backward_hook", "FullyShardedDataParallel._post_backward_hook"}) {
    EXPECT_NE(Find(r, name), nullptr) << name << " is not in the trace:" << Names(r);
  }
  // The first ranges are the root's: its forward holds its pre-forward, which follows its
  // root pre-forward, and the children's forwards.
  ExpectNested(r, "FullyShardedDataParallel._root_pre_forward", "FullyShardedDataParallel.forward");
  ExpectNested(r, "FullyShardedDataParallel._pre_forward", "FullyShardedDataParallel.forward");
  ExpectNested(r, "FullyShardedDataParallel._post_forward", "FullyShardedDataParallel.forward");
  int forwards = 0;
  for (const auto& range : r) forwards += range.name == "FullyShardedDataParallel.forward";
  EXPECT_EQ(forwards, 3);  // the root and both blocks
}

TEST(ProfilerRanges, DTensorRedistributeAndDcpPhases) {
  const std::string dir = ::fsdp::testing::NewTestPath("profiler_ranges_dcp");
  ::fsdp::testing::RunOnRanks(::fsdp::testing::Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    TwoBlocks model;
    fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
    const dtensor::DTensor d = dtensor::DTensor::from_local(at::ones({2, 3}), mesh, {dtensor::Placement::Shard(0)});
    const auto body = [&] {
      d.redistribute({dtensor::Placement::Replicate()});
      dcp::Save(*model, nullptr, dir);
      dcp::Load(*model, nullptr, dir);
    };
    if (pg->rank() != 0) return body();  // one profiled thread: Kineto runs one session
    const std::vector<Range> r = TraceRanges(body);
    for (const char* name : {"Redistribute", "dcp.save", "dcp.save.plan", "dcp.save.write", "dcp.save.finish",
                             "dcp.load", "dcp.load.plan", "dcp.load.read", "dcp.load.apply"}) {
      EXPECT_NE(Find(r, name), nullptr) << name << " is not in the trace:" << Names(r);
    }
    ExpectNested(r, "dcp.save.write", "dcp.save");
    ExpectNested(r, "dcp.load.read", "dcp.load");
  });
}

TEST(ProfilerRanges, InnermostRangeNamesTheIssuer) {
  EXPECT_EQ(comm::CurrentProfilerRange(), nullptr);
  const comm::ProfilerLabel outer("outer"), inner("inner");
  {
    comm::ProfilerRange a(outer);
    EXPECT_EQ(comm::CurrentProfilerRange(), &outer.str());
    {
      comm::ProfilerRange b(inner);
      EXPECT_EQ(comm::CurrentProfilerRange(), &inner.str());
    }
    EXPECT_EQ(comm::CurrentProfilerRange(), &outer.str());
  }
  EXPECT_EQ(comm::CurrentProfilerRange(), nullptr);
}

}  // namespace
}  // namespace fsdp
