#include "fsdp/common/parity_harness.h"

#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <algorithm>

#include "testing/float_tolerance.h"

namespace fsdp::parity {

double ParamTolerance(int steps, bool bf16_params) {
  return bf16_params ? 3 * kLr : ::fsdp::testing::AdamWParityTolerance(steps, kLr);
}

void ExpectParamsMatch(const std::map<std::string, at::Tensor>& full, torch::nn::Module& ref, double tol,
                       const std::string& label) {
  const auto ref_params = ref.named_parameters();
  for (const auto& [name, got] : full) {
    const at::Tensor* want = ref_params.find(name);
    if (want == nullptr) {
      ADD_FAILURE() << label << ": no reference parameter named " << name;
      continue;
    }
    const at::Tensor expected = want->detach();
    const double scale = std::max(1.0, expected.abs().max().item<double>());
    const double diff = (got.to(expected.scalar_type()) - expected).abs().max().item<double>();
    EXPECT_LE(diff, tol * scale) << label << " " << name;
  }
  EXPECT_EQ(full.size(), test_models::UniqueParameters(ref).size()) << label << ": parameters compared";
}

void Train(const Run& run, const std::function<at::Tensor(const at::Tensor&)>& ref_forward,
           const std::vector<at::Tensor>& ref_params, const Trainee& trainee) {
  torch::optim::AdamW ref_opt(ref_params, torch::optim::AdamWOptions(kLr));
  torch::optim::AdamW opt(trainee.params, torch::optim::AdamWOptions(kLr));
  const int64_t local = kBatch / run.world;
  for (int step = 0; step < run.steps; ++step) {
    for (int mb = 0; mb < run.micro_batches; ++mb) {
      const at::Tensor x = test_models::Batch(step * 10 + mb, kBatch, 3, 1).to(run.device);
      const at::Tensor y = test_models::Batch(step * 10 + mb, kBatch, 1, 2).to(run.device);
      torch::nn::functional::mse_loss(ref_forward(x), y).backward();
      // Data-parallel ranks (the whole world, HSDP replicas included) split the batch.
      trainee.micro_batch(x.narrow(0, run.rank * local, local), y.narrow(0, run.rank * local, local),
                          /*sync=*/mb + 1 == run.micro_batches);
    }
    if (trainee.before_step) trainee.before_step(step);
    ref_opt.step();
    ref_opt.zero_grad();
    opt.step();
    opt.zero_grad();
    if (trainee.after_step) trainee.after_step(step);
  }
}

}  // namespace fsdp::parity
