#include "train/dataloader.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/randperm.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <utility>

namespace fsdp::train {

PackedTokenStream::PackedTokenStream(std::shared_ptr<const TokenDataset> dataset, int64_t seq_len, int64_t seed)
    : dataset_(std::move(dataset)), seq_len_(seq_len), seed_(seed) {
  TORCH_CHECK(dataset_ != nullptr, "PackedTokenStream: dataset is null");
  TORCH_CHECK(seq_len >= 1, "PackedTokenStream: seq_len = ", seq_len, " must be at least 1");
  TORCH_CHECK(seed >= 0, "PackedTokenStream: seed = ", seed, " is negative");
  for (int64_t d = 0; d < dataset_->num_documents(); ++d) {
    tokens_per_epoch_ += std::max<int64_t>(dataset_->DocumentSize(d) - 1, 0);
  }
  TORCH_CHECK(tokens_per_epoch_ > 0, "PackedTokenStream: ", dataset_->prefix(),
              " has no document of 2 or more tokens (", dataset_->num_documents(), " documents): nothing to train on");
}

int64_t PackedTokenStream::EpochOfWindow(int64_t k) const {
  TORCH_CHECK(k >= 0 && k <= std::numeric_limits<int64_t>::max() / seq_len_ - 1, "PackedTokenStream: window ", k,
              " out of range (negative, or its tokens overflow int64 at seq_len ", seq_len_, ")");
  return k * seq_len_ / tokens_per_epoch_;
}

std::vector<int64_t> PackedTokenStream::EpochOrder(int64_t epoch) const {
  TORCH_CHECK(epoch >= 0, "PackedTokenStream: epoch ", epoch, " is negative");
  const int64_t n = dataset_->num_documents();
  std::vector<int64_t> order(static_cast<size_t>(n));
  if (epoch == 0) {
    // torchtitan's first epoch reads the dataset unshuffled.
    std::iota(order.begin(), order.end(), int64_t{0});
    return order;
  }
  // torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)): the CPU
  // generator's mt19937 and randperm's own shuffle, reproducible from Python.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed_) + static_cast<uint64_t>(epoch));
  const at::Tensor perm = at::randperm(n, gen, at::kLong);
  std::copy_n(perm.const_data_ptr<int64_t>(), n, order.begin());
  return order;
}

const PackedTokenStream::EpochIndex& PackedTokenStream::Index(int64_t epoch) {
  for (const EpochIndex& c : cache_) {
    if (c.epoch == epoch) return c;
  }
  // Windows are read in increasing order and straddle at most two epochs (or many, when an
  // epoch is shorter than a window: then this rebuilds, still correct).
  EpochIndex& slot = cache_[next_slot_];
  next_slot_ = 1 - next_slot_;
  slot.epoch = -1;
  slot.order = EpochOrder(epoch);
  slot.prefix.assign(slot.order.size() + 1, 0);
  for (size_t j = 0; j < slot.order.size(); ++j) {
    slot.prefix[j + 1] = slot.prefix[j] + std::max<int64_t>(dataset_->DocumentSize(slot.order[j]) - 1, 0);
  }
  slot.epoch = epoch;
  return slot;
}

void PackedTokenStream::FillWindow(int64_t k, int64_t* input, int64_t* labels, int64_t* positions) {
  EpochOfWindow(k);          // the range check
  int64_t g = k * seq_len_;  // the window's first token in the endless stream
  int64_t filled = 0;
  while (filled < seq_len_) {
    const int64_t epoch = g / tokens_per_epoch_;
    const int64_t r = g % tokens_per_epoch_;
    const EpochIndex& idx = Index(epoch);
    // The document holding input token r: the last j with prefix[j] <= r (documents without
    // input tokens have prefix[j] == prefix[j + 1] and are skipped by upper_bound).
    const auto j =
        static_cast<size_t>(std::upper_bound(idx.prefix.begin(), idx.prefix.end(), r) - idx.prefix.begin() - 1);
    const int64_t start = r - idx.prefix[j];  // the fragment's first input token in its document
    const int64_t run = std::min(seq_len_ - filled, idx.prefix[j + 1] - r);
    const DocumentView doc = dataset_->Document(idx.order[j]);
    for (int64_t i = 0; i < run; ++i) {
      input[filled + i] = doc[start + i];
      labels[filled + i] = doc[start + i + 1];
      // Per-document positions start..start+run-1, minus the first fragment's offset
      // (_normalize_positions); every later fragment starts a document at 0 anyway.
      positions[filled + i] = i;
    }
    filled += run;
    g += run;
  }
}

TokenBatch PackedTokenStream::Window(int64_t k) {
  TokenBatch w{at::empty({seq_len_}, at::kLong), at::empty({seq_len_}, at::kLong), at::empty({seq_len_}, at::kLong)};
  FillWindow(k, w.input.mutable_data_ptr<int64_t>(), w.labels.mutable_data_ptr<int64_t>(),
             w.positions.mutable_data_ptr<int64_t>());
  return w;
}

DataLoader::DataLoader(std::shared_ptr<const TokenDataset> dataset, const DataLoaderConfig& config)
    : config_(config), dataset_(std::move(dataset)) {
  TORCH_CHECK(config.local_batch_size >= 1, "DataLoader: local_batch_size = ", config.local_batch_size,
              " must be at least 1");
  TORCH_CHECK(config.dp_degree >= 1, "DataLoader: dp_degree = ", config.dp_degree, " must be at least 1");
  TORCH_CHECK(config.dp_rank >= 0 && config.dp_rank < config.dp_degree, "DataLoader: dp_rank = ", config.dp_rank,
              " is not in [0, dp_degree = ", config.dp_degree, ")");
  TORCH_CHECK(config.gradient_accumulation_steps >= 1,
              "DataLoader: gradient_accumulation_steps = ", config.gradient_accumulation_steps, " must be at least 1");
  // Window indices (and their tokens) must stay far inside int64 for any realistic run.
  constexpr int64_t kMaxGlobalWindows = int64_t{1} << 31;
  TORCH_CHECK(
      config.local_batch_size <= kMaxGlobalWindows / config.dp_degree / config.gradient_accumulation_steps,
      "DataLoader: global batch local_batch_size * dp_degree * gradient_accumulation_steps = ", config.local_batch_size,
      " * ", config.dp_degree, " * ", config.gradient_accumulation_steps, " is over 2^31 windows");
  micro_windows_ = config.local_batch_size * config.dp_degree;
  stream_ = std::make_unique<PackedTokenStream>(dataset_, config.seq_len, config.seed);
}

TokenBatch DataLoader::NextBatch() {
  const int64_t b = config_.local_batch_size;
  const int64_t L = config_.seq_len;
  TokenBatch batch{at::empty({b, L}, at::kLong), at::empty({b, L}, at::kLong), at::empty({b, L}, at::kLong)};
  int64_t* in = batch.input.mutable_data_ptr<int64_t>();
  int64_t* lab = batch.labels.mutable_data_ptr<int64_t>();
  int64_t* pos = batch.positions.mutable_data_ptr<int64_t>();
  const int64_t first = windows_consumed_ + config_.dp_rank * b;
  for (int64_t i = 0; i < b; ++i) stream_->FillWindow(first + i, in + i * L, lab + i * L, pos + i * L);
  windows_consumed_ += micro_windows_;
  return batch;
}

DataLoaderState DataLoader::state() const {
  return {stream_->EpochOfWindow(windows_consumed_), windows_consumed_, stream_->seed()};
}

void DataLoader::LoadState(const DataLoaderState& state) {
  TORCH_CHECK(state.windows_consumed >= 0, "DataLoader::LoadState: windows_consumed = ", state.windows_consumed,
              " is negative");
  TORCH_CHECK(state.epoch >= 0, "DataLoader::LoadState: epoch = ", state.epoch, " is negative");
  TORCH_CHECK(state.seed >= 0, "DataLoader::LoadState: seed = ", state.seed, " is negative");
  TORCH_CHECK(state.windows_consumed % micro_windows_ == 0,
              "DataLoader::LoadState: windows_consumed = ", state.windows_consumed,
              " is not a multiple of local_batch_size * dp_degree = ", micro_windows_,
              " (saved mid-micro-batch, or with another global batch size)");
  auto stream = std::make_unique<PackedTokenStream>(dataset_, config_.seq_len, state.seed);
  const int64_t epoch = stream->EpochOfWindow(state.windows_consumed);
  TORCH_CHECK(epoch == state.epoch, "DataLoader::LoadState: epoch = ", state.epoch,
              " but windows_consumed = ", state.windows_consumed, " lies in epoch ", epoch, " of ", dataset_->prefix(),
              " at seq_len ", config_.seq_len, " (another dataset or seq_len?)");
  stream_ = std::move(stream);
  config_.seed = state.seed;
  windows_consumed_ = state.windows_consumed;
}

}  // namespace fsdp::train
