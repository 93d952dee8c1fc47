// bench/e2e: one FSDP training step (forward + backward + AdamW) end to end on W processes
// over Gloo, FSDP2 (fully_shard, --fsdp=2) or FSDP1 (wrap_fsdp FULL_SHARD, --fsdp=1), each
// block wrapped then the root, next to what it is made of, all measured in one run:
//   step_ms     median step time with FSDP (max over ranks of each rank's median);
//   compute_ms  the same model without FSDP on this rank's local batch (no communication);
//   comm_ms     the step's collectives replayed raw: the same ops, sizes and reductions,
//               recorded by a CommTrace during a step, issued directly on the process group;
//   overhead_ms step - compute - comm: FSDP's own CPU cost (bookkeeping, copies, hooks).
// Memory (max over ranks, bytes; see metrics/allocation_window.h), measured as bench/peer/e2e_peer.py
// measures PyTorch:
//   rss_base / rss_peak  resident set before building the model / high-water mark after the
//                        timed steps (getrusage ru_maxrss);
//   alloc_peak           on a second model: the most LibTorch CPU bytes live at once during 3
//                        training steps, counting everything allocated since before the model
//                        was built (sharded parameters, gradients, optimizer state, buffers
//                        FSDP keeps, unsharded parameters, activations);
//   alloc_end            of those, the bytes still live after the steps (zero_grad'ed);
//   numel, group_numel   parameter elements in all / in the largest FSDP unit (for the
//                        ZeRO-3 estimate tools/e2e_table.py prints);
//   predicted_peak       `fsdp_plan --memory`'s prediction of alloc_peak (tools/fsdp_memory.h)
//                        from the block's shapes, the block count and what a block saves for
//                        backward (ModelSpec::activation_bytes).
// Prints one JSON line on rank 0; bench/peer/e2e_peer.py prints the same for PyTorch's FSDP,
// and `./x bench --peer` puts them side by side.
//
//   ./x run -n 2 "$(bazel info --config=opt bazel-bin)/bench/e2e_bench" --model=overhead --fsdp=1
// --device=cuda (a --config=cuda build): rank r on cuda:LOCAL_RANK over NCCL (c10d's
// ProcessGroupNCCL); step times end with a synchronization of the current stream; the
// allocation fields are -1 (they count LibTorch's CPU allocator). --trace=PREFIX writes one
// profiled step per rank as a Chrome trace, PREFIX.rank<R>.json (Kineto: CPU, and CUDA
// kernels and collectives on a GPU), to see communication overlap compute.
// --detect_nonfinite_grads turns the non-finite gradient sentinel on (its cost: the step_ms
// of the same run with and without it).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "comm/comm_trace.h"
#include "comm/init_process_group.h"
#include "comm/main_guard.h"
#include "fsdp/fsdp1/fully_sharded_data_parallel.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "metrics/allocation_window.h"
#include "tools/fsdp_memory.h"
#include "tools/fsdp_plan_lib.h"

ABSL_FLAG(std::string, model, "overhead",
          "overhead (64 x Linear(64,64)+LayerNorm, batch 8/rank) or compute (4 x Linear(1024,1024), batch 64/rank)");
ABSL_FLAG(int, steps, 20, "timed steps (after 3 warm-up steps)");
ABSL_FLAG(int, fsdp, 2, "2: FSDP2 (fully_shard), 1: FSDP1 (wrap_fsdp, FULL_SHARD, flat parameters to the optimizer)");
ABSL_FLAG(std::string, device, "cpu", "cpu (Gloo) or cuda (NCCL, rank on cuda:LOCAL_RANK; a --config=cuda build)");
ABSL_FLAG(std::string, trace, "", "PREFIX: write one profiled FSDP step per rank to PREFIX.rank<R>.json (empty: none)");
ABSL_FLAG(bool, detect_nonfinite_grads, false,
          "turn on the non-finite gradient sentinel (FullyShardOptions / FSDPOptions::detect_nonfinite_grads)");

