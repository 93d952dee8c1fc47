#include "dcp/collectives.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace fsdp::dcp::internal {
void AgreeOrThrow(const comm::ProcessGroupPtr& group, const std::string& local_error, const std::string& what) {
  const auto all = comm::AllGatherBytes(group, std::vector<char>(local_error.begin(), local_error.end()));
  TORCH_CHECK(local_error.empty(), local_error);
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty()) TORCH_CHECK(false, what, ": rank ", r, " failed: ", std::string(all[r].begin(), all[r].end()));
  }
}

bool AgreeUnchanged(const comm::ProcessGroupPtr& group, const std::string& local_error, bool unchanged,
                    const std::string& what) {
  // Each rank's "!" + error, or "=" (unchanged) / "~" (changed).
  std::vector<char> mine{local_error.empty() ? (unchanged ? '=' : '~') : '!'};
  mine.insert(mine.end(), local_error.begin(), local_error.end());
  const auto all = comm::AllGatherBytes(group, mine);
  TORCH_CHECK(local_error.empty(), local_error);
  bool same = true;
  for (size_t r = 0; r < all.size(); ++r) {
    TORCH_CHECK(!all[r].empty() && all[r][0] != '!', what, ": rank ", r,
                " failed: ", all[r].empty() ? std::string() : std::string(all[r].begin() + 1, all[r].end()));
    same = same && all[r][0] == '=';
  }
  return same;
}

std::vector<std::vector<char>> GatherOrThrow(const comm::ProcessGroupPtr& group, const std::string& local_error,
                                             const std::vector<char>& payload, int root, const std::string& what) {
  AgreeOrThrow(group, local_error, what);  // without errors: one all-gather of W lengths
  return comm::GatherBytes(group, payload, root);
}

std::vector<char> ScatterOrThrow(const comm::ProcessGroupPtr& group, const std::string& root_error,
                                 const std::vector<std::vector<char>>& pieces, int root, const std::string& what) {
  const bool is_root = group == nullptr || group->rank() == root;
  const std::vector<char> error = comm::BroadcastBytes(
      group, is_root ? std::vector<char>(root_error.begin(), root_error.end()) : std::vector<char>(), root);
  if (!error.empty()) {
    TORCH_CHECK(!is_root, root_error);
    TORCH_CHECK(false, what, ": rank ", root, " failed: ", std::string(error.begin(), error.end()));
  }
  return comm::ScatterBytes(group, pieces, root);
}

comm::ProcessGroupPtr BackgroundGroup(const comm::ProcessGroupPtr& world, comm::ProcessGroupPtr given,
                                      const char* caller) {
  if (given == nullptr && world != nullptr && world->size() > 1) {
    std::vector<int> ranks(world->size());
    for (int r = 0; r < world->size(); ++r) ranks[r] = r;
    given = world->new_subgroup(ranks);
  }
  TORCH_CHECK(world == nullptr || given == nullptr || given->size() == world->size(), caller, ": background_group has ",
              given->size(), " ranks, the model's world ", world->size());
  return given;
}

}  // namespace fsdp::dcp::internal
