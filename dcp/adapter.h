// The model adapters of //dcp, internal to it: what the DCP core (//dcp:core: planning,
// dedup, writing, `.metadata`, reading boxes, the optimizer-state keys, Stateful objects,
// AsyncSave) asks of a kind of model, so that the core knows nothing of FSDP. A model kind's
// adapter says, for each parameter it shards, which boxes of the global tensor this rank's
// local tensor holds (the same layout for the optimizer-state tensors shaped like it), how to
// gather such a tensor whole (full saves), where a load reads it and how the read value is
// installed, and how the optimizer's state is read and installed in that per-parameter form.
// Everything else (buffers, parameters no adapter shards, 0-d state, param groups) the core
// handles as whole tensors and values, which is also the whole story for a plain module.
//
// Kinds and their adapters (torch/distributed/checkpoint/state_dict.py does the same per
// FSDP flavour in _get_model_state_dict / _load_model_state_dict):
//   plain module (no FSDP)    the core's own (whole tensors), always linked
//   tensor parallel, no FSDP  the core's own (dcp/tp_adapter.h: DistributedParameterModule
//                             parameters as their DTensor boxes), always linked
//   "fully_shard" (FSDP2)     //dcp:fsdp2 (dcp/fsdp2_adapter.cc)
//   "wrap_fsdp" (FSDP1)       //dcp:fsdp1 (dcp/fsdp1_adapter.cc)
// The kind is the api_name() of the FSDPStateBase hooks in the model's tree
// (fsdp/common/fsdp_state_base.h); a tree holding two kinds is an error. An adapter library
// registers its factory from a static initializer and is alwayslink, so that linking it is
// all a binary does to get it: an FSDP2-only binary links //dcp:fsdp2 and no FSDP1 code.
// A model of a kind whose adapter is not linked is a c10::Error naming the Bazel target to
// link ("this model is FSDP1 (wrap_fsdp): link //dcp:fsdp1 ...").
//
// Contract of an adapter (a ModelAdapter made by its factory for one Save / Load / AsyncSave):
//  * The factory runs on every rank, outside forward/backward, before anything else of the
//    call; it may reshard (FSDP2 does), must not communicate, and throws a c10::Error
//    starting with `caller` for a model it cannot handle (the same on every rank).
//  * world(): the group the call is collective over (null: a world of one rank).
//  * Sharded(fqn): the layout of a parameter it shards under that name (every name of a tied
//    parameter), or null: the core then treats the tensor as whole and the same on every
//    rank. Layouts live as long as the adapter.
//  * A ShardedParam's boxes describe the local tensor exactly: each box's local part
//    (BoxOf) is its global box, boxes are disjoint, and over the ranks of the world the
//    boxes cover the global tensor (replicas may hold the same box: the save's dedup keeps
//    one). Boxes of a positive-dim optimizer-state tensor are the parameter's.
//  * Gather is collective over world(), called on every rank for every sharded tensor in the
//    same order (only for StateDictKind::kFull / kFullRank0, after CheckFullSave passed).
//  * Commit runs once all ranks read and checked everything; it must not communicate.
//  * The optimizer functions take and give the per-parameter form: keyed by FQN (the first
//    name of a tied parameter), a sharded parameter's positive-dim state tensors laid out
//    like its local tensor, everything else as the optimizer holds it. GetOptimState's
//    tensors alias the optimizer's; LoadOptimState may adopt the given tensors.
//  * Not thread-safe: one call at a time per model, as dcp.h's.
//
// A new source of sharded parameters: (1) teach ModelKindOf (adapter.cc) to recognize it and
// kKnownKinds the Bazel target of its adapter; (2) implement ShardedParam per parameter (the
// tensor-parallel adapter, dcp/tp_adapter.cc, is the smallest example: boxes from RunBoxes of
// dtensor::LocalSegments of the parameter's DTensorSpec, Gather a redistribute to Replicate,
// Commit a copy into the local tensor; the optimizer functions as the defaults here); (3)
// register its factory from an alwayslink cc_library in this package and add it to the //dcp
// bundle.
#ifndef FSDP_DCP_ADAPTER_H_
#define FSDP_DCP_ADAPTER_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/process_group.h"
#include "dcp/plan.h"
#include "optim_state/optim_state_dict.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace fsdp::dcp::internal {

