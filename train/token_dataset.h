// A tokenized text corpus on disk, as the trainer reads it: every document's token ids as the
// tokenizer's encode(text, add_bos=True, add_eos=True) returned them (torchtitan's
// HuggingFaceTextDataset encodes each sample so), written once by tools/prepare_data.py and
// memory-mapped read-only here. docs/guide/data_format.md describes the format for writers.
//
// Format: a file pair PREFIX.index + PREFIX.tokens, little-endian.
//   PREFIX.index   a 64-byte header, then num_documents + 1 uint64 offsets:
//                    0  char[8]  magic "FSDPTOKS"
//                    8  uint32   version (1)
//                   12  uint32   token_bytes: 2 (uint16 ids) if vocab_size <= 65536, else 4
//                   16  uint64   vocab_size (1 .. 2^32)
//                   24  uint64   bos_id (< vocab_size)
//                   32  uint64   eos_id (< vocab_size)
//                   40  uint64   num_documents
//                   48  uint64   num_tokens (the tokens file holds exactly this many ids)
//                   56  uint64   reserved, 0
//                  offsets[d] is where document d starts in the tokens file, in tokens:
//                  offsets[0] = 0, non-decreasing, offsets[num_documents] = num_tokens.
//   PREFIX.tokens  the documents' ids back to back, token_bytes each, nothing else (so that
//                  numpy.memmap(dtype=uint16/uint32) reads it as it is).
// Why two files: the tokens file stays one flat array that can be mapped, appended to by a
// writer and inspected by any tool; the index is small and carries what a reader must check.
//
// Contract: TokenDataset::Open validates everything in both files before returning (they are
// untrusted: a truncated copy, another program's file): the magic, the version, token_bytes
// against vocab_size, bos/eos ids, the index size against num_documents, the tokens file size
// against num_tokens, the offsets (start at 0, non-decreasing, end at num_tokens), and every
// token id < vocab_size: one linear scan over the mapped tokens at open (a memory-bandwidth
// pass, ~0.1 s per 100M tokens), so that no later read can see an id out of range. A failure
// is a c10::Error naming the file and the bad value. Documents of fewer than 2 tokens are
// valid and contribute nothing to training (torchtitan: tokens[:-1] of such a document is
// empty). The dataset is immutable after Open and its reads are thread-safe; the files are
// mapped read-only (MAP_SHARED, PROT_READ) and their descriptors closed before Open returns.
#ifndef FSDP_TRAIN_TOKEN_DATASET_H_
#define FSDP_TRAIN_TOKEN_DATASET_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fsdp::train {

inline constexpr char kTokenDatasetMagic[8] = {'F', 'S', 'D', 'P', 'T', 'O', 'K', 'S'};
inline constexpr uint32_t kTokenDatasetVersion = 1;
inline constexpr size_t kTokenIndexHeaderBytes = 64;

// The token width the format requires for `vocab_size`: 2 up to 65536 ids, else 4.
inline constexpr uint32_t TokenBytesForVocab(uint64_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

// One document's ids, either width (token_bytes() says which pointer is set).
struct DocumentView {
  const uint16_t* u16 = nullptr;
  const uint32_t* u32 = nullptr;
  int64_t size = 0;

  uint32_t operator[](int64_t i) const { return u16 != nullptr ? u16[i] : u32[i]; }
};

class TokenDataset {
 public:
  // Opens PREFIX.index and PREFIX.tokens (`prefix` is the path without the suffix).
  static std::shared_ptr<const TokenDataset> Open(const std::string& prefix);
  // The same validation over the two files' bytes held in memory (copied), for fuzzers and
  // tests; errors name `prefix` + ".index" / ".tokens" as if they were files.
  static std::shared_ptr<const TokenDataset> FromBytes(std::string_view index, std::string_view tokens,
                                                       const std::string& prefix);

  ~TokenDataset();
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;

  const std::string& prefix() const { return prefix_; }
  int64_t num_documents() const { return static_cast<int64_t>(num_documents_); }
  int64_t num_tokens() const { return static_cast<int64_t>(num_tokens_); }
  int64_t vocab_size() const { return static_cast<int64_t>(vocab_size_); }
  int64_t bos_id() const { return static_cast<int64_t>(bos_id_); }
  int64_t eos_id() const { return static_cast<int64_t>(eos_id_); }
  uint32_t token_bytes() const { return token_bytes_; }

  // Document `i` (0 <= i < num_documents(), else a c10::Error): a view into the mapping,
  // valid as long as this dataset.
  DocumentView Document(int64_t i) const;
  int64_t DocumentSize(int64_t i) const;
  // The index: num_documents() + 1 offsets, in tokens.
  std::span<const uint64_t> offsets() const { return {offsets_, num_documents_ + 1}; }

 private:
  TokenDataset() = default;
  // Parses and validates the two files' bytes (already mapped or copied) into this object.
  void Init(const void* index, size_t index_size, const void* tokens, size_t tokens_size);

  struct Mapping {  // an munmap'ed-on-destruction read-only mapping; empty for a 0-byte file
    void* addr = nullptr;
    size_t size = 0;
  };

  std::string prefix_;
  Mapping index_map_, tokens_map_;
  std::vector<uint64_t> owned_index_, owned_tokens_;  // FromBytes' copies (8-byte aligned)
  const uint64_t* offsets_ = nullptr;
  const void* tokens_ = nullptr;
  uint64_t num_documents_ = 0, num_tokens_ = 0, vocab_size_ = 0, bos_id_ = 0, eos_id_ = 0;
  uint32_t token_bytes_ = 0;
};

// Writes `documents` as PREFIX.index + PREFIX.tokens (the format above; token width from
// vocab_size), replacing existing files. For tests and fuzz seeds: tools/prepare_data.py is
// the writer of real corpora. An id >= vocab_size or a bad bos/eos is a c10::Error.
void WriteTokenDataset(const std::string& prefix, const std::vector<std::vector<uint32_t>>& documents,
                       uint64_t vocab_size, uint64_t bos_id, uint64_t eos_id);

// The two files' bytes, as WriteTokenDataset writes them (fuzzers and tests that corrupt them).
struct TokenDatasetBytes {
  std::string index, tokens;
};
TokenDatasetBytes SerializeTokenDataset(const std::vector<std::vector<uint32_t>>& documents, uint64_t vocab_size,
                                        uint64_t bos_id, uint64_t eos_id);

}  // namespace fsdp::train

#endif  // FSDP_TRAIN_TOKEN_DATASET_H_
