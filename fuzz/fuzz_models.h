// What the fuzz targets and the corrupt-checkpoint test share: a small fully_shard'ed model
// (rank 0 of a Fake group of 2, so loads take the chunking path), its optimizers, valid
// checkpoint bytes for seed corpora, and a check that a loaded tensor only addresses
// bytes its storage holds.
#ifndef FSDP_FUZZ_FUZZ_MODELS_H_
#define FSDP_FUZZ_FUZZ_MODELS_H_

#include <ATen/core/Tensor.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/fsdp2/test_models.h"

namespace fsdp::fuzz {

struct Target {
  fsdp2::testing::Net model;
  std::unique_ptr<torch::optim::AdamW> adamw;
  std::unique_ptr<torch::optim::SGD> sgd;
};

// Built once per process (not thread-safe; fuzz targets run single-threaded).
Target& SharedTarget();

// Named valid files: full state dicts (the target's, plus tensors of every dtype the
// reader knows, views, scalars, an empty dict) and optimizer states (AdamW, SGD).
using NamedBytes = std::vector<std::pair<std::string, std::vector<char>>>;
NamedBytes FullStateDictSeeds();
NamedBytes OptimStateSeeds();

// Rewrites the CRC-32 fields of a zip archive's records (central directory and local
// headers) to match their data, so that mutated pickles and tensor bytes get past the
// checksum to the parsers behind it. Returns whether anything changed; leaves input that
// is not a plain zip archive as it is.
bool FixZipCrcs(std::vector<char>& bytes);

// Aborts (a fuzzing failure) unless `t`'s elements lie inside its storage and every byte of
// the storage is readable (ASan reports the first one that is not); bool bytes must be 0/1.
void TouchTensor(const at::Tensor& t);

// One fuzz input for a checkpoint loader: `run` on the bytes as they are and, when their zip
// records' CRC-32s did not match, once more with them fixed (so mutations reach the parsers).
void RunAsIsAndWithFixedCrcs(const uint8_t* data, size_t size, void (*run)(const std::vector<char>&));

}  // namespace fsdp::fuzz

// Defines the libFuzzer entry points of a checkpoint-loader target: the shared model is
// built once, and each input goes through RunAsIsAndWithFixedCrcs(run).
#define FSDP_CHECKPOINT_FUZZ_TARGET(run)                                    \
  extern "C" int LLVMFuzzerInitialize(int*, char***) {                      \
    ::fsdp::fuzz::SharedTarget();                                           \
    return 0;                                                               \
  }                                                                         \
  extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { \
    ::fsdp::fuzz::RunAsIsAndWithFixedCrcs(data, size, (run));               \
    return 0;                                                               \
  }

#endif  // FSDP_FUZZ_FUZZ_MODELS_H_
