// bench/tp: the tensor-parallel styles' CPU cost per step that communication does not hide,
// single process.
//
// Step/{ours,raw}/<blocks>: one training step (forward, backward, SGD step, zero_grad) of
// <blocks> Linear(8, 8) layers, alternately ColwiseParallel and RowwiseParallel under
// parallelize_module (ours) or plain (raw), as rank 0 of a Fake tp group of 4 (the Fake
// collectives are a few small copies). Compute is ~nothing, so ours - raw is the styles'
// bookkeeping (hooks, redistribute plans, autograd nodes); the slope over block counts is
// its cost per tensor-parallel Linear. In the same run, PyTorch 2.15's twin
// (bench/peer/tp_step_peer.py: the same model and plan under parallelize_module on its fake
// process group, DTensor dispatch and all; --peer=0 skips it). Issue goal: PyTorch / ours
// >= 20. The communication side (a sequence-parallel MLP's forward against the same
// collectives by hand, 2 ranks over Gloo) is bench/dtensor's TPSequenceMLP.
//
//   bazel build --config=opt //bench:tp_bench
//   bazel-bin/bench/tp_bench [--pair_repetitions=3] [--peer=0] --benchmark_out=bench/out/tp.json
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/nn/modules/linear.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/linear_stack.h"
#include "bench/step_slope.h"
#include "comm/fake_process_group.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "mesh/device_mesh.h"
#include "tensor_parallel/parallel_style.h"
#include "tensor_parallel/parallelize_module.h"

namespace {

constexpr int kTp = 4;  // this process is rank 0 of 4
constexpr int64_t kDim = 8;
constexpr int64_t kBatch = 8;

using RawNet = fsdp::bench::LinearStackImpl<torch::nn::Linear>;
using TpNet = fsdp::bench::LinearStackImpl<fsdp::Hooked<torch::nn::LinearImpl>>;

void BM_Step(benchmark::State& state, bool ours) {
  const int64_t blocks = state.range(0);
  if (!ours) {
    RawNet net(blocks, kDim);
    return fsdp::bench::RunTrainingSteps(state, net, kBatch, kDim);
  }
  TpNet net(blocks, kDim);
  auto mesh = fsdp::mesh::DeviceMesh::Create(fsdp::comm::CreateFakeProcessGroup(0, kTp), {kTp});
  fsdp::tensor_parallel::ParallelizePlan plan;
  for (int64_t i = 0; i < blocks; ++i) {  // Megatron pairs: colwise, then rowwise back to Replicate
    plan.emplace_back(absl::StrCat("l", i),
                      i % 2 == 0 ? fsdp::tensor_parallel::ColwiseParallel() : fsdp::tensor_parallel::RowwiseParallel());
  }
  fsdp::tensor_parallel::parallelize_module(net, mesh, plan);
  fsdp::bench::RunTrainingSteps(state, net, kBatch, kDim);
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::bench::RunStepSlopeMain(argc, argv,
                                       {"tp step", "tensor-parallel Linear", "bench/peer/tp_step_peer.py", "tp",
                                        "PyTorch 2.15 tensor parallel (fake group)"},
                                       BM_Step);
}
