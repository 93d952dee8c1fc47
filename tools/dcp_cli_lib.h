// The `dcp` command-line tool for PyTorch distributed-checkpoint (DCP) directories, as a
// library so that tests run it in process. Subcommands (usage: Run with {"--help"}):
//
//   ls DIR              every `.metadata` entry in its order: a tensor's dtype, global shape
//                       and chunks (offsets, sizes, the file and byte range holding each), a
//                       bytes entry's file and range; then the data files, each checked to be
//                       present and as long as the metadata says (else an error after the list).
//   to-torch DIR FILE   one torch.save file of full tensors, what Python's
//                       torch/distributed/checkpoint/format_utils.py dcp_to_torch_save writes:
//                       the state dict nested again along `planner_data` (so a checkpoint of
//                       {"model": ..., "optim": ...} becomes that nested dict, lists included),
//                       each tensor assembled from its chunks (dcp_storage.h ReadInto) and
//                       written to FILE before the next one is read, and each bytes entry as
//                       the value it holds (read with checkpoint_reader.h). A bytes entry that
//                       reader refuses (a Python object other than None, bool, int, float, str,
//                       tuple, list, dict and tensors) is an error naming it, or with
//                       --skip-unreadable left out and named in the summary line.
//   from-torch FILE DIR one rank's `__0_0.distcp` and `.metadata` from a torch.save file of a
//                       (nested) state dict, what format_utils.py torch_save_to_dcp writes: the
//                       dict flattened as torch/distributed/checkpoint/_traverse.py
//                       traverse_state_dict does (dict keys joined by '.', lists holding tensors
//                       or dicts by index; any other value, tuples included, one bytes entry
//                       torch.save'd), in that order and with those object paths as
//                       planner_data, each tensor one whole chunk.
//   ls HF_DIR           a Hugging Face directory (no .metadata; an index or *.safetensors files):
//                       each tensor's dtype, shape and file (per-rank files: each chunk's).
//   from-hf HF_DIR DIR  a DCP checkpoint of a Hugging Face directory (checkpoint/hf_checkpoint.h
//                       reads it, per-rank files included): each tensor under "model.<key>"
//                       (--prefix P: "P<key>"; the object path nests "model." as
//                       get_model_state_dict does), so dcp::Load / dcp.load of a model reads it.
//   to-hf DIR HF_DIR    the tensors under "model." (--prefix P) of a DCP checkpoint as a Hugging
//                       Face directory: model-0000i-of-0000N.safetensors (split at
//                       --max-shard-size, default 50GB, as save_pretrained splits) and
//                       model.safetensors.index.json, written last; --dtype bf16 converts
//                       floating-point tensors (as tensor.to(bfloat16)).
//   Both conversions stream: at most kStreamBytes of tensor data in memory at a time (a larger
//   tensor goes in pieces of rows: several DCP chunks, or several writes into its place).
//
// Where this differs from Python:
//  * to-torch's FILE holds the same values as Python's, bit for bit (tools/dcp_cli_test.cc
//    compares them), and like it loads with torch.load's default weights_only=True
//    (checkpoint/checkpoint_writer.h); only the order of its zip records differs (each
//    tensor's before data.pkl), which torch.load does not mind.
//  * A bytes entry whose value the validating reader refuses (a Python object) stops to-torch
//    (or, with --skip-unreadable, is left out); Python's torch.load(weights_only=False) runs
//    whatever it holds.
//  * from-torch reads FILE with the validating reader too, so only the values it knows load
//    (Python's torch_save_to_dcp uses torch.load(weights_only=False): any object); a dict key
//    that is a float is refused (Python would use its repr as the path element).
//
// Errors: every bad input (a missing or foreign directory, a missing, corrupt or truncated
// file, a usage error) makes Run print one line "dcp: error: <what, naming the file and the
// bad value>" and return non-zero; nothing is left half-written (FILE and the `.metadata`
// are written through a temporary file renamed into place).
#ifndef TOOLS_DCP_CLI_LIB_H_
#define TOOLS_DCP_CLI_LIB_H_

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace dcp_cli {

// Exit statuses of Run.
inline constexpr int kOk = 0;
inline constexpr int kFailed = 1;  // bad input, or the conversion failed
inline constexpr int kUsage = 2;   // bad arguments

// Runs the tool on `args` (the arguments after the program name). Output goes to `out`; an
// error is one line on `err`.
int Run(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

// The subcommands. Output (the listing, a one-line summary) goes to `out`; errors are
// c10::Errors naming the file and the bad value.
void List(const std::string& dir, std::ostream& out);
void ToTorch(const std::string& dir, const std::string& file, bool skip_unreadable, std::ostream& out);
void FromTorch(const std::string& file, const std::string& dir, std::ostream& out);

inline constexpr int64_t kStreamBytes = int64_t{64} << 20;
// A directory without .metadata that holds model.safetensors.index.json or *.safetensors.
bool IsHuggingFaceDir(const std::string& dir);
void ListHuggingFace(const std::string& dir, std::ostream& out);
void FromHuggingFace(const std::string& hf_dir, const std::string& dir, const std::string& prefix, std::ostream& out);
void ToHuggingFace(const std::string& dir, const std::string& hf_dir, const std::string& prefix,
                   std::optional<at::ScalarType> dtype, int64_t max_shard_size, std::ostream& out);
// "bf16", "float32", ... (errors name --dtype and the text).
at::ScalarType ParseDtype(const std::string& name);
// `s` with control characters escaped, so that every listed name stays on its line.
std::string Printable(const std::string& s);

}  // namespace dcp_cli

#endif  // TOOLS_DCP_CLI_LIB_H_
