#include "bench/pipeline_overhead_floor.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "bench/callgrind_loop.h"

namespace fsdp::bench {

using pipelining::ActionType;

std::shared_ptr<torch::nn::LinearImpl> TinyLinear() {
  auto l = std::make_shared<torch::nn::LinearImpl>(1, 1);
  at::NoGradGuard no_grad;
  l->weight.fill_(0.5);
  l->bias.fill_(0.1);
  return l;
}

RawLoop RawLoopOf(pipelining::ScheduleKind kind, bool split) {
  return {.v = pipelining::IsSingleStageSchedule(kind) ? 1 : 2,
          .v_shaped = pipelining::IsVShapedSchedule(kind),
          .split = split};
}

void RunRawLoop(benchmark::State& state, const comm::ProcessGroupPtr& group, RawLoop loop, int microbatches) {
  const int m = microbatches;
  const int p = group->size(), rank = group->rank(), v = loop.v, n = p * v;
  const auto stage_of = [&](int c) { return loop.v_shaped && c == 1 ? 2 * p - 1 - rank : c * p + rank; };
  const auto rank_of = [&](int s) { return loop.v_shaped && s >= p ? 2 * p - 1 - s : s % p; };
  std::vector<std::shared_ptr<torch::nn::LinearImpl>> layers;
  for (int c = 0; c < v; ++c) layers.push_back(TinyLinear());
  const at::Tensor x = at::linspace(-1, 1, m).reshape({m, 1});
  const at::Tensor target = x * 0.3;
  auto step = [&] {
    std::vector<std::vector<at::Tensor>> inputs(v), outputs(v), output_grads(v);
    std::vector<at::Tensor> handed(m);  // per microbatch, between this rank's two stages
    std::vector<comm::WorkPtr> sends;
    for (int c = 0; c < v; ++c) {
      const int s = stage_of(c);
      for (int mb = 0; mb < m; ++mb) {
        at::Tensor in;
        if (s == 0) {
          in = x.narrow(0, mb, 1);
        } else if (rank_of(s - 1) == rank) {
          in = handed[mb].requires_grad_(true);
        } else {
          in = at::empty({1, 1});
          group->recv(in, rank_of(s - 1), 2 * s)->wait();
          in.requires_grad_(true);
        }
        at::Tensor out = layers[c]->forward(in);
        if (s == n - 1) {
          out = at::mse_loss(out, target.narrow(0, mb, 1));
        } else if (rank_of(s + 1) == rank) {
          handed[mb] = out.detach();
        } else {
          sends.push_back(group->send(out.detach(), rank_of(s + 1), 2 * (s + 1)));
        }
        inputs[c].push_back(in);
        outputs[c].push_back(out);
      }
    }
    for (auto& w : sends) w->wait();
    sends.clear();
    for (int c = v - 1; c >= 0; --c) {
      const int s = stage_of(c);
      for (int mb = 0; mb < m; ++mb) {
        std::vector<at::Tensor> grad;  // empty: the output is the loss
        if (s < n - 1 && rank_of(s + 1) == rank) {
          grad.push_back(handed[mb]);
        } else if (s < n - 1) {
          grad.push_back(at::empty({1, 1}));
          group->recv(grad[0], rank_of(s + 1), 2 * s + 1)->wait();
        }
        if (!loop.split) {
          torch::autograd::backward({outputs[c][mb]}, grad);
        } else if (s > 0) {
          inputs[c][mb].mutable_grad() =
              torch::autograd::grad({outputs[c][mb]}, {inputs[c][mb]}, grad, /*retain_graph=*/true)[0];
        }
        if (s > 0 && rank_of(s - 1) == rank) {
          handed[mb] = inputs[c][mb].grad();
        } else if (s > 0) {
          sends.push_back(group->send(inputs[c][mb].grad(), rank_of(s - 1), 2 * (s - 1) + 1));
        }
        if (loop.split) output_grads[c].push_back(grad.empty() ? at::Tensor() : grad[0]);
      }
    }
    for (int c = v - 1; c >= 0 && loop.split; --c) {
      const std::vector<at::Tensor> params = layers[c]->parameters();
      for (int mb = 0; mb < m; ++mb) {
        std::vector<at::Tensor> grad;
        if (output_grads[c][mb].defined()) grad.push_back(output_grads[c][mb]);
        torch::autograd::backward({outputs[c][mb]}, grad, /*retain_graph=*/false, /*create_graph=*/false,
                                  /*inputs=*/stage_of(c) == 0 ? std::vector<at::Tensor>{} : params);
      }
    }
    for (auto& w : sends) w->wait();
  };
  for (int i = 0; i < 3; ++i) step();
  group->barrier()->wait();
  TimedLoop(state, absl::StrCat(loop.Name(), "/ours/", m), step);
  group->barrier()->wait();
}

SplitShare SplitShareOf(const std::vector<pipelining::Action>& actions) {
  int inputs = 0, full = 0;
  for (const pipelining::Action& a : actions) {
    inputs += a.type == ActionType::kBackwardInput;
    full += a.type == ActionType::kFullBackward;
  }
  const int merged = static_cast<int>(pipelining::InputBackwardsFollowedByTheirWeight(actions).size());
  if (inputs + full == 0) return {};
  return {.ours = static_cast<double>(inputs - merged) / (inputs + full),
          .pytorch = static_cast<double>(inputs) / (inputs + full)};
}

}  // namespace fsdp::bench
