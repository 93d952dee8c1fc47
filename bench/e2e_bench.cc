// bench/e2e: one FSDP2 training step (forward + backward + AdamW) end to end on W processes
// over Gloo, next to what it is made of, all measured in one run:
//   step_ms     median step time with fully_shard (max over ranks of each rank's median);
//   compute_ms  the same model without FSDP on this rank's local batch (no communication);
//   comm_ms     the step's collectives replayed raw: the same ops and sizes, recorded by a
//               CommTrace during a step, issued directly on the process group;
//   overhead_ms step - compute - comm: FSDP's own CPU cost (bookkeeping, copies, hooks).
// Prints one JSON line per model on rank 0; bench/peer/e2e_peer.py prints the same for
// PyTorch's FSDP2, and `./x bench --peer` puts them side by side.
//
//   ./x run -n 2 "$(bazel info --config=opt bazel-bin)/bench/e2e_bench" --model=overhead
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "comm/comm_trace.h"
#include "comm/gloo_process_group.h"
#include "fsdp/per_param/fully_shard.h"

ABSL_FLAG(std::string, model, "overhead", "overhead (64 x Linear(64,64)+LayerNorm, batch 8/rank) or compute (4 x Linear(1024,1024), batch 64/rank)");
ABSL_FLAG(int, steps, 20, "timed steps (after 3 warm-up steps)");

namespace {

using fsdp::per_param::FullySharded;

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t width, bool norm)
      : fc(register_module("fc", torch::nn::Linear(width, width))) {
    if (norm) ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  }
  at::Tensor forward(const at::Tensor& x) { return x + fc(ln ? ln(x) : x).relu(); }
  torch::nn::Linear fc;
  torch::nn::LayerNorm ln{nullptr};
};

struct NetImpl : torch::nn::Module {
  NetImpl(int64_t blocks, int64_t width, bool norm) {
    for (int64_t i = 0; i < blocks; ++i) layers.push_back(register_module(absl::StrCat("block", i), FullySharded<BlockImpl>(width, norm)));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (auto& b : layers) h = b(h);
    return h;
  }
  std::vector<FullySharded<BlockImpl>> layers;
};

struct ModelSpec {
  int64_t blocks, width, batch;
  bool norm;
};

ModelSpec Spec(const std::string& name) {
  if (name == "overhead") return {64, 64, 8, true};
  if (name == "compute") return {4, 1024, 64, false};
  std::fprintf(stderr, "--model must be overhead or compute, got '%s'\n", name.c_str());
  std::exit(2);
}

FullySharded<NetImpl> Build(const ModelSpec& s) {
  FullySharded<NetImpl> m(s.blocks, s.width, s.norm);
  at::NoGradGuard no_grad;
  uint64_t seed = 1;
  for (auto& p : m->parameters()) p.copy_(at::randn(p.sizes(), at::make_generator<at::CPUGeneratorImpl>(seed++)) * 0.05);
  return m;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class Fn>
double MedianMs(int steps, fsdp::comm::ProcessGroup* barrier_group, Fn&& fn) {
  for (int i = 0; i < 3; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < steps; ++i) {
    if (barrier_group) barrier_group->barrier()->wait();
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return Median(ms);
}

double MaxOverRanks(fsdp::comm::ProcessGroup& pg, double v) {
  at::Tensor t = at::full({1}, v, at::kDouble);
  pg.all_reduce(t, fsdp::comm::ReduceOp::Max())->wait();
  return t.item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  at::set_num_threads(1);  // W processes share the machine's cores
  const ModelSpec spec = Spec(absl::GetFlag(FLAGS_model));
  const int steps = absl::GetFlag(FLAGS_steps);
  auto world = fsdp::comm::CreateGlooProcessGroupFromEnv();
  auto trace = std::make_shared<fsdp::comm::CommTrace>(world);
  const int w = world->size();
  const at::Tensor x = at::randn({spec.batch, spec.width}, at::make_generator<at::CPUGeneratorImpl>(100 + world->rank()));

  auto model = Build(spec);
  auto mesh = fsdp::mesh::DeviceMesh::Create(trace, {w});
  for (auto& b : model->layers) fsdp::per_param::fully_shard(b.ptr(), {.mesh = mesh});
  fsdp::per_param::fully_shard(model.ptr(), {.mesh = mesh});
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto step = [&](auto& m, torch::optim::Optimizer& o) {
    m(x).square().mean().backward();
    o.step();
    o.zero_grad();
  };
  const double step_ms = MaxOverRanks(*world, MedianMs(steps, world.get(), [&] { step(model, opt); }));

  // The collectives of one step, replayed raw.
  trace->clear();
  step(model, opt);
  const auto records = trace->records();
  int64_t bytes = 0;
  std::vector<std::pair<at::Tensor, at::Tensor>> buffers;
  for (const auto& r : records) {
    buffers.emplace_back(at::empty({r.output_numel}, at::TensorOptions(r.dtype)), at::zeros({r.input_numel}, at::TensorOptions(r.dtype)));
    bytes += std::max(r.input_bytes, r.output_bytes);
  }
  const double comm_ms = MaxOverRanks(*world, MedianMs(steps, world.get(), [&] {
    for (size_t i = 0; i < records.size(); ++i) {
      auto& [out, in] = buffers[i];
      if (records[i].op == "all_gather_into_tensor") world->all_gather_into_tensor(out, in)->wait();
      else if (records[i].op == "reduce_scatter_tensor") world->reduce_scatter_tensor(out, in, fsdp::comm::ReduceOp::Avg())->wait();
      else if (records[i].op == "all_reduce") world->all_reduce(in)->wait();
    }
  }));

  // The same model without FSDP, this rank's batch, every rank at once (as in the step).
  auto plain = Build(spec);
  torch::optim::AdamW plain_opt(plain->parameters(), torch::optim::AdamWOptions(1e-3));
  const double compute_ms = MaxOverRanks(*world, MedianMs(steps, world.get(), [&] { step(plain, plain_opt); }));

  if (world->rank() == 0) {
    std::printf("{\"impl\": \"ours\", \"model\": \"%s\", \"world\": %d, \"params\": %zu, \"step_ms\": %.3f, "
                "\"compute_ms\": %.3f, \"comm_ms\": %.3f, \"overhead_ms\": %.3f, \"collectives\": %zu, \"bytes\": %lld}\n",
                absl::GetFlag(FLAGS_model).c_str(), w, plain->parameters().size(), step_ms, compute_ms, comm_ms,
                step_ms - compute_ms - comm_ms, records.size(), static_cast<long long>(bytes));
  }
  return 0;
}
