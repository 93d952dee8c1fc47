// The trainer's input pipeline over a TokenDataset (train/token_dataset.h): torchtitan's
// document packing (torchtitan/hf_datasets/text_datasets.py, HuggingFaceTextDataset.__iter__
// with infinite=True, dp_world_size=1) as one global stream of windows, and its distribution
// to data-parallel ranks and gradient-accumulation micro-batches.
//
// The stream. Each document's ids t (as the tokenizer's encode(add_bos, add_eos) returned
// them) contribute inputs t[:-1], labels t[1:], positions 0..len(t)-2: max(len(t)-1, 0) input
// tokens. Concatenated over the documents of epoch 0 (in file order), then epoch 1, 2, ...
// they form one endless token stream, and window k is its tokens [k*seq_len, (k+1)*seq_len):
// inputs, labels and positions, each seq_len int64s. Positions are per document, and the
// first fragment of a window starts at 0 (torchtitan's _normalize_positions), so a document
// longer than a window restarts at 0 in each. As torchtitan's infinite loop, the buffer is
// not dropped at the end of an epoch: a window may hold the last tokens of epoch e and the
// first of epoch e+1 (torchtitan's re-loop keeps its buffers). With infinite=False torchtitan
// stops instead and drops the incomplete tail: its windows are the first
// windows_per_epoch() = floor(T / seq_len) of the stream (T = input tokens per epoch).
//
// The epoch order (a documented deviation: torchtitan re-shuffles with datasets' own
// Dataset.shuffle(seed=42 + epoch), numpy's generator): epoch 0 is file order; epoch e >= 1
// visits the documents in the order torch.randperm(num_documents,
// generator=torch.Generator().manual_seed(seed + epoch)) returns (at::randperm with a CPU
// generator seeded seed + epoch here: the same mt19937 and the same kernel, so Python reproduces
// it). seed defaults to 42, so epoch e's generator starts from torchtitan's 42 + e.
//
// Addressing: per epoch order, prefix sums of the documents' input-token counts; window k is
// found by binary search, O(log num_documents) per fragment, with no buffer to carry: the
// state is (windows_consumed, seed). An epoch's order and prefix sums are built on first use
// (O(num_documents)) and the last two kept.
//
// Distribution (DataLoader): for training step s, micro-batch m (0..accum-1), dp rank r of
// dp_degree, row i of local_batch_size, the window is
//   s*G + m*(local_batch_size*dp_degree) + r*local_batch_size + i,  G = local_batch_size*dp_degree*accum
// (torchtitan instead splits the documents by rank, split_dataset_by_node, so its batches
// depend on the dp degree; here the windows of a step depend only on G, and a resume on
// another dp degree with the same global batch continues the same token stream).
//
// Not thread-safe (the epoch cache). Errors are c10::Errors naming the argument and value.
#ifndef FSDP_TRAIN_DATALOADER_H_
#define FSDP_TRAIN_DATALOADER_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "train/token_dataset.h"

namespace fsdp::train {

inline constexpr int64_t kDefaultDataSeed = 42;  // torchtitan's re-loop seeds are 42 + epoch

// One window's or one batch's tensors, int64: [seq_len] or [batch, seq_len].
struct TokenBatch {
  at::Tensor input, labels, positions;
};

class PackedTokenStream {
 public:
  // A dataset whose documents have no input token at all (every one shorter than 2) is a
  // c10::Error: the stream would be empty. seq_len >= 1, seed >= 0.
  PackedTokenStream(std::shared_ptr<const TokenDataset> dataset, int64_t seq_len, int64_t seed = kDefaultDataSeed);

  int64_t seq_len() const { return seq_len_; }
  int64_t seed() const { return seed_; }
  const TokenDataset& dataset() const { return *dataset_; }
  // T: input tokens per epoch, sum over documents of max(len - 1, 0).
  int64_t tokens_per_epoch() const { return tokens_per_epoch_; }
  // The windows of one pass without re-loop (torchtitan's infinite=False): floor(T / seq_len).
  int64_t windows_per_epoch() const { return tokens_per_epoch_ / seq_len_; }
  // The epoch of window k's first token: floor(k * seq_len / T).
  int64_t EpochOfWindow(int64_t k) const;
  // The document order of `epoch` (identity for 0, else the permutation above).
  std::vector<int64_t> EpochOrder(int64_t epoch) const;

  // Window k (k >= 0) as three [seq_len] int64 tensors.
  TokenBatch Window(int64_t k);
  // Writes window k into three arrays of seq_len int64s.
  void FillWindow(int64_t k, int64_t* input, int64_t* labels, int64_t* positions);

 private:
  struct EpochIndex {
    int64_t epoch = -1;
    std::vector<int64_t> order;   // document ids in visiting order
    std::vector<int64_t> prefix;  // prefix[j]: input tokens before order[j]; size n + 1
  };
  const EpochIndex& Index(int64_t epoch);

  std::shared_ptr<const TokenDataset> dataset_;
  int64_t seq_len_, seed_;
  int64_t tokens_per_epoch_ = 0;
  EpochIndex cache_[2];
  int next_slot_ = 0;
};

struct DataLoaderConfig {
  int64_t seq_len = 2048;
  int64_t local_batch_size = 8;
  int64_t dp_degree = 1;
  int64_t dp_rank = 0;
  int64_t gradient_accumulation_steps = 1;
  int64_t seed = kDefaultDataSeed;
};

// The loader's checkpoint state, the same on every rank. A plain struct of int64s so that a
// Stateful wrapper can save it as three scalars. epoch is derived (the epoch of the next
// window's first token) and stored for readers of a checkpoint; LoadState checks it.
struct DataLoaderState {
  int64_t epoch = 0;
  int64_t windows_consumed = 0;  // global windows handed out, all ranks together
  int64_t seed = kDefaultDataSeed;

  bool operator==(const DataLoaderState&) const = default;
};

class DataLoader {
 public:
  // Every config field is checked: seq_len, local_batch_size, dp_degree and
  // gradient_accumulation_steps >= 1, 0 <= dp_rank < dp_degree, seed >= 0.
  DataLoader(std::shared_ptr<const TokenDataset> dataset, const DataLoaderConfig& config);

  // This rank's next micro-batch: [local_batch_size, seq_len] int64 tensors (CPU); then the
  // state advances by local_batch_size * dp_degree windows (every rank's share).
  TokenBatch NextBatch();

  int64_t global_batch_size() const { return micro_windows_ * config_.gradient_accumulation_steps; }
  const DataLoaderConfig& config() const { return config_; }
  const PackedTokenStream& stream() const { return *stream_; }

  DataLoaderState state() const;
  // Resumes at `state`. A negative value, an epoch that is not the one windows_consumed lies in,
  // or a windows_consumed that is not a multiple of local_batch_size * dp_degree (a
  // micro-batch boundary of this loader) is a c10::Error. The state's seed replaces the
  // config's: the checkpointed stream goes on.
  void LoadState(const DataLoaderState& state);

 private:
  DataLoaderConfig config_;
  std::shared_ptr<const TokenDataset> dataset_;
  std::unique_ptr<PackedTokenStream> stream_;
  int64_t micro_windows_;  // local_batch_size * dp_degree
  int64_t windows_consumed_ = 0;
};

}  // namespace fsdp::train

#endif  // FSDP_TRAIN_DATALOADER_H_
