#include "train/token_dataset.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <utility>

namespace fsdp::train {
namespace {

// The format is little-endian and read in place: a big-endian host would need a byte swap on
// every read, which nothing here needs yet.
static_assert(std::endian::native == std::endian::little, "token datasets are read in place as little-endian");

struct Header {
  char magic[8];
  uint32_t version;
  uint32_t token_bytes;
  uint64_t vocab_size;
  uint64_t bos_id;
  uint64_t eos_id;
  uint64_t num_documents;
  uint64_t num_tokens;
  uint64_t reserved;
};
static_assert(sizeof(Header) == kTokenIndexHeaderBytes);

// Maps `path` read-only and closes the descriptor (the mapping keeps the file alive). A
// 0-byte file maps to nothing (mmap refuses length 0); the caller checks the sizes.
void* MapFile(const std::string& path, size_t* size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "token dataset: cannot open ", path, ": ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    TORCH_CHECK(false, "token dataset: cannot stat ", path, ": ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    TORCH_CHECK(false, "token dataset: ", path, " is not a regular file");
  }
  *size = static_cast<size_t>(st.st_size);
  void* addr = nullptr;
  if (*size > 0) {
    addr = ::mmap(nullptr, *size, PROT_READ, MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);
    TORCH_CHECK(addr != MAP_FAILED, "token dataset: cannot mmap ", path, " (", *size, " bytes): ", std::strerror(err));
  } else {
    ::close(fd);
  }
  return addr;
}

void Unmap(void* addr, size_t size) {
  if (addr != nullptr) ::munmap(addr, size);
}

// The first id >= vocab_size, or -1: the one pass over every token at open.
template <typename T>
int64_t FirstOutOfRange(const T* tokens, uint64_t n, uint64_t vocab_size) {
  for (uint64_t i = 0; i < n; ++i) {
    if (tokens[i] >= vocab_size) return static_cast<int64_t>(i);
  }
  return -1;
}

std::vector<uint64_t> CopyAligned(std::string_view bytes) {
  std::vector<uint64_t> out((bytes.size() + 7) / 8);
  if (!bytes.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

}  // namespace

std::shared_ptr<const TokenDataset> TokenDataset::Open(const std::string& prefix) {
  std::shared_ptr<TokenDataset> ds(new TokenDataset());
  ds->prefix_ = prefix;
  // The destructor unmaps whatever was mapped when a check below throws.
  ds->index_map_.addr = MapFile(prefix + ".index", &ds->index_map_.size);
  ds->tokens_map_.addr = MapFile(prefix + ".tokens", &ds->tokens_map_.size);
  ds->Init(ds->index_map_.addr, ds->index_map_.size, ds->tokens_map_.addr, ds->tokens_map_.size);
  return ds;
}

std::shared_ptr<const TokenDataset> TokenDataset::FromBytes(std::string_view index, std::string_view tokens,
                                                            const std::string& prefix) {
  std::shared_ptr<TokenDataset> ds(new TokenDataset());
  ds->prefix_ = prefix;
  ds->owned_index_ = CopyAligned(index);
  ds->owned_tokens_ = CopyAligned(tokens);
  ds->Init(ds->owned_index_.data(), index.size(), ds->owned_tokens_.data(), tokens.size());
  return ds;
}

TokenDataset::~TokenDataset() {
  Unmap(index_map_.addr, index_map_.size);
  Unmap(tokens_map_.addr, tokens_map_.size);
}

void TokenDataset::Init(const void* index, size_t index_size, const void* tokens, size_t tokens_size) {
  const std::string index_path = prefix_ + ".index";
  const std::string tokens_path = prefix_ + ".tokens";
  TORCH_CHECK(index_size >= kTokenIndexHeaderBytes, "token dataset: ", index_path, " has ", index_size,
              " bytes, fewer than its ", kTokenIndexHeaderBytes, "-byte header (truncated?)");
  Header h{};
  std::memcpy(&h, index, sizeof(h));
  TORCH_CHECK(std::memcmp(h.magic, kTokenDatasetMagic, sizeof(h.magic)) == 0, "token dataset: ", index_path,
              " does not start with the magic \"FSDPTOKS\" (not a token index)");
  TORCH_CHECK(h.version == kTokenDatasetVersion, "token dataset: ", index_path, " has format version ", h.version,
              "; this reader reads version ", kTokenDatasetVersion);
  TORCH_CHECK(h.vocab_size >= 1 && h.vocab_size <= (uint64_t{1} << 32), "token dataset: ", index_path,
              " has vocab_size ", h.vocab_size, ", not in [1, 2^32]");
  TORCH_CHECK(h.token_bytes == TokenBytesForVocab(h.vocab_size), "token dataset: ", index_path, " has token_bytes ",
              h.token_bytes, " for vocab_size ", h.vocab_size, " (the format requires ",
              TokenBytesForVocab(h.vocab_size), ")");
  TORCH_CHECK(h.bos_id < h.vocab_size, "token dataset: ", index_path, " has bos_id ", h.bos_id, " >= vocab_size ",
              h.vocab_size);
  TORCH_CHECK(h.eos_id < h.vocab_size, "token dataset: ", index_path, " has eos_id ", h.eos_id, " >= vocab_size ",
              h.vocab_size);
  TORCH_CHECK(h.reserved == 0, "token dataset: ", index_path, " has reserved header field ", h.reserved,
              ", not 0 (written by a newer writer?)");
  // Sizes in uint64 without overflow: n+1 offsets of 8 bytes must fit in the file we have.
  const uint64_t max_docs = (index_size - kTokenIndexHeaderBytes) / 8;
  TORCH_CHECK(h.num_documents < max_docs && (h.num_documents + 1) * 8 == index_size - kTokenIndexHeaderBytes,
              "token dataset: ", index_path, " has ", index_size, " bytes, but its header's num_documents ",
              h.num_documents, " needs ", kTokenIndexHeaderBytes, " + 8 * (num_documents + 1) bytes");
  TORCH_CHECK(h.num_tokens <= tokens_size / h.token_bytes && h.num_tokens * h.token_bytes == tokens_size,
              "token dataset: ", tokens_path, " has ", tokens_size, " bytes, but ", index_path, " says num_tokens ",
              h.num_tokens, " of ", h.token_bytes, " bytes each");
  const auto* offsets = reinterpret_cast<const uint64_t*>(static_cast<const char*>(index) + kTokenIndexHeaderBytes);
  TORCH_CHECK(offsets[0] == 0, "token dataset: ", index_path, " has offsets[0] = ", offsets[0], ", not 0");
  for (uint64_t d = 0; d < h.num_documents; ++d) {
    TORCH_CHECK(offsets[d + 1] >= offsets[d], "token dataset: ", index_path, " has decreasing offsets: offsets[", d + 1,
                "] = ", offsets[d + 1], " < offsets[", d, "] = ", offsets[d]);
  }
  TORCH_CHECK(offsets[h.num_documents] == h.num_tokens, "token dataset: ", index_path, " has last offset ",
              offsets[h.num_documents], " (offsets[", h.num_documents, "]), not num_tokens ", h.num_tokens);
  const int64_t bad = h.token_bytes == 2
                          ? FirstOutOfRange(static_cast<const uint16_t*>(tokens), h.num_tokens, h.vocab_size)
                          : FirstOutOfRange(static_cast<const uint32_t*>(tokens), h.num_tokens, h.vocab_size);
  if (bad >= 0) {
    const uint64_t id =
        h.token_bytes == 2 ? static_cast<const uint16_t*>(tokens)[bad] : static_cast<const uint32_t*>(tokens)[bad];
    TORCH_CHECK(false, "token dataset: ", tokens_path, " has token id ", id, " at token ", bad, " >= vocab_size ",
                h.vocab_size, " (from ", index_path, ")");
  }
  offsets_ = offsets;
  tokens_ = tokens;
  num_documents_ = h.num_documents;
  num_tokens_ = h.num_tokens;
  vocab_size_ = h.vocab_size;
  bos_id_ = h.bos_id;
  eos_id_ = h.eos_id;
  token_bytes_ = h.token_bytes;
}

int64_t TokenDataset::DocumentSize(int64_t i) const {
  TORCH_CHECK(i >= 0 && static_cast<uint64_t>(i) < num_documents_, "TokenDataset::Document: index ", i,
              " out of range [0, ", num_documents_, ") of ", prefix_);
  return static_cast<int64_t>(offsets_[i + 1] - offsets_[i]);
}

DocumentView TokenDataset::Document(int64_t i) const {
  DocumentView v;
  v.size = DocumentSize(i);
  if (token_bytes_ == 2) {
    v.u16 = static_cast<const uint16_t*>(tokens_) + offsets_[i];
  } else {
    v.u32 = static_cast<const uint32_t*>(tokens_) + offsets_[i];
  }
  return v;
}

TokenDatasetBytes SerializeTokenDataset(const std::vector<std::vector<uint32_t>>& documents, uint64_t vocab_size,
                                        uint64_t bos_id, uint64_t eos_id) {
  TORCH_CHECK(vocab_size >= 1 && vocab_size <= (uint64_t{1} << 32), "WriteTokenDataset: vocab_size ", vocab_size,
              " not in [1, 2^32]");
  TORCH_CHECK(bos_id < vocab_size && eos_id < vocab_size, "WriteTokenDataset: bos_id ", bos_id, " or eos_id ", eos_id,
              " >= vocab_size ", vocab_size);
  Header h{};
  std::memcpy(h.magic, kTokenDatasetMagic, sizeof(h.magic));
  h.version = kTokenDatasetVersion;
  h.token_bytes = TokenBytesForVocab(vocab_size);
  h.vocab_size = vocab_size;
  h.bos_id = bos_id;
  h.eos_id = eos_id;
  h.num_documents = documents.size();
  std::vector<uint64_t> offsets{0};
  for (const auto& doc : documents) offsets.push_back(offsets.back() + doc.size());
  h.num_tokens = offsets.back();
  TokenDatasetBytes out;
  out.index.resize(sizeof(h) + offsets.size() * 8);
  std::memcpy(out.index.data(), &h, sizeof(h));
  std::memcpy(out.index.data() + sizeof(h), offsets.data(), offsets.size() * 8);
  out.tokens.reserve(h.num_tokens * h.token_bytes);
  for (size_t d = 0; d < documents.size(); ++d) {
    for (const uint32_t id : documents[d]) {
      TORCH_CHECK(id < vocab_size, "WriteTokenDataset: document ", d, " has token id ", id, " >= vocab_size ",
                  vocab_size);
      if (h.token_bytes == 2) {
        const auto v = static_cast<uint16_t>(id);
        out.tokens.append(reinterpret_cast<const char*>(&v), 2);
      } else {
        out.tokens.append(reinterpret_cast<const char*>(&id), 4);
      }
    }
  }
  return out;
}

void WriteTokenDataset(const std::string& prefix, const std::vector<std::vector<uint32_t>>& documents,
                       uint64_t vocab_size, uint64_t bos_id, uint64_t eos_id) {
  const TokenDatasetBytes bytes = SerializeTokenDataset(documents, vocab_size, bos_id, eos_id);
  for (const auto& [suffix, data] : {std::pair{".index", &bytes.index}, std::pair{".tokens", &bytes.tokens}}) {
    const std::string path = prefix + suffix;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(data->data(), static_cast<std::streamsize>(data->size()));
    out.close();
    TORCH_CHECK(out.good(), "WriteTokenDataset: cannot write ", path);
  }
}

}  // namespace fsdp::train
