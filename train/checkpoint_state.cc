// See checkpoint_state.h.
#include "train/checkpoint_state.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <optional>
#include <string>

namespace fsdp::train {
namespace {

const c10::IValue& At(const dcp::StateDict& state, const char* object, const std::string& key) {
  auto it = state.find(key);
  TORCH_CHECK(it != state.end(), "checkpoint: '", object, "' has no '", key, "'");
  return it->second;
}

int64_t IntAt(const dcp::StateDict& state, const char* object, const std::string& key) {
  const c10::IValue& v = At(state, object, key);
  TORCH_CHECK(v.isInt(), "checkpoint: '", object, ".", key, "' is a ", v.tagKind(), ", not an int");
  return v.toInt();
}

at::Tensor ByteTensorAt(const dcp::StateDict& state, const char* object, const std::string& key) {
  const c10::IValue& v = At(state, object, key);
  TORCH_CHECK(v.isTensor() && v.toTensor().scalar_type() == at::kByte && v.toTensor().dim() == 1, "checkpoint: '",
              object, ".", key, "' is not a 1-d uint8 tensor (a generator state)");
  return v.toTensor();
}

at::Tensor GeneratorState(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void SetGeneratorState(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace

dcp::StateDict TrainStateStateful::state_dict() const {
  return {{"step", progress_.step}, {"ntokens_seen", progress_.ntokens_seen}};
}

void TrainStateStateful::load_state_dict(const dcp::StateDict& state) {
  const int64_t step = IntAt(state, "train_state", "step");
  const int64_t ntokens = IntAt(state, "train_state", "ntokens_seen");
  TORCH_CHECK(step >= 0 && ntokens >= 0, "checkpoint: train_state step = ", step, ", ntokens_seen = ", ntokens,
              ": negative");
  progress_ = {step, ntokens};
}

dcp::StateDict LRSchedulersStateful::state_dict() const { return {{"last_epoch", schedulers_.last_epoch()}}; }

void LRSchedulersStateful::load_state_dict(const dcp::StateDict& state) {
  schedulers_.LoadLastEpoch(IntAt(state, "lr_scheduler", "last_epoch"));
}

dcp::StateDict DataLoaderStateful::state_dict() const {
  const DataLoaderState s = loader_.state();
  return {{"epoch", s.epoch}, {"windows_consumed", s.windows_consumed}, {"seed", s.seed}};
}

void DataLoaderStateful::load_state_dict(const dcp::StateDict& state) {
  loader_.LoadState({.epoch = IntAt(state, "dataloader", "epoch"),
                     .windows_consumed = IntAt(state, "dataloader", "windows_consumed"),
                     .seed = IntAt(state, "dataloader", "seed")});
}

dcp::StateDict RngStateful::state_dict() const {
  dcp::StateDict s{{"cpu", GeneratorState(at::detail::getDefaultCPUGenerator())}};
  if (at::hasCUDA()) {
    s.emplace("cuda", GeneratorState(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA))));
  }
  return s;
}

void RngStateful::load_state_dict(const dcp::StateDict& state) {
  const at::Tensor cpu = ByteTensorAt(state, "rng", "cpu");
  std::optional<at::Tensor> cuda;
  if (at::hasCUDA()) cuda = ByteTensorAt(state, "rng", "cuda");
  SetGeneratorState(at::detail::getDefaultCPUGenerator(), cpu);
  if (cuda) SetGeneratorState(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA)), *cuda);
}

}  // namespace fsdp::train
