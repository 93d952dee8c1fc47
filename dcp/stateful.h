// Stateful: an object checkpointed beside the model and optimizer through its state dict, the
// C++ counterpart of torch.distributed.checkpoint.stateful.Stateful (PyTorch 2.15). A data
// loader position, a learning-rate schedule, a step counter, RNG states:
//
//   class StepCounter : public fsdp::dcp::Stateful {
//    public:
//     fsdp::dcp::StateDict state_dict() const override { return {{"step", step}}; }
//     void load_state_dict(const fsdp::dcp::StateDict& s) override { step = s.at("step").toInt(); }
//     int64_t step = 0;
//   };
//   dcp::Save(*model, &optim, dir, {.stateful = {{"train", &counter}}});
//
// Stored as Python's dcp.save({"model": ..., "optim": ..., "train": counter}) stores it: the state
// dict is flattened as torch/distributed/checkpoint/_traverse.py traverse_state_dict flattens it
// (every dict is entered, its keys written with str(); a list is entered when it holds a tensor
// or an enterable container; anything else is one leaf), each leaf under the key
// "<name>.<path joined by '.'>": a tensor as a tensor entry (whole, written once, as a buffer),
// any other leaf as a bytes entry holding its torch.save archive. Python's dcp.load fills a
// Stateful with such a checkpoint, and ours fills ours from Python's.
//
// Contract:
//  * Leaves: tensors (any device; loaded in place into the template's tensor, cast to its dtype,
//    with the same shape), None, bool, int, float, str, and tuples, lists and dicts of those
//    (dict keys str or int). Python's bytes objects are not representable (c10::IValue has no
//    bytes). Anything else is a c10::Error naming the object's name and the leaf's path.
//  * Save calls state_dict() once per object on the calling thread (AsyncSave too: the values are
//    a snapshot). Load calls state_dict() once for the template (which leaves exist and which are
//    tensors), reads every leaf, and calls load_state_dict() with the template, its leaves
//    replaced, only once every rank read the whole checkpoint: a failed load calls nothing.
//  * Names: non-empty, without '.', not "model" or "optim", unique. Every rank passes the same
//    names and the same structure; the values are written once (by DCP's dedup), so they should
//    be the same on every rank (a per-rank value belongs under a per-rank key).
//  * Thread-safety: the objects are used on the calling thread, during the call only.
#ifndef FSDP_DCP_STATEFUL_H_
#define FSDP_DCP_STATEFUL_H_

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::dcp {

// The top level of a state dict; nested dicts are c10::impl::GenericDict (NestedStateDict()).
using StateDict = std::map<std::string, c10::IValue>;

// An empty nested dict with str keys (c10::impl::GenericDict(IntType, AnyType) for int keys).
inline c10::impl::GenericDict NestedStateDict() {
  return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
}

class Stateful {
 public:
  virtual ~Stateful() = default;
  virtual StateDict state_dict() const = 0;
  virtual void load_state_dict(const StateDict& state) = 0;
};

// Objects under their names, not owned: they must outlive the call.
using StatefulItems = std::vector<std::pair<std::string, Stateful*>>;

}  // namespace fsdp::dcp

#endif  // FSDP_DCP_STATEFUL_H_
