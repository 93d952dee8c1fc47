#include "dcp/collectives.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

namespace fsdp::dcp::internal {

std::vector<std::vector<char>> AllGatherBytes(const comm::ProcessGroupPtr& group, const std::vector<char>& mine) {
  if (group == nullptr || group->size() == 1) return {mine};
  const int64_t w = group->size();
  at::Tensor length = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lengths = at::empty({w}, at::kLong);
  group->all_gather_into_tensor(lengths, length)->wait();
  std::vector<int64_t> sizes(lengths.data_ptr<int64_t>(), lengths.data_ptr<int64_t>() + w);
  const int64_t longest = *std::max_element(sizes.begin(), sizes.end());
  std::vector<std::vector<char>> out(w);
  if (longest == 0) return out;
  at::Tensor padded = at::zeros({longest}, at::kByte);
  if (!mine.empty()) std::memcpy(padded.data_ptr<uint8_t>(), mine.data(), mine.size());
  at::Tensor all = at::empty({w * longest}, at::kByte);
  group->all_gather_into_tensor(all, padded)->wait();
  const char* base = reinterpret_cast<const char*>(all.data_ptr<uint8_t>());
  for (int64_t r = 0; r < w; ++r) {
    TORCH_CHECK(sizes[r] >= 0 && sizes[r] <= longest, "AllGatherBytes: rank ", r, " sent length ", sizes[r]);
    out[r].assign(base + r * longest, base + r * longest + sizes[r]);
  }
  return out;
}

std::vector<char> BroadcastBytes(const comm::ProcessGroupPtr& group, const std::vector<char>& bytes, int root) {
  if (group == nullptr || group->size() == 1) return bytes;
  const bool is_root = group->rank() == root;
  at::Tensor length = at::full({1}, is_root ? static_cast<int64_t>(bytes.size()) : int64_t{0}, at::kLong);
  group->broadcast(length, root)->wait();
  const int64_t n = length.item<int64_t>();
  TORCH_CHECK(n >= 0, "BroadcastBytes: rank ", root, " sent length ", n);
  if (n == 0) return {};
  at::Tensor data = at::empty({n}, at::kByte);
  if (is_root) std::memcpy(data.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  group->broadcast(data, root)->wait();
  const char* p = reinterpret_cast<const char*>(data.data_ptr<uint8_t>());
  return std::vector<char>(p, p + n);
}

void AgreeOrThrow(const comm::ProcessGroupPtr& group, const std::string& local_error, const std::string& what) {
  const auto all = AllGatherBytes(group, std::vector<char>(local_error.begin(), local_error.end()));
  TORCH_CHECK(local_error.empty(), local_error);
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty()) TORCH_CHECK(false, what, ": rank ", r, " failed: ", std::string(all[r].begin(), all[r].end()));
  }
}

std::vector<std::vector<char>> AllGatherOrThrow(const comm::ProcessGroupPtr& group, const std::string& local_error,
                                                const std::vector<char>& payload, const std::string& what) {
  std::vector<char> mine(1, local_error.empty() ? 'P' : 'E');
  if (local_error.empty()) {
    mine.insert(mine.end(), payload.begin(), payload.end());
  } else {
    mine.insert(mine.end(), local_error.begin(), local_error.end());
  }
  std::vector<std::vector<char>> all = AllGatherBytes(group, mine);
  TORCH_CHECK(local_error.empty(), local_error);
  for (size_t r = 0; r < all.size(); ++r) {
    TORCH_CHECK(!all[r].empty(), what, ": rank ", r, " sent nothing");
    if (all[r][0] == 'E')
      TORCH_CHECK(false, what, ": rank ", r, " failed: ", std::string(all[r].begin() + 1, all[r].end()));
    all[r].erase(all[r].begin());
  }
  return all;
}

}  // namespace fsdp::dcp::internal
