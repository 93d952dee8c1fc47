// Hugging Face checkpoints for sharded models: load a `save_pretrained` directory
// (`model.safetensors`, or `model-0000i-of-0000N.safetensors` + `model.safetensors.index.json`)
// straight into the shards of an FSDP2 (1-D, HSDP, FSDP + TP), FSDP1 or plain model, and save
// one from them, as PyTorch 2.15's HuggingFaceStorageReader / HuggingFaceStorageWriter
// (torch/distributed/checkpoint/hf_storage.py, _consolidate_hf_safetensors.py) with
// get/set_model_state_dict do in Python:
//
//   dcp::LoadHuggingFace(*model, "/models/llama-1b");     // every rank, collective
//   dcp::SaveHuggingFace(*model, "/out/llama-1b-tuned", {.dtype = at::kBFloat16});
//
// Linking: //dcp:core, with the adapter of the model's FSDP (dcp.h says which).
//
// Contract (both collective over the model's world group, like dcp::Load / dcp::Save: every
// rank calls with the same arguments, outside forward/backward; FSDP groups are resharded):
//  * Keys: each parameter (a tied one once, under its first name that the checkpoint has)
//    and buffer is the checkpoint's tensor key_of(fqn) (null key_of: the FQN itself).
//  * LoadHuggingFace reads `dir`'s index or every *.safetensors file in it, or per-rank files
//    with DCP_SHARDING_INFO (checkpoint/hf_checkpoint.h checks them all), then checks on
//    every rank, before any tensor changes: every model tensor's key is there (a tied
//    parameter: any of its names), every checkpoint key is some model tensor's, and each has
//    the model's global shape. Missing and unexpected keys are one error listing them
//    (allow_partial_load: missing keys keep their values and unexpected ones are ignored;
//    allow_unexpected_keys: only unexpected ones are ignored, as PyTorch's dcp.load ignores
//    checkpoint keys its state dict lacks, for a model that holds part of the checkpoint,
//    such as a rank's pipeline stages);
//    a shape mismatch is always an error. Each rank then reads only the byte ranges of its own
//    boxes (rows of a Shard(0) parameter, a column range per row under TP), converting dtype
//    (a bf16 file into fp32 parameters) on the way: into the live shards where they are CPU
//    memory of the local size (peak memory: the shards plus one read block), else (a
//    meta-device model, FSDP1, all_or_nothing) into fresh local tensors installed once every
//    rank read all of it. Read errors fail every rank; in place, the model is then partly
//    loaded (the error says so).
//  * SaveHuggingFace exports every tensor any rank's model has (ranks may hold different ones,
//    as a rank's pipeline stages; a key two ranks give different shapes or dtypes is an
//    error). It writes, under `dir`, each rank's boxes to `sharded/` in PyTorch's per-rank
//    layout (`shard-<s>-model-<i>-of-<n>.safetensors`, s = rank + 1; a rank's second box of
//    one tensor, as under some FSDP + TP layouts, goes to shard s + world size, and so on;
//    replicated tensors written once, as dcp::Save's dedup chooses), in `dtype` when given
//    (floating-point tensors only). With `consolidate`, the ranks then write
//    `model-0000i-of-0000N.safetensors` (files split by max_shard_size as save_pretrained
//    splits them; each the bytes safetensors.torch.save_file(..., metadata={"format": "pt"})
//    writes for its tensors) and `model.safetensors.index.json`: rank 0 creates the files,
//    each rank copies the chunks of every world-size-th per-rank file into place, a block at
//    a time (no rank holds a whole tensor), and rank 0 writes the index last: the export is
//    complete only once it exists (an old one is removed first). Without keep_sharded no
//    per-rank files are written (old ones are removed): each rank writes its boxes straight
//    into their places in the export files, the same bytes, once instead of twice.
//  * ConsolidateHuggingFace: that consolidation alone, of per-rank files written by
//    SaveHuggingFace or by PyTorch's HuggingFaceStorageWriter(save_distributed=True) at any
//    world size, collective over `group` (null: this process does all of it). Tensors are
//    ordered as the files first name them.
//  * Errors are c10::Errors starting with the function's name, naming the directory, file and
//    key; a failure on one rank fails every rank.
//  * Thread-safety: one call at a time per model.
#ifndef FSDP_DCP_HF_H_
#define FSDP_DCP_HF_H_

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "comm/process_group.h"
#include "dcp/dcp.h"

namespace torch::nn {
class Module;
}

namespace fsdp::dcp {

// fqn -> the checkpoint's key.
using HfKeyFn = std::function<std::string(const std::string& fqn)>;

struct HfLoadOptions {
  HfKeyFn key_of;
  bool allow_partial_load = false;
  bool allow_unexpected_keys = false;
  // As LoadOptions::all_or_nothing (dcp.h).
  bool all_or_nothing = false;
};

struct HfConsolidateOptions {
  // Floating-point tensors are written as this dtype (nullopt: as stored).
  std::optional<at::ScalarType> dtype;
  // Bytes per output file (huggingface_hub's split; a larger tensor gets a file of its own);
  // save_pretrained's default "50GB". <= 0: one file.
  int64_t max_shard_size = 50'000'000'000;
};

struct HfSaveOptions {
  HfKeyFn key_of;
  std::optional<at::ScalarType> dtype;
  int64_t max_shard_size = 50'000'000'000;
  bool consolidate = true;
  bool keep_sharded = true;
  // A Hugging Face directory whose other files (config.json, generation_config.json, the
  // tokenizer's: every regular file but *.safetensors and the index) rank 0 copies into the
  // export first, so that from_pretrained finds the model's config ("": none).
  std::string copy_files_from;
};

void LoadHuggingFace(torch::nn::Module& model, const std::string& dir, const HfLoadOptions& options = {});

void SaveHuggingFace(torch::nn::Module& model, const std::string& dir, const HfSaveOptions& options = {});

// SaveHuggingFace split as dcp::AsyncSave splits dcp::Save (dcp.h): the plan (collective over
// the model's world) and a CPU snapshot of this rank's boxes now, then a background thread
// writes the per-rank files and consolidates, communicating over `background_group` (null: a
// new subgroup of the world's ranks). The export is complete once wait() returns.
AsyncSaveHandle AsyncSaveHuggingFace(torch::nn::Module& model, const std::string& dir,
                                     const HfSaveOptions& options = {},
                                     comm::ProcessGroupPtr background_group = nullptr);

void ConsolidateHuggingFace(const std::string& sharded_dir, const std::string& out_dir,
                            const HfConsolidateOptions& options = {}, comm::ProcessGroupPtr group = nullptr);

}  // namespace fsdp::dcp

#endif  // FSDP_DCP_HF_H_