// One parameter as this rank holds it, under a model kind that shards it.
class ShardedParam {
 public:
  ShardedParam(std::vector<int64_t> global_size, std::vector<int64_t> local_size, std::vector<Box> boxes,
               at::Tensor local, at::Tensor live)
      : global_size_(std::move(global_size)),
        local_size_(std::move(local_size)),
        boxes_(std::move(boxes)),
        local_(std::move(local)),
        live_(std::move(live)) {}
  virtual ~ShardedParam() = default;

  // The parameter's shape in the checkpoint.
  const std::vector<int64_t>& global_size() const { return global_size_; }
  // The shape of this rank's local tensor and of its positive-dim optimizer-state tensors.
  const std::vector<int64_t>& local_size() const { return local_size_; }
  // The boxes of the global tensor the local tensor holds; empty: none.
  const std::vector<Box>& boxes() const { return boxes_; }
  // Save: this rank's local tensor (aliases the model; detached). Undefined: this rank holds
  // none of the parameter, and neither saves nor loads it.
  const at::Tensor& local() const { return local_; }
  // Load: the tensor a load reads into in place when it can (a CPU tensor of the stored dtype
  // and local_size()); the value Commit gets is then this tensor itself.
  const at::Tensor& live() const { return live_; }

  // kFull / kFullRank0 saves: the global tensor of `local` (the parameter's local tensor or a
  // state tensor laid out like it). Collective over the adapter's world.
  virtual at::Tensor Gather(const at::Tensor& local) const = 0;
  // Load: a fresh tensor of local_size() and `dtype` to read into when not in place.
  virtual at::Tensor Staging(at::ScalarType dtype) const;
  // Load, once every rank read everything: installs `value` (live() itself, or a Staging
  // tensor) as the parameter's local tensor. Local; may adopt `value`'s storage.
  virtual void Commit(const at::Tensor& value) const = 0;

 private:
  std::vector<int64_t> global_size_, local_size_;
  std::vector<Box> boxes_;
  at::Tensor local_, live_;
};

// A kind of model, for one Save / Load / AsyncSave. The defaults are a model whose optimizer
// holds the model's own parameters (a plain module, FSDP2, TP).
class ModelAdapter {
 public:
  virtual ~ModelAdapter() = default;

  virtual comm::ProcessGroupPtr world() const = 0;
  // Where a load materializes a whole tensor (buffer, unmanaged parameter) still on the meta
  // device.
  virtual c10::Device device() const { return c10::Device(c10::kCPU); }
  virtual const ShardedParam* Sharded(const std::string& fqn) const = 0;

  // Whether a load may read into the live tensors (else it stages every tensor and installs
  // them at the end, as LoadOptions::all_or_nothing).
  virtual bool CanLoadInPlace() const { return true; }
  // Throws (naming `caller`) when this kind cannot save kFull / kFullRank0.
  virtual void CheckFullSave(const char* caller) const {}

  // `model`'s parameters as the optimizer knows them: each tensor once, under its first name.
  virtual optim_state::OptimStateDict GetOptimState(torch::nn::Module& model,
                                                    const torch::optim::Optimizer& optimizer) const;
  // Every check of LoadOptimState, changing nothing (a load in place calls it before reading).
  virtual void CheckOptimState(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                               const optim_state::OptimStateDict& state) const;
  // Installs `state` (the load's own tensors: adopted where they fit, as
  // optim_state::StateTensors::kAdopt); on an error the optimizer is unchanged.
  virtual void LoadOptimState(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                              const optim_state::OptimStateDict& state, const char* caller) const;
};

// Makes the adapter of a model of the registered kind; `caller` starts its errors.
using AdapterFactory = std::unique_ptr<ModelAdapter> (*)(torch::nn::Module& model, const char* caller);

// Registers `factory` for models of `kind` (an FSDPStateBase::api_name()); for static
// initializers (returns true). A second registration of a kind keeps the first.
bool RegisterModelAdapter(const std::string& kind, AdapterFactory factory);

// The adapter for `model`: the registered one of its kind, the core's for a plain module.
// Errors (starting with `caller`): a kind whose adapter is not linked (naming the Bazel
// target), a tree holding two kinds.
std::unique_ptr<ModelAdapter> AdapterFor(torch::nn::Module& model, const char* caller);

// `model`'s parameters, each tensor once under its first name, in named_parameters() order
// (what an optimizer over model.parameters() holds).
optim_state::NamedParams UniqueParameters(torch::nn::Module& model);

}  // namespace fsdp::dcp::internal

#endif  // FSDP_DCP_ADAPTER_H_