namespace {

using fsdp::Hooked;
using fsdp::comm::ProcessGroup;
using fsdp::comm::ProcessGroupPtr;
using fsdp::comm::ReduceOp;

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t width, bool norm) : fc(register_module("fc", torch::nn::Linear(width, width))) {
    if (norm) ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  }
  at::Tensor forward(const at::Tensor& x) { return x + fc(ln ? ln(x) : x).relu(); }
  torch::nn::Linear fc;
  torch::nn::LayerNorm ln{nullptr};
};

// Blocks of Hooked<BlockImpl>: one model type for FSDP2 and FSDP1, running the plain forward
// until sharded.
struct NetImpl : torch::nn::Module {
  NetImpl(int64_t blocks, int64_t width, bool norm) {
    for (int64_t i = 0; i < blocks; ++i)
      layers.push_back(register_module(absl::StrCat("block", i), Hooked<BlockImpl>(width, norm)));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (auto& b : layers) h = b(h);
    return h;
  }
  std::vector<Hooked<BlockImpl>> layers;
};
using Net = Hooked<NetImpl>;

struct ModelSpec {
  int64_t blocks, width, batch;
  bool norm;
  int64_t block_numel() const { return width * width + width + (norm ? 2 * width : 0); }
  // What a block saves for backward, per rank: addmm its input, ReLU its output, LayerNorm
  // its input and per-row mean and rstd (float32).
  int64_t activation_bytes() const { return 4 * (2 * batch * width + (norm ? batch * width + 2 * batch : 0)); }
  std::string shapes() const {
    return absl::StrCat(width, "x", width, ",", width, norm ? absl::StrCat(",", width, ",", width) : "");
  }
};

// fsdp_plan --memory's predicted allocation peak per rank for this model on `world` ranks.
int64_t PredictedPeak(const ModelSpec& s, int world, int fsdp_version) {
  fsdp_plan::RawFlags flags;
  flags.shapes = s.shapes();
  flags.world = std::to_string(world);
  flags.style = fsdp_version == 1 ? "fsdp1" : "fsdp2";
  flags.align = false;  // wrap_fsdp's default use_orig_params = false
  fsdp_plan::PlanOptions options;
  const std::string error = fsdp_plan::ParseOptions(flags, &options);
  TORCH_CHECK(error.empty(), "PredictedPeak: ", error);
  const fsdp_plan::MemoryOptions memory{.units = s.blocks, .activation_bytes = s.activation_bytes()};
  return fsdp_plan::EstimateMemory(fsdp_plan::MakePlan(options), memory).peak;
}

ModelSpec Spec(const std::string& name) {
  if (name == "overhead") return {64, 64, 8, true};
  if (name == "compute") return {4, 1024, 64, false};
  std::fprintf(stderr, "--model must be overhead or compute, got '%s'\n", name.c_str());
  std::exit(2);
}

Net Build(const ModelSpec& s, c10::Device device) {
  Net m(s.blocks, s.width, s.norm);
  at::NoGradGuard no_grad;
  uint64_t seed = 1;
  for (auto& p : m->parameters())
    p.copy_(at::randn(p.sizes(), at::make_generator<at::CPUGeneratorImpl>(seed++)) * 0.05);
  if (!device.is_cpu()) m->to(device);
  return m;
}

// Waits until the work queued on the current stream finished (a no-op on the CPU): a
// one-element copy to the host is ordered after it.
void Sync(c10::Device device) {
  if (!device.is_cpu()) (void)at::zeros({1}, at::TensorOptions(device)).item<float>();
}

