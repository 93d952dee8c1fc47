#include "comm/object_collectives.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

namespace fsdp::comm {
namespace {

// Runs `collective` on `host` (a CPU tensor it reads and writes in place) where the group's
// collectives take it (ProcessGroup::object_collective_device: NCCL's CUDA device, else
// the CPU, where this is `host` itself) and returns the result on the CPU.
template <class Collective>
at::Tensor RunOnObjectDevice(const ProcessGroup& group, const at::Tensor& host, Collective&& collective) {
  at::Tensor wire = ToObjectCollectiveDevice(group, host);
  collective(wire);
  return wire.cpu();
}

// Every rank's `mine`, in rank order.
std::vector<int64_t> AllGatherLengths(ProcessGroup& group, int64_t mine) {
  const at::Tensor length = ToObjectCollectiveDevice(group, at::full({1}, mine, at::kLong));
  at::Tensor lengths = at::empty({group.size()}, at::kLong);
  lengths = RunOnObjectDevice(group, lengths,
                              [&](const at::Tensor& wire) { group.all_gather_into_tensor(wire, length)->wait(); });
  return std::vector<int64_t>(lengths.data_ptr<int64_t>(), lengths.data_ptr<int64_t>() + group.size());
}

}  // namespace

std::vector<std::vector<char>> AllGatherBytes(const ProcessGroupPtr& group, const std::vector<char>& mine) {
  if (group == nullptr || group->size() == 1) return {mine};
  const int64_t w = group->size();
  const std::vector<int64_t> sizes = AllGatherLengths(*group, static_cast<int64_t>(mine.size()));
  const int64_t longest = *std::max_element(sizes.begin(), sizes.end());
  std::vector<std::vector<char>> out(w);
  if (longest == 0) return out;
  at::Tensor padded = at::zeros({longest}, at::kByte);
  if (!mine.empty()) std::memcpy(padded.data_ptr<uint8_t>(), mine.data(), mine.size());
  at::Tensor all = at::empty({w * longest}, at::kByte);
  all = RunOnObjectDevice(*group, all, [&](const at::Tensor& out_wire) {
    group->all_gather_into_tensor(out_wire, ToObjectCollectiveDevice(*group, padded))->wait();
  });
  const char* base = reinterpret_cast<const char*>(all.data_ptr<uint8_t>());
  for (int64_t r = 0; r < w; ++r) {
    TORCH_CHECK(sizes[r] >= 0 && sizes[r] <= longest, "AllGatherBytes: rank ", r, " sent length ", sizes[r]);
    out[r].assign(base + r * longest, base + r * longest + sizes[r]);
  }
  return out;
}

std::vector<char> BroadcastBytes(const ProcessGroupPtr& group, const std::vector<char>& bytes, int root) {
  if (group == nullptr || group->size() == 1) return bytes;
  const bool is_root = group->rank() == root;
  at::Tensor length = at::full({1}, is_root ? static_cast<int64_t>(bytes.size()) : int64_t{0}, at::kLong);
  length = RunOnObjectDevice(*group, length, [&](const at::Tensor& wire) { group->broadcast(wire, root)->wait(); });
  const int64_t n = length.item<int64_t>();
  TORCH_CHECK(n >= 0, "BroadcastBytes: rank ", root, " sent length ", n);
  if (n == 0) return {};
  at::Tensor data = at::empty({n}, at::kByte);
  if (is_root) std::memcpy(data.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  data = RunOnObjectDevice(*group, data, [&](const at::Tensor& wire) { group->broadcast(wire, root)->wait(); });
  const char* p = reinterpret_cast<const char*>(data.data_ptr<uint8_t>());
  return std::vector<char>(p, p + n);
}

std::vector<std::vector<char>> GatherBytes(const ProcessGroupPtr& group, const std::vector<char>& mine, int root) {
  if (group == nullptr || group->size() == 1) return {mine};
  const int64_t w = group->size();
  const bool is_root = group->rank() == root;
  const std::vector<int64_t> sizes = AllGatherLengths(*group, static_cast<int64_t>(mine.size()));
  int64_t total = 0;
  for (int64_t r = 0; r < w; ++r) {
    TORCH_CHECK(sizes[r] >= 0, "GatherBytes: rank ", r, " sent length ", sizes[r]);
    total += sizes[r];
  }
  // Only `root` receives: every rank's input goes whole to it (an all-to-all with one
  // non-empty piece per rank), so no other rank holds the W payloads.
  at::Tensor input = at::empty({static_cast<int64_t>(mine.size())}, at::kByte);
  if (!mine.empty()) std::memcpy(input.data_ptr<uint8_t>(), mine.data(), mine.size());
  std::vector<int64_t> input_splits(w, 0), output_splits(w, 0);
  input_splits[root] = static_cast<int64_t>(mine.size());
  if (is_root) output_splits = sizes;
  at::Tensor output = at::empty({is_root ? total : 0}, at::kByte);
  output = RunOnObjectDevice(*group, output, [&](const at::Tensor& out_wire) {
    group->all_to_all_single(out_wire, ToObjectCollectiveDevice(*group, input), output_splits, input_splits)->wait();
  });
  if (!is_root) return {};
  std::vector<std::vector<char>> out(w);
  const char* p = reinterpret_cast<const char*>(output.data_ptr<uint8_t>());
  for (int64_t r = 0; r < w; ++r) {
    out[r].assign(p, p + sizes[r]);
    p += sizes[r];
  }
  return out;
}

std::vector<char> ScatterBytes(const ProcessGroupPtr& group, const std::vector<std::vector<char>>& pieces, int root) {
  const bool is_root = group == nullptr || group->rank() == root;
  const int64_t w = group == nullptr ? 1 : group->size();
  TORCH_CHECK(!is_root || static_cast<int64_t>(pieces.size()) == w, "ScatterBytes: ", pieces.size(), " pieces for ", w,
              " ranks");
  if (w == 1) return pieces[0];
  at::Tensor lengths = at::zeros({w}, at::kLong);
  int64_t total = 0;
  if (is_root) {
    for (int64_t r = 0; r < w; ++r) total += lengths[r].fill_(static_cast<int64_t>(pieces[r].size())).item<int64_t>();
  }
  lengths = RunOnObjectDevice(*group, lengths, [&](const at::Tensor& wire) { group->broadcast(wire, root)->wait(); });
  std::vector<int64_t> sizes(lengths.data_ptr<int64_t>(), lengths.data_ptr<int64_t>() + w);
  const int64_t me = sizes[group->rank()];
  TORCH_CHECK(me >= 0, "ScatterBytes: rank ", root, " sent length ", me);
  at::Tensor input = at::empty({total}, at::kByte);
  if (is_root) {
    char* p = reinterpret_cast<char*>(input.data_ptr<uint8_t>());
    for (const auto& piece : pieces) {
      if (!piece.empty()) std::memcpy(p, piece.data(), piece.size());
      p += piece.size();
    }
  }
  std::vector<int64_t> input_splits(w, 0), output_splits(w, 0);
  if (is_root) input_splits = sizes;
  output_splits[root] = me;
  at::Tensor output = at::empty({me}, at::kByte);
  output = RunOnObjectDevice(*group, output, [&](const at::Tensor& out_wire) {
    group->all_to_all_single(out_wire, ToObjectCollectiveDevice(*group, input), output_splits, input_splits)->wait();
  });
  const char* p = reinterpret_cast<const char*>(output.data_ptr<uint8_t>());
  return std::vector<char>(p, p + me);
}

}  // namespace fsdp::comm
