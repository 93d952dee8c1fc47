// dcp::Load's phases, private to //dcp:core. load.cc runs them on every rank and makes the
// ranks agree (every rank fails if one did) before anything changes: after Plan (staging:
// after Read), after Read in place, and after Apply.
//   Validate  the metadata, every key the model, Stateful objects and optimizer need, global
//             shapes, the non-tensor values and 0-d state (read now: small), the optimizer
//             state's structure (param groups). Changes nothing.
//   Plan      per local tensor, where it is read (the live tensor in place, or a staging
//             tensor) and which boxes of which entry: DcpReader::Prepare checks each box and
//             opens every chunk file it needs, checking the chunk's byte range. A load in
//             place also checks that the optimizer state will install.
//   Read      the planned boxes, each byte CRC-checked (in place: the model now changes).
//   Apply     optimizer state, model tensors through their adapter, Stateful objects.
// Contract: Validate and Plan throw c10::Errors naming the directory, key and value (the
// messages dcp.h promises); Read throws on a read error or a damaged file; Apply on an
// optimizer state that does not install (nothing changed then). Not thread-safe.
#ifndef FSDP_DCP_LOAD_JOB_H_
#define FSDP_DCP_LOAD_JOB_H_

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/dcp_storage.h"
#include "dcp/adapter.h"
#include "dcp/dcp.h"
#include "dcp/plan.h"
#include "dcp/state_items.h"
#include "optim_state/optim_state_dict.h"

namespace fsdp::dcp::internal {

inline constexpr char kLoad[] = "dcp::Load";

// "'a', 'b', 'c' (and 4 more)": the first five keys, for errors.
std::string ListKeys(const std::vector<std::string>& keys);

// The agreement of a load, on every rank (collective over `world`): `prepare` (every check,
// and the reads too when not in place), agree; in place, `read`, agree (a failure there says
// the model, `what` ("the model and optimizer are"), is now partly loaded and that `option`
// reads into fresh memory first); then `apply`, agree.
void RunLoadPhases(const comm::ProcessGroupPtr& world, bool in_place, const std::function<void()>& prepare,
                   const std::function<void()>& read, const std::function<void()>& apply, const char* caller,
                   const char* what, const char* option);

// The rows [offsets[0], + sizes[0]) of a stored tensor that one box of ours reads when the
// checkpoint keeps our rows elsewhere (StoredTensor::rows): our box's row k is row index[k] of
// them.
struct StoredRows {
  std::vector<int64_t> offsets, sizes;
  at::Tensor index;  // int64
};

// A tensor entry of the checkpoint read into a local tensor.
struct TensorRead {
  const checkpoint::DcpEntry* entry = nullptr;
  std::vector<int64_t> local_size;
  std::vector<Box> boxes;                    // of the global tensor, in the local tensor
  at::Tensor live;                           // read into in place when it can be (undefined: never)
  const ShardedParam* staging_of = nullptr;  // its Staging when not in place (null: at::empty)
  at::Tensor value;                          // Plan: where it is read
  // StoredTensor::rows of the entry (empty: row for row), and per box (Plan) the stored rows
  // it reads.
  std::vector<int64_t> rows;
  std::vector<StoredRows> stored_rows;
};

// A parameter or buffer of the model.
struct ModelTarget {
  at::Tensor tensor;                      // the live one
  const ShardedParam* sharded = nullptr;  // installs the value (null: copied into `tensor`)
  TensorRead read;
};

// A positive-dim optimizer-state tensor.
struct StateTarget {
  std::string fqn, name;
  TensorRead read;
};

class LoadJob {
 public:
  LoadJob(torch::nn::Module& model, torch::optim::Optimizer* optimizer, std::string dir, const LoadOptions& options,
          const ModelAdapter& adapter, bool in_place);

  void Validate();
  void Plan();
  void Read();
  void Apply();

 private:
  void ValidateModel();
  void ValidateStateful();
  void ValidateParamGroups();
  void ValidateState();
  void ValidateStateEntry(const checkpoint::DcpEntry& e, const std::string& fqn, const std::string& name,
                          const at::Tensor& param, const at::Tensor& live, const std::vector<int64_t>& rows);
  bool ReadFlatParamGroups(const std::string& prefix);
  StoredTensor StoredModel(const std::string& fqn) const;
  StoredTensor StoredOptimizer(const std::string& fqn) const;
  c10::IValue ReadValue(const std::string& key);
  // `rows`: StoredTensor::rows (empty: the entry has the size `want`).
  const checkpoint::DcpEntry& TensorEntry(const std::string& key, const std::vector<int64_t>& want,
                                          const std::string& what, const std::vector<int64_t>& rows = {}) const;
  void PlanRead(TensorRead& r);
  template <class Fn>
  void ForEachRead(Fn&& fn);

  torch::nn::Module& model_;
  torch::optim::Optimizer* optimizer_;
  const std::string dir_;
  const LoadOptions& options_;
  const ModelAdapter& adapter_;
  const bool in_place_;

  checkpoint::DcpMetadata md_;
  std::unique_ptr<checkpoint::DcpReader> reader_;
  std::vector<ModelTarget> model_targets_;
  std::vector<ModelTarget> stateful_targets_;  // the tensor leaves of LoadOptions::stateful
  // The objects' template state dicts, and their non-tensor leaves with the values read.
  std::vector<StateDict> stateful_dicts_;
  std::vector<std::pair<StateLeaf, c10::IValue>> stateful_values_;
  std::vector<StateTarget> state_targets_;
  bool has_optimizer_state_ = false;
  // Param groups and every non-tensor and 0-d value after Validate; the tensors after Plan.
  optim_state::OptimStateDict optim_;
};

}  // namespace fsdp::dcp::internal

#endif  // FSDP_DCP_LOAD_JOB_H_
