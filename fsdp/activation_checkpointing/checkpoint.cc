#include "fsdp/activation_checkpointing/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include <memory>
#include <mutex>
#include <optional>
#include <utility>

namespace fsdp::activation_checkpointing {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What one checkpointed call keeps for its backward besides the inputs (saved on the context
// with save_for_backward, so in-place changes to them are caught by the version counter).
// A CustomClassHolder so it can live in AutogradContext::saved_data as an IValue capsule.
struct CheckpointState : torch::CustomClassHolder {
  CheckpointMultiFn fn;
  CheckpointOptions options;
  size_t num_inputs = 0;  // the user's inputs; a dummy may follow them
  bool has_dummy = false;
  std::vector<bool> requires_grad;  // of the user's inputs, for their recomputation copies
  // RNG states at the first forward: the CPU generator and each other device's default
  // generator among the inputs (PyTorch: get_device_states + torch.get_rng_state).
  at::Tensor cpu_rng_state;
  std::vector<std::pair<c10::Device, at::Tensor>> device_rng_states;
  struct Meta {
    std::vector<int64_t> sizes;
    c10::ScalarType dtype;
    c10::Device device;
  };
  std::vector<Meta> outputs;                            // for the determinism check
  std::shared_ptr<internal::SelectiveCache> selective;  // the kept outputs; null without a policy
};

// Generator is a shared handle: copies lock and read the same generator.
at::Tensor GetState(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}
void SetState(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// torch.random.fork_rng: installs the forward's RNG states for the recomputation and puts the
// caller's back afterwards (also on exceptions), so backward's own random stream is untouched.
class RngFork {
 public:
  explicit RngFork(const CheckpointState& s) {
    if (!s.options.preserve_rng_state) return;
    saved_cpu_ = GetState(at::detail::getDefaultCPUGenerator());
    SetState(at::detail::getDefaultCPUGenerator(), s.cpu_rng_state);
    for (const auto& [device, state] : s.device_rng_states) {
      at::Generator gen = at::globalContext().defaultGenerator(device);
      saved_devices_.emplace_back(device, GetState(gen));
      SetState(gen, state);
    }
  }
  ~RngFork() {
    if (saved_cpu_.defined()) SetState(at::detail::getDefaultCPUGenerator(), saved_cpu_);
    for (const auto& [device, state] : saved_devices_) SetState(at::globalContext().defaultGenerator(device), state);
  }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  at::Tensor saved_cpu_;
  std::vector<std::pair<c10::Device, at::Tensor>> saved_devices_;
};

std::vector<at::Tensor> CallChecked(const CheckpointState& s, const std::vector<at::Tensor>& inputs) {
  std::vector<at::Tensor> outs = s.fn(inputs);
  for (size_t i = 0; i < outs.size(); ++i) {
    TORCH_CHECK(outs[i].defined(), "checkpoint: fn returned an undefined tensor as output ", i);
  }
  return outs;
}

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // Function::apply runs this with grad mode off: `fn` builds no graph and saves nothing.
  // `inputs` is the user's inputs, possibly followed by a dummy that requires grad.
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<CheckpointState> state, at::TensorList inputs) {
    const std::vector<at::Tensor> user(inputs.begin(), inputs.begin() + static_cast<int64_t>(state->num_inputs));
    std::vector<at::Tensor> outs;
    if (state->options.selective_policy) {
      state->selective = internal::MakeSelectiveCache(state->options.selective_policy());
      internal::SelectiveScope scope(state->selective, internal::SelectiveScope::Phase::kForward);
      outs = CallChecked(*state, user);
    } else {
      outs = CallChecked(*state, user);
    }
    for (const at::Tensor& o : outs) state->outputs.push_back({o.sizes().vec(), o.scalar_type(), o.device()});
    ctx->save_for_backward(user);
    // Unused outputs get no gradient: skip them rather than backpropagate zeros.
    ctx->set_materialize_grads(false);
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return outs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(ctx->saved_data["state"].toCapsule());
    // The nested backward below accumulates into every leaf it reaches; torch::autograd::grad
    // (or backward with `inputs`) asked for some gradients only and must not see .grad change.
    TORCH_CHECK(torch::autograd::Engine::get_default_engine().is_checkpoint_valid(),
                "checkpoint: not compatible with torch::autograd::grad() or backward() with `inputs`: "
                "call backward() without `inputs` (PyTorch's reentrant checkpoint has the same limit)");
    const variable_list saved = ctx->get_saved_variables();
    std::vector<at::Tensor> detached;
    detached.reserve(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      detached.push_back(saved[i].detach());
      detached.back().set_requires_grad(state->requires_grad[i]);
    }
    std::vector<at::Tensor> outs;
    {
      RngFork fork(*state);
      at::AutoGradMode enable_grad(true);  // the engine runs backward functions without grad
      std::optional<internal::SelectiveScope> scope;
      if (state->selective) scope.emplace(state->selective, internal::SelectiveScope::Phase::kRecompute);
      outs = CallChecked(*state, detached);
    }
    if (state->options.determinism_check) {
      TORCH_CHECK(outs.size() == state->outputs.size(), "checkpoint: the recomputation returned ", outs.size(),
                  " outputs, the first forward ", state->outputs.size(),
                  " (fn must compute the same thing both times; see CheckpointOptions::determinism_check)");
      for (size_t i = 0; i < outs.size(); ++i) {
        const CheckpointState::Meta& m = state->outputs[i];
        TORCH_CHECK(outs[i].sizes() == c10::IntArrayRef(m.sizes) && outs[i].scalar_type() == m.dtype &&
                        outs[i].device() == m.device,
                    "checkpoint: recomputed output ", i, " is ", outs[i].sizes(), " ", outs[i].scalar_type(), " on ",
                    outs[i].device(), ", the first forward's was ", c10::IntArrayRef(m.sizes), " ", m.dtype, " on ",
                    m.device, " (fn must compute the same thing both times)");
      }
    }
    std::vector<at::Tensor> roots, grads;
    for (size_t i = 0; i < outs.size() && i < grad_outputs.size(); ++i) {
      if (outs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    // A nested (reentrant) backward: parameter gradients accumulate here, as they would have
    // in the outer backward.
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    variable_list result;
    result.push_back(at::Tensor());  // the state argument
    for (const at::Tensor& d : detached) result.push_back(d.requires_grad() ? d.grad() : at::Tensor());
    if (state->has_dummy) result.push_back(at::Tensor());  // it needs no gradient
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> checkpoint_multi(CheckpointMultiFn fn, const std::vector<at::Tensor>& inputs,
                                         CheckpointOptions options) {
  TORCH_CHECK(fn != nullptr, "checkpoint: fn is empty");
  bool any_requires_grad = false;
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK(inputs[i].defined(), "checkpoint: inputs[", i, "] is an undefined tensor");
    any_requires_grad = any_requires_grad || inputs[i].requires_grad();
  }
  // Nothing will be differentiated (inference, evaluation): there is nothing to recompute.
  if (!at::GradMode::is_enabled()) return fn(inputs);
  bool params_require_grad = !options.params.has_value();
  if (options.params) {
    for (size_t i = 0; i < options.params->size(); ++i) {
      TORCH_CHECK((*options.params)[i].defined(), "checkpoint: options.params[", i, "] is an undefined tensor");
      params_require_grad = params_require_grad || (*options.params)[i].requires_grad();
    }
  }
  auto state = c10::make_intrusive<CheckpointState>();
  state->fn = std::move(fn);
  state->num_inputs = inputs.size();
  for (const at::Tensor& t : inputs) state->requires_grad.push_back(t.requires_grad());
  if (options.preserve_rng_state) {
    state->cpu_rng_state = GetState(at::detail::getDefaultCPUGenerator());
    for (const at::Tensor& t : inputs) {
      const c10::Device d = t.device();
      if (d.is_cpu() || d.is_meta()) continue;
      bool seen = false;
      for (const auto& [device, s] : state->device_rng_states) seen = seen || device == d;
      if (!seen) state->device_rng_states.emplace_back(d, GetState(at::globalContext().defaultGenerator(d)));
    }
  }
  state->options = std::move(options);
  state->options.params.reset();  // only their flags mattered; do not keep them alive
  std::vector<at::Tensor> fn_inputs = inputs;
  // Parameters read inside fn need the Function node even when no input requires grad; a
  // 0-element leaf makes the outputs require grad (torch's non-reentrant semantics).
  state->has_dummy = !any_requires_grad && params_require_grad;
  if (state->has_dummy) fn_inputs.push_back(at::empty({0}).set_requires_grad(true));
  return CheckpointFunction::apply(state, at::TensorList(fn_inputs));
}

at::Tensor checkpoint(CheckpointFn fn, const std::vector<at::Tensor>& inputs, CheckpointOptions options) {
  TORCH_CHECK(fn != nullptr, "checkpoint: fn is empty");
  std::vector<at::Tensor> outs = checkpoint_multi(
      [fn = std::move(fn)](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{fn(in)}; }, inputs,
      std::move(options));
  return outs.front();
}

}  // namespace fsdp::activation_checkpointing
