// Fuzz target: a tokenized corpus (train/token_dataset.h: PREFIX.index + PREFIX.tokens; a
// training job reads files that another program wrote). The input is the index file followed
// by the tokens file, split where the index's header says the index ends (64 + 8 *
// (num_documents + 1) bytes; all of it when that is past the end). TokenDataset::FromBytes
// must accept it or throw a c10::Error. Of what it accepts: the format is canonical, so our
// writer's bytes of the documents read must be the input's bytes exactly; every id is below
// vocab_size; and, when there is something to train on, a few windows of the packed stream
// (the first ones and those around the first epoch boundaries) are well formed: positions
// start at 0 and count up by one within a document, the label of a token is the next input
// when both are in the same document, all ids are in the vocabulary. A crash, a sanitizer
// report or a mismatch (an abort) is a failure.
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "train/dataloader.h"
#include "train/token_dataset.h"

namespace {

using fsdp::train::TokenDataset;

void Require(bool ok) {
  if (!ok) std::abort();
}

void CheckWindow(fsdp::train::PackedTokenStream& stream, int64_t k, int64_t vocab) {
  const int64_t L = stream.seq_len();
  std::vector<int64_t> in(L), lab(L), pos(L);
  stream.FillWindow(k, in.data(), lab.data(), pos.data());
  Require(pos[0] == 0);
  for (int64_t i = 0; i < L; ++i) {
    Require(in[i] >= 0 && in[i] < vocab && lab[i] >= 0 && lab[i] < vocab);
    if (i + 1 < L && pos[i + 1] != 0) Require(pos[i + 1] == pos[i] + 1 && lab[i] == in[i + 1]);
  }
}

void Run(const char* data, size_t size, int64_t seq_len) {
  size_t index_size = size;
  if (size >= fsdp::train::kTokenIndexHeaderBytes) {
    uint64_t n_docs = 0;
    std::memcpy(&n_docs, data + 40, 8);
    if (n_docs < (size - fsdp::train::kTokenIndexHeaderBytes) / 8) {
      index_size = fsdp::train::kTokenIndexHeaderBytes + 8 * (n_docs + 1);
    }
  }
  const std::string_view index(data, index_size), tokens(data + index_size, size - index_size);
  const auto ds = TokenDataset::FromBytes(index, tokens, "fuzz");
  std::vector<std::vector<uint32_t>> docs(static_cast<size_t>(ds->num_documents()));
  int64_t total = 0;
  for (int64_t d = 0; d < ds->num_documents(); ++d) {
    const fsdp::train::DocumentView v = ds->Document(d);
    for (int64_t i = 0; i < v.size; ++i) {
      Require(v[i] < static_cast<uint64_t>(ds->vocab_size()));
      docs[d].push_back(v[i]);
    }
    total += v.size;
  }
  Require(total == ds->num_tokens());
  const auto again = fsdp::train::SerializeTokenDataset(docs, ds->vocab_size(), ds->bos_id(), ds->eos_id());
  Require(again.index == index && again.tokens == tokens);
  int64_t inputs = 0;
  for (const auto& doc : docs) inputs += doc.size() > 1 ? static_cast<int64_t>(doc.size()) - 1 : 0;
  if (inputs == 0) return;
  fsdp::train::PackedTokenStream stream(ds, seq_len, /*seed=*/42);
  Require(stream.tokens_per_epoch() == inputs);
  for (int64_t k = 0; k < 3; ++k) CheckWindow(stream, k, ds->vocab_size());
  for (int64_t epoch = 1; epoch <= 2; ++epoch) CheckWindow(stream, epoch * inputs / seq_len, ds->vocab_size());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The window length comes from the size, not a byte of the input, so that the files' bytes
  // stay exactly the format (a seed is a real index + tokens pair).
  const int64_t seq_len = 1 + static_cast<int64_t>(size % 37);
  try {
    Run(reinterpret_cast<const char*>(data), size, seq_len);
  } catch (const c10::Error&) {
  }
  return 0;
}