// FSDP `fsdp_version` (1 or 2) on each block, then the root, over `group`; returns what the
// optimizer gets.
std::vector<at::Tensor> Shard(Net& m, const ProcessGroupPtr& group, int fsdp_version, c10::Device device) {
  if (fsdp_version == 1) {
    const fsdp::fsdp1::FSDPOptions options{.process_group = group,
                                           .sharding_strategy = fsdp::fsdp1::ShardingStrategy::FULL_SHARD,
                                           .device = device,
                                           .detect_nonfinite_grads = absl::GetFlag(FLAGS_detect_nonfinite_grads)};
    for (auto& b : m->layers) fsdp::fsdp1::wrap_fsdp(b.ptr(), options);
    return fsdp::fsdp1::wrap_fsdp(m.ptr(), options).parameters();
  }
  auto mesh = fsdp::mesh::DeviceMesh::Create(group, {group->size()});
  const fsdp::fsdp2::FullyShardOptions options{
      .mesh = mesh, .device = device, .detect_nonfinite_grads = absl::GetFlag(FLAGS_detect_nonfinite_grads)};
  for (auto& b : m->layers) fsdp::fsdp2::fully_shard(b.ptr(), options);
  fsdp::fsdp2::fully_shard(m.ptr(), options);
  return m->parameters();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class Fn>
double MedianMs(int steps, ProcessGroup* barrier_group, Fn&& fn) {
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

double MaxOverRanks(ProcessGroup& pg, double v, c10::Device device) {
  at::Tensor t = at::full({1}, v, at::TensorOptions(at::kDouble).device(device));
  pg.all_reduce(t, ReduceOp::Max())->wait();
  return t.item<double>();
}

// CollectiveRecord::reduce_op ("SUM", "AVG", "MAX", "MIN", "PREMUL_SUM(f)") back to a ReduceOp.
ReduceOp ParseReduceOp(const std::string& s) {
  if (s == "AVG") return ReduceOp::Avg();
  if (s == "MAX") return ReduceOp::Max();
  if (s == "MIN") return ReduceOp::Min();
  if (s.rfind("PREMUL_SUM(", 0) == 0) return ReduceOp::PremulSum(std::stod(s.substr(11)));
  return ReduceOp::Sum();
}

// One profiled step per rank, as a Chrome trace at PREFIX.rank<R>.json.
template <class Fn>
void TraceStep(const std::string& prefix, int rank, c10::Device device, Fn&& step) {
  namespace profiler = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  std::set<ActivityType> activities{ActivityType::CPU};
  if (device.is_cuda()) activities.insert(ActivityType::CUDA);
  const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
  profiler::prepareProfiler(config, activities);
  profiler::enableProfiler(config, activities);
  step();
  Sync(device);
  profiler::disableProfiler()->save(absl::StrCat(prefix, ".rank", rank, ".json"));
}

int Run(const ModelSpec& spec, int steps, int fsdp_version, c10::Device device, const ProcessGroupPtr& world) {
  auto trace = std::make_shared<fsdp::comm::CommTrace>(world);
  const int w = world->size();
  const at::Tensor x =
      at::randn({spec.batch, spec.width}, at::make_generator<at::CPUGeneratorImpl>(100 + world->rank())).to(device);
  auto step = [&](auto& m, torch::optim::Optimizer& o) {
    // The loss first, then backward, as two statements: in one expression the model's output
    // and its square (C++ temporaries) would live through the whole backward, 2 activations
    // that Python's `model(x).square().mean().backward()` (bench/peer/e2e_peer.py) frees as
    // soon as autograd no longer needs them (the allocation peak counted them: +512 KiB).
    const at::Tensor loss = m(x).square().mean();
    loss.backward();
    o.step();
    o.zero_grad();
    Sync(device);
  };
  auto max_over_ranks = [&](double v) { return MaxOverRanks(*world, v, device); };

  const double rss_base = max_over_ranks(fsdp::metrics::RssBytes());
  auto model = Build(spec, device);
  torch::optim::AdamW opt(Shard(model, trace, fsdp_version, device), torch::optim::AdamWOptions(1e-3));
  const double step_ms = max_over_ranks(MedianMs(steps, world.get(), [&] { step(model, opt); }));
  const double rss_peak = max_over_ranks(fsdp::metrics::RssPeakBytes());
  const std::string trace_prefix = absl::GetFlag(FLAGS_trace);
  if (!trace_prefix.empty()) TraceStep(trace_prefix, world->rank(), device, [&] { step(model, opt); });

  // The collectives of one step, replayed raw.
  trace->clear();
  step(model, opt);
  const auto records = trace->records();
  int64_t bytes = 0;
  std::vector<std::pair<at::Tensor, at::Tensor>> buffers;
  for (const auto& r : records) {
    buffers.emplace_back(at::empty({r.output_numel}, at::TensorOptions(r.dtype).device(device)),
                         at::zeros({r.input_numel}, at::TensorOptions(r.dtype).device(device)));
    bytes += std::max(r.input_bytes, r.output_bytes);
  }
  const double comm_ms = max_over_ranks(MedianMs(steps, world.get(), [&] {
    for (size_t i = 0; i < records.size(); ++i) {
      auto& [out, in] = buffers[i];
      const auto& r = records[i];
      if (r.op == "all_gather_into_tensor")
        world->all_gather_into_tensor(out, in)->wait();
      else if (r.op == "reduce_scatter_tensor")
        world->reduce_scatter_tensor(out, in, ParseReduceOp(r.reduce_op))->wait();
      else if (r.op == "all_reduce")
        world->all_reduce(in, ParseReduceOp(r.reduce_op))->wait();
    }
    Sync(device);
  }));

  // Memory: a second model, counted from before it is built (CPU allocations only: -1 on a GPU).
  double alloc_peak = -1, alloc_end = -1;
  if (device.is_cpu()) {
    fsdp::metrics::AllocationWindow window;
    auto mem_model = Build(spec, device);
    torch::optim::AdamW mem_opt(Shard(mem_model, world, fsdp_version, device), torch::optim::AdamWOptions(1e-3));
    window.Mark();  // the training peak, not the full model before sharding
    for (int i = 0; i < 3; ++i) step(mem_model, mem_opt);
    alloc_peak = max_over_ranks(window.peak());
    alloc_end = max_over_ranks(window.current());
  }

  // The same model without FSDP, this rank's batch, every rank at once (as in the step).
  auto plain = Build(spec, device);
  torch::optim::AdamW plain_opt(plain->parameters(), torch::optim::AdamWOptions(1e-3));
  const double compute_ms = max_over_ranks(MedianMs(steps, world.get(), [&] { step(plain, plain_opt); }));

  if (world->rank() == 0) {
    std::printf(
        "{\"impl\": \"ours\", \"fsdp\": %d, \"model\": \"%s\", \"world\": %d, \"params\": %zu, \"step_ms\": %.3f, "
        "\"compute_ms\": %.3f, \"comm_ms\": %.3f, \"overhead_ms\": %.3f, \"collectives\": %zu, \"bytes\": %lld, "
        "\"numel\": %lld, \"group_numel\": %lld, \"rss_base\": %.0f, \"rss_peak\": %.0f, "
        "\"alloc_peak\": %.0f, \"alloc_end\": %.0f, \"predicted_peak\": %lld}\n",
        absl::GetFlag(FLAGS_fsdp), absl::GetFlag(FLAGS_model).c_str(), w, plain->parameters().size(), step_ms,
        compute_ms, comm_ms, step_ms - compute_ms - comm_ms, records.size(), static_cast<long long>(bytes),
        static_cast<long long>(spec.blocks * spec.block_numel()), static_cast<long long>(spec.block_numel()), rss_base,
        rss_peak, alloc_peak, alloc_end, static_cast<long long>(PredictedPeak(spec, w, fsdp_version)));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Any error: one line "[rank R] error: ..." on stderr and exit 1 (comm/main_guard.h).
  return fsdp::comm::RunMain([&]() -> int {
    absl::ParseCommandLine(argc, argv);
    at::set_num_threads(1);  // W processes share the machine's cores
    const ModelSpec spec = Spec(absl::GetFlag(FLAGS_model));
    const int steps = absl::GetFlag(FLAGS_steps);
    const int fsdp_version = absl::GetFlag(FLAGS_fsdp);
    if (fsdp_version != 1 && fsdp_version != 2) {
      std::fprintf(stderr, "--fsdp must be 1 or 2, got %d\n", fsdp_version);
      return 2;
    }
    auto [group, device] = fsdp::comm::InitProcessGroupFromEnv(absl::GetFlag(FLAGS_device));
    return Run(spec, steps, fsdp_version, device, group);
  });
}
