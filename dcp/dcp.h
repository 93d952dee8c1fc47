// Distributed checkpoints of models and optimizers in PyTorch's distributed-checkpoint (DCP)
// format: the C++ counterpart of torch.distributed.checkpoint's save / load together with
// torch.distributed.checkpoint.state_dict's get/set_model_state_dict and
// get/set_optimizer_state_dict (PyTorch 2.15), for fully_shard'ed (FSDP2), wrap_fsdp'ed (FSDP1)
// and plain modules. A checkpoint directory holds one `__<rank>_0.distcp` file per writing
// rank and `.metadata` (checkpoint/dcp_storage.h), and is interchangeable with Python's:
//
//   dcp::Save(*model, &optim, "/ckpt/step100");          // every rank, collective
//   dcp::Load(*model, &optim, "/ckpt/step100");          // any world size or mesh
//
// Python reads it with dcp.load({"model": get_model_state_dict(m), "optim":
// get_optimizer_state_dict(m, o)}, checkpoint_id=dir) and set_*_state_dict; a checkpoint
// Python saved that way loads here. Keys: "model.<fqn>", "optim.state.<fqn>.<name>",
// "optim.param_groups.<i>.<option>" (dcp/state_items.h has the details).
//
// Linking: this header is //dcp:core's, which handles plain modules itself and each FSDP
// through an adapter library the binary links: //dcp:fsdp2 (FSDP2), //dcp:fsdp1 (FSDP1), or
// //dcp for both. An FSDP2-only program links //dcp:fsdp2 and no FSDP1 code. The functions
// below find the model's adapter themselves (dcp/adapter.h); a model whose adapter is not
// linked is a c10::Error naming the target to link, on every rank, before anything is written.
//
// Contract:
//  * Collective over the model's world group (the world of its FSDP meshes; a model FSDP
//    does not manage is a world of one rank): every rank calls, with the same `dir` (a
//    directory every rank can reach) and options, outside forward/backward, in the same
//    order as its other collectives. FSDP groups are resharded first. Ranks are the world
//    group's; the model may be FSDP, HSDP (Replicate, Shard), FSDP + TP (StridedShard;
//    several index runs per rank become several chunks), the SPMD-mesh variant, or tensor
//    parallel without FSDP (distributed_parameters::DistributedParameterModule parameters, dcp/tp_adapter.h).
//  * Save (sharded, the default): each rank writes only its own shards, one chunk per box
//    of its local tensor; a tensor several ranks hold whole or in the same box (HSDP
//    replicas, buffers, unmanaged parameters, `step`, param group options) is written by
//    one of them, chosen as DCP's dedup chooses (dcp/plan.h). Rank 0 gathers every rank's
//    fragment and writes `.metadata` last; the checkpoint is complete only then (an
//    existing `.metadata` in `dir` is removed first). Save returns on every rank once
//    `.metadata` is written, or throws on every rank (a rank's failure names the rank).
//  * Load: reads `.metadata`, checks every key the model (and optimizer) needs is there
//    with the right global shape, then reads into each rank's shards only the chunks that
//    overlap them (checkpoint::ReadInto): any world size and mesh, whatever the saving
//    sharding was; no rank builds a full tensor it does not own (it may read a stored chunk
//    larger than its part when the saver stored one). Values are cast to the model's dtypes.
//    Nothing in the model or optimizer changes unless every rank checked its part: the
//    metadata, every key, shape and dtype, every needed chunk's file and byte range, the
//    non-tensor values and the optimizer state's structure (checkpoint::DcpReader::Prepare).
//    Then the tensors are read in place (LoadOptions::all_or_nothing: into staging first),
//    each chunk's archive checked and every byte CRC-checked; a read error or a damaged data
//    file found then fails every rank, and in place the error says the model is partly
//    loaded. Optimizer state keys for parameters the model lacks and
//    other extra checkpoint keys are ignored (as DCP's load planner).
//  * Optimizer: any optimizer with an adapter (optim_state/optimizer_adapter.h). LibTorch's
//    int `step` is saved as PyTorch's 0-d float32 tensor and read back as an int; the
//    options PyTorch has and LibTorch lacks are saved with PyTorch's defaults.
//  * Errors are c10::Errors naming the directory or file and the key or value: a missing or
//    invalid `.metadata`, a key missing from the checkpoint, a shape mismatch, an unreadable
//    chunk, a model whose adapter is not linked.
//  * Thread-safety: one call at a time per model; the calls of a rank run on one thread
//    (AsyncSave's writer thread uses its own group).
#ifndef FSDP_DCP_DCP_H_
#define FSDP_DCP_DCP_H_

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/process_group.h"
#include "dcp/stateful.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace fsdp::dcp {

