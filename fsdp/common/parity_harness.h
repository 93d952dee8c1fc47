// The parity harness both FSDPs' parity tests share (fsdp/fsdp1/parity_test.cc,
// fsdp/fsdp2/parity_test.cc): N AdamW steps of a model under FSDP on W ranks, each rank on its
// rows of every batch, equal N steps of the same model on one rank on the whole batch (the
// reference runs on every rank, without FSDP).
//
// The harness holds what does not depend on the FSDP: a case (backend x world size x the
// FSDP's own configuration) and its test name, the multi-rank driver with its skip rule, the
// training loop running the reference and the FSDP model side by side (batches, row slices,
// micro-batches, both AdamW optimizers), the parameter comparison, and the tolerances with
// their arguments. Each FSDP brings its wrapping, its gradient-sync control and its own
// per-step checks as callbacks (Trainee).
#ifndef FSDP_FSDP_COMMON_PARITY_HARNESS_H_
#define FSDP_FSDP_COMMON_PARITY_HARNESS_H_

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "comm/process_group.h"
#include "fsdp/common/test_models.h"
#include "testing/multi_rank.h"

namespace fsdp::parity {

inline constexpr int64_t kBatch = 12;  // rows of every batch: world sizes 1..4 divide it
inline constexpr double kLr = 1e-2;    // both optimizers' AdamW learning rate

// The parity tolerance, relative to max(1, |reference|) (ExpectParamsMatch), after `steps`
// AdamW steps at kLr.
// - float32 parameters (CPU kernels, or cuBLAS and NCCL on CUDA): FSDP's per-rank means reduced
//   across ranks and one rank's whole-batch mean are two legitimate summation orders of the
//   gradients; AdamWParityTolerance(steps, kLr) is what they can differ by (its argument in
//   testing/float_tolerance.h).
// - bfloat16 parameters (mixed precision) against the float32 reference: each gradient is off
//   by some bf16 unit roundoffs (2^-8, relative), which AdamW's lr * m / sqrt(v) turns into up
//   to a whole step (lr) where a gradient element is near zero. Allowed: 3 * kLr, three whole
//   steps, which is all a parameter can move in a 3-step run and 3/4 of it in a 4-step run, so
//   the bf16 cases catch divergence (a wrong shard, a lost gradient compounding), not one
//   step's rounding.
double ParamTolerance(int steps, bool bf16_params);

// Every FSDP parameter in `full` (its name -> the gathered full tensor) equals the reference's
// parameter of that name: max |full - reference| <= tol * max(1, max |reference|); and `full`
// has one entry per distinct parameter of `ref` (a tied tensor once, under either name).
// `label` names the case in failures.
void ExpectParamsMatch(const std::map<std::string, at::Tensor>& full, torch::nn::Module& ref, double tol,
                       const std::string& label);

// One parity case: `cfg` (the FSDP's own configuration, with a `std::string name`) trained on
// `world` ranks of `backend`.
template <class Config>
struct Case {
  ::fsdp::testing::Backend backend;
  int world;
  Config cfg;
};

// GoogleTest's name of a case: "<backend>_w<world>_<cfg.name>".
template <class Config>
std::string CaseName(const ::testing::TestParamInfo<Case<Config>>& info) {
  return ::fsdp::testing::BackendName(info.param.backend) + "_w" + std::to_string(info.param.world) + "_" +
         info.param.cfg.name;
}

// Runs `body(cfg, group, device)` on c.world ranks of c.backend, rank r's model, batches and
// reference on RankDevice(backend, r) (cuda:r for NCCL, else the CPU). Skips the test, saying
// why, where the backend cannot run here (no CUDA build, too few GPUs, no LibTorch CUDA).
template <class Config>
void RunCase(const Case<Config>& c,
             const std::function<void(const Config&, const comm::ProcessGroupPtr&, c10::Device)>& body) {
  FSDP_SKIP_IF_BACKEND_UNAVAILABLE(c.backend, c.world);
  ::fsdp::testing::RunOnRanks(c.backend, c.world, [c, body](const comm::ProcessGroupPtr& pg) {
    body(c.cfg, pg, ::fsdp::testing::RankDevice(c.backend, pg->rank()));
  });
}

// The same deterministic values in the reference and the model (before FSDP wraps it), then
// both on `device` (Module::to swaps each parameter's data in place: tied parameters stay one
// tensor).
template <class Model>
void InitPair(Model& ref, Model& model, c10::Device device) {
  test_models::InitDeterministic(*ref);
  test_models::InitDeterministic(*model);
  if (!device.is_cpu()) {
    ref->to(device);
    model->to(device);
  }
}

// This rank's place in a run.
struct Run {
  int world = 1;
  int rank = 0;
  c10::Device device = c10::Device(c10::kCPU);  // where the batches go
  int steps = 1;
  int micro_batches = 1;  // > 1: all but the last accumulate without gradient sync
};

// The FSDP side of the training loop.
struct Trainee {
  std::vector<at::Tensor> params;  // what its AdamW steps (the sharded parameters)
  // Forward, loss and backward of this rank's rows `x`, `y` of one micro-batch. `sync` false:
  // accumulate without gradient communication (FSDP1's no_sync, FSDP2's
  // set_requires_gradient_sync(false)).
  std::function<void(const at::Tensor& x, const at::Tensor& y, bool sync)> micro_batch;
  // Optional: after a step's last backward (the reference's gradients are there too), before
  // the optimizers step.
  std::function<void(int step)> before_step;
  // Optional: after both optimizers stepped and zeroed the gradients.
  std::function<void(int step)> after_step;
};

// `run.steps` AdamW steps at kLr of the reference `ref_forward` (its optimizer over
// `ref_params`) and of the trainee, each over `run.micro_batches` micro-batches of kBatch rows
// (x = Batch(10 * step + mb, kBatch, 3, 1), y = Batch(10 * step + mb, kBatch, 1, 2)): the
// reference trains on the whole batch with an MSE loss and sums the micro-batches by gradient
// accumulation; the trainee gets rows [rank * kBatch / world, (rank + 1) * kBatch / world).
void Train(const Run& run, const std::function<at::Tensor(const at::Tensor&)>& ref_forward,
           const std::vector<at::Tensor>& ref_params, const Trainee& trainee);

// Train with the reference module `ref` (its distinct parameters: a tied tensor once).
template <class Model>
void Train(const Run& run, Model& ref, const Trainee& trainee) {
  Train(
      run, [&ref](const at::Tensor& x) { return ref(x); }, test_models::UniqueParameters(*ref), trainee);
}

}  // namespace fsdp::parity

#endif  // FSDP_FSDP_COMMON_PARITY_HARNESS_H_