class Stager;

enum class StateDictKind {
  // Each rank writes its shards (get_model_state_dict's default).
  kSharded,
  // StateDictOptions(full_state_dict=True): every FSDP tensor is all-gathered whole on every
  // rank, and each whole tensor is written by one rank (DCP's dedup spreads them). Every rank
  // holds one gathered tensor at a time plus those it writes.
  kFull,
  // As kFull, but rank 0 keeps every gathered tensor and writes the whole checkpoint into its
  // one file; the other ranks write nothing (small models, export).
  kFullRank0,
};

struct SaveOptions {
  StateDictKind kind = StateDictKind::kSharded;
  // Objects saved beside the model and optimizer under their names (dcp/stateful.h): a training
  // loop's own state (step, data position, schedule, RNG).
  StatefulItems stateful;
  // Called on this rank's writing thread (AsyncSave's background thread, Save's caller)
  // right after this rank's data file is complete on disk and before the ranks agree and
  // rank 0 writes `.metadata`: e.g. to upload the file. A throw fails the save on every
  // rank, which then leaves no `.metadata`. Null: none.
  std::function<void(const std::string& data_file)> on_rank_file_written;
  // AsyncSave only: copy the snapshot into these reused buffers (dcp/stager.h) instead of
  // fresh memory, after the previous save through them has written its file. Null: fresh.
  std::shared_ptr<Stager> stager;
  // Floating-point tensors are written in this dtype (torchtitan's export_dtype of a last,
  // model-only save); a load casts back to the model's. Unset: as they are. Each rank casts
  // its items into fresh memory; not with a stager (its buffers are the tensors' own dtypes).
  std::optional<at::ScalarType> dtype;
  // PyTorch's StateDictOptions(flatten_optimizer_state_dict=True) for the param groups: each
  // group's options under each of its parameters, "optim.param_groups.<fqn>.<option>" (no FQN
  // lists), as torchtitan saves them. Needed where ranks hold different parameters (pipeline
  // stages): their nested "param_groups.<i>.params" lists would collide under one key. Load
  // reads either form.
  bool flatten_optimizer_state_dict = false;
  // The checkpoint's name for each of the model's FQNs, which also keys its optimizer state and
  // param groups (StoredLayout's model / optimizer for a load of it). The names must stay
  // distinct. Null: the FQNs themselves. E.g. a module holding a rank's pipeline stages as
  // children "0", "1", ... saves them under the whole model's names by dropping that prefix.
  std::function<std::string(const std::string& fqn)> stored_fqn;
};

// Where a checkpoint another program wrote keeps one of the model's tensors (StoredLayout).
struct StoredTensor {
  std::string fqn;  // the checkpoint's name for it (under StoredLayout's prefix)
  // Empty: the stored tensor is ours, row for row. Else our row k (dim 0) is the stored
  // tensor's row rows[k]: a tensor kept with its rows in another order (torchtitan's q/k
  // rows) or inside a larger one (a fused qkv weight). The other dims are the same.
  std::vector<int64_t> rows;
};

// How a checkpoint another program wrote names and lays out what Load fills (e.g. torchtitan's:
// train/torchtitan_checkpoint.h). The default is this library's, which is PyTorch's
// {"model": get_model_state_dict, "optim": get_optimizer_state_dict} (state_items.h).
//   model entries            model_prefix + model(fqn).fqn
//   optimizer state          optimizer_prefix + "state." + optimizer(fqn).fqn + "." + name
//   param groups             optimizer_prefix + "param_groups." + i + "." + option (PyTorch's
//                            nested form), or, where the checkpoint has no "<i>.params" entry,
//                            the flattened form of StateDictOptions(flatten_optimizer_state_dict
//                            =True): optimizer_prefix + "param_groups." + optimizer(first).fqn +
//                            "." + option, the optimizer's own groups keeping their parameters
//                            (torch/distributed/checkpoint/state_dict.py _unflatten_optim_state_dict)
// Several of our tensors may come from one stored tensor (its rows). `model` / `optimizer`
// null: every FQN is its own, row for row. Stateful objects keep their names.
struct StoredLayout {
  std::string model_prefix = "model.";
  std::string optimizer_prefix = "optim.";
  std::function<StoredTensor(const std::string& fqn)> model;
  std::function<StoredTensor(const std::string& fqn)> optimizer;
};

struct LoadOptions {
  // DefaultLoadPlanner(allow_partial_load=True): model and optimizer keys missing from the
  // checkpoint keep their current values instead of being an error.
  bool allow_partial_load = false;
  // Loaded through load_state_dict once every rank read every part (dcp/stateful.h): each leaf
  // of the object's state_dict() must be in the checkpoint (a tensor with its shape; its dtype
  // is cast). Not subject to allow_partial_load.
  StatefulItems stateful;
  // Read every tensor into fresh memory first and change the model and optimizer only once
  // every rank read and checked all of it (a damaged data file or a read error then changes
  // nothing), at the price of a second copy of the local state in memory while
  // loading. By default (false) Load reads tensors straight into the live parameters,
  // buffers, Stateful tensors and optimizer state, as Python's dcp.load fills the state dict it is
  // given: peak memory is the model plus one read block. Either way everything that needs no
  // tensor bytes is checked on every rank before anything changes. FSDP1 models always load
  // all or nothing.
  bool all_or_nothing = false;
  // The checkpoint's names and row layout, where another program wrote it. FSDP1 models load
  // only checkpoints whose rows are theirs.
  StoredLayout layout;
};

// `optimizer` may be null (the model alone). The optimizer's state is saved as it is now (a
// parameter without state, e.g. before the first step, has none in the checkpoint).
void Save(torch::nn::Module& model, const torch::optim::Optimizer* optimizer, const std::string& dir,
          const SaveOptions& options = {});

// `optimizer` may be null (the model alone; optimizer entries in the checkpoint are ignored).
void Load(torch::nn::Module& model, torch::optim::Optimizer* optimizer, const std::string& dir,
          const LoadOptions& options = {});

class AsyncSaveHandle;
namespace internal {
// For //dcp's async saves: runs `body` on a new thread; the handle reports the message of what
// it throws.
AsyncSaveHandle StartAsyncSave(std::function<void()> body);
}  // namespace internal

// The handle of an AsyncSave (and of AsyncSaveHuggingFace, hf.h). wait() blocks until this rank's files are written and
// the checkpoint is complete (rank 0 wrote `.metadata`), or throws the save's error (every rank throws when any rank's
// write failed). Later waits return or throw the same. Local: no collective on the model's group. The destructor waits;
// a failure nobody waited for is reported on stderr (TORCH_WARN) since a destructor cannot throw. Movable.
class AsyncSaveHandle {
 public:
  AsyncSaveHandle();
  AsyncSaveHandle(AsyncSaveHandle&&) noexcept;
  AsyncSaveHandle& operator=(AsyncSaveHandle&&) noexcept;
  ~AsyncSaveHandle();

  void wait();
  // Whether the writer thread has finished (wait() would not block).
  bool done() const;

  struct State;

 private:
  explicit AsyncSaveHandle(std::shared_ptr<State> state);
  friend AsyncSaveHandle internal::StartAsyncSave(std::function<void()> body);
  std::shared_ptr<State> state_;
};

// Save, split: synchronously (collective on the model's group) the plan is made, this rank's
// items are copied to the CPU (a snapshot: training may change the model right after the
// call) and serialized values encoded; then a background thread writes this rank's file,
// sends rank 0 its fragment (which depends only on shapes and dtypes) over
// `background_group` once every rank's thread has written its own, and rank 0's writes
// `.metadata`. So the caller waits for one small collective and the copy (torchtitan's
// async_mode "async" waits for the copy; PyTorch's async_save plans on the writing thread).
// `background_group`: a group of the same ranks that nothing else uses until wait() returns
// (PyTorch's async_save advises a separate Gloo group too); null: one is created from the
// model's world group (collective, new_subgroup) for this save.
AsyncSaveHandle AsyncSave(torch::nn::Module& model, const torch::optim::Optimizer* optimizer, const std::string& dir,
                          const SaveOptions& options = {}, comm::ProcessGroupPtr background_group = nullptr);

}  // namespace fsdp::dcp

#endif  // FSDP_DCP_DCP_H_
